"""The packed flash call with RoPE (flash_attention_qkvpacked(..., rope=(cos, sin))) against a float64 reference.

The reference rotates q and k with kernels.rope_reference and runs naive attention, all in float64; its
gradient is w.r.t. qkv before the rotation. Criterion as in test_flash_attention.py: each of out and d(qkv) is
within 2x the error of the same computation in the input dtype (naive attention after the PyTorch rotation) plus
a floor of 1e-5 x max(1, |reference|). Inputs are fresh random tensors seeded from the test id, tables of random
angles (not only RotaryEmbedding's), every buffer the kernels allocate is NaN-poisoned first, nothing may come
back NaN. Power-of-two head dims rotate the gradients back inside the dQ and dK/dV kernels (ROPE); other head
dims take a rotation pass after them: both are covered, with the split and the fused backward, GQA, odd lengths,
a window, documents, and tables per sequence. On the CPU through Triton's interpreter (fp16, fp32); on a GPU
bf16 as well, and the autotuned configs.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

import kernels
import kernels._triton as kt
from kernels import naive_attention, options, rope_reference, split_qkv
from kernels.flash import configs, flash_attention_qkvpacked, launch, ops
from tests.util import seeded_generator

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else [])


@pytest.fixture(autouse=True)
def _poison(monkeypatch, request):
    """NaN-fill every buffer the kernels allocate; plans recorded by this test only; default (untuned) configs
    unless the test is marked autotune."""
    monkeypatch.setattr(kt, "empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                            device=device))
    monkeypatch.setattr(launch, "_plans", {})
    with options.use(autotune="autotune" in request.keywords):
        yield


def _tables(shape, D, g, dtype):
    """cos, sin of random angles, (shape..., D), pair (i, i + D/2) sharing angle i as RotaryEmbedding's do."""
    half = torch.rand((*shape, D // 2), generator=g) * 2 * math.pi
    angles = torch.cat((half, half), dim=-1)
    return angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)


def _attend(fn, qkv, rope, do):
    """fn(qkv, rope) and its gradient w.r.t. qkv for the output gradient do."""
    o = fn(qkv, rope)
    (d,) = torch.autograd.grad(o, qkv, do)
    return o.detach(), d


def _check(B, N, nh, nkv, D, dtype, g, per_seq=False, causal=True, window=0, docs=None, amp=1.0):
    qkv = (torch.randn(B, N, (nh + 2 * nkv) * D, generator=g) * amp).to(DEVICE, dtype).requires_grad_()
    cos, sin = _tables((B, N) if per_seq else (N,), D, g, dtype)
    do = torch.randn(B, nh, N, D, generator=g).to(DEVICE, dtype)
    if docs is not None:
        docs = docs.to(DEVICE)

    def flash(x, rope):
        return flash_attention_qkvpacked(x, nh, nkv, causal=causal, window=window, docs=docs, rope=rope)

    def naive(x, rope):
        return naive_attention(*split_qkv(rope_reference(x, *rope, nh, nkv), nh, nkv), causal=causal, window=window,
                               docs=docs)

    x64 = qkv.detach().double().requires_grad_()
    ref = _attend(naive, x64, (cos.double(), sin.double()), do.double())
    low = _attend(naive, qkv, (cos, sin), do)
    out = _attend(flash, qkv, (cos, sin), do)
    for name, o, r, n in zip(("out", "dqkv"), out, ref, low):
        assert o.dtype == dtype and o.shape == r.shape, name
        assert not torch.isnan(o).any(), f"{name}: NaN (an element was never written)"
        err = (o.double() - r).abs().max().item()
        err_naive = (n.double() - r).abs().max().item()
        floor = 1e-5 * max(r.abs().max().item(), 1.0)
        assert err <= 2 * err_naive + floor, (
            f"{name}: max error {err:.3g} > 2 x naive's {err_naive:.3g} + floor {floor:.3g}")
    return out


# (B, N, Hq, Hkv, D, tables per sequence): odd lengths, MHA, GQA and MQA, head dims rotated back in the kernels
# (16, 32, 64, 128) and after them (24, 48, 80)
CASES = [
    (1, 1, 2, 2, 64, False),
    (2, 17, 2, 2, 32, False),
    (1, 113, 4, 2, 64, True),
    (2, 70, 3, 1, 16, False),
    (1, 203, 2, 2, 128, False),
    (1, 37, 4, 1, 48, True),
    (1, 51, 2, 2, 24, False),
    (1, 29, 2, 1, 80, False),
]


def _id(c):
    B, N, nh, nkv, D, per_seq = c
    return f"B{B}-N{N}-H{nh}/{nkv}-d{D}" + ("-per_seq" if per_seq else "")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("mode", ["split", "fused"])
def test_rope_matches_float64(case, dtype, mode, request):
    B, N, nh, nkv, D, per_seq = case
    with options.use(backward=mode):
        _check(B, N, nh, nkv, D, dtype, seeded_generator(request), per_seq=per_seq)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_rope_non_causal_window_and_documents(dtype, request):
    """The masks of the packed call keep working with the tables: non-causal, a sliding window, documents
    (positions restarting per document, as the trainer's doc_mask gives them: tables per sequence)."""
    g = seeded_generator(request)
    _check(1, 61, 2, 2, 32, dtype, g, causal=False)
    _check(2, 45, 4, 2, 32, dtype, g, window=7)
    tokens = torch.randint(0, 5, (2, 77), generator=g)  # token 0 ends a document
    docs = kernels.document_bounds(tokens, 0)
    _check(2, 77, 2, 1, 64, dtype, g, per_seq=True, docs=docs)


@pytest.mark.skipif(not CUDA, reason="every autotuned config: GPU only")
@pytest.mark.parametrize("kernel", ["dq", "dkdv"])
@pytest.mark.parametrize("D", [64, 128])
def test_rope_every_tile_config(kernel, D, request):
    """Each tile config of the autotune lists rotates back correctly (bf16, GQA, an odd length)."""
    g = seeded_generator(request)
    for cfg in configs.gpu_configs(kernel, torch.bfloat16, D):
        with configs.forced_configs(**{kernel: cfg}):
            launch._plans.clear()
            _check(2, 333, 6, 2, D, torch.bfloat16, g)


@pytest.mark.skipif(not CUDA, reason="the autotuner runs on a GPU only")
@pytest.mark.autotune
def test_rope_autotuned(request):
    _check(2, 1000, 9, 3, 64, torch.bfloat16, seeded_generator(request))


def test_rope_plans_replay_exactly(request):
    """Calls replayed from their launch plans give bit for bit the first call's output and gradient (split and
    fused, head dims rotated back in the kernels and after them)."""
    g = seeded_generator(request)
    for mode in ("split", "fused"):
        for D in (32, 48):
            qkv = torch.randn(2, 41, 4 * D, generator=g).to(DEVICE, torch.float16).requires_grad_()
            cos, sin = _tables((41,), D, g, torch.float16)
            do = torch.randn(2, 2, 41, D, generator=g).to(DEVICE, torch.float16)
            with options.use(backward=mode):
                runs = [_attend(lambda x, r: flash_attention_qkvpacked(x, 2, 1, rope=r), qkv, (cos, sin), do)
                        for _ in range(3)]
            exact = mode == "split" or kt.INTERPRET  # the fused dQ sums with atomics in a varying order on a GPU
            for run in runs[1:]:
                for got, want in zip(run, runs[0]):
                    if exact:
                        assert torch.equal(got, want)
                    else:
                        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-2)
    assert any("/rope" in key[0] for key in launch._plans)
    if not kt.INTERPRET and options.get().fast_launch:  # the RoPE forward's repeats went through its launcher
        assert kernels.rope._compiled


def test_rope_dispatch_custom_ops_and_compile(request):
    """attention_qkvpacked(rope=...) gives the same result on every backend; the RoPE custom ops pass opcheck;
    torch.compile(fullgraph=True) traces the call and gives the eager gradient."""
    g = seeded_generator(request)
    nh, nkv, D, N = 4, 2, 32, 17
    qkv = torch.randn(2, N, (nh + 2 * nkv) * D, generator=g).to(DEVICE).requires_grad_()
    cos, sin = _tables((N,), D, g, torch.float32)
    want = naive_attention(*split_qkv(rope_reference(qkv, cos, sin, nh, nkv), nh, nkv))
    for backend in kernels.BACKENDS:
        got = kernels.attention_qkvpacked(qkv, nh, nkv, backend=backend, rope=(cos, sin))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    x = qkv.detach()
    torch.library.opcheck(ops._packed_rope_fwd_op, (x, cos, sin, nh, nkv, True, 0.17))
    o, lse, rotated = ops._packed_rope_fwd_op(x, cos, sin, nh, nkv, True, 0.17)
    torch.testing.assert_close(rotated, rope_reference(x, cos, sin, nh, nkv), atol=1e-6, rtol=1e-6)
    torch.library.opcheck(ops._packed_rope_bwd_op, (torch.randn_like(o), rotated, o, lse, cos, sin, nh, nkv, True,
                                                    0.17))

    def loss(t):
        return kernels.attention_qkvpacked(t * 1.5, nh, nkv, backend="flash", rope=(cos, sin)).square().sum()
    (eager,) = torch.autograd.grad(loss(qkv), qkv)
    (compiled,) = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(qkv), qkv)
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)


def test_rope_bad_inputs():
    qkv = torch.randn(1, 9, 4 * 16, device=DEVICE)
    cos = torch.ones(9, 16, device=DEVICE)
    with pytest.raises(ValueError, match="pair"):
        flash_attention_qkvpacked(qkv, 2, 1, rope=cos)
    with pytest.raises(ValueError, match="cos and sin"):
        flash_attention_qkvpacked(qkv, 2, 1, rope=(cos[:8], cos[:8]))
    with pytest.raises(ValueError, match="one dtype"):
        flash_attention_qkvpacked(qkv, 2, 1, rope=(cos, cos.half()))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_model_hands_rope_to_flash(qk_norm, monkeypatch, request):
    """A Llama-style model on the flash backend: with rope_in_flash its attention calls take the RoPE tables
    (without qk_norm) and give the loss and gradients of the model rotating q and k itself; with qk_norm, or
    the option off, the model rotates and no call takes tables."""
    from model.config import GPTConfig
    from model.gpt import GPT
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    cfg = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=32, vocab_size=97, pos_emb="rope",
                    norm="rmsnorm", mlp="swiglu", intermediate_size=96, bias=False, qk_norm=qk_norm,
                    attention="flash", dropout=0.0)
    model = GPT(cfg).to(DEVICE)
    idx = torch.randint(0, 97, (2, 29), device=DEVICE)
    targets = torch.randint(0, 97, (2, 29), device=DEVICE)
    calls = []
    real = launch._packed_rope_fwd
    monkeypatch.setattr(ops, "_packed_rope_fwd", lambda *a: calls.append(1) or real(*a))
    results = {}
    for on in (True, False):
        model.zero_grad()
        with options.use(rope_in_flash=on):
            _, loss = model(idx, targets)
        loss.backward()
        results[on] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
        assert len(calls) == (cfg.n_layer if on and not qk_norm else 0)
        calls.clear()
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-6, rtol=1e-6)
    for got, want in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
