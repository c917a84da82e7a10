"""The Gluon Hopper forward (kernels/flash_hopper) against a float64 reference, on an sm_90 GPU.

Output: within the suite's error budget (tests/error_budget.py) of naive attention computed in the same dtype.
Log-sum-exp (base 2, scaled, what the tl backward reads): within the budget of the tl forward's own. Rows that
see no key (causal, Nq > Nk): O exactly 0 and lse exactly +inf. Every buffer the kernels write starts as NaN,
so an element never written fails the test. The persistent grid is also run with 1 and 5 programs (many tiles
per program: the mbarrier phases across tiles, tiles with no key block in between), which must give bitwise the
result of the full grid; causal tiles from per-program lists of any group size, bitwise the strided order's;
repeated launches through the compiled kernel's launcher, bitwise the JIT's; Q released early or late, bitwise
alike; the row sums as per-thread partial sums or whole (hopper_lane_sums on and off), within the budget.
Through kernels.flash_attention the hopper_forward switch on and off give the same output and gradients within
the budget, on and off each launching the forward they should.

Skipped (with the reason) without a CUDA device of compute capability 9.0, or with a Triton lacking Gluon; the
compile check for any machine is tests/test_flash_hopper_compile.py.
"""
from __future__ import annotations

import math

import pytest
import torch

import kernels._triton as kt
from kernels import flash_attention, flash_attention_qkvpacked, flash_hopper, naive_attention, options, split_qkv
from kernels.flash import launch
from kernels.flash_hopper import launch as hopper_launch
from kernels.naive import causal_mask
from tests.error_budget import assert_within_budget
from tests.util import needs_sm90_gluon, seeded_generator

pytestmark = needs_sm90_gluon()

DTYPES = [torch.bfloat16, torch.float16]
# (B, Hq, Hkv, Nq, Nk, causal): odd lengths, Nq != Nk both ways (bottom-right causal; Nq > Nk leaves rows that
# see no key), lengths past one tile and past one key block, GQA and MQA; each in d64 and d128, bf16 and fp16.
CASES = [
    (1, 2, 2, 1, 1, True),
    (1, 2, 2, 1, 1, False),
    (2, 2, 2, 113, 113, True),
    (1, 2, 2, 113, 113, False),
    (1, 2, 2, 1023, 1023, True),
    (1, 2, 2, 1023, 1023, False),
    (1, 2, 2, 4097, 4097, True),
    (1, 1, 1, 4097, 4097, False),
    (1, 2, 2, 113, 1023, True),
    (1, 2, 2, 113, 1023, False),
    (1, 2, 2, 1, 4097, True),
    (1, 2, 2, 1023, 113, True),
    (1, 2, 2, 1023, 113, False),
    (1, 2, 2, 300, 1, True),
    (2, 4, 2, 1023, 1023, True),
    (1, 8, 1, 257, 257, False),
]


def _id(case, D):
    B, Hq, Hkv, Nq, Nk, causal = case
    return f"B{B}-H{Hq}/{Hkv}-{Nq}x{Nk}-d{D}-{'causal' if causal else 'full'}"


MATRIX = [pytest.param(case, D, dtype, id=f"{_id(case, D)}-{str(dtype)[6:]}")
          for case in CASES for D in (64, 128) for dtype in DTYPES]


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    """Every buffer the kernels allocate starts as NaN; no launch plan recorded by another test is replayed."""
    monkeypatch.setattr(kt, "empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                            device=device))
    monkeypatch.setattr(launch, "_plans", {})


def _inputs(case, D, dtype, g):
    B, Hq, Hkv, Nq, Nk, causal = case
    q = torch.randn(B, Hq, Nq, D, generator=g).to("cuda", dtype)  # (B, Hq, Nq, D)
    k = torch.randn(B, Hkv, Nk, D, generator=g).to("cuda", dtype)  # (B, Hkv, Nk, D)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to("cuda", dtype)
    return q, k, v


def _reference_lse(q, k, causal: bool, sm_scale: float) -> torch.Tensor:
    """(B, Hq, Nq) float64: log2 of the row's sum of exp2(s · sm_scale · log2 e), +inf where a row sees no key."""
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, Hq, Nk, D)
    s = q.double() @ kk.transpose(-1, -2) * sm_scale  # (B, Hq, Nq, Nk)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], device=q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1) * kt.LOG2E
    return torch.where(torch.isneginf(lse), float("inf"), lse)


def _assert_few_programs_bitwise(q, k, v, o, lse, causal: bool, monkeypatch):
    """The forward on a persistent grid of 1 and of 5 programs gives o and lse of the full grid bitwise (the
    rings' phases carried across the tiles a program runs), under the options in force."""
    for programs in (1, 5):
        monkeypatch.setattr(kt, "sm_count", lambda device, programs=programs: programs)
        few = flash_hopper.flash_hopper_forward(q, k, v, causal=causal)
        assert torch.equal(few[0], o) and torch.equal(few[1], lse)


def _assert_matches_reference(q, k, v, o, lse, causal: bool):
    """O within the budget of the float64 reference, lse within the tl forward's budget and +inf exactly where a
    row sees no key, and those rows' O exactly 0."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    ref = naive_attention(q.double(), k.double(), v.double(), causal=causal)
    assert_within_budget("out", o, ref, naive_attention(q, k, v, causal=causal))
    ref_lse = _reference_lse(q, k, causal, scale)
    _, tl_lse = launch._fwd(q, k, v, causal, scale)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~seen)
    assert_within_budget("lse", lse[seen], ref_lse[seen], tl_lse[seen])
    if causal and q.shape[2] > k.shape[2]:
        blind = ~causal_mask(q.shape[2], k.shape[2], device="cuda").any(dim=1)  # (Nq,)
        assert (o[:, :, blind] == 0).all()


@pytest.mark.parametrize("case,D,dtype", MATRIX)
def test_forward_matches_reference(case, D, dtype, request):
    causal = case[-1]
    q, k, v = _inputs(case, D, dtype, seeded_generator(request))
    scale = 1.0 / math.sqrt(D)
    o, lse = flash_hopper.flash_hopper_forward(q, k, v, causal=causal)
    assert o.dtype == dtype and lse.dtype == torch.float32

    ref = naive_attention(q.double(), k.double(), v.double(), causal=causal)
    assert_within_budget("out", o, ref, naive_attention(q, k, v, causal=causal))

    ref_lse = _reference_lse(q, k, causal, scale)
    _, tl_lse = launch._fwd(q, k, v, causal, scale)  # the tl forward's (the option is off): the budget
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~seen) and torch.equal(torch.isinf(tl_lse), ~seen)
    assert_within_budget("lse", lse[seen], ref_lse[seen], tl_lse[seen])
    if causal and case[3] > case[4]:  # rows that see no key: exactly zero output
        blind = ~causal_mask(case[3], case[4], device="cuda").any(dim=1)  # (Nq,)
        assert blind.any() and (o[:, :, blind] == 0).all()


@pytest.mark.parametrize("case,dtype", [pytest.param(case, dtype, id=f"{_id(case, 64)}-{str(dtype)[6:]}")
                                        for case in CASES for dtype in DTYPES])
def test_other_consumer_count_matches_reference(case, dtype, request, monkeypatch):
    """Head dim 64 with the consumer count the default does not choose (three warpgroups and 192-row tiles with a
    causal mask, two without, under the Triton measured): within the budget of the float64 reference (O and lse), rows that
    see no key exactly 0 / +inf, every output written; with 1 and 5 programs bitwise the full grid's (the
    turn ring's and the K/V ring's phases across tiles)."""
    causal = case[-1]
    q, k, v = _inputs(case, 64, dtype, seeded_generator(request))
    count = 5 - hopper_launch.consumer_count(64, causal)  # the count the default does not choose
    with options.use(hopper_consumers_d64=count):
        o, lse = flash_hopper.flash_hopper_forward(q, k, v, causal=causal)
    _assert_matches_reference(q, k, v, o, lse, causal)
    if case[3] >= 300:
        with options.use(hopper_consumers_d64=count):
            _assert_few_programs_bitwise(q, k, v, o, lse, causal, monkeypatch)


@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("case,D,dtype", [
    pytest.param((2, 4, 2, 1023, 1023, True), 128, torch.bfloat16, id="causal-d128"),
    pytest.param((2, 3, 1, 700, 300, False), 64, torch.float16, id="full-d64-mqa"),
    pytest.param((1, 4, 2, 700, 300, True), 64, torch.bfloat16, id="causal-Nq>Nk-d64"),
])
def test_persistent_grid_gives_the_same_result_with_any_program_count(case, D, dtype, programs, request,
                                                                       monkeypatch):
    """A program works through tiles program_id, program_id + grid, ...; the result of a tile must not depend
    on which program takes it or what it did before (ring and barrier phases carried across tiles, tiles with
    no key block, the O store of the previous tile)."""
    q, k, v = _inputs(case, D, dtype, seeded_generator(request))
    full = flash_hopper.flash_hopper_forward(q, k, v, causal=case[-1])
    monkeypatch.setattr(kt, "sm_count", lambda device: programs)
    few = flash_hopper.flash_hopper_forward(q, k, v, causal=case[-1])
    assert torch.equal(few[0], full[0]) and torch.equal(few[1], full[1])


@pytest.mark.parametrize("l2_bytes", [1, 1 << 20, 1 << 40])
@pytest.mark.parametrize("case,D,dtype", [
    pytest.param((3, 4, 2, 1023, 1023, True), 128, torch.bfloat16, id="causal-gqa-d128"),
    pytest.param((2, 3, 3, 700, 1500, True), 64, torch.float16, id="causal-Nq<Nk-d64"),
    pytest.param((1, 5, 1, 900, 300, True), 64, torch.bfloat16, id="causal-Nq>Nk-d64-mqa"),
])
def test_tile_lists_give_the_result_of_the_strided_order(case, D, dtype, l2_bytes, request):
    """Causal tiles run from per-program lists (groups of 1 pair, of a few, of every pair) or strided over the
    grid (hopper_tile_lists off): a tile's result does not depend on the order, so both must agree bitwise, and
    every tile must be in some list (the NaN-poisoned outputs)."""
    q, k, v = _inputs(case, D, dtype, seeded_generator(request))
    scale = 1.0 / math.sqrt(D)
    outs = []
    for lists in (True, False):
        o, lse = (kt.empty(t.shape, t.dtype, t.device) for t in (q, q[..., 0].float()))
        with options.use(hopper_tile_lists=lists):
            hopper_launch.forward_into(q, k, v, o, lse, True, scale, l2_bytes=l2_bytes)
        outs.append((o, lse))
    (o, lse), (o_strided, lse_strided) = outs
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(o, o_strided) and torch.equal(lse, lse_strided)


@pytest.mark.parametrize("case,D,dtype", [
    pytest.param((2, 4, 2, 1023, 1023, True), 64, torch.bfloat16, id="causal-d64"),
    pytest.param((1, 5, 1, 900, 130, True), 128, torch.float16, id="causal-Nq>Nk-d128-mqa"),
    pytest.param((2, 3, 3, 700, 1500, False), 128, torch.bfloat16, id="full-Nq<Nk-d128"),
    pytest.param((1, 3, 1, 300, 4100, False), 64, torch.bfloat16, id="full-Nq<Nk-d64-mqa-three"),
])
def test_early_and_late_q_release_give_the_same_result(case, D, dtype, request):
    """The consumers release Q after a tile's last QKᵀ (hopper_early_q "on") or after its last PV ("off"):
    only the synchronisation moves, so the results agree bitwise with each other and with the default (tiles of
    no, one and many key blocks; two and three consumers)."""
    q, k, v = _inputs(case, D, dtype, seeded_generator(request))
    outs = []
    for mode in ("on", "off", "auto"):
        with options.use(hopper_early_q=mode):
            outs.append(flash_hopper.flash_hopper_forward(q, k, v, causal=case[-1]))
    for o, lse in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lse, outs[0][1])
    assert hopper_launch.early_q(case[-1], case[4]) is (case[-1] or case[4] < 4096)


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("case,D,dtype", [
    pytest.param((2, 4, 2, 1023, 1023, True), 64, torch.bfloat16, id="causal-d64"),
    pytest.param((1, 5, 1, 900, 130, True), 64, torch.float16, id="causal-Nq>Nk-d64-mqa"),
    pytest.param((2, 3, 3, 700, 1500, True), 64, torch.bfloat16, id="causal-Nq<Nk-d64"),
    pytest.param((1, 4, 2, 2049, 2049, True), 128, torch.bfloat16, id="causal-d128"),
    pytest.param((1, 5, 1, 900, 130, True), 128, torch.float16, id="causal-Nq>Nk-d128-mqa"),
])
def test_own_key_blocks_give_the_result_of_every_block(case, D, dtype, consumers, request, monkeypatch):
    """Causal, each consumer skips the matmuls of the tile's key blocks its own rows do not see
    (hopper_own_blocks, the default) or runs them all masked: a fully masked block changes neither the row
    statistics nor O, so both agree bitwise, also with 1 and 5 programs (turns and stages taken without
    matmuls, across tiles)."""
    q, k, v = _inputs(case, D, dtype, seeded_generator(request))
    with options.use(hopper_consumers_d64=consumers):
        with options.use(hopper_own_blocks=False):
            every = flash_hopper.flash_hopper_forward(q, k, v, causal=True)
        for programs in (None, 1, 5):
            if programs:
                monkeypatch.setattr(kt, "sm_count", lambda device: programs)
            own = flash_hopper.flash_hopper_forward(q, k, v, causal=True)
            assert not own[0].isnan().any()
            assert torch.equal(own[0], every[0]) and torch.equal(own[1], every[1])


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("case,D,dtype", [
    pytest.param((2, 4, 2, 1023, 1023, True), 64, torch.bfloat16, id="causal-d64"),
    pytest.param((1, 5, 1, 900, 130, True), 64, torch.float16, id="causal-Nq>Nk-d64-mqa"),
    pytest.param((1, 3, 1, 300, 4100, False), 64, torch.bfloat16, id="full-Nq<Nk-d64-mqa"),
    pytest.param((1, 4, 2, 2049, 2049, True), 128, torch.bfloat16, id="causal-d128"),
    pytest.param((2, 3, 3, 700, 1500, False), 128, torch.float16, id="full-Nq<Nk-d128"),
])
def test_row_sum_forms_match_reference(case, D, dtype, consumers, mode, request, monkeypatch):
    """The row sums kept as per-thread partial sums and reduced once per tile (hopper_lane_sums on), or summed
    whole every key block (off), whichever the default: within the budget of the float64 reference (O and lse;
    only the order of the sum's additions moves), rows that see no key exactly 0 / +inf, every output written,
    with 1 and 5 programs bitwise the full grid's."""
    if consumers == 3 and D != 64:
        pytest.skip("three consumers run head dim 64 only")
    causal = case[-1]
    q, k, v = _inputs(case, D, dtype, seeded_generator(request))
    with options.use(hopper_consumers_d64=consumers, hopper_lane_sums=mode):
        o, lse = flash_hopper.flash_hopper_forward(q, k, v, causal=causal)
        _assert_few_programs_bitwise(q, k, v, o, lse, causal, monkeypatch)
    _assert_matches_reference(q, k, v, o, lse, causal)
    if causal and case[3] > case[4]:
        assert (~causal_mask(case[3], case[4], device="cuda").any(dim=1)).any()  # some rows see no key


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", [(1, 2, 1, 6151, 6151, True), (1, 2, 2, 300, 6200, True)],
                         ids=lambda c: _id(c, 64))
def test_long_causal_head_dim_64_default_matches_reference(case, dtype, request, monkeypatch):
    """Causal at head dim 64 from D64_CAUSAL_THREE_FROM_KEYS keys: the default runs three consumers with lane
    sums (under the Triton they were measured with), within the budget of the float64 reference, every output
    written, with 1 and 5 programs bitwise the full grid's."""
    assert case[4] >= hopper_launch.D64_CAUSAL_THREE_FROM_KEYS
    q, k, v = _inputs(case, 64, dtype, seeded_generator(request))
    if hopper_launch.triton.__version__.startswith(hopper_launch.THREE_CONSUMERS_TRITON):
        assert hopper_launch.consumer_count(64, True, Nk=case[4]) == 3 and hopper_launch.lane_sums(64, None, True,
                                                                                                    case[4])
    o, lse = flash_hopper.flash_hopper_forward(q, k, v, causal=True)
    _assert_few_programs_bitwise(q, k, v, o, lse, True, monkeypatch)
    _assert_matches_reference(q, k, v, o, lse, True)


@pytest.mark.parametrize("causal", [True, False])
def test_direct_launches_give_the_result_of_the_jit(causal, request, monkeypatch):
    """A repeated signature calls the compiled kernel's launcher directly (fast_launch, the default): bitwise the
    result of a launch through JITFunction.run, and only the repeat goes direct."""
    q, k, v = _inputs((2, 4, 2, 1023, 1023, causal), 128, torch.bfloat16, seeded_generator(request))
    monkeypatch.setattr(hopper_launch, "_compiled", {})
    direct = []
    real = kt.launch_compiled
    monkeypatch.setattr(kt, "launch_compiled", lambda *a: direct.append(1) or real(*a))
    with options.use(fast_launch=False):
        via_jit = flash_hopper.flash_hopper_forward(q, k, v, causal=causal)
    assert direct == []
    first = flash_hopper.flash_hopper_forward(q, k, v, causal=causal)
    repeat = flash_hopper.flash_hopper_forward(q, k, v, causal=causal)
    assert direct == [1]
    for o, lse in (first, repeat):
        assert torch.equal(o, via_jit[0]) and torch.equal(lse, via_jit[1])


def _fwd_bwd(fn, q, k, v, do, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, causal=causal)
    o.backward(do)
    return [o.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("case,D,dtype", [
    pytest.param((2, 4, 2, 1023, 1023, True), 128, torch.bfloat16, id="causal-gqa-d128-bf16"),
    pytest.param((1, 2, 2, 113, 1023, False), 64, torch.float16, id="full-Nq<Nk-d64-fp16"),
    pytest.param((1, 2, 2, 1023, 113, True), 64, torch.bfloat16, id="causal-Nq>Nk-d64-bf16"),
])
def test_switch_on_and_off_give_the_same_gradients(case, D, dtype, request, monkeypatch):
    """kernels.flash_attention with hopper_forward on runs the Gluon forward (and no tl forward), and the tl
    backward reads its O and lse: output and dq, dk, dv within the budget of naive attention, as with it off."""
    causal = case[-1]
    q, k, v = _inputs(case, D, dtype, seeded_generator(request))
    do = torch.randn(q.shape, generator=seeded_generator(request)).to("cuda", dtype)
    gluon, tl = [], []
    real_into, real_launch = hopper_launch.forward_into, launch._launch
    monkeypatch.setattr(hopper_launch, "forward_into", lambda *a: gluon.append(1) or real_into(*a))
    monkeypatch.setattr(launch, "_launch", lambda name, *a: tl.append(name) or real_launch(name, *a))
    with options.use(hopper_forward="on"):
        on = _fwd_bwd(flash_attention, q, k, v, do, causal)
    assert gluon == [1] and "fwd" not in tl
    tl.clear()
    with options.use(hopper_forward="off"):
        off = _fwd_bwd(flash_attention, q, k, v, do, causal)
    assert gluon == [1] and "fwd" in tl
    ref = _fwd_bwd(naive_attention, q.double(), k.double(), v.double(), do.double(), causal)
    low = _fwd_bwd(naive_attention, q, k, v, do, causal)
    for name, a, b, r, n in zip(("out", "dq", "dk", "dv"), on, off, ref, low):
        assert_within_budget(f"{name} (switch on)", a, r, n)
        assert_within_budget(f"{name} (switch off)", b, r, n)


@pytest.mark.parametrize("causal", [True, False])
def test_default_dispatch_at_the_measured_shapes(causal, request, monkeypatch):
    """With the default option (auto), head dims 128 and 64 at 4096 tokens run the Gluon forward, head dim 64 at
    2048 with fewer query rows than measured the tl forward; all within the budget of naive attention against
    the float64 reference, with GQA."""
    assert options.get().hopper_forward == "auto"
    for D, N, want_gluon in ((128, 4096, True), (64, 4096, True), (64, 2048, False)):
        case = (1, 4, 2, N, N, causal)
        q, k, v = _inputs(case, D, torch.bfloat16, seeded_generator(request))
        gluon, tl = [], []
        real_into, real_launch = hopper_launch.forward_into, launch._launch
        monkeypatch.setattr(hopper_launch, "forward_into", lambda *a: gluon.append(1) or real_into(*a))
        monkeypatch.setattr(launch, "_launch", lambda name, *a: tl.append(name) or real_launch(name, *a))
        monkeypatch.setattr(launch, "_plan_key", lambda *args: None)  # every tl launch goes through _launch
        out = flash_attention(q, k, v, causal=causal)
        monkeypatch.undo()
        assert (gluon == [1]) is want_gluon and ("fwd" in tl) is not want_gluon, (D, gluon, tl)
        ref = naive_attention(q.double(), k.double(), v.double(), causal=causal)
        assert_within_budget(f"out d{D}", out, ref, naive_attention(q, k, v, causal=causal))


@pytest.mark.parametrize("D", [64, 128])
def test_packed_projection_layout(D, request):
    """The model's path: q, k, v as (B, N, H, D) views of one projection (no copy), through the packed form with
    the switch on; O laid out like q, as the tl forward lays it out."""
    B, N, Hq, Hkv = 2, 333, 4, 2
    qkv = torch.randn(B, N, (Hq + 2 * Hkv) * D, generator=seeded_generator(request)).to("cuda", torch.bfloat16)
    qkv.requires_grad_()
    with options.use(hopper_forward="on"):
        o = flash_attention_qkvpacked(qkv, Hq, Hkv)
    q, k, v = (t.detach() for t in split_qkv(qkv, Hq, Hkv))  # (B, H, N, D) views
    assert hopper_launch.unsupported(q, k, v) is None  # the Gluon kernel took these strides
    ref = naive_attention(q.double(), k.double(), v.double(), causal=True)
    assert_within_budget("out", o, ref, naive_attention(q, k, v, causal=True))
    assert o.stride() == launch._empty_like_layout(launch._layout(q), q.dtype, q.device).stride()
    o.sum().backward()
    assert qkv.grad is not None and not torch.isnan(qkv.grad).any()

