"""The GPT model: `from model import GPT, GPTConfig`."""
from .config import ConfigError, GPTConfig
from .gpt import GPT

__all__ = ["GPT", "GPTConfig", "ConfigError"]
