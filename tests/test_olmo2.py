"""OLMo 2's options of GPTConfig on our side: norms on the sub-blocks' outputs only (pre_norm = false with
sandwich_norm), RMSNorm with its weight applied in float32 (rmsnorm_fp32), q and k normalised over all heads
(qk_norm_scope = "all"): the pieces against formulas of their own, flash (the interpreter on the CPU) against the
naive reference forward and backward, compile, training, cached generation, validation and the real shape's config. Against transformers' own Olmo2ForCausalLM:
tests/test_hf_import.py, test_export.py, test_finetune.py, test_hf_adapter.py."""
from __future__ import annotations

import os

import pytest
import torch

from config import ConfigError, load_config
from model import GPT, GPTConfig
from model.fused_decode import stack_plan
from model.generation import generate
from model.norms import Fp32GainRMSNorm, RMSNorm
from model.rope import apply_rope
from model.sampling import SamplingParams
from tests.util import (ROOT, assert_compiles_as_one_graph, assert_flash_matches_naive, recompute_greedy,
                        train_losses)

VOCAB = 97
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OLMO2 = dict(pos_emb="rope", norm="rmsnorm_fp32", mlp="swiglu", bias=False, pre_norm=False, sandwich_norm=True,
             qk_norm=True, qk_norm_scope="all", n_kv_head=2, rope_theta=5e5, norm_eps=1e-6, tie_embeddings=False)


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=VOCAB, block_size=64, n_layer=2, n_head=4, n_embd=64, attention="naive", **OLMO2)
    base.update(kw)
    return GPTConfig(**base)


def random_model(seed: int = 0, **kw) -> GPT:
    """Weights off their init (norm weights off 1)."""
    torch.manual_seed(seed)
    model = GPT(tiny(**kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.1))
    return model


def test_parameter_names_and_shapes():
    """No input norms; the output norms; q and k norms as wide as all their heads."""
    model = GPT(tiny())
    names = {n for n, _ in model.named_parameters()}
    assert not [n for n in names if ".ln_1." in n or ".ln_2." in n]
    for n in ("ln_attn_out", "ln_mlp_out"):
        assert f"transformer.h.0.{n}.weight" in names, n
    attn = model.transformer.h[0].attn
    assert attn.q_norm.weight.shape == (4 * 16,) and attn.k_norm.weight.shape == (2 * 16,)
    assert isinstance(attn.q_norm, Fp32GainRMSNorm) and isinstance(model.transformer.ln_f, Fp32GainRMSNorm)
    per_head = GPT(tiny(qk_norm_scope="head", norm="rmsnorm"))
    assert per_head.transformer.h[0].attn.q_norm.weight.shape == (16,)
    assert isinstance(per_head.transformer.h[0].attn.q_norm, RMSNorm)


def test_fp32_gain_rmsnorm_formula_and_rounding():
    """x / rms(x) · w, all in float32, rounded once at the end (Llama's rounds x / rms first)."""
    torch.manual_seed(0)
    norm = Fp32GainRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1, 0.5)
    x = torch.randn(3, 5, 48, dtype=torch.float64)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    torch.testing.assert_close(norm.double()(x), want)
    xb = x.to(torch.bfloat16)
    wide = xb.float() / torch.sqrt((xb.float() ** 2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert torch.equal(norm(xb), wide.to(torch.bfloat16))
    llama = RMSNorm(48, eps=1e-6, kernel="torch")
    with torch.no_grad():
        llama.weight.copy_(norm.weight)
    assert not torch.equal(llama(xb), norm(xb))  # the two roundings differ: the check above can fail


@torch.no_grad()
def test_block_against_an_explicit_formula():
    """x + N_a(attn(x)), then + N_m(mlp(·)); attention's q and k normalised over all heads before RoPE."""
    model = random_model()
    block = model.transformer.h[0]
    idx = torch.randint(0, VOCAB, (2, 11))
    x, rope = model.embed(idx)
    B, T = idx.shape
    q, k, v = block.attn.c_attn(x).split([64, 32, 32], dim=-1)
    q = block.attn.q_norm(q).view(B, T, 4, 16)
    k = block.attn.k_norm(k).view(B, T, 2, 16)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    q, k, v = q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.view(B, T, 2, 16).repeat_interleave(
        2, 2).transpose(1, 2)
    visible = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
    scores = (q @ k.transpose(-1, -2)) / 4.0
    y = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v  # (B, H, T, D)
    h = x + block.ln_attn_out(block.attn.c_proj(y.transpose(1, 2).reshape(B, T, 64)))
    want = h + block.ln_mlp_out(block.mlp(h))
    torch.testing.assert_close(block(x, rope=rope), want, atol=1e-5, rtol=1e-5)
    other = random_model()
    for b in other.transformer.h:  # normalised per head instead: another model (the scope is not ignored)
        b.attn.qk_norm_all = False
        b.attn.q_norm.weight = torch.nn.Parameter(b.attn.q_norm.weight[:16].clone())
        b.attn.k_norm.weight = torch.nn.Parameter(b.attn.k_norm.weight[:16].clone())
    assert (other(idx)[0] - model(idx)[0]).abs().max() > 1e-3


def test_flash_matches_naive_forward_and_backward():
    """Every layer through the flash kernel (the interpreter on the CPU) in float32: logits and gradients."""
    torch.manual_seed(3)
    model = random_model().to(DEVICE).train()
    idx = torch.randint(0, VOCAB, (2, 19), device=DEVICE)
    assert_flash_matches_naive(model, idx)


def test_compiled_model_has_no_graph_break_and_training_lowers_the_loss():
    torch.manual_seed(5)
    model = random_model(attention="sdpa")
    idx = torch.randint(0, VOCAB, (2, 17))
    assert_compiles_as_one_graph(model, idx)
    losses = train_losses(random_model().train(), torch.randint(0, VOCAB, (4, 32)))
    assert losses[-1] < losses[0] - 1.0, losses


@torch.no_grad()
def test_cached_generation_equals_recomputing_and_the_stack_refuses_it():
    """Greedy tokens with the KV cache (the model's own step) equal the no-cache recompute; the one-launch decode
    stack has no OLMo pieces (the fused step's per-layer launches do: tests/test_fused_decode_olmo.py)."""
    model = random_model()
    assert stack_plan(model) is None
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    out = generate(model, [prompt], SamplingParams(temperature=0.0, max_new_tokens=8), fused=False)
    assert out.decode_path == "model"
    assert out.sequences[0] == recompute_greedy(model, prompt, 8)


def test_olmo2_1b_config_has_its_parameter_count():
    cfg = load_config(os.path.join(ROOT, "configs", "olmo2_1b.toml")).model
    with torch.device("meta"):
        model = GPT(cfg)
    # 2 · 100352·2048 (embedding, untied head) + 16 × (4·2048² + 3·2048·8192 + 4·2048 norms) + 2048
    assert sum(p.numel() for p in model.parameters()) == 1_484_916_736


@pytest.mark.parametrize("overrides, needle", [
    (["--pos_emb=rope", "--norm=rmsnorm", "--pre_norm=false"], "model.pre_norm=False: false needs sandwich_norm"),
    (["--qk_norm_scope=layer"], "model.qk_norm_scope='layer': must be one of head, all"),
    (["--norm=rmsnorm_fp16"], "model.norm="),
])
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)
