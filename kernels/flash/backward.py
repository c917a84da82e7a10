"""The backward kernels: dQ, dK, dV of softmax(Q Kᵀ · scale + mask) V from the forward's O and log-sum-exp.

Split backward (the default): _attn_bwd_dq, one program per query tile looping over the key blocks, which
also stores each row's delta = rowsum(dO * O); then _attn_bwd_dkdv, one program per key tile looping over the
query heads of its GQA group and the query blocks, recomputing P = exp2(S * scale - lse) tile by tile
(deterministic, no atomics). Fused backward: _attn_bwd_prep (delta, and zeros into an fp32 dQ accumulator),
_attn_bwd_dkdv with FUSED_DQ adding each tile's dS K into that accumulator with atomics, _attn_bwd_dq_out
(dQ from the accumulator). Every kernel skips hidden causal blocks and masks only the diagonal ones.
Launched by kernels/flash/launch.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import _triton
from .blocks import _key_blocks, _key_range, _kv_descriptors, _lpt_tile, _query_range, _query_tile


@triton.jit
def _rotate_back(x, cos_base, sin_base, rows, row_ok, stride_cn, offs_d, DT: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """RoPE's transposed rotation of a gradient tile (ROPE): x (BLOCK_R, BLOCK_D) fp32, the gradient w.r.t.
    rows of rotated q or k (head dim exactly BLOCK_D, in the rotate-half layout) → the gradient w.r.t. the
    rows before the rotation, fp32. cos_base, sin_base: the tables' rows of this batch row ((N, BLOCK_D),
    row stride stride_cn, unit stride along the head dim), read at the tile's positions `rows`, rounded to DT
    (the inputs' dtype, as the forward's rotation rounds them). The forward turns halves (x1, x2) into
    (x1·c1 − x2·s1, x2·c2 + x1·s2), so with z = x·sin the way back is x·cos + (z2, −z1)."""
    tab = rows[:, None].to(tl.int64) * stride_cn + offs_d[None, :]  # (BLOCK_R, BLOCK_D)
    c = tl.load(cos_base + tab, mask=row_ok[:, None], other=0.0).to(DT).to(tl.float32)
    s = tl.load(sin_base + tab, mask=row_ok[:, None], other=0.0).to(DT).to(tl.float32)
    z = tl.permute(tl.reshape(x * s, (BLOCK_R, 2, BLOCK_D // 2)), (0, 2, 1))  # (BLOCK_R, BLOCK_D/2, 2)
    z1, z2 = tl.split(z)  # (BLOCK_R, BLOCK_D/2) each: lanes i and i + D/2
    z = tl.reshape(tl.permute(tl.join(z2, -z1), (0, 2, 1)), (BLOCK_R, BLOCK_D))  # (z2, −z1) along the head dim
    return x * c + z


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                lo, hi, GROUP, Nq, offset, qk_scale, offs_n, offs_d, key_lo, key_hi,
                MASK: tl.constexpr, GQA: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, FUSED_DQ: tl.constexpr,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr):
    """Accumulate dK, dV of one key tile over query blocks [lo, hi) of each of the GROUP query heads that
    read it (GQA; 1 otherwise), in one flat loop: head g = step // blocks. (A loop over the heads around
    this one kept the accumulators of both loops live: 255 registers and spills on sm_90.)

    Works transposed (keys along rows): sT = K Qᵀ is (BLOCK_N, BLOCK_M). MASK: 0 = full query blocks, no checks;
    1 = the Nq tail (rows past Nq load as q = dO = 0 with lse = +inf, so their P is 0); 2 = blocks that cross
    the causal diagonal, the window's edge (WINDOW) or a document boundary (VARLEN: key_lo, key_hi are the
    document bounds of the tile's keys), masked, with the row checks of 1. q_base, do_base, lse_base,
    delta_base address the group's first query head (head g at + g * stride_qh, ..., + g * Nq for lse and
    delta). TMA: q_base, do_base are
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
            if CAUSAL:
                visible = offs_n[:, None] <= offs_m[None, :] + offset  # key j <= query i + offset
            else:  # (documents without the causal mask) query i at or after key j's document start
                visible = offs_m[None, :] >= key_lo[:, None]
            if WINDOW > 0:
                visible = visible & (offs_n[:, None] > offs_m[None, :] + offset - WINDOW)
            if VARLEN:  # query i before the end of key j's document (causal: its start is then implied)
                visible = visible & (offs_m[None, :] < key_hi[:, None])
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
            # (not as (Kᵀ dSᵀ)ᵀ: Triton 3.6 miscompiled that form with one tile config, bench/NOTES.md)
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
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, DQACC, DOCS, COS, SIN,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd, stride_cb, stride_cn,
                   Hq, Hkv, GROUP, Nq, Nk, offset, qk_scale, sm_scale, lpt_group, q_bucket, k_bucket,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, LPT: tl.constexpr, GQA: tl.constexpr,
                   FUSED_DQ: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, ROPE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK, dV of BLOCK_N key rows of one (batch, kv head), summed over the GROUP query heads that read them.

    Same support as _attn_fwd (dtypes, HEAD_DIM, any Nq/Nk, both masks, WINDOW, VARLEN with DOCS, GQA, strides;
    TMA: Q/dO through descriptors). Needs DELTA = rowsum(O * dO): from _attn_bwd_dq, which runs first, or
    (FUSED_DQ) from _attn_bwd_prep. FUSED_DQ (1: element atomics, 2: TMA reduce-add per tile, Hopper+): dQ
    too, accumulated unscaled in DQACC ((B, Hq, Nq, BLOCK_D) fp32, zeroed by _attn_bwd_prep) with atomic adds —
    5 matmuls per tile instead of the two kernels' 7, but the summation order, and so the last bits of dQ, vary
    from run to run; _attn_bwd_dq_out writes dQ from it. ROPE (HEAD_DIM == BLOCK_D, Nq == Nk): Q and K were
    rotated by RoPE before the forward; dK is stored rotated back (_rotate_back with COS, SIN: (B | 1, Nk,
    HEAD_DIM) tables, batch stride stride_cb, 0 for tables shared by the batch), the gradient w.r.t. the keys
    before the rotation.
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

    if WINDOW > 0 or VARLEN:
        docs_base = DOCS  # None without documents
        if VARLEN:
            docs_base = DOCS + b.to(tl.int64) * 2 * Nk
        # query blocks: [lo, full_lo) and [full_hi, hi) masked (with row checks), [full_lo, full_hi) no checks
        lo, full_lo, full_hi, hi = _query_range(start_n, Nq, Nk, offset, docs_base, CAUSAL, WINDOW, VARLEN,
                                                BLOCK_M, BLOCK_N)
        key_lo = offs_n
        key_hi = offs_n
        if VARLEN:
            key_lo = tl.load(docs_base + offs_n, mask=n_ok, other=0)  # (BLOCK_N,) document bounds of the keys
            key_hi = tl.load(docs_base + Nk + offs_n, mask=n_ok, other=0)
    else:
        key_lo = offs_n
        key_hi = offs_n
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
    if WINDOW > 0 or VARLEN:
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                             stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                             lo, full_lo, GROUP, Nq, offset, qk_scale, offs_n, offs_d, key_lo, key_hi,
                             2, GQA, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, FUSED_DQ, CAUSAL, WINDOW, VARLEN)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                             stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                             full_lo, full_hi, GROUP, Nq, offset, qk_scale, offs_n, offs_d, key_lo, key_hi,
                             0, GQA, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, FUSED_DQ, CAUSAL, WINDOW, VARLEN)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                             stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                             full_hi, hi, GROUP, Nq, offset, qk_scale, offs_n, offs_d, key_lo, key_hi,
                             2, GQA, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, FUSED_DQ, CAUSAL, WINDOW, VARLEN)
    else:
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                             stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                             tail_lo, m_end, GROUP, Nq, offset, qk_scale, offs_n, offs_d, key_lo, key_hi,
                             1, GQA, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, FUSED_DQ, CAUSAL, WINDOW, VARLEN)
        if CAUSAL:
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                                 stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                                 lo, full_lo, GROUP, Nq, offset, qk_scale, offs_n, offs_d, key_lo, key_hi,
                                 2, GQA, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, FUSED_DQ, CAUSAL, WINDOW,
                                 VARLEN)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base,
                             stride_qh, stride_qm, stride_qd, stride_doh, stride_dom, stride_dod,
                             full_lo, m_full, GROUP, Nq, offset, qk_scale, offs_n, offs_d, key_lo, key_hi,
                             0, GQA, BLOCK_M, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, FUSED_DQ, CAUSAL, WINDOW, VARLEN)
    # The stores' mask (kv_mask's values) computed anew after the loops: reusing kv_mask, the K/V loads', kept its
    # per-row predicates live through the loops, and ptxas (sm_90) spilled in the main loop for them.
    out_ok = tl.arange(0, BLOCK_N) < Nk - start_n  # (BLOCK_N,) == n_ok
    out_mask = out_ok[:, None] & d_ok[None, :]
    # dV first: its accumulator is dead while dK is rotated back (ROPE), whose tables take registers too
    tl.store(DV + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh
             + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
             mask=out_mask)
    dk = dk * sm_scale  # dS was taken w.r.t. the scaled scores
    if ROPE:
        cos_base = COS + b.to(tl.int64) * stride_cb
        sin_base = SIN + b.to(tl.int64) * stride_cb
        dk = _rotate_back(dk, cos_base, sin_base, offs_n, out_ok, stride_cn, offs_d, Q.dtype.element_ty, BLOCK_N,
                          BLOCK_D)
    tl.store(DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
             + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
             mask=out_mask)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
              lo, hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d, row_lo, row_hi,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
              WINDOW: tl.constexpr, VARLEN: tl.constexpr):
    """Accumulate dQ of one query tile over key blocks [lo, hi); MASKED, row_lo, row_hi and TMA as in
    _fwd_inner."""
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
            if WINDOW > 0:
                visible = visible & (cols[None, :] > offs_m[:, None] + offset - WINDOW)
            if VARLEN:
                visible = visible & (cols[None, :] >= row_lo[:, None])
                if not CAUSAL:
                    visible = visible & (cols[None, :] < row_hi[:, None])
            s = tl.where(visible, s * qk_scale, float("-inf"))
            p = tl.math.exp2(s - lse[:, None])  # (BLOCK_M, BLOCK_N)
        else:
            p = tl.math.exp2(s * qk_scale - lse[:, None])
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_D)
    return dq


@triton.jit(do_not_specialize=["Hq", "GROUP", "Nq", "Nk", "offset", "lpt_group", "q_bucket", "k_bucket"])
def _attn_bwd_dq(Q, K, V, O, DO, LSE, DELTA, DQ, DOCS, COS, SIN,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_ob, stride_oh, stride_om, stride_od,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd, stride_cb, stride_cn,
                 Hq, GROUP, Nq, Nk, offset, qk_scale, sm_scale, lpt_group, q_bucket, k_bucket,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, LPT: tl.constexpr,
                 WINDOW: tl.constexpr, VARLEN: tl.constexpr, ROPE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ of BLOCK_M query rows, and the rows' delta = rowsum(O * dO) in fp32 (the softmax backward's row term),
    computed here from the tiles this program loads anyway and stored to DELTA for the dK/dV kernel, which
    runs after this one (no separate delta pass over O and dO).

    Same support as _attn_fwd (dtypes, HEAD_DIM, any Nq/Nk, both masks, WINDOW, VARLEN with DOCS, GQA, strides).
    ROPE: dQ stored rotated back, as dK in _attn_bwd_dkdv. grid: as the forward's (_query_tile)."""
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
    k_base, v_base = _kv_descriptors(k_base, v_base, Nk, stride_kn, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if WINDOW > 0 or VARLEN:  # the forward's key ranges and masks
        docs_base = DOCS  # None without documents
        row_lo = offs_m
        row_hi = offs_m
        if VARLEN:
            docs_base = DOCS + b.to(tl.int64) * 2 * Nk
            row_lo = tl.load(docs_base + offs_m, mask=row_ok, other=0)  # (BLOCK_M,)
            row_hi = tl.load(docs_base + Nk + offs_m, mask=row_ok, other=Nk)
        lo, full_lo, full_hi, hi = _key_range(start_m, Nq, Nk, offset, docs_base, CAUSAL, WINDOW, VARLEN,
                                              BLOCK_M, BLOCK_N)
        dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       lo, full_lo, Nk, offset, qk_scale, offs_m, offs_n, offs_d, row_lo, row_hi,
                       True, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, WINDOW, VARLEN)
        dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       full_lo, full_hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d, row_lo, row_hi,
                       False, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, WINDOW, VARLEN)
        dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       full_hi, hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d, row_lo, row_hi,
                       True, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, WINDOW, VARLEN)
    else:
        full_hi, hi = _key_blocks(start_m, Nk, offset, CAUSAL, BLOCK_M, BLOCK_N)  # as the forward's
        dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       0, full_hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d, offs_m, offs_m,
                       False, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, WINDOW, VARLEN)
        dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       full_hi, hi, Nk, offset, qk_scale, offs_m, offs_n, offs_d, offs_m, offs_m,
                       True, CAUSAL, BLOCK_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, TMA, WINDOW, VARLEN)
    dq = dq * sm_scale
    if ROPE:
        dq = _rotate_back(dq, COS + b.to(tl.int64) * stride_cb, SIN + b.to(tl.int64) * stride_cb, offs_m, row_ok,
                          stride_cn, offs_d, Q.dtype.element_ty, BLOCK_M, BLOCK_D)
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
def _attn_bwd_dq_out(DQACC, DQ, COS, SIN, stride_dqb, stride_dqh, stride_dqm, stride_dqd, stride_cb, stride_cn,
                     Hq, Nq, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROPE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The fused backward's last pass: dQ = sm_scale * DQACC (fp32, (B, Hq, Nq, BLOCK_D), contiguous) in DQ's
    dtype and strides, for BLOCK_M rows of one (batch, head); ROPE: rotated back as in _attn_bwd_dq. BLOCK_N is
    unused. grid: (cdiv(Nq, BLOCK_M), Hq, B)."""
    pid_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Nq
    acc = tl.load(DQACC + ((b * Hq + h).to(tl.int64) * Nq + offs_m[:, None]) * BLOCK_D + offs_d[None, :],
                  mask=row_ok[:, None], other=0.0)  # (BLOCK_M, BLOCK_D)
    acc = acc * sm_scale
    if ROPE:
        acc = _rotate_back(acc, COS + b.to(tl.int64) * stride_cb, SIN + b.to(tl.int64) * stride_cb, offs_m, row_ok,
                           stride_cn, offs_d, DQ.dtype.element_ty, BLOCK_M, BLOCK_D)
    tl.store(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
             + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd, acc.to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


_triton.check_decorated(_attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_prep, _attn_bwd_dq_out)
