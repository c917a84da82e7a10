"""The suite's own tools: --test-times (tests/conftest.py) writes each test phase's duration as it ends, and the
GPU acceptance script's dry run on a CPU (bench/gpu_check.sh with CHECK_ARGS) reports one verdict per step."""
import os
import subprocess
import sys

from tests.util import ROOT

FAST_TEST = "tests/test_bench_train.py::test_tiles_are_parsed_checked_and_listed_per_run"


def test_test_times_has_one_line_per_phase(tmp_path):
    path = tmp_path / "times.tsv"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", FAST_TEST,
                        "--test-times", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    assert [row[1:3] for row in rows] == [["setup", "passed"], ["call", "passed"], ["teardown", "passed"]]
    assert all(len(row) == 5 and row[4] == FAST_TEST and float(row[0]) >= 0 for row in rows)


def test_gpu_check_dry_run_reports_each_step(tmp_path):
    """One step of the acceptance script on the CPU: its PASS line, the summary, exit 0; a step whose command
    fails gives a FAIL line and a non-zero exit."""
    env = dict(os.environ, SKIP_TESTS="1", ONLY="^help_entry_points$", OUT=str(tmp_path / "ok"),
               PYTHON=sys.executable)
    r = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    summary = (tmp_path / "ok" / "gpu_check.log").read_text()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "PASS  help_entry_points" in summary and "ALL PASSED" in summary
    broken = tmp_path / "python-without-help"  # the same Python, except that every --help fails
    broken.write_text(f'#!/bin/sh\ncase "$*" in *--help*) echo "no help" >&2; exit 3;; esac\n'
                      f'exec {sys.executable} "$@"\n')
    broken.chmod(0o755)
    env.update(OUT=str(tmp_path / "bad"), PYTHON=str(broken))
    r = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    summary = (tmp_path / "bad" / "gpu_check.log").read_text()
    assert r.returncode != 0 and "FAIL  help_entry_points" in summary and "1 FAILED" in summary
