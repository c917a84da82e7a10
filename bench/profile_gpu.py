"""Where the GPU time goes: torch.profiler tables for the two figures that miss their targets.

    python bench/profile_gpu.py [--out DIR]

1. One GPT-2 124M decode step (bf16, KV cache of 384, prompt 128), replayed as a CUDA graph, batch 1 and 16,
   flash (split-KV decode kernel) and sdpa: the kernels of 20 replays by GPU time, and the count per step
   (`--only decode`: the fused step of model/fused_decode.py, batch 1 and 16).
2. flash attention forward + backward at (B, H, N, D) = (8, 12, 1024, 64) causal bf16 (the GPT-2 124M training
   shape), eager: GPU kernel time against wall time, to separate kernel time from host overhead.
3. One GPT-2 124M training step (batch 16 x 1024, bf16 autocast, torch.compile, fused AdamW) with flash and
   with sdpa attention: the kernels by GPU time, to show where the two differ (`--only train`).
Writes profile_gpu.txt (profile_train.txt for --only train) into --out (default bench/results/).
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from kernels import flash_attention  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.fused_decode import fused_decode_step  # noqa: E402
from model.sampling import DecodeGraph, decode_one_token, prefill  # noqa: E402


def table(prof, n=18) -> str:
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=70)


def profile_decode(out: io.StringIO, backend: str, batch: int, fused: bool = False) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768,
                          attention=backend)).cuda().to(torch.bfloat16).eval()
    model.setup_kv_cache(batch, 384)
    graph = DecodeGraph(model, batch, "cuda", fused_decode_step if fused else decode_one_token)
    idx = torch.randint(0, 50304, (batch, 128), device="cuda")
    prefill(model, idx, torch.full((batch,), 128, device="cuda"))
    tok = torch.randint(0, 50304, (batch, 1), device="cuda")
    pos = torch.full((batch, 1), 128, device="cuda")
    for _ in range(3):
        graph(model, tok, pos)
    torch.cuda.synchronize()
    steps = 20
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            graph(model, tok, pos)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels) / steps if kernels else float("nan")
    t0 = time.perf_counter()
    for _ in range(100):
        graph(model, tok, pos)
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) / 100 * 1e6
    out.write(f"\n## decode step, {backend}{' fused' if fused else ''}, batch {batch}: {len(kernels) / steps:.0f} kernels per step, "
              f"{gpu_us:.0f} µs of kernel time per step, {wall_us:.0f} µs per replay (wall)\n")
    out.write(table(prof) + "\n")
    model.clear_kv_cache()


def profile_attention(out: io.StringIO) -> None:
    B, H, N, D = 8, 12, 1024, 64
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        flash_attention(q, k, v, causal=True).backward(do)
    torch.cuda.synchronize()
    reps = 20
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            flash_attention(q, k, v, causal=True).backward(do)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        flash_attention(q, k, v, causal=True).backward(do)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / 50 * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / reps / 1e3
    out.write(f"\n## flash attention fwd+bwd (8,12,1024,64) causal bf16, eager: {gpu_ms:.3f} ms kernel time, "
              f"{wall_ms:.3f} ms wall per call ({len(kernels) / reps:.0f} kernels per call)\n")
    out.write(table(prof) + "\n")


def profile_train(out: io.StringIO, backend: str) -> None:
    # bench/train.py's model, batch and optimizer step (loaded by path: the root's train.py has the same name)
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "train.py")
    bench_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_train)
    _, step = bench_train.make_train_step(backend, compiled=True, batch=16, block=1024)
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    steps = 3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / steps / 1e3
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / 5 * 1e3
    out.write(f"\n## training step, {backend} + compile: {gpu_ms:.2f} ms kernel time, {wall_ms:.2f} ms wall per step, "
              f"{len(kernels) / steps:.0f} kernels per step\n")
    out.write(table(prof, 60) + "\n")
    torch._dynamo.reset()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--only", choices=["all", "train", "decode"], default="all")
    args = p.parse_args()
    out = io.StringIO()
    out.write(f"# GPU profile — {torch.cuda.get_device_name()}, torch {torch.__version__}\n"
              f"`python bench/profile_gpu.py {' '.join(sys.argv[1:])}`\n")
    parts = ((profile_attention, ()), (profile_decode, ("flash", 1)), (profile_decode, ("sdpa", 1)),
             (profile_decode, ("flash", 16)))
    if args.only == "train":
        parts = ((profile_train, ("flash",)), (profile_train, ("sdpa",)))
    elif args.only == "decode":
        parts = ((profile_decode, ("flash", 1, True)), (profile_decode, ("flash", 16, True)))
    for fn, fargs in parts:
        try:
            fn(out, *fargs)
        except Exception as e:  # keep what the other parts measured
            out.write(f"\n## {fn.__name__}{fargs}: failed: {type(e).__name__}: {e}\n")
        print(out.getvalue().split("\n## ")[-1][:3000], flush=True)
    os.makedirs(args.out, exist_ok=True)
    name = {"all": "profile_gpu.txt", "train": "profile_train.txt", "decode": "profile_decode.txt"}[args.only]
    with open(os.path.join(args.out, name), "w") as f:
        f.write(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
