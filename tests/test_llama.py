"""Llama-family options of GPTConfig on our side: parameter names and shapes, RoPE against an independent
formula, backends, KV-cache greedy decoding against full recomputation, training, configs."""
from __future__ import annotations

import math
import os

import pytest
import torch

from config import ConfigError, load_config
from model import GPT, GPTConfig
from model.rope import RotaryEmbedding, apply_rope, rope_inv_freq
from model.generation import generate
from model.sampling import SamplingParams
from tests.util import (ROOT, assert_flash_matches_naive, recompute_greedy, run_entry, train_losses,
                        write_corpus)

VOCAB = 97
LLAMA = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=VOCAB, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, attention="naive",
                **LLAMA)
    base.update(kw)
    return GPTConfig(**base)


def random_model(seed: int = 0, **kw) -> GPT:
    """Weights large enough that greedy choices have clear margins; norm weights off 1."""
    torch.manual_seed(seed)
    model = GPT(tiny(**kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
            else:
                p.add_(torch.randn_like(p) * 0.2)
    return model


# ------------------------------------------------------------------------------------------ config and shapes

def test_gpt2_defaults_and_old_configs_unchanged():
    """The defaults build GPT-2 exactly as before; a config saved before the new fields loads as GPT-2."""
    old = dict(block_size=32, vocab_size=50, n_layer=1, n_head=2, n_kv_head=0, n_embd=32, dropout=0.0, bias=True,
               attention="sdpa")
    model = GPT(GPTConfig(**old))
    assert model.rotary is None and model.transformer.wpe.weight.shape == (32, 32)
    assert isinstance(model.transformer.h[0].ln_1, torch.nn.LayerNorm) and model.transformer.h[0].ln_1.eps == 1e-5
    assert model.transformer.h[0].mlp.c_fc.weight.shape == (128, 32)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert [n for n, _ in model.named_buffers()] == []  # the state dict holds what it held before


def test_llama_parameter_names_and_shapes():
    cfg = tiny(n_embd=64, n_head=4, n_kv_head=2, intermediate_size=80, tie_embeddings=False)
    model = GPT(cfg)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert "transformer.wpe.weight" not in params
    assert params["transformer.h.0.attn.c_attn.weight"] == ((4 + 2 * 2) * 16, 64)  # [q (4 heads) | k | v]
    assert params["transformer.h.0.mlp.c_fc.weight"] == (2 * 80, 64)               # [gate | up]
    assert params["transformer.h.0.mlp.c_proj.weight"] == (64, 80)
    assert params["transformer.h.0.ln_1.weight"] == (64,) and "transformer.h.0.ln_1.bias" not in params
    assert params["lm_head.weight"] == (VOCAB, 64) and model.lm_head.weight is not model.transformer.wte.weight
    assert not any(n.endswith(".bias") for n in params)
    assert model.num_params() == sum(p.numel() for p in model.parameters()) - VOCAB * 64  # wte is a lookup table

    qwen = GPT(tiny(qkv_bias=True, qk_norm=True, head_size=24))
    params = {n: tuple(p.shape) for n, p in qwen.named_parameters()}
    assert params["transformer.h.1.attn.c_attn.bias"] == ((4 + 2 * 2) * 24,)
    assert "transformer.h.1.attn.c_proj.bias" not in params and "transformer.h.1.mlp.c_fc.bias" not in params
    assert params["transformer.h.1.attn.q_norm.weight"] == (24,) == params["transformer.h.1.attn.k_norm.weight"]
    assert params["transformer.h.1.attn.c_proj.weight"] == (64, 4 * 24)
    logits, _ = qwen(torch.randint(0, VOCAB, (2, 10)))
    assert logits.shape == (2, 10, VOCAB)


def test_mlp_widths():
    assert GPTConfig(n_embd=576, n_head=9, mlp="swiglu").mlp_hidden == 1536  # 8/3 · 576, a multiple of 64
    assert GPTConfig(n_embd=128, mlp="swiglu", n_head=4).mlp_hidden == 384    # 341.3 rounded up to 64
    assert GPTConfig(n_embd=128, n_head=4).mlp_hidden == 512                  # GELU: 4·n_embd
    assert GPTConfig(n_embd=128, n_head=4, mlp="swiglu", intermediate_size=100).mlp_hidden == 100


def test_smollm2_config_has_its_parameter_count():
    cfg = load_config(os.path.join(ROOT, "configs", "smollm2_135m.toml")).model
    with torch.device("meta"):
        model = GPT(cfg)
    # 49152·576 embedding + 30 × (q 576² + k, v 2·576·192 + o 576² + 3·576·1536 + 2·576) + 576
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert (cfg.kv_heads, cfg.head_dim, cfg.rope_theta, cfg.norm_eps) == (3, 64, 100000.0, 1e-5)


def test_qwen3_config_has_its_parameter_count():
    from model.fused_decode import unsupported_reason
    cfg = load_config(os.path.join(ROOT, "configs", "qwen3_0_6b.toml")).model
    with torch.device("meta"):
        model = GPT(cfg)
    # 151936·1024 embedding + 28 × (q 1024·2048 + k, v 2·1024·1024 + o 2048·1024 + 3·1024·3072 + 2·1024 + 2·128)
    # + 1024
    assert sum(p.numel() for p in model.parameters()) == 596_049_920
    assert (cfg.kv_heads, cfg.head_dim, cfg.qk_norm) == (8, 128, True)
    assert unsupported_reason(model, check_cache=False) == "the model is on meta (the fused step runs on CUDA)"


@pytest.mark.parametrize("overrides, needle", [
    (["--pos_emb=alibi"], "model.pos_emb"),
    (["--norm=batchnorm"], "model.norm="),
    (["--mlp=relu"], "model.mlp"),
    (["--rope_scaling=llama3"], "needs pos_emb = 'rope'"),
    (["--pos_emb=rope", "--rope_scaling=dynamic"], "model.rope_scaling"),
    (["--pos_emb=rope", "--rope_scaling=yarn", "--rope_beta_fast=1"], "must be above rope_beta_slow=1.0"),
    (["--rope_beta_slow=0"], "model.rope_beta_slow"),
    (["--rope_attention_factor=-1"], "model.rope_attention_factor"),
    (["--pos_emb=rope", "--rope_theta=0"], "model.rope_theta"),
    (["--pos_emb=rope", "--rope_theta=nan"], "model.rope_theta"),
    (["--rope_factor=0.5"], "model.rope_factor"),
    (["--rope_high_freq_factor=0.5"], "model.rope_high_freq_factor"),
    (["--rope_original_max_pos=0"], "model.rope_original_max_pos"),
    (["--norm_eps=0"], "model.norm_eps"),
    (["--intermediate_size=-1"], "model.intermediate_size"),
    (["--head_size=-2"], "model.head_size"),
    (["--pos_emb=rope", "--head_size=15"], "RoPE needs it even"),
    (["--qk_norm=maybe"], "model.qk_norm"),
    (["--block_size=1000000"], "model.block_size"),  # the learned table's cap
    (["--nope_interval=4"], "model.nope_interval=4: needs pos_emb = 'rope'"),
    (["--pos_emb=rope", "--nope_interval=-1"], "model.nope_interval=-1"),
])
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_rope_has_no_learned_position_cap():
    cfg = load_config(None, ["--pos_emb=rope", "--block_size=1000000", "--n_head=4", "--n_embd=64"]).model
    assert cfg.block_size == 1_000_000


# ----------------------------------------------------------------------------------------------------- RoPE

def test_rope_is_a_rotation_of_each_half_pair():
    """Against an independent formula: pair (x_i, x_{i+D/2}) as the complex number x_i + i·x_{i+D/2}, multiplied by
    exp(i · p · theta^(-2i/D)) for a token at position p."""
    cfg = GPTConfig(n_embd=64, n_head=4, pos_emb="rope", rope_theta=500.0)
    D = cfg.head_dim
    x = torch.randn(2, 7, 3, D, dtype=torch.float64)  # (B, T, H, D)
    pos = torch.tensor([[0, 1, 2, 5, 9, 40, 41], [3, 4, 5, 6, 7, 8, 100]])  # (B, T), per sequence
    cos, sin = RotaryEmbedding(cfg)(pos, torch.float64)
    got = apply_rope(x, cos, sin)
    freq = torch.tensor([500.0 ** (-2 * i / D) for i in range(D // 2)], dtype=torch.float64)
    z = torch.complex(x[..., :D // 2], x[..., D // 2:]) * torch.polar(torch.ones(1, dtype=torch.float64),
                                                                      pos[:, :, None, None] * freq)
    want = torch.cat((z.real, z.imag), dim=-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # angles in float32, as transformers


def test_rope_scores_depend_only_on_the_offset():
    cfg = GPTConfig(n_embd=32, n_head=2, pos_emb="rope")
    rot = RotaryEmbedding(cfg)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(pq, pk):
        cq, sq = rot(torch.tensor([pq]), torch.float64)
        ck, sk = rot(torch.tensor([pk]), torch.float64)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()
    assert score(7, 3) == pytest.approx(score(107, 103), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


def test_llama3_frequency_scaling():
    base = GPTConfig(n_embd=128, n_head=2, pos_emb="rope", rope_theta=500000.0)  # head_dim 64
    scaled = GPTConfig(**{**base.__dict__, "rope_scaling": "llama3", "rope_factor": 8.0,
                          "rope_original_max_pos": 64})
    f0, f1 = rope_inv_freq(base), rope_inv_freq(scaled)
    wavelen = 2 * math.pi / f0
    short, long_ = wavelen < 64 / 4, wavelen > 64 / 1
    assert short.any() and long_.any() and (~short & ~long_).any()
    assert torch.equal(f1[short], f0[short])                          # high frequencies kept
    torch.testing.assert_close(f1[long_], f0[long_] / 8)              # low frequencies stretched 8×
    mid = ~short & ~long_
    assert ((f1[mid] < f0[mid]) & (f1[mid] > f0[mid] / 8)).all()      # the band in between blends
    assert (f1[1:] < f1[:-1]).all()                                   # still decreasing


def test_inv_freq_stays_float32_and_meta_models_recover():
    cfg = tiny()
    model = GPT(cfg).to(torch.bfloat16)
    assert model.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary.inv_freq, rope_inv_freq(cfg))
    assert "rotary.inv_freq" not in model.state_dict() and not list(model.buffers())  # nothing for DDP to broadcast
    with torch.device("meta"):
        meta = GPT(cfg)
    meta.to_empty(device="cpu")
    assert torch.equal(meta.rotary.inv_freq, rope_inv_freq(cfg))
    for table in (meta.rotary.cos_table, meta.rotary.sin_table):  # real values again, float32
        assert table.dtype == torch.float32 and not table.is_meta and table.shape == (cfg.block_size, cfg.head_dim)
    assert torch.equal(meta.rotary.cos_table, model.rotary.cos_table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_tables_give_the_computed_values(dtype):
    """Below block_size, cos and sin come from tables: bit for bit what computing them gives, for positions of
    one sequence, restarting per document (B, T), and in every dtype; past the bound they are computed."""
    cfg = GPTConfig(n_embd=64, n_head=4, pos_emb="rope", rope_theta=10000.0, block_size=64)
    rot = RotaryEmbedding(cfg)
    for pos in (torch.arange(37), torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [5, 6, 7, 8, 0, 1, 2, 3, 4]])):
        bound = pos.shape[-1] if pos.dim() == 1 else 9
        got = rot(pos, dtype, bound=bound)
        want = rot(pos, dtype)  # computed
        for g, w in zip(got, want):
            assert g.dtype == dtype and g.shape == (*pos.shape, cfg.head_dim)
            assert torch.equal(g, w)
    far = torch.tensor([0, 63, 64, 500])  # past block_size (a KV cache past the training length): computed
    cos, sin = rot(far, torch.float32, bound=None)
    assert torch.equal(cos[:2], rot.cos_table[[0, 63]]) and cos.shape == (4, cfg.head_dim)
    assert torch.equal(rot(far[:2], torch.float32, bound=65)[0], cos[:2])  # a bound past the table: computed


def test_rope_model_output_is_the_same_with_tables():
    """A training forward reads cos/sin from the tables (bound = T) and gives the logits computing them gives."""
    model = random_model()
    idx = torch.randint(0, model.config.vocab_size, (2, 11))
    table_forward, bounds = model.rotary.forward, []

    def recording(pos, dtype, bound=None):
        bounds.append(bound)
        return table_forward(pos, dtype, bound)
    model.rotary.forward = recording
    logits, _ = model(idx)
    assert bounds == [11]
    model.rotary.forward = lambda pos, dtype, bound=None: table_forward(pos, dtype)  # computed
    want, _ = model(idx)
    del model.rotary.forward
    assert torch.equal(logits, want)


# ---------------------------------------------------------------------------------------- model behaviour

def test_causality_and_positions_matter():
    model = random_model()
    idx = torch.randint(0, VOCAB, (1, 20))
    a, _ = model(idx)
    idx2 = idx.clone()
    idx2[0, 15:] = (idx2[0, 15:] + 1) % VOCAB  # change the future
    torch.testing.assert_close(model(idx2)[0][:, :15], a[:, :15])
    # The last query attends to the same set of (key, value) pairs in both orders: only RoPE tells them apart.
    swapped = idx.clone()
    swapped[0, [3, 9]] = idx[0, [9, 3]]
    assert idx[0, 3] != idx[0, 9] and (model(swapped)[0][0, -1] - a[0, -1]).abs().amax() > 1e-3


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_head=1, qk_norm=True, qkv_bias=True, tie_embeddings=False),
                                dict(head_size=24, rope_scaling="llama3", rope_original_max_pos=8),
                                dict(nope_interval=2, n_layer=4)])
def test_backends_agree(kw):
    torch.manual_seed(0)
    model = GPT(tiny(**kw)).double()  # GPT-2's init: CPU SDPA's float64 drifts ~1e-7 relative on large scores
    idx = torch.randint(0, VOCAB, (2, 23))
    ref, _ = model(idx)
    model.set_attention_backend("sdpa")
    torch.testing.assert_close(model(idx)[0], ref)


def test_flash_backend_matches_naive_forward_and_backward():
    """RoPE inside the packed projection, through the Triton kernel (the interpreter on CPU): same logits and
    gradients as the reference."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(3)
    model = GPT(tiny(qk_norm=True, n_layer=1)).to(device)
    idx = torch.randint(0, VOCAB, (2, 19), device=device)
    assert_flash_matches_naive(model, idx)


def test_nope_layers_through_flash_match_naive_and_matter():
    """nope_interval = 2 (SmolLM3): layer 0 rotates inside the flash call (rope_in_flash), layer 1 rotates nothing;
    flash gives the reference's logits and gradients, and the NoPE layer is what makes them differ from a model
    with RoPE everywhere."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(5)
    model = GPT(tiny(nope_interval=2, n_layer=2)).to(device)
    assert [b.attn.use_rope for b in model.transformer.h] == [True, False]
    idx = torch.randint(0, VOCAB, (2, 19), device=device)
    flash_logits = assert_flash_matches_naive(model, idx)
    model.transformer.h[1].attn.use_rope = True
    with torch.no_grad():
        assert (model(idx)[0] - flash_logits).abs().max() > 1e-3


@pytest.mark.parametrize("scaling", [dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_pos=8),
                                     dict(rope_scaling="linear", rope_factor=2.0)], ids=["yarn", "linear"])
def test_scaled_rope_through_flash_matches_naive(scaling):
    """YaRN's tables carry its attention factor (cos and sin scaled, not a rotation): the flash call rotates with
    them and its backward rotates the gradients back with them (rope_in_flash); logits and gradients are the
    reference's."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(6)
    model = GPT(tiny(n_layer=1, **scaling)).to(device)
    idx = torch.randint(0, VOCAB, (2, 21), device=device)
    assert_flash_matches_naive(model, idx)


def test_compiled_rope_model_has_no_graph_break():
    torch.manual_seed(4)
    model = GPT(tiny(attention="sdpa", qk_norm=True))
    idx = torch.randint(0, VOCAB, (2, 17))
    eager_logits, eager_loss = model(idx, idx)
    torch._dynamo.reset()
    logits, loss = torch.compile(model, fullgraph=True, backend="aot_eager")(idx, idx)
    torch.testing.assert_close(logits, eager_logits)
    torch.testing.assert_close(loss, eager_loss)


def test_compile_before_the_kernel_options_were_read_has_no_graph_break(monkeypatch):
    """A process whose first use of the kernel options is a compiled forward (a script that builds a model and
    compiles it): building the model reads them, so tracing never reads the environment, which would break
    the graph inside the loop over blocks and send the whole forward to eager."""
    import kernels.options
    monkeypatch.setattr(kernels.options, "_current", None)  # as in a fresh process
    model = GPT(tiny(attention="sdpa"))
    assert kernels.options._current is not None
    idx = torch.randint(0, VOCAB, (2, 17))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(idx, idx)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()


def test_autocast_keeps_the_packed_projection_in_its_dtype():
    """Under bf16 autocast, q and k come out of RoPE and qk_norm in bf16 (no silent float32 attention)."""
    model = GPT(tiny(attention="sdpa", qk_norm=True))
    seen = []
    model.transformer.h[0].attn.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    orig = model.transformer.h[0].attn.rotate_qk
    model.transformer.h[0].attn.rotate_qk = lambda qkv, rope: seen.append(out := orig(qkv, rope)) or out
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(torch.randint(0, VOCAB, (1, 12)))
    assert seen[0].dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_fused_decode_step_covers_llama_blocks():
    """Llama blocks, NoPE layers and qk_norm at head dims the QKV kernel's per-head norm takes (tests/
    test_fused_decode_llama.py checks the fused step's numbers)."""
    from model.fused_decode import unsupported_reason
    for model in (GPT(tiny()), GPT(tiny(nope_interval=2)), GPT(tiny(qk_norm=True, head_size=32))):
        reason = unsupported_reason(model, check_cache=False)
        assert reason is None or reason.startswith("the model is on cpu")  # a GPU machine runs the step on CUDA only
    assert "qk_norm with head dim 16" in unsupported_reason(GPT(tiny(qk_norm=True, head_size=16)), check_cache=False)


# --------------------------------------------------------------------------------- greedy: cache = recompute

N_NEW = 10
PROMPT_LENS = (1, 5, 17, 30)


@pytest.fixture(scope="module")
def oracle():
    """{name: (model, prompts, expected greedy tokens)} for a Llama-shaped, a Qwen3-shaped and a SmolLM3-shaped
    (NoPE every second layer) model."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    out = {}
    for name, kw in {"llama": dict(), "qwen3": dict(qk_norm=True, qkv_bias=True, head_size=32,
                                                    tie_embeddings=False, n_kv_head=1),
                     "smollm3": dict(nope_interval=2)}.items():
        model = random_model(**kw)
        out[name] = (model, prompts, [recompute_greedy(model, p, N_NEW) for p in prompts])
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3", "smollm3"])
@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("chunk", [0, 4, 13])
def test_greedy_with_cache_equals_recompute(oracle, name, backend, chunk):
    model, prompts, expected = oracle[name]
    params = SamplingParams(temperature=0.0, max_new_tokens=N_NEW)
    model.set_attention_backend(backend)
    try:
        assert generate(model, prompts, params, prefill_chunk=chunk).sequences == expected  # (B, T) positions
        for p, e in zip(prompts, expected):
            assert generate(model, [p], params, prefill_chunk=chunk).sequences == [e]     # (T,) positions
    finally:
        model.set_attention_backend("naive")


@pytest.mark.parametrize("name", ["llama", "smollm3"])
def test_greedy_flash_backend_equals_recompute(oracle, name):
    """Flash prefill with RoPE, then the split-KV decode kernel (the interpreter on CPU, float32)."""
    if torch.cuda.is_available():
        pytest.skip("CPU tensors go through the Triton interpreter only without a GPU")
    model, prompts, expected = oracle[name]
    model.set_attention_backend("flash")
    try:
        got = generate(model, prompts[1:3], SamplingParams(temperature=0.0, max_new_tokens=N_NEW)).sequences
        assert got == expected[1:3]
    finally:
        model.set_attention_backend("naive")


# ------------------------------------------------------------------------------------------------ training

def test_a_few_steps_of_training_lower_the_loss():
    torch.manual_seed(0)
    model = GPT(tiny(qk_norm=True, tie_embeddings=False))
    data = torch.arange(33).repeat(8, 1) % 11  # (8, 33): a learnable periodic sequence
    losses = train_losses(model, data, weight_decay=0.1)
    assert losses[-1] < 0.5 * losses[0]


def test_llama_demo_config_trains_and_generates(tmp_path):
    """configs/llama_demo.toml end to end, shrunk: train.py writes a RoPE checkpoint that generate.py reads."""
    corpus = write_corpus(tmp_path)
    out = tmp_path / "run"
    r = run_entry("train.py", os.path.join(ROOT, "configs", "llama_demo.toml"), f"--dataset={corpus}",
                  f"--cache_dir={tmp_path}/cache", f"--out_dir={out}", "--max_iters=30", "--eval_interval=15",
                  "--num_proc=1", "--eval_iters=2", "--n_layer=2", "--n_embd=32", "--n_head=2", "--n_kv_head=1",
                  "--block_size=32", "--batch_size=8")
    assert r.returncode == 0, r.stderr
    assert 'pos_emb = "rope"' in r.stdout and 'mlp = "swiglu"' in r.stdout
    g = run_entry("generate.py", "--ckpt", out, "--prompt", "the king", "--max-new-tokens", "20", "--seed", "1")
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("the king") and len(g.stdout) > len("the king") + 10
