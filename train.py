"""Train a GPT from a config.

    python train.py configs/demo.toml [--key=value ...] [--resume]
    torchrun --nproc_per_node=8 train.py configs/gpt2_124m.toml          # DistributedDataParallel

Writes into train.out_dir: ckpt_<step>.pt (last train.keep_last kept) and best.pt, config.toml,
metrics.jsonl and loss.png. Ctrl-C saves a checkpoint and exits; --resume continues exactly.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time

import torch

if not torch.cuda.is_available():  # flash on a CPU runs in Triton's interpreter, chosen before kernels load
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels  # noqa: E402
from config import SECTIONS, ConfigError, RunConfig, format_config, load_config  # noqa: E402
from data.loader import TokenData  # noqa: E402
from data.prepare import DataError, prepare  # noqa: E402
from data.tokenizers import TokenizerError  # noqa: E402
from model import GPT  # noqa: E402
from model.checkpoint import CheckpointError, load_checkpoint, save_run_checkpoint  # noqa: E402
from model.device import pick_device, pick_dtype  # noqa: E402
from runlog import RunLog  # noqa: E402

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


class TrainError(RuntimeError):
    """A problem that stops training with a one-line message (non-finite loss, unwritable run folder)."""


def build_parser() -> argparse.ArgumentParser:
    keys = []
    for section in SECTIONS:
        obj = getattr(RunConfig(), section)
        keys.append(f"  [{section}] " + ", ".join(f"{f.name}={getattr(obj, f.name)!r}"
                                                  for f in dataclasses.fields(obj)))
    p = argparse.ArgumentParser(
        description="Train a GPT from a TOML config, with --key=value overrides.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (defaults), overridable as --key=value or --section.key=value:\n" + "\n".join(keys))
    p.add_argument("config", nargs="?", help="TOML config file (see configs/)")
    p.add_argument("--resume", action="store_true", help="continue the run in train.out_dir from its last checkpoint")
    return p


def setup_distributed():
    """(rank, local_rank, world_size); initialises the process group under torchrun."""
    if "RANK" not in os.environ:
        return 0, 0, 1
    import torch.distributed as dist
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend)
    return dist.get_rank(), local_rank, dist.get_world_size()


def peak_flops(cfg_tflops: float, device: torch.device) -> float | None:
    if cfg_tflops > 0:
        return cfg_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_BF16_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None


def lr_at(it: int, t) -> float:
    """Linear warmup to learning_rate, then cosine decay to min_lr over lr_decay_iters (or max_iters)."""
    decay_iters = t.lr_decay_iters or t.max_iters
    if it < t.warmup_iters:
        return t.learning_rate * (it + 1) / (t.warmup_iters + 1)
    if it >= decay_iters:
        return t.min_lr
    ratio = (it - t.warmup_iters) / max(1, decay_iters - t.warmup_iters)
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (t.learning_rate - t.min_lr)


@torch.no_grad()
def estimate_loss(model, data: TokenData, t, device, autocast) -> dict:
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = []
        for _ in range(t.eval_iters):
            x, y = data.eval_batch(split, t.batch_size)
            with autocast:
                _, loss = model(x.to(device), y.to(device))
            losses.append(loss.item())
        out[split] = sum(losses) / len(losses)
    model.train()
    return out


def check_writable(folder: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as e:
        raise TrainError(f"run directory {folder!r} is not writable ({e.strerror or e})") from None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def train(cfg: RunConfig) -> dict:
    """Run training to completion; returns a summary dict. Raises TrainError/ConfigError/DataError."""
    rank, local_rank, world = setup_distributed()
    master = rank == 0
    t = cfg.train
    device = pick_device(t.device, local_rank, what="train.device")
    dtype = pick_dtype(t.dtype, device, what="train.dtype")
    resume = t.init_from == "resume"
    ckpt = None
    if master:
        check_writable(t.out_dir)
    if resume:
        ckpt = load_checkpoint(t.out_dir, map_location="cpu")
        saved = RunConfig.from_dict(ckpt["config"])
        cfg.model = saved.model  # the architecture comes from the checkpoint; training keys may change
        cfg.data = saved.data
    elif master and any(f.startswith("ckpt_") or f == "best.pt" for f in os.listdir(t.out_dir)):
        raise TrainError(f"run directory {t.out_dir!r} already holds checkpoints: pass --resume to continue "
                         "it, or choose another --out_dir")

    # Data: tokenised once by rank 0; the other ranks wait, then find the token files in the cache.
    def prepare_data() -> str:
        return prepare(cfg.data.dataset, cfg.data.tokenizer, val_fraction=cfg.data.val_fraction,
                       num_proc=cfg.data.num_proc, cache_dir=cfg.data.cache_dir, verbose=master)
    folder = prepare_data() if master else None
    if world > 1:
        import torch.distributed as dist
        dist.barrier()
    folder = folder or prepare_data()
    data = TokenData(folder, cfg.model.block_size, seed=t.seed)
    tok_vocab = data.meta["vocab_size"]
    baseline = data.unigram_loss()  # what a model that ignores context scores on val
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = (tok_vocab + 63) // 64 * 64 if tok_vocab > 1000 else tok_vocab
    elif cfg.model.vocab_size < tok_vocab:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size}: smaller than the tokenizer's {tok_vocab}")
    cfg.model.attention = kernels.resolve_backend(cfg.model.attention, device)

    torch.manual_seed(t.seed + rank)
    model = GPT(cfg.model).to(device)
    optimizer = model.configure_optimizer(t.weight_decay, t.learning_rate, (t.beta1, t.beta2), device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    start_iter, best_val = 0, float("inf")
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        data.load_state_dict(ckpt["data"])
        set_rng_state(ckpt["rng"])
        start_iter, best_val = ckpt["iter"], ckpt["best_val"]
        del ckpt
    raw_model = model
    if t.compile:
        model = torch.compile(model)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())

    tokens_per_step = t.batch_size * t.grad_accum_steps * world * cfg.model.block_size
    peak = peak_flops(t.peak_tflops, device)
    if master:
        print(format_config(cfg))
        print(f"device {device} ({dtype}), attention backend: {cfg.model.attention}, "
              f"loss kernel: {kernels.resolve_loss_kernel(cfg.model.loss_kernel, device)}, world size {world}, "
              f"{raw_model.num_params() / 1e6:.2f}M parameters, {tokens_per_step:,} tokens/step"
              + (f", resuming at step {start_iter}" if resume else ""))
        print(f"unigram baseline val loss: {baseline:.4f} (uniform: {math.log(tok_vocab):.4f})")
        with open(os.path.join(t.out_dir, "config.toml"), "w") as f:
            f.write(format_config(cfg) + "\n")
    log = RunLog(t.out_dir, cfg.to_dict(), use_wandb=t.wandb, project=t.wandb_project,
                 run_name=t.wandb_run_name, enabled=master)
    if master and resume:
        _truncate_metrics(log.path, start_iter)

    def checkpoint(it: int, is_best: bool) -> str | None:
        if not master:
            return None
        state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "config": cfg.to_dict(),
                 "tokenizer": data.meta["tokenizer"], "iter": it, "best_val": best_val,
                 "data": snapshot["data"], "rng": snapshot["rng"], "version": 1}
        try:
            return save_run_checkpoint(state, t.out_dir, it, t.keep_last, is_best)
        except OSError as e:
            raise TrainError(f"could not write a checkpoint into {t.out_dir!r} ({e.strerror or e}); "
                             "the previous checkpoint is intact") from None

    from tqdm import tqdm
    bar = tqdm(total=t.max_iters, initial=start_iter, disable=not master, dynamic_ncols=True, desc="train")
    it, last_eval, last_ckpt = start_iter, {}, None
    t_start, t_last, tokens_since = time.time(), time.time(), 0
    # A step's loss and grad norm stay on the device until they are needed: the loss of step i is read while
    # step i + 1 runs (so the host does not wait for the GPU after every step, and the GPU does not wait for
    # the host to launch the next one), at once on log steps, and always before an evaluation or a
    # checkpoint, so a checkpoint never holds weights that a non-finite step has touched.
    pending = None  # (step, loss, grad norm) of the last step, not read back yet

    def settle():
        """Read back the pending step (waits for it on the GPU); a non-finite loss stops the run."""
        nonlocal pending
        step, loss_t, norm_t = pending
        loss_value, norm_value = loss_t.item(), norm_t.item()
        if not math.isfinite(loss_value):
            raise TrainError(f"non-finite loss ({loss_value}) at step {step}: stopping; the last good "
                             f"checkpoint is {last_ckpt or 'none (no checkpoint was written yet)'}")
        pending = None  # only now: a Ctrl-C during the read-back leaves the step to check in the handler
        return loss_value, norm_value

    try:
        while True:
            snapshot = {"data": data.state_dict(), "rng": rng_state()}  # the state at the top of step `it`
            out_of_time = t.max_time > 0 and time.time() - t_start > t.max_time
            last = it >= t.max_iters or out_of_time
            if (it % t.eval_interval == 0 or last) and not (resume and it == start_iter):
                if pending is not None:
                    settle()
                losses = estimate_loss(raw_model, data, t, device, autocast)
                snapshot["data"] = data.state_dict()  # evaluation draws from its own generators
                is_best = losses["val"] < best_val
                best_val = min(best_val, losses["val"])
                last_eval = losses
                log.log({"iter": it, "train_loss": losses["train"], "val_loss": losses["val"]})
                log.plot()
                last_ckpt = checkpoint(it, is_best) or last_ckpt
                bar.write(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if last:
                break
            lr = lr_at(it, t)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_loss = torch.zeros((), device=device)
            micro = data.train_batches(t.batch_size, t.grad_accum_steps, rank, world)
            for m, (x, y) in enumerate(micro):
                sync = m == len(micro) - 1
                no_sync = model.no_sync() if world > 1 and not sync else contextlib.nullcontext()
                with no_sync, autocast:
                    _, loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                    loss = loss / len(micro)
                scaler.scale(loss).backward()
                step_loss += loss.detach()
            if world > 1:
                import torch.distributed as dist
                dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
            if pending is not None:
                settle()  # the previous step, while this one's forward and backward run on the GPU
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), t.grad_clip if t.grad_clip > 0
                                                       else float("inf"))
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            pending = (it, step_loss, grad_norm)
            it += 1
            bar.update(1)
            tokens_since += tokens_per_step
            if it % t.log_interval == 0 or it == t.max_iters:
                loss_value, grad_norm = settle()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                now = time.time()
                tok_s = tokens_since / (now - t_last)
                t_last, tokens_since = now, 0
                record = {"iter": it, "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tok_s}
                if peak is not None:
                    record["mfu"] = raw_model.flops_per_token() * tok_s / world / peak
                if device.type == "cuda":
                    record["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                log.log(record)
                bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tok_s:,.0f}")
    except KeyboardInterrupt:
        bar.close()
        if pending is not None:
            settle()  # never save the weights of a non-finite step
        path = checkpoint(it, False)
        log.close()
        raise TrainError(f"interrupted at step {it}; checkpoint saved to {path}; continue with --resume") from None
    finally:
        bar.close()
    log.close()
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
    summary = {"iters": it, "val_loss": last_eval.get("val"), "train_loss": last_eval.get("train"),
               "best_val": best_val, "unigram_val_loss": baseline, "checkpoint": last_ckpt,
               "seconds": time.time() - t_start}
    if master:
        print(f"done: {it} steps in {summary['seconds']:.0f}s, val loss {summary['val_loss']:.4f} "
              f"(unigram baseline {summary['unigram_val_loss']:.4f}); checkpoint {last_ckpt}")
    return summary


def _truncate_metrics(path: str, upto_iter: int) -> None:
    """On resume, drop the rows an interrupted run logged after the checkpoint it resumes from."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip()]
    kept = [r for r in rows if json.loads(r).get("iter", 0) <= upto_iter]
    with open(path, "w") as f:
        f.writelines(kept)


def main(argv=None) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        if args.resume:
            cfg.train.init_from = "resume"
        train(cfg)
    except (ConfigError, DataError, TokenizerError, CheckpointError, TrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
