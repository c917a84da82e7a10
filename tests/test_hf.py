"""GPT-2 weights from Hugging Face transformers: the same logits, offline (random GPT2Config models, no download)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model  # noqa: E402

from model import GPT  # noqa: E402
from model.hf import HFError, from_hf_gpt2, load_hf_gpt2  # noqa: E402
from model.generation import generate  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from tests.util import run_entry  # noqa: E402

transformers.logging.set_verbosity_error()


def hf_model(**overrides) -> GPT2LMHeadModel:
    """A random GPT2LMHeadModel in eval mode; every parameter randomised (HF zeroes the biases) so that a
    missing transpose or a swapped tensor changes the logits."""
    torch.manual_seed(0)
    cfg = dict(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=100, bos_token_id=0, eos_token_id=0)
    hf = GPT2LMHeadModel(GPT2Config(**{**cfg, **overrides})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.05))
    return hf


@torch.no_grad()
def test_same_logits_as_transformers():
    hf = hf_model()
    model = GPT.from_hf_gpt2(hf)
    assert model.config.n_layer == 2 and model.config.n_head == 2 and model.config.block_size == 64
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(0, 100, (3, 64))
    want = hf(idx).logits
    got, _ = model(idx)
    assert want.abs().max() > 1  # not a degenerate comparison
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_from_state_dicts():
    hf = hf_model()
    idx = torch.randint(0, 100, (2, 40))
    want = hf(idx).logits
    sd = hf.state_dict()
    sd["transformer.h.0.attn.bias"] = torch.ones(1, 1, 64, 64, dtype=torch.bool)  # older transformers' buffers
    sd["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    torch.testing.assert_close(from_hf_gpt2(sd, n_head=2)(idx)[0], want, atol=1e-5, rtol=1e-5)
    # GPT2Model's keys have no "transformer." prefix and no lm_head (tied anyway)
    base = GPT2Model(hf.config).eval()
    base.load_state_dict(hf.transformer.state_dict())
    torch.testing.assert_close(from_hf_gpt2(base)(idx)[0], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(HFError, match="n_head"):
        from_hf_gpt2(sd)  # n_embd=64 is not a published GPT-2 size: the head count cannot be guessed


def test_standard_sizes_guess_the_heads():
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=12, n_embd=768, n_positions=32, vocab_size=50))
    model = from_hf_gpt2(hf.state_dict())
    assert (model.config.n_head, model.config.n_embd, model.config.vocab_size) == (12, 768, 50)


def test_greedy_generation_matches_transformers():
    hf = hf_model()
    model = from_hf_gpt2(hf)
    prompt = torch.randint(0, 100, (1, 9))
    want = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 9:].tolist()
    got = generate(model, prompt.tolist(), SamplingParams(temperature=0.0, max_new_tokens=12)).sequences[0]
    assert got == want


def test_incompatible_models_are_refused():
    with pytest.raises(HFError, match="activation_function"):
        from_hf_gpt2(hf_model(activation_function="relu"))
    with pytest.raises(HFError, match="attention scaling"):
        from_hf_gpt2(hf_model(scale_attn_by_inverse_layer_idx=True))
    sd = hf_model().state_dict()
    sd["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(64, 100)
    wrong = r"transformer\.h\.1\.mlp\.c_fc\.weight has shape \(64, 100\), expected \(64, 256\)"
    with pytest.raises(HFError, match=wrong):
        from_hf_gpt2(sd, n_head=2)
    with pytest.raises(HFError, match="not a GPT-2 state dict"):
        from_hf_gpt2({"foo": torch.zeros(1)})
    with pytest.raises(HFError, match="expected a GPT2LMHeadModel"):
        from_hf_gpt2(42)


@torch.no_grad()
def test_options_gpt2_configs_may_set():
    """n_inner (the MLP width), layer_norm_epsilon and an untied LM head map onto GPTConfig fields."""
    hf = hf_model(n_inner=100, layer_norm_epsilon=1e-3, tie_word_embeddings=False)
    with torch.no_grad():
        hf.lm_head.weight.copy_(torch.randn_like(hf.lm_head.weight) * 0.05)  # differs from wte
    model = from_hf_gpt2(hf)
    c = model.config
    assert (c.intermediate_size, c.norm_eps, c.tie_embeddings) == (100, 1e-3, False)
    idx = torch.randint(0, 100, (2, 30))
    torch.testing.assert_close(model(idx)[0], hf(idx).logits, atol=1e-5, rtol=1e-5)


def test_load_offline_fails_fast_with_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HFError, match="HF_HUB_OFFLINE"):
        load_hf_gpt2("gpt2-xl")
    with pytest.raises(HFError, match="unknown GPT-2 model"):
        load_hf_gpt2("gpt3")


def test_init_from_gpt2_offline_cli():
    r = run_entry("generate.py", "--init-from", "gpt2", "--prompt", "Hello", timeout=120)  # HF_HUB_OFFLINE=1
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot load GPT-2 weights 'gpt2'"), r.stderr
    assert "HF_HUB_OFFLINE" in lines[0]


def test_load_uses_the_local_cache_first(tmp_path, monkeypatch):
    """A model in the local hub cache loads offline (HF_HUB_OFFLINE=1), through safetensors alone."""
    import huggingface_hub.constants
    hf = hf_model()
    snapshot = tmp_path / "hub" / "models--gpt2" / "snapshots" / ("0" * 40)
    hf.save_pretrained(snapshot, safe_serialization=True)
    (tmp_path / "hub" / "models--gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--gpt2" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_hf_gpt2("gpt2")
    idx = torch.randint(0, 100, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], hf(idx).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(HFError, match="GPT-2 weights 'gpt2-xl': HF_HUB_OFFLINE is set"):
        load_hf_gpt2("gpt2-xl")  # not in this cache
