"""GPT.from_pretrained against transformers, offline: tiny random models of each family, saved with
save_pretrained (safetensors), load with the same logits and the same greedy tokens; bad folders fail with
one line that names the problem."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Olmo2Config,
                          Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM)

from model import GPT  # noqa: E402
from model.hf import HFError  # noqa: E402
from model.generation import generate  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402

transformers.logging.set_verbosity_error()
VOCAB = 128
LLAMA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2,
             vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=None, eos_token_id=None)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
FAMILIES = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=VOCAB,
                                               bos_token_id=None, eos_token_id=None)),
    "llama-gqa-untied": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA)),
    "llama3-scaled-tied": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=True,
                                                               rope_parameters=dict(LLAMA3_ROPE))),
    "llama-biases-mqa": lambda: LlamaForCausalLM(LlamaConfig(**{**LLAMA, "num_key_value_heads": 1},
                                                             attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5)),
    "qwen2-tied": lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA, tie_word_embeddings=True)),
    "qwen2-untied": lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA, tie_word_embeddings=False,
                                                         rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3-head-dim-32": lambda: Qwen3ForCausalLM(Qwen3Config(**LLAMA, head_dim=32)),
    # sliding windows shorter than the 100 tokens compared and than the 9-token prompt plus its 20 new tokens
    "mistral-window-7": lambda: MistralForCausalLM(MistralConfig(**LLAMA, sliding_window=7)),
    "mistral-no-window-tied": lambda: MistralForCausalLM(MistralConfig(**LLAMA, sliding_window=None,
                                                                       tie_word_embeddings=True)),
    "qwen2-window-every-layer": lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA, use_sliding_window=True,
                                                                     sliding_window=11, max_window_layers=0)),
    "qwen3-window-every-layer": lambda: Qwen3ForCausalLM(Qwen3Config(**LLAMA, use_sliding_window=True,
                                                                     sliding_window=5, max_window_layers=0)),
    # Phi-3: q, k, v in one qkv_proj, gate and up in one gate_up_proj; with and without its sliding window
    "phi3-window-9": lambda: Phi3ForCausalLM(Phi3Config(**LLAMA, sliding_window=9, pad_token_id=None)),
    "phi3-mqa-tied": lambda: Phi3ForCausalLM(Phi3Config(**{**LLAMA, "num_key_value_heads": 1}, pad_token_id=None,
                                                         tie_word_embeddings=True)),
    # RoPE scaled for a longer context than the 16 tokens it "trained" on: YaRN (its own attention factor, given,
    # or DeepSeek's mscale ratio) and position interpolation
    "llama-yarn": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16))),
    "qwen3-yarn-given": lambda: Qwen3ForCausalLM(Qwen3Config(**LLAMA, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e5, factor=8.0, original_max_position_embeddings=16, attention_factor=1.3,
        beta_fast=16.0, beta_slow=2.0, truncate=False))),
    "llama-yarn-mscale": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16, mscale=1.0,
        mscale_all_dim=0.5))),
    "qwen2-linear": lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA, rope_parameters=dict(
        rope_type="linear", rope_theta=1e4, factor=2.5))),
    # SmolLM3: the second layer without RoPE (NoPE); its own default rope_theta
    "smollm3-nope-every-2": lambda: SmolLM3ForCausalLM(SmolLM3Config(**LLAMA, no_rope_layer_interval=2,
                                                                                 pad_token_id=None)),
    "smollm3-biases-rope-everywhere": lambda: SmolLM3ForCausalLM(SmolLM3Config(
        **LLAMA, no_rope_layer_interval=4, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        pad_token_id=None)),
    # OLMo 2: norms after the attention and the MLP only, q and k normalised over all heads; GQA untied, and MHA
    # with a tied head and llama3 scaling
    "olmo2-gqa-untied": lambda: Olmo2ForCausalLM(Olmo2Config(**LLAMA, pad_token_id=None)),
    "olmo2-mha-tied-llama3": lambda: Olmo2ForCausalLM(Olmo2Config(
        **{**LLAMA, "num_key_value_heads": 4}, tie_word_embeddings=True, pad_token_id=None,
        rope_parameters=dict(LLAMA3_ROPE))),
    # OLMo 3: OLMo 2's blocks with windows in all layers but every 2nd, whose RoPE (linear-scaled) differs from the
    # windowed layers'; its default pattern (every 4th layer full: here, 2 layers, a window in both)
    "olmo3-window-every-2nd-full": lambda: Olmo3ForCausalLM(Olmo3Config(
        **{**LLAMA, "num_hidden_layers": 4}, sliding_window=5, pad_token_id=None,
        layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters={
            "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e5),
            "sliding_attention": dict(rope_type="default", rope_theta=1e3)})),
    "olmo3-window-every-layer": lambda: Olmo3ForCausalLM(Olmo3Config(**LLAMA, sliding_window=6, pad_token_id=None)),
    # Gemma 3: windows on all layers but every 2nd, whose RoPE (linear-scaled) differs from the windowed layers',
    # query_pre_attn_scalar unlike the head dim; a window on every layer (the pattern beyond the 2 layers), MQA,
    # an untied head; no window at all
    "gemma3-window-every-2nd-full": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **{**LLAMA, "num_hidden_layers": 4}, head_dim=32, sliding_window=5, sliding_window_pattern=2,
        query_pre_attn_scalar=24, pad_token_id=None, rope_parameters={
            "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e5),
            "sliding_attention": dict(rope_type="default", rope_theta=1e3)})),
    "gemma3-window-every-layer-mqa-untied": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **{**LLAMA, "num_key_value_heads": 1}, head_dim=16, sliding_window=6, sliding_window_pattern=3,
        query_pre_attn_scalar=16, tie_word_embeddings=False, pad_token_id=None)),
    "gemma3-no-window": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **LLAMA, head_dim=16, sliding_window_pattern=1, query_pre_attn_scalar=16, pad_token_id=None)),
}


def randomised(hf):
    """Every parameter moved off its init (norm weights off 1, biases off 0), so that a swapped, untransposed or
    unused tensor changes the logits; matrices large enough that greedy choices have clear margins."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.08))
    return hf.eval()


def saved(family: str, folder) -> tuple:
    hf = randomised(FAMILIES[family]())
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, str(folder)


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_same_logits_and_greedy_tokens_as_transformers(family, tmp_path):
    hf, folder = saved(family, tmp_path / family)
    model = GPT.from_pretrained(folder)
    assert not model.training and model.lm_head.weight.dtype == torch.float32
    assert (model.lm_head.weight is model.transformer.wte.weight) == hf.config.tie_word_embeddings
    idx = torch.randint(0, VOCAB, (2, 100))
    want, got = hf(idx).logits, model(idx)[0]
    assert want.abs().max() > 1  # not a degenerate comparison
    assert (got - want).abs().max() <= 1e-4
    prompt = torch.randint(0, VOCAB, (1, 9))
    # the mask given: transformers would otherwise take any token 0 in the prompt for padding (pad_token_id)
    expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False,
                           pad_token_id=0)[0, 9:].tolist()
    for backend in ("naive", "sdpa"):
        model.set_attention_backend(backend)
        ours = generate(model, prompt.tolist(), SamplingParams(temperature=0.0, max_new_tokens=20)).sequences[0]
        assert ours == expected, backend



@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_transformers_to_ours_to_export_to_transformers(family, tmp_path):
    """The whole chain from a transformers model: saved, loaded here, written as a checkpoint, exported
    (python -m model.export's export_checkpoint), loaded by transformers again: the same architecture (a Mistral
    without a window, a SmolLM3 with RoPE in every layer, a Phi-3: a Llama; a Phi-3 with a window: a Mistral)
    and the original model's logits."""
    from model.export import export_checkpoint
    from tests.hf_models import char_spec, write_ckpt

    hf, folder = saved(family, tmp_path / family)
    ckpt = write_ckpt(tmp_path / "ckpt.pt", GPT.from_pretrained(folder), char_spec(VOCAB))
    again = transformers.AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, str(tmp_path / "out"))).eval()
    as_llama = family in ("mistral-no-window-tied", "smollm3-biases-rope-everywhere", "phi3-mqa-tied")
    architecture = {"phi3-window-9": "MistralForCausalLM"}.get(family, "LlamaForCausalLM" if as_llama
                                                                else type(hf).__name__)
    assert type(again).__name__ == architecture
    idx = torch.randint(0, VOCAB, (2, 100))
    want = hf(idx).logits
    assert want.abs().max() > 1 and (again(idx).logits - want).abs().max() <= 1e-4

def test_config_fields_per_family(tmp_path):
    """What each family's config.json becomes (the options that make the logits above agree)."""
    c = GPT.from_pretrained(saved("llama3-scaled-tied", tmp_path / "a")[1]).config
    assert (c.pos_emb, c.norm, c.mlp, c.bias, c.qkv_bias, c.qk_norm, c.tie_embeddings) == \
        ("rope", "rmsnorm", "swiglu", False, False, False, True)
    assert (c.rope_scaling, c.rope_theta, c.rope_factor, c.rope_original_max_pos) == ("llama3", 5e5, 8.0, 16)
    assert (c.n_head, c.kv_heads, c.head_dim, c.intermediate_size, c.block_size, c.norm_eps) == \
        (4, 2, 16, 96, 128, 1e-6)
    c = GPT.from_pretrained(saved("qwen2-untied", tmp_path / "b")[1]).config
    assert (c.qkv_bias, c.bias, c.tie_embeddings, c.rope_theta, c.rope_scaling) == (True, False, False, 1e6, "")
    c = GPT.from_pretrained(saved("qwen3-head-dim-32", tmp_path / "c")[1]).config
    assert (c.qk_norm, c.head_size, c.head_dim, c.attention_window) == (True, 32, 32, 0)
    c = GPT.from_pretrained(saved("mistral-window-7", tmp_path / "d")[1]).config
    assert (c.attention_window, c.bias, c.qkv_bias, c.tie_embeddings) == (7, False, False, False)
    assert GPT.from_pretrained(saved("mistral-no-window-tied", tmp_path / "e")[1]).config.attention_window == 0
    assert GPT.from_pretrained(saved("qwen2-window-every-layer", tmp_path / "f")[1]).config.attention_window == 11
    c = GPT.from_pretrained(saved("smollm3-nope-every-2", tmp_path / "h")[1]).config
    assert (c.nope_interval, c.rope_theta, c.uses_rope(0), c.uses_rope(1)) == (2, 2e6, True, False)
    c = GPT.from_pretrained(saved("smollm3-biases-rope-everywhere", tmp_path / "i")[1]).config
    assert (c.nope_interval, c.bias, c.tie_embeddings) == (0, True, False)  # interval 4 > 2 layers: no NoPE layer
    c = GPT.from_pretrained(saved("qwen3-yarn-given", tmp_path / "j")[1]).config
    assert (c.rope_scaling, c.rope_factor, c.rope_original_max_pos, c.rope_attention_factor, c.rope_beta_fast,
            c.rope_beta_slow, c.rope_yarn_truncate) == ("yarn", 8.0, 16, 1.3, 16.0, 2.0, False)
    c = GPT.from_pretrained(saved("llama-yarn-mscale", tmp_path / "k")[1]).config
    assert abs(c.rope_attention_factor - (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1)) < 1e-12
    folder = saved("mistral-window-7", tmp_path / "g")[1]
    with open(os.path.join(folder, "config.json")) as f:
        cfg = {k: v for k, v in json.load(f).items() if k != "sliding_window"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert GPT.from_pretrained(folder).config.attention_window == 4096  # MistralConfig's default when left out


@pytest.mark.parametrize("family", ["mistral-window-7", "qwen3-window-every-layer", "smollm3-nope-every-2",
                                    "phi3-window-9",
                                    "llama-yarn", "qwen3-yarn-given", "llama-yarn-mscale", "qwen2-linear"])
@torch.no_grad()
def test_windows_nope_layers_and_rope_scaling_are_what_makes_them_agree(family, tmp_path):
    """The same weights without the window, with RoPE in the NoPE layer, or without the RoPE scaling (for YaRN:
    also with its frequencies but without its attention factor) give other logits: the comparisons above see
    them."""
    hf, folder = saved(family, tmp_path / "m")
    idx = torch.randint(0, VOCAB, (1, 100))
    model = GPT.from_pretrained(folder)
    want = hf(idx).logits
    assert (model(idx)[0] - want).abs().max() <= 1e-4
    if model.config.rope_scaling == "yarn":
        model.config.rope_attention_factor = 1.0
        model.rotary.reset()
        assert (model(idx)[0] - want).abs().max() > 1e-2
    model.config.rope_scaling = ""
    model.rotary.reset()
    for block in model.transformer.h:
        block.attn.window, block.attn.use_rope = 0, True
    assert (model(idx)[0] - want).abs().max() > 1e-2


@torch.no_grad()
def test_llama3_rope_scaling_is_what_makes_them_agree(tmp_path):
    """The scaled model's logits differ from the same weights with plain RoPE: the comparison above sees it."""
    hf, folder = saved("llama3-scaled-tied", tmp_path / "m")
    idx = torch.randint(0, VOCAB, (1, 100))
    model = GPT.from_pretrained(folder)
    assert (model(idx)[0] - hf(idx).logits).abs().max() <= 1e-4
    model.config.rope_scaling = ""
    model.rotary.reset()
    assert (model(idx)[0] - hf(idx).logits).abs().max() > 1e-2


@torch.no_grad()
def test_sharded_checkpoint(tmp_path):
    hf = randomised(FAMILIES["llama-gqa-untied"]())
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert "model.safetensors.index.json" in os.listdir(tmp_path) and len(shards) > 2
    idx = torch.randint(0, VOCAB, (2, 33))
    assert (GPT.from_pretrained(str(tmp_path))(idx)[0] - hf(idx).logits).abs().max() <= 1e-4


@torch.no_grad()
def test_dtype_and_device(tmp_path):
    hf, folder = saved("llama3-scaled-tied", tmp_path / "m")
    model = GPT.from_pretrained(folder, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.inv_freq.dtype == torch.float32 and model.rotary.inv_freq.device.type == "cpu"
    idx = torch.randint(0, VOCAB, (1, 40))
    got = model(idx)[0].float()
    want = hf(idx).logits
    assert (got - want).abs().max() < 0.1 * want.abs().max()  # bf16 rounding, not a different model


def test_hub_id_offline_names_the_repo(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HFError) as e:
        GPT.from_pretrained("HuggingFaceTB/SmolLM2-135M")
    msg = str(e.value)
    assert "'HuggingFaceTB/SmolLM2-135M'" in msg and "HF_HUB_OFFLINE" in msg and "config.json" in msg
    assert "\n" not in msg


def test_hub_cache_snapshot_of_a_llama_loads_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants
    repo = tmp_path / "hub" / "models--org--tiny-llama"
    hf, _ = saved("llama-gqa-untied", repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    idx = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        assert (GPT.from_pretrained("org/tiny-llama")(idx)[0] - hf(idx).logits).abs().max() <= 1e-4



def _hub_error(cls):
    """An instance of one of huggingface_hub's HTTP errors without an HTTP response (their constructor wants one)."""
    e = cls.__new__(cls)
    Exception.__init__(e, "404 Client Error")
    return e


@pytest.mark.parametrize("kind,want", [("GatedRepoError", "gated; accept its licence on the hub and set HF_TOKEN"),
                                       ("RepositoryNotFoundError", "no such repo on the hub (or it is private"),
                                       ("RevisionNotFoundError", "no such revision"),
                                       ("OSError", "the download failed")])
def test_hub_download_errors_are_one_line(kind, want, monkeypatch):
    """A repo missing from the local cache with the hub reachable: what the download raises becomes one line that
    says what to do (the hub itself is not contacted: snapshot_download is replaced)."""
    import huggingface_hub
    import huggingface_hub.errors as hub_errors

    from model import hf_files

    def fake_download(repo, allow_patterns=None, local_files_only=False):
        if local_files_only:
            raise hub_errors.LocalEntryNotFoundError("not in the cache")
        raise OSError("disk full") if kind == "OSError" else _hub_error(getattr(hub_errors, kind))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.setattr(hf_files, "_hub_reachable", lambda timeout=5.0: True)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(HFError) as e:
        GPT.from_pretrained("org/some-model")
    msg = str(e.value)
    assert "'org/some-model'" in msg and want in msg and "\n" not in msg, msg


# ------------------------------------------------------------------------------------------------- bad input

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    saved("llama-gqa-untied", folder)
    return folder


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharded")
    randomised(FAMILIES["llama-gqa-untied"]()).save_pretrained(folder, safe_serialization=True,
                                                               max_shard_size="40KB")
    return folder


def edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def edit_tensors(folder, fn):
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def one_line_error(folder) -> str:
    with pytest.raises(HFError) as e:
        GPT.from_pretrained(str(folder))
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


def test_unsupported_architecture_is_named(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "m")
    edit_config(tmp_path / "m", architectures=["GemmaForCausalLM"], model_type="gemma")
    assert "unsupported architecture 'GemmaForCausalLM'" in one_line_error(tmp_path / "m")


@pytest.mark.parametrize("changes, needle", [
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=4.0)), "rope type 'dynamic'"),
    (dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4)), "linear rope scaling without a usable 'factor'"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     "partial_rotary_factor"),
    (dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "sliding-window"),
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True, sliding_window=8,
          max_window_layers=1), "sliding-window attention on 1 of 2 layers"),
    (dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=True, sliding_window=8,
          layer_types=["sliding_attention", "full_attention"]), "sliding-window attention on 1 of 2 layers"),
    (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=0), "sliding_window=0"),
    (dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", no_rope_layers=[0, 1]),
     "no_rope_layers=[0, 1] (only every N-th layer without RoPE"),
    (dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", no_rope_layers=[1]),
     "no_rope_layers must be 2 flags of 0 or 1"),
    (dict(num_hidden_layers="two"), "integer num_hidden_layers"),
])
def test_unsupported_options_are_named(llama_dir, tmp_path, changes, needle):
    shutil.copytree(llama_dir, tmp_path / "m")
    edit_config(tmp_path / "m", **changes)
    assert needle in one_line_error(tmp_path / "m")


@torch.no_grad()
def test_gemma3_hub_config_keys(tmp_path):
    """Gemma 3's config.json as the hub has it (transformers 4.x): rope_theta, rope_local_base_freq and
    rope_scaling instead of per-layer-type rope_parameters, sliding_window_pattern instead of layer_types. The
    same model loads with the same logits; the windowed layers' base and the pattern are read from those keys."""
    hf, folder = saved("gemma3-window-every-2nd-full", tmp_path / "g")
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    for key in ("rope_parameters", "layer_types"):
        del cfg[key]
    cfg.update(rope_theta=1e5, rope_local_base_freq=1e3, rope_scaling=dict(rope_type="linear", factor=2.0),
               sliding_window_pattern=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    model = GPT.from_pretrained(folder)
    c = model.config
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling, c.rope_factor) == (1e5, 1e3, "linear", 2.0)
    assert [model.transformer.h[i].attn.window for i in range(4)] == [5, 0, 5, 0]
    assert [model.transformer.h[i].attn.local_rope for i in range(4)] == [True, False, True, False]
    assert c.query_scale_dim == 24 and c.embed_scale and c.sandwich_norm and c.norm == "rmsnorm1p"
    idx = torch.randint(0, VOCAB, (2, 40))
    assert (model(idx)[0] - hf(idx).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("changes, needle", [
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 (no soft-capping here)"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"]),
     "full attention on layers [0, 3] (only on every N-th layer)"),
    (dict(layer_types=["sliding_attention"] * 3), "layer_types must be 4 of"),
    (dict(sliding_window=None), "sliding_window=None"),
    (dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e5),
                           "sliding_attention": dict(rope_type="linear", rope_theta=1e3, factor=2.0)}),
     "rope scaling 'linear' on the sliding-window layers"),
    (dict(architectures=["Gemma3nForConditionalGeneration"]), "unsupported architecture 'Gemma3nForConditionalGeneration'"),
])
def test_gemma3_options_it_cannot_reproduce_are_named(tmp_path, changes, needle):
    _, folder = saved("gemma3-window-every-2nd-full", tmp_path / "g")
    edit_config(folder, **changes)
    assert needle in one_line_error(folder)


@torch.no_grad()
def test_olmo3_layer_types_and_rope_by_layer_type(tmp_path):
    """OLMo 3's windows and RoPE by layer type as GPTConfig fields; the older rope_theta + rope_scaling keys
    (scaling on the full layers only) load the same way; options it cannot reproduce are named."""
    hf, folder = saved("olmo3-window-every-2nd-full", tmp_path / "o")
    c = GPT.from_pretrained(folder).config
    assert (c.attention_window, c.full_attention_interval, c.rope_local_theta, c.rope_theta, c.rope_scaling,
            c.rope_factor) == (5, 2, 1e3, 1e5, "linear", 2.0)
    assert (c.pre_norm, c.sandwich_norm, c.norm, c.qk_norm_scope) == (False, True, "rmsnorm_fp32", "all")
    edit_config(folder, rope_parameters=None, rope_theta=1e3, rope_scaling=dict(rope_type="linear", factor=2.0))
    c = GPT.from_pretrained(folder).config  # both layer types at base 1e3, the full ones scaled
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e3, 1e3, "linear")
    for changes, needle in [
        (dict(layer_types=["full_attention", "sliding_attention"] * 2), "full attention on layers [0, 2]"),
        (dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e5),
                               "sliding_attention": dict(rope_type="linear", rope_theta=1e3, factor=2.0)}),
         "rope scaling 'linear' on the sliding-window layers"),
        (dict(attention_bias=True), "attention_bias=True with mlp_bias=False")]:
        _, other = saved("olmo3-window-every-2nd-full", tmp_path / needle[:12].replace(" ", "_"))
        edit_config(other, **changes)
        assert needle in one_line_error(other), (changes, one_line_error(other))


def test_wrong_shape_names_tensor_expected_and_got(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "m")
    edit_tensors(tmp_path / "m", lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    msg = one_line_error(tmp_path / "m")
    assert "model.layers.1.self_attn.k_proj.weight" in msg and "(16, 64)" in msg and "expected (32, 64)" in msg


def test_missing_and_unexpected_tensors(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "a")
    edit_tensors(tmp_path / "a", lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    assert one_line_error(tmp_path / "a") == "missing tensors: model.layers.0.mlp.up_proj.weight"
    shutil.copytree(llama_dir, tmp_path / "b")
    edit_tensors(tmp_path / "b", lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    msg = one_line_error(tmp_path / "b")
    assert msg.startswith("unexpected tensors") and "model.layers.0.self_attn.extra.weight" in msg


def test_tied_head_that_differs_from_the_embedding(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "m")
    edit_config(tmp_path / "m", tie_word_embeddings=True)  # the file keeps its own (different) lm_head.weight
    assert "lm_head.weight differs from model.embed_tokens.weight" in one_line_error(tmp_path / "m")


def test_missing_shard_and_index_mismatches(sharded_dir, tmp_path):
    index = "model.safetensors.index.json"
    shutil.copytree(sharded_dir, tmp_path / "a")
    shard = sorted(f for f in os.listdir(tmp_path / "a") if f.endswith(".safetensors"))[-1]
    os.remove(tmp_path / "a" / shard)
    msg = one_line_error(tmp_path / "a")
    assert f"names shard {shard}, which is missing" in msg
    shutil.copytree(sharded_dir, tmp_path / "b")
    with open(tmp_path / "b" / index) as f:
        idx = json.load(f)
    name = sorted(idx["weight_map"])[0]
    other = sorted(s for s in set(idx["weight_map"].values()) if s != idx["weight_map"][name])[0]
    idx["weight_map"][name] = other  # the index places a tensor in a shard that does not hold it
    with open(tmp_path / "b" / index, "w") as f:
        json.dump(idx, f)
    assert f"places tensor {name} in {other}, which does not hold it" in one_line_error(tmp_path / "b")
    for bad in (3, ["x.safetensors"], "../x.safetensors"):  # not a file name: one line, before any sorting
        shutil.copytree(sharded_dir, tmp_path / "c", dirs_exist_ok=True)
        with open(tmp_path / "c" / index) as f:
            idx = json.load(f)
        idx["weight_map"][name] = bad
        with open(tmp_path / "c" / index, "w") as f:
            json.dump(idx, f)
        assert f"names {bad!r}, which is not a .safetensors file of the folder" in one_line_error(tmp_path / "c")


def test_folders_without_usable_weights(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "a")
    os.remove(tmp_path / "a" / "config.json")
    assert "has no config.json" in one_line_error(tmp_path / "a")
    shutil.copytree(llama_dir, tmp_path / "b")
    os.rename(tmp_path / "b" / "model.safetensors", tmp_path / "b" / "pytorch_model.bin")
    assert "only pickled weights" in one_line_error(tmp_path / "b")
    shutil.copytree(llama_dir, tmp_path / "c")
    with open(tmp_path / "c" / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "c" / "model.safetensors") // 2)
    assert one_line_error(tmp_path / "c").startswith("cannot read")
    assert "no such folder" in one_line_error(tmp_path / "nope" / "deeper")
    assert "it is a file" in one_line_error(llama_dir / "config.json")
