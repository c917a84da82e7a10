"""LoRA: fine-tuning a low-rank update of chosen projections while every pretrained weight stays frozen.

    apply_lora(model, LoRASettings(rank=16, alpha=32.0))  # the targets' nn.Linear → LoRALinear; the rest frozen
    state = inference_weights(ckpt)                         # a checkpoint's weights for GPT(cfg), updates merged

A target projection y = x Wᵀ + b becomes

    y = x Wᵀ + b + s · (dropout(x) Aᵀ) Bᵀ,    A: (rank, in) random,  B: (out, rank) zeros,  s = alpha / rank

so the model starts exactly where the pretrained weights are, and only A and B (and no optimizer state for
anything else) are trained. The wrapped layer keeps the names `weight` and `bias` and adds `lora_A`, `lora_B`,
so a run's checkpoint holds GPT's own keys plus `<projection>.lora_A` / `.lora_B`, and a "lora" entry with the
settings (LoRASettings.to_dict): a loader that does not know LoRA fails on the extra keys instead of silently
running the base model. `inference_weights` folds each update into its weight, W + s·B·A (computed in float32 at least),
which is what generation, evaluation, the Hugging Face export and a fine-tuning run started from this run read:
they run a plain GPT, at the plain model's speed.

Targets, by the parameter names of model/gpt.py (each block's): "attn.c_attn" (the fused q, k, v projection: one
A over the input, B's rows the q | k | v heads), "attn.c_proj", "mlp.c_fc" (SwiGLU: gate | up), "mlp.c_proj".
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
SUFFIXES = (".lora_A", ".lora_B")


@dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LoRASettings":
        return cls(rank=int(d["rank"]), alpha=float(d["alpha"]), dropout=float(d.get("dropout", 0.0)),
                   targets=tuple(d.get("targets", LORA_TARGETS)))


class LoRALinear(nn.Linear):
    """A frozen nn.Linear (the same weight and bias Parameters) plus a trainable rank-r update (module docstring)."""

    def __init__(self, base: nn.Linear, settings: LoRASettings):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias  # the pretrained Parameters themselves, under their names
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(settings.rank, base.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, settings.rank, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear's own weights
        self.scale = settings.scale
        self.lora_dropout = nn.Dropout(settings.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in) → (..., out). With the kernel option lora_addmm the update's GEMM adds s · h Bᵀ onto the
        frozen output in its epilogue (one addmm), instead of writing the update and adding it after."""
        h = F.linear(self.lora_dropout(x), self.lora_A)                        # (..., rank)
        y = F.linear(x, self.weight, self.bias)                                 # (..., out)
        if kernels.options.get().lora_addmm:
            out = torch.addmm(y.reshape(-1, y.shape[-1]), h.reshape(-1, h.shape[-1]), self.lora_B.t(),
                              alpha=self.scale)                                 # (N, out)
            return out.view(y.shape)
        return y + F.linear(h, self.lora_B) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


def apply_lora(model: nn.Module, settings: LoRASettings) -> int:
    """Wrap each block's target projections of a GPT in LoRALinear and freeze every other parameter; returns the
    number of trainable parameters (the updates'). The wrapped layers stay where they were, under their names."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.transformer.h:
        for target in settings.targets:
            owner_name, _, name = target.partition(".")
            owner = getattr(block, owner_name)
            layer = getattr(owner, name)
            if isinstance(layer, LoRALinear):
                raise ValueError(f"{target} already holds a LoRA update")
            setattr(owner, name, LoRALinear(layer, settings))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def is_lora_key(key: str) -> bool:
    return key.endswith(SUFFIXES)


def merged_state(state: dict, settings: LoRASettings) -> dict:
    """GPT's own state dict from a LoRA run's: every update folded into its weight (W + scale · B A, computed in
    float32 or W's wider dtype, stored in W's dtype), the lora_A / lora_B keys gone. Raises ValueError naming a missing half."""
    out = {k: v for k, v in state.items() if not is_lora_key(k)}
    for key in state:
        if not key.endswith(".lora_A"):
            continue
        prefix = key[:-len(".lora_A")]
        if prefix + ".lora_B" not in state or prefix + ".weight" not in state:
            raise ValueError(f"LoRA update {prefix}: its lora_B or its weight is missing")
        w = state[prefix + ".weight"]
        acc = torch.promote_types(w.dtype, torch.float32)  # float32 at least (float64 stays float64)
        a, b = state[key].to(acc), state[prefix + ".lora_B"].to(acc)  # (rank, in), (out, rank)
        out[prefix + ".weight"] = (w.to(acc) + settings.scale * (b @ a)).to(w.dtype)  # (out, in)
    stray = [k for k in state if k.endswith(".lora_B") and k[:-len(".lora_B")] + ".lora_A" not in state]
    if stray:
        raise ValueError(f"LoRA update {stray[0][:-len('.lora_B')]}: its lora_A is missing")
    return out


def inference_weights(ckpt: dict) -> dict:
    """The weights of a checkpoint for GPT(its [model] config): its "model" state, with LoRA updates merged where
    the run trained some (a "lora" entry)."""
    lora = ckpt.get("lora")
    if not lora:
        return ckpt["model"]
    return merged_state(ckpt["model"], LoRASettings.from_dict(lora))


__all__ = ["LORA_TARGETS", "LoRALinear", "LoRASettings", "apply_lora", "inference_weights", "is_lora_key",
           "merged_state"]
