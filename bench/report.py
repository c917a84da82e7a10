"""What the benchmark scripts share: the commit they measured, their markdown report printed and written into the
results folder, and the parsing of an attention shape argument."""
from __future__ import annotations

import argparse
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    """The checkout's short commit, "+changes" when tracked files differ from it; "unknown" without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_report(out_dir: str, filename: str, lines: list[str]) -> str:
    """Print lines as one markdown text and write it to out_dir/filename (the folder made if needed)."""
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, filename), "w") as f:
        f.write(text)
    return text


def attention_shape(text: str) -> tuple[int, int, int, int]:
    """An argparse type: "B,H,N,D" as four integers of at least 1 (one line naming the problem otherwise)."""
    try:
        B, H, N, D = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected B,H,N,D (four integers)") from None
    if min(B, H, N, D) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: every size must be at least 1")
    return B, H, N, D
