"""Data-parallel scaling on one node: train.py on 1 GPU vs torchrun on N GPUs with the same global batch.

    python bench/ddp_scaling.py [--gpus 2] [--steps 40] [--out DIR] [-- extra train.py overrides]

GPT-2 124M (configs/gpt2_124m.toml) on the Shakespeare GPT-2-BPE token files, compile off, bf16 autocast.
The single-GPU run uses grad_accum_steps = N · a, the N-GPU run a per rank, so both take identical
optimizer steps (train.py draws one global batch and every rank reads its rows). Throughput is the median
of the logged tokens/s after the first quarter of the steps; efficiency = tok/s(N) / (N · tok/s(1)).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(cmd, out_dir, env) -> dict:
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"exit {r.returncode}: {r.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    steps = [x for x in rows if "tokens_per_s" in x]
    steady = steps[len(steps) // 4:]
    evals = [x for x in rows if "val_loss" in x]
    return {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in steady),
            "mfu": statistics.median(x.get("mfu", 0) for x in steady),
            "peak_mem_gib": max(x.get("peak_mem_gib", 0) for x in steady),
            "final_loss": steps[-1]["loss"], "val_loss": evals[-1]["val_loss"] if evals else None,
            "losses": [x["loss"] for x in steps]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per rank per step in the N-GPU run")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("overrides", nargs="*", help="extra --key=value for train.py")
    args = p.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    base = [os.path.join(ROOT, "configs", "gpt2_124m.toml"), "--dataset=shakespeare", "--compile=false",
            f"--max_iters={args.steps}", "--eval_interval=100000", "--eval_iters=2", "--log_interval=1",
            "--warmup_iters=10", "--keep_last=1", *args.overrides]
    work = ROOT / "runs" / "ddp_scaling"
    one_dir, many_dir = work / "gpu1", work / f"gpu{args.gpus}"
    for d in (one_dir, many_dir):
        subprocess.run(["rm", "-rf", str(d)])
    one = run([sys.executable, "train.py", *base, f"--out_dir={one_dir}", f"--grad_accum_steps={args.accum * args.gpus}"],
              one_dir, env)
    many = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
                "train.py", *base, f"--out_dir={many_dir}", f"--grad_accum_steps={args.accum}"], many_dir, env)
    eff = many["tokens_per_s"] / (args.gpus * one["tokens_per_s"])
    gap = max(abs(a - b) for a, b in zip(one["losses"], many["losses"]))
    import torch
    text = "\n".join([
        f"# DDP scaling — {args.gpus} × {torch.cuda.get_device_name()} (torchrun, NCCL)", "",
        f"`python bench/ddp_scaling.py --gpus {args.gpus} --steps {args.steps} --accum {args.accum}` — GPT-2 124M "
        f"(configs/gpt2_124m.toml, compile off), batch 16×1024 per micro-step, global batch "
        f"{16 * args.accum * args.gpus}×1024 per step in both runs, bf16 autocast, {args.steps} steps", "",
        "| run | tokens/s | MFU per GPU | peak memory per GPU (GiB) | final step loss |",
        "| --- | --- | --- | --- | --- |",
        f"| 1 GPU, accum {args.accum * args.gpus} | {one['tokens_per_s']:,.0f} | {one['mfu']:.1%} | "
        f"{one['peak_mem_gib']:.1f} | {one['final_loss']:.4f} |",
        f"| {args.gpus} GPUs (DDP), accum {args.accum} | {many['tokens_per_s']:,.0f} | {many['mfu']:.1%} | "
        f"{many['peak_mem_gib']:.1f} | {many['final_loss']:.4f} |", "",
        f"Scaling efficiency: **{eff:.1%}** ({many['tokens_per_s'] / one['tokens_per_s']:.2f}× on {args.gpus} GPUs). "
        f"Largest per-step loss difference between the two runs: {gap:.2e} (bf16 autocast, different reduction order).",
    ]) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ddp_scaling.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "ddp_scaling.json"), "w") as f:
        json.dump({"one": one, "many": many, "efficiency": eff, "max_loss_gap": gap, "gpus": args.gpus}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
