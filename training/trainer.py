"""One training run: Trainer.setup() (checkpoint, data, model, log), then Trainer.run(), whose loop is made of
step(), log_step(), evaluate() and checkpoint(). train.py holds the command line and the run folder's lock around it.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import torch

import kernels
from config import NO_EOT_FOR_DOC_MASK, ConfigError, RunConfig, apply_changes, format_config, resume_config
from data.batches import open_train_data, to_device
from data.chat_data import prepare_chat
from data.prepare import prepare
from data.shards import prepare_shards
from data.tokenizers import spec_difference
from model import GPT
from model.checkpoint import (BEST_DIR_PATTERN, CheckpointError, find_checkpoint, load_checkpoint,
                              remove_stale_temp_dirs, save_run_checkpoint)
from model.device import pick_device, pick_dtype
from model.lora import LoRASettings, apply_lora
from model.parallel import (auto_blocks_per_unit, broadcast_parameters, check_parallel, clip_grad_norm,
                            compile_blocks, compile_root, enable_activation_checkpointing,
                            end_single_process_group, load_full_optimizer_state, load_sharded_state,
                            optimizer_groups, set_gradient_sync, shard_model, sharded_state,
                            start_single_process_group)
from model.sharded_checkpoint import (load_rank_state, open_sharded_checkpoint, read_sharded_tensors,
                                      save_sharded_checkpoint)
from training.errors import Stopped, TrainError
from training.evaluate import document_kwargs, estimate_loss
from training.pretrained import load_pretrained, settle_run_config
from training.runfolder import format_bytes, remove_stale_temp_files, write_text_atomic
from training.runlog import RunLog, rewind_metrics
from training.schedule import lr_at, peak_flops
from training.signals import Interrupted, StopSignals


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

class Trainer:
    """One training run of `cfg` in cfg.train.out_dir (the caller holds the folder's lock on rank 0).

    setup() opens the checkpoint when resuming (returning False when the run has nothing left to do),
    prepares the data, builds the model and starts the log; run() trains to train.max_iters (or max_time)
    and returns a summary. Only rank 0 writes into the run folder. Problems raise TrainError, ConfigError,
    DataError or CheckpointError with one line.
    """

    def __init__(self, cfg: RunConfig, *, rank: int = 0, local_rank: int = 0, world: int = 1,
                 signals: StopSignals | None = None, allow_config_change: bool = False):
        self.cfg, self.t = cfg, cfg.train
        self.rank, self.local_rank, self.world, self.master = rank, local_rank, world, rank == 0
        self.signals = signals or StopSignals()
        self.allow_config_change = allow_config_change
        self.device = pick_device(self.t.device, local_rank, what="train.device")
        self.dtype = pick_dtype(self.t.dtype, self.device, what="train.dtype")
        check_parallel(self.t, self.device, self.dtype)
        if self.t.cuda_graphs and (self.device.type != "cuda" or world > 1):
            where = f"on {self.device}" if self.device.type != "cuda" else f"with {world} processes"
            raise ConfigError(f"train.cuda_graphs=true {where}: CUDA graphs run on one CUDA GPU in one process; "
                              "set train.cuda_graphs=false")
        self.sharded = self.t.parallel == "fsdp"
        # FSDP2 needs a process group even for one process: without torchrun, this run starts its own
        self.solo_group = self.sharded and world == 1 and start_single_process_group(self.device)
        self.resume = self.t.init_from == "resume"
        self.it = self.start_iter = 0
        self.best_val = float("inf")
        self.last_eval: dict = {}
        self.last_ckpt: str | None = None  # the last checkpoint written (or resumed from)
        self.finished = False              # resumed a run that had already reached max_iters
        self.init = None                   # pretrained.Pretrained of train.init_from (a fresh fine-tuning run)
        self.lora: LoRASettings | None = None  # train.lora_*: the trained updates (model/lora.py), or None
        self.trainable: int | None = None  # with LoRA: the trained parameters
        self.lora_base = ""                # with LoRA: train.init_from of the run's start
        # A step's loss and grad norm stay on the device until they are needed: the loss of step i is read
        # while step i + 1 runs (so the host does not wait for the GPU after every step, and the GPU does not
        # wait for the host to launch the next one), at once on log steps, and always before an evaluation or
        # a checkpoint, so a checkpoint never holds weights that a non-finite step has touched.
        self.pending = None       # (step, loss, grad norm, ranks asked to stop) of the last step, not read back
        self.stop_agreed = False  # under DDP: a settled step says some rank was asked to stop
        self.log = None
        self.bar = None

    # ------------------------------------------------------------------------------------------------ setup

    def setup(self) -> bool:
        """Everything before the first step; False when a resumed run has already reached max_iters."""
        ckpt = self._open_checkpoint() if self.resume else self._check_fresh_folder()
        if self.finished:
            return False
        if self.master:
            count, size = remove_stale_temp_files(self.t.out_dir)
            if count:
                print(f"note: removed {count} temporary file(s) ({format_bytes(size)}) that an interrupted "
                      f"write left in {self.t.out_dir}", file=sys.stderr)
            count, size = remove_stale_temp_dirs(self.t.out_dir)
            if count:
                print(f"note: removed {count} temporary folder(s) ({format_bytes(size)}) that an interrupted "
                      f"checkpoint write left in {self.t.out_dir}", file=sys.stderr)
        self._open_pretrained()
        self._load_data(ckpt)
        self._build_model(ckpt)
        self._start_log()
        return True

    def _open_pretrained(self) -> None:
        """A fresh run with train.init_from = "hf:..." or a run folder: load those weights, take their shape
        and tokenizer (pretrained.settle_run_config). With train.export_hf, check that the model has a Hugging
        Face architecture before training."""
        t = self.t
        if not self.resume and t.init_from != "scratch":
            self.init = load_pretrained(t.init_from)
            settle_run_config(self.cfg, self.init)
            if self.master:
                print(f"init: weights of {self.init.source} ({self.init.tokenizer.name} tokenizer, "
                      f"vocab {self.init.tokenizer.vocab_size})")
        if t.export_hf:
            from model.export import ExportError, hf_family
            try:
                hf_family(self.cfg.model)
            except ExportError as e:
                raise ConfigError(f"train.export_hf: {e}") from None

    def _data_tokenizer(self, ckpt: dict | None):
        """What data.prepare tokenises with: the pretrained tokenizer (a fresh fine-tuning run), the checkpoint's
        own (resuming a run whose tokenizer is not rebuilt from the corpus: 'model' and 'hf:...', offline),
        else data.tokenizer by name."""
        name = self.cfg.data.tokenizer
        if self.init is not None:
            return self.init.tokenizer.spec()
        if ckpt is not None and name not in ("char", "gpt2"):
            if ckpt.get("tokenizer") is None:
                raise TrainError(f"--resume: {ckpt['path']} holds no tokenizer spec for data.tokenizer={name!r}")
            return ckpt["tokenizer"]
        return name

    def _open_checkpoint(self) -> dict | None:
        """Load the run's latest checkpoint; settle the config it resumes with (see config.resume_config)."""
        t = self.t
        path = find_checkpoint(t.out_dir)
        if os.path.isdir(path) and self.sharded:  # its metadata now; the shards once the model is sharded
            ckpt = open_sharded_checkpoint(path, self.rank, self.world)
        else:
            ckpt = load_checkpoint(path, map_location="cpu")
        step = ckpt["iter"]
        if step > t.max_iters:
            raise ConfigError(f"train.max_iters={t.max_iters} is below the step of the checkpoint to resume "
                              f"({ckpt['path']}, step {step}): pass a larger --max_iters")
        self.last_ckpt = ckpt["path"]
        if step == t.max_iters:
            self.finished, self.it = True, step
            if self.master:
                print(f"{t.out_dir}: the run has already finished (its checkpoint {ckpt['path']} is at step "
                      f"{step} = train.max_iters); nothing to do: pass a larger --max_iters to train further")
            return None
        cfg, changes = resume_config(self.cfg, RunConfig.from_dict(ckpt["config"]))
        if changes and not self.allow_config_change:
            raise ConfigError(
                "--resume: " + "; ".join(map(str, changes)) + ". The checkpoint's [model] and [data] settings "
                f"hold: drop these (resume with the run's own {os.path.join(t.out_dir, 'config.toml')}), or "
                "pass --allow-config-change to apply them")
        if changes and self.master:
            print("note: --allow-config-change: " + "; ".join(f"{c.key} {c.saved!r} -> {c.asked!r}"
                                                              for c in changes), file=sys.stderr)
        apply_changes(cfg, changes)
        self.cfg.model, self.cfg.data = cfg.model, cfg.data
        return ckpt

    def _check_fresh_folder(self) -> None:
        if self.master and any(f.startswith("ckpt_") or f == "best.pt" or BEST_DIR_PATTERN.fullmatch(f)
                               for f in os.listdir(self.t.out_dir)):
            raise TrainError(f"run directory {self.t.out_dir!r} already holds checkpoints: pass --resume to "
                             "continue it, or choose another --out_dir")
        return None

    def _load_data(self, ckpt: dict | None) -> None:
        """Token files or shards (data.format; tokenised once, by rank 0; the other ranks wait, then find them
        in the cache)."""
        cfg = self.cfg
        tokenizer = self._data_tokenizer(ckpt)

        d, sharded, chat = cfg.data, cfg.data.format == "shards", cfg.data.format == "chat"

        def prepare_data() -> str:
            if chat:
                return prepare_chat(d.dataset, tokenizer, val_fraction=d.val_fraction, column=d.messages_column,
                                    cache_dir=d.cache_dir, verbose=self.master)
            if sharded:
                return prepare_shards(d.dataset, tokenizer, shard_tokens=d.shard_tokens, val_docs=d.val_docs,
                                      text_column=d.text_column, num_proc=d.num_proc, cache_dir=d.cache_dir,
                                      verbose=self.master)
            return prepare(d.dataset, tokenizer, val_fraction=d.val_fraction, num_proc=d.num_proc,
                           cache_dir=d.cache_dir, verbose=self.master)
        folder = prepare_data() if self.master else None
        self._barrier()
        folder = folder or prepare_data()
        self.data = open_train_data(folder, cfg.model.block_size, sharded=sharded, seed=self.t.seed,
                                    device=self.device, chat=chat)
        if chat and self.master and sum(self.data.dropped.values()):
            print(f"note: {self.data.dropped['train']} train and {self.data.dropped['val']} val conversations have "
                  f"no assistant token within block_size={cfg.model.block_size} and are never drawn",
                  file=sys.stderr)
        if ckpt is not None and ckpt.get("tokenizer") is not None:
            difference = spec_difference(ckpt["tokenizer"], self.data.meta["tokenizer"])
            if difference:
                raise TrainError(f"--resume: the tokenizer of data.dataset={cfg.data.dataset!r} no longer matches "
                                 f"the checkpoint's: {difference}; the data changed since the run started: "
                                 "restore it, or start a new run in another --out_dir")
        tok_vocab = self.data.meta["vocab_size"]
        self.tok_vocab = tok_vocab
        self.baseline = self.data.unigram_loss()  # what a model that ignores context scores on val
        if cfg.model.vocab_size == 0:
            cfg.model.vocab_size = (tok_vocab + 63) // 64 * 64 if tok_vocab > 1000 else tok_vocab
        elif cfg.model.vocab_size < tok_vocab:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size}: smaller than the tokenizer's {tok_vocab}")
        cfg.model.attention = kernels.resolve_backend(cfg.model.attention, self.device)
        self.eot = None  # the end-of-text token that ends each document, under train.doc_mask
        if self.t.doc_mask:
            self.eot = self.data.eot_token
            if self.eot is None:
                raise ConfigError(NO_EOT_FOR_DOC_MASK.format(
                    what=f"the {self.data.meta['tokenizer'].get('kind')} tokenizer of data.dataset="
                         f"{cfg.data.dataset!r}"))

    def _build_model(self, ckpt: dict | None) -> None:
        """Model, optimizer and grad scaler; restored from the checkpoint when resuming. Activation checkpointing
        and compile as configured; then DDP-wrapped (world > 1) or sharded with FSDP2 (model/parallel.py)."""
        t, device = self.t, self.device
        torch.manual_seed(t.seed + self.rank)
        model = GPT(self.cfg.model).to(device)
        if self.init is not None:
            model.load_state_dict(self.init.state_for(self.cfg.model))
            self.init.state = {}  # the model holds the weights now
        self.lora = t.lora_settings()
        if ckpt is not None:
            check_resumed_lora(self.lora, ckpt)
        self.trainable = apply_lora(model, self.lora) if self.lora else None
        # the weights the updates apply to, as the user named them (a PEFT adapter's base model)
        self.lora_base = (ckpt.get("lora") or {}).get("base", "") if ckpt is not None else t.init_from
        from_shards = ckpt is not None and ckpt.get("sharded", False)
        if ckpt is not None and not from_shards:
            self._load_weights(model, lambda: model.load_state_dict(ckpt["model"]), ckpt["path"])
        if t.activation_checkpointing:
            enable_activation_checkpointing(model)
        if self.sharded:
            if ckpt is None and self.world > 1:
                broadcast_parameters(model)  # every rank starts from rank 0's weights, as under DDP
            self.fsdp_unit = t.fsdp_blocks_per_unit or auto_blocks_per_unit(self.cfg.model.n_layer, self.world)
            if t.compile:  # blocks and the root's own work, FSDP2's hooks left outside (the whole model under DDP)
                compile_blocks(model, self.fsdp_unit)
                compile_root(model)
            shard_model(model, device, self.dtype if device.type == "cuda" else None, self.fsdp_unit)
        self.optimizer = model.configure_optimizer(t.weight_decay, t.learning_rate, (t.beta1, t.beta2),
                                                   device.type)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype == torch.float16)
        if ckpt is not None:
            if from_shards:
                self._load_weights(model, lambda: load_sharded_state(
                    model, self.optimizer, ckpt["optimizer_groups"], ckpt["tensors"],
                    lambda targets: read_sharded_tensors(ckpt["path"], targets)), ckpt["path"])
                rank_state = load_rank_state(ckpt["path"], ckpt, self.rank)
            else:
                rank_state = ckpt
                if self.sharded:
                    self._load_weights(model, lambda: load_full_optimizer_state(model, self.optimizer,
                                                                                ckpt["optimizer"]), ckpt["path"])
                else:
                    self.optimizer.load_state_dict(ckpt["optimizer"])
            self.data.load_state_dict(rank_state["data"])
            set_rng_state(rank_state["rng"])
            self.it = self.start_iter = ckpt["iter"]
            self.best_val = ckpt["best_val"]
        self.raw_model = model
        if not self.sharded:
            if t.compile:
                model = torch.compile(model, mode="reduce-overhead" if t.cuda_graphs else "default")
            if t.cuda_graphs and t.grad_accum_steps > 1:
                # the backward graph's gradients live in the graphs' memory pool, which the next micro-batch's
                # replay reuses: accumulate them into buffers of our own, zeroed (not freed) after each step
                for p in model.parameters():
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
            if self.world > 1:
                from torch.nn.parallel import DistributedDataParallel as DDP
                model = DDP(model, device_ids=[self.local_rank] if device.type == "cuda" else None)
        self.model = model
        self.autocast = (torch.autocast(device.type, dtype=self.dtype) if self.dtype != torch.float32
                         else contextlib.nullcontext())

    def _load_weights(self, model, load, path: str) -> None:
        """Run `load` (weights into `model`, and optimizer state); weights of another shape → TrainError."""
        try:
            load()
        except (RuntimeError, ValueError) as e:
            what = ("the changed [model] (only changes that keep every weight's shape can resume)"
                    if self.allow_config_change else "the [model] config it holds")
            detail = f" ({' '.join(str(e).split())[:200]})" if isinstance(e, ValueError) else ""
            raise TrainError(f"the weights of {path} do not fit {what}{detail}") from None

    def _start_log(self) -> None:
        """Print the run's set-up, write config.toml, open the metrics log (rewound to the resumed step)."""
        cfg, t = self.cfg, self.t
        self.tokens_per_step = t.batch_size * t.grad_accum_steps * self.world * cfg.model.block_size
        self.peak = peak_flops(t.peak_tflops, self.device)
        if self.master:
            print(format_config(cfg))
            loss_kernel = kernels.resolve_loss_kernel(cfg.model.loss_kernel, self.device)
            print(f"device {self.device} ({self.dtype}), attention backend: {cfg.model.attention}, "
                  f"loss kernel: {loss_kernel}, world size {self.world}, "
                  + (f"FSDP2 units of {self.fsdp_unit} blocks, " if self.sharded else "")
                  + f"{self.raw_model.num_params() / 1e6:.2f}M parameters, "
                  + (f"LoRA rank {self.lora.rank} on {','.join(self.lora.targets)}: {self.trainable:,} trained "
                     "(the rest frozen), " if self.lora else "")
                  + f"{self.tokens_per_step:,} tokens/step"
                  + (f", resuming at step {self.start_iter}" if self.resume else ""))
            print(f"unigram baseline val loss: {self.baseline:.4f} (uniform: {math.log(self.tok_vocab):.4f})")
            path = os.path.join(t.out_dir, "config.toml")
            with self._writing(path):
                write_text_atomic(path, format_config(cfg) + "\n")
            metrics = os.path.join(t.out_dir, "metrics.jsonl")
            with self._writing(metrics):
                # a fresh run owns the folder: rows of an earlier run that left no checkpoint go
                dropped, torn = rewind_metrics(metrics, self.start_iter if self.resume else -1)
            if torn:
                print(f"note: {metrics}: dropped {torn} unreadable line(s), the end of a write that was cut "
                      "short", file=sys.stderr)
            if dropped and not self.resume:
                print(f"note: {metrics}: removed {dropped} row(s) of an earlier run", file=sys.stderr)
        self.log = RunLog(t.out_dir, cfg.to_dict(), use_wandb=t.wandb, project=t.wandb_project,
                          run_name=t.wandb_run_name, enabled=self.master)

    # ------------------------------------------------------------------------------------------------- loop

    def run(self) -> dict:
        """Train from the current step to train.max_iters (or train.max_time); returns the summary."""
        from tqdm import tqdm
        t = self.t
        self.bar = tqdm(total=t.max_iters, initial=self.start_iter, disable=not self.master, dynamic_ncols=True,
                        desc="train")
        self.t_start = self.t_last = time.time()
        self.tokens_since = 0
        self.signals.armed = True
        try:
            hellaswag = None
            if t.eval_hellaswag_interval:  # not even imported when off
                from evals.train_hook import HellaSwagHook
                hellaswag = HellaSwagHook.for_trainer(self)
            while True:
                self.snapshot = {"data": self.data.state_dict(), "rng": rng_state()}  # the top of step `it`
                out_of_time = t.max_time > 0 and time.time() - self.t_start > t.max_time
                last = self.it >= t.max_iters or out_of_time
                if hellaswag is not None and hellaswag.due(self.it, last):
                    record = hellaswag.run(self.raw_model, self.autocast, step=self.it)
                    self._log(record)
                    if self.master:
                        self.bar.write(hellaswag.describe(record))
                saved = False
                if (self.it % t.eval_interval == 0 or last) and not (self.resume and self.it == self.start_iter):
                    self.checkpoint(is_best=self.evaluate())
                    saved = True
                if last:
                    break
                if self._stop_requested():
                    self._stop(saved)
                lr = self.step()
                if self.it % t.log_interval == 0 or self.it == t.max_iters:
                    self.log_step(lr)
        except Interrupted as e:
            raise Stopped(f"interrupted again at step {self.it} ({e.signame}): stopped at once, without a "
                          f"checkpoint; the last one is {self.last_ckpt or 'none'}") from None
        finally:
            self.bar.close()
            self.log.close()
        return self.summary()

    def step(self) -> float:
        """One optimizer step over grad_accum_steps micro-batches, queued without waiting for the device: its
        loss and grad norm become `pending` (the previous step's are read back meanwhile). Returns its lr."""
        t, model, device = self.t, self.model, self.device
        lr = lr_at(self.it, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        step_loss = torch.zeros((), device=device)
        micro = self.data.train_batches(t.batch_size, t.grad_accum_steps, self.rank, self.world)
        for m, (x, y) in enumerate(micro):
            sync = m == len(micro) - 1
            if self.sharded and len(micro) > 1 and (m == 0 or sync):
                set_gradient_sync(model, sync)  # off from the first micro-batch, on for the last
            no_sync = (model.no_sync() if self.world > 1 and not sync and not self.sharded
                       else contextlib.nullcontext())
            if t.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs were read: reuse them
            with no_sync, self.autocast:
                x, y = to_device(x, y, device)
                _, loss = model(x, y, **document_kwargs(x, self.eot))
                loss = loss / len(micro)
            self.scaler.scale(loss).backward()
            step_loss += loss.detach()
        stop_votes = None
        if self.world > 1:
            step_loss, stop_votes = self._all_reduce(step_loss)
        if self.pending is not None:
            self.settle()  # the previous step, while this one's forward and backward run on the GPU
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(self.raw_model, t.grad_clip if t.grad_clip > 0 else float("inf"))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=not (t.cuda_graphs and t.grad_accum_steps > 1))
        self.pending = (self.it, step_loss, grad_norm, stop_votes)
        self.it += 1
        self.bar.update(1)
        self.tokens_since += self.tokens_per_step
        return lr

    def _all_reduce(self, step_loss: torch.Tensor):
        """The step's loss averaged over the ranks, and how many ranks were asked to stop, in one all-reduce:
        every rank reads the same count for the same step (in settle), so all of them stop after the same
        step. Built on the device (no host-to-device copy, which would wait for the GPU)."""
        import torch.distributed as dist
        asked = torch.full((), float(self.signals.received is not None), device=self.device)
        stats = torch.stack([step_loss, asked])  # (2,)
        dist.all_reduce(stats)  # sum over ranks
        return stats[0] / self.world, stats[1]

    def settle(self) -> tuple[float, float]:
        """Read back the pending step (waits for it on the GPU); a non-finite loss stops the run."""
        step, loss_t, norm_t, votes_t = self.pending
        loss_value, norm_value = loss_t.item(), norm_t.item()
        if not math.isfinite(loss_value):
            raise TrainError(f"non-finite loss ({loss_value}) at step {step}: stopping; the last good "
                             f"checkpoint is {self.last_ckpt or 'none (no checkpoint was written yet)'}")
        if votes_t is not None and votes_t.item() > 0:
            self.stop_agreed = True
        self.pending = None
        return loss_value, norm_value

    def log_step(self, lr: float) -> None:
        """Read back the step just taken and log its loss, lr, grad norm, throughput (and MFU, memory)."""
        loss_value, grad_norm = self.settle()
        device = self.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.time()
        tok_s = self.tokens_since / (now - self.t_last)
        self.t_last, self.tokens_since = now, 0
        record = {"iter": self.it, "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tok_s}
        if self.peak is not None:
            record["mfu"] = self.raw_model.flops_per_token() * tok_s / self.world / self.peak
        if device.type == "cuda":
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        self._log(record)
        self.bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tok_s:,.0f}")

    def evaluate(self) -> bool:
        """Estimate train and val loss (after reading back the pending step), log them, redraw loss.png.
        Returns whether val loss is the best so far."""
        if self.pending is not None:
            self.settle()
        losses = estimate_loss(self.raw_model, self.data, self.t, self.device, self.autocast)
        self.snapshot["data"] = self.data.state_dict()  # evaluation draws from its own generators
        is_best = losses["val"] < self.best_val
        self.best_val = min(self.best_val, losses["val"])
        self.last_eval = losses
        self._log({"iter": self.it, "train_loss": losses["train"], "val_loss": losses["val"]})
        if self.master:
            try:
                self.log.plot()
            except OSError as e:  # a missing picture does not stop a run whose metrics are safe
                self.bar.write(f"warning: could not write {self.log.plot_path} ({e.strerror or e}); "
                               "training continues", file=sys.stderr)
        self.bar.write(f"step {self.it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        return is_best

    def checkpoint(self, is_best: bool) -> str | None:
        """Rank 0 writes ckpt_<it>.pt (and best.pt) holding the state at the top of step `it`; its path.
        Sharded: every rank writes its shards into ckpt_<it>/ (and best_<it>/); every rank gets the path."""
        if self.sharded:
            return self._checkpoint_sharded(is_best)
        if not self.master:
            return None
        t = self.t
        state = {"model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "config": self.cfg.to_dict(), "tokenizer": self.data.meta["tokenizer"], "iter": self.it,
                 "best_val": self.best_val, "data": self.snapshot["data"], "rng": self.snapshot["rng"],
                 "version": 1}
        if self.lora:  # the updates are in "model" as <projection>.lora_A / .lora_B (model/lora.py)
            state["lora"] = {**self.lora.to_dict(), "base": self.lora_base}
        path = os.path.join(t.out_dir, f"ckpt_{self.it:07d}.pt")
        try:
            self.last_ckpt = save_run_checkpoint(state, t.out_dir, self.it, t.keep_last, is_best)
        except OSError as e:
            raise self._write_failed(e, self._failed_checkpoint_file(e, path, is_best)) from None
        return self.last_ckpt

    def _checkpoint_sharded(self, is_best: bool) -> str:
        t = self.t
        tensors, tied = sharded_state(self.raw_model, self.optimizer)
        meta = {"iter": self.it, "best_val": self.best_val, "config": self.cfg.to_dict(),
                "tokenizer": self.data.meta["tokenizer"], "tied": tied,
                "optimizer_groups": optimizer_groups(self.raw_model, self.optimizer)}
        rank_state = {"data": self.snapshot["data"], "rng": self.snapshot["rng"]}
        try:
            self.last_ckpt = save_sharded_checkpoint(tensors, meta, rank_state, t.out_dir, self.it, t.keep_last,
                                                     is_best)
        except OSError as e:
            raise self._write_failed(e, os.path.join(t.out_dir, f"ckpt_{self.it:07d}")) from None
        return self.last_ckpt

    def close(self) -> None:
        """End what the run started outside its folder: the one-process group of a sharded run."""
        if self.solo_group:
            end_single_process_group()
            self.solo_group = False

    def _stop_requested(self) -> bool:
        if self.world == 1:
            return self.signals.received is not None
        return self.stop_agreed

    def _stop(self, saved: bool) -> None:
        """Stop on a signal: read back the step in flight (never save the weights of a non-finite step),
        checkpoint the state at the top of this step (unless this step's evaluation just did), exit."""
        if self.pending is not None:
            self.settle()
        path = self.last_ckpt if saved else self.checkpoint(is_best=False)
        self._barrier()  # the other ranks exit only once rank 0's checkpoint is written
        name = self.signals.received or "a signal to another rank"
        raise Stopped(f"interrupted at step {self.it} ({name}); checkpoint saved to {path}; continue with --resume")

    def summary(self) -> dict:
        summary = {"iters": self.it, "val_loss": self.last_eval.get("val"),
                   "train_loss": self.last_eval.get("train"), "best_val": self.best_val,
                   "unigram_val_loss": getattr(self, "baseline", None), "checkpoint": self.last_ckpt,
                   "seconds": time.time() - self.t_start if self.bar is not None else 0.0,
                   "already_finished": self.finished}
        if self.master and not self.finished:
            val = summary["val_loss"]
            print(f"done: {self.it} steps in {summary['seconds']:.0f}s, val loss "
                  + (f"{val:.4f}" if val is not None else "not evaluated")
                  + f" (unigram baseline {summary['unigram_val_loss']:.4f}); checkpoint {self.last_ckpt}")
        return summary

    # -------------------------------------------------------------------------------------------- helpers

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()

    def _log(self, record: dict) -> None:
        with self._writing(self.log.path):
            self.log.log(record)

    @contextlib.contextmanager
    def _writing(self, path: str):
        """OSError from a write of `path` (disk full, read-only, ...) → TrainError naming it."""
        try:
            yield
        except OSError as e:
            raise self._write_failed(e, path) from None

    def _write_failed(self, e: OSError, path: str) -> TrainError:
        try:
            last = find_checkpoint(self.t.out_dir)  # written atomically: the latest one on disk is whole
        except CheckpointError:
            last = "none (no checkpoint was written yet)"
        return TrainError(f"could not write {path} ({e.strerror or e}): stopping; the last whole checkpoint "
                          f"is {last}")

    def _failed_checkpoint_file(self, e: OSError, path: str, is_best: bool) -> str:
        """Which file of a checkpoint write failed: the numbered one, else best.pt, else an old one's removal."""
        if not os.path.isfile(path):
            return path
        for name in (e.filename, e.filename2):
            name = os.fspath(name) if name is not None else ""
            if os.path.basename(name).startswith("ckpt_") and os.path.abspath(name) != os.path.abspath(path):
                return name
        return os.path.join(self.t.out_dir, "best.pt") if is_best else path

def _describe_lora(s: LoRASettings | None) -> str:
    return (f"rank {s.rank}, alpha {s.alpha:g}, dropout {s.dropout:g}, targets {','.join(s.targets)}" if s
            else "no LoRA (every weight trained)")


def check_resumed_lora(lora: LoRASettings | None, ckpt: dict) -> None:
    """A resumed run trains the LoRA its checkpoint holds (or none, as it did): another is one ConfigError."""
    saved = LoRASettings.from_dict(ckpt["lora"]) if ckpt.get("lora") else None
    if saved != lora:
        raise ConfigError(f"--resume: train.lora_* ask for {_describe_lora(lora)}, the checkpoint {ckpt['path']} "
                          f"holds {_describe_lora(saved)}; resume with the run's own settings")
