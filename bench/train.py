"""Training-step benchmark on a GPU: GPT-2 124M (or a config's model) with flash, sdpa and naive attention,
eager and compiled.

    python bench/train.py [--out DIR] [--steps 20] [--variants flash,sdpa+compile,flash+compile/fused,...]
    python bench/train.py --model configs/smollm2_135m.toml --block 2048 [--llama-kernels triton]
    python bench/train.py --steps 20 --repeats 3 --variants flash+compile --data memory,shards
    python bench/train.py --model configs/smollm2_135m.toml --block 2048 --lora-rank 16   # LoRA fine-tuning steps

GPT-2 124M's shape (12 layers, 12 heads, 768 wide, block 1024, vocab 50304, no biases), batch 16 x 1024, or
with --model the [model] section of a training config (e.g. SmolLM2-135M's Llama shape; --block sets its
block_size, --llama-kernels what its RMSNorm, SwiGLU and RoPE run on),
bf16 autocast, fused AdamW, one optimizer step per measured iteration (forward, backward, clip, step) on
one fixed batch: uniform random tokens, or (--tokens FILE) real text, windows of a token file from
data/prepare.py (train.bin: uint16), spread evenly over it. For each variant: median step time over --steps after warm-up (compile included in warm-up), each step
synchronised at its end, so the host time the GPU waits for at a step's start counts; then --steps more steps
queued back to back as train.py queues them (each loss read after the next step is queued), whose mean is the
queued step time; tokens/s, MFU (nanoGPT's 6N + 12·L·H·Dh·T FLOPs per token, of 989 TFLOP/s bf16 dense), peak memory, and
(with nvidia-ml-py installed: `pip install -e ".[bench]"`) the GPU's energy per timed step and its mean power.

Each variant is measured in a fresh process (--repeats R: R processes per variant, the order of the variants
reversed every other round; the table gives the median over the processes and each process's median). In one
process, the variant measured first was about 1.5% faster than the same variant measured after another
(bench/NOTES.md: flash/sdpa 1.015x in one order, 0.984x in the other), which is the whole margin between the
two compiled variants. --in-process runs them all in this process instead. Results: train_step.json / .md.

A variant is ATTENTION[+compile|+graphs][/SUFFIX]: +graphs is torch.compile's "reduce-overhead" mode (the compiled
forward and backward replayed as CUDA graphs, as train.py's train.cuda_graphs runs them), each flash variant's
ratio taken over the sdpa variant of the same mode; SUFFIX (flash only) = split or fused, the flash backward's
structure (the backward kernel option, kernels/options.py), or rope-pass: a RoPE model rotates q and k in its own
pass before the flash call (the rope_in_flash option off; by default the flash call takes the RoPE tables and its
backward kernels store dQ and dK rotated back); without it, the options in force. --loss picks the loss
kernel of every variant (kernels.cross_entropy: auto = the Triton kernel on CUDA; torch = F.cross_entropy on
fp32 logits).

--data says what feeds the steps, a list measured for every variant (each pair in its own processes): random
(the fixed batch above), memory (the in-memory loader, data.loader.TokenData over train.bin / val.bin from
data.prepare.prepare) and/or shards (the sharded streaming loader, data.sharded_loader.ShardedData over token
shards from data.shards.prepare_shards). A loader gives a new batch every step, fetched and copied to the GPU
inside the timed step by train.py's own data path (data/batches.py: open_train_data, then train_batches and
to_device); the step synchronises at its end, so whatever time the GPU waits for the batch counts (train.py
fetches a step ahead of the GPU, which can only hide more). Both loaders read folders prepared in a temporary
folder (removed at the end) from one corpus: documents of GPT-2 text decoded from uniform random tokens, or
from the first tokens of --tokens, enough that the sharded loader never reads a token twice in a process
((warmup + steps) x batch x block tokens), in shards of 4 steps' tokens, so that the timed steps cross shards
and verify each new one's checksum as training does. The report adds, per variant, the sharded loader's
tokens/s over the in-memory loader's (target >= 0.99x) and the same ratio per round. The command that measures
it on GPT-2 124M:

    python bench/train.py --steps 20 --repeats 3 --variants flash+compile --data memory,shards
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kernels  # noqa: E402
from bench.report import git_commit  # noqa: E402
from data.batches import open_train_data, to_device  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.lora import LoRASettings, apply_lora  # noqa: E402

KERNELS = ("fwd", "dq", "dkdv")  # --tiles accepts these (the split backward's kernels)

PEAK = 989e12

DATA_KINDS = {"random": "", "memory": "in-memory loader", "shards": "sharded loader"}  # --data → row label
GPT2_VOCAB = 50257  # the loaders' corpus is GPT-2 text: the model's vocabulary must hold these ids


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


def parse_data(text: str) -> list[str]:
    """'memory,shards' -> ["memory", "shards"]: what feeds the steps, each of DATA_KINDS at most once."""
    kinds = text.split(",")
    if any(kind not in DATA_KINDS or kinds.count(kind) > 1 for kind in kinds):
        raise ValueError(f"bad --data {text!r}: expected a comma-separated list of {', '.join(DATA_KINDS)}, "
                         "each at most once")
    return kinds


def loader_tokens(steps: int, warmup: int, batch: int, block: int) -> int:
    """Tokens the sharded loader reads in one process: every warm-up and timed step's batch, and the last target."""
    return (warmup + steps) * batch * block + 1


def write_corpus(folder: str, tokens: int, block: int, tokens_file: str = "") -> int:
    """Documents doc_00000.txt, ... in `folder`, each the GPT-2 text of 4 x block token ids (uniform random
    ids, or consecutive windows of the uint16 GPT-2 token file `tokens_file`): as many as give `tokens`, plus
    one for each loader's validation split. Returns the number of documents."""
    import numpy as np
    from data.tokenizers import GPT2Tokenizer
    doc_tokens = 4 * block
    n_docs = math.ceil(tokens / doc_tokens) + 2
    if tokens_file:
        ids = np.memmap(tokens_file, dtype=np.uint16, mode="r")  # (n,)
        if len(ids) < n_docs * doc_tokens:
            raise ValueError(f"--tokens {tokens_file}: {len(ids):,} tokens, fewer than the {n_docs * doc_tokens:,} "
                             "the loaders' corpus takes; take fewer --steps or a larger file")
        ids = ids[:n_docs * doc_tokens]
        if int(ids.max()) >= GPT2_VOCAB:
            raise ValueError(f"--tokens {tokens_file}: holds id {int(ids.max())}, not GPT-2 tokens")
    else:
        ids = np.random.default_rng(0).integers(0, GPT2_VOCAB - 1, n_docs * doc_tokens)  # below end-of-text
    tok = GPT2Tokenizer()
    os.makedirs(folder, exist_ok=True)
    for i in range(n_docs):
        with open(os.path.join(folder, f"doc_{i:05d}.txt"), "w", encoding="utf-8") as f:
            f.write(tok.decode(ids[i * doc_tokens:(i + 1) * doc_tokens]))
    return n_docs


@contextlib.contextmanager
def loader_folders(kinds: list, tokens: int, batch: int, block: int, tokens_file: str = ""):
    """Prepared folders of the loaders in `kinds` ("memory", "shards"; "random" needs none), built from one corpus
    (write_corpus) by the project's writers in a temporary folder, removed on leaving: yields {kind: folder}.
    The sharded train split holds at least `tokens` tokens, in shards of 4 x batch x block tokens; the first
    document is its validation split, and the in-memory folder's validation split is about one document."""
    if not any(k in kinds for k in ("memory", "shards")):
        yield {}
        return
    from data.prepare import prepare
    from data.shards import prepare_shards, read_manifest
    work = tempfile.mkdtemp(prefix="flashgpt-bench-data-")
    try:
        corpus, folders = os.path.join(work, "corpus"), {}
        n_docs = write_corpus(corpus, tokens, block, tokens_file)
        if "memory" in kinds:
            folders["memory"] = prepare(corpus, "gpt2", val_fraction=1 / n_docs, num_proc=1,
                                        cache_dir=os.path.join(work, "bin"), verbose=False)
        if "shards" in kinds:
            folders["shards"] = prepare_shards(corpus, "gpt2", out=os.path.join(work, "shards"),
                                               shard_tokens=4 * batch * block, val_docs=1, num_proc=1, verbose=False)
            have = read_manifest(folders["shards"])["tokens"]["train"]
            if have < tokens:
                raise ValueError(f"the benchmark's shards hold {have:,} train tokens, fewer than the {tokens:,} "
                                 "the steps read")
        yield folders
    finally:
        shutil.rmtree(work, ignore_errors=True)


def loader_batch(data, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's next training batch as train.py takes it (one micro-batch of one rank) and moves it to the
    device: (x, y), (batch, block) each."""
    (x, y), = data.train_batches(batch, 1)
    return to_device(x, y, device)


def model_config(attention: str, block: int, model_toml: str = "", llama_kernels: str = "torch") -> GPTConfig:
    """GPT-2 124M's shape, or the [model] section of the training config `model_toml`, with block_size = block."""
    if not model_toml:
        return GPTConfig(block_size=block, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, bias=False,
                         attention=attention)
    return toml_model_config(model_toml, [f"--model.block_size={block}", f"--model.attention={attention}",
                                          f"--model.llama_kernels={llama_kernels}"])


def toml_model_config(model_toml: str, overrides: list[str] | None = None) -> GPTConfig:
    """The [model] section of the training config `model_toml` (with --key=value overrides); vocab_size 0, which
    train.py takes from the tokenizer, as the GPT-2 tokenizer's padded 50304."""
    from config import load_config
    cfg = load_config(model_toml, overrides or []).model
    return cfg if cfg.vocab_size else GPTConfig(**{**vars(cfg), "vocab_size": 50304})


def compile_label(compiled) -> str:
    """A variant's compile mode as the tables name it: False → "", True → " + compile", "graphs" → " + graphs"."""
    return {False: "", True: " + compile", "graphs": " + graphs"}[compiled]


def build_model(cfg: GPTConfig, lora_rank: int = 0, device: str = "cuda") -> GPT:
    """The benchmark's model on `device`: every weight trained, or (lora_rank > 0) LoRA updates of rank lora_rank
    (alpha 2·rank) on every block's four projections with the rest frozen, as train.lora_rank trains them."""
    model = GPT(cfg).to(device)
    if lora_rank:
        apply_lora(model, LoRASettings(lora_rank, 2.0 * lora_rank))
    return model


def make_train_step(attention: str, compiled, batch: int, block: int, tokens: str | None = None,
                    model_toml: str = "", llama_kernels: str = "torch", data=None, lora_rank: int = 0):
    """The benchmark's model and one optimizer step → (model, step); step() → loss. Each step takes the next batch
    of the loader `data` (loader_batch), or without one the same fixed batch. compiled: False (eager), True
    (torch.compile) or "graphs" (torch.compile's "reduce-overhead" mode: forward and backward replayed as CUDA
    graphs, as train.cuda_graphs runs them)."""
    torch.manual_seed(0)
    cfg = model_config(attention, block, model_toml, llama_kernels)
    model = build_model(cfg, lora_rank)
    opt = model.configure_optimizer(0.1, 6e-4, (0.9, 0.95), "cuda")  # the trained parameters only
    graphs = compiled == "graphs"
    step_model = (torch.compile(model, mode="reduce-overhead" if graphs else "default") if compiled else model)
    if data is None:
        fixed = fixed_batch(batch, block, tokens, vocab=cfg.vocab_size)  # (batch, block) each
        next_batch = lambda: fixed  # noqa: E731
    else:
        next_batch = lambda: loader_batch(data, batch, "cuda")  # noqa: E731

    def step():
        x, y = next_batch()  # (batch, block) each
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # a graph's output is overwritten by its next replay: the loss outlives it (queued_steps reads it later)
        return loss.detach().clone() if graphs else loss

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


def queued_steps(step, steps: int) -> float:
    """Milliseconds per step of `steps` steps queued back to back as train.py queues them: each step's loss is
    read back (.item()) only after the next step is queued, so the GPU never drains between steps and the host
    time of a step hides behind the GPU work of the one before. Wall clock, synchronised at both ends."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pending = None
    for _ in range(steps):
        loss = step()
        if pending is not None:
            pending.item()  # the previous step's loss, as train.py's settle() reads it
        pending = loss
    pending.item()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


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


def run_variant(attention: str, compiled, steps: int, warmup: int, batch: int, block: int,
                tiles: dict | None = None, tokens: str | None = None, model_toml: str = "",
                llama_kernels: str = "torch", data: str = "random", data_folder: str = "", lora_rank: int = 0) -> dict:
    """One variant measured in this process; data: "random" (the fixed batch), or "memory" / "shards", the
    loader of the prepared folder data_folder (open_train_data, as train.py opens it)."""
    from kernels.flash import forced_configs
    loader = None if data == "random" else open_train_data(data_folder, block, sharded=data == "shards", seed=0,
                                                           device="cuda")
    with forced_configs(**(tiles or {})):
        model, step = make_train_step(attention, compiled, batch, block, tokens, model_toml, llama_kernels, loader,
                                      lora_rank)
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
        times = timed_steps(step, steps)
        med = statistics.median(times) / 1e3
        wall, joules = time.perf_counter() - t0, energy() - e0 if energy else None
        queued_ms = queued_steps(step, steps)
        row_tiles = flash_tiles() if attention == "flash" else None
    tok_s = batch * block / med
    row = {"attention": attention, "compiled": compiled, "step_ms": med * 1e3, "tokens_per_s": tok_s,
           "mfu": model.flops_per_token() * tok_s / PEAK, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
           "warmup_s": warm_s, "loss": loss.item(), "params_M": model.num_params() / 1e6,
           "mean_step_ms": statistics.mean(times), "queued_step_ms": queued_ms,
           # a CUDA graph's memory pool is allocated while recording (warm-up), before the peak above is reset,
           # and replays allocate nothing: what the process holds is the comparable figure there
           "reserved_gib": torch.cuda.memory_reserved() / 2**30}
    if joules is not None:
        row.update(energy_j_per_step=joules / steps, power_w=joules / wall)
    return {**row, "tiles": row_tiles} if row_tiles else row


# A flash variant's suffix: the backward's structure, or "rope-pass" (a RoPE model rotates q and k in a pass
# of its own before the flash call instead of handing the tables to it: kernels option rope_in_flash off)
FLASH_SUFFIXES = {"split": ", split bwd", "fused": ", fused bwd", "rope-pass": ", RoPE pass"}


def parse_variant(variant: str) -> tuple[str, bool | str, str | None]:
    """'flash+compile/fused' -> ("flash", True, "fused"), 'sdpa+graphs' -> ("sdpa", "graphs", None): attention,
    compile mode (False, True or "graphs") and the flash suffix (FLASH_SUFFIXES; None where not given)."""
    name, _, suffix = variant.partition("/")
    attention, *mode = name.split("+")
    modes = {(): False, ("compile",): True, ("graphs",): "graphs"}
    mode = tuple(mode)
    if attention not in kernels.BACKENDS or mode not in modes or (
            suffix and (attention != "flash" or suffix not in FLASH_SUFFIXES)):
        raise ValueError(f"bad variant {variant!r}: expected ATTENTION[+compile|+graphs][/split|/fused|/rope-pass] "
                         "with ATTENTION one of flash, sdpa, naive (a suffix only for flash)")
    return attention, modes[mode], suffix or None


def use_variant(variant: str) -> tuple[str, bool | str]:
    """Parse a variant and set its flash options for this process → (attention, compiled)."""
    attention, compiled, suffix = parse_variant(variant)
    if suffix == "rope-pass":
        kernels.options.update(rope_in_flash=False)
    elif suffix:
        kernels.options.update(backward=suffix)
    return attention, compiled


def run_isolated(variant: str, data: str, data_folder: str, args) -> dict:
    """run_variant in a fresh Python process (this script with --worker); its JSON row, or an error row."""
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", variant, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch", str(args.batch), "--block", str(args.block),
           "--tiles", args.tiles, "--tokens", args.tokens, "--loss", args.loss, "--model", args.model,
           "--llama-kernels", args.llama_kernels, "--data", data, "--data-folder", data_folder,
           "--lora-rank", str(args.lora_rank)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"worker exit {proc.returncode}: {tail}"[:300]}


def run_in_process(variant: str, data: str, data_folder: str, args) -> dict:
    saved = kernels.options.get()
    attention, compiled = use_variant(variant)
    try:
        return run_variant(attention, compiled, args.steps, args.warmup, args.batch, args.block,
                           parse_tiles(args.tiles), args.tokens, args.model, args.llama_kernels, data, data_folder,
                           args.lora_rank)
    except Exception as e:  # one failure (OOM, compile error) must not hide the other variants
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        kernels.options.update(backward=saved.backward)


def combine(variant: str, runs: list, data: str = "random") -> dict:
    """One table row from a variant's runs on one --data kind: the median step over the runs that did not fail."""
    attention, compiled, suffix = parse_variant(variant)
    name = f"{attention}{compile_label(compiled)}{FLASH_SUFFIXES[suffix] if suffix else ''}"
    row = {"variant": f"{name}, {DATA_KINDS[data]}" if DATA_KINDS[data] else name, "attention": attention,
           "compiled": compiled, "data": data, "base": name}
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {**row, "error": runs[-1]["error"]}
    step = statistics.median(r["step_ms"] for r in ok)
    tok_s = ok[0]["tokens_per_s"] * ok[0]["step_ms"] / step
    return {**row, "step_ms": step, "tokens_per_s": tok_s, "mfu": ok[0]["mfu"] / ok[0]["tokens_per_s"] * tok_s,
            "peak_mem_gib": max(r["peak_mem_gib"] for r in ok), "reserved_gib": _max_of(ok, "reserved_gib"),
            "runs_step_ms": [r.get("step_ms") for r in runs],
            "runs_tiles": [r.get("tiles") for r in runs], "errors": [r["error"] for r in runs if "error" in r],
            "energy_j_per_step": _median_of(ok, "energy_j_per_step"), "power_w": _median_of(ok, "power_w"),
            "mean_step_ms": _median_of(ok, "mean_step_ms"), "queued_step_ms": _median_of(ok, "queued_step_ms"),
            "runs_queued_step_ms": [r.get("queued_step_ms") for r in runs]}


def _max_of(runs: list, key: str):
    values = [r[key] for r in runs if r.get(key) is not None]
    return max(values) if values else None


def memory_cell(row: dict) -> str:
    """The table's memory figure: the peak allocated over the timed steps; for +graphs variants also the memory
    reserved, since their graphs' pool was allocated before the timed steps and the peak misses it."""
    cell = f"{row['peak_mem_gib']:.1f}"
    if row.get("compiled") == "graphs" and row.get("reserved_gib") is not None:
        cell += f" ({row['reserved_gib']:.1f} reserved)"
    return cell


def _median_of(runs: list, key: str):
    """The median of a key over the runs that have it (None if none has)."""
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def describe_model(args) -> str:
    """The measured model in words: GPT-2 124M, or the config file's name and shape."""
    lora = f", LoRA rank {args.lora_rank} (the rest frozen)" if getattr(args, "lora_rank", 0) else ""
    if not getattr(args, "model", ""):
        return "GPT-2 124M" + lora
    c = model_config("sdpa", args.block, args.model, args.llama_kernels)
    return (f"{os.path.basename(args.model)} ({c.n_layer} layers, {c.n_embd} wide, {c.n_head}/{c.n_kv_head or c.n_head} "
            f"heads, {c.pos_emb}, {c.norm}, {c.mlp}; Llama pieces on {args.llama_kernels}){lora}")


def describe_data(args) -> str:
    """What fed the steps, in words: the fixed batch's tokens and/or the loaders and their corpus."""
    kinds = parse_data(getattr(args, "data", "random"))
    fixed = "tokens of " + args.tokens if args.tokens else "uniform random tokens"
    parts = [fixed if kinds == ["random"] else f"random: one fixed batch of {fixed}"] if "random" in kinds else []
    loaders = [f"{k} ({DATA_KINDS[k]})" for k in kinds if k != "random"]
    if loaders:
        source = f"the first tokens of {args.tokens}" if args.tokens else "uniform random tokens"
        parts.append(f"{' and '.join(loaders)}: the loader's next batch every step, fetched and copied to the GPU "
                     f"inside the timed step as train.py does (data/batches.py); GPT-2 text of {source}, "
                     f"{loader_tokens(args.steps, args.warmup, args.batch, args.block):,} tokens read per run, "
                     f"shards of {4 * args.batch * args.block:,} tokens")
    return "; ".join(parts)


def write_results(rows: list, args, argv) -> str:
    """Table (markdown) + JSON of the variants measured so far: written after each run, so a timeout keeps them."""
    device = torch.cuda.get_device_name()
    cmd = "python bench/train.py " + " ".join(argv if argv is not None else sys.argv[1:])
    how = ("all in one process" if args.in_process else
           f"each in a fresh process, {args.repeats} per variant (order reversed every other round)")
    lines = [f"# {describe_model(args)} training step — {device}", "",
             f"`{cmd.strip()}` — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, "
             f"torch {torch.__version__}, batch {args.batch}×{args.block}, bf16 autocast, fused AdamW, "
             f"median of {args.steps} steps per run, each synchronised at its end (then {args.steps} more queued back to "
             f"back for the queued figure), {how}; {describe_data(args)}; loss kernel {args.loss}; "
             f"commit {git_commit()}", "",
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
                         f"{memory_cell(r)} | {energy} | {per_run} |")
    ok = [r for r in rows if "step_ms" in r]
    for flash in ok:
        sdpa = next((r for r in ok if r["attention"] == "sdpa" and r["compiled"] == flash["compiled"]
                     and r["data"] == flash["data"]), None)
        if not (sdpa and flash["attention"] == "flash" and flash["compiled"]):
            continue
        name, ratio = flash["variant"], flash["tokens_per_s"] / sdpa["tokens_per_s"]
        lines += ["", f"{name} / {sdpa['variant']} = **{ratio:.3f}×** (target ≥ 1.0×: "
                      f"{'met' if ratio >= 1.0 else 'NOT met'}); {name} MFU {flash['mfu']:.1%} (stretch 50%)"]
        pairs = [(a, b) for a, b in zip(flash["runs_step_ms"], sdpa["runs_step_ms"]) if a and b]
        if len(pairs) > 1:
            lines.append("per round: " + ", ".join(f"{b / a:.3f}×" for a, b in pairs))
        if flash.get("queued_step_ms") and sdpa.get("queued_step_ms"):
            queued = sdpa["queued_step_ms"] / flash["queued_step_ms"]
            lines.append(f"steps queued back to back as train.py runs them (each loss read after the next step is "
                         f"queued): {flash['queued_step_ms']:.2f} against {sdpa['queued_step_ms']:.2f} ms, "
                         f"**{queued:.3f}×**")
            pairs = [(a, b) for a, b in zip(flash["runs_queued_step_ms"], sdpa["runs_queued_step_ms"]) if a and b]
            if len(pairs) > 1:
                lines.append("queued, per round: " + ", ".join(f"{b / a:.3f}×" for a, b in pairs))
    for memory in (r for r in ok if r["data"] == "memory"):
        shards = next((r for r in ok if r["data"] == "shards" and r["base"] == memory["base"]), None)
        if shards is None:
            continue
        ratio = shards["tokens_per_s"] / memory["tokens_per_s"]
        lines += ["", f"{memory['base']}: sharded / in-memory loader = **{ratio:.3f}×** tokens/s (target ≥ 0.99×: "
                      f"{'met' if ratio >= 0.99 else 'NOT met'})"]
        if shards.get("mean_step_ms") and memory.get("mean_step_ms"):
            lines[-1] += (f"; mean step {shards['mean_step_ms']:.2f} ms sharded, {memory['mean_step_ms']:.2f} ms "
                          "in-memory")
        pairs = [(a, b) for a, b in zip(memory["runs_step_ms"], shards["runs_step_ms"]) if a and b]
        if len(pairs) > 1:
            lines.append("per round: " + ", ".join(f"{a / b:.3f}×" for a, b in pairs))
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
        json.dump({"device": device, "torch": torch.__version__, "commit": git_commit(), "command": cmd,
                   "rows": rows}, f, indent=1)
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
                   help="attention backends, '+compile' for torch.compile, '+graphs' for its CUDA-graph mode; "
                        "the headline pair runs first")
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
    p.add_argument("--data", default="random", metavar="KIND,...",
                   help="what feeds the steps, each kind measured for every variant: random (one fixed batch), "
                        "memory (the in-memory loader, TokenData), shards (the sharded loader, ShardedData); the "
                        "loaders compared on GPT-2 124M: python bench/train.py --steps 20 --repeats 3 --variants "
                        "flash+compile --data memory,shards")
    p.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help="train LoRA updates of rank R (alpha 2R) on every block's projections, the rest frozen "
                        "(model/lora.py; MFU still counts a full step's 6N FLOPs per token); 0 = every weight")
    p.add_argument("--worker", metavar="VARIANT", help=argparse.SUPPRESS)  # run_isolated's child: one JSON line
    p.add_argument("--data-folder", default="", help=argparse.SUPPRESS)  # the worker's prepared loader folder
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        print("error: --repeats and --steps must be at least 1", file=sys.stderr)
        return 2
    if args.lora_rank < 0:
        print(f"error: --lora-rank {args.lora_rank}: must be a rank, or 0 (every weight trained)", file=sys.stderr)
        return 2
    if args.tokens and not os.path.isfile(args.tokens):
        print(f"error: --tokens {args.tokens}: no such file", file=sys.stderr)
        return 2
    variants = args.variants.split(",")
    try:
        tiles = parse_tiles(args.tiles)
        vocab = model_config("sdpa", args.block, args.model, args.llama_kernels).vocab_size  # a bad file: one line
        for variant in [args.worker] if args.worker else variants:
            parse_variant(variant)
        kinds = parse_data(args.data)
        if vocab < GPT2_VOCAB and kinds != ["random"]:
            raise ValueError(f"--data {args.data}: the loaders read GPT-2 tokens (ids below {GPT2_VOCAB}), more "
                             f"than the model's vocabulary of {vocab}")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: bench/train.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    kernels.options.update(loss_kernel=args.loss)  # (workers get --loss too)
    if args.worker:
        attention, compiled = use_variant(args.worker)
        print(json.dumps(run_variant(attention, compiled, args.steps, args.warmup, args.batch, args.block, tiles,
                                     args.tokens, args.model, args.llama_kernels, kinds[0], args.data_folder,
                                     args.lora_rank)))
        return 0
    jobs = [(v, d) for v in variants for d in kinds]  # a variant's data kinds measured one after the other
    runs: dict[tuple, list] = {job: [] for job in jobs}
    with contextlib.ExitStack() as stack:
        try:
            folders = stack.enter_context(loader_folders(
                kinds, loader_tokens(args.steps, args.warmup, args.batch, args.block), args.batch, args.block,
                args.tokens))
        except (ValueError, OSError) as e:  # the loaders' corpus could not be written or prepared
            print(f"error: {e}", file=sys.stderr)
            return 2
        for rnd in range(args.repeats):
            for variant, data in jobs if rnd % 2 == 0 else jobs[::-1]:
                run = run_in_process if args.in_process else run_isolated
                r = run(variant, data, folders.get(data, ""), args)
                runs[variant, data].append(r)
                print(json.dumps({"variant": variant, "data": data, "round": rnd, **r}), flush=True)
                text = write_results([combine(v, runs[v, d], d) for v, d in jobs if runs[v, d]], args, argv)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
