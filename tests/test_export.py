"""python -m model.export: checkpoints of each exportable shape → a folder that transformers loads with the same
logits and the same tokenizer ids, and that GPT.from_pretrained reads back bit for bit; bad input in one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from data.tokenizers import CharTokenizer, GPT2Tokenizer, HFTokenizer  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.export import ExportError, export_checkpoint, hf_family  # noqa: E402
from tests import hf_models  # noqa: E402
from tests.hf_models import write_ckpt, write_tokenizer  # noqa: E402
from tests.util import ROOT, pythonpath  # noqa: E402

transformers.logging.set_verbosity_error()
VOCAB = 96
LLAMA = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
             block_size=64, vocab_size=VOCAB)
GEMMA3 = dict(LLAMA, norm="rmsnorm1p", mlp="geglu", sandwich_norm=True, embed_scale=True, qk_norm=True, head_size=32,
              intermediate_size=80)
OLMO2 = dict(LLAMA, norm="rmsnorm_fp32", pre_norm=False, sandwich_norm=True, qk_norm=True, qk_norm_scope="all",
             tie_embeddings=False)
SHAPES = {
    # name: (GPTConfig fields, the architecture transformers must build)
    "gpt2": (dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=VOCAB), "GPT2LMHeadModel"),
    "gpt2-nobias-untied-inner": (dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=VOCAB, bias=False,
                                      tie_embeddings=False, intermediate_size=80, norm_eps=1e-3), "GPT2LMHeadModel"),
    "llama-gqa-untied": (dict(LLAMA, tie_embeddings=False, rope_theta=5e5, norm_eps=1e-6), "LlamaForCausalLM"),
    "llama-biases-mqa-tied": (dict(LLAMA, bias=True, n_kv_head=1, intermediate_size=80), "LlamaForCausalLM"),
    "llama3-scaling-head32": (dict(LLAMA, head_size=32, rope_scaling="llama3", rope_original_max_pos=16),
                              "LlamaForCausalLM"),
    "qwen2": (dict(LLAMA, qkv_bias=True, tie_embeddings=False), "Qwen2ForCausalLM"),
    "qwen3": (dict(LLAMA, qk_norm=True, head_size=32), "Qwen3ForCausalLM"),
    # a sliding window: Mistral's sliding_window; Qwen2's and Qwen3's use_sliding_window on every layer
    "mistral-window": (dict(LLAMA, attention_window=7, tie_embeddings=False), "MistralForCausalLM"),
    "qwen2-window": (dict(LLAMA, qkv_bias=True, attention_window=9), "Qwen2ForCausalLM"),
    "qwen3-window": (dict(LLAMA, qk_norm=True, attention_window=5), "Qwen3ForCausalLM"),
    # RoPE scaling: YaRN (its attention factor from the factor, or given), position interpolation
    "llama-yarn": (dict(LLAMA, rope_scaling="yarn", rope_factor=4.0, rope_original_max_pos=16), "LlamaForCausalLM"),
    "qwen2-yarn-given": (dict(LLAMA, qkv_bias=True, rope_scaling="yarn", rope_factor=6.0, rope_original_max_pos=8,
                              rope_attention_factor=1.25, rope_beta_fast=8.0, rope_beta_slow=0.5,
                              rope_yarn_truncate=False), "Qwen2ForCausalLM"),
    "llama-linear": (dict(LLAMA, rope_scaling="linear", rope_factor=3.0), "LlamaForCausalLM"),
    # NoPE layers: SmolLM3's no_rope_layers
    "smollm3-nope-2": (dict(LLAMA, nope_interval=2, rope_theta=2e6), "SmolLM3ForCausalLM"),
    "smollm3-nope-1-biases-window": (dict(LLAMA, nope_interval=1, bias=True, attention_window=6, tie_embeddings=False),
                                     "SmolLM3ForCausalLM"),
    # OLMo 2: norms after the attention and the MLP only, applied in float32, q and k normalised over all heads;
    # with a tied head, MHA and llama3 scaling
    "olmo2": (dict(OLMO2, rope_theta=5e5, norm_eps=1e-6), "Olmo2ForCausalLM"),
    "olmo2-mha-tied-llama3": (dict(OLMO2, n_kv_head=4, tie_embeddings=True, rope_scaling="llama3",
                                   rope_original_max_pos=16), "Olmo2ForCausalLM"),
    # OLMo 3: windows in all but every 2nd layer with their own RoPE base, the full layers' scaled; a window in every
    # layer (its RoPE scaled too)
    "olmo3-every-2nd-full": (dict(OLMO2, n_layer=4, attention_window=5, full_attention_interval=2,
                                  rope_local_theta=1e3, rope_scaling="linear", rope_factor=2.0), "Olmo3ForCausalLM"),
    "olmo3-window-everywhere": (dict(OLMO2, attention_window=6, rope_scaling="yarn", rope_factor=4.0,
                                     rope_original_max_pos=16), "Olmo3ForCausalLM"),
    # Gemma 3: windows in all but every 3rd layer, their own RoPE base, the full layers' scaled; a window in every
    # layer; none; query_scale_dim other than the head dim
    "gemma3-every-3rd-full": (dict(GEMMA3, n_layer=3, attention_window=5, full_attention_interval=3,
                                   rope_local_theta=1e3, rope_scaling="linear", rope_factor=2.0), "Gemma3ForCausalLM"),
    "gemma3-window-everywhere-untied": (dict(GEMMA3, attention_window=4, tie_embeddings=False, query_scale_dim=20),
                                        "Gemma3ForCausalLM"),
    "gemma3-no-window-mqa": (dict(GEMMA3, n_kv_head=1, rope_theta=1e6), "Gemma3ForCausalLM"),
}


def random_model(fields: dict, seed: int = 0) -> GPT:
    """GPT(cfg) with every parameter moved off its init (norm weights off 1, biases off 0)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**fields))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.05))
    return model.eval()


@pytest.fixture(scope="module")
def char_spec():
    return hf_models.char_spec(VOCAB)


@pytest.mark.parametrize("name", list(SHAPES))
@torch.no_grad()
def test_transformers_loads_it_with_the_same_logits(name, tmp_path, char_spec):
    fields, architecture = SHAPES[name]
    model = random_model(fields)
    out = export_checkpoint(write_ckpt(tmp_path / "c.pt", model, char_spec), str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == architecture and hf.dtype == torch.float32
    idx = torch.randint(0, VOCAB, (2, model.config.block_size))
    want, got = model(idx)[0], hf(idx).logits
    assert want.abs().max() > 1  # not a degenerate comparison
    assert (got - want).abs().max() <= 1e-4


@pytest.mark.parametrize("name", list(SHAPES))
def test_round_trip_is_bit_identical(name, tmp_path, char_spec):
    fields, _ = SHAPES[name]
    model = random_model(fields)
    out = export_checkpoint(write_ckpt(tmp_path / "c.pt", model, char_spec), str(tmp_path / "hf"))
    back = GPT.from_pretrained(out)
    ours, theirs = model.state_dict(), back.state_dict()
    for key, t in theirs.items():
        if key in ours:
            assert torch.equal(ours[key], t), key
        else:  # GPT-2 without biases comes back with biases: zeros, the same function
            assert not model.config.bias and key.endswith(".bias") and not t.any(), key
    assert set(ours) <= set(theirs)
    c, b = model.config, back.config
    assert (b.n_layer, b.n_head, b.kv_heads, b.head_dim, b.mlp_hidden, b.block_size, b.vocab_size, b.norm_eps,
            b.rope_theta, b.rope_scaling, b.tie_embeddings, b.qk_norm, b.attention_window, b.nope_interval, b.norm,
            b.pre_norm, b.sandwich_norm, b.qk_norm_scope) == \
        (c.n_layer, c.n_head, c.kv_heads, c.head_dim, c.mlp_hidden, c.block_size, c.vocab_size, c.norm_eps,
         c.rope_theta, c.rope_scaling, c.tie_embeddings, c.qk_norm, c.attention_window, c.nope_interval, c.norm,
         c.pre_norm, c.sandwich_norm, c.qk_norm_scope)
    scaling = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_pos"), "linear": ("factor",),
               "yarn": ("factor", "original_max_pos", "beta_fast", "beta_slow", "attention_factor", "yarn_truncate"),
               "": ()}[c.rope_scaling]
    for name in scaling:
        assert getattr(b, f"rope_{name}") == getattr(c, f"rope_{name}"), name


TOKENIZER_TEXTS = ["the king and the queen\n", "Thou art fair!  Spaces,\ttabs and é 日本\n"]


@pytest.mark.parametrize("kind", ["char", "gpt2", "hf"])
def test_auto_tokenizer_gives_the_same_ids(kind, tmp_path):
    if kind == "char":
        tok = CharTokenizer("".join(TOKENIZER_TEXTS))
    elif kind == "gpt2":
        tok = GPT2Tokenizer()
    else:
        tok = HFTokenizer.from_folder(write_tokenizer(tmp_path / "tok", TOKENIZER_TEXTS * 20, bos="<|im_start|>"))
    model = random_model(dict(LLAMA, vocab_size=max(VOCAB, tok.vocab_size)))
    out = export_checkpoint(write_ckpt(tmp_path / "c.pt", model, tok.spec()), str(tmp_path / "hf"))
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for text in TOKENIZER_TEXTS:
        assert theirs(text).input_ids == tok.encode(text)
        plain = tok.encode(text, add_special_tokens=False) if kind == "hf" else tok.encode(text)  # no BOS
        assert theirs.decode(plain) == text
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["eos_token_id"] == tok.eot_token  # char: None; gpt2: 50256; hf: its eos_token
    assert os.path.isfile(os.path.join(out, "generation_config.json")) == bool(tok.stop_tokens)
    if kind == "hf":
        assert theirs.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
            "<|im_start|>user\nhi<|im_end|>\n"


def test_bfloat16_export(tmp_path, char_spec):
    model = random_model(SHAPES["llama-gqa-untied"][0])
    out = export_checkpoint(write_ckpt(tmp_path / "c.pt", model, char_spec), str(tmp_path / "hf"), dtype="bfloat16")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    back = GPT.from_pretrained(out, dtype=torch.bfloat16)
    for key, t in back.state_dict().items():
        assert torch.equal(t, model.state_dict()[key].to(torch.bfloat16)), key


@pytest.mark.parametrize("fields, needle", [
    (dict(LLAMA, norm="layernorm"), "no Hugging Face architecture represents pos_emb='rope' with norm='layernorm'"),
    (dict(LLAMA, pos_emb="learned"), "pos_emb='learned' with norm='rmsnorm' and mlp='swiglu'"),
    (dict(LLAMA, qk_norm=True, qkv_bias=True), "qk_norm (Qwen3) with bias=False, qkv_bias=True"),
    (dict(n_layer=1, n_head=4, n_kv_head=2, n_embd=32), "GPT-2 blocks with n_kv_head=2"),
    (dict(n_layer=1, n_head=4, n_embd=32, head_size=16), "GPT-2 blocks with head_size=16"),
    (dict(n_layer=1, n_head=4, n_embd=32, attention_window=8), "GPT-2 blocks with attention_window=8"),
    (dict(LLAMA, bias=True, attention_window=8), "attention_window=8 with bias=True"),
    (dict(LLAMA, nope_interval=2, qk_norm=True), "nope_interval (SmolLM3) with qk_norm=True"),
    (dict(GEMMA3, sandwich_norm=False), "Gemma 3 blocks need sandwich_norm, embed_scale and qk_norm, without biases "
                                        "or NoPE layers; got sandwich_norm=False"),
    (dict(GEMMA3, bias=True), "got bias=True"),
    (dict(LLAMA, embed_scale=True), "represents embed_scale=True without Gemma 3's blocks"),
    (dict(LLAMA, attention_window=4, full_attention_interval=2), "full_attention_interval=2 without Gemma 3's"),
    (dict(GEMMA3, attention_window=4, rope_scaling="linear"), "rope_scaling='linear' on windowed layers"),
    (dict(OLMO2, qk_norm_scope="head"), "OLMo 2 blocks (norm 'rmsnorm_fp32') need pre_norm false, sandwich_norm and "
                                        "qk_norm over all heads"),
    (dict(OLMO2, bias=True), "got bias=True"),
    (dict(LLAMA, qk_norm=True, qk_norm_scope="all"), "qk_norm_scope='all' without OLMo 2's blocks"),
    (dict(LLAMA, pre_norm=False, sandwich_norm=True), "represents pre_norm=False"),
])
def test_shapes_without_an_architecture_are_refused(fields, needle):
    with pytest.raises(ExportError) as e:
        hf_family(GPTConfig(**fields).validate())
    assert needle in str(e.value) and "\n" not in str(e.value)


def export_cli(*args):
    env = dict(os.environ, PYTHONPATH=pythonpath(ROOT), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "model.export", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)


def test_cli(tmp_path, char_spec):
    """The command exports a run folder's best.pt; refuses a non-empty --out (then replaces it with --force), an
    unexportable shape and a missing checkpoint, each in one line, writing nothing."""
    run = tmp_path / "run"
    run.mkdir()
    best = random_model(SHAPES["qwen2"][0], seed=1)
    write_ckpt(run / "ckpt_0000010.pt", random_model(SHAPES["qwen2"][0], seed=2), char_spec)
    write_ckpt(run / "best.pt", best, char_spec)
    write_ckpt(tmp_path / "odd.pt", random_model(dict(LLAMA, norm="layernorm")), char_spec)
    out = tmp_path / "exported"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    def one_line_error(r):
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        return lines[0]

    assert "--out" in export_cli("--help").stdout
    assert "is not empty: choose a new folder, or pass --force" in one_line_error(
        export_cli("--ckpt", run, "--best", "--out", out))
    assert os.listdir(out) == ["keep.txt"]
    assert "no Hugging Face architecture represents" in one_line_error(
        export_cli("--ckpt", tmp_path / "odd.pt", "--out", tmp_path / "odd"))
    assert "checkpoint not found" in one_line_error(export_cli("--ckpt", tmp_path / "nope", "--out", tmp_path / "x"))
    assert not os.path.exists(tmp_path / "odd") and not os.path.exists(tmp_path / "x")
    r = export_cli("--ckpt", run, "--best", "--out", out, "--force")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(os.listdir(tmp_path)) == sorted(["run", "odd.pt", "exported"])  # no temporary folder left
    back = GPT.from_pretrained(str(out)).state_dict()
    assert all(torch.equal(t, back[k]) for k, t in best.state_dict().items())  # best.pt, not the latest
