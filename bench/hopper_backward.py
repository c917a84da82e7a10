"""The attention backward alone on a Hopper GPU: the Gluon dK/dV path against the tl backward and cuDNN's.

    python bench/hopper_backward.py [--shapes 4,16,4096,64 ...] [--causal both|yes|no] [--stages N]
                                    [--ahead auto|on|off] [--fused 1 2 3 4 5 6] [--rep 100] [--rows-loads]
                                    [--mask-skip] [--ds-ring] [--tail-rounds R] [--direct-launches] [--out DIR]

For each (B, H, N, D), bf16, the forward runs once (kernels/flash/launch.py: _fwd, giving O and the row
log-sum-exp), then three backwards of the same upstream gradient are timed with triton.testing.do_bench
medians (it flushes L2 between runs):

* hopper  kernels/flash/launch.py: _hopper_bwd, the tl dQ kernel, then the Gluon dK/dV kernel;
* fused1  the same with fused=1: the tl pass storing delta and zeroing an fp32 dQ, the Gluon kernel adding
          dS K into it with atomics besides dK and dV (each warpgroup its own keys' part), the tl pass
          converting dQ;
* fused2  fused=2: the two warpgroups' dS through one shared buffer, each adding half of dQ's columns;
* fused3  fused=3: as fused2, each warpgroup's half of dQ added through shared memory and a TMA reduce-add
          per step instead of atomics per element (FlashAttention-3's way);
* fused4  fused=4: as fused3, each step's dQ computed in the next step, after that step's dK matmul is
          issued, so that neither warpgroup waits for the other's dS of the step it has just computed;
* fused5  fused=5: as fused3, each step's dK matmul issued after its dQ matmuls, so that it runs while dQ goes
          out (FlashAttention-3's order);
* fused6  fused=6: fused4 with fused5's order in each step: the previous step's dQ matmuls, then this step's dK;
* tl      kernels/flash/launch.py: _bwd with hopper_backward off: the tl split backward;
* cudnn   SDPA's cuDNN backend: its backward alone (the graph of one forward kept, backward re-run).

Before timing, hopper's dQ, dK, dV are compared with tl's (largest relative L2 difference, column "diff"); a
shape where it exceeds 1e-2 is reported as wrong and its time is left out. Then each kernel alone: the tl dQ
kernel (both backwards launch it first) and the Gluon dK/dV kernel; tl's dK/dV kernel is tl's time less dQ's.
TFLOP/s count 2.5x the forward's 4·B·H·N²·D (halved when causal). Writes hopper_backward.md into --out
(default bench/results/flash_hopper).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.report import attention_shape, git_commit, write_report  # noqa: E402
from kernels.flash_hopper.backward_launch import DQ_MODES, LAGGED_DQ_MODES  # noqa: E402

DEFAULT_SHAPES = ["4,16,4096,64", "4,16,4096,128", "1,16,16384,128", "8,12,1024,64"]
WRONG = 1e-2
FUSED_MODES = DQ_MODES  # kernels/flash/launch.py: _hopper_bwd(fused=...), the fused forms


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def measure(B: int, H: int, N: int, D: int, causal: bool, rep: int, stages: int | None = None,
            ahead: bool | None = None, fused_modes=FUSED_MODES) -> dict:
    """ms per backward of each provider at one shape, and hopper's difference from tl's gradients."""
    import triton.testing
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import options
    from kernels.flash import launch
    from kernels.flash_hopper.backward_launch import dkdv_into, unsupported_backward
    scale = D ** -0.5
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    o, lse = launch._fwd(q, k, v, causal, scale)  # (B, H, N, D), (B, H, N)
    row = {"shape": f"{B},{H},{N},{D}", "causal": causal}
    def tl():  # the tl backward, whatever the hopper_backward option's default would pick
        with options.use(hopper_backward="off"):
            return launch._bwd(do, q, k, v, o, lse, causal, scale)
    tl_grads = tl()
    row["tl"] = triton.testing.do_bench(tl, rep=rep)
    reason = unsupported_backward(do, q, k, v, o)
    if reason is None:
        grads = launch._hopper_bwd(do, q, k, v, o, lse, causal, scale, stages, ahead)
        row["diff"] = max(_rel(a, b) for a, b in zip(grads, tl_grads))
        if row["diff"] <= WRONG:
            row["hopper"] = triton.testing.do_bench(
                lambda: launch._hopper_bwd(do, q, k, v, o, lse, causal, scale, stages, ahead), rep=rep)
            # each kernel alone: the dQ kernel (shared by both), the Gluon dK/dV kernel after it
            dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
            delta = torch.empty_like(lse)
            row["dq"] = triton.testing.do_bench(
                lambda: launch._dq_into(do, q, k, v, o, lse, dq, delta, causal, scale), rep=rep)
            row["dkdv"] = triton.testing.do_bench(
                lambda: dkdv_into(do, q, k, v, lse, delta, dk, dv, causal, scale, stages, ahead), rep=rep)
        for mode in fused_modes:
            fused = launch._hopper_bwd(do, q, k, v, o, lse, causal, scale, stages, ahead, fused=mode)
            row[f"fused{mode}_diff"] = max(_rel(a, b) for a, b in zip(fused, tl_grads))
            if row[f"fused{mode}_diff"] <= WRONG:
                row[f"fused{mode}"] = triton.testing.do_bench(
                    lambda: launch._hopper_bwd(do, q, k, v, o, lse, causal, scale, stages, ahead, fused=mode),
                    rep=rep)
    else:
        row["skipped"] = reason
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
        row["cudnn"] = triton.testing.do_bench(lambda: out.backward(do, retain_graph=True), rep=rep,
                                               grad_to_none=[qg, kg, vg])
    except RuntimeError as e:  # the backend does not take the shape here
        row["cudnn_skipped"] = str(e).splitlines()[0][:100]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", type=attention_shape, default=[attention_shape(s) for s in DEFAULT_SHAPES],
                   help="B,H,N,D ... (bf16)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--stages", type=int, default=None,
                   help="the Gluon kernel's Q/dO ring depth (default: its own per head dim)")
    p.add_argument("--ahead", choices=["auto", "on", "off"], default="auto",
                   help="issue the next query block's score matmuls before this block's elementwise work "
                        "(auto: the kernel's default per head dim)")
    p.add_argument("--fused", nargs="*", type=int, choices=FUSED_MODES, default=list(FUSED_MODES),
                   help="the fused forms to time (hopper_backward's fused=)")
    p.add_argument("--rep", type=int, default=100, help="do_bench's time budget per measurement (ms)")
    p.add_argument("--rows-loads", action="store_true",
                   help="the Gluon kernel loads each step's lse and delta from global memory in its consumers "
                        "instead of through the producer's TMA (the default; kernels.flash_hopper.backward_launch."
                        "rows_through_tma) in every hopper and fused column")
    p.add_argument("--mask-skip", action="store_true",
                   help="causal: the Gluon kernel skips the mask on blocks wholly below the diagonal "
                        "(kernels.flash_hopper.backward_launch.skip_mask_below_diagonal) in every hopper and "
                        "fused column")
    p.add_argument("--ds-ring", action="store_true",
                   help="fused forms 2, 3 and 5 keep a dS buffer per ring stage, counted free through the ring's "
                        "releases instead of their own barriers (kernels.flash_hopper.backward_launch."
                        "ds_freed_by_ring; up to DS_RING_MAX_STAGES) in every fused column")
    p.add_argument("--tail-rounds", type=int, default=None, metavar="R",
                   help="causal: the grid's last R · SMs / key tiles (batch, kv head) pairs deal their key tiles "
                        "across them, longest first (kernels.flash_hopper.backward_launch.tail_heads_dealt; 0: the "
                        "launch order; default: the launcher's TAIL_ROUNDS) in every hopper and fused column")
    p.add_argument("--direct-launches", action="store_true",
                   help="repeated Gluon dK/dV launches call the compiled kernel's launcher instead of "
                        "JITFunction.run (kernels.flash_hopper.backward_launch.direct_launches) in every hopper "
                        "and fused column")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "flash_hopper"))
    args = p.parse_args(argv)
    if args.tail_rounds is not None and args.tail_rounds < 0:
        print(f"error: --tail-rounds {args.tail_rounds}: must be 0 or more", file=sys.stderr)
        return 2
    if args.rep < 1:
        print(f"error: --rep {args.rep}: must be at least 1", file=sys.stderr)
        return 2
    lagged = sorted(set(args.fused) & set(LAGGED_DQ_MODES))
    if args.ahead == "on" and lagged:
        print(f"error: --ahead on does not run with --fused {' '.join(map(str, lagged))} (dQ one step behind)",
              file=sys.stderr)
        return 2
    from kernels.flash_hopper import backward_launch
    from kernels.flash_hopper.backward_launch import (MAX_STAGES, direct_launches, ds_freed_by_ring,
                                                      rows_through_tma, skip_mask_below_diagonal, tail_heads_dealt)
    tail_rounds = backward_launch.TAIL_ROUNDS if args.tail_rounds is None else args.tail_rounds
    for _, _, _, D in args.shapes:
        if args.stages is not None and not 2 <= args.stages <= MAX_STAGES.get(D, 2):
            print(f"error: --stages {args.stages}: the ring holds 2 to {MAX_STAGES.get(D, 2)} stages at head dim {D}",
                  file=sys.stderr)
            return 2
        too_big = [m for m in args.fused if args.stages is not None and D in MAX_STAGES
                   and backward_launch.shared_bytes(D, args.stages, m) > backward_launch.SMEM_LIMIT]
        if too_big:
            print(f"error: --stages {args.stages} at head dim {D}: fused form {too_big[0]}'s buffers do not fit in "
                  f"shared memory ({backward_launch.shared_bytes(D, args.stages, too_big[0])} B > "
                  f"{backward_launch.SMEM_LIMIT})", file=sys.stderr)
            return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("error: the Hopper backward needs an sm_90 GPU (none here)", file=sys.stderr)
        return 2
    causals = {"both": [True, False], "yes": [True], "no": [False]}[args.causal]
    modes = tuple(args.fused)
    lines = ["# The attention backward alone: Gluon dK/dV (hopper) against tl and cuDNN", "",
             f"`python bench/hopper_backward.py {' '.join(sys.argv[1:] if argv is None else argv)}` at commit "
             f"{git_commit()}, {datetime.datetime.now().isoformat(timespec='seconds')}; "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16; do_bench medians.", "",
             "TFLOP/s of one backward (ms in brackets); diff: hopper's largest relative L2 difference from tl's "
             "dQ, dK, dV.", "",
             "Each kernel alone (ms): dQ, the tl dQ kernel both backwards launch first; Gluon dK/dV, the hopper "
             "backward's second kernel; tl dK/dV, tl's time less the dQ kernel's.", "",
             "| B,H,N,D | causal | hopper | " + " | ".join(f"fused{m}" for m in modes) + " | tl | cudnn | "
             "hopper / tl | hopper / cudnn | " + " | ".join(f"fused{m} / cudnn" for m in modes) +
             " | dQ ms | Gluon dK/dV ms | tl dK/dV ms | diff | fused diffs |",
             "| --- | --- | " + " | ".join("---:" for _ in range(10 + 2 * len(modes))) + " |"]
    for B, H, N, D in args.shapes:
        for causal in causals:
            ahead = {"auto": None, "on": True, "off": False}[args.ahead]
            with rows_through_tma(not args.rows_loads), skip_mask_below_diagonal(args.mask_skip), \
                    ds_freed_by_ring(args.ds_ring), tail_heads_dealt(tail_rounds), \
                    direct_launches(args.direct_launches):
                row = measure(B, H, N, D, causal, args.rep, args.stages, ahead, args.fused)
            work = 2.5 * 4 * B * H * N * N * D * (0.5 if causal else 1.0)

            def cell(name):
                ms = row.get(name)
                return f"{work / ms / 1e9:.0f} ({ms:.3f})" if ms else "—"

            def ms(name, less=None):
                if not row.get(name) or (less and not row.get(less)):
                    return "—"
                return f"{row[name] - (row[less] if less else 0.0):.3f}"

            def ratio(a, b):
                return f"{row[b] / row[a]:.2f}" if row.get(a) and row.get(b) else "—"
            diff = f"{row['diff']:.1e}" + (" WRONG" if row["diff"] > WRONG else "") if "diff" in row else \
                row.get("skipped", "—")
            fdiff = " / ".join(f"{row[f'fused{m}_diff']:.1e}" + (" WRONG" if row[f"fused{m}_diff"] > WRONG else "")
                               for m in modes if f"fused{m}_diff" in row) or "—"
            fused_cells = " | ".join(cell(f"fused{m}") for m in modes)
            fused_ratios = " | ".join(ratio(f"fused{m}", "cudnn") for m in modes)
            lines.append(f"| {row['shape']} | {'yes' if causal else 'no'} | {cell('hopper')} | {fused_cells} | "
                         f"{cell('tl')} | {cell('cudnn')} | {ratio('hopper', 'tl')} | {ratio('hopper', 'cudnn')} | "
                         f"{fused_ratios} | {ms('dq')} | {ms('dkdv')} | {ms('tl', 'dq')} | {diff} | {fdiff} |")
            print(lines[-1], flush=True)
    write_report(args.out, "hopper_backward.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
