"""The norm layers: LayerNorm (GPT-2), RMSNorm (Llama), RMSNorm scaled by 1 + weight (Gemma) or RMSNorm with its
weight applied in float32 (OLMo 2), picked by cfg.norm."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight over the last dim, normalised in float32 (float64 for float64 x) and
    rounded back to x's dtype before the weight is applied (transformers' LlamaRMSNorm, so bf16 models round the
    same way). kernel: "triton" | "torch" | "auto" (kernels.resolve_llama_kernels): "triton" runs the same function
    as kernels/rmsnorm.py's fused forward and backward."""

    def __init__(self, dim: int, eps: float = 1e-5, kernel: str = "auto"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.resolve_llama_kernels(self.kernel, x.device) == "triton":
            return kernels.triton_rms_norm(x, self.weight, self.eps)  # (..., dim)
        y = F.rms_norm(x.to(torch.promote_types(x.dtype, torch.float32)), (x.shape[-1],), eps=self.eps)  # (..., dim)
        return self.weight * y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Fp32GainRMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · (OFFSET + weight) over the last dim, all in float32 (float64 for float64 x),
    then rounded to x's dtype: the gain multiplies before the one rounding, where LlamaRMSNorm rounds first.
    OFFSET 0 here (transformers' Olmo2RMSNorm, the weight starts at ones); OffsetRMSNorm's 1 (Gemma's). Runs on
    torch (compiled with the model under torch.compile)."""
    OFFSET = 0.0

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.OFFSET))  # a gain of 1 at the start
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        y = F.rms_norm(x.to(wide), (x.shape[-1],), eps=self.eps)  # (..., dim)
        gain = self.weight.to(wide) + self.OFFSET if self.OFFSET else self.weight.to(wide)
        return (y * gain).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, gain {self.OFFSET:g}+weight in float32"


class OffsetRMSNorm(Fp32GainRMSNorm):
    """x / sqrt(mean(x²) + eps) · (1 + weight), all in float32, then rounded (transformers' Gemma3RMSNorm): the
    weight is stored as its offset from 1 and starts at zeros."""
    OFFSET = 1.0


def make_norm(cfg, dim: int | None = None) -> nn.Module:
    """A norm over `dim` (default n_embd) of the config's kind; LayerNorm has a bias when cfg.bias."""
    dim = dim or cfg.n_embd
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, eps=cfg.norm_eps, kernel=cfg.llama_kernels)
    if cfg.norm == "rmsnorm1p":
        return OffsetRMSNorm(dim, eps=cfg.norm_eps)
    if cfg.norm == "rmsnorm_fp32":
        return Fp32GainRMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)
