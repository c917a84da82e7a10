"""Checkpoint files on disk, written and read safely: the names in a run folder, atomic writes (a temporary
file, fsync, rename), hard links or copies, removal of folders and of what an interrupted write left, and the
weights-only reader. Both checkpoint formats build on these: one file (model/checkpoint.py) and a sharded
folder (model/sharded_checkpoint.py).
"""
from __future__ import annotations

import contextlib
import glob
import os
import pickle
import re
import secrets
import shutil
import tempfile

import torch

CKPT_PATTERN = re.compile(r"ckpt_(\d+)\.pt$")
CKPT_DIR_PATTERN = re.compile(r"ckpt_(\d+)")   # a sharded checkpoint folder (full match)
BEST_DIR_PATTERN = re.compile(r"best_(\d+)")   # a sharded run's best checkpoint, a folder
TEMP_PREFIX, TEMP_SUFFIX = ".tmp-", ".pt"  # every temporary file of a checkpoint write: .tmp-*.pt
SHARDED_META = "flashgpt.json"  # what makes a folder a whole sharded checkpoint (see model/sharded_checkpoint.py)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, damaged, unsafe or not from this project."""


def remove_quietly(path: str) -> None:
    """Remove a temporary file while another error is being raised: a failure here must not hide that one."""
    try:
        os.remove(path)
    except OSError:
        pass


def fsync_dir(folder: str) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_save(obj, path: str) -> None:
    """torch.save `obj` to `path` through a temporary file and a rename; the temporary file never stays."""
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=os.path.dirname(os.path.abspath(path)))
    with _replacing(tmp, path):
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def _replacing(tmp: str, dst: str):
    """The block writes `tmp`; then it replaces `dst` (a rename) and the folder is synced. On any error the
    temporary file is removed and `dst` is left as it was."""
    try:
        yield
        os.replace(tmp, dst)
        fsync_dir(os.path.dirname(os.path.abspath(dst)))
    except BaseException:
        if os.path.exists(tmp):
            remove_quietly(tmp)
        raise


def numbered_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the run folder's ckpt_<step>.pt files and ckpt_<step>/ folders, by step."""
    found = []
    for entry in os.scandir(out_dir):
        m = CKPT_PATTERN.fullmatch(entry.name) if entry.is_file() else CKPT_DIR_PATTERN.fullmatch(entry.name)
        if m and (entry.is_file() or entry.is_dir()):
            found.append((int(m.group(1)), entry.path))
    return sorted(found)


def best_folders(out_dir: str) -> list[str]:
    """The best_<step>/ folders of a sharded run, by step."""
    found = []
    for entry in os.scandir(out_dir):
        m = BEST_DIR_PATTERN.fullmatch(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry.path))
    return [path for _, path in sorted(found)]


# What torch's weights-only unpickler says when a pickle asks for a class or function it does not allow (as
# opposed to bytes it cannot parse, which a truncated or foreign file gives).
UNSAFE_PICKLE = re.compile(r"GLOBAL|Can only (create new object|build)|call reduce")


def _refused(file: str, error: pickle.UnpicklingError) -> CheckpointError:
    named = re.search(r"GLOBAL ([\w.]+)", str(error))
    return CheckpointError(f"refusing to unpickle: {file} contains objects other than tensors/containers"
                           + (f" ({named.group(1)})" if named else "") + "; not loaded")


def read_torch_file(file: str, map_location="cpu"):
    """torch.load(weights_only=True) of one file; CheckpointError (one line) when unreadable or unsafe."""
    try:
        f = open(file, "rb")
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {file} ({e.strerror or e})") from None
    try:
        with f:
            return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if UNSAFE_PICKLE.search(str(e)):
            raise _refused(file, e) from None
        raise CheckpointError(f"corrupt or truncated checkpoint {file} (not a readable torch file)") from None
    except Exception as e:  # a truncated zip archive gives RuntimeError, EOFError or even OSError(EINVAL)
        raise CheckpointError(f"corrupt or truncated checkpoint {file} ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:120]})") from None


def link_or_copy(src: str, dst: str) -> None:
    """Make `dst` a file with `src`'s content, atomically: a hard link where the file system allows one (no
    extra disk space; the files are only ever replaced, never written in place), else a copy. On any error
    the temporary file is removed and `dst` is left as it was."""
    tmp = os.path.join(os.path.dirname(os.path.abspath(dst)), f"{TEMP_PREFIX}{secrets.token_hex(8)}{TEMP_SUFFIX}")
    with _replacing(tmp, dst):
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())


def prune(out_dir: str, keep_last: int) -> None:
    """Remove all but the last `keep_last` numbered checkpoints, files and folders alike."""
    for _, old in numbered_checkpoints(out_dir)[:-keep_last]:
        if os.path.isdir(old):
            remove_tree(old)
        else:
            os.remove(old)


def remove_stale_temp_files(folder: str) -> list[str]:
    """Remove the temporary files (`.tmp-*.pt`) that an interrupted write of this module left in `folder`;
    return their paths. Only safe while no other process writes checkpoints into `folder` (hold its lock)."""
    removed = []
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), f"{TEMP_PREFIX}*{TEMP_SUFFIX}"))):
        if os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)
            removed.append(path)
    return removed


def remove_tree(path: str) -> None:
    """Remove a checkpoint folder: first renamed to a temporary name (one atomic step, after which no reader
    takes it for a checkpoint), then deleted; a crash in between leaves a temporary folder, removed at the next
    start (remove_stale_temp_dirs)."""
    parent = os.path.dirname(os.path.abspath(path))
    doomed = os.path.join(parent, f"{TEMP_PREFIX}removed-{secrets.token_hex(6)}")
    os.rename(path, doomed)
    fsync_dir(parent)
    shutil.rmtree(doomed)


def remove_stale_temp_dirs(folder: str) -> tuple[int, int]:
    """Remove the temporary folders (`.tmp-*/`) that an interrupted sharded checkpoint write or removal left in
    `folder`; returns (how many, their total bytes). Only while no writer works in `folder` (hold its lock)."""
    count = size = 0
    for entry in os.scandir(folder):
        if entry.name.startswith(TEMP_PREFIX) and entry.is_dir(follow_symlinks=False):
            for root, _, files in os.walk(entry.path):
                size += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
            shutil.rmtree(entry.path)
            count += 1
    return count, size
