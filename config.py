"""Run configuration: typed dataclasses loaded from TOML, overridden by validated `--key=value` flags.

A TOML file has up to three tables, [model], [data] and [train], whose keys are the fields below.
Overrides name a key as `--section.key=value` or, when the name is unique, `--key=value`:

    python train.py configs/demo.toml --n_layer=4 --train.learning_rate=3e-4 --attention=naive

Unknown keys, wrong types, non-finite floats (nan, inf) and invalid values raise ConfigError with one line
that names the key; the entry points print it and exit with status 2.

A loaded config remembers where each key it was given came from (`origins`: the file, or the flag), so that
resuming a run can tell a value the user asked for from a default (`resume_config`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field

from model.config import ConfigError, GPTConfig
from model.lora import LORA_TARGETS, LoRASettings


@dataclass
class DataConfig:
    dataset: str = "shakespeare"  # "shakespeare" | text file | folder | glob | "hf:NAME[:CONFIG]" | shard folder
    tokenizer: str = "char"       # "char" | "gpt2" | "hf:<repo-or-dir>" | "model" (train.init_from's own tokenizer)
    format: str = "bin"           # "bin": one train.bin/val.bin (data/prepare.py) | "shards": streamed token
                                  # shards read in order (data/shards.py; dataset may be a prepared folder) |
                                  # "chat": conversations in the tokenizer's chat template, the loss on the
                                  # assistant's turns (data/chat_data.py)
    val_fraction: float = 0.1     # bin: the last tokens of the corpus form the validation split
    val_docs: int = 1000          # shards: the first documents form the validation split
    shard_tokens: int = 100_000_000  # shards: tokens per shard file
    text_column: str = "text"     # shards: the field of .jsonl/.parquet/hub rows that holds the text
    # chat: the field of rows that holds a conversation's list of messages (a row without it: its Alpaca or Dolly
    # instruction fields as one exchange)
    messages_column: str = "messages"
    num_proc: int = 2             # tokenisation processes
    cache_dir: str = ".cache/data"

    def validate(self) -> "DataConfig":
        if self.tokenizer not in ("char", "gpt2", "model") and not is_hf_name(self.tokenizer):
            raise ConfigError(f"data.tokenizer={self.tokenizer!r}: must be 'char', 'gpt2', 'hf:<repo-or-dir>' (a "
                              "Hugging Face model's tokenizer.json) or 'model' (the tokenizer of train.init_from)")
        if self.format not in ("bin", "shards", "chat"):
            raise ConfigError(f"data.format={self.format!r}: must be 'bin', 'shards' or 'chat'")
        if not self.messages_column:
            raise ConfigError("data.messages_column: must not be empty")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction!r}: must be in (0, 1)")
        for key in ("num_proc", "val_docs", "shard_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"data.{key}={getattr(self, key)!r}: must be at least 1")
        if not self.dataset:
            raise ConfigError("data.dataset: must not be empty")
        if not self.text_column:
            raise ConfigError("data.text_column: must not be empty")
        return self


LR_SCHEDULES = ("cosine", "linear", "wsd", "constant")  # training/schedule.py: lr_at


@dataclass
class TrainConfig:
    out_dir: str = "runs/default"   # run directory: checkpoints, metrics.jsonl, config
    seed: int = 1337
    device: str = "auto"            # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"             # "auto" (bf16 autocast on CUDA, fp32 on CPU) | "float32" | "bfloat16" | "float16"
    batch_size: int = 32            # sequences per micro-batch
    grad_accum_steps: int = 1       # micro-batches per optimizer step
    max_iters: int = 2000           # optimizer steps
    max_time: float = 0.0           # stop after this many seconds of training (0 = no limit)
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 0         # the step the decay ends at (min_lr from there on); 0 = max_iters
    lr_schedule: str = "cosine"     # after warmup: "cosine" | "linear" (to min_lr at lr_decay_iters) | "wsd"
                                    # (warmup-stable-decay: learning_rate, then linear to min_lr over the last
                                    # lr_decay_frac of lr_decay_iters) | "constant" (learning_rate throughout)
    lr_decay_frac: float = 0.2      # wsd: the share of the steps that decays
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0          # 0 = no clipping
    eval_interval: int = 250
    eval_iters: int = 20
    eval_hellaswag_interval: int = 0  # HellaSwag every this many steps and at the end (0 = off); evals/train_hook.py
    eval_hellaswag_data: str = ""     # its local JSONL/Parquet file; "" = download once into data.cache_dir/eval
    log_interval: int = 10
    keep_last: int = 2              # checkpoints kept besides best.pt
    init_from: str = "scratch"      # "scratch" | "resume" (continue the run in out_dir exactly) | "hf:<repo-or-dir>"
                                    # (Hugging Face weights) | a run folder (its best.pt) or checkpoint: fine-tune
    export_hf: bool = False         # at the end, export best.pt as a Hugging Face model into <out_dir>/hf
    lora_rank: int = 0              # > 0: train rank-r LoRA updates of lora_targets only, every pretrained
                                    # weight frozen (needs init_from; model/lora.py); 0 = train every weight
    lora_alpha: float = 16.0        # the updates' scale is lora_alpha / lora_rank
    lora_dropout: float = 0.0       # dropout on the updates' input
    lora_targets: str = "attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj"  # comma-separated projections of each block
    compile: bool = False           # torch.compile the model (the flash kernel is a custom op: no graph break)
    cuda_graphs: bool = False       # with compile, on one CUDA GPU: replay each micro-batch's compiled forward
                                    # and backward as CUDA graphs (torch.compile mode "reduce-overhead"), so
                                    # the GPU does not wait for the host between their kernels
    doc_mask: bool = False          # attention stays within each document of a packed row (documents end after
                                    # the end-of-text token) and positions restart at 0 for each document
    parallel: str = "ddp"           # "ddp" (each rank holds the whole model) | "fsdp" (FSDP2: sharded over ranks)
    activation_checkpointing: bool = False  # recompute each block's activations in backward (less memory)
    fsdp_blocks_per_unit: int = 0   # parallel=fsdp: consecutive blocks gathered, resharded and compiled together;
                                    # larger units cost more memory while gathered and less host time per step;
                                    # 0 = automatic: on one rank units of up to 12 blocks, on several one block
    wandb: bool = False             # log to Weights & Biases (offline when there is no key or network)
    wandb_project: str = "flashgpt"
    wandb_run_name: str = ""
    peak_tflops: float = 0.0        # accelerator's dense bf16 peak for MFU; 0 = detect (H100/H200 989, A100 312)

    def validate(self) -> "TrainConfig":
        positive = ("batch_size", "grad_accum_steps", "max_iters", "eval_interval", "eval_iters",
                    "log_interval", "keep_last")
        for key in positive:
            if getattr(self, key) <= 0:
                raise ConfigError(f"train.{key}={getattr(self, key)!r}: must be positive")
        if self.fsdp_blocks_per_unit < 0:
            raise ConfigError(f"train.fsdp_blocks_per_unit={self.fsdp_blocks_per_unit!r}: must be a number of "
                              "blocks, or 0 (automatic)")
        if not self.learning_rate > 0:
            raise ConfigError(f"train.learning_rate={self.learning_rate!r}: must be positive")
        if not 0 <= self.min_lr <= self.learning_rate:
            raise ConfigError(f"train.min_lr={self.min_lr!r}: must be in [0, learning_rate]")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"train.lr_schedule={self.lr_schedule!r}: must be one of {', '.join(LR_SCHEDULES)}")
        if not 0 < self.lr_decay_frac <= 1:
            raise ConfigError(f"train.lr_decay_frac={self.lr_decay_frac!r}: must be in (0, 1]")
        for key in ("warmup_iters", "lr_decay_iters", "weight_decay", "grad_clip", "max_time"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key}={getattr(self, key)!r}: must not be negative")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)!r}: must be in [0, 1)")
        if self.eval_hellaswag_interval < 0:
            raise ConfigError(f"train.eval_hellaswag_interval={self.eval_hellaswag_interval!r}: must not be "
                              "negative (0 = off)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"train.dtype={self.dtype!r}: must be auto, float32, bfloat16 or float16")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"train.device={self.device!r}: must be auto, cpu, cuda or cuda:N")
        if self.parallel not in ("ddp", "fsdp"):
            raise ConfigError(f"train.parallel={self.parallel!r}: must be 'ddp' or 'fsdp'")
        if self.cuda_graphs:
            if not self.compile:
                raise ConfigError("train.cuda_graphs=true needs train.compile=true (the graphs are torch.compile's)")
            if self.parallel == "fsdp":
                raise ConfigError("train.cuda_graphs=true with train.parallel=fsdp: FSDP's collectives cannot be "
                                  "captured in a CUDA graph; use train.parallel=ddp or train.cuda_graphs=false")
            if self.doc_mask:
                raise ConfigError("train.cuda_graphs=true with train.doc_mask=true: each batch's document "
                                  "boundaries have their own shape, which a CUDA graph cannot replay; turn one off")
        if not self.init_from or self.init_from == "hf:":
            raise ConfigError(f"train.init_from={self.init_from!r}: must be 'scratch', 'resume', "
                              "'hf:<repo-or-dir>' or a run folder / checkpoint file")
        if self.peak_tflops < 0:
            raise ConfigError(f"train.peak_tflops={self.peak_tflops!r}: must not be negative")
        self._validate_lora()
        if not self.out_dir:
            raise ConfigError("train.out_dir: must not be empty")
        return self

    def _validate_lora(self) -> None:
        if self.lora_rank < 0:
            raise ConfigError(f"train.lora_rank={self.lora_rank!r}: must be a rank, or 0 (no LoRA: train every "
                              "weight)")
        if not self.lora_alpha > 0:
            raise ConfigError(f"train.lora_alpha={self.lora_alpha!r}: must be positive")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"train.lora_dropout={self.lora_dropout!r}: must be in [0, 1)")
        targets = [t.strip() for t in self.lora_targets.split(",")]
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or len(set(targets)) != len(targets):
            raise ConfigError(f"train.lora_targets={self.lora_targets!r}: "
                              + (f"unknown {unknown[0]!r}" if unknown else "a projection named twice")
                              + f"; choose from {', '.join(LORA_TARGETS)}")
        if not self.lora_rank:
            return
        if self.init_from == "scratch":
            raise ConfigError(f"train.lora_rank={self.lora_rank}: LoRA adapts pretrained weights; set "
                              "train.init_from to hf:<repo-or-dir> or a run folder (or lora_rank=0)")
        if self.parallel == "fsdp":
            raise ConfigError(f"train.lora_rank={self.lora_rank} with train.parallel=fsdp: not supported (the "
                              "frozen weights would be sharded with the trained ones); use train.parallel=ddp")

    def lora_settings(self) -> LoRASettings | None:
        """The LoRA of this run (None: every weight trained)."""
        if not self.lora_rank:
            return None
        return LoRASettings(self.lora_rank, self.lora_alpha, self.lora_dropout,
                            tuple(t.strip() for t in self.lora_targets.split(",")))


@dataclass
class RunConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # "section.key" → where its value came from (a config file's path, or "--key=value"); keys left at their
    # defaults are absent. Not part of the config itself: not compared, not saved.
    origins: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def validate(self) -> "RunConfig":
        if self.train.init_from in ("scratch", "resume"):
            # a run from pretrained weights takes [model] from them: training/pretrained.py's settle_run_config
            # names the keys that contradict them and validates the result (so a RoPE key may be set there
            # without pos_emb, which the weights give); GPT(config) validates whatever it builds
            self.model.validate()
        self.data.validate()
        self.train.validate()
        if self.train.doc_mask and self.data.format == "bin" and self.data.tokenizer == "char":
            raise ConfigError(NO_EOT_FOR_DOC_MASK.format(what="the char tokenizer of data.format = 'bin'"))
        if self.data.tokenizer == "model" and self.train.init_from == "scratch":
            raise ConfigError("data.tokenizer='model' is the tokenizer of a pretrained model: set train.init_from "
                              "to 'hf:<repo-or-dir>' or a run folder, or choose 'char', 'gpt2' or 'hf:<repo-or-dir>'")
        return self

    def to_dict(self) -> dict:
        return {section: dataclasses.asdict(getattr(self, section)) for section in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        cfg = cls()
        for section, values in d.items():
            _apply_section(cfg, section, values)
        return cfg.validate()


SECTIONS = ("model", "data", "train")
NO_EOT_FOR_DOC_MASK = ("train.doc_mask = true needs documents that end with an end-of-text token, and {what} has "
                       "none: use data.format = 'shards' (its char tokenizer adds one) or the gpt2 tokenizer")


def is_hf_name(value: str) -> bool:
    """Whether a tokenizer or init_from value names a Hugging Face model: "hf:<repo-or-dir>"."""
    return value.startswith("hf:") and len(value) > 3


def _field_types(obj) -> dict[str, type]:
    hints = typing.get_type_hints(type(obj))
    return {f.name: hints[f.name] for f in dataclasses.fields(obj)}


def _coerce(value, typ: type, key: str, from_text: bool):
    """Check (TOML) or parse (command line) one value against the field's declared type."""
    if from_text:
        text = value.strip()
        if typ is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
            raise ConfigError(f"{key}={value!r}: expected true or false")
        try:
            value = typ(text) if typ is not str else value
        except ValueError:
            raise ConfigError(f"{key}={value!r}: expected {typ.__name__}") from None
    elif typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key}={value!r}: expected {typ.__name__}, got {type(value).__name__}")
    if typ is float and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r}: must be a finite number")
    return value


def _apply_section(cfg: RunConfig, section: str, values, from_text: bool = False, origin: str | None = None) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section [{section}]; expected one of {', '.join(SECTIONS)}")
    if not isinstance(values, dict):
        raise ConfigError(f"[{section}] must be a table of key = value")
    obj = getattr(cfg, section)
    types = _field_types(obj)
    for key, value in values.items():
        if key not in types:
            raise ConfigError(f"unknown config key {section}.{key}; valid keys: {', '.join(types)}")
        setattr(obj, key, _coerce(value, types[key], f"{section}.{key}", from_text))
        if origin is not None:
            cfg.origins[f"{section}.{key}"] = origin


def _resolve_key(cfg: RunConfig, key: str) -> tuple[str, str]:
    if "." in key:
        section, _, name = key.partition(".")
        return section, name
    owners = [s for s in SECTIONS if key in _field_types(getattr(cfg, s))]
    if not owners:
        raise ConfigError(f"unknown config key {key!r}")
    if len(owners) > 1:
        raise ConfigError(f"config key {key!r} is ambiguous: write one of {', '.join(f'{s}.{key}' for s in owners)}")
    return owners[0], key


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    for arg in overrides:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"bad override {arg!r}: expected --key=value")
        key, _, value = arg[2:].partition("=")
        section, name = _resolve_key(cfg, key)
        _apply_section(cfg, section, {name: value}, from_text=True, origin=arg)
    return cfg


def load_config(path: str | None, overrides: list[str] = ()) -> RunConfig:
    """Defaults ← TOML file ← overrides, then validated. Raises ConfigError with a one-line message."""
    cfg = RunConfig()
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except IsADirectoryError:
            raise ConfigError(f"config path is a folder, not a TOML file: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for section, values in data.items():
            _apply_section(cfg, section, values, origin=path)
    apply_overrides(cfg, list(overrides))
    return cfg.validate()


def format_config(cfg: RunConfig) -> str:
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for key, value in dataclasses.asdict(getattr(cfg, section)).items():
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines)


# Resuming: the checkpoint's [model] and [data] describe the weights and the data they were trained on; the
# [train] keys may change. Of [model] and [data], these say how to work, not what: a resumed run takes them
# from its own invocation when given there.
RESUME_FROM_INVOCATION = ("data.num_proc", "data.cache_dir")
# Values that mean "whatever the run resolved" and so never contradict a checkpoint.
UNRESOLVED = {"model.attention": "auto", "model.vocab_size": 0}


@dataclass(frozen=True)
class Change:
    """A [model]/[data] value asked for on resume that differs from the checkpoint's."""
    key: str       # "section.key"
    saved: object  # the checkpoint's value
    asked: object  # the value asked for
    origin: str    # where it was asked for: a config file's path or "--key=value"

    def __str__(self) -> str:
        return f"{self.key}={self.asked!r} ({self.origin}) against the checkpoint's {self.saved!r}"


def resume_config(requested: RunConfig, saved: RunConfig) -> tuple[RunConfig, list[Change]]:
    """The config a resumed run uses, and the contradictions in the request.

    The result holds the checkpoint's [model] and [data] (with RESUME_FROM_INVOCATION keys taken from the
    request where it sets them) and the request's [train]. Each [model]/[data] key the request sets (in its
    config file or as a flag; `origins`) to a value other than the checkpoint's is a Change, NOT applied:
    the caller refuses or applies them (`apply_changes`), never drops them silently.
    """
    cfg = RunConfig(model=dataclasses.replace(saved.model), data=dataclasses.replace(saved.data),
                    train=requested.train, origins=dict(requested.origins))
    changes = []
    for name, origin in requested.origins.items():
        section, _, key = name.partition(".")
        if section == "train":
            continue
        asked, was = getattr(getattr(requested, section), key), getattr(getattr(saved, section), key)
        if name in RESUME_FROM_INVOCATION:
            setattr(getattr(cfg, section), key, asked)
        elif asked != was and UNRESOLVED.get(name, object()) != asked:
            changes.append(Change(name, was, asked, origin))
    return cfg, changes


def apply_changes(cfg: RunConfig, changes: list[Change]) -> RunConfig:
    for change in changes:
        section, _, key = change.key.partition(".")
        setattr(getattr(cfg, section), key, change.asked)
    return cfg.validate()
