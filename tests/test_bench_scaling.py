"""bench/scaling.py --smoke: the scaling benchmark's whole path (torchrun through the c10d rendezvous, DDP and
FSDP2 with activation checkpointing, metrics, efficiency, report, merging of invocations) on CPU with gloo."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.util import ROOT, write_corpus


def run_bench(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_DATASETS_OFFLINE="1")
    env.pop("OUT", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "scaling.py"), "--smoke", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU gloo ranks: the CPU suite runs these")
def test_scaling_smoke_runs_every_case_and_merges_invocations(tmp_path):
    corpus = write_corpus(tmp_path)
    common = [f"--out={tmp_path}/out", f"--work={tmp_path}/work", f"--dataset={corpus}", "--steps=3"]
    r = run_bench(*common, "--cases=124m:ddp,1.5b:fsdp", "--gpus=1,2", "--launcher=c10d")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "scaling_smoke.json").read_text())
    rows = {(row["model"], row["mode"], row["gpus"]): row for row in results["rows"]}
    assert set(rows) == {("124m", "ddp", 1), ("124m", "ddp", 2), ("1.5b", "fsdp", 1), ("1.5b", "fsdp", 2)}
    for (model, mode, n), row in rows.items():
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and len(row["losses"]) == 3
        one_gpu = rows[(model, mode, 1)]["tokens_per_s"]
        assert row["efficiency"] == (1.0 if n == 1 else row["tokens_per_s"] / (2 * one_gpu))
        assert row["max_loss_gap"] < 1e-5  # the same global batch at every N: fp32 losses agree
        assert row["command"].startswith("NCCL_NVLS_ENABLE=0 python -m torch.distributed.run")
        assert "--nnodes=1:1 --rdzv_backend=c10d --rdzv_endpoint=localhost:" in row["command"]
        assert f"--parallel={mode}" in row["command"]
        assert ("--activation_checkpointing=true" in row["command"]) == (model == "1.5b")
    assert not os.listdir(tmp_path / "work")  # run folders removed after each run
    md = (tmp_path / "out" / "scaling_smoke.md").read_text()
    assert "| 1.5b:fsdp + act. ckpt | 2 |" in md and "bench/scaling.py --smoke" in md

    again = run_bench(*common, "--cases=124m:ddp", "--gpus=1")
    assert again.returncode == 0, again.stderr[-2000:]
    merged = json.loads((tmp_path / "out" / "scaling_smoke.json").read_text())
    keyed = {(row["model"], row["mode"], row["gpus"]): row["invocation"] for row in merged["rows"]}
    assert keyed == {("124m", "ddp", 1): 2, ("124m", "ddp", 2): 1, ("1.5b", "fsdp", 1): 1, ("1.5b", "fsdp", 2): 1}
    assert [inv["id"] for inv in merged["invocations"]] == [1, 2]
    assert "efficiency" not in next(r for r in merged["rows"] if r["gpus"] == 2 and r["model"] == "124m")


def test_scaling_rejects_bad_cases_and_needs_gpus_without_smoke():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "scaling.py"), "--cases=124m:zero"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "'124m:zero' is not MODEL:MODE" in r.stderr
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "scaling.py"), "--gpus=3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "3 does not divide --micro-batches=8" in r.stderr
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "scaling.py"), "--gpus=1"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "needs CUDA GPUs (use --smoke on CPU)" in r.stderr


def test_fsdp_host_times_both_models_and_refuses_bad_sizes(tmp_path, capsys):
    """bench/fsdp_host.py: clipping, the optimizer step (ours and torch's AdamW) and zero_grad timed for plain
    and FSDP2 parameters (the CPU here; the same code times a GPU's host), one row each; a bad size is one line
    and exit 2."""
    from bench import fsdp_host
    assert fsdp_host.main(["--layers", "2", "--repeat", "2", "--device", "cpu", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "fsdp_host.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| | clip"))
    assert [c.strip() for c in header.strip("|").split("|")[1:]] == [
        "clip", "torch clip", "optimizer step", "torch AdamW", "AdamW one tensor at a time", "zero_grad + restore"]
    rows = [line for line in text.splitlines() if line.startswith(("| plain |", "| FSDP2 |"))]
    assert len(rows) == 2
    for row in rows:
        values = [float(v) for v in row.strip("|").split("|")[1:]]
        assert len(values) == 6 and all(v > 0 for v in values)
    import torch.distributed as dist
    assert not dist.is_initialized()  # the one-rank group ended with the run
    capsys.readouterr()
    assert fsdp_host.main(["--width", "3", "--out", str(tmp_path)]) == 2
    assert "--width" in capsys.readouterr().err
