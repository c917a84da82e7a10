"""RMSNorm of the training step in Triton: forward and backward, differentiable in x and the weight.

    rms_norm(x, weight, eps) -> y      y = round_x(x / sqrt(mean(x²) + eps)) · weight over the last dim

The same function as model/norms.py's RMSNorm (transformers' LlamaRMSNorm): each row is normalised in float32,
the normalised row is rounded to x's dtype (a no-op for float32), then multiplied by the weight in float32 and
stored in promote_types(x.dtype, weight.dtype) — what `weight * y.to(x.dtype)` gives in PyTorch, so a float32
weight under bf16 autocast gives a float32 output there and here.

Forward: one program per BLOCK_M rows (the whole row in registers), which also stores each row's 1/rms (float32)
for the backward. Backward: a fixed number of programs, each over a contiguous run of rows, writes
dx = rstd · (dn - n · mean(dn · n)) (n = x · rstd, dn = dy · weight, all float32) and sums dy · round_x(n) over
its rows into one float32 partial row of d(weight); a second kernel adds the partial rows (in a fixed order:
deterministic) and stores d(weight) in the weight's dtype. The rounding to x's dtype counts as the identity in
the backward, as autograd treats the cast.

Supports (a ValueError before any launch otherwise):
    dtypes     x and weight each float16, bfloat16 or float32 (they may differ); statistics and accumulation in
               float32; dx in x's dtype, d(weight) in the weight's dtype
    shapes     x (..., N) with any leading dims (flattened to M rows; a view when x's layout allows, a copy
               otherwise), 1 <= N <= MAX_N (16384); any M >= 0 (M = 0: empty outputs, no launch); weight (N,)
    devices    CUDA; CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, for tests)
Under torch.compile the launches are the custom ops ``flashgpt::rms_norm_fwd`` / ``rms_norm_bwd``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _triton

MAX_N = 16384  # the whole row of one program in registers (BLOCK_N = next power of 2 of N)
TILE = 4096    # elements of the (BLOCK_M, BLOCK_N) tile a program holds per tensor
BWD_PROGRAMS_PER_SM = 2  # backward programs (partial rows of d(weight)) per streaming multiprocessor


@triton.jit
def _rms_fwd(X, W, Y, RSTD, stride_x, stride_y, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows pid·BLOCK_M ...: Y = round_x(X · rstd) · W in Y's dtype, RSTD = 1/sqrt(mean(X²) + eps) (float32).
    grid (cdiv(M, BLOCK_M),)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                 # (BLOCK_M,)
    cols = tl.arange(0, BLOCK_N)                                              # (BLOCK_N,)
    row_ok, col_ok = rows < M, cols < N
    ok = row_ok[:, None] & col_ok[None, :]                                    # (BLOCK_M, BLOCK_N)
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, 1) / N + eps)                          # (BLOCK_M,)
    n = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)             # (BLOCK_M, BLOCK_N) rounded to x's
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)              # (BLOCK_N,)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], (n * w[None, :]).to(Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _rms_bwd(DY, X, W, RSTD, DX, DW_PART, stride_dy, stride_x, stride_dx, M, N, rows_per_program,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows [pid·rows_per_program, +rows_per_program) ∩ [0, M): DX = rstd · (dn - n · mean(dn · n)) with
    n = X · rstd, dn = DY · W; DW_PART[pid] = Σ_rows DY · round_x(n) (float32, N wide). rows_per_program is a
    multiple of BLOCK_M. grid (cdiv(M, rows_per_program),)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)                                              # (BLOCK_N,)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)              # (BLOCK_N,)
    dw = tl.zeros([BLOCK_N], tl.float32)                                      # this program's partial d(weight)
    first = pid * rows_per_program
    for start in range(first, tl.minimum(first + rows_per_program, M), BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)                                  # (BLOCK_M,)
        row_ok = rows < M
        ok = row_ok[:, None] & col_ok[None, :]                                # (BLOCK_M, BLOCK_N)
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)                   # (BLOCK_M,)
        n = x * rstd[:, None]                                                 # (BLOCK_M, BLOCK_N)
        dw += tl.sum(dy * n.to(X.dtype.element_ty).to(tl.float32), 0)
        dn = dy * w[None, :]
        c = tl.sum(dn * n, 1) / N                                             # (BLOCK_M,) mean(dn · n)
        dx = rstd[:, None] * (dn - n * c[:, None])
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)
    tl.store(DW_PART + pid.to(tl.int64) * N + cols, dw, mask=col_ok)


@triton.jit
def _sum_partials(PART, OUT, G, N, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[cols] = Σ_g PART[g, cols] (PART float32 (G, N) contiguous), in OUT's dtype. grid (cdiv(N, BLOCK_N),)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                 # (BLOCK_N,)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, G, BLOCK_G):
        g = start + tl.arange(0, BLOCK_G)                                     # (BLOCK_G,)
        ok = (g < G)[:, None] & col_ok[None, :]                               # (BLOCK_G, BLOCK_N)
        acc += tl.sum(tl.load(PART + g.to(tl.int64)[:, None] * N + cols[None, :], mask=ok, other=0.0), 0)
    tl.store(OUT + cols, acc.to(OUT.dtype.element_ty), mask=col_ok)


_triton.check_decorated(_rms_fwd, _rms_bwd, _sum_partials)


def _tile(N: int, backward: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for rows N wide: the whole row, TILE elements per tensor and program where
    rows are narrow; the forward with at most 32 elements per thread and tensor, the backward (more tensors
    live: x, dy, n, dn, the d(weight) sum) with half as many where 16 warps allow."""
    block_n = triton.next_power_of_2(N)
    block_m = max(1, TILE // block_n)
    warps = max(4, block_m * block_n // 1024)
    return block_m, block_n, min(16, 2 * warps if backward else warps)


def _check(x: torch.Tensor, weight: torch.Tensor, eps) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ValueError("rms_norm: x and weight must be tensors")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: expected x (..., N) and weight (N,), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if not 1 <= x.shape[-1] <= MAX_N:
        raise ValueError(f"rms_norm supports rows of 1..{MAX_N} elements, got {x.shape[-1]}")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in _triton.SUPPORTED_DTYPES:
            raise ValueError(f"rms_norm supports float16, bfloat16 and float32 {name}, got {t.dtype}")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x on {x.device}, weight on {weight.device}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"rms_norm: eps must be a positive number, got {eps!r}")
    _triton.check_device(x.device, "rms_norm's Triton kernel")


def _unit_cols(t: torch.Tensor) -> torch.Tensor:
    """t (M, N) with unit stride along N (a copy only when it has another)."""
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


def _fwd(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """Launch the forward on x (M, N): (y (M, N) in promote_types(x, weight), rstd (M,) float32)."""
    x = _unit_cols(x)
    M, N = x.shape
    y = _triton.empty((M, N), torch.promote_types(x.dtype, weight.dtype), x.device)
    rstd = _triton.empty((M,), torch.float32, x.device)
    if M == 0:
        return y, rstd
    block_m, block_n, warps = _tile(N)
    with _triton.device_guard(x):
        _rms_fwd[(triton.cdiv(M, block_m),)](x, weight, y, rstd, x.stride(0), y.stride(0), M, N, eps,
                                             BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return y, rstd


def _bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    """Launch the backward: (dx (M, N) in x's dtype, d(weight) (N,) in the weight's dtype)."""
    x, dy = _unit_cols(x), _unit_cols(dy)
    M, N = x.shape
    dx = _triton.empty((M, N), x.dtype, x.device)
    dw = _triton.empty((N,), weight.dtype, x.device)
    if M == 0:
        return dx, dw.zero_()
    block_m, block_n, warps = _tile(N, backward=True)
    tiles = triton.cdiv(M, block_m)
    programs = min(tiles, BWD_PROGRAMS_PER_SM * _triton.sm_count(x.device))
    rows_per_program = triton.cdiv(tiles, programs) * block_m
    programs = triton.cdiv(M, rows_per_program)  # every program has rows
    part = _triton.empty((programs, N), torch.float32, x.device)  # (G, N) partial sums of d(weight)
    block_n2 = min(block_n, 1024)
    with _triton.device_guard(x):
        _rms_bwd[(programs,)](dy, x, weight, rstd, dx, part, dy.stride(0), x.stride(0), dx.stride(0), M, N,
                              rows_per_program, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        _sum_partials[(triton.cdiv(N, block_n2),)](part, dw, programs, N, BLOCK_G=8, BLOCK_N=block_n2,
                                                   num_warps=4)
    return dx, dw


# Custom ops, so that torch.compile traces through the norm without a graph break (the "flashgpt" namespace is
# shared with the other kernel modules).
_LIB = torch.library.Library("flashgpt", "FRAGMENT")
_LIB.define("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)")
_LIB.define("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)")
_LIB.impl("rms_norm_fwd", _fwd, "CompositeExplicitAutograd")
_LIB.impl("rms_norm_bwd", _bwd, "CompositeExplicitAutograd")
torch.library.register_fake(
    "flashgpt::rms_norm_fwd",
    lambda x, weight, eps: (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
                            x.new_empty(x.shape[0], dtype=torch.float32)),
    lib=_LIB)
torch.library.register_fake(
    "flashgpt::rms_norm_bwd",
    lambda dy, x, weight, rstd: (x.new_empty(x.shape), weight.new_empty(weight.shape)),
    lib=_LIB)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.flashgpt.rms_norm_bwd(dy, x, weight, rstd)
    return dx, dw, None


torch.library.register_autograd("flashgpt::rms_norm_fwd", _backward, setup_context=_setup_context, lib=_LIB)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., N), weight (N,) → (..., N) in promote_types(x.dtype, weight.dtype); differentiable in both."""
    _check(x, weight, eps)
    N = x.shape[-1]
    y, _ = torch.ops.flashgpt.rms_norm_fwd(x.reshape(-1, N), weight, float(eps))  # (M, N)
    return y.view(*x.shape[:-1], N)
