"""bench/hopper_backward.py on a machine without an sm_90 GPU: --help, and bad input or no GPU as one line with
exit 2 (the timing itself runs on the H200)."""
from __future__ import annotations

import pytest
import torch

from tests.util import run_entry


def run(*args):
    return run_entry("bench/hopper_backward.py", *args, timeout=120)


def test_help_and_bad_shapes():
    r = run("--help")
    assert r.returncode == 0 and "Gluon dK/dV" in r.stdout
    r = run("--shapes", "1,2,3")
    assert r.returncode == 2 and "expected B,H,N,D" in r.stderr
    r = run("--shapes", "1,2,0,64")
    assert r.returncode == 2 and "at least 1" in r.stderr
    r = run("--shapes", "1,2,128,128", "--stages", "5")
    assert r.returncode == 2 and r.stderr.strip() == "error: --stages 5: the ring holds 2 to 4 stages at head dim 128"
    r = run("--shapes", "1,2,128,128", "--stages", "4", "--fused", "5")
    assert r.returncode == 2 and r.stderr.strip().startswith(
        "error: --stages 4 at head dim 128: fused form 5's buffers do not fit in shared memory (")
    r = run("--rep", "0")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --rep 0")
    r = run("--tail-rounds", "-1")
    assert r.returncode == 2 and r.stderr.strip() == "error: --tail-rounds -1: must be 0 or more"
    assert "--tail-rounds" in run("--help").stdout and "--direct-launches" in run("--help").stdout
    r = run("--ahead", "on", "--fused", "3", "6", "4")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --ahead on does not run with --fused 4 6 (dQ one step behind)"


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9,
                    reason="an sm_90 GPU is here: the benchmark would run")
def test_without_an_sm90_gpu_one_line():
    r = run("--shapes", "1,2,128,64")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: the Hopper backward needs an sm_90 GPU (none here)"
