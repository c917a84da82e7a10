"""bench/hopper_forward.py on a machine without an sm_90 GPU: --help, and bad input or no GPU as one line with
exit 2 (the timing itself runs on the H200)."""
from __future__ import annotations

import pytest
import torch

from tests.util import run_entry


def run(*args):
    return run_entry("bench/hopper_forward.py", *args, timeout=120)


def test_help_and_bad_arguments():
    r = run("--help")
    assert r.returncode == 0 and "causal tile orders" in " ".join(r.stdout.split()) and "--l2-mb" in r.stdout
    r = run("--shapes", "1,2,3")
    assert r.returncode == 2 and "expected B,H,N,D" in r.stderr
    r = run("--shapes", "1,2,0,64")
    assert r.returncode == 2 and "at least 1" in r.stderr
    r = run("--l2-mb", "lots")
    assert r.returncode == 2 and "expected a whole number of MB or 'all'" in r.stderr
    r = run("--l2-mb", "0")
    assert r.returncode == 2 and "must be at least 1" in r.stderr
    r = run("--rep", "0")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --rep 0")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0),
                    reason="an sm_90 GPU is here: the benchmark would run")
def test_without_an_sm90_gpu_one_line():
    r = run("--shapes", "1,2,128,64")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: the Gluon forward needs an sm_90 GPU (none here)"


def test_variants_per_mask(monkeypatch):
    """Without a causal mask the default and the other Q release run (one order; late below 4096 keys, early
    from there); causal: also each other budget
    and the strided order and every block per consumer; at head dim 64 the other consumer count."""
    from bench.hopper_forward import ALL, variants
    from kernels.flash_hopper.schedule import L2_BYTES
    assert variants(False, [24 << 20, ALL]) == {"lists": ({}, L2_BYTES),
                                                "early-q": ({"hopper_early_q": "on"}, L2_BYTES),
                                                "row-sums": ({"hopper_lane_sums": "off"}, L2_BYTES)}
    assert variants(False, [], N=2048)["late-q"] == ({"hopper_early_q": "off"}, L2_BYTES)
    assert variants(True, [24 << 20, L2_BYTES, ALL]) == {
        "lists": ({}, L2_BYTES), "lists@24": ({}, 24 << 20), "lists@all": ({}, ALL),
        "strided": ({"hopper_tile_lists": False}, L2_BYTES), "every": ({"hopper_own_blocks": False}, L2_BYTES),
        "late-q": ({"hopper_early_q": "off"}, L2_BYTES), "row-sums": ({"hopper_lane_sums": "off"}, L2_BYTES)}
    # head dim 64: the consumer count the default does not run (three without a causal mask under the Triton
    # measured, two with one)
    from kernels.flash_hopper import launch
    monkeypatch.setattr(launch.triton, "__version__", "3.6.0")
    assert variants(False, [], D=64)["c2"] == ({"hopper_consumers_d64": 2}, L2_BYTES)
    assert variants(True, [], D=64)["c3"] == ({"hopper_consumers_d64": 3}, L2_BYTES)
    assert variants(True, [], D=64)["c3-every"] == ({"hopper_consumers_d64": 3, "hopper_own_blocks": False}, L2_BYTES)
    assert "c2" not in variants(True, [], D=64) and "c3" not in variants(False, [], D=64)
    assert variants(True, [], D=64)["lane-sums"] == ({"hopper_lane_sums": "on"}, L2_BYTES)
    assert variants(True, [], D=64)["c3-lane-sums"] == ({"hopper_consumers_d64": 3, "hopper_lane_sums": "on"},
                                                        L2_BYTES)
    long = variants(True, [], D=64, N=launch.D64_CAUSAL_THREE_FROM_KEYS)  # default: three with lane sums
    assert long["c2"] == ({"hopper_consumers_d64": 2}, L2_BYTES) and "c3" not in long
    assert long["row-sums"] == ({"hopper_lane_sums": "off"}, L2_BYTES) and "lane-sums" not in long
    monkeypatch.setattr(launch.triton, "__version__", "3.9.0")  # two consumers by default: three is the other
    assert variants(False, [], D=64)["c3"] == ({"hopper_consumers_d64": 3}, L2_BYTES)
