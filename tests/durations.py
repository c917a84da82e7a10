"""Rebuild tests/gpu_durations.tsv (the GPU run's test order, tests/conftest.py) from a GPU run's --test-times file.

    python tests/durations.py runs/gpu_check/test_times.tsv          # after `bash bench/gpu_check.sh` on a GPU
    python tests/durations.py --unfinished runs/gpu_check/test_times.tsv   # the tests that never ended
    python tests/durations.py --ended 3863 runs/gpu_check/test_times.tsv   # the verdicts of a run of 3,863 tests

A test's seconds are the sum of its phases (setup, call, teardown). A test that started and never ended (still
running when the run was stopped) is given the longest time of the table, so that the next run starts it first.
Tests the run did not reach keep the seconds the table already holds for them; tests that no longer exist are
dropped.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
TABLE = os.path.join(HERE, "gpu_durations.tsv")
HEADER = ("# seconds per test on one GPU (setup + call + teardown, under pytest-xdist), from a --test-times file\n"
          "# (tests/durations.py); only the order of the GPU run uses it (tests/conftest.py: _longest_first)\n")


def _rows(path: str):
    """The lines of a --test-times file as [seconds, phase, outcome, worker, test id]; ValueError on a bad line."""
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 5:
                raise ValueError(f"{path}: line {n}: expected 5 tab-separated fields, found {len(parts)}")
            yield parts


def read_test_times(path: str) -> dict[str, float]:
    """{test id: seconds} summed over the phases of a --test-times file (seconds, phase, outcome, worker, id)."""
    total: dict[str, float] = defaultdict(float)
    for parts in _rows(path):
        total[parts[4]] += float(parts[0])
    return dict(total)


CRASHED = "???"  # the phase pytest-xdist reports for the test a worker was running when its process ended


def unfinished(path: str) -> list[str]:
    """The tests of a --test-times file that were set up but never torn down: still running (or hung) when the
    run was stopped, so they have no verdict (a test whose worker crashed has one: failed). In the order they
    started."""
    started, ended = [], set()
    for parts in _rows(path):
        if parts[1] == "setup":
            started.append(parts[4])
        elif parts[1] in ("teardown", CRASHED):
            ended.add(parts[4])
    return [t for t in started if t not in ended]


def verdicts(path: str) -> dict[str, str]:
    """{test id: "passed" | "skipped" | "failed"} of the tests of a --test-times file that ended (torn down, or
    crashed with their worker): failed where any phase failed or the worker crashed, else skipped where a phase
    was skipped, else passed."""
    phases: dict[str, set[str]] = defaultdict(set)
    ended = set()
    for parts in _rows(path):
        phases[parts[4]].add("failed" if parts[1] == CRASHED else parts[2])
        if parts[1] in ("teardown", CRASHED):
            ended.add(parts[4])
    return {t: next((v for v in ("failed", "skipped") if v in phases[t]), "passed") for t in ended}


def ended_summary(path: str, collected: int) -> tuple[bool, str]:
    """(whether all `collected` tests ended and none failed, one line saying how many of each verdict)."""
    counts = defaultdict(int)
    for v in verdicts(path).values():
        counts[v] += 1
    ended, hung = sum(counts.values()), unfinished(path)
    line = (f"{ended} of {collected} tests ended: {counts['passed']} passed, {counts['skipped']} skipped, "
            + (f"{counts['failed']} failed" if counts["failed"] else "none failed")
            + (f"; {len(hung)} never ended" if hung else ""))
    return ended == collected and not counts["failed"] and not hung, line


def read_table(path: str) -> dict[str, float]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [line.rstrip("\n").split("\t", 1) for line in f if line.strip() and not line.startswith("#")]
    return {test: float(s) for s, test in rows}


def merged(old: dict[str, float], new: dict[str, float], existing: set[str] | None) -> dict[str, float]:
    """`new` wins; `old` fills the tests the run did not reach; ids not in `existing` (when given) are dropped."""
    out = {**old, **new}
    return {t: s for t, s in out.items() if existing is None or t.split("::")[0] in existing}


def write_table(path: str, seconds: dict[str, float]) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".durations-")
    with os.fdopen(fd, "w") as f:
        f.write(HEADER)
        for test in sorted(seconds):
            f.write(f"{seconds[test]:.2f}\t{test}\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("times", help="a --test-times file from a GPU run")
    p.add_argument("--table", default=TABLE, help="the table to update (default tests/gpu_durations.tsv)")
    p.add_argument("--unfinished", action="store_true",
                   help="only list the tests that started and never ended (exit 1 if there are any); no table")
    p.add_argument("--ended", type=int, metavar="N",
                   help="only say how many of the run's N collected tests ended with each verdict (exit 1 unless "
                        "all N ended and none failed); no table")
    a = p.parse_args(argv)
    try:
        if a.ended is not None:
            complete, line = ended_summary(a.times, a.ended)
            print(line)
            return 0 if complete else 1
        hung = unfinished(a.times)
        if a.unfinished:
            print("\n".join(hung))
            return 1 if hung else 0
        new = read_test_times(a.times)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = os.path.dirname(HERE)
    files = {f"tests/{name}" for name in os.listdir(HERE) if name.startswith("test_") and name.endswith(".py")}
    table = merged(read_table(a.table), new, files)
    longest = max(table.values(), default=0.0)
    table.update({t: longest for t in hung if t in table})  # at least as long as any: first next time
    write_table(a.table, table)
    print(f"{a.table}: {len(table)} tests ({len(new)} from {os.path.relpath(a.times, root)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
