"""The SwiGLU activation of the training step in Triton: forward and backward, differentiable in its input.

    swiglu(h) -> y        h (..., 2·I) = [gate | up] (the model's fused c_fc output), y = SiLU(gate) · up (..., I)

SiLU(g) = g · sigmoid(g). The forward reads gate and up once and writes y; nothing but the input h is saved
(autograd keeps h alive for the backward anyway), and the backward recomputes sigmoid(gate) from it:

    d(gate) = dy · up · s · (1 + gate · (1 - s)),   d(up) = dy · gate · s,   s = sigmoid(gate)

written into one (..., 2·I) buffer [d(gate) | d(up)], the layout of c_fc's output gradient (no concatenation).
Everything is computed in float32 and rounded once to h's dtype (eager PyTorch rounds SiLU(gate) before the
product, so low-precision results may differ from it by an ulp).

Supports (a ValueError before any launch otherwise):
    dtypes     h float16, bfloat16 or float32; y and d(h) in h's dtype
    shapes     h (..., 2·I) with any leading dims (flattened to M rows: a view when h's layout allows, a copy
               otherwise), any I >= 1, any M >= 0 (M = 0: empty outputs, no launch)
    devices    CUDA; CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, for tests)
Under torch.compile the launches are the custom ops ``flashgpt::swiglu_fwd`` / ``swiglu_bwd``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _triton

MAX_BLOCK_I = 1024  # columns of gate (and of up) per program
TILE = 4096         # elements of the (BLOCK_M, BLOCK_I) tile a program holds per tensor


@triton.jit
def _swiglu_fwd(H, Y, stride_h, stride_y, M, I, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    """Y[rows, cols] = SiLU(H[rows, cols]) · H[rows, I + cols] in Y's dtype.
    grid (cdiv(M, BLOCK_M), cdiv(I, BLOCK_I))."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BLOCK_M,)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)                 # (BLOCK_I,)
    ok = (rows < M)[:, None] & (cols < I)[None, :]                            # (BLOCK_M, BLOCK_I)
    h = H + rows[:, None] * stride_h + cols[None, :]
    g = tl.load(h, mask=ok, other=0.0).to(tl.float32)                         # (BLOCK_M, BLOCK_I) gate
    u = tl.load(h + I, mask=ok, other=0.0).to(tl.float32)                     # (BLOCK_M, BLOCK_I) up
    y = g * tl.sigmoid(g) * u
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd(DY, H, DH, stride_dy, stride_h, stride_dh, M, I, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    """DH[rows, cols] = d(gate), DH[rows, I + cols] = d(up) of y = SiLU(gate) · up, recomputed from H; in DH's
    dtype. grid (cdiv(M, BLOCK_M), cdiv(I, BLOCK_I))."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BLOCK_M,)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)                 # (BLOCK_I,)
    ok = (rows < M)[:, None] & (cols < I)[None, :]                            # (BLOCK_M, BLOCK_I)
    h = H + rows[:, None] * stride_h + cols[None, :]
    g = tl.load(h, mask=ok, other=0.0).to(tl.float32)                         # (BLOCK_M, BLOCK_I) gate
    u = tl.load(h + I, mask=ok, other=0.0).to(tl.float32)                     # (BLOCK_M, BLOCK_I) up
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    dh = DH + rows[:, None] * stride_dh + cols[None, :]
    tl.store(dh, dg.to(DH.dtype.element_ty), mask=ok)
    tl.store(dh + I, du.to(DH.dtype.element_ty), mask=ok)


_triton.check_decorated(_swiglu_fwd, _swiglu_bwd)


def _tile(I: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_I, num_warps): up to MAX_BLOCK_I columns, TILE elements per tensor and program."""
    block_i = min(triton.next_power_of_2(I), MAX_BLOCK_I)
    return max(1, TILE // block_i), block_i, 8


def _check(h: torch.Tensor) -> None:
    if not isinstance(h, torch.Tensor):
        raise ValueError("swiglu: the input must be a tensor")
    if h.dim() < 1 or h.shape[-1] < 2 or h.shape[-1] % 2:
        raise ValueError(f"swiglu: expected (..., 2·I) = [gate | up] with I >= 1, got {tuple(h.shape)}")
    if h.dtype not in _triton.SUPPORTED_DTYPES:
        raise ValueError(f"swiglu supports float16, bfloat16 and float32 inputs, got {h.dtype}")
    _triton.check_device(h.device, "swiglu's Triton kernel")


def _unit_cols(t: torch.Tensor) -> torch.Tensor:
    """t (M, K) with unit stride along K (a copy only when it has another)."""
    return t if t.stride(1) == 1 else t.contiguous()


def _grid(M: int, I: int):
    block_m, block_i, warps = _tile(I)
    return (triton.cdiv(M, block_m), triton.cdiv(I, block_i)), dict(BLOCK_M=block_m, BLOCK_I=block_i,
                                                                     num_warps=warps)


def _fwd(h: torch.Tensor) -> torch.Tensor:
    """Launch the forward on h (M, 2I): y (M, I) in h's dtype."""
    h = _unit_cols(h)
    M, I = h.shape[0], h.shape[1] // 2
    y = _triton.empty((M, I), h.dtype, h.device)
    if M:
        grid, meta = _grid(M, I)
        with _triton.device_guard(h):
            _swiglu_fwd[grid](h, y, h.stride(0), y.stride(0), M, I, **meta)
    return y


def _bwd(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Launch the backward: d(h) (M, 2I) = [d(gate) | d(up)] in h's dtype."""
    h, dy = _unit_cols(h), _unit_cols(dy)
    M, I = h.shape[0], h.shape[1] // 2
    dh = _triton.empty((M, 2 * I), h.dtype, h.device)
    if M:
        grid, meta = _grid(M, I)
        with _triton.device_guard(h):
            _swiglu_bwd[grid](dy, h, dh, dy.stride(0), h.stride(0), dh.stride(0), M, I, **meta)
    return dh


_LIB = torch.library.Library("flashgpt", "FRAGMENT")
_LIB.define("swiglu_fwd(Tensor h) -> Tensor")
_LIB.define("swiglu_bwd(Tensor dy, Tensor h) -> Tensor")
_LIB.impl("swiglu_fwd", _fwd, "CompositeExplicitAutograd")
_LIB.impl("swiglu_bwd", _bwd, "CompositeExplicitAutograd")
torch.library.register_fake("flashgpt::swiglu_fwd", lambda h: h.new_empty(h.shape[0], h.shape[1] // 2), lib=_LIB)
torch.library.register_fake("flashgpt::swiglu_bwd", lambda dy, h: h.new_empty(h.shape), lib=_LIB)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dy):
    (h,) = ctx.saved_tensors
    return torch.ops.flashgpt.swiglu_bwd(dy, h)


torch.library.register_autograd("flashgpt::swiglu_fwd", _backward, setup_context=_setup_context, lib=_LIB)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """h (..., 2·I) = [gate | up] → SiLU(gate) · up (..., I) in h's dtype; differentiable in h."""
    _check(h)
    K = h.shape[-1]
    y = torch.ops.flashgpt.swiglu_fwd(h.reshape(-1, K))  # (M, I)
    return y.view(*h.shape[:-1], K // 2)
