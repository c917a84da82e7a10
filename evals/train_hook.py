"""HellaSwag during training: every `train.eval_hellaswag_interval` steps and at the last step.

train.py imports this module only when the interval is set. The hook reads and tokenises the data once, when
the run starts (so a bad file stops the run before its first step), and each evaluation returns the record
train.py logs to metrics.jsonl and wandb: {"iter", "hellaswag_acc", "hellaswag_acc_norm", "hellaswag_n"}.

Data: `train.eval_hellaswag_data`, a local file (see evals/hellaswag.py for the formats); empty = the dataset's
validation file, downloaded once into <data.cache_dir>/eval/ (which needs the network the first time).

Distribution (DDP or FSDP): every rank scores its own share of the items (item i goes to rank i mod world
size) and the counts of right answers are summed over the ranks with one all-reduce, so an evaluation takes
1/world of the single-process time. Every rank runs the same number of forward passes of the same batch size:
its share is padded with copies of one request whose scores are dropped, because FSDP's parameter all-gathers
are collective (ranks with unequal numbers of forward passes would wait for each other forever). The model
is scored as the trainer holds it (`raw_model`: not the torch.compile'd or DDP-wrapped module), under the
run's autocast. Evaluating reads no data batches and draws no random numbers, so resuming stays exact.
"""
from __future__ import annotations

import os

import torch

from model.config import ConfigError

from .hellaswag import EvalDataError, Item, Tally, default_data, encode_requests, load_items, tally_items
from .scoring import score_continuations

DUMMY_REQUEST = ([0], [0])  # pads a rank that has no item at all (more ranks than items)


class HellaSwagHook:
    """HellaSwag over `items`, this rank's share of them scored by `run`."""

    def __init__(self, items: list[Item], tokenizer, *, block_size: int, interval: int, batch_size: int,
                 rank: int = 0, world: int = 1, device: torch.device | str = "cpu", skip_step: int | None = None):
        self.interval, self.batch_size = interval, batch_size
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.skip_step = skip_step  # a resumed run's first step: its evaluation was logged before the checkpoint
        self.total = len(items)
        self.items = items[rank::world]
        self.requests = encode_requests(self.items, tokenizer, block_size)
        # every rank's request count is known to every rank (all of them read the whole file): no collective
        self.padded = max(sum(len(item.endings) for item in items[r::world]) for r in range(world))

    @classmethod
    def for_trainer(cls, trainer) -> "HellaSwagHook":
        """The hook of a Trainer (training/trainer.py) after its setup(): data from train.eval_hellaswag_data (or
        the cached download, fetched by rank 0 while the others wait), the data's tokenizer, the run's micro-batch
        size.
        Raises ConfigError with one line when the data cannot be had or read."""
        from data.tokenizers import tokenizer_from_spec
        t, cfg = trainer.t, trainer.cfg
        try:
            path = t.eval_hellaswag_data
            if not path:
                cache = os.path.join(cfg.data.cache_dir, "eval")
                option = "--train.eval_hellaswag_data=FILE"
                path = default_data(cache, option=option) if trainer.master else None
                if trainer.world > 1:  # the others find rank 0's download in the cache
                    import torch.distributed as dist
                    dist.barrier()
                path = path or default_data(cache, option=option)
            hook = cls(load_items(path), tokenizer_from_spec(trainer.data.meta["tokenizer"]),
                       block_size=cfg.model.block_size, interval=t.eval_hellaswag_interval,
                       batch_size=t.batch_size, rank=trainer.rank, world=trainer.world, device=trainer.device,
                       skip_step=trainer.start_iter if trainer.resume else None)
        except EvalDataError as e:
            raise ConfigError(f"train.eval_hellaswag_data: {e}") from None
        return hook

    def due(self, step: int, last: bool) -> bool:
        """Whether to evaluate at the top of `step` (after `step` optimizer steps)."""
        return (step % self.interval == 0 or last) and step != self.skip_step

    def run(self, model, autocast=None, *, step: int) -> dict:
        """Score this rank's share, sum the counts over the ranks; the record to log (the same on every rank)."""
        requests = self.requests + [self.requests[0] if self.requests else DUMMY_REQUEST] * (
            self.padded - len(self.requests))
        scored = score_continuations(model, requests, batch_size=self.batch_size, autocast=autocast)
        tally, _ = tally_items(self.items, [s.logprob for s in scored[:len(self.requests)]])
        counts = [tally.n, tally.correct, tally.correct_norm]
        if self.world > 1:
            import torch.distributed as dist
            summed = torch.tensor(counts, dtype=torch.long, device=self.device)  # (3,)
            dist.all_reduce(summed)
            counts = summed.tolist()
        total = Tally(*counts)
        assert total.n == self.total, (total.n, self.total)
        m = total.metrics()
        return {"iter": step, "hellaswag_acc": m["acc"], "hellaswag_acc_norm": m["acc_norm"],
                "hellaswag_n": m["n"]}

    @staticmethod
    def describe(record: dict) -> str:
        return (f"step {record['iter']}: hellaswag acc {record['hellaswag_acc']:.4f}, acc_norm "
                f"{record['hellaswag_acc_norm']:.4f} ({record['hellaswag_n']} items)")
