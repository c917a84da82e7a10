"""Training on token shards (data.format = "shards"): exact resume across shard boundaries, the smoke config,
and bad shards stopping train.py with one line."""
import json
import os
import shutil

import pytest
import torch

import train as train_mod
from config import load_config
from data.errors import DataError
from data.shards import prepare_shards
from model.checkpoint import load_checkpoint
from tests.test_data_shards import documents, write_jsonl
from tests.util import ROOT, TINY_MODEL, run_entry


def corpus(tmp_path, n=60, seed=0) -> str:
    os.makedirs(tmp_path, exist_ok=True)
    return write_jsonl(os.path.join(tmp_path, "docs.jsonl"), documents(n, seed=seed, long_every=15))


def cfg_for(tmp_path, *extra, dataset=None):
    return load_config(None, [f"--dataset={dataset or corpus(tmp_path)}", "--format=shards", "--tokenizer=char",
                              "--shard_tokens=1500", "--val_docs=3", f"--cache_dir={tmp_path}/cache",
                              f"--out_dir={tmp_path}/run", "--num_proc=1", "--batch_size=8",
                              "--grad_accum_steps=2", "--learning_rate=3e-3", "--min_lr=3e-4", "--warmup_iters=5",
                              "--eval_iters=3", "--log_interval=1", "--device=cpu", *TINY_MODEL, *extra])


def metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_resume_across_shards_reproduces_the_uninterrupted_run(tmp_path):
    common = ["--eval_interval=8", "--lr_decay_iters=24", "--dropout=0.1", "--log_interval=4"]
    a = cfg_for(tmp_path / "a", "--max_iters=24", *common)
    train_mod.train(a)
    b = cfg_for(tmp_path / "b", "--max_iters=16", *common)
    train_mod.train(b)
    stopped_at = load_checkpoint(b.train.out_dir)["data"]
    b2 = cfg_for(tmp_path / "b", "--max_iters=24", "--init_from=resume", *common)
    train_mod.train(b2)
    la = [(r["iter"], r["loss"]) for r in metrics(a.train.out_dir) if "loss" in r]
    lb = [(r["iter"], r["loss"]) for r in metrics(b.train.out_dir) if "loss" in r]
    assert la == lb and len(la) == 6  # bit-identical on CPU: data position, model, optimizer, RNG restored
    ea = [(r["val_loss"], r["train_loss"]) for r in metrics(a.train.out_dir) if "val_loss" in r]
    assert ea == [(r["val_loss"], r["train_loss"]) for r in metrics(b.train.out_dir) if "val_loss" in r]
    # 16 steps × 2 micro-batches × 8 rows × 32 tokens = 8,192 tokens: resumed inside the 6th 1,500-token
    # shard, after crossing five boundaries; the uninterrupted run crossed more
    assert stopped_at["format"] == "shards" and stopped_at["shard"] == 5 and stopped_at["offset"] == 692
    assert load_checkpoint(a.train.out_dir)["data"]["shard"] == 8


def test_smoke_config_trains_and_resumes(tmp_path):
    smoke = os.path.join(ROOT, "configs", "gpt2_124m_fineweb_smoke.toml")
    out, cache = tmp_path / "run", tmp_path / "cache"
    small = ["--n_layer=1", "--n_embd=32", "--block_size=64", "--batch_size=2", "--eval_iters=1",
             f"--out_dir={out}", f"--cache_dir={cache}"]
    r = run_entry("train.py", smoke, "--max_iters=3", "--eval_interval=3", *small, timeout=600)
    assert r.returncode == 0, r.stderr
    assert 'format = "shards"' in r.stdout and "tokens/step" in r.stdout
    ckpt = load_checkpoint(str(out))
    assert ckpt["iter"] == 3 and ckpt["tokenizer"] == {"kind": "gpt2"} and ckpt["data"]["format"] == "shards"
    folders = os.listdir(cache / "shards")
    assert len(folders) == 1 and folders[0].startswith("shakespeare-gpt2-")
    r2 = run_entry("train.py", out / "config.toml", "--resume", "--max_iters=5", timeout=600)
    assert r2.returncode == 0, r2.stderr
    assert "resuming at step 3" in r2.stdout and load_checkpoint(str(out))["iter"] == 5


def prepared_folder(tmp_path, tokenizer="char") -> str:
    return prepare_shards(corpus(tmp_path / "src"), tokenizer, out=str(tmp_path / f"shards-{tokenizer}"),
                          shard_tokens=1500, val_docs=3, verbose=False)


def one_line_error(r) -> str:
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def train_cli(tmp_path, folder, *extra):
    return run_entry("train.py", f"--dataset={folder}", "--format=shards", "--tokenizer=char",
                     f"--out_dir={tmp_path}/run", "--device=cpu", "--max_iters=2", "--eval_interval=2",
                     "--eval_iters=1", "--batch_size=2", *TINY_MODEL, *extra, timeout=300)


def test_shard_folder_of_another_tokenizer_is_one_line(tmp_path):
    folder = prepared_folder(tmp_path, "gpt2")
    line = one_line_error(train_cli(tmp_path, folder))
    assert "data.tokenizer = 'char'" in line and "tokenised with 'gpt2'" in line


def test_missing_shard_is_one_line_at_start(tmp_path):
    folder = prepared_folder(tmp_path)
    os.remove(os.path.join(folder, "train_000003.bin"))
    line = one_line_error(train_cli(tmp_path, folder))
    assert "shard missing" in line and "train_000003.bin" in line


def test_resume_on_changed_shards_is_one_line(tmp_path):
    folder = prepared_folder(tmp_path)
    r = train_cli(tmp_path, folder)
    assert r.returncode == 0, r.stderr
    shutil.rmtree(folder)  # the same folder, prepared again from other documents with the same alphabet
    prepare_shards(write_jsonl(tmp_path / "other.jsonl", documents(60, seed=0, long_every=15)[::-1]), "char",
                   out=folder, shard_tokens=1500, val_docs=3, verbose=False)
    line = one_line_error(run_entry("train.py", tmp_path / "run" / "config.toml", "--resume", "--max_iters=4"))
    assert "not the ones the checkpoint was trained on" in line


def test_empty_shard_file_and_format_mismatch(tmp_path):
    folder = prepared_folder(tmp_path)
    open(os.path.join(folder, "train_000001.bin"), "wb").close()
    with pytest.raises(DataError, match=r"train_000001\.bin is empty"):
        train_mod.train(cfg_for(tmp_path, "--max_iters=1", dataset=folder))
    line = one_line_error(train_cli(tmp_path, folder, "--format=bin"))
    assert "prepared token shards" in line and 'data.format = "shards"' in line


def test_checkpoint_position_is_plain_data(tmp_path):
    cfg = cfg_for(tmp_path, "--max_iters=2", "--eval_interval=2")
    train_mod.train(cfg)
    position = load_checkpoint(cfg.train.out_dir)["data"]
    assert {k for k in position} == {"format", "epoch", "shard", "offset", "train_shards", "eval_generator"}
    assert isinstance(position["eval_generator"], torch.Tensor)  # loads with weights_only=True


def test_two_ranks_read_their_rows_and_match_one_process(tmp_path):
    """torchrun on CPU (gloo): 2 ranks × 2 micro-batches over shards give the losses of 1 process × 4."""
    import subprocess
    import sys
    src = corpus(tmp_path)
    common = [os.path.join(ROOT, "train.py"), f"--dataset={src}", "--format=shards", "--tokenizer=char",
              "--shard_tokens=1500", "--val_docs=3", f"--cache_dir={tmp_path}/cache", "--num_proc=1",
              "--max_iters=8", "--eval_interval=4", "--eval_iters=2", "--log_interval=1", "--batch_size=4",
              "--device=cpu", "--attention=naive", "--learning_rate=3e-3", "--warmup_iters=2", *TINY_MODEL]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TQDM_DISABLE="1", HF_DATASETS_OFFLINE="1")
    one = subprocess.run([sys.executable, *common, f"--out_dir={tmp_path}/one", "--grad_accum_steps=4"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          *common, f"--out_dir={tmp_path}/two", "--grad_accum_steps=2"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "world size 2" in two.stdout
    rows = {run: metrics(f"{tmp_path}/{run}") for run in ("one", "two")}
    l1, l2 = ([r["loss"] for r in rows[run] if "loss" in r] for run in ("one", "two"))
    assert len(l1) == len(l2) == 8
    for a, b in zip(l1, l2):
        assert abs(a - b) < 2e-5, (l1, l2)
    # the same position in the same shards afterwards
    p1, p2 = (load_checkpoint(f"{tmp_path}/{run}")["data"] for run in ("one", "two"))
    assert (p1["shard"], p1["offset"]) == (p2["shard"], p2["offset"]) and p1["shard"] >= 2
