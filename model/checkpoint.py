"""Checkpoints: written atomically, verified by a checksum, loaded without unpickling arbitrary objects.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts saved with torch.save and read back
with torch.load(weights_only=True). Writing goes to a temporary file (`.tmp-*.pt`) in the same folder, fsync,
then an atomic rename: a crash or kill during the write leaves the previous checkpoint whole, and a failed
write removes its temporary file.

`save_checkpoint` stores a "checksum" entry: sha256 over the whole content (every tensor's dtype, shape and
bytes, every other value's type and repr, in sorted key order). `load_checkpoint` recomputes it, so a flipped
byte inside tensor data (which torch.load itself does not notice) is reported instead of loaded. Files
without the entry (written by older versions, or by `atomic_save` directly) load with verified=False.

`load_checkpoint` and `find_checkpoint` take either format: a file, or a sharded folder
(model/sharded_checkpoint.py). The file operations both formats share are in model/checkpoint_files.py.
"""
from __future__ import annotations

import hashlib
import os

import torch

from .checkpoint_files import (BEST_DIR_PATTERN, CKPT_DIR_PATTERN, SHARDED_META, CheckpointError, atomic_save,
                               best_folders, link_or_copy, numbered_checkpoints, prune, read_torch_file,
                               remove_stale_temp_dirs, remove_stale_temp_files, remove_tree)
from .sharded_checkpoint import load_sharded_checkpoint

__all__ = ["CheckpointError", "atomic_save", "content_checksum", "find_checkpoint", "is_sharded_checkpoint",
           "load_checkpoint", "numbered_checkpoints", "remove_stale_temp_dirs", "remove_stale_temp_files",
           "save_checkpoint", "save_run_checkpoint"]

CHECKSUM_KEY = "checksum"
LOAD_KEYS = ("path", "verified")  # added by load_checkpoint, never saved


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


def _best_checkpoint(out_dir: str) -> str | None:
    """best.pt, or the best_<step>/ folder of a sharded run (the highest step, if a crash left two)."""
    folders = best_folders(out_dir)
    if folders:
        return folders[-1]
    best = os.path.join(out_dir, "best.pt")
    return best if os.path.isfile(best) else None


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
        return load_sharded_checkpoint(file, map_location, with_optimizer=with_optimizer)
    ckpt = read_torch_file(file, map_location)
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


def save_run_checkpoint(ckpt: dict, out_dir: str, step: int, keep_last: int, is_best: bool) -> str:
    """Write ckpt_<step>.pt (with a checksum), refresh best.pt when is_best, keep the last `keep_last`
    numbered ones. An OSError (disk full, read-only folder) propagates with no temporary file left behind;
    best.pt and every checkpoint already written stay whole."""
    path = os.path.join(out_dir, f"ckpt_{step:07d}.pt")
    save_checkpoint(ckpt, path)
    if is_best:
        link_or_copy(path, os.path.join(out_dir, "best.pt"))
        for folder in best_folders(out_dir):  # of a sharded run this one resumed
            remove_tree(folder)
    prune(out_dir, keep_last)
    return path
