"""Which tiles each program of the persistent Gluon forward runs, in which order, when a causal mask makes the
tiles unequal. Host code only (plain Python and one small device copy), cached per shape.

    causal_tile_lists(n_m, n_bh, Nk, offset, tile_m, block_n, kv_bytes_per_pair, programs, l2_bytes)
        -> (starts, tiles)   tuples of ints: program p runs tiles[starts[p]:starts[p + 1]] in that order
    device_tile_lists(..., device) -> (starts, tiles) int32 tensors on the device, kept for good; (None, None)
        for a shape not kept yet while a CUDA graph is being captured, or once DEVICE_LISTS_MAX are kept (the
        kernel then keeps its own arithmetic order)

A tile is (query block m, batch·head bh), coded as m · n_bh + bh. The order is longest first within groups of
(batch, head) pairs whose K and V fit in `l2_bytes` together (so that the programs working at one time read
the same K/V blocks, which then come from L2 rather than HBM), the groups one after another; within a group
all pairs' heaviest query blocks first, then the next level up. The tiles are dealt in that order to the
program that would be free first (a greedy list schedule whose cost per tile is its key blocks plus one for
its prologue and epilogue), so the programs end together although each runs its own fixed list.

Striding a longest-first list over the programs (tile p, p + P, ...), the kernel's order without lists, keeps
the programs level only when every pair is in one group; with groups of 12 MB it would leave the most loaded
program 21-37 % above the mean at the 4096- and 16384-token shapes of bench/results/flash_hopper/, the dealt
lists 0-5 % (counted in key blocks; tests/test_flash_hopper_schedule.py measures both).
"""
from __future__ import annotations

import functools
import heapq

import torch

# One group's K and V: about a quarter of a Hopper GPU's 50 MB L2. On the H200 groups of 12 MB were within 3 %
# of 24 MB ones at 1024-4096 tokens and 4-6 % faster at 16k, d128 (one pair of 8 MB against three): two runs in
# bench/results/flash_hopper/tile_lists/.
L2_BYTES = 12 << 20
TILE_OVERHEAD_BLOCKS = 1  # a tile's prologue (Q load, the first QKᵀ waited for) and epilogue, in key blocks


def tile_key_blocks(m_block: int, Nk: int, offset: int, tile_m: int, block_n: int) -> int:
    """Key blocks that causal query tile m_block reads (the kernel's _key_blocks: bottom-right aligned mask,
    offset = Nk - Nq); 0 when no row of it sees a key."""
    hi = min(max(m_block * tile_m + tile_m + offset, 0), Nk)
    return -(-hi // block_n)


def pairs_per_group(n_bh: int, kv_bytes_per_pair: int, l2_bytes: int) -> int:
    """How many (batch, head) pairs one group holds: their K and V within l2_bytes, at least one."""
    return max(1, min(n_bh, l2_bytes // max(1, kv_bytes_per_pair)))


@functools.lru_cache(maxsize=64)
def causal_tile_lists(n_m: int, n_bh: int, Nk: int, offset: int, tile_m: int, block_n: int,
                      kv_bytes_per_pair: int, programs: int, l2_bytes: int) -> tuple[tuple, tuple]:
    """(starts, tiles): program p runs tiles[starts[p]:starts[p + 1]] (codes m · n_bh + bh), see the module."""
    if min(n_m, n_bh, programs, tile_m, block_n) < 1:
        raise ValueError(f"causal_tile_lists: n_m {n_m}, n_bh {n_bh}, programs {programs}, tile_m {tile_m}, "
                         f"block_n {block_n} must all be at least 1")
    group = pairs_per_group(n_bh, kv_bytes_per_pair, l2_bytes)
    cost = [tile_key_blocks(m, Nk, offset, tile_m, block_n) for m in range(n_m)]
    levels = sorted(range(n_m), key=lambda m: -cost[m])  # heaviest query block first (stable: bottom first)
    free = [(0, p) for p in range(programs)]  # (time its work so far takes, program)
    lists: list[list[int]] = [[] for _ in range(programs)]
    for g0 in range(0, n_bh, group):
        for m in levels:
            for bh in range(g0, min(g0 + group, n_bh)):
                busy, p = heapq.heappop(free)
                lists[p].append(m * n_bh + bh)
                heapq.heappush(free, (busy + cost[m] + TILE_OVERHEAD_BLOCKS, p))
    starts = [0]
    for tiles in lists:
        starts.append(starts[-1] + len(tiles))
    return tuple(starts), tuple(t for tiles in lists for t in tiles)


_DEVICE_LISTS: dict = {}
# Kept lists are never freed (a captured CUDA graph may read them at every replay), so their number is capped:
# a few KB each, up to some tens of KB at 16k tokens and many heads.
DEVICE_LISTS_MAX = 512


def device_tile_lists(n_m: int, n_bh: int, Nk: int, offset: int, tile_m: int, block_n: int,
                      kv_bytes_per_pair: int, programs: int, l2_bytes: int, device: torch.device):
    """causal_tile_lists as two int32 tensors on `device`, kept for later calls with the same arguments. While
    a CUDA graph is being captured a list that is not kept yet cannot be copied to the device: (None, None)."""
    key = (n_m, n_bh, Nk, offset, tile_m, block_n, kv_bytes_per_pair, programs, l2_bytes, device)
    hit = _DEVICE_LISTS.get(key)
    if hit is not None:
        return hit
    if len(_DEVICE_LISTS) >= DEVICE_LISTS_MAX or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return None, None
    starts, tiles = causal_tile_lists(*key[:-1])
    # kept for good: a CUDA graph captured with them reads them at every replay (a few KB per causal shape)
    hit = (torch.tensor(starts, dtype=torch.int32, device=device),
           torch.tensor(tiles, dtype=torch.int32, device=device))
    _DEVICE_LISTS[key] = hit
    return hit
