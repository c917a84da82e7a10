"""Mutation check of the attention kernels' causal bounds: each listed off-by-one must fail the boundary sweep.

    python -m tests.mutants                 # every mutant against tests/test_flash_boundaries.py (default run)
    python -m tests.mutants --only dkdv-lo+1 fwd-full-hi+1
    python -m tests.mutants --list          # the mutants and where each one applies, nothing run
    python -m tests.mutants --slow          # the sweep's exhaustive `slow` tests as well (much longer)
    python -m tests.mutants --tests tests/test_flash_attention.py   # another test selection instead

Run from the repository root. First the unmutated repository must pass the tests (else exit 2: nothing could be
judged). Then, per mutant, the repository (git's tracked files and untracked, not ignored ones) is copied to a
temporary folder, the mutation is applied there, and pytest runs the tests in a subprocess (stopping at the first
failure). Each mutant is reported as "killed" (the tests failed, or ran past --timeout) or "SURVIVED" (they
passed); exit 1 if any survived, 2 on a mutant that cannot be applied or a run that errored.

Locating a mutation: `site` is a snippet of kernel source searched in every file matching `files` (default
kernels/**/*.py, so a kernel moved into a package is still found), whitespace-insensitively (a run of blanks or
newlines matches any run) and as whole tokens; it must match exactly once in all those files together, else
the check stops with one line saying so. Inside the matched text, `old` must occur exactly once; it is replaced
by `new`.

Time: one run of the sweep per mutant plus the baseline, each a subprocess; through Triton's interpreter on one
CPU core the baseline takes about as long as `pytest tests/test_flash_boundaries.py` (tens of seconds) and a
killed mutant stops at its first failing case, usually sooner. --jobs N runs N mutants at once.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TESTS = ("tests/test_flash_boundaries.py",)


@dataclass(frozen=True)
class Mutant:
    name: str
    site: str  # a snippet that occurs exactly once in `files` (whitespace-insensitive)
    old: str   # occurs exactly once inside the matched site
    new: str
    files: str = "kernels/**/*.py"


MUTANTS = [
    # forward and dQ (one helper, _key_blocks): key blocks below full_hi are streamed without a mask; +2 lets one
    # block that the tile's first row must see only in part through unmasked when start_m + offset + 2 is a
    # multiple of BLOCK_N
    Mutant("fwd-full-hi+1",
           "full_hi = tl.minimum((tl.maximum(start_m + offset + 1, 0) // BLOCK_N) * BLOCK_N, n_full)",
           "start_m + offset + 1", "start_m + offset + 2"),
    # dK/dV: query blocks from lo on are visited; +1 skips the block holding query start_n - offset (the first
    # query that sees this key tile) when that query is the last row of its block
    Mutant("dkdv-lo+1",
           "lo = (tl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M",
           "start_n - offset", "start_n - offset + 1"),
    # forward and dQ: hi is one past the last key the tile's last row sees; -1 drops a block that holds only it
    Mutant("fwd-hi-1",
           "hi = tl.minimum(tl.maximum(start_m + BLOCK_M + offset, 0), Nk)  # past the last row's last key",
           "start_m + BLOCK_M + offset", "start_m + BLOCK_M + offset - 1"),
    # dK/dV: query blocks from full_lo on are visited without a mask; -1 lets one block in whose first row does
    # not see the tile's last key
    Mutant("dkdv-full-lo-1",
           "full_lo = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - offset, 0), BLOCK_M)",
           "start_n + BLOCK_N - 1 - offset", "start_n + BLOCK_N - 2 - offset"),
]


class MutationError(Exception):
    """A mutant that cannot be applied (its site is missing or not unique, or `old` is not in it once)."""


def _site_pattern(site: str) -> re.Pattern:
    """The site as a regex: literal text, any whitespace run matching any whitespace run, whole tokens only."""
    body = r"\s+".join(re.escape(part) for part in site.split())
    head = r"(?<![\w.])" if re.match(r"\w", site.strip()) else ""
    tail = r"(?!\w)" if re.search(r"\w$", site.strip()) else ""
    return re.compile(head + body + tail)


def locate(mutant: Mutant, root: str) -> tuple[str, re.Match]:
    """(path relative to root, match) of the mutant's one site. Raises MutationError unless it is unique."""
    pattern = _site_pattern(mutant.site)
    hits = []
    for path in sorted(glob.glob(os.path.join(root, mutant.files), recursive=True)):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        hits += [(os.path.relpath(path, root), m) for m in pattern.finditer(text)]
    if len(hits) != 1:
        where = ", ".join(f"{p}:{m.string.count(chr(10), 0, m.start()) + 1}" for p, m in hits) or "nowhere"
        raise MutationError(f"mutant {mutant.name}: its site matches {len(hits)} times in {mutant.files} "
                            f"(expected exactly once; found {where}): {mutant.site!r}")
    path, match = hits[0]
    if match.group(0).count(mutant.old) != 1:
        raise MutationError(f"mutant {mutant.name}: {mutant.old!r} occurs {match.group(0).count(mutant.old)} "
                            f"times in its site {path} (expected once)")
    return path, match


def line_of(match: re.Match, old: str) -> int:
    """The line number of `old` inside the matched site."""
    return match.string.count("\n", 0, match.start() + match.group(0).index(old)) + 1


def apply(mutant: Mutant, root: str) -> str:
    """Apply the mutant to the files under root (in place). Returns "path:line" of the change."""
    path, match = locate(mutant, root)
    text = match.string
    mutated = text[:match.start()] + match.group(0).replace(mutant.old, mutant.new) + text[match.end():]
    with open(os.path.join(root, path), "w", encoding="utf-8") as f:
        f.write(mutated)
    return f"{path}:{line_of(match, mutant.old)}"


def copy_repository(dest: str) -> None:
    """Copy git's tracked and untracked-but-not-ignored files of ROOT into dest (no .git, no venv, no caches)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):  # a tracked file deleted in the work tree is skipped
            os.makedirs(os.path.dirname(os.path.join(dest, rel)) or dest, exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def run_tests(root: str, tests: list[str], slow: bool, timeout: float) -> tuple[str, float, str]:
    """Run pytest on `tests` inside root. Returns (outcome, seconds, first failing test or a note): outcome is
    "passed", "failed", "timeout" or "error" (pytest could not run the tests: exit status other than 0 and 1)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    if slow:
        cmd += ["-m", "slow or not slow"]
    env = dict(os.environ, PYTHONPATH=root + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
               PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, f"ran past {timeout:.0f} s"
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "passed", seconds, ""
    if proc.returncode == 1:
        failed = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("FAILED ")]
        return "failed", seconds, failed[0] if failed else "tests failed"
    tail = [line for line in out.strip().splitlines() if line.strip()][-1:] or ["no output"]
    return "error", seconds, f"pytest exit status {proc.returncode}: {tail[0]}"


def _run_mutant(mutant: Mutant, tests: list[str], slow: bool, timeout: float) -> tuple[str, str, float, str]:
    """(verdict, where, seconds, note) of one mutant, in its own copy of the repository."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        copy_repository(tmp)
        where = apply(mutant, tmp)
        outcome, seconds, note = run_tests(tmp, tests, slow, timeout)
    verdict = {"failed": "killed", "timeout": "killed", "passed": "SURVIVED"}.get(outcome, "ERROR")
    return verdict, where, seconds, note


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and their sites, run nothing")
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS), help="pytest arguments: what to run")
    parser.add_argument("--slow", action="store_true", help="include the tests marked slow")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per test run (default 1800)")
    args = parser.parse_args(argv)

    by_name = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.only or [] if n not in by_name]
    if unknown:
        print(f"error: unknown mutant(s) {', '.join(unknown)}; known: {', '.join(by_name)}", file=sys.stderr)
        return 2
    if args.jobs < 1 or args.timeout <= 0:
        print("error: --jobs must be >= 1 and --timeout > 0", file=sys.stderr)
        return 2
    mutants = [by_name[n] for n in args.only] if args.only else MUTANTS
    try:
        sites = {m.name: locate(m, ROOT) for m in mutants}  # every site is checked before anything runs
    except MutationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    width = max(len(m.name) for m in mutants)
    if args.list:
        for m in mutants:
            path, match = sites[m.name]
            print(f"{m.name:<{width}}  {path}:{line_of(match, m.old)}  {m.old!r} -> {m.new!r}")
        return 0

    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as tmp:
        copy_repository(tmp)
        outcome, seconds, note = run_tests(tmp, args.tests, args.slow, args.timeout)
    print(f"{'baseline':<{width}}  unmutated  {outcome} in {seconds:.0f} s  {note}".rstrip(), flush=True)
    if outcome != "passed":
        print("error: the unmutated repository does not pass the tests; no mutant can be judged", file=sys.stderr)
        return 2

    verdicts = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(_run_mutant, m, args.tests, args.slow, args.timeout) for m in mutants]
        for m, future in zip(mutants, futures):
            verdict, where, seconds, note = future.result()
            verdicts.append(verdict)
            print(f"{m.name:<{width}}  {where}  {verdict} in {seconds:.0f} s  {note}".rstrip(), flush=True)
    survived = verdicts.count("SURVIVED")
    errors = verdicts.count("ERROR")
    print(f"{len(verdicts) - survived - errors} killed, {survived} survived, {errors} errors")
    return 2 if errors else (1 if survived else 0)


if __name__ == "__main__":
    sys.exit(main())
