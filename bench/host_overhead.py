"""Host (CPU) time per call of the attention ops a compiled training step runs, on a GPU.

    python bench/host_overhead.py [--out DIR] [--calls 2000]

A tiny shape (B=1, H=2, N=64, D=64, causal, bf16) keeps each kernel to a few microseconds, so a loop of calls
without synchronisation is bound by the host: the time per call is what the CPU spends to launch it. Rows:
the packed flash ops (forward: 1 Triton launch; backward: 2) as torch.compile's graphs call them, the same through
Triton's JITFunction.run instead of the launch plans and cached launchers, the same with the launchers' calls
stubbed out (our Python alone), and SDPA's cuDNN forward and backward ops for comparison.
In GPT-2 124M's compiled training step (bench/train.py) the step starts with an idle GPU (the loop syncs on
every step), so host time per layer adds to the step until the CPU is ahead of the GPU again.
Writes host_overhead.md into --out.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kernels.flash as fa  # noqa: E402
from kernels import split_qkv  # noqa: E402


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over `repeats` loops of `calls` unsynchronised calls: host microseconds per call."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    per_loop = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        per_loop.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_loop)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/host_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    B, H, N, D = 1, 2, 64, 64
    scale = D ** -0.5
    qkv = torch.randn(B, N, 3 * H * D, device="cuda", dtype=torch.bfloat16)
    fwd_op = torch.ops.flashgpt.flash_attn_qkvpacked_fwd.default
    bwd_op = torch.ops.flashgpt.flash_attn_qkvpacked_bwd.default
    o, lse = fwd_op(qkv, H, H, True, scale)
    do = torch.randn_like(o)
    q, k, v = split_qkv(qkv, H, H)
    cu_fwd = torch.ops.aten._scaled_dot_product_cudnn_attention.default
    cu_bwd = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    out = cu_fwd(q, k, v, None, True, 0.0, True, False, scale=scale)
    cu_o, cu_lse, philox_seed, philox_offset = out[0], out[1], out[6], out[7]

    def cudnn_bwd():
        cu_bwd(do, q, k, v, cu_o, cu_lse, philox_seed, philox_offset, None, out[2], out[3], N, N, 0.0, True,
               scale=scale)

    fa._compiled.clear()  # the direct launchers (FLASHGPT_FAST_LAUNCH) and launch plans fill again in the warm-up
    fa._plans.clear()
    rows = [("flash packed fwd op (1 Triton launch)",
             per_call_us(lambda: fwd_op(qkv, H, H, True, scale), args.calls)),
            ("flash packed bwd op (2 Triton launches)",
             per_call_us(lambda: bwd_op(do, qkv, o, lse, H, H, True, scale), args.calls))]
    fast, launch_compiled = fa._FAST_LAUNCH, fa._launch_compiled
    try:
        fa._FAST_LAUNCH = False  # plans recorded now launch through JITFunction.run
        fa._plans.clear()
        rows += [("flash fwd op, launched through JITFunction.run (FLASHGPT_FAST_LAUNCH=0)",
                  per_call_us(lambda: fwd_op(qkv, H, H, True, scale), args.calls)),
                 ("flash bwd op, launched through JITFunction.run (FLASHGPT_FAST_LAUNCH=0)",
                  per_call_us(lambda: bwd_op(do, qkv, o, lse, H, H, True, scale), args.calls))]
        fa._FAST_LAUNCH = fast
        fa._plans.clear()
        fa._launch_compiled = lambda kernel, grid, vals: None  # everything but the launcher's call
        rows += [("flash fwd op, launcher calls stubbed (Python only)",
                  per_call_us(lambda: fwd_op(qkv, H, H, True, scale), args.calls)),
                 ("flash bwd op, launcher calls stubbed (Python only)",
                  per_call_us(lambda: bwd_op(do, qkv, o, lse, H, H, True, scale), args.calls))]
    finally:
        fa._FAST_LAUNCH, fa._launch_compiled = fast, launch_compiled
        fa._plans.clear()
    rows.append(("SDPA cuDNN fwd op",
                 per_call_us(lambda: cu_fwd(q, k, v, None, True, 0.0, True, False, scale=scale), args.calls)))
    try:
        rows.append(("SDPA cuDNN bwd op", per_call_us(cudnn_bwd, args.calls)))
    except Exception as e:  # a private op whose signature changes between torch versions
        print(f"SDPA cuDNN bwd op not measured: {e}", file=sys.stderr)
    cmd = "python bench/host_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# Host time per attention op call — {torch.cuda.get_device_name()}", "",
             f"`{cmd.strip()}` — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
             f"torch {torch.__version__}, "
             f"(B, H, N, D) = ({B}, {H}, {N}, {D}) causal bf16, median of 5 loops of {args.calls} calls "
             "without sync", "",
             "| op | host µs per call |", "| --- | --- |"]
    lines += [f"| {name} | {us:.1f} |" for name, us in rows]
    text = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_overhead.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
