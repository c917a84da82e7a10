"""FlashAttention kernel against a float64 reference: output, dq, dk, dv.

Criterion (in the spirit of FlashAttention's own suite): for every tensor, the kernel's max error against the
float64 reference is at most 2x the error of naive attention computed in the same dtype, plus a floor of
1e-5 x max(1, |reference|) (it matters only where naive happens to be exact, e.g. dq = 0 when Nk = 1). Inputs are fresh random tensors per test (seeded from the
test id, so a failure reproduces), every output buffer the kernels allocate is poisoned with NaN first, and
nothing may come back NaN.

On the CPU these run through Triton's interpreter (fp16 and fp32; the interpreter's bf16 dots are wrong). On a
GPU the same file adds bf16, larger shapes, every autotune config, the autotuner, torch.compile with inductor and
a peak-memory check.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import kernels
import kernels._triton as kt
import kernels.flash as fa
from kernels import flash_attention, naive_attention, options
from kernels.flash import configs, launch, ops
from kernels.naive import causal_mask
from tests.util import seeded_generator

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else [])
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _poison_and_fix_config(monkeypatch, request):
    """NaN-fill every buffer the kernels allocate, record its size, and use the default (untuned) configs."""
    allocs = []

    def poisoned_empty(shape, dtype, device):
        allocs.append(math.prod(shape))
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(kt, "empty", poisoned_empty)
    monkeypatch.setattr(launch, "_plans", {})  # launch plans recorded by this test only
    with options.use(autotune="autotune" in request.keywords):
        yield allocs


def _make(shape, dtype, g, amp=1.0):
    return (torch.randn(shape, generator=g, dtype=torch.float32) * amp).to(DEVICE, dtype).requires_grad_()


def _run(fn, q, k, v, do, causal, sm_scale=None):
    for t in (q, k, v):
        t.grad = None
    o = fn(q, k, v, causal=causal, sm_scale=sm_scale)
    o.backward(do)
    return [o.detach(), q.grad.detach(), k.grad.detach(), v.grad.detach()]


def _check(B, Hq, Hkv, Nq, Nk, D, causal, dtype, g, amp=1.0, sm_scale=None):
    q = _make((B, Hq, Nq, D), dtype, g, amp)
    k = _make((B, Hkv, Nk, D), dtype, g, amp)
    v = _make((B, Hkv, Nk, D), dtype, g)
    do = torch.randn((B, Hq, Nq, D), generator=g).to(DEVICE, dtype)

    ref = _run(naive_attention, *[t.detach().double().requires_grad_() for t in (q, k, v)], do.double(), causal,
               sm_scale)
    low = _run(naive_attention, q, k, v, do, causal, sm_scale)  # naive in the same dtype: the error budget
    out = _run(flash_attention, q, k, v, do, causal, sm_scale)

    for name, o, r, n in zip(("out", "dq", "dk", "dv"), out, ref, low):
        assert o.dtype == dtype and o.shape == r.shape, name
        assert not torch.isnan(o).any(), f"{name}: NaN (an element was never written, or a 0/0)"
        assert not torch.isnan(r).any(), f"{name}: NaN in the float64 reference"
        err = (o.double() - r).abs().max().item()
        err_naive = (n.double() - r).abs().max().item()
        floor = 1e-5 * max(r.abs().max().item(), 1.0)  # matters only where naive is exact (e.g. Nk = 1: dq = 0)
        assert err <= 2 * err_naive + floor, (
            f"{name}: max error {err:.3g} > 2 x naive's {err_naive:.3g} + floor {floor:.3g}")
    if causal and Nq > Nk:  # rows that see no key: exactly zero output and zero dq
        blind = ~causal_mask(Nq, Nk, device=DEVICE).any(dim=1)  # (Nq,)
        assert (out[0][:, :, blind] == 0).all() and (out[1][:, :, blind] == 0).all()
    return out


# (B, Hq, Hkv, Nq, Nk, D, causal): each listed head dim, each odd length, Nq != Nk both ways, GQA and MQA,
# causal and not; every case runs in fp16 and fp32 (and bf16 on a GPU).
CASES = [
    (1, 2, 2, 1, 1, 64, True),
    (1, 2, 2, 1, 1, 32, False),
    (2, 2, 2, 17, 17, 64, True),
    (1, 2, 2, 17, 17, 16, False),
    (1, 2, 2, 113, 113, 32, False),
    (1, 2, 2, 113, 113, 48, True),
    (1, 2, 2, 203, 203, 128, True),
    (1, 1, 1, 203, 203, 80, False),
    (1, 1, 1, 203, 203, 96, True),
    (1, 1, 1, 113, 113, 256, True),
    (1, 1, 1, 113, 203, 256, False),
    (1, 1, 1, 1023, 1023, 64, True),
    (1, 2, 2, 113, 113, 8, True),  # tiny head dim: padded to 16 lanes
    # Nq < Nk (KV cache / chunked prefill, bottom-right aligned) and Nq > Nk (leading rows see no key)
    (1, 2, 2, 17, 203, 64, True),
    (1, 2, 2, 1, 203, 64, True),
    (1, 2, 2, 113, 1023, 64, False),
    (1, 2, 2, 203, 17, 64, True),
    (1, 2, 2, 203, 17, 96, False),
    (1, 2, 2, 113, 1, 32, True),
    (1, 1, 1, 1023, 113, 48, True),
    # grouped-query and multi-query attention
    (2, 4, 2, 113, 113, 64, True),
    (1, 6, 2, 203, 113, 96, False),
    (1, 4, 1, 17, 203, 48, True),
    (1, 4, 1, 203, 203, 80, False),
]


def _id(c):
    B, Hq, Hkv, Nq, Nk, D, causal = c
    return f"B{B}-H{Hq}/{Hkv}-{Nq}x{Nk}-d{D}-{'causal' if causal else 'full'}"


def _spy(monkeypatch, record) -> list:
    """Collect record(kernel name, its constexpr kwargs) per kernel launch."""
    seen = []
    real = launch._launch

    def spy(name, *args):
        seen.append(record(name, args[-1]))
        return real(name, *args)

    monkeypatch.setattr(launch, "_launch", spy)
    monkeypatch.setattr(launch, "_plan_key", lambda *args: None)  # no replays: every launch goes through _launch
    return seen


def _spy_tma(monkeypatch) -> list:
    """Record, per kernel launch, whether it read its inputs through TMA descriptors (kernel name, TMA)."""
    return _spy(monkeypatch, lambda name, kwargs: (name, kwargs["TMA"]))


def _tma_for(kernel: str, D: int) -> bool:
    """Whether aligned inputs of head dim D take the descriptor path in `kernel` here (the interpreter: always)."""
    return launch._tma_available(torch.device(DEVICE), options.get()) and (
        kt.INTERPRET or configs.block_d(D) >= launch.TMA_MIN_BLOCK_D[kernel])


def _matrix(cases: list) -> list:
    """(case, dtype) parameters: every case in every dtype. On a GPU each distinct shape and dtype compiles kernels
    of its own, so there the default run takes every case in bf16 (the training dtype) and every sixth case in
    fp16 and fp32; the rest of the matrix is `slow` (`-m slow`). On the CPU every pair runs."""
    return [pytest.param(case, dtype, id=f"{_id(case)}-{dtype}",
                         marks=[pytest.mark.slow] if CUDA and dtype != torch.bfloat16 and i % 6 else [])
            for i, case in enumerate(cases) for dtype in DTYPES]


@pytest.mark.parametrize("path", ["tma", "pointers"])
@pytest.mark.parametrize("case,dtype", _matrix(CASES))
def test_matches_reference(case, dtype, path, request, monkeypatch):
    """Both load paths of every kernel: tensor descriptors (TMA on Hopper, here in all three kernels at every head
    dim, whatever the default policy; these inputs are aligned) and masked pointer loads."""
    seen = _spy_tma(monkeypatch)
    with options.use(tma=path == "tma", tma_min_block_d=16) as opts:
        _check(*case, dtype, seeded_generator(request))
        want = path == "tma" and launch._tma_available(torch.device(DEVICE), opts)
    assert [name for name, _ in seen] == ["fwd", "dq", "dkdv"] and all(t == want for _, t in seen)


# The fused backward (backward="fused"): tails, Nq != Nk both ways (blind rows), GQA and MQA, padded head dims.
FUSED_CASES = [
    (1, 2, 2, 1, 1, 64, True),
    (2, 2, 2, 17, 17, 16, False),
    (1, 2, 2, 113, 113, 48, True),
    (1, 2, 2, 203, 203, 128, False),
    (1, 1, 1, 113, 113, 256, True),
    (1, 2, 2, 113, 113, 8, True),
    (1, 2, 2, 17, 203, 64, True),
    (1, 2, 2, 203, 17, 96, True),
    (1, 2, 2, 113, 1023, 64, False),
    (2, 4, 2, 113, 113, 64, True),
    (1, 6, 2, 203, 113, 96, False),
    (1, 4, 1, 17, 203, 48, True),
]


@pytest.mark.parametrize("case,dtype", _matrix(FUSED_CASES))
def test_fused_backward_matches_reference(case, dtype, request, monkeypatch):
    """The fused backward (delta pass, dK/dV kernel adding dQ with atomics, dQ pass) against float64, both load
    paths of its dK/dV kernel and both ways of adding dQ: TMA reduce-adds where the GPU and Triton have them
    (tma on, Hopper), element atomics otherwise (always in the interpreter)."""
    seen = _spy(monkeypatch, lambda name, kwargs: (name, kwargs.get("FUSED_DQ")))
    for tma in (True, False):
        with options.use(backward="fused", tma=tma) as opts:
            reduce_mode = 2 if (CUDA and launch._TRITON_HAS_DESC_REDUCE
                                and launch._tma_available(torch.device(DEVICE), opts)) else 1
            seen.clear()
            _check(*case, dtype, seeded_generator(request))
        assert seen == [("fwd", None), ("prep", None), ("dkdvq", reduce_mode), ("dqout", None)]


def test_fused_backward_other_tiles_and_bad_mode(request, monkeypatch):
    """Fused dK/dV with BLOCK_M != BLOCK_N both ways, the LPT order, and replayed plans; an unknown backward or
    fused_dq option (or its environment override) is a clear error."""
    g = seeded_generator(request)
    with options.use(backward="fused"):
        for cfg in [(32, 64, 4, 1), (64, 16, 4, 1)]:
            with fa.forced_configs(dkdvq=cfg):
                _check(1, 2, 1, 203, 150, 64, True, torch.float16, g)
                _check(1, 2, 1, 150, 203, 48, False, torch.float32, g)
        monkeypatch.setattr(launch, "_lpt_group", lambda t, rows, heads: 4)
        monkeypatch.setattr(launch, "LPT_MIN_GROUP", 1)
        for _ in range(2):  # records a plan, then replays it
            _check(2, 6, 3, 150, 203, 32, True, torch.float32, g)
    with pytest.raises(ValueError, match="backward='atomic': expected one of split, fused"):
        options.update(backward="atomic")
    with pytest.raises(ValueError, match="FLASHGPT_BWD='atomic': expected one of split, fused"):
        options.from_env({"FLASHGPT_BWD": "atomic"})
    with pytest.raises(ValueError, match="FLASHGPT_FUSED_DQ='3': expected 1"):
        options.from_env({"FLASHGPT_BWD": "fused", "FLASHGPT_FUSED_DQ": "3"})
    assert options.get().backward == "split"  # the failed update changed nothing


@pytest.mark.parametrize("heads_per_group", [1, 4, 6, None])
def test_causal_longest_first_order(heads_per_group, monkeypatch, request):
    """The causal kernels' 1-D longest-first grid covers every tile once: groups of 1, 4 (a partial last
    group: 6 (batch, head) pairs) and all heads; None = the plain per-head 3-D grid (lpt option off)."""
    seen = _spy(monkeypatch, lambda name, kwargs: kwargs["LPT"])
    if heads_per_group is not None:
        monkeypatch.setattr(launch, "_lpt_group", lambda t, rows, heads: heads_per_group)
        monkeypatch.setattr(launch, "LPT_MIN_GROUP", 1)
    with options.use(lpt=heads_per_group is not None):
        _check(2, 3, 3, 150, 203, 32, True, torch.float16, seeded_generator(request))
        _check(2, 6, 3, 203, 150, 64, True, torch.float32, seeded_generator(request))  # GQA, Nq > Nk
    assert len(seen) == 6 and all(lpt == (heads_per_group is not None) for lpt in seen)


def test_unaligned_rows_use_pointer_loads(monkeypatch, request):
    """Rows whose stride is not a multiple of 16 bytes (or a unit head dim) cannot be TMA-loaded: the kernels
    fall back to pointer loads for those tensors (per kernel), with the same results."""
    seen = _spy_tma(monkeypatch)
    g = seeded_generator(request)
    q = _make((1, 2, 113, 65), torch.float16, g)[..., :64].detach().requires_grad_()  # rows 130 bytes apart
    k, v = _make((1, 2, 203, 64), torch.float16, g), _make((1, 2, 203, 64), torch.float16, g)
    do = torch.randn(1, 2, 113, 64, generator=g).to(DEVICE, torch.float16)
    ref = _run(naive_attention, *[t.detach().double().requires_grad_() for t in (q, k, v)], do.double(), True)
    out = _run(flash_attention, q, k, v, do, True)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.double(), r, atol=1e-2, rtol=1e-2)
    # fwd and dq read k, v (aligned: their policy decides); dK/dV reads q and dO (q is not)
    assert seen == [("fwd", _tma_for("fwd", 64)), ("dq", _tma_for("dq", 64)), ("dkdv", False)]
    assert not launch._tma_ok("dkdv", options.get(), torch.randn(1, 1, 4, 1, device=DEVICE))  # D = 1: 2-byte rows


def test_repeated_launches_reuse_plans_and_compiled_kernels(monkeypatch, request):
    """Launch plans (_plans: the host work of a call recorded per input signature) and the direct launchers
    (_run: Triton's compiled kernel reused per launch signature) give bit-for-bit what a first call gives, on a
    second call with the same signature and across signatures that differ in dtype, head dim, GQA, strides (a
    transposed layout) and 16-byte alignment (an offset view). The interpreter runs the plans but never the
    direct launchers; on a GPU both."""
    g = seeded_generator(request)
    cases = []
    for dtype, (B, Hq, Hkv, N, D) in [(torch.float16, (1, 2, 2, 113, 64)), (torch.float32, (1, 4, 2, 17, 48))]:
        q, k, v = (_make((B, h, N, D), dtype, g) for h in (Hq, Hkv, Hkv))
        cases.append((q, k, v))
    base = torch.randn(1, 203 * 2 * 64 + 3, generator=g).to(DEVICE, torch.float16)
    q = base[:, 3:].view(1, 203, 2, 64).transpose(1, 2).detach().requires_grad_()  # (B, H, N, D), misaligned
    cases.append((q, q.detach().clone().requires_grad_(), q.detach().clone().requires_grad_()))
    do = [torch.randn(c[0].shape, generator=g).to(DEVICE, c[0].dtype) for c in cases]
    plan_key = launch._plan_key
    monkeypatch.setattr(launch, "_plan_key", lambda *args: None)
    with options.use(fast_launch=False):
        want = [_run(flash_attention, *c, d, True) for c, d in zip(cases, do)]
    # plans and direct launchers on, fresh caches (outputs still NaN-poisoned by the fixture)
    monkeypatch.setattr(launch, "_plan_key", plan_key)
    monkeypatch.setattr(launch, "_compiled", {})
    monkeypatch.setattr(launch, "_plans", {})
    assert launch._fast_launch() == (not kt.INTERPRET)
    for _ in range(2):  # the first round records, the second replays
        for c, d, w in zip(cases, do, want):
            for got, ref in zip(_run(flash_attention, *c, d, True), w):
                assert torch.equal(got, ref)
    assert len(launch._plans) == 2 * len(cases)  # forward and backward per signature
    if not kt.INTERPRET:
        assert len(launch._compiled) == 3 * len(cases)  # fwd, dq, dkdv per signature


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_peaky_softmax_and_custom_scale(causal, dtype, request):
    """Large scores (amp 3, scale 0.3): the running max moves a lot, the rescaling must be right."""
    _check(1, 2, 1, 203, 331, 64, causal, dtype, seeded_generator(request), amp=3.0, sm_scale=0.3)


# On a GPU the default run takes the two most lopsided tiles, causal (each forced tile compiles every kernel
# anew); all of them run under `-m slow` and on the CPU.
_GPU_SLOW = [pytest.mark.slow] if CUDA else []


@pytest.mark.parametrize("cfg", [pytest.param((32, 64, 4, 1), marks=_GPU_SLOW),
                                 pytest.param((64, 32, 4, 1), marks=_GPU_SLOW), (16, 128, 4, 1), (128, 16, 4, 1)],
                         ids=str)
@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=_GPU_SLOW)])
def test_other_tile_shapes(cfg, causal, request):
    """BLOCK_M != BLOCK_N in every kernel: the causal block ranges and tails must not assume square tiles."""
    with fa.forced_configs(fwd=cfg, dkdv=cfg, dq=cfg):
        g = seeded_generator(request)
        _check(1, 2, 1, 203, 150, 64, causal, torch.float16, g)
        _check(1, 2, 1, 150, 203, 48, causal, torch.float32, g)


def test_any_strides(request):
    """Transposed views (B, N, H, D) -> (B, H, N, D), an expanded kv head and a non-contiguous dO."""
    g = seeded_generator(request)
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 113, 203, 64
    dtype = torch.float16
    q = torch.randn(B, Nq, Hq, D, generator=g).to(DEVICE, dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, Nk, Hkv, D, generator=g).to(DEVICE, dtype).transpose(1, 2).requires_grad_()
    v_base = torch.randn(B, 1, Nk, D, generator=g).to(DEVICE, dtype).requires_grad_()
    do = torch.randn(B, Nq, Hq, D, generator=g).to(DEVICE, dtype).transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous() and not do.is_contiguous()
    for causal in (True, False):
        outs = []
        for fn in (flash_attention, naive_attention):
            for t in (q, k, v_base):
                t.grad = None
            v = v_base.expand(B, Hkv, Nk, D)  # stride 0 over heads
            o = fn(q, k, v, causal=causal)
            if fn is flash_attention:  # O comes back in q's (B, N, H, D) memory order: the model's
                assert o.transpose(1, 2).is_contiguous()  # transpose(1, 2).contiguous() is then free
            o.backward(do)
            if fn is flash_attention:
                assert q.grad.transpose(1, 2).is_contiguous() and k.grad.transpose(1, 2).is_contiguous()
            outs.append([o.detach(), q.grad.clone(), k.grad.clone(), v_base.grad.clone()])
        for a, b in zip(*outs):
            assert not torch.isnan(a).any()
            torch.testing.assert_close(a.float(), b.float(), atol=3e-3, rtol=3e-3)


def test_deterministic_and_linear_memory(_poison_and_fix_config, request):
    """Two runs agree bit for bit (no atomics); every buffer the kernels allocate is O(N), never Nq x Nk."""
    allocs = _poison_and_fix_config
    g = seeded_generator(request)
    B, Hq, Hkv, Nq, Nk, D = 1, 4, 2, 203, 1023, 32
    q, k, v = _make((B, Hq, Nq, D), torch.float16, g), _make((B, Hkv, Nk, D), torch.float16, g), \
        _make((B, Hkv, Nk, D), torch.float16, g)
    do = torch.randn(B, Hq, Nq, D, generator=g).to(DEVICE, torch.float16)
    first = _run(flash_attention, q, k, v, do, True)
    second = _run(flash_attention, q, k, v, do, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert allocs and max(allocs) <= max(q.numel(), k.numel()) < Nq * Nk * B * Hq


@pytest.mark.parametrize("bad", [
    "D=512", "D=300", "heads 3/2", "dtype mismatch", "int", "float64", "3-d", "k!=v", "batch",
    "Nq=0", "scale=0", "scale=-1", "scale=nan",
])
def test_unsupported_raises_value_error(bad, monkeypatch):
    """Nothing unsupported reaches a kernel: a ValueError first (the launch helper would fail the test)."""
    def no_launch(*a, **k):
        raise AssertionError("a kernel was launched")
    monkeypatch.setattr(launch, "_launch", no_launch)

    def t(*shape, dtype=torch.float16):
        return torch.ones(shape, dtype=dtype, device=DEVICE) if not dtype.is_floating_point else \
            torch.randn(shape, device=DEVICE).to(dtype)
    q, k, v = t(1, 2, 8, 64), t(1, 2, 8, 64), t(1, 2, 8, 64)
    scale = None
    if bad == "D=512":
        q, k, v = t(1, 2, 8, 512), t(1, 2, 8, 512), t(1, 2, 8, 512)
    elif bad == "D=300":
        q, k, v = t(1, 2, 8, 300), t(1, 2, 8, 300), t(1, 2, 8, 300)
    elif bad == "heads 3/2":
        q = t(1, 3, 8, 64)
    elif bad == "dtype mismatch":
        k = t(1, 2, 8, 64, dtype=torch.float32)
    elif bad == "int":
        q, k, v = (t(1, 2, 8, 64, dtype=torch.int32) for _ in range(3))
    elif bad == "float64":
        q, k, v = (t(1, 2, 8, 64, dtype=torch.float64) for _ in range(3))
    elif bad == "3-d":
        q = t(2, 8, 64)
    elif bad == "k!=v":
        v = t(1, 2, 9, 64)
    elif bad == "batch":
        q = t(2, 2, 8, 64)
    elif bad == "Nq=0":
        q = t(1, 2, 0, 64)
    elif bad.startswith("scale="):
        scale = float(bad.split("=")[1])
    with pytest.raises(ValueError):
        flash_attention(q, k, v, causal=True, sm_scale=scale)


def test_dispatch_and_custom_op(request):
    """kernels.attention(backend="flash") reaches this kernel; the custom op passes torch.library.opcheck."""
    from kernels import attention
    g = seeded_generator(request)
    q, k, v = (_make((1, 2, 17, 32), torch.float32, g) for _ in range(3))
    torch.testing.assert_close(attention(q, k, v, backend="flash"), naive_attention(q, k, v), atol=1e-5, rtol=1e-5)
    torch.library.opcheck(ops._flash_attn_fwd_op, (q, k, v, True, 0.17))
    q, k, v = (t.detach() for t in (q, k, v))  # the backward op is not itself differentiable (no double backward)
    o, lse = ops._flash_attn_fwd_op(q, k, v, True, 0.17)
    torch.library.opcheck(ops._flash_attn_bwd_op, (torch.randn_like(o), q, k, v, o, lse, True, 0.17))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("heads,N,D,causal", [((2, 2), 113, 64, True), ((4, 2), 17, 48, False),
                                             ((4, 1), 203, 32, True)])
def test_qkvpacked_matches_split(heads, N, D, causal, dtype, request):
    """The packed form gives exactly flash_attention's output and gradients on the views (the same kernels),
    its d(qkv) is one buffer holding dq | dk | dv per token, and it is within the error budget of float64."""
    Hq, Hkv = heads
    g = seeded_generator(request)
    qkv = _make((2, N, (Hq + 2 * Hkv) * D), dtype, g)
    do = torch.randn((2, Hq, N, D), generator=g).to(DEVICE, dtype)

    o = fa.flash_attention_qkvpacked(qkv, Hq, Hkv, causal=causal)
    (dqkv,) = torch.autograd.grad(o, qkv, do)
    q, k, v = (t.detach().requires_grad_() for t in kernels.split_qkv(qkv.detach(), Hq, Hkv))
    o_split = flash_attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(o_split, (q, k, v), do)
    assert torch.equal(o, o_split)
    assert dqkv.shape == qkv.shape and dqkv.is_contiguous() and not torch.isnan(dqkv).any()
    for got, want in zip(kernels.split_qkv(dqkv, Hq, Hkv), grads):
        assert torch.equal(got, want)

    ref_qkv = qkv.detach().double().requires_grad_()
    ref_o = naive_attention(*kernels.split_qkv(ref_qkv, Hq, Hkv), causal=causal)
    (ref_d,) = torch.autograd.grad(ref_o, ref_qkv, do.double())
    low_o = naive_attention(*kernels.split_qkv(qkv, Hq, Hkv), causal=causal)
    (low_d,) = torch.autograd.grad(low_o, qkv, do)
    for name, got, ref, low in (("out", o, ref_o, low_o), ("dqkv", dqkv, ref_d, low_d)):
        err = (got.double() - ref).abs().max().item()
        budget = 2 * (low.double() - ref).abs().max().item() + 1e-5 * max(ref.abs().max().item(), 1.0)
        assert err <= budget, f"{name}: max error {err:.3g} > budget {budget:.3g}"


@pytest.mark.parametrize("mode", ["split", "fused"])
def test_qkvpacked_plans_replay_exactly(mode, monkeypatch, request):
    """Packed calls replayed from qkv's own plan (on a GPU: q, k, v and dq, dk, dv passed to the compiled
    kernels as addresses at the split's offsets) give bit for bit what unplanned calls give: MHA and GQA,
    fp16 and fp32, a qkv view at a 2-byte offset (misaligned), a transposed (non-contiguous) qkv. In the
    interpreter the packed signatures are marked unpackable and replay through the per-view plans. The fused
    backward's dQ sums with atomics in a varying order on a GPU: there its gradient is compared to a tolerance."""
    exact = mode == "split" or kt.INTERPRET
    g = seeded_generator(request)
    cases = []
    for dtype, (B, Hq, Hkv, N, D) in [(torch.float16, (2, 4, 4, 113, 64)), (torch.float32, (1, 6, 2, 17, 48))]:
        cases.append((_make((B, N, (Hq + 2 * Hkv) * D), dtype, g), Hq, Hkv))
    base = torch.randn(1 * 64 * 3 * 2 * 32 + 1, generator=g).to(DEVICE, torch.float16)
    cases.append((base[1:].view(1, 64, 3 * 2 * 32).detach().requires_grad_(), 2, 2))  # 2 bytes off alignment
    wide = torch.randn(3 * 2 * 32, 1, 50, generator=g).to(DEVICE, torch.float16)
    cases.append((wide.permute(1, 2, 0).detach().requires_grad_(), 2, 2))  # (1, 50, 192), stride 1 along N
    dos = [torch.randn((qkv.shape[0], hq, qkv.shape[1], qkv.shape[2] // (hq + 2 * hkv)),
                       generator=g).to(DEVICE, qkv.dtype) for qkv, hq, hkv in cases]

    def run(qkv, hq, hkv, do):
        o = fa.flash_attention_qkvpacked(qkv, hq, hkv, causal=True)
        return o.detach(), *torch.autograd.grad(o, qkv, do)

    plan_key = launch._plan_key
    with options.use(backward=mode):
        monkeypatch.setattr(launch, "_plan_key", lambda *args: None)
        want = [run(*c, d) for c, d in zip(cases, dos)]
        monkeypatch.setattr(launch, "_plan_key", plan_key)
        for _ in range(3):  # records the per-view plans, then the packed ones, then replays them
            for c, d, w in zip(cases, dos, want):
                for got, ref in zip(run(*c, d), w):
                    if exact:
                        assert torch.equal(got, ref)
                    else:
                        torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-2)
        fast = launch._fast_launch()
    packed = [p for key, p in launch._plans.items() if key[0].startswith("packed_")]
    assert len(packed) == 2 * len(cases)
    if fast:
        assert all(p is not launch._UNPACKABLE for p in packed)
    else:
        assert all(p is launch._UNPACKABLE for p in packed)


def test_qkvpacked_dispatch_and_custom_ops(request):
    """attention_qkvpacked: flash reaches the packed kernel, the other backends the views; both custom ops
    pass opcheck; a width that does not split is a ValueError."""
    g = seeded_generator(request)
    qkv = _make((1, 17, 6 * 32), torch.float32, g)  # 4 query heads, 1 kv head, D = 32
    want = naive_attention(*kernels.split_qkv(qkv, 4, 1))
    for backend in kernels.BACKENDS:
        torch.testing.assert_close(kernels.attention_qkvpacked(qkv, 4, 1, backend=backend), want,
                                   atol=1e-5, rtol=1e-5)
    torch.library.opcheck(ops._packed_fwd_op, (qkv, 4, 1, True, 0.17))
    x = qkv.detach()
    o, lse = ops._packed_fwd_op(x, 4, 1, True, 0.17)
    torch.library.opcheck(ops._packed_bwd_op, (torch.randn_like(o), x, o, lse, 4, 1, True, 0.17))
    with pytest.raises(ValueError, match="packed qkv width"):
        kernels.attention_qkvpacked(qkv, 3, 1, backend="flash")
    with pytest.raises(ValueError, match="3-d"):
        kernels.attention_qkvpacked(qkv[0], 4, 1, backend="flash")


def test_public_api_import():
    """`from kernels import flash_attention, naive_attention` in a fresh interpreter: same function as naive."""
    import subprocess
    import sys
    code = ("import torch\nfrom kernels import flash_attention, naive_attention\n"
            "q, k, v = (torch.randn(1, 2, 9, 16, device=%r) for _ in range(3))\n"
            "torch.testing.assert_close(flash_attention(q, k, v), naive_attention(q, k, v), atol=1e-5, rtol=1e-5)\n"
            "torch.testing.assert_close(flash_attention(q, k, v, causal=False, sm_scale=0.3),\n"
            "                           naive_attention(q, k, v, causal=False, sm_scale=0.3), atol=1e-5, rtol=1e-5)\n"
            % DEVICE)
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_compiled_kernel_module_imports():
    """kernels.flash imported for a GPU (TRITON_INTERPRET=0) builds its autotuners: newer Triton checks their keys
    against each kernel's arguments at import (the GPU path, which CI otherwise never imports)."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0")
    code = ("import kernels._triton as kt, kernels.flash.configs as c\nassert not kt.INTERPRET and "
            "len(c.TUNERS) == sum(len(x) > 1 for x in c.GPU_CONFIGS.values())\n")  # single configs: no tuner
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.flash import configs
from kernels.flash.launch import TMA_MIN_BLOCK_D

PTRS = ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "LSE", "DELTA", "DQACC", "COS", "SIN")
FP32 = ("LSE", "DELTA", "DQACC")
def compile_one(name, head_dim, **flags):
    fn = configs.KERNELS[name]
    bm, bn, warps, stages = configs.gpu_configs(name, configs.torch.bfloat16, head_dim)[0]
    bd = configs.block_d(head_dim)
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=bn)
    if name in ("fwd", "dq", "dkdv", "dkdvq"):
        consts.update(CAUSAL=True, DOT_PRECISION="tf32", LPT=False,
                      TMA=bd >= TMA_MIN_BLOCK_D["dkdv" if name == "dkdvq" else name], WINDOW=0, VARLEN=False)
    if name in ("dkdv", "dkdvq"):
        consts.update(GQA=False, FUSED_DQ=0)
    if "ROPE" in fn.arg_names:
        consts.update(ROPE=False)
    consts.update(flags)
    if "DOCS" in fn.arg_names and not consts["VARLEN"]:
        consts["DOCS"] = None  # what the host passes without documents: a constant, not a parameter
    if "COS" in fn.arg_names and not consts["ROPE"]:
        consts.update(COS=None, SIN=None)  # likewise without RoPE tables
    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg == "DOCS":
            sig[arg] = "*i32"
        elif arg in PTRS:
            sig[arg] = "*fp32" if arg in FP32 else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[arg] = "fp32" if arg in ("qk_scale", "sm_scale") else "i32"
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    print(name, head_dim, ".entry" in c.asm["ptx"])

compile_one("fwd", 64, LPT=True)
compile_one("fwd", 128, TMA=True)
compile_one("dq", 64)
compile_one("dq", 128, TMA=True)
compile_one("dkdv", 64, GQA=True)
compile_one("dkdv", 128)
compile_one("dkdvq", 64, TMA=True, FUSED_DQ=2)
compile_one("prep", 64)
compile_one("dqout", 64)
compile_one("fwd", 64, VARLEN=True, LPT=True)
compile_one("fwd", 128, TMA=True, WINDOW=256)
compile_one("dq", 128, TMA=True, VARLEN=True, WINDOW=128)
compile_one("dq", 64, VARLEN=True, CAUSAL=False)
compile_one("dkdv", 64, GQA=True, VARLEN=True)
compile_one("dkdv", 128, WINDOW=256, CAUSAL=True)
compile_one("dkdvq", 64, TMA=True, FUSED_DQ=2, VARLEN=True, CAUSAL=False)
compile_one("dq", 64, ROPE=True)
compile_one("dq", 128, TMA=True, ROPE=True, VARLEN=True)
compile_one("dkdv", 64, GQA=True, ROPE=True)
compile_one("dkdv", 128, TMA=True, ROPE=True)
compile_one("dkdvq", 64, TMA=True, FUSED_DQ=2, ROPE=True)
compile_one("dqout", 64, ROPE=True)
"""


@pytest.mark.skipif(CUDA, reason="on a GPU every other test compiles these kernels for the GPU itself")
def test_kernels_compile_for_hopper():
    """Triton's GPU compiler is stricter than its interpreter: compile every flash kernel for sm_90 ahead of time
    (PTX and ptxas, no GPU needed) with the load paths, grids and GQA / fused-dQ variants a GPU launches, and
    the window and document (VARLEN) variants and the RoPE (ROPE) ones, in its own process (the tests run the
    interpreter)."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["fwd", "64", "True", "fwd", "128", "True", "dq", "64", "True", "dq", "128", "True",
                                "dkdv", "64", "True", "dkdv", "128", "True", "dkdvq", "64", "True", "prep", "64",
                                "True", "dqout", "64", "True",
                                "fwd", "64", "True", "fwd", "128", "True", "dq", "128", "True", "dq", "64", "True",
                                "dkdv", "64", "True", "dkdv", "128", "True", "dkdvq", "64", "True",
                                "dq", "64", "True", "dq", "128", "True", "dkdv", "64", "True", "dkdv", "128", "True",
                                "dkdvq", "64", "True", "dqout", "64", "True"]


@pytest.mark.parametrize("entry", ["function", "dispatch", "packed"])
def test_torch_compile_fullgraph(entry, request):
    """A function calling flash_attention compiles with fullgraph=True (no graph break), forward and backward.

    On the CPU the aot_eager backend (the interpreter has no inductor codegen to test); inductor on a GPU.
    "dispatch" goes through kernels.attention(backend="flash"); "packed" through kernels.attention_qkvpacked,
    the model's training path.
    """
    torch._dynamo.reset()
    g = seeded_generator(request)
    q, k, v = (_make((1, 4, 65, 64), torch.float16, g) for _ in range(3))
    if entry == "packed":  # the model's path: one projection in, d(qkv) out of the backward op
        qkv = _make((1, 65, 3 * 4 * 64), torch.float16, g)
        f = lambda qkv: kernels.attention_qkvpacked(qkv * 1.5, 4, 4, backend="flash").float().square().sum()  # noqa
        compiled = torch.compile(f, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
        (want,) = torch.autograd.grad(f(qkv), qkv)
        (got,) = torch.autograd.grad(compiled(qkv), qkv)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        return
    fn = {"function": fa.flash_attention,
          "dispatch": lambda q, k, v, causal: kernels.attention(q, k, v, backend="flash", causal=causal)}[entry]

    def f(q, k, v):
        return fn(q * 1.5, k, v, causal=True).float().square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    eager_grads = torch.autograd.grad(f(q, k, v), (q, k, v))
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    torch.testing.assert_close(loss, f(q, k, v), atol=1e-2, rtol=1e-3)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------- GPU only --------------------------------

BIG = [
    (2, 8, 2, 1024, 1024, 128, True),
    (1, 4, 4, 2048, 4096, 64, True),
    (1, 4, 1, 4097, 4095, 96, False),
    (1, 2, 2, 4096, 333, 256, True),
]


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", BIG, ids=_id)
def test_large_shapes(case, dtype, request):
    _check(*case, dtype, seeded_generator(request))


def _config_params():
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for D in (64, 128, 256):
            n = max(len(fa.gpu_configs(kn, dtype, D)) for kn in ("fwd", "dkdv", "dq", "dkdvq"))
            for i in range(n):
                for causal in (True, False):
                    out.append(pytest.param(dtype, D, i, causal, id=f"{str(dtype)[6:]}-d{D}-cfg{i}-{causal}"))
    return out


@cuda_only
@pytest.mark.slow  # ~60 cases of their own compiles: the default configs run in every other test
@pytest.mark.parametrize("dtype,D,i,causal", _config_params())
def test_every_autotune_config(dtype, D, i, causal, request):
    """Each config the autotuner may pick is itself correct (on odd lengths, GQA, both masks).

    A config that does not fit this GPU (shared memory / registers) is skipped here, as the autotuner skips it;
    the default (first) configs are run by every other test, so they must fit.
    """
    from triton.runtime.errors import OutOfResources
    cfgs = {kn: fa.gpu_configs(kn, dtype, D) for kn in ("fwd", "dkdv", "dq", "dkdvq")}
    forced = {kn: c[i % len(c)] for kn, c in cfgs.items()}
    try:
        with fa.forced_configs(**forced):
            _check(1, 4, 2, 331, 517, D, causal, dtype, seeded_generator(request))
            _check(1, 2, 2, 517, 331, D, causal, dtype, seeded_generator(request))
            with options.use(backward="fused"):  # the fused backward's dK/dV kernel at the same index
                _check(1, 4, 2, 331, 517, D, causal, dtype, seeded_generator(request))
    except OutOfResources as e:
        pytest.skip(f"config {forced} does not fit this GPU: {e}")


@cuda_only
@pytest.mark.autotune
def test_autotuned_path(request):
    """The autotuner's first call (benchmarks every config) and the later calls (reuse its pick directly)."""
    g = seeded_generator(request)
    _check(2, 4, 2, 1000, 1000, 64, True, torch.bfloat16, g)
    _check(2, 4, 2, 1000, 1000, 64, True, torch.bfloat16, g)
    assert launch._picked, "the autotuner's choice was not recorded"


@cuda_only
@pytest.mark.autotune
def test_short_calls_run_the_first_config_and_tunings_are_kept_on_disk(request, monkeypatch):
    """A call whose key-length bucket is under autotune_min_keys is not tuned (its compiles would cost seconds
    for a kernel of microseconds); a tuned call's timings land in Triton's cache folder for later processes."""
    import glob

    import triton
    monkeypatch.setattr(launch, "_picked", {})
    g = seeded_generator(request)
    _check(1, 2, 2, 77, 100, 64, True, torch.bfloat16, g)
    assert not launch._picked, "a call under 256 keys was tuned"
    with options.use(autotune_min_keys=0):
        _check(1, 2, 2, 77, 100, 64, True, torch.bfloat16, g)
    assert launch._picked and all(key[-2] == 128 for key in launch._picked)  # (..., q bucket, k bucket, device)
    assert glob.glob(os.path.join(triton.knobs.cache.dir, "*", "_attn_fwd.autotune.json"))


@cuda_only
def test_peak_memory_is_linear(request):
    """N = 16384: an N x N fp32 score matrix per head would be 1 GiB; fwd+bwd stays near the inputs' size."""
    g = seeded_generator(request)
    B, H, N, D = 1, 4, 16384, 64
    q, k, v = (_make((B, H, N, D), torch.bfloat16, g) for _ in range(3))
    do = torch.randn(B, H, N, D, generator=g).to(DEVICE, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    flash_attention(q, k, v, causal=True).backward(do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    inputs = 4 * q.numel() * q.element_size()
    assert extra < 3 * inputs, f"extra memory {extra / 2**20:.0f} MiB vs inputs {inputs / 2**20:.0f} MiB"
