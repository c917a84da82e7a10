r"""One call of each decode attention at one shape, for Nsight Compute: the kernels to profile, once each.

    ncu --profile-from-start off --set full -o REPORT \
        python bench/profile_decode_attention.py --batch 16 --len 32768 [--splits 11 16] [--tile 128:1:3 ...] \
            [--key-parts 4]
    ncu --import REPORT.ncu-rep --page raw --csv > raw.csv && python bench/ncu_summary.py raw.csv

GPT-2's decode shape by default (12 heads of 64, bf16, one new token) over caches of --capacity positions
(default --len) holding --len keys per sequence. Every call below runs once to compile and warm up and then,
between cudaProfilerStart and cudaProfilerStop (what `ncu --profile-from-start off` profiles), once more, in
this order:

* split        kernels.decode.decode_attention as the model calls it (its automatic plan and tile)
* split-S      the same with num_splits=S, for each --splits S (a merge launch follows where S > 1)
* tile-N:W:S   the automatic plan with the tile BLOCK_N:WARPS:STAGES, for each --tile
* parts-P      the automatic plan under decode_key_parts=P (a softmax state per part of each key block), for
               each --key-parts P
* sdpa         F.scaled_dot_product_attention over the first --len positions, the backend torch picks
               (what bench/decode_attention.py's sdpa provider times)

Kernel names and launch order tell them apart in the report (_decode_split_kernel with its constants,
_decode_merge_kernel, then SDPA's). Nothing is timed here: bench/decode_attention.py times.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _tile(text: str):
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected BLOCK_N:WARPS:STAGES, got {text!r}")
    return tuple(int(p) for p in parts)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--len", type=int, default=32768, help="keys per sequence")
    p.add_argument("--capacity", type=int, default=None, help="cache positions (default --len)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--splits", type=int, nargs="*", default=[], help="explicit split counts, one call each")
    p.add_argument("--tile", type=_tile, nargs="*", default=[], help="tiles BLOCK_N:WARPS:STAGES, one call each")
    p.add_argument("--key-parts", type=int, nargs="*", default=[], choices=(2, 4, 8),
                   help="decode_key_parts values, one call each")
    a = p.parse_args(argv)
    a.capacity = a.capacity or a.len
    if min(a.batch, a.len, a.heads, a.head_dim) < 1 or a.len > a.capacity or any(s < 1 for s in a.splits):
        p.error("--batch, --len, --heads, --head-dim and --splits must be positive, --len at most --capacity")
    return a


def calls(a: argparse.Namespace) -> dict:
    """name -> a callable running that decode attention once on this shape's bf16 caches."""
    import torch
    import torch.nn.functional as F

    from kernels import decode, options
    B, H, L, D = a.batch, a.heads, a.len, a.head_dim
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)           # (B, H, 1, D)
    k, v = (torch.randn(B, H, a.capacity, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))  # (B, H, cap, D)
    lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)

    def split(**kw):
        return lambda: decode.decode_attention(q, k, v, lens, out=out, check_lens=False, **kw)

    fns = {"split": split()}
    fns.update({f"split-{s}": split(num_splits=s) for s in a.splits})
    fns.update({f"tile-{n}:{w}:{s}": split(tile=decode.DecodeTile(n, w, s)) for n, w, s in a.tile})

    def parts(p):
        def fn():
            with options.use(decode_key_parts=p):
                decode.decode_attention(q, k, v, lens, out=out, check_lens=False)
        return fn
    fns.update({f"parts-{p}": parts(p) for p in a.key_parts})
    fns["sdpa"] = lambda: F.scaled_dot_product_attention(q, k[:, :, :L], v[:, :, :L])
    return fns


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("error: profile_decode_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    fns = calls(a)
    for fn in fns.values():  # compile and warm up outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in fns.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled, in order: " + ", ".join(fns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
