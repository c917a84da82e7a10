"""Matched training runs (same config, seed and data order; only model.attention differs) and a probe of
the largest context each attention backend fits.

Each run is train.train(cfg) into its own folder of the run directory; the comparison reads their
metrics.jsonl back: per-step |Δloss| against the first backend (naive), the val gap at the common
evaluations, tokens/s and peak memory.
"""
from __future__ import annotations

import copy
import gc
import os
import statistics
import time

import torch

from training.runlog import read_metrics


def run_matched(cfg, backends: list[str], out_dir: str, *, keep_checkpoints: bool = False, log=print) -> dict:
    """Train once per backend; returns {"runs": {backend: summary}, "compare": {...}}.

    The checkpoints (*.pt) are deleted after each run unless keep_checkpoints: the ablation needs only the
    metrics, and the run directory stays small enough to commit."""
    import train as train_mod
    runs = {}
    for backend in backends:
        c = copy.deepcopy(cfg)
        c.model.attention = backend
        c.train.out_dir = os.path.join(out_dir, f"train-{backend}")
        c.train.init_from = "scratch"
        if c.train.wandb_run_name:
            c.train.wandb_run_name = f"{c.train.wandb_run_name}-{backend}"
        log(f"matched training run: attention={backend} -> {c.train.out_dir}")
        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        summary = train_mod.train(c)
        runs[backend] = summarise_run(c.train.out_dir, summary)
        if not keep_checkpoints:
            for name in os.listdir(c.train.out_dir):
                if name.endswith(".pt"):
                    os.remove(os.path.join(c.train.out_dir, name))
    return {"runs": runs, "compare": compare_runs(runs, backends[0])}


def summarise_run(folder: str, summary: dict) -> dict:
    rows = read_metrics(os.path.join(folder, "metrics.jsonl"))
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    warm = steps[max(1, len(steps) // 10):] or steps  # the first steps include compilation / autotuning
    peak = [r["peak_mem_gib"] for r in steps if "peak_mem_gib" in r]
    return {"folder": folder, "metrics": os.path.join(folder, "metrics.jsonl"),
            "iters": summary.get("iters"), "seconds": summary.get("seconds"),
            "val_loss": summary.get("val_loss"), "unigram_val_loss": summary.get("unigram_val_loss"),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in warm) if warm else None,
            "peak_mem_gib": max(peak) if peak else None,
            "step_loss": {r["iter"]: r["loss"] for r in steps},
            "val": {r["iter"]: r["val_loss"] for r in evals}}


def compare_runs(runs: dict, base: str) -> dict:
    """Per-step max and mean |Δ train loss| and the val gap at the last common evaluation, vs `base`."""
    out = {}
    for name, run in runs.items():
        if name == base:
            continue
        ref = runs[base]
        common = sorted(set(ref["step_loss"]) & set(run["step_loss"]))
        diffs = [abs(run["step_loss"][i] - ref["step_loss"][i]) for i in common]
        evals = sorted(set(ref["val"]) & set(run["val"]))
        last = evals[-1] if evals else None
        out[name] = {"vs": base, "steps": len(common),
                     "max_abs_dloss": max(diffs) if diffs else None,
                     "mean_abs_dloss": sum(diffs) / len(diffs) if diffs else None,
                     "val_iter": last,
                     "val_gap": (run["val"][last] - ref["val"][last]) if last is not None else None,
                     "max_abs_dval": max((abs(run["val"][i] - ref["val"][i]) for i in evals), default=None)}
    return out


def probe_context(model_cfg, backends: list[str], *, batch: int, start: int, max_len: int, time_budget: float,
                  log=print) -> dict:
    """CUDA only: for each backend, one model fwd+bwd (bf16 autocast) at block_size = start, 2·start, …
    until it runs out of memory, reaches max_len or exceeds its share of time_budget seconds.

    Returns {backend: {"fits": [{"T", "peak_gib", "tokens_per_s"}], "oom_at": T or None, "stopped": why}}.
    The optimizer is left out: its state does not depend on the context length.
    """
    from kernels.flash import forced_configs, gpu_configs
    from model import GPT
    device = torch.device("cuda")
    hd = model_cfg.n_embd // model_cfg.n_head
    tiles = {k: gpu_configs(k, torch.bfloat16, hd)[0] for k in ("fwd", "dkdv", "dq")}  # no autotuning here
    results = {}
    for backend in backends:
        deadline = time.time() + time_budget / len(backends)
        res = {"fits": [], "oom_at": None, "stopped": f"reached the probe's limit T={max_len}"}
        T = start
        while T <= max_len:
            if time.time() > deadline:
                res["stopped"] = f"time budget ({time_budget / len(backends):.0f} s) spent before T={T}"
                break
            failure, entry = None, None
            try:
                entry = _probe_step(model_cfg, backend, T, batch, device, tiles, forced_configs, GPT)
            except RuntimeError as e:
                if not ("out of memory" in str(e).lower() or isinstance(e, torch.cuda.OutOfMemoryError)):
                    raise
                failure = T
            gc.collect()
            torch.cuda.empty_cache()
            if failure is not None:
                res["oom_at"] = T
                res["stopped"] = f"out of memory at T={T}"
                log(f"  probe {backend}: T={T} out of memory")
                break
            res["fits"].append(entry)
            log(f"  probe {backend}: T={T} fits, peak {entry['peak_gib']:.2f} GiB, "
                f"{entry['tokens_per_s']:,.0f} tokens/s")
            T *= 2
        results[backend] = res
    return {"batch": batch, "start": start, "max_len": max_len, "backends": results}


def _probe_step(model_cfg, backend, T, batch, device, tiles, forced_configs, GPT) -> dict:
    c = copy.deepcopy(model_cfg)
    c.block_size, c.attention = T, backend
    c.vocab_size = c.vocab_size or 64
    torch.manual_seed(0)
    model = GPT(c).to(device)
    x = torch.randint(0, c.vocab_size, (batch, T), device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with forced_configs(**tiles):
        times = []
        for _ in range(2):  # the first step compiles
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, x)
            loss.backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, x, loss
    return {"T": T, "peak_gib": peak, "tokens_per_s": batch * T / times[-1]}
