"""The loss of a GPT-2 training step on a GPU: the Triton cross-entropy against PyTorch's, eager and compiled.

    python bench/cross_entropy.py [--rows 16384] [--vocab 50304] [--out DIR]

Logits (rows, vocab) in bf16 as a bf16-autocast lm_head gives them, random targets. For each implementation:
the forward alone and forward + backward (the gradient of the logits), do_bench medians, and the effective
memory bandwidth (the forward reads the logits once; forward + backward reads them twice and writes their
gradient once). PyTorch: F.cross_entropy on logits.float() (what the model ran before kernels/ce_loss.py),
eager and under torch.compile. Triton: kernels/ce_loss.py with each (BLOCK_V, num_warps) candidate, its loss
checked against float64. Writes cross_entropy.md into --out.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.report import write_report  # noqa: E402

CANDIDATES = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16 * 1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/cross_entropy.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.rows < 1 or args.vocab < 1:
        print("error: --rows and --vocab must be at least 1", file=sys.stderr)
        return 2
    import torch.nn.functional as F
    import triton

    import kernels.ce_loss as ce

    N, V = args.rows, args.vocab
    torch.manual_seed(0)
    logits = (torch.randn(N, V, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (N,), device="cuda")
    ref = F.cross_entropy(logits.detach().double(), targets).item()
    nbytes = N * V * logits.element_size()

    def torch_loss(x, t):
        return F.cross_entropy(x.float(), t, ignore_index=-1)

    impls = [("torch eager", torch_loss, None), ("torch compiled", torch.compile(torch_loss), None)]
    impls += [(f"triton {bv} x {w} warps", ce.cross_entropy, (bv, w)) for bv, w in CANDIDATES]
    rows = []
    saved = ce.GPU_CONFIG
    for name, fn, cfg in impls:
        ce.GPU_CONFIG = cfg or saved
        fwd = lambda: fn(logits, targets)  # noqa: E731
        both = lambda: fn(logits, targets).backward()  # noqa: E731
        loss = fwd().item()
        both()  # warm-up (compiles)
        t_fwd = triton.testing.do_bench(fwd, warmup=10, rep=200, grad_to_none=[logits], return_mode="median")
        t_both = triton.testing.do_bench(both, warmup=10, rep=200, grad_to_none=[logits], return_mode="median")
        rows.append((name, t_fwd, t_both, abs(loss - ref)))
        print(f"{name}: fwd {t_fwd * 1e3:.0f} us, fwd+bwd {t_both * 1e3:.0f} us, |loss - float64| {abs(loss - ref):.2e}",
              flush=True)
    ce.GPU_CONFIG = saved
    lines = [f"# Cross-entropy of ({N}, {V}) bf16 logits — {torch.cuda.get_device_name()}", "",
             f"`python bench/cross_entropy.py {' '.join(argv if argv is not None else sys.argv[1:])}` — "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, torch {torch.__version__}, "
             f"triton {triton.__version__}; do_bench medians; bandwidth counts one read of the logits forward, "
             "two reads and one write forward + backward", "",
             "| implementation | forward (µs) | forward + backward (µs) | fwd+bwd TB/s | vs torch compiled | "
             "abs(loss - float64) |", "| --- | --- | --- | --- | --- | --- |"]
    base = rows[1][2]
    for name, t_fwd, t_both, err in rows:
        lines.append(f"| {name} | {t_fwd * 1e3:.0f} | {t_both * 1e3:.0f} | {3 * nbytes / t_both / 1e9:.2f} | "
                     f"{base / t_both:.2f}x | {err:.1e} |")
    write_report(args.out, "cross_entropy.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
