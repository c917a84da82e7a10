"""GPU time of each kernel of one flash backward at the training shape, split against fused, by torch.profiler.

    python bench/bwd_kernels.py [--shape 16,12,1024,64] [--calls 20] [--modes split,fused:1,fused:2] [--out DIR]

Each mode is FLASHGPT_BWD (split or fused) with, for fused, the FLASHGPT_FUSED_DQ way of adding dQ (1 element
atomics, 2 TMA reduce-adds on Hopper). Inputs as bench/tiles.py's: packed
q/k/v views, causal, bf16; tile configs from the autotuner (tuned before profiling). Writes bwd_kernels.md:
per mode the mean GPU time per call of each kernel and their sum.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.report import write_report  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="16,12,1024,64", help="B,H,N,D (causal, packed q/k/v, bf16)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--modes", default="split,fused:1,fused:2")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m != "split" and not (m.startswith("fused:") and m[6:] in ("1", "2")):
            p.error(f"--modes: expected split or fused:1|2, got {m!r}")
    if not torch.cuda.is_available():
        print("error: bench/bwd_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    from torch.profiler import ProfilerActivity, profile

    from bench.tiles import packed_inputs
    from kernels import flash as fa

    B, H, N, D = (int(x) for x in args.shape.split(","))
    q, k, v, do, grads, scale = packed_inputs(args.shape)
    o, lse = fa._fwd(q, k, v, True, scale)
    lines = [f"# Flash backward kernels at (B, H, N, D) = ({B}, {H}, {N}, {D}), causal bf16 — "
             f"{torch.cuda.get_device_name()}", "",
             f"`python bench/bwd_kernels.py {' '.join(argv if argv is not None else sys.argv[1:])}` — "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, torch {torch.__version__}, "
             f"triton {triton.__version__}; mean GPU time per call over {args.calls} calls (torch.profiler)", ""]
    for mode in modes:
        os.environ["FLASHGPT_BWD"] = mode.split(":")[0]
        if ":" in mode:
            os.environ["FLASHGPT_FUSED_DQ"] = mode.split(":")[1]
        fa._picked.clear()
        for _ in range(3):  # tunes, records the plan, replays it
            fa._bwd(do, q, k, v, o, lse, True, scale, out=grads)
        torch.cuda.synchronize()
        picks = {key[0]: "x".join(map(str, cfg)) for key, cfg in fa._picked.items()}
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                fa._bwd(do, q, k, v, o, lse, True, scale, out=grads)
            torch.cuda.synchronize()
        per = collections.defaultdict(float)
        for ev in prof.key_averages():
            if ev.device_time_total > 0:
                per[ev.key] += ev.device_time_total / args.calls
        lines += [f"## {mode} (autotuner's picks: {', '.join(f'{k} {v}' for k, v in picks.items()) or 'none'})", "",
                  "| kernel | µs per call |", "| --- | --- |"]
        lines += [f"| {name} | {t:.1f} |" for name, t in sorted(per.items(), key=lambda kv: -kv[1])]
        lines += [f"| **sum** | **{sum(per.values()):.1f}** |", ""]
    os.environ.pop("FLASHGPT_FUSED_DQ", None)
    os.environ["FLASHGPT_BWD"] = "split"
    write_report(args.out, "bwd_kernels.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
