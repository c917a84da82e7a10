"""Where the one-launch decode step (kernels/decode_stack.py) spends its time: a phase-by-phase timeline.

    python bench/stack_timeline.py [--model smollm2|gpt2] [--pos 255] [--runs 5] [--out DIR]

One sequence of the benchmark's model (bench/generate.py's shapes, random weights, bf16) with its cache filled to
--pos positions; the stack runs once per run with its timeline on: every program with work in a phase stamps
the GPU's global timer (%globaltimer, nanoseconds, one clock for all SMs) when it has the phase's inputs and at
the phase's end (A: norm + QKV + RoPE, B: attention shares, M: merge of a head's shares, C: output projection +
residual, D1: norm + MLP up, D2: MLP down + residual). Per phase, over layers 1..L-2 and the runs (medians):

    programs      how many programs have work in the phase
    handoff µs    from the last program of the phase before ending to the median program having its inputs:
                  what passing the words on costs
    work µs       from having its inputs to its end: median over the programs, and the slowest
    span µs       from the last end of the phase before to this phase's last end (the spans add up to a layer)

Then the same launch without the timeline, timed as a CUDA graph of 20 back-to-back launches: µs per launch (the
stamps themselves add a little). Needs a CUDA GPU. Writes stack_timeline_<model>.md and .json to --out (default
bench/results/generate_smollm2/stack/).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.generate import build_model  # noqa: E402
from model.fused_decode import rope_tables, stack_plan  # noqa: E402
from kernels.decode_stack import N_STAMPS, decode_stack  # noqa: E402

PHASES = ["A qkv", "B attention", "M merge", "C out-proj", "D1 mlp up", "D2 mlp down"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("smollm2", "gpt2"), default="smollm2")
    p.add_argument("--pos", type=int, default=255, help="the token's position (cache length - 1), default 255")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench/results/generate_smollm2/stack"))
    return p.parse_args(argv)


def analyse(times: torch.Tensor, n_layers: int) -> list[dict]:
    """times (runs, programs, n_layers, N_STAMPS) ns, 0 where a program had no work → per phase: programs,
    handoff, work (median, slowest), span µs."""
    rows = []
    for p, name in enumerate(PHASES):
        cols = {k: [] for k in ("programs", "handoff", "work_med", "work_max", "span")}
        for r in range(times.shape[0]):
            for layer in range(1, n_layers - 1):
                t = times[r, :, layer].double()                              # (programs, N_STAMPS)
                before = t[:, 2 * p - 1] if p else times[r, :, layer - 1, 2 * len(PHASES) - 1].double()
                prev_end = before[before > 0].max()
                active = t[:, 2 * p + 1] > 0
                got, end = t[active, 2 * p], t[active, 2 * p + 1]
                cols["programs"].append(int(active.sum()))
                cols["handoff"].append((got.median() - prev_end).item() / 1e3)
                cols["work_med"].append((end - got).median().item() / 1e3)
                cols["work_max"].append((end - got).max().item() / 1e3)
                cols["span"].append((end.max() - prev_end).item() / 1e3)
        rows.append(dict(phase=name, programs=statistics.median(cols["programs"]),
                         handoff_us=statistics.median(cols["handoff"]), work_median_us=statistics.median(cols["work_med"]),
                         work_slowest_us=statistics.median(cols["work_max"]), span_us=statistics.median(cols["span"])))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    return run(args, argv)


def run(args, argv) -> int:
    if not torch.cuda.is_available():
        print("stack_timeline: needs a CUDA GPU", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    model = build_model(args.model, False, device, dtype)
    max_len = max(512, args.pos + 1)
    model.setup_kv_cache(1, max_len)
    for block in model.transformer.h:
        block.attn.kv_cache.k.normal_()
        block.attn.kv_cache.v.normal_()
    plan = stack_plan(model)
    if plan is None:
        print(f"stack_timeline: the {args.model} shape does not run as one launch here", file=sys.stderr)
        return 2
    rope = rope_tables(model, max_len, dtype) if model.rotary is not None else None
    x = torch.randn(1, model.config.n_embd, device=device).to(dtype)
    pos = torch.tensor([args.pos], device=device)
    timeline = torch.zeros(plan.programs, 1024, N_STAMPS.value, dtype=torch.int64, device=device)
    for _ in range(3):
        decode_stack(plan, x, pos, rope)
    runs = []
    for _ in range(args.runs):
        timeline.zero_()
        decode_stack(plan, x, pos, rope, timeline=timeline)
        torch.cuda.synchronize()
        runs.append(timeline[:, :plan.n_layers].clone().cpu())
    rows = analyse(torch.stack(runs), plan.n_layers)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode_stack(plan, x, pos, rope)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        for _ in range(20):
            decode_stack(plan, x, pos, rope)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_launch = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        per_launch.append(start.elapsed_time(end) * 1e3 / 20)
    launch_us = statistics.median(per_launch)
    meta = dict(model=args.model, pos=args.pos, runs=args.runs, programs=plan.programs, layers=plan.n_layers,
                blocks=plan.blocks, max_splits=plan.max_splits, gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, command="python bench/stack_timeline.py " + " ".join(argv or sys.argv[1:]))
    lines = [f"# One-launch decode step timeline: {args.model}, position {args.pos}", "",
             f"`{meta['command']}`", "",
             f"{meta['gpu']}, torch {meta['torch']}; {plan.programs} programs, {plan.n_layers} layers, tiles "
             f"{plan.blocks}, up to {plan.max_splits} key shares per kv group. Medians over layers 1..L-2 and "
             f"{args.runs} runs (bench/stack_timeline.py explains the columns).", "",
             "| phase | programs | handoff µs | work µs (median program) | work µs (slowest) | span µs |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['programs']:.0f} | {r['handoff_us']:.2f} | {r['work_median_us']:.2f} | "
                     f"{r['work_slowest_us']:.2f} | {r['span_us']:.2f} |")
    per_layer = sum(r["span_us"] for r in rows)
    lines += ["", f"Per layer {per_layer:.1f} µs; the launch without the timeline: **{launch_us:.1f} µs** "
              f"(CUDA graph of 20 launches, median of 5 replays)."]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"stack_timeline_{args.model}"
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps(dict(meta=meta, phases=rows,
                                                                           launch_us=launch_us), indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
