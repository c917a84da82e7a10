"""Decode-attention benchmark: split-KV (flash-decoding) vs the non-split kernel vs SDPA, GPT-2-like shape.

    python bench/decode_attention.py                 # GPU: B in (1, 16), H=12, D=64, bf16, Nq=1, 1k..32k cache
    python bench/decode_attention.py --smoke         # CPU, Triton interpreter, tiny sizes: checks the script runs

Providers, all over the same static cache of capacity max(--lens) (positions past the valid length hold NaN):
    split    decode_attention(..., num_splits=None)  the auto split count
    nosplit  decode_attention(..., num_splits=1)     one program per (sequence, kv head): the baseline
    sdpa     F.scaled_dot_product_attention(q, k[:, :, :L], v[:, :, :L])
Each (batch, length) is first checked against a float32 SDPA reference (error <= 2x bf16 SDPA's + 4e-3), then
timed with triton.testing.do_bench medians (µs per call). The decode calls pass check_lens=False (no host sync,
as in a CUDA-graph decode step). GB/s counts the bytes of K and V read: 2·B·H·L·D·bytes. Results go to --out as
decode_attention.json and .md (decode_attention_smoke.* with --smoke), with the split kernel's speed-up over the
non-split kernel at the longest cache (the reason the split form exists: it should be >= 4x at 32k, batch 1).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for JSON + markdown (default bench/results/)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU through the Triton interpreter")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16)")
    p.add_argument("--lens", default=None, help="comma-separated cache lengths (default 1024,...,32768)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before kernels.decode is imported
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from kernels.decode import auto_num_splits, decode_attention  # noqa: E402

TARGET_LEN, TARGET_SPEEDUP = 32768, 4.0


def time_us(fn) -> float:
    """Median µs per call: do_bench on CUDA; a plain timer in the interpreter (smoke only, meaningless)."""
    if torch.cuda.is_available() and not ARGS.smoke:
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> int:
    if ARGS.smoke:
        device, dtype = torch.device("cpu"), torch.float32  # the interpreter's tl.dot is wrong for bf16
        batches, lens, H, D = [1, 2], [64, 600], 2, 16  # capacity 600: the auto path splits
    else:
        if not torch.cuda.is_available():
            print("error: the benchmark needs a CUDA GPU (use --smoke on CPU)", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
        batches, lens, H, D = [1, 16], [1024, 2048, 4096, 8192, 16384, 32768], ARGS.heads, ARGS.head_dim
    if ARGS.batches:
        batches = [int(x) for x in ARGS.batches.split(",")]
    if ARGS.lens:
        lens = [int(x) for x in ARGS.lens.split(",")]
    capacity = max(lens)
    out_dir = Path(ARGS.out) if ARGS.out else ROOT / "bench" / "results"
    torch.manual_seed(0)

    rows, failures = [], []
    for B in batches:
        for L in lens:
            q = torch.randn(B, H, 1, D, device=device, dtype=dtype)
            k = torch.randn(B, H, capacity, D, device=device, dtype=dtype)
            v = torch.randn(B, H, capacity, D, device=device, dtype=dtype)
            k[:, :, L:], v[:, :, L:] = float("nan"), float("nan")  # garbage past the valid length
            cache_lens = torch.full((B,), L, device=device, dtype=torch.int32)
            out = torch.empty_like(q)
            splits = auto_num_splits(B * H, capacity, device)
            providers = {
                "split": lambda: decode_attention(q, k, v, cache_lens, out=out, check_lens=False),
                "nosplit": lambda: decode_attention(q, k, v, cache_lens, num_splits=1, out=out, check_lens=False),
                "sdpa": lambda: F.scaled_dot_product_attention(q, k[:, :, :L], v[:, :, :L]),
            }
            # Correctness first: each provider vs float32 SDPA on the valid prefix.
            ref = F.scaled_dot_product_attention(q.float(), k[:, :, :L].float(), v[:, :, :L].float())
            errs = {name: (fn().float() - ref).abs().max().item() for name, fn in providers.items()}
            bound = 2 * errs["sdpa"] + (4e-3 if dtype != torch.float32 else 1e-5)
            for name in ("split", "nosplit"):
                if not errs[name] <= bound:  # also catches NaN
                    failures.append(f"B={B} L={L} {name}: error {errs[name]:.3g} > {bound:.3g}")
            us = {name: time_us(fn) for name, fn in providers.items()}
            nbytes = 2 * B * H * L * D * q.element_size()
            row = dict(B=B, H=H, D=D, L=L, capacity=capacity, num_splits=splits,
                       **{f"{n}_us": round(t, 2) for n, t in us.items()},
                       **{f"{n}_GBps": round(nbytes / (t * 1e-6) / 1e9, 1) for n, t in us.items()},
                       **{f"{n}_max_err": e for n, e in errs.items()},
                       speedup_vs_nosplit=round(us["nosplit"] / us["split"], 2),
                       speedup_vs_sdpa=round(us["sdpa"] / us["split"], 2))
            rows.append(row)
            print(f"B={B:3d} L={L:6d} splits={splits:3d}  split {us['split']:9.1f} µs  nosplit "
                  f"{us['nosplit']:9.1f} µs  sdpa {us['sdpa']:9.1f} µs  ->  {row['speedup_vs_nosplit']:.2f}x "
                  f"vs nosplit, {row['speedup_vs_sdpa']:.2f}x vs sdpa", flush=True)
            del q, k, v, out

    meta = dict(
        command="python " + " ".join([f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        date=datetime.datetime.now().isoformat(timespec="seconds"), smoke=ARGS.smoke,
        device=torch.cuda.get_device_name() if device.type == "cuda" else f"CPU interpreter ({platform.machine()})",
        torch=torch.__version__, triton=triton.__version__, dtype=str(dtype).replace("torch.", ""), Nq=1,
        timing="triton.testing.do_bench median" if device.type == "cuda" else "perf_counter median (smoke)",
        note="decode calls use check_lens=False; GB/s = bytes of K and V read (2*B*H*L*D*bytes) / time",
        correctness_failures=failures)
    target = [dict(B=r["B"], speedup=r["speedup_vs_nosplit"], met=r["speedup_vs_nosplit"] >= TARGET_SPEEDUP)
              for r in rows if r["L"] == TARGET_LEN]
    meta["target"] = dict(rule=f"split >= {TARGET_SPEEDUP}x nosplit at L={TARGET_LEN}", results=target)
    table = render_markdown(meta, rows)
    print("\n" + table)

    name = "decode_attention_smoke" if ARGS.smoke else "decode_attention"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(table)
    print(f"wrote {out_dir / name}.json and .md")
    if failures:
        print("CORRECTNESS FAILURES:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def render_markdown(meta, rows) -> str:
    lines = [f"# Decode attention: split-KV vs non-split vs SDPA ({meta['dtype']}, Nq=1)", "",
             f"`{meta['command']}` — {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"{meta['date']}; {meta['timing']}; {meta['note']}.", "",
             "| B | cache len | splits | split µs | nosplit µs | sdpa µs | split GB/s | nosplit GB/s | sdpa GB/s "
             "| split vs nosplit | split vs sdpa |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['B']} | {r['L']} | {r['num_splits']} | {r['split_us']:.1f} | {r['nosplit_us']:.1f} "
                     f"| {r['sdpa_us']:.1f} | {r['split_GBps']:.0f} | {r['nosplit_GBps']:.0f} | {r['sdpa_GBps']:.0f} "
                     f"| {r['speedup_vs_nosplit']:.2f}x | {r['speedup_vs_sdpa']:.2f}x |")
    lines.append("")
    t = meta["target"]
    if t["results"]:
        lines.append(f"Target ({t['rule']}): " + ", ".join(
            f"B={x['B']}: {x['speedup']:.2f}x {'met' if x['met'] else 'NOT met'}" for x in t["results"]))
    if meta["correctness_failures"]:
        lines.append("Correctness failures: " + "; ".join(meta["correctness_failures"]))
    else:
        lines.append("Correctness: every provider within 2x SDPA's error (+ floor) of a float32 SDPA reference.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
