"""The Hopper backward: kernels/flash/launch.py's _hopper_bwd around the Gluon dK/dV kernel (kernels/flash_hopper).

On an sm_90 GPU: dq, dk, dv of fresh random inputs against a float64 reference (autograd through naive
attention), within the suite's error budget (tests/error_budget.py) of naive attention's gradients computed in
the same dtype; O and lse from the tl forward, as kernels.flash_attention's backward reads them. Odd lengths,
Nq != Nk both ways (bottom-right causal; Nq > Nk leaves rows that see no key), GQA and MQA, bf16 and fp16, head
dims 64 and 128, causal or not. Every buffer the launcher allocates (dq, dk, dv, delta) starts as NaN, so an
element never written fails the test. Skipped without a CUDA device of compute capability 9.0 or a Triton
lacking Gluon.

On any machine: the launcher compiled for sm_90 with the Triton installed (tests/gpu_compile.py, in a child
process with TRITON_INTERPRET=0 standing in for an H200; nothing is launched), each variant of the Gluon kernel
checked for wgmma, TMA, mbarriers, setmaxnreg, 12 warps and its shared memory; `ptxas -v` registers and spill
bytes per variant are printed (pytest -s) and bounded. And which inputs the launcher refuses, with the reason.
"""
from __future__ import annotations

import re

import pytest
import torch

import kernels._triton as kt
from kernels import flash_attention, flash_attention_qkvpacked, flash_hopper, naive_attention, options, split_qkv
from kernels.flash import launch
from kernels.flash_hopper import backward_launch
from kernels.flash_hopper import launch as hopper_launch
from tests.error_budget import assert_within_budget
from tests.util import CompiledStandIn, needs_sm90_gluon, recording_jit, seeded_generator

on_sm90 = needs_sm90_gluon()
needs_gluon = pytest.mark.skipif(not flash_hopper.AVAILABLE, reason=f"{flash_hopper.UNAVAILABLE_REASON}")

DTYPES = [torch.bfloat16, torch.float16]
# (B, Hq, Hkv, Nq, Nk, causal): single rows, odd lengths past one key tile (128) and one query block (64), Nq
# != Nk both ways, rows that see no key (causal, Nq > Nk), GQA and MQA, several kv heads with a group each
CASES = [
    (1, 2, 2, 1, 1, True),
    (1, 2, 2, 1, 1, False),
    (2, 2, 2, 113, 113, True),
    (1, 2, 2, 113, 113, False),
    (1, 2, 2, 1023, 1023, True),
    (1, 2, 2, 1023, 1023, False),
    (1, 2, 2, 113, 1023, True),
    (1, 2, 2, 113, 1023, False),
    (1, 2, 2, 1023, 113, True),
    (1, 2, 2, 1023, 113, False),
    (1, 2, 2, 1, 2049, True),
    (1, 2, 2, 300, 1, True),
    (1, 2, 2, 2049, 2049, True),
    (2, 4, 2, 1023, 1023, True),
    (1, 6, 2, 777, 333, True),
    (1, 8, 1, 257, 257, False),
]

# cases whose Nq is a multiple of 4, so that every head's lse and delta rows start on 16 bytes and go through the
# producer's TMA (backward_launch.rows_through_tma_for): partial last query blocks whose box runs into the next
# head's rows or past the buffer, Nq != Nk both ways, rows that see no key, GQA and MQA
TMA_CASES = [
    (1, 2, 2, 1020, 1023, True),
    (1, 2, 2, 1020, 1023, False),
    (2, 4, 2, 116, 116, True),
    (1, 6, 2, 332, 777, True),
    (1, 2, 2, 772, 113, True),
    (1, 8, 1, 260, 257, False),
    (1, 2, 2, 64, 64, True),
]


def _id(case, D, dtype):
    B, Hq, Hkv, Nq, Nk, causal = case
    return f"B{B}-H{Hq}/{Hkv}-{Nq}x{Nk}-d{D}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"


MATRIX = [pytest.param(case, D, dtype, id=_id(case, D, dtype)) for case in CASES for D in (64, 128)
          for dtype in DTYPES]


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the kernels allocate starts as NaN; no launch plan recorded by another test is replayed."""
    monkeypatch.setattr(kt, "empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                            device=device))
    monkeypatch.setattr(launch, "_plans", {})


def _inputs(case, D, dtype, g):
    """q (B, Hq, Nq, D), k, v (B, Hkv, Nk, D), do like q, on the GPU."""
    B, Hq, Hkv, Nq, Nk, _ = case
    shapes = ((B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D), (B, Hq, Nq, D))
    return [torch.randn(s, generator=g).to("cuda", dtype) for s in shapes]


def _naive_grads(q, k, v, do, causal):
    """dq, dk, dv of naive attention in the inputs' dtype (float64 inputs: the reference)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    naive_attention(q, k, v, causal=causal).backward(do)
    return q.grad, k.grad, v.grad


def _assert_matches_reference(case, D, dtype, request, **launch_kw):
    """dq, dk, dv of launch._hopper_bwd (launch_kw: its stages, ahead, fused) on fresh inputs of case, O and lse
    from the tl forward: shaped and typed like q, k, v and within the float64-reference budget."""
    causal = case[-1]
    q, k, v, do = _inputs(case, D, dtype, seeded_generator(request))
    o, lse = launch._fwd(q, k, v, causal, D ** -0.5)  # (B, Hq, Nq, D), (B, Hq, Nq): what the backward reads
    grads = launch._hopper_bwd(do, q, k, v, o, lse, causal, D ** -0.5, **launch_kw)
    assert tuple(g.shape for g in grads) == (q.shape, k.shape, v.shape)
    assert all(g.dtype == dtype for g in grads)
    ref = _naive_grads(q.double(), k.double(), v.double(), do.double(), causal)
    low = _naive_grads(q, k, v, do, causal)
    for name, got, r, n in zip(("dq", "dk", "dv"), grads, ref, low):
        assert_within_budget(name, got, r, n)


@on_sm90
@pytest.mark.parametrize("case,D,dtype", MATRIX)
def test_backward_matches_reference(case, D, dtype, request, poisoned):
    """The split form: the tl dQ kernel, then the Gluon dK/dV kernel, on every case in both dtypes."""
    _assert_matches_reference(case, D, dtype, request)


@on_sm90
@pytest.mark.parametrize("fused", backward_launch.DQ_MODES)
@pytest.mark.parametrize("case,D,dtype", MATRIX)
def test_fused_backward_matches_reference(case, D, dtype, fused, request, poisoned):
    """The fused forms: the Gluon kernel also adds dS K into an fp32 dQ accumulator (no tl dQ kernel): each
    warpgroup its own keys' part with atomics (1); half the columns over both warpgroups' keys through one
    shared dS buffer, with atomics (2) or a TMA reduce-add from shared memory (3); 3 with each step's dQ one step
    later (4) or with dK's matmul issued after dQ's (5), or both (6). The same float64-reference criterion on every
    case."""
    _assert_matches_reference(case, D, dtype, request, fused=fused)


@on_sm90
@pytest.mark.parametrize("fused", [0, 4, 6])
@pytest.mark.parametrize("causal", [True, False])
def test_direct_backward_launches_give_the_result_of_the_jit(causal, fused, request, monkeypatch):
    """A repeated signature calls the compiled dK/dV kernel's launcher directly (with direct_launches): the
    gradients of launches through JITFunction.run (dK and dV bitwise; dQ bitwise in the split form, where no
    reduction order varies, and within bf16 rounding in the fused forms, whose fp32 adds land in any order), and
    only the repeat goes direct."""
    q, k, v, do = _inputs((2, 4, 2, 300, 300, causal), 64, torch.bfloat16, seeded_generator(request))
    o, lse = launch._fwd(q, k, v, causal, 0.125)
    monkeypatch.setattr(backward_launch, "_compiled", {})
    monkeypatch.setattr(backward_launch, "FAST_LAUNCH", True)
    direct = []
    real = kt.launch_compiled
    monkeypatch.setattr(kt, "launch_compiled", lambda kernel, grid, vals: direct.append(kernel)
                        or real(kernel, grid, vals))

    def gluon_direct():  # direct launches of the dK/dV kernel (the tl kernels around it have their own)
        return sum(any(kernel is c for c in backward_launch._compiled.values()) for kernel in direct)

    with options.use(fast_launch=False):
        via_jit = launch._hopper_bwd(do, q, k, v, o, lse, causal, 0.125, fused=fused)
    assert gluon_direct() == 0 and not backward_launch._compiled
    first = launch._hopper_bwd(do, q, k, v, o, lse, causal, 0.125, fused=fused)
    assert gluon_direct() == 0 and len(backward_launch._compiled) == 1
    repeat = launch._hopper_bwd(do, q, k, v, o, lse, causal, 0.125, fused=fused)
    assert gluon_direct() == 1
    for grads in (first, repeat):
        dq, dk, dv = grads
        assert torch.equal(dk, via_jit[1]) and torch.equal(dv, via_jit[2])
        if fused == 0:
            assert torch.equal(dq, via_jit[0])
        else:
            torch.testing.assert_close(dq, via_jit[0], rtol=1e-2, atol=1e-3)


@on_sm90
@pytest.mark.parametrize("case", [CASES[2], CASES[8], CASES[10], CASES[14]])
@pytest.mark.parametrize("D", [64, 128])
def test_other_schedule_matches_reference(case, D, request, poisoned):
    """The schedule the launcher does not take by default (the next block's score matmuls issued ahead) is
    right too: a launch option, for the benchmark's comparison."""
    _assert_matches_reference(case, D, torch.bfloat16, request, ahead=not backward_launch.AHEAD[D])


@on_sm90
@pytest.mark.parametrize("fused", [None, 3])
@pytest.mark.parametrize("case,D,dtype", [pytest.param(case, D, dtype, id=_id(case, D, dtype)) for case in TMA_CASES
                                          for D in (64, 128) for dtype in DTYPES])
def test_rows_through_tma_match_reference(case, D, dtype, fused, request, poisoned):
    """The default form where it applies (Nq a multiple of 4): each step's lse and delta brought into the stage by
    the producer's TMA; rows past Nq (the next head's, or past the buffer as zeros) masked in the consumers. The
    split and the fused form 3, both dtypes."""
    B, Hq, _, Nq, _, _ = case
    assert backward_launch.rows_through_tma_for(Nq) and backward_launch.rows_fit_tma(torch.zeros(B, Hq, Nq))
    _assert_matches_reference(case, D, dtype, request, fused=fused)


@on_sm90
@pytest.mark.parametrize("fused", [None, 3])
@pytest.mark.parametrize("case,D", [pytest.param(case, D, id=_id(case, D, torch.bfloat16))
                                    for case in CASES + TMA_CASES if case[-1] for D in (64, 128)])
def test_mask_skip_matches_reference(case, D, fused, request, poisoned):
    """With skip_mask_below_diagonal (at d64, causal blocks wholly below the diagonal take the unmasked branch;
    d128 keeps its mask): the split and the fused form 3 on every causal case, rows through TMA or loaded, bf16."""
    with backward_launch.skip_mask_below_diagonal():
        _assert_matches_reference(case, D, torch.bfloat16, request, fused=fused)


@on_sm90
@pytest.mark.parametrize("fused", [2, 3, 5])
@pytest.mark.parametrize("case,D", [pytest.param(case, D, id=_id(case, D, torch.bfloat16))
                                    for case in CASES + TMA_CASES for D in (64, 128)])
def test_ds_freed_by_ring_matches_reference(case, D, fused, request, poisoned):
    """With ds_freed_by_ring (a dSᵀ buffer per ring stage, counted free through the ring's releases instead of its
    own barriers): fused forms 2, 3 and 5 on their default stages on every case, rows through TMA or loaded, bf16."""
    with backward_launch.ds_freed_by_ring():
        _assert_matches_reference(case, D, torch.bfloat16, request, fused=fused)


@on_sm90
@pytest.mark.parametrize("sms,rounds", [(1, 1), (None, 0)])
@pytest.mark.parametrize("fused", [None, 3, 5])
@pytest.mark.parametrize("case,D", [pytest.param(case, D, id=_id(case, D, torch.bfloat16))
                                    for case in [CASES[2], CASES[4], CASES[12], CASES[13], CASES[14], TMA_CASES[2],
                                                 TMA_CASES[3]] for D in (64, 128)])
def test_tail_heads_dealt_match_reference(case, D, fused, sms, rounds, request, monkeypatch, poisoned):
    """The causal grid's other orders (the default deals the last heads' key tiles across them, which on these
    small grids is every head): counting one SM and one round, only the last (batch, kv head) pair is dealt, so
    the head-by-head part runs too; with tail_heads_dealt(0), the launch order. The split and the fused forms 3
    and 5 on causal cases of several pairs (lengths past one tile, Nq != Nk, GQA, rows through TMA or loaded),
    bf16."""
    B, _, Hkv, _, Nk, _ = case
    n_tiles = -(-Nk // (2 * backward_launch.BLOCK_N))
    if sms:
        monkeypatch.setattr(kt, "sm_count", lambda device: sms)
    with backward_launch.tail_heads_dealt(rounds):
        tail = backward_launch.tail_heads_for(n_tiles, B * Hkv, True, kt.sm_count(torch.device("cuda")))
        assert (0 < tail < B * Hkv) if rounds else tail == 0
        _assert_matches_reference(case, D, torch.bfloat16, request, fused=fused)


def test_tail_heads_order_is_a_permutation_longest_first_at_the_end():
    """program_order (the kernel's _program_tile mapping) visits every (tile, head) once: the heads before the
    tail in launch order, each head's tiles in order; the tail's tiles dealt tile by tile across its heads.
    tail_heads_for: 0 when off or not causal, at most the heads, ceil(rounds · SMs / tiles)."""
    for n_tiles, n_heads, tail in ((1, 1, 0), (1, 1, 1), (5, 7, 0), (5, 7, 3), (5, 7, 7), (32, 64, 17)):
        order = backward_launch.program_order(n_tiles, n_heads, tail)
        assert sorted(order) == [(t, h) for t in range(n_tiles) for h in range(n_heads)]
        body = (n_heads - tail) * n_tiles
        assert order[:body] == [(t, h) for h in range(n_heads - tail) for t in range(n_tiles)]
        assert [t for t, _ in order[body:]] == sorted(t for t, _ in order[body:])  # tile 0s first
    with backward_launch.tail_heads_dealt(0):
        assert backward_launch.tail_heads_for(32, 64, True, 132) == 0
    with backward_launch.tail_heads_dealt(4):
        assert backward_launch.tail_heads_for(32, 64, False, 132) == 0
        assert backward_launch.tail_heads_for(32, 64, True, 132) == 17  # ceil(528 / 32)
        assert backward_launch.tail_heads_for(2, 3, True, 132) == 3


def _makespan(order, steps, sms=132, overhead=2.0):
    """List scheduling: each program starts on the first SM free, in launch order, one per SM (the kernel's
    shared memory allows one), taking its query blocks plus `overhead` steps."""
    import heapq
    free = [0.0] * sms
    for tile, _ in order:
        heapq.heappush(free, heapq.heappop(free) + steps(tile) + overhead)
    return max(free)


@pytest.mark.parametrize("B,H,N", [(8, 16, 2048), (4, 16, 4096), (1, 16, 8192), (2, 8, 4096)])
def test_dealing_the_tail_shortens_the_modelled_causal_run(B, H, N):
    """The model behind TAIL_ROUNDS: causal, key tile t of 128 keys reads the query blocks of 64 rows from its
    diagonal on; launched head by head the run ends 5-27 % above its work spread evenly over 132 SMs, with the last
    4 · SMs / tiles heads dealt within 2 %."""
    n_tiles, n_heads = N // 128, B * H
    steps = lambda tile: N // 64 - 2 * tile  # noqa: E731
    ideal = sum(steps(t) + 2.0 for t in range(n_tiles)) * n_heads / 132
    launch_order = _makespan(backward_launch.program_order(n_tiles, n_heads, 0), steps) / ideal
    with backward_launch.tail_heads_dealt(4):
        tail = backward_launch.tail_heads_for(n_tiles, n_heads, True, 132)
    dealt = _makespan(backward_launch.program_order(n_tiles, n_heads, tail), steps) / ideal
    assert launch_order > 1.05 and dealt < 1.02, (launch_order, dealt)


@on_sm90
@pytest.mark.parametrize("fused", [None, 3])
@pytest.mark.parametrize("case,D", [pytest.param(case, D, id=_id(case, D, torch.bfloat16))
                                    for case in CASES + TMA_CASES for D in (64, 128)])
def test_rows_through_loads_match_reference(case, D, fused, request, poisoned):
    """With rows_through_tma off (each step's lse and delta loaded from global memory by the consumers, as the
    default does where Nq is not a multiple of 4 or the buffer is smaller than one TMA box): the split and the
    fused form 3 on every case, bf16."""
    with backward_launch.rows_through_tma(False):
        _assert_matches_reference(case, D, torch.bfloat16, request, fused=fused)


def _fwd_bwd(q, k, v, do, causal):
    """o, dq, dk, dv of kernels.flash_attention."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = flash_attention(q, k, v, causal=causal)
    o.backward(do)
    return [o.detach(), q.grad, k.grad, v.grad]


def _spy(monkeypatch):
    """Record the Hopper backward's calls (their fused argument) and the tl launches' names."""
    gluon, tl = [], []
    real_bwd, real_launch = launch._hopper_bwd, launch._launch
    monkeypatch.setattr(launch, "_hopper_bwd",
                        lambda *a, **kw: gluon.append(kw.get("fused")) or real_bwd(*a, **kw))
    monkeypatch.setattr(launch, "_launch", lambda name, *a: tl.append(name) or real_launch(name, *a))
    monkeypatch.setattr(launch, "_plan_key", lambda *args: None)  # every tl launch goes through _launch
    return gluon, tl


@on_sm90
@pytest.mark.parametrize("case,D,dtype", [
    pytest.param((2, 4, 2, 1023, 1023, True), 128, torch.bfloat16, id="causal-gqa-d128-bf16"),
    pytest.param((1, 2, 2, 113, 1023, False), 64, torch.float16, id="full-Nq<Nk-d64-fp16"),
    pytest.param((1, 2, 2, 1023, 113, True), 64, torch.bfloat16, id="causal-Nq>Nk-d64-bf16"),
])
def test_switch_runs_the_fused_gluon_backward(case, D, dtype, request, monkeypatch, poisoned):
    """kernels.flash_attention's backward with hopper_backward on runs the Gluon kernel's fused form (fused=5 at
    d128 causal, 3 at d128 without a mask, 4 at d64 causal, 6 at d64 without: the tl delta and dQ passes around it,
    no tl dQ or dK/dV kernel); off, the tl backward. Both within the float64-reference budget."""
    causal = case[-1]
    form = {(128, True): 5, (128, False): 3, (64, True): 4, (64, False): 6}[(D, causal)]
    assert launch.hopper_bwd_form(D, causal) == form
    q, k, v, do = _inputs(case, D, dtype, seeded_generator(request))
    gluon, tl = _spy(monkeypatch)
    with options.use(hopper_backward="on"):
        on = _fwd_bwd(q, k, v, do, causal)
    assert gluon == [form] and {"prep", "dqout"} <= set(tl) and not {"dq", "dkdv", "dkdvq"} & set(tl), tl
    tl.clear()
    with options.use(hopper_backward="off"):
        off = _fwd_bwd(q, k, v, do, causal)
    assert gluon == [form] and "dkdv" in tl
    ref = _naive_grads(q.double(), k.double(), v.double(), do.double(), causal)
    low = _naive_grads(q, k, v, do, causal)
    for name, a, b, r, n in zip(("dq", "dk", "dv"), on[1:], off[1:], ref, low):
        assert_within_budget(f"{name} (switch on)", a, r, n)
        assert_within_budget(f"{name} (switch off)", b, r, n)


@on_sm90
@pytest.mark.parametrize("causal", [True, False])
def test_default_backward_dispatch_at_the_measured_shapes(causal, request, monkeypatch):
    """With the default option (auto), kernels.flash_attention's backward runs the Gluon kernel's fused form where
    launch.HOPPER_BWD_AUTO_MIN_LEN says, the tl backward elsewhere; each within the float64-reference budget, with
    GQA: head dim 128 at 4096 and 2048 tokens (rows through TMA) always, at 4097 (rows loaded) only not causal;
    head dim 64 at 4096 and at 8192 (two query heads over one kv head), causal or not."""
    assert options.get().hopper_backward == "auto"
    for N, D, want_gluon, Hq in ((4096, 128, True, 4), (2048, 128, True, 4), (4097, 128, not causal, 4),
                                 (4096, 64, True, 4), (8192, 64, True, 2)):
        q, k, v, do = _inputs((1, Hq, Hq // 2, N, N, causal), D, torch.bfloat16, seeded_generator(request))
        gluon, tl = _spy(monkeypatch)
        grads = _fwd_bwd(q, k, v, do, causal)[1:]
        monkeypatch.undo()
        want = [launch.hopper_bwd_form(D, causal)] if want_gluon else []
        assert gluon == want and ("dkdv" in tl) is not want_gluon, (N, D, gluon, tl)
        ref = _naive_grads(q.double(), k.double(), v.double(), do.double(), causal)
        low = _naive_grads(q, k, v, do, causal)
        for name, got, r, n in zip(("dq", "dk", "dv"), grads, ref, low):
            assert_within_budget(f"{name} N{N} d{D}", got, r, n)


@on_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_packed_gradient_through_the_gluon_backward(D, request, monkeypatch):
    """The model's path: q, k, v as views of one projection; with hopper_backward on, the Gluon kernel writes
    dK, dV (and the tl pass dQ) straight into d(qkv)'s slices: within the float64-reference budget."""
    B, N, Hq, Hkv = 2, 333, 4, 2
    g = seeded_generator(request)
    qkv = torch.randn(B, N, (Hq + 2 * Hkv) * D, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    do = torch.randn(B, Hq, N, D, generator=g).to("cuda", torch.bfloat16)
    gluon, _ = _spy(monkeypatch)
    with options.use(hopper_backward="on"):
        flash_attention_qkvpacked(qkv, Hq, Hkv).backward(do)
    assert gluon == [launch.hopper_bwd_form(D, True)]
    ref_qkv = qkv.detach().double().requires_grad_()
    naive_attention(*split_qkv(ref_qkv, Hq, Hkv), causal=True).backward(do.double())
    low_qkv = qkv.detach().clone().requires_grad_()
    naive_attention(*split_qkv(low_qkv, Hq, Hkv), causal=True).backward(do)
    assert_within_budget("d(qkv)", qkv.grad, ref_qkv.grad, low_qkv.grad)


@on_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_packed_projection_layout(D, request, poisoned):
    """q, k, v as (B, N, H, D) views of one projection (the model's layout, no copy): the kernels read those
    strides, and dq, dk, dv come back laid out like q, k, v, as the tl backward lays them out."""
    B, N, Hq, Hkv = 2, 333, 4, 2
    g = seeded_generator(request)
    qkv = torch.randn(B, N, (Hq + 2 * Hkv) * D, generator=g).to("cuda", torch.bfloat16)
    q, k, v = split_qkv(qkv, Hq, Hkv)  # (B, H, N, D) views
    do = torch.randn(B, N, Hq, D, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)  # like o
    assert backward_launch.unsupported_backward(do, q, k, v, do) is None
    o, lse = launch._fwd(q, k, v, True, D ** -0.5)
    dq, dk, dv = launch._hopper_bwd(do, q, k, v, o, lse, True, D ** -0.5)
    for got, like in ((dq, q), (dk, k), (dv, v)):
        assert got.stride() == launch._empty_like_layout(launch._layout(like), like.dtype, like.device).stride()
    ref = _naive_grads(q.double(), k.double(), v.double(), do.double(), True)
    low = _naive_grads(q, k, v, do, True)
    for name, got, r, n in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, low):
        assert_within_budget(name, got, r, n)


# --------------------------------------------------------------------- which inputs it takes (any machine)

def _cpu_inputs(D=64, dtype=torch.bfloat16, Hq=4, Hkv=2):
    q = torch.randn(2, Hq, 17, D).to(dtype)
    kv = torch.randn(2, Hkv, 33, D).to(dtype)
    return torch.randn_like(q), q, kv, kv, torch.randn_like(q)


def test_unsupported_inputs_name_the_reason(monkeypatch):
    """On an sm_90 device (stood in for): what the Gluon forward takes, with do and o shaped like q and
    TMA-aligned; anything else is refused with the reason (_hopper_bwd raises it)."""
    monkeypatch.setattr(hopper_launch, "_is_sm90", lambda device: True)
    monkeypatch.setattr(kt, "INTERPRET", False)
    if not flash_hopper.AVAILABLE:
        assert backward_launch.unsupported_backward(*_cpu_inputs()) == flash_hopper.UNAVAILABLE_REASON
        return
    do, q, k, v, o = _cpu_inputs()
    assert backward_launch.unsupported_backward(do, q, k, v, o) is None
    assert "head dim 96" in backward_launch.unsupported_backward(*_cpu_inputs(D=96))
    assert "dtype torch.float32" in backward_launch.unsupported_backward(*_cpu_inputs(dtype=torch.float32))
    assert "do (2, 4, 16, 64)" in backward_launch.unsupported_backward(do[:, :, :16], q, k, v, o)
    misaligned = torch.randn(2, 4, 17, 64 + 4).bfloat16()[..., :64]  # a row stride of 136 bytes
    assert "16-byte" in backward_launch.unsupported_backward(do, q, k, v, misaligned)
    with pytest.raises(ValueError, match="16-byte"):
        launch._hopper_bwd(misaligned, q, k, v, o, torch.zeros(2, 4, 17))
    monkeypatch.setattr(hopper_launch, "_is_sm90", lambda device: False)
    assert "compute capability 9.0" in backward_launch.unsupported_backward(do, q, k, v, o)



def test_fused_form_arguments_are_checked_before_the_launch():
    """dkdv_into refuses an unknown fused form and the lagged forms (4, 6) with the next block's score matmuls
    issued ahead, each in one line, before anything is launched."""
    do, q, k, v, o = _cpu_inputs()
    B, Hq, Nq, D = q.shape
    lse = torch.zeros(B, Hq, Nq)
    dqacc = torch.zeros(B, Hq, Nq, D)
    with pytest.raises(ValueError, match="dq_mode=7"):
        backward_launch.dkdv_into(do, q, k, v, lse, lse, k.clone(), v.clone(), True, 0.125, dqacc=dqacc, dq_mode=7)
    for lagged in backward_launch.LAGGED_DQ_MODES:
        with pytest.raises(ValueError, match=f"dq_mode={lagged} .*ahead"):
            backward_launch.dkdv_into(do, q, k, v, lse, lse, k.clone(), v.clone(), True, 0.125, ahead=True,
                                      dqacc=dqacc, dq_mode=lagged)


def test_a_ring_beyond_shared_memory_is_refused_in_one_line():
    """A ring depth within MAX_STAGES whose buffers do not fit beside the fused form's dQ and dSᵀ buffers (d128,
    4 stages, dq_mode 3 and up: 264 KB) is refused before the compiler would fail; the unfused kernel takes it."""
    do, q, k, v, o = _cpu_inputs(D=128)
    B, Hq, Nq, D = q.shape
    lse = torch.zeros(B, Hq, Nq)
    dqacc = torch.zeros(B, Hq, Nq, D)
    assert backward_launch.MAX_STAGES[128] == 4
    assert backward_launch.shared_bytes(128, 4, 0) <= backward_launch.SMEM_LIMIT
    for mode in (3, 4, 5, 6):
        assert backward_launch.shared_bytes(128, 4, mode) > backward_launch.SMEM_LIMIT
        with pytest.raises(ValueError, match=f"stages=4 at head dim 128 with dq_mode={mode} needs .* fewer stages"):
            backward_launch.dkdv_into(do, q, k, v, lse, lse, k.clone(), v.clone(), True, 0.125, stages=4,
                                      dqacc=dqacc, dq_mode=mode)
    for D in (64, 128):  # every default fits, fused or not
        for causal in (True, False):
            for mode in backward_launch.DQ_MODES + (0,):
                stages = backward_launch.default_stages(D, causal)
                assert backward_launch.shared_bytes(D, stages, mode) <= backward_launch.SMEM_LIMIT


@pytest.mark.skipif(not flash_hopper.AVAILABLE, reason="this Triton has no Gluon Hopper API (nothing to launch)")
def test_repeated_backward_launches_call_the_compiled_kernel_directly(monkeypatch):
    """dkdv_into's first launch of a signature goes through the JIT (which compiles and returns the kernel); a
    repeat, on other buffers of the same shapes, calls the compiled kernel's launcher with the arguments then the
    constexprs in the kernel's order; another fused form, mask, dtype or pointer alignment is a new signature;
    with fast_launch off every launch goes through the JIT."""
    from kernels.flash_hopper import backward

    names = list(backward._attn_bwd_dkdv_hopper.arg_names)
    jit_calls, direct = [], []
    monkeypatch.setattr(backward_launch._backward, "_attn_bwd_dkdv_hopper", recording_jit(names, jit_calls))
    monkeypatch.setattr(backward_launch, "_compiled", {})
    monkeypatch.setattr(backward_launch, "FAST_LAUNCH", True)
    monkeypatch.setattr(kt, "INTERPRET", False)
    monkeypatch.setattr(kt, "sm_count", lambda device: H200_SMS)
    monkeypatch.setattr(kt, "launch_compiled", lambda kernel, grid, vals: direct.append((kernel, grid, vals)))

    def launch(dtype=torch.bfloat16, causal=True, mode=4, lse_offset=0):
        do, q, k, v, _ = _cpu_inputs(dtype=dtype)
        B, Hq, Nq, D = q.shape
        lse = torch.zeros(B * Hq * Nq + 4)[lse_offset:lse_offset + B * Hq * Nq].view(B, Hq, Nq)
        backward_launch.dkdv_into(do, q, k, v, lse, lse.clone(), k.clone(), v.clone(), causal, 0.125,
                                  dqacc=torch.zeros(B, Hq, Nq, D), dq_mode=mode)

    launch()
    assert len(jit_calls) == 1 and not direct
    launch()
    assert len(jit_calls) == 1 and len(direct) == 1
    kernel, grid, vals = direct[0]
    assert isinstance(kernel, CompiledStandIn) and grid == jit_calls[0][0] and len(vals) == len(names)
    assert jit_calls[0][2] == tuple(names[jit_calls[0][1]:]) + ("num_warps", "maxnreg")
    assert vals[names.index("DQ")] == 4 and vals[names.index("CAUSAL")] is True
    for change in (dict(mode=6), dict(causal=False), dict(dtype=torch.float16), dict(lse_offset=1)):
        launch(**change)
        launch(**change)
    assert len(jit_calls) == 5 and len(direct) == 5
    with options.use(fast_launch=False):
        launch()
    assert len(jit_calls) == 6 and len(direct) == 5
    with backward_launch.direct_launches(False):  # the module's switch, off by default until run on a GPU
        launch()
    assert len(jit_calls) == 7 and len(direct) == 5


def test_rows_through_tma_only_where_a_box_fits():
    """The lse and delta rows go through a 1-d TMA descriptor only where every head's rows start on 16 bytes (Nq
    a multiple of 4), the flat buffer holds at least one BLOCK_M box and starts on 16 bytes; elsewhere the
    consumers keep their global loads."""
    m = backward_launch.BLOCK_M
    assert backward_launch.rows_fit_tma(torch.zeros(1, 1, m))
    assert backward_launch.rows_fit_tma(torch.zeros(1, 2, 1020))
    assert not backward_launch.rows_fit_tma(torch.zeros(1, 2, 1023))  # the second head's rows start at byte 4092
    assert not backward_launch.rows_fit_tma(torch.zeros(1, 2, 4))  # 8 floats: less than one box
    assert not backward_launch.rows_fit_tma(torch.zeros(4 * m + 4)[1:].view(1, 1, 4 * m + 3)[..., :-3])  # 4 B past 16
    assert backward_launch.rows_through_tma_for(4096) and not backward_launch.rows_through_tma_for(4097)
    with backward_launch.rows_through_tma(False):
        assert not backward_launch.rows_through_tma_for(4096)


@pytest.mark.parametrize("N,D,causal,want", [
    (4096, 128, True, True), (2048, 128, True, True), (2047, 128, False, False), (2044, 128, True, False),
    (4097, 128, False, True), (4097, 128, True, False), (4096, 64, False, True), (4096, 64, True, True),
    (4092, 64, True, False), (4097, 64, True, False),
    (16384, 64, True, True), (8192, 64, True, True), (8188, 64, True, True), (2048, 64, False, False),
])
def test_backward_auto_dispatch_by_shape(N, D, causal, want):
    """hopper_backward = "auto": the Gluon backward for the shapes launch.HOPPER_BWD_AUTO_MIN_LEN names (head dim,
    causal, the shorter length, and whether the rows go through TMA), the tl backward for the others."""
    q = torch.empty(1, 2, N, D, device="meta")
    assert launch._hopper_bwd_auto(q, q, causal) is want
    assert launch._hopper_bwd_auto(q, q[:, :, :2043], causal) is False  # the shorter length counts (< 2048)


# --------------------------------------------------------------------- compiled for sm_90 (any machine)

H200_SMS = 132
SMEM_LIMIT = backward_launch.SMEM_LIMIT
# ptxas spill bytes (stores and loads, per thread) each default variant of the Gluon kernel may have: none at
# d64; at d128 the consumers sit at their 240 registers. Measured when this was written (stores / loads, GQA):
# Triton 3.9 causal 76 / 100, not causal 0 / 0; Triton 3.6 causal 8 / 8, not causal 12 / 12 (without GQA:
# 44 / 44 and 24 / 24).
MAX_SPILL = {64: 0, 128: 128}
# the fused forms at d128 hold dQ's half-tile and the shared dS buffers besides dK and dV: Triton 3.6 (the
# H200's, where they were timed) spills 120-248 B per thread in form 3 and 144-324 B in form 4; Triton 3.9
# 364-528 B and 552-792 B
MAX_SPILL_FUSED_D128 = 800


def _record(c) -> dict:
    from tests.gpu_compile import ptxas_usage
    names = c.src.fn.arg_names
    consts = {names[path[0]]: v for path, v in c.src.constants.items() if isinstance(v, (bool, int, str))}
    ptx = c.asm["ptx"]
    rec = dict(kernel=c.name, consts=consts, shared=c.metadata.shared, num_warps=c.metadata.num_warps,
               ptx_entry=f".entry {c.name}(" in ptx, cubin_bytes=len(c.asm.get("cubin") or b""), **ptxas_usage(c))
    if c.name == "_attn_bwd_dkdv_hopper":
        desc = str(c.src.signature["q_desc"])  # e.g. "tensordesc<bf16[1, 1, 64, 64],...>"
        rec.update(dtype=desc[desc.index("<") + 1:desc.index("[")], wgmma="wgmma.mma_async" in ptx,
                   tma_load="cp.async.bulk.tensor.4d.shared" in ptx,
                   tma_store="cp.async.bulk.tensor.4d.global.shared" in ptx, mbarrier="mbarrier.try_wait" in ptx,
                   rows_tma="cp.async.bulk.tensor.1d.shared" in ptx,
                   setmaxnreg=re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx) is not None
                   and re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx) is not None)
    return rec


# the fused forms compiled per head dim
FUSED_COMPILED = ((64, (1, 2, 3, 4, 5, 6)), (128, (3, 4, 5, 6)))

# the child processes' shares of the variants (tests/util.py: compiled_records): the defaults and fused forms;
# the mask skipped and the dSᵀ ring; the tail in launch order and the rows through loads
PARTS = ("forms", "mask_ring", "tail_rows")


def compile_hopper_backward(part: str | None = None) -> list[dict]:
    """Run in a process started with TRITON_INTERPRET=0: every variant _hopper_bwd launches (the tl dQ kernel
    in its default config, the Gluon dK/dV kernel), compiled for sm_90: Nq = 116 takes the rows through TMA,
    Nq = 113 (not a multiple of 4) or rows_through_tma off the consumers' loads. With a part of PARTS, its
    share."""
    from kernels import options
    from kernels.flash.backward import _attn_bwd_dq, _attn_bwd_dq_out, _attn_bwd_prep
    from kernels.flash_hopper import backward
    from tests.gpu_compile import compiling_instead_of_launching

    kt.check_device = lambda device, what: None  # CPU tensors stand in for the GPU's; nothing is launched
    kt.sm_count = lambda device: H200_SMS
    hopper_launch._is_sm90 = lambda device: True
    launch._hopper_or_newer = lambda index: True
    def compile_one(D, causal, dtype=torch.bfloat16, Hkv=2, Nq=116, **launch_kw):
        q = torch.randn(2, 4, Nq, D).to(dtype)  # (B, Hq, Nq, D)
        kv = torch.randn(2, Hkv, 203, D).to(dtype)  # (B, Hkv, Nk, D): Nk != Nq
        launch._hopper_bwd(torch.randn_like(q), q, kv, kv, torch.randn_like(q), torch.zeros(2, 4, Nq), causal,
                           **launch_kw)

    with compiling_instead_of_launching(backward._attn_bwd_dkdv_hopper, _attn_bwd_dq, _attn_bwd_prep,
                                        _attn_bwd_dq_out) as compiled, options.use(autotune=False, fast_launch=False):
        if part in (None, "forms"):
            _compile_forms(compile_one)
        if part in (None, "mask_ring"):
            _compile_mask_ring(compile_one)
        if part in (None, "tail_rows"):
            _compile_tail_rows(compile_one)
    return [_record(c) for c in compiled]


def _compile_forms(compile_one) -> None:
    """The default variants (both dtypes, head dims, masks; GQA and not) and the fused forms."""
    for dtype in DTYPES:
        for D in (64, 128):
            for causal in (True, False):
                for Hkv in ((2, 4) if (dtype, D) == (torch.bfloat16, 128) else (2,)):  # GQA; and not
                    compile_one(D, causal, dtype, Hkv)
    for causal in (True, False):  # the fused forms (dQ in the Gluon kernel): all at d64, 3 to 6 at d128
        for D, forms in FUSED_COMPILED:
            for fused in forms:
                compile_one(D, causal, fused=fused)


def _compile_mask_ring(compile_one) -> None:
    """Causal blocks below the diagonal unmasked; the dSᵀ buffers freed by the ring."""
    with backward_launch.skip_mask_below_diagonal():  # causal blocks below the diagonal unmasked (CAUSAL = 2)
        for D in (64, 128):
            for fused in (None, 3):
                compile_one(D, True, fused=fused)
    with backward_launch.ds_freed_by_ring():  # forms 2, 3 and 5, a dS buffer per stage, no free barriers
        for causal in (True, False):
            for D, stages in ((64, None), (64, backward_launch.DS_RING_MAX_STAGES[64]), (128, None)):
                for fused in (2, 3, 5):
                    compile_one(D, causal, stages=stages, fused=fused)


def _compile_tail_rows(compile_one) -> None:
    """Causal in launch order; lse and delta loaded by the consumers."""
    with backward_launch.tail_heads_dealt(0):  # causal in launch order (the default deals the last heads)
        for D in (64, 128):
            for fused in (None, 3, 5):
                compile_one(D, True, fused=fused)
    with backward_launch.rows_through_tma(False):  # lse and delta loaded by the consumers: split and form 3
        for causal in (True, False):
            for D in (64, 128):
                for fused in (None, 3):
                    compile_one(D, causal, Nq=113, fused=fused)


@needs_gluon
def test_hopper_backward_compiles_for_sm90(tmp_path):
    """Each variant of the Gluon kernel (bf16 and fp16, head dims 64 and 128, causal or not, GQA or not; the
    causal d64 variants with the mask skipped below the diagonal, CAUSAL = 2; fused forms 2, 3 and 5 with the
    dSᵀ buffers freed by the ring, DS_RING, which spill no more bytes than the same forms without it; causal, with
    the last heads' key tiles dealt (TAIL_HEADS, the default) and, for the split and fused forms 3 and 5, in
    launch order)
    compiles to a cubin with wgmma, 4-d TMA loads and stores, mbarrier waits and the producer-to-consumer
    register reallocation; 12 warps; shared memory within sm_90's limit; spills within MAX_SPILL; ptxas does
    not serialise its wgmmas. The tl dQ
    kernel it launches first compiles too. Registers and spills are printed."""
    import triton

    from tests.util import compiled_records

    records = compiled_records("tests.test_flash_hopper_backward", tmp_path, PARTS)
    every_gluon = [r for r in records if r["kernel"] == "_attn_bwd_dkdv_hopper"]
    mask_skip = [r for r in every_gluon if r["consts"]["CAUSAL"] == 2]  # the option: checked alike, then set apart
    ring = [r for r in every_gluon if r["consts"].get("DS_RING")]  # the option ds_freed_by_ring: the same
    # causal in launch order (tail_heads_dealt(0); the default deals the last heads' tiles): checked alike
    in_order = [r for r in every_gluon if r["consts"]["CAUSAL"] and not r["consts"]["TAIL_HEADS"]]
    gluon = [r for r in every_gluon if r not in mask_skip and r not in ring and r not in in_order]
    for rec in records:
        c = rec["consts"]
        print(f"triton {triton.__version__} {rec['kernel']} {rec.get('dtype', '')} "
              f"d{c.get('HEAD_D', c.get('HEAD_DIM'))} causal={c.get('CAUSAL', '-')} gqa={c.get('GQA', '-')} "
              f"dq={c.get('DQ', '-')}: "
              f"{rec['registers']} registers, spill stores {rec['spill_stores']} B, loads {rec['spill_loads']} B, "
              f"shared {rec['shared']} B")
    assert {(r["consts"]["HEAD_D"], r["consts"]["DQ"]) for r in mask_skip} == {(64, 0), (64, 3)}  # d64 only
    default = backward_launch.default_stages
    assert {(r["consts"]["HEAD_D"], r["consts"]["CAUSAL"], r["consts"]["DQ"], r["consts"]["STAGES"])
            for r in ring} == {(D, causal, mode, stages) for causal in (True, False) for mode in (2, 3, 5)
                               for D, stages in ((64, default(64, causal)),
                                                 (64, backward_launch.DS_RING_MAX_STAGES[64]),
                                                 (128, default(128, causal)))}
    assert sorted((r["consts"]["HEAD_D"], r["consts"]["DQ"]) for r in in_order) == \
        [(D, mode) for D in (64, 128) for mode in (0, 3, 5)]
    assert all(r["consts"]["TAIL_HEADS"] for r in every_gluon if r["consts"]["CAUSAL"] and r not in in_order)
    for rec in ring:  # no more spilled bytes, stores and loads together, than the same variant with the barriers
        same = [r for r in gluon if r["consts"] == {**rec["consts"], "DS_RING": False}
                or r["consts"] == {k: v for k, v in rec["consts"].items() if k != "DS_RING"}]
        for r in same:
            assert rec["spill_stores"] + rec["spill_loads"] <= r["spill_stores"] + r["spill_loads"], (rec, r)
    for rec in every_gluon:  # the launcher's estimate of shared memory holds every variant, with little to spare
        c = rec["consts"]
        need = backward_launch.shared_bytes(c["HEAD_D"], c["STAGES"], c["DQ"], c["DS_RING"], c["ROWS_TMA"])
        assert 0 <= need - rec["shared"] < backward_launch.SMEM_SLACK, (need, rec)
    for rec in every_gluon:
        assert rec["wgmma"] and rec["tma_load"] and rec["tma_store"] and rec["mbarrier"] and rec["setmaxnreg"], rec
        assert rec["num_warps"] == 12 and 0 < rec["shared"] <= SMEM_LIMIT, rec
        fused_d128 = rec["consts"]["HEAD_D"] == 128 and rec["consts"].get("DQ", 0) >= 1
        limit = MAX_SPILL_FUSED_D128 if fused_d128 else MAX_SPILL[rec["consts"]["HEAD_D"]]
        assert rec["spill_stores"] <= limit and rec["spill_loads"] <= limit, rec
        assert not rec["wgmma_serialized"], rec  # ptxas's C751x notes: every wgmma of the kernel serialised
    got = {(r["dtype"], r["consts"]["HEAD_D"], r["consts"]["CAUSAL"], r["consts"]["GQA"]) for r in gluon}
    want = {(dt, D, causal, True) for dt in ("bf16", "fp16") for D in (64, 128) for causal in (True, False)}
    assert got == want | {("bf16", 128, causal, False) for causal in (True, False)}
    assert any(r["kernel"] == "_attn_bwd_dq" for r in records)
    rows_tma = [r for r in gluon if r["consts"].get("ROWS_TMA")]
    assert all(r["rows_tma"] for r in rows_tma) and not any(r["rows_tma"] for r in gluon if r not in rows_tma)
    loads = [r for r in gluon if r not in rows_tma]  # the other variant: only where rows_through_tma was off
    assert {(r["consts"]["HEAD_D"], r["consts"]["CAUSAL"], r["consts"]["DQ"]) for r in loads} == {
        (D, causal, mode) for D in (64, 128) for causal in (True, False) for mode in (0, 3)}
    assert {(r["consts"]["HEAD_D"], r["consts"]["CAUSAL"], r["consts"].get("DQ")) for r in gluon
            if r["consts"].get("DQ")} == {(D, causal, mode) for causal in (True, False)
                                          for D, modes in FUSED_COMPILED for mode in modes}


if __name__ == "__main__":
    from tests.util import compile_child
    compile_child("tests.test_flash_hopper_backward", PARTS, compile_hopper_backward)
