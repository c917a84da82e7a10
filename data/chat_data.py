"""Conversations for supervised fine-tuning (data.format = "chat"): each written with the model's chat template,
the loss taken on the assistant's turns only.

    folder = prepare_chat("chats.jsonl", tokenizer_spec, val_fraction=0.1)   # tokenised once, cached
    data = ChatData(folder, block_size=1024, seed=0)                         # TokenData's interface

Source: any corpus data.dataset takes but .txt files (.jsonl(.gz), .parquet, a folder or glob of them, or
hf:NAME[:CONFIG]), each row holding one conversation in its `column` (data.messages_column): a list of
{"role": "system" | "user" | "assistant", "content": text} (Hugging Face / OpenAI messages) or ShareGPT's
{"from": "system" | "human" | "gpt", "value": text}. A row without that column but with instruction-tuning
fields is one exchange: Alpaca's instruction / input / output, or Dolly's instruction / context / response (the
user's message is the instruction, then a blank line and the input or context where there is one; an optional
"system" field comes first). A conversation needs at least one assistant turn.

Tokens: the conversation as the tokenizer's chat template writes it (no generation prompt), encoded whole
without added special tokens (the template writes its own), then the end-of-text token where the tokenizer has
one and the text does not already end with it. The mask marks the assistant's turns: the characters from the
end of the conversation before the turn, rendered with the generation prompt, to the end of the conversation
through the turn: the reply and the template's end-of-turn marker. A token is a target when its first character
lies in such a span. The end-of-text token after a conversation that ends with the assistant is a target too:
generation stops at it, also for a model whose own stop tokens do not include the template's end-of-turn
marker (a base model's). A template that does not write a shorter
conversation as the start of a longer one cannot be masked this way and is refused, naming the row.

Split: the last val_fraction of the conversations (at least one), whole, form val.

Files, written into a temporary folder renamed into place (a folder is whole or absent): train.bin / val.bin
(ids, uint16 or uint32), train.mask / val.mask (uint8, 1 = a target), train.starts / val.starts (int64, where
each conversation starts), meta.json (data/prepare.py's fields, "format": "chat", and counts).

Batches: windows of block_size + 1 tokens, each starting where a conversation starts, drawn at random (packed: a
window runs on into the next conversations; past the end of the split it is padded with the end-of-text token,
masked); targets are the next tokens where they are targets, else -1, which the loss ignores. A conversation
whose first target lies beyond a window is never drawn (ChatData counts them; none left is a DataError).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

from .chat import ChatTemplateError, render_chat
from .errors import DataError
from .loader import TokenData
from .sources import Source, checksum_algorithm
from .tokenizers import spec_key

FORMAT = "flashgpt-chat-1"
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}


def _messages(value, where: str) -> list[dict]:
    """One row's conversation as [{"role", "content"}, ...]; DataError naming the row when it is not one."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: not a conversation (a non-empty list of messages), but "
                        f"{type(value).__name__ if value is not None else 'null'}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {i} is not an object")
        role, content = (m.get("role"), m.get("content")) if "role" in m else (m.get("from"), m.get("value"))
        if role not in ROLES or not isinstance(content, str):
            raise DataError(f"{where}: message {i} needs a role (system, user, assistant; or ShareGPT's from: "
                            f"human, gpt) and text content, not {json.dumps(m, ensure_ascii=False)[:120]}")
        out.append({"role": ROLES[role], "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant turn, so nothing to learn from it")
    return out


INSTRUCTION_FIELDS = (("instruction", "input", "output"), ("instruction", "context", "response"))


def conversation_of(row: dict, column: str, where: str) -> list[dict] | None:
    """A row's conversation: its `column`'s messages, else its instruction-tuning fields as one exchange; None
    for an empty row. DataError naming the row when it holds neither."""
    if column in row:
        value = row[column]
        return None if value is None or value == "" else _messages(value, where)
    for ask, extra, answer in INSTRUCTION_FIELDS:
        if ask in row and answer in row:
            texts = {k: row.get(k) for k in (ask, extra, answer, "system")}
            bad = [k for k in (ask, answer) if not isinstance(texts[k], str) or not texts[k].strip()]
            bad += [k for k in (extra, "system") if texts[k] is not None and not isinstance(texts[k], str)]
            if bad:
                raise DataError(f"{where}: field {bad[0]!r} holds {json.dumps(texts[bad[0]], ensure_ascii=False)[:80]},"
                                f" not text")
            user = texts[ask] + (f"\n\n{texts[extra]}" if texts[extra] and texts[extra].strip() else "")
            system = [{"role": "system", "content": texts["system"]}] if texts["system"] else []
            return system + [{"role": "user", "content": user}, {"role": "assistant", "content": texts[answer]}]
    raise DataError(f"{where}: no {column!r} field (data.messages_column) and no instruction / output (Alpaca) or "
                    f"instruction / response (Dolly) fields; its fields: {', '.join(map(str, row)) or 'none'}")


def encode_conversation(tok, messages: list[dict], where: str = "a conversation") -> tuple[list[int], list[int]]:
    """(ids, mask) of one conversation (see the module's doc); DataError / ChatTemplateError in one line."""

    def render(msgs, prompt):
        return render_chat(tok.chat_template, msgs, bos_token=tok.bos_text, eos_token=tok.eos_text,
                           add_generation_prompt=prompt)
    text = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[:i + 1], False)
        if not (text.startswith(through) and through.startswith(before)):
            raise DataError(f"{where}: the chat template does not write the conversation up to message {i} as "
                            "the start of the whole, so its assistant turns cannot be told apart")
        spans.append((len(before), len(through)))
    ids, offsets = tok.encode_with_offsets(text)
    mask = [0] * len(ids)
    k = 0
    for j, (start, _) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k < len(spans) and spans[k][0] <= start < spans[k][1]:
            mask[j] = 1
    if tok.eot_token is not None and (not ids or ids[-1] != tok.eot_token):
        ids.append(tok.eot_token)
        mask.append(int(messages[-1]["role"] == "assistant"))  # the reply ends the conversation: learn to stop
    return ids, mask


def _fixed(tokenizer):
    from .tokenizers import fixed_tokenizer
    tok = fixed_tokenizer(tokenizer)
    if tok is None or getattr(tok, "chat_template", None) is None:
        what = f"the {tokenizer} tokenizer" if tok is None else f"the tokenizer of {tok.source}"
        raise DataError(f"data.format = 'chat' writes conversations with the tokenizer's chat template, and {what} "
                        "has none: start from a Hugging Face model that has one (train.init_from = "
                        "'hf:<repo-or-dir>') or set data.tokenizer = 'hf:<repo-or-dir>'")
    return tok


def prepare_chat(dataset: str, tokenizer: str | dict, *, val_fraction: float = 0.1, column: str = "messages",
                 cache_dir: str = ".cache/data", verbose: bool = True) -> str:
    """Tokenise the conversations of `dataset` once (see the module's doc); return the folder."""
    tok = _fixed(tokenizer)
    source = Source(dataset, column, values="row")
    digest, tok_key = source.digest(checksum_algorithm()), spec_key(tok.spec())
    key = hashlib.sha256(json.dumps([FORMAT, digest, tok_key, val_fraction, column]).encode())
    out = os.path.join(cache_dir, "chat", f"{source.label}-{tok_key}-{key.hexdigest()[:16]}")
    if os.path.isfile(os.path.join(out, "meta.json")):
        return out
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    ids, masks = [], []  # per conversation, as arrays: ~2-4 bytes a token rather than a Python int's ~36
    from tqdm import tqdm
    for n, row in enumerate(tqdm(source.rows(), desc="conversations", unit=" rows", disable=not verbose,
                                 dynamic_ncols=True), start=1):
        where = f"data.dataset: {dataset} row {n}"
        if row == "":  # a blank line of a .jsonl file
            continue
        messages = conversation_of(row, column, where)
        if messages is None:
            continue
        try:
            i, m = encode_conversation(tok, messages, where)
        except ChatTemplateError as e:
            raise DataError(f"{where}: {e}") from None
        ids.append(np.asarray(i, dtype=dtype))
        masks.append(np.asarray(m, dtype=np.uint8))
    if len(ids) < 2:
        raise DataError(f"data.dataset: {dataset!r} holds {len(ids)} conversation(s); training and validation "
                        "need at least 2")
    n_val = max(1, int(round(len(ids) * val_fraction)))
    splits = {"train": (ids[:-n_val], masks[:-n_val]), "val": (ids[-n_val:], masks[-n_val:])}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    work = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(out))
    try:
        meta = {"format": FORMAT, "dataset": dataset, "source_digest": digest, "tokenizer": tok.spec(),
                "vocab_size": tok.vocab_size, "dtype": dtype.name, "column": column, "val_fraction": val_fraction}
        for split, (sids, smasks) in splits.items():
            flat, flat_mask = np.concatenate(sids), np.concatenate(smasks)
            starts = np.cumsum([0] + [len(c) for c in sids[:-1]], dtype=np.int64)
            flat.tofile(os.path.join(work, f"{split}.bin"))
            flat_mask.tofile(os.path.join(work, f"{split}.mask"))
            starts.tofile(os.path.join(work, f"{split}.starts"))
            meta[f"{split}_tokens"] = int(len(flat))
            meta[f"{split}_targets"] = int(flat_mask.sum())
            meta[f"{split}_conversations"] = len(sids)
        with open(os.path.join(work, "meta.json"), "w") as f:
            json.dump(meta, f)
        try:
            os.rename(work, out)
        except OSError:
            if not os.path.isfile(os.path.join(out, "meta.json")):  # not another process's finished folder
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if verbose:
        print(f"data: {len(ids):,} conversations of {dataset} → {out} ({meta['train_targets']:,} of "
              f"{meta['train_tokens']:,} train tokens are assistant targets; {n_val} conversations for val)",
              file=sys.stderr)
    return out


class ChatData(TokenData):
    """A prepared chat folder, batched as the module's doc says; the interface of TokenData."""

    def __init__(self, folder: str, block_size: int, *, seed: int = 0, pin_memory: bool = False):
        self.folder = folder
        super().__init__(folder, block_size, seed=seed, pin_memory=pin_memory)
        if self.meta.get("format") != FORMAT:
            raise DataError(f"{folder}: not a prepared chat folder (format {self.meta.get('format')!r})")
        self.pad = self.eot_token if self.eot_token is not None else 0
        self.masks, self.starts, self.dropped = {}, {}, {}
        for split, data in self.splits.items():
            mask = self._read(f"{split}.mask", np.uint8, len(data))
            starts = self._read(f"{split}.starts", np.int64, self.meta[f"{split}_conversations"])
            first = self._first_targets(mask, starts)
            usable = first - starts < block_size  # a target within the window's block_size predictions
            if not usable.any():
                raise DataError(f"no {split} conversation of {folder} has an assistant token within the first "
                                f"{block_size} tokens: raise model.block_size or shorten the prompts")
            self.masks[split], self.starts[split] = mask, starts[usable]
            self.dropped[split] = int((~usable).sum())

    def _check_sizes(self) -> None:  # windows past a split's end are padded: any length serves
        for split, data in self.splits.items():
            if len(data) < 2:
                raise DataError(f"the {split} split of {self.folder} holds {len(data)} tokens")

    def _read(self, name: str, dtype, count: int) -> np.ndarray:
        path = os.path.join(self.folder, name)
        if not os.path.isfile(path) or os.path.getsize(path) != count * np.dtype(dtype).itemsize:
            raise DataError(f"chat data file {path} is missing or of the wrong size; delete {self.folder} to "
                            "tokenise the conversations again")
        return np.fromfile(path, dtype=dtype)

    @staticmethod
    def _first_targets(mask: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Each conversation's first target position (target positions index y, one behind x: position p of
        the mask is predicted at window offset p − start − 1)."""
        never = len(mask) + 10**9  # no target: beyond any window
        ends = np.append(starts[1:], len(mask))
        pos = np.append(np.flatnonzero(mask), never)  # target positions, then a sentinel
        first = pos[np.searchsorted(pos, starts)]  # the first target at or after each start
        return np.where(first < ends, first - 1, never)

    def _windows(self, split: str, starts: list[int]):
        data, mask, T = self.splits[split], self.masks[split], self.block_size
        n = len(data)
        xs, ys = [], []
        for s in starts:
            ids = np.full(T + 1, self.pad, dtype=np.int64)       # (T + 1,) padded past the split's end
            targets = np.zeros(T + 1, dtype=bool)
            m = min(T + 1, n - s)
            ids[:m] = data[s:s + m]
            targets[:m] = mask[s:s + m] == 1
            xs.append(ids[:-1])
            ys.append(np.where(targets[1:], ids[1:], -1))          # (T,) -1: not a target
        x, y = torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))  # (B, T) each
        return (x.pin_memory(), y.pin_memory()) if self.pin_memory else (x, y)

    def _draw(self, split: str, shape: tuple, generator) -> np.ndarray:
        starts = self.starts[split]
        return starts[torch.randint(0, len(starts), shape, generator=generator).numpy()]

    def train_batches(self, batch_size: int, accum: int, rank: int = 0, world_size: int = 1):
        starts = self._draw("train", (accum, world_size, batch_size), self.generators["train"])
        return [self._windows("train", starts[m, rank].tolist()) for m in range(accum)]

    def eval_batch(self, split: str, batch_size: int):
        gen = self.generators["train_eval" if split == "train" else "val"]
        return self._windows(split, self._draw(split, (batch_size,), gen).tolist())

    def unigram_loss(self) -> float:
        """Cross-entropy (nats) on val's targets of the train targets' unigram distribution."""
        V = self.meta["vocab_size"]
        train = np.asarray(self.splits["train"])[self.masks["train"] == 1]
        val = np.asarray(self.splits["val"])[self.masks["val"] == 1]
        counts = np.bincount(train, minlength=V).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-(np.bincount(val, minlength=V) * logp[:V]).sum() / max(1, len(val)))
