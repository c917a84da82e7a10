"""Every layer of a one-sequence decode step in one persistent launch: the phases meet at grid barriers.

    plan = StackPlan(layers, ...)                 the layers' weights and caches as a table of addresses
    x_out = decode_stack(plan, x, pos, rope)      x (1, C) the embedded token → the last layer's output (1, C)
    decode_stack(..., final_norm=(w, b, eps))     ... with the model's final norm applied (in the last phase)
    fits(...) -> str | None                       why a model's shape cannot run here (None: it can)

A decode step of a narrow model at batch 1 is a chain of ~4 small kernels per layer (ln_linear.py,
decode.py, decode_mlp.py): each pays its launch, its ramp and its memory latency, so a 30-layer model's step
is bound by ~120 launch boundaries, not by its weights' bytes (bench/NOTES.md). Here one launch of one program
per SM runs the whole stack. Each layer is four phases, separated by grid barriers (an arrival counter in
global memory, release / acquire at GPU scope) instead of kernel boundaries, and every program loads the
weights of its next phase before it waits at the barrier, so the weights stream while the slowest program of
the phase before finishes:

    A   x = x_mid + round(Σ_down + b_down)  (the previous layer's MLP sums; the embedding at layer 0)
        q, k, v = rope(N₁(x) W_qkvᵀ + b)     each program PA lane pairs (i, i + D/2) of one head; k, v into
                                            the cache at pos, q into a buffer
    B   attention of one kv group over one strided share of the cache's key tiles → partial (m, l, acc)
    C   y = merge of the partials (every head); x_mid = x + round(y W_oᵀ + b_o)    OC output columns a program
    D   h = act(N₂(x_mid) W_fcᵀ + b_fc)       IB intermediate columns a program (h never leaves it), and
        Σ_down[l + 1] += h W_downᵀ[:, cols] with fp32 atomics

and after the last layer x_out = x_mid + round(Σ_down + b_down). Rounding follows the eager model in its dtype
as ln_linear's does (norm outputs, each linear's output with its bias, RoPE's products, SiLU and h, the
attention output, each residual add); the attention itself and every sum run in fp32.

Supported (checked by fits / StackPlan with a ValueError naming the problem):
    dtypes   float16, bfloat16, float32 (one for x, weights, caches and RoPE tables)
    shapes   one sequence (batch 1); C <= MAX_C held as two power-of-two blocks (576 = 512 + 64); head dim a
             power of two 16..128 with caches (B', Hkv, max_len, D) unit-strided along D; Hq a multiple of
             Hkv; each phase's blocks within one program per SM
    models   LayerNorm or RMSNorm (a gain, optional bias), GELU (tanh) or SwiGLU (w_fc rows [gate | up]),
             optional biases on every linear, RoPE (rotate-half tables) or none, GQA
    devices  CUDA, every program resident at once (one per SM: a GPU shared with other work at the same time,
             or partitioned below its SM count, cannot pass the barriers; they give up after seconds with a
             device trap, and decode_stack=False avoids them); under Triton's interpreter, where programs
             run one after another and no barrier could be passed, each phase is its own launch
             (phase_by_phase=True), the same code without the barriers: that is what the CPU tests run.
Weights are read through 64-bit addresses from the plan's table (no copies); every address must be 16-byte
aligned. Inference only.

Measured on an H200 (bench/results/generate_smollm2/stack/one_poller/, bf16, batch 1, prompt 128 + 256 new
tokens): SmolLM2-135M's step 393 µs against 716 in per-layer launches (685 against 376 GB/s of weights);
GPT-2 124M's 254 against 296. The timeline (bench/stack_timeline.py) gives each phase ~2-3.5 µs, 0.8-2 µs of
it the barrier: 11.3 µs a layer against ~23 in launches. Loads that need nothing from the phase before (the
RoPE angles, attention's first key tile, phase C's residual) are issued before the barrier, and only warp 0
of a program polls a barrier (one launch 350 against 365 µs with every warp polling). Loading phase D's
weights during attention (mlp_weights_after("A")) spilled and was slower (525 against 439 µs a launch).

Fewer CTA-wide reductions (kernel option decode_stack_merged_sums, on by default; widths up to MERGED_MAX_C):
each tl.sum across the warps and each layout change is a round trip through shared memory with its bar.syncs,
and with C as two column blocks every sum over C is two. With the option, phase A holds the width as one
power-of-two block CW (576 → 1024, masked): the residual and N₁'s sums are one reduction (LayerNorm: Σx and Σx²
together, var = Σx²/C - mean²), and its two lane halves' QKV rows, (PA, CW) each, one two-operand reduction.
Phase D takes N₂'s sums over x_mid loaded once more as one block, its gate and up rows (still two column blocks)
in one two-operand reduction per block with one layout change for both, and its down-projection share as one
(CW, IB) block: one reduction and one atomic add instead of two. At SmolLM2-135M's shape under Triton 3.6 at
sm_90 the PTX's bar.sync go from 27 to 12 in phase A and from 20 to 14 in phase D (77 to 55 in the one-launch
kernel), at 232 registers without spills either way; at GPT-2 124M's width the one-block tiles spill 216 B
(40 B without), hence MERGED_MAX_C. Phase D's gate and up rows stay two column blocks: as one block they take
the kernel to 255 registers and 52 B of spills. On the H200 the SmolLM2-135M launch took 333 against 347 µs
(bench/results/generate_smollm2/stack/merged_sums_77f303e/: phase A's median work 1.02 against 1.54 µs), the
decode step 378 against 394 µs.
"""
from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from . import _triton
from . import options as _options
from .decode_mlp import _parts  # C as two power-of-two column blocks

MAX_C = 768        # C held in registers as two power-of-two blocks, as decode_mlp's
WARPS = 8
MLP_AFTER = "C"    # the phase after whose arrival phase D's weights load: "A", "B" or "C" (mlp_weights_after)
MLP_POINTS = {"A": 1, "B": 2, "C": 3}  # ... as the kernel's MLP_AT
ONE_POLLER = True  # only warp 0 of a program polls a barrier's counter (every_warp_polls: all warps)
MERGED_MAX_C = 576  # widest C the option decode_stack_merged_sums applies to (768's one-block tiles spill 216 B)
MAX_SPLITS = 16    # key shares per kv group in phase B (C merges at most this many partials per head)
BLOCK_N = 32       # keys per tile in phase B
MAX_POLLS: tl.constexpr = tl.constexpr(1 << 24)  # a barrier's polls before it gives up (~0.5 µs each)

# the per-layer address table's columns (TABLE the tensor each holds; absent biases are address 0)
TABLE = ("w_qkv", "b_qkv", "ln1_w", "ln1_b", "w_o", "b_o", "ln2_w", "ln2_b", "w_fc", "b_fc", "w_down", "b_down",
         "k_cache", "v_cache")
W_QKV: tl.constexpr = tl.constexpr(0)
B_QKV: tl.constexpr = tl.constexpr(1)
LN1_W: tl.constexpr = tl.constexpr(2)
LN1_B: tl.constexpr = tl.constexpr(3)
W_O: tl.constexpr = tl.constexpr(4)
B_O: tl.constexpr = tl.constexpr(5)
LN2_W: tl.constexpr = tl.constexpr(6)
LN2_B: tl.constexpr = tl.constexpr(7)
W_FC: tl.constexpr = tl.constexpr(8)
B_FC: tl.constexpr = tl.constexpr(9)
W_DN: tl.constexpr = tl.constexpr(10)
B_DN: tl.constexpr = tl.constexpr(11)
K_CACHE: tl.constexpr = tl.constexpr(12)
V_CACHE: tl.constexpr = tl.constexpr(13)
N_PTRS: tl.constexpr = tl.constexpr(len(TABLE))


@contextlib.contextmanager
def mlp_weights_after(phase: str):
    """Inside the block, launches load phase D's weights right after arriving from phase `phase`: "A" (they
    stream in during attention, held in registers through phases B and C), "B" (during the barrier after
    attention and phase C) or "C" (the default: during the barrier before phase D). Benchmark A/B runs
    (bench/results/generate_smollm2/stack/weights_after_a09248b_h100/: no point beats C)."""
    global MLP_AFTER
    if phase not in MLP_POINTS:
        raise ValueError(f"mlp_weights_after: phase must be one of {', '.join(MLP_POINTS)}, not {phase!r}")
    old, MLP_AFTER = MLP_AFTER, phase
    try:
        yield
    finally:
        MLP_AFTER = old


@contextlib.contextmanager
def every_warp_polls(on: bool = True):
    """Inside the block, launches have every warp of a program poll the barrier counter (as before ONE_POLLER):
    benchmark A/B runs."""
    global ONE_POLLER
    old, ONE_POLLER = ONE_POLLER, not on
    try:
        yield
    finally:
        ONE_POLLER = old


@triton.jit
def _addr(PTRS, layer, j: tl.constexpr, dtype: tl.constexpr):
    """Column j of the address table's row `layer`, as a pointer to dtype (16-byte aligned: the plan checks)."""
    a = tl.multiple_of(tl.load(PTRS + layer * N_PTRS + j), 16)
    return tl.multiple_of(a.to(tl.pointer_type(dtype)), 16)  # kept on the pointer: loads from it vectorize


@triton.jit
def _ld_acquire(p):
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [p], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _spin_warp0(p, target):
    """Warp 0 polls the counter at p (acquire loads; a warp's loads of one address coalesce into one request)
    until it reads at least target, in a loop of its own; the other warps return at once (_wait's CTA barrier
    then holds them). Returns the polls (0 for the other warps): above MAX_POLLS (seconds: some program never
    became resident) it gave up."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred w; .reg .u32 t, s; mov.u32 $0, 0; mov.u32 t, %tid.x; setp.ge.u32 w, t, 32; "
        "@w bra SPIN_DONE_${:uid}; "
        "SPIN_LOOP_${:uid}: ld.global.acquire.gpu.b32 s, [$1]; setp.ge.s32 w, s, $2; @w bra SPIN_DONE_${:uid}; "
        f"add.u32 $0, $0, 1; setp.le.u32 w, $0, {MAX_POLLS}; @w bra SPIN_LOOP_${{:uid}}; "
        "SPIN_DONE_${:uid}: }",
        "=r,l,r", [p, target], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _stamp(TIMES, pid, layer, k: tl.constexpr, ON: tl.constexpr):
    """With ON: the GPU's global nanosecond timer into TIMES[pid, layer, k] (the phase timeline)."""
    if ON:
        tl.debug_barrier()
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                      pack=1)
        tl.store(TIMES + (pid * 1024 + layer) * 8 + k, t)


@triton.jit
def _arrive(BAR):
    """This program is done with the phase: its writes (every thread's) become visible to any program that
    sees the counter include this arrival."""
    tl.debug_barrier()                                    # the whole program's writes precede the arrival
    tl.atomic_add(BAR, 1, sem="release", scope="gpu")      # one thread arrives for the program


@triton.jit
def _trap():
    return tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait(BAR, target, ONE_POLLER: tl.constexpr):
    """Until every program has arrived (the counter reaches target); their writes are visible after it. Loads
    issued between _arrive and _wait (the next phase's weights) stream in while this program waits. A wait of
    more than MAX_POLLS polls (seconds: some program never became resident) ends the kernel with a trap, an
    error on the host instead of a hang.

    ONE_POLLER: only warp 0 polls, and the CTA barrier after its acquire orders the other warps' reads (the
    cooperative-groups grid sync's pattern): one load of the counter per program and poll instead of one per
    warp, so the programs' polls and arrivals queue less at the counter's L2 slice. Otherwise every warp polls."""
    if ONE_POLLER:
        if _spin_warp0(BAR, target) > MAX_POLLS:
            _trap()
    else:
        seen = _ld_acquire(BAR)
        polls = 0
        while seen < target:
            seen = _ld_acquire(BAR)
            polls += 1
            if polls > MAX_POLLS:
                _trap()
    tl.debug_barrier()


@triton.jit
def _rows2(W, rows, ok, stride, offs_a, a_ok, offs_b, b_ok):
    """Weight rows `rows` (R,) over the two column blocks: (R, A), (R, B), masked by ok (R,)."""
    base = W + rows.to(tl.int64)[:, None] * stride
    wa = tl.load(base + offs_a[None, :], mask=ok[:, None] & a_ok[None, :], other=0.0)
    wb = tl.load(base + offs_b[None, :], mask=ok[:, None] & b_ok[None, :], other=0.0)
    return wa, wb


@triton.jit
def _rows1(W, rows, ok, stride, offs, c_ok):
    """Weight rows `rows` (R,) over one column block offs (W,): (R, W), masked by ok (R,) and c_ok (W,)."""
    return tl.load(W + rows.to(tl.int64)[:, None] * stride + offs[None, :], mask=ok[:, None] & c_ok[None, :],
                   other=0.0)


@triton.jit
def _vec1(V, offs, ok, ON: tl.constexpr):
    """A vector over one column block offs, fp32 (zeros where not ON, and beyond ok)."""
    if ON:
        return tl.load(V + offs, mask=ok, other=0.0).to(tl.float32)
    return tl.zeros(offs.shape, tl.float32)


@triton.jit
def _vec2(V, offs_a, a_ok, offs_b, b_ok, ON: tl.constexpr):
    """A (C,) vector over the two column blocks, fp32 (zeros where not ON)."""
    if ON:
        va = tl.load(V + offs_a, mask=a_ok, other=0.0).to(tl.float32)
        vb = tl.load(V + offs_b, mask=b_ok, other=0.0).to(tl.float32)
    else:
        va = tl.zeros(offs_a.shape, tl.float32)
        vb = tl.zeros(offs_b.shape, tl.float32)
    return va, vb


@triton.jit
def _gemv(wa, wb, xa, xb):
    """Σ_c w[r, c] x[c] over both column blocks, fp32: (R,)."""
    return tl.sum(wa.to(tl.float32) * xa[None, :], 1) + tl.sum(wb.to(tl.float32) * xb[None, :], 1)


@triton.jit
def _residual(X0, XM, WS, bias, layer, offs, ok, C: tl.constexpr, dtype: tl.constexpr):
    """The residual stream entering `layer` at columns offs, fp32 of dtype values: the embedding at layer 0,
    else x_mid + round(Σ_down[layer] + b_down of layer - 1) (bias: its values there, fp32), rounded as eager."""
    at = offs * 0 + layer                                                    # (R,) (a tensor & a tensor)
    later = at > 0
    x = tl.load(X0 + offs, mask=ok & (at == 0), other=0.0).to(tl.float32)
    x += tl.load(XM + offs, mask=ok & later, other=0.0, cache_modifier=".cg").to(tl.float32)
    s = tl.load(WS + layer * C + offs, mask=ok & later, other=0.0, cache_modifier=".cg")
    s += tl.where(later, bias, 0.0)
    return (s.to(dtype).to(tl.float32) + x).to(dtype).to(tl.float32)


@triton.jit
def _normed(xa, xb, ga, gb, ba, bb, a_ok, b_ok, eps, C: tl.constexpr, RMS: tl.constexpr, dtype: tl.constexpr):
    """N(x) over the two blocks (gain ga/gb, bias ba/bb: zeros without one), rounded as eager, fp32."""
    if RMS:  # eager rounds x / rms to dtype, then the product with the gain
        rstd = 1.0 / tl.sqrt((tl.sum(xa * xa, 0) + tl.sum(xb * xb, 0)) / C + eps)
        na = ((xa * rstd).to(dtype).to(tl.float32) * ga).to(dtype).to(tl.float32)
        nb = ((xb * rstd).to(dtype).to(tl.float32) * gb).to(dtype).to(tl.float32)
    else:
        mean = (tl.sum(xa, 0) + tl.sum(xb, 0)) / C
        da = tl.where(a_ok, xa - mean, 0.0)
        db = tl.where(b_ok, xb - mean, 0.0)
        rstd = 1.0 / tl.sqrt((tl.sum(da * da, 0) + tl.sum(db * db, 0)) / C + eps)
        na = (da * rstd * ga + ba).to(dtype).to(tl.float32)
        nb = (db * rstd * gb + bb).to(dtype).to(tl.float32)
    return na, nb


@triton.jit
def _add2(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def _stats(x, eps, C: tl.constexpr, RMS: tl.constexpr):
    """N's (mean, rstd) of x (CW,), zero beyond its C columns, in one CTA-wide reduction: Σx² (RMSNorm: mean
    0), or Σx and Σx² together (LayerNorm: var = Σx²/C - mean², as ln_linear's row statistics)."""
    if RMS:
        mean = 0.0
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / C + eps)
    else:
        s1, s2 = tl.reduce((x, x * x), 0, _add2)
        mean = s1 / C
        rstd = 1.0 / tl.sqrt(tl.maximum(s2 / C - mean * mean, 0.0) + eps)
    return mean, rstd


@triton.jit
def _scaled(x, mean, rstd, g, b, RMS: tl.constexpr, dtype: tl.constexpr):
    """N(x) from its statistics (gain g, bias b: zeros without one, and beyond C), rounded as eager, fp32."""
    if RMS:
        return ((x * rstd).to(dtype).to(tl.float32) * g).to(dtype).to(tl.float32)
    return ((x - mean) * rstd * g + b).to(dtype).to(tl.float32)


@triton.jit
def _gemv_pair(w1, w2, n):
    """(Σ_c w1[r, c] n[c], Σ_c w2[r, c] n[c]) as one two-operand reduction, fp32: (R,), (R,)."""
    return tl.reduce((w1.to(tl.float32) * n[None, :], w2.to(tl.float32) * n[None, :]), 1, _add2)


@triton.jit
def _qkv_weights(PTRS, layer, before, rows1, rows2, r_ok, offs_a, a_ok, offs_b, b_ok, offs_w, w_ok,
                 C: tl.constexpr, LN_BIAS: tl.constexpr, QKV_BIAS: tl.constexpr, DN_BIAS: tl.constexpr,
                 MERGED: tl.constexpr, dtype: tl.constexpr):
    """Phase A's weights of `layer` (prefetched): the QKV rows1 / rows2 (lane pairs), N₁'s gain and bias, the
    QKV biases, and layer `before`'s down-projection bias (the residual's). Two column blocks each, or with
    MERGED the width as one block offs_w (CW,) and scalar zeros in the second block's places."""
    wq = _addr(PTRS, layer, W_QKV, dtype)
    if MERGED:
        w1a = _rows1(wq, rows1, r_ok, C, offs_w, w_ok)                     # (PA, CW)
        w2a = _rows1(wq, rows2, r_ok, C, offs_w, w_ok)
        g1a = _vec1(_addr(PTRS, layer, LN1_W, dtype), offs_w, w_ok, True)  # (CW,)
        l1a = _vec1(_addr(PTRS, layer, LN1_B, dtype), offs_w, w_ok, LN_BIAS)
        bpa = _vec1(_addr(PTRS, before, B_DN, dtype), offs_w, w_ok, DN_BIAS)
        w1b = 0.0
        w2b = 0.0
        g1b = 0.0
        l1b = 0.0
        bpb = 0.0
    else:
        w1a, w1b = _rows2(wq, rows1, r_ok, C, offs_a, a_ok, offs_b, b_ok)   # (PA, A), (PA, B)
        w2a, w2b = _rows2(wq, rows2, r_ok, C, offs_a, a_ok, offs_b, b_ok)
        g1a, g1b = _vec2(_addr(PTRS, layer, LN1_W, dtype), offs_a, a_ok, offs_b, b_ok, True)
        l1a, l1b = _vec2(_addr(PTRS, layer, LN1_B, dtype), offs_a, a_ok, offs_b, b_ok, LN_BIAS)
        bpa, bpb = _vec2(_addr(PTRS, before, B_DN, dtype), offs_a, a_ok, offs_b, b_ok, DN_BIAS)
    bq1 = _bias_rows(_addr(PTRS, layer, B_QKV, dtype), rows1, r_ok, QKV_BIAS)
    bq2 = _bias_rows(_addr(PTRS, layer, B_QKV, dtype), rows2, r_ok, QKV_BIAS)
    return w1a, w1b, w2a, w2b, g1a, g1b, l1a, l1b, bq1, bq2, bpa, bpb


@triton.jit
def _phase_qkv(X0, XM, XA, WS, QBUF, KC, VC, cos, sin, layer, pid, pos, eps, stride_ch, stride_cn,
               w1a, w1b, w2a, w2b, g1a, g1b, l1a, l1b, bq1, bq2, bpa, bpb, rows1, rows2, r_ok,
               offs_a, a_ok, offs_b, b_ok, offs_w, w_ok, C: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr,
               HKV: tl.constexpr, RMS: tl.constexpr, ROPE: tl.constexpr, MERGED: tl.constexpr,
               dtype: tl.constexpr):
    """Phase A: the residual stream (kept in XA by program 0), N₁, the QKV rows1/rows2 (lane pairs) with their
    biases bq1/bq2, RoPE (cos, sin of the lanes: 1 and 0 on v's rows), q into QBUF, k and v into the layer's
    cache at pos; program 0 also zeroes Σ_down[layer + 1]. Every weight arrives prefetched (_qkv_weights).
    MERGED: the width as one block offs_w (w1a, w2a (PA, CW), g1a, l1a, bpa (CW,)), N₁'s sums in one reduction
    and both lanes' rows in one two-operand reduction."""
    if MERGED:
        x = _residual(X0, XM, WS, bpa, layer, offs_w, w_ok, C, dtype)        # (CW,) zeros beyond C
        if pid == 0:
            tl.store(XA + offs_w, x.to(dtype), mask=w_ok)
            tl.store(WS + (layer + 1) * C + offs_w, tl.zeros_like(x), mask=w_ok)
        mean, rstd = _stats(x, eps, C, RMS)
        n = _scaled(x, mean, rstd, g1a, l1a, RMS, dtype)                     # (CW,)
        y1, y2 = _gemv_pair(w1a, w2a, n)                                     # (PA,), (PA,)
        y1 = (y1 + bq1).to(dtype).to(tl.float32)                             # lanes i
        y2 = (y2 + bq2).to(dtype).to(tl.float32)                             # lanes i + D/2
    else:
        xa = _residual(X0, XM, WS, bpa, layer, offs_a, a_ok, C, dtype)       # (A,)
        xb = _residual(X0, XM, WS, bpb, layer, offs_b, b_ok, C, dtype)       # (B,)
        if pid == 0:
            tl.store(XA + offs_a, xa.to(dtype), mask=a_ok)
            tl.store(XA + offs_b, xb.to(dtype), mask=b_ok)
            tl.store(WS + (layer + 1) * C + offs_a, tl.zeros_like(xa), mask=a_ok)
            tl.store(WS + (layer + 1) * C + offs_b, tl.zeros_like(xb), mask=b_ok)
        na, nb = _normed(xa, xb, g1a, g1b, l1a, l1b, a_ok, b_ok, eps, C, RMS, dtype)
        y1 = (_gemv(w1a, w1b, na, nb) + bq1).to(dtype).to(tl.float32)        # (PA,) lanes i
        y2 = (_gemv(w2a, w2b, na, nb) + bq2).to(dtype).to(tl.float32)        # (PA,) lanes i + D/2
    N_Q: tl.constexpr = HQ * D
    N_KV: tl.constexpr = HKV * D
    if ROPE:  # rotate-half as eager rounds it: x·cos and rotate_half(x)·sin rounded, then their sum
        r1 = (y1 * cos).to(dtype).to(tl.float32) + (-y2 * sin).to(dtype).to(tl.float32)
        r2 = (y2 * cos).to(dtype).to(tl.float32) + (y1 * sin).to(dtype).to(tl.float32)
        y1 = r1
        y2 = r2
    _store_qkv(y1.to(dtype), rows1, r_ok, QBUF, KC, VC, pos, stride_ch, stride_cn, N_Q, N_KV, D)
    _store_qkv(y2.to(dtype), rows2, r_ok, QBUF, KC, VC, pos, stride_ch, stride_cn, N_Q, N_KV, D)


@triton.jit
def _store_qkv(y, rows, r_ok, QBUF, KC, VC, pos, stride_ch, stride_cn, N_Q: tl.constexpr, N_KV: tl.constexpr,
               D: tl.constexpr):
    """QKV rows `rows` (R,): q into QBUF, k and v into the caches at position pos."""
    tl.store(QBUF + rows, y, mask=r_ok & (rows < N_Q))
    c = tl.where(rows >= N_Q + N_KV, rows - N_Q - N_KV, tl.maximum(rows - N_Q, 0))  # within k or v
    at = (c // D) * stride_ch + pos * stride_cn + c % D                      # (R,)
    tl.store(KC + at, y, mask=r_ok & (rows >= N_Q) & (rows < N_Q + N_KV))
    tl.store(VC + at, y, mask=r_ok & (rows >= N_Q + N_KV))


@triton.jit
def _kv_tile(KC, VC, n, T, d, stride_cn):
    """Keys and values n (BLOCK_N,) of one kv head (rows >= T zero), in the cache's dtype: (BLOCK_N, D) each."""
    n_ok = n < T
    at = n.to(tl.int64)[:, None] * stride_cn + d[None, :]
    k = tl.load(KC + at, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
    v = tl.load(VC + at, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
    return k, v


@triton.jit
def _first_tile(KC, VC, pid, T, S, stride_ch, stride_cn, D: tl.constexpr, HKV: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Phase B's first key tile of program (g, s) (tile s of kv head g), loaded before the barrier: the keys
    cached before this token only (the token's own row, written in phase A of this launch, is added after the
    barrier by _phase_attention)."""
    g = pid // S
    s = pid % S
    n = s * BLOCK_N + tl.arange(0, BLOCK_N)                                  # (BLOCK_N,)
    d = tl.arange(0, D)
    mine = (g < HKV) & (s < tl.cdiv(T, BLOCK_N))
    off = tl.minimum(g, HKV - 1).to(tl.int64) * stride_ch
    return _kv_tile(KC + off, VC + off, tl.where(n * 0 + mine.to(tl.int32) > 0, n, T), T - 1, d, stride_cn)


@triton.jit
def _phase_attention(QBUF, PART, KC, VC, k, v, pid, T, S, qk_scale, stride_ch, stride_cn,
                     D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, GP: tl.constexpr,
                     BLOCK_N: tl.constexpr, MAX_S: tl.constexpr, PRECISION: tl.constexpr, dtype: tl.constexpr):
    """Phase B: program (g, s) attends kv group g's query heads (GP rows, the group's padded to 16 for tl.dot)
    to key tiles s, s + S, ... of the cache (S shares of the T keys) and stores its partial (acc, m, l) per head
    (base-2 logits). QKᵀ and PV on the tensor cores (P as the sum of two dtype terms, so PV keeps about fp32's
    accuracy); the first tile (k, v) came before the barrier without the token's own row, which is added here;
    the next tiles are loaded one tile ahead."""
    G: tl.constexpr = HQ // HKV
    n_tiles = tl.cdiv(T, BLOCK_N)
    g = pid // S
    s = pid % S
    mine = tl.where(g < HKV, (n_tiles - s + S - 1) // S, 0)                  # this program's tiles
    j = tl.arange(0, GP)                                                     # (GP,)
    d = tl.arange(0, D)                                                      # (D,)
    h = g * G + j
    h_ok = (j < G) & (j * 0 + g < HKV)                                       # (GP,) (a tensor & a tensor)
    kc = KC + g.to(tl.int64) * stride_ch
    vc = VC + g.to(tl.int64) * stride_ch
    n = s * BLOCK_N + tl.arange(0, BLOCK_N)                                  # (BLOCK_N,) the first tile
    own = ((n == T - 1) & ((n * 0 + mine) > 0))[:, None]                    # (BLOCK_N, 1) this token's row
    at = (T - 1).to(tl.int64) * stride_cn + d[None, :]                       # (1, D)
    k = tl.where(own, tl.load(kc + at, mask=own, other=0.0, cache_modifier=".cg"), k)  # (BLOCK_N, D)
    v = tl.where(own, tl.load(vc + at, mask=own, other=0.0, cache_modifier=".cg"), v)
    q = tl.load(QBUF + h[:, None] * D + d[None, :], mask=h_ok[:, None], other=0.0,
                cache_modifier=".cg")                                        # (GP, D) dtype
    m = tl.full([GP], float("-inf"), tl.float32)
    l_sum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for it in range(0, mine):
        n_ok = n < T
        nxt = n + S * BLOCK_N
        k_next, v_next = _kv_tile(kc, vc, tl.where(it + 1 < mine, nxt, T), T, d, stride_cn)
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale    # (GP, BLOCK_N), base 2
        sc = tl.where(n_ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        p_hi = p.to(dtype)                                                   # P as two dtype terms: PV
        p_lo = (p - p_hi.to(tl.float32)).to(dtype)                           # to ~fp32 accuracy
        acc = tl.dot(p_hi, v, acc * alpha[:, None], input_precision=PRECISION)  # (GP, D)
        acc = tl.dot(p_lo, v, acc, input_precision=PRECISION)
        m = m_new
        k = k_next
        v = v_next
        n = nxt
    cell = h * MAX_S + s                                                     # (GP,)
    tl.store(PART + cell[:, None] * D + d[None, :], acc, mask=h_ok[:, None])
    tl.store(PART + HQ * MAX_S * D + cell, m, mask=h_ok)
    tl.store(PART + HQ * MAX_S * (D + 1) + cell, l_sum, mask=h_ok)


@triton.jit
def _partials(PART, S, D: tl.constexpr, HQ: tl.constexpr, HP: tl.constexpr, MAX_S: tl.constexpr):
    """Phase C's inputs: every head's S partials (m, l (HP, MAX_S) and acc (HP, MAX_S, D), fp32), loaded at once."""
    h = tl.arange(0, HP)
    s = tl.arange(0, MAX_S)
    d = tl.arange(0, D)
    ok = (h < HQ)[:, None] & (s < S)[None, :]                                # (HP, MAX_S)
    cell = h[:, None] * MAX_S + s[None, :]
    ms = tl.load(PART + HQ * MAX_S * D + cell, mask=ok, other=float("-inf"), cache_modifier=".cg")
    ls = tl.load(PART + HQ * MAX_S * (D + 1) + cell, mask=ok, other=0.0, cache_modifier=".cg")
    ps = tl.load(PART + cell[:, :, None] * D + d[None, None, :], mask=ok[:, :, None], other=0.0,
                 cache_modifier=".cg")                                       # (HP, MAX_S, D)
    return ms, ls, ps


@triton.jit
def _phase_out(res, XM, ms, ls, ps, S, wo, bo, cols, c_ok, D: tl.constexpr, HQ: tl.constexpr, HP: tl.constexpr,
               MAX_S: tl.constexpr, dtype: tl.constexpr):
    """Phase C: every head's S partials (ms, ls, ps from _partials) merged, y rounded, this program's output
    columns of y W_oᵀ + b_o (wo, bo prefetched) rounded, plus the residual, into XM."""
    h = tl.arange(0, HP)
    s = tl.arange(0, MAX_S)
    ok = (h < HQ)[:, None] & (s < S)[None, :]                                # (HP, MAX_S)
    m = tl.max(ms, 1)                                                        # (HP,)
    m = tl.where(h < HQ, m, 0.0)
    w = tl.where(ok, tl.exp2(ms - m[:, None]), 0.0)                          # (HP, MAX_S)
    l_sum = tl.sum(w * ls, 1)
    y = tl.sum(ps * w[:, :, None], 1)                                        # (HP, D)
    y = tl.where((h < HQ)[:, None], y / tl.where(h < HQ, l_sum, 1.0)[:, None], 0.0).to(dtype).to(tl.float32)
    o = tl.sum(tl.sum(wo.to(tl.float32) * y[None, :, :], 2), 1) + bo         # (OC,)
    tl.store(XM + cols, (o.to(dtype).to(tl.float32) + res).to(dtype), mask=c_ok)


@triton.jit
def _phase_mlp(XM, WS, layer, eps, fa, fb, ua, ub, da, db, g2a, g2b, l2a, l2b, bf1, bf2, i_ok,
               offs_a, a_ok, offs_b, b_ok, offs_w, w_ok, C: tl.constexpr, RMS: tl.constexpr,
               SWIGLU: tl.constexpr, MERGED: tl.constexpr, dtype: tl.constexpr):
    """Phase D: N₂(x_mid), this program's intermediate columns h (fc / gate, up biases bf1, bf2), and its share
    h W_downᵀ added into Σ_down[layer + 1]. Every weight arrives prefetched. MERGED: N₂'s sums in one reduction
    over x_mid loaded as one block offs_w (CW,), the gate and up rows of each column block in one two-operand
    reduction, and the down projection's share as one (CW,) block (da (CW, IB): one reduction, one atomic add)."""
    xa = tl.load(XM + offs_a, mask=a_ok, other=0.0, cache_modifier=".cg").to(tl.float32)  # (A,)
    xb = tl.load(XM + offs_b, mask=b_ok, other=0.0, cache_modifier=".cg").to(tl.float32)  # (B,)
    if MERGED:
        xw = tl.load(XM + offs_w, mask=w_ok, other=0.0, cache_modifier=".cg").to(tl.float32)  # (CW,)
        mean, rstd = _stats(xw, eps, C, RMS)
        na = _scaled(xa, mean, rstd, g2a, l2a, RMS, dtype)                   # (A,) zeros beyond C
        nb = _scaled(xb, mean, rstd, g2b, l2b, RMS, dtype)                   # (B,)
        if SWIGLU:
            ya, upa = _gemv_pair(fa, ua, na)                                 # (IB,) each
            yb, upb = _gemv_pair(fb, ub, nb)
            y, up = tl.split(tl.join(ya, upa) + tl.join(yb, upb))            # one layout change for both
            y = (y + bf1).to(dtype).to(tl.float32)                           # gate
            up = (up + bf2).to(dtype).to(tl.float32)
        else:
            y = (_gemv(fa, fb, na, nb) + bf1).to(dtype).to(tl.float32)       # fc
            up = y
    else:
        na, nb = _normed(xa, xb, g2a, g2b, l2a, l2b, a_ok, b_ok, eps, C, RMS, dtype)
        y = (_gemv(fa, fb, na, nb) + bf1).to(dtype).to(tl.float32)           # (IB,) gate / fc
        up = y
        if SWIGLU:
            up = (_gemv(ua, ub, na, nb) + bf2).to(dtype).to(tl.float32)
    if SWIGLU:
        h = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32) * up
    else:  # GELU, tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1), 2z clamped where tanh is 1 anyway
        z = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        h = 0.5 * y * (2.0 - 2.0 / (tl.exp(tl.minimum(2.0 * z, 60.0)) + 1.0))
    h = tl.where(i_ok, h, 0.0).to(dtype).to(tl.float32)                      # (IB,)
    if MERGED:
        pw = tl.sum(da.to(tl.float32) * h[None, :], 1)                       # (CW,)
        tl.atomic_add(WS + (layer + 1) * C + offs_w, pw, mask=w_ok, sem="relaxed")
    else:
        pa = tl.sum(da.to(tl.float32) * h[None, :], 1)                       # (A,)
        pb = tl.sum(db.to(tl.float32) * h[None, :], 1)                       # (B,)
        tl.atomic_add(WS + (layer + 1) * C + offs_a, pa, mask=a_ok, sem="relaxed")
        tl.atomic_add(WS + (layer + 1) * C + offs_b, pb, mask=b_ok, sem="relaxed")


@triton.jit
def _mlp_weights(PTRS, layer, offs_i, i_ok, offs_a, a_ok, offs_b, b_ok, offs_w, w_ok, C: tl.constexpr,
                 I: tl.constexpr, LN_BIAS: tl.constexpr, SWIGLU: tl.constexpr, FC_BIAS: tl.constexpr,
                 MERGED: tl.constexpr, dtype: tl.constexpr):
    """Phase D's weights for this program's intermediate columns offs_i: fc / gate rows, up rows (SwiGLU; else
    the fc rows again), down columns (each over the two column blocks; with MERGED the down columns as one
    block offs_w, da (CW, IB), and a scalar zero for db), N₂'s gain and bias, the fc biases."""
    wf = _addr(PTRS, layer, W_FC, dtype)
    fa, fb = _rows2(wf, offs_i, i_ok, C, offs_a, a_ok, offs_b, b_ok)          # (IB, A), (IB, B)
    ua = fa
    ub = fb
    if SWIGLU:
        ua, ub = _rows2(wf, offs_i + I, i_ok, C, offs_a, a_ok, offs_b, b_ok)
    wd = _addr(PTRS, layer, W_DN, dtype) + offs_i[None, :]
    if MERGED:  # the down columns as one block over the width
        da = tl.load(wd + offs_w.to(tl.int64)[:, None] * I, mask=w_ok[:, None] & i_ok[None, :], other=0.0)  # (CW, IB)
        db = 0.0
    else:
        da = tl.load(wd + offs_a.to(tl.int64)[:, None] * I, mask=a_ok[:, None] & i_ok[None, :], other=0.0)
        db = tl.load(wd + offs_b.to(tl.int64)[:, None] * I, mask=b_ok[:, None] & i_ok[None, :], other=0.0)
    g2a, g2b = _vec2(_addr(PTRS, layer, LN2_W, dtype), offs_a, a_ok, offs_b, b_ok, True)
    l2a, l2b = _vec2(_addr(PTRS, layer, LN2_B, dtype), offs_a, a_ok, offs_b, b_ok, LN_BIAS)
    bf1 = _bias_rows(_addr(PTRS, layer, B_FC, dtype), offs_i, i_ok, FC_BIAS)
    bf2 = _bias_rows(_addr(PTRS, layer, B_FC, dtype), offs_i + I, i_ok, FC_BIAS and SWIGLU)
    return fa, fb, ua, ub, da, db, g2a, g2b, l2a, l2b, bf1, bf2


@triton.jit
def _bias_rows(B, rows, ok, ON: tl.constexpr):
    """bias[rows] fp32 (zeros where not ON)."""
    if ON:
        return tl.load(B + rows, mask=ok, other=0.0).to(tl.float32)
    return tl.zeros(rows.shape, tl.float32)


@triton.jit(do_not_specialize=["layer0", "n_layers"])
def _decode_stack_kernel(PTRS, X0, XM, XA, WS, QBUF, PART, POS, COS, SIN, OUT, BAR, TIMES, LNF_W, LNF_B,
                         layer0, n_layers, eps1, eps2, eps_f, qk_scale, stride_ch, stride_cn, stride_rope,
                         C: tl.constexpr, PART_A: tl.constexpr, PART_B: tl.constexpr, D: tl.constexpr,
                         HQ: tl.constexpr, HKV: tl.constexpr, GP: tl.constexpr, HP: tl.constexpr,
                         I: tl.constexpr, PA: tl.constexpr, OC: tl.constexpr, IB: tl.constexpr,
                         BLOCK_N: tl.constexpr, MAX_S: tl.constexpr, RMS: tl.constexpr, LN_BIAS: tl.constexpr,
                         SWIGLU: tl.constexpr, ROPE: tl.constexpr, QKV_BIAS: tl.constexpr,
                         O_BIAS: tl.constexpr, FC_BIAS: tl.constexpr, DN_BIAS: tl.constexpr,
                         PRECISION: tl.constexpr, MLP_AT: tl.constexpr, FINAL: tl.constexpr, PHASE: tl.constexpr,
                         TIMELINE: tl.constexpr, ONE_POLLER: tl.constexpr, CW: tl.constexpr, MERGED: tl.constexpr):
    """grid = (programs,), one per SM: layers layer0 .. layer0 + n_layers - 1 of a one-token decode step.

    PHASE -1: every phase of every layer and the output, with grid barriers between phases (all programs must
    be resident); PHASE 0..3: only that phase (A, B, C, D) of one layer, 4: only the output (one launch each,
    the launches in order make the barriers). Buffers: X0 (C,) the embedding; XM, XA (C,) the residual stream
    after attention and entering the layer; WS (L + 1, C) fp32 down-projection sums; QBUF (HQ·D,); PART
    (HQ, MAX_S, D + 2) fp32 partials; BAR (2,) int32 zeros before and after a launch. FINAL: the output is the
    final norm (gain LNF_W, bias LNF_B where LN_BIAS, eps_f) of the last residual stream.
    At each barrier a program arrives, loads the next phase's weights, then waits; MLP_AT 1: phase D's weights
    load after phase A (they stream in during attention), 2: after phase B, 3: after phase C (PHASE >= 0: 3).
    TIMELINE (PHASE -1 only):
    TIMES (programs, 1024, 8) int64 receives the global timer at each phase's end (k = 1, 3, 5, 7 for A, B, C,
    D) and after each wait (k = 0 before A, 2, 4, 6), per program and layer. ONE_POLLER: only warp 0 polls
    the barrier counter (_wait). MERGED (CW the width's power of two): phases A and D take their norm's sums in
    one reduction over the width as one block, phase A its QKV rows as one (PA, CW) block per lane half with both
    halves in one two-operand reduction, phase D its gate and up rows in one (_phase_qkv, _phase_mlp).
    """
    dtype: tl.constexpr = X0.dtype.element_ty
    ALL: tl.constexpr = PHASE < 0
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    pos = tl.load(POS).to(tl.int64)                                          # the token's position
    T = pos.to(tl.int32) + 1                                                 # keys in the cache after it
    S = tl.minimum(tl.cdiv(T, BLOCK_N), MAX_S)                               # key shares per kv group
    offs_a = tl.arange(0, PART_A)
    offs_b = PART_A + tl.arange(0, PART_B)
    a_ok = offs_a < C
    b_ok = offs_b < C
    offs_w = tl.arange(0, CW)                                                # (CW,) the width as one block
    w_ok = offs_w < C
    # this program's rows and columns in each phase (fixed across layers)
    PAIRS: tl.constexpr = D // 2 // PA                                       # lane-pair blocks per head
    rows1 = (pid // PAIRS) * D + (pid % PAIRS) * PA + tl.arange(0, PA)       # (PA,) lanes i of a head
    rows2 = rows1 + D // 2                                                   # lanes i + D/2
    r_ok = rows1 < (HQ + 2 * HKV) * D
    cols = pid * OC + tl.arange(0, OC)                                       # (OC,) phase C's output columns
    c_ok = cols < C
    offs_i = pid * IB + tl.arange(0, IB)                                     # (IB,) phase D's h columns
    i_ok = offs_i < I
    h3 = tl.arange(0, HP)
    d3 = tl.arange(0, D)
    o_at = cols[:, None, None] * (HQ * D) + h3[None, :, None] * D + d3[None, None, :]  # (OC, HP, D)
    o_ok = c_ok[:, None, None] & (h3 < HQ)[None, :, None]
    if ROPE:  # the token's RoPE angles for this program's lanes, once (q and k heads; v's rows keep 1 and 0)
        lane = rows1 % D                                                     # (PA,) < D / 2
        turn = r_ok & (rows1 < (HQ + HKV) * D)
        cos = tl.load(COS + pos * stride_rope + lane, mask=turn, other=1.0).to(tl.float32)
        sin = tl.load(SIN + pos * stride_rope + lane, mask=turn, other=0.0).to(tl.float32)
    else:
        cos = tl.full([PA], 1.0, tl.float32)
        sin = tl.zeros([PA], tl.float32)
    epoch = 0
    if ALL or PHASE == 0:  # phase A's prefetch for the first layer: weights, norm, biases, the bias before
        layer = layer0
        w1a, w1b, w2a, w2b, g1a, g1b, l1a, l1b, bq1, bq2, bpa, bpb = _qkv_weights(
            PTRS, layer, tl.maximum(layer - 1, 0), rows1, rows2, r_ok, offs_a, a_ok, offs_b, b_ok, offs_w, w_ok,
            C, LN_BIAS, QKV_BIAS, DN_BIAS, MERGED, dtype)
    for layer in range(layer0, layer0 + n_layers):
        KC = _addr(PTRS, layer, K_CACHE, dtype)
        VC = _addr(PTRS, layer, V_CACHE, dtype)
        if ALL:
            if layer > layer0:
                epoch += 1
                _wait(BAR, epoch * nprog, ONE_POLLER)                        # the layer before is done
            _stamp(TIMES, pid, layer, 0, TIMELINE)
        if ALL or PHASE == 0:
            _phase_qkv(X0, XM, XA, WS, QBUF, KC, VC, cos, sin, layer, pid, pos, eps1, stride_ch, stride_cn,
                       w1a, w1b, w2a, w2b, g1a, g1b, l1a, l1b, bq1, bq2, bpa, bpb, rows1, rows2,
                       r_ok, offs_a, a_ok, offs_b, b_ok, offs_w, w_ok, C, D, HQ, HKV, RMS, ROPE, MERGED, dtype)
        if ALL:
            _stamp(TIMES, pid, layer, 1, TIMELINE)
            _arrive(BAR)
        if ALL or PHASE == 2:
            wo = tl.load(_addr(PTRS, layer, W_O, dtype) + o_at, mask=o_ok, other=0.0)  # (OC, HP, D)
            bo = _bias_rows(_addr(PTRS, layer, B_O, dtype), cols, c_ok, O_BIAS)
        if ALL or PHASE == 1:  # attention's first key tile, without the row phase A is writing
            k0, v0 = _first_tile(KC, VC, pid, T, S, stride_ch, stride_cn, D, HKV, BLOCK_N)
        if MLP_AT == 1:  # the MLP's weights stream in during attention (SMs without work in phase B wait)
            fa, fb, ua, ub, da, db, g2a, g2b, l2a, l2b, bf1, bf2 = _mlp_weights(
                PTRS, layer, offs_i, i_ok, offs_a, a_ok, offs_b, b_ok, offs_w, w_ok, C, I, LN_BIAS, SWIGLU, FC_BIAS,
                MERGED, dtype)
        if ALL:
            epoch += 1
            _wait(BAR, epoch * nprog, ONE_POLLER)                            # q, k, v written
            _stamp(TIMES, pid, layer, 2, TIMELINE)
        if ALL or PHASE == 2:  # phase C's residual (program 0 wrote it in phase A) loads during attention
            res = tl.load(XA + cols, mask=c_ok, other=0.0, cache_modifier=".cg").to(tl.float32)  # (OC,)
        if ALL or PHASE == 1:
            _phase_attention(QBUF, PART, KC, VC, k0, v0, pid, T, S, qk_scale, stride_ch, stride_cn, D, HQ, HKV, GP,
                             BLOCK_N, MAX_S, PRECISION, dtype)
        if ALL:
            _stamp(TIMES, pid, layer, 3, TIMELINE)
            _arrive(BAR)
            if MLP_AT == 2:  # the MLP's weights stream in during this barrier and phase C
                fa, fb, ua, ub, da, db, g2a, g2b, l2a, l2b, bf1, bf2 = _mlp_weights(
                    PTRS, layer, offs_i, i_ok, offs_a, a_ok, offs_b, b_ok, offs_w, w_ok, C, I, LN_BIAS, SWIGLU,
                    FC_BIAS, MERGED, dtype)
            epoch += 1
            _wait(BAR, epoch * nprog, ONE_POLLER)                            # partials written
            _stamp(TIMES, pid, layer, 4, TIMELINE)
        if ALL or PHASE == 2:
            ms, ls, ps = _partials(PART, S, D, HQ, HP, MAX_S)
            _phase_out(res, XM, ms, ls, ps, S, wo, bo, cols, c_ok, D, HQ, HP, MAX_S, dtype)
        if ALL:
            _stamp(TIMES, pid, layer, 5, TIMELINE)
            _arrive(BAR)
        if ALL or PHASE == 3:
            if MLP_AT == 3:
                fa, fb, ua, ub, da, db, g2a, g2b, l2a, l2b, bf1, bf2 = _mlp_weights(
                    PTRS, layer, offs_i, i_ok, offs_a, a_ok, offs_b, b_ok, offs_w, w_ok, C, I, LN_BIAS, SWIGLU,
                    FC_BIAS, MERGED, dtype)
            if ALL:
                epoch += 1
                _wait(BAR, epoch * nprog, ONE_POLLER)                        # x_mid written
                _stamp(TIMES, pid, layer, 6, TIMELINE)
            _phase_mlp(XM, WS, layer, eps2, fa, fb, ua, ub, da, db, g2a, g2b, l2a, l2b, bf1, bf2, i_ok,
                       offs_a, a_ok, offs_b, b_ok, offs_w, w_ok, C, RMS, SWIGLU, MERGED, dtype)
        if ALL:
            _stamp(TIMES, pid, layer, 7, TIMELINE)
            _arrive(BAR)
            # the next layer's phase A prefetch (the last layer: a harmless reload of its own rows)
            nl = tl.minimum(layer + 1, layer0 + n_layers - 1)
            w1a, w1b, w2a, w2b, g1a, g1b, l1a, l1b, bq1, bq2, bpa, bpb = _qkv_weights(
                PTRS, nl, layer, rows1, rows2, r_ok, offs_a, a_ok, offs_b, b_ok, offs_w, w_ok,
                C, LN_BIAS, QKV_BIAS, DN_BIAS, MERGED, dtype)
    if ALL or PHASE == 4:
        last = layer0 + n_layers
        bpa, bpb = _vec2(_addr(PTRS, last - 1, B_DN, dtype), offs_a, a_ok, offs_b, b_ok, DN_BIAS)
        gfa, gfb = _vec2(LNF_W, offs_a, a_ok, offs_b, b_ok, FINAL)
        lfa, lfb = _vec2(LNF_B, offs_a, a_ok, offs_b, b_ok, FINAL and LN_BIAS)
        if ALL:
            epoch += 1
            _wait(BAR, epoch * nprog, ONE_POLLER)                            # the last Σ_down complete
        if pid == 0:
            xa = _residual(X0, XM, WS, bpa, last, offs_a, a_ok, C, dtype)
            xb = _residual(X0, XM, WS, bpb, last, offs_b, b_ok, C, dtype)
            if FINAL:  # the model's final norm, as eager rounds it
                xa, xb = _normed(xa, xb, gfa, gfb, lfa, lfb, a_ok, b_ok, eps_f, C, RMS, dtype)
            tl.store(OUT + offs_a, xa.to(dtype), mask=a_ok)
            tl.store(OUT + offs_b, xb.to(dtype), mask=b_ok)
        if ALL:  # the last program to leave resets the counters for the next launch
            if tl.atomic_add(BAR + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
                tl.atomic_xchg(BAR, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(BAR + 1, 0, sem="relaxed", scope="gpu")


_triton.check_decorated(_decode_stack_kernel)


def _pow2_at_least(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(n))


class StackPlan:
    """What decode_stack needs of a model, built once: the table of each layer's addresses, the shape
    constants and the step's buffers (fixed addresses, so a CUDA graph can hold them).

    layers: per layer a dict with w_qkv (Nqkv, C), b_qkv, ln1 (weight, bias or None, eps), w_o (C, Hq·D),
    b_o, ln2, w_fc ((2)I, C), b_fc, w_down (C, I), b_down, k_cache, v_cache ((B', Hkv, max_len, D));
    absent biases None. n_head, n_kv_head, head_dim; rms, swiglu, rope (bool): the model's kinds.
    programs: the grid (default the SM count; the interpreter's 4 would leave blocks unassigned, so tests pass
    what their shape needs).
    """

    def __init__(self, layers: list[dict], *, n_head: int, n_kv_head: int, head_dim: int, rms: bool,
                 swiglu: bool, rope: bool, programs: int | None = None):
        if not layers:
            raise ValueError("decode_stack: no layers")
        first = layers[0]
        w = first["w_qkv"]
        dtype, device = w.dtype, w.device
        C = w.shape[1]
        I = first["w_down"].shape[1]
        D, HQ, HKV = head_dim, n_head, n_kv_head
        self.programs = programs or _triton.sm_count(device)
        why = fits(C, I, D, HQ, HKV, dtype, self.programs)
        if why:
            raise ValueError(f"decode_stack: {why}")
        self.C, self.I, self.D, self.HQ, self.HKV = C, I, D, HQ, HKV
        self.rms, self.swiglu, self.rope = bool(rms), bool(swiglu), bool(rope)
        self.dtype, self.device, self.n_layers = dtype, device, len(layers)
        self.blocks = _blocks(C, I, D, HQ, HKV, self.programs)
        # phase B's HKV x splits programs fit the grid; a power of two (phase C loads every partial as one tile)
        self.max_splits = min(MAX_SPLITS, 1 << ((self.programs // HKV).bit_length() - 1))
        shapes = {"w_qkv": ((HQ + 2 * HKV) * D, C), "w_o": (C, HQ * D), "w_fc": ((2 * I if swiglu else I), C),
                  "w_down": (C, I)}
        biases = {"b_qkv": shapes["w_qkv"][0], "b_o": C, "b_fc": shapes["w_fc"][0], "b_down": C}
        k0 = first["k_cache"]
        self.eps = (float(first["ln1"][2]), float(first["ln2"][2]))
        self.has = {b: first[b] is not None for b in biases}
        self.ln_bias = first["ln1"][1] is not None
        rows = []
        for i, lay in enumerate(layers):
            for name, shape in shapes.items():
                t = lay[name]
                if tuple(t.shape) != shape or not t.is_contiguous():
                    raise ValueError(f"decode_stack: layer {i} {name} must be a contiguous {shape}, got "
                                     f"{tuple(t.shape)}")
            for name, n in biases.items():
                t = lay[name]
                if (t is not None) != self.has[name] or (t is not None and tuple(t.shape) != (n,)):
                    raise ValueError(f"decode_stack: layer {i} {name} must be ({n},) in every layer or none")
            for name in ("ln1", "ln2"):
                g, b, eps = lay[name]
                if (tuple(g.shape) != (C,) or (b is not None) != self.ln_bias or (b is not None and tuple(b.shape) != (C,))
                        or float(eps) != self.eps[name == "ln2"] or (self.rms and b is not None)):
                    raise ValueError(f"decode_stack: layer {i} {name}: a ({C},) gain, the same bias use and eps "
                                     "in every layer (RMSNorm: no bias)")
            kc, vc = lay["k_cache"], lay["v_cache"]
            if (kc.dim() != 4 or kc.shape != k0.shape or kc.stride() != k0.stride() or vc.shape != kc.shape
                    or vc.stride() != kc.stride() or kc.shape[1] != HKV or kc.shape[3] != D or kc.stride(3) != 1):
                raise ValueError(f"decode_stack: layer {i} caches must be (B', {HKV}, max_len, {D}) with unit "
                                 "stride along D, the same shape and strides in every layer")
            row = []
            for t in _table_tensors(lay):
                if t is None:
                    row.append(0)
                    continue
                if t.dtype != dtype or t.device != device:
                    raise ValueError(f"decode_stack: layer {i}: every weight and cache must be {dtype} on {device}")
                if t.data_ptr() % 16:
                    raise ValueError(f"decode_stack: layer {i}: a tensor's address is not 16-byte aligned")
                row.append(t.data_ptr())
            rows.append(row)
        self.addresses = rows
        self.ptrs = torch.tensor(rows, dtype=torch.int64, device=device)      # (L, N_PTRS)
        self.max_len = k0.shape[2]
        self.stride_ch, self.stride_cn = k0.stride(1), k0.stride(2)
        L, ws_dtype = self.n_layers, torch.float32
        self.ws = torch.zeros(L + 1, C, dtype=ws_dtype, device=device)        # row 0 stays zero
        self.xm = torch.zeros(C, dtype=dtype, device=device)
        self.xa = torch.zeros(C, dtype=dtype, device=device)
        self.qbuf = torch.zeros(HQ * D, dtype=dtype, device=device)
        self.part = torch.zeros(HQ * self.max_splits * (D + 2), dtype=torch.float32, device=device)
        self.bar = torch.zeros(2, dtype=torch.int32, device=device)
        self.keep = layers  # the tensors whose addresses the table holds stay alive with the plan

    def same_tensors(self, layers: list[dict]) -> bool:
        """Whether `layers` still has the tensors (addresses) this plan was built from."""
        if len(layers) != self.n_layers:
            return False
        return all([0 if t is None else t.data_ptr() for t in _table_tensors(lay)] == row
                   for row, lay in zip(self.addresses, layers))


def _table_tensors(lay: dict) -> list:
    """A layer's tensors in the address table's column order (TABLE; None for an absent bias)."""
    ln1, ln2 = lay["ln1"], lay["ln2"]
    by_name = dict(lay, ln1_w=ln1[0], ln1_b=ln1[1], ln2_w=ln2[0], ln2_b=ln2[1])
    return [by_name[name] for name in TABLE]


def _blocks(C: int, I: int, D: int, HQ: int, HKV: int, programs: int) -> dict:
    """Each phase's tile: the fewest rows / columns per program (powers of two) whose blocks fit the grid."""
    pa = 1
    while (HQ + 2 * HKV) * (D // 2) // pa > programs and pa < D // 2:
        pa *= 2
    oc = 1
    while triton.cdiv(C, oc) > programs:
        oc *= 2
    ib = 1
    while triton.cdiv(I, ib) > programs:
        ib *= 2
    return {"PA": pa, "OC": oc, "IB": ib}


def fits(C: int, I: int, D: int, HQ: int, HKV: int, dtype: torch.dtype, programs: int) -> str | None:
    """Why decode_stack cannot take this shape on `programs` programs, or None."""
    if dtype not in _triton.SUPPORTED_DTYPES:
        return f"dtype {dtype}"
    if not 1 <= C <= MAX_C:
        return f"width {C} above {MAX_C}"
    if D & (D - 1) or not 16 <= D <= 128:
        return f"head dim {D} (a power of two 16..128)"
    if HKV < 1 or HQ % HKV:
        return f"{HQ} query heads not a multiple of {HKV} kv heads"
    if HKV > programs:
        return f"{HKV} kv heads above {programs} programs"
    b = _blocks(C, I, D, HQ, HKV, programs)
    if (HQ + 2 * HKV) * (D // 2) // b["PA"] > programs:
        return f"{HQ + 2 * HKV} heads of QKV rows above one program per SM"
    if b["IB"] > 64 or b["OC"] > 64:
        return f"an intermediate width {I} or width {C} needing more than 64 columns per program"
    return None


def decode_stack(plan: StackPlan, x: torch.Tensor, pos: torch.Tensor, rope: tuple | None = None, *,
                 final_norm: tuple | None = None, phase_by_phase: bool | None = None,
                 timeline: torch.Tensor | None = None) -> torch.Tensor:
    """x (1, C) the embedded token at position pos ((1,) int tensor, on the device) → (1, C) the residual
    stream after the plan's last layer (a new tensor), or with final_norm (weight, bias or None, eps) of the
    plan's norm kind that norm of it; writes the token's k and v into every layer's cache.

    rope: (cos, sin) tables (L, D) in x's dtype, unit stride along D, row p the angles of position p
    (plan.rope models). phase_by_phase: one launch per phase instead of one for everything (default: in
    Triton's interpreter only). timeline: an int64 (programs, 1024, 8) tensor that receives each program's
    global-timer stamps around every phase and barrier (the one-launch form on a GPU only; bench/stack_timeline.py).
    """
    if x.dim() != 2 or tuple(x.shape) != (1, plan.C) or x.dtype != plan.dtype or x.device != plan.device \
            or not x.is_contiguous():
        raise ValueError(f"decode_stack: x must be a contiguous (1, {plan.C}) {plan.dtype} tensor on {plan.device}")
    if (not isinstance(pos, torch.Tensor) or pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64)
            or pos.device != x.device):
        raise ValueError(f"decode_stack: pos must be a one-element int tensor on {x.device}")
    if plan.rope != (rope is not None):
        raise ValueError("decode_stack: rope tables are needed exactly for a RoPE model")
    if rope is not None:
        cos, sin = rope
        if (cos.dim() != 2 or cos.shape[1] != plan.D or cos.dtype != x.dtype or cos.device != x.device
                or cos.stride(1) != 1 or sin.shape != cos.shape or sin.stride() != cos.stride()
                or sin.dtype != x.dtype):
            raise ValueError(f"decode_stack: rope must be (cos, sin), each (L, {plan.D}) {x.dtype} with unit "
                             "stride along D")
    if final_norm is not None:
        g, b, _ = final_norm
        if (tuple(g.shape) != (plan.C,) or g.dtype != x.dtype or g.device != x.device or not g.is_contiguous()
                or (b is not None) != plan.ln_bias or (b is not None and (b.shape != g.shape or b.dtype != g.dtype
                                                                           or not b.is_contiguous()))):
            raise ValueError(f"decode_stack: final_norm must be a contiguous ({plan.C},) {x.dtype} gain with a bias "
                             "exactly where the layers' norms have one")
    _triton.check_device(x.device, "decode_stack")
    if phase_by_phase is None:
        phase_by_phase = _triton.INTERPRET
    if timeline is not None and (phase_by_phase or timeline.dtype != torch.int64 or timeline.device != x.device
                                 or tuple(timeline.shape) != (plan.programs, 1024, 8) or plan.n_layers > 1024):
        raise ValueError(f"decode_stack: timeline must be an int64 ({plan.programs}, 1024, 8) tensor on {x.device}, "
                         "with the one-launch form")
    out = _triton.empty((1, plan.C), x.dtype, x.device)
    cos, sin = rope if rope is not None else (x, x)
    pa, pb = _parts(plan.C)
    consts = dict(C=plan.C, PART_A=pa, PART_B=pb, D=plan.D, HQ=plan.HQ, HKV=plan.HKV,
                  GP=_pow2_at_least(plan.HQ // plan.HKV, 16), HP=_pow2_at_least(plan.HQ), I=plan.I,
                  BLOCK_N=BLOCK_N, MAX_S=plan.max_splits, RMS=plan.rms, LN_BIAS=plan.ln_bias, SWIGLU=plan.swiglu,
                  ROPE=plan.rope, QKV_BIAS=plan.has["b_qkv"], O_BIAS=plan.has["b_o"],
                  FC_BIAS=plan.has["b_fc"], DN_BIAS=plan.has["b_down"], **plan.blocks)
    _mlp_at = MLP_POINTS[MLP_AFTER]
    consts["PRECISION"] = "ieee" if plan.dtype == torch.float32 else "tf32"  # fp32 models: exact dots
    qk_scale = _triton.LOG2E / math.sqrt(plan.D)
    gf, bf, eps_f = final_norm if final_norm is not None else (x, None, 0.0)
    args = (plan.ptrs, x, plan.xm, plan.xa, plan.ws, plan.qbuf, plan.part, pos, cos, sin, out, plan.bar,
            timeline if timeline is not None else plan.bar, gf, bf if bf is not None else gf)
    consts["FINAL"] = final_norm is not None
    consts["CW"] = triton.next_power_of_2(plan.C)
    consts["MERGED"] = _options.get().decode_stack_merged_sums and plan.C <= MERGED_MAX_C

    scal = (plan.eps[0], plan.eps[1], float(eps_f), qk_scale, plan.stride_ch, plan.stride_cn, cos.stride(0))
    grid = (plan.programs,)
    with _triton.device_guard(x):
        if not phase_by_phase:
            _decode_stack_kernel[grid](*args, 0, plan.n_layers, *scal, **consts, MLP_AT=_mlp_at, PHASE=-1,
                                       TIMELINE=timeline is not None, ONE_POLLER=ONE_POLLER, num_warps=WARPS,
                                       num_stages=1)
            return out
        for layer in range(plan.n_layers):
            for phase in range(4):
                _decode_stack_kernel[grid](*args, layer, 1, *scal, **consts, MLP_AT=3, PHASE=phase, TIMELINE=False,
                                           ONE_POLLER=False, num_warps=WARPS,
                                           num_stages=1)
        _decode_stack_kernel[grid](*args, plan.n_layers, 0, *scal, **consts, MLP_AT=3, PHASE=4, TIMELINE=False,
                                   ONE_POLLER=False, num_warps=WARPS,
                                   num_stages=1)
    return out


__all__ = ["StackPlan", "decode_stack", "fits", "mlp_weights_after", "every_warp_polls", "MAX_C", "MAX_SPLITS"]
