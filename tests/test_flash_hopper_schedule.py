"""The causal tile lists of the Gluon forward (kernels/flash_hopper/schedule.py), on any machine: every tile in
exactly one program's list, groups of heads in order and within the L2 budget, heaviest tiles first within a
group, and programs that end together, measured in key blocks against the strided order the kernel uses without
lists. That the kernel computes the same output from lists as from striding is tests/test_flash_hopper.py's
(GPU)."""
from __future__ import annotations

import statistics

import pytest
import torch

from kernels.flash_hopper import schedule

TILE_M, BLOCK_N = 128, 128


def _lists(n_m, n_bh, Nk, offset, kv_bytes, programs, l2_bytes=schedule.L2_BYTES):
    starts, tiles = schedule.causal_tile_lists(n_m, n_bh, Nk, offset, TILE_M, BLOCK_N, kv_bytes, programs,
                                               l2_bytes)
    return [tiles[starts[p]:starts[p + 1]] for p in range(programs)], starts, tiles


def _load(tile_lists, n_bh, Nk, offset):
    """Each program's work in key blocks plus the per-tile overhead, as the schedule counts it."""
    cost = lambda code: (schedule.tile_key_blocks(code // n_bh, Nk, offset, TILE_M, BLOCK_N)  # noqa: E731
                         + schedule.TILE_OVERHEAD_BLOCKS)
    return [sum(cost(c) for c in tiles) for tiles in tile_lists]


# (B·H, N, D): the benchmark's causal shapes; K and V of one pair are 2·N·D·2 bytes (bf16)
SHAPES = [(64, 4096, 128), (16, 16384, 128), (64, 4096, 64), (96, 1024, 64), (12, 8192, 128)]


@pytest.mark.parametrize("n_bh,N,D", SHAPES)
def test_every_tile_once_in_group_order_heaviest_first(n_bh, N, D):
    n_m = -(-N // TILE_M)
    kv = 2 * N * D * 2
    tile_lists, starts, tiles = _lists(n_m, n_bh, N, 0, kv, 132)
    assert len(starts) == 133 and starts[0] == 0 and list(starts) == sorted(starts)
    assert sorted(tiles) == list(range(n_m * n_bh))
    group = schedule.pairs_per_group(n_bh, kv, schedule.L2_BYTES)
    assert group * kv <= schedule.L2_BYTES or group == 1
    for own in tile_lists:
        groups = [(c % n_bh) // group for c in own]
        assert groups == sorted(groups)  # a program never returns to an earlier group
        for g in set(groups):  # within a group: its heaviest (lowest-placed) query blocks first
            blocks = [c // n_bh for c in own if (c % n_bh) // group == g]
            assert blocks == sorted(blocks, reverse=True)


@pytest.mark.parametrize("n_bh,N,D", SHAPES)
def test_programs_end_together(n_bh, N, D):
    """The most loaded program within 6 % of the mean, and never above the strided order's most loaded one."""
    n_m = -(-N // TILE_M)
    kv = 2 * N * D * 2
    programs = 132
    tile_lists, _, tiles = _lists(n_m, n_bh, N, 0, kv, programs)
    load = _load(tile_lists, n_bh, N, 0)
    assert max(load) <= 1.06 * statistics.mean(load)
    strided = [tiles[p::programs] for p in range(programs)]  # the same order, dealt round-robin
    assert max(load) <= max(_load(strided, n_bh, N, 0))


def test_grouped_striding_is_what_the_lists_fix():
    """The premise of the lists: striding a list grouped for L2 over the programs leaves them uneven (at 4096
    tokens, d128, 64 pairs: groups of 12 pairs)."""
    n_m, n_bh, N, kv = 32, 64, 4096, 2 * 4096 * 128 * 2
    _, _, tiles = _lists(n_m, n_bh, N, 0, kv, 132)
    strided = [tiles[p::132] for p in range(132)]
    load = _load(strided, n_bh, N, 0)
    assert max(load) > 1.1 * statistics.mean(load)


@pytest.mark.parametrize("Nq,Nk", [(1023, 113), (113, 1023), (1, 4097), (300, 1)])
def test_key_blocks_follow_the_bottom_right_mask(Nq, Nk):
    """A tile's key blocks: up to its last row's last visible key (offset = Nk - Nq), none for rows that see no
    key; checked against the mask itself."""
    offset = Nk - Nq
    for m in range(-(-Nq // TILE_M)):
        last_row = min((m + 1) * TILE_M, Nq) - 1
        visible = [j for j in range(Nk) if any(j <= r + offset for r in range(m * TILE_M, last_row + 1))]
        want = -(-(max(visible) + 1) // BLOCK_N) if visible else 0
        got = schedule.tile_key_blocks(m, Nk, offset, TILE_M, BLOCK_N)
        assert got >= want and (got == want or (m + 1) * TILE_M > Nq)  # a padded last tile may read one more


def test_device_lists_are_kept_and_match():
    args = (8, 6, 1000, 0, TILE_M, BLOCK_N, 2 * 1000 * 64 * 2, 5, 1 << 20)
    starts, tiles = schedule.device_tile_lists(*args, torch.device("cpu"))
    assert starts.dtype == tiles.dtype == torch.int32
    assert (tuple(starts.tolist()), tuple(tiles.tolist())) == schedule.causal_tile_lists(*args)
    again = schedule.device_tile_lists(*args, torch.device("cpu"))
    assert again[0] is starts and again[1] is tiles


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="programs 0"):
        schedule.causal_tile_lists(4, 4, 512, 0, TILE_M, BLOCK_N, 1, 0, 1)


def test_no_new_lists_while_a_cuda_graph_is_captured(monkeypatch):
    """During capture a list never made for the shape cannot be copied to the device: (None, None), and the
    kernel keeps its strided order; lists made before capture are returned as they are."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(schedule, "_DEVICE_LISTS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    args = (8, 6, 1000, 0, TILE_M, BLOCK_N, 2 * 1000 * 64 * 2, 5, 1 << 20)
    assert schedule.device_tile_lists(*args, cuda) == (None, None)
    kept = (torch.zeros(6, dtype=torch.int32), torch.zeros(48, dtype=torch.int32))
    schedule._DEVICE_LISTS[(*args, cuda)] = kept
    assert schedule.device_tile_lists(*args, cuda) is kept


def test_kept_lists_are_capped(monkeypatch):
    """Lists are never freed (a captured graph may read them), so past DEVICE_LISTS_MAX shapes no new ones are
    made: (None, None), the strided order; the kept ones still come back."""
    monkeypatch.setattr(schedule, "_DEVICE_LISTS", {})
    monkeypatch.setattr(schedule, "DEVICE_LISTS_MAX", 3)
    cpu = torch.device("cpu")
    made = [schedule.device_tile_lists(8, 6, 1000 + i, 0, TILE_M, BLOCK_N, 1 << 10, 5, 1 << 20, cpu) for i in range(4)]
    assert all(s is not None for s, _ in made[:3]) and made[3] == (None, None)
    again = schedule.device_tile_lists(8, 6, 1000, 0, TILE_M, BLOCK_N, 1 << 10, 5, 1 << 20, cpu)
    assert again[0] is made[0][0] and again[1] is made[0][1]
