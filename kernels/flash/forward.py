"""The forward kernel: O and the row log-sum-exp of softmax(Q Kᵀ · scale + mask) V, one query tile per program.

The online softmax (running max m, running sum l, running output acc, rescaled by exp2(m_old - m_new) when the
max grows) streams K and V in BLOCK_N-row blocks past a Q tile held on chip, in base 2 with the scale folded
into one multiply. Under a causal mask the key blocks come in three kinds: fully visible (an unmasked loop),
crossing the diagonal (a masked loop) and fully hidden (never loaded). Launched by kernels/flash/launch.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import _triton
from .blocks import _key_blocks, _key_range, _kv_descriptors, _query_tile


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               lo, hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d, row_lo, row_hi,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
               WINDOW: tl.constexpr, VARLEN: tl.constexpr):
    """Stream key/value blocks [lo, hi) through the online softmax of one query tile.

    MASKED=False: every key of every block is visible (no bounds or causal checks at all).
    MASKED=True: blocks that cross the causal diagonal, the window's edge, a document boundary (row_lo, row_hi:
    the rows' document bounds, VARLEN) or the Nk tail; hidden scores become -inf.
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
            if WINDOW > 0:
                visible = visible & (cols[None, :] > offs_m[:, None] + offset - WINDOW)
            if VARLEN:  # under the causal mask only keys of earlier documents remain to be hidden
                visible = visible & (cols[None, :] >= row_lo[:, None])
                if not CAUSAL:
                    visible = visible & (cols[None, :] < row_hi[:, None])
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


# Scalars are not specialised (no ==1 / %16 variants): one compiled kernel serves every length and head count.
@triton.jit(do_not_specialize=["Hq", "GROUP", "Nq", "Nk", "offset", "lpt_group", "q_bucket", "k_bucket"])
def _attn_fwd(Q, K, V, O, LSE, DOCS,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              Hq, GROUP, Nq, Nk, offset, qk_scale, lpt_group, q_bucket, k_bucket,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
              DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, LPT: tl.constexpr,
              WINDOW: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Forward: O (and the row log-sum-exp LSE, base 2, scaled) of BLOCK_M query rows of one (batch, query head).

    Supports fp16, bf16 and fp32 Q/K/V (one dtype; fp32 accumulation), HEAD_DIM 1..256 padded to BLOCK_D (a power
    of two >= 16), any Nq, Nk >= 1, causal (bottom-right aligned, offset = Nk - Nq) or not, GQA via GROUP =
    Hq // Hkv, any strides (TMA: K/V through descriptors, needs 16-byte aligned rows). grid: _query_tile.
    WINDOW > 0 (causal only): query i sees keys j with i + offset - WINDOW < j <= i + offset. VARLEN (Nq = Nk):
    query i sees only the keys of its document, DOCS[b, 0, i] <= j < DOCS[b, 1, i] (DOCS: (B, 2, N) int32,
    contiguous; None otherwise, which leaves it out of the compiled signature). Key blocks outside a tile's
    range are never loaded (blocks._key_range).
    """
    pid_m, h, b = _query_tile(Nq, Hq, lpt_group, CAUSAL, LPT, BLOCK_M)
    bh = b * Hq + h
    hk = h // GROUP  # kv head of this query head
    start_m = pid_m * BLOCK_M

    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    k_base, v_base = _kv_descriptors(k_base, v_base, Nk, stride_kn, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)

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

    if WINDOW > 0 or VARLEN:
        # keys [lo, hi) of which [full_lo, full_hi) need no mask (blocks._key_range)
        docs_base = DOCS  # None without documents
        row_lo = offs_m
        row_hi = offs_m
        if VARLEN:
            docs_base = DOCS + b.to(tl.int64) * 2 * Nk
            row_lo = tl.load(docs_base + offs_m, mask=row_ok, other=0)  # (BLOCK_M,) document bounds of the rows
            row_hi = tl.load(docs_base + Nk + offs_m, mask=row_ok, other=Nk)
        lo, full_lo, full_hi, hi = _key_range(start_m, Nq, Nk, offset, docs_base, CAUSAL, WINDOW, VARLEN,
                                              BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                   lo, full_lo, Nk, offset, qk_scale, offs_m, offs_n, offs_d, row_lo, row_hi,
                                   True, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, WINDOW, VARLEN)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                   full_lo, full_hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d, row_lo, row_hi,
                                   False, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, WINDOW, VARLEN)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                   full_hi, hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d, row_lo, row_hi,
                                   True, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, WINDOW, VARLEN)
    else:
        # key blocks [0, full_hi) need no mask; [full_hi, hi) cross the diagonal and/or the Nk tail
        full_hi, hi = _key_blocks(start_m, Nk, offset, CAUSAL, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                   0, full_hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d, offs_m, offs_m,
                                   False, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, WINDOW, VARLEN)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                   full_hi, hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d, offs_m, offs_m,
                                   True, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, WINDOW, VARLEN)

    # rows that saw no key (causal with Nq > Nk): output 0 and lse = +inf, so the backward's P is exactly 0
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(l_safe))  # (BLOCK_M,) base-2, scaled
    o = acc / l_safe[:, None]  # (BLOCK_M, BLOCK_D)
    tl.store(LSE + bh.to(tl.int64) * Nq + offs_m, lse, mask=row_ok)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


_triton.check_decorated(_attn_fwd)
