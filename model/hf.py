"""Hugging Face weights → this project's GPT, with the same logits, without transformers at run time.

    model = from_pretrained("HuggingFaceTB/SmolLM2-135M")   # a hub id (local cache first) or a local folder
    model = from_pretrained("path/to/folder", dtype=torch.bfloat16, device="cuda")
    model = load_hf_gpt2("gpt2")                            # gpt2, gpt2-medium, gpt2-large, gpt2-xl
    model = from_hf_gpt2(GPT2LMHeadModel_or_its_state_dict) # an in-memory transformers GPT-2 (tests, notebooks)

A model folder holds config.json and model.safetensors (or model.safetensors.index.json and its shards); a PEFT
LoRA adapter (adapter_config.json + adapter_model.safetensors) loads as its base model with the updates merged.
Supported: GPT-2, Llama (SmolLM2, Llama-3.x with its rope scaling), Mistral, Phi-3, Qwen2/2.5, Qwen3, SmolLM3,
OLMo 2, OLMo 3, Gemma 3 (text) — see model/hf_config.py for what maps to which GPTConfig field and model/hf_weights.py for the
tensor names.
Everything that cannot be loaded is an HFError with one line.
"""
from __future__ import annotations

import re

import torch

from .config import GPTConfig
from .hf_config import gpt_config_from_hf
from .hf_adapter import ModelFiles, read_merged_tensors, resolve_model_files
from .hf_files import HFError, read_config
from .hf_weights import state_dict_from_hf

__all__ = ["HFError", "from_pretrained", "from_hf_gpt2", "load_hf_gpt2", "read_weights", "HF_NAMES"]

HF_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GPT2_HEADS = {768: 12, 1024: 16, 1280: 20, 1600: 25}  # n_embd → n_head of the published GPT-2 sizes


def from_pretrained(path_or_repo: str, *, dtype: torch.dtype | None = None, device=None, label: str | None = None):
    """A Hugging Face model folder or hub id → GPT in eval mode (dtype default float32, device default cpu). A PEFT
    LoRA adapter's folder or id gives its base model with the updates merged (model/hf_adapter.py)."""
    cfg, state = read_weights(resolve_model_files(path_or_repo, label), dtype=dtype or torch.float32, device=device)
    return build(cfg, state, device)


def read_weights(files: ModelFiles, label: str | None = None, dtype: torch.dtype = torch.float32,
                 device=None) -> tuple[GPTConfig, dict]:
    """(GPTConfig, our state dict in dtype on device) of a model that resolve_model_files found, an adapter's
    updates merged. An HFError is one line; with a label it starts "cannot load LABEL: "."""
    try:
        family, cfg = gpt_config_from_hf(read_config(files.folder))
        state = state_dict_from_hf(family, cfg, read_merged_tensors(files, family), dtype=dtype, device=device)
    except HFError as e:
        if label is None:
            raise
        raise HFError(f"cannot load {label}: {e}") from None
    return cfg, state


def build(cfg: GPTConfig, state: dict, device=None):
    """GPT(cfg) holding exactly `state` (our names), without spending time on a random init."""
    from .gpt import GPT
    with torch.device("meta"):
        model = GPT(cfg)
    if cfg.tie_embeddings:
        state = {**state, "lm_head.weight": state["transformer.wte.weight"]}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise HFError(f"incompatible weights: {' '.join(str(e).split())[:300]}") from None
    if cfg.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight  # assign=True gave each its own Parameter: tie them again
    for rotary in (model.rotary, model.rotary_local):
        if rotary is not None:
            rotary.reset(device if device is not None else "cpu")
    return model.eval()


# --- GPT-2 from an in-memory transformers model or state dict, and by its hub name ---

def _gpt2_config_from_state_dict(sd: dict, n_head: int | None) -> GPTConfig:
    """n_layer, n_embd, vocab and context from the tensor shapes; n_head given or from the standard sizes."""
    vocab, n_embd = sd["transformer.wte.weight"].shape
    n_positions = sd["transformer.wpe.weight"].shape[0] if "transformer.wpe.weight" in sd else 1024
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    if n_head is None:
        if n_embd not in GPT2_HEADS:
            raise HFError(f"cannot tell n_head from a state dict with n_embd={n_embd}: pass n_head=")
        n_head = GPT2_HEADS[n_embd]
    fc = sd.get("transformer.h.0.mlp.c_fc.weight")
    inner = fc.shape[1] if fc is not None and fc.dim() == 2 and fc.shape[1] != 4 * n_embd else 0
    return GPTConfig(block_size=n_positions, vocab_size=vocab, n_layer=len(layers), n_head=n_head,
                     n_embd=n_embd, dropout=0.0, bias=True, intermediate_size=inner)


def from_hf_gpt2(model_or_state_dict, *, n_head: int | None = None):
    """A transformers GPT2LMHeadModel (or GPT2Model, or either's state dict) → GPT in float32, eval mode."""
    src = model_or_state_dict
    if hasattr(src, "state_dict") and hasattr(src, "config"):  # a transformers model
        family, cfg = gpt_config_from_hf(src.config.to_dict())
        if family != "gpt2":
            raise HFError(f"expected a GPT-2 model, got a {family} one (use from_pretrained on its folder)")
        sd = src.state_dict()
    elif isinstance(src, dict):
        sd, cfg = src, None
    else:
        raise HFError(f"expected a GPT2LMHeadModel or its state dict, got {type(src).__name__}")
    # GPT2Model's keys have no "transformer." prefix; GPT2LMHeadModel's do (and add lm_head.weight, tied to wte).
    sd = {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v for k, v in sd.items()}
    if "transformer.wte.weight" not in sd:
        raise HFError("not a GPT-2 state dict: no transformer.wte.weight")
    cfg = cfg or _gpt2_config_from_state_dict(sd, n_head)
    sd = {k: v.detach() for k, v in sd.items()}
    return build(cfg, state_dict_from_hf("gpt2", cfg, sd))


def load_hf_gpt2(name: str):
    """One of the GPT-2 sizes from the local hub cache, else downloaded → GPT in float32. One-line HFError on
    failure; with HF_HUB_OFFLINE=1 (or an unreachable hub) and nothing cached it fails at once, without retries."""
    if name not in HF_NAMES:
        raise HFError(f"unknown GPT-2 model {name!r}; choose one of {', '.join(HF_NAMES)}")
    return from_pretrained(name, label=f"GPT-2 weights {name!r}")
