"""GPTConfig: the model's shape, validated."""
from __future__ import annotations

from dataclasses import dataclass

from kernels import BACKEND_CHOICES, LOSS_KERNELS

MAX_BLOCK_SIZE = 1 << 17  # learned position embeddings: the table must fit comfortably in memory


class ConfigError(ValueError):
    """A bad configuration value; the message names the key."""


@dataclass
class GPTConfig:
    block_size: int = 256      # context length in tokens (size of the position-embedding table)
    vocab_size: int = 0        # 0 = take it from the tokenizer (GPT-2: 50257 padded to 50304)
    n_layer: int = 6
    n_head: int = 6
    n_kv_head: int = 0         # key/value heads; 0 = n_head (multi-head), fewer = GQA, 1 = MQA
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True          # biases in Linear and LayerNorm layers, as GPT-2
    attention: str = "auto"    # "flash" | "sdpa" | "naive"; "auto" = flash on CUDA, sdpa on CPU
    loss_kernel: str = "auto"  # "triton" | "torch"; "auto" = the kernels' loss_kernel option (Triton on CUDA)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def validate(self, prefix: str = "model.") -> "GPTConfig":
        def bad(key, msg):
            raise ConfigError(f"{prefix}{key}={getattr(self, key)!r}: {msg}")
        for key in ("block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, key) <= 0:
                bad(key, "must be positive")
        if self.block_size > MAX_BLOCK_SIZE:
            bad("block_size", f"is above the largest context this model allows ({MAX_BLOCK_SIZE})")
        if self.vocab_size < 0:
            bad("vocab_size", "must be positive (or 0 to take it from the tokenizer)")
        if self.n_embd % self.n_head:
            bad("n_embd", f"must be divisible by n_head={self.n_head}")
        if self.n_kv_head < 0 or (self.n_kv_head and self.n_head % self.n_kv_head):
            bad("n_kv_head", f"must divide n_head={self.n_head} (or be 0 for n_head)")
        if not 0.0 <= self.dropout < 1.0:
            bad("dropout", "must be in [0, 1)")
        if self.attention not in BACKEND_CHOICES:
            bad("attention", f"must be one of {', '.join(BACKEND_CHOICES)}")
        if self.loss_kernel not in LOSS_KERNELS:
            bad("loss_kernel", f"must be one of {', '.join(LOSS_KERNELS)}")
        return self
