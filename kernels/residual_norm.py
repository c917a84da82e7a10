"""x + N(y) for the few rows of a decode step: a sandwich norm's residual add (Gemma's post-attention and
post-MLP norms), leaving the new stream's row sums for the next norm.

    add_rms_norm(x, y, weight, eps, *, kind="rmsnorm", stats_out=None, pdl=False) -> x + N(y)   (M, C)

N is an RMSNorm over the row of y, by kind (config.norm's names, model/norms.py): "rmsnorm" round(round(y / rms)
· w) (Llama's), "rmsnorm1p" round(y / rms · (1 + w)) all in fp32 (Gemma's, the weight stored as its offset from
1), "rmsnorm_fp32" round(y / rms · w) all in fp32 (OLMo's); the sum with x is rounded once, as eager adds two
tensors of the dtype. One program per row: the row of y is
read twice (its sum of squares, then the norm), which for a decode step's C of a few thousand stays in L1/L2.
stats_out (M, 2) float32 receives the result's row sums (Σ, Σ²), stored (not accumulated): the statistics the
next fused norm reads instead of a pass over the stream (kernels/ln_linear.py ln_stats).

Supported (a ValueError before any launch otherwise):
    dtypes     x, y and the result float16, bfloat16 or float32 (one dtype); the weight of any of them; sums in
               float32
    shapes     x and y (M, C), unit stride along C, M >= 1, C >= 1 (any C: the row in tiles of <= 4096);
               weight (C,)
    devices    CUDA; CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, for tests)
Inference only (no backward).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _triton
from .pdl import pdl_enabled

MAX_BLOCK_C = 4096  # columns a program holds per pass
KINDS = {"rmsnorm": 0, "rmsnorm1p": 1, "rmsnorm_fp32": 2}  # the norm's rounding and gain (KIND)


@triton.jit
def _add_rms_norm_kernel(X, Y, W, OUT, STATS_OUT, C, stride_x, stride_y, stride_o, eps,
                         BLOCK_C: tl.constexpr, KIND: tl.constexpr, STATS_OUT_ON: tl.constexpr,
                         USE_GDC: tl.constexpr):
    """grid = (M,): OUT[m] = X[m] + N(Y[m]) rounded to OUT's dtype; STATS_OUT[m] = (Σ OUT[m], Σ OUT[m]²).
    USE_GDC (launched with programmatic dependent launch): the next kernel may start at once; this one waits for
    the previous kernel before it reads anything."""
    m = tl.program_id(0).to(tl.int64)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    dtype = OUT.dtype.element_ty
    ss = tl.zeros([BLOCK_C], tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs = c0 + tl.arange(0, BLOCK_C)
        y = tl.load(Y + m * stride_y + offs, mask=offs < C, other=0.0).to(tl.float32)  # (BLOCK_C,)
        ss += y * y
    rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / C + eps)
    s1 = tl.zeros([BLOCK_C], tl.float32)
    s2 = tl.zeros([BLOCK_C], tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs = c0 + tl.arange(0, BLOCK_C)
        ok = offs < C
        y = tl.load(Y + m * stride_y + offs, mask=ok, other=0.0).to(tl.float32)  # (BLOCK_C,)
        g = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
        if KIND == 1:    # Gemma: y / rms · (1 + w) in fp32, rounded once
            n = (y * rstd * (1.0 + g)).to(dtype).to(tl.float32)
        elif KIND == 2:  # OLMo: y / rms · w in fp32, rounded once
            n = (y * rstd * g).to(dtype).to(tl.float32)
        else:            # Llama: y / rms rounded, then times w, rounded
            n = ((y * rstd).to(dtype).to(tl.float32) * g).to(dtype).to(tl.float32)
        x = tl.load(X + m * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        out = (x + n).to(dtype)
        tl.store(OUT + m * stride_o + offs, out, mask=ok)
        o = tl.where(ok, out.to(tl.float32), 0.0)
        s1 += o
        s2 += o * o
    if STATS_OUT_ON:
        tl.store(STATS_OUT + m * 2, tl.sum(s1, 0))
        tl.store(STATS_OUT + m * 2 + 1, tl.sum(s2, 0))


_triton.check_decorated(_add_rms_norm_kernel)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, *, kind: str = "rmsnorm",
                 stats_out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x, y (M, C) → x + N(y) (M, C) in x's dtype, a new tensor (N: an RMSNorm of `kind`, KINDS, with weight (C,)
    and eps). stats_out: (M, 2) float32 for the result's row sums (Σ, Σ²), or None. pdl: launch with
    programmatic dependent launch where the device has it (kernels/pdl.py)."""
    if kind not in KINDS:
        raise ValueError(f"add_rms_norm: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    for name, t in (("x", x), ("y", y), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"add_rms_norm: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or y.shape != x.shape or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"add_rms_norm: x and y must be (M, C) of one shape, M, C >= 1; got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    M, C = x.shape
    if tuple(weight.shape) != (C,) or weight.stride(0) != 1:
        raise ValueError(f"add_rms_norm: weight must be ({C},) with unit stride, got {tuple(weight.shape)}")
    if x.dtype not in _triton.SUPPORTED_DTYPES or y.dtype != x.dtype or weight.dtype not in _triton.SUPPORTED_DTYPES:
        raise ValueError(f"add_rms_norm: x and y of one of float16/bfloat16/float32, got {x.dtype} and {y.dtype} "
                         f"(weight {weight.dtype})")
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("add_rms_norm: x and y need unit stride along C")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"add_rms_norm: eps must be a number >= 0, got {eps!r}")
    if stats_out is not None and (not isinstance(stats_out, torch.Tensor) or stats_out.dtype != torch.float32
                                  or tuple(stats_out.shape) != (M, 2) or stats_out.stride() != (2, 1)):
        raise ValueError(f"add_rms_norm: stats_out must be a contiguous float32 ({M}, 2) tensor")
    if len({t.device for t in (x, y, weight) + ((stats_out,) if stats_out is not None else ())}) != 1:
        raise ValueError("add_rms_norm: all tensors must be on one device")
    _triton.check_device(x.device, "add_rms_norm")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, y, weight)):
        raise ValueError("add_rms_norm is inference-only (no backward): call it under torch.no_grad()")
    out = _triton.empty((M, C), x.dtype, x.device)
    block_c = min(MAX_BLOCK_C, triton.next_power_of_2(C))
    pdl = bool(pdl) and pdl_enabled(x.device)
    with _triton.device_guard(x):
        _add_rms_norm_kernel[(M,)](x, y, weight, out, stats_out if stats_out is not None else out, C, x.stride(0),
                                   y.stride(0), out.stride(0), float(eps), BLOCK_C=block_c, KIND=KINDS[kind],
                                   STATS_OUT_ON=stats_out is not None, USE_GDC=pdl,
                                   num_warps=4 if block_c <= 1024 else 8, **(dict(launch_pdl=True) if pdl else {}))
    return out


__all__ = ["add_rms_norm"]
