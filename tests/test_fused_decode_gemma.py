"""The fused decode path's Gemma 3 pieces against float64 references: norms scaled by 1 + weight (the input
norms and the q / k norms), GeGLU, q scaled for query_scale_dim, the embedding times sqrt(C), and the sandwich
norms' residual add (kernels/residual_norm.py); then whole Gemma 3 models' fused steps (per-layer RoPE bases,
windowed and global layers) against their own step and in greedy generation.

Criterion as in tests/test_fused_decode.py (tests/error_budget.py): max error against the float64 reference at
most 2x that of the eager op sequence in the same dtype, plus a floor. CUDA when present (bf16 included),
otherwise CPU through the Triton interpreter (fp16/fp32). Outputs are poisoned with NaN first.
"""
import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (triton decorates then)

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels._triton as kt  # noqa: E402
from kernels.ln_linear import embed_with_stats, forced_config, ln_linear, ln_qkv_to_cache  # noqa: E402
from kernels.residual_norm import add_rms_norm  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.fused_decode import fused_decode_step, stack_plan, unsupported_reason  # noqa: E402
from model.rope import RotaryEmbedding, apply_rope  # noqa: E402
from tests.error_budget import assert_within_budget  # noqa: E402
from tests.test_fused_decode import DEVICE, DTYPES  # noqa: E402
from tests.test_fused_decode_llama import assert_fused_generation_equals_the_models, decode_three_ways  # noqa: E402


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(kt, "empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                              device=device))


def offset_norm_ref(x, w, eps, dtype):
    """model/norms.py's OffsetRMSNorm in `dtype`: x / rms · (1 + w) in float32 (float64 for float64), rounded once."""
    wide = torch.promote_types(dtype, torch.float32)
    y = F.rms_norm(x.to(dtype).to(wide), (x.shape[-1],), eps=eps)
    return (y * (1.0 + w.to(dtype).to(wide))).to(dtype)


def fp32_norm_ref(x, w, eps, dtype):
    """model/norms.py's Fp32GainRMSNorm in `dtype`: x / rms · w in float32 (float64 for float64), rounded once."""
    wide = torch.promote_types(dtype, torch.float32)
    y = F.rms_norm(x.to(dtype).to(wide), (x.shape[-1],), eps=eps)
    return (y * w.to(dtype).to(wide)).to(dtype)


def rms_norm_ref(x, w, eps, dtype):
    """model/norms.py's RMSNorm in `dtype`: x / rms rounded, times the gain."""
    y = F.rms_norm(x.to(dtype).to(torch.promote_types(dtype, torch.float32)), (x.shape[-1],), eps=eps)
    return w.to(dtype) * y.to(dtype)


def rand(gen, *shape, scale=1.0, shift=0.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(DEVICE, dtype)


def cpu(t):
    return None if t is None else t.cpu()


# ------------------------------------------------------------------------------------------- the kernels

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K,bias,split", [(1, 40, 48, False, False), (5, 24, 37, True, False),
                                             (3, 40, 96, False, True)],
                         ids=["one-row", "odd-k-bias", "split-k"])
@torch.no_grad()
def test_offset_norm_and_geglu_match_reference(M, N, K, bias, split, dtype):
    """N(x) = x / rms · (1 + w) rounded once, then [gate | up] = N(x) Wᵀ + b and GELU_tanh(gate) · up."""
    g = torch.Generator().manual_seed(M * 100 + K)
    x = rand(g, M, K, scale=3.0, shift=1.0, dtype=dtype)
    w = rand(g, 2 * N, K, scale=2 * K ** -0.5, dtype=dtype)
    b = rand(g, 2 * N, dtype=dtype) if bias else None
    gain = rand(g, K, scale=0.4, dtype=dtype)                                  # offsets from 1

    def ref(dt, x, w, b, gain):
        h = F.linear(offset_norm_ref(x, gain, 1e-6, dt), w.to(dt), None if b is None else b.to(dt))
        gate, up = h.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    with (forced_config((16, 32, 4, 1, 2)) if split else contextlib.nullcontext()):
        got = ln_linear(x, w, b, ln=(gain, None, 1e-6), rms=True, norm_offset=True, swiglu=True, geglu=True)
    exact = ref(torch.float64, cpu(x), cpu(w), cpu(b), cpu(gain))
    plain = ref(dtype, x, w, b, gain)
    silu = F.linear(offset_norm_ref(cpu(x), cpu(gain), 1e-6, torch.float64), cpu(w).double()).chunk(2, dim=-1)
    assert (F.silu(silu[0]) * silu[1] - exact).abs().max() > 1e-2  # GELU is not SiLU here: the check can fail
    assert_within_budget("offset norm → GeGLU", got, exact, plain)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Hq,Hkv,D,split", [(4, 2, 32, False), (2, 1, 64, True)], ids=["gqa-d32", "mqa-d64-split"])
@torch.no_grad()
def test_offset_qk_norms_and_q_scale_then_rope(Hq, Hkv, D, split, dtype):
    """Gemma's attention input: offset input norm → c_attn → offset q and k norms → q · q_scale → RoPE; q out,
    k and v into the cache at each row's position and nowhere else."""
    B, C, max_len, q_scale = 3, 40, 40, 1.2649110640673518   # sqrt(32 / 20): query_scale_dim 20 at head dim 32
    g = torch.Generator().manual_seed(Hq * D)
    cfg = GPTConfig(n_embd=C, n_head=Hq, head_size=D, pos_emb="rope", rope_theta=1e4)
    cos, sin = RotaryEmbedding(cfg).to(DEVICE)(torch.arange(max_len, device=DEVICE), dtype)  # (L, D) each
    n_q, n_kv = Hq * D, Hkv * D
    x = rand(g, B, C, scale=3.0, shift=1.0, dtype=dtype)
    w = rand(g, n_q + 2 * n_kv, C, scale=2 * C ** -0.5, dtype=dtype)
    gain, qg, kg = (rand(g, n, scale=0.4, dtype=dtype) for n in (C, D, D))
    kc = torch.full((B + 1, Hkv, max_len, D), float("nan"), dtype=dtype, device=DEVICE)  # one spare row
    vc = torch.full_like(kc, float("nan"))
    pos = torch.tensor([0, 17, max_len - 1], device=DEVICE)

    def ref(dt, x, w, gain, qg, kg, cos, sin, pos, scale=q_scale):
        heads = F.linear(offset_norm_ref(x, gain, 1e-6, dt), w.to(dt)).view(B, 1, Hq + 2 * Hkv, D)
        q = offset_norm_ref(heads[:, :, :Hq], qg, 1e-6, dt) * scale
        k = offset_norm_ref(heads[:, :, Hq:Hq + Hkv], kg, 1e-6, dt)
        qk = apply_rope(torch.cat((q, k), dim=2), cos[pos][:, None].to(dt), sin[pos][:, None].to(dt))
        return qk[:, 0, :Hq].reshape(B, -1), qk[:, 0, Hq:], heads[:, 0, Hq + Hkv:]

    with (forced_config((16, 32, 4, 1, 2)) if split else contextlib.nullcontext()):
        q = ln_qkv_to_cache(x, w, None, (gain, None, 1e-6), kc, vc, pos, n_q, rms=True, rope=(cos, sin),
                            qk_norm=(qg, kg, 1e-6), norm_offset=True, q_scale=q_scale)  # (B, n_q)
    args = (cpu(x), cpu(w), cpu(gain), cpu(qg), cpu(kg), cos.cpu(), sin.cpu(), pos.cpu())
    exact = ref(torch.float64, *args)
    naive = ref(dtype, x, w, gain, qg, kg, cos, sin, pos)
    unscaled = ref(torch.float64, *args, scale=1.0)
    assert (unscaled[0] - exact[0]).abs().max() > 0.1  # q_scale changes q: the comparison below can fail
    assert_within_budget("normed, scaled, rotated q", q, exact[0], naive[0])
    rows = torch.arange(B, device=DEVICE)
    assert_within_budget("normed, rotated k in the cache", kc[rows, :, pos], exact[1], naive[1])
    assert_within_budget("v in the cache", vc[rows, :, pos], exact[2], naive[2])
    kc[rows, :, pos] = vc[rows, :, pos] = float("nan")
    assert kc.isnan().all() and vc.isnan().all(), "a write outside the rows' positions"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.no_grad()
def test_scaled_embedding_and_its_row_sums(dtype):
    g = torch.Generator().manual_seed(3)
    V, C, B = 11, 37, 3
    wte = rand(g, V, C, scale=0.3, dtype=dtype)
    scale = torch.tensor(C ** 0.5, dtype=dtype).item()                        # rounded to the dtype, as the model's
    tok = torch.tensor([4, 0, 10], device=DEVICE)
    stats = torch.full((3, B, 2), float("nan"), device=DEVICE)
    x = embed_with_stats(tok, torch.zeros_like(tok), wte, None, stats, scale=scale)
    assert torch.equal(x, wte[tok] * scale)                                   # one rounding, as eager's
    torch.testing.assert_close(stats[0], torch.stack((x.double().sum(1), (x.double() ** 2).sum(1)), 1).float(),
                               rtol=1e-5, atol=1e-4)
    assert torch.equal(stats[1:], torch.zeros_like(stats[1:]))
    with pytest.raises(ValueError, match="scale must be a positive number"):
        embed_with_stats(tok, tok, wte, None, stats, scale=-1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["rmsnorm1p", "rmsnorm", "rmsnorm_fp32"])
@pytest.mark.parametrize("M,C", [(1, 37), (4, 640), (2, 4100)], ids=["odd", "gemma-270m", "two-tiles"])
@torch.no_grad()
def test_add_rms_norm_matches_reference(M, C, kind, dtype):
    """x + N(y) with N an offset (Gemma), plain (Llama) or float32-weight (OLMo) RMSNorm, its row sums stored for
    the next norm."""
    g = torch.Generator().manual_seed(C + M)
    x, y = rand(g, M, C, scale=2.0, dtype=dtype), rand(g, M, C, scale=5.0, shift=1.0, dtype=dtype)
    w = rand(g, C, scale=0.4, shift=0.0 if kind == "rmsnorm1p" else 1.0, dtype=dtype)
    norm = {"rmsnorm1p": offset_norm_ref, "rmsnorm": rms_norm_ref, "rmsnorm_fp32": fp32_norm_ref}[kind]
    stats = torch.full((M, 2), float("nan"), device=DEVICE)
    got = add_rms_norm(x, y, w, 1e-6, kind=kind, stats_out=stats)
    exact = cpu(x).double() + norm(cpu(y), cpu(w), 1e-6, torch.float64)
    plain = x + norm(y, w, 1e-6, dtype)
    assert_within_budget("x + N(y)", got, exact, plain)
    sums = torch.stack((got.double().sum(1), (got.double() ** 2).sum(1)), 1)
    torch.testing.assert_close(stats.double(), sums, rtol=1e-5, atol=1e-3)


def test_add_rms_norm_input_checks():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="x and y must be"):
        add_rms_norm(x, torch.zeros(2, 9, device=DEVICE), torch.zeros(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match=r"weight must be \(8,\)"):
        add_rms_norm(x, x, torch.zeros(9, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="stats_out must be"):
        add_rms_norm(x, x, torch.zeros(8, device=DEVICE), 1e-6, stats_out=torch.zeros(2, 3, device=DEVICE))
    with pytest.raises(ValueError, match="eps must be"):
        add_rms_norm(x, x, torch.zeros(8, device=DEVICE), -1.0)
    with pytest.raises(ValueError, match="kind must be one of rmsnorm, rmsnorm1p, rmsnorm_fp32"):
        add_rms_norm(x, x, torch.zeros(8, device=DEVICE), 1e-6, kind="layernorm")


def test_gemma_modes_need_their_partners():
    x, w = torch.zeros(1, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE)
    g = torch.zeros(8, device=DEVICE)
    with pytest.raises(ValueError, match="norm_offset .* needs rms=True"):
        ln_linear(x, w, ln=(g, None, 1e-6), norm_offset=True)
    with pytest.raises(ValueError, match="geglu .* needs swiglu=True"):
        ln_linear(x, w, geglu=True)
    kc = torch.zeros(1, 1, 4, 2, device=DEVICE)
    with pytest.raises(ValueError, match="q_scale must be a positive number"):
        ln_qkv_to_cache(x, w, None, None, kc, kc.clone(), torch.zeros(1, dtype=torch.long, device=DEVICE), 2,
                        q_scale=2.0)  # other than 1 only with rope


# ------------------------------------------------------------------------------------------- the model

GEMMA3 = dict(pos_emb="rope", norm="rmsnorm1p", mlp="geglu", bias=False, sandwich_norm=True, embed_scale=True,
              qk_norm=True, n_head=4, n_kv_head=2, n_embd=64, head_size=32, intermediate_size=96,
              attention_window=5, full_attention_interval=3, rope_theta=1e6, rope_local_theta=1e4,
              query_scale_dim=20, norm_eps=1e-6)


def tiny_gemma(dtype, **kw) -> GPT:
    """Three layers: two windowed ones on the local RoPE base, then a global one; weights off their init."""
    torch.manual_seed(7)
    model = GPT(GPTConfig(block_size=48, vocab_size=61, n_layer=3, attention="naive", **{**GEMMA3, **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 0.2))
        model.transformer.wte.weight.mul_(1 / 8)  # the blocks matter after the embedding's sqrt(C)
    return model.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.no_grad()
def test_gemma3_fused_step_equals_the_models_step(dtype):
    """Sequences from positions 1, 6 and 14 (inside, at and past the 5-token window) decode 4 steps."""
    model = tiny_gemma(dtype)
    assert unsupported_reason(model, check_cache=False) is None and stack_plan(model) is None
    decode_three_ways(model, [1, 6, 14], max_len=24, steps=4)


@pytest.mark.parametrize("variant", ["no-window", "plain-mlp-norms"])
@torch.no_grad()
def test_gemma3_pieces_one_at_a_time(variant):
    """Gemma's pieces without the window (every layer global, one RoPE base), and sandwich norms with Llama's
    RMSNorm and SwiGLU (the residual add's plain norm, no offsets, no embedding scale)."""
    kw = (dict(attention_window=0, full_attention_interval=0, rope_local_theta=0.0) if variant == "no-window" else
          dict(norm="rmsnorm", mlp="swiglu", embed_scale=False, query_scale_dim=0))
    decode_three_ways(tiny_gemma(torch.float32, **kw), [2, 9], max_len=16, steps=3)


@torch.no_grad()
def test_gemma3_greedy_generation_with_the_fused_step_equals_without():
    """The same tokens with the fused step as with the model's own (prompts across the window, each sequence at
    its own positions). On a GPU: generate()'s own choice with the flash backend, in a CUDA graph and without."""
    assert_fused_generation_equals_the_models(tiny_gemma(torch.float32))


def test_sandwich_norm_with_layernorm_is_refused():
    model = tiny_gemma(torch.float32, norm="layernorm", qk_norm=False)
    assert "sandwich_norm with LayerNorm" in unsupported_reason(model, check_cache=False)


@torch.no_grad()
def test_gemma3_fused_step_launches(monkeypatch):
    """Per layer: the QKV launch with offset norms, q scale and RoPE; the output projection; the residual add's
    norm; GeGLU's launch; the down projection; the residual add's norm."""
    import kernels.ln_linear as ll
    import kernels.residual_norm as rn
    from tests.test_fused_decode_llama import LaunchLog
    launches: list = []
    keys = ("OFFSET", "GEGLU", "Q_SCALED", "ROPE", "QK_NORM", "HAS_RES")
    monkeypatch.setattr(ll, "_ln_linear_kernel", LaunchLog(ll._ln_linear_kernel, keys, into=launches))
    monkeypatch.setattr(rn, "_add_rms_norm_kernel", LaunchLog(rn._add_rms_norm_kernel, ("KIND",), into=launches))
    model = tiny_gemma(torch.float32)
    model.setup_kv_cache(1, 16)
    fused_decode_step(model, torch.tensor([[1]], device=DEVICE), torch.tensor([[0]], device=DEVICE))
    off = dict(OFFSET=False, GEGLU=False, Q_SCALED=False, ROPE=False, QK_NORM=False, HAS_RES=False)
    qkv = {**off, "OFFSET": True, "Q_SCALED": True, "ROPE": True, "QK_NORM": True}
    fc = {**off, "OFFSET": True, "GEGLU": True}
    assert launches == [qkv, off, {"KIND": 1}, fc, off, {"KIND": 1}] * 3
