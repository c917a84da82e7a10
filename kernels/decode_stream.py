"""Stream-K decode attention: the key blocks of every (sequence, kv head, row block) laid end to end and dealt
out in equal contiguous ranges to a fixed grid of programs, so that every program reads the same number of
cache blocks whatever the batch, the heads and the lengths.

    stream_decode(q, k_cache, v_cache, cache_lens, out, *, scale, tile, block_m, programs)

Called by kernels.decode.decode_attention under the option decode_split_order = "stream" (automatic split
count only), after its checks; the contract is decode_attention's (see kernels/decode.py):
    q        (B, Hq, Nq, D)        Nq <= 16 new tokens per sequence
    k_cache  (B, Hkv, max_len, D)  v_cache the same shape; Hq a multiple of Hkv (MHA, GQA, MQA)
    cache_lens (B,) int32/int64    valid positions per sequence including the Nq new tokens, clamped on the
                                   device into [0, max_len]; causal, bottom-right aligned
    dtypes   float16, bfloat16, float32 (float32 dots exact); head dim 16..256, padded to a power of two
    batch    B <= STREAM_MAX_BATCH (the per-sequence block counts are one vector of a program)

Why: the split kernel gives each (sequence, kv head, row block) the same number of split programs, so the
grid's programs spread over the SMs only as evenly as their count divides: batch 16 of GPT-2's 12 heads has
192 rows of work for 132 SMs, and one or two splits of them leave some SMs a third more bytes than others.
Here the T = sum over rows of ceil(L_b / BLOCK_N) blocks (at least one per row) are cut into `programs`
ranges [p * T // P, (p + 1) * T // P) on the device, from the lengths of this call, so the plan stays right
inside a CUDA graph whose lengths change at every replay.

Program p walks the rows its range touches (usually one to three), and each row's blocks in the range in an
inner loop (the split kernel's), then writes the row:
    - the whole row in this range: the output itself (OUT);
    - part of it: a part (the normalised partial output, fp32, and its log-sum-exp) in slot 2p (the range's
      first row) or 2p + 1 (its last row); only these two rows of a range can be partial.
The merge kernel then finds, for each output row whose blocks span programs q0 < ... < q1, its parts in
slots 2 q0 + (0 if q0's range starts at the row, else 1), 2 (q0 + 1), ..., 2 q1, and merges them by their
log-sum-exps as the split kernel's merge does (programs with an empty range, where P > T, are skipped); a row
held by one program is left alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _triton
from .decode import _attend_block, _cdiv, _launch, _next_pow2
from .pdl import pdl_enabled

STREAM_MAX_BATCH = 1024  # sequences per call: their block counts are one vector in every program
MERGE_TILE = 16          # parts the merge kernel reads per step


@triton.jit
def _stream_layout(LENS, B, MAX_LEN, ROWS_PER_SEQ, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """Per sequence (BLOCK_B,): its valid length, its key blocks per row (at least 1), and the first of its
    rows' blocks in the stream (int64); and T, the blocks of all rows. ROWS_PER_SEQ = H_KV * row blocks."""
    idx = tl.arange(0, BLOCK_B)
    seq_ok = idx < B
    lens = tl.load(LENS + idx, mask=seq_ok, other=0).to(tl.int32)
    lens = tl.minimum(tl.maximum(lens, 0), MAX_LEN)                             # (BLOCK_B,)
    nblk = tl.where(seq_ok, tl.maximum(tl.cdiv(lens, BLOCK_N), 1), 0).to(tl.int64)
    sizes = nblk * ROWS_PER_SEQ                                                 # (BLOCK_B,) blocks per sequence
    ends = tl.cumsum(sizes, 0)
    return lens, nblk, ends - sizes, tl.sum(sizes, 0)


@triton.jit
def _pick(values, idx, b):
    """values[b] of a (BLOCK_B,) vector, as a scalar."""
    return tl.sum(tl.where(idx == b, values, 0), 0)


@triton.jit(do_not_specialize=["B", "MAX_LEN", "ROWS_PER_SEQ", "PROGRAMS"])
def _stream_decode_kernel(
        Q, K, V, LENS, O_PART, LSE, OUT,
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_on, stride_od,
        qk_scale, B, MAX_LEN, ROWS_PER_SEQ, PROGRAMS,
        N_Q: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_BLOCKS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
        DOT: tl.constexpr, PRECISION: tl.constexpr, USE_GDC: tl.constexpr):
    """grid = (PROGRAMS,): program p attends the stream's blocks [p * T // P, (p + 1) * T // P).

    A row of the stream is (sequence b, kv head h_kv, row block rb): BLOCK_M of the kv head's GROUP * N_Q query
    rows (row r: query head h_kv * GROUP + r // N_Q, new token r % N_Q), over ceil(L_b / BLOCK_N) key blocks
    (one when L_b = 0: it sees no key and writes 0). Supports what kernels/decode.py's split kernel supports:
    float16 / bfloat16 / float32, HEAD_DIM <= BLOCK_D <= 256, N_Q <= 16, GQA, any strides; keys at or past
    L_b, and keys after a query's own position, are masked (never read into the result, NaN allowed there).
    Writes OUT (B, Hq, N_Q, HEAD_DIM) for rows wholly in the range, else a part: O_PART (2 P * BLOCK_M,
    HEAD_DIM) fp32 normalised and LSE (2 P * BLOCK_M,) fp32 (log2 units), slot 2p or 2p + 1 (module docstring).
    USE_GDC: programmatic dependent launch, as the split kernel.
    """
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK_B)
    lens, nblk, starts, total = _stream_layout(LENS, B, MAX_LEN, ROWS_PER_SEQ, BLOCK_N, BLOCK_B)
    lo = (pid * total // PROGRAMS).to(tl.int32)
    hi = ((pid + 1) * total // PROGRAMS).to(tl.int32)

    if lo >= hi:
        return  # more programs than blocks: an empty range
    # the range's stream rows g = b * ROWS_PER_SEQ + (h_kv * ROW_BLOCKS + rb), from the one holding block lo to
    # the one holding block hi - 1
    b_lo = tl.sum((starts + nblk * ROWS_PER_SEQ <= lo).to(tl.int64), 0)
    b_hi = tl.sum((starts + nblk * ROWS_PER_SEQ <= hi - 1).to(tl.int64), 0)
    g_lo = b_lo * ROWS_PER_SEQ + (lo - _pick(starts, idx, b_lo)) // _pick(nblk, idx, b_lo)
    g_hi = b_hi * ROWS_PER_SEQ + (hi - 1 - _pick(starts, idx, b_hi)) // _pick(nblk, idx, b_hi)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for g in range(g_lo, g_hi + 1):
        b = g // ROWS_PER_SEQ
        row = g % ROWS_PER_SEQ                                                  # h_kv * ROW_BLOCKS + rb
        n = _pick(nblk, idx, b)                                                 # the row's key blocks
        row_start = _pick(starts, idx, b) + row * n                             # its first block in the stream
        L = _pick(lens, idx, b)
        h_kv = row // ROW_BLOCKS
        rows = (row % ROW_BLOCKS) * BLOCK_M + offs_m                            # (BLOCK_M,) rows of the kv head
        row_ok = rows < GROUP * N_Q
        h_q = h_kv * GROUP + rows // N_Q
        i_q = rows % N_Q
        q = tl.load(Q + b * stride_qb + h_q[:, None] * stride_qh + i_q[:, None] * stride_qn
                    + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        Kb = K + b * stride_kb + h_kv * stride_kh
        Vb = V + b * stride_vb + h_kv * stride_vh
        j_lo = (tl.maximum(lo, row_start) - row_start).to(tl.int32)             # the row's blocks in the range
        j_hi = (tl.minimum(hi, row_start + n) - row_start).to(tl.int32)         # (int32: a 32-bit inner loop)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)                      # running max (log2 units)
        l_i = tl.zeros([BLOCK_M], tl.float32)                                   # running sum of 2^(s - m)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)                          # running sum of 2^(s - m) v
        for start in range(j_lo * BLOCK_N, j_hi * BLOCK_N, BLOCK_N):
            acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, Kb, Vb, start, L, L - N_Q + i_q, offs_n, offs_d,
                                          d_ok, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, DOT,
                                          PRECISION)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]                      # rows with no key: 0
        if (j_lo == 0) & (j_hi == n.to(tl.int32)):                                           # the whole row: the output
            tl.store(OUT + b * stride_ob + h_q[:, None] * stride_oh + i_q[:, None] * stride_on
                     + offs_d[None, :] * stride_od, o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:                                                                   # a part: slot 2p or 2p + 1
            part = (2 * pid + (row_start > lo).to(tl.int64)) * BLOCK_M + offs_m  # (BLOCK_M,)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
            tl.store(LSE + part, lse, mask=row_ok)
            tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["B", "MAX_LEN", "ROWS_PER_SEQ", "PROGRAMS"])
def _stream_merge_kernel(O_PART, LSE, OUT, LENS, stride_ob, stride_oh, stride_on, stride_od,
                         B, MAX_LEN, ROWS_PER_SEQ, PROGRAMS,
                         H_Q: tl.constexpr, N_Q: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         ROW_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, TILE_S: tl.constexpr,
                         USE_GDC: tl.constexpr):
    """grid = (B * H_Q * N_Q,): one output row's parts merged into OUT, if its blocks span several programs.

    The row's stream row (b, kv head, row block) holds blocks [s, s + n) of the stream; the programs holding
    its first and last block are q0 and q1 (the inverse of the kernel's ranges: block x lies in program
    ((x + 1) * P - 1) // T); programs between them with empty ranges (P > T) wrote nothing and are skipped.
    Parts are read TILE_S at a time, merged by their log-sum-exps (weight 0 for -inf).
    """
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    out_row = tl.program_id(0).to(tl.int64)
    b, h, i = out_row // (H_Q * N_Q), (out_row // N_Q) % H_Q, out_row % N_Q
    r = (h % GROUP) * N_Q + i                                                   # row within the kv head
    idx = tl.arange(0, BLOCK_B)
    lens, nblk, starts, total = _stream_layout(LENS, B, MAX_LEN, ROWS_PER_SEQ, BLOCK_N, BLOCK_B)
    n = _pick(nblk, idx, b)
    s = _pick(starts, idx, b) + ((h // GROUP) * ROW_BLOCKS + r // BLOCK_M) * n
    q0 = ((s + 1) * PROGRAMS - 1) // total
    q1 = ((s + n) * PROGRAMS - 1) // total
    if q0 == q1:
        return  # the whole row lay in one program's range, which wrote it
    first = (q0 * total // PROGRAMS < s).to(tl.int64)  # q0's range starts before the row: its second slot
    offs_t = tl.arange(0, TILE_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m = tl.full([1], float("-inf"), tl.float32)                                 # running max of lse
    denom = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, BLOCK_D], tl.float32)
    for t0 in range(q0, q1 + 1, TILE_S):
        qs = t0 + offs_t                                                        # (TILE_S,) programs
        ok = (qs <= q1) & (qs * total // PROGRAMS < (qs + 1) * total // PROGRAMS)  # an empty range wrote nothing
        slot = 2 * qs + tl.where(qs == q0, first, 0)
        parts = slot * BLOCK_M + r % BLOCK_M
        lse = tl.load(LSE + parts, mask=ok, other=float("-inf"))                # (TILE_S,)
        o = tl.load(O_PART + parts[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=(ok & (lse > float("-inf")))[:, None] & d_ok[None, :], other=0.0)  # (TILE_S, BLOCK_D)
        m_new = tl.maximum(m, tl.max(lse, 0))                                   # (1,)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse[None, :] - m_ref[:, None])                              # (1, TILE_S)
        denom = denom * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o[None, :, :], 1)
        m = m_new
    merged = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]                 # (1, BLOCK_D)
    tl.store(OUT + b * stride_ob + h * stride_oh + i * stride_on + offs_d[None, :] * stride_od,
             merged.to(OUT.dtype.element_ty), mask=d_ok[None, :])


_triton.check_decorated(_stream_decode_kernel, _stream_merge_kernel)


def stream_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lens: torch.Tensor,
                  out: torch.Tensor, *, scale: float, tile, block_m: int, programs: int) -> torch.Tensor:
    """The stream-K decode of checked inputs (kernels.decode.decode_attention's checks) into `out`, with
    `programs` programs, the split kernel's tile config and block_m query rows per program step."""
    B, Hq, Nq, D = q.shape
    Hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    block_d = _next_pow2(D)
    row_blocks = _cdiv(group * Nq, block_m)
    block_b = max(_next_pow2(B), 2)
    o_part = _triton.empty((2 * programs * block_m, D), torch.float32, q.device)
    lse = _triton.empty((2 * programs * block_m,), torch.float32, q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    pdl = pdl_enabled(q.device)
    gdc = dict(launch_pdl=True) if pdl else {}
    with _triton.device_guard(q):
        _launch(_stream_decode_kernel, (programs, 1, 1), (q, k_cache, v_cache, cache_lens, o_part, lse, out),
                (*q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
                 scale * _triton.LOG2E, B, max_len, Hkv * row_blocks, programs),
                dict(N_Q=Nq, GROUP=group, HEAD_DIM=D, ROW_BLOCKS=row_blocks, BLOCK_M=block_m,
                     BLOCK_N=tile.block_n, BLOCK_D=block_d, BLOCK_B=block_b, DOT=tile.dot, PRECISION=precision,
                     USE_GDC=pdl),
                dict(num_warps=tile.num_warps, num_stages=tile.num_stages, **gdc))
        _launch(_stream_merge_kernel, (B * Hq * Nq, 1, 1), (o_part, lse, out, cache_lens),
                (*out.stride(), B, max_len, Hkv * row_blocks, programs),
                dict(H_Q=Hq, N_Q=Nq, GROUP=group, HEAD_DIM=D, ROW_BLOCKS=row_blocks, BLOCK_M=block_m,
                     BLOCK_N=tile.block_n, BLOCK_D=block_d, BLOCK_B=block_b, TILE_S=MERGE_TILE, USE_GDC=pdl),
                dict(num_warps=4, **gdc))
    return out


__all__ = ["stream_decode", "STREAM_MAX_BATCH"]
