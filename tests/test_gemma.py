"""Gemma 3's options of GPTConfig on our side: the pieces against formulas of their own, per-layer windows and RoPE
bases, flash (the interpreter on the CPU, bf16 on the GPU) against the naive reference forward and backward,
compile, the fused decode step's per-layer path, validation and the real shape's config. Against transformers' own
Gemma3ForCausalLM: tests/test_hf_import.py, test_export.py, test_finetune.py, test_hf_adapter.py."""
from __future__ import annotations

import math
import os

import pytest
import torch

from config import ConfigError, load_config
from model import GPT, GPTConfig
from model.norms import OffsetRMSNorm
from model.rope import apply_rope
from tests.util import ROOT, assert_compiles_as_one_graph, assert_flash_matches_naive, train_losses

VOCAB = 97
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GEMMA = dict(pos_emb="rope", norm="rmsnorm1p", mlp="geglu", bias=False, sandwich_norm=True, embed_scale=True,
             qk_norm=True, n_kv_head=2, head_size=32, attention_window=5, full_attention_interval=3,
             rope_theta=1e4, rope_local_theta=100.0, query_scale_dim=20, norm_eps=1e-6)


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=VOCAB, block_size=64, n_layer=3, n_head=4, n_embd=64, attention="naive", **GEMMA)
    base.update(kw)
    return GPTConfig(**base)


def random_model(seed: int = 0, **kw) -> GPT:
    """Weights off their init (norm weights off 0), the embedding small enough that the blocks matter after its
    scaling by sqrt(n_embd)."""
    torch.manual_seed(seed)
    model = GPT(tiny(**kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 0.2))
        model.transformer.wte.weight.mul_(1 / 8)
    return model


# ------------------------------------------------------------------------------------------ the pieces

def test_parameter_names_and_per_layer_settings():
    model = GPT(tiny())
    names = {n for n, _ in model.named_parameters()}
    for n in ("ln_1", "ln_2", "ln_attn_out", "ln_mlp_out", "attn.q_norm", "attn.k_norm"):
        assert f"transformer.h.0.{n}.weight" in names, n
    assert model.transformer.h[0].mlp.c_fc.weight.shape[0] == 2 * model.config.mlp_hidden
    assert all(torch.count_nonzero(m.weight) == 0 for m in model.modules() if isinstance(m, OffsetRMSNorm))
    assert [b.attn.window for b in model.transformer.h] == [5, 5, 0]
    assert [b.attn.local_rope for b in model.transformer.h] == [True, True, False]
    assert model.rotary_local is not None and model.rotary_local.cfg.rope_theta == 100.0
    assert all(b.attn.q_scale == pytest.approx(math.sqrt(32 / 20)) for b in model.transformer.h)
    for hd in (32, 64, 128, 256):  # no query_scale_dim, or the head dim: exactly no scaling (so rope_in_flash
        for qsd in (0, hd):       # stays open), though (hd ** -0.5) * sqrt(hd) is not 1.0 for 32 or 128
            assert all(b.attn.q_scale == 1.0 for b in GPT(tiny(head_size=hd, query_scale_dim=qsd)).transformer.h)
    no_local = GPT(tiny(rope_local_theta=0.0))
    assert no_local.rotary_local is None and not any(b.attn.local_rope for b in no_local.transformer.h)


def test_offset_rmsnorm_formula_and_rounding():
    """x / rms(x) · (1 + w), all in float32, rounded once at the end (not before the scale, as Llama's)."""
    torch.manual_seed(0)
    norm = OffsetRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(0, 0.5)
    x = torch.randn(3, 5, 48, dtype=torch.float64)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight.double())
    torch.testing.assert_close(norm.double()(x), want)
    xb = x.to(torch.bfloat16)
    wide = xb.float() / torch.sqrt((xb.float() ** 2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight)
    assert torch.equal(norm(xb), wide.to(torch.bfloat16))


def test_geglu_and_embedding_scale_formulas():
    torch.manual_seed(1)
    model = random_model(n_layer=1)
    mlp = model.transformer.h[0].mlp
    x = torch.randn(2, 3, 64)
    gate, up = (x @ mlp.c_fc.weight.t()).chunk(2, dim=-1)
    want = (0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3))) * up) \
        @ mlp.c_proj.weight.t()
    torch.testing.assert_close(mlp(x), want, atol=1e-5, rtol=1e-5)
    idx = torch.randint(0, VOCAB, (2, 7))
    x, _ = model.embed(idx)
    torch.testing.assert_close(x, model.transformer.wte(idx) * 8.0)
    model16 = random_model(n_layer=1).to(torch.bfloat16)
    x16, _ = model16.embed(idx)  # sqrt(64) = 8 exactly; the table holds the rounded value for other widths
    assert torch.equal(x16, model16.transformer.wte(idx) * torch.tensor(8.0, dtype=torch.bfloat16))
    wide = GPT(tiny(n_embd=48, n_head=4, n_layer=1))
    assert wide.embed_scales[torch.bfloat16] == 6.9375 != wide.embed_scales[torch.float32]  # sqrt(48) = 6.928...
    assert wide.embed_scales[torch.float32] == pytest.approx(math.sqrt(48))


@torch.no_grad()
def test_attention_against_an_explicit_formula():
    """One block's attention output from its own formula: q, k normalised per head, rotated with the layer's
    RoPE base, logits scaled by 1/sqrt(query_scale_dim), the layer's window; layer 0 (windowed, local base)
    and layer 2 (full, global base)."""
    model = random_model()
    idx = torch.randint(0, VOCAB, (2, 23))
    x, rope = model.embed(idx)
    T = idx.shape[1]
    for layer in (0, 2):
        attn = model.transformer.h[layer].attn
        h = model.transformer.h[layer].ln_1(x)
        q, k, v = attn.c_attn(h).split([4 * 32, 2 * 32, 2 * 32], dim=-1)
        q, k, v = q.view(2, T, 4, 32), k.view(2, T, 2, 32), v.view(2, T, 2, 32)
        cos, sin = rope[2:] if layer == 0 else rope[:2]
        q, k = apply_rope(attn.q_norm(q), cos, sin), apply_rope(attn.k_norm(k), cos, sin)
        q, k, v = q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        visible = (j <= i) & ((j > i - 5) if layer == 0 else True)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(20)
        y = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v  # (B, H, T, D)
        want = attn.c_proj(y.transpose(1, 2).reshape(2, T, 128))
        torch.testing.assert_close(attn(h, rope=rope), want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_each_piece_changes_the_logits():
    """Turning any one Gemma piece off (the same weights) changes the logits: none is silently ignored."""
    model = random_model()
    idx = torch.randint(0, VOCAB, (2, 30))
    ref = model(idx)[0]
    for change in ("window", "local_rope", "q_scale", "sandwich", "embed_scale"):
        other = random_model()
        if change == "window":
            other.transformer.h[0].attn.window = 0
        elif change == "local_rope":
            other.transformer.h[0].attn.local_rope = False
        elif change == "q_scale":
            for b in other.transformer.h:
                b.attn.q_scale = 1.0
        elif change == "sandwich":
            other.transformer.h[1].sandwich_norm = False
        else:
            other.embed_scales = None
        assert (other(idx)[0] - ref).abs().max() > 1e-3, change


# ------------------------------------------------------------------------------------------ kernels and compile

@pytest.mark.parametrize("rope_local_theta", [100.0, 0.0], ids=["local-rope", "one-rope"])
def test_flash_matches_naive_forward_and_backward(rope_local_theta):
    """Every layer through the flash kernel (the interpreter on the CPU) in float32: the windowed layers' and the
    full layer's masks, both RoPE tables, the scaled q: the naive reference's logits and gradients."""
    torch.manual_seed(3)
    model = random_model(rope_local_theta=rope_local_theta).to(DEVICE).train()
    idx = torch.randint(0, VOCAB, (2, 19), device=DEVICE)
    assert_flash_matches_naive(model, idx)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 flash on the GPU")
def test_gemma_shape_flash_bf16_against_float64():
    """Head dim 256 (Gemma 3's), GQA 4/1, a window of 64 in two of three layers, 300 tokens, under bf16 autocast:
    flash's logits and gradients within twice SDPA's error of a float64 naive run of the same weights."""
    torch.manual_seed(4)
    cfg = dict(n_embd=256, n_head=4, n_kv_head=1, head_size=256, attention_window=64, block_size=512,
               query_scale_dim=0)
    model = random_model(**cfg).cuda().train()
    idx = torch.randint(0, VOCAB, (2, 300), device="cuda")
    ref = random_model(**cfg).cuda().double().train()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ref.zero_grad()
    ref_logits, ref_loss = ref(idx, idx)
    ref_loss.backward()
    got = {}
    for backend in ("flash", "sdpa"):
        model.zero_grad()
        model.set_attention_backend(backend)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, loss = model(idx, idx)
        loss.backward()
        got[backend] = (logits.float(), {n: p.grad.float() for n, p in model.named_parameters()})
    assert torch.isfinite(got["flash"][0]).all()
    err_f, err_s = (got["flash"][0] - ref_logits).abs().max(), (got["sdpa"][0] - ref_logits).abs().max()
    assert err_f <= 2 * err_s + 1e-3, (err_f, err_s)
    ref_grads = dict(ref.named_parameters())
    for name, g in got["flash"][1].items():
        want = ref_grads[name].grad
        err_f, err_s = (g - want).abs().max(), (got["sdpa"][1][name] - want).abs().max()
        assert err_f <= 2 * err_s + 1e-3 * want.abs().max(), (name, err_f, err_s)


def test_compiled_model_has_no_graph_break():
    """Both RoPE tables, per-layer windows and scales trace as one graph."""
    torch.manual_seed(5)
    model = random_model(attention="sdpa")
    idx = torch.randint(0, VOCAB, (2, 17))
    assert_compiles_as_one_graph(model, idx)


def test_fused_decode_step_serves_gemma_blocks_in_per_layer_launches():
    """The fused step takes Gemma 3 (tests/test_fused_decode_gemma.py checks it against the model's step); the
    one-launch stack does not (no sandwich norms in its phases)."""
    from model.fused_decode import stack_plan, unsupported_reason
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: under the interpreter (tests/conftest.py)
    for model in (random_model(), random_model(qk_norm=False, attention_window=0, full_attention_interval=0,
                                               rope_local_theta=0.0)):
        model.to(device)
        assert unsupported_reason(model, check_cache=False) is None
        assert stack_plan(model) is None


def test_a_few_training_steps_lower_the_loss():
    torch.manual_seed(6)
    model = random_model().train()
    losses = train_losses(model, torch.randint(0, VOCAB, (4, 32)))
    assert losses[-1] < losses[0] - 1.0, losses


# ------------------------------------------------------------------------------------------ config

def test_gemma3_270m_config_has_its_parameter_count():
    cfg = load_config(os.path.join(ROOT, "configs", "gemma3_270m.toml")).model
    with torch.device("meta"):
        model = GPT(cfg)
    # 262144·640 embedding + 18 × (q 640·1024 + k, v 2·640·256 + o 1024·640 + 3·640·2048 + 4·640 + 2·256) + 640
    assert sum(p.numel() for p in model.parameters()) == 268_098_176
    assert [b.attn.window for b in model.transformer.h] == [512] * 5 + [0] + [512] * 5 + [0] + [512] * 5 + [0]


@pytest.mark.parametrize("overrides, needle", [
    (["--norm=rmsnorm2"], "model.norm="),
    (["--mlp=reglu"], "model.mlp="),
    (["--full_attention_interval=2"], "model.full_attention_interval=2: needs attention_window"),
    (["--attention_window=4", "--full_attention_interval=-1"], "model.full_attention_interval=-1"),
    (["--pos_emb=rope", "--rope_local_theta=100"], "model.rope_local_theta=100.0: needs pos_emb = 'rope' and "
                                                   "full_attention_interval"),
    (["--pos_emb=rope", "--attention_window=4", "--full_attention_interval=2", "--rope_local_theta=0.5"],
     "model.rope_local_theta=0.5"),
    (["--query_scale_dim=-1"], "model.query_scale_dim=-1"),
    (["--sandwich_norm=perhaps"], "model.sandwich_norm"),
])
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)
