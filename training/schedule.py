"""The learning rate at each step, and the peak FLOP/s that MFU divides by."""
from __future__ import annotations

import math

import torch

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_flops(cfg_tflops: float, device: torch.device) -> float | None:
    if cfg_tflops > 0:
        return cfg_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None


def lr_at(it: int, t) -> float:
    """Linear warmup to learning_rate, then cosine decay to min_lr over lr_decay_iters (or max_iters)."""
    decay_iters = t.lr_decay_iters or t.max_iters
    if it < t.warmup_iters:
        return t.learning_rate * (it + 1) / (t.warmup_iters + 1)
    if it >= decay_iters:
        return t.min_lr
    ratio = (it - t.warmup_iters) / max(1, decay_iters - t.warmup_iters)
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (t.learning_rate - t.min_lr)
