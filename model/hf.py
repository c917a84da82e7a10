"""Hugging Face GPT-2 weights → this project's GPT, with the same logits.

    model = from_hf_gpt2(GPT2LMHeadModel_or_its_state_dict)   # any size; tested offline on a random GPT2Config
    model = load_hf_gpt2("gpt2")                              # gpt2, gpt2-medium, gpt2-large, gpt2-xl (the hub)

Hub weights are read from safetensors files only (`hf_pretrained`), never from a pickle.

The two models have the same parameter names (nanoGPT kept GPT-2's). Two differences remain:
* HF's attention and MLP layers are `Conv1D`, which stores its weight as (in, out): the c_attn, c_proj and
  c_fc weights are transposed into nn.Linear's (out, in).
* HF's state dict may hold non-parameter buffers (`attn.bias`, the causal mask, and `attn.masked_bias` in
  older transformers): they are dropped.
The config comes from n_layer, n_head, n_embd, n_positions and vocab_size, with bias=True. A plain state dict
carries no head count: pass n_head=, or it is taken from the standard GPT-2 sizes (n_embd 768, 1024, 1280, 1600).
"""
from __future__ import annotations

import re

import torch

from .checkpoint import CheckpointError
from .config import GPTConfig

HF_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GPT2_HEADS = {768: 12, 1024: 16, 1280: 20, 1600: 25}  # n_embd → n_head of the published GPT-2 sizes
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
DROPPED = (".attn.bias", ".attn.masked_bias")  # buffers (causal mask), not weights


class HFError(CheckpointError):
    """GPT-2 weights that cannot be loaded: transformers missing, hub unreachable, incompatible model."""


def _check_hf_config(cfg) -> None:
    """Refuse the GPT2Config options that this project's GPT does not implement (their logits would differ)."""
    problems = []
    if getattr(cfg, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function={cfg.activation_function!r} (only the tanh GELU, gelu_new)")
    if getattr(cfg, "n_inner", None) not in (None, 4 * cfg.n_embd):
        problems.append(f"n_inner={cfg.n_inner} (the MLP is 4 * n_embd wide)")
    if abs(getattr(cfg, "layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon={cfg.layer_norm_epsilon} (LayerNorm uses 1e-5)")
    if not getattr(cfg, "scale_attn_weights", True) or getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
        problems.append("attention scaling other than 1/sqrt(head_dim)")
    if not getattr(cfg, "tie_word_embeddings", True):
        problems.append("untied lm_head (this GPT ties it to wte)")
    if problems:
        raise HFError("incompatible GPT-2 config: " + "; ".join(problems))


def _config_from_state_dict(sd: dict, n_head: int | None) -> GPTConfig:
    """n_layer, n_embd, vocab and context from the tensor shapes; n_head given or from the standard sizes."""
    vocab, n_embd = sd["transformer.wte.weight"].shape
    n_positions = sd["transformer.wpe.weight"].shape[0]
    layers = {int(m.group(1)) for k in sd if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    if n_head is None:
        if n_embd not in GPT2_HEADS:
            raise HFError(f"cannot tell n_head from a state dict with n_embd={n_embd}: pass n_head=")
        n_head = GPT2_HEADS[n_embd]
    return GPTConfig(block_size=n_positions, vocab_size=vocab, n_layer=len(layers), n_head=n_head,
                     n_embd=n_embd, dropout=0.0, bias=True)


def from_hf_gpt2(model_or_state_dict, *, n_head: int | None = None):
    """A transformers GPT2LMHeadModel (or GPT2Model, or either's state dict) → GPT in float32, eval mode."""
    from .gpt import GPT
    src = model_or_state_dict
    if hasattr(src, "state_dict") and hasattr(src, "config"):  # a transformers model
        hf = src.config
        _check_hf_config(hf)
        sd = src.state_dict()
        cfg = GPTConfig(block_size=hf.n_positions, vocab_size=hf.vocab_size, n_layer=hf.n_layer,
                        n_head=hf.n_head, n_embd=hf.n_embd, dropout=0.0, bias=True)
    elif isinstance(src, dict):
        sd, cfg = src, None
    else:
        raise HFError(f"expected a GPT2LMHeadModel or its state dict, got {type(src).__name__}")
    # GPT2Model's keys have no "transformer." prefix; GPT2LMHeadModel's do (and add lm_head.weight, tied to wte).
    sd = {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.endswith(DROPPED)}
    if "transformer.wte.weight" not in sd:
        raise HFError("not a GPT-2 state dict: no transformer.wte.weight")
    cfg = cfg or _config_from_state_dict(sd, n_head)
    cfg.validate()

    ours = {}
    for k, v in sd.items():
        if k == "lm_head.weight":
            continue  # tied to transformer.wte.weight
        ours[k] = v.t() if k.endswith(CONV1D) else v  # Conv1D (in, out) → Linear (out, in)
    ours["lm_head.weight"] = ours["transformer.wte.weight"]
    with torch.device("meta"):  # no time spent on a random init of weights that are replaced anyway
        model = GPT(cfg)
    try:
        model.load_state_dict({k: v.detach().float().contiguous() for k, v in ours.items()}, assign=True)
    except RuntimeError as e:
        raise HFError(f"incompatible GPT-2 weights: {' '.join(str(e).split())[:300]}") from None
    model.lm_head.weight = model.transformer.wte.weight  # assign=True replaced both: tie them again
    return model.eval()


def _hub_reachable(timeout: float = 5.0) -> bool:
    """A TCP connection to the hub's host within `timeout` seconds (instead of the hub client's long retries)."""
    import os
    import socket
    from urllib.parse import urlparse
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def hf_pretrained(name_or_folder: str, **kwargs):
    """GPT2LMHeadModel.from_pretrained reading safetensors files only: a pickled pytorch_model.bin is never
    opened (a name or folder without model.safetensors raises OSError)."""
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel.from_pretrained(name_or_folder, use_safetensors=True, **kwargs)


def load_hf_gpt2(name: str):
    """One of the GPT-2 sizes from the local hub cache, else downloaded → GPT. One-line HFError on failure.

    Weights are read from safetensors files only. With HF_HUB_OFFLINE=1 (or an unreachable hub) and nothing
    cached, it fails at once, without retries.
    """
    import os
    if name not in HF_NAMES:
        raise HFError(f"unknown GPT-2 model {name!r}; choose one of {', '.join(HF_NAMES)}")
    try:
        from huggingface_hub.utils import logging as hub_logging
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise HFError(f"--init-from {name} needs the transformers package: pip install transformers") from None
    hf_logging.set_verbosity_error()
    hub_logging.set_verbosity_error()  # no "Retrying in 1s" lines
    try:
        cached = hf_pretrained(name, local_files_only=True)
    except OSError:
        cached = None  # not in the local cache (or only as a pickle, which is not read)
    except Exception as e:
        raise HFError(f"cannot load GPT-2 weights {name!r} from the local Hugging Face cache "
                      f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    if cached is not None:
        return from_hf_gpt2(cached)
    offline = any(os.environ.get(k, "") not in ("", "0", "false", "False")
                  for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if offline:
        raise HFError(f"cannot load GPT-2 weights {name!r}: HF_HUB_OFFLINE is set and they are not in the "
                      "local Hugging Face cache")
    if not _hub_reachable():
        raise HFError(f"cannot load GPT-2 weights {name!r}: the Hugging Face hub is unreachable and they are not "
                      "in the local cache")
    try:
        hf = hf_pretrained(name)
    except Exception as e:  # connection errors mid-download, corrupt files
        raise HFError(f"cannot load GPT-2 weights {name!r}: the download failed "
                      f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    return from_hf_gpt2(hf)
