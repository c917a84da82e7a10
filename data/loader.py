"""Random (B, T) batches from memmapped token files.

The sampling position is a torch.Generator: saving its state is saving the data position, so a resumed
run draws exactly the batches an uninterrupted run would.
"""
from __future__ import annotations

import numpy as np
import torch

from .errors import DataError
from .prepare import load_meta
from .tokenizers import tokenizer_from_spec


class TokenData:
    """Token files of one prepared corpus, sampled as random windows of block_size + 1 tokens.

    Under DDP every rank draws the same global batch offsets from the same generator and reads only
    its own rows, so world_size ranks × grad_accum_steps micro-batches see exactly the windows that one
    process with world_size · grad_accum_steps micro-batches sees.
    """

    def __init__(self, folder: str, block_size: int, *, seed: int = 0, pin_memory: bool = False):
        """Open the token files; DataError if they are missing, of the wrong size or hold ids outside the
        vocabulary (load_meta reads every token once for that check). pin_memory: return batches in pinned host
        memory, so that copies to a GPU with non_blocking=True do not hold the host."""
        self.meta = load_meta(folder)
        self.pin_memory = pin_memory
        self.block_size = block_size
        self.tokenizer = tokenizer_from_spec(self.meta["tokenizer"])
        self.eot_token = self.tokenizer.eot_token  # ends every document (data/prepare.py); None: no documents
        self.splits = {s: self._open(f"{folder}/{s}.bin", s) for s in ("train", "val")}
        self._check_sizes()
        # Separate generators, so that evaluating never shifts the training data order.
        self.generators = {name: torch.Generator().manual_seed(seed * 1000 + i)
                           for i, name in enumerate(("train", "val", "train_eval"))}

    def _check_sizes(self) -> None:
        for split, data in self.splits.items():
            if len(data) <= self.block_size + 1:
                raise DataError(f"the {split} split holds {len(data)} tokens, not enough for "
                                f"block_size={self.block_size}: use more data or a smaller model.block_size")

    def _open(self, path: str, split: str) -> np.ndarray:
        if self.meta[f"{split}_tokens"] == 0:  # np.memmap cannot map an empty file
            return np.zeros(0, dtype=self.meta["dtype"])
        return np.memmap(path, dtype=self.meta["dtype"], mode="r")

    def _windows(self, split: str, starts: list[int]):
        data, T = self.splits[split], self.block_size
        x = torch.from_numpy(np.stack([data[s:s + T].astype(np.int64) for s in starts]))  # (B, T)
        y = torch.from_numpy(np.stack([data[s + 1:s + 1 + T].astype(np.int64) for s in starts]))  # (B, T)
        return (x.pin_memory(), y.pin_memory()) if self.pin_memory else (x, y)

    def train_batches(self, batch_size: int, accum: int, rank: int = 0, world_size: int = 1):
        """One optimizer step's micro-batches for this rank: a list of `accum` (x, y), each (B, T)."""
        n = len(self.splits["train"]) - self.block_size - 1
        starts = torch.randint(0, n, (accum, world_size, batch_size), generator=self.generators["train"])
        return [self._windows("train", starts[m, rank].tolist()) for m in range(accum)]

    def eval_batch(self, split: str, batch_size: int):
        """A random (x, y) batch for loss estimation; split is "train" or "val"."""
        n = len(self.splits[split]) - self.block_size - 1
        gen = self.generators["train_eval" if split == "train" else "val"]
        return self._windows(split, torch.randint(0, n, (batch_size,), generator=gen).tolist())

    def eval_batches(self, split: str, batch_size: int, n: int):
        """n random (x, y) batches for loss estimation (eval_batch n times)."""
        for _ in range(n):
            yield self.eval_batch(split, batch_size)

    def state_dict(self) -> dict:
        return {name: g.get_state() for name, g in self.generators.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, g in self.generators.items():
            g.set_state(state[name])

    def unigram_loss(self) -> float:
        """Cross-entropy (nats) on val of the train unigram distribution: the 'knows nothing' baseline."""
        V = self.meta["vocab_size"]
        counts = np.bincount(np.asarray(self.splits["train"]), minlength=V).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        val_counts = np.bincount(np.asarray(self.splits["val"]), minlength=V)
        return float(-(val_counts * logp[:V]).sum() / max(1, val_counts.sum()))
