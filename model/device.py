"""The device and dtype a run uses: one choice for train.py, generate.py and ablate.py.

    pick_device("auto" | "cpu" | "cuda" | "cuda:N", local_rank=None) -> torch.device  (always indexed for CUDA)
    pick_dtype("auto" | "float32" | "bfloat16" | "float16", device) -> torch.dtype

A CUDA device comes back with its index ("cuda" → "cuda:<local rank>" under torchrun, else the current device),
so that devices compare equal whenever they name the same GPU (torch.device("cuda") != torch.device("cuda:0")).
Problems raise ConfigError with one line naming the option (`what`).
"""
from __future__ import annotations

import torch

from .config import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str = "auto", local_rank: int | None = None, *, what: str = "device") -> torch.device:
    """"auto" → CUDA when available, else the CPU. "cuda" → the local rank's GPU (or the current one)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"{what}={name}: not a device (choose {', '.join(DEVICE_CHOICES)})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ConfigError(f"{what}={name}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise ConfigError(f"{what}={name}: CUDA is not available on this machine (use cpu)")
    index = device.index
    if index is None:
        index = local_rank if local_rank is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ConfigError(f"{what}={name}: only {torch.cuda.device_count()} CUDA device(s) here")
    return torch.device("cuda", index)


def pick_dtype(name: str, device: torch.device, *, what: str = "dtype") -> torch.dtype:
    """"auto" → bfloat16 on CUDA (float16 where the GPU has no bf16), float32 on the CPU."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"{what}={name}: choose auto, {', '.join(DTYPES)}") from None
