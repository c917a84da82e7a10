"""bench/decode_plan_diff.py: the plans its child records for this tree, and its refusals."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    return subprocess.run([sys.executable, "bench/decode_plan_diff.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))


def test_child_records_the_documented_plans():
    """GPT-2's shape on an H100/H200: batch 1 at 2,048 keys a short grid of 16 splits with the four-stage
    128-key tile and a merge launch; batch 16 the full grid's one split (192 programs, three stages, no merge);
    every case planned launches something."""
    r = _run("--child", ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    plans = json.loads(r.stdout.strip().splitlines()[-1])
    one = plans["H100/H200 B=1 Hq=12 Hkv=12 D=64 bfloat16 L=2048"]
    assert [launch[0] for launch in one] == ["_decode_split_kernel", "_decode_merge_kernel"], one
    assert one[0][1:] == [[16, 12, 1], 128, 4, 4], one
    full = plans["H100/H200 B=16 Hq=12 Hkv=12 D=64 bfloat16 L=4096"]
    assert full == [["_decode_split_kernel", [1, 192, 1], 128, 4, 3]], full
    assert len(plans) > 1000 and all(plans.values())


def test_help_and_bad_revisions():
    """--help exits 0; no --base, or one git does not know, is one error line and exit 2."""
    r = _run("--help")
    assert r.returncode == 0 and "--base" in r.stdout
    for args, why in [((), "--base REV is required"), (("--base", "no-such-revision"), "--base no-such-revision")]:
        r = _run(*args)
        assert r.returncode == 2 and r.stderr.count("error:") == 1 and why in r.stderr, r.stderr
