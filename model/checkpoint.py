"""Checkpoints: written atomically, verified by a checksum, loaded without unpickling arbitrary objects.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts saved with torch.save and read back
with torch.load(weights_only=True). Writing goes to a temporary file (`.tmp-*.pt`) in the same folder, fsync,
then an atomic rename: a crash or kill during the write leaves the previous checkpoint whole, and a failed
write removes its temporary file.

`save_checkpoint` stores a "checksum" entry: sha256 over the whole content (every tensor's dtype, shape and
bytes, every other value's type and repr, in sorted key order). `load_checkpoint` recomputes it, so a flipped
byte inside tensor data (which torch.load itself does not notice) is reported instead of loaded. Files
without the entry (written by older versions, or by `atomic_save` directly) load with verified=False.
"""
from __future__ import annotations

import glob
import hashlib
import os
import pickle
import re
import secrets
import shutil
import tempfile

import torch

__all__ = ["CheckpointError", "atomic_save", "content_checksum", "find_checkpoint", "is_sharded_checkpoint",
           "load_checkpoint", "numbered_checkpoints", "remove_stale_temp_dirs", "remove_stale_temp_files",
           "save_checkpoint", "save_run_checkpoint"]

CKPT_PATTERN = re.compile(r"ckpt_(\d+)\.pt$")
CKPT_DIR_PATTERN = re.compile(r"ckpt_(\d+)")   # a sharded checkpoint folder (full match)
BEST_DIR_PATTERN = re.compile(r"best_(\d+)")   # a sharded run's best checkpoint, a folder
TEMP_PREFIX, TEMP_SUFFIX = ".tmp-", ".pt"  # every temporary file this module writes: .tmp-*.pt
CHECKSUM_KEY = "checksum"
SHARDED_META = "flashgpt.json"  # what makes a folder a whole sharded checkpoint (see model/sharded_checkpoint.py)
LOAD_KEYS = ("path", "verified")  # added by load_checkpoint, never saved


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, damaged, unsafe or not from this project."""


def _remove_quietly(path: str) -> None:
    """Remove a temporary file while another error is being raised: a failure here must not hide that one."""
    try:
        os.remove(path)
    except OSError:
        pass


def _fsync_dir(folder: str) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_save(obj, path: str) -> None:
    """torch.save `obj` to `path` through a temporary file and a rename; the temporary file never stays."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(folder)
    except BaseException:
        if os.path.exists(tmp):
            _remove_quietly(tmp)
        raise


def _feed(h, value, where: str) -> None:
    """Add one value (recursively) to the hash: containers in a stable order, tensors by their bytes."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        h.update(f"{where}=tensor:{t.dtype}:{tuple(t.shape)}\0".encode())
        if t.numel():
            flat = t.resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)  # (numel,)
            h.update(memoryview(flat.view(torch.uint8).numpy()))  # (numel * element_size,) raw bytes
    elif isinstance(value, dict):
        h.update(f"{where}=dict:{len(value)}\0".encode())
        for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
            _feed(h, value[key], f"{where}/{key!r}")
    elif isinstance(value, (list, tuple)):
        h.update(f"{where}={'list' if isinstance(value, list) else 'tuple'}:{len(value)}\0".encode())
        for i, item in enumerate(value):
            _feed(h, item, f"{where}[{i}]")
    else:  # numbers, strings, None, bools, dtypes: what weights_only=True can load
        h.update(f"{where}={type(value).__name__}:{value!r}\0".encode())


def content_checksum(obj) -> str:
    """"sha256:<hex>" of a checkpoint's content, independent of dict insertion order and tensor strides.

    Costs one pass over every tensor's bytes (plus a device-to-host copy of each CUDA tensor, one at a time).
    """
    h = hashlib.sha256()
    _feed(h, obj, "")
    return "sha256:" + h.hexdigest()


def save_checkpoint(ckpt: dict, path: str) -> None:
    """atomic_save of `ckpt` with a checksum entry over the rest of its content."""
    body = {k: v for k, v in ckpt.items() if k != CHECKSUM_KEY and k not in LOAD_KEYS}
    body[CHECKSUM_KEY] = content_checksum(body)
    atomic_save(body, path)


def find_checkpoint(path: str, prefer: str = "latest") -> str:
    """A checkpoint file or folder, or a run folder → its latest (or "best") checkpoint, file or folder."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if is_sharded_checkpoint(path):
        return path
    numbered = numbered_checkpoints(path)
    best = _best_checkpoint(path)
    if prefer == "best" and best is not None:
        return best
    if numbered:
        return numbered[-1][1]
    if best is not None:
        return best
    raise CheckpointError(f"no checkpoint in run folder {path}")


def is_sharded_checkpoint(folder: str) -> bool:
    """Whether `folder` is one sharded checkpoint (named ckpt_<step> or best_<step>, or holding one's files),
    as opposed to a run folder."""
    if not os.path.isdir(folder):
        return False
    name = os.path.basename(os.path.normpath(folder))
    return bool(CKPT_DIR_PATTERN.fullmatch(name) or BEST_DIR_PATTERN.fullmatch(name)
                or os.path.exists(os.path.join(folder, SHARDED_META))
                or os.path.exists(os.path.join(folder, ".metadata")))


def numbered_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the run folder's ckpt_<step>.pt files and ckpt_<step>/ folders, by step."""
    found = []
    for entry in os.scandir(out_dir):
        m = CKPT_PATTERN.fullmatch(entry.name) if entry.is_file() else CKPT_DIR_PATTERN.fullmatch(entry.name)
        if m and (entry.is_file() or entry.is_dir()):
            found.append((int(m.group(1)), entry.path))
    return sorted(found)


def _best_folders(out_dir: str) -> list[str]:
    """The best_<step>/ folders of a sharded run, by step."""
    found = []
    for entry in os.scandir(out_dir):
        m = BEST_DIR_PATTERN.fullmatch(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry.path))
    return [path for _, path in sorted(found)]


def _best_checkpoint(out_dir: str) -> str | None:
    """best.pt, or the best_<step>/ folder of a sharded run (the highest step, if a crash left two)."""
    folders = _best_folders(out_dir)
    if folders:
        return folders[-1]
    best = os.path.join(out_dir, "best.pt")
    return best if os.path.isfile(best) else None


# What torch's weights-only unpickler says when a pickle asks for a class or function it does not allow (as
# opposed to bytes it cannot parse, which a truncated or foreign file gives).
UNSAFE_PICKLE = re.compile(r"GLOBAL|Can only (create new object|build)|call reduce")


def _refused(file: str, error: pickle.UnpicklingError) -> CheckpointError:
    named = re.search(r"GLOBAL ([\w.]+)", str(error))
    return CheckpointError(f"refusing to unpickle: {file} contains objects other than tensors/containers"
                           + (f" ({named.group(1)})" if named else "") + "; not loaded")


def _read_torch_file(file: str, map_location="cpu"):
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


def load_checkpoint(path: str, map_location="cpu", prefer: str = "latest", *, with_optimizer: bool = True) -> dict:
    """Load safely (weights_only=True) and verify the checksum. Raises CheckpointError with one line.

    `path` is a checkpoint file, a sharded checkpoint folder, or a run folder (its latest, or best, checkpoint of
    either kind). A sharded folder is read on this process alone, without a process group, into the same dict
    a file holds (see load_sharded_checkpoint; with_optimizer=False skips its optimizer state).
    The dict returned has two more keys: "path" (the file read) and "verified" (True when a stored checksum
    matched; False when the file has none, so nothing about its integrity is known).
    """
    file = find_checkpoint(path, prefer)
    if os.path.isdir(file):
        from .sharded_checkpoint import load_sharded_checkpoint
        return load_sharded_checkpoint(file, map_location, with_optimizer=with_optimizer)
    ckpt = _read_torch_file(file, map_location)
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{file} is not a flashgpt checkpoint (no model weights and config)")
    stored = ckpt.pop(CHECKSUM_KEY, None)
    if stored is not None and stored != content_checksum(ckpt):
        raise CheckpointError(f"checksum mismatch in {file}: its content differs from what was saved, "
                              "the file is damaged; use another checkpoint")
    if "model" not in ckpt or "config" not in ckpt:
        raise CheckpointError(f"{file} is not a flashgpt checkpoint (no model weights and config)")
    ckpt["path"], ckpt["verified"] = file, stored is not None
    return ckpt


def _link_or_copy(src: str, dst: str) -> None:
    """Make `dst` a file with `src`'s content, atomically: a hard link where the file system allows one (no
    extra disk space; the files are only ever replaced, never written in place), else a copy. On any error
    the temporary file is removed and `dst` is left as it was."""
    folder = os.path.dirname(os.path.abspath(dst))
    tmp = os.path.join(folder, f"{TEMP_PREFIX}{secrets.token_hex(8)}{TEMP_SUFFIX}")
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dst)
        _fsync_dir(folder)
    except BaseException:
        if os.path.exists(tmp):
            _remove_quietly(tmp)
        raise


def save_run_checkpoint(ckpt: dict, out_dir: str, step: int, keep_last: int, is_best: bool) -> str:
    """Write ckpt_<step>.pt (with a checksum), refresh best.pt when is_best, keep the last `keep_last`
    numbered ones. An OSError (disk full, read-only folder) propagates with no temporary file left behind;
    best.pt and every checkpoint already written stay whole."""
    path = os.path.join(out_dir, f"ckpt_{step:07d}.pt")
    save_checkpoint(ckpt, path)
    if is_best:
        _link_or_copy(path, os.path.join(out_dir, "best.pt"))
        for folder in _best_folders(out_dir):  # of a sharded run this one resumed
            _remove_tree(folder)
    _prune(out_dir, keep_last)
    return path


def _prune(out_dir: str, keep_last: int) -> None:
    """Remove all but the last `keep_last` numbered checkpoints, files and folders alike."""
    for _, old in numbered_checkpoints(out_dir)[:-keep_last]:
        if os.path.isdir(old):
            _remove_tree(old)
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


def _remove_tree(path: str) -> None:
    """Remove a checkpoint folder: first renamed to a temporary name (one atomic step, after which no reader
    takes it for a checkpoint), then deleted; a crash in between leaves a temporary folder, removed at the next
    start (remove_stale_temp_dirs)."""
    parent = os.path.dirname(os.path.abspath(path))
    doomed = os.path.join(parent, f"{TEMP_PREFIX}removed-{secrets.token_hex(6)}")
    os.rename(path, doomed)
    _fsync_dir(parent)
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
