"""FlashAttention (the FA2 algorithm) in Triton: forward and backward.

    flash_attention(q, k, v, *, causal=True, sm_scale=None) -> (B, Hq, Nq, D)
    flash_attention_qkvpacked(qkv, n_head, n_kv_head, *, causal=True, sm_scale=None) -> (B, Hq, N, D)

Same semantics as ``kernels.naive.naive_attention`` (the reference and test oracle):

* q is (B, Hq, Nq, D); k and v are (B, Hkv, Nk, D); Hq must be a multiple of Hkv (grouped-query and
  multi-query attention: query head h reads key/value head h // (Hq // Hkv)). Any strides (transposed
  views, expanded heads): the kernels index through the strides, nothing is copied.
* ``sm_scale`` defaults to 1/sqrt(D); it must be a finite number > 0.
* ``causal=True`` is aligned bottom-right: query i sees keys j <= i + (Nk - Nq). With Nq < Nk this is what a
  KV cache or chunked prefill needs. With Nq > Nk the first Nq - Nk query rows see no key at all: those rows
  are defined to be **zero** in the output, and they give **zero** gradients (no NaN anywhere).
* The result has q's dtype and is differentiable in q, k and v.
* The packed form takes one projection qkv (B, N, (Hq + 2·Hkv)·D) — what a fused QKV matmul gives — and runs
  the same kernels on its views (``kernels.naive.split_qkv``); its backward writes dQ, dK, dV straight into
  one d(qkv) buffer, so a model's gradient needs no concatenation copy.

Supported, forward and backward (anything else raises ValueError before any launch):

* dtypes: float16, bfloat16, float32 (q, k, v the same). Accumulation is always float32: S = QKᵀ, the online
  softmax statistics and O (and in the backward dP, dS, dQ, dK, dV) are float32 in registers; P and dS are
  rounded to the input dtype before they enter the second matmul of each pair, exactly as the naive reference
  rounds P to q's dtype. float32 inputs use ``input_precision="ieee"`` dots (true fp32, no TF32) so that the
  kernel matches float32 PyTorch (whose matmuls do not use TF32 by default); that path is for accuracy, not
  speed — train in bf16/fp16.
* head dims 1 <= D <= 256. D is padded to the constexpr BLOCK_D = max(16, next power of two) with masked loads
  and stores, so 48, 80, 96 (and 8 or 200) work; the padding lanes are zeros and never written back.
* any lengths Nq, Nk >= 1: the sequence tails are handled with masked loads/stores; nothing needs to be a
  multiple of a block size.
* causal and non-causal masks, both in the forward and in the backward.
* tensors on a CUDA device, or on the CPU through Triton's interpreter (TRITON_INTERPRET=1; set automatically at
  import when no CUDA device exists; bf16 is wrong in the interpreter because its dots run numpy matmul on raw
  bits — test bf16 on a GPU).

Algorithm (memory is linear in the sequence length; no Nq x Nk tensor exists anywhere, S and P live in
registers tile by tile):

* forward: one program per (BLOCK_M query rows, batch, query head). The Q tile stays on chip; K and V stream
  through in BLOCK_N-row blocks; the softmax is online (running max m, running sum l, running output acc, all
  rescaled by exp(m_old - m_new) when the max grows), in base 2 with the scale folded into one multiply. With a
  causal mask the key blocks come in three kinds: fully visible ones (the unmasked loop), the blocks crossing
  the diagonal (a separate masked loop) and fully hidden ones (skipped: never loaded). The forward saves only O
  and the per-row log-sum-exp (base 2, scaled; +inf for rows that see no key).
* backward: a dQ kernel with one program per (BLOCK_M queries, batch, query head) looping over the key blocks,
  which also stores each row's delta = rowsum(dO * O) (computed from tiles it loads anyway); then a dK/dV
  kernel with one program per (BLOCK_N keys, batch, kv head) that loops over the query heads of its group and
  over the query blocks, recomputing P = exp2(S * scale - lse) tile by tile (so GQA needs no atomics and the
  result is deterministic). Both skip hidden causal blocks and mask only the diagonal ones.
  ``FLASHGPT_BWD=fused`` (an option, measured slower at GPT-2's shape: bench/results/fused_bwd/) runs the
  FA2/cuDNN structure instead: a pass storing delta and zeroing an fp32 dQ accumulator, the same dK/dV kernel
  also adding each tile's dS K into it (5 matmuls per pair of tiles instead of 7) — one TMA reduce-add per tile
  on Hopper with Triton's descriptor reductions, element atomic adds elsewhere and in the interpreter
  (``FLASHGPT_FUSED_DQ=1`` forces those) — and a pass writing dQ; its dQ then varies in the last bits from run
  to run.

Loads: the dK/dV kernel, from head dim 128 (padded) on Hopper or newer, when every row stride and head start is
a multiple of 16 bytes and D is contiguous, reads Q/dO through TMA tensor descriptors built on the device (they
fill zeros past the sequence end and the head dim, so those loads need no masks); otherwise, and always with
``FLASHGPT_TMA=0``, through masked pointer loads. The forward and dQ kernels have the same descriptor path for
K/V, off by default on the GPU (measured slower, see TMA_MIN_BLOCK_D). The interpreter runs the descriptor path
of every kernel at every head dim (so CI tests both). Causal grids: where one L2-sized group holds at least 8
(batch, head) pairs, a 1-D grid in longest-first order (``_lpt_tile``), else (blocks, heads, batch) with the
heaviest blocks of each head first; ``FLASHGPT_LPT=0`` forces the latter.

Tile shapes: on a GPU each kernel is autotuned (``triton.autotune``) over a short list of configs per head dim
and dtype, keyed on (head dim, causal, power-of-two buckets of Nq and Nk, dtypes). ``FLASHGPT_AUTOTUNE=0``
turns that off and takes the first config of each list. The interpreter always uses one
small config. Eager calls go through a thin ``torch.autograd.Function``; under ``torch.compile`` the same
launches are the custom ops ``flashgpt::flash_attn_fwd`` / ``flashgpt::flash_attn_bwd`` (and the packed
``flash_attn_qkvpacked_*``), with fake (meta) implementations and an autograd formula (register_autograd), so
``torch.compile(fullgraph=True)`` traces through them without a graph break. Repeated launches with the same
argument signature call Triton's compiled kernel directly (``_run``). Double backward (a gradient of the
gradient) is not supported: it raises a RuntimeError.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # Triton reads TRITON_INTERPRET when it decorates a kernel, so this works even if triton was imported
    # already; the check after the kernels below makes sure it took effect.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .naive import check_qkv, split_qkv  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)

_CFG_FWD = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               lo, hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Stream key/value blocks [lo, hi) through the online softmax of one query tile.

    MASKED=False: every key of every block is visible (no bounds or causal checks at all).
    MASKED=True: blocks that cross the causal diagonal or the Nk tail; hidden scores become -inf.
    TMA: k_base, v_base are tensor descriptors over this head's (Nk, HEAD_DIM) (the loads fill zeros past
    either end); otherwise pointers, loaded with masks.
    """
    d_ok = offs_d < HEAD_DIM  # (BLOCK_D,) padding lanes of a non-power-of-two head dim
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,) key indices
        if TMA:
            kT = tl.trans(k_base.load([start_n, 0]))  # (BLOCK_D, BLOCK_N)
        else:
            kT_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd  # (BLOCK_D, BLOCK_N)
            if MASKED:
                kT = tl.load(kT_ptrs, mask=d_ok[:, None] & (cols[None, :] < Nk), other=0.0)
            elif BLOCK_D != HEAD_DIM:
                kT = tl.load(kT_ptrs, mask=d_ok[:, None], other=0.0)
            else:
                kT = tl.load(kT_ptrs)
        qk = tl.dot(q, kT, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32, unscaled
        if MASKED:
            visible = cols[None, :] < Nk  # (1, BLOCK_N)
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + offset)  # (BLOCK_M, BLOCK_N)
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # (BLOCK_M,)
            # a row that has seen no key yet keeps m = -inf: subtract 0 instead so exp2 gives 0, not NaN
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_sub[:, None])  # (BLOCK_M, BLOCK_N)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # qk_scale > 0
            m_sub = m_new
            p = tl.math.exp2(qk * qk_scale - m_sub[:, None])  # (BLOCK_M, BLOCK_N)
        alpha = tl.math.exp2(m_i - m_sub)  # (BLOCK_M,) rescales the old statistics; 0 on the first block
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if TMA:
            v = v_base.load([start_n, 0])  # (BLOCK_N, BLOCK_D)
        else:
            v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd  # (BLOCK_N, BLOCK_D)
            if MASKED:
                v = tl.load(v_ptrs, mask=d_ok[None, :] & (cols[:, None] < Nk), other=0.0)
            elif BLOCK_D != HEAD_DIM:
                v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_D)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _lpt_tile(n_blocks, heads, lpt_group, HEAVY_LAST: tl.constexpr):
    """Causal masks make tiles unequal (the work of a block grows with its distance from the top-left corner).
    With a 1-D grid of n_blocks x heads x batch programs this returns (block, head, batch) in longest-first
    order: the (batch, head) pairs are taken in groups of lpt_group (sized on the host so that one group's
    K/V, or Q/dO, stays in L2); within a group all heads' heaviest blocks come first, then the next level.
    The hardware starts programs in grid order, so the short ones fill the tail instead of a long one
    starting last. HEAVY_LAST: the heaviest block is the last one (query blocks), else the first (key blocks).
    """
    pid = tl.program_id(0)
    per_group = lpt_group * n_blocks
    g = pid // per_group
    r = pid - g * per_group
    total = tl.num_programs(0) // n_blocks  # batch x heads
    g_heads = tl.minimum(lpt_group, total - g * lpt_group)  # the last group may be smaller
    level = r // g_heads  # 0 = heaviest
    hb = g * lpt_group + (r - level * g_heads)
    if HEAVY_LAST:
        block = n_blocks - 1 - level
    else:
        block = level
    return block, hb % heads, hb // heads


@triton.jit
def _query_tile(Nq, Hq, lpt_group, CAUSAL: tl.constexpr, LPT: tl.constexpr, BLOCK_M: tl.constexpr):
    """(query block, head, batch) of this program in the forward and dQ grids.

    Grid (cdiv(Nq, BLOCK_M), Hq, B): axis 0 fastest, so the query blocks of one head run side by side and share
    its K/V in L2; causal: the blocks at the bottom see the most keys, so they go first. LPT (causal): a 1-D
    grid in longest-first order across heads instead (_lpt_tile).
    """
    if LPT:
        pid_m, h, b = _lpt_tile(tl.cdiv(Nq, BLOCK_M), Hq, lpt_group, True)
    else:
        pid_m = tl.program_id(0)
        if CAUSAL:
            pid_m = tl.num_programs(0) - 1 - pid_m
        h = tl.program_id(1)
        b = tl.program_id(2)
    return pid_m, h, b


# Scalars are not specialised (no ==1 / %16 variants): one compiled kernel serves every length and head count.
@triton.jit(do_not_specialize=["Hq", "GROUP", "Nq", "Nk", "offset", "lpt_group", "q_bucket", "k_bucket"])
def _attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              Hq, GROUP, Nq, Nk, offset, qk_scale, lpt_group, q_bucket, k_bucket,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
              DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, LPT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Forward: O (and the row log-sum-exp LSE, base 2, scaled) of BLOCK_M query rows of one (batch, query head).

    Supports fp16, bf16 and fp32 Q/K/V (one dtype; fp32 accumulation), HEAD_DIM 1..256 padded to BLOCK_D (a power
    of two >= 16), any Nq, Nk >= 1, causal (bottom-right aligned, offset = Nk - Nq) or not, GQA via GROUP =
    Hq // Hkv, any strides (TMA: K/V through descriptors, needs 16-byte aligned rows). grid: _query_tile.
    """
    pid_m, h, b = _query_tile(Nq, Hq, lpt_group, CAUSAL, LPT, BLOCK_M)
    bh = b * Hq + h
    hk = h // GROUP  # kv head of this query head
    start_m = pid_m * BLOCK_M

    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    if TMA:
        k_base = tl.make_tensor_descriptor(k_base, shape=[Nk, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_base = tl.make_tensor_descriptor(v_base, shape=[Nk, HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])

    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    row_ok = offs_m < Nq
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2, scaled)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running unnormalised output

    # key blocks [0, full_hi) need no mask; [full_hi, hi) cross the diagonal and/or the Nk tail
    n_full = (Nk // BLOCK_N) * BLOCK_N
    if CAUSAL:
        # the first row of the tile sees keys <= start_m + offset: blocks ending there are fully visible
        full_hi = tl.minimum((tl.maximum(start_m + offset + 1, 0) // BLOCK_N) * BLOCK_N, n_full)
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + offset, 0), Nk)  # past the last row's last key
    else:
        full_hi = n_full
        hi = Nk
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               0, full_hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d,
                               False, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               full_hi, hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d,
                               True, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA)

    # rows that saw no key (causal with Nq > Nk): output 0 and lse = +inf, so the backward's P is exactly 0
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(l_safe))  # (BLOCK_M,) base-2, scaled
    o = acc / l_safe[:, None]  # (BLOCK_M, BLOCK_D)
    tl.store(LSE + bh.to(tl.int64) * Nq + offs_m, lse, mask=row_ok)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                lo, hi, GROUP, Nq, offset, qk_scale, offs_n, offs_d,
                MASK: tl.constexpr, GQA: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, FUSED_DQ: tl.constexpr):
    """Accumulate dK, dV of one key tile over query blocks [lo, hi) of each of the GROUP query heads that
    read it (GQA; 1 otherwise), in one flat loop: head g = step // blocks. (A loop over the heads around
    this one kept the accumulators of both loops live: 255 registers and spills on sm_90.)

    Works transposed (keys along rows): sT = K Qᵀ is (BLOCK_N, BLOCK_M). MASK: 0 = full query blocks, no checks;
    1 = the Nq tail (rows past Nq load as q = dO = 0 with lse = +inf, so their P is 0); 2 = causal diagonal
    blocks (causal mask + the row checks of 1). q_base, do_base, lse_base, delta_base address the group's
    first query head (head g at + g * stride_qh, ..., + g * Nq for lse and delta). TMA: q_base, do_base are
    tensor descriptors over the group's (GROUP, Nq, HEAD_DIM) (zeros past either end), else pointers.
    FUSED_DQ (0: off): also add each tile's dQ part dS K (unscaled, fp32) into the group's rows of the
    accumulator ((GROUP, Nq, BLOCK_D) fp32, contiguous): 1 = element atomic adds at the pointer dq_base, 2 = one
    TMA reduce-add per tile through the tensor descriptor dq_base (Hopper or newer; not in the interpreter).
    """
    d_ok = offs_d < HEAD_DIM
    blocks = tl.maximum((hi - lo) // BLOCK_M, 1)  # >= 1 only to keep the division defined when hi == lo
    steps = ((hi - lo) // BLOCK_M) * GROUP
    for step in range(0, steps):
        if GQA:
            g = step // blocks  # query head within the group
            start_m = lo + (step - g * blocks) * BLOCK_M
        else:
            g = step * 0  # (one head: no division, and the compiler folds the head offsets away)
            start_m = lo + step * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        row_ok = offs_m < Nq
        g_rows = g.to(tl.int64) * Nq  # this head's rows of lse and delta
        if TMA:
            qT = tl.trans(q_base.load([g, start_m, 0]).reshape(BLOCK_M, BLOCK_D))  # (BLOCK_D, BLOCK_M)
        else:
            qT_ptrs = (q_base + g.to(tl.int64) * stride_qh
                       + offs_m[None, :] * stride_qm + offs_d[:, None] * stride_qd)  # (BLOCK_D, BLOCK_M)
            if MASK == 0:
                if BLOCK_D != HEAD_DIM:
                    qT = tl.load(qT_ptrs, mask=d_ok[:, None], other=0.0)
                else:
                    qT = tl.load(qT_ptrs)
            else:
                qT = tl.load(qT_ptrs, mask=row_ok[None, :] & d_ok[:, None], other=0.0)
        if MASK == 0:
            lse = tl.load(lse_base + g_rows + offs_m)
        else:
            lse = tl.load(lse_base + g_rows + offs_m, mask=row_ok, other=float("inf"))  # (BLOCK_M,)
        sT = tl.dot(k, qT, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        if MASK == 2:
            visible = offs_n[:, None] <= offs_m[None, :] + offset  # key j <= query i + offset
            sT = tl.where(visible, sT * qk_scale, float("-inf"))
            pT = tl.math.exp2(sT - lse[None, :])  # (BLOCK_N, BLOCK_M)
        else:
            pT = tl.math.exp2(sT * qk_scale - lse[None, :])
        if TMA:
            do = do_base.load([g, start_m, 0]).reshape(BLOCK_M, BLOCK_D)  # (BLOCK_M, BLOCK_D)
        else:
            do_ptrs = (do_base + g.to(tl.int64) * stride_doh
                       + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod)  # (BLOCK_M, BLOCK_D)
            if MASK == 0:
                if BLOCK_D != HEAD_DIM:
                    do = tl.load(do_ptrs, mask=d_ok[None, :], other=0.0)
                else:
                    do = tl.load(do_ptrs)
            else:
                do = tl.load(do_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if MASK == 0:
            delta = tl.load(delta_base + g_rows + offs_m)
        else:
            delta = tl.load(delta_base + g_rows + offs_m, mask=row_ok, other=0.0)  # (BLOCK_M,)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_D)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M) = (dO Vᵀ)ᵀ
        dsT = pT * (dpT - delta[None, :])  # (BLOCK_N, BLOCK_M) gradient w.r.t. the scaled scores
        dsT = dsT.to(qT.dtype)
        dk = tl.dot(dsT, tl.trans(qT), dk, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_D)
        if FUSED_DQ != 0:
            # (taken as (Kᵀ dSᵀ)ᵀ it was 4% faster, but Triton 3.6 on the H200 got it wrong with one tile
            # config: bench/results/fused_tma/)
            dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_D) = dS K
            if FUSED_DQ == 2:  # one bulk TMA reduce-add of the tile (rows past Nq are dropped by the unit)
                dq_base.atomic_add([g, start_m, 0], dq.reshape(1, BLOCK_M, BLOCK_D))
            else:
                dq_ptrs = dq_base + (g_rows + offs_m)[:, None] * BLOCK_D + offs_d[None, :]  # (BLOCK_M, BLOCK_D)
                if MASK == 0:
                    tl.atomic_add(dq_ptrs, dq, sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq, mask=row_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["Hq", "Hkv", "GROUP", "Nq", "Nk", "offset", "lpt_group", "q_bucket", "k_bucket"])
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, DQACC,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   Hq, Hkv, GROUP, Nq, Nk, offset, qk_scale, sm_scale, lpt_group, q_bucket, k_bucket,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, LPT: tl.constexpr, GQA: tl.constexpr,
                   FUSED_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK, dV of BLOCK_N key rows of one (batch, kv head), summed over the GROUP query heads that read them.

    Same support as _attn_fwd (dtypes, HEAD_DIM, any Nq/Nk, both masks, GQA, strides; TMA: Q/dO through
    descriptors). Needs DELTA = rowsum(O * dO): from _attn_bwd_dq, which runs first, or (FUSED_DQ) from
    _attn_bwd_prep. FUSED_DQ (1: element atomics, 2: TMA reduce-add per tile, Hopper+): dQ too, accumulated
    unscaled in DQACC ((B, Hq, Nq, BLOCK_D) fp32, zeroed by _attn_bwd_prep) with atomic adds — 5 matmuls per
    tile instead of the two kernels' 7, but the summation order, and so the last bits of dQ, vary from run to
    run; _attn_bwd_dq_out writes dQ from it.
    """
    # grid: (cdiv(Nk, BLOCK_N), Hkv, B). Under a causal mask the first key blocks are seen by the most
    # queries, so within a head the natural order starts with the heaviest programs; LPT (causal): a 1-D grid
    # in longest-first order across heads (_lpt_tile).
    if LPT:
        pid_n, hk, b = _lpt_tile(tl.cdiv(Nk, BLOCK_N), Hkv, lpt_group, False)
    else:
        pid_n = tl.program_id(0)
        hk = tl.program_id(1)
        b = tl.program_id(2)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key rows
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < Nk
    d_ok = offs_d < HEAD_DIM
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
                + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
                + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    m_full = (Nq // BLOCK_M) * BLOCK_M  # query blocks below this hold no row past Nq
    m_end = tl.cdiv(Nq, BLOCK_M) * BLOCK_M
    if CAUSAL:
        # queries i >= start_n - offset see some key of this tile; i >= start_n + BLOCK_N - 1 - offset see all
        lo = (tl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M, m_end)
        lo = tl.minimum(lo, full_lo)
    else:
        lo = 0
        full_lo = 0
    tail_lo = tl.maximum(full_lo, m_full)
    # query blocks: [lo, full_lo) causal diagonal (masked); [full_lo, m_full) no checks at all;
    # [tail_lo, m_end) the partial block at the Nq tail (row checks only). The tail loop runs first: entering
    # the main loop with zero-initialised accumulators made ptxas serialise the non-causal kernel's wgmmas.
    # the GROUP query heads that read this kv head, all in this program: no atomics needed for GQA
    h0 = hk * GROUP
    q_base = Q + b.to(tl.int64) * stride_qb + h0.to(tl.int64) * stride_qh
    do_base = DO + b.to(tl.int64) * stride_dob + h0.to(tl.int64) * stride_doh
    if TMA:
        q_base = tl.make_tensor_descriptor(q_base, shape=[GROUP, Nq, HEAD_DIM], strides=[stride_qh, stride_qm, 1],
                                           block_shape=[1, BLOCK_M, BLOCK_D])
        do_base = tl.make_tensor_descriptor(do_base, shape=[GROUP, Nq, HEAD_DIM],
                                            strides=[stride_doh, stride_dom, 1], block_shape=[1, BLOCK_M, BLOCK_D])
    lse_base = LSE + (b * Hq + h0).to(tl.int64) * Nq
    delta_base = DELTA + (b * Hq + h0).to(tl.int64) * Nq
    dq_base = DQACC + (b * Hq + h0).to(tl.int64) * Nq * BLOCK_D
    if FUSED_DQ == 2:
        dq_base = tl.make_tensor_descriptor(dq_base, shape=[GROUP, Nq, BLOCK_D], strides=[Nq * BLOCK_D, BLOCK_D, 1],
                                            block_shape=[1, BLOCK_M, BLOCK_D])
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                         stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                         tail_lo, m_end, GROUP, Nq, offset, qk_scale, offs_n, offs_d,
                         1, GQA, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, FUSED_DQ)
    if CAUSAL:
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                             stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                             lo, full_lo, GROUP, Nq, offset, qk_scale, offs_n, offs_d,
                             2, GQA, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, FUSED_DQ)
    dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                         stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                         full_lo, m_full, GROUP, Nq, offset, qk_scale, offs_n, offs_d,
                         0, GQA, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, FUSED_DQ)
    dk = dk * sm_scale  # dS was taken w.r.t. the scaled scores
    tl.store(DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
             + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh
             + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
              lo, hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Accumulate dQ of one query tile over key blocks [lo, hi); MASKED and TMA as in _fwd_inner."""
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,)
        if TMA:
            kT = tl.trans(k_base.load([start_n, 0]))  # (BLOCK_D, BLOCK_N)
            vT = tl.trans(v_base.load([start_n, 0]))  # (BLOCK_D, BLOCK_N)
        else:
            kT_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd  # (BLOCK_D, BLOCK_N)
            vT_ptrs = v_base + cols[None, :] * stride_vn + offs_d[:, None] * stride_vd  # (BLOCK_D, BLOCK_N)
            if MASKED:
                kv_mask = d_ok[:, None] & (cols[None, :] < Nk)
                kT = tl.load(kT_ptrs, mask=kv_mask, other=0.0)
                vT = tl.load(vT_ptrs, mask=kv_mask, other=0.0)
            elif BLOCK_D != HEAD_DIM:
                kT = tl.load(kT_ptrs, mask=d_ok[:, None], other=0.0)
                vT = tl.load(vT_ptrs, mask=d_ok[:, None], other=0.0)
            else:
                kT = tl.load(kT_ptrs)
                vT = tl.load(vT_ptrs)
        s = tl.dot(q, kT, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        if MASKED:
            visible = cols[None, :] < Nk
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + offset)
            s = tl.where(visible, s * qk_scale, float("-inf"))
            p = tl.math.exp2(s - lse[:, None])  # (BLOCK_M, BLOCK_N)
        else:
            p = tl.math.exp2(s * qk_scale - lse[:, None])
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_D)
    return dq


@triton.jit(do_not_specialize=["Hq", "GROUP", "Nq", "Nk", "offset", "lpt_group", "q_bucket", "k_bucket"])
def _attn_bwd_dq(Q, K, V, O, DO, LSE, DELTA, DQ,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_ob, stride_oh, stride_om, stride_od,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 Hq, GROUP, Nq, Nk, offset, qk_scale, sm_scale, lpt_group, q_bucket, k_bucket,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, LPT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ of BLOCK_M query rows, and the rows' delta = rowsum(O * dO) in fp32 (the softmax backward's row term),
    computed here from the tiles this program loads anyway and stored to DELTA for the dK/dV kernel, which
    runs after this one (no separate delta pass over O and dO).

    Same support as _attn_fwd (dtypes, HEAD_DIM, any Nq/Nk, both masks, GQA, strides). grid: as the forward's
    (_query_tile)."""
    pid_m, h, b = _query_tile(Nq, Hq, lpt_group, CAUSAL, LPT, BLOCK_M)
    bh = b * Hq + h
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Nq
    d_ok = offs_d < HEAD_DIM
    qd_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=qd_mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=qd_mask, other=0.0)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, mask=qd_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,)
    tl.store(DELTA + bh.to(tl.int64) * Nq + offs_m, delta, mask=row_ok)
    lse = tl.load(LSE + bh.to(tl.int64) * Nq + offs_m, mask=row_ok, other=float("inf"))  # (BLOCK_M,)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    if TMA:
        k_base = tl.make_tensor_descriptor(k_base, shape=[Nk, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_base = tl.make_tensor_descriptor(v_base, shape=[Nk, HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    n_full = (Nk // BLOCK_N) * BLOCK_N
    if CAUSAL:
        full_hi = tl.minimum((tl.maximum(start_m + offset + 1, 0) // BLOCK_N) * BLOCK_N, n_full)
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + offset, 0), Nk)
    else:
        full_hi = n_full
        hi = Nk
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   0, full_hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d,
                   False, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   full_hi, hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d,
                   True, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA)
    dq = dq * sm_scale
    tl.store(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
             + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
             mask=qd_mask)


@triton.jit(do_not_specialize=["Hq", "Nq"])
def _attn_bwd_prep(O, DO, DELTA, DQACC,
                   stride_ob, stride_oh, stride_om, stride_od,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   Hq, Nq, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The fused backward's first pass over BLOCK_M query rows of one (batch, head): delta = rowsum(O * dO) in
    fp32 into DELTA (B, Hq, Nq), and zeros into the rows' dQ accumulator DQACC ((B, Hq, Nq, BLOCK_D) fp32,
    contiguous). Any dtype of O/dO, any strides, HEAD_DIM <= BLOCK_D, any Nq. BLOCK_N is unused.
    grid: (cdiv(Nq, BLOCK_M), Hq, B)."""
    pid_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bh = b * Hq + h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Nq
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * Nq + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=row_ok)
    tl.store(DQACC + (bh.to(tl.int64) * Nq + offs_m[:, None]) * BLOCK_D + offs_d[None, :],
             tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["Hq", "Nq"])
def _attn_bwd_dq_out(DQACC, DQ, stride_dqb, stride_dqh, stride_dqm, stride_dqd, Hq, Nq, sm_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The fused backward's last pass: dQ = sm_scale * DQACC (fp32, (B, Hq, Nq, BLOCK_D), contiguous) in DQ's
    dtype and strides, for BLOCK_M rows of one (batch, head). BLOCK_N is unused. grid: (cdiv(Nq, BLOCK_M), Hq, B)."""
    pid_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Nq
    acc = tl.load(DQACC + ((b * Hq + h).to(tl.int64) * Nq + offs_m[:, None]) * BLOCK_D + offs_d[None, :],
                  mask=row_ok[:, None], other=0.0)  # (BLOCK_M, BLOCK_D)
    tl.store(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
             + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd, (acc * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


if INTERPRET and not type(_attn_fwd).__name__.startswith("Interpreted"):
    raise RuntimeError("TRITON_INTERPRET=1 did not take effect for kernels/flash.py; set it in the "
                       "environment before starting Python (or before anything imports this module)")


# ----------------------------------------------------------------------------------------------------------
# Tile configs: (BLOCK_M, BLOCK_N, num_warps, num_stages). The first of each list is the default.
# fwd / dq: BLOCK_M query rows per program, BLOCK_N keys per loop step.
# dkdv:     BLOCK_N key rows per program, BLOCK_M queries per loop step.
# ----------------------------------------------------------------------------------------------------------

_INTERPRET_CFG = (64, 64, 4, 1)  # the interpreter pays per loop step: 64-row tiles (tests also force others)

_GPU_CFGS = {
    # (kernel, dtype class, BLOCK_D) -> configs. Measured on an H200 (bench/NOTES.md): the first of each list
    # is the best or near-best on the benchmark shapes; configs that never won there were dropped.
    ("fwd", "16", 64): [(128, 64, 8, 4), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 4, 3), (128, 64, 4, 3),
                        (64, 64, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3)],
    ("fwd", "16", 128): [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
                         (128, 32, 4, 4), (128, 128, 8, 3)],
    ("fwd", "16", 256): [(64, 32, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3)],
    ("dkdv", "16", 64): [(32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 4, 4), (32, 128, 8, 3), (16, 128, 4, 3),
                         (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2), (16, 64, 4, 3), (32, 64, 4, 4),
                         (16, 64, 4, 4)],
    ("dkdv", "16", 128): [(64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 3), (32, 64, 4, 4), (32, 64, 4, 2),
                          (16, 64, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3), (16, 128, 8, 3)],
    ("dkdv", "16", 256): [(32, 64, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2)],
    ("dq", "16", 64): [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 4), (64, 32, 4, 4),
                       (64, 128, 4, 3)],
    ("dq", "16", 128): [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3),
                        (64, 32, 4, 3)],
    ("dq", "16", 256): [(64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)],
    # float32 runs ieee dots on the CUDA cores: small tiles, accuracy path
    ("fwd", "32", 64): [(64, 32, 4, 2), (32, 32, 4, 2)],
    ("fwd", "32", 128): [(64, 32, 4, 2), (32, 32, 4, 2)],
    ("fwd", "32", 256): [(32, 32, 4, 1), (32, 16, 4, 2)],
    ("dkdv", "32", 64): [(32, 32, 4, 2), (16, 32, 4, 2)],
    ("dkdv", "32", 128): [(32, 32, 4, 2), (16, 32, 4, 2)],
    ("dkdv", "32", 256): [(16, 32, 8, 1), (16, 16, 4, 1)],
    ("dq", "32", 64): [(32, 32, 4, 2), (32, 16, 4, 2)],
    ("dq", "32", 128): [(32, 32, 4, 2), (32, 16, 4, 2)],
    ("dq", "32", 256): [(32, 16, 8, 1), (16, 16, 4, 1)],
}
# The fused backward (FLASHGPT_BWD=fused): "dkdvq" is the dK/dV kernel that also adds dQ (its own autotuner, which
# zeroes the dQ accumulator before each trial), "prep" and "dqout" its two row-wise passes (one config each).
_GPU_CFGS.update({("dkdvq", dcls, bd): list(cfgs) for (name, dcls, bd), cfgs in list(_GPU_CFGS.items())
                  if name == "dkdv"})
_GPU_CFGS.update({(name, dcls, bd): [(64 if bd < 256 else 32, 64, 4, 1)]
                  for name in ("prep", "dqout") for dcls in ("16", "32") for bd in (64, 128, 256)})


def _cfg_key(kernel: str, dtype: torch.dtype, block_d: int):
    return (kernel, "32" if dtype == torch.float32 else "16", max(64, block_d))


def gpu_configs(kernel: str, dtype: torch.dtype, head_dim: int) -> list[tuple[int, int, int, int]]:
    """The autotune list of one kernel ("fwd", "dkdv", "dq") for a dtype and head dim (tests run them all)."""
    return list(_GPU_CFGS[_cfg_key(kernel, dtype, _block_d(head_dim))])


def _as_config(c):
    return triton.Config({"BLOCK_M": c[0], "BLOCK_N": c[1]}, num_warps=c[2], num_stages=c[3])


def _tuned(fn):
    """One autotuner per (kernel, dtype class, BLOCK_D) so each only tries the configs meant for it (none for a
    single config: _launch runs it directly)."""
    out = {}
    for (name, dcls, bd), cfgs in _GPU_CFGS.items():
        if INTERPRET or len(cfgs) == 1:
            continue
        key = ["HEAD_DIM", "CAUSAL", "TMA", "LPT", "q_bucket", "k_bucket"]  # + the tensor dtypes (triton)
        if "GQA" in fn[name].arg_names:  # dK/dV only (newer Triton rejects key names that are not arguments)
            key.append("GQA")
        zero = ["DQACC"] if name == "dkdvq" else None  # each trial adds into it: start every one from zeros
        out[(name, dcls, bd)] = triton.autotune(configs=[_as_config(c) for c in cfgs], key=key,
                                                reset_to_zero=zero)(fn[name])
    return out


_RAW = {"fwd": _attn_fwd, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq, "dkdvq": _attn_bwd_dkdv,
        "prep": _attn_bwd_prep, "dqout": _attn_bwd_dq_out}
_TUNED = _tuned(_RAW)

_forced: dict[str, tuple[int, int, int, int]] = {}
_picked: dict[tuple, tuple[int, int, int, int]] = {}  # autotuner's choice per key, reused without the tuner


@contextlib.contextmanager
def forced_configs(**cfgs):
    """Run with fixed tile configs, e.g. ``forced_configs(fwd=(64, 32, 4, 2), dq=..., dkdv=...)``.

    For tests (check every config of the autotune lists) and benchmarks; not thread-safe.
    """
    old = dict(_forced)
    _forced.update(cfgs)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(old)


def _autotune_enabled() -> bool:
    return not INTERPRET and os.environ.get("FLASHGPT_AUTOTUNE", "1") not in ("0", "", "false", "False")


def _tma_scratch(size: int, alignment: int, stream):
    """Global scratch for the descriptors the kernels build on the device (128 bytes per descriptor)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")  # the current device: _launch runs under its guard


def _grid(name: str, length: int, heads: int, batch: int, lpt: bool, block_m: int, block_n: int):
    """(blocks, heads, batch), or the same count in 1-D for the LPT order; fwd/dq tile queries, dkdv keys."""
    blocks = -(-length // (block_n if name in ("dkdv", "dkdvq") else block_m))  # ceil
    return (blocks * heads * batch,) if lpt else (blocks, heads, batch)


# Triton's compiled kernel per launch signature, so that a repeated launch calls its launcher directly and skips
# JITFunction.run's per-call work (binding and specialising ~45 arguments, building its cache key: microseconds
# of host time per launch, which the GPU waits for where a training step starts). FLASHGPT_FAST_LAUNCH=0 (read
# at import) always goes through JITFunction.run.
_FAST_LAUNCH = (os.environ.get("FLASHGPT_FAST_LAUNCH", "1") not in ("0", "", "false", "False")
                and not INTERPRET)
_compiled: dict[tuple, object] = {}
_COMPILED_MAX = 4096  # signatures kept (one per distinct shape/stride set); the cache starts over beyond it
_N_TENSOR_ARGS = {"fwd": 5, "dq": 8, "dkdv": 9, "dkdvq": 9, "prep": 4, "dqout": 2}  # tensors lead the arguments


def _run(name: str, grid: tuple, cfg, args, kwargs):
    """Launch the plain kernel `name` with tile config cfg (the cached compiled kernel when there is one).
    Returns the compiled kernel that later launches of this signature can call directly (_launch_compiled),
    or None (direct launches off, or not cacheable).

    The cache key is stricter than Triton's specialisation: the tensors' dtypes and 16-byte alignment (what
    Triton specialises a pointer on) and every other argument by value, so a hit always has the signature the
    kernel was compiled for."""
    bm, bn, warps, stages = cfg
    if not _FAST_LAUNCH:
        _RAW[name][grid](*args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        return None
    n = _N_TENSOR_ARGS[name]
    key = (name, cfg, args[0].device.index, *kwargs.values(), *args[n:],
           *[(t.dtype, t.data_ptr() % 16 == 0) for t in args[:n]])
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _RAW[name][grid](*args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        # the launcher takes every parameter in the kernel's order: the positional args, then the constexprs
        if (hasattr(kernel, "run") and list(_RAW[name].arg_names[len(args):]) == [*kwargs, "BLOCK_M", "BLOCK_N"]
                and all(isinstance(a, torch.Tensor) == (i < n) for i, a in enumerate(args))):
            if len(_compiled) >= _COMPILED_MAX:
                _compiled.clear()
            _compiled[key] = kernel
            return kernel
        return None
    _launch_compiled(kernel, grid, (*args, *kwargs.values(), bm, bn))
    return kernel


def _launch_compiled(kernel, grid: tuple, vals: tuple) -> None:
    """Call a compiled kernel's launcher on the current device and stream. vals: every kernel parameter in
    order (pointer parameters may be tensors or plain integer addresses)."""
    device = triton.runtime.driver.active.get_current_device()
    stream = triton.runtime.driver.active.get_current_stream(device)
    hooks = triton.knobs.runtime
    kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, kernel.function,
               kernel.packed_metadata, kernel.launch_metadata(grid, stream, *vals), hooks.launch_enter_hook,
               hooks.launch_exit_hook, *vals)


def _uses_descriptors(kwargs: dict) -> bool:
    """Whether the launch builds tensor descriptors on the device (then Triton needs its scratch allocator)."""
    return bool(kwargs.get("TMA")) or kwargs.get("FUSED_DQ") == 2


def _exec(name: str, grid: tuple, cfg, args, kwargs):
    if _uses_descriptors(kwargs) and not INTERPRET:
        triton.set_allocator(_tma_scratch)  # a context variable: set per launch (autograd runs in its own thread)
    return _run(name, grid, cfg, args, kwargs)


def _launch(name: str, grid_axis0_len: int, heads: int, batch: int, dtype, args, kwargs):
    """Launch kernel `name` with a forced config, the autotuner, or the default config. Returns (grid, config,
    compiled kernel or None: see _run) of a launch with a fixed config, None after the autotuner's first run for
    its key."""
    cfgs = _GPU_CFGS[_cfg_key(name, dtype, kwargs["BLOCK_D"])]
    if name in _forced or INTERPRET or not _autotune_enabled() or len(cfgs) == 1:
        if name in _forced:
            cfg = _forced[name]
        elif INTERPRET:
            cfg = _INTERPRET_CFG
        else:
            cfg = cfgs[0]
    else:
        # after the autotuner has picked a config for this key, launch the plain kernel with it directly
        # (skips the autotuner's per-call bookkeeping: ~tens of microseconds of CPU per launch)
        tkey = (name, dtype, kwargs["HEAD_DIM"], kwargs["CAUSAL"], kwargs["TMA"], kwargs["LPT"], kwargs.get("GQA"),
                kwargs.get("FUSED_DQ"), args[-2], args[-1], args[0].device.index)  # the buckets are the last two args
        cfg = _picked.get(tkey)
        if cfg is None:
            grid = lambda meta: _grid(name, grid_axis0_len, heads, batch, kwargs["LPT"],  # noqa: E731
                                      meta["BLOCK_M"], meta["BLOCK_N"])
            if _uses_descriptors(kwargs):
                triton.set_allocator(_tma_scratch)
            tuner = _TUNED[_cfg_key(name, dtype, kwargs["BLOCK_D"])]
            tuner[grid](*args, **kwargs)
            best = tuner.best_config
            _picked[tkey] = (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)
            return None
    grid = _grid(name, grid_axis0_len, heads, batch, kwargs.get("LPT", False), cfg[0], cfg[1])
    return grid, cfg, _exec(name, grid, cfg, args, kwargs)


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------

# Host-side helpers in plain integer arithmetic: triton.next_power_of_2 / triton.cdiv are constexpr-function
# wrappers costing microseconds per call, and these run several times per launch.
def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _block_d(head_dim: int) -> int:
    return max(16, _next_pow2(head_dim))


def _bucket(n: int) -> int:
    """Power-of-two length bucket for the autotune key (so every new length does not re-tune)."""
    return min(_next_pow2(n), 1 << 16)


def _empty(shape, dtype, device) -> torch.Tensor:
    """Every output buffer comes from here (tests replace it to poison outputs with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _memory_order(t: torch.Tensor) -> list[int]:
    """t's dims from outermost to innermost in memory (stride-0 broadcast dims count as outermost)."""
    return sorted(range(4), key=lambda i: (-(t.stride(i) or 2**62), i))


def _layout(t: torch.Tensor) -> tuple[tuple, tuple]:
    """(shape in memory order, permutation back to (B, H, N, D)) of a buffer laid out like t.

    A model hands q, k, v as (B, N, H, D) memory seen as (B, H, N, D); returning O and dQ/dK/dV in that same
    order makes the model's `y.transpose(1, 2).contiguous()` (and the gradients' way back) free instead of a
    copy, as with PyTorch's SDPA. The head dim stays innermost; ties keep the (B, H, N, D) order.
    """
    order = _memory_order(t) if t.stride(3) == 1 else [0, 1, 2, 3]
    return tuple(t.shape[i] for i in order), tuple(order.index(i) for i in range(4))


def _empty_like_layout(layout, dtype, device) -> torch.Tensor:
    shape, perm = layout
    return _empty(shape, dtype, device).permute(*perm)


_TRITON_HAS_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _tma_available(device: torch.device) -> bool:
    """Triton with on-device tensor descriptors, on a Hopper-or-newer GPU (or the interpreter); FLASHGPT_TMA=0
    turns the descriptor path off."""
    if not _TRITON_HAS_DESCRIPTORS or os.environ.get("FLASHGPT_TMA", "1") in ("0", "", "false", "False"):
        return False
    return INTERPRET or _hopper_or_newer(torch.device(device).index or 0)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


# Head dims (padded, BLOCK_D) from which each kernel reads through TMA descriptors (_NEVER: pointers only).
# Measured on the H200 (bench/NOTES.md, "TMA"): at BLOCK_D = 128 descriptors take fewer registers than pointer
# tiles and the dK/dV kernel's best config was 2-6% faster with them; the dQ kernel and the forward were 4.6%
# and 1.5% slower; at BLOCK_D = 64 the forward was 4-18% slower. FLASHGPT_TMA_MIN_D sets all three (A/B runs).
_NEVER = MAX_HEAD_DIM * 2
TMA_MIN_BLOCK_D = {"fwd": _NEVER, "dq": _NEVER, "dkdv": 128}
if "FLASHGPT_TMA_MIN_D" in os.environ:
    TMA_MIN_BLOCK_D = dict.fromkeys(TMA_MIN_BLOCK_D, _env_int("FLASHGPT_TMA_MIN_D", 128))


def _tma_ok(kernel: str, *tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can and should read these (B, H, N, D) tensors in `kernel`: head dim padded to at
    least TMA_MIN_BLOCK_D[kernel] (the interpreter: any), unit stride along D, and every head's start and row
    stride a multiple of 16 bytes (a copy is never made to get there: otherwise pointer loads)."""
    if _block_d(tensors[0].shape[-1]) < TMA_MIN_BLOCK_D[kernel] and not INTERPRET:
        return False
    if not _tma_available(tensors[0].device):
        return False
    for t in tensors:
        size = t.element_size()
        sb, sh, sn, sd = t.stride()
        if sd != 1 or sn <= 0 or (sn * size) % 16 or (sb * size) % 16 or (sh * size) % 16 or t.data_ptr() % 16:
            return False
    return True


# Causal grids in longest-first order (_lpt_tile), in groups of heads whose streamed tiles stay in L2: the
# budget is about half of an H100/H200's 50 MB L2. Used only when a group holds at least LPT_MIN_GROUP
# (batch, head) pairs: measured on the H200 (bench/results/lpt_ab.md, CUDA-graph timed, fixed configs) the
# forward gained 3-4% at N = 1024 and 4096 (d64) and the backward moved within +-1%, while at N = 16384, d128
# (groups of 3 heads) both lost 4%. FLASHGPT_LPT=0: always the per-head 3-D grid (for A/B runs).
LPT_L2_BYTES = 24 << 20
LPT_MIN_GROUP = 8


def _lpt(causal: bool, group: int) -> bool:
    return (bool(causal) and group >= LPT_MIN_GROUP
            and os.environ.get("FLASHGPT_LPT", "1") not in ("0", "", "false", "False"))


def _lpt_group(t: torch.Tensor, rows: int, heads: int) -> int:
    """How many (batch, head) pairs one LPT group holds: a program streams `rows` rows of two tensors like t
    (K and V, or Q and dO) per head; the group's share fits LPT_L2_BYTES."""
    per_head = 2 * rows * t.shape[-1] * t.element_size()
    return max(1, min(heads, LPT_L2_BYTES // per_head))


# The backward's structure. "split": the dQ kernel (which also stores delta), then the dK/dV kernel — 7 matmuls per
# pair of tiles (both kernels recompute S and dP), deterministic. "fused": a delta pass that also zeroes an fp32
# dQ accumulator, the dK/dV kernel adding each tile's dS K into it with atomics (5 matmuls), and a pass writing
# dQ — the FA2/cuDNN structure: less work, but dQ's last bits vary from run to run. FLASHGPT_BWD=split|fused
# picks one (read per call; A/B runs); BWD_DEFAULT is the measured choice (bench/NOTES.md).
BWD_DEFAULT = "split"


def _fused_bwd() -> bool:
    mode = os.environ.get("FLASHGPT_BWD", BWD_DEFAULT)
    if mode not in ("split", "fused"):
        raise ValueError(f"FLASHGPT_BWD={mode!r}: expected 'split' or 'fused'")
    return mode == "fused"


# The fused dK/dV kernel's dQ accumulation (FUSED_DQ): 2 = one TMA reduce-add per tile (cp.reduce.async.bulk:
# the tile goes through shared memory, the adds happen in L2) where Triton has descriptor reductions and the GPU
# has TMA (FLASHGPT_TMA=0 turns it off); 1 = element atomic adds (older GPUs and Triton, the interpreter, which
# has no descriptor reductions).
_TRITON_HAS_DESC_REDUCE = _TRITON_HAS_DESCRIPTORS and hasattr(tl.core.tensor_descriptor_base, "atomic_add")


def _fused_dq_mode(device: torch.device) -> int:
    mode = _env_int("FLASHGPT_FUSED_DQ", 2)  # A/B runs: 1 forces element atomics
    if mode not in (1, 2):
        raise ValueError(f"FLASHGPT_FUSED_DQ={mode}: expected 1 (element atomics) or 2 (TMA reduce-adds)")
    return 2 if mode == 2 and not INTERPRET and _TRITON_HAS_DESC_REDUCE and _tma_available(device) else 1


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale) -> float:
    """All checks happen here, before any launch. Returns the softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    check_qkv(q, k, v)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"flash_attention supports float16, bfloat16 and float32 inputs, got {q.dtype}")
    D = q.shape[-1]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"flash_attention supports head dims 1..{MAX_HEAD_DIM}, got D={D}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if INTERPRET:
        if q.device.type != "cpu":
            raise ValueError("TRITON_INTERPRET=1: flash_attention runs through Triton's interpreter and "
                             f"expects CPU tensors, got {q.device}")
    elif q.device.type != "cuda":
        raise ValueError(f"flash_attention needs CUDA tensors, got {q.device} (on a machine without a GPU, "
                         "set TRITON_INTERPRET=1 before importing kernels.flash to run the kernels "
                         "on the CPU through Triton's interpreter)")
    if max(q.shape[0], q.shape[1]) > 65535:
        raise ValueError(f"flash_attention: batch and head count must be <= 65535 (grid limits), got {q.shape}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        # offsets inside one (batch, head) slice are int32 in the kernels (batch/head offsets are int64)
        if (t.shape[2] - 1) * t.stride(2) + (t.shape[3] - 1) * t.stride(3) >= 2**31:
            raise ValueError(f"flash_attention: {name} is too long for int32 offsets within one head "
                             f"(shape {tuple(t.shape)}, strides {t.stride()})")
    if sm_scale is None:
        return 1.0 / math.sqrt(D)
    sm_scale = float(sm_scale)
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a finite number > 0, got {sm_scale}")
    return sm_scale


# ---- launch plans ---------------------------------------------------------------------------------------
# What _fwd and _bwd compute on the host (output layouts, grids, tile configs, the stride and scalar arguments,
# the constexprs, the compiled kernels) depends only on the inputs' shapes, strides, dtypes, device and 16-byte
# alignment, the mask and scale, and the FLASHGPT_* switches. The first call with such a signature records a
# plan; later calls allocate the outputs and launch from it (host time per call: bench/host_overhead.py). Not
# under forced_configs, and not recorded from the autotuner's first run.
_plans: dict[tuple, tuple] = {}
_PLANS_MAX = 4096


def _plan_key(kind: str, tensors, *scalars) -> tuple | None:
    env = os.environ
    return (kind, *scalars, env.get("FLASHGPT_TMA"), env.get("FLASHGPT_LPT"), env.get("FLASHGPT_AUTOTUNE"),
            env.get("FLASHGPT_BWD"), env.get("FLASHGPT_FUSED_DQ"),
            *sorted(_forced.items()),  # a plan replays the configs it was recorded with
            *TMA_MIN_BLOCK_D.values(), LPT_MIN_GROUP,
            *[(t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors])


def _planned(name: str, launched, idx: tuple, tail: tuple, kwargs: dict):
    """A plan's record of one launch (None when _launch gave none): the kernel, grid, config, compiled kernel,
    the indices of its tensors in the replay's pool, the other arguments, the constexprs, and (with a compiled
    kernel) everything after the tensors as its launcher takes it."""
    if launched is None:
        return None
    grid, cfg, kernel = launched
    after = None if kernel is None else (*tail, *kwargs.values(), cfg[0], cfg[1])
    return name, grid, cfg, kernel, idx, tail, kwargs, after


def _record(key, plan) -> None:
    if key is not None and all(launch is not None for launch in plan[-1]):
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        _plans[key] = plan


def _replay(launches, pool, like: torch.Tensor) -> None:
    """Run a plan's launches on the tensors (or, for compiled kernels only, integer addresses) in pool."""
    with _device_guard(like):
        for name, grid, cfg, kernel, idx, tail, kwargs, after in launches:
            if kernel is None:
                _exec(name, grid, cfg, (*[pool[i] for i in idx], *tail), kwargs)
                continue
            if _uses_descriptors(kwargs):
                triton.set_allocator(_tma_scratch)
            _launch_compiled(kernel, grid, (*[pool[i] for i in idx], *after))


def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float):
    """Launch the forward. Returns O (B, Hq, Nq, D) in q's dtype and lse (B, Hq, Nq) fp32 (base 2, scaled)."""
    key = _plan_key("fwd", (q, k, v), causal, sm_scale)
    plan = _plans.get(key)
    if plan is not None:
        o_layout, lse_shape, launches = plan
        o = _empty_like_layout(o_layout, q.dtype, q.device)
        lse = _empty(lse_shape, torch.float32, q.device)
        _replay(launches, (q, k, v, o, lse), q)
        return o, lse
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    o_layout = _layout(q)
    o = _empty_like_layout(o_layout, q.dtype, q.device)  # (B, Hq, Nq, D), laid out like q
    lse = _empty((B, Hq, Nq), torch.float32, q.device)
    group = _lpt_group(k, Nk, B * Hq)
    args = (q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            Hq, Hq // Hkv, Nq, Nk, Nk - Nq, sm_scale * LOG2E, group, _bucket(Nq), _bucket(Nk))
    kwargs = dict(HEAD_DIM=D, BLOCK_D=_block_d(D), CAUSAL=bool(causal), DOT_PRECISION=_dot_precision(q.dtype),
                  TMA=_tma_ok("fwd", k, v), LPT=_lpt(causal, group))
    with _device_guard(q):
        launched = _launch("fwd", Nq, Hq, B, q.dtype, args, kwargs)
    _record(key, (o_layout, (B, Hq, Nq), [_planned("fwd", launched, range(5), args[5:], kwargs)]))
    return o, lse


def _bwd(do, q, k, v, o, lse, causal: bool, sm_scale: float, out=None):
    """Launch the backward (split: dQ, which also stores delta, then dK/dV; fused: delta pass, dK/dV adding dQ,
    dQ pass; see _fused_bwd). Returns dq, dk, dv shaped like q, k, v, written into `out` = (dq, dk, dv) when
    given (views of one packed gradient), else new buffers."""
    key = _plan_key("bwd", (do, q, k, v, o, lse, *(out or ())), causal, sm_scale)
    plan = _plans.get(key)
    if plan is not None:
        delta_shape, layouts, acc_shape, launches = plan
        delta = _empty(delta_shape, torch.float32, q.device)
        acc = delta if acc_shape is None else _empty(acc_shape, torch.float32, q.device)
        dq, dk, dv = out or [_empty_like_layout(lay, q.dtype, q.device) for lay in layouts]
        _replay(launches, (q, k, v, o, do, lse, delta, dq, dk, dv, acc), q)
        return dq, dk, dv
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    BLOCK_D = _block_d(D)
    fused = _fused_bwd()
    delta = _empty((B, Hq, Nq), torch.float32, q.device)
    acc_shape = (B, Hq, Nq, BLOCK_D) if fused else None
    acc = delta if acc_shape is None else _empty(acc_shape, torch.float32, q.device)  # fused: dQ accumulator
    layouts = None
    if out is None:
        layouts = [_layout(t) for t in (q, k, v)]
        dq, dk, dv = [_empty_like_layout(lay, q.dtype, q.device) for lay in layouts]  # laid out like q, k, v
    else:
        dq, dk, dv = out
    kwargs = dict(HEAD_DIM=D, BLOCK_D=BLOCK_D, CAUSAL=bool(causal), DOT_PRECISION=_dot_precision(q.dtype))
    dq_group, dkdv_group = _lpt_group(k, Nk, B * Hq), _lpt_group(q, Nq * (Hq // Hkv), B * Hkv)
    qk_scale = sm_scale * LOG2E
    dkdv_args = (q, k, v, do, lse, delta, dk, dv, acc, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
                 *dk.stride(), *dv.stride(), Hq, Hkv, Hq // Hkv, Nq, Nk, Nk - Nq, qk_scale, sm_scale,
                 dkdv_group, _bucket(Nq), _bucket(Nk))
    dkdv_kwargs = dict(kwargs, TMA=_tma_ok("dkdv", q, do), LPT=_lpt(causal, dkdv_group), GQA=Hq > Hkv,
                       FUSED_DQ=_fused_dq_mode(q.device) if fused else 0)
    # pool order of a replay: q, k, v, o, do, lse, delta, dq, dk, dv, acc (= delta when not fused)
    dkdv_idx = (0, 1, 2, 4, 5, 6, 8, 9, 10)
    if fused:
        rows = dict(HEAD_DIM=D, BLOCK_D=BLOCK_D)
        prep_args = (o, do, delta, acc, *o.stride(), *do.stride(), Hq, Nq)
        out_args = (acc, dq, *dq.stride(), Hq, Nq, sm_scale)
        with _device_guard(q):
            launched = [_launch("prep", Nq, Hq, B, q.dtype, prep_args, rows),
                        _launch("dkdvq", Nk, Hkv, B, q.dtype, dkdv_args, dkdv_kwargs),
                        _launch("dqout", Nq, Hq, B, q.dtype, out_args, rows)]
        launches = [_planned("prep", launched[0], (3, 4, 6, 10), prep_args[4:], rows),
                    _planned("dkdvq", launched[1], dkdv_idx, dkdv_args[9:], dkdv_kwargs),
                    _planned("dqout", launched[2], (10, 7), out_args[2:], rows)]
    else:
        dq_args = (q, k, v, o, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                   *do.stride(), *dq.stride(), Hq, Hq // Hkv, Nq, Nk, Nk - Nq, qk_scale, sm_scale, dq_group,
                   _bucket(Nq), _bucket(Nk))
        dq_kwargs = dict(kwargs, TMA=_tma_ok("dq", k, v), LPT=_lpt(causal, dq_group))
        with _device_guard(q):
            dq_launch = _launch("dq", Nq, Hq, B, q.dtype, dq_args, dq_kwargs)
            dkdv_launch = _launch("dkdv", Nk, Hkv, B, q.dtype, dkdv_args, dkdv_kwargs)  # after dQ: reads its delta
        launches = [_planned("dq", dq_launch, (0, 1, 2, 3, 4, 5, 6, 7), dq_args[8:], dq_kwargs),
                    _planned("dkdv", dkdv_launch, dkdv_idx, dkdv_args[9:], dkdv_kwargs)]
    _record(key, ((B, Hq, Nq), layouts, acc_shape, launches))
    return dq, dk, dv


def _device_guard(t: torch.Tensor):
    """Launch on t's GPU (the kernels run on the current device); no context switch when it is current."""
    if t.device.type != "cuda" or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


# ----------------------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile, with fake implementations) and the autograd formula
# ----------------------------------------------------------------------------------------------------------

# Defined through torch.library's operator registration rather than the @custom_op decorator: the decorator's
# per-call wrappers (dynamo-disable, output aliasing checks) cost ~7 us of CPU per call on top of the dispatcher,
# and in a compiled training step of GPT-2 124M the GPU waits for the host where the step starts.
_LIB = torch.library.Library("flashgpt", "DEF")


def _define(name: str, schema: str, impl, fake):
    """Register flashgpt::name(schema) with `impl` for every device and `fake` for tracing; returns the op."""
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake("flashgpt::" + name, fake, lib=_LIB)
    return getattr(torch.ops.flashgpt, name).default


def _fwd_fake(q, k, v, causal, sm_scale):
    B, Hq, Nq, D = q.shape
    return _fake_like(q), q.new_empty((B, Hq, Nq), dtype=torch.float32)


_flash_attn_fwd_op = _define(
    "flash_attn_fwd", "(Tensor q, Tensor k, Tensor v, bool causal, float sm_scale) -> (Tensor, Tensor)",
    _fwd, _fwd_fake)
_flash_attn_bwd_op = _define(
    "flash_attn_bwd", "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, "
                      "float sm_scale) -> (Tensor, Tensor, Tensor)",
    _bwd, lambda do, q, k, v, o, lse, causal, sm_scale: (_fake_like(q), _fake_like(k), _fake_like(v)))



def _fake_like(t: torch.Tensor) -> torch.Tensor:
    """The fake (meta) twin of the outputs' allocation (_layout): the same shape AND strides as a real launch."""
    shape, perm = _layout(t)
    return t.new_empty(shape).permute(*perm)


def _remember(ctx, saved, causal: bool, sm_scale: float, heads=None) -> None:
    """What every backward here needs: the saved tensors, the mask, the scale (and the packed head counts)."""
    ctx.save_for_backward(*saved)
    ctx.causal = causal
    ctx.sm_scale = sm_scale
    ctx.heads = heads


def _setup_context(ctx, inputs, output):
    q, k, v, causal, sm_scale = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    _remember(ctx, (q, k, v, o, lse), causal, sm_scale)  # beyond the inputs only O and the log-sum-exp


def _backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _flash_attn_bwd_op(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale)
    return dq, dk, dv, None, None


torch.library.register_autograd("flashgpt::flash_attn_fwd", _backward, setup_context=_setup_context, lib=_LIB)


class _FlashAttnFunction(torch.autograd.Function):
    """The eager path: a thin autograd.Function over the same launches (less dispatch overhead per call than
    the custom op, which matters for short sequences where the kernels take tens of microseconds)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        o, lse = _fwd(q, k, v, causal, sm_scale)
        _remember(ctx, (q, k, v, o, lse), causal, sm_scale)
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _bwd(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale)
        return dq, dk, dv, None, None


# ---- packed projections: qkv (B, N, (Hq + 2·Hkv)·D) in, O out; the backward returns d(qkv) in one buffer ----
# A model's fused QKV matmul gives one tensor; q, k, v are views of it. Through flash_attention, autograd
# would concatenate dq, dk, dv into d(qkv) with a copy kernel (a read and a write of the whole gradient per
# layer); here the two backward kernels write their slices of d(qkv) directly.

# A packed call whose launches all have compiled kernels (on a GPU) is also planned by qkv's own signature: the
# launchers then take q, k, v (and dq, dk, dv) as integer addresses at the split's fixed byte offsets, so a
# replay skips building the views (split_qkv) and the per-view plan key.

def _offsets(packed: torch.Tensor, views) -> tuple:
    return tuple(t.data_ptr() - packed.data_ptr() for t in views)


def _record_packed(key, inner_key, offsets: tuple) -> None:
    """Plan a packed call as the per-view plan `inner_key` that its first call recorded, plus the offsets
    (or mark the signature _UNPACKABLE when that plan launches through Triton's JITFunction.run)."""
    inner = _plans.get(inner_key) if key is not None else None
    if inner is not None:
        _record(key, (offsets, *inner) if all(launch[3] is not None for launch in inner[-1]) else _UNPACKABLE)


# The plan recorded for a packed signature whose per-view plan launches through JITFunction.run (the interpreter,
# FLASHGPT_FAST_LAUNCH=0): such calls take the per-view path without trying to record again. Its last item is
# an empty list of launches, so _record accepts it.
_UNPACKABLE = ((),)


def _packed_fwd(qkv, n_head: int, n_kv_head: int, causal: bool, sm_scale: float):
    key = _plan_key("packed_fwd", (qkv,), n_head, n_kv_head, causal, sm_scale)
    plan = _plans.get(key)
    if plan is not None and plan is not _UNPACKABLE:
        offsets, o_layout, lse_shape, launches = plan
        o = _empty_like_layout(o_layout, qkv.dtype, qkv.device)
        lse = _empty(lse_shape, torch.float32, qkv.device)
        at = qkv.data_ptr()
        _replay(launches, (*[at + off for off in offsets], o, lse), qkv)
        return o, lse
    q, k, v = split_qkv(qkv, n_head, n_kv_head)
    o, lse = _fwd(q, k, v, causal, sm_scale)
    if plan is None:
        _record_packed(key, _plan_key("fwd", (q, k, v), causal, sm_scale), _offsets(qkv, (q, k, v)))
    return o, lse


def _packed_bwd(do, qkv, o, lse, n_head: int, n_kv_head: int, causal: bool, sm_scale: float) -> torch.Tensor:
    dqkv = _empty(tuple(qkv.shape), qkv.dtype, qkv.device)  # (B, N, (Hq + 2·Hkv)·D), contiguous
    key = _plan_key("packed_bwd", (do, qkv, o, lse, dqkv), n_head, n_kv_head, causal, sm_scale)
    plan = _plans.get(key)
    if plan is not None and plan is not _UNPACKABLE:
        offsets, delta_shape, _, acc_shape, launches = plan
        delta = _empty(delta_shape, torch.float32, qkv.device)
        acc = delta if acc_shape is None else _empty(acc_shape, torch.float32, qkv.device)
        at, grad_at = qkv.data_ptr(), dqkv.data_ptr()
        _replay(launches, (*[at + off for off in offsets[:3]], o, do, lse, delta,
                           *[grad_at + off for off in offsets[3:]], acc), qkv)
        return dqkv
    q, k, v = split_qkv(qkv, n_head, n_kv_head)
    out = split_qkv(dqkv, n_head, n_kv_head)
    _bwd(do, q, k, v, o, lse, causal, sm_scale, out=out)
    if plan is None:
        _record_packed(key, _plan_key("bwd", (do, q, k, v, o, lse, *out), causal, sm_scale),
                       _offsets(qkv, (q, k, v)) + _offsets(dqkv, out))
    return dqkv


_packed_fwd_op = _define(
    "flash_attn_qkvpacked_fwd", "(Tensor qkv, int n_head, int n_kv_head, bool causal, float sm_scale) "
                                "-> (Tensor, Tensor)",
    _packed_fwd, lambda qkv, n_head, n_kv_head, causal, sm_scale: _fwd_fake(
        split_qkv(qkv, n_head, n_kv_head)[0], None, None, causal, sm_scale))
_packed_bwd_op = _define(
    "flash_attn_qkvpacked_bwd", "(Tensor do, Tensor qkv, Tensor o, Tensor lse, int n_head, int n_kv_head, "
                                "bool causal, float sm_scale) -> Tensor",
    _packed_bwd, lambda do, qkv, o, lse, n_head, n_kv_head, causal, sm_scale: qkv.new_empty(qkv.shape))


def _packed_setup_context(ctx, inputs, output):
    qkv, n_head, n_kv_head, causal, sm_scale = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    _remember(ctx, (qkv, o, lse), causal, sm_scale, heads=(n_head, n_kv_head))


def _packed_backward(ctx, do, dlse):
    qkv, o, lse = ctx.saved_tensors
    dqkv = _packed_bwd_op(do, qkv, o, lse, *ctx.heads, ctx.causal, ctx.sm_scale)
    return dqkv, None, None, None, None


torch.library.register_autograd("flashgpt::flash_attn_qkvpacked_fwd", _packed_backward,
                                setup_context=_packed_setup_context, lib=_LIB)


class _FlashAttnQKVPackedFunction(torch.autograd.Function):
    """The eager path of flash_attention_qkvpacked (as _FlashAttnFunction for flash_attention)."""

    @staticmethod
    def forward(ctx, qkv, n_head, n_kv_head, causal, sm_scale):
        o, lse = _packed_fwd(qkv, n_head, n_kv_head, causal, sm_scale)
        _remember(ctx, (qkv, o, lse), causal, sm_scale, heads=(n_head, n_kv_head))
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        qkv, o, lse = ctx.saved_tensors
        return _packed_bwd(do, qkv, o, lse, *ctx.heads, ctx.causal, ctx.sm_scale), None, None, None, None


def flash_attention_qkvpacked(qkv: torch.Tensor, n_head: int, n_kv_head: int | None = None, *,
                              causal: bool = True, sm_scale: float | None = None) -> torch.Tensor:
    """flash_attention over the views q, k, v = split_qkv(qkv, n_head, n_kv_head) of one packed projection.

    qkv: (B, N, (Hq + 2·Hkv)·D) (per token: all query heads, then the key heads, then the value heads);
    n_kv_head defaults to n_head. Returns (B, Hq, N, D) in qkv's dtype, exactly flash_attention's result;
    its gradient w.r.t. qkv is written by the backward kernels into one (B, N, (Hq + 2·Hkv)·D) buffer.
    """
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    q, k, v = split_qkv(qkv, n_head, n_kv_head)
    scale = _validate(q, k, v, sm_scale)
    if torch.compiler.is_compiling():
        o, _ = _packed_fwd_op(qkv, n_head, n_kv_head, bool(causal), scale)
        return o
    return _FlashAttnQKVPackedFunction.apply(qkv, n_head, n_kv_head, bool(causal), scale)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    sm_scale: float | None = None) -> torch.Tensor:
    """softmax(Q Kᵀ · sm_scale + mask) V with the FlashAttention kernels; see the module docstring.

    q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D), Hq % Hkv == 0. Returns (B, Hq, Nq, D) in q's dtype.
    Eager calls go through a torch.autograd.Function; under torch.compile the custom op is traced instead.
    """
    scale = _validate(q, k, v, sm_scale)
    if torch.compiler.is_compiling():
        o, _ = _flash_attn_fwd_op(q, k, v, bool(causal), scale)
        return o
    return _FlashAttnFunction.apply(q, k, v, bool(causal), scale)


__all__ = ["flash_attention", "flash_attention_qkvpacked", "forced_configs", "gpu_configs", "SUPPORTED_DTYPES",
           "MAX_HEAD_DIM"]
