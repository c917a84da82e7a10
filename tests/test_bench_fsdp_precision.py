"""bench/fsdp_precision.py: --help, bad input as one line with exit 2, and a tiny CPU run in which FSDP2 with
fp32 parameters trains exactly as the plain model and FSDP2 with bf16 block parameters does not."""
from __future__ import annotations

import json

from tests.util import run_entry


def run(*args):
    return run_entry("bench/fsdp_precision.py", *args, timeout=300)


def test_help_and_bad_input():
    r = run("--help")
    assert r.returncode == 0 and "FSDP2" in r.stdout
    for args, message in ((["--layers", "3"], "error: --layers 3: must be an even number >= 2"),
                          (["--steps", "0"], "error: --steps 0: must be at least 1"),
                          (["--width", "30"], "error: --width 30: must be a positive multiple of 4"),
                          (["--norm", "layernorm"], "error: --norm layernorm needs --device cuda")):
        r = run(*args)
        assert r.returncode == 2 and r.stderr.strip().startswith(message), (args, r.stderr)


def test_fp32_sharding_matches_plain_and_bf16_parameters_do_not(tmp_path):
    r = run("--steps", "3", "--layers", "2", "--width", "32", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.load(open(tmp_path / "fsdp_precision.json"))
    losses = data["losses"]
    assert set(losses) == {"plain", "fsdp-bf16", "fsdp-fp32"} and all(len(v) == 3 for v in losses.values())
    assert losses["fsdp-fp32"] == losses["plain"]  # sharding alone changes nothing, to the last bit
    assert losses["fsdp-bf16"] != losses["plain"]  # bf16 norm weights and biases do
    assert losses["plain"][-1] < losses["plain"][0]  # it learns
    assert "| fsdp-bf16 |" in (tmp_path / "fsdp_precision.md").read_text()
