"""Where the GPU waits in a synchronised training step: idle time between kernels, flash vs sdpa.

    python bench/idle_gaps.py [--out DIR] [--steps 10] [--backends flash,sdpa]

bench/train.py times each GPT-2 124M step (batch 16 x 1024, bf16 autocast, torch.compile, fused AdamW) from a
CUDA event recorded after the previous step's synchronisation; whatever host work the GPU waits for inside
that window counts. This records the kernels of such steps (CUPTI only: no CPU-side profiling, which would
inflate host time) and splits each step's event time into kernel time, idle time between kernels, and the
lead (event start to first kernel plus last kernel to end event). The idle gaps are summed by the pair of
kernels around them, so the table names where the host falls behind; the kernels whose GPU time per step
differs between the backends are listed too. Writes idle_gaps.md into --out.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import os
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def _bench_train():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _short(name: str) -> str:
    return name if len(name) <= 48 else name[:45] + "..."


def measure(backend: str, steps: int, min_gap_us: float) -> tuple[dict, list, dict]:
    bench_train = _bench_train()
    _, step = bench_train.make_train_step(backend, compiled=True, batch=16, block=1024)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        event_ms = bench_train.timed_steps(step, steps)
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per_step = len(kernels) // steps
    rows, gaps, by_name = [], collections.defaultdict(float), collections.defaultdict(lambda: [0.0, 0.0])
    for k in kernels[:per_step * steps]:
        by_name[k.name][0] += (k.time_range.end - k.time_range.start) / steps
        by_name[k.name][1] += 1 / steps
    for s in range(steps):
        ks = kernels[s * per_step:(s + 1) * per_step]
        busy_until, busy, idle = ks[0].time_range.start, 0.0, 0.0
        for prev, k in zip([None, *ks[:-1]], ks):
            t0, t1 = k.time_range.start, k.time_range.end
            gap = t0 - busy_until
            if gap > 0:
                idle += gap
                if prev is not None and gap >= min_gap_us:
                    gaps[(_short(prev.name), _short(k.name))] += gap / steps
            busy += max(0.0, t1 - max(t0, busy_until))
            busy_until = max(busy_until, t1)
        span = busy_until - ks[0].time_range.start
        rows.append({"event_ms": event_ms[s], "kernel_ms": busy / 1e3, "idle_ms": idle / 1e3,
                     "lead_ms": event_ms[s] - span / 1e3})
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    summary["kernels"] = per_step
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return summary, sorted(gaps.items(), key=lambda kv: -kv[1]), dict(by_name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--backends", default="flash,sdpa")
    p.add_argument("--min-gap-us", type=float, default=5.0, help="gaps shorter than this are not tabled")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: bench/idle_gaps.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    lines = [f"# Idle GPU time in a synchronised training step — {torch.cuda.get_device_name()}", "",
             f"`python bench/idle_gaps.py {' '.join(sys.argv[1:])}` — "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, torch {torch.__version__}, "
             f"GPT-2 124M, batch 16×1024, compile; medians of {args.steps} steps", "",
             "| backend | event step (ms) | kernel (ms) | idle between kernels (ms) | lead + tail (ms) | kernels |",
             "| --- | --- | --- | --- | --- | --- |"]
    details, kernel_times = [], {}
    for backend in args.backends.split(","):
        s, gaps, kernel_times[backend] = measure(backend, args.steps, args.min_gap_us)
        lines.append(f"| {backend} | {s['event_ms']:.2f} | {s['kernel_ms']:.2f} | {s['idle_ms']:.2f} | "
                     f"{s['lead_ms']:.2f} | {s['kernels']} |")
        details += ["", f"## {backend}: idle gaps ≥ {args.min_gap_us:g} µs by the kernels around them "
                        "(µs per step, top 20)", "", "| µs | before | after |", "| --- | --- | --- |"]
        details += [f"| {us:.0f} | {a} | {b} |" for (a, b), us in gaps[:20]]
        print("\n".join(lines[-1:]), flush=True)
    if len(kernel_times) == 2:
        (a, ta), (b, tb) = kernel_times.items()
        names = sorted(set(ta) | set(tb), key=lambda n: -abs(ta.get(n, [0])[0] - tb.get(n, [0])[0]))
        details += ["", f"## kernels whose GPU time per step differs by ≥ 2 µs: {a} vs {b} (µs per step, calls)", "",
                    f"| kernel | {a} µs | {a} calls | {b} µs | {b} calls |", "| --- | --- | --- | --- | --- |"]
        for n in names:
            x, y = ta.get(n, [0.0, 0.0]), tb.get(n, [0.0, 0.0])
            if abs(x[0] - y[0]) >= 2:
                details.append(f"| {n[:110]} | {x[0]:.1f} | {x[1]:.0f} | {y[0]:.1f} | {y[1]:.0f} |")
    text = "\n".join(lines + details) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "idle_gaps.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
