"""Train a GPT from a config.

    python train.py configs/demo.toml [--key=value ...] [--resume [--allow-config-change]]
    python train.py configs/finetune_tiny.toml --init-from hf:runs/llama_demo_hf   # fine-tune from weights
    torchrun --nproc_per_node=8 train.py configs/gpt2_124m.toml          # DistributedDataParallel
    torchrun --nproc_per_node=8 train.py configs/gpt2_124m.toml --parallel=fsdp   # FSDP2, sharded checkpoints

Writes into train.out_dir, while holding its lock (.lock): ckpt_<step>.pt (last train.keep_last kept) and
best.pt (under parallel=fsdp: folders ckpt_<step>/ and best_<step>/), config.toml, metrics.jsonl and loss.png
(and with train.export_hf, <out_dir>/hf: best.pt as a Hugging Face model). Ctrl-C or SIGTERM saves a
checkpoint after the step in flight and exits; --resume continues exactly.

train.init_from = "hf:<repo-or-dir>" or a run folder (--init-from gives the same) starts from those weights, with
their shape and tokenizer (training/pretrained.py); the run's own checkpoints then resume it like any other.

This file is the command line and the run folder's lock; the run itself is a Trainer (training/trainer.py):
setup() (checkpoint, data, model, log), then run(), whose loop is made of step(), log_step(), evaluate() and
checkpoint().
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

import torch

if not torch.cuda.is_available():  # flash on a CPU runs in Triton's interpreter, chosen before kernels load
    os.environ.setdefault("TRITON_INTERPRET", "1")

from config import SECTIONS, ConfigError, RunConfig, load_config  # noqa: E402
from data.errors import DataError  # noqa: E402
from data.tokenizers import TokenizerError  # noqa: E402
from model.checkpoint import CheckpointError  # noqa: E402
from training.distributed import setup_distributed, teardown_distributed  # noqa: E402
from training.errors import Stopped, TrainError  # noqa: E402
from training.runfolder import RunFolderError, RunLock  # noqa: E402
from training.signals import Interrupted, StopSignals  # noqa: E402
from training.trainer import Trainer  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    keys = []
    for section in SECTIONS:
        obj = getattr(RunConfig(), section)
        keys.append(f"  [{section}] " + ", ".join(f"{f.name}={getattr(obj, f.name)!r}"
                                                  for f in dataclasses.fields(obj)))
    p = argparse.ArgumentParser(
        description="Train a GPT from a TOML config, with --key=value overrides.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (defaults), overridable as --key=value or --section.key=value:\n" + "\n".join(keys))
    p.add_argument("config", nargs="?", help="TOML config file (see configs/)")
    p.add_argument("--resume", action="store_true", help="continue the run in train.out_dir from its last checkpoint")
    p.add_argument("--init-from", metavar="hf:REPO_OR_DIR | RUN_DIR",
                   help="start from pretrained weights, with their shape and tokenizer: the same as "
                        "--init_from=... (train.init_from; generate.py and eval.py take the same flag)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: apply [model]/[data] values that differ from the checkpoint's "
                        "(refused without it)")
    return p

def train(cfg: RunConfig, *, allow_config_change: bool = False) -> dict:
    """Run training to completion; returns a summary dict. Raises TrainError/ConfigError/DataError/CheckpointError
    with one line (Stopped on SIGINT/SIGTERM, after saving a checkpoint).

    Rank 0 holds the run folder's lock from before its first look at the folder until the end, however the
    run ends. allow_config_change: on resume, apply [model]/[data] values that differ from the checkpoint's."""
    if cfg.train.wandb:
        _require_wandb()
    rank, local_rank, world = setup_distributed(cfg.train.device)
    try:
        summary = _train_holding_the_folder(cfg, rank, local_rank, world, allow_config_change)
    except Stopped:
        teardown_distributed(world)  # every rank stopped after the same step: the group closes cleanly
        raise
    teardown_distributed(world)
    return summary


def _require_wandb() -> None:
    """train.wandb = true needs the wandb package: say so before any work rather than after the data is ready."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise TrainError("train.wandb = true needs the wandb package, which is not installed here "
                         "(pip install wandb, or leave wandb off)") from None


def _train_holding_the_folder(cfg: RunConfig, rank: int, local_rank: int, world: int,
                              allow_config_change: bool) -> dict:
    with contextlib.ExitStack() as stack:
        signals = stack.enter_context(StopSignals())
        if rank == 0:
            try:
                lock = stack.enter_context(RunLock(cfg.train.out_dir))
            except RunFolderError as e:
                raise TrainError(str(e)) from None
            if lock.took_over:
                print(f"note: {cfg.train.out_dir}: took over the lock left by {lock.took_over}", file=sys.stderr)
        trainer = Trainer(cfg, rank=rank, local_rank=local_rank, world=world, signals=signals,
                          allow_config_change=allow_config_change)
        stack.callback(trainer.close)
        if not trainer.setup():
            return trainer.summary()
        summary = trainer.run()
        if cfg.train.export_hf and rank == 0:
            summary["export"] = export_best(cfg.train.out_dir)
            if trainer.lora:
                summary["export_adapter"] = export_best_adapter(cfg.train.out_dir)
        return summary

def export_best(out_dir: str) -> str:
    """Export the run's best.pt as a Hugging Face model into <out_dir>/hf (replacing an earlier export)."""
    from data.tokenizers import TokenizerError
    from model.export import export_checkpoint
    target = os.path.join(out_dir, "hf")
    try:
        export_checkpoint(out_dir, target, prefer="best", force=True)
    except (CheckpointError, TokenizerError) as e:
        raise TrainError(f"training finished, but the export of its best checkpoint to {target} failed: {e}") \
            from None
    print(f"exported the best checkpoint as a Hugging Face model: {target}")
    return target


def export_best_adapter(out_dir: str) -> str:
    """Export the LoRA updates of the run's best.pt as a PEFT adapter into <out_dir>/hf_adapter."""
    from model.lora_export import export_adapter
    target = os.path.join(out_dir, "hf_adapter")
    try:
        export_adapter(out_dir, target, prefer="best", force=True)
    except CheckpointError as e:
        raise TrainError(f"training finished, but the export of its LoRA adapter to {target} failed: {e}") from None
    print(f"exported the best checkpoint's LoRA updates as a PEFT adapter: {target}")
    return target


def main(argv=None) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    try:
        if args.init_from is not None:
            if args.resume:
                raise ConfigError("--init-from and --resume: a resumed run continues from its own checkpoint; "
                                  "give one of them")
            overrides = [*overrides, f"--train.init_from={args.init_from}"]  # validated with the other keys
        cfg = load_config(args.config, overrides)
        if args.resume:
            cfg.train.init_from = "resume"
        if args.allow_config_change and cfg.train.init_from != "resume":
            raise ConfigError("--allow-config-change applies to --resume only")
        train(cfg, allow_config_change=args.allow_config_change)
    except (ConfigError, DataError, TokenizerError, CheckpointError, TrainError) as e:
        if isinstance(e, Stopped) and os.environ.get("RANK", "0") != "0":
            return 0  # rank 0 reports the stop (once); a failing rank here would make torchrun kill rank 0
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt as e:  # during setup: nothing to save yet
        name = e.signame if isinstance(e, Interrupted) else "SIGINT"
        print(f"error: interrupted ({name}) before training started; nothing was saved", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
