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
    """The learning rate of step `it` under train config `t`: linear warmup to learning_rate over warmup_iters,
    then t.lr_schedule until lr_decay_iters (or max_iters), min_lr from there on (config.LR_SCHEDULES):

        cosine     half a cosine from learning_rate down to min_lr
        linear     a straight line from learning_rate down to min_lr
        wsd        learning_rate (stable), then a straight line to min_lr over the last lr_decay_frac of the
                   steps (warmup-stable-decay; the decay starts no earlier than the warmup's end)
        constant   learning_rate to the end (min_lr unused)
    """
    if it < t.warmup_iters:
        return t.learning_rate * (it + 1) / (t.warmup_iters + 1)
    if t.lr_schedule == "constant":
        return t.learning_rate
    decay_iters = t.lr_decay_iters or t.max_iters
    if it >= decay_iters:
        return t.min_lr
    start = t.warmup_iters
    if t.lr_schedule == "wsd":
        start = max(start, decay_iters - max(1, round(t.lr_decay_frac * decay_iters)))
        if it < start:
            return t.learning_rate
    ratio = (it - start) / max(1, decay_iters - start)               # 0 at the decay's start, -> 1 at its end
    if t.lr_schedule == "cosine":
        return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (t.learning_rate - t.min_lr)
    return t.learning_rate + ratio * (t.min_lr - t.learning_rate)    # linear, and wsd's decay
