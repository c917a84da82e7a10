"""HellaSwag (Zellers et al., 2019) as multiple choice by log-likelihood, the way lm-evaluation-harness scores it.

Data: one item per line of a JSONL file in the format of the dataset's own release (hellaswag_val.jsonl:
`ctx_a`, `ctx_b`, `ctx`, `activity_label`, `endings`, `label` an int), or of the Hugging Face dataset
`Rowan/hellaswag` (the same columns, `label` a string), as JSONL or Parquet. An item needs `endings` (two or
more strings), `label` (the index of the right one) and a context: `ctx_a` and `ctx_b`, or `ctx`.

Prompt (lm-eval's `hellaswag` task): context = ctx_a + " " + ctx_b.capitalize() (or `ctx` when there is no
ctx_a/ctx_b), prefixed by activity_label + ": " when the item has one; the context and each ending go through
`preprocess` (WikiHow's bracket artefacts removed); each ending is scored as the continuation " " + ending.

Metrics, over items:
    acc       the ending with the largest summed log-likelihood is the labelled one
    acc_norm  the same after dividing each sum by the ending's length in characters (len() of the preprocessed
              ending, without the leading space): lm-eval's acc_norm exactly. (lm-eval's separate `acc_bytes`
              divides by UTF-8 bytes instead; for HellaSwag's English text the two agree on almost every item.)
Each with its standard error sqrt(p (1 − p) / (n − 1)), as lm-eval reports it.

The default data source is the validation file of the dataset's release (HELLASWAG_VAL_URL), downloaded once
into a cache folder; offline, pass a local copy instead.
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass

from .scoring import score_with_progress

HELLASWAG_VAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_VAL_ITEMS = 10_042
DEFAULT_FILE = "hellaswag_val.jsonl"
OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")  # set by users (and tests) who mean "no network"


class EvalDataError(ValueError):
    """Evaluation data that is missing or malformed; the message is one line naming the file (and line)."""


@dataclass(frozen=True)
class Item:
    context: str              # the prompt, preprocessed
    endings: tuple[str, ...]  # the candidate endings, preprocessed (scored as " " + ending)
    label: int                # index of the right ending
    where: str                # "FILE line N" (JSONL) or "FILE row N" (Parquet), for messages


def preprocess(text: str) -> str:
    """lm-eval's HellaSwag clean-up: strip, " [title]" → ". ", drop other [bracketed] artefacts, "  " → " "."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def item_from_record(rec, where: str) -> Item:
    """One item from a JSON object of either format; EvalDataError naming `where` otherwise."""
    if not isinstance(rec, dict):
        raise EvalDataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    endings = rec.get("endings")
    if (not isinstance(endings, list) or len(endings) < 2
            or not all(isinstance(e, str) and e.strip() for e in endings)):
        raise EvalDataError(f"{where}: 'endings' must be a list of two or more non-empty strings")
    if isinstance(rec.get("ctx_a"), str) and isinstance(rec.get("ctx_b"), str):
        ctx = rec["ctx_a"] + " " + rec["ctx_b"].capitalize()
    elif isinstance(rec.get("ctx"), str):
        ctx = rec["ctx"]
    else:
        raise EvalDataError(f"{where}: no context: expected string fields 'ctx_a' and 'ctx_b', or 'ctx'")
    activity = rec.get("activity_label")
    if isinstance(activity, str) and activity.strip():
        ctx = activity + ": " + ctx
    context = preprocess(ctx)
    if not context:
        raise EvalDataError(f"{where}: empty context")
    label = rec.get("label")
    if isinstance(label, str) and re.fullmatch(r"\s*\d+\s*", label):
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(endings):
        raise EvalDataError(f"{where}: label {rec.get('label')!r} is not the index of one of its "
                            f"{len(endings)} endings (0..{len(endings) - 1})")
    endings = tuple(preprocess(e) for e in endings)
    if not all(endings):
        raise EvalDataError(f"{where}: an ending is empty once cleaned of [bracketed] markup")
    return Item(context, endings, label, where)


def load_items(path: str, limit: int | None = None) -> list[Item]:
    """The items of a HellaSwag file (.jsonl/.json lines, or .parquet); the first `limit` of them when given.
    Raises EvalDataError with one line naming the file and the first bad line."""
    if not os.path.isfile(path):
        raise EvalDataError(f"HellaSwag data file not found: {path}")
    if path.endswith(".parquet"):
        return _load_parquet(path, limit)
    items = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, text in enumerate(f, start=1):
                if limit is not None and len(items) >= limit:
                    break
                if not text.strip():
                    continue
                try:
                    rec = json.loads(text)
                except ValueError as e:
                    raise EvalDataError(f"{path} line {n}: not valid JSON ({e.msg})") from None
                items.append(item_from_record(rec, f"{path} line {n}"))
    except UnicodeDecodeError:
        raise EvalDataError(f"{path}: not UTF-8 text (expected JSONL, one item per line)") from None
    except OSError as e:
        raise EvalDataError(f"cannot read {path} ({e.strerror or e})") from None
    if not items:
        raise EvalDataError(f"{path}: no items")
    return items


def _load_parquet(path: str, limit: int | None) -> list[Item]:
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError for a file that is not Parquet
        raise EvalDataError(f"{path}: not a readable Parquet file ({' '.join(str(e).split())[:120]})") from None
    rows = table.slice(0, limit).to_pylist() if limit is not None else table.to_pylist()
    if not rows:
        raise EvalDataError(f"{path}: no items")
    return [item_from_record(rec, f"{path} row {n}") for n, rec in enumerate(rows, start=1)]


def default_data(cache_dir: str, *, option: str = "--data FILE", url: str = HELLASWAG_VAL_URL,
                 expected_items: int | None = HELLASWAG_VAL_ITEMS, timeout: float = 30.0) -> str:
    """Path of the cached validation file, downloaded from `url` the first time. The download is kept only
    when it has `expected_items` items, each readable, and is moved into place atomically.
    Raises EvalDataError with one line (naming the URL and `option`, how to pass a local file) when it cannot
    be had."""
    path = os.path.join(cache_dir, DEFAULT_FILE)
    if os.path.isfile(path):
        return path
    how = f"download {DEFAULT_FILE} from {url} elsewhere and pass it with {option}"
    offline = [flag for flag in OFFLINE_FLAGS if os.environ.get(flag, "").strip() not in ("", "0")]
    if offline:
        raise EvalDataError(f"HellaSwag data not in the cache ({path}) and {offline[0]} is set (offline): {how}")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".jsonl", dir=cache_dir)
    except OSError as e:
        raise EvalDataError(f"cannot write the HellaSwag cache folder {cache_dir} ({e.strerror or e})") from None
    try:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, os.fdopen(fd, "wb") as f:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or e
            raise EvalDataError(f"HellaSwag data not in the cache ({path}) and {url} cannot be reached "
                                f"({reason}): {how}") from None
        count = len(load_items(tmp))
        if expected_items is not None and count != expected_items:
            raise EvalDataError(f"the file downloaded from {url} has {count} items, not {expected_items}: {how}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def encode_requests(items: list[Item], tokenizer, block_size: int) -> list[tuple[list[int], list[int]]]:
    """(context ids, " " + ending ids) for every ending of every item, item by item, in order.
    Raises EvalDataError naming the item when its text cannot be encoded with `tokenizer`, or when an ending
    is longer than the model's context (block_size tokens); a long context is cut from the left when scored."""
    from data.tokenizers import TokenizerError
    requests = []
    for item in items:
        try:
            ctx = tokenizer.encode(item.context)
            endings = [tokenizer.encode(" " + ending) for ending in item.endings]
        except TokenizerError as e:
            raise EvalDataError(f"{item.where}: cannot be encoded with the model's {tokenizer.name} "
                                f"tokenizer: {e}") from None
        for k, ids in enumerate(endings):
            if len(ids) > block_size:
                raise EvalDataError(f"{item.where}: ending {k} is {len(ids)} tokens long, more than the model's "
                                    f"context of {block_size}")
        requests.extend((ctx, ids) for ids in endings)
    return requests


@dataclass
class Tally:
    """Counts of right answers; adds up across slices of the data (and across ranks)."""
    n: int = 0
    correct: int = 0       # acc
    correct_norm: int = 0  # acc_norm

    def add(self, item: Item, logprobs: list[float]) -> tuple[int, int]:
        """Count one item from its endings' summed log-likelihoods; returns (prediction, normalised prediction)."""
        pred = max(range(len(logprobs)), key=lambda i: logprobs[i])  # first of equals, as numpy's argmax
        norm = [lp / len(ending) for lp, ending in zip(logprobs, item.endings)]
        pred_norm = max(range(len(norm)), key=lambda i: norm[i])
        self.n += 1
        self.correct += pred == item.label
        self.correct_norm += pred_norm == item.label
        return pred, pred_norm

    def metrics(self) -> dict:
        def stderr(p):  # None when undefined (a single item)
            return math.sqrt(p * (1 - p) / (self.n - 1)) if self.n > 1 else None
        acc, acc_norm = self.correct / self.n, self.correct_norm / self.n
        return {"acc": acc, "acc_stderr": stderr(acc), "acc_norm": acc_norm, "acc_norm_stderr": stderr(acc_norm),
                "n": self.n}


def tally_items(items: list[Item], logprobs: list[float]) -> tuple[Tally, list[tuple[int, int]]]:
    """Tally items from the flat list of their endings' log-likelihoods (in encode_requests's order); also each
    item's (prediction, normalised prediction)."""
    tally, preds, k = Tally(), [], 0
    for item in items:
        preds.append(tally.add(item, logprobs[k:k + len(item.endings)]))
        k += len(item.endings)
    if k != len(logprobs):
        raise ValueError(f"{len(logprobs)} scores for {k} endings")
    return tally, preds


def evaluate(model, tokenizer, items: list[Item], *, batch_size: int = 16, autocast=None,
             progress: bool = False, requests=None) -> dict:
    """acc, acc_norm (with standard errors) and n of `model` on `items` (one process); see the module's doc.
    requests: what encode_requests made of `items` already, if anything."""
    if requests is None:
        requests = encode_requests(items, tokenizer, model.config.block_size)
    scored = score_with_progress(model, requests, desc="hellaswag" if progress else None, unit="ending",
                                 batch_size=batch_size, autocast=autocast)
    tally, _ = tally_items(items, [s.logprob for s in scored])
    return tally.metrics()
