"""Sharded checkpoints (train.parallel = "fsdp"): one folder per checkpoint, written by every rank at once
through torch.distributed.checkpoint (DCP).

    <out_dir>/ckpt_<step>/          the checkpoint at the top of step <step> (best_<step>/: the best one, hard links)
        __<rank>_0.distcp           DCP shards: each rank's slices of the parameters and AdamW moments
        .metadata                   DCP's index of which slice of which tensor lies where (a pickle; see below)
        rank_<rank>.pt              that rank's data position and RNG states (torch.save of tensors and containers)
        flashgpt.json               step, best val loss, config, tokenizer, world size, optimizer groups, tied
                                    names, size and sha256 of every other file, and a checksum of itself

Tensors are saved under flat keys: "model/<parameter name>" and "optim/<parameter name>/<state>" (step,
exp_avg, exp_avg_sq); a tied parameter is saved once (flashgpt.json "tied" names its other name).

Writing (save_sharded_checkpoint, called by every rank): DCP and the rank files go into .tmp-ckpt_<step>/;
rank 0 writes flashgpt.json last and renames the folder to ckpt_<step>/: one atomic step, so a crash or a kill
mid-write never leaves a half checkpoint under a checkpoint's name (the temporary folder is removed at the next
start). A write error on any rank becomes the same OSError on every rank. The run folder must be on a file system
that every rank sees (one node, or a shared file system across nodes).

Reading: flashgpt.json's checksum, then every file's size and sha256 (split between the ranks that read), before
anything is loaded: a missing shard or a damaged file is named in one line. A checkpoint written by N ranks loads
on M ranks (DCP reads each rank's slices from wherever they lie), or on one process without a process group
(load_sharded_checkpoint: what generate.py and exporters get from model.checkpoint.load_checkpoint).

Unpickling: DCP's .metadata is a pickle of DCP's own classes (Metadata, TensorStorageMetadata, TensorProperties,
ChunkStorageMetadata, MetadataIndex, StorageMeta, _StorageInfo), torch.Size, dtypes, layouts, memory formats and
a pathlib path; torch itself reads it with an unrestricted pickle.load. Here it is read by an unpickler that
admits exactly those (anything else is refused, naming it). Tensors are read with torch.load(weights_only=True),
as DCP does; the non-tensor values that DCP reads with weights_only=False are never requested (these checkpoints
hold tensors only) and are refused if a checkpoint ever offers one. Rank files: torch.load(weights_only=True).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import shutil
import warnings

import torch

from .checkpoint_files import (SHARDED_META, TEMP_PREFIX, CheckpointError, atomic_save, best_folders, fsync_dir,
                               link_or_copy, prune, read_torch_file, remove_tree)
from .parallel import MODEL_PREFIX, OPTIM_PREFIX, optimizer_state_dict

__all__ = ["load_rank_state", "load_sharded_checkpoint", "open_sharded_checkpoint", "read_sharded_meta",
           "read_sharded_tensors", "save_sharded_checkpoint", "verify_sharded_files"]

FORMAT = "flashgpt-sharded"
VERSION = 1
SHARD_NAME = re.compile(r"__(\d+)_\d+\.distcp")
REQUIRED = ("format", "version", "iter", "best_val", "config", "tokenizer", "world_size", "tied",
            "optimizer_groups", "files")


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj) -> list:
    """Every rank's `obj` (a list of one element without a process group)."""
    import torch.distributed as dist
    _, world = _rank_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _describe(path: str) -> dict:
    return {"bytes": os.path.getsize(path), "sha256": _sha256(path)}


def _json_checksum(body: dict) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if not isinstance(e, OSError) else (e.strerror or text[:300])


# ----------------------------------------------------------------------------------------------- writing

def save_sharded_checkpoint(tensors: dict, meta: dict, rank_state: dict, out_dir: str, step: int,
                            keep_last: int, is_best: bool) -> str:
    """Write ckpt_<step>/ (every rank calls this, with its own shards and rank_state); refresh best_<step>/ when
    is_best; keep the last `keep_last` numbered checkpoints. Returns the folder's path.

    tensors: flat "model/..." and "optim/..." keys (DTensor shards or replicated tensors); meta: iter, best_val,
    config, tokenizer, tied, optimizer_groups (JSON-able); rank_state: this rank's "data" and "rng".
    A checkpoint folder of this step that already exists is kept as it is (it holds this same state: a run that
    resumed at this step and stops before taking one). Raises OSError on every rank when any rank's write fails;
    no temporary folder stays behind where it can be removed, and every checkpoint already written stays whole.
    """
    import torch.distributed.checkpoint as dcp
    rank, world = _rank_world()
    final = os.path.join(out_dir, f"ckpt_{step:07d}")
    tmp = os.path.join(out_dir, f"{TEMP_PREFIX}ckpt_{step:07d}")

    error, exists = None, False
    if rank == 0:
        try:
            exists = os.path.isdir(final)
            if not exists:
                if os.path.isdir(tmp):
                    shutil.rmtree(tmp)
                os.makedirs(tmp)
        except OSError as e:
            error = (tmp, _first_line(e))
    error, exists = _all_gather((error, exists))[0]
    if error:
        raise OSError(f"{error[1]} ({error[0]})")
    if exists:
        return final

    error, files = None, {}
    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True,
                                                              thread_count=1))
    except Exception as e:  # DCP hands every rank the exception of any rank
        error = (tmp, _first_line(e))
    if error is None:
        try:
            atomic_save(rank_state, os.path.join(tmp, _rank_file(rank)))
            for name in os.listdir(tmp):
                if name == _rank_file(rank) or name.startswith(f"__{rank}_"):
                    files[name] = _describe(os.path.join(tmp, name))
        except OSError as e:
            error = (os.path.join(tmp, _rank_file(rank)), _first_line(e))
    gathered = _all_gather((error, files))
    errors = [e for e, _ in gathered if e]

    if rank == 0 and not errors:
        try:
            everything = {name: d for _, f in gathered for name, d in f.items()}
            everything[".metadata"] = _describe(os.path.join(tmp, ".metadata"))
            body = {"format": FORMAT, "version": VERSION, "iter": meta["iter"],
                    "best_val": meta["best_val"] if math.isfinite(meta["best_val"]) else None,
                    "config": meta["config"], "tokenizer": meta["tokenizer"], "world_size": world,
                    "tied": meta["tied"], "optimizer_groups": meta["optimizer_groups"], "files": everything}
            body["checksum"] = _json_checksum(body)
            _write_json(os.path.join(tmp, SHARDED_META), body)
            fsync_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(out_dir)
        except OSError as e:
            errors.append((os.path.join(final, SHARDED_META), _first_line(e)))
        else:
            try:
                if is_best:
                    _write_best(final, out_dir, step)
                prune(out_dir, keep_last)
            except OSError as e:
                errors.append((getattr(e, "filename", None) or out_dir, _first_line(e)))
    if rank == 0 and errors and os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    errors = _all_gather(errors)[0]  # rank 0's list: every rank's errors and its own
    if errors:
        where, what = errors[0]
        raise OSError(f"{what} ({where})")
    return final


def _write_json(path: str, body: dict) -> None:
    with open(path, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _write_best(final: str, out_dir: str, step: int) -> None:
    """best_<step>/: hard links to (or copies of) the checkpoint's files, renamed into place in one step; older
    best folders and a best.pt are removed after."""
    tmp = os.path.join(out_dir, f"{TEMP_PREFIX}best_{step:07d}")
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    for name in os.listdir(final):
        link_or_copy(os.path.join(final, name), os.path.join(tmp, name))
    fsync_dir(tmp)
    target = os.path.join(out_dir, f"best_{step:07d}")
    if os.path.isdir(target):
        remove_tree(target)
    os.rename(tmp, target)
    fsync_dir(out_dir)
    for old in best_folders(out_dir):
        if os.path.abspath(old) != os.path.abspath(target):
            remove_tree(old)
    best_pt = os.path.join(out_dir, "best.pt")
    if os.path.isfile(best_pt):
        os.remove(best_pt)


# ----------------------------------------------------------------------------------------------- reading

def read_sharded_meta(folder: str) -> dict:
    """flashgpt.json of a sharded checkpoint, its checksum verified; "best_val" inf when none, "path" added."""
    path = os.path.join(folder, SHARDED_META)
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder} is not a whole sharded checkpoint: it has no {SHARDED_META} (written last, "
                              "so a folder without it was never completed); use another checkpoint")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{path} is damaged (not readable JSON); use another checkpoint") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a flashgpt checkpoint description")
    stored = meta.pop("checksum", None)
    if stored != _json_checksum(meta):
        raise CheckpointError(f"checksum mismatch in {path}: its content differs from what was saved, the file is "
                              "damaged; use another checkpoint")
    missing = [k for k in REQUIRED if k not in meta]
    if missing or meta["format"] != FORMAT:
        raise CheckpointError(f"{path} is not a flashgpt sharded checkpoint description"
                              + (f" (no {', '.join(missing)})" if missing else ""))
    if meta["version"] > VERSION:
        raise CheckpointError(f"{folder}: sharded checkpoint version {meta['version']} is newer than this code "
                              f"reads ({VERSION})")
    meta["best_val"] = float("inf") if meta["best_val"] is None else meta["best_val"]
    meta["path"] = folder
    return meta


def verify_sharded_files(folder: str, meta: dict, rank: int = 0, world: int = 1) -> list[str]:
    """Problems (one line each) with the files flashgpt.json lists: every one must exist with its size; of every
    `world`-th one from `rank` on, the sha256 is recomputed."""
    problems = []
    names = sorted(meta["files"])
    for name in names:
        if os.path.basename(name) != name or name in ("", ".", ".."):
            problems.append(f"{os.path.join(folder, SHARDED_META)} names a file outside its folder ({name!r})")
            continue
        path = os.path.join(folder, name)
        m = SHARD_NAME.fullmatch(name)
        if not os.path.isfile(path):
            what = (f"its shard {name} (written by rank {m.group(1)} of {meta['world_size']})" if m
                    else f"its file {name}")
            problems.append(f"checkpoint {folder} is incomplete: {what} is missing; use another checkpoint")
        elif os.path.getsize(path) != meta["files"][name]["bytes"]:
            problems.append(f"checkpoint {folder}: {name} holds {os.path.getsize(path)} bytes, "
                            f"{meta['files'][name]['bytes']} were written; the file is damaged")
    if problems:
        return problems
    for name in names[rank::world]:
        if _sha256(os.path.join(folder, name)) != meta["files"][name]["sha256"]:
            problems.append(f"checksum mismatch in {os.path.join(folder, name)}: its content differs from what "
                            "was saved, the file is damaged; use another checkpoint")
    return problems


# Exactly what DCP's .metadata pickle may name; anything else is refused.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {(_DCP_METADATA, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                               "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
                                               "StorageMeta", "_MEM_FORMAT_ENCODING")}
_ALLOWED |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
             ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
             ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
             ("pathlib", "PureWindowsPath"), ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed in checkpoint metadata")


def read_dcp_metadata(folder: str):
    """DCP's .metadata of `folder`, read with the restricted unpickler; CheckpointError when refused/unreadable."""
    path = os.path.join(folder, ".metadata")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e})") from None
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        if named:
            raise CheckpointError(f"refusing to unpickle: {path} names {named.group(1)}, which checkpoint metadata "
                                  "never holds; not loaded") from None
        raise CheckpointError(f"{path} is damaged (not readable); use another checkpoint") from None
    except Exception as e:
        raise CheckpointError(f"{path} is damaged ({_first_line(e)}); use another checkpoint") from None
    from torch.distributed.checkpoint.metadata import Metadata
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} is not DCP metadata")
    return metadata


def _safe_reader(folder: str):
    """A DCP FileSystemReader whose metadata comes through the restricted unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_dcp_metadata(folder)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(folder)


def _safe_planner():
    """DCP's default load planner, except that it refuses non-tensor values (DCP unpickles them freely)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise CheckpointError(f"the checkpoint holds a pickled value for {read_item.dest_index.fqn}; "
                                  "flashgpt checkpoints hold tensors only; not loaded")

    return SafePlanner()


def open_sharded_checkpoint(folder: str, rank: int = 0, world: int = 1) -> dict:
    """flashgpt.json of `folder` after checking every file (with world > 1, every rank calls this and checks
    its share of the checksums; all ranks raise the same CheckpointError). Adds "tensors" ({key: shape}),
    "verified" and "sharded" (True)."""
    meta = read_sharded_meta(folder)
    problems = verify_sharded_files(folder, meta, rank, world)
    if world > 1:
        problems = [p for ps in _all_gather(problems) for p in ps]
    if problems:
        raise CheckpointError(problems[0])
    metadata = read_dcp_metadata(folder)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    for info in metadata.storage_data.values():
        if info.relative_path not in meta["files"]:
            raise CheckpointError(f"checkpoint {folder}: its DCP index names {info.relative_path!r}, which "
                                  f"{SHARDED_META} does not list; the checkpoint is damaged")
    meta["tensors"] = {key: (tuple(md.size), md.properties.dtype)
                       for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    meta["verified"] = meta["sharded"] = True
    return meta


def read_sharded_tensors(folder: str, targets: dict, *, distributed: bool = True) -> None:
    """Fill `targets` (key → tensor or DTensor shard) in place from the checkpoint in `folder`; collective when
    `distributed` and a process group exists (every rank calls it with its own shards)."""
    import torch.distributed.checkpoint as dcp
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load(targets, storage_reader=_safe_reader(folder), planner=_safe_planner(),
                     no_dist=not distributed)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"could not read checkpoint {folder} ({_first_line(e)})") from None


def load_rank_state(folder: str, meta: dict, rank: int) -> dict:
    """The data position and RNG states saved by `rank` (rank 0's when the checkpoint has fewer ranks)."""
    saved = rank if rank < meta["world_size"] else 0
    state = read_torch_file(os.path.join(folder, _rank_file(saved)))
    if not isinstance(state, dict) or "data" not in state or "rng" not in state:
        raise CheckpointError(f"{os.path.join(folder, _rank_file(saved))} is not a flashgpt rank state")
    return state


def load_sharded_checkpoint(folder: str, map_location="cpu", *, with_optimizer: bool = True) -> dict:
    """A sharded checkpoint folder, read whole on this process without a process group, as the dict a
    single-file checkpoint holds: "model" (full tensors, tied names included), "optimizer" (the
    optimizer.state_dict() format; left out when with_optimizer is False), "config", "tokenizer", "iter",
    "best_val", "data" and "rng" (rank 0's), plus "path", "verified" (True) and "world_size"."""
    meta = open_sharded_checkpoint(folder)
    wanted = (MODEL_PREFIX, OPTIM_PREFIX) if with_optimizer else (MODEL_PREFIX,)
    targets = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in meta["tensors"].items()
               if key.startswith(wanted)}
    read_sharded_tensors(folder, targets, distributed=False)
    if map_location not in (None, "cpu") and not (isinstance(map_location, torch.device)
                                                  and map_location.type == "cpu"):
        targets = {k: v.to(map_location) for k, v in targets.items()}
    model = {key[len(MODEL_PREFIX):]: value for key, value in targets.items() if key.startswith(MODEL_PREFIX)}
    for alias, name in meta["tied"].items():
        if name not in model:
            raise CheckpointError(f"checkpoint {folder}: {alias} is tied to {name}, which it does not hold")
        model[alias] = model[name]
    rank0 = load_rank_state(folder, meta, 0)
    ckpt = {"model": model, "config": meta["config"], "tokenizer": meta["tokenizer"], "iter": meta["iter"],
            "best_val": meta["best_val"], "data": rank0["data"], "rng": rank0["rng"], "version": 1,
            "path": folder, "verified": True, "world_size": meta["world_size"]}
    if with_optimizer:
        saved = optimizer_state_dict(meta["optimizer_groups"], targets)
        for group in saved["param_groups"]:
            del group["param_names"]
        ckpt["optimizer"] = saved
    return ckpt
