"""bench/profile_decode_attention.py: --help, bad input as one line with exit 2, no GPU as one line; on a CUDA GPU
one call of each decode attention runs (what Nsight Compute profiles)."""
from __future__ import annotations

import pytest
import torch

from tests.util import run_entry

CUDA = torch.cuda.is_available()


def run(*args):
    return run_entry("bench/profile_decode_attention.py", *args, timeout=300)


def test_help_and_bad_input():
    r = run("--help")
    assert r.returncode == 0 and "Nsight Compute" in r.stdout
    r = run("--tile", "128:4")
    assert r.returncode == 2 and "expected BLOCK_N:WARPS:STAGES, got '128:4'" in r.stderr
    r = run("--len", "100", "--capacity", "64")
    assert r.returncode == 2 and "--len at most --capacity" in r.stderr
    r = run("--splits", "0")
    assert r.returncode == 2 and "must be positive" in r.stderr
    r = run("--key-parts", "3")
    assert r.returncode == 2 and "invalid choice: 3" in r.stderr


@pytest.mark.skipif(CUDA, reason="a CUDA GPU is here: the calls would run")
def test_without_a_gpu_one_line():
    r = run("--batch", "1", "--len", "64")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: profile_decode_attention.py needs a CUDA GPU"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_each_call_runs_once_on_the_gpu():
    r = run("--batch", "2", "--len", "300", "--capacity", "512", "--splits", "3", "--tile", "64:1:4",
            "--key-parts", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "profiled, in order: split, split-3, tile-64:1:4, parts-4, sdpa"
