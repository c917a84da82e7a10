"""tests/mutants.py: every listed mutation site is found exactly once in the kernels as they are, a site that
is missing or ambiguous stops the check with one line, and (slow) the boundary sweep kills every mutant."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import mutants
from tests.util import ROOT


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_each_site_is_unique_and_the_mutation_changes_one_line(mutant, tmp_path):
    path, match = mutants.locate(mutant, ROOT)
    target = tmp_path / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(match.string, encoding="utf-8")
    where = mutants.apply(mutant, str(tmp_path))
    before = match.string.splitlines()
    after = target.read_text(encoding="utf-8").splitlines()
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert len(before) == len(after) and len(changed) == 1, changed
    line = changed[0]
    assert where == f"{path}:{line + 1}"
    assert before[line].replace(mutant.old, mutant.new, 1) == after[line]


def _kernel_file(tmp_path, name: str, text: str) -> None:
    (tmp_path / "kernels" / "sub").mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels" / name).write_text(text, encoding="utf-8")


def test_site_matching_ignores_layout_but_not_tokens(tmp_path):
    """Whitespace runs (indentation, line breaks) match any whitespace; a site inside a longer name does not."""
    _kernel_file(tmp_path, "sub/a.py",
                 "    if CAUSAL:\n            lo = (x - offset) // B\n    full_lo = (x - offset)\n")
    m = mutants.Mutant("t", "if CAUSAL: lo = (x - offset)", "x - offset", "x - offset + 1")
    path, match = mutants.locate(m, str(tmp_path))
    assert path == os.path.join("kernels", "sub", "a.py") and match.group(0).startswith("if CAUSAL:")
    assert mutants.locate(mutants.Mutant("t", "lo = (x - offset)", "x", "y"), str(tmp_path))[1].start() > 0


@pytest.mark.parametrize("text,expect", [
    ("a = start + 1\n", "matches 0 times"),
    ("a = start + offset + 1\nb = start + offset + 1\n", "matches 2 times"),
])
def test_missing_or_ambiguous_site_is_one_clear_error(tmp_path, text, expect):
    _kernel_file(tmp_path, "k.py", text)
    m = mutants.Mutant("t", "start + offset + 1", "+ 1", "+ 2")
    with pytest.raises(mutants.MutationError, match=expect):
        mutants.locate(m, str(tmp_path))


def test_old_text_must_occur_once_in_the_site(tmp_path):
    _kernel_file(tmp_path, "k.py", "a = (x + 1) + (x + 1)\n")
    with pytest.raises(mutants.MutationError, match="occurs 2 times"):
        mutants.locate(mutants.Mutant("t", "a = (x + 1) + (x + 1)", "x + 1", "x + 2"), str(tmp_path))


def test_unknown_mutant_name_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "tests.mutants", "--only", "no-such-mutant"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "no-such-mutant" in proc.stderr


@pytest.mark.slow
def test_the_boundary_sweep_kills_every_mutant():
    """The whole mutation check: the unmutated sweep passes and each mutant fails it."""
    proc = subprocess.run([sys.executable, "-m", "tests.mutants"], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"{len(mutants.MUTANTS)} killed, 0 survived, 0 errors" in proc.stdout
