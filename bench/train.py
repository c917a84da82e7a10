"""Training-step benchmark on a GPU: GPT-2 124M (or a config's model) with flash, sdpa and naive attention,
eager and compiled.

    python bench/train.py [--out DIR] [--steps 20] [--variants flash,sdpa+compile,flash+compile/fused,...]
    python bench/train.py --model configs/smollm2_135m.toml --block 2048 [--llama-kernels triton]

GPT-2 124M's shape (12 layers, 12 heads, 768 wide, block 1024, vocab 50304, no biases), batch 16 x 1024, or
with --model the [model] section of a training config (e.g. SmolLM2-135M's Llama shape; --block sets its
block_size, --llama-kernels what its RMSNorm, SwiGLU and RoPE run on),
bf16 autocast, fused AdamW, one optimizer step per measured iteration (forward, backward, clip, step) on
one fixed batch: uniform random tokens, or (--tokens FILE) real text, windows of a token file from
data/prepare.py (train.bin: uint16), spread evenly over it. For each variant: median step time over --steps after warm-up (compile included in warm-up),
tokens/s, MFU (nanoGPT's 6N + 12·L·H·Dh·T FLOPs per token, of 989 TFLOP/s bf16 dense), peak memory, and
(with nvidia-ml-py installed: `pip install -e ".[bench]"`) the GPU's energy per timed step and its mean power.

Each variant is measured in a fresh process (--repeats R: R processes per variant, the order of the variants
reversed every other round; the table gives the median over the processes and each process's median). In one
process, the variant measured first was about 1.5% faster than the same variant measured after another
(bench/NOTES.md: flash/sdpa 1.015x in one order, 0.984x in the other), which is the whole margin between the
two compiled variants. --in-process runs them all in this process instead. Results: train_step.json / .md.

A variant is ATTENTION[+compile][/BWD]: BWD (flash only) = split or fused, the flash backward's structure
(the backward kernel option, kernels/options.py); without it, the option in force. --loss picks the loss
kernel of every variant (kernels.cross_entropy: auto = the Triton kernel on CUDA; torch = F.cross_entropy on
fp32 logits).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kernels  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

KERNELS = ("fwd", "dq", "dkdv")  # --tiles accepts these (the split backward's kernels)

PEAK = 989e12


def fixed_batch(batch: int, block: int, tokens: str | None, device="cuda",
                vocab: int = 50304) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (batch, block): uniform random tokens below `vocab`, or `batch` windows of block + 1
    tokens spread evenly over the uint16 token file `tokens`."""
    if not tokens:
        return (torch.randint(0, vocab, (batch, block), device=device),
                torch.randint(0, vocab, (batch, block), device=device))
    import numpy as np
    data = np.memmap(tokens, dtype=np.uint16, mode="r")  # (n,)
    if len(data) < batch * (block + 1):
        raise ValueError(f"--tokens {tokens}: {len(data)} tokens, fewer than batch x (block + 1)")
    starts = np.linspace(0, len(data) - block - 1, batch).astype(np.int64)
    rows = torch.from_numpy(np.stack([data[i:i + block + 1].astype(np.int64) for i in starts])).to(device)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()  # (batch, block) each


def model_config(attention: str, block: int, model_toml: str = "", llama_kernels: str = "torch") -> GPTConfig:
    """GPT-2 124M's shape, or the [model] section of the training config `model_toml`, with block_size = block."""
    if not model_toml:
        return GPTConfig(block_size=block, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, bias=False,
                         attention=attention)
    from config import load_config
    cfg = load_config(model_toml, [f"--model.block_size={block}", f"--model.attention={attention}",
                                   f"--model.llama_kernels={llama_kernels}"]).model
    return cfg if cfg.vocab_size else GPTConfig(**{**vars(cfg), "vocab_size": 50304})


def make_train_step(attention: str, compiled: bool, batch: int, block: int, tokens: str | None = None,
                    model_toml: str = "", llama_kernels: str = "torch"):
    """The benchmark's model and one optimizer step on one fixed batch → (model, step); step() → loss."""
    torch.manual_seed(0)
    cfg = model_config(attention, block, model_toml, llama_kernels)
    model = GPT(cfg).cuda()
    opt = model.configure_optimizer(0.1, 6e-4, (0.9, 0.95), "cuda")
    step_model = torch.compile(model) if compiled else model
    x, y = fixed_batch(batch, block, tokens, vocab=cfg.vocab_size)  # (batch, block)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step


def nvml_handle():
    """(pynvml, NVML handle of the current CUDA device, found by PCI bus id since NVML's indices need not be
    CUDA's), or None without nvidia-ml-py or NVML."""
    try:
        import pynvml
        pynvml.nvmlInit()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        try:
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            return pynvml, pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        except AttributeError:  # a torch without PCI ids in its device properties
            return pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:
        return None


def energy_meter():
    """A function returning the GPU's energy counter in joules (NVML: energy since the driver loaded), or None
    where nvidia-ml-py or the counter is not available. The timed steps' energy divided by their count is the
    energy per step; under a power cap (bench/results/power_cap) step time follows it."""
    nvml = nvml_handle()
    if nvml is None:
        return None
    pynvml, handle = nvml
    try:
        read = lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3  # noqa: E731  mJ -> J
        read()
        return read
    except Exception:  # a GPU without the energy counter: the table leaves the column out
        return None


def timed_steps(step, steps: int) -> list:
    """Milliseconds of GPU time per call of step(), each between CUDA events and synchronised at its end (as a
    training loop that reads the loss after every step; whatever host work the GPU waits for counts)."""
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def parse_tiles(text: str) -> dict:
    """'fwd=128x64x8x4,dkdv=32x128x4x3' -> {"fwd": (128, 64, 8, 4), ...}: (BLOCK_M, BLOCK_N, warps, stages)."""
    tiles = {}
    for item in filter(None, text.split(",")):
        name, _, cfg = item.partition("=")
        parts = cfg.split("x")
        if name not in KERNELS or len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise ValueError(f"bad --tiles entry {item!r}: expected KERNEL=BMxBNxWARPSxSTAGES with KERNEL one of "
                             f"{', '.join(KERNELS)}")
        tiles[name] = tuple(int(p) for p in parts)
    return tiles


def flash_tiles() -> dict:
    """The tile configs the flash kernels ran with in this process: the autotuner's picks (or forced ones);
    dkdvq is the fused backward's dK/dV kernel (backward="fused")."""
    from kernels.flash import configs, launch
    used = {key[0]: cfg for key, cfg in launch._picked.items()}
    used.update(configs.forced)  # --tiles
    return {name: "x".join(map(str, used[name])) for name in KERNELS + ("dkdvq",) if name in used}


def run_variant(attention: str, compiled: bool, steps: int, warmup: int, batch: int, block: int,
                tiles: dict | None = None, tokens: str | None = None, model_toml: str = "",
                llama_kernels: str = "torch") -> dict:
    from kernels.flash import forced_configs
    with forced_configs(**(tiles or {})):
        model, step = make_train_step(attention, compiled, batch, block, tokens, model_toml, llama_kernels)
        t0 = time.perf_counter()
        for _ in range(warmup):
            loss = step()
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss {loss.item()}")
        torch.cuda.reset_peak_memory_stats()
        energy = energy_meter()
        e0, t0 = energy() if energy else None, time.perf_counter()
        med = statistics.median(timed_steps(step, steps)) / 1e3
        wall, joules = time.perf_counter() - t0, energy() - e0 if energy else None
        row_tiles = flash_tiles() if attention == "flash" else None
    tok_s = batch * block / med
    row = {"attention": attention, "compiled": compiled, "step_ms": med * 1e3, "tokens_per_s": tok_s,
           "mfu": model.flops_per_token() * tok_s / PEAK, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
           "warmup_s": warm_s, "loss": loss.item(), "params_M": model.num_params() / 1e6}
    if joules is not None:
        row.update(energy_j_per_step=joules / steps, power_w=joules / wall)
    return {**row, "tiles": row_tiles} if row_tiles else row


def parse_variant(variant: str) -> tuple[str, bool, str | None]:
    """'flash+compile/fused' -> ("flash", True, "fused"); the backward mode is None where not given."""
    name, _, bwd = variant.partition("/")
    attention, compiled = name.split("+")[0], name.endswith("+compile")
    if attention not in kernels.BACKENDS or name not in (attention, attention + "+compile") or (
            bwd and (attention != "flash" or bwd not in ("split", "fused"))):
        raise ValueError(f"bad variant {variant!r}: expected ATTENTION[+compile][/split|/fused] with ATTENTION one "
                         "of flash, sdpa, naive (a backward mode only for flash)")
    return attention, compiled, bwd or None


def use_variant(variant: str) -> tuple[str, bool]:
    """Parse a variant and set its flash backward mode for this process → (attention, compiled)."""
    attention, compiled, bwd = parse_variant(variant)
    if bwd:
        kernels.options.update(backward=bwd)
    return attention, compiled


def run_isolated(variant: str, args) -> dict:
    """run_variant in a fresh Python process (this script with --worker); its JSON row, or an error row."""
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", variant, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch", str(args.batch), "--block", str(args.block),
           "--tiles", args.tiles, "--tokens", args.tokens, "--loss", args.loss, "--model", args.model,
           "--llama-kernels", args.llama_kernels]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"worker exit {proc.returncode}: {tail}"[:300]}


def run_in_process(variant: str, args) -> dict:
    saved = kernels.options.get()
    attention, compiled = use_variant(variant)
    try:
        return run_variant(attention, compiled, args.steps, args.warmup, args.batch, args.block,
                           parse_tiles(args.tiles), args.tokens, args.model, args.llama_kernels)
    except Exception as e:  # one failure (OOM, compile error) must not hide the other variants
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        kernels.options.update(backward=saved.backward)


def combine(variant: str, runs: list) -> dict:
    """One table row from a variant's runs: the median step over the runs that did not fail."""
    attention, compiled, bwd = parse_variant(variant)
    row = {"variant": f"{attention}{' + compile' if compiled else ''}{f', {bwd} bwd' if bwd else ''}",
           "attention": attention, "compiled": compiled}
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {**row, "error": runs[-1]["error"]}
    step = statistics.median(r["step_ms"] for r in ok)
    tok_s = ok[0]["tokens_per_s"] * ok[0]["step_ms"] / step
    return {**row, "step_ms": step, "tokens_per_s": tok_s, "mfu": ok[0]["mfu"] / ok[0]["tokens_per_s"] * tok_s,
            "peak_mem_gib": max(r["peak_mem_gib"] for r in ok), "runs_step_ms": [r.get("step_ms") for r in runs],
            "runs_tiles": [r.get("tiles") for r in runs], "errors": [r["error"] for r in runs if "error" in r],
            "energy_j_per_step": _median_of(ok, "energy_j_per_step"), "power_w": _median_of(ok, "power_w")}


def _median_of(runs: list, key: str):
    """The median of a key over the runs that have it (None if none has)."""
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def describe_model(args) -> str:
    """The measured model in words: GPT-2 124M, or the config file's name and shape."""
    if not getattr(args, "model", ""):
        return "GPT-2 124M"
    c = model_config("sdpa", args.block, args.model, args.llama_kernels)
    return (f"{os.path.basename(args.model)} ({c.n_layer} layers, {c.n_embd} wide, {c.n_head}/{c.n_kv_head or c.n_head} "
            f"heads, {c.pos_emb}, {c.norm}, {c.mlp}; Llama pieces on {args.llama_kernels})")


def write_results(rows: list, args, argv) -> str:
    """Table (markdown) + JSON of the variants measured so far: written after each run, so a timeout keeps them."""
    device = torch.cuda.get_device_name()
    cmd = "python bench/train.py " + " ".join(argv if argv is not None else sys.argv[1:])
    how = ("all in one process" if args.in_process else
           f"each in a fresh process, {args.repeats} per variant (order reversed every other round)")
    lines = [f"# {describe_model(args)} training step — {device}", "",
             f"`{cmd.strip()}` — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
             f"torch {torch.__version__}, batch {args.batch}×{args.block}, bf16 autocast, fused AdamW, "
             f"median of {args.steps} steps per run, {how}; "
             f"{'tokens of ' + args.tokens if args.tokens else 'uniform random tokens'}; loss kernel {args.loss}", "",
             "| variant | step (ms) | tokens/s | MFU | peak memory (GiB) | energy per step (J), power (W) | "
             "step per run (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "step_ms" not in r:
            lines.append(f"| {r['variant']} | — | — | — | — | — | {r['error']} |")
        else:
            per_run = ", ".join("failed" if ms is None else f"{ms:.2f}" for ms in r["runs_step_ms"])
            energy = (f"{r['energy_j_per_step']:.2f}, {r['power_w']:.0f}" if r.get("energy_j_per_step") is not None
                      else "—")
            lines.append(f"| {r['variant']} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                         f"{r['peak_mem_gib']:.1f} | {energy} | {per_run} |")
    by = {r["variant"]: r for r in rows if "step_ms" in r}
    sdpa = by.get("sdpa + compile")
    for name, flash in by.items():
        if not (sdpa and flash["attention"] == "flash" and flash["compiled"]):
            continue
        ratio = flash["tokens_per_s"] / sdpa["tokens_per_s"]
        lines += ["", f"{name} / sdpa + compile = **{ratio:.3f}×** (target ≥ 1.0×: "
                      f"{'met' if ratio >= 1.0 else 'NOT met'}); {name} MFU {flash['mfu']:.1%} (stretch 50%)"]
        pairs = [(a, b) for a, b in zip(flash["runs_step_ms"], sdpa["runs_step_ms"]) if a and b]
        if len(pairs) > 1:
            lines.append("per round: " + ", ".join(f"{b / a:.3f}×" for a, b in pairs))
    tiled = [(r["variant"], ms, t) for r in rows if "step_ms" in r
             for ms, t in zip(r["runs_step_ms"], r["runs_tiles"]) if t]
    if tiled:
        lines += ["", "flash tile configs per run (BLOCK_M×BLOCK_N×warps×stages; the autotuner's picks unless "
                      "--tiles fixed them):", ""]
        lines += [f"- {v}, {'failed' if ms is None else f'{ms:.2f} ms'}: "
                  + ", ".join(f"{k} {c}" for k, c in t.items()) for v, ms, t in tiled]
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
    p.add_argument("--repeats", type=int, default=1, help="processes per variant (medians over them)")
    p.add_argument("--in-process", action="store_true", help="measure every variant in this process")
    p.add_argument("--tiles", default="", metavar="KERNEL=BMxBNxWxS,...",
                   help="fixed flash tile configs instead of the autotuner's, e.g. dkdv=32x128x4x3 (kernels: "
                        "fwd, dq, dkdv; BLOCK_M x BLOCK_N x warps x stages)")
    p.add_argument("--tokens", default="", metavar="FILE",
                   help="real text: a uint16 token file from data/prepare.py (train.bin) instead of random tokens")
    p.add_argument("--loss", default="auto", choices=kernels.LOSS_KERNELS,
                   help="the loss kernel of every variant (kernels.cross_entropy)")
    p.add_argument("--model", default="", metavar="TOML",
                   help="the [model] section of this training config instead of GPT-2 124M (e.g. "
                        "configs/smollm2_135m.toml; --block sets its block_size)")
    p.add_argument("--llama-kernels", default="torch", choices=("torch", "triton"),
                   help="what a Llama-family model's RMSNorm, SwiGLU and RoPE run on (model.llama_kernels)")
    p.add_argument("--worker", metavar="VARIANT", help=argparse.SUPPRESS)  # run_isolated's child: one JSON line
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/train.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.steps < 1:
        print("error: --repeats and --steps must be at least 1", file=sys.stderr)
        return 2
    if args.tokens and not os.path.isfile(args.tokens):
        print(f"error: --tokens {args.tokens}: no such file", file=sys.stderr)
        return 2
    try:
        tiles = parse_tiles(args.tiles)
        if args.model:
            model_config("sdpa", args.block, args.model, args.llama_kernels)  # a bad file or shape: one line now
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    kernels.options.update(loss_kernel=args.loss)  # (workers get --loss too)
    variants = args.variants.split(",")
    try:
        for variant in [args.worker] if args.worker else variants:
            parse_variant(variant)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.worker:
        attention, compiled = use_variant(args.worker)
        print(json.dumps(run_variant(attention, compiled, args.steps, args.warmup, args.batch, args.block, tiles,
                                     args.tokens, args.model, args.llama_kernels)))
        return 0
    runs: dict[str, list] = {v: [] for v in variants}
    for rnd in range(args.repeats):
        for variant in variants if rnd % 2 == 0 else variants[::-1]:
            r = (run_in_process if args.in_process else run_isolated)(variant, args)
            runs[variant].append(r)
            print(json.dumps({"variant": variant, "round": rnd, **r}), flush=True)
            text = write_results([combine(v, runs[v]) for v in variants if runs[v]], args, argv)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
