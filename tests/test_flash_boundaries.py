"""Causal tile boundaries of the FlashAttention kernels: Nk - Nq offsets swept across whole tiles.

Under a causal mask (bottom-right aligned: query i sees keys j <= i + Nk - Nq) each kernel sorts its loop blocks
by `offset = Nk - Nq` and the tile starts: fully visible blocks (no mask), blocks crossing the diagonal (masked)
and hidden ones (skipped). An off-by-one in those bounds misplaces one key or one query row, and only when a
tile start plus the offset lands within a step of a tile edge: the square shapes and few odd lengths of
test_flash_attention.py miss it. So this file forces small tiles and sweeps the offset:

* tiles (BLOCK_M, BLOCK_N) = (16, 32) and (32, 16) in the forward, dQ and dK/dV kernels (forward and dQ:
  BLOCK_M query rows per program, BLOCK_N keys per step; dK/dV: BLOCK_N keys per program, BLOCK_M queries per
  step), head dim 16, batch 1, one head or two query heads sharing one kv head;
* Nk - Nq = +-(16 j + e) for j = 0..4 and e = -2..2 (every value within 2 of a multiple of BLOCK_M and of
  BLOCK_N up to two 32-row tiles, 0 excluded), both signs: Nq < Nk (chunked prefill, a KV cache) and Nq > Nk
  (the first Nq - Nk rows see no key, and must come back exactly 0 with a zero dQ);
* the shorter of the two lengths cycles through 30..34 and 62..66 (within 2 of one and two 32-row tiles).

Every case checks the output and dQ, dK, dV against naive attention in float64, with the suite's criterion
(tests/error_budget.py: at most 2x the error of naive attention in the same dtype, plus a floor), on fresh
random inputs (seeded from the test id) and with every buffer the kernels allocate filled with NaN first.

On the CPU (Triton's interpreter) the default run is float32 (the tightest budget); on a GPU it adds bfloat16.
The `slow` tests (run with `-m slow`) cross every pair of lengths within 2 of a multiple of 16 up to 66 (and 1,
2), in float16 too, with the fused backward as well. `python -m tests.mutants` checks that these tests fail on
deliberate off-by-one changes of the kernels' causal bounds.
"""
from __future__ import annotations

import sys

import pytest
import torch

import kernels
import kernels._triton
import kernels.flash as fa
from kernels import flash_attention, naive_attention
from kernels.naive import causal_mask
from tests.error_budget import assert_within_budget
from tests.util import seeded_generator

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])  # the interpreter's bf16 dots are wrong
SLOW_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
HEAD_DIM = 16

# (BLOCK_M, BLOCK_N, num_warps, num_stages), forced on all three kernels at once
TILES = {"m16n32": (16, 32, 4, 1), "m32n16": (32, 16, 4, 1)}
STEP = 16  # every multiple of BLOCK_M or BLOCK_N above is a multiple of STEP
NEAR_TILE_EDGES = sorted({j * STEP + e for j in range(5) for e in range(-2, 3)} - {0})  # -2..66, 0 excluded
OFFSETS = [s * d for d in NEAR_TILE_EDGES if d > 0 for s in (1, -1)]  # Nk - Nq: 44 values, both signs
SHORT = (30, 31, 32, 33, 34, 62, 63, 64, 65, 66)  # the shorter length, cycled through with the offsets
LENGTHS = [d for d in NEAR_TILE_EDGES if d > 0]  # slow sweep: every pair of these as (Nq, Nk), Nq != Nk


def _shape(offset: int) -> tuple[int, int]:
    """(Nq, Nk) with Nk - Nq = offset, the shorter one taken from SHORT by the offset's position in OFFSETS."""
    short = SHORT[OFFSETS.index(offset) % len(SHORT)]
    return (short, short + offset) if offset > 0 else (short - offset, short)


def _heads(offset: int) -> tuple[int, int]:
    """(Hq, Hkv): one head for half of the offsets, two query heads sharing one kv head (GQA) for the others."""
    return (1, 1) if OFFSETS.index(offset) % 4 < 2 else (2, 1)


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """NaN-fill every buffer the attention kernels allocate: their one allocator, kernels._triton.empty."""
    def poisoned_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(kernels._triton, "empty", poisoned_empty)


def _grads(fn, q, k, v, do):
    """[O, dQ, dK, dV] of fn(q, k, v, causal=True) on leaf copies of q, k, v."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, causal=True)
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]


def _check(Nq: int, Nk: int, heads: tuple[int, int], dtype, tiles, g: torch.Generator, fused_name="dkdv"):
    """Forward and backward of one causal shape under forced tiles, against float64 naive attention."""
    Hq, Hkv = heads
    q = torch.randn(1, Hq, Nq, HEAD_DIM, generator=g).to(DEVICE, dtype)
    k = torch.randn(1, Hkv, Nk, HEAD_DIM, generator=g).to(DEVICE, dtype)
    v = torch.randn(1, Hkv, Nk, HEAD_DIM, generator=g).to(DEVICE, dtype)
    do = torch.randn(1, Hq, Nq, HEAD_DIM, generator=g).to(DEVICE, dtype)

    ref = _grads(naive_attention, q.double(), k.double(), v.double(), do.double())
    plain = _grads(naive_attention, q, k, v, do)  # naive in the same dtype: the error budget
    with fa.forced_configs(fwd=tiles, dq=tiles, **{fused_name: tiles}):
        out = _grads(flash_attention, q, k, v, do)

    where = f"Nq={Nq} Nk={Nk} (offset {Nk - Nq:+d}) heads {Hq}/{Hkv} {dtype} tiles {tiles[:2]}"
    for name, got, r, p in zip(("out", "dq", "dk", "dv"), out, ref, plain):
        assert got.dtype == dtype, f"{name}: dtype {got.dtype}, {where}"
        assert_within_budget(f"{name}, {where}", got, r, p)
    if Nq > Nk:  # the first Nq - Nk rows see no key: exactly zero output and zero dQ
        blind = ~causal_mask(Nq, Nk, device=DEVICE).any(dim=1)  # (Nq,)
        assert (out[0][:, :, blind] == 0).all() and (out[1][:, :, blind] == 0).all(), f"blind rows, {where}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", OFFSETS, ids=lambda d: f"offset{d:+d}")
@pytest.mark.parametrize("tiles", list(TILES.values()), ids=list(TILES))
def test_causal_offset_sweep(tiles, offset, dtype, request):
    Nq, Nk = _shape(offset)
    _check(Nq, Nk, _heads(offset), dtype, tiles, seeded_generator(request))


def test_sweep_covers_every_tile_edge():
    """The offsets reach within 2 of every multiple of both block sizes up to two of the larger tiles, in both
    directions, and the shorter lengths within 2 of one and of two such tiles."""
    for bm, bn, _, _ in TILES.values():
        for block in (bm, bn):
            for edge in range(0, 2 * max(bm, bn) + 1, block):
                for e in range(-2, 3):
                    if edge + e > 0:
                        assert edge + e in OFFSETS and -(edge + e) in OFFSETS, (block, edge + e)
    tile = max(max(t[:2]) for t in TILES.values())
    assert {tile + e for e in range(-2, 3)} | {2 * tile + e for e in range(-2, 3)} <= set(SHORT)
    for d in OFFSETS:
        Nq, Nk = _shape(d)
        assert Nk - Nq == d and min(Nq, Nk) in SHORT


@pytest.mark.slow
@pytest.mark.parametrize("bwd", ["split", "fused"])
@pytest.mark.parametrize("dtype", SLOW_DTYPES, ids=str)
@pytest.mark.parametrize("Nq", LENGTHS, ids=lambda n: f"Nq{n}")
@pytest.mark.parametrize("tiles", list(TILES.values()), ids=list(TILES))
def test_causal_length_pairs_exhaustive(tiles, Nq, dtype, bwd, request):
    """Every (Nq, Nk) pair of LENGTHS with Nq != Nk, MHA and GQA alternately; `fused`: the fused backward
    (options backward="fused", whose dK/dV kernel is configured as "dkdvq") with the same causal bounds."""
    g = seeded_generator(request)
    with kernels.options.use(backward=bwd):
        for i, Nk in enumerate(n for n in LENGTHS if n != Nq):
            _check(Nq, Nk, (1, 1) if i % 2 else (2, 1), dtype, tiles, g, "dkdvq" if bwd == "fused" else "dkdv")
