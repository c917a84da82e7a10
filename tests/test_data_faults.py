"""Bad corpora and damaged token caches: each gives one DataError line naming the file, never stale tokens."""
import os

import numpy as np
import pytest

from data.loader import TokenData
from data.prepare import DataError, load_meta, prepare
from tests.util import TINY_MODEL, run_entry, write_corpus


def tokens_of(folder: str) -> list[int]:
    meta = load_meta(folder)
    return np.concatenate([np.fromfile(os.path.join(folder, f"{s}.bin"), dtype=meta["dtype"])
                           for s in ("train", "val")]).tolist()


@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_file_edited_with_mtime_kept_is_retokenised(tmp_path, tokenizer):
    """`cp -p` / `rsync -t` keep the mtime (and here the size): the new bytes must still be what is tokenised."""
    corpus, cache = tmp_path / "corpus.txt", str(tmp_path / "cache")
    old_text, new_text = "the king speaks.\n" * 60, "a fool laughs!!\n\n" * 60
    assert len(old_text) == len(new_text) and old_text != new_text
    corpus.write_text(old_text)
    stat = os.stat(corpus)
    old = prepare(str(corpus), tokenizer, num_proc=1, cache_dir=cache, verbose=False)
    corpus.write_text(new_text)
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(corpus).st_mtime_ns == stat.st_mtime_ns and os.stat(corpus).st_size == stat.st_size
    new = prepare(str(corpus), tokenizer, num_proc=1, cache_dir=cache, verbose=False)
    assert new != old
    tok = TokenData(new, block_size=8).tokenizer
    ids = tokens_of(new)
    if tok.eot_token is not None:
        assert ids[-1] == tok.eot_token
        ids = ids[:-1]
    assert tok.decode(ids) == new_text
    assert TokenData(old, block_size=8).tokenizer.decode(tokens_of(old)[:8]).startswith("the king")  # old cache


def test_parallel_tokenisation_matches_one_process(tmp_path):
    """Several documents tokenised by two workers give the same ids, in file order, as one worker."""
    folder = tmp_path / "docs"
    for i in range(5):
        write_corpus(folder / f"part{i}", n_lines=30, seed=i)
    one = prepare(str(folder), "gpt2", num_proc=1, cache_dir=str(tmp_path / "c1"), verbose=False)
    two = prepare(str(folder), "gpt2", num_proc=2, cache_dir=str(tmp_path / "c2"), verbose=False)
    assert tokens_of(one) == tokens_of(two)
    assert load_meta(two)["documents"] == 5
    assert tokens_of(two).count(50256) == 5  # one <|endoftext|> per document


@pytest.mark.parametrize("num_proc", [1, 2])
def test_tokenisation_never_forks_the_calling_process(tmp_path, monkeypatch, num_proc):
    """The caller may run threads (a training run's process group, torch's pools): a fork of it can inherit a
    lock held by one of them and wait for ever, so prepare() tokenises in this process or in workers of a fork
    server, never in forks of this process."""
    def no_fork():
        raise AssertionError("prepare() forked the calling process")

    monkeypatch.setattr(os, "fork", no_fork)
    folder = tmp_path / "docs"
    for i in range(3):
        write_corpus(folder / f"part{i}", n_lines=10, seed=i)
    out = prepare(str(folder), "gpt2", num_proc=num_proc, cache_dir=str(tmp_path / "c"), verbose=False)
    assert load_meta(out)["documents"] == 3


def test_crlf_newlines_are_read_as_newlines(tmp_path):
    corpus = tmp_path / "dos.txt"
    corpus.write_bytes(b"to be,\r\nor not\rto be\n" * 40)
    folder = prepare(str(corpus), "char", num_proc=1, cache_dir=str(tmp_path / "c"), verbose=False)
    assert TokenData(folder, 8).tokenizer.decode(tokens_of(folder)) == "to be,\nor not\nto be\n" * 40


@pytest.mark.parametrize("case, payload, offset", [
    ("latin1", "Ophelia: nymph, in thy orisons be all my sins rememb'red, caf\xe9.\n".encode("latin-1"), 61),
    ("binary", bytes(range(256)), 128),
    ("elf", b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 8 + b"\x02\x00\x3e\x00\x01\x00\x00\x00\xb0\x10", 24),
])
def test_non_utf8_file_names_the_file_and_offset(tmp_path, case, payload, offset):
    bad = tmp_path / f"{case}.txt"
    bad.write_bytes(payload)
    with pytest.raises(DataError) as e:
        prepare(str(bad), "char", num_proc=1, cache_dir=str(tmp_path / "c"), verbose=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(bad) in msg and "UTF-8" in msg and f"byte offset {offset}" in msg, msg
    assert f"0x{payload[offset]:02x}" in msg


def test_non_utf8_file_in_a_folder_is_the_one_named(tmp_path):
    folder = tmp_path / "corpus"
    write_corpus(folder / "a")
    (folder / "b.txt").write_bytes(b"fine text\n" * 10 + b"\xff tail")
    with pytest.raises(DataError, match=r"b\.txt.*byte offset 100"):
        prepare(str(folder), "gpt2", num_proc=1, cache_dir=str(tmp_path / "c"), verbose=False)


def test_non_utf8_dataset_one_line_from_train_cli(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("na\xefve text\n".encode("latin-1") * 50)
    r = run_entry("train.py", f"--dataset={bad}", f"--cache_dir={tmp_path}/cache", f"--out_dir={tmp_path}/run",
                  "--device=cpu", "--max_iters=1", "--num_proc=1", *TINY_MODEL, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "byte offset 2" in lines[0], r.stderr


def corrupt_cache(tmp_path, split: str, position: int, value: int):
    folder = prepare(write_corpus(tmp_path), "char", num_proc=1, cache_dir=str(tmp_path / "c"), verbose=False)
    meta = load_meta(folder)
    path = os.path.join(folder, f"{split}.bin")
    ids = np.fromfile(path, dtype=meta["dtype"])
    ids[position] = value
    ids.tofile(path)  # same size: the size check alone cannot notice
    return folder, path, meta


def test_cached_token_file_with_out_of_range_ids(tmp_path):
    folder, path, meta = corrupt_cache(tmp_path, "train", 7, 60_000)
    assert meta["vocab_size"] < 60_000
    with pytest.raises(DataError) as e:
        TokenData(folder, block_size=16)
    msg = str(e.value)
    assert path in msg and "60000" in msg and "position 7" in msg and "\n" not in msg, msg
    with pytest.raises(DataError, match="60000"):
        load_meta(folder)


def test_out_of_range_id_found_in_a_later_chunk(tmp_path, monkeypatch):
    import data.prepare
    monkeypatch.setattr(data.prepare, "ID_SCAN_CHUNK", 64)  # many chunks over a small file
    folder, path, meta = corrupt_cache(tmp_path, "val", 0, 0)  # an in-range change: still loads
    TokenData(folder, block_size=16)
    ids = np.fromfile(path, dtype=meta["dtype"])
    ids[300] = meta["vocab_size"]  # the first id past the vocabulary
    ids.tofile(path)
    with pytest.raises(DataError, match=rf"val\.bin.*id {meta['vocab_size']} at position 300"):
        TokenData(folder, block_size=16)


def test_progress_is_a_parameter_not_an_environment_variable(tmp_path, monkeypatch, capsys):
    """prepare() turns datasets' (global) progress bars on or off by its `progress` argument, which follows
    `verbose` by default, and restores the switch afterwards; FLASHGPT_QUIET is not read. (Whether a bar then
    prints is tqdm's and huggingface_hub's business: tqdm reads TQDM_* variables once, when it is imported.)"""
    import datasets.utils
    monkeypatch.setenv("FLASHGPT_QUIET", "1")  # no longer read
    seen = []

    def spy(real):
        def call():
            seen.append(real.__name__)
            return real()
        return call

    real_enable, real_disable = datasets.utils.enable_progress_bars, datasets.utils.disable_progress_bars
    real_enable()
    corpus = write_corpus(tmp_path)
    monkeypatch.setattr(datasets.utils, "enable_progress_bars", spy(real_enable))
    monkeypatch.setattr(datasets.utils, "disable_progress_bars", spy(real_disable))
    prepare(corpus, "char", num_proc=1, cache_dir=str(tmp_path / "a"), verbose=False, progress=True)
    assert seen[0] == "enable_progress_bars" and not datasets.utils.are_progress_bars_disabled()
    seen.clear()
    prepare(corpus, "char", num_proc=1, cache_dir=str(tmp_path / "b"), verbose=False)  # progress follows verbose
    assert seen == ["disable_progress_bars", "enable_progress_bars"]  # off, then restored
    assert not datasets.utils.are_progress_bars_disabled() and capsys.readouterr().out == ""
