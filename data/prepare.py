"""Turn a text corpus into token files, once: datasets → parallel tokenisation → train.bin / val.bin.

This is the small-corpus path (data.format = "bin": the whole corpus in memory-mapped train.bin / val.bin,
the split cut by token count). `python -m data.prepare SOURCE ...` runs the streamed, sharded path instead
(data.format = "shards", data/shards.py); see `python -m data.prepare --help`.

Sources (`data.dataset` in the config):
  "shakespeare"           the 42 public-domain works shipped by the `shksprdata` package (the default)
  a path                  a text file, a folder of *.txt files, or a glob such as "corpus/*.txt"
  "hf:NAME[:CONFIG]"      a Hugging Face hub dataset with a "text" column (needs internet), e.g. hf:openwebtext

A local source is read as bytes, one file at a time: those bytes are hashed, decoded as UTF-8 (universal
newlines, as text-mode `open` reads them) and written into a private Arrow file whose documents are then
tokenised, so the tokens always come from the bytes that were hashed; no cache is trusted by file size or mtime.
A file that is not UTF-8 is refused with the byte offset of its first invalid byte.

Tokenisation runs in this process (num_proc = 1) or in num_proc worker processes started by a fork server,
never in forks of this process: the caller (a training run, a test session) may be running threads — torch's,
a process group's — and a forked child inherits their locks in whatever state they are, which can leave it
waiting for ever.

The output folder is keyed by a hash of the source contents (hub datasets: of their name), the tokenizer and the
split, so the same corpus is tokenised once and reused; a changed file gives a new folder. Layout:
  <cache_dir>/<name>-<tokenizer>-<hash>/{train.bin, val.bin, meta.json}
Token files are flat arrays of uint16 (vocab < 65536) or uint32, read back with np.memmap.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import tempfile

import numpy as np

from .errors import DataError
from .sources import shakespeare_files
from .tokenizers import CharTokenizer, GPT2Tokenizer, fixed_tokenizer, spec_key, tokenizer_from_spec

FORMAT_VERSION = 1
ID_SCAN_CHUNK = 1 << 24  # tokens per block when a token file is scanned for ids outside the vocabulary
TOKENIZE_BATCH = 16      # documents per tokenisation task, at most (a local source's file is one document)
TASKS_PER_WORKER = 2     # tasks in flight per worker process


def resolve_files(dataset: str) -> list[str]:
    """Local source → sorted list of text files. Raises DataError when there is nothing to read."""
    if dataset == "shakespeare":
        return shakespeare_files()
    if os.path.isdir(dataset):
        if os.path.isfile(os.path.join(dataset, "manifest.json")):
            raise DataError(f"data.dataset: {dataset!r} is a folder of prepared token shards: train on it with "
                            "data.format = \"shards\"")
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


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"data.dataset: cannot read {path} ({e.strerror or e})") from None


def _update_digest(h, path: str, raw: bytes) -> None:
    """One file's share of the source hash: its name, its length and its bytes."""
    h.update(os.path.basename(path).encode() + b"\0" + len(raw).to_bytes(8, "little") + raw)


def _files_digest(files: list[str]) -> str:
    """sha256 over the files' names and bytes, in order; reads each file once, one at a time."""
    h = hashlib.sha256()
    for path in files:
        _update_digest(h, path, _read_file(path))
    return h.hexdigest()


def _decode(path: str, raw: bytes) -> str:
    """UTF-8 bytes → text with universal newlines; DataError naming the file and the first invalid byte."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data.dataset: {path} is not UTF-8 text: byte 0x{raw[e.start]:02x} at byte offset "
                        f"{e.start} ({e.reason}); convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) "
                        "or leave it out") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _write_documents(files: list[str], arrow_path: str) -> tuple[str, int]:
    """Each non-empty file → one row of a "text" column in an Arrow stream file at `arrow_path`.

    Returns (sha256 of the names and bytes that were read, number of rows). Reads each file once: the
    digest is of exactly the bytes that are written, whatever happens to the files meanwhile.
    """
    import pyarrow as pa
    schema = pa.schema([("text", pa.large_string())])  # large: a document may exceed 2 GiB
    h, rows = hashlib.sha256(), 0
    with pa.OSFile(arrow_path, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for path in files:
            raw = _read_file(path)
            _update_digest(h, path, raw)
            text = _decode(path, raw)
            del raw
            if text:
                writer.write_batch(pa.record_batch([pa.array([text], type=pa.large_string())], schema=schema))
                rows += 1
    return h.hexdigest(), rows


@contextlib.contextmanager
def _datasets_progress(enabled: bool):
    """datasets' progress bars on or off for the duration (its switch is global: restored afterwards)."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    was_disabled = are_progress_bars_disabled()
    (enable_progress_bars if enabled else disable_progress_bars)()
    try:
        yield
    finally:
        (disable_progress_bars if was_disabled else enable_progress_bars)()


@functools.lru_cache(maxsize=4)
def _tokenizer_for(spec_json: str):
    return tokenizer_from_spec(json.loads(spec_json))


def _tokenize_texts(spec_json: str, texts: list[str]) -> list[list[int]]:
    """Tokenisation task: each document → its ids, followed by the end-of-text id when the tokenizer has one."""
    tok = _tokenizer_for(spec_json)
    try:
        ids = tok.encode_batch(texts)
    except Exception as e:  # e.g. a character outside a WordLevel vocabulary: tokenizers raises a bare Exception
        raise DataError(f"data.dataset: the {tok.name} tokenizer cannot encode the corpus "
                        f"({' '.join(str(e).split())[:160]})") from None
    if tok.eot_token is not None:
        ids = [doc + [tok.eot_token] for doc in ids]
    return ids


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops, then the workers


def _tokenized(batches, spec_json: str, num_proc: int):
    """The ids of each batch of texts (_tokenize_texts), in the batches' order: in this process when num_proc
    is 1, else in num_proc workers started by a fork server (see the module's docstring), with at most
    num_proc * TASKS_PER_WORKER batches in flight."""
    if num_proc <= 1:
        for texts in batches:
            yield _tokenize_texts(spec_json, texts)
        return
    pool = concurrent.futures.ProcessPoolExecutor(num_proc, mp_context=multiprocessing.get_context("forkserver"),
                                                  initializer=_ignore_sigint)
    try:
        window = collections.deque()
        for texts in batches:
            window.append(pool.submit(_tokenize_texts, spec_json, texts))
            if len(window) >= num_proc * TASKS_PER_WORKER:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _load_hub_dataset(dataset: str, hf_cache: str):
    import datasets
    name, _, subset = dataset[len("hf:"):].partition(":")
    try:
        ds = datasets.load_dataset(name, subset or None, split="train", cache_dir=hf_cache)
    except Exception as e:  # offline, unknown name, ...: one line, not a traceback
        raise DataError(f"data.dataset: could not load hub dataset {name!r} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); use a local text file when offline") from None
    if "text" not in ds.column_names:
        raise DataError(f"data.dataset: hub dataset {name!r} has no 'text' column ({ds.column_names})")
    return ds.filter(lambda row: len(row["text"]) > 0)


def _cache_folder(dataset: str, files: list[str] | None, tokenizer: str, val_fraction: float, source_id: str,
                  cache_dir: str) -> str:
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, source_id, tokenizer, val_fraction]).encode()).hexdigest()[:16]
    label = "hub-" + dataset[3:].replace("/", "_").replace(":", "_") if files is None else (
        "shakespeare" if dataset == "shakespeare" else os.path.splitext(os.path.basename(files[0]))[0])
    return os.path.join(cache_dir, f"{label}-{tokenizer}-{key}")


def prepare(dataset: str, tokenizer: str | dict, *, val_fraction: float = 0.1, num_proc: int = 2,
            cache_dir: str = ".cache/data", verbose: bool = True, progress: bool | None = None) -> str:
    """Tokenise `dataset` with `tokenizer` once; return the folder of token files.

    tokenizer: "gpt2"; "char" (the alphabet of the corpus); "hf:<repo-or-dir>" (a Hugging Face model's
    tokenizer.json); or a tokenizer spec (data/tokenizers.py), for exactly that tokenizer, e.g. a pretrained
    model's (a character spec whose alphabet lacks a character of the corpus is refused, naming it).
    verbose: print one summary line when tokenising. progress: show datasets' progress bars (default: as
    verbose; the TQDM_DISABLE environment variable still turns every bar off).
    """
    if tokenizer == {"kind": "gpt2"}:
        tokenizer = "gpt2"  # the same tokenizer as the name: the same token files
    fixed = fixed_tokenizer(tokenizer)
    if fixed is None and tokenizer not in ("gpt2", "char"):
        raise DataError(f"data.tokenizer: unknown tokenizer {tokenizer!r}; choose 'gpt2', 'char' or "
                        "'hf:<repo-or-dir>'")
    tokenizer_id = tokenizer if fixed is None else spec_key(fixed.spec())
    is_hub = dataset.startswith("hf:")
    files = None if is_hub else resolve_files(dataset)
    source_id = dataset if is_hub else _files_digest(files)
    out = _cache_folder(dataset, files, tokenizer_id, val_fraction, source_id, cache_dir)
    if os.path.isfile(os.path.join(out, "meta.json")):
        load_meta(out, check_ids=False)  # sizes only: TokenData scans the ids when it opens the files
        return out

    os.makedirs(cache_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir)  # this call's scratch folder, removed at the end
    try:
        with _datasets_progress(verbose if progress is None else progress):
            return _tokenize(dataset, files, tokenizer_id, fixed, val_fraction, num_proc, cache_dir, work, verbose,
                             out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _tokenize(dataset: str, files: list[str] | None, tokenizer: str, fixed, val_fraction: float, num_proc: int,
              cache_dir: str, work: str, verbose: bool, out: str) -> str:
    """prepare()'s cache miss: documents → token ids (_tokenized) → train.bin / val.bin / meta.json in `out`."""
    import datasets
    from datasets.utils import tqdm  # off while datasets' progress bars are off (_datasets_progress)
    if files is None:
        ds, source_sha256 = _load_hub_dataset(dataset, os.path.join(cache_dir, "hf")), None
    else:
        source_sha256, rows = _write_documents(files, os.path.join(work, "documents.arrow"))
        # Named by the bytes just read (the same as `out`'s unless a file changed since it was hashed).
        out = _cache_folder(dataset, files, tokenizer, val_fraction, source_sha256, cache_dir)
        if rows == 0:
            raise DataError(f"data.dataset: {dataset!r} holds no text")
        ds = datasets.Dataset.from_file(os.path.join(work, "documents.arrow"))
    if len(ds) == 0:
        raise DataError(f"data.dataset: {dataset!r} holds no text")
    if tokenizer == "char" or isinstance(fixed, CharTokenizer):
        chars = set()
        for batch in ds.iter(batch_size=64):
            chars.update(*map(set, batch["text"]))
        tok = fixed or CharTokenizer("".join(sorted(chars)))
        missing = "".join(sorted(chars - set(tok.chars)))
        if missing:
            raise DataError(f"data.dataset: {dataset!r} has characters the model's alphabet lacks: {missing[:40]!r}")
    else:
        tok = fixed or GPT2Tokenizer()
    spec_json = json.dumps(tok.spec())
    dtype = np.uint16 if tok.vocab_size < 2**16 else np.uint32
    tmp = os.path.join(work, "tokens")  # written whole, then renamed into place (same file system)
    os.mkdir(tmp)
    total = 0
    workers = max(1, min(num_proc, len(ds)))
    per_task = min(TOKENIZE_BATCH, -(-len(ds) // workers))  # a few documents still go to every worker
    batches = (b["text"] for b in ds.select_columns(["text"]).iter(batch_size=per_task))
    with open(os.path.join(tmp, "all.bin"), "wb") as f, \
            tqdm(total=len(ds), desc=f"tokenizing ({tok.name})", unit=" documents") as bar:
        for ids in _tokenized(batches, spec_json, workers):
            for doc in ids:
                f.write(np.asarray(doc, dtype=dtype).tobytes())
                total += len(doc)
            bar.update(len(ids))
    n_val = int(total * val_fraction)
    if total - n_val < 2 or (val_fraction > 0 and n_val < 2):
        raise DataError(f"data.dataset: {dataset!r} is too small ({total} tokens) to split into train and val")
    flat = np.memmap(os.path.join(tmp, "all.bin"), dtype=dtype, mode="r", shape=(total,))
    n_train = total - n_val
    flat[:n_train].tofile(os.path.join(tmp, "train.bin"))
    flat[n_train:].tofile(os.path.join(tmp, "val.bin"))
    del flat
    os.remove(os.path.join(tmp, "all.bin"))
    meta = {"format": FORMAT_VERSION, "dataset": dataset, "tokenizer": tok.spec(),
            "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name,
            "train_tokens": n_train, "val_tokens": n_val, "documents": len(ds)}
    if source_sha256:
        meta["source_sha256"] = source_sha256
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.replace(tmp, out)
    if verbose:
        print(f"data: {dataset} → {out} ({n_train:,} train / {n_val:,} val tokens, vocab {tok.vocab_size})")
    return out


def load_meta(folder: str, *, check_ids: bool = True) -> dict:
    """Read meta.json and check that the token files are present, of the recorded size and (with check_ids)
    hold only ids below the recorded vocab_size.

    The id check reads every token once, ID_SCAN_CHUNK tokens at a time (vectorised max per block, memory
    bounded by one block): about as long as reading the files, i.e. well under a second per GB from the page
    cache, the disk's read speed otherwise.
    """
    path = os.path.join(folder, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataError(f"token folder {folder!r} has no meta.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DataError(f"corrupt metadata file {path}") from None
    try:
        dtype = np.dtype(meta["dtype"])
        vocab_size = meta["vocab_size"]
        if dtype not in (np.uint16, np.uint32) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise TypeError
        for split in ("train", "val"):
            f = os.path.join(folder, f"{split}.bin")
            if not os.path.isfile(f):
                raise DataError(f"token file missing: {f}")
            if os.path.getsize(f) != meta[f"{split}_tokens"] * dtype.itemsize:
                raise DataError(f"corrupt token file {f}: size does not match {path}; delete {folder} to "
                                "tokenise the corpus again")
            if check_ids:
                _check_ids(f, dtype, vocab_size, folder)
    except (KeyError, TypeError):
        raise DataError(f"corrupt metadata file {path}") from None
    return meta


def _check_ids(path: str, dtype: np.dtype, vocab_size: int, folder: str) -> None:
    """DataError naming the first id >= vocab_size in a token file, and where it is."""
    if os.path.getsize(path) == 0:
        return
    ids = np.memmap(path, dtype=dtype, mode="r")
    for start in range(0, len(ids), ID_SCAN_CHUNK):
        block = ids[start:start + ID_SCAN_CHUNK]
        if int(block.max()) >= vocab_size:
            at = int(np.argmax(block >= vocab_size))
            raise DataError(f"corrupt token file {path}: token id {int(block[at])} at position {start + at} is "
                            f"outside the vocabulary of {vocab_size}; delete {folder} to tokenise the corpus again")


def main(argv=None) -> int:
    """`python -m data.prepare`: the sharded preparation's command line (data/shards.py)."""
    from .shards import cli_main
    return cli_main(argv)


if __name__ == "__main__":
    import sys
    sys.exit(main())
