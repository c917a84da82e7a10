"""A Hugging Face config.json → (family, GPTConfig) that gives transformers' logits, or one line saying why not.

Families and the options they map:

    gpt2    GPT2LMHeadModel     learned positions, LayerNorm, GELU (tanh), biases; n_inner → intermediate_size
    llama   LlamaForCausalLM    RoPE (+ llama3 scaling), RMSNorm, SwiGLU, GQA; attention_bias with mlp_bias → bias
    mistral MistralForCausalLM  as llama without biases, with a sliding window on every layer (sliding_window,
                                4096 when config.json leaves it out, null for none) → attention_window
    phi3    Phi3ForCausalLM     as mistral (sliding_window null when left out), its q, k, v in one qkv_proj and
                                gate and up in one gate_up_proj (model/hf_weights.py); exports as llama/mistral
    qwen2   Qwen2ForCausalLM    as llama, with biases on q, k, v only (qkv_bias)
    qwen3   Qwen3ForCausalLM    as llama, with RMSNorm on each head's q and k (qk_norm) and its own head_dim
    smollm3 SmolLM3ForCausalLM  as llama, every no_rope_layer_interval-th layer without RoPE (no_rope_layers, in
                                that pattern) → nope_interval; rope_theta 2e6 when config.json leaves it out
    (qwen2, qwen3 and smollm3 with use_sliding_window: a window on every layer → attention_window; on some
    layers only: refused, attention_window being one window for the whole model)
    olmo2   Olmo2ForCausalLM    as llama without biases (attention_bias refused: OLMo 2's MLP has none), its RMSNorm
                                applied in float32 (rmsnorm_fp32) on the attention's and the MLP's outputs only
                                (pre_norm false, sandwich_norm), and over the whole q and k projections
                                (qk_norm, qk_norm_scope "all")
    olmo3   Olmo3ForCausalLM    as olmo2, with a sliding window on all layers but every N-th (layer_types; by
                                default every 4th layer full) → attention_window with full_attention_interval N,
                                and each layer type's RoPE (rope_parameters): the windowed layers' base →
                                rope_local_theta where it differs from the full layers' (which may be scaled)
    gemma3  Gemma3ForCausalLM   (model_type gemma3_text) RoPE, RMSNorm scaled by 1 + weight (rmsnorm1p) before
                                and after the attention and the MLP (sandwich_norm), GeGLU (tanh), embeddings
                                times sqrt(hidden_size), qk_norm, query_pre_attn_scalar → query_scale_dim; its
                                sliding window on all layers but every N-th (layer_types, or sliding_window_pattern)
                                → attention_window with full_attention_interval N, those windowed layers' own RoPE
                                base (rope_local_base_freq, or rope_parameters["sliding_attention"]) →
                                rope_local_theta; logit soft-capping and bidirectional attention refused
            Gemma3ForConditionalGeneration (model_type gemma3: the 4B, 12B and 27B image-text models) loads its
                                text model: text_config, whose keys left out take Gemma3TextConfig's defaults (the
                                hub's configs give only those that differ), and the language model's weights (the
                                vision tower and the projector are dropped, model/hf_weights.py)

Both the current `rope_parameters` and the older `rope_theta` + `rope_scaling` keys are read. A key that
config.json leaves out takes the default of the transformers class it names (e.g. tie_word_embeddings is
true for GPT-2, false for the others). Options these models cannot reproduce are refused by name: another
activation, a sliding window on some layers only, RoPE types other than default, llama3, linear and yarn, partial
rotary, biases on attention without the MLP's.
"""
from __future__ import annotations

import dataclasses
import math

from .config import ConfigError, GPTConfig
from .hf_files import HFError

ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Phi3ForCausalLM": "phi3", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "SmolLM3ForCausalLM": "smollm3", "Olmo2ForCausalLM": "olmo2", "Olmo3ForCausalLM": "olmo3",
                 "Gemma3ForCausalLM": "gemma3",
                 "Gemma3ForConditionalGeneration": "gemma3"}
# model_type, when architectures is absent
MODEL_TYPES = {**{family: family for family in ARCHITECTURES.values() if family != "gemma3"},
               "gemma3_text": "gemma3", "gemma3": "gemma3"}
# image-text models whose text model is read (from config.json's text_config): architectures, model_types
MULTIMODAL_ARCHITECTURES, MULTIMODAL_TYPES = ("Gemma3ForConditionalGeneration",), ("gemma3",)
# Gemma3TextConfig's defaults for the sizes a multimodal config's text_config may leave out
GEMMA3_TEXT_SIZES = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                         num_attention_heads=8, num_key_value_heads=4)
# transformers' defaults for keys a config.json may leave out, per family
DEFAULTS = {
    "llama": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=2048, head_dim=None),
    "mistral": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=131072, head_dim=None,
                    sliding_window=4096),
    "phi3": dict(tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=4096, head_dim=None,
                 sliding_window=None),
    "qwen2": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=32768, head_dim=None),
    "qwen3": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=32768, head_dim=128),
    "smollm3": dict(tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768, head_dim=None,
                    rope_theta=2e6, no_rope_layer_interval=4),
    "olmo2": dict(tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=2048, head_dim=None),
    "olmo3": dict(tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=2048, head_dim=None,
                  rope_theta=5e5, sliding_window=4096, full_attention_every=4),
    "gemma3": dict(tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=131072, head_dim=256,
                   sliding_window=4096, query_pre_attn_scalar=256, rope_theta=1e6, rope_local_base_freq=1e4,
                   sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh"),
}
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")


def family_of(hf: dict) -> str:
    """The family ("gpt2", "llama", ... : ARCHITECTURES' values) from config.json's architectures (or model_type)."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if archs:
        if not isinstance(archs, list) or archs[0] not in ARCHITECTURES:
            raise HFError(f"unsupported architecture {archs[0] if isinstance(archs, list) else archs!r} "
                          f"(model_type {model_type!r}); supported: {', '.join(ARCHITECTURES)}")
        return ARCHITECTURES[archs[0]]
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise HFError(f"unsupported model_type {model_type!r} (no architectures given); supported: "
                  f"{', '.join(MODEL_TYPES)}")


def gpt_config_from_hf(hf: dict) -> tuple[str, GPTConfig]:
    """(family, GPTConfig) for a config.json dict; HFError with one line for what does not map."""
    family = family_of(hf)
    hf = text_config(hf)
    cfg = (_gpt2(hf) if family == "gpt2" else _gemma3(hf) if family == "gemma3" else _olmo3(hf) if family == "olmo3"
           else _llama_like(hf, family))
    try:
        cfg.validate(prefix="config: ")
    except ConfigError as e:
        raise HFError(f"config.json gives an invalid model ({e})") from None
    return family, cfg


def is_multimodal(hf: dict) -> bool:
    """Whether config.json is an image-text model's whose text model is what loads (Gemma 3's 4B and larger)."""
    archs = hf.get("architectures")
    if isinstance(archs, list) and archs:
        return archs[0] in MULTIMODAL_ARCHITECTURES
    return hf.get("model_type") in MULTIMODAL_TYPES


def text_config(hf: dict) -> dict:
    """The config of the text model: config.json itself, or a multimodal config's text_config with the text
    class's defaults for the sizes it leaves out. HFError (one line) where there is no text_config object."""
    if not is_multimodal(hf):
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise HFError(f"config.json of a {(hf.get('architectures') or [hf.get('model_type')])[0]} has no "
                      "text_config object (the text model's settings)")
    return {**GEMMA3_TEXT_SIZES, **text}


def _require(hf: dict, *keys: str) -> list:
    missing = [k for k in keys if not isinstance(hf.get(k), int) or isinstance(hf.get(k), bool)]
    if missing:
        raise HFError(f"config.json lacks integer {', '.join(missing)}")
    return [hf[k] for k in keys]


def _refuse(family: str, problems: list[str]) -> None:
    if problems:
        raise HFError(f"unsupported {family} config: " + "; ".join(problems))


def _gpt2(hf: dict) -> GPTConfig:
    n_layer, n_head, n_embd, vocab = _require(hf, "n_layer", "n_head", "n_embd", "vocab_size")
    problems = []
    if hf.get("activation_function", "gelu_new") not in GELU_TANH:
        problems.append(f"activation_function={hf['activation_function']!r} (only the tanh GELU, gelu_new)")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("attention scaling other than 1/sqrt(head_dim)")
    if hf.get("add_cross_attention", False):
        problems.append("cross-attention layers")
    _refuse("GPT-2", problems)
    return GPTConfig(block_size=hf.get("n_positions") or hf.get("n_ctx") or 1024, vocab_size=vocab, n_layer=n_layer,
                     n_head=n_head, n_embd=n_embd, dropout=0.0, bias=True,
                     norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), intermediate_size=hf.get("n_inner") or 0,
                     tie_embeddings=bool(hf.get("tie_word_embeddings", True)))


def _rope_fields(hf: dict, problems: list[str], default_theta: float = 10000.0, rp: dict | None = None) -> dict:
    """rope_theta and the scaling fields (llama3, linear, yarn) from rope_parameters (current) or rope_theta +
    rope_scaling, read as transformers reads them; rp: the rope_parameters to read instead (one layer type's)."""
    rp = rp if rp is not None else hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(rp, dict) or any(isinstance(v, dict) for v in rp.values()):
        problems.append("per-layer-type rope_parameters")
        return {}
    theta = rp.get("rope_theta", hf.get("rope_theta", default_theta))
    fields = dict(rope_theta=float(theta))
    if float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        problems.append("partial_rotary_factor (RoPE on part of each head)")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type == "llama3":
        try:
            fields.update(rope_scaling="llama3", rope_factor=float(rp["factor"]),
                          rope_low_freq_factor=float(rp["low_freq_factor"]),
                          rope_high_freq_factor=float(rp["high_freq_factor"]),
                          rope_original_max_pos=int(rp.get("original_max_position_embeddings")
                                                    or hf.get("max_position_embeddings") or 8192))
        except (KeyError, TypeError, ValueError) as e:
            problems.append(f"llama3 rope scaling without a usable {e}")
    elif rope_type == "linear":
        try:
            fields.update(rope_scaling="linear", rope_factor=float(rp["factor"]))
        except (KeyError, TypeError, ValueError) as e:
            problems.append(f"linear rope scaling without a usable {e}")
    elif rope_type == "yarn":
        try:
            fields.update(_yarn_fields(hf, rp))
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            problems.append(f"yarn rope scaling without a usable {e}")
    elif rope_type != "default":
        problems.append(f"rope type {rope_type!r} (only default, llama3, linear and yarn)")
    return fields


def _yarn_fields(hf: dict, rp: dict) -> dict:
    """YaRN's fields: factor (or max_position_embeddings / original_max_position_embeddings), beta_fast and
    beta_slow (32 and 1 where unset), truncate (true), and the attention factor: given, or from DeepSeek's mscale
    and mscale_all_dim where both are set, else 0 (the model's own 0.1·ln(factor) + 1)."""
    original = int(rp.get("original_max_position_embeddings") or hf.get("max_position_embeddings"))
    factor = float(rp["factor"]) if rp.get("factor") is not None else hf["max_position_embeddings"] / original
    attention = rp.get("attention_factor")
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:
        def m(ms: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * ms * math.log(factor) + 1.0
        attention = m(float(mscale)) / m(float(mscale_all_dim))
    return dict(rope_scaling="yarn", rope_factor=factor, rope_original_max_pos=original,
                rope_beta_fast=float(rp.get("beta_fast") or 32), rope_beta_slow=float(rp.get("beta_slow") or 1),
                rope_attention_factor=float(attention or 0.0), rope_yarn_truncate=bool(rp.get("truncate", True)))


def _llama_like(hf: dict, family: str) -> GPTConfig:
    d = DEFAULTS[family]
    n_embd, n_layer, n_head, inter, vocab = _require(hf, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                                     "intermediate_size", "vocab_size")
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only silu: SwiGLU)")
    # qwen2: biases on q, k, v only; mistral, phi3: none
    olmo = family in ("olmo2", "olmo3")  # norms after the sub-blocks only, in float32, q and k over all heads
    attention_bias = bool(hf.get("attention_bias", False)) if family in ("llama", "qwen3", "smollm3") or olmo \
        else False
    mlp_bias = bool(hf.get("mlp_bias", False)) if family in ("llama", "smollm3") else False
    if attention_bias != mlp_bias:
        problems.append(f"attention_bias={attention_bias} with mlp_bias={mlp_bias} (biases on all projections "
                        "or none)")
    nope = _nope_interval(hf, n_layer, problems) if family == "smollm3" else 0
    window = _window(hf, family, n_layer, nope, problems)
    rope = _rope_fields(hf, problems, d.get("rope_theta", 10000.0)) if family != "olmo3" else {}  # (_olmo3's own)
    _refuse(family, problems)
    head_dim = hf.get("head_dim", d["head_dim"]) or n_embd // n_head
    head_size = head_dim if head_dim * n_head != n_embd else 0
    return GPTConfig(block_size=hf.get("max_position_embeddings", d["max_position_embeddings"]), vocab_size=vocab,
                     n_layer=n_layer, n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head,
                     n_embd=n_embd, dropout=0.0, bias=attention_bias, head_size=head_size, pos_emb="rope",
                     norm="rmsnorm_fp32" if olmo else "rmsnorm",
                     norm_eps=float(hf.get("rms_norm_eps", d["rms_norm_eps"])), mlp="swiglu",
                     intermediate_size=inter, qkv_bias=family == "qwen2", qk_norm=family == "qwen3" or olmo,
                     qk_norm_scope="all" if olmo else "head", pre_norm=not olmo, sandwich_norm=olmo,
                     tie_embeddings=bool(hf.get("tie_word_embeddings", d["tie_word_embeddings"])),
                     attention_window=window, nope_interval=nope, **rope)


def _nope_interval(hf: dict, n_layer: int, problems: list[str]) -> int:
    """SmolLM3's layers without RoPE as nope_interval: no_rope_layers (1 = RoPE, 0 = none, one per layer) where
    config.json has it, else every no_rope_layer_interval-th layer. A pattern other than every N-th layer is
    refused; RoPE in every layer is 0."""
    interval = hf.get("no_rope_layer_interval", DEFAULTS["smollm3"]["no_rope_layer_interval"])
    flags = hf.get("no_rope_layers")
    if flags is None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            problems.append(f"no_rope_layer_interval={interval!r} (a positive number of layers)")
            return 0
        return interval if interval <= n_layer else 0
    if not isinstance(flags, list) or len(flags) != n_layer or any(f not in (0, 1) for f in flags):
        problems.append(f"no_rope_layers must be {n_layer} flags of 0 or 1")
        return 0
    nope = [i for i, f in enumerate(flags) if not f]
    if not nope:
        return 0
    n = nope[0] + 1  # the first NoPE layer is layer n - 1 in an every-n-th pattern
    if [int((i + 1) % n != 0) for i in range(n_layer)] != flags:
        problems.append(f"no_rope_layers={flags} (only every N-th layer without RoPE, as no_rope_layer_interval)")
        return 0
    return n


def _window(hf: dict, family: str, n_layer: int, nope: int, problems: list[str]) -> int:
    """attention_window (0: none) from the family's sliding-window keys, as transformers reads them: Mistral and
    Phi-3 apply sliding_window on every layer (and ignore layer_types); Qwen2/Qwen3/SmolLM3 only with
    use_sliding_window, on the layers that layer_types marks "sliding_attention" (without it: Qwen's layers from
    max_window_layers on, SmolLM3's NoPE layers); Llama has no window."""
    if family in ("mistral", "phi3"):
        window = hf.get("sliding_window", DEFAULTS[family]["sliding_window"])
        if window is None:
            return 0
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            problems.append(f"sliding_window={window!r} (a positive number of tokens, or null)")
            return 0
        return window
    layer_types = hf.get("layer_types") or []
    if family == "olmo3":
        return 0  # (_olmo3 reads its layer_types)
    window = (hf.get("sliding_window") if family not in ("llama", "olmo2") and hf.get("use_sliding_window", False)
              else None)
    if window is None:
        if "sliding_attention" in layer_types:
            problems.append("sliding-window attention in layer_types without a sliding_window")
        return 0
    if not layer_types:
        first = hf.get("max_window_layers", 28)  # transformers' default
        in_window = (lambda i: nope and (i + 1) % nope == 0) if family == "smollm3" else (lambda i: i >= first)
        layer_types = ["sliding_attention" if in_window(i) else "full_attention" for i in range(n_layer)]
    windowed = sum(t == "sliding_attention" for t in layer_types)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        problems.append(f"sliding_window={window!r} (a positive number of tokens)")
    elif 0 < windowed < len(layer_types):
        problems.append(f"sliding-window attention on {windowed} of {len(layer_types)} layers "
                        f"(sliding_window={window}; one window for every layer or none)")
    else:
        return window if windowed else 0
    return 0


def _gemma3(hf: dict) -> GPTConfig:
    """Gemma 3's text model (Gemma3ForCausalLM): see the module docstring."""
    d = DEFAULTS["gemma3"]
    n_embd, n_layer, n_head, inter, vocab = _require(hf, "hidden_size", "num_hidden_layers", "num_attention_heads",
                                                     "intermediate_size", "vocab_size")
    problems = []
    act = hf.get("hidden_activation") or hf.get("hidden_act") or d["hidden_activation"]
    if act not in GELU_TANH:
        problems.append(f"hidden_activation={act!r} (only the tanh GELU, gelu_pytorch_tanh: GeGLU)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            problems.append(f"{key}={hf[key]!r} (no soft-capping here)")
    if hf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention (causal attention only)")
    if hf.get("attention_bias"):
        problems.append("attention_bias=True (Gemma 3's MLP has none: biases on all projections or none)")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", d["sliding_window_pattern"]))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            problems.append(f"sliding_window_pattern={pattern!r} (a positive number of layers)")
            pattern = 1
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer)]
    window, interval = _layer_type_windows(hf, layer_types, n_layer, d["sliding_window"], problems)
    # RoPE: the full layers' (theta, scaling) and the windowed layers' (theta alone)
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", d["rope_theta"])}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", d["rope_local_base_freq"])}
    rope = _rope_fields(hf, problems, d["rope_theta"], rp=full)
    local_rope = _rope_fields(hf, problems, d["rope_local_base_freq"], rp=local)
    if local_rope.get("rope_scaling"):
        problems.append(f"rope scaling {local_rope['rope_scaling']!r} on the sliding-window layers (only on the "
                        "full-attention layers)")
    if window and not interval:  # every layer windowed: the windowed layers' RoPE is the model's
        rope, local_theta = local_rope, 0.0
    else:
        local_theta = local_rope.get("rope_theta", 0.0) if window else 0.0
    _refuse("gemma3", problems)
    head_dim = hf.get("head_dim", d["head_dim"]) or n_embd // n_head
    scalar = hf.get("query_pre_attn_scalar", d["query_pre_attn_scalar"])
    return GPTConfig(block_size=hf.get("max_position_embeddings", d["max_position_embeddings"]), vocab_size=vocab,
                     n_layer=n_layer, n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head,
                     n_embd=n_embd, dropout=0.0, bias=False, head_size=head_dim if head_dim * n_head != n_embd else 0,
                     pos_emb="rope", norm="rmsnorm1p", norm_eps=float(hf.get("rms_norm_eps", d["rms_norm_eps"])),
                     sandwich_norm=True, mlp="geglu", intermediate_size=inter, embed_scale=True, qk_norm=True,
                     query_scale_dim=0 if scalar == head_dim else int(scalar),
                     tie_embeddings=bool(hf.get("tie_word_embeddings", d["tie_word_embeddings"])),
                     attention_window=window, full_attention_interval=interval, rope_local_theta=local_theta, **rope)


def _layer_type_windows(hf: dict, layer_types, n_layer: int, default_window: int,
                        problems: list[str]) -> tuple[int, int]:
    """(attention_window, full_attention_interval) from layer_types and sliding_window (Gemma 3, OLMo 3): the
    window on every "sliding_attention" layer, which must be all layers but every N-th (N = the first full
    layer's number)."""
    if (not isinstance(layer_types, list) or len(layer_types) != n_layer
            or any(t not in ("sliding_attention", "full_attention") for t in layer_types)):
        problems.append(f"layer_types must be {n_layer} of 'sliding_attention' or 'full_attention'")
        return 0, 0
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    if len(full) == n_layer:
        return 0, 0
    window = hf.get("sliding_window", default_window)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        problems.append(f"sliding_window={window!r} (a positive number of tokens)")
        return 0, 0
    if not full:
        return window, 0
    n = full[0] + 1
    if full != list(range(n - 1, n_layer, n)):
        problems.append(f"full attention on layers {full} (only on every N-th layer)")
        return 0, 0
    return window, n


def _olmo3(hf: dict) -> GPTConfig:
    """OLMo 3 (Olmo3ForCausalLM): OLMo 2's blocks, windows by layer_types, RoPE by layer type (module docstring)."""
    d = DEFAULTS["olmo3"]
    cfg = _llama_like(hf, "olmo3")  # the sizes, OLMo 2's blocks; its window and RoPE are set below
    n_layer = cfg.n_layer
    problems = []
    layer_types = hf.get("layer_types")
    if layer_types is None:
        every = d["full_attention_every"]
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layer)]
    window, interval = _layer_type_windows(hf, layer_types, n_layer, d["sliding_window"], problems)
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    else:  # the older keys: rope_theta in every layer, rope_scaling on the full-attention layers only
        theta = hf.get("rope_theta", d["rope_theta"])
        full = {**(hf.get("rope_scaling") or rp or {}), "rope_theta": theta}
        local = {"rope_type": "default", "rope_theta": theta}
    rope = _rope_fields(hf, problems, d["rope_theta"], rp=full)
    local_rope = _rope_fields(hf, problems, d["rope_theta"], rp=local)
    local_theta = 0.0
    if window and not interval:  # every layer windowed: the windowed layers' RoPE is the model's
        rope = local_rope
    elif window and local_rope != rope:  # the windowed layers rotate otherwise than the full ones
        if local_rope.get("rope_scaling"):
            problems.append(f"rope scaling {local_rope['rope_scaling']!r} on the sliding-window layers unlike the "
                            "full-attention layers' (only an unscaled base of their own)")
        local_theta = local_rope.get("rope_theta", 0.0)
    _refuse("olmo3", problems)
    defaults = GPTConfig()
    rope_keys = {k: rope.get(k, getattr(defaults, k)) for k in (
        "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
        "rope_original_max_pos", "rope_beta_fast", "rope_beta_slow", "rope_attention_factor", "rope_yarn_truncate")}
    return dataclasses.replace(cfg, attention_window=window, full_attention_interval=interval,
                               rope_local_theta=local_theta, **rope_keys)
