"""Stream a corpus into fixed-size token shards, resumably: `python -m data.prepare SOURCE` and train.py's
`data.format = "shards"`.

Layout of a prepared folder (default <cache_dir>/shards/<label>-<tokenizer>-<key>, the key a hash of the
source's digest and the settings below; or --out). The digest of local files is a hash of their bytes, read
at each call (about a second per GB): for a large local corpus, point data.dataset at the prepared folder.
  val_000000.bin, ...     the first `val_docs` documents (whole documents: the validation split)
  train_000000.bin, ...   every later document
  manifest.json           written last: its presence means the folder is complete
Each shard is a flat array of token ids, uint16 when the vocabulary has fewer than 65536 ids, else uint32,
with no header; every shard but the last of each split holds exactly `shard_tokens` tokens. Documents are
packed back to back, each followed by the tokenizer's end-of-text id (GPT-2: 50256; char: an extra id,
len(alphabet), see data.tokenizers.CharTokenizer), and a document continues into the next shard where one
fills: the shards of a split, read in order, are the split's token stream. A document longer than a training
window is fine: the loader cuts windows out of the stream, whatever the document boundaries.

manifest.json: {"format", "version", "source", "source_digest", "tokenizer" (spec), "vocab_size", "eot_token",
"dtype", "shard_tokens", "val_docs", "text_column", "checksum" (the algorithm: "xxh3_128", or "sha256" without
xxhash), "shards": [{"split", "file", "tokens", "checksum"}, ...], "documents": {"val", "train"},
"tokens": {"val", "train"}, "rows"}.

Tokenizers: "gpt2" (vocab 50257, uint16); "char", whose alphabet is every character of the source: collected
in a first pass over it (so a hub source is streamed twice), then fixed in the state file and the manifest;
"hf:<repo-or-dir>", a Hugging Face model's tokenizer.json (documents end with its eos_token; uint32 above 65,536
ids, e.g. Llama-3's 128,256); or a tokenizer spec (data/tokenizers.py): exactly the tokenizer of a pretrained
model or a run, which is how train.py prepares a fine-tuning run's shards. A tokenizer without an end-of-text
token is refused.

Writing: shards are written as they fill, each whole or not at all (temp file, fsync, rename); after each one
a small state file (.prepare-state.json) records how far the source has been consumed (rows, and how many
tokens of the document in progress are already in shards). An interrupted preparation re-run with the same
source and settings continues from there and writes byte-identical shards, as does any number of processes:
worker processes tokenise batches of documents, which are written in source order. One preparation per folder
at a time (a lock file, .prepare.lock).
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import time

import numpy as np

from .errors import DataError
from .sources import Source, checksum_algorithm, new_hash
from .tokenizers import (CharTokenizer, GPT2Tokenizer, TokenizerError, fixed_tokenizer, spec_difference, spec_key,
                         tokenizer_from_spec)

FORMAT = "flashgpt-shards"
VERSION = 1
MANIFEST = "manifest.json"
STATE = ".prepare-state.json"
LOCK = ".prepare.lock"
TEMP_PREFIX = ".tmp-"
DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_VAL_DOCS = 1000
BATCH_ROWS = 512         # documents per tokenisation task, at most
BATCH_CHARS = 1 << 20    # characters per tokenisation task, at most (a task holds at least one document)
TASKS_PER_WORKER = 4     # tasks in flight per worker process: bounds memory on an endless stream


def shard_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def settings_of(source: Source, tokenizer: str, shard_tokens: int, val_docs: int, digest: str) -> dict:
    """What a prepared folder is made from; a folder holding other settings is never continued or reused."""
    return {"source": source.spec, "source_digest": digest, "tokenizer_name": tokenizer,
            "shard_tokens": shard_tokens, "val_docs": val_docs, "text_column": source.text_column}


def default_folder(source: Source, tokenizer: str, shard_tokens: int, val_docs: int, digest: str,
                   cache_dir: str) -> str:
    key = json.dumps([FORMAT, VERSION, settings_of(source, tokenizer, shard_tokens, val_docs, digest)],
                     sort_keys=True)
    return os.path.join(cache_dir, "shards",
                        f"{source.label}-{tokenizer}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


# --------------------------------------------------------------------------------------- reading manifests

def read_manifest(folder: str) -> dict:
    """The manifest of a prepared folder, its fields checked; DataError (one line) when missing or corrupt."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{folder!r} holds no {MANIFEST}: not a prepared shard folder (or its preparation did not "
                        "finish: run python -m data.prepare again)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"corrupt shard manifest {path} ({getattr(e, 'msg', None) or e})") from None
    try:
        if m["format"] != FORMAT or m["version"] != VERSION:
            raise DataError(f"{path}: format {m['format']!r} version {m['version']!r}, expected {FORMAT!r} "
                            f"version {VERSION}")
        tokenizer_from_spec(m["tokenizer"])
        dtype = np.dtype(m["dtype"])
        if dtype != shard_dtype(m["vocab_size"]) or not isinstance(m["vocab_size"], int):
            raise TypeError
        for entry in m["shards"]:
            if entry["split"] not in ("train", "val") or not isinstance(entry["tokens"], int) \
                    or os.path.basename(entry["file"]) != entry["file"] or not isinstance(entry["checksum"], str):
                raise TypeError
        str(m["checksum"])
    except (KeyError, TypeError, ValueError, TokenizerError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"corrupt shard manifest {path} (a field is missing or of the wrong type)") from None
    return m


def shard_entries(manifest: dict, split: str) -> list[dict]:
    return [e for e in manifest["shards"] if e["split"] == split]


def file_checksum(path: str, algorithm: str) -> str:
    h = new_hash(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ writing

def _write_atomic(path: str, data) -> None:
    """Replace `path` with the bytes of `data` whole or not at all: temp file, fsync, rename."""
    tmp = os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}{os.getpid()}-{os.path.basename(path)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _write_json(path: str, obj: dict) -> None:
    _write_atomic(path, (json.dumps(obj, indent=1) + "\n").encode())


@functools.lru_cache(maxsize=4)
def _tokenizer_for(spec_json: str):
    return tokenizer_from_spec(json.loads(spec_json))


def tokenize_rows(spec_json: str, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Worker task: texts → (their ids back to back, each non-empty one followed by the end-of-text id;
    the number of ids of each text, 0 for an empty one)."""
    tok = _tokenizer_for(spec_json)
    dtype = shard_dtype(tok.vocab_size)
    try:
        encoded = tok.encode_batch(texts)
    except Exception as e:  # a character outside a fixed alphabet; tokenizers raises a bare Exception
        raise DataError(f"data.dataset: the {tok.name} tokenizer cannot encode the corpus "
                        f"({' '.join(str(e).split())[:160]})") from None
    docs = [np.asarray(ids + [tok.eot_token], dtype=dtype) if t else np.zeros(0, dtype)
            for t, ids in zip(texts, encoded)]
    lens = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    return (np.concatenate(docs) if docs else np.zeros(0, dtype)), lens


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops, then the workers


class _Pipeline:
    """Ordered parallel tokenisation: batches in, (batch, ids, lens) out in the same order, at most
    num_proc * TASKS_PER_WORKER batches in flight. num_proc=1 tokenises in this process."""

    def __init__(self, spec_json: str, num_proc: int):
        self.spec_json, self.num_proc = spec_json, num_proc
        self.pool = None
        if num_proc > 1:
            self.pool = concurrent.futures.ProcessPoolExecutor(
                num_proc, mp_context=multiprocessing.get_context("forkserver"), initializer=_ignore_sigint)

    def run(self, batches):
        if self.pool is None:
            for batch in batches:
                yield (batch, *tokenize_rows(self.spec_json, batch[2]))
            return
        window = collections.deque()
        for batch in batches:
            window.append((batch, self.pool.submit(tokenize_rows, self.spec_json, batch[2])))
            if len(window) >= self.num_proc * TASKS_PER_WORKER:
                b, fut = window.popleft()
                yield (b, *fut.result())
        while window:
            b, fut = window.popleft()
            yield (b, *fut.result())

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _batches(source: Source, start: dict | None, first_row: int):
    """(index of its first row, source position at its first row, texts) for consecutive batches of rows."""
    rows = source.rows(start)
    row = first_row
    while True:
        position = source.position() if row != first_row else start
        texts, chars = [], 0
        for text in rows:
            texts.append(text)
            chars += len(text)
            if len(texts) >= BATCH_ROWS or chars >= BATCH_CHARS:
                break
        if not texts:
            return
        yield row, position, texts
        row += len(texts)


class _Writer:
    """The shards of one preparation, the state file that makes it resumable, and the manifest."""

    def __init__(self, folder: str, settings: dict, tok, algorithm: str, state: dict | None):
        self.folder, self.settings, self.tok, self.algorithm = folder, settings, tok, algorithm
        self.dtype = shard_dtype(tok.vocab_size)
        self.shard_tokens = settings["shard_tokens"]
        self.state = state or {"settings": settings, "tokenizer": tok.spec(), "checksum": algorithm,
                               "rows_done": 0, "carry": 0, "split": "val", "docs": {"val": 0, "train": 0},
                               "tokens": {"val": 0, "train": 0}, "shards": [], "resume_from": None,
                               "resume_row": 0}
        self.buffer = np.empty(self.shard_tokens, dtype=self.dtype)
        self.fill = 0

    def write_shard(self, rows_done: int, carry: int, resume_from: dict | None, resume_row: int) -> None:
        """Write the buffer as the split's next shard, then record how far the source is consumed."""
        s = self.state
        split, data = s["split"], self.buffer[:self.fill]
        index = sum(e["split"] == split for e in s["shards"])
        name = f"{split}_{index:06d}.bin"
        h = new_hash(self.algorithm)
        h.update(memoryview(data))
        _write_atomic(os.path.join(self.folder, name), memoryview(data))
        s["shards"].append({"split": split, "file": name, "tokens": int(self.fill), "checksum": h.hexdigest()})
        s["tokens"][split] += int(self.fill)
        s["rows_done"], s["carry"] = rows_done, carry
        s["resume_from"], s["resume_row"] = resume_from, resume_row
        self.fill = 0
        _write_json(os.path.join(self.folder, STATE), s)

    def check_complete(self) -> None:
        """At the end of the source: DataError unless both splits have documents."""
        s = self.state
        if s["docs"]["val"] + s["docs"]["train"] == 0:
            raise DataError(f"data.dataset: {self.settings['source']!r} holds no text")
        if s["split"] == "val" or s["docs"]["train"] == 0:
            raise DataError(f"data.dataset: {self.settings['source']!r} holds {s['docs']['val']} document(s), "
                            f"all of them taken by the validation split (data.val_docs = "
                            f"{self.settings['val_docs']}); lower data.val_docs (--val-docs)")

    def finish(self, rows: int) -> dict:
        """Write the manifest (the folder is complete from then on) and drop the state file."""
        s = self.state
        manifest = {"format": FORMAT, "version": VERSION, "source": self.settings["source"],
                    "source_digest": self.settings["source_digest"], "tokenizer": self.tok.spec(),
                    "vocab_size": self.tok.vocab_size, "eot_token": self.tok.eot_token,
                    "dtype": self.dtype.name, "shard_tokens": self.shard_tokens,
                    "val_docs": self.settings["val_docs"], "text_column": self.settings["text_column"],
                    "checksum": self.algorithm, "shards": s["shards"], "documents": s["docs"],
                    "tokens": s["tokens"], "rows": rows, "settings": self.settings}
        _write_json(os.path.join(self.folder, MANIFEST), manifest)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.folder, STATE))
        return manifest


def _char_alphabet(source: Source) -> str:
    chars = set()
    for text in source.rows():
        chars.update(text)
    if not chars:
        raise DataError(f"data.dataset: {source.spec!r} holds no text")
    return "".join(sorted(chars))


def _progress(enabled: bool, initial_rows: int):
    """The progress bar: documents/s from tqdm, tokens/s in its postfix (TQDM_DISABLE=1 hides it too)."""
    from tqdm import tqdm
    kwargs = {} if enabled else {"disable": True}  # when enabled, tqdm's own TQDM_* environment applies
    return tqdm(desc="tokenizing", unit=" docs", initial=initial_rows, dynamic_ncols=True, smoothing=0.1, **kwargs)


def _lock(folder: str, verbose: bool):
    """An exclusive lock on the folder's preparation (released when the process ends, however it ends)."""
    f = open(os.path.join(folder, LOCK), "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if verbose:
            print(f"data: waiting for another process that prepares {folder}", file=sys.stderr)
        fcntl.flock(f, fcntl.LOCK_EX)
    return f


def prepare_shards(dataset: str, tokenizer: str | dict = "gpt2", *, out: str | None = None,
                   shard_tokens: int = DEFAULT_SHARD_TOKENS, val_docs: int = DEFAULT_VAL_DOCS,
                   text_column: str = "text", num_proc: int = 1, cache_dir: str = ".cache/data",
                   verbose: bool = True, progress: bool | None = None) -> str:
    """Tokenise `dataset` into shards once; return the prepared folder (see the module docstring).

    tokenizer: "gpt2", "char", "hf:<repo-or-dir>" or a tokenizer spec. `dataset` may also be a prepared folder
    (holding manifest.json): it is returned as it is, after checking that its tokenizer is `tokenizer`. An
    unfinished preparation of the same source and settings continues; a folder holding another preparation is
    refused. progress: the progress bar (default: as verbose).
    """
    if tokenizer == {"kind": "gpt2"}:
        tokenizer = "gpt2"  # the same tokenizer as the name: the same shards
    fixed = fixed_tokenizer(tokenizer)
    if fixed is None and tokenizer not in ("gpt2", "char"):
        raise DataError(f"data.tokenizer: unknown tokenizer {tokenizer!r}; choose 'gpt2', 'char' or "
                        "'hf:<repo-or-dir>'")
    if fixed is not None and fixed.eot_token is None:
        source = getattr(fixed, "source", None)
        what = f"the tokenizer of {source}" if source else f"the {fixed.name} tokenizer"
        raise DataError(f"data.format = 'shards' ends every document with an end-of-text token, and {what} has "
                        "none (no eos_token): use data.format = 'bin'")
    tokenizer_id = tokenizer if fixed is None else spec_key(fixed.spec())
    for key, value in (("shard_tokens", shard_tokens), ("val_docs", val_docs), ("num_proc", num_proc)):
        if value < 1:
            raise DataError(f"data.{key}={value}: must be at least 1")
    if not text_column:
        raise DataError("data.text_column: must not be empty")
    if os.path.isdir(dataset) and os.path.isfile(os.path.join(dataset, MANIFEST)):
        manifest = read_manifest(dataset)
        kind = manifest["tokenizer"].get("kind")
        if fixed is not None:
            difference = spec_difference(manifest["tokenizer"], fixed.spec(), "the shards'", "the model's")
            if difference:
                raise DataError(f"the shards in {dataset} were tokenised with another tokenizer than the model's "
                                f"({difference}): prepare the source again with the model's tokenizer")
        elif kind != tokenizer:
            raise DataError(f"data.tokenizer = {tokenizer!r}, but the shards in {dataset} were tokenised with "
                            f"{kind!r}: set data.tokenizer = {kind!r}, or prepare the source again")
        return dataset
    source = Source(dataset, text_column)
    algorithm = checksum_algorithm()
    digest = source.digest(algorithm)
    settings = settings_of(source, tokenizer_id, shard_tokens, val_docs, digest)
    folder = out or default_folder(source, tokenizer_id, shard_tokens, val_docs, digest, cache_dir)
    try:
        os.makedirs(folder, exist_ok=True)
        with _lock(folder, verbose):
            if os.path.isfile(os.path.join(folder, MANIFEST)):
                manifest = read_manifest(folder)
                if manifest.get("settings") != settings:
                    raise DataError(f"{folder} already holds shards prepared from other data or settings "
                                    f"({_difference(manifest.get('settings') or {}, settings)}): choose another "
                                    "--out, or delete it")
                return folder
            return _prepare_locked(source, fixed or tokenizer, settings, algorithm, folder, num_proc, verbose,
                                   verbose if progress is None else progress)
    except OSError as e:  # disk full, read-only folder: what is written stays whole (temp file + rename)
        where = e.filename or folder
        raise DataError(f"could not write {where} ({e.strerror or e}); the shards written so far are kept: "
                        "fix this and run the same preparation again to continue") from None
    except concurrent.futures.BrokenExecutor:
        raise DataError(f"a tokenisation process died (out of memory?) while preparing {folder}; the shards "
                        "written so far are kept: run again, with fewer processes (--num-proc, data.num_proc)") from None


def _difference(found: dict, wanted: dict) -> str:
    return ", ".join(f"{k} {found.get(k)!r} there, {wanted[k]!r} asked" for k in wanted if found.get(k) != wanted[k])


def _read_state(folder: str, settings: dict) -> dict | None:
    path = os.path.join(folder, STATE)
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"corrupt preparation state {path}: delete {folder} to prepare it again") from None
    if state.get("settings") != settings:
        raise DataError(f"{folder} holds an unfinished preparation of other data or settings "
                        f"({_difference(state.get('settings') or {}, settings)}): choose another --out, or delete it")
    for entry in state["shards"]:  # the shards it records must still be whole
        path = os.path.join(folder, entry["file"])
        if not os.path.isfile(path) or file_checksum(path, state["checksum"]) != entry["checksum"]:
            raise DataError(f"{path}, written by the unfinished preparation in {folder}, is missing or changed: "
                            f"delete {folder} to prepare it again")
    return state


def _prepare_locked(source: Source, tokenizer, settings: dict, algorithm: str, folder: str, num_proc: int,
                    verbose: bool, progress: bool) -> str:
    """tokenizer: "gpt2", "char" (its alphabet read from the source) or a tokenizer object."""
    for name in os.listdir(folder):  # what an interrupted write left
        if name.startswith(TEMP_PREFIX):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))
    state = _read_state(folder, settings)
    if state is not None:
        tok = tokenizer_from_spec(state["tokenizer"])
        algorithm = state["checksum"]
        if verbose:
            print(f"data: continuing the preparation in {folder} ({len(state['shards'])} shard(s) written, "
                  f"{state['rows_done']:,} document(s) done)", file=sys.stderr)
    elif tokenizer == "char":
        tok = CharTokenizer(_char_alphabet(source), eot=True)
    elif tokenizer == "gpt2":
        tok = GPT2Tokenizer()
    else:
        tok = tokenizer
    writer = _Writer(folder, settings, tok, algorithm, state)
    t0 = time.time()
    manifest = _stream(source, writer, num_proc, progress)
    if verbose:
        n = manifest["tokens"]
        print(f"data: {source.spec} → {folder} ({n['train']:,} train / {n['val']:,} val tokens in "
              f"{len(manifest['shards'])} shard(s), {manifest['documents']['train']:,} + "
              f"{manifest['documents']['val']:,} documents, {time.time() - t0:.0f}s)", file=sys.stderr)
    return folder


def _stream(source: Source, writer: _Writer, num_proc: int, progress: bool) -> dict:
    """Source rows → tokenised batches (in order) → shards; resumes from writer.state."""
    s = writer.state
    val_docs = writer.settings["val_docs"]
    pipeline = _Pipeline(json.dumps(writer.tok.spec()), num_proc)
    # A resumed stream restarts at the batch start recorded with the last shard, then skips to rows_done.
    position, row0 = s["resume_from"], s["resume_row"]
    carry, rows = s["carry"], s["rows_done"]
    bar, tokens_seen, t0 = None, 0, time.time()
    try:
        for (row0, position, _), ids, lens in pipeline.run(_batches(source, position, row0)):
            if bar is None:  # once there is something to show
                bar = _progress(progress, row0)
            ends = np.cumsum(lens)
            for j in np.flatnonzero(lens):  # per document: split bookkeeping; its tokens are copied in slices
                row = row0 + int(j)
                if row < s["rows_done"]:
                    continue
                doc = ids[ends[j] - lens[j]:ends[j]]
                skipped = 0
                if row == s["rows_done"] and carry:  # its first `carry` tokens are in the last shard
                    doc, skipped, carry = doc[carry:], carry, 0
                else:
                    if s["split"] == "val" and s["docs"]["val"] >= val_docs:  # the validation split is complete
                        if writer.fill:
                            writer.write_shard(row, 0, position, row0)
                        s["split"] = "train"
                    s["docs"][s["split"]] += 1
                at = 0
                while at < len(doc):
                    n = min(len(doc) - at, writer.shard_tokens - writer.fill)
                    writer.buffer[writer.fill:writer.fill + n] = doc[at:at + n]
                    writer.fill += n
                    at += n
                    if writer.fill == writer.shard_tokens:
                        done = at == len(doc)
                        writer.write_shard(row + 1 if done else row, 0 if done else skipped + at, position, row0)
                tokens_seen += len(doc)
            rows = row0 + len(lens)
            bar.update(len(lens))
            bar.set_postfix_str(f"{tokens_seen / max(time.time() - t0, 1e-9):,.0f} tok/s, "
                                f"{len(s['shards'])} shards", refresh=False)
        writer.check_complete()
        if writer.fill:
            writer.write_shard(rows, 0, position, row0)
    finally:
        pipeline.close()
        if bar is not None:
            bar.close()
    return writer.finish(rows)


# ------------------------------------------------------------------------------------------------ the CLI

def _tokenizer_name(value: str) -> str:
    if value in ("gpt2", "char") or (value.startswith("hf:") and len(value) > 3):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: choose gpt2, char or hf:REPO_OR_DIR")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.prepare",
        description="Stream a corpus into fixed-size token shards (uint16/uint32, one end-of-text token after each "
                    "document, the first --val-docs documents as the validation split) with a manifest; "
                    "resumable: run the same command again after an interruption.",
        epilog="SOURCE: 'shakespeare', a .txt/.jsonl/.jsonl.gz/.parquet file, a folder or glob of them, or "
               "hf:NAME[:CONFIG] (a Hugging Face hub dataset, streamed), e.g. hf:HuggingFaceFW/fineweb-edu:sample-10BT. "
               "Train on the result with data.format = \"shards\" and the same settings (train.py finds the "
               "folder), or with data.dataset = the folder printed at the end.")
    p.add_argument("source")
    p.add_argument("--tokenizer", type=_tokenizer_name, default="gpt2", metavar="{gpt2,char,hf:REPO_OR_DIR}",
                   help="gpt2 (default); char (the source's alphabet); hf:REPO_OR_DIR, a Hugging Face model's "
                        "tokenizer.json, from a local folder or a hub id (the local cache first), for the shards "
                        "of a model fine-tuned with train.init_from")
    p.add_argument("--out", help="output folder (default: <cache-dir>/shards/<name>-<tokenizer>-<hash of source "
                                 "and settings>, where train.py looks)")
    p.add_argument("--cache-dir", default=".cache/data", help="where the default --out lies (data.cache_dir)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    p.add_argument("--val-docs", type=int, default=DEFAULT_VAL_DOCS,
                   help="the first this many documents form the validation split")
    p.add_argument("--text-column", default="text", help="the field of .jsonl/.parquet/hub rows that holds the text")
    p.add_argument("--num-proc", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="tokenisation processes (the shards are the same for any number)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary; print only the folder")
    return p


def cli_main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        folder = prepare_shards(args.source, args.tokenizer, out=args.out, shard_tokens=args.shard_tokens,
                                val_docs=args.val_docs, text_column=args.text_column, num_proc=args.num_proc,
                                cache_dir=args.cache_dir, verbose=not args.quiet)
    except (DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; the shards written so far are kept: run the same command again to continue",
              file=sys.stderr)
        return 1
    print(folder)
    return 0
