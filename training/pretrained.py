"""Pretrained weights to start from (train.init_from, generate.py --init-from): shape, weights and tokenizer.

    pre = load_pretrained("hf:HuggingFaceTB/SmolLM2-135M")  # a Hugging Face model: hub id (local cache first) or folder
    pre = load_pretrained("runs/demo")                      # a run folder (its best.pt) or a checkpoint file
    settle_run_config(cfg, pre)                             # cfg.model ← its shape; data.tokenizer = "model"
    model.load_state_dict(pre.state_for(cfg.model))

A Hugging Face model brings its config.json (model/hf_config.py), its safetensors weights (model/hf_weights.py)
and its tokenizer.json (data/tokenizers.py HFTokenizer); a run of this project brings its checkpoint's [model]
config, weights and tokenizer spec. Nothing is read from the hub once a checkpoint of the new run exists: a
fine-tuning run stores its tokenizer (the whole tokenizer.json) in every checkpoint, and resume reads only those.
Every failure is one line (ConfigError, CheckpointError / HFError, TokenizerError).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from config import RunConfig, is_hf_name
from model.config import ConfigError, GPTConfig

# [model] keys a fine-tuning run may set freely: how to train or run, not what the weights are
FREE_MODEL_KEYS = ("dropout", "attention")
# and, for RoPE models, the position encoding's frequencies: a run that extends the context (with a longer
# block_size) rescales them, as YaRN, position interpolation or a larger rope_theta are fine-tuned
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
             "rope_original_max_pos", "rope_beta_fast", "rope_beta_slow", "rope_attention_factor",
             "rope_yarn_truncate")


@dataclass
class Pretrained:
    source: str          # what it was loaded from, as the user named it ("hf:org/name", a run folder, ...)
    config: GPTConfig    # the shape of its weights
    state: dict          # our parameter names → tensors (CPU), lm_head.weight included (the embedding when tied)
    tokenizer: object    # the model's own tokenizer (data/tokenizers.py)
    generation: dict = dataclasses.field(default_factory=dict)  # a Hugging Face model's generation_config.json

    def state_for(self, cfg: GPTConfig) -> dict:
        """The weights for GPT(cfg), cfg from settle_run_config: a learned position table cut to cfg.block_size."""
        state = dict(self.state)
        wpe = state.get("transformer.wpe.weight")
        if wpe is not None and wpe.shape[0] > cfg.block_size:
            state["transformer.wpe.weight"] = wpe[:cfg.block_size].clone()  # (block_size, C)
        return state


def load_pretrained(source: str, what: str = "train.init_from") -> Pretrained:
    """"hf:<repo-or-dir>" → a Hugging Face model; another existing path → a run folder (best.pt) or checkpoint.
    `what` names the option in messages."""
    if is_hf_name(source):
        return _from_hf(source)
    if os.path.exists(source):
        return _from_checkpoint(source, what)
    raise ConfigError(f"{what}={source!r}: no such run folder or checkpoint file (expected 'hf:<repo-or-dir>' for "
                      "a Hugging Face model, or a run folder / checkpoint of this project)")


def _from_hf(source: str) -> Pretrained:
    from data.tokenizers import HFTokenizer
    from model.hf import read_weights
    from model.hf_adapter import resolve_model_files
    from model.hf_files import read_json_object
    path_or_repo = source[len("hf:"):]
    files = resolve_model_files(path_or_repo, repr(source), need="config.json, *.safetensors and tokenizer.json")
    # first: a missing tokenizer.json fails before the weights
    tokenizer = HFTokenizer.from_folder(files.tokenizer_folder, source)
    cfg, state = read_weights(files, repr(source))
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    _check_vocab(source, tokenizer, cfg)
    generation = os.path.join(files.folder, "generation_config.json")
    return Pretrained(source, cfg, state, tokenizer,
                      read_json_object(generation) if os.path.isfile(generation) else {})


def _from_checkpoint(path: str, what: str) -> Pretrained:
    from data.tokenizers import tokenizer_from_spec
    from model.checkpoint import CheckpointError, load_checkpoint
    from model.lora import inference_weights
    ckpt = load_checkpoint(path, map_location="cpu", prefer="best")
    try:
        cfg = GPTConfig(**ckpt["config"]["model"]).validate()
    except (TypeError, KeyError, ConfigError) as e:
        raise CheckpointError(f"{what}: {ckpt['path']} holds an unusable [model] config "
                              f"({' '.join(str(e).split())[:200]})") from None
    if ckpt.get("tokenizer") is None:
        raise CheckpointError(f"{what}: {ckpt['path']} holds no tokenizer spec (not a checkpoint of a training run)")
    tokenizer = tokenizer_from_spec(ckpt["tokenizer"])
    _check_vocab(ckpt["path"], tokenizer, cfg)
    try:
        weights = inference_weights(ckpt)  # a LoRA run's updates merged: the next run starts from its model
    except ValueError as e:
        raise CheckpointError(f"{what}: {ckpt['path']}: {e}") from None
    return Pretrained(path, cfg, dict(weights), tokenizer)


def _check_vocab(source: str, tokenizer, cfg: GPTConfig) -> None:
    from model.checkpoint import CheckpointError
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{source}: its tokenizer has {tokenizer.vocab_size} tokens, its model only "
                              f"{cfg.vocab_size}")


def settle_run_config(cfg: RunConfig, pre: Pretrained) -> None:
    """Make `cfg` a fine-tuning run of `pre`: [model] becomes the pretrained shape (keeping the run's dropout and
    attention, and its block_size where it sets one: a shorter training context, or for RoPE models a longer
    one, with the RoPE keys it sets: ROPE_KEYS) and data.tokenizer becomes "model" (the pretrained tokenizer).

    Keys the user set (cfg.origins) to values the pretrained model contradicts are refused in one ConfigError,
    as resume refuses them: the shape comes from the weights."""
    asked, base = cfg.model, pre.config
    problems = []
    block_size, rope = base.block_size, {}
    for key, origin in cfg.origins.items():
        section, _, name = key.partition(".")
        if section == "data" and name == "tokenizer" and cfg.data.tokenizer != "model":
            problems.append(f"data.tokenizer={cfg.data.tokenizer!r} ({origin}): a pretrained model is trained with "
                            "its own tokenizer (leave data.tokenizer out, or write 'model')")
        if section != "model" or name in FREE_MODEL_KEYS:
            continue
        value, pretrained = getattr(asked, name), getattr(base, name)
        if name in ROPE_KEYS and base.pos_emb == "rope":
            rope[name] = value
            continue
        if name == "block_size":
            if base.pos_emb == "learned" and value > base.block_size:
                problems.append(f"model.block_size={value} ({origin}) is above the pretrained model's learned "
                                f"position table of {base.block_size}")
            block_size = value
        elif name == "vocab_size" and value == 0:
            continue  # "from the tokenizer": the pretrained vocab
        elif value != pretrained:
            problems.append(f"model.{name}={value!r} ({origin}) against the pretrained model's {pretrained!r}")
    if problems:
        raise ConfigError(f"train.init_from={pre.source!r}: " + "; ".join(problems)
                          + ". The model's shape comes from its weights: drop these keys")
    cfg.model = dataclasses.replace(base, dropout=asked.dropout, attention=asked.attention,
                                    block_size=block_size, **rope).validate()
    cfg.data.tokenizer = "model"
