"""Where the one-launch decode step (kernels/decode_stack.py) spends its time: a phase-by-phase timeline.

    python bench/stack_timeline.py [--model smollm2|gpt2] [--pos 255] [--runs 5] [--no-merged-sums]
                                   [--mlp-weights-after A|B|C] [--out DIR]

One sequence of the benchmark's model (bench/generate.py's shapes, random weights, bf16) with its cache filled to
--pos positions; the stack runs once per run with its timeline on: every program stamps the GPU's global timer
(%globaltimer, nanoseconds, one clock for all SMs) at the end of each phase (A: norm + QKV + RoPE + cache write,
B: attention shares, C: merge + output projection + residual, D: MLP with the down projection's atomics) and
after each barrier's wait. Per phase, averaged over layers 1..L-1 and the runs:

    work µs       the phase's time in a program, from leaving the barrier before it to its end: median over the
                  programs, and the slowest program
    barrier µs    from the slowest program's phase end (its arrival follows) to the median program leaving the
                  wait: what a grid barrier costs beyond the work
    phase µs      from the median program leaving the barrier before the phase to the median leaving the one after

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
from kernels import options as kernel_options  # noqa: E402
from kernels.decode_stack import decode_stack, every_warp_polls, mlp_weights_after  # noqa: E402

PHASES = [("A qkv", 0, 1, 2), ("B attention", 2, 3, 4), ("C out-proj", 4, 5, 6), ("D mlp", 6, 7, 0)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("smollm2", "gpt2"), default="smollm2")
    p.add_argument("--pos", type=int, default=255, help="the token's position (cache length - 1), default 255")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--mlp-weights-after", choices=("A", "B", "C"), default="C",
                   help="the phase after whose arrival each program loads phase D's weights "
                   "(kernels.decode_stack.mlp_weights_after; default C)")
    p.add_argument("--early-mlp", action="store_const", const="A", dest="mlp_weights_after",
                   help="the same as --mlp-weights-after A")
    p.add_argument("--every-warp-polls", action="store_true", help="every warp of a program polls the barrier "
                   "counter (kernels.decode_stack.every_warp_polls) instead of warp 0 alone")
    p.add_argument("--merged-sums", action=argparse.BooleanOptionalAction, default=True,
                   help="the kernel option decode_stack_merged_sums: phases A and D with fewer CTA-wide reductions")
    p.add_argument("--out", default=str(ROOT / "bench/results/generate_smollm2/stack"))
    return p.parse_args(argv)


def analyse(times: torch.Tensor, n_layers: int) -> list[dict]:
    """times (runs, programs, n_layers, 8) ns → per phase: work (median, slowest), barrier, phase µs."""
    rows = []
    for name, start_k, end_k, next_k in PHASES:
        work_med, work_max, barrier, phase = [], [], [], []
        for r in range(times.shape[0]):
            for layer in range(1, n_layers - 1):
                t = times[r, :, layer].double()                              # (programs, 8)
                start, end = t[:, start_k], t[:, end_k]
                nxt = times[r, :, layer + 1, 0].double() if next_k == 0 else t[:, next_k]
                work = (end - start) / 1e3
                work_med.append(work.median().item())
                work_max.append(work.max().item())
                barrier.append((nxt.median() - end.max()).item() / 1e3)
                phase.append((nxt.median() - start.median()).item() / 1e3)
        rows.append(dict(phase=name, work_median_us=statistics.median(work_med),
                         work_slowest_us=statistics.median(work_max), barrier_us=statistics.median(barrier),
                         phase_us=statistics.median(phase)))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    with mlp_weights_after(args.mlp_weights_after), every_warp_polls(args.every_warp_polls), \
            kernel_options.use(decode_stack_merged_sums=args.merged_sums):
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
    timeline = torch.zeros(plan.programs, 1024, 8, dtype=torch.int64, device=device)
    for _ in range(3):
        decode_stack(plan, x, pos, rope)
    runs = []
    for _ in range(args.runs):
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
    meta = dict(model=args.model, pos=args.pos, mlp_weights_after=args.mlp_weights_after,
                every_warp_polls=args.every_warp_polls, merged_sums=args.merged_sums,
                runs=args.runs, programs=plan.programs, layers=plan.n_layers,
                blocks=plan.blocks, max_splits=plan.max_splits, gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, command="python bench/stack_timeline.py " + " ".join(argv or sys.argv[1:]))
    lines = [f"# One-launch decode step timeline: {args.model}, position {args.pos}", "",
             f"`{meta['command']}`", "",
             f"{meta['gpu']}, torch {meta['torch']}; {plan.programs} programs, {plan.n_layers} layers, tiles "
             f"{plan.blocks}, up to {plan.max_splits} key shares per kv group. Medians over layers 1..L-2 and "
             f"{args.runs} runs (bench/stack_timeline.py explains the columns). Phase D's weights loaded "
             f"after phase {args.mlp_weights_after}; "
             f"{'every warp polls' if args.every_warp_polls else 'warp 0 polls'} a barrier's counter; "
             f"decode_stack_merged_sums {'on' if args.merged_sums else 'off'}.", "",
             "| phase | work µs (median program) | work µs (slowest) | barrier µs | phase µs |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['work_median_us']:.2f} | {r['work_slowest_us']:.2f} | "
                     f"{r['barrier_us']:.2f} | {r['phase_us']:.2f} |")
    per_layer = sum(r["phase_us"] for r in rows)
    lines += ["", f"Per layer {per_layer:.1f} µs; the launch without the timeline: **{launch_us:.1f} µs** "
              f"(CUDA graph of 20 launches, median of 5 replays)."]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    after = "" if args.mlp_weights_after == "C" else "_mlp_after_" + args.mlp_weights_after
    name = (f"stack_timeline_{args.model}{after}"
            f"{'_every_warp_polls' if args.every_warp_polls else ''}{'' if args.merged_sums else '_unmerged_sums'}")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps(dict(meta=meta, phases=rows,
                                                                           launch_us=launch_us), indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
