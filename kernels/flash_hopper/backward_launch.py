"""Host side of the Hopper backward's Gluon dK/dV kernel (kernels/flash_hopper/backward.py).

    dkdv_into(do, q, k, v, lse, delta, dk, dv, causal, sm_scale, stages=None, ahead=None, dqacc=None,
              dq_mode=1) -> None                                  the Gluon kernel alone
    unsupported_backward(do, q, k, v, o) -> str | None            None when it takes these
    checked_scale(do, q, k, v, o, lse, sm_scale) -> float         the scale, or a ValueError naming the problem

Inputs as kernels/flash/launch.py's _bwd (the tl backward's entry point, the reference): q (B, Hq, Nq, D), k, v
(B, Hkv, Nk, D), o and do like q, lse (B, Hq, Nq) float32, contiguous, base 2 and scaled (qk_scale = sm_scale ·
log2 e), +inf for rows that see no key — what either forward stores.

kernels/flash/launch.py's _hopper_bwd runs the whole backward around it: split, the tl dQ kernel (which stores
delta = rowsum(dO * O)) and then this kernel for dK and dV; or fused (dq_mode 1 to 6), the tl pass storing
delta and zeroing an fp32 dQ accumulator, this kernel adding dS K into it besides dK and dV, the tl pass
scaling and converting dQ. kernels.flash_attention's backward runs the fused form 5, 3, 4 or 6 (per head dim and
mask: kernels/flash/launch.py: hopper_bwd_form) where the hopper_backward option sends it (_hopper_bwd_takes there).
Taken: what the Gluon forward takes
(float16/bfloat16, head dims 64 and 128, any lengths, causal or not, GQA, TMA-aligned strides, compute
capability 9.0), with do and o TMA-aligned as well.
"""
from __future__ import annotations

import contextlib
import math

import torch

from .. import _triton
from .. import options as _options
from .launch import AVAILABLE, _desc, _tma_ok, launch_cached, unsupported

if AVAILABLE:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import backward as _backward

# the fused forms (dkdv_into's dq_mode), and those that compute each step's dQ one step later (not with ahead)
DQ_MODES = (1, 2, 3, 4, 5, 6)
LAGGED_DQ_MODES = (4, 6)

BLOCK_M = 64  # query rows per step (the Q/dO ring's blocks)
BLOCK_N = 64  # keys per consumer warpgroup (a program holds 2 x BLOCK_N keys)
# the Q/dO ring's depth per head dim without a mask (d128: K, V 64 KB + 2 stages of Q, dO 64 KB) and causal. At
# d64, on an H100, each depth timed in four runs over two calls (bench/results/flash_hopper/backward/
# stages_d64_h100/): causal, fused form 4 (what flash_attention runs there) 2-4 % shorter with 4 stages than with
# 3, 2 or 5 at 4,16,4096 and 2,16,8192; without a mask, form 6 0.9-3 % shorter with 5 than with 3 in every run,
# 4 the longest. d128: 3 stages longer for the causal form 5; 4 do not fit beside the fused forms' buffers
STAGES = {64: 5, 128: 2}
CAUSAL_STAGES = {64: 4, 128: 2}
# the next block's score matmuls issued before this one's elementwise work: off, measured slower at both head
# dims (bench/results/flash_hopper/backward/)
AHEAD = {64: False, 128: False}
MAX_STAGES = {64: 6, 128: 4}  # the ring alone in 227 KB (a stage: Q and dO, 16 KB at d64, 32 at d128); shared_bytes
# decides with the fused forms' buffers
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)
SMEM_SLACK = 512  # alignment above the buffers and barriers (280-376 B in the compiled variants)
NUM_WARPS = 4  # the default partition: consumer 0
# each step's lse and delta brought into the ring by the producer's TMA beside Q and dO, instead of global loads
# in the consumers (the largest consumer stall under Nsight Compute: bench/results/flash_hopper/backward/
# profile_d128_h100/): at N = 4096 the dK/dV kernel 5-11 % less time, the fused form 0-11 %, on an H100
# (bench/results/flash_hopper/backward/rows_through_tma/). Where a head's rows do not start on 16 bytes (Nq not
# a multiple of 4) or the buffer is smaller than one box, the consumers keep the global loads.
ROWS_TMA = True


# at head dim 64, causal blocks wholly below the diagonal skip the mask through a runtime branch in the consumers'
# loop (the kernel's CAUSAL = 2; at d128 it spills more under Triton 3.6 and 3.9, so d128 keeps the mask on
# every block). On an H100 it shortened the split form's dK/dV kernel by 6-8 % but lengthened the fused form 3,
# the one flash_attention runs, by 3-4 % (bench/results/flash_hopper/backward/mask_skip_d64/), so off
# (skip_mask_below_diagonal)
MASK_SKIP = False


# fused forms 2, 3 and 5: one dSᵀ buffer per ring stage, each counted free through the ring's own releases (both
# warpgroups release a stage after the step's dQ matmuls retired) instead of its own mbarriers. Gluon lowers each
# mbarrier arrive to one thread's arrive between two warpgroup barriers (BAR.SYNC), so this drops one arrive and
# its barriers from every step (sm_90, Triton 3.6: the d128 causal form 3 42 -> 40 BAR.SYNC, spill stores
# 24 -> 17 in the SASS). Up to DS_RING_MAX_STAGES, where the buffers still fit in shared memory beside the ring.
# On an H100 it shortened none of the forms flash_attention runs (d128 causal 0.9-1.7 % longer, d64 causal
# 0.6-1.2 %; bench/results/flash_hopper/backward/ds_ring/), so off (ds_freed_by_ring)
DS_RING = False
DS_RING_MAX_STAGES = {64: 5, 128: 2}  # d64: 5 x (16 KB of Q and dO + 16 KB of dSᵀ) + K, V and dQ's 48 KB

# causal: the last (batch, kv head) pairs of the grid deal out their key tiles across pairs, longest first, so
# that the run's last long programs start while other work is left (the kernel's _program_tile). Launched in
# order, each head's tiles longest first and one head after another, the last head's first tile starts when
# about one head's work is left; modelled as list scheduling on 132 SMs, the makespan is 5-27 % above the
# total work at 2048-8192 tokens (B,H 8,16 / 4,16 / 1,16 / 2,8) and within 2 % with the last
# TAIL_ROUNDS · SMs / tiles heads dealt (tests/test_flash_hopper_backward.py: the model). On an H100 the fused
# form 5 at d128 took 3 % less time at 4,16,4096 and 6 % less at 1,16,8192 (the Gluon kernel alone 1-2 % and
# 5-8 %; bench/results/flash_hopper/backward/tail_dealt/). Pairs dealt: enough that their work covers
# TAIL_ROUNDS / 2 rounds of the longest program on every SM; 0 keeps the launch order (tail_heads_dealt)
TAIL_ROUNDS = 4


@contextlib.contextmanager
def ds_freed_by_ring(on: bool = True):
    """Inside the block, Gluon dK/dV launches of fused forms 2, 3 and 5 (up to DS_RING_MAX_STAGES) keep one dSᵀ
    buffer per stage, counted free through the ring's releases instead of its own barriers (DS_RING): benchmark
    A/B runs and tests."""
    global DS_RING
    old, DS_RING = DS_RING, bool(on)
    try:
        yield
    finally:
        DS_RING = old


@contextlib.contextmanager
def tail_heads_dealt(rounds: int = 4):
    """Inside the block, causal Gluon dK/dV launches deal the last heads' key tiles across them (TAIL_ROUNDS =
    rounds; 0: the launch order): benchmark A/B runs and tests."""
    global TAIL_ROUNDS
    old, TAIL_ROUNDS = TAIL_ROUNDS, int(rounds)
    try:
        yield
    finally:
        TAIL_ROUNDS = old


def tail_heads_for(n_tiles: int, n_heads: int, causal: bool, sms: int) -> int:
    """How many of the grid's last (batch, kv head) pairs deal their n_tiles key tiles across them: causal
    only, min(n_heads, ceil(TAIL_ROUNDS · sms / n_tiles)) (a pair's tiles hold about n_tiles / 2 times its
    longest program's work, so these pairs hold TAIL_ROUNDS / 2 rounds of the longest program on every SM)."""
    if not causal or TAIL_ROUNDS <= 0:
        return 0
    return min(n_heads, -(-TAIL_ROUNDS * sms // n_tiles))


def program_order(n_tiles: int, n_heads: int, tail_heads: int) -> list[tuple[int, int]]:
    """(key tile, linear head b·Hkv + hk) of each program of the grid in launch order, as the kernel's
    _program_tile maps them (for the schedule's model in the tests)."""
    body = n_heads - tail_heads
    order = [(tile, head) for head in range(body) for tile in range(n_tiles)]
    return order + [(tile, body + j) for tile in range(n_tiles) for j in range(tail_heads)]


@contextlib.contextmanager
def skip_mask_below_diagonal(on: bool = True):
    """Inside the block, causal Gluon dK/dV launches at head dim 64 skip the mask on blocks wholly below the
    diagonal (MASK_SKIP): benchmark A/B runs and tests."""
    global MASK_SKIP
    old, MASK_SKIP = MASK_SKIP, bool(on)
    try:
        yield
    finally:
        MASK_SKIP = old


@contextlib.contextmanager
def rows_through_tma(on: bool = True):
    """Inside the block, Gluon dK/dV launches take each step's lse and delta rows through TMA into the stage
    (on, the default) or load them from global memory in the consumers (off): benchmark A/B runs and tests."""
    global ROWS_TMA
    old, ROWS_TMA = ROWS_TMA, bool(on)
    try:
        yield
    finally:
        ROWS_TMA = old


# The compiled dK/dV kernel per launch signature: with FAST_LAUNCH (and the fast_launch option) a repeated
# signature calls its launcher directly (kernels/flash_hopper/launch.py: launch_cached), as the forward does.
# Off: on one H100 it timed the same as launches through JITFunction.run at GPT-2's shapes (0.285 against 0.281
# ms at 16,12,1024,64 causal: bench/results/flash_hopper/backward/gpt2_direct_h100/); its GPU test
# (tests/test_flash_hopper_backward.py: test_direct_backward_launches_give_the_result_of_the_jit) passes
# (bench/results/gpu_check/pytest_4145c2a.log.gz). direct_launches: tests and benchmarks
FAST_LAUNCH = False
_compiled: dict[tuple, object] = {}


@contextlib.contextmanager
def direct_launches(on: bool = True):
    """Inside the block, repeated Gluon dK/dV launch signatures call the compiled kernel's launcher directly
    (FAST_LAUNCH): tests and benchmark A/B runs."""
    global FAST_LAUNCH
    old, FAST_LAUNCH = FAST_LAUNCH, bool(on)
    try:
        yield
    finally:
        FAST_LAUNCH = old


def unsupported_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         o: torch.Tensor) -> str | None:
    """Why the Hopper backward does not take these inputs, or None when it does."""
    reason = unsupported(q, k, v)
    if reason is not None:
        return reason
    for name, t in (("do", do), ("o", o)):
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            return f"{name} {tuple(t.shape)} {t.dtype} is not shaped like q {tuple(q.shape)} {q.dtype}"
        if not _tma_ok(t):
            return f"a stride or start of {name} is not 16-byte aligned (TMA)"
    return None


def dkdv_into(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
              delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, causal: bool, sm_scale: float,
              stages: int | None = None, ahead: bool | None = None, dqacc: torch.Tensor | None = None,
              dq_mode: int = 1) -> None:
    """Launch the Gluon dK/dV kernel on inputs that unsupported_backward() accepted: dK into dk, dV into dv
    (like k, v: (B, Hkv, Nk, D), TMA-aligned). lse and delta: (B, Hq, Nq) float32, contiguous. On q's device.
    stages: the Q/dO ring's depth, 2 to MAX_STAGES[D] (None: default_stages(D, causal)). ahead: whether each
    consumer issues the next query block's score matmuls before this block's elementwise work (None: AHEAD[D]).
    dqacc: a contiguous (B, Hq, Nq, D) float32 buffer (zeros) into which the kernel also adds dS K, dQ unscaled
    (the fused backward); None: no dQ. dq_mode (with dqacc): 1, each consumer warpgroup adds its own keys' part; 2,
    the two warpgroups' dS go through one shared buffer and each adds half of dQ's columns over both; 3, as 2
    with TMA reduce-adds instead of atomics; 4, as 3 with each step's dQ computed in the next step, after that
    step's dK matmul is issued (not with ahead); 5, as 3 with each step's dK matmul issued after its dQ
    matmuls, so that it runs while dQ goes out (FlashAttention-3's order); 6, as 4 with each step's dK matmul
    issued after the previous step's dQ matmuls (5's order; not with ahead)."""
    if dqacc is not None and dq_mode not in DQ_MODES:
        raise ValueError(f"flash_hopper: dq_mode={dq_mode}: one of {', '.join(map(str, DQ_MODES))}")
    B, Hq, Nq, D = q.shape
    if dqacc is not None and (dqacc.shape != (B, Hq, Nq, D) or dqacc.dtype != torch.float32
                              or not dqacc.is_contiguous()):
        raise ValueError(f"flash_hopper: dqacc must be a contiguous (B, Hq, Nq, D) float32 buffer, got "
                         f"{tuple(dqacc.shape)} {dqacc.dtype}")
    Hkv, Nk = k.shape[1], k.shape[2]
    ahead = AHEAD[D] if ahead is None else bool(ahead)
    if ahead and dqacc is not None and dq_mode in LAGGED_DQ_MODES:
        raise ValueError(f"flash_hopper: dq_mode={dq_mode} (dQ one step behind) does not run with ahead=True")
    stages = default_stages(D, causal) if stages is None else stages
    if not 2 <= stages <= MAX_STAGES[D]:
        raise ValueError(f"flash_hopper: stages={stages} at head dim {D}: the ring holds 2 to {MAX_STAGES[D]}")
    dq = 0 if dqacc is None else int(dq_mode)
    ds_ring = DS_RING and stages <= DS_RING_MAX_STAGES[D] and dq in (2, 3, 5)
    rows_tma = rows_through_tma_for(Nq) and rows_fit_tma(lse) and rows_fit_tma(delta)
    need = shared_bytes(D, stages, dq, ds_ring, rows_tma)
    if need > SMEM_LIMIT:
        raise ValueError(f"flash_hopper: stages={stages} at head dim {D} with dq_mode={dq} needs {need} B of "
                         f"shared memory, more than sm_90's {SMEM_LIMIT}: fewer stages")
    for name, t, like in (("dk", dk, k), ("dv", dv, v)):
        if not _tma_ok(t) or t.shape != like.shape or t.dtype != like.dtype:
            raise ValueError(f"flash_hopper: the {name} buffer {tuple(t.shape)} {t.dtype} (strides {t.stride()}) "
                             "does not match k or is not TMA-aligned")
    for name, t in (("lse", lse), ("delta", delta)):
        if t.shape != (B, Hq, Nq) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"flash_hopper: {name} must be a contiguous (B, Hq, Nq) float32 buffer, got "
                             f"{tuple(t.shape)} {t.dtype}")
    grid = (-(-Nk // (2 * BLOCK_N)), Hkv, B)
    tail_heads = tail_heads_for(grid[0], Hkv * B, causal, _triton.sm_count(q.device))
    args = (_desc(q, BLOCK_M), _desc(k, BLOCK_N), _desc(v, BLOCK_N), _desc(do, BLOCK_M), _desc(dk, BLOCK_N),
            _desc(dv, BLOCK_N), lse, delta, _rows_desc(lse) if rows_tma else lse,
            _rows_desc(delta) if rows_tma else delta, Hq, Hq // Hkv, Nq, Nk - Nq, sm_scale * _triton.LOG2E, sm_scale,
            lse if dqacc is None else _dq_desc(dqacc) if dq_mode >= 3 else dqacc)  # (dqacc not read without DQ)
    consts = dict(TAIL_HEADS=tail_heads, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_D=D, STAGES=stages,
                  CAUSAL=2 if causal and MASK_SKIP and D == 64 else bool(causal), GQA=Hq > Hkv, AHEAD=ahead,
                  DQ=dq, ROWS_TMA=rows_tma, DS_RING=ds_ring)
    launch_cached(_backward._attn_bwd_dkdv_hopper, _compiled, grid, args, consts, q,
                  FAST_LAUNCH and _options.get().fast_launch, num_warps=NUM_WARPS, maxnreg=_backward.MAX_REGS)


def shared_bytes(D: int, stages: int, dq_mode: int = 0, ds_ring: bool = False, rows_tma: bool = True) -> int:
    """Shared memory a launch of the Gluon kernel takes, from its buffers (16-bit elements): the Q and dO ring,
    K and V of both consumers, the dSᵀ buffers (dq_mode 1: one per consumer; 2 and up: both consumers' per step
    parity, or per stage with ds_ring), dQ's fp32 half-tiles (dq_mode 3 and up), the lse and delta rows per stage
    (rows_tma), the mbarriers and SMEM_SLACK. tests/test_flash_hopper_backward.py checks it against every
    compiled variant."""
    ring = stages * 2 * BLOCK_M * D * 2
    kv = 2 * 2 * BLOCK_N * D * 2
    ds = 0 if dq_mode == 0 else BLOCK_N * BLOCK_M * 2 * 2 * ((stages if ds_ring else 2) if dq_mode >= 2 else 1)
    dq = 2 * BLOCK_M * (D // 2) * 4 if dq_mode >= 3 else 0
    rows = 2 * stages * BLOCK_M * 4 if rows_tma else 0
    barriers = 8 * (2 * stages + 6)  # ready and empty per stage, two K/V, four dS
    return ring + kv + ds + dq + rows + barriers + SMEM_SLACK


def default_stages(D: int, causal: bool) -> int:
    """The Q/dO ring's depth a launch takes unless told: CAUSAL_STAGES[D] with the causal mask, STAGES[D]
    without."""
    return (CAUSAL_STAGES if causal else STAGES)[D]


def rows_through_tma_for(Nq: int) -> bool:
    """Whether a launch with Nq query rows per head takes its lse and delta through TMA (given 16-byte-aligned
    buffers of at least one box): ROWS_TMA on and every head's rows starting on 16 bytes (Nq a multiple of 4;
    the step's block start is a multiple of BLOCK_M). A 1-d box whose start is not 16-byte aligned faults at the
    copy (an illegal instruction on an H100)."""
    return ROWS_TMA and Nq % 4 == 0


def rows_fit_tma(rows: torch.Tensor) -> bool:
    """Whether the flat (B·Hq·Nq) float32 rows of lse or delta can be read through a 1-d TMA descriptor: every
    head's rows starting on 16 bytes (Nq a multiple of 4, a 16-byte base), int32 coordinates, and at least one
    BLOCK_M box of elements."""
    return (rows.shape[-1] % 4 == 0 and BLOCK_M <= rows.numel() < 2 ** 31 and rows.data_ptr() % 16 == 0)


def _rows_desc(rows: torch.Tensor):
    """A 1-d TMA descriptor over the flat (B·Hq·Nq) float32 rows of lse or delta, read in BLOCK_M blocks."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    return TensorDescriptor(rows.view(-1), [rows.numel()], [1], [BLOCK_M], layout)


def _dq_desc(dqacc: torch.Tensor):
    """The TMA descriptor of the fused form's fp32 dQ accumulator (B, Hq, Nq, D), contiguous, as (B·Hq, Nq, D):
    each consumer warpgroup adds (1, BLOCK_M, D / 2) blocks, half of dQ's columns."""
    B, Hq, Nq, D = dqacc.shape
    block = [1, BLOCK_M, D // 2]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float32)
    return TensorDescriptor(dqacc, [B * Hq, Nq, D], [Nq * D, D, 1], block, layout)


def checked_scale(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, sm_scale: float | None) -> float:
    """The softmax scale (None: 1/sqrt(D)) of backward inputs the kernels take; a ValueError naming the reason
    otherwise (shapes, dtypes, devices, what unsupported_backward() refuses, lse's layout, the scale)."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1] \
            or k.shape[1] < 1 or q.shape[1] % k.shape[1] or q.shape[2] < 1 or k.shape[2] < 1:
        raise ValueError(f"flash_hopper: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not "
                         "(B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D) with Nq, Nk >= 1, Hq a multiple of Hkv")
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise ValueError(f"flash_hopper: q, k, v of one dtype and device, got {q.dtype}, {k.dtype}, {v.dtype}")
    reason = unsupported_backward(do, q, k, v, o)
    if reason is not None:
        raise ValueError(f"flash_hopper: {reason}")
    B, Hq, Nq, D = q.shape
    if lse.shape != (B, Hq, Nq) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"flash_hopper: lse must be a contiguous (B, Hq, Nq) float32 tensor, got "
                         f"{tuple(lse.shape)} {lse.dtype}")
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"flash_hopper: sm_scale must be a finite number > 0, got {sm_scale}")
    return scale
