"""Host time of a training step's end under FSDP2 against plain training: clipping, AdamW, zero_grad.

    python bench/fsdp_host.py [--layers 12] [--width 32] [--repeat 50] [--device cpu|cuda] [--out DIR]

The model is GPT-2-deep (its 148 parameter tensors at 12 layers) and narrow, so the arithmetic costs next to
nothing and what is timed is the host's work per call: train.py's clip_grad_norm (model/parallel.py), the
optimizer's step (AdamW as GPT.configure_optimizer builds it: fused on CUDA, foreach on the CPU, on the local
shards under FSDP2; torch's AdamW with the same groups and settings; the same groups one tensor at a time) and
zero_grad, each the median of --repeat calls, synchronised on CUDA. FSDP2 runs on one process (a one-rank
group), one unit of every block, so the same parameters are DTensors there and plain tensors in the other model;
`torch clip` is torch.nn.utils.clip_grad_norm_ on the same parameters (DTensor dispatch for every gradient).
Writes fsdp_host.md into --out (default bench/results/scaling/fsdp_host).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.report import git_commit, write_report  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.parallel import (clip_grad_norm, end_single_process_group, fsdp_available, shard_model,  # noqa: E402
                            start_single_process_group)


def _median_ms(fn, repeat: int, cuda: bool) -> float:
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(model: GPT, device: torch.device, repeat: int) -> dict:
    """Median ms per call of each piece of a step's end, after a backward has made every gradient."""
    cuda = device.type == "cuda"
    optimizer = model.configure_optimizer(0.1, 1e-4, (0.9, 0.95), device.type)
    x = torch.randint(0, model.config.vocab_size, (2, model.config.block_size), device=device)
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()  # the optimizer's state exists from here on
    row = {"clip": _median_ms(lambda: clip_grad_norm(model, 1.0), repeat, cuda),
           "torch clip": _median_ms(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), repeat, cuda),
           "optimizer step": _median_ms(optimizer.step, repeat, cuda)}
    groups = [{k: v for k, v in g.items() if k not in ("foreach", "fused")} for g in optimizer.param_groups]
    dispatched = torch.optim.AdamW(groups, foreach=optimizer.defaults["foreach"], fused=optimizer.defaults["fused"])
    dispatched.step()
    row["torch AdamW"] = _median_ms(dispatched.step, repeat, cuda)
    single = torch.optim.AdamW(groups, foreach=False, fused=False)
    single.step()
    row["AdamW one tensor at a time"] = _median_ms(single.step, repeat, cuda)
    grads = [p.grad for p in model.parameters()]

    def zero_and_restore():
        optimizer.zero_grad(set_to_none=True)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
    row["zero_grad + restore"] = _median_ms(zero_and_restore, repeat, cuda)
    row["tensors"] = len(grads)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=32, help="n_embd (2 heads)")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "scaling", "fsdp_host"))
    args = p.parse_args(argv)
    if args.layers < 1 or args.width < 2 or args.width % 2 or args.repeat < 1:
        print("error: --layers and --repeat must be at least 1, --width an even number of at least 2",
              file=sys.stderr)
        return 2
    if not fsdp_available():
        print("error: this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but no CUDA GPU is available", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_head=2, n_embd=args.width, block_size=32, vocab_size=64,
                    attention="naive")
    rows = {"plain": measure(GPT(cfg).to(device), device, args.repeat)}
    start_single_process_group(device)
    try:
        sharded = GPT(cfg).to(device)
        shard_model(sharded, device, None, args.layers)
        rows["FSDP2"] = measure(sharded, device, args.repeat)
    finally:
        end_single_process_group()
    pieces = ["clip", "torch clip", "optimizer step", "torch AdamW", "AdamW one tensor at a time",
              "zero_grad + restore"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = ["# Host time of a step's end: FSDP2 (one rank) against plain training", "",
             f"`python bench/fsdp_host.py --layers {args.layers} --width {args.width} --repeat {args.repeat} "
             f"--device {args.device}` at commit {git_commit()}, "
             f"{datetime.datetime.now().isoformat(timespec='seconds')}; {name}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} intra-op threads.", "",
             f"Median ms per call ({rows['plain']['tensors']} parameter tensors; a narrow model, so this is the "
             "host's time per call):", "",
             "| | " + " | ".join(pieces) + " |", "| --- |" + " ---: |" * len(pieces)]
    for label, row in rows.items():
        lines.append(f"| {label} | " + " | ".join(f"{row[k]:.2f}" for k in pieces) + " |")
    lines += ["", "`clip` is train.py's clip_grad_norm (on local shards under FSDP2); `torch clip` is "
              "torch.nn.utils.clip_grad_norm_ on the same parameters; `optimizer step` is the AdamW that "
              "GPT.configure_optimizer builds (model/shard_adamw.py: on local shards under FSDP2; fused on CUDA, "
              "foreach on the CPU), `torch AdamW` torch.optim.AdamW with the same groups and settings (under "
              "FSDP2 its step goes through DTensor dispatch), `AdamW one tensor at a time` the same groups with "
              "foreach and fused off."]
    write_report(args.out, "fsdp_host.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
