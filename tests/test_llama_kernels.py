"""The Triton RMSNorm, SwiGLU and RoPE of the training step (kernels/rmsnorm.py, swiglu.py, rope.py): forward and
backward against float64 references, the model's switch (model.llama_kernels, the llama_kernels option), and
bench/llama_kernels.py --smoke.

Criterion (tests/error_budget.py): each output and gradient's max error against the PyTorch implementation run
in float64 is at most 2x the error of that implementation in the kernel's dtype, plus a floor of
1e-5 x max(1, |reference|). Fresh random inputs per test (seeded from the test id), output buffers poisoned with
NaN (a missed write shows), odd shapes (rows not a multiple of the block, widths not a power of 2), strided
inputs. On the CPU through Triton's interpreter in float32 and float16; bfloat16 only on CUDA.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

import kernels
import kernels._triton as kt
import kernels.rmsnorm as rms
from kernels import options, rope_reference
from model import GPT, GPTConfig
from model.config import ConfigError
from model.norms import RMSNorm
from model.rope import RotaryEmbedding
from tests.error_budget import assert_within_budget
from tests.util import ROOT, pythonpath

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not CUDA, reason="bf16 runs on CUDA only: Triton's interpreter rounds float32 to bf16 by truncation"))
DTYPES = [torch.float32, torch.float16, BF16]
LLAMA = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(kt, "empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                             device=device))


@pytest.fixture
def gen(request) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


def _randn(*shape, g, scale=1.0) -> torch.Tensor:
    """float64 normal values on the CPU (rounded to the kernels' dtype by the caller)."""
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _run(fn, inputs: list[torch.Tensor], dy: torch.Tensor):
    """fn(*leaf copies of inputs) and the gradients of <output, dy> → (output, [grad of each input])."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return y.detach(), [t.grad for t in leaves]


def _assert_all(names, got, ref, plain):
    for name, a, b, c in zip(names, got, ref, plain):
        assert a.dtype == c.dtype and a.shape == b.shape, f"{name}: {a.dtype} {tuple(a.shape)}"
        assert_within_budget(name, a, b, c)


# ------------------------------------------------------------------------------------------------ RMSNorm

def _torch_rms(kernel):
    def fn(x, w):
        norm = RMSNorm(x.shape[-1], eps=1e-5, kernel=kernel)
        return torch.func.functional_call(norm, {"weight": w}, (x,))
    return fn


def _check_rms(x64, w64, dy64, x_dtype, w_dtype, x_view=None):
    """The Triton RMSNorm (on x_view(x) when given: a strided view) against RMSNorm in float64 and in the
    dtypes: y, dx, d(weight)."""
    x, w = x64.to(DEVICE, x_dtype), w64.to(DEVICE, w_dtype)
    view = x_view or (lambda t: t)
    ref = _run(lambda a, b: _torch_rms("torch")(view(a), b), [x64, w64], dy64)
    plain = _run(lambda a, b: _torch_rms("torch")(view(a), b), [x, w], dy64.to(DEVICE))
    got = _run(lambda a, b: kernels.triton_rms_norm(view(a), b, 1e-5), [x, w], dy64.to(DEVICE))
    assert got[0].dtype == torch.promote_types(x_dtype, w_dtype)
    _assert_all(["y", "dx", "dweight"], [got[0], *got[1]], [ref[0], *ref[1]], [plain[0], *plain[1]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 576), (3, 7), (1, 1), (2, 5, 96)])
def test_rms_norm_matches_float64(shape, dtype, gen):
    x, w, dy = _randn(*shape, g=gen, scale=3.0), 1 + _randn(shape[-1], g=gen, scale=0.3), _randn(*shape, g=gen)
    _check_rms(x, w, dy, dtype, dtype)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float16, torch.float32), pytest.param(
    torch.bfloat16, torch.float32, marks=BF16.marks), (torch.float32, torch.float16)])
def test_rms_norm_mixed_dtypes_promote_like_the_module(x_dtype, w_dtype, gen):
    """A float32 weight on low-precision x (bf16 autocast keeps float32 weights) gives a float32 output, as
    `weight * y.to(x.dtype)` does; dx in x's dtype, d(weight) in the weight's."""
    x, w, dy = _randn(9, 130, g=gen), 1 + _randn(130, g=gen, scale=0.3), _randn(9, 130, g=gen)
    _check_rms(x, w, dy, x_dtype, w_dtype)


@pytest.mark.parametrize("x_dtype", [torch.float16, BF16])
def test_rms_norm_rounds_the_normalised_row_to_x_dtype_before_the_weight(x_dtype, gen):
    """model/norms.py's (and transformers') rounding: x / rms is rounded to x's dtype, then scaled. With float32
    weights that are powers of 2 the float32 output divided by the weight is exactly a value of x's dtype."""
    x = _randn(6, 50, g=gen, scale=3.0).to(DEVICE, x_dtype)
    w = (2.0 ** torch.randint(-2, 3, (50,), generator=gen).float()).to(DEVICE)
    y = kernels.triton_rms_norm(x, w, 1e-5)  # (6, 50) float32
    n = y / w
    assert y.dtype == torch.float32 and torch.equal(n.to(x_dtype).float(), n)
    flips = (y != _torch_rms("torch")(x, w)).float().mean().item()  # the module's output, element for element
    assert flips < 0.05, f"{flips:.1%} of the elements differ from the module's"  # rstd's last bit: rare flips


def test_rms_norm_wide_rows_and_many_row_tiles_per_program(gen, monkeypatch):
    """A row wider than the tile (one row per program); a backward whose programs each sum several row tiles into
    their partial d(weight) (a stand-in GPU of 2 SMs, one program per SM), with a tail tile; and more partial
    rows than the second stage adds per step."""
    monkeypatch.setattr(rms, "BWD_PROGRAMS_PER_SM", 1)
    monkeypatch.setattr(kt, "sm_count", lambda device: 2)
    x, w, dy = _randn(70, 1000, g=gen), 1 + _randn(1000, g=gen, scale=0.3), _randn(70, 1000, g=gen)
    assert triton_cdiv(70, rms._tile(1000, backward=True)[0]) >= 4 * 2  # several row tiles per program
    _check_rms(x, w, dy, torch.float32, torch.float32)
    monkeypatch.setattr(rms, "BWD_PROGRAMS_PER_SM", 16)  # one tile per program: 18 partial rows, 3 steps of 8
    _check_rms(x, w, dy, torch.float32, torch.float32)
    x, w, dy = _randn(3, 5000, g=gen), 1 + _randn(5000, g=gen, scale=0.3), _randn(3, 5000, g=gen)
    _check_rms(x, w, dy, torch.float32, torch.float32)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_rms_norm_strided_input_and_gradient(gen):
    """x a column slice of a wider buffer (row stride != N, no copy), and an expanded gradient (row stride 0)."""
    wide = _randn(11, 200, g=gen)
    w, dy = 1 + _randn(150, g=gen, scale=0.3), _randn(1, 150, g=gen).expand(11, 150)
    _check_rms(wide, w, dy, torch.float32, torch.float32, x_view=lambda t: t[:, 20:170])


def test_rms_norm_empty_rows_and_bad_inputs():
    x = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    w = torch.ones(8, device=DEVICE, requires_grad=True)
    y = kernels.triton_rms_norm(x, w, 1e-5)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros(8, device=DEVICE))
    for args, match in [((torch.randn(2, rms.MAX_N + 1), torch.ones(rms.MAX_N + 1), 1e-5), "rows of 1..16384"),
                        ((torch.randn(2, 8), torch.ones(7), 1e-5), r"expected x \(..., N\) and weight \(N,\)"),
                        ((torch.randn(2, 8).double(), torch.ones(8), 1e-5), "float16, bfloat16 and float32 x"),
                        ((torch.randn(2, 8), torch.ones(8), 0.0), "eps must be a positive number")]:
        with pytest.raises(ValueError, match=match):
            kernels.triton_rms_norm(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))


# ------------------------------------------------------------------------------------------------- SwiGLU

def _torch_swiglu(h):
    gate, up = h.chunk(2, dim=-1)  # the model's MLP
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 2 * 96), (3, 2 * 7), (1, 2), (2, 3, 2 * 1536)])
def test_swiglu_matches_float64(shape, dtype, gen):
    """(2, 3, 3072): I = 1536 is one full and one half column block of 1024."""
    h, dy = _randn(*shape, g=gen, scale=2.0), _randn(*shape[:-1], shape[-1] // 2, g=gen)
    hd = h.to(DEVICE, dtype)
    ref = _run(_torch_swiglu, [h], dy)
    plain = _run(_torch_swiglu, [hd], dy.to(DEVICE))
    got = _run(kernels.triton_swiglu, [hd], dy.to(DEVICE))
    _assert_all(["y", "dh"], [got[0], *got[1]], [ref[0], *ref[1]], [plain[0], *plain[1]])


def test_swiglu_strided_input_and_saturated_gates(gen):
    """h a column slice of a wider buffer; gates of ±60 (sigmoid 0 or 1 in float32) stay finite."""
    wide = _randn(10, 2 * 40 + 6, g=gen, scale=2.0)
    wide[:, :5] = 60.0
    wide[:, 5:10] = -60.0
    dy = _randn(10, 40, g=gen)
    ref = _run(lambda t: _torch_swiglu(t[:, 3:83]), [wide], dy)
    plain = _run(lambda t: _torch_swiglu(t[:, 3:83]), [wide.float()], dy.float())
    got = _run(lambda t: kernels.triton_swiglu(t[:, 3:83]), [wide.float().to(DEVICE)], dy.float().to(DEVICE))
    _assert_all(["y", "dh"], [got[0], *got[1]], [ref[0], *ref[1]], [plain[0], *plain[1]])
    assert torch.equal(got[1][0][:, :3].cpu(), torch.zeros(10, 3))  # columns outside the slice get no gradient


def test_swiglu_bad_inputs():
    for h, match in [(torch.randn(4, 7), r"expected \(..., 2·I\)"), (torch.randn(4, 8).double(), "float16")]:
        with pytest.raises(ValueError, match=match):
            kernels.triton_swiglu(h.to(DEVICE))


# --------------------------------------------------------------------------------------------------- RoPE

def _rope_cfg(nh, nkv, D, **kw) -> GPTConfig:
    return GPTConfig(n_embd=nh * D, n_head=nh, n_kv_head=nkv, head_size=D, pos_emb="rope", **kw)


def _torch_rope(nh, nkv):
    """model/gpt.py's rotate_qk without qk_norm: apply_rope on the q and k heads of the packed projection
    (kernels.rope_reference)."""
    return lambda qkv, cos, sin: rope_reference(qkv, cos, sin, nh, nkv)


ROPE_CASES = [  # B, T, n_head, n_kv_head, D, positions per sequence, GPTConfig fields
    (2, 5, 4, 2, 16, False, {}),
    (3, 7, 3, 1, 10, True, dict(rope_theta=500.0)),                  # D/2 = 5 lanes, (B, T, D) tables
    (1, 33, 9, 3, 64, False, {}),                                    # SmolLM2's heads
    (2, 4, 2, 2, 8, True, dict(rope_theta=500.0, rope_scaling="llama3", rope_original_max_pos=16,
                                rope_high_freq_factor=2.0)),          # MHA, Llama-3 frequency scaling
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,nh,nkv,D,per_seq,fields", ROPE_CASES)
def test_rope_qkv_matches_float64(B, T, nh, nkv, D, per_seq, fields, dtype, gen):
    rotary = RotaryEmbedding(_rope_cfg(nh, nkv, D, **fields))
    pos = torch.randint(0, 200, (B, T), generator=gen) if per_seq else torch.arange(T)
    cos64, sin64 = rotary(pos, torch.float64)
    cos, sin = rotary.to(DEVICE)(pos.to(DEVICE), dtype)
    qkv, dy = _randn(B, T, (nh + 2 * nkv) * D, g=gen, scale=2.0), _randn(B, T, (nh + 2 * nkv) * D, g=gen)
    x = qkv.to(DEVICE, dtype)
    ref = _run(lambda t: _torch_rope(nh, nkv)(t, cos64, sin64), [qkv], dy)
    plain = _run(lambda t: _torch_rope(nh, nkv)(t, cos, sin), [x], dy.to(DEVICE))
    got = _run(lambda t: kernels.triton_rope_qkv(t, cos, sin, nh, nkv), [x], dy.to(DEVICE))
    _assert_all(["y", "dqkv"], [got[0], *got[1]], [ref[0], *ref[1]], [plain[0], *plain[1]])
    v = slice((nh + nkv) * D, None)
    assert torch.equal(got[0][..., v], x[..., v]) and torch.equal(got[1][0][..., v], dy.to(DEVICE, dtype)[..., v])
    if dtype == torch.float32:  # model/rope.py's output, to float32 rounding
        torch.testing.assert_close(got[0], plain[0], rtol=1e-6, atol=2e-6)


def test_rope_backward_is_the_rotation_by_minus_the_angle(gen):
    """With RotaryEmbedding's tables (cos, sin equal in both halves) d(qkv) = rope(dy) with sin negated."""
    B, T, nh, nkv, D = 2, 6, 2, 1, 12
    cos, sin = RotaryEmbedding(_rope_cfg(nh, nkv, D)).to(DEVICE)(torch.arange(3, 3 + T, device=DEVICE),
                                                                  torch.float32)
    x = _randn(B, T, 4 * D, g=gen).float().to(DEVICE).requires_grad_()
    dy = _randn(B, T, 4 * D, g=gen).float().to(DEVICE)
    kernels.triton_rope_qkv(x, cos, sin, nh, nkv).backward(dy)
    torch.testing.assert_close(x.grad, kernels.triton_rope_qkv(dy, cos, -sin, nh, nkv), rtol=1e-6, atol=1e-6)
    # and the two rotations undo each other
    y = kernels.triton_rope_qkv(x.detach(), cos, sin, nh, nkv)
    torch.testing.assert_close(kernels.triton_rope_qkv(y, cos, -sin, nh, nkv), x.detach(), rtol=1e-5, atol=1e-5)


def test_rope_qkv_strided_projection_and_gradient(gen):
    """qkv with padded token and batch strides (a slice of a wider buffer), and a non-contiguous gradient."""
    B, T, nh, nkv, D = 2, 5, 2, 1, 8
    W = (nh + 2 * nkv) * D
    cos, sin = RotaryEmbedding(_rope_cfg(nh, nkv, D))(torch.arange(T), torch.float64)
    wide = _randn(B, T + 1, W + 5, g=gen)
    dy = _randn(B, W, T, g=gen).transpose(1, 2)  # (B, T, W), stride 1 along T
    view = lambda t: t[:, 1:, 2:2 + W]  # noqa: E731
    ref = _run(lambda t: _torch_rope(nh, nkv)(view(t).contiguous(), cos, sin), [wide], dy)
    plain = _run(lambda t: _torch_rope(nh, nkv)(view(t).contiguous(), cos.float(), sin.float()), [wide.float()],
                 dy.float())
    got = _run(lambda t: kernels.triton_rope_qkv(view(t), cos.float().to(DEVICE), sin.float().to(DEVICE), nh, nkv),
               [wide.float().to(DEVICE)], dy.float().to(DEVICE))
    _assert_all(["y", "dqkv"], [got[0], *got[1]], [ref[0], *ref[1]], [plain[0], *plain[1]])


def test_rope_qkv_bad_inputs():
    qkv = torch.randn(2, 3, 4 * 6, device=DEVICE)
    cos = torch.ones(3, 6, device=DEVICE)
    for args, match in [((torch.randn(2, 3, 4 * 5, device=DEVICE), torch.ones(3, 5, device=DEVICE),
                          torch.ones(3, 5, device=DEVICE), 2, 1), "even head dims"),
                        ((qkv, cos[:2], cos[:2], 2, 1), r"expected cos and sin \(3, 6\) or \(2, 3, 6\)"),
                        ((qkv, cos, cos, 3, 1), r"expected qkv \(B, T, \(n_head \+ 2·n_kv_head\)·D\)"),
                        ((qkv, cos, cos.double(), 2, 1), "cos and sin must be of one dtype"),
                        ((qkv, cos, cos, 2, 0), "n_kv_head must be an int >= 1")]:
        with pytest.raises(ValueError, match=match):
            kernels.triton_rope_qkv(*args)


def test_the_custom_ops_trace_under_torch_compile(gen):
    """torch.compile(fullgraph=True) traces the three kernels as custom ops (no graph break; AOTAutograd's graphs
    give the eager outputs and grads), and each op passes torch.library.opcheck (fake shapes, dtypes and strides
    against the kernels', the schema, the autograd registration)."""
    torch._dynamo.reset()
    x = _randn(2, 3, 48, g=gen).half().to(DEVICE)           # (B, T, C) float16 (the weight float32)
    w = (1 + _randn(48, g=gen, scale=0.2)).float().to(DEVICE)  # (C,)
    h = _randn(2, 3, 2 * 40, g=gen).half().to(DEVICE)         # (B, T, 2I) float16
    qkv = _randn(2, 3, 4 * 16, g=gen).float().to(DEVICE)      # (B, T, (2 + 2·1)·16)
    cos, sin = RotaryEmbedding(_rope_cfg(2, 1, 16)).to(DEVICE)(torch.arange(3, device=DEVICE), torch.float32)

    def step(x, w, h, qkv):
        y = kernels.triton_rms_norm(x, w, 1e-5)               # (B, T, C) float32
        return (y.sum() + kernels.triton_swiglu(h).float().sum()
                + (kernels.triton_rope_qkv(qkv, cos, sin, 2, 1) * qkv).sum())

    inputs, one = [x, w, h, qkv], torch.tensor(1.0, device=DEVICE)
    eager = _run(step, inputs, one)
    compiled = _run(torch.compile(step, backend="aot_eager", fullgraph=True), inputs, one)
    torch.testing.assert_close(compiled[0], eager[0])
    for a, b in zip(compiled[1], eager[1]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)
    # the fake implementations against the kernels (shapes, dtypes, strides), the schemas, the autograd formulas
    ops = torch.ops.flashgpt
    x2, dy2 = x.view(6, 48), torch.randn(6, 48, device=DEVICE)
    y2, rstd = ops.rms_norm_fwd(x2, w, 1e-5)
    for op, args in [(ops.rms_norm_fwd, (x2.requires_grad_(), w.requires_grad_(), 1e-5)),
                     (ops.rms_norm_bwd, (dy2, x2.detach(), w.detach(), rstd)),
                     (ops.swiglu_fwd, (h.view(6, 80).requires_grad_(),)),
                     (ops.swiglu_bwd, (torch.randn(6, 40, device=DEVICE).half(), h.view(6, 80))),
                     (ops.rope_qkv_fwd, (qkv.requires_grad_(), cos, sin, 2, 1)),
                     (ops.rope_qkv_bwd, (torch.randn_like(qkv), cos, sin, 2, 1))]:
        torch.library.opcheck(op, args)


# ---------------------------------------------------------------------------------------- the model's switch

def test_switch_resolves_like_the_loss_kernel():
    assert options.get().llama_kernels == "torch"  # the default until GPU measurements choose Triton
    assert kernels.resolve_llama_kernels("auto", "cuda") == "torch"
    assert kernels.resolve_llama_kernels("triton", "cpu") == "triton"  # an explicit choice wins
    with options.use(llama_kernels="auto"):
        assert kernels.resolve_llama_kernels(None, "cuda") == "triton"
        assert kernels.resolve_llama_kernels("auto", "cpu") == "torch"
        assert kernels.resolve_llama_kernels("torch", "cuda") == "torch"
    assert options.from_env({"FLASHGPT_LLAMA_KERNELS": "triton"}).llama_kernels == "triton"
    with pytest.raises(ValueError, match="FLASHGPT_LLAMA_KERNELS='fused': expected one of auto, triton, torch"):
        options.from_env({"FLASHGPT_LLAMA_KERNELS": "fused"})
    with pytest.raises(ValueError, match="unknown llama kernel choice 'fused'"):
        kernels.resolve_llama_kernels("fused", "cpu")
    with pytest.raises(ConfigError, match="model.llama_kernels='fused': must be one of auto, triton, torch"):
        GPTConfig(llama_kernels="fused").validate()


def _tiny_llama(kernel: str, **kw) -> GPT:
    cfg = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=48, intermediate_size=40,
                    attention="naive", loss_kernel="torch", llama_kernels=kernel, **LLAMA, **kw)
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)  # norm weights off 1
    return model.to(DEVICE)


def _count_calls(monkeypatch) -> dict:
    calls = {}
    for name in ("triton_rms_norm", "triton_swiglu", "triton_rope_qkv"):
        fn = getattr(kernels, name)

        def counted(*args, _fn=fn, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kw)
        monkeypatch.setattr(kernels, name, counted)
    return calls


@pytest.fixture
def _fp32_matmuls():
    """float32 matmuls without TF32 on a GPU (TF32 would magnify the kernels' last-bit differences)."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_tiny_llama_same_loss_and_grads_with_the_kernels(qk_norm, monkeypatch, gen, _fp32_matmuls):
    """A 2-layer Llama-style GPT (RoPE, RMSNorm, SwiGLU, GQA; qk_norm: Qwen3's per-head norms) in float32: loss
    and every parameter's gradient with model.llama_kernels = "triton" as with "torch"."""
    calls = _count_calls(monkeypatch)
    ref, tri = _tiny_llama("torch", qk_norm=qk_norm), _tiny_llama("triton", qk_norm=qk_norm)
    tri.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 61, (2, 16), generator=gen).to(DEVICE)
    targets = torch.randint(0, 61, (2, 16), generator=gen).to(DEVICE)
    losses = []
    for model in (ref, tri):
        _, loss = model(idx, targets)
        loss.backward()
        losses.append(loss.detach())
    norms = 2 * 2 + 1 + (2 * 2 if qk_norm else 0)
    assert calls == {"triton_rms_norm": norms, "triton_swiglu": 2, "triton_rope_qkv": 2}  # the kernels ran
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    grads = dict(ref.named_parameters())
    for name, p in tri.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_option_reaches_a_model_on_auto(monkeypatch, gen):
    """model.llama_kernels = "auto" (the default) follows the llama_kernels option: "torch" by default, the
    kernels with FLASHGPT_LLAMA_KERNELS=triton."""
    calls = _count_calls(monkeypatch)
    model = _tiny_llama("auto")
    idx = torch.randint(0, 61, (1, 8), generator=gen).to(DEVICE)
    model(idx)
    assert calls == {}
    with options.use(llama_kernels="triton"):
        model(idx)
    assert calls == {"triton_rms_norm": 5, "triton_swiglu": 2, "triton_rope_qkv": 2}


# ---------------------------------------------------------------------------------------------- the benchmark

@pytest.mark.skipif(CUDA, reason="--smoke is the CPU (interpreter) path; a GPU runs the real benchmark")
def test_bench_smoke(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath(str(ROOT)))
    r = subprocess.run([sys.executable, "bench/llama_kernels.py", "--smoke", "--sweep", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "llama_kernels_smoke.json").read_text())
    assert data["meta"]["command"] == "python bench/llama_kernels.py --smoke --sweep --out " + str(tmp_path)
    assert data["meta"]["commit"] and not data["meta"]["correctness_failures"]
    pieces = {(row["piece"], row["provider"]) for row in data["rows"]}
    assert pieces == {(p, q) for p in ("rmsnorm", "rmsnorm_fp32", "swiglu", "rope")
                      for q in ("triton", "torch eager", "torch compiled")}
    assert all(row["fwd_bwd_us"] > 0 for row in data["rows"])
    swept = {row["setting"] for row in data["sweep"] if row["piece"] == "rope"}
    assert "kernels.rope.TILE=1024" in swept
    assert sum(row["default"] for row in data["sweep"]) == 2 + 2 + 2 + 1  # each setting's default, per piece
    md = (tmp_path / "llama_kernels_smoke.md").read_text()
    assert "| rope | triton |" in md and "python bench/llama_kernels.py --smoke" in md
