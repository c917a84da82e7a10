"""Tile/split-K sweep of the fused decode kernels (kernels/ln_linear.py) on the GPT-2 124M decode shapes.

    python bench/ln_linear_sweep.py [--out DIR] [--batches 1,16]

For each op of a decode step (bf16, rows = batch size) and each config (BLOCK_N, BLOCK_K, num_warps,
num_stages, SPLIT_K), the op is launched 20 times inside one CUDA graph and the graph replayed 10 times: the
time per op is what it costs inside the decode step's graph (launch gaps included, host excluded). Beside it:
pick_config's choice, and eager PyTorch's op sequence (LayerNorm, cuBLAS matmul, bias, GELU, residual add)
captured the same way. Writes ln_linear_sweep.{md,json} into --out (default bench/results/).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.ln_linear import forced_config, ln_linear, ln_qkv_to_cache, pick_config  # noqa: E402

C, V, H, D, MAX_LEN = 768, 50304, 12, 64, 384


def graph_us(fn, reps: int = 20, replays: int = 10) -> float:
    """GPU µs per call of fn when `reps` calls are replayed back to back in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * replays)


def cases(M: int):
    """name → (fused call, eager PyTorch call, (N, K))."""
    dev, dt = "cuda", torch.bfloat16
    r = lambda *s, scale=0.02: torch.randn(*s, device=dev, dtype=dt) * scale  # noqa: E731
    x = r(M, C, scale=1.0)
    h = r(M, 4 * C, scale=1.0)
    g, b = torch.ones(C, device=dev, dtype=dt), torch.zeros(C, device=dev, dtype=dt)
    ln = (g, b, 1e-5)
    w_attn, b_attn = r(3 * C, C), r(3 * C)
    w_proj, b_proj = r(C, C), r(C)
    w_fc, b_fc = r(4 * C, C), r(4 * C)
    w_mlp, b_mlp = r(C, 4 * C), r(C)
    w_head = r(V, C)
    kc = torch.zeros(M, H, MAX_LEN, D, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    pos = torch.full((M,), 200, device=dev)
    where = pos[:, None, None, None].expand(M, H, 1, D)

    def eager_qkv():
        q, k, v = F.linear(F.layer_norm(x, (C,), g, b), w_attn, b_attn).split(C, dim=1)
        kc.scatter_(2, where, k.view(M, H, 1, D))
        vc.scatter_(2, where, v.view(M, H, 1, D))
        return q

    return {
        "LN1+QKV+cache (2304x768)": (lambda: ln_qkv_to_cache(x, w_attn, b_attn, ln, kc, vc, pos, C), eager_qkv,
                                     (3 * C, C)),
        "proj+residual (768x768)": (lambda: ln_linear(x, w_proj, b_proj, residual=x),
                                    lambda: x + F.linear(x, w_proj, b_proj), (C, C)),
        "LN2+fc+GELU (3072x768)": (lambda: ln_linear(x, w_fc, b_fc, ln=ln, gelu=True),
                                   lambda: F.gelu(F.linear(F.layer_norm(x, (C,), g, b), w_fc, b_fc), approximate="tanh"),
                                   (4 * C, C)),
        "mlp proj+residual (768x3072)": (lambda: ln_linear(h, w_mlp, b_mlp, residual=x),
                                         lambda: x + F.linear(h, w_mlp, b_mlp), (C, 4 * C)),
        "LNf+lm_head (50304x768)": (lambda: ln_linear(x, w_head, None, ln=ln),
                                    lambda: F.linear(F.layer_norm(x, (C,), g, b), w_head), (V, C)),
    }


CONFIGS = [(bn, bk, 4, 3, sp) for bn, bk, sp in itertools.product((16, 32), (128, 256, 512), (1, 2, 4, 8))]
CONFIGS += [(16, 128, 4, 4, sp) for sp in (1, 2, 4, 8)] + [(16, 64, 4, 4, sp) for sp in (1, 4, 8)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--batches", default="1,16")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: bench/ln_linear_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    lines = [f"# Fused decode kernels: tile / split-K sweep — {torch.cuda.get_device_name()}", "",
             f"`python bench/ln_linear_sweep.py --batches {args.batches}` — torch {torch.__version__}, bf16; µs per op "
             "inside a CUDA graph (20 launches per graph, 10 replays)", "",
             "| batch | op | eager PyTorch µs | pick_config | its µs | best config (BN, BK, warps, stages, split) | "
             "best µs |", "| --- | --- | --- | --- | --- | --- | --- |"]
    with torch.no_grad():
        for M in (int(b) for b in args.batches.split(",")):
            for name, (fused, eager, (N, K)) in cases(M).items():
                timings = {}
                for cfg in CONFIGS:
                    if K // cfg[4] < cfg[1]:
                        continue  # fewer than one BLOCK_K step per split
                    try:
                        with forced_config(cfg):
                            timings[cfg] = graph_us(fused)
                    except Exception as e:  # e.g. out of shared memory
                        timings[cfg] = float("nan")
                        print(f"{name} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                picked = pick_config(M, N, K, torch.device("cuda"))
                picked_us = graph_us(fused)
                eager_us = graph_us(eager)
                ok = {c: t for c, t in timings.items() if t == t}
                best = min(ok, key=ok.get)
                rows.append(dict(batch=M, op=name, eager_us=eager_us, picked=picked, picked_us=picked_us,
                                 best=best, best_us=ok[best], all={str(c): t for c, t in timings.items()}))
                lines.append(f"| {M} | {name} | {eager_us:.2f} | {picked} | {picked_us:.2f} | {best} | "
                             f"{ok[best]:.2f} |")
                top = sorted(ok.items(), key=lambda kv: kv[1])[:5]
                print(f"B={M} {name}: eager {eager_us:.2f} µs, picked {picked} {picked_us:.2f} µs, top: "
                      + ", ".join(f"{c} {t:.2f}" for c, t in top), flush=True)
    text = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    pathlib.Path(args.out, "ln_linear_sweep.md").write_text(text)
    pathlib.Path(args.out, "ln_linear_sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
