"""Energy per call of the training step's attention and loss, by NVML's energy counter: what a power-capped GPU pays.

    python bench/energy.py [--seconds 2] [--rounds 2] [--out DIR]

At GPT-2 124M's training shape the H200 runs at its 700 W cap, where a step takes about its energy / 700 W
(bench/results/power_cap, train_energy): a kernel that is faster but spends the same energy leaves the step
as long as it was (bench/results/ce_loss: the Triton loss is 1.7x faster than Inductor's and the step did not
move). This measures joules per call, each candidate looped for --seconds (back to back, synchronised only at
the end) in --rounds rounds in turn:

* attention forward + backward as the model runs it (packed qkv (16, 1024, 3·768) bf16, 12 heads, causal):
  flash with the split backward, with the fused one (dQ by TMA reduce-adds, and by element atomics), and SDPA
  (cuDNN, with autograd's concatenation of dq, dk, dv);
* the loss forward + backward on (16384, 50304) bf16 logits: F.cross_entropy on logits.float() compiled by
  Inductor, and kernels/ce_loss.py.

Needs a GPU and nvidia-ml-py. Writes energy.md into --out.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.report import write_report  # noqa: E402


def per_call(fn, seconds: float, read_energy) -> tuple[float, float, float]:
    """(joules per call, microseconds per call, mean watts) of fn() looped for about `seconds`."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.2:  # calls per second, roughly
        fn()
        n += 1
    torch.cuda.synchronize()
    calls = max(1, int(n * seconds / (time.perf_counter() - t0) / 5))  # host runs ahead: synchronise per batch
    e0, t0, total = read_energy(), time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(calls):
            fn()
        total += calls
        torch.cuda.synchronize()
    wall, joules = time.perf_counter() - t0, read_energy() - e0
    return joules / total, wall / total * 1e6, joules / wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/energy.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.train import energy_meter
    read_energy = energy_meter()
    if read_energy is None:
        print("error: bench/energy.py needs nvidia-ml-py and a GPU with an energy counter", file=sys.stderr)
        return 2
    import torch.nn.functional as F

    import kernels

    torch.manual_seed(0)
    B, H, N, D, V = 16, 12, 1024, 64, 50304
    qkv = (torch.randn(B, N, 3 * H * D, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(B, H, N, D, device="cuda").to(torch.bfloat16)
    logits = (torch.randn(B * N, V, device="cuda") * 2).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (B * N,), device="cuda")
    torch_loss = torch.compile(lambda x, t: F.cross_entropy(x.float(), t, ignore_index=-1))

    def attention(backend: str, bwd: str | None = None, dq_mode: str | None = None):
        def run():
            os.environ["FLASHGPT_BWD"] = bwd or "split"
            if dq_mode:
                os.environ["FLASHGPT_FUSED_DQ"] = dq_mode
            else:
                os.environ.pop("FLASHGPT_FUSED_DQ", None)
            qkv.grad = None
            kernels.attention_qkvpacked(qkv, H, H, backend=backend, causal=True).backward(dy)
        return run

    def loss(kernel: str):
        def run():
            logits.grad = None
            (torch_loss(logits, targets) if kernel == "torch" else
             kernels.cross_entropy(logits, targets, kernel="triton")).backward()
        return run

    candidates = {
        "attention: flash, split backward (default)": attention("flash"),
        "attention: flash, fused backward, dQ by TMA reduce-adds": attention("flash", "fused", "2"),
        "attention: flash, fused backward, dQ by element atomics": attention("flash", "fused", "1"),
        "attention: SDPA (cuDNN) + dq/dk/dv concatenation": attention("sdpa"),
        "loss: F.cross_entropy, torch.compile": loss("torch"),
        "loss: kernels/ce_loss.py": loss("triton"),
    }
    results = {name: [] for name in candidates}
    for rnd in range(args.rounds):
        for name, fn in (candidates.items() if rnd % 2 == 0 else reversed(candidates.items())):
            results[name].append(per_call(fn, args.seconds, read_energy))
            j, us, w = results[name][-1]
            print(f"round {rnd}: {name}: {j * 1e3:.2f} mJ, {us:.0f} us, {w:.0f} W", flush=True)
    os.environ["FLASHGPT_BWD"] = "split"
    lines = [f"# Energy per call: attention and loss of a GPT-2 124M training step — {torch.cuda.get_device_name()}",
             "", f"`python bench/energy.py {' '.join(argv if argv is not None else sys.argv[1:])}` — "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, torch {torch.__version__}; "
             f"each looped {args.seconds:g} s per round, {args.rounds} rounds (order reversed every other round); "
             "medians over the rounds; NVML total-energy counter", "",
             "| candidate | mJ per call | µs per call | mean W | mJ per round |", "| --- | --- | --- | --- | --- |"]
    for name, runs in results.items():
        j, us, w = (statistics.median(r[i] for r in runs) for i in range(3))
        lines.append(f"| {name} | {j * 1e3:.2f} | {us:.0f} | {w:.0f} | "
                     f"{', '.join(f'{r[0] * 1e3:.2f}' for r in runs)} |")
    write_report(args.out, "energy.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
