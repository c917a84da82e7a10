"""The frame of the tools that compare this tree with another revision of the repository: `--base REV`, each
tree's result from a child process of the tool run in that tree (`--child TREE`, printing one JSON line), and
one error line with exit 2 for a missing or unknown revision. Used by bench/decode_ptx_diff.py and
bench/decode_plan_diff.py."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def extract_revision(rev: str, tmp: str) -> str | None:
    """`git archive rev` of this repository extracted under tmp: the tree's path, or None after one error line."""
    archive = os.path.join(tmp, "base.tar")
    with open(archive, "wb") as f:
        r = subprocess.run(["git", "archive", rev], cwd=ROOT, stdout=f, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        why = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "git archive failed"
        print(f"error: --base {rev}: {why}", file=sys.stderr)
        return None
    tree = os.path.join(tmp, "base")
    with tarfile.open(archive) as t:
        t.extractall(tree, filter="data")
    return tree


def child_result(tool: str, tree: str, env: dict, what: str) -> dict:
    """The JSON line that `tool --child tree`, run in tree with env added, prints last; `what` names the work in
    the error if the child fails."""
    r = subprocess.run([sys.executable, tool, "--child", tree], cwd=tree, env=dict(os.environ, **env),
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: {what} in {tree} failed: {(r.stderr.strip() or 'no output')[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def compare_main(argv: list[str] | None, doc: str, child: Callable[[str], None],
                 result: Callable[[str], dict], report: Callable[[str, dict, dict], int]) -> int:
    """Parse --base/--child; as a child run child(tree); else report(rev, base's result, this tree's result)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--base", help="the git revision to compare against (required)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child)
        return 0
    if not a.base:
        print("error: --base REV is required", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tree-compare-") as tmp:
        base_tree = extract_revision(a.base, tmp)
        if base_tree is None:
            return 2
        base, head = result(base_tree), result(ROOT)
    return report(a.base, base, head)
