"""PEFT LoRA adapters in (model/hf_adapter.py): an adapter folder made by PEFT itself, with random updates on a
tiny random model of each family saved by transformers, loads as its base model with the updates merged: the
same logits as PEFT's model (fp32, <= 1e-4), through GPT.from_pretrained, train.init_from and generate.py. What
is not merged is refused in one line each."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")  # a dev dependency, as transformers is

from model import GPT  # noqa: E402
from model.hf_files import HFError  # noqa: E402
from tests.hf_models import randomised, tiny_llama, write_tokenizer  # noqa: E402
from tests.util import run_entry, write_corpus  # noqa: E402

transformers.logging.set_verbosity_error()
VOCAB = 320
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "mistral": ["k_proj", "o_proj", "up_proj"], "qwen2": ["q_proj", "v_proj", "down_proj"],
           "phi3": ["qkv_proj", "gate_up_proj"], "gemma3": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
           "olmo2": ["q_proj", "k_proj", "up_proj", "down_proj"],
           "gpt2": ["c_attn", "c_proj", "c_fc"]}


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    corpus = write_corpus(tmp / "corpus", n_lines=200)
    with open(corpus) as f:
        return write_tokenizer(tmp / "tok", f.read().splitlines())


def base_model(folder, family: str, tokenizer_folder: str):
    """A random model of `family` saved in `folder` (with the tokenizer files), loaded back from there."""
    os.makedirs(folder, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_folder, name), folder)
    hf = randomised(tiny_llama(folder, VOCAB, family))
    hf.save_pretrained(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def make_adapter(base, out, family: str, seed: int = 0, **lora):
    """A PEFT LoRA of `base` with random A and B (init_lora_weights=False), saved in `out`; the PEFT model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=lora.pop("r", 4), lora_alpha=lora.pop("lora_alpha", 8),
                             target_modules=lora.pop("target_modules", TARGETS[family]), init_lora_weights=False,
                             fan_in_fan_out=family == "gpt2", task_type="CAUSAL_LM", **lora)
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(out)
    return model


def logits_close(ours, theirs, idx, tol=1e-4):
    with torch.no_grad():
        want = theirs(idx).logits
        got = ours(idx)[0]
    assert (got - want).abs().max() <= tol, (got - want).abs().max()


@pytest.mark.parametrize("family, lora", [("llama", {}), ("qwen2", {"use_rslora": True}), ("mistral", {}),
                                          ("phi3", {}), ("gemma3", {}), ("olmo2", {}), ("gpt2", {}),
                                          ("llama", {"rank_pattern": {"q_proj": 2}})],
                         ids=["llama", "qwen2-rslora", "mistral-window", "phi3-fused", "gemma3", "olmo2", "gpt2",
                              "llama-rank-pattern"])
def test_adapter_loads_as_its_merged_base(family, lora, tokenizer_folder, tmp_path):
    base = base_model(tmp_path / "base", family, tokenizer_folder)
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = base(idx).logits.clone()
    peft_model = make_adapter(base, tmp_path / "adapter", family, **lora)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    with torch.no_grad():
        assert (peft_model(idx).logits - before).abs().max() > 1e-2  # the updates change the model
    ours = GPT.from_pretrained(str(tmp_path / "adapter"))
    logits_close(ours, peft_model, idx)


def test_adapter_starts_a_run_and_generates(tokenizer_folder, tmp_path):
    """train.init_from and generate.py --init-from take the adapter as a model: its merged weights, the base's
    tokenizer (the adapter ships none)."""
    from training.pretrained import load_pretrained
    base = base_model(tmp_path / "base", "llama", tokenizer_folder)
    make_adapter(base, tmp_path / "adapter", "llama")
    pre = load_pretrained(f"hf:{tmp_path / 'adapter'}")
    merged = GPT.from_pretrained(str(tmp_path / "adapter")).state_dict()
    assert set(pre.state) == set(merged) and all(torch.equal(pre.state[k], merged[k]) for k in merged)
    assert pre.tokenizer.vocab_size == 300
    r = run_entry("generate.py", "--init-from", f"hf:{tmp_path / 'adapter'}", "--prompt", "the king",
                  "--max-new-tokens", "4", "--device", "cpu", "--temperature", "0")
    assert r.returncode == 0 and r.stdout.startswith("the king"), r.stderr


# ------------------------------------------------------------------------------------------------- bad input

def adapter_with(tmp_path, tokenizer_folder, edit_config=None, edit_tensors=None) -> str:
    base = base_model(tmp_path / "base", "llama", tokenizer_folder)
    make_adapter(base, tmp_path / "adapter", "llama")
    path = tmp_path / "adapter" / "adapter_config.json"
    if edit_config:
        config = json.loads(path.read_text())
        edit_config(config)
        path.write_text(json.dumps(config))
    if edit_tensors:
        from safetensors.torch import load_file, save_file
        weights = str(tmp_path / "adapter" / "adapter_model.safetensors")
        tensors = load_file(weights)
        edit_tensors(tensors)
        save_file(tensors, weights)
    return str(tmp_path / "adapter")


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize("config_edit, tensors_edit, message", [
    (lambda c: c.update(use_dora=True), None, "DoRA (use_dora) is not supported"),
    (lambda c: c.update(peft_type="IA3"), None, "adapter type 'IA3' (LoRA adapters only) is not supported"),
    (lambda c: c.update(modules_to_save=["lm_head"]), None, "modules_to_save ['lm_head'] is not supported"),
    (lambda c: c.update(bias="all"), None, "trained biases (bias='all') is not supported"),
    (lambda c: c.update(alpha_pattern={"q_proj": 4}), None, "alpha_pattern is not supported"),
    (lambda c: c.update(base_model_name_or_path="/nowhere/base"), None, "base model '/nowhere/base'"),
    (lambda c: c.pop("base_model_name_or_path"), None, "names no base_model_name_or_path"),
    (None, lambda t: t.pop(Q_B), "the update of model.layers.0.self_attn.q_proj has no lora_B"),
    (None, lambda t: t.update({Q_B: torch.zeros(7, 4)}), "the update of model.layers.0.self_attn.q_proj is (7, 64)"),
    (None, lambda t: t.update({Q_A: torch.zeros(3, 64)}), "whose ranks differ"),
    (None, lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, VOCAB)}),
     "is not a LoRA update of a linear layer"),
    (None, lambda t: t.update({"base_model.model.model.layers.0.mlp.w9.lora_A.weight": torch.zeros(4, 64),
                               "base_model.model.model.layers.0.mlp.w9.lora_B.weight": torch.zeros(64, 4)}),
     "it updates model.layers.0.mlp.w9, which the base model does not have"),
])
def test_adapters_that_cannot_be_merged_are_one_line(config_edit, tensors_edit, message, tokenizer_folder, tmp_path):
    folder = adapter_with(tmp_path, tokenizer_folder, config_edit, tensors_edit)
    with pytest.raises(HFError) as e:
        GPT.from_pretrained(folder)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    r = run_entry("generate.py", "--init-from", f"hf:{folder}", "--prompt", "a", "--device", "cpu")
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and message in lines[0], r.stderr
