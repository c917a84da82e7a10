"""Training-step benchmark on a GPU: GPT-2 124M with flash, sdpa and naive attention, eager and compiled.

    python bench/train.py [--out DIR] [--steps 20] [--variants flash,sdpa+compile,...] [--rounds 1]

The model of the issue (12 layers, 12 heads, 768 wide, block 1024, vocab 50304, no biases), batch 16 x 1024,
bf16 autocast, fused AdamW, one optimizer step per measured iteration (forward, backward, clip, step) on
random tokens. For each variant: median step time over --steps after warm-up (compile included in warm-up),
tokens/s, MFU (nanoGPT's 6N + 12·L·H·Dh·T FLOPs per token, of 989 TFLOP/s bf16 dense) and peak memory.
All variants run in the same process, one after the other (--rounds R > 1: all built first, then timed in
turn for R rounds, so slow drift of the GPU falls on each alike); results go to train_step.json / .md.
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


def warm_variant(attention: str, compiled: bool, warmup: int, batch: int, block: int):
    """Build the variant and run its warm-up steps (compile included) → (model, step, warm-up seconds)."""
    model, step = make_train_step(attention, compiled, batch, block)
    t0 = time.perf_counter()
    for _ in range(warmup):
        loss = step()
    torch.cuda.synchronize()
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    return model, step, time.perf_counter() - t0


def time_steps(step, steps: int) -> list[float]:
    """Seconds of each of `steps` optimizer steps (CUDA events around each)."""
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def summarize(attention: str, compiled: bool, model, times: list[float], warm_s: float, batch: int, block: int):
    med = statistics.median(times)
    tok_s = batch * block / med
    return {"attention": attention, "compiled": compiled, "step_ms": med * 1e3, "tokens_per_s": tok_s,
            "mfu": model.flops_per_token() * tok_s / PEAK, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "warmup_s": warm_s, "params_M": model.num_params() / 1e6}


def run_variant(attention: str, compiled: bool, steps: int, warmup: int, batch: int, block: int) -> dict:
    model, step, warm_s = warm_variant(attention, compiled, warmup, batch, block)
    torch.cuda.reset_peak_memory_stats()
    return summarize(attention, compiled, model, time_steps(step, steps), warm_s, batch, block)


def run_interleaved(variants: list[tuple[str, bool]], rounds: int, steps: int, warmup: int, batch: int,
                    block: int) -> list[dict]:
    """All variants built and warmed first, then measured in turn, `steps` steps each, for `rounds` rounds: drift
    of the GPU (clocks, temperature) over the minutes of a run falls on every variant alike. The step time is
    the median of all rounds' steps; round_ms keeps each round's median. Peak memory of a variant: the peak
    during its first round less what the other variants keep allocated between steps."""
    built, resident = [], []
    for a, c in variants:
        before = torch.cuda.memory_allocated()
        built.append(warm_variant(a, c, warmup, batch, block))
        resident.append(torch.cuda.memory_allocated() - before)
    times = [[] for _ in variants]
    rounds_ms = [[] for _ in variants]
    peaks = [0.0] * len(variants)
    for r in range(rounds):
        for i, (_, step, _) in enumerate(built):
            torch.cuda.reset_peak_memory_stats()
            t = time_steps(step, steps)
            if r == 0:
                peaks[i] = torch.cuda.max_memory_allocated() - (sum(resident) - resident[i])
            times[i] += t
            rounds_ms[i].append(round(statistics.median(t) * 1e3, 3))
    rows = []
    for (a, c), (model, _, warm_s), t, r, peak in zip(variants, built, times, rounds_ms, peaks):
        row = summarize(a, c, model, t, warm_s, batch, block)
        row.update(peak_mem_gib=peak / 2**30, round_ms=r)
        rows.append(row)
    return rows


def write_results(rows: list, args, argv) -> str:
    """Table (markdown) + JSON of the variants measured so far: written after each one, so a timeout keeps them."""
    device = torch.cuda.get_device_name()
    cmd = "python bench/train.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# GPT-2 124M training step — {device}", "",
             f"`{cmd.strip()}` — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
             f"torch {torch.__version__}, batch {args.batch}×{args.block}, bf16 autocast, fused AdamW, "
             + (f"median of {args.rounds} interleaved rounds × {args.steps} steps" if args.rounds > 1
              else f"median of {args.steps} steps"), "",
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
        if "round_ms" in by["flash + compile"]:
            per_round = [s / f for f, s in zip(by["flash + compile"]["round_ms"], by["sdpa + compile"]["round_ms"])]
            lines.append("ratio per round: " + ", ".join(f"{x:.3f}" for x in per_round))
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
    p.add_argument("--rounds", type=int, default=1,
                   help="> 1: build and warm every variant first, then time them in turn, --steps each, this many "
                        "rounds (all variants stay in GPU memory together)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/train.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.rounds > 1:
        variants = [(v.split("+")[0], v.endswith("+compile")) for v in args.variants.split(",")]
        rows = run_interleaved(variants, args.rounds, args.steps, args.warmup, args.batch, args.block)
        for r in rows:
            r["variant"] = f"{r['attention']}{' + compile' if r['compiled'] else ''}"
            print(json.dumps(r), flush=True)
        print(write_results(rows, args, argv))
        return 0
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
