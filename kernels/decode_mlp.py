"""The whole MLP block of a decode step in one launch: norm, up projection, activation, down projection, residual.

    ln_mlp(x, w_fc, b_fc, w_down, b_down, *, ln, rms=False, swiglu=False, ln_stats=None, stats_out=None,
           pdl=False) -> x + act(N(x) W_fcᵀ + b_fc) W_downᵀ + b_down            (M, C)
    fusable(M, C, I, device) -> bool          whether the decode step runs this shape's MLP through ln_mlp

A decode step's MLP as two ln_linear launches (kernels/ln_linear.py) is two kernels in a chain of small
kernels, each paying its start and its memory latency; at a narrow model's widths (SmolLM2-135M: C = 576,
I = 1536) that chain, not the bytes of the weights, bounds the step. Here each program owns BLOCK_I columns
of the intermediate activation h: it computes them over the whole C (h never leaves the program), multiplies
them by the matching BLOCK_I columns of W_down and adds its (M, C) share of the down projection into an fp32
workspace with atomics. The last program of a row block to finish (an acq_rel counter, as ln_linear's
split-K) reads the sums, zeroes the workspace and the counter again, adds the bias and the residual, stores
the rows and their statistics (Σy, Σy²) for the next norm.

    N     LayerNorm, or RMSNorm (rms=True); ln = (weight (C,), bias (C,) or None, eps)
    act   GELU (tanh approximation; w_fc (I, C)), or SwiGLU (swiglu=True: w_fc holds [gate (I) | up (I)] rows,
          (2I, C), and h = SiLU(gate) · up)
    w_down (C, I); b_fc, b_down optional

Supported (checked with a ValueError before any launch):
    dtypes   float16, bfloat16, float32, one for x and every weight; statistics and accumulation in float32;
             float32 uses exact ("ieee") dots
    shapes   x (M, C) with unit stride along C, any M >= 1 (rows in blocks of 16); C <= MAX_C: each program holds
             its weights for the whole C in registers, as two power-of-two column blocks of at least 16
             (C = 576 is 512 + 64, 768 is 512 + 256, 960 is 512 + 448 padded to 512, 1024 is 512 + 512);
             any I >= 1 (tails masked)
    devices  CUDA; CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, for tests)
Rounding follows the eager model in its dtype, as ln_linear's does: the norm's output, the up projection with
its bias, SiLU(gate) and h are rounded to the dtype; so is the down projection with its bias before the
residual add. Only the down projection's sum runs in another order (over the programs' column blocks).
Inference only (no backward). With pdl=True (under programmatic dependent launch, kernels/pdl.py) each program
loads all its weights before it waits for the previous kernel: the caller guarantees that no kernel queued
before this one writes the weights, as for ln_linear.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import _triton
from .ln_linear import BLOCK_M, _check, _check_modes, _check_stats, _workspace, _x_tile
from .pdl import pdl_enabled

# Widest model (C) whose weights a program holds whole. `ptxas -v` at sm_90 (Triton 3.6, bf16, 4 or 8 warps,
# 16 or 32 intermediate columns): C = 576 and 768 take 254-255 registers without spilling; C = 960 spills
# 412-748 B per thread.
MAX_C = 768
WARPS = 8
# Where the decode step uses it (fusable), from whole decode steps on an H200 (bench/results/generate_smollm2/
# fused_mlp/, two runs): SmolLM2-135M (I = 1536, 96 programs of 16 columns, 8 warps) at batch 1 took 725-727
# against 755-760 us per step in two launches; at batch 4 828 against 806, at batch 16 1,113-1,135 against 782
# (the atomics of more rows); 4 warps 763 at batch 1. GPT-2 124M (I = 3072) at batch 1: 334 us with programs of
# 32 columns (96 KB of weights each), 398-463 with 16-column ones, against 295 in two launches.
MAX_ROWS = 1
MAX_BLOCK_I = 16

_forced: tuple | None = None  # (block_i, num_warps): every decode step of width <= MAX_C fuses its MLP so


@contextlib.contextmanager
def forced_tile(block_i: int, num_warps: int = WARPS):
    """Inside the block, ln_mlp's default tile is (block_i, num_warps) and fusable() takes every width up to
    MAX_C at any row count: tests and benchmark sweeps."""
    global _forced
    old, _forced = _forced, (block_i, num_warps)
    try:
        yield
    finally:
        _forced = old


def _parts(C: int) -> tuple[int, int]:
    """C as two power-of-two column blocks (a, b) of at least 16 (a tl.dot's least): a the largest power of two
    below C (C / 2 when C is one), b the rest rounded up to a power of two."""
    a = 1 << (C.bit_length() - 1)
    if a == C:
        a //= 2
    return max(16, a), max(16, triton.next_power_of_2(max(C - a, 1)))


@triton.jit
def _fc_tile(xk, w1, w2, acc1, acc2, PRECISION: tl.constexpr, SWIGLU: tl.constexpr):
    acc1 = tl.dot(xk, tl.trans(w1), acc1, input_precision=PRECISION)           # (BLOCK_M, BLOCK_I)
    if SWIGLU:
        acc2 = tl.dot(xk, tl.trans(w2), acc2, input_precision=PRECISION)
    return acc1, acc2


@triton.jit
def _finish_part(WS, X, B_DN, OUT, offs_m, m_ok, offs_c, C, stride_xm, stride_om, s1, s2,
                 HAS_DN_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """The last program's epilogue over columns offs_c: read and zero the sums, + bias, + residual, store."""
    c_ok = offs_c < C
    ok = m_ok[:, None] & c_ok[None, :]
    ws = WS + offs_m.to(tl.int64)[:, None] * C + offs_c[None, :]               # (BLOCK_M, BLOCK_C)
    zero = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    total = tl.atomic_add(ws, zero, mask=ok)  # read at the point of coherence (not a stale L1)
    total = tl.where(ok, total, 0.0)          # masked lanes of an atomic return nothing defined
    tl.store(ws, zero, mask=ok)               # left zeroed for the next call: every program is done with it
    if HAS_DN_BIAS:
        total += tl.load(B_DN + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    dtype = OUT.dtype.element_ty
    res = tl.load(X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_c[None, :], mask=ok, other=0.0)
    y = (total.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)         # eager: round, then add
    tl.store(OUT + offs_m.to(tl.int64)[:, None] * stride_om + offs_c[None, :], y, mask=ok)
    ys = tl.where(ok, y.to(tl.float32), 0.0)
    return s1 + tl.sum(ys, 1), s2 + tl.sum(ys * ys, 1)


@triton.jit(do_not_specialize=["M"])  # one binary serves every batch size
def _ln_mlp_kernel(X, W_FC, B_FC, W_DN, B_DN, LN_W, LN_B, OUT, WS, CNT, STATS_IN, STATS_OUT,
                   M, I, C, stride_xm, stride_fc, stride_dn, stride_om, eps,
                   LN_STATS_IN: tl.constexpr, STATS_OUT_ON: tl.constexpr, LN_HAS_BIAS: tl.constexpr,
                   HAS_FC_BIAS: tl.constexpr, HAS_DN_BIAS: tl.constexpr, RMS: tl.constexpr,
                   SWIGLU: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_I: tl.constexpr, PART_A: tl.constexpr, PART_B: tl.constexpr, USE_GDC: tl.constexpr):
    """grid = (cdiv(I, BLOCK_I), cdiv(M, BLOCK_M)): intermediate columns [i0, i0 + BLOCK_I) of BLOCK_M rows.

    C is covered as columns [0, PART_A) and [PART_A, PART_A + PART_B), both masked to C.
    WS (row blocks x BLOCK_M, C) fp32 and CNT (per row block) are zeros before the launch and after it.
    USE_GDC: signal the next kernel, load every weight tile, then wait for the previous kernel before reading
    x, the statistics or the workspace.
    """
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)                # (BLOCK_M,)
    offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)                # (BLOCK_I,)
    m_ok = offs_m < M
    i_ok = offs_i < I
    offs_a = tl.arange(0, PART_A)                                              # (PART_A,)
    offs_b = PART_A + tl.arange(0, PART_B)                                     # (PART_B,)
    a_ok = offs_a < C
    b_ok = offs_b < C
    fc1 = W_FC + offs_i.to(tl.int64)[:, None] * stride_fc                      # (BLOCK_I, 1) gate / fc rows
    fc2 = fc1 + I * stride_fc                                                  # up rows (SwiGLU)
    dn = W_DN + offs_i[None, :]                                                # (1, BLOCK_I) down columns

    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start streaming its own weights
    # every weight of this program, before the wait: (BLOCK_I, PART) up rows and (PART, BLOCK_I) down columns
    wa1 = tl.load(fc1 + offs_a[None, :], mask=i_ok[:, None] & a_ok[None, :], other=0.0)
    da = tl.load(dn + offs_a.to(tl.int64)[:, None] * stride_dn, mask=a_ok[:, None] & i_ok[None, :], other=0.0)
    if SWIGLU:
        wa2 = tl.load(fc2 + offs_a[None, :], mask=i_ok[:, None] & a_ok[None, :], other=0.0)
    wb1 = tl.load(fc1 + offs_b[None, :], mask=i_ok[:, None] & b_ok[None, :], other=0.0)
    db = tl.load(dn + offs_b.to(tl.int64)[:, None] * stride_dn, mask=b_ok[:, None] & i_ok[None, :], other=0.0)
    if SWIGLU:
        wb2 = tl.load(fc2 + offs_b[None, :], mask=i_ok[:, None] & b_ok[None, :], other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # the previous kernel is done and its writes are visible

    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm                      # (BLOCK_M, 1)
    if LN_STATS_IN:
        s1 = tl.load(STATS_IN + offs_m * 2, mask=m_ok, other=0.0)               # (BLOCK_M,)
        s2 = tl.load(STATS_IN + offs_m * 2 + 1, mask=m_ok, other=0.0)
    else:
        xa = tl.load(x_rows + offs_a[None, :], mask=m_ok[:, None] & a_ok[None, :], other=0.0).to(tl.float32)
        xb = tl.load(x_rows + offs_b[None, :], mask=m_ok[:, None] & b_ok[None, :], other=0.0).to(tl.float32)
        s1 = tl.sum(xa, 1) + tl.sum(xb, 1)
        s2 = tl.sum(xa * xa, 1) + tl.sum(xb * xb, 1)
    mean = tl.zeros([BLOCK_M], tl.float32)
    if RMS:
        rstd = 1.0 / tl.sqrt(s2 / C + eps)                                      # (BLOCK_M,)
    else:
        mean = s1 / C
        rstd = 1.0 / tl.sqrt(tl.maximum(s2 / C - mean * mean, 0.0) + eps)

    dtype = W_FC.dtype.element_ty
    acc1 = tl.zeros([BLOCK_M, BLOCK_I], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_I], tl.float32)                            # SwiGLU: the up rows
    xk = _x_tile(x_rows, LN_W, LN_B, offs_a, a_ok, m_ok, mean, rstd, dtype, True, LN_HAS_BIAS, RMS, False)
    if SWIGLU:
        acc1, acc2 = _fc_tile(xk, wa1, wa2, acc1, acc2, PRECISION, True)
    else:
        acc1, acc2 = _fc_tile(xk, wa1, wa1, acc1, acc2, PRECISION, False)
    xk = _x_tile(x_rows, LN_W, LN_B, offs_b, b_ok, m_ok, mean, rstd, dtype, True, LN_HAS_BIAS, RMS, False)
    if SWIGLU:
        acc1, acc2 = _fc_tile(xk, wb1, wb2, acc1, acc2, PRECISION, True)
    else:
        acc1, acc2 = _fc_tile(xk, wb1, wb1, acc1, acc2, PRECISION, False)

    # h (BLOCK_M, BLOCK_I), each step rounded as eager rounds it
    if HAS_FC_BIAS:
        acc1 += tl.load(B_FC + offs_i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    y = acc1.to(dtype).to(tl.float32)                                           # the linear's output
    if SWIGLU:
        if HAS_FC_BIAS:
            acc2 += tl.load(B_FC + I + offs_i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
        up = acc2.to(dtype).to(tl.float32)
        h = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32) * up
    else:  # GELU, tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1), 2z clamped where tanh is 1 anyway
        z = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        h = 0.5 * y * (2.0 - 2.0 / (tl.exp(tl.minimum(2.0 * z, 60.0)) + 1.0))
    h = tl.where(m_ok[:, None] & i_ok[None, :], h, 0.0).to(dtype)              # (BLOCK_M, BLOCK_I)

    # this program's share of the down projection, added into the workspace
    ws_rows = WS + offs_m.to(tl.int64)[:, None] * C                            # (BLOCK_M, 1)
    part_a = tl.dot(h, tl.trans(da), input_precision=PRECISION)                # (BLOCK_M, PART_A)
    # acq_rel: each thread's adds are performed before it reaches the barrier, so that the counter's release
    # below (one thread) covers the whole share
    tl.atomic_add(ws_rows + offs_a[None, :], part_a, mask=m_ok[:, None] & a_ok[None, :], sem="acq_rel")
    part_b = tl.dot(h, tl.trans(db), input_precision=PRECISION)                # (BLOCK_M, PART_B)
    tl.atomic_add(ws_rows + offs_b[None, :], part_b, mask=m_ok[:, None] & b_ok[None, :], sem="acq_rel")
    tl.debug_barrier()
    if tl.atomic_add(CNT + tl.program_id(1), 1, sem="acq_rel") == tl.num_programs(0) - 1:  # the last program
        t1 = tl.zeros([BLOCK_M], tl.float32)
        t2 = tl.zeros([BLOCK_M], tl.float32)
        t1, t2 = _finish_part(WS, X, B_DN, OUT, offs_m, m_ok, offs_a, C, stride_xm, stride_om, t1, t2,
                              HAS_DN_BIAS, BLOCK_M, PART_A)
        t1, t2 = _finish_part(WS, X, B_DN, OUT, offs_m, m_ok, offs_b, C, stride_xm, stride_om, t1, t2,
                              HAS_DN_BIAS, BLOCK_M, PART_B)
        tl.atomic_xchg(CNT + tl.program_id(1), 0)
        if STATS_OUT_ON:  # the whole rows are here: their sums, for the next norm
            tl.store(STATS_OUT + offs_m * 2, t1, mask=m_ok)
            tl.store(STATS_OUT + offs_m * 2 + 1, t2, mask=m_ok)


_triton.check_decorated(_ln_mlp_kernel)


def fusable(M: int, C: int, I: int, device: torch.device) -> bool:
    """Whether the decode step should run its MLP block (width C, intermediate I) through ln_mlp for M rows:
    C up to MAX_C (a program holds its weights over the whole C), up to MAX_ROWS rows, and a grid of one wave
    of programs of at most MAX_BLOCK_I columns (see MAX_ROWS); inside forced_tile, any M and I. ln_mlp itself
    takes any M and I."""
    if not 1 <= C <= MAX_C or M < 1:
        return False
    return _forced is not None or (M <= MAX_ROWS and pick_block_i(I, device) <= MAX_BLOCK_I)


def pick_block_i(I: int, device: torch.device) -> int:
    """Intermediate columns per program: the fewest (16 at least, for tl.dot) that keep the grid within one
    wave of one program per SM (each program holds 254-255 registers per thread at 8 warps: one fits an SM)."""
    block_i, sms = 16, _triton.sm_count(device)
    while triton.cdiv(I, block_i) > sms and block_i < 256:
        block_i *= 2
    return block_i


def ln_mlp(x: torch.Tensor, w_fc: torch.Tensor, b_fc: torch.Tensor | None, w_down: torch.Tensor,
           b_down: torch.Tensor | None, *, ln: tuple, rms: bool = False, swiglu: bool = False,
           ln_stats: torch.Tensor | None = None, stats_out: torch.Tensor | None = None,
           pdl: bool = False, block_i: int | None = None, num_warps: int = WARPS) -> torch.Tensor:
    """x (M, C) → x + act(N(x) w_fcᵀ + b_fc) w_downᵀ + b_down, (M, C) in x's dtype (a new tensor).

    ln: (weight, bias or None, eps) of the norm (rms=True: an RMSNorm, bias None). swiglu: w_fc (2I, C) holds
    [gate | up] rows; otherwise w_fc (I, C) and GELU. w_down (C, I).
    ln_stats: (M, 2) float32 row sums (Σx, Σx²) of x for the norm, instead of a pass over x.
    stats_out: (M, 2) float32: receives the result's row sums (Σy, Σy²), for the next norm.
    pdl: as ln_linear's (the weights are read before the wait on the previous kernel).
    block_i, num_warps: the tile (intermediate columns per program, a power of two >= 16, default
    pick_block_i; warps); block_i None inside forced_tile: the forced tile.
    """
    if ln is None:
        raise ValueError("ln_mlp: the MLP block's norm is required (ln=(weight, bias or None, eps))")
    _check_modes(x, w_fc, ln, rms, not swiglu, swiglu, "ln_mlp")
    _check(x, w_fc, b_fc, ln, None, ())
    _check_stats(x, ln_stats, stats_out, ln)
    for name, t in (("w_down", w_down), ("b_down", b_down)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"ln_mlp: {name} must be a {x.dtype} tensor on {x.device}")
    M, C = x.shape
    I = w_fc.shape[0] // 2 if swiglu else w_fc.shape[0]
    if tuple(w_down.shape) != (C, I) or w_down.stride(1) != 1:
        raise ValueError(f"ln_mlp: w_down must be ({C}, {I}) with unit stride along I, got {tuple(w_down.shape)}")
    if b_down is not None and tuple(b_down.shape) != (C,):
        raise ValueError(f"ln_mlp: b_down must have shape ({C},), got {tuple(b_down.shape)}")
    if b_fc is not None and tuple(b_fc.shape) != (w_fc.shape[0],):
        raise ValueError(f"ln_mlp: b_fc must have shape ({w_fc.shape[0]},), got {tuple(b_fc.shape)}")
    if not 1 <= C <= MAX_C:
        raise ValueError(f"ln_mlp: width C={C} above {MAX_C} (use two ln_linear calls)")
    if block_i is None:
        block_i, num_warps = _forced if _forced is not None else (pick_block_i(I, x.device), num_warps)
    if not isinstance(block_i, int) or block_i < 16 or block_i & (block_i - 1):
        raise ValueError(f"ln_mlp: block_i must be a power of two >= 16, got {block_i}")
    out = _triton.empty((M, C), x.dtype, x.device)
    row_blocks = triton.cdiv(M, BLOCK_M)
    ws, cnt = _workspace(x.device, row_blocks * BLOCK_M, C)
    part_a, part_b = _parts(C)
    pdl = bool(pdl) and pdl_enabled(x.device)
    ln_w, ln_b, eps = ln
    dummy = w_fc  # pointer for the absent optional tensors (never read: their flags are off)
    with _triton.device_guard(x):
        _ln_mlp_kernel[(triton.cdiv(I, block_i), row_blocks)](
            x, w_fc, b_fc if b_fc is not None else dummy, w_down, b_down if b_down is not None else dummy,
            ln_w, ln_b if ln_b is not None else dummy, out, ws, cnt,
            ln_stats if ln_stats is not None else ws, stats_out if stats_out is not None else ws,
            M, I, C, x.stride(0), w_fc.stride(0), w_down.stride(0), out.stride(0), float(eps),
            LN_STATS_IN=ln_stats is not None, STATS_OUT_ON=stats_out is not None, LN_HAS_BIAS=ln_b is not None,
            HAS_FC_BIAS=b_fc is not None, HAS_DN_BIAS=b_down is not None, RMS=bool(rms), SWIGLU=bool(swiglu),
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M, BLOCK_I=block_i,
            PART_A=part_a, PART_B=part_b, USE_GDC=pdl, num_warps=num_warps, num_stages=1,
            **(dict(launch_pdl=True) if pdl else {}))
    return out


__all__ = ["ln_mlp", "fusable", "pick_block_i", "forced_tile"]
