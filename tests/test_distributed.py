"""torchrun + DistributedDataParallel on CPU (gloo): two ranks match one process with the same global batch."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.util import ROOT, TINY_MODEL, write_corpus


def losses(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]


ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TQDM_DISABLE="1", HF_DATASETS_OFFLINE="1")


def train_run(args: list, ranks: int = 1):
    """train.py with `args` in one process, or under torchrun with `ranks` gloo ranks; the finished process."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    run = subprocess.run([sys.executable, *launcher, os.path.join(ROOT, "train.py"), *args], env=ENV, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU gloo ranks: the CPU suite runs this")
def test_two_ranks_match_one_process(tmp_path):
    corpus = write_corpus(tmp_path)
    common = [os.path.join(ROOT, "configs", "demo.toml"), f"--dataset={corpus}",
              f"--cache_dir={tmp_path}/cache", "--num_proc=1", "--max_iters=12", "--eval_interval=6",
              "--eval_iters=2", "--log_interval=1", "--batch_size=4", "--device=cpu", "--attention=naive",
              "--learning_rate=3e-3", "--warmup_iters=2", *TINY_MODEL]
    train_run([*common, f"--out_dir={tmp_path}/one", "--grad_accum_steps=4"])
    two = train_run([*common, f"--out_dir={tmp_path}/two", "--grad_accum_steps=2"], ranks=2)
    assert "world size 2" in two.stdout and two.stdout.count("[model]") == 1  # only rank 0 prints and logs
    (l1, v1), (l2, v2) = losses(f"{tmp_path}/one"), losses(f"{tmp_path}/two")
    assert len(l1) == len(l2) == 12
    for a, b in zip(l1 + v1, l2 + v2):
        assert abs(a - b) < 2e-5, (l1, l2)
    assert l1[-1] < l1[0]
    ckpts = sorted(f for f in os.listdir(f"{tmp_path}/two") if f.endswith(".pt"))
    assert ckpts == ["best.pt", "ckpt_0000006.pt", "ckpt_0000012.pt"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU gloo ranks: the CPU suite runs this")
def test_two_ranks_match_one_process_with_lora(tmp_path):
    """LoRA under DDP: the frozen weights take no part in the gradient all-reduce, the updates match one process."""
    corpus = write_corpus(tmp_path)
    base = [f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", "--num_proc=1", "--eval_iters=2",
            "--log_interval=1", "--batch_size=4", "--device=cpu", "--attention=naive", "--warmup_iters=2"]
    train_run([*base, *TINY_MODEL, f"--out_dir={tmp_path}/src", "--max_iters=4", "--eval_interval=4"])
    common = [*base, f"--init_from={tmp_path}/src", "--max_iters=8", "--eval_interval=4", "--learning_rate=3e-2",
              "--lora_rank=4", "--lora_alpha=8"]
    train_run([*common, f"--out_dir={tmp_path}/one", "--grad_accum_steps=4"])
    two = train_run([*common, f"--out_dir={tmp_path}/two", "--grad_accum_steps=2"], ranks=2)
    assert "world size 2" in two.stdout and "LoRA rank 4" in two.stdout
    (l1, v1), (l2, v2) = losses(f"{tmp_path}/one"), losses(f"{tmp_path}/two")
    assert len(l1) == len(l2) == 8 and l1[-1] < l1[0]
    for a, b in zip(l1 + v1, l2 + v2):
        assert abs(a - b) < 2e-5, (l1, l2)


def test_cpu_training_uses_gloo_on_a_gpu_machine(monkeypatch):
    """train.device = "cpu" under torchrun takes gloo even where CUDA exists (NCCL would bind each rank to a GPU
    the machine may not have: two CPU ranks on a one-GPU machine failed); a CUDA run takes NCCL."""
    import torch
    import torch.distributed as dist

    import train as train_mod
    calls = []
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend: calls.append(("init", backend)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert train_mod.setup_distributed("cpu") == (1, 1, 2) and calls == [("init", "gloo")]
    calls.clear()
    assert train_mod.setup_distributed("auto") == (1, 1, 2) and calls == [("set_device", 1), ("init", "nccl")]
