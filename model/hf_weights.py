"""Hugging Face tensor names ↔ this project's GPT parameter names, per family, with the shapes each must have.

A Rule says how one of our parameters is made from Hugging Face tensors: the HF tensors `parts`, concatenated
along dim 0 in that order, transposed when `transpose` (GPT-2's Conv1D stores (in, out)). The mapping per family:

    ours                              gpt2 (transformer.* prefix)       llama-like families (model.* prefix)
    transformer.wte.weight            wte.weight                        embed_tokens.weight
    transformer.wpe.weight            wpe.weight                        —
    transformer.h.N.ln_1.*            h.N.ln_1.{weight,bias}            layers.N.input_layernorm.weight
    transformer.h.N.attn.c_attn.*     h.N.attn.c_attn.{weight ᵀ,bias}   layers.N.self_attn.[q_proj | k_proj | v_proj]
                                                                        (phi3: layers.N.self_attn.qkv_proj)
    transformer.h.N.attn.q_norm/k_norm  —                               layers.N.self_attn.q_norm / k_norm (qwen3,
                                                                        gemma3; olmo2: over all heads)
    transformer.h.N.attn.c_proj.*     h.N.attn.c_proj.{weight ᵀ,bias}   layers.N.self_attn.o_proj
    transformer.h.N.ln_2.*            h.N.ln_2.{weight,bias}            layers.N.post_attention_layernorm.weight
                                                                        (gemma3: layers.N.pre_feedforward_layernorm)
    transformer.h.N.ln_attn_out.*     —                                 layers.N.post_attention_layernorm (gemma3,
                                                                        olmo2; olmo2 has no ln_1 and ln_2)
    transformer.h.N.ln_mlp_out.*      —                                 layers.N.post_feedforward_layernorm (gemma3,
                                                                        olmo2)
    transformer.h.N.mlp.c_fc.*        h.N.mlp.c_fc.{weight ᵀ,bias}      layers.N.mlp.[gate_proj | up_proj]
                                                                        (phi3: layers.N.mlp.gate_up_proj)
    transformer.h.N.mlp.c_proj.*      h.N.mlp.c_proj.{weight ᵀ,bias}    layers.N.mlp.down_proj
    transformer.ln_f.*                ln_f.{weight,bias}                norm.weight
    lm_head.weight                    lm_head.weight (untied only)      lm_head.weight (untied only)

The same rules read backwards (split instead of concatenate) give the Hugging Face names of our weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import GPTConfig
from .hf_files import HFError

# one layout of names for these families: model.layers.N.self_attn.q_proj, ...
LLAMA_LIKE = ("llama", "mistral", "phi3", "qwen2", "qwen3", "smollm3", "olmo2", "olmo3", "gemma3")
# tensors some files hold that are not weights: GPT-2's causal-mask buffers, old Llama files' RoPE frequencies
DROPPED = {"gpt2": (".attn.bias", ".attn.masked_bias"), **{f: (".rotary_emb.inv_freq",) for f in LLAMA_LIKE}}
PREFIX = {"gpt2": "transformer.", **{f: "model." for f in LLAMA_LIKE}}
# An image-text model's files (Gemma3ForConditionalGeneration) hold its text model under a prefix of its own (the
# hub's layout first, the one later transformers versions save second) and the vision tower and the projector,
# which are dropped: {family: ((prefix, replacement), ...), (dropped prefixes)}
TEXT_MODEL_PREFIXES = {"gemma3": ((("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                                   ("model.language_model.", "model.")),
                                  ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                   "model.multi_modal_projector."))}
EMBEDDING = {"gpt2": "transformer.wte.weight", **{f: "model.embed_tokens.weight" for f in LLAMA_LIKE}}


@dataclass(frozen=True)
class Rule:
    ours: str                                   # our parameter name
    parts: tuple[tuple[str, tuple], ...]        # (HF name, HF shape), concatenated along dim 0 in this order
    transpose: bool = False                     # HF stores it (in, out): GPT-2's Conv1D


def tensor_rules(family: str, cfg: GPTConfig) -> list[Rule]:
    """Every parameter of GPT(cfg) and the HF tensors it is made of."""
    rules = _gpt2_rules(cfg) if family == "gpt2" else _llama_rules(cfg, fused=family == "phi3")
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head.weight", (("lm_head.weight", (cfg.vocab_size, cfg.n_embd)),)))
    return rules


def _gpt2_rules(cfg: GPTConfig) -> list[Rule]:
    C, I, V = cfg.n_embd, cfg.mlp_hidden, cfg.vocab_size
    rules = [Rule("transformer.wte.weight", (("transformer.wte.weight", (V, C)),)),
             Rule("transformer.wpe.weight", (("transformer.wpe.weight", (cfg.block_size, C)),))]
    shapes = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,),
              "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
              "mlp.c_fc.weight": (C, I), "mlp.c_fc.bias": (I,), "mlp.c_proj.weight": (I, C), "mlp.c_proj.bias": (C,)}
    for i in range(cfg.n_layer):
        for name, shape in shapes.items():
            full = f"transformer.h.{i}.{name}"
            rules.append(Rule(full, ((full, shape),), transpose=len(shape) == 2))  # every GPT-2 matrix is a Conv1D
    rules += [Rule("transformer.ln_f.weight", (("transformer.ln_f.weight", (C,)),)),
              Rule("transformer.ln_f.bias", (("transformer.ln_f.bias", (C,)),))]
    return rules


def _llama_rules(cfg: GPTConfig, fused: bool = False) -> list[Rule]:
    """fused (Phi-3): q, k, v stored as one self_attn.qkv_proj, gate and up as one mlp.gate_up_proj, in the order
    c_attn and c_fc hold them."""
    C, I, V, D = cfg.n_embd, cfg.mlp_hidden, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.n_head * D, cfg.kv_heads * D
    rules = [Rule("transformer.wte.weight", (("model.embed_tokens.weight", (V, C)),))]
    for i in range(cfg.n_layer):
        hf, ours = f"model.layers.{i}.", f"transformer.h.{i}."
        a, m = hf + "self_attn.", hf + "mlp."
        qkv = ([(a + "qkv_proj.weight", (q + 2 * kv, C))] if fused else
               [(a + "q_proj.weight", (q, C)), (a + "k_proj.weight", (kv, C)), (a + "v_proj.weight", (kv, C))])
        gate_up = ([(m + "gate_up_proj.weight", (2 * I, C))] if fused else
                   [(m + "gate_proj.weight", (I, C)), (m + "up_proj.weight", (I, C))])
        # sandwich norms (Gemma): post_attention_layernorm is the attention output's norm, the MLP's input norm
        # is pre_feedforward_layernorm
        ln_2 = "pre_feedforward_layernorm" if cfg.sandwich_norm else "post_attention_layernorm"
        layer = [("attn.c_attn.weight", qkv),
                 ("attn.c_proj.weight", [(a + "o_proj.weight", (C, q))]),
                 ("mlp.c_fc.weight", gate_up),
                 ("mlp.c_proj.weight", [(m + "down_proj.weight", (C, I))])]
        if cfg.pre_norm:  # (OLMo 2 normalises the sub-blocks' outputs only)
            layer += [("ln_1.weight", [(hf + "input_layernorm.weight", (C,))]),
                      ("ln_2.weight", [(hf + ln_2 + ".weight", (C,))])]
        if cfg.sandwich_norm:
            layer += [("ln_attn_out.weight", [(hf + "post_attention_layernorm.weight", (C,))]),
                      ("ln_mlp_out.weight", [(hf + "post_feedforward_layernorm.weight", (C,))])]
        if cfg.bias or cfg.qkv_bias:
            layer.append(("attn.c_attn.bias", [(a + "q_proj.bias", (q,)), (a + "k_proj.bias", (kv,)),
                                               (a + "v_proj.bias", (kv,))]))
        if cfg.bias:
            layer += [("attn.c_proj.bias", [(a + "o_proj.bias", (C,))]),
                      ("mlp.c_fc.bias", [(m + "gate_proj.bias", (I,)), (m + "up_proj.bias", (I,))]),
                      ("mlp.c_proj.bias", [(m + "down_proj.bias", (C,))])]
        if cfg.qk_norm:  # over each head, or (OLMo 2) over all of q's and all of k's heads
            q_dim, k_dim = (q, kv) if cfg.qk_norm_scope == "all" else (D, D)
            layer += [("attn.q_norm.weight", [(a + "q_norm.weight", (q_dim,))]),
                      ("attn.k_norm.weight", [(a + "k_norm.weight", (k_dim,))])]
        rules += [Rule(ours + name, tuple(parts)) for name, parts in layer]
    rules.append(Rule("transformer.ln_f.weight", (("model.norm.weight", (C,)),)))
    return rules


def normalize_names(family: str, tensors: dict) -> dict:
    """Drop non-weight buffers (and an image-text model's vision tower and projector) and give every name the
    family's prefix (files saved from the bare model, e.g. the hub's gpt2 or a LlamaModel, have none; an
    image-text model's text model has a prefix of its own)."""
    out = {}
    for name, t in tensors.items():
        name = hf_name(family, name)
        if name is not None:
            out[name] = t
    return out


def hf_name(family: str, name: str) -> str | None:
    """A tensor's name as the family's rules spell it (normalize_names), or None for a tensor that is dropped."""
    renames, skipped = TEXT_MODEL_PREFIXES.get(family, ((), ()))
    if name.endswith(DROPPED[family]) or name.startswith(skipped):
        return None
    for old, new in renames:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    prefix = PREFIX[family]
    return name if name.startswith((prefix, "lm_head.")) else prefix + name


def state_dict_from_hf(family: str, cfg: GPTConfig, tensors: dict, dtype: torch.dtype = torch.float32,
                       device=None) -> dict:
    """HF tensors (names as in the files) → our state dict in `dtype` on `device`. Raises HFError naming the
    missing, unexpected or wrongly shaped tensors."""
    tensors = normalize_names(family, tensors)
    rules = tensor_rules(family, cfg)
    expected = {name: shape for rule in rules for name, shape in rule.parts}
    if cfg.tie_embeddings and "lm_head.weight" in tensors:  # some files keep the tied head: it must be the embedding
        head, emb = tensors.pop("lm_head.weight"), tensors.get(EMBEDDING[family])
        if emb is not None and (head.shape != emb.shape or not torch.equal(head, emb)):
            raise HFError(f"lm_head.weight differs from {EMBEDDING[family]}, but tie_word_embeddings is true")
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise HFError(f"missing tensors: {_names(missing)}")
    unexpected = [n for n in tensors if n not in expected]
    if unexpected:
        raise HFError(f"unexpected tensors (not in a {family} model of this config): {_names(unexpected)}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise HFError(f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape} from config.json")
    out = {}
    for rule in rules:
        parts = [tensors[name].to(device=device, dtype=dtype) for name, _ in rule.parts]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        out[rule.ours] = (t.t() if rule.transpose else t).contiguous()
    return out


def _names(names: list[str], limit: int = 4) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
