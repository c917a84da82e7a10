"""Does the training step slow down as the GPU runs longer at its power cap? One variant, many steps, one process.

    python bench/step_drift.py [--variant flash+compile] [--steps 400] [--windows 25,100,200] [--out DIR]

bench/train.py times 20 steps after a short warm-up; train.py's loop runs for minutes and was measured ~4%
slower (bench/results/train_loop_pin/). This runs bench/train.py's step (GPT-2 124M, batch 16 x 1024, bf16,
fused AdamW, one fixed batch) --steps times after the warm-up, each synchronised, and reports the median step
of each window of steps (window edges --windows), with the GPU's SM clock, power and temperature at each
window's end when nvidia-ml-py is installed. Writes step_drift.md.
"""
from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.report import write_report  # noqa: E402


def gpu_state():
    """A function returning 'SM MHz, W, °C' of the current GPU now, or None without nvidia-ml-py."""
    from bench.train import nvml_handle
    nvml = nvml_handle()
    if nvml is None:
        return None
    pynvml, h = nvml
    return lambda: (f"{pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)} MHz, "
                    f"{pynvml.nvmlDeviceGetPowerUsage(h) / 1000:.0f} W, "
                    f"{pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)} °C")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", default="flash+compile")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--windows", default="25,100,200", help="step counts where a window ends (the last: --steps)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    from bench.train import make_train_step, parse_variant, timed_steps, use_variant
    try:
        parse_variant(args.variant)
        edges = sorted({int(x) for x in args.windows.split(",") if x} | {args.steps})
    except ValueError as e:
        p.error(str(e))
    if args.steps < 1 or edges[0] < 1:
        p.error("--steps and the window edges must be at least 1")
    if not torch.cuda.is_available():
        print("error: bench/step_drift.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    attention, compiled = use_variant(args.variant)
    _, step = make_train_step(attention, compiled, 16, 1024)
    for _ in range(5):  # warm-up, compile included
        step()
    torch.cuda.synchronize()
    state = gpu_state()
    lines = [f"# Step time over a long run — {torch.cuda.get_device_name()}", "",
             f"`python bench/step_drift.py {' '.join(argv if argv is not None else sys.argv[1:])}` — "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, torch {torch.__version__}; "
             f"{args.variant}, GPT-2 124M, batch 16×1024, bf16, fused AdamW, synchronised steps after 5 warm-up steps",
             "", "| steps | median step (ms) | min–max (ms) | at the window's end |", "| --- | --- | --- | --- |"]
    done = 0
    for edge in [e for e in edges if e <= args.steps]:
        times = timed_steps(step, edge - done)
        lines.append(f"| {done + 1}–{edge} | {statistics.median(times):.2f} | {min(times):.2f}–{max(times):.2f} | "
                     f"{state() if state else '—'} |")
        print(lines[-1], flush=True)
        done = edge
    write_report(args.out, "step_drift.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
