import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import kernels
import train as train_mod
from config import load_config
from model.checkpoint import atomic_save, load_checkpoint
from tests.util import ROOT, TINY_MODEL, run_entry, write_corpus


def cfg_for(tmp_path, *extra):
    corpus = write_corpus(tmp_path)
    return load_config(None, [f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", f"--out_dir={tmp_path}/run",
                              "--num_proc=1", "--batch_size=8", "--learning_rate=3e-3", "--min_lr=3e-4",
                              "--warmup_iters=5", "--eval_iters=4", "--log_interval=1", "--device=cpu",
                              *TINY_MODEL, *extra])


def metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_tiny_run_loss_falls_and_checkpoints(tmp_path):
    cfg = cfg_for(tmp_path, "--max_iters=60", "--eval_interval=30", "--keep_last=1")
    summary = train_mod.train(cfg)
    rows = metrics(cfg.train.out_dir)
    evals = [r for r in rows if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 30, 60]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5
    assert summary["val_loss"] < summary["unigram_val_loss"]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 60 and all(r["tokens_per_s"] > 0 and r["grad_norm"] >= 0 for r in steps)
    files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(cfg.train.out_dir, "*.pt")))
    assert files == ["best.pt", "ckpt_0000060.pt"]  # keep_last=1 removed older ones
    assert os.path.getsize(os.path.join(cfg.train.out_dir, "loss.png")) > 1000
    assert "n_layer = 2" in open(os.path.join(cfg.train.out_dir, "config.toml")).read()


def test_checkpoint_round_trip(tmp_path):
    cfg = cfg_for(tmp_path, "--max_iters=10", "--eval_interval=10")
    train_mod.train(cfg)
    ckpt = load_checkpoint(cfg.train.out_dir)
    assert ckpt["iter"] == 10 and ckpt["config"]["model"]["n_layer"] == 2
    assert ckpt["tokenizer"]["kind"] == "char"
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(**ckpt["config"]["model"]))
    model.load_state_dict(ckpt["model"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, ckpt["model"][k])


@pytest.mark.parametrize("log_interval", [1, 5])  # 5: four steps in five are read back a step late
def test_resume_reproduces_the_uninterrupted_run(log_interval, tmp_path):
    common = ["--eval_interval=10", "--lr_decay_iters=40", "--dropout=0.1", f"--log_interval={log_interval}"]
    a = cfg_for(tmp_path / "a", "--max_iters=40", *common)
    train_mod.train(a)
    b = cfg_for(tmp_path / "b", "--max_iters=20", *common)
    train_mod.train(b)
    b2 = cfg_for(tmp_path / "b", "--max_iters=40", "--init_from=resume", *common)
    train_mod.train(b2)
    ra, rb = metrics(a.train.out_dir), metrics(b.train.out_dir)
    la = [(r["iter"], r["loss"]) for r in ra if "loss" in r]
    lb = [(r["iter"], r["loss"]) for r in rb if "loss" in r]
    assert la == lb  # bit-identical on CPU: model, optimizer, schedule, data order and dropout RNG restored
    assert [r["val_loss"] for r in ra if "val_loss" in r] == [r["val_loss"] for r in rb if "val_loss" in r]


def test_refuses_to_overwrite_a_run(tmp_path):
    cfg = cfg_for(tmp_path, "--max_iters=2", "--eval_interval=2")
    train_mod.train(cfg)
    with pytest.raises(train_mod.TrainError, match="--resume"):
        train_mod.train(cfg_for(tmp_path, "--max_iters=2", "--eval_interval=2"))


def test_unwritable_run_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = cfg_for(tmp_path, "--max_iters=2", f"--out_dir={blocker}/run")
    with pytest.raises(train_mod.TrainError, match="not writable"):
        train_mod.train(cfg)


@pytest.mark.parametrize("bad_step, log_interval", [(7, 1), (7, 10), (9, 10)])
def test_non_finite_loss_stops_and_keeps_the_checkpoint(bad_step, log_interval, tmp_path, monkeypatch):
    """Every step logged (read back at once), or read back one step late (7: while step 8 runs; 9: before the
    evaluation and checkpoint of step 10): the run stops naming the bad step, and the last checkpoint is the
    good one of step 5, never a later one."""
    cfg = cfg_for(tmp_path, "--max_iters=30", "--eval_interval=5", f"--log_interval={log_interval}")
    from model import GPT
    real_forward, calls = GPT.forward, {"n": 0}

    def poisoned(self, idx, targets=None, input_pos=None):
        logits, loss = real_forward(self, idx, targets, input_pos)
        if self.training:
            calls["n"] += 1
            if calls["n"] > bad_step:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    with pytest.raises(train_mod.TrainError, match=rf"non-finite loss .* step {bad_step}:.*ckpt_0000005\.pt"):
        train_mod.train(cfg)
    assert load_checkpoint(cfg.train.out_dir)["iter"] == 5
    assert max(int(f[5:12]) for f in os.listdir(cfg.train.out_dir) if f.startswith("ckpt_")) == 5


def test_atomic_save_keeps_the_previous_file(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    atomic_save({"model": torch.ones(3), "config": {}}, path)

    def crash(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        atomic_save({"model": torch.zeros(3), "config": {}}, path)
    monkeypatch.undo()
    assert torch.equal(load_checkpoint(path)["model"], torch.ones(3))
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temp file left behind


def test_train_and_generate_end_to_end(tmp_path):
    corpus = write_corpus(tmp_path)
    out = tmp_path / "run"
    r = run_entry("train.py", os.path.join(ROOT, "configs", "demo.toml"), f"--dataset={corpus}",
                  f"--cache_dir={tmp_path}/cache", f"--out_dir={out}", "--max_iters=30", "--eval_interval=15",
                  "--num_proc=1", "--eval_iters=2", *TINY_MODEL)
    assert r.returncode == 0, r.stderr
    device = "cuda" if torch.cuda.is_available() else "cpu"  # what train.device = "auto" picks here
    assert f"attention backend: {kernels.resolve_backend('auto', device)}" in r.stdout and "val loss" in r.stdout
    assert "loss kernel: torch" in r.stdout or torch.cuda.is_available()  # the Triton loss only on CUDA
    assert "[model]" in r.stdout  # the resolved config is printed at start
    g = run_entry("generate.py", "--ckpt", out, "--prompt", "the king", "--max-new-tokens", "20", "--seed", "1")
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("the king") and len(g.stdout) > len("the king") + 10
    assert "time to first token" in g.stderr and "decode" in g.stderr
    g2 = run_entry("generate.py", "--ckpt", out, "--prompt", "the king", "--max-new-tokens", "20", "--seed", "1")
    assert g2.stdout == g.stdout  # seeded sampling is reproducible


def test_help_on_entry_points():
    for script in ("train.py", "generate.py"):
        r = run_entry(script, "--help")
        assert r.returncode == 0 and "usage" in r.stdout.lower()
    assert "n_layer" in run_entry("train.py", "--help").stdout


def test_ctrl_c_saves_and_resume_continues(tmp_path):
    corpus = write_corpus(tmp_path)
    out = tmp_path / "run"
    args = [sys.executable, os.path.join(ROOT, "train.py"), os.path.join(ROOT, "configs", "demo.toml"),
            f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", f"--out_dir={out}", "--max_iters=100000",
            "--eval_interval=100000", "--num_proc=1", "--eval_iters=1", "--log_interval=1", "--max_time=0",
            *TINY_MODEL]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until some steps have run
        m = out / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) > 5:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "interrupted at step" in err and "(SIGINT)" in err and "--resume" in err and "Traceback" not in err
    ckpt = load_checkpoint(str(out))
    assert ckpt["iter"] > 0
    r = run_entry("train.py", out / "config.toml", "--resume", f"--max_iters={ckpt['iter'] + 3}")
    assert r.returncode == 0, r.stderr
    assert f"resuming at step {ckpt['iter']}" in r.stdout
    assert load_checkpoint(str(out))["iter"] == ckpt["iter"] + 3


def test_wandb_without_the_package_is_one_line(tmp_path):
    """train.wandb = true where wandb is not installed: one line naming the package, before any work."""
    code = "import sys; sys.modules['wandb'] = None; import train; sys.exit(train.main(sys.argv[1:]))"
    corpus = write_corpus(tmp_path)
    r = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "configs", "demo.toml"),
                        f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", f"--out_dir={tmp_path}/run",
                        "--max_iters=4", "--wandb=true", *TINY_MODEL], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "wandb" in errors[0] and "pip install" in errors[0], r.stderr
    assert not os.path.exists(tmp_path / "cache")  # refused before the data was prepared


def test_wandb_offline_run_and_lazy_import(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed here")
    code = ("import sys, train; rc = train.main(sys.argv[1:]); "
            "print('WANDB_IMPORTED', 'wandb' in sys.modules); sys.exit(rc)")
    corpus = write_corpus(tmp_path)
    base = [os.path.join(ROOT, "configs", "demo.toml"), f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache",
            "--max_iters=4", "--eval_interval=2", "--eval_iters=1", "--num_proc=1", *TINY_MODEL]
    env = dict(os.environ, WANDB_DIR=str(tmp_path), TQDM_DISABLE="1", HF_DATASETS_OFFLINE="1")
    env.pop("WANDB_MODE", None)
    env.pop("WANDB_API_KEY", None)
    off = subprocess.run([sys.executable, "-c", code, *base, f"--out_dir={tmp_path}/off"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr
    assert "WANDB_IMPORTED False" in off.stdout
    on = subprocess.run([sys.executable, "-c", code, *base, f"--out_dir={tmp_path}/on", "--wandb=true",
                         "--wandb_run_name=test"], cwd=ROOT, env=dict(env, HOME=str(tmp_path)),
                        capture_output=True, text=True, timeout=300)
    assert on.returncode == 0, on.stderr
    assert "wandb: logging offline" in on.stdout  # no API key: offline, automatically
    runs = glob.glob(os.path.join(tmp_path, "on", "wandb", "offline-run-*"))
    assert runs, os.listdir(os.path.join(tmp_path, "on"))
