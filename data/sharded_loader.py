"""(B, T) batches read in order from the token shards of a prepared folder (data/shards.py).

Order: the train shards, concatenated in manifest order, are one token stream that is read front to back
(as llm.c does). An optimizer step takes the next `accum * world_size * batch_size` rows of block_size
tokens: row i of the step is stream[p + i*T : p + i*T + T] (targets shifted by one token), p the step's start;
p then advances by the rows' tokens (the last target of a step is the first input of the next). The rows are
numbered (micro-batch, rank, row) as in data.loader.TokenData: rank r's m-th micro-batch is rows
(m * world_size + r) * B ... + B - 1, one contiguous slice of the stream, so world_size ranks × accum
micro-batches see exactly the windows one process with world_size · accum micro-batches sees. A step that
would run past the end of the stream starts a new epoch at the stream's beginning instead (the tail, shorter
than one step, is left out); every epoch reads the same order.

The position (epoch, shard, offset in it) and the generator of the train-loss estimate are the loader's
state (state_dict / load_state_dict): a resumed run reads exactly the windows an uninterrupted one reads.
Validation reads the val shards' stream from its beginning every time, so every evaluation sees the same
tokens.

Checks: when opened, every shard the manifest lists must exist with the size of its token count (a missing,
empty or truncated shard is named then, not when training reaches it); the first time a shard is read its
checksum and its largest id are verified (about a tenth of a second per 100M tokens, once per process).
"""
from __future__ import annotations

import bisect
import json
import os

import numpy as np
import torch

from .errors import DataError
from .shards import MANIFEST, read_manifest, shard_entries
from .sources import new_hash
from .tokenizers import tokenizer_from_spec

UNIGRAM_SAMPLE_TOKENS = 1 << 26  # tokens per split read for the unigram baseline (an estimate beyond that)


class _Stream:
    """The shards of one split as one read-only token array, addressed by global position."""

    def __init__(self, folder: str, manifest: dict, split: str):
        self.folder, self.split = folder, split
        self.entries = shard_entries(manifest, split)
        self.algorithm, self.vocab_size = manifest["checksum"], manifest["vocab_size"]
        dtype = np.dtype(manifest["dtype"])
        if not self.entries:
            raise DataError(f"{folder}/{MANIFEST} lists no {split} shards: prepare the data again")
        self.maps, self.starts, total = [], [], 0
        for e in self.entries:
            path = f"{folder}/{e['file']}"
            if e["tokens"] <= 0:
                raise DataError(f"{folder}/{MANIFEST} lists an empty shard, {e['file']}: prepare the data again")
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                raise DataError(f"shard missing: {path} (listed in {folder}/{MANIFEST}); restore it, or prepare "
                                "the data again") from None
            if size != e["tokens"] * dtype.itemsize:
                what = "empty (0 bytes)" if size == 0 else f"{size} bytes"
                raise DataError(f"shard {path} is {what}, but {MANIFEST} says {e['tokens']} {dtype.name} tokens "
                                f"({e['tokens'] * dtype.itemsize} bytes): restore it, or prepare the data again")
            self.maps.append(np.memmap(path, dtype=dtype, mode="r"))
            self.starts.append(total)
            total += e["tokens"]
        self.total = total
        self.verified = [False] * len(self.entries)

    def locate(self, pos: int) -> tuple[int, int]:
        """Global position → (shard index, offset in that shard)."""
        i = bisect.bisect_right(self.starts, pos) - 1
        return i, pos - self.starts[i]

    def _shard(self, i: int) -> np.memmap:
        if not self.verified[i]:
            self._verify(i)
        return self.maps[i]

    def _verify(self, i: int) -> None:
        e, data = self.entries[i], self.maps[i]
        path = f"{self.folder}/{e['file']}"
        h = new_hash(self.algorithm)
        h.update(memoryview(data))
        if h.hexdigest() != e["checksum"]:
            raise DataError(f"shard {path} does not match its {self.algorithm} checksum in {MANIFEST}: it was "
                            "changed or replaced (by a shard of other data or another tokenizer?); restore it, "
                            "or prepare the data again")
        top = int(data.max())
        if top >= self.vocab_size:
            raise DataError(f"shard {path} holds token id {top}, outside the vocabulary of {self.vocab_size}")
        self.verified[i] = True

    def read(self, pos: int, n: int) -> np.ndarray:
        """Tokens [pos, pos + n) of the stream (0 <= pos, pos + n <= total): a view of one shard, or a copy
        joining consecutive shards."""
        i, off = self.locate(pos)
        shard = self._shard(i)
        if off + n <= len(shard):
            return shard[off:off + n]
        parts, need = [shard[off:]], n - (len(shard) - off)
        while need > 0:
            i += 1
            piece = self._shard(i)[:need]
            parts.append(piece)
            need -= len(piece)
        return np.concatenate(parts)


class ShardedData:
    """The train and val shards of a prepared folder, read in order (see the module docstring).

    Has what the Trainer uses of data.loader.TokenData: meta (tokenizer spec, vocab_size, dtype),
    tokenizer, train_batches, eval_batches, state_dict / load_state_dict, unigram_loss. pin_memory: return
    batches in pinned host memory, so that copies to a GPU with non_blocking=True do not wait.
    """

    def __init__(self, folder: str, block_size: int, *, seed: int = 0, pin_memory: bool = False):
        self.folder, self.block_size, self.pin_memory = folder, block_size, pin_memory
        self.manifest = read_manifest(folder)
        m = self.manifest
        self.meta = {"tokenizer": m["tokenizer"], "vocab_size": m["vocab_size"], "dtype": m["dtype"],
                     "train_tokens": m["tokens"]["train"], "val_tokens": m["tokens"]["val"],
                     "eot_token": m["eot_token"], "format": "shards"}
        self.tokenizer = tokenizer_from_spec(m["tokenizer"])
        self.eot_token = m["eot_token"]
        self.train, self.val = _Stream(folder, m, "train"), _Stream(folder, m, "val")
        for stream in (self.train, self.val):
            if stream.total <= block_size + 1:
                raise DataError(f"the {stream.split} shards of {folder} hold {stream.total} tokens, not enough for "
                                f"block_size={block_size}: prepare more data (data.val_docs for val) or use a "
                                "smaller model.block_size")
        # the train shards, by name, size and checksum: a checkpoint's position belongs to these
        h = new_hash("sha256")
        h.update(json.dumps([[e["file"], e["tokens"], e["checksum"]] for e in self.train.entries]).encode())
        self.fingerprint = h.hexdigest()[:16]
        self.epoch, self.pos = 0, 0
        self.eval_generator = torch.Generator().manual_seed(seed * 1000 + 2)

    # ---------------------------------------------------------------------------------------- batches

    def _tensor(self, tokens: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(tokens.astype(np.int64))
        return t.pin_memory() if self.pin_memory else t

    def train_batches(self, batch_size: int, accum: int, rank: int = 0, world_size: int = 1):
        """One optimizer step's micro-batches for this rank: a list of `accum` (x, y), each (B, T), views of
        one contiguous read each."""
        B, T = batch_size, self.block_size
        step_tokens = accum * world_size * B * T
        if step_tokens + 1 > self.train.total:
            raise DataError(f"the train shards of {self.folder} hold {self.train.total} tokens, fewer than one "
                            f"step's {step_tokens + 1} (batch_size × grad_accum_steps × world size × block_size "
                            "+ 1): prepare more data or take smaller steps")
        if self.pos + step_tokens + 1 > self.train.total:
            self.epoch, self.pos = self.epoch + 1, 0
        micro = []
        for m in range(accum):
            start = self.pos + (m * world_size + rank) * B * T
            t = self._tensor(self.train.read(start, B * T + 1))  # (B*T + 1,)
            micro.append((t[:-1].view(B, T), t[1:].view(B, T)))
        self.pos += step_tokens
        return micro

    def eval_batches(self, split: str, batch_size: int, n: int):
        """n (x, y) batches for loss estimation, each (B, T). val: the first n·B rows of the val stream,
        the same every call (wrapping around a val split shorter than that); train: random windows from
        the train stream, drawn from the loader's own generator (training's order is left as it is)."""
        B, T = batch_size, self.block_size
        if split == "val":
            span = self.val.total - T - 1  # window starts in [0, span]
            for k in range(n):
                starts = [((k * B + j) * T) % (span + 1) for j in range(B)]
                yield self._windows(self.val, starts)
        else:
            for _ in range(n):
                starts = torch.randint(0, self.train.total - T - 1, (B,), generator=self.eval_generator).tolist()
                yield self._windows(self.train, starts)

    def _windows(self, stream: _Stream, starts: list[int]):
        T = self.block_size
        rows = np.stack([stream.read(s, T + 1) for s in starts]).astype(np.int64)  # (B, T + 1)
        t = torch.from_numpy(rows)
        if self.pin_memory:
            t = t.pin_memory()
        return t[:, :-1], t[:, 1:]

    # ------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        shard, offset = self.train.locate(self.pos)
        return {"format": "shards", "epoch": self.epoch, "shard": shard, "offset": offset,
                "train_shards": self.fingerprint, "eval_generator": self.eval_generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != "shards":
            raise DataError("the checkpoint's data position is not one in token shards (it was trained with "
                            "data.format = \"bin\"): resume it with its own [data] settings")
        if state["train_shards"] != self.fingerprint:
            raise DataError(f"the train shards of {self.folder} are not the ones the checkpoint was trained on "
                            "(names, sizes or checksums differ): resume with the shards it was trained on")
        self.epoch = int(state["epoch"])
        self.pos = self.train.starts[int(state["shard"])] + int(state["offset"])
        self.eval_generator.set_state(state["eval_generator"])

    # ------------------------------------------------------------------------------------- baselines

    def unigram_loss(self) -> float:
        """Cross-entropy (nats) on val of the train unigram distribution (from the first
        UNIGRAM_SAMPLE_TOKENS tokens of each split): the 'knows nothing' baseline."""
        V = self.meta["vocab_size"]
        train = self.train.read(0, min(self.train.total, UNIGRAM_SAMPLE_TOKENS))
        val = self.val.read(0, min(self.val.total, UNIGRAM_SAMPLE_TOKENS))
        logp = np.log((np.bincount(train, minlength=V).astype(np.float64) + 1.0) / (len(train) + V))
        val_counts = np.bincount(val, minlength=V)
        return float(-(val_counts * logp[:V]).sum() / max(1, val_counts.sum()))
