"""Every tile config of the flash kernels at one shape, timed round-robin: which config is really the fastest?

    python bench/tiles.py [--shape 16,12,1024,64] [--rounds 7] [--kernels fwd,dq,dkdv,dkdvq] [--out DIR]
                          [--best-out FILE]

The autotuner times each config once, one after the other, so a config measured while the GPU's clocks or
temperature drift can win or lose by that alone; where the top configs lie within a few percent, its pick can
change from one process to the next. This times each config of each kernel in --rounds rounds, the configs in a
fresh random order each round (triton.testing.do_bench medians, L2 flushed between calls): the forward; the
split backward's dQ and dK/dV kernels (the other one held at the autotuner's pick); the fused backward's dK/dV
kernel (FLASHGPT_BWD=fused). Inputs have the training layout: q, k, v as views of one packed projection
(B, N, 3·H·D), causal, bf16. It prints and writes tiles.md: per config the median over the rounds, the spread,
and the autotuner's own pick in this process. --best-out writes the fastest split-backward configs as a
--tiles argument for bench/train.py.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import random
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


KERNELS = ("fwd", "dq", "dkdv", "dkdvq")


def packed_inputs(shape: str):
    """Attention inputs in the training layout at "B,H,N,D" (bf16, on the GPU, seeded): q, k, v as (B, H, N, D)
    views of one packed projection (B, N, 3·H·D), dO (B, H, N, D) laid out as the model's, the views of one
    packed gradient buffer, and the softmax scale."""
    from kernels.naive import split_qkv

    B, H, N, D = (int(x) for x in shape.split(","))
    torch.manual_seed(0)
    qkv = torch.randn(B, N, 3 * H * D, device="cuda", dtype=torch.bfloat16)  # (B, N, 3·H·D)
    q, k, v = split_qkv(qkv, H, H)  # (B, H, N, D) views
    do = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # (B, H, N, D)
    grads = split_qkv(torch.empty_like(qkv), H, H)  # dq, dk, dv: (B, H, N, D) views
    return q, k, v, do, grads, D ** -0.5


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="16,12,1024,64", help="B,H,N,D (causal, packed q/k/v, bf16)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--kernels", default=",".join(KERNELS), help="which kernels' configs to time (comma-separated)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--best-out", default=None, help="file for the fastest configs as a bench/train.py --tiles value")
    args = p.parse_args(argv)
    kernels = [name for name in args.kernels.split(",") if name]
    if not kernels or any(name not in KERNELS for name in kernels):
        p.error(f"--kernels: expected some of {','.join(KERNELS)}, got {args.kernels!r}")
    if not torch.cuda.is_available():
        print("error: bench/tiles.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from kernels import flash as fa

    B, H, N, D = (int(x) for x in args.shape.split(","))
    q, k, v, do, grads, scale = packed_inputs(args.shape)

    # the autotuner's own picks in this process (its first call at this shape tunes)
    o, lse = fa._fwd(q, k, v, True, scale)
    fa._bwd(do, q, k, v, o, lse, True, scale, out=grads)
    os.environ["FLASHGPT_BWD"] = "fused"  # the fused backward's pick too
    fa._bwd(do, q, k, v, o, lse, True, scale, out=grads)
    os.environ["FLASHGPT_BWD"] = "split"
    torch.cuda.synchronize()
    auto = {key[0]: cfg for key, cfg in fa._picked.items()}

    lists = {name: fa.gpu_configs(name, torch.bfloat16, D) for name in kernels}
    bwd = lambda: fa._bwd(do, q, k, v, o, lse, True, scale, out=grads)  # noqa: E731
    calls = {"fwd": lambda: fa._fwd(q, k, v, True, scale), "dq": bwd, "dkdv": bwd, "dkdvq": bwd}
    other = {"fwd": {}, "dq": {"dkdv": auto["dkdv"]}, "dkdv": {"dq": auto["dq"]}, "dkdvq": {}}
    times: dict[tuple, list] = {(name, c): [] for name, cfgs in lists.items() for c in cfgs}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(times)
        rng.shuffle(order)
        for name, cfg in order:
            os.environ["FLASHGPT_BWD"] = "fused" if name == "dkdvq" else "split"
            with fa.forced_configs(**{name: cfg}, **other[name]):
                times[(name, cfg)].append(triton.testing.do_bench(calls[name], warmup=5, rep=40,
                                                                  return_mode="median"))
    os.environ["FLASHGPT_BWD"] = "split"

    device = torch.cuda.get_device_name()
    lines = [f"# Flash tile configs at (B, H, N, D) = ({B}, {H}, {N}, {D}), causal bf16, packed qkv — {device}", "",
             f"`python bench/tiles.py {' '.join(argv if argv is not None else sys.argv[1:])}` — "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, torch {torch.__version__}, "
             f"triton {triton.__version__}; {args.rounds} rounds, configs in a random order each round; "
             "dq and dkdv rows time the whole split backward (dQ then dK/dV) with the other kernel at the "
             "autotuner's pick; dkdvq rows the whole fused backward (delta pass, dK/dV adding dQ, dQ pass; "
             "FLASHGPT_BWD=fused)", ""]
    best = {}
    for name, cfgs in lists.items():
        med = {c: statistics.median(times[(name, c)]) for c in cfgs}
        top = min(med, key=med.get)
        best[name] = top
        lines += [f"## {name} (autotuner's pick in this process: {'x'.join(map(str, auto.get(name, ())))})", "",
                  "| config | median (µs) | vs fastest | min–max over rounds (µs) |", "| --- | --- | --- | --- |"]
        for c in sorted(cfgs, key=med.get):
            ts = times[(name, c)]
            lines.append(f"| {'x'.join(map(str, c))}{' (list first)' if c == cfgs[0] else ''} | {med[c] * 1e3:.1f} | "
                         f"{med[c] / med[top]:.3f} | {min(ts) * 1e3:.1f}–{max(ts) * 1e3:.1f} |")
        lines.append("")
    tiles = ",".join(f"{name}={'x'.join(map(str, c))}" for name, c in best.items() if name != "dkdvq")
    if tiles:
        lines.append(f"fastest: `--tiles {tiles}`")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tiles.md"), "w") as f:
        f.write(text)
    if args.best_out:
        with open(args.best_out, "w") as f:
            f.write(tiles + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
