"""A/B of the causal grid order on the GPU: longest-first (LPT, the default) vs the per-head 3-D grid.

    python bench/lpt_ab.py [--out DIR]

For each causal shape, with each kernel's tile config fixed (the autotuner's pick on the H200 in
bench/results/attention_*.log), the forward (one _fwd launch) and the backward (dQ then dK/dV) are timed
inside CUDA graphs (triton.testing.do_bench_cudagraph medians, so host launch cost is out of the number)
with FLASHGPT_LPT=1 and =0 in the same process. Prints one table and writes lpt_ab.md into --out.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# (B, H, N, D) -> fwd, dq, dkdv configs (BLOCK_M, BLOCK_N, warps, stages)
CASES = {
    (16, 12, 1024, 64): ((64, 64, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3)),
    (4, 16, 4096, 64): ((128, 64, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3)),
    (4, 16, 4096, 128): ((128, 128, 8, 3), (128, 64, 8, 4), (32, 64, 4, 3)),
    (1, 16, 16384, 128): ((128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 8, 3)),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/lpt_ab.py needs a CUDA GPU")
    import kernels.flash as fa
    from triton.testing import do_bench_cudagraph
    rows = ["| B,H,N,D | fwd LPT (ms) | fwd 3-D grid (ms) | bwd LPT (ms) | bwd 3-D grid (ms) | fwd, bwd gain |",
            "| --- | --- | --- | --- | --- | --- |"]
    for (B, H, N, D), (cf, cq, ck) in CASES.items():
        g = torch.Generator(device="cuda").manual_seed(N + D)
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        scale = D ** -0.5
        t = {}
        with fa.forced_configs(fwd=cf, dq=cq, dkdv=ck):
            for lpt in ("1", "0"):
                os.environ["FLASHGPT_LPT"] = lpt
                o, lse = fa._fwd(q, k, v, True, scale)
                fa._bwd(do, q, k, v, o, lse, True, scale)
                torch.cuda.synchronize()
                t["fwd", lpt] = do_bench_cudagraph(lambda: fa._fwd(q, k, v, True, scale), rep=200)
                t["bwd", lpt] = do_bench_cudagraph(lambda: fa._bwd(do, q, k, v, o, lse, True, scale), rep=200)
        os.environ.pop("FLASHGPT_LPT", None)
        line = (f"| {B},{H},{N},{D} | {t['fwd', '1']:.4f} | {t['fwd', '0']:.4f} | {t['bwd', '1']:.4f} | "
                f"{t['bwd', '0']:.4f} | {t['fwd', '0'] / t['fwd', '1']:.3f}x, {t['bwd', '0'] / t['bwd', '1']:.3f}x |")
        print(line, flush=True)
        rows.append(line)
    text = ("# Causal grid order: longest-first (LPT) vs per-head 3-D grid — " + torch.cuda.get_device_name()
            + "\n\n`python bench/lpt_ab.py`; bf16, causal, fixed tile configs, CUDA-graph medians\n\n"
            + "\n".join(rows) + "\n")
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(args.out) / "lpt_ab.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
