"""@triton.jit helpers shared by the forward and backward kernels: which tile a program owns, which key blocks
a query tile visits under the mask, and how a kv head's K and V are read (descriptors or pointers).

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
