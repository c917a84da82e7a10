"""bench/profile_hopper_backward.py: --help, bad input as one line with exit 2, no sm_90 GPU as one line; on an
sm_90 GPU one call of each backward runs (what Nsight Compute profiles)."""
from __future__ import annotations

import pytest
import torch

from tests.util import run_entry

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def run(*args):
    return run_entry("bench/profile_hopper_backward.py", *args, timeout=300)


def test_help_and_bad_input():
    r = run("--help")
    assert r.returncode == 0 and "Nsight Compute" in r.stdout
    r = run("--shape", "1,2,3")
    assert r.returncode == 2 and "expected B,H,N,D" in r.stderr
    r = run("--shape", "1,2,128,80")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --shape 1,2,128,80: the Gluon backward takes head dims 64 and 128"
    r = run("--providers", "fa9")
    assert r.returncode == 2 and "invalid choice: 'fa9'" in r.stderr
    r = run("--form", "6")
    assert r.returncode == 2 and "invalid choice: 6" in r.stderr


@pytest.mark.skipif(SM90, reason="an sm_90 GPU is here: the backwards would run")
def test_without_an_sm90_gpu_one_line():
    r = run("--shape", "1,2,128,64")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: the Hopper backward needs an sm_90 GPU (none here)"


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", ["yes", "no"])
def test_each_backward_runs_once_on_the_gpu(causal):
    r = run("--shape", "1,2,300,128", "--causal", causal)
    assert r.returncode == 0, r.stderr
    form = 5 if causal == "yes" else 3  # kernels/flash/launch.py: hopper_bwd_form at head dim 128
    assert r.stdout.strip() == (f"profiled one backward each of split, fused, tl, cudnn at 1,2,300,128 "
                                f"causal={causal} (fused form {form})")
