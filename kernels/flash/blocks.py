"""@triton.jit helpers shared by the forward and backward kernels: which tile a program owns, which key blocks
a query tile visits under the mask (causal; or a window and/or documents: _key_range, and _query_range for the
dK/dV kernel's query blocks), and how a kv head's K and V are read (descriptors or pointers).

Triton inlines these into each kernel; they hold no state.
"""
from __future__ import annotations

import triton
import triton.language as tl


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


@triton.jit
def _key_blocks(start_m, Nk, offset, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key ranges of the query tile [start_m, start_m + BLOCK_M): blocks in [0, full_hi) are visible to every
    row (no mask needed); [full_hi, hi) cross the causal diagonal (offset = Nk - Nq, bottom-right aligned) or the
    Nk tail and need a mask; keys from hi on are hidden from every row of the tile (never loaded)."""
    n_full = (Nk // BLOCK_N) * BLOCK_N
    if CAUSAL:
        # the first row of the tile sees keys <= start_m + offset: blocks ending there are fully visible
        full_hi = tl.minimum((tl.maximum(start_m + offset + 1, 0) // BLOCK_N) * BLOCK_N, n_full)
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + offset, 0), Nk)  # past the last row's last key
    else:
        full_hi = n_full
        hi = Nk
    return full_hi, hi


@triton.jit
def _kv_descriptors(k_base, v_base, Nk, stride_kn, stride_vn,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """How a kernel reads one kv head's K and V (pointers to their first row): TMA, tensor descriptors over their
    (Nk, HEAD_DIM) rows read in (BLOCK_N, BLOCK_D) blocks, which fill zeros past either end (unit stride along D
    and 16-byte aligned rows: the host checks); otherwise the pointers themselves."""
    if TMA:
        k_base = tl.make_tensor_descriptor(k_base, shape=[Nk, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_base = tl.make_tensor_descriptor(v_base, shape=[Nk, HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
    return k_base, v_base


# ----------------------------------------------------------------------------------------------------------
# Sliding windows and documents (WINDOW > 0 and/or VARLEN): key ranges bounded on both sides
# ----------------------------------------------------------------------------------------------------------
# With a window (query i sees keys j with i + offset - WINDOW < j <= i + offset) or documents (query i sees keys
# of its own document only: docs[b, 0, i] <= j < docs[b, 1, i], Nq = Nk), the keys a row sees are an interval
# [Lo(i), Hi(i)) whose two ends never decrease with i. So a query tile sees keys [Lo(first row), Hi(last row)),
# and the key blocks inside [Lo(last row), Hi(first row)) are visible to every row of the tile (no mask); the
# blocks on either side of that need the mask, the rest are never loaded. The dK/dV kernel reads the same
# intervals from the keys' side. DOCS is (B, 2, N) int32: row b's document start and end of every token.


@triton.jit
def _key_range(start_m, Nq, Nk, offset, docs_base, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
               VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks of the query tile [start_m, start_m + BLOCK_M) under a window and/or documents:
    (lo, full_lo, full_hi, hi). Blocks in [lo, full_lo) and [full_hi, hi) need the mask, [full_lo, full_hi) is
    visible to every real row of the tile; nothing outside [lo, hi) is visible. lo, full_lo, full_hi are
    multiples of BLOCK_N, all four lie in [0, cdiv(Nk, BLOCK_N) * BLOCK_N] and keys in [full_lo, full_hi) are
    below Nk. When no block is fully visible, full_lo = full_hi >= hi (one masked range [lo, hi))."""
    r0 = start_m
    r1 = tl.minimum(start_m + BLOCK_M, Nq) - 1  # the last real row
    lo_first = 0
    lo_last = 0
    hi_first = Nk
    hi_last = Nk
    if CAUSAL:
        hi_first = tl.minimum(tl.maximum(r0 + offset + 1, 0), Nk)
        hi_last = tl.minimum(tl.maximum(r1 + offset + 1, 0), Nk)
    if WINDOW > 0:
        lo_first = tl.maximum(r0 + offset - WINDOW + 1, 0)
        lo_last = tl.maximum(r1 + offset - WINDOW + 1, 0)
    if VARLEN:
        # Nq = Nk: bounds clamped into [0, Nk] so that no value of DOCS can send a load out of the row
        lo_first = tl.maximum(lo_first, tl.minimum(tl.load(docs_base + r0), Nk))
        lo_last = tl.maximum(lo_last, tl.minimum(tl.load(docs_base + r1), Nk))
        hi_first = tl.minimum(hi_first, tl.maximum(tl.load(docs_base + Nk + r0), 0))
        hi_last = tl.minimum(hi_last, tl.maximum(tl.load(docs_base + Nk + r1), 0))
    lo = (lo_first // BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(lo_last, BLOCK_N) * BLOCK_N
    full_hi = (hi_first // BLOCK_N) * BLOCK_N
    hi = hi_last
    hi_up = tl.maximum(tl.cdiv(hi, BLOCK_N) * BLOCK_N, lo)
    has_full = full_lo < full_hi
    full_lo = tl.where(has_full, full_lo, hi_up)
    full_hi = tl.where(has_full, full_hi, hi_up)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_range(start_n, Nq, Nk, offset, docs_base, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                 VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dK/dV kernel's side of _key_range: query blocks of the key tile [start_n, start_n + BLOCK_N),
    (lo, full_lo, full_hi, hi), all multiples of BLOCK_M in [0, cdiv(Nq, BLOCK_M) * BLOCK_M]. Blocks in
    [lo, full_lo) and [full_hi, hi) need the mask and row checks, [full_lo, full_hi) holds real rows that see
    every real key of the tile; no query outside [lo, hi) sees one."""
    c0 = start_n
    c1 = tl.minimum(start_n + BLOCK_N, Nk) - 1  # the last real key
    lo_first = 0
    lo_last = 0
    hi_first = Nq
    hi_last = Nq
    if CAUSAL:  # queries i >= j - offset see key j
        lo_first = tl.maximum(c0 - offset, 0)
        lo_last = tl.maximum(c1 - offset, 0)
    if WINDOW > 0:  # queries i < j - offset + WINDOW see key j
        hi_first = tl.minimum(tl.maximum(c0 - offset + WINDOW, 0), Nq)
        hi_last = tl.minimum(tl.maximum(c1 - offset + WINDOW, 0), Nq)
    if VARLEN:  # the queries of key j's own document
        lo_first = tl.maximum(lo_first, tl.minimum(tl.load(docs_base + c0), Nq))
        lo_last = tl.maximum(lo_last, tl.minimum(tl.load(docs_base + c1), Nq))
        hi_first = tl.minimum(hi_first, tl.maximum(tl.load(docs_base + Nk + c0), 0))
        hi_last = tl.minimum(hi_last, tl.maximum(tl.load(docs_base + Nk + c1), 0))
    lo = (lo_first // BLOCK_M) * BLOCK_M
    full_lo = tl.cdiv(lo_last, BLOCK_M) * BLOCK_M
    full_hi = (hi_first // BLOCK_M) * BLOCK_M
    hi = tl.maximum(tl.cdiv(hi_last, BLOCK_M) * BLOCK_M, lo)
    has_full = full_lo < full_hi
    full_lo = tl.where(has_full, full_lo, hi)
    full_hi = tl.where(has_full, full_hi, hi)
    return lo, full_lo, full_hi, hi
