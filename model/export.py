"""A checkpoint of this project → a Hugging Face model folder that transformers (and vLLM, lm-eval, ...) loads.

    python -m model.export --ckpt runs/llama_demo --out exported/llama_demo [--best] [--dtype bfloat16] [--force]
    python -m model.export --ckpt runs/lora_run --adapter --out exported/lora_adapter   # a PEFT adapter instead
                                                                                       # (model/lora_export.py)

writes into DIR:
    config.json             architectures + model_type and the shape (see hf_family for which architecture)
    model.safetensors       the weights under the architecture's names (model/hf_weights.py's rules read
                            backwards: c_attn split into q/k/v, c_fc into gate/up, GPT-2's Conv1D transposed,
                            a tied LM head left to the embedding)
    generation_config.json  bos/eos token ids (when the tokenizer has an end-of-text token; eos_token_id is a list
                            when generation stops at more than one, as the model's own generation_config.json had)
    tokenizer files         tokenizer.json + tokenizer_config.json (data/tokenizer_export.py; GPT-2 adds
                            vocab.json and merges.txt; the character tokenizer becomes a WordLevel tokenizer.json)

so that `transformers.AutoModelForCausalLM.from_pretrained(DIR)` gives this model's logits and
`GPT.from_pretrained(DIR)` gives back exactly these weights. max_position_embeddings (n_positions) is the
checkpoint's block_size. A LoRA run exports its merged model (model/lora.py). The folder is written whole or
not at all (model/hf_folder.py): into a temporary folder beside DIR, then renamed; a DIR that exists and is not
empty is refused unless --force (then it is replaced). Every failure is one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from .config import ConfigError, GPTConfig
from .hf_folder import DTYPES, ExportError, check_destination, hf_family, json_text, write_folder
from .hf_weights import tensor_rules

ARCHITECTURE = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
MODEL_TYPE = {"gemma3": "gemma3_text"}  # where config.json's model_type is not the family's name


def hf_config(family: str, cfg: GPTConfig, dtype: torch.dtype, bos: int | None, eos: int | None) -> dict:
    """config.json of `family` for GPT(cfg), with transformers' key names (the legacy rope_theta and
    rope_scaling keys, which transformers 4.x and 5.x and vLLM all read)."""
    common = {"architectures": [ARCHITECTURE[family]], "model_type": MODEL_TYPE.get(family, family),
              "vocab_size": cfg.vocab_size,
              "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": bos, "eos_token_id": eos,
              "pad_token_id": None,  # not a class default that may lie outside this vocabulary (SmolLM3's)
              "torch_dtype": str(dtype).removeprefix("torch.")}
    if family == "gpt2":
        return {**common, "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd,
                "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                "n_inner": None if cfg.mlp_hidden == 4 * cfg.n_embd else cfg.mlp_hidden,
                "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "scale_attn_weights": True}
    out = {**common, "hidden_size": cfg.n_embd, "intermediate_size": cfg.mlp_hidden,
           "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
           "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
           "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
           "rope_scaling": None, "attention_dropout": cfg.dropout}
    if cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_factor,
                               "low_freq_factor": cfg.rope_low_freq_factor,
                               "high_freq_factor": cfg.rope_high_freq_factor,
                               "original_max_position_embeddings": cfg.rope_original_max_pos}
    elif cfg.rope_scaling == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_factor}
    elif cfg.rope_scaling == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rope_factor,
                               "original_max_position_embeddings": cfg.rope_original_max_pos,
                               "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
                               "attention_factor": cfg.rope_attention_factor or None,
                               "truncate": cfg.rope_yarn_truncate}
    window = cfg.attention_window or None
    if family == "gemma3":  # the window's layers written out; the windowed layers' own RoPE base
        del out["hidden_act"]
        local = cfg.rope_local_theta if cfg.full_attention_interval and cfg.rope_local_theta else None
        if window and not cfg.full_attention_interval:
            local = cfg.rope_theta  # every layer windowed: their RoPE is the model's (unscaled: checked below)
        out.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False, query_pre_attn_scalar=(
            cfg.query_scale_dim or cfg.head_dim), sliding_window=window or cfg.block_size,
            layer_types=["sliding_attention" if cfg.layer_window(i) else "full_attention" for i in range(cfg.n_layer)],
            rope_local_base_freq=local if local is not None else cfg.rope_theta,
            final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False)
        return out
    if family == "olmo3":  # the window's layers written out; each layer type's RoPE (its rope_parameters)
        full = {**(out.pop("rope_scaling") or {"rope_type": "default"}), "rope_theta": out.pop("rope_theta")}
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta} if cfg.rope_local_theta else full
        out.update(attention_bias=False, sliding_window=window,
                   layer_types=["sliding_attention" if cfg.layer_window(i) else "full_attention"
                                for i in range(cfg.n_layer)],
                   rope_parameters={"full_attention": full, "sliding_attention": dict(local)})
        return out
    if family in ("llama", "olmo2"):  # (OLMo 2: no biases, hf_family checked)
        out.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)
    elif family == "mistral":
        out["sliding_window"] = window
    elif family == "smollm3":  # the window, if any, on every layer: layer_types written out
        out.update(attention_bias=cfg.bias, mlp_bias=cfg.bias, no_rope_layer_interval=cfg.nope_interval,
                   no_rope_layers=[int(cfg.uses_rope(i)) for i in range(cfg.n_layer)],
                   use_sliding_window=window is not None, sliding_window=window,
                   layer_types=[("sliding_attention" if window else "full_attention")] * cfg.n_layer)
    else:  # qwen2, qwen3: a window on every layer (max_window_layers 0) or none
        out.update(use_sliding_window=window is not None, sliding_window=window,
                   max_window_layers=0 if window else cfg.n_layer)
        if family == "qwen3":
            out["attention_bias"] = False
    return out


def hf_tensors(family: str, cfg: GPTConfig, state: dict, dtype: torch.dtype) -> dict:
    """Our state dict → {HF name: tensor} in `dtype`, each tensor its own contiguous memory (safetensors stores
    no shared storage). GPT-2 biases the model does not have are written as zeros."""
    rule_cfg = dataclasses.replace(cfg, bias=True) if family == "gpt2" else cfg
    rules = tensor_rules(family, rule_cfg)
    used = {rule.ours for rule in rules}
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # the embedding itself
    unexpected = sorted(set(state) - used)
    if unexpected:
        raise ExportError(f"the checkpoint holds weights a {family} model does not have: {', '.join(unexpected[:4])}")
    out = {}
    for rule in rules:
        sizes = [shape[0] for _, shape in rule.parts]
        whole_shape = (sum(sizes), *rule.parts[0][1][1:])
        if rule.ours in state:
            t = state[rule.ours].detach()
            t = t.t() if rule.transpose else t
        elif family == "gpt2" and rule.ours.endswith(".bias"):
            t = torch.zeros(whole_shape)
        else:
            raise ExportError(f"the checkpoint has no {rule.ours}")
        if tuple(t.shape) != whole_shape:
            raise ExportError(f"{rule.ours} has shape {tuple(t.shape)}, expected {whole_shape} from the "
                              "checkpoint's [model] config")
        for (name, _), piece in zip(rule.parts, torch.split(t, sizes, dim=0)):
            out[name] = piece.to(device="cpu", dtype=dtype).clone(memory_format=torch.contiguous_format)
    return out


def export_checkpoint(ckpt_path: str, out: str, *, prefer: str = "latest", dtype: str = "auto",
                      force: bool = False) -> str:
    """Export the checkpoint `ckpt_path` (a file, or a run folder: its latest, or best.pt with prefer="best")
    into the folder `out`; returns `out`. Raises ExportError, CheckpointError or TokenizerError (one line)."""
    from data.tokenizers import tokenizer_from_spec
    from data.tokenizer_export import hf_tokenizer_files
    from .checkpoint import load_checkpoint
    from .lora import inference_weights
    check_destination(out, force)  # before reading a large checkpoint
    ckpt = load_checkpoint(ckpt_path, map_location="cpu", prefer=prefer)
    try:
        cfg = GPTConfig(**ckpt["config"]["model"]).validate()
    except (TypeError, KeyError, ConfigError) as e:
        raise ExportError(f"{ckpt['path']}: its [model] config is unusable ({' '.join(str(e).split())[:200]})") \
            from None
    family = hf_family(cfg)
    if ckpt.get("tokenizer") is None:
        raise ExportError(f"{ckpt['path']} holds no tokenizer spec: not a checkpoint of a training run")
    tok = tokenizer_from_spec(ckpt["tokenizer"])
    if tok.vocab_size > cfg.vocab_size:
        raise ExportError(f"{ckpt['path']}: its tokenizer has {tok.vocab_size} tokens, the model only "
                          f"{cfg.vocab_size}")
    try:
        weights = inference_weights(ckpt)  # a LoRA run's updates merged into their weights
    except ValueError as e:
        raise ExportError(f"{ckpt['path']}: {e}") from None
    first = next(iter(weights.values()))
    torch_dtype = first.dtype if dtype == "auto" else DTYPES[dtype]
    bos = getattr(tok, "bos_token", None)
    eos = tok.eot_token
    if family == "gpt2" and tok.name == "gpt2":
        bos = eos
    files = {"config.json": json_text(hf_config(family, cfg, torch_dtype, bos, eos))}
    stops = list(tok.stop_tokens)  # eos first, then the ends of the original generation_config.json
    if stops:
        files["generation_config.json"] = json_text({"bos_token_id": bos,
                                                 "eos_token_id": stops if len(stops) > 1 else stops[0]})
    files.update(hf_tokenizer_files(tok, cfg.block_size))
    tensors = hf_tensors(family, cfg, weights, torch_dtype)
    write_folder(out, files, tensors, force)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m model.export",
                                description="Write a flashgpt checkpoint as a Hugging Face model folder "
                                            "(config.json, model.safetensors, tokenizer files) that "
                                            "transformers.AutoModelForCausalLM.from_pretrained loads.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint file, or a run folder (its latest checkpoint)")
    p.add_argument("--best", action="store_true", help="with a run folder: export best.pt instead of the latest")
    p.add_argument("--out", required=True, help="the folder to write (must be new or empty, unless --force)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="dtype of the weights written; auto = the checkpoint's")
    p.add_argument("--force", action="store_true", help="replace the content of a non-empty --out")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its updates as a PEFT adapter (adapter_config.json, "
                        "adapter_model.safetensors) for the model it started from, instead of the merged model")
    return p


def main(argv=None) -> int:
    from data.tokenizers import TokenizerError
    from .checkpoint import CheckpointError
    args = build_parser().parse_args(argv)
    prefer = "best" if args.best else "latest"
    try:
        if args.adapter:
            from .lora_export import export_adapter
            out = export_adapter(args.ckpt, args.out, prefer=prefer, dtype=args.dtype, force=args.force)
        else:
            out = export_checkpoint(args.ckpt, args.out, prefer=prefer, dtype=args.dtype, force=args.force)
    except (CheckpointError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.ckpt} → {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
