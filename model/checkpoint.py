"""Checkpoints: written atomically, loaded without unpickling arbitrary objects.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts saved with torch.save and read back
with torch.load(weights_only=True). Writing goes to a temporary file in the same folder, fsync, then an
atomic rename: a crash or kill during the write leaves the previous checkpoint whole.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile

import torch

CKPT_PATTERN = re.compile(r"ckpt_(\d+)\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or not from this project."""


def atomic_save(obj, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def find_checkpoint(path: str, prefer: str = "latest") -> str:
    """A checkpoint file, or a run folder → its latest (or "best") checkpoint."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    best = os.path.join(path, "best.pt")
    numbered = sorted((int(m.group(1)), f) for f in glob.glob(os.path.join(path, "ckpt_*.pt"))
                      if (m := CKPT_PATTERN.search(f)))
    if prefer == "best" and os.path.isfile(best):
        return best
    if numbered:
        return numbered[-1][1]
    if os.path.isfile(best):
        return best
    raise CheckpointError(f"no checkpoint in run folder {path}")


def load_checkpoint(path: str, map_location="cpu", prefer: str = "latest") -> dict:
    """Load safely (weights_only=True). Raises CheckpointError with one line on any problem."""
    file = find_checkpoint(path, prefer)
    try:
        ckpt = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"corrupt or unreadable checkpoint {file} ({type(e).__name__})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise CheckpointError(f"{file} is not a flashgpt checkpoint (no model weights and config)")
    ckpt["path"] = file
    return ckpt


def save_run_checkpoint(ckpt: dict, out_dir: str, step: int, keep_last: int, is_best: bool) -> str:
    """Write ckpt_<step>.pt, refresh best.pt when is_best, keep only the last `keep_last` numbered ones."""
    path = os.path.join(out_dir, f"ckpt_{step:07d}.pt")
    atomic_save(ckpt, path)
    if is_best:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=out_dir)
        os.close(fd)
        shutil.copyfile(path, tmp)
        os.replace(tmp, os.path.join(out_dir, "best.pt"))
    numbered = sorted((int(m.group(1)), f) for f in glob.glob(os.path.join(out_dir, "ckpt_*.pt"))
                      if (m := CKPT_PATTERN.search(f)))
    for _, old in numbered[:-keep_last]:
        os.remove(old)
    return path
