"""The attention forward alone on a Hopper GPU: the Gluon kernel's causal tile orders against each other, the tl
forward, cuDNN and (where installed) FlashAttention-4, in one process.

    python bench/hopper_forward.py [--shapes 4,16,4096,128 ...] [--causal both|yes|no] [--l2-mb 24 ...]
                                   [--rep 100] [--rounds 3] [--kernel-times] [--out DIR]

For each (B, H, N, D), bf16, the Gluon forward (kernels/flash_hopper/launch.py: forward_into, into buffers
allocated once) runs as

* lists      causal tiles from per-program lists, groups of heads whose K/V fit the default L2 budget
             (kernels/flash_hopper/schedule.py: L2_BYTES), the default;
* lists@M    the same with groups sized to M MB (each --l2-mb value; "all" puts every head in one group);
* strided    the option hopper_tile_lists off: heaviest query blocks of every head first, strided over the grid;
* late-q     the option hopper_early_q "off": each consumer releases its Q tile after a tile's last PV, not its
             last QKᵀ (without a causal mask from 4096 keys, where that is the default: early-q, the option "on");
* every      causal: the option hopper_own_blocks off: each consumer runs every key block of its tile, masked,
             also those its own rows do not see;
* lane-sums, row-sums  the option hopper_lane_sums on / off, whichever the default (on at head dim 128) is
             not: each row's running sum kept as per-thread partial sums, reduced across the row's threads once
             per tile, or the whole row summed every key block;
* c2, c3     head dim 64: two or three consumer warpgroups (the option hopper_consumers_d64; 128- or 192-row
             tiles), whichever "lists" (the default: three without a causal mask, two with one) is not;

and its peers: call (kernels.flash_attention on inputs that require grad, as the model calls it: the default
dispatch, the autograd op and its host time), tl (kernels/flash/launch.py: _fwd, hopper_forward off: the portable
forward), cudnn (SDPA's cuDNN backend) and fa4 (flash-attn-4's flash_attn_func; skipped with the reason where it
is not installed). Without a causal mask the orders are one (the arithmetic order), so only "lists" and
"late-q" run. Each Gluon variant's O is first compared with tl's (largest relative L2 difference; above 1e-2
the shape is reported wrong and not timed). Times are
triton.testing.do_bench medians (it flushes L2 between runs), each the median of --rounds rounds that time
every variant and peer in turn (the order rotated each round); TFLOP/s count 4·B·H·N²·D, halved when causal.
--kernel-times adds each one's kernel time alone (torch.profiler), which host time cannot move, and its host
time per call (50 calls queued without a sync).
Writes hopper_forward.md and hopper_forward.json into --out (default bench/results/flash_hopper).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.report import attention_shape, git_commit, write_report  # noqa: E402

DEFAULT_SHAPES = ["4,16,4096,128", "1,16,16384,128", "4,16,4096,64", "8,16,2048,128", "8,16,2048,64",
                  "16,16,1024,128", "16,12,1024,64"]
WRONG = 1e-2
ALL = 1 << 40  # an L2 budget that holds every head: one group


def _l2_mb(text: str) -> int:
    if text == "all":
        return ALL
    try:
        mb = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--l2-mb {text!r}: expected a whole number of MB or 'all'") from None
    if mb < 1:
        raise argparse.ArgumentTypeError(f"--l2-mb {text!r}: must be at least 1")
    return mb << 20


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def variants(causal: bool, budgets: list[int], D: int = 128, N: int = 4096) -> dict:
    """name -> (kernel option overrides, l2_bytes) of the Gluon runs at one shape."""
    from kernels.flash_hopper.schedule import L2_BYTES
    out = {"lists": ({}, L2_BYTES)}
    if causal:
        for b in budgets:
            if b != L2_BYTES:
                out[f"lists@{'all' if b == ALL else b >> 20}"] = ({}, b)
        out["strided"] = ({"hopper_tile_lists": False}, L2_BYTES)
        out["every"] = ({"hopper_own_blocks": False}, L2_BYTES)
    if causal or N < 4096:
        out["late-q"] = ({"hopper_early_q": "off"}, L2_BYTES)
    else:  # the default releases late here
        out["early-q"] = ({"hopper_early_q": "on"}, L2_BYTES)
    from kernels.flash_hopper.launch import lane_sums
    if lane_sums(D, None, causal, N):  # the form of the row sums the default does not run
        out["row-sums"] = ({"hopper_lane_sums": "off"}, L2_BYTES)
    else:
        out["lane-sums"] = ({"hopper_lane_sums": "on"}, L2_BYTES)
    if D == 64:
        from kernels.flash_hopper.launch import consumer_count
        other = 5 - consumer_count(64, causal, None, N)  # the consumer count the default does not run
        out[f"c{other}"] = ({"hopper_consumers_d64": other}, L2_BYTES)
        if causal:
            out["c3-every"] = ({"hopper_consumers_d64": 3, "hopper_own_blocks": False}, L2_BYTES)
        out[f"c{other}-lane-sums"] = ({"hopper_consumers_d64": other, "hopper_lane_sums": "on"}, L2_BYTES)
    return out


def measure(B: int, H: int, N: int, D: int, causal: bool, budgets: list[int], rep: int, rounds: int,
            kernel_times: bool = False) -> dict:
    """ms per forward of each variant and peer at one shape (the median of `rounds` rounds, each timing every
    one in turn, the order rotated by one per round; "runs" keeps each round's), and each Gluon variant's
    difference from tl."""
    import statistics

    import triton.testing

    from bench.attention import Unavailable, make_provider
    from kernels import flash_attention, options
    from kernels.flash import launch
    from kernels.flash_hopper.launch import forward_into
    scale = D ** -0.5
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    row = {"shape": f"{B},{H},{N},{D}", "causal": causal, "ms": {}, "runs": {}, "diff": {}, "skipped": {}}

    def tl():
        with options.use(hopper_forward="off"):
            return launch._fwd(q, k, v, causal, scale)
    o_tl, _ = tl()
    fns = {"tl": tl}
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)

    def gluon(overrides, l2):
        def run():
            with options.use(**overrides):
                forward_into(q, k, v, o, lse, causal, scale, l2_bytes=l2)
        return run
    for name, (overrides, l2) in variants(causal, budgets, D, N).items():
        o.fill_(float("nan"))
        gluon(overrides, l2)()
        row["diff"][name] = _rel(o, o_tl)
        if row["diff"][name] <= WRONG:
            fns[name] = gluon(overrides, l2)
    q_grad, k_grad, v_grad = (t.detach().clone().requires_grad_() for t in (q, k, v))
    fns["call"] = lambda: flash_attention(q_grad, k_grad, v_grad, causal=causal)  # the model's path, autograd
    for peer in ("sdpa-cudnn", "fa4"):
        try:
            fn = make_provider(peer, N, causal, q)
            fn(q, k, v)
            fns[peer.replace("sdpa-", "")] = functools.partial(fn, q, k, v)
        except (Unavailable, RuntimeError) as e:
            row["skipped"][peer] = str(e).splitlines()[0][:120]
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            row["runs"].setdefault(name, []).append(triton.testing.do_bench(fns[name], rep=rep))
    row["ms"] = {name: statistics.median(row["runs"][name]) for name in names}
    if kernel_times:
        row["kernel_ms"] = {name: _kernel_ms(fns[name]) for name in names}
        row["host_us"] = {name: _host_us(fns[name]) for name in names}
    return row


def _host_us(fn, calls: int = 50) -> float:
    """Host time of one call: `calls` calls queued back to back without a sync (the GPU still working through
    them), divided by their number."""
    import time
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def _kernel_ms(fn) -> float:
    """GPU time of the kernels one call launches, after a warm-up call (bench.attention.kernels_ms_per_call)."""
    from bench.attention import kernels_ms_per_call
    fn()
    return kernels_ms_per_call(fn)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--shapes", nargs="+", type=attention_shape, default=[attention_shape(s) for s in DEFAULT_SHAPES],
                   help="B,H,N,D ... (bf16)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--l2-mb", nargs="*", type=_l2_mb, default=[24 << 20, 48 << 20, ALL],
                   help="L2 budgets (MB, or 'all') of the lists@M variants besides the default")
    p.add_argument("--rep", type=int, default=100, help="do_bench's time budget per measurement (ms)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every variant in turn (the median is kept)")
    p.add_argument("--kernel-times", action="store_true",
                   help="also each variant's kernel time alone (torch.profiler) and host time per call, printed "
                        "and in the json")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "flash_hopper"))
    args = p.parse_args(argv)
    for flag in ("rep", "rounds"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag} {getattr(args, flag)}: must be at least 1", file=sys.stderr)
            return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("error: the Gluon forward needs an sm_90 GPU (none here)", file=sys.stderr)
        return 2
    from kernels.flash_hopper import unsupported
    for B, H, N, D in args.shapes:
        probe = torch.empty(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
        reason = unsupported(probe, probe, probe)
        if reason:
            print(f"error: shape {B},{H},{N},{D}: {reason}", file=sys.stderr)
            return 2
    causals = {"both": [True, False], "yes": [True], "no": [False]}[args.causal]
    rows = []
    for B, H, N, D in args.shapes:
        for causal in causals:
            row = measure(B, H, N, D, causal, args.l2_mb, args.rep, args.rounds, args.kernel_times)
            rows.append(row)
            work = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
            cells = ", ".join(f"{k} {work / ms / 1e9:.0f} ({ms:.3f} ms)" for k, ms in row["ms"].items())
            kernels = ", ".join(f"{k} {ms:.3f}" for k, ms in row.get("kernel_ms", {}).items())
            host = ", ".join(f"{k} {us:.0f}" for k, us in row.get("host_us", {}).items())
            print(f"{row['shape']} causal={causal}: {cells}; diff {row['diff']}; skipped {row['skipped']}"
                  + (f"; kernel ms: {kernels}; host us per call: {host}" if kernels else ""), flush=True)
    names = list(dict.fromkeys(n for r in rows for n in r["ms"]))
    lines = ["# The attention forward alone: the Gluon kernel's causal tile orders, tl, cuDNN, FA4", "",
             f"`python bench/hopper_forward.py {' '.join(sys.argv[1:] if argv is None else argv)}` at commit "
             f"{git_commit()}, {datetime.datetime.now().isoformat(timespec='seconds')}; "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16; do_bench medians.", "",
             "TFLOP/s of one forward (ms in brackets); lists: the default per-program tile lists; lists@M: "
             "groups sized to M MB of L2; strided: the option hopper_tile_lists off; late-q / early-q: hopper_early_q off / on; "
             "every: hopper_own_blocks off; c2, c3: two or three consumer warpgroups at head dim 64.", "",
             "| B,H,N,D | causal | " + " | ".join(names) + " | lists / cudnn | lists / strided | lists / late-q | "
             "lists / early-q | lists / every | lists / c2 | lists / c3 | max diff |",
             "| --- | --- | " + " | ".join("---:" for _ in names) + " | ---:" * 8 + " |"]
    for r in rows:
        B, H, N, D = (int(x) for x in r["shape"].split(","))
        work = 4 * B * H * N * N * D * (0.5 if r["causal"] else 1.0)
        ms = r["ms"]
        cells = [f"{work / ms[n] / 1e9:.0f} ({ms[n]:.3f})" if n in ms else "—" for n in names]

        def ratio(a, b):
            return f"{ms[b] / ms[a]:.3f}" if a in ms and b in ms else "—"
        diff = max(r["diff"].values()) if r["diff"] else float("nan")
        lines.append(f"| {r['shape']} | {'yes' if r['causal'] else 'no'} | " + " | ".join(cells)
                     + f" | {ratio('lists', 'cudnn')} | {ratio('lists', 'strided')} | {ratio('lists', 'late-q')}"
                     + f" | {ratio('lists', 'early-q')} | {ratio('lists', 'every')} | {ratio('lists', 'c2')} | {ratio('lists', 'c3')}"
                     + f" | {diff:.1e}"
                     + (" WRONG" if diff > WRONG else "") + " |")
    skipped = {f"{r['shape']} {'causal' if r['causal'] else 'full'} {k}": v for r in rows
               for k, v in r["skipped"].items()}
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items())]
    write_report(args.out, "hopper_forward.md", lines)
    path = os.path.join(args.out, "hopper_forward.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"command": sys.argv, "commit": git_commit(), "rows": rows}, f, indent=1)
    os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
