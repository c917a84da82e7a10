"""Training-step benchmark on a GPU: GPT-2 124M with flash, sdpa and naive attention, eager and compiled.

    python bench/train.py [--out DIR] [--steps 20] [--variants flash,sdpa+compile,...]

The model of the issue (12 layers, 12 heads, 768 wide, block 1024, vocab 50304, no biases), batch 16 x 1024,
bf16 autocast, fused AdamW, one optimizer step per measured iteration (forward, backward, clip, step) on
random tokens. For each variant: median step time over --steps after warm-up (compile included in warm-up),
tokens/s, MFU (nanoGPT's 6N + 12·L·H·Dh·T FLOPs per token, of 989 TFLOP/s bf16 dense) and peak memory.
All variants run in the same process, one after the other; results go to train_step.json / .md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model import GPT, GPTConfig  # noqa: E402

PEAK = 989e12


def make_train_step(attention: str, compiled: bool, batch: int, block: int):
    """The benchmark's GPT-2 124M and one optimizer step on fixed random tokens → (model, step); step() → loss."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=block, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, bias=False,
                    attention=attention)
    model = GPT(cfg).cuda()
    opt = model.configure_optimizer(0.1, 6e-4, (0.9, 0.95), "cuda")
    step_model = torch.compile(model) if compiled else model
    x = torch.randint(0, 50304, (batch, block), device="cuda")
    y = torch.randint(0, 50304, (batch, block), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step


def run_variant(attention: str, compiled: bool, steps: int, warmup: int, batch: int, block: int) -> dict:
    model, step = make_train_step(attention, compiled, batch, block)
    t0 = time.perf_counter()
    for _ in range(warmup):
        loss = step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    med = statistics.median(times)
    tok_s = batch * block / med
    return {"attention": attention, "compiled": compiled, "step_ms": med * 1e3, "tokens_per_s": tok_s,
            "mfu": model.flops_per_token() * tok_s / PEAK, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "warmup_s": warm_s, "loss": loss.item(), "params_M": model.num_params() / 1e6}


def write_results(rows: list, args, argv) -> str:
    """Table (markdown) + JSON of the variants measured so far: written after each one, so a timeout keeps them."""
    device = torch.cuda.get_device_name()
    cmd = "python bench/train.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# GPT-2 124M training step — {device}", "",
             f"`{cmd.strip()}` — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
             f"torch {torch.__version__}, batch {args.batch}×{args.block}, bf16 autocast, fused AdamW, "
             f"median of {args.steps} steps", "",
             "| variant | step (ms) | tokens/s | MFU | peak memory (GiB) |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | — | — | — | {r['error']} |")
        else:
            lines.append(f"| {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                         f"{r['peak_mem_gib']:.1f} |")
    by = {r["variant"]: r for r in rows if "error" not in r}
    if "flash + compile" in by and "sdpa + compile" in by:
        ratio = by["flash + compile"]["tokens_per_s"] / by["sdpa + compile"]["tokens_per_s"]
        lines += ["", f"flash + compile / sdpa + compile = **{ratio:.3f}×** (target ≥ 1.0×: "
                      f"{'met' if ratio >= 1.0 else 'NOT met'}); "
                      f"flash + compile MFU {by['flash + compile']['mfu']:.1%} (stretch 50%)"]
    text = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "train_step.json"), "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "command": cmd, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "train_step.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--variants", default="flash,sdpa,flash+compile,sdpa+compile,naive,naive+compile",
                   help="attention backends, '+compile' for torch.compile; the headline pair runs first")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/train.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for variant in args.variants.split(","):
        attention, compiled = variant.split("+")[0], variant.endswith("+compile")
        name = f"{attention}{' + compile' if compiled else ''}"
        try:
            r = run_variant(attention, compiled, args.steps, args.warmup, args.batch, args.block)
        except Exception as e:  # one failure (OOM, compile error) must not hide the other variants
            traceback.print_exc()
            r = {"attention": attention, "compiled": compiled, "error": f"{type(e).__name__}: {e}"[:300]}
        r["variant"] = name
        rows.append(r)
        print(json.dumps(r), flush=True)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        text = write_results(rows, args, argv)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
