"""Streamed token shards: python -m data.prepare (data/shards.py, data/sources.py) and the loader that reads
them (data/sharded_loader.py). Offline: local .txt/.jsonl/.parquet fixtures written here; hub datasets are
local JSON files streamed through a stand-in for datasets.load_dataset."""
import gzip
import json
import os
import random

import numpy as np
import pytest
import torch

import data.shards as shards
from config import load_config
from data.errors import DataError
from data.sharded_loader import ShardedData
from data.shards import prepare_shards, read_manifest
from data.sources import new_hash
from data.tokenizers import GPT2Tokenizer, tokenizer_from_spec
from model.config import ConfigError
from tests.util import ROOT, pythonpath


def run_prepare(*args, timeout: int = 300):
    """`python -m data.prepare ARGS` as a user runs it (offline, no progress bars)."""
    import subprocess
    import sys
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TQDM_DISABLE="1",
               PYTHONPATH=pythonpath(ROOT))
    return subprocess.run([sys.executable, "-m", "data.prepare", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)

WORDS = ["the", "king", "queen", "sword", "night", "love", "crown", "speak", "thou", "art", "fair", "and", "café"]


def documents(n: int, seed: int = 0, long_every: int = 0) -> list[str]:
    """n distinct texts of varied length; every long_every-th one is long (thousands of tokens)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = 2000 if long_every and i % long_every == long_every - 1 else rng.randint(3, 60)
        docs.append(f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + ".")
    return docs


def write_jsonl(path, docs, column="text", gz=False, extra=True) -> str:
    rows = [json.dumps({column: d, "id": i} if extra else {column: d}) for i, d in enumerate(docs)]
    payload = ("\n".join(rows) + "\n").encode()
    with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
        f.write(payload)
    return str(path)


def write_parquet(path, docs, column="text", row_group_size=7) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({column: docs, "id": list(range(len(docs)))}), str(path), row_group_size=row_group_size)
    return str(path)


def split_tokens(folder: str, split: str) -> np.ndarray:
    m = read_manifest(folder)
    return np.concatenate([np.fromfile(os.path.join(folder, e["file"]), dtype=m["dtype"])
                           for e in m["shards"] if e["split"] == split])


def shard_bytes(folder: str) -> dict:
    return {e["file"]: open(os.path.join(folder, e["file"]), "rb").read() for e in read_manifest(folder)["shards"]}


def prep(source, tmp_path, name="out", **kw):
    kw = {"tokenizer": "gpt2", "shard_tokens": 500, "val_docs": 3, "num_proc": 1, "verbose": False} | kw
    return prepare_shards(str(source), kw.pop("tokenizer"), out=str(tmp_path / name), **kw)


# ------------------------------------------------------------------------------------------------ writing

def test_jsonl_shards_hold_each_document_then_end_of_text(tmp_path):
    docs = documents(40, long_every=13)  # three documents longer than a shard
    docs.insert(5, "")                   # an empty row: no tokens, no end-of-text
    folder = prep(write_jsonl(tmp_path / "c.jsonl", docs), tmp_path)
    m = read_manifest(folder)
    tok = GPT2Tokenizer()
    ids = [tok.encode(d) + [50256] for d in docs if d]
    val, train = split_tokens(folder, "val"), split_tokens(folder, "train")
    assert val.tolist() == sum(ids[:3], [])                 # the validation split: the first 3 documents, whole
    assert train.tolist() == sum(ids[3:], [])
    assert m["documents"] == {"val": 3, "train": 37} and m["rows"] == 41
    assert m["dtype"] == "uint16" and m["eot_token"] == 50256 and m["tokenizer"] == {"kind": "gpt2"}
    assert m["tokens"] == {"val": len(val), "train": len(train)}
    for split in ("val", "train"):  # fixed-size shards; only each split's last one is shorter
        sizes = [e["tokens"] for e in m["shards"] if e["split"] == split]
        assert all(s == 500 for s in sizes[:-1]) and 0 < sizes[-1] <= 500
    assert len([e for e in m["shards"] if e["split"] == "train"]) > 3
    for e in m["shards"]:  # checksums are of the bytes on disk
        h = new_hash(m["checksum"])
        h.update(open(os.path.join(folder, e["file"]), "rb").read())
        assert h.hexdigest() == e["checksum"]
    assert not os.path.exists(os.path.join(folder, shards.STATE))


def test_parquet_jsonl_gz_and_txt_sources_agree(tmp_path):
    docs = documents(25, seed=1)
    a = prep(write_jsonl(tmp_path / "c.jsonl", docs), tmp_path, "a")
    b = prep(write_parquet(tmp_path / "c.parquet", docs), tmp_path, "b")
    (tmp_path / "gz").mkdir()
    c = prep(write_jsonl(tmp_path / "gz" / "c.jsonl.gz", docs, gz=True), tmp_path, "c")
    txt = tmp_path / "txt"
    txt.mkdir()
    for i, d in enumerate(docs):  # one document per .txt file, read in sorted path order
        (txt / f"{i:03d}.txt").write_text(d)
    d = prep(txt, tmp_path, "d")
    assert shard_bytes(a) == shard_bytes(b) == shard_bytes(c) == shard_bytes(d)


def test_char_tokenizer_gets_an_end_of_text_id(tmp_path):
    docs = documents(12, seed=2)
    folder = prep(write_jsonl(tmp_path / "c.jsonl", docs), tmp_path, tokenizer="char", val_docs=2)
    m = read_manifest(folder)
    tok = tokenizer_from_spec(m["tokenizer"])
    alphabet = sorted(set("".join(docs)))
    assert tok.chars == "".join(alphabet) and tok.vocab_size == len(alphabet) + 1
    assert m["eot_token"] == tok.eot_token == len(alphabet) and m["vocab_size"] == len(alphabet) + 1
    ids = np.concatenate([split_tokens(folder, "val"), split_tokens(folder, "train")])
    assert (ids == tok.eot_token).sum() == len(docs)
    assert tok.decode(ids.tolist()) == "".join(docs)  # the end-of-text id decodes to nothing
    ends = np.flatnonzero(ids == tok.eot_token)
    assert tok.decode(ids[:ends[0]].tolist()) == docs[0]


def test_same_shards_for_any_number_of_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "BATCH_ROWS", 3)  # many tasks, so that two workers interleave
    src = write_jsonl(tmp_path / "c.jsonl", documents(60, seed=3, long_every=17))
    one = prep(src, tmp_path, "one", num_proc=1)
    two = prep(src, tmp_path, "two", num_proc=2)
    assert shard_bytes(one) == shard_bytes(two)
    assert read_manifest(one)["shards"] == read_manifest(two)["shards"]


def interrupt_after(monkeypatch, k: int):
    """Make the k-th shard write of a preparation raise KeyboardInterrupt right after it is recorded."""
    real, count = shards._Writer.write_shard, {"n": 0}

    def write_then_stop(self, *a, **kw):
        real(self, *a, **kw)
        count["n"] += 1
        if count["n"] == k:
            raise KeyboardInterrupt

    monkeypatch.setattr(shards._Writer, "write_shard", write_then_stop)


@pytest.mark.parametrize("k, num_proc", [(1, 1), (2, 1), (6, 1), (4, 2)])  # 1, 2: in val; 6, 4: in train
def test_interrupted_preparation_continues_to_identical_bytes(tmp_path, monkeypatch, k, num_proc):
    monkeypatch.setattr(shards, "BATCH_ROWS", 4)
    docs = documents(50, seed=4, long_every=11)
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", docs[:20])
    write_parquet(src / "b.parquet", docs[20:])
    whole = prep(src, tmp_path, "whole", val_docs=6)
    with monkeypatch.context() as mp:
        interrupt_after(mp, k)
        with pytest.raises(KeyboardInterrupt):
            prep(src, tmp_path, "cut", val_docs=6, num_proc=num_proc)
    cut = str(tmp_path / "cut")
    state = json.load(open(os.path.join(cut, shards.STATE)))
    assert len(state["shards"]) == k and not os.path.exists(os.path.join(cut, "manifest.json"))
    assert prep(src, tmp_path, "cut", val_docs=6, num_proc=num_proc) == cut
    assert shard_bytes(cut) == shard_bytes(whole)
    assert read_manifest(cut)["shards"] == read_manifest(whole)["shards"]
    assert not os.path.exists(os.path.join(cut, shards.STATE))


def test_changed_settings_or_source_never_reuse_a_folder(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", documents(20, seed=5))
    folder = prep(src, tmp_path)
    before = shard_bytes(folder)
    with pytest.raises(DataError, match=r"other data or settings .*shard_tokens 500 there, 400 asked"):
        prep(src, tmp_path, shard_tokens=400)
    write_jsonl(tmp_path / "c.jsonl", documents(20, seed=6))
    with pytest.raises(DataError, match="source_digest"):
        prep(src, tmp_path)
    assert shard_bytes(folder) == before  # nothing of the prepared folder was touched
    # default folders are keyed by source and settings: a changed source gets its own folder
    cache = str(tmp_path / "cache")
    f1 = prepare_shards(src, "gpt2", shard_tokens=500, val_docs=3, num_proc=1, cache_dir=cache, verbose=False)
    write_jsonl(tmp_path / "c.jsonl", documents(20, seed=7))
    f2 = prepare_shards(src, "gpt2", shard_tokens=500, val_docs=3, num_proc=1, cache_dir=cache, verbose=False)
    assert f1 != f2 and os.path.isfile(os.path.join(f1, "manifest.json"))


def test_cli_prepares_where_train_looks(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", documents(30, seed=8))
    cache = str(tmp_path / "cache")
    r = run_prepare(src, "--tokenizer", "char", "--shard-tokens", "700", "--val-docs", "2",
                  "--num-proc", "2", "--cache-dir", cache)
    assert r.returncode == 0, r.stderr
    folder = r.stdout.strip().splitlines()[-1]
    assert folder.startswith(os.path.join(cache, "shards", "c-char-"))
    assert "train" in r.stderr and "val tokens" in r.stderr  # the summary line
    mtime = os.path.getmtime(os.path.join(folder, "manifest.json"))
    cfg = load_config(None, [f"--dataset={src}", "--tokenizer=char", "--format=shards", "--shard_tokens=700",
                             "--val_docs=2", f"--cache_dir={cache}"])
    d = cfg.data
    assert prepare_shards(d.dataset, d.tokenizer, shard_tokens=d.shard_tokens, val_docs=d.val_docs,
                          text_column=d.text_column, cache_dir=d.cache_dir, verbose=False) == folder
    assert os.path.getmtime(os.path.join(folder, "manifest.json")) == mtime  # found, not prepared again
    h = run_prepare("--help")
    assert h.returncode == 0 and "--shard-tokens" in h.stdout and "--val-docs" in h.stdout


# ------------------------------------------------------------------- a model's own tokenizer (fine-tuning)

@pytest.fixture
def hf_folder(tmp_path):
    """A Hugging Face tokenizer folder (byte-level BPE trained on the test documents) whose post-processor starts
    every encoding with a BOS token, as Llama-3's does; documents end with its eos_token."""
    from tests.hf_models import write_tokenizer
    return write_tokenizer(tmp_path / "tok", documents(200, seed=20), bos="<|im_start|>")


def test_hf_tokenizer_shards_hold_its_encoding_then_its_eos(tmp_path, hf_folder):
    from data.tokenizers import hf_tokenizer
    docs = documents(40, seed=21, long_every=13)
    docs.insert(3, "")
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    folder = prep(src, tmp_path, tokenizer=f"hf:{hf_folder}", num_proc=2)
    tok = hf_tokenizer(hf_folder)
    m = read_manifest(folder)
    ids = [tok.encode(d) + [tok.eot_token] for d in docs if d]
    assert all(i[0] == tok.bos_token for i in ids) and tok.eot_token == 0  # <|endoftext|>
    assert split_tokens(folder, "val").tolist() == sum(ids[:3], [])
    assert split_tokens(folder, "train").tolist() == sum(ids[3:], [])
    assert m["tokenizer"] == tok.spec() and m["eot_token"] == 0 and m["vocab_size"] == tok.vocab_size == 300
    # the same ids through the spec the manifest keeps (a run rebuilds it offline), with one process
    spec = prep(src, tmp_path, "spec", tokenizer=tok.spec())
    assert shard_bytes(spec) == shard_bytes(folder)
    # the default folder names the tokenizer by a hash of its spec; the loader reads the shards back
    cache = str(tmp_path / "cache")
    default = prepare_shards(src, f"hf:{hf_folder}", shard_tokens=500, val_docs=3, cache_dir=cache, verbose=False)
    assert os.path.basename(default).startswith("c-hf-")
    data = ShardedData(default, block_size=16, seed=0)
    assert data.tokenizer.spec() == tok.spec() and data.meta["eot_token"] == 0


def test_interrupted_hf_preparation_continues_to_identical_bytes(tmp_path, monkeypatch, hf_folder):
    monkeypatch.setattr(shards, "BATCH_ROWS", 4)
    src = write_jsonl(tmp_path / "c.jsonl", documents(50, seed=22, long_every=11))
    whole = prep(src, tmp_path, "whole", tokenizer=f"hf:{hf_folder}", val_docs=6)
    with monkeypatch.context() as mp:
        interrupt_after(mp, 4)
        with pytest.raises(KeyboardInterrupt):
            prep(src, tmp_path, "cut", tokenizer=f"hf:{hf_folder}", val_docs=6)
    assert prep(src, tmp_path, "cut", tokenizer=f"hf:{hf_folder}", val_docs=6) == str(tmp_path / "cut")
    assert shard_bytes(str(tmp_path / "cut")) == shard_bytes(whole)


def test_a_prepared_folder_is_checked_against_the_models_tokenizer(tmp_path, hf_folder):
    import shutil
    from tests.hf_models import write_tokenizer
    folder = prep(write_jsonl(tmp_path / "c.jsonl", documents(20, seed=23)), tmp_path, tokenizer=f"hf:{hf_folder}")
    copy = shutil.copytree(hf_folder, tmp_path / "copy")  # the same tokenizer read from elsewhere: accepted
    assert prepare_shards(folder, f"hf:{copy}", verbose=False) == folder
    other = write_tokenizer(tmp_path / "other", documents(200, seed=24), vocab_size=280)
    with pytest.raises(DataError) as e:
        prepare_shards(folder, f"hf:{other}", verbose=False)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 1000 and "tokenised with another tokenizer than the model's" in msg
    assert "tokenizer.json sha256" in msg and "other" in msg
    with pytest.raises(DataError, match=r"data.tokenizer = 'gpt2', but the shards in .* were tokenised with 'hf'"):
        prepare_shards(folder, "gpt2", verbose=False)


def test_a_character_spec_keeps_its_alphabet(tmp_path):
    """A run's character tokenizer (a spec) prepares shards with exactly its alphabet: a corpus character outside
    it is one line naming it; a spec without the end-of-text id (a run of token files) is refused before any
    work."""
    docs = documents(12, seed=25)
    alphabet = "".join(sorted(set("".join(docs))))
    spec = {"kind": "char", "chars": "".join(sorted(alphabet + "z")), "eot": True}  # one more than the corpus has
    assert "z" not in alphabet
    folder = prep(write_jsonl(tmp_path / "c.jsonl", docs), tmp_path, tokenizer=spec, val_docs=2)
    m = read_manifest(folder)
    assert m["tokenizer"] == spec and m["eot_token"] == len(alphabet) + 1 == m["vocab_size"] - 1
    assert tokenizer_from_spec(spec).decode(split_tokens(folder, "train").tolist()) == "".join(docs[2:])
    with pytest.raises(DataError, match=r"the char tokenizer cannot encode the corpus \(character 'é' is not in "):
        prep(write_jsonl(tmp_path / "d.jsonl", docs), tmp_path, "d", tokenizer={**spec, "chars": "".join(
            c for c in alphabet if c != "é")})
    before = set(os.listdir(tmp_path))
    with pytest.raises(DataError, match=r"ends every document with an end-of-text token, and the char tokenizer "
                                        r"has none .*data.format = 'bin'"):
        prep(write_jsonl(tmp_path / "c.jsonl", docs), tmp_path, "e", tokenizer={"kind": "char", "chars": alphabet})
    assert set(os.listdir(tmp_path)) == before  # refused before any folder was made


def test_hf_tokenizer_without_an_eos_token_is_refused(tmp_path):
    from tests.hf_models import write_tokenizer
    folder = write_tokenizer(tmp_path / "tok", documents(50, seed=26), eos=None)
    with pytest.raises(DataError, match=r"and the tokenizer of hf:.*tok has none \(no eos_token\): use data.format = 'bin'"):
        prep(write_jsonl(tmp_path / "c.jsonl", documents(10)), tmp_path, tokenizer=f"hf:{folder}")


def test_cli_takes_a_hugging_face_tokenizer(tmp_path, hf_folder):
    src = write_jsonl(tmp_path / "c.jsonl", documents(30, seed=27))
    r = run_prepare(src, "--tokenizer", f"hf:{hf_folder}", "--shard-tokens", "700", "--val-docs", "2",
                    "--cache-dir", str(tmp_path / "cache"), "--quiet")
    assert r.returncode == 0, r.stderr
    folder = r.stdout.strip()
    assert read_manifest(folder)["tokenizer"]["kind"] == "hf"
    cfg = load_config(None, [f"--dataset={src}", f"--tokenizer=hf:{hf_folder}", "--format=shards",
                             "--shard_tokens=700", "--val_docs=2", f"--cache_dir={tmp_path / 'cache'}"])
    assert cfg.data.tokenizer == f"hf:{hf_folder}"  # the config takes it for shards too
    bad = run_prepare(src, "--tokenizer", "sentencepiece")
    assert bad.returncode == 2 and "'sentencepiece': choose gpt2, char or hf:REPO_OR_DIR" in bad.stderr
    missing = run_prepare(src, "--tokenizer", f"hf:{tmp_path / 'nowhere'}")
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert missing.stderr.startswith("error: ")


# ------------------------------------------------------------------------------------------ hub datasets

@pytest.fixture
def local_hub(tmp_path, monkeypatch):
    """datasets.load_dataset answering hub names with local JSON files, streamed; records the calls."""
    import datasets
    real, calls = datasets.load_dataset, []

    def fake(name, subset=None, split=None, streaming=False, **kw):
        calls.append((name, subset, streaming))
        files = sorted(str(p) for p in (tmp_path / "hub" / name.replace("/", "_")).glob("*.jsonl"))
        return real("json", data_files=files, split=split, streaming=streaming, cache_dir=str(tmp_path / "hf"))

    monkeypatch.setattr(datasets, "load_dataset", fake)
    return calls


def test_hub_dataset_is_streamed_and_resumes_from_its_state(tmp_path, monkeypatch, local_hub):
    monkeypatch.setattr(shards, "BATCH_ROWS", 5)
    docs = documents(40, seed=9, long_every=9)
    (tmp_path / "hub" / "org_corpus").mkdir(parents=True)
    for i in range(4):  # four remote files
        write_jsonl(tmp_path / "hub" / "org_corpus" / f"part{i}.jsonl", docs[i * 10:(i + 1) * 10])
    whole = prep("hf:org/corpus:sample", tmp_path, "whole")
    assert local_hub[0] == ("org/corpus", "sample", True)
    tok = GPT2Tokenizer()
    assert split_tokens(whole, "train").tolist() == sum((tok.encode(d) + [50256] for d in docs[3:]), [])
    with monkeypatch.context() as mp:
        interrupt_after(mp, 5)
        with pytest.raises(KeyboardInterrupt):
            prep("hf:org/corpus:sample", tmp_path, "cut")
    state = json.load(open(tmp_path / "cut" / shards.STATE))
    assert state["resume_from"]["hub"] is not None  # datasets' own position: no re-reading from the start
    prep("hf:org/corpus:sample", tmp_path, "cut")
    assert shard_bytes(str(tmp_path / "cut")) == shard_bytes(whole)


def test_hub_dataset_without_the_text_column_lists_its_columns(tmp_path, local_hub):
    (tmp_path / "hub" / "org_code").mkdir(parents=True)
    write_jsonl(tmp_path / "hub" / "org_code" / "a.jsonl", documents(5), column="content")
    with pytest.raises(DataError) as e:
        prep("hf:org/code", tmp_path)
    msg = str(e.value)
    assert "'text' column" in msg and "content, id" in msg and "text_column" in msg and "\n" not in msg
    folder = prep("hf:org/code", tmp_path, "ok", text_column="content", val_docs=1)
    assert read_manifest(folder)["documents"] == {"val": 1, "train": 4}


def test_hub_unreachable_is_one_line(tmp_path, monkeypatch):
    import datasets

    def offline(*a, **kw):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as e:
        prep("hf:HuggingFaceFW/fineweb-edu:sample-10BT", tmp_path)
    msg = str(e.value)
    assert "could not load hub dataset 'HuggingFaceFW/fineweb-edu'" in msg and "ConnectionError" in msg
    assert "\n" not in msg and "local files" in msg


def test_hub_offline_from_the_cli(tmp_path):
    r = run_prepare("hf:surely/not-a-dataset", "--out", tmp_path / "o", timeout=120)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not load hub dataset 'surely/not-a-dataset'" in lines[0], r.stderr


# ------------------------------------------------------------------------------------------- bad sources

@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_file_without_the_text_column_lists_its_columns(tmp_path, kind):
    path = (write_jsonl(tmp_path / "c.jsonl", documents(3), column="body") if kind == "jsonl"
            else write_parquet(tmp_path / "c.parquet", documents(3), column="body"))
    with pytest.raises(DataError) as e:
        prep(path, tmp_path)
    msg = str(e.value)
    assert path in msg and "'text'" in msg and "body, id" in msg and "\n" not in msg, msg


def test_non_utf8_jsonl_names_the_byte_offset(tmp_path):
    path = tmp_path / "c.jsonl"
    good = b'{"text": "fine"}\n'
    path.write_bytes(good * 2 + b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError) as e:
        prep(path, tmp_path)
    msg = str(e.value)
    assert str(path) in msg and "UTF-8" in msg and f"byte offset {2 * len(good) + 13}" in msg and "0xe9" in msg


def test_non_utf8_txt_in_a_folder_is_the_one_named(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("fine text\n" * 10)
    (folder / "b.txt").write_bytes(b"more text\n" * 10 + b"\xff tail")
    with pytest.raises(DataError, match=r"b\.txt is not UTF-8 text: byte 0xff at byte offset 100"):
        prep(folder, tmp_path)


def test_bad_json_line_is_named(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"c\.jsonl line 2 is not JSON"):
        prep(path, tmp_path)


def test_too_few_documents_for_the_validation_split(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", documents(3))
    with pytest.raises(DataError, match=r"3 document\(s\), all of them taken by the validation split"):
        prep(src, tmp_path, val_docs=3)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n\n')
    with pytest.raises(DataError, match="holds no text"):
        prep(empty, tmp_path, "e")


def test_config_keys_are_validated():
    cfg = load_config(None, ["--format=shards", "--val_docs=5", "--shard_tokens=1000", "--text_column=body"])
    assert (cfg.data.format, cfg.data.val_docs, cfg.data.shard_tokens, cfg.data.text_column) == \
        ("shards", 5, 1000, "body")
    for bad, key in (("--format=zip", "data.format"), ("--val_docs=0", "data.val_docs"),
                     ("--shard_tokens=0", "data.shard_tokens"), ("--text_column=", "data.text_column")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])


# ------------------------------------------------------------------------------------------------ loading

@pytest.fixture
def prepared(tmp_path):
    """A folder of many small shards (documents cross shard boundaries), char tokenizer."""
    return prep(write_jsonl(tmp_path / "c.jsonl", documents(80, seed=10, long_every=20)), tmp_path,
                tokenizer="char", shard_tokens=777, val_docs=4)


def test_train_batches_read_the_stream_in_order_across_shards(prepared):
    stream = split_tokens(prepared, "train").astype(np.int64)
    data = ShardedData(prepared, block_size=16)
    B, T, accum, p = 3, 16, 2, 0
    assert len(data.train.entries) > 10
    for _ in range(len(stream) // (B * T * accum) + 3):  # past the end: a new epoch from the beginning
        if p + B * T * accum + 1 > len(stream):
            p = 0
        for x, y in data.train_batches(B, accum):
            rows = torch.from_numpy(stream[p:p + B * T + 1])
            assert torch.equal(x, rows[:-1].view(B, T)) and torch.equal(y, rows[1:].view(B, T))
            p += B * T
    assert data.epoch == 1


def test_ranks_read_their_rows_of_one_global_batch(prepared):
    single = ShardedData(prepared, 8, seed=1)
    ranks = [ShardedData(prepared, 8, seed=1) for _ in range(2)]
    for _ in range(7):
        one = single.train_batches(2, 4)                                  # 4 micro-batches, one process
        per_rank = [d.train_batches(2, 2, rank=r, world_size=2) for r, d in enumerate(ranks)]
        # rank r's m-th micro-batch is the single process's micro-batch m * world + r
        for m in range(2):
            for r in range(2):
                assert torch.equal(per_rank[r][m][0], one[m * 2 + r][0])
                assert torch.equal(per_rank[r][m][1], one[m * 2 + r][1])


def test_state_dict_resumes_exactly(prepared):
    a = ShardedData(prepared, 12, seed=3)
    for _ in range(9):
        a.train_batches(4, 2)
    list(a.eval_batches("train", 4, 2))
    state = a.state_dict()
    assert state["shard"] > 0  # the position is past the first shard
    b = ShardedData(prepared, 12, seed=3)
    b.load_state_dict(state)
    for _ in range(30):
        for (xa, ya), (xb, yb) in zip(a.train_batches(4, 2), b.train_batches(4, 2)):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    for (xa, _), (xb, _) in zip(a.eval_batches("train", 4, 3), b.eval_batches("train", 4, 3)):
        assert torch.equal(xa, xb)
    with pytest.raises(DataError, match="data.format"):
        b.load_state_dict({"train": torch.zeros(3)})  # a data.format = "bin" position


def test_validation_batches_are_the_same_every_time(prepared):
    data = ShardedData(prepared, 16)
    val = split_tokens(prepared, "val").astype(np.int64)
    first = list(data.eval_batches("val", 4, 3))
    data.train_batches(4, 1)
    again = list(data.eval_batches("val", 4, 3))
    assert all(torch.equal(p[0], q[0]) for p, q in zip(first, again))
    assert torch.equal(first[0][0][1], torch.from_numpy(val[16:32]))  # row 1 of batch 0: the 2nd window


def test_unigram_baseline_is_an_entropy(prepared):
    data = ShardedData(prepared, 8)
    assert 0 < data.unigram_loss() < np.log(data.meta["vocab_size"]) + 1e-6


# ---------------------------------------------------------------------------------------- damaged shards

def test_missing_empty_or_truncated_shard_is_named_at_open(prepared):
    victim = os.path.join(prepared, "train_000005.bin")
    data = open(victim, "rb").read()
    os.remove(victim)
    with pytest.raises(DataError, match=r"shard missing: .*train_000005\.bin"):
        ShardedData(prepared, 8)
    open(victim, "wb").close()
    with pytest.raises(DataError, match=r"train_000005\.bin is empty \(0 bytes\)"):
        ShardedData(prepared, 8)
    open(victim, "wb").write(data[:-2])
    with pytest.raises(DataError, match=r"train_000005\.bin is \d+ bytes, but manifest.json says 777"):
        ShardedData(prepared, 8)


def test_replaced_shard_fails_its_checksum_when_first_read(prepared, tmp_path):
    other = prep(write_jsonl(tmp_path / "o.jsonl", documents(80, seed=11)), tmp_path, "other",
                 tokenizer="gpt2", shard_tokens=777, val_docs=4)
    victim = os.path.join(prepared, "train_000001.bin")
    os.replace(os.path.join(other, "train_000001.bin"), victim)  # same size, another tokenizer's ids
    data = ShardedData(prepared, 8)  # sizes match: opens
    with pytest.raises(DataError, match=r"train_000001\.bin does not match its xxh3_128 checksum"):
        for _ in range(100):
            data.train_batches(4, 4)


def test_folder_of_another_tokenizer_is_refused(prepared):
    with pytest.raises(DataError, match=r"data.tokenizer = 'gpt2', but the shards in .* were tokenised with 'char'"):
        prepare_shards(prepared, "gpt2", verbose=False)
    assert prepare_shards(prepared, "char", verbose=False) == prepared


def test_a_document_longer_than_the_block_is_cut_into_windows(tmp_path):
    """Packed training takes any document length: a 20-block document spanning several shards is read back
    exactly, window after window."""
    long_doc = " ".join(["thou art fair and the night is long"] * 300)
    folder = prep(write_jsonl(tmp_path / "c.jsonl", ["a validation document. " * 4, long_doc, "tail"]), tmp_path,
                  tokenizer="char", shard_tokens=1000, val_docs=1)
    data = ShardedData(folder, block_size=32)
    tok = data.tokenizer
    got = [x.flatten() for _ in range(5) for x, _ in data.train_batches(4, 1)]
    assert tok.decode(torch.cat(got).tolist()) == long_doc[:5 * 4 * 32]


def test_disk_full_is_one_line_and_keeps_what_was_written(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "c.jsonl", documents(40, seed=12, long_every=7))
    whole = prep(src, tmp_path, "whole")
    real, writes = shards._write_atomic, {"n": 0}

    def fill_up(path, data):
        writes["n"] += 1
        if writes["n"] == 6:
            with open(os.path.join(os.path.dirname(path), ".tmp-partial"), "wb") as f:
                f.write(b"half a shard")  # what a write cut short leaves
            raise OSError(28, "No space left on device", path)
        real(path, data)

    monkeypatch.setattr(shards, "_write_atomic", fill_up)
    with pytest.raises(DataError) as e:
        prep(src, tmp_path, "cut")
    msg = str(e.value)
    assert "No space left on device" in msg and "run the same preparation again" in msg and "\n" not in msg
    monkeypatch.undo()
    prep(src, tmp_path, "cut")
    assert shard_bytes(str(tmp_path / "cut")) == shard_bytes(whole)
    assert not any(f.startswith(".tmp-") for f in os.listdir(tmp_path / "cut"))


def test_hub_stream_failing_midway_is_one_line_and_resumable(tmp_path, monkeypatch, local_hub):
    import datasets
    monkeypatch.setattr(shards, "BATCH_ROWS", 4)
    (tmp_path / "hub" / "org_web").mkdir(parents=True)
    for i in range(3):
        write_jsonl(tmp_path / "hub" / "org_web" / f"part{i}.jsonl", documents(12, seed=20 + i, long_every=5))
    whole = prep("hf:org/web", tmp_path, "whole")
    streaming = datasets.IterableDataset.__iter__

    def drop_connection(self):
        for n, row in enumerate(streaming(self)):
            if n == 25:
                raise ConnectionError("Connection reset by peer")
            yield row

    with monkeypatch.context() as mp:
        mp.setattr(datasets.IterableDataset, "__iter__", drop_connection)
        with pytest.raises(DataError) as e:
            prep("hf:org/web", tmp_path, "cut")
    msg = str(e.value)
    assert "streaming hub dataset 'org/web' failed (ConnectionError: Connection reset by peer)" in msg
    assert "\n" not in msg and os.path.exists(tmp_path / "cut" / shards.STATE)
    prep("hf:org/web", tmp_path, "cut")
    assert shard_bytes(str(tmp_path / "cut")) == shard_bytes(whole)
