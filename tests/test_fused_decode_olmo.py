"""The fused decode path's OLMo 2 and 3 pieces against float64 references: q and k normalised over all their heads
then rotated (kernels/qk_norm_rope.py), and whole OLMo models' fused steps (no input norms, sandwich norms with the
weight in float32; OLMo 3's windows and RoPE bases) against their own step and in greedy generation. The sandwich
norms' row launch with OLMo's norm: tests/test_fused_decode_gemma.py.

Criterion as in tests/test_fused_decode.py (tests/error_budget.py). CUDA when present (bf16 included), otherwise
CPU through the Triton interpreter (fp16/fp32). Outputs and caches are poisoned with NaN first.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (triton decorates then)

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.qk_norm_rope import qk_norm_rope  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.fused_decode import fused_decode_step, stack_plan, unsupported_reason  # noqa: E402
from model.rope import RotaryEmbedding, apply_rope  # noqa: E402
from tests.error_budget import assert_within_budget  # noqa: E402
from tests.test_fused_decode import DEVICE, DTYPES  # noqa: E402
from tests.test_fused_decode_gemma import fp32_norm_ref  # noqa: E402
from tests.test_fused_decode_llama import (LaunchLog, assert_fused_generation_equals_the_models,  # noqa: E402
                                          decode_three_ways)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 16), (3, 3, 32), (5, 1, 8), (2, 2, 24), (3, 1, 6)],
                         ids=["gqa", "mha", "mqa-d8", "mha-d24", "gqa-d6"])
@torch.no_grad()
def test_qk_norm_over_all_heads_then_rope(Hq, Hkv, D, dtype):
    """q and each row's cached k: x / rms over all heads · w (float32, rounded once), then RoPE at the row's
    position; in place, nothing else of the cache touched."""
    B, max_len = 3, 24
    g = torch.Generator().manual_seed(Hq * D)

    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(DEVICE, dtype)

    cos, sin = RotaryEmbedding(GPTConfig(n_embd=Hq * D, n_head=Hq, pos_emb="rope", rope_theta=1e4)).to(DEVICE)(
        torch.arange(max_len, device=DEVICE), dtype)                        # (L, D) each
    q0, k0 = r(B, Hq * D, scale=2.0, shift=0.5), r(B, Hkv, D, scale=3.0)
    qg, kg = r(Hq * D, scale=0.3, shift=1.0), r(Hkv * D, scale=0.3, shift=1.0)
    pos = torch.tensor([0, 9, max_len - 1], device=DEVICE)
    kc = torch.full((B + 1, Hkv, max_len, D), float("nan"), dtype=dtype, device=DEVICE)  # one spare row
    rows = torch.arange(B, device=DEVICE)
    kc[rows, :, pos] = k0
    q = q0.clone()
    assert qk_norm_rope(q, kc, pos, qg, kg, 1e-6, (cos, sin)) is q

    def ref(dt, q0, k0, qg, kg, cos, sin, pos):
        qn = fp32_norm_ref(q0, qg, 1e-6, dt).view(B, 1, Hq, D)
        kn = fp32_norm_ref(k0.reshape(B, Hkv * D), kg, 1e-6, dt).view(B, 1, Hkv, D)
        c, s = cos[pos][:, None].to(dt), sin[pos][:, None].to(dt)          # (B, T=1, D)
        return apply_rope(qn, c, s).reshape(B, Hq * D), apply_rope(kn, c, s)[:, 0]

    cpu = [t.cpu() for t in (q0, k0, qg, kg, cos, sin, pos)]
    exact, plain = ref(torch.float64, *cpu), ref(dtype, q0, k0, qg, kg, cos, sin, pos)
    per_head = F.rms_norm(q0.cpu().double().view(B, Hq, D), (D,), eps=1e-6).view(B, -1) * qg.cpu().double()
    if Hq > 1:
        assert (per_head - fp32_norm_ref(q0.cpu(), qg.cpu(), 1e-6, torch.float64)).abs().max() > 1e-3
    assert_within_budget("q normalised over all heads, rotated", q, exact[0], plain[0])
    assert_within_budget("k in the cache", kc[rows, :, pos], exact[1], plain[1])
    kc[rows, :, pos] = float("nan")
    assert kc.isnan().all(), "a write outside the rows' positions"


def test_qk_norm_rope_input_checks():
    q, kc = torch.zeros(2, 32, device=DEVICE), torch.zeros(2, 2, 8, 16, device=DEVICE)
    tables = (torch.zeros(8, 16, device=DEVICE),) * 2
    pos, g = torch.zeros(2, dtype=torch.long, device=DEVICE), torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match=r"gains of \(32,\) and \(32,\)"):
        qk_norm_rope(q, kc, pos, g, g[:16], 1e-6, tables)
    with pytest.raises(ValueError, match="rope must be"):
        qk_norm_rope(q, kc, pos, g, g, 1e-6, (tables[0][:, :8],) * 2)
    with pytest.raises(ValueError, match="pos must be"):
        qk_norm_rope(q, kc, pos[:1], g, g, 1e-6, tables)


# ------------------------------------------------------------------------------------------- the model

OLMO = dict(pos_emb="rope", norm="rmsnorm_fp32", mlp="swiglu", bias=False, pre_norm=False, sandwich_norm=True,
            qk_norm=True, qk_norm_scope="all", n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96,
            rope_theta=5e5, norm_eps=1e-6, tie_embeddings=False)
OLMO3 = dict(OLMO, n_layer=3, attention_window=5, full_attention_interval=3, rope_local_theta=1e3)


def tiny_olmo(dtype, **kw) -> GPT:
    torch.manual_seed(11)
    model = GPT(GPTConfig(**{"block_size": 48, "vocab_size": 61, "n_layer": 2, "attention": "naive", **OLMO,
                             **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.1))
    return model.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["olmo2", "olmo3", "olmo2-d24"])
@torch.no_grad()
def test_olmo_fused_step_equals_the_models_step(family, dtype):
    """Sequences from positions 1, 6 and 14 decode 4 steps (OLMo 3: across its 5-token window; d24: a head dim whose
    half is no power of 2, as 96 is)."""
    model = tiny_olmo(dtype, **{"olmo3": OLMO3, "olmo2-d24": dict(head_size=24)}.get(family, {}))
    assert unsupported_reason(model, check_cache=False) is None and stack_plan(model) is None
    decode_three_ways(model, [1, 6, 14], max_len=24, steps=4)


@torch.no_grad()
def test_olmo_greedy_generation_with_the_fused_step_equals_without():
    assert_fused_generation_equals_the_models(tiny_olmo(torch.float32, **OLMO3))


@torch.no_grad()
def test_olmo_fused_step_launches(monkeypatch):
    """Per layer: the QKV launch without a norm, RoPE or q / k norm; the q / k norm + RoPE launch; the output
    projection; the residual add's norm (OLMo's kind); the MLP's two launches without a norm; the residual add's."""
    import kernels.ln_linear as ll
    import kernels.qk_norm_rope as qr
    import kernels.residual_norm as rn
    launches: list = []
    monkeypatch.setattr(ll, "_ln_linear_kernel", LaunchLog(ll._ln_linear_kernel, ("HAS_LN", "ROPE", "QK_NORM",
                                                                                   "SWIGLU", "HAS_RES"), into=launches))
    monkeypatch.setattr(rn, "_add_rms_norm_kernel", LaunchLog(rn._add_rms_norm_kernel, ("KIND",), into=launches))
    monkeypatch.setattr(qr, "_qk_norm_rope_kernel", LaunchLog(qr._qk_norm_rope_kernel, ("D",), into=launches))
    model = tiny_olmo(torch.float32)
    model.setup_kv_cache(1, 16)
    fused_decode_step(model, torch.tensor([[1]], device=DEVICE), torch.tensor([[0]], device=DEVICE))
    plain = dict(HAS_LN=False, ROPE=False, QK_NORM=False, SWIGLU=False, HAS_RES=False)
    assert launches == [plain, {"D": 16}, plain, {"KIND": 2}, {**plain, "SWIGLU": True}, plain, {"KIND": 2}] * 2


def test_olmo_norms_elsewhere_are_refused():
    for kw, needle in [(dict(pre_norm=True), "norm 'rmsnorm_fp32' on the sub-blocks' inputs or on each head"),
                       (dict(qk_norm_scope="head"), "norm 'rmsnorm_fp32' on the sub-blocks' inputs or on each head"),
                       (dict(norm="rmsnorm"), "qk_norm over all heads other than OLMo's"),
                       (dict(nope_interval=2), "qk_norm over all heads other than OLMo's")]:
        assert needle in unsupported_reason(tiny_olmo(torch.float32, **kw), check_cache=False), kw
