"""Why FlashAttention matters, measured on your hardware: naive vs flash (vs sdpa) attention.

    python ablate.py [config.toml] [--key=value ...] [--out DIR] [--quick | --full] [--seq-lens 256,512,...]
                     [--skip-sweep] [--skip-train] [--skip-probe] [--train-iters N] [--budget S] [--wandb]

1. Kernel sweep over sequence lengths: forward and forward+backward time, peak memory and the HBM bytes of
   the standard I/O model (ablation/io_model.py) for naive, flash and sdpa; naive runs until it is out of memory.
2. Matched training runs of the config (default ablation/ablate.toml) with model.attention = naive, flash and
   sdpa (the noise reference): same seed, data order and config; overlaid loss curves, the measured gap,
   tokens/s and peak memory.
3. (CUDA) the largest context each backend fits: one model forward+backward at doubling block_size.

Writes report.md, results.json, readme_section.md and PNG plots into --out (default runs/ablate-<timestamp>), and logs them to
wandb when --wandb or train.wandb is on. On CUDA the full version runs by default; elsewhere a reduced one
(tiny sizes, flash through Triton's interpreter) that finishes in a few minutes. Config keys are validated
as in train.py: a bad key or value prints one line and exits with status 2.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

# numpy's BLAS threads (used by Triton's interpreter) spin after each call and would steal the cores from
# the next torch op being timed; the interpreter's matmuls are tiny anyway.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Flash runs through Triton's interpreter on a CPU; it must be on before anything imports triton (the model
    # imports the decode kernels, and triton reads this setting once).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels  # noqa: E402
from config import ConfigError, load_config  # noqa: E402
from training.runfolder import write_text_atomic  # noqa: E402

DEFAULT_CONFIG = os.path.join(ROOT, "ablation", "ablate.toml")  # installed with the ablation package
# Reduced mode: a tiny model and few steps (flash runs through the interpreter on a CPU). The user's own
# --key=value overrides come after these and win.
QUICK_OVERRIDES = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=64", "--batch_size=8",
                   "--max_iters=40", "--eval_interval=10", "--eval_iters=2", "--warmup_iters=5",
                   "--learning_rate=3e-3", "--min_lr=3e-4", "--max_time=0"]
# Every matched run logs every step (per-step comparison) and keeps one checkpoint besides best.pt.
MATCHED_OVERRIDES = ["--log_interval=1", "--keep_last=1", "--init_from=scratch"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other --key=value (or --section.key=value) overrides the config, as in train.py.\n"
               "Outputs: report.md, results.json, readme_section.md, sweep_time.png, sweep_memory.png,\n"
               "sweep_bytes_time.png, train_loss.png, probe_memory.png (CUDA), train-<backend>/ (each run's\n"
               "metrics; checkpoints only with --keep-checkpoints).")
    p.add_argument("config", nargs="?", default=None,
                   help=f"TOML config of the matched training runs (default {os.path.relpath(DEFAULT_CONFIG)})")
    p.add_argument("--out", help="run directory (default runs/ablate-<timestamp>); must be new or empty")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="reduced sizes (the default without CUDA)")
    mode.add_argument("--full", action="store_true", help="full sizes (the default on CUDA)")
    p.add_argument("--seq-lens", help="comma-separated sweep lengths, e.g. 256,1024,4096")
    p.add_argument("--skip-sweep", action="store_true", help="no kernel sweep")
    p.add_argument("--skip-train", action="store_true", help="no matched training runs (and no probe)")
    p.add_argument("--skip-probe", action="store_true", help="no largest-context probe")
    p.add_argument("--train-iters", type=int, help="optimizer steps of each matched run (train.max_iters)")
    p.add_argument("--train-backends", default="naive,flash,sdpa",
                   help="attention backends of the matched runs; the first is the reference (default %(default)s)")
    p.add_argument("--probe-batch", type=int, default=4, help="batch of the context probe (default %(default)s)")
    p.add_argument("--probe-max", type=int, default=65536, help="longest context the probe tries (default %(default)s)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the matched runs' *.pt files")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole ablation (default 210 in full CUDA mode, else none): the sweep "
                        "stops starting new lengths after 30%%, each training run gets train.max_time ≤ 40%% "
                        "split between the runs, the probe 20%%")
    return p


def parse_args(argv):
    argv = ["--train.wandb=true" if a == "--wandb" else a for a in argv]
    args, overrides = build_parser().parse_known_args(argv)
    for name in ("seq_lens", "train_backends"):
        setattr(args, name, _csv(getattr(args, name), int if name == "seq_lens" else str, name))
    if args.train_iters is not None and args.train_iters <= 0:
        raise ConfigError(f"--train-iters={args.train_iters}: must be positive")
    bad = [b for b in args.train_backends if b not in kernels.BACKENDS]
    if bad or not args.train_backends:
        raise ConfigError(f"--train-backends: {','.join(bad) or 'empty'}: choose from {', '.join(kernels.BACKENDS)}")
    return args, overrides


def _csv(text, typ, name):
    if text is None:
        return None
    try:
        values = [typ(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--{name.replace('_', '-')}={text!r}: expected comma-separated {typ.__name__}s") from None
    if typ is int and any(v <= 0 for v in values):
        raise ConfigError(f"--{name.replace('_', '-')}={text!r}: lengths must be positive")
    return values


def prepare_run(argv):
    """Parse everything and validate the config before any work starts. Returns (args, cfg, device, full)."""
    from model.device import pick_device
    args, overrides = parse_args(argv)
    path = args.config or DEFAULT_CONFIG
    cfg = load_config(path, QUICK_OVERRIDES + MATCHED_OVERRIDES + overrides)  # validates the user's keys
    device = pick_device(cfg.train.device, what="train.device")
    full = args.full or (device.type == "cuda" and not args.quick)
    if full:
        cfg = load_config(path, MATCHED_OVERRIDES + overrides)
    if args.train_iters:
        cfg.train.max_iters = args.train_iters
    if args.budget is None:
        args.budget = 210.0 if full and device.type == "cuda" else 0.0
    args.out = args.out or os.path.join("runs", "ablate-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        raise ConfigError(f"--out {args.out}: exists and is not an empty folder; choose a new one")
    if not args.skip_train and not cfg.data.dataset.startswith("hf:"):
        from data.prepare import resolve_files
        resolve_files(cfg.data.dataset)  # DataError now rather than after the sweep
    return args, cfg, device, full


def write_outputs(results: dict, out: str, t0: float) -> list[str]:
    """Plots, results.json and report.md from what has been measured so far (called after every part, so an
    interrupted run still leaves a report)."""
    from ablation import report
    results["meta"]["seconds"] = time.time() - t0
    images = []
    if results.get("sweep"):
        images += report.plot_sweep(results["sweep"], out)
    if results.get("matched"):
        images.append(report.plot_training(results["matched"], out))
    if results.get("probe"):
        images.append(report.plot_probe(results["probe"], out))
    write_text_atomic(os.path.join(out, "results.json"), json.dumps(results, indent=1, default=str))
    report.write_report(results, out)
    report.write_readme_section(results, out)
    return images


def run(args, cfg, device, full, command: str) -> tuple[dict, int]:
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    results = {"meta": {"command": command, "mode": "full" if full else "reduced", "device": str(device),
                        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                        "torch": torch.__version__, "triton": _version("triton"),
                        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}}
    status = 0
    if not args.skip_sweep:
        from ablation.sweep import default_settings, run_sweep
        s = default_settings(device, full)
        s.seq_lens = args.seq_lens or s.seq_lens
        s.deadline = t0 + 0.3 * args.budget if args.budget else 0.0
        print(f"kernel sweep: B={s.B} H={s.H} D={s.D} {s.dtype} N={s.seq_lens}", flush=True)
        results["sweep"] = run_sweep(s)
        write_outputs(results, args.out, t0)
    if args.skip_train:
        results["matched_note"] = results["probe_note"] = "Skipped (--skip-train)."
    else:
        status = _train_part(args, cfg, device, results, t0)
    images = write_outputs(results, args.out, t0)
    if cfg.train.wandb:
        from ablation.report import log_wandb
        log_wandb(results, args.out, images, cfg.train.wandb_project, cfg.train.wandb_run_name)
    print(f"report: {os.path.join(args.out, 'report.md')} ({len(images)} plots) in "
          f"{results['meta']['seconds']:.0f} s")
    return results, status


def _train_part(args, cfg, device, results, t0) -> int:
    from ablation.matched import probe_context, run_matched
    from data.errors import DataError
    from data.tokenizers import TokenizerError
    from training.errors import TrainError
    backends = args.train_backends
    if args.budget:
        share = max(5.0, (t0 + 0.7 * args.budget - time.time()) / len(backends))
        cfg.train.max_time = min(cfg.train.max_time or share, share)
    m = cfg.model
    tiles = ("the interpreter's" if device.type != "cuda" else
             "autotuned" if kernels.options.get().autotune else "its default (autotune off)")
    results["matched_note"] = (
        f"Config: {os.path.relpath(args.config or DEFAULT_CONFIG)} with {m.n_layer} layers, {m.n_head} heads, "
        f"{m.n_embd} wide, block_size {m.block_size}, batch {cfg.train.batch_size}, dataset "
        f"{cfg.data.dataset!r} ({cfg.data.tokenizer}), {cfg.train.max_iters} steps"
        + (f" (stopped after {cfg.train.max_time:.0f} s if not done)" if cfg.train.max_time else "")
        + f", seed {cfg.train.seed}, dtype {cfg.train.dtype} (auto = bf16 autocast on CUDA, fp32 on CPU). "
        f"Only model.attention differs (flash with {tiles} tile configs). Δ is measured against {backends[0]}; sdpa "
        "(PyTorch's fused kernel) is the noise reference: a gap of the same size as sdpa's is the rounding of "
        "mixed precision, not a bug.")
    try:
        results["matched"] = run_matched(cfg, backends, args.out, keep_checkpoints=args.keep_checkpoints)
    except (DataError, TokenizerError, TrainError, ConfigError) as e:
        results["matched_note"] += f"\n\n**Training failed:** {e}"
        results["probe_note"] = "Not run: the training runs failed."
        print(f"error: matched training: {e}", file=sys.stderr)
        return 1
    write_outputs(results, args.out, t0)
    if device.type != "cuda":
        results["probe_note"] = ("Skipped on the CPU: there is no device memory to run out of, and the flash "
                                 "interpreter would take hours at long contexts. Run on a GPU.")
    elif args.skip_probe:
        results["probe_note"] = "Skipped (--skip-probe)."
    else:
        budget = max(10.0, t0 + args.budget - time.time() - 15) if args.budget else 120.0
        probe_backends = [b for b in backends if b != "sdpa"] or backends
        results["probe"] = probe_context(cfg.model, probe_backends, batch=args.probe_batch,
                                         start=min(1024, cfg.model.block_size), max_len=args.probe_max,
                                         time_budget=budget)
    return 0


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return "not installed"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from data.errors import DataError
    try:
        args, cfg, device, full = prepare_run(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # Flash runs its default tile configs instead of autotuning ~20 configs on first use, which would cost tens of
    # seconds of compiling inside the first timed training step (FLASHGPT_AUTOTUNE=1 turns autotuning back on).
    with kernels.options.use_defaults(autotune=False):
        _, status = run(args, cfg, device, full, "python ablate.py " + " ".join(argv))
    return status


if __name__ == "__main__":
    sys.exit(main())
