"""The suite's own tools (tests/conftest.py): --test-times writes each test phase's duration as it ends,
--failure-log each failure's report, --gpu-memory each GPU test's peak of memory; a broken CUDA context stops its
process; and the GPU acceptance script's dry run on a CPU (bench/gpu_check.sh with CHECK_ARGS) reports one
verdict per step."""
import os
import subprocess
import sys

import pytest
import torch

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


def test_failure_log_keeps_each_failure_as_it_ends(tmp_path):
    """--failure-log appends a failed phase's id and traceback when it ends; a passing test writes nothing."""
    tests = tmp_path / "test_sample.py"
    tests.write_text("def test_ok():\n    assert True\n\n\ndef test_bad():\n    assert 1 + 1 == 3, 'arithmetic'\n")
    path = tmp_path / "failures.txt"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        "-c", os.devnull, "-p", "tests.conftest", str(tests), "--failure-log", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    text = path.read_text()
    assert text.count("=== ") == 1 and "test_sample.py::test_bad (call, worker -" in text
    assert "AssertionError: arithmetic" in text and "test_ok" not in text


def test_gpu_memory_log_has_each_gpu_test_peak(tmp_path):
    """--gpu-memory: a line per test that used the GPU (its peak of reserved memory, worker, id); a test that
    never touched the GPU (and every test on a CPU) writes none; the memory a test left cached is given back
    before the next test starts."""
    tests = tmp_path / "test_sample.py"
    tests.write_text("import torch\n\n\ndef test_cpu():\n    assert torch.ones(3).sum() == 3\n\n\n"
                     "def test_gpu():\n    if torch.cuda.is_available():\n"
                     "        x = torch.empty(3 << 29, dtype=torch.uint8, device='cuda')\n        del x\n"
                     "        assert torch.cuda.memory_reserved() >= 3 << 29\n\n\n"
                     "def test_after_it():  # the cache the test before left is back with the driver\n"
                     "    if torch.cuda.is_available():\n        assert torch.cuda.memory_reserved() <= 1 << 30\n")
    path = tmp_path / "memory.tsv"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        "-c", os.devnull, "-p", "tests.conftest", str(tests), "--gpu-memory", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    if not torch.cuda.is_available():
        assert rows == []
        return
    assert [row[2] for row in rows] == [f"{tests.name}::test_gpu", f"{tests.name}::test_after_it"], rows
    assert float(rows[0][0]) >= 1.5 and float(rows[1][0]) < 1.0, rows


BREAKS = ("import tests.conftest as c\n\n\ndef test_breaks():  # as if the GPU had faulted: a broken context\n"
          "    c._cuda_context_broken = lambda: 'simulated sticky error'\n\n\n"
          "def test_after():\n    assert c._cuda_context_broken.__name__ == '_cuda_context_broken'\n\n\n"
          "def test_third():\n    assert True\n")


def _run_sample(tmp_path, *args):
    tests = tmp_path / "test_sample.py"
    tests.write_text(BREAKS)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-c", os.devnull, "-p", "tests.conftest", str(tests), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_broken_cuda_context_replaces_the_worker(tmp_path):
    """A test after which the process's CUDA context is broken (simulated): its worker exits, the failure log
    names the test and the error, the test counts as crashed (failed, not unfinished) and a fresh worker runs
    the other tests, which pass."""
    log, times = tmp_path / "failures.txt", tmp_path / "times.tsv"
    r = _run_sample(tmp_path, "-n", "1", "--failure-log", str(log), "--test-times", str(times))
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "crashed while running 'test_sample.py::test_breaks'" in out, out[-3000:]
    rows = [row.split("\t") for row in times.read_text().splitlines()]
    passed = {row[4] for row in rows if row[1:3] == ["call", "passed"]}
    assert {"test_sample.py::test_after", "test_sample.py::test_third"} <= passed, times.read_text()
    assert "test_sample.py::test_breaks (CUDA context broken, worker gw0" in log.read_text()
    assert "simulated sticky error" in log.read_text()
    from tests import durations
    assert durations.unfinished(str(times)) == []


def test_broken_cuda_context_ends_a_plain_run(tmp_path):
    """Without workers the run ends at once with one line naming the test and the error, exit code 3."""
    r = _run_sample(tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 3, out[-3000:]
    assert "CUDA context broken after test_sample.py::test_breaks: simulated sticky error" in out
    assert "test_after" not in out and "1 passed" in out


def _dry_run(tmp_path, name: str, python: str, step: str = "help_entry_points"):
    """bench/gpu_check.sh's step `step` alone (help_entry_points, or gpu_test_suite), run by `python`, its logs
    under tmp_path / name: (the completed process, the summary log's text)."""
    env = dict(os.environ, ONLY=f"^{step}$", OUT=str(tmp_path / name), PYTHON=python)
    if step != "gpu_test_suite":
        env["SKIP_TESTS"] = "1"
    r = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    return r, (tmp_path / name / "gpu_check.log").read_text()


def _python_wrapper(path, case_line: str):
    """An executable at path that runs this Python, except where its arguments match case_line's sh case."""
    path.write_text(f'#!/bin/sh\ncase "$*" in {case_line} esac\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


def test_gpu_check_dry_run_reports_each_step(tmp_path):
    """One step of the acceptance script on the CPU: its PASS line, the summary, exit 0; a step whose command
    fails gives a FAIL line and a non-zero exit; a step that fails for want of GPU memory runs again alone once
    and says so."""
    r, summary = _dry_run(tmp_path, "ok", sys.executable)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "PASS  help_entry_points" in summary and "ALL PASSED" in summary
    # the same Python, except that every --help fails
    broken = _python_wrapper(tmp_path / "python-without-help", '*--help*) echo "no help" >&2; exit 3;;')
    r, summary = _dry_run(tmp_path, "bad", broken)
    assert r.returncode != 0 and "FAIL  help_entry_points" in summary and "1 FAILED" in summary
    # a step that ran out of GPU memory beside the others runs again alone: here its first --help does
    marker = tmp_path / "ran-out-once"
    oom = _python_wrapper(tmp_path / "python-out-of-memory-once",
                          f'*--help*) if [ ! -e {marker} ]; then touch {marker}; echo "torch.OutOfMemoryError: '
                          'CUDA out of memory. Tried to allocate 2.00 GiB" >&2; exit 1; fi;;')
    r, summary = _dry_run(tmp_path, "oom", oom)
    assert r.returncode == 0 and marker.exists(), r.stdout[-2000:] + r.stderr[-2000:]
    assert "PASS  help_entry_points" in summary and "run again alone: out of GPU memory" in summary
    assert "ALL PASSED" in summary


def test_gpu_check_rerun_after_out_of_memory_starts_from_a_clean_run_folder(tmp_path):
    """A train-then-generate step whose first attempt wrote a checkpoint and then ran out of memory runs again
    without that checkpoint in its --out_dir (train.py refuses a folder that holds one)."""
    marker = tmp_path / "ran-out-once"
    fake = _python_wrapper(
        tmp_path / "python-fake-train",
        '*train.py*) d=$(echo "$*" | sed -n "s/.*--out_dir=\\([^ ]*\\).*/\\1/p"); '
        'if [ -e "$d/ckpt_0000001.pt" ]; then echo "error: run directory $d already holds checkpoints"; exit 1; fi; '
        'mkdir -p "$d"; touch "$d/ckpt_0000001.pt"; '
        f'if [ ! -e {marker} ]; then touch {marker}; echo "torch.AcceleratorError: CUDA error: out of memory"; '
        'exit 1; fi; echo "done: 1 steps"; exit 0;; '
        '*generate.py*) echo "ROMEO: a sample of generated text"; echo "[48 new] decode 100 tok/s"; exit 0;;')
    r, summary = _dry_run(tmp_path, "oom_run", fake, step="llama_train_and_generate")
    assert marker.exists(), r.stdout[-2000:] + r.stderr[-2000:]
    assert r.returncode == 0 and "PASS  llama_train_and_generate" in summary, summary
    assert "run again alone: out of GPU memory" in summary and "ALL PASSED" in summary


def test_gpu_check_suite_stopped_before_its_summary_says_the_verdicts(tmp_path):
    """The acceptance script's test-suite step, its pytest stopped (exit 130) after the last test ended but
    before its summary line: the step still fails, and its log ends with the verdicts of the test times against
    the count collected; a run that ends normally is left as pytest printed it."""
    times = tmp_path / "stopped" / "test_times.tsv"
    lines = "".join(f"0.1\t{phase}\t{outcome}\tgw0\ttests/a.py::{t}\\n"
                    for t, outcome in (("ok", "passed"), ("skip", "skipped"))
                    for phase in ("setup", "teardown"))
    stopped = _python_wrapper(tmp_path / "python-stopped",
                              f'*"-m pytest"*) printf "16 workers [2 items]\\n" ; printf "{lines}" >> {times}; '
                              'echo "Traceback (most recent call last):"; exit 130;;')
    r, summary = _dry_run(tmp_path, "stopped", stopped, step="gpu_test_suite")
    assert r.returncode != 0 and "FAIL  gpu_test_suite" in summary and "exit 130" in summary, summary
    assert summary.rstrip().splitlines()[-2].strip() == (
        "== pytest stopped (exit 130) before its summary: 2 of 2 tests ended: 1 passed, 1 skipped, none failed")
    finished = _python_wrapper(tmp_path / "python-finished",
                               '*"-m pytest"*) printf "16 workers [2 items]\\n'
                               '=== 1 passed, 1 skipped in 1.00s ===\\n"; '
                               f'mkdir -p {tmp_path / "finished"}; '
                               f'printf "{lines}" >> {tmp_path / "finished" / "test_times.tsv"}; exit 0;;')
    r, summary = _dry_run(tmp_path, "finished", finished, step="gpu_test_suite")
    assert r.returncode == 0 and "PASS  gpu_test_suite" in summary and "stopped" not in summary, summary


def test_ended_counts_each_verdict_of_the_test_times(tmp_path):
    """tests/durations.py --ended N: the ended tests' verdicts (a failed or crashed phase: failed; a skipped
    one: skipped), exit 0 only when all N ended and none failed; 2 on a bad file."""
    times = tmp_path / "times.tsv"
    rows = [("setup", "passed", "ok"), ("call", "passed", "ok"), ("teardown", "passed", "ok"),
            ("setup", "skipped", "skip"), ("teardown", "passed", "skip"),
            ("setup", "passed", "bad"), ("call", "failed", "bad"), ("teardown", "passed", "bad"),
            ("setup", "passed", "crash"), ("???", "failed", "crash"), ("setup", "passed", "hung")]
    times.write_text("".join(f"0.1\t{w}\t{o}\tgw0\ttests/a.py::{t}\n" for w, o, t in rows))

    def ended(path, n):
        return subprocess.run([sys.executable, "tests/durations.py", "--ended", str(n), str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    r = ended(times, 5)
    assert r.returncode == 1 and r.stdout.strip() == (
        "4 of 5 tests ended: 1 passed, 1 skipped, 2 failed; 1 never ended")
    times.write_text("".join(f"0.1\t{w}\t{o}\tgw0\ttests/a.py::{t}\n" for w, o, t in rows[:5]))
    assert ended(times, 2).returncode == 0 and ended(times, 3).returncode == 1
    assert ended(times, 2).stdout.strip() == "2 of 2 tests ended: 1 passed, 1 skipped, none failed"
    times.write_text("0.1\tsetup\n")
    r = ended(times, 1)
    assert r.returncode == 2 and r.stderr.count("error:") == 1


def test_longest_first_orders_by_the_table_and_keeps_every_test(tmp_path):
    """The GPU run's order: longest first by the table; an unlisted test counts as the median; ties keep the
    collected order; nothing is dropped; without a table the order stays as collected."""
    from tests.conftest import _longest_first

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    table = tmp_path / "durations.tsv"
    table.write_text("# a comment line\n1.0\tt::a\n30.0\tt::b\n5.0\tt::c\n2.0\tt::d\n")
    items = [Item(n) for n in ("t::a", "t::new1", "t::b", "t::c", "t::d", "t::new2")]
    _longest_first(items, str(table))
    # median of (1, 2, 5, 30) by index len//2 of the sorted values is 5.0: unlisted tests tie with t::c
    assert [i.nodeid for i in items] == ["t::b", "t::new1", "t::c", "t::new2", "t::d", "t::a"]
    collected = [Item(n) for n in ("x::1", "x::2")]
    _longest_first(collected, str(tmp_path / "missing.tsv"))
    assert [i.nodeid for i in collected] == ["x::1", "x::2"]


def test_durations_table_is_rebuilt_from_test_times(tmp_path):
    """tests/durations.py sums each test's phases, keeps the old seconds of tests the run did not reach, drops
    tests whose file is gone, gives a test that started and never ended the table's longest time (first in the
    next run), and refuses a malformed line with one error line."""
    times = tmp_path / "times.tsv"
    times.write_text("1.5\tsetup\tpassed\tgw0\ttests/test_config.py::t1\n"
                     "2.0\tcall\tpassed\tgw0\ttests/test_config.py::t1\n"
                     "0.5\tteardown\tpassed\tgw0\ttests/test_config.py::t1\n")
    table = tmp_path / "table.tsv"
    table.write_text("9.00\ttests/test_config.py::t1\n7.00\ttests/test_config.py::t2\n3.00\ttests/test_gone.py::t\n")
    r = subprocess.run([sys.executable, "tests/durations.py", str(times), "--table", str(table)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [line.split("\t") for line in table.read_text().splitlines() if not line.startswith("#")]
    assert rows == [["4.00", "tests/test_config.py::t1"], ["7.00", "tests/test_config.py::t2"]]
    times.write_text("1.0\tsetup\tpassed\tgw0\ttests/test_config.py::t1\n")  # started, never ended
    r = subprocess.run([sys.executable, "tests/durations.py", str(times), "--table", str(table)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [line.split("\t") for line in table.read_text().splitlines() if not line.startswith("#")]
    assert rows == [["7.00", "tests/test_config.py::t1"], ["7.00", "tests/test_config.py::t2"]]
    times.write_text("1.0\tcall\n")
    r = subprocess.run([sys.executable, "tests/durations.py", str(times), "--table", str(table)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and "line 1" in r.stderr


def test_unfinished_lists_the_tests_that_started_and_never_ended(tmp_path):
    """tests/durations.py --unfinished: the tests with a setup line and no teardown line (running or hung when
    the run was stopped), in the order they started; exit 1 when there are any, 0 when none, 2 on a bad file."""
    times = tmp_path / "times.tsv"
    lines = ["0.1\tsetup\tpassed\tgw0\ttests/a.py::done", "0.1\tsetup\tpassed\tgw1\ttests/a.py::hung[2]",
             "1.0\tcall\tpassed\tgw0\ttests/a.py::done", "0.1\tsetup\tskipped\tgw0\ttests/a.py::skipped",
             "0.0\tteardown\tpassed\tgw0\ttests/a.py::skipped", "0.0\tteardown\tpassed\tgw0\ttests/a.py::done",
             "0.1\tsetup\tpassed\tgw0\ttests/a.py::hung[1]"]
    times.write_text("\n".join(lines) + "\n")

    def unfinished(path):
        return subprocess.run([sys.executable, "tests/durations.py", "--unfinished", str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    r = unfinished(times)
    assert r.returncode == 1 and r.stdout.split() == ["tests/a.py::hung[2]", "tests/a.py::hung[1]"]
    times.write_text("\n".join(lines[:6]) + "\n0.0\tteardown\tpassed\tgw1\ttests/a.py::hung[2]\n")
    r = unfinished(times)
    assert r.returncode == 0 and r.stdout.strip() == ""
    times.write_text("0.1\tsetup\n")
    r = unfinished(times)
    assert r.returncode == 2 and r.stderr.count("error:") == 1
    assert unfinished(tmp_path / "missing.tsv").returncode == 2


@pytest.mark.parametrize("module", ["tests.test_kernels_compile", "tests.test_flash_hopper_backward",
                                    "tests.test_flash_hopper_compile"])
def test_compile_children_refuse_an_unknown_part(module):
    """The compile checks' children (tests/util.py: compiled_records) take one of their module's PARTS or none;
    anything else is one usage line naming the parts and a non-zero exit, before anything compiles."""
    import importlib
    parts = importlib.import_module(module).PARTS
    proc = subprocess.run([sys.executable, "-m", module, "no_such_part"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert proc.returncode != 0 and not proc.stdout
    assert proc.stderr.strip() == f"usage: python -m {module} [{' | '.join(parts)}]", proc.stderr


def test_compiled_records_joins_the_parts_and_names_a_failing_one(tmp_path, monkeypatch):
    """compiled_records runs one child per part at once and joins their records in the order of the parts; a
    child that fails is reported with its part and its stderr."""
    from tests import util
    pkg = tmp_path / "fake_children"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "child.py").write_text(
        "import json, sys\n"
        "part = sys.argv[1]\n"
        "if part == 'bad':\n"
        "    sys.exit('no compiler for ' + part)\n"
        "json.dump([dict(part=part, ptx_entry=True, cubin_bytes=1)], sys.stdout)\n")
    monkeypatch.setattr(util, "ROOT", str(tmp_path))
    records = util.compiled_records("fake_children.child", tmp_path, ("a", "b", "c"))
    assert [r["part"] for r in records] == ["a", "b", "c"]
    (tmp_path / "again").mkdir()
    with pytest.raises(AssertionError, match="fake_children.child bad: no compiler for bad"):
        util.compiled_records("fake_children.child", tmp_path / "again", ("a", "bad"))
