"""Training losses of one model, data and schedule three ways: plain training under bf16 autocast, FSDP2 with
bf16 block parameters (train.py's policy on CUDA), and FSDP2 with fp32 parameters, both under the same autocast.

    python bench/fsdp_precision.py [--steps 40] [--layers 4] [--width 128] [--norm rmsnorm|layernorm]
                                   [--device cpu|cuda] [--out DIR]

DDP on one process is plain training, so the plain model stands for DDP. Under autocast every matmul reads
bf16 operands either way; what FSDP2's bf16 parameters change is the rest of each block: norm weights and
biases, and their gradients, in bf16 where autocast keeps them fp32. FSDP2 with fp32 parameters isolates the
sharding itself (it should give the plain model's losses to the last bit). The data: sequences drawn from a
fixed random bigram table (a distribution the model can learn), 4 micro-batches of 8 × 64 per step, AdamW at
3e-3. One process (a one-rank gloo or NCCL group), FSDP2 in units of two blocks. On the CPU the norm must be
RMSNorm: torch's CPU layer_norm refuses bf16 weights with fp32 input, which FSDP2's policy gives it.
Writes fsdp_precision.md and fsdp_precision.json (every loss) into --out (default
bench/results/scaling/fsdp_precision).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.report import git_commit, write_report  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.parallel import (end_single_process_group, fsdp_available, set_gradient_sync, shard_model,  # noqa: E402
                            start_single_process_group)

VOCAB, SEQ, ROWS, MICRO = 256, 64, 8, 4
MODES = ("plain", "fsdp-bf16", "fsdp-fp32")


def bigram_batches(n: int) -> list[torch.Tensor]:
    """n batches (ROWS, SEQ + 1) of token ids drawn from one fixed random bigram table, the same every call."""
    table = torch.softmax(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(1)) * 3, -1)
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.zeros(ROWS, SEQ + 1, dtype=torch.long)  # (ROWS, SEQ + 1)
        x[:, 0] = torch.randint(0, VOCAB, (ROWS,), generator=g)
        for t in range(SEQ):
            x[:, t + 1] = torch.multinomial(table[x[:, t]], 1, generator=g).squeeze(1)
        out.append(x)
    return out


def train(mode: str, cfg: GPTConfig, weights: dict, data: list[torch.Tensor], device: torch.device) -> list[float]:
    """The last micro-batch's loss at each optimizer step of one mode, from the same weights and data."""
    model = GPT(cfg).to(device)
    model.load_state_dict(weights)
    if mode != "plain":
        shard_model(model, device, torch.bfloat16 if mode == "fsdp-bf16" else None, 2)
    optimizer = model.configure_optimizer(0.1, 3e-3, (0.9, 0.95), device.type)
    losses = []
    for step in range(len(data) // MICRO):
        for i in range(MICRO):
            if mode != "plain":
                set_gradient_sync(model, i == MICRO - 1)
            x = data[step * MICRO + i].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                _, loss = model(x[:, :-1], x[:, 1:])
            (loss / MICRO).backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (an even number: units of two)")
    p.add_argument("--width", type=int, default=128, help="model width (4 heads)")
    p.add_argument("--norm", choices=["rmsnorm", "layernorm"], default="rmsnorm")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "scaling", "fsdp_precision"))
    args = p.parse_args(argv)
    problems = [f"--steps {args.steps}: must be at least 1" if args.steps < 1 else "",
                f"--layers {args.layers}: must be an even number >= 2" if args.layers < 2 or args.layers % 2 else "",
                f"--width {args.width}: must be a positive multiple of 4" if args.width < 4 or args.width % 4 else "",
                "--norm layernorm needs --device cuda (the CPU's layer_norm refuses bf16 weights with fp32 input)"
                if args.norm == "layernorm" and args.device == "cpu" else "",
                "--device cuda: no CUDA device here" if args.device == "cuda" and not torch.cuda.is_available()
                else "",
                "FSDP2 is not available in this torch" if not fsdp_available() else ""]
    problems = [x for x in problems if x]
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    cfg = GPTConfig(n_layer=args.layers, n_head=4, n_embd=args.width, block_size=SEQ, vocab_size=VOCAB,
                    attention="naive", dropout=0.0, norm=args.norm)
    torch.manual_seed(0)
    weights = GPT(cfg).state_dict()
    data = bigram_batches(args.steps * MICRO)
    losses = {}
    start_single_process_group(device)
    try:
        for mode in MODES:
            losses[mode] = train(mode, cfg, weights, data, device)
            print(f"{mode}: {losses[mode][0]:.4f} -> {losses[mode][-1]:.4f}", flush=True)
    finally:
        end_single_process_group()
    tail = max(1, args.steps // 4)
    command = "python bench/fsdp_precision.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = ["# FSDP2's parameter dtype and the training loss", "",
             f"`{command.strip()}` at commit {git_commit()}, "
             f"{datetime.datetime.now().isoformat(timespec='seconds')}; "
             f"torch {torch.__version__}, {device.type}; {args.layers} layers × {args.width} wide, {args.norm}, "
             f"vocab {VOCAB}, {MICRO} micro-batches of {ROWS} × {SEQ} per step, bf16 autocast in every mode.", "",
             "| mode | first loss | last loss | mean gap to plain, last "
             f"{tail} steps | largest gap to plain |", "| --- | ---: | ---: | ---: | ---: |"]
    for mode in MODES:
        gaps = [a - b for a, b in zip(losses[mode], losses["plain"])]
        lines.append(f"| {mode} | {losses[mode][0]:.4f} | {losses[mode][-1]:.4f} | "
                     f"{statistics.mean(gaps[-tail:]):+.5f} | {max(gaps, key=abs):+.5f} |")
    lines += ["", "Loss at every step (plain / fsdp-bf16 / fsdp-fp32):", ""]
    lines += [f"- {i + 1}: " + " / ".join(f"{losses[m][i]:.4f}" for m in MODES) for i in range(args.steps)]
    write_report(args.out, "fsdp_precision.md", lines)
    with open(os.path.join(args.out, "fsdp_precision.json"), "w") as f:
        json.dump({"command": command.strip(), "commit": git_commit(), "torch": torch.__version__,
                   "device": device.type, "layers": args.layers, "width": args.width, "norm": args.norm,
                   "losses": losses}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
