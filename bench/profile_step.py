"""Where a training step's GPU time goes: train.py's own step under torch.profiler, its kernels summed by kind.

    python bench/profile_step.py configs/gpt2_124m.toml --case ddp: --case fsdp:--parallel=fsdp \\
        --dataset=shakespeare --batch_size=16 --grad_accum_steps=8
    python bench/profile_step.py configs/smollm2_135m.toml --case flash:--attention=flash \\
        --case sdpa:--attention=sdpa --batch_size=16 --block_size=2048 --grad_accum_steps=1

Each --case NAME:OVERRIDES (space-separated --key=value, added after the common ones) runs in a process of its
own: the Trainer (training/trainer.py) is set up as for a real run (one GPU, no torchrun; FSDP2 starts its own
one-process group), takes --warmup steps (compilation included), then --timed steps timed with the device synchronised at
both ends (ms per step), then --profiled steps under torch.profiler. Every CUDA kernel of the profiled steps is
summed by name and by kind (matmul, attention, Inductor's fused kernels, loss, optimizer, communication,
copies, other ATen kernels); "GPU busy" is the union of the kernels' intervals, so the step time minus it is
the time the GPU waited; the idle gaps between kernels are summed by size and by the kernel before and after
each, and split by whose fault they are (launch_waits: the GPU waiting for the host to launch the next kernel,
or idle with work already issued), with the CUDA API calls that held the host (syncs, pageable copies). With
--host-ops the profiled steps record the host's operators too, listed by their host time per step and per call.
With --cprofile N, N more steps run under cProfile: the Python functions the host's time goes to (where the GPU waits
for the host). The cases run one after another, never side by side.

Prints, and writes into --out (and $OUT when set): profile_step.md (kinds per case and their differences from
the first case, then the kernels with the largest differences) and profile_step.json (every kernel).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (kind, pattern on the kernel name), first match wins
KINDS = [
    ("communication", r"nccl"),
    ("attention", r"_attn_|flash|fmha|cudnn|attention|sdpa"),
    ("loss", r"cross_entropy|_ce_|nll_loss|log_softmax"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|cublas|gemv|splitKreduce"),
    ("Inductor fused", r"^triton_"),
    ("copies", r"[Mm]emcpy|[Mm]emset|copy_kernel|CatArrayBatched"),
    ("other Triton", r"^_"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other ATen"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (µs)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


GAP_SIZES_US = (5.0, 50.0)  # idle gaps shorter than 5 µs (back-to-back launches), up to 50 µs, and longer


def _gaps(work):
    """(gap µs, item, name before) for each idle stretch in `work`: (start, end, name, ...) tuples sorted by
    start, a gap being the time between the union of the work so far and the next item's start."""
    end, last = None, ""
    for item in work:
        s, e, name = item[:3]
        if end is not None and s > end:
            yield s - end, item, last
        if end is None or e > end:
            end, last = e, name


def _per_step(table: dict, steps: int, top: int, key: str, count: str) -> list[dict]:
    """Rows {key: name, "ms": per step, count: per step} of a {name: [µs, times]} table, largest first."""
    return sorted(({key: k, "ms": v[0] / 1e3 / steps, count: v[1] / steps} for k, v in table.items()),
                  key=lambda r: -r["ms"])[:top]


def _add(table: dict, name: str, us: float) -> None:
    entry = table.setdefault(name, [0.0, 0])
    entry[0] += us
    entry[1] += 1


def idle_gaps(kernels: list[tuple[float, float, str]], steps: int, top: int = 25) -> dict:
    """Where the GPU idles between kernels: each gap between the union of the kernels so far and the next
    kernel's start (µs, from (start, end, name) triples) counted against the kernel after it and the kernel
    before it, in ms and gaps per step, and by size (GAP_SIZES_US). Idle time before the first kernel and after
    the last is not a gap."""
    before: dict[str, list[float]] = {}
    after: dict[str, list[float]] = {}
    sizes = [[0.0, 0] for _ in range(len(GAP_SIZES_US) + 1)]
    for gap, (_, _, name), last in _gaps(sorted(kernels)):
        _add(before, name, gap)
        _add(after, last, gap)
        bucket = sizes[sum(gap >= b for b in GAP_SIZES_US)]
        bucket[0] += gap
        bucket[1] += 1
    return {"total_ms": sum(b[0] for b in sizes) / 1e3 / steps,
            "before": _per_step(before, steps, top, "kernel", "gaps"),
            "after": _per_step(after, steps, top, "kernel", "gaps"),
            "by_size": [{"ms": b[0] / 1e3 / steps, "gaps": b[1] / steps} for b in sizes]}


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # chrome-trace categories of work on the GPU
HOST_CATS = ("cuda_runtime", "cuda_driver")          # ... and of the host's CUDA API calls (launches, copies, syncs)
BLOCKING_US = 20.0  # an API call longer than this held the host (a sync, a pageable copy, an allocation)


def launch_waits(trace: list[dict], steps: int, top: int = 25) -> dict | None:
    """Whose fault each idle gap is, from a chrome trace's events (µs): the GPU work (kernels, copies, memsets)
    and the host's CUDA API calls that issued it (matched by their "correlation" id). A gap before a kernel
    is the host's for the part of it before that kernel's launch call returned (the GPU had nothing queued),
    the device's for the rest (launch latency, waits inside the GPU). Returns ms per step: both totals, the
    host's share by the kernel it was waiting to launch, and the API calls that held the host longer than
    BLOCKING_US by name (syncs, pageable copies, allocations), or None where the trace has no API calls."""
    issued = {}
    blocking: dict[str, list[float]] = {}
    for e in trace:
        if e.get("cat") in HOST_CATS and "dur" in e:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                issued[corr] = e["ts"] + e["dur"]
            if e["dur"] > BLOCKING_US:
                _add(blocking, e["name"], e["dur"])
    if not issued:
        return None
    work = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"], (e.get("args") or {}).get("correlation"))
                  for e in trace if e.get("cat") in GPU_CATS)
    host_us = device_us = 0.0
    by_kernel: dict[str, list[float]] = {}
    for gap, (s, _, name, corr), _ in _gaps(work):
        ready = issued.get(corr)
        host = min(gap, max(0.0, ready - (s - gap))) if ready is not None else 0.0
        host_us += host
        device_us += gap - host
        if host > 0:
            _add(by_kernel, name, host)
    return {"host_ms": host_us / 1e3 / steps, "device_ms": device_us / 1e3 / steps,
            "host_by_kernel": _per_step(by_kernel, steps, top, "kernel", "per_step"),
            "blocking_calls": _per_step(blocking, steps, top, "call", "per_step")}


def host_ops(trace: list[dict], steps: int, top: int = 25) -> list[dict]:
    """The host's operators in a chrome trace profiled with CPU activity (cat "cpu_op": ATen ops, custom ops
    such as flashgpt::..., the compiled graphs' calls): by name, their inclusive host time (an operator's time
    includes the operators it calls) in ms per step, calls per step and µs per call, longest first."""
    by_name: dict[str, list[float]] = {}
    for e in trace:
        if e.get("cat") == "cpu_op" and "dur" in e:
            _add(by_name, e["name"], e["dur"])
    return [{**r, "us_per_call": by_name[r["op"]][0] / by_name[r["op"]][1]}
            for r in _per_step(by_name, steps, top, "op", "calls")]


def host_profile(steps, n: int, top: int = 25) -> dict:
    """n steps under cProfile: the host's time per step and the Python functions it goes to (ms per step,
    own time and with callees; a call that waits for the device counts its wait as its own time)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    steps(n)
    prof.disable()
    wall_ms = (time.perf_counter() - t0) * 1e3 / n
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.items():
        short = file.split("site-packages/")[-1] if "site-packages/" in file else os.path.relpath(file, ROOT)
        where = name if file == "~" else f"{short}:{line}({name})"
        rows.append({"function": where, "calls": calls / n, "own_ms": own * 1e3 / n, "cum_ms": cum * 1e3 / n})
    return {"wall_ms": wall_ms, "by_own": sorted(rows, key=lambda r: -r["own_ms"])[:top],
            "by_cum": sorted(rows, key=lambda r: -r["cum_ms"])[:top]}


def profile_one(args, overrides: list[str]) -> dict:
    """Runs in the case's own process: set up a Trainer (training/trainer.py), warm up, time, profile."""
    import torch
    sys.path.insert(0, str(ROOT))
    import train
    from config import load_config
    total = args.warmup + args.timed + args.profiled
    with tempfile.TemporaryDirectory(prefix="profile_step_") as work:
        cfg = load_config(args.config, [*overrides, f"--out_dir={work}", f"--max_iters={total + 1}",
                                        "--eval_interval=1000000", "--wandb=false"])
        trainer = train.Trainer(cfg)
        try:
            trainer.setup()
            trainer.bar = type("NoBar", (), {"update": lambda self, n: None})()
            trainer.tokens_since = 0

            cuda = trainer.device.type == "cuda"

            def steps(n: int) -> None:
                for _ in range(n):
                    trainer.step()
                trainer.settle()
                if cuda:
                    torch.cuda.synchronize()

            t0 = time.perf_counter()
            steps(args.warmup)
            warmup_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            steps(args.timed)
            step_ms = (time.perf_counter() - t0) * 1e3 / args.timed
            from torch.profiler import ProfilerActivity, profile
            # on a CPU (the tool's own test) the CPU ops are profiled but not counted: no kernels, times only
            activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
            if cuda and args.host_ops:
                activities.append(ProfilerActivity.CPU)
            with profile(activities=activities) as prof:
                t0 = time.perf_counter()
                steps(args.profiled)
                profiled_ms = (time.perf_counter() - t0) * 1e3 / args.profiled
            kernels: dict[str, list[float]] = {}
            named = []  # (start, end, name) of every kernel
            for e in prof.events():
                if e.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                start, end = e.time_range.start, e.time_range.end
                named.append((start, end, e.name))
                _add(kernels, e.name, end - start)
            n = args.profiled
            waits = ops = None
            if cuda:
                trace_path = os.path.join(work, "trace.json")
                prof.export_chrome_trace(trace_path)
                with open(trace_path) as f:
                    trace = json.load(f).get("traceEvents", [])
                waits = launch_waits(trace, n, args.top)
                ops = host_ops(trace, n, args.top) if args.host_ops else None
            rows = sorted(({"name": k, "kind": kind_of(k), "ms": v[0] / 1e3 / n, "calls": v[1] / n}
                           for k, v in kernels.items()), key=lambda r: -r["ms"])
            kinds: dict[str, float] = {}
            for r in rows:
                kinds[r["kind"]] = kinds.get(r["kind"], 0.0) + r["ms"]
            host = host_profile(steps, args.cprofile, args.top) if args.cprofile else None
            return {"host": host, "step_ms": step_ms, "profiled_step_ms": profiled_ms, "warmup_s": warmup_s,
                    "gpu_busy_ms": busy_us([k[:2] for k in named]) / 1e3 / n,
                    "gaps": idle_gaps(named, n, args.top), "waits": waits, "host_ops": ops,
                    "kernel_ms": sum(r["ms"] for r in rows),
                    "kinds": kinds, "kernels": rows, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                    "tokens_per_step": trainer.tokens_per_step}
        finally:
            trainer.close()


def report(cases: list[dict], command: str, commit: str, top: int) -> str:
    first = cases[0]
    names = [c["name"] for c in cases]
    head = "| | " + " | ".join(f"`{n}`" for n in names) + "".join(f" | `{n}` − `{first['name']}`"
                                                                     for n in names[1:]) + " |"
    rule = "| --- |" + " ---: |" * (2 * len(cases) - 1)
    out = [f"# Where a training step's GPU time goes\n", "```bash", command, "```", "",
           f"Commit {commit}. Milliseconds per optimizer step (all its micro-batches). Cases:", ""]
    out += [f"- `{c['name']}`: `{' '.join(c['overrides']) or '(the common overrides only)'}`; "
            f"{c['tokens_per_step']:,} tokens per step, warm-up {c['warmup_s']:.0f} s, peak {c['peak_gib']:.1f} GiB"
            for c in cases]
    out += ["", head, rule]

    def row(label, values):
        base = values[0]
        return (f"| {label} | " + " | ".join(f"{v:.2f}" for v in values)
                + "".join(f" | {v - base:+.2f}" for v in values[1:]) + " |")
    out.append(row("step (timed, synchronised)", [c["step_ms"] for c in cases]))
    out.append(row("step (profiled)", [c["profiled_step_ms"] for c in cases]))
    out.append(row("GPU busy", [c["gpu_busy_ms"] for c in cases]))
    out.append(row("GPU waiting (profiled step − busy)", [c["profiled_step_ms"] - c["gpu_busy_ms"] for c in cases]))
    kinds = sorted({k for c in cases for k in c["kinds"]}, key=lambda k: -max(c["kinds"].get(k, 0) for c in cases))
    for k in kinds:
        out.append(row(f"kernels: {k}", [c["kinds"].get(k, 0.0) for c in cases]))
    out += ["", f"The {top} kernels whose time differs most between the cases (ms per step; calls per step in "
            "brackets):", "", "| kernel | kind | " + " | ".join(f"`{n}`" for n in names) + " |",
            "| --- | --- |" + " ---: |" * len(cases)]
    table = {}
    for i, c in enumerate(cases):
        for r in c["kernels"]:
            table.setdefault(r["name"], [r["kind"], [None] * len(cases)])[1][i] = (r["ms"], r["calls"])
    spread = lambda v: max(x[0] if x else 0 for x in v) - min(x[0] if x else 0 for x in v)  # noqa: E731
    for name, (kind, vals) in sorted(table.items(), key=lambda kv: -spread(kv[1][1]))[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        cells = " | ".join(f"{v[0]:.3f} ({v[1]:g})" if v else "–" for v in vals)
        out.append(f"| `{short}` | {kind} | {cells} |")
    gapped = [c for c in cases if c.get("gaps")]
    if gapped:
        bounds = GAP_SIZES_US
        labels = ([f"< {bounds[0]:g} µs"] + [f"{a:g}–{b:g} µs" for a, b in zip(bounds, bounds[1:])]
                  + [f"≥ {bounds[-1]:g} µs"])
        out += ["", "Idle gaps between kernels in the profiled steps (ms per step, gaps per step in brackets), "
                "by size:", "", "| gap size | " + " | ".join(f"`{c['name']}`" for c in gapped) + " |",
                "| --- |" + " ---: |" * len(gapped)]
        for i, label in enumerate(labels):
            cells = (c["gaps"]["by_size"][i] for c in gapped)
            out.append(f"| {label} | " + " | ".join(f"{b['ms']:.2f} ({b['gaps']:g})" for b in cells) + " |")
        out.append("| all | " + " | ".join(f"{c['gaps']['total_ms']:.2f}" for c in gapped) + " |")
        for c in gapped:
            out += ["", f"`{c['name']}`: the kernels the GPU idles before, and after (ms per step, gaps per step):",
                    "", "| idle before | ms | gaps | | idle after | ms | gaps |",
                    "| --- | ---: | ---: | --- | --- | ---: | ---: |"]
            for a, b in zip(c["gaps"]["before"], c["gaps"]["after"]):
                out.append(f"| `{a['kernel'][:70]}` | {a['ms']:.3f} | {a['gaps']:g} | | `{b['kernel'][:70]}` | "
                           f"{b['ms']:.3f} | {b['gaps']:g} |")
    waited = [c for c in cases if c.get("waits")]
    if waited:
        out += ["", "Whose fault the idle gaps are (launch_waits: the host's part of a gap lasts until the launch "
                "call of the work after it returned; the rest is the device's), ms per step:", "",
                "| | " + " | ".join(f"`{c['name']}`" for c in waited) + " |", "| --- |" + " ---: |" * len(waited),
                "| GPU waiting for a launch (host-bound) | "
                + " | ".join(f"{c['waits']['host_ms']:.2f}" for c in waited) + " |",
                "| GPU idle with work issued (device-side) | "
                + " | ".join(f"{c['waits']['device_ms']:.2f}" for c in waited) + " |"]
        for c in waited:
            w = c["waits"]
            out += ["", f"`{c['name']}`: host-bound idle by the work waited for, and the API calls that held the host "
                    f"over {BLOCKING_US:g} µs (ms per step, times per step):", "",
                    "| waiting to launch | ms | times | | API call | ms | times |",
                    "| --- | ---: | ---: | --- | --- | ---: | ---: |"]
            a_rows, b_rows = w["host_by_kernel"], w["blocking_calls"]
            for i in range(max(len(a_rows), len(b_rows))):
                a = (f"`{a_rows[i]['kernel'][:70]}` | {a_rows[i]['ms']:.3f} | {a_rows[i]['per_step']:g}"
                     if i < len(a_rows) else " | | ")
                b = (f"`{b_rows[i]['call'][:50]}` | {b_rows[i]['ms']:.3f} | {b_rows[i]['per_step']:g}"
                     if i < len(b_rows) else " | | ")
                out.append(f"| {a} | | {b} |")
    for c in cases:
        ops = c.get("host_ops")
        if not ops:
            continue
        out += ["", f"`{c['name']}`: the host's operators in the profiled steps (CPU activity on: the profiler slows "
                "the host), inclusive of the operators they call:", "",
                "| operator | ms per step | calls per step | µs per call |", "| --- | ---: | ---: | ---: |"]
        out += [f"| `{r['op'][:80]}` | {r['ms']:.2f} | {r['calls']:g} | {r['us_per_call']:.1f} |" for r in ops]
    for c in cases:
        host = c.get("host")
        if not host:
            continue
        out += ["", f"`{c['name']}` on the host under cProfile: {host['wall_ms']:.1f} ms per step (cProfile slows Python "
                "code down, so this is an upper bound). Functions by own time, then by time with callees (ms per step):",
                "", "| function | calls | own ms | | function | calls | with callees ms |", "| --- | ---: | ---: | --- | --- | ---: | ---: |"]
        for a, b in zip(host["by_own"], host["by_cum"]):
            out.append(f"| `{a['function'][-70:]}` | {a['calls']:g} | {a['own_ms']:.2f} | | `{b['function'][-70:]}` | "
                       f"{b['calls']:g} | {b['cum_ms']:.2f} |")
    return "\n".join(out) + "\n"


def case_command(args, out_json: str, overrides: list[str]) -> list[str]:
    """The command line of one case's own process: this script with --one, every measuring option passed on."""
    return [sys.executable, __file__, args.config, f"--one={out_json}", f"--warmup={args.warmup}",
            f"--timed={args.timed}", f"--profiled={args.profiled}", f"--cprofile={args.cprofile}", f"--top={args.top}",
            *(["--host-ops"] if args.host_ops else []),
            *overrides]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("config", help="TOML config (configs/)")
    p.add_argument("--case", action="append", default=[], metavar="NAME:OVERRIDES",
                   help="a case to profile; repeat it (at least one)")
    p.add_argument("--warmup", type=int, default=4, help="steps before timing (compilation included)")
    p.add_argument("--timed", type=int, default=4, help="steps timed")
    p.add_argument("--profiled", type=int, default=2, help="steps profiled")
    p.add_argument("--top", type=int, default=25, help="kernels listed, and host functions under --cprofile")
    p.add_argument("--host-ops", action="store_true",
                   help="profile the host's operators too (CPU activity): each operator's host time per step and "
                        "per call, e.g. an attention op's (slows the host, so the idle split then overstates it)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="then N more steps under cProfile: where the host's time goes (default 0: none)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per case")
    p.add_argument("--out", default=str(ROOT / "runs" / "profile_step"), help="results folder")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: the case process writes JSON here
    args, common = p.parse_known_args(argv)
    bad = [o for o in common if not o.startswith("--")]
    if bad:
        p.error(f"unexpected argument {bad[0]!r}: overrides are --key=value")
    if args.one:
        result = profile_one(args, common)
        with open(args.one, "w") as f:
            json.dump(result, f)
        return 0
    if not args.case:
        p.error("give at least one --case NAME:OVERRIDES")
    if min(args.warmup, args.timed, args.profiled) < 1:
        p.error("--warmup, --timed and --profiled must be at least 1")
    specs = []
    for spec in args.case:
        name, sep, rest = spec.partition(":")
        if not sep or not name:
            p.error(f"--case {spec!r}: expected NAME:OVERRIDES (OVERRIDES may be empty)")
        specs.append((name, shlex.split(rest)))
    import torch
    if not torch.cuda.is_available():
        print("error: profile_step needs a CUDA GPU", file=sys.stderr)
        return 1
    sys.path.insert(0, str(ROOT))
    from bench.report import git_commit
    cases = []
    for name, overrides in specs:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        cmd = case_command(args, path, [*common, *overrides])
        print(f"== {name}: {' '.join(shlex.quote(c) for c in cmd[1:])}", flush=True)
        try:
            r = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            print(f"error: case {name} ran past --timeout={args.timeout} s", file=sys.stderr)
            return 1
        if r.returncode != 0:
            print(r.stdout[-2000:] + r.stderr[-4000:], file=sys.stderr)
            print(f"error: case {name} failed (exit {r.returncode})", file=sys.stderr)
            return 1
        with open(path) as f:
            result = json.load(f)
        os.unlink(path)
        result.update(name=name, overrides=overrides)
        print(f"   {result['step_ms']:.2f} ms/step, GPU busy {result['gpu_busy_ms']:.2f} ms", flush=True)
        cases.append(result)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    text = report(cases, command, git_commit(), args.top)
    print(text)
    for folder in {args.out, os.environ.get("OUT") or args.out}:
        os.makedirs(folder, exist_ok=True)
        Path(folder, "profile_step.md").write_text(text)
        Path(folder, "profile_step.json").write_text(json.dumps({"command": command, "cases": cases}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
