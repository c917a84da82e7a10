"""Gemma 3's image-text checkpoints (Gemma3ForConditionalGeneration: the 4B, 12B and 27B models) load their text
model, offline: a tiny random one built by transformers and saved with save_pretrained gives, on text, the same
logits and greedy tokens as transformers' own model; the weight layout later transformers versions save loads the
same; a config laid out like the hub's (text_config with only the keys that differ) maps to the text class's
defaults; the text model exports as a Gemma3ForCausalLM with the same logits."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Gemma3Config, Gemma3ForConditionalGeneration  # noqa: E402

from model import GPT  # noqa: E402
from model.generation import generate  # noqa: E402
from model.hf import HFError  # noqa: E402
from model.hf_config import gpt_config_from_hf  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402

transformers.logging.set_verbosity_error()
VOCAB = 128
# four layers, a window of 5 on all but every 2nd, query_pre_attn_scalar unlike the head dim, linear-scaled RoPE
# on the full layers
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=VOCAB, max_position_embeddings=128, sliding_window=5, sliding_window_pattern=2,
            query_pre_attn_scalar=24, pad_token_id=None, bos_token_id=None, eos_token_id=None,
            rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e5),
                             "sliding_attention": dict(rope_type="default", rope_theta=1e3)})
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers' model, its folder): every parameter moved off its init, so a swapped or unused tensor
    changes the logits."""
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
                                                     image_token_index=VOCAB - 1))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.08))
    folder = tmp_path_factory.mktemp("gemma3_mm")
    hf.eval().save_pretrained(folder, safe_serialization=True)
    return hf, str(folder)


@torch.no_grad()
def test_text_model_has_the_same_logits_and_greedy_tokens(saved):
    hf, folder = saved
    names = load_file(f"{folder}/model.safetensors")
    assert any(n.startswith("vision_tower.") for n in names) and any(n.startswith("language_model.") for n in names)
    model = GPT.from_pretrained(folder)
    c = model.config
    assert (c.n_layer, c.n_head, c.n_kv_head, c.attention_window, c.full_attention_interval) == (4, 4, 2, 5, 2)
    assert (c.rope_scaling, c.rope_factor, c.rope_local_theta, c.query_scale_dim) == ("linear", 2.0, 1e3, 24)
    idx = torch.randint(0, VOCAB - 1, (2, 60))  # text only (the last id is the image token)
    want, got = hf(input_ids=idx).logits, model(idx)[0]
    assert want.abs().max() > 1
    assert (got - want).abs().max() <= 1e-4
    prompt = torch.randint(0, VOCAB - 1, (1, 9))
    expected = hf.generate(input_ids=prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 9:].tolist()
    for backend in ("naive", "sdpa"):
        model.set_attention_backend(backend)
        ours = generate(model, prompt.tolist(), SamplingParams(temperature=0.0, max_new_tokens=20)).sequences[0]
        assert ours == expected, backend


@torch.no_grad()
def test_the_later_weight_layout_loads_the_same(saved, tmp_path):
    """model.language_model.* and model.vision_tower.*, the head saved (tied): the same parameters."""
    hf, folder = saved
    names = load_file(f"{folder}/model.safetensors")
    later = {}
    for name, t in names.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model."):]
        elif name.startswith(("vision_tower.", "multi_modal_projector.")):
            name = "model." + name
        later[name] = t
    later["lm_head.weight"] = names["language_model.model.embed_tokens.weight"].clone()
    save_file(later, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(f"{folder}/config.json").read())
    a, b = GPT.from_pretrained(folder).state_dict(), GPT.from_pretrained(str(tmp_path)).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_hub_style_config_takes_the_text_class_defaults():
    """The layout of the hub's Gemma 3 4B config.json: text_config names only what differs from
    Gemma3TextConfig (heads, vocabulary and head dim come from its defaults)."""
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}
    family, c = gpt_config_from_hf(hub)
    want = dict(n_embd=2560, intermediate_size=10240, n_layer=34, n_head=8, n_kv_head=4, head_size=256,
                vocab_size=262208, attention_window=1024, full_attention_interval=6, rope_scaling="linear",
                rope_factor=8.0, rope_theta=1e6, rope_local_theta=1e4, tie_embeddings=True, query_scale_dim=0)
    assert family == "gemma3"
    assert {k: getattr(c, k) for k in want} == want
    _, no_arch = gpt_config_from_hf({k: v for k, v in hub.items() if k != "architectures"})  # by model_type
    assert no_arch == c


@pytest.mark.parametrize("config, message", [
    (dict(architectures=["Gemma3ForConditionalGeneration"]), "has no text_config object"),
    (dict(model_type="gemma3", text_config="big"), "has no text_config object"),
])
def test_a_multimodal_config_without_its_text_config_is_refused(config, message, tmp_path):
    with pytest.raises(HFError, match=message):
        gpt_config_from_hf(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFError) as e:
        GPT.from_pretrained(str(tmp_path))
    assert message in str(e.value) and "\n" not in str(e.value)


@torch.no_grad()
def test_the_text_model_exports_as_gemma3_for_causal_lm(saved, tmp_path):
    from model.export import export_checkpoint
    from tests.hf_models import char_spec, write_ckpt
    hf, folder = saved
    ckpt = write_ckpt(tmp_path / "ckpt.pt", GPT.from_pretrained(folder), char_spec(VOCAB))
    out = export_checkpoint(ckpt, str(tmp_path / "out"))
    assert json.loads(open(f"{out}/config.json").read())["architectures"] == ["Gemma3ForCausalLM"]
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    idx = torch.randint(0, VOCAB - 1, (2, 50))
    assert (again(idx).logits - hf(input_ids=idx).logits).abs().max() <= 1e-4


@torch.no_grad()
def test_a_peft_adapter_of_the_image_text_model_merges_into_the_text_model(saved, tmp_path):
    """LoRA on q_proj and v_proj (the vision tower's attention has them too) and down_proj: the text model's
    updates merge, the tower's go with it; the same text logits as PEFT's model."""
    peft = pytest.importorskip("peft")
    _, folder = saved
    base = Gemma3ForConditionalGeneration.from_pretrained(folder).eval()  # a copy: PEFT wraps it in place
    idx = torch.randint(0, VOCAB - 1, (2, 40))
    before = base(input_ids=idx).logits.clone()
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False, task_type="CAUSAL_LM")
    tuned = peft.get_peft_model(base, config).eval()
    tuned.save_pretrained(tmp_path / "adapter")
    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert any("vision" in k for k in keys) and any("language_model" in k for k in keys)
    want = tuned(input_ids=idx).logits
    assert (want - before).abs().max() > 1e-2  # the updates change the text model
    got = GPT.from_pretrained(str(tmp_path / "adapter"))(idx)[0]
    assert (got - want).abs().max() <= 1e-4
