"""The Hugging Face folders this project writes: which architecture represents a model, and a folder written whole.

    family = hf_family(cfg)          # "gpt2" | "llama" | ... | "smollm3", or ExportError naming why none
    write_folder(out, {"config.json": json_text(config)}, tensors, force)   # into a temporary folder, then renamed

Used by the model export (model/export.py) and the LoRA adapter export (model/lora_export.py).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

from .config import GPTConfig
from .hf_files import HFError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPORTABLE = ("GPT-2 blocks (pos_emb 'learned', norm 'layernorm', mlp 'gelu': GPT2LMHeadModel) and Llama-family "
              "blocks (pos_emb 'rope', norm 'rmsnorm', mlp 'swiglu': LlamaForCausalLM, MistralForCausalLM with "
              "attention_window, Qwen2ForCausalLM with qkv_bias, Qwen3ForCausalLM with qk_norm, SmolLM3ForCausalLM "
              "with nope_interval), OLMo 2 blocks (pos_emb 'rope', norm 'rmsnorm_fp32', mlp 'swiglu' with pre_norm "
              "false, sandwich_norm and qk_norm over all heads: Olmo2ForCausalLM, Olmo3ForCausalLM with "
              "attention_window) and Gemma 3 blocks (pos_emb 'rope', norm 'rmsnorm1p', mlp 'geglu' with "
              "sandwich_norm, embed_scale and qk_norm: Gemma3ForCausalLM)")


class ExportError(HFError):
    """A checkpoint that cannot be written as a Hugging Face model, or a destination that cannot take it."""


def hf_family(cfg: GPTConfig) -> str:
    """The Hugging Face family whose architecture computes exactly GPT(cfg): "gpt2" | "llama" | "mistral" | "qwen2" |
    "qwen3" | "smollm3" | "olmo2" | "olmo3" | "gemma3".

    GPT-2 blocks without biases export as GPT2LMHeadModel with zero biases (the same function; read back, the
    config says bias = true). Llama-family blocks: biases everywhere → Llama with attention_bias and mlp_bias;
    biases on q, k, v only → Qwen2; qk_norm → Qwen3; none of those and no biases → Llama, or Mistral with a
    sliding window (attention_window; Qwen2 and Qwen3 carry theirs as use_sliding_window on every layer); NoPE
    layers (nope_interval) → SmolLM3. OLMo 2 blocks (norms after the sub-blocks only, q and k normalised over all
    heads, norms applied in float32) → Olmo2ForCausalLM, or with a sliding window Olmo3ForCausalLM (its
    layer_types and per-layer-type RoPE carry the window pattern and rope_local_theta). Gemma 3 blocks (every one of its pieces) →
    Gemma3ForCausalLM, whose layer_types carry any window pattern.
    ExportError names what no architecture represents.
    """
    blocks = (cfg.pos_emb, cfg.norm, cfg.mlp)
    if blocks == ("rope", "rmsnorm_fp32", "swiglu"):
        problems = [f"{k}={getattr(cfg, k)!r}" for k, want in (
            ("pre_norm", False), ("sandwich_norm", True), ("qk_norm", True), ("qk_norm_scope", "all"), ("bias", False),
            ("qkv_bias", False), ("nope_interval", 0), ("embed_scale", False), ("query_scale_dim", 0))
            if getattr(cfg, k) != want]
        if problems:
            raise ExportError("no Hugging Face architecture represents this model: OLMo 2 blocks (norm "
                              "'rmsnorm_fp32') need pre_norm false, sandwich_norm and qk_norm over all heads, "
                              "without biases, NoPE layers or Gemma's scales; got " + ", ".join(problems))
        return "olmo3" if cfg.attention_window else "olmo2"  # OLMo 3: the same blocks with windows
    if not cfg.pre_norm or (cfg.qk_norm and cfg.qk_norm_scope != "head"):
        raise ExportError(f"no Hugging Face architecture represents pre_norm={cfg.pre_norm}, qk_norm_scope="
                          f"{cfg.qk_norm_scope!r} without OLMo 2's blocks (pos_emb 'rope', norm 'rmsnorm_fp32', mlp "
                          "'swiglu')")
    gemma = dict(sandwich_norm=cfg.sandwich_norm, embed_scale=cfg.embed_scale, query_scale_dim=cfg.query_scale_dim,
                 full_attention_interval=cfg.full_attention_interval, rope_local_theta=cfg.rope_local_theta)
    if blocks == ("rope", "rmsnorm1p", "geglu"):
        problems = [f"{k}={v}" for k, v in (("sandwich_norm", cfg.sandwich_norm), ("embed_scale", cfg.embed_scale),
                                            ("qk_norm", cfg.qk_norm)) if not v]
        problems += [f"{k}={getattr(cfg, k)}" for k in ("bias", "qkv_bias", "nope_interval") if getattr(cfg, k)]
        if problems:
            raise ExportError("no Hugging Face architecture represents this model: Gemma 3 blocks need "
                              "sandwich_norm, embed_scale and qk_norm, without biases or NoPE layers; got "
                              + ", ".join(problems))
        if cfg.attention_window and cfg.rope_scaling and not (cfg.full_attention_interval and cfg.rope_local_theta):
            raise ExportError(f"no Hugging Face architecture represents this model: rope_scaling="
                              f"{cfg.rope_scaling!r} on windowed layers (Gemma 3 scales the full-attention layers' "
                              "RoPE only; set rope_local_theta for the windowed ones)")
        return "gemma3"
    others = [f"{k}={v}" for k, v in gemma.items() if v]
    if others:
        raise ExportError(f"no Hugging Face architecture represents {', '.join(others)} without Gemma 3's blocks "
                          "(pos_emb 'rope', norm 'rmsnorm1p', mlp 'geglu')")
    if blocks == ("learned", "layernorm", "gelu"):
        problems = []
        if cfg.attention_window:
            problems.append(f"attention_window={cfg.attention_window} (GPT-2 has no sliding window)")
        if cfg.kv_heads != cfg.n_head:
            problems.append(f"n_kv_head={cfg.n_kv_head} (GPT-2 has no grouped-query attention)")
        if cfg.head_dim * cfg.n_head != cfg.n_embd:
            problems.append(f"head_size={cfg.head_size} (GPT-2's heads are n_embd / n_head wide)")
        if cfg.qk_norm:
            problems.append("qk_norm (GPT-2 has none)")
        if problems:
            raise ExportError("no Hugging Face architecture represents this model: GPT-2 blocks with "
                              + "; ".join(problems))
        return "gpt2"
    if blocks == ("rope", "rmsnorm", "swiglu"):
        if cfg.nope_interval:
            if cfg.qk_norm or (cfg.qkv_bias and not cfg.bias):
                raise ExportError("no Hugging Face architecture represents this model: nope_interval (SmolLM3) with "
                                  f"qk_norm={cfg.qk_norm}, qkv_bias={cfg.qkv_bias} (SmolLM3 has neither)")
            return "smollm3"
        if cfg.qk_norm:
            if cfg.bias or cfg.qkv_bias:
                raise ExportError("no Hugging Face architecture represents this model: qk_norm (Qwen3) with "
                                  f"bias={cfg.bias}, qkv_bias={cfg.qkv_bias} (Qwen3 has no biases on the MLP, "
                                  "nor on q, k, v without the output projection)")
            return "qwen3"
        if cfg.bias:
            if cfg.attention_window:
                raise ExportError(f"no Hugging Face architecture represents this model: attention_window="
                                  f"{cfg.attention_window} with bias=True (Llama, which has biases, has no sliding "
                                  "window; Mistral, which has one, has no biases)")
            return "llama"
        if cfg.qkv_bias:
            return "qwen2"
        return "mistral" if cfg.attention_window else "llama"
    raise ExportError(f"no Hugging Face architecture represents pos_emb={cfg.pos_emb!r} with norm={cfg.norm!r} and "
                      f"mlp={cfg.mlp!r}; exportable are {EXPORTABLE}")


def json_text(obj) -> str:
    return json.dumps(obj, indent=2) + "\n"


def check_destination(out: str, force: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"--out {out} is a file, not a folder")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ExportError(f"--out {out} is not empty: choose a new folder, or pass --force to replace its content")


def write_folder(out: str, files: dict[str, str], tensors: dict, force: bool,
                  weights_file: str = "model.safetensors") -> None:
    """Write the files and the tensors (as weights_file) into a temporary folder beside `out`, then put it in
    `out`'s place."""
    from safetensors.torch import save_file
    check_destination(out, force)
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-export-", dir=parent)
    except OSError as e:
        raise ExportError(f"cannot write into {parent} ({e.strerror or e})") from None
    old = None
    try:
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        save_file(tensors, os.path.join(tmp, weights_file), metadata={"format": "pt"})
        if os.path.isdir(out):
            old = tempfile.mkdtemp(prefix=".tmp-replaced-", dir=parent)
            os.rename(out, os.path.join(old, "previous"))  # out's content stays whole until the new one is in place
        os.rename(tmp, out)
    except OSError as e:
        if old is not None and not os.path.exists(out) and os.path.isdir(os.path.join(old, "previous")):
            os.rename(os.path.join(old, "previous"), out)  # put the previous export back
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"cannot write {out} ({e.strerror or e})") from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
