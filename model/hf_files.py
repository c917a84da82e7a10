"""The files of a Hugging Face model: a local folder or a hub repo → config.json and the safetensors tensors.

    folder = resolve_model_dir("HuggingFaceTB/SmolLM2-135M")   # or a local folder: used as it is
    hf_config = read_config(folder)                            # config.json as a dict
    tensors = read_tensors(folder)                             # {name: tensor} from model.safetensors or shards

A hub id is looked up in the local Hugging Face cache first (no network), then downloaded through
huggingface_hub.snapshot_download (config, weights and tokenizer files only). Weights are read only from
safetensors files (never pickles). Every failure is an HFError with one line naming the repo or file and what is
missing or wrong.
"""
from __future__ import annotations

import json
import os

from .checkpoint import CheckpointError

# what a hub snapshot brings down: the model's config and weights, and its tokenizer and generation settings
# (and a PEFT adapter's config: model/hf_adapter.py)
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "chat_template.json", "adapter_config.json"]
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFError(CheckpointError):
    """Hugging Face weights that cannot be loaded: missing or unreadable files, an unsupported architecture or
    option, tensors of the wrong shape, a hub that cannot be reached."""


def _offline() -> bool:
    return any(os.environ.get(k, "") not in ("", "0", "false", "False")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_reachable(timeout: float = 5.0) -> bool:
    """A TCP connection to the hub's host within `timeout` seconds (instead of the hub client's long retries)."""
    import socket
    from urllib.parse import urlparse
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def _one_line(e: BaseException, limit: int = 200) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:limit]}"


def resolve_model_dir(path_or_repo: str, label: str | None = None,
                      need: str = "config.json and *.safetensors") -> str:
    """A local model folder as it is, or a hub repo id → the folder of its snapshot in the Hugging Face cache.

    label names the model in error messages (default: the repr of path_or_repo); need names the files the
    caller reads, for the message when there is no copy of them.
    """
    label = label or repr(path_or_repo)
    local = os.path.expanduser(path_or_repo)
    if os.path.isdir(local):
        return local
    if os.path.exists(local):
        raise HFError(f"cannot load {label}: it is a file; give the model's folder (config.json + *.safetensors)")
    looks_local = path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") > 1
    if looks_local or (os.sep != "/" and os.sep in path_or_repo):
        raise HFError(f"cannot load {label}: no such folder (and not a hub repo id like 'org/name')")
    return _snapshot(path_or_repo, label, need)


def _snapshot(repo: str, label: str, need: str) -> str:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
        from huggingface_hub.utils import logging as hub_logging
    except ImportError:
        raise HFError(f"cannot load {label} from the hub: the huggingface_hub package is not installed "
                      "(pip install huggingface_hub), or give a local folder") from None
    hub_logging.set_verbosity_error()  # no "Retrying in 1s" lines
    try:
        return snapshot_download(repo, allow_patterns=HUB_FILES, local_files_only=True)
    except HFValidationError:
        raise HFError(f"cannot load {label}: not a local folder, nor a valid hub repo id ('org/name')") from None
    except LocalEntryNotFoundError:
        pass  # not in the local cache (or only part of it)
    if _offline():
        raise HFError(f"cannot load {label}: HF_HUB_OFFLINE is set and the local Hugging Face cache has no copy "
                      f"of it ({need})")
    if not _hub_reachable():
        raise HFError(f"cannot load {label}: the Hugging Face hub is unreachable and the local cache has no copy "
                      f"of it ({need})")
    try:
        return snapshot_download(repo, allow_patterns=HUB_FILES)
    except GatedRepoError:
        raise HFError(f"cannot load {label}: the repo is gated; accept its licence on the hub and set HF_TOKEN") \
            from None
    except RepositoryNotFoundError:
        raise HFError(f"cannot load {label}: no such repo on the hub (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HFError(f"cannot load {label}: the hub has no such revision") from None
    except Exception as e:  # connection errors mid-download, full disk
        raise HFError(f"cannot load {label}: the download failed ({_one_line(e)})") from None


def read_config(folder: str) -> dict:
    """config.json of a model folder as a dict."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise HFError(f"{folder} has no config.json: not a Hugging Face model folder")
    return read_json_object(path)


def read_json_object(path: str) -> dict:
    """A JSON file holding an object, as a dict; HFError with one line where it cannot be read or is no object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"cannot read {path} ({_one_line(e)})") from None
    if not isinstance(value, dict):
        raise HFError(f"{path} is not a JSON object")
    return value


def read_tensors(folder: str) -> dict:
    """{name: tensor} (on the CPU, in the file's dtype) from model.safetensors, or from the shards that
    model.safetensors.index.json names (every shard must exist and hold the tensors the index places in it)."""
    index_path = os.path.join(folder, INDEX)
    if os.path.isfile(index_path):
        return _read_sharded(folder, index_path)
    single = os.path.join(folder, SINGLE)
    if os.path.isfile(single):
        return load_safetensors(single)
    others = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if others:
        raise HFError(f"{folder} has {', '.join(others[:3])} but no {SINGLE} and no {INDEX} naming the shards")
    if any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(folder)):
        raise HFError(f"{folder} has only pickled weights (pytorch_model.bin), which are not read; it needs "
                      f"{SINGLE} (or an {INDEX} with its shards)")
    raise HFError(f"{folder} has no {SINGLE} (or {INDEX} with its shards)")


def _read_sharded(folder: str, index_path: str) -> dict:
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise HFError(f"cannot read {index_path} ({_one_line(e)})") from None
    for shard in weight_map.values():  # checked before sorting: a number or a list would not sort with names
        if not isinstance(shard, str) or os.path.basename(shard) != shard or not shard.endswith(".safetensors"):
            raise HFError(f"{index_path} names {shard!r}, which is not a .safetensors file of the folder")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not os.path.isfile(os.path.join(folder, shard)):
            raise HFError(f"{index_path} names shard {shard}, which is missing from {folder}")
    tensors: dict = {}
    for shard in shards:
        for name, t in load_safetensors(os.path.join(folder, shard)).items():
            if name in tensors:
                raise HFError(f"tensor {name} is in more than one shard of {folder}")
            tensors[name] = t
    for name, shard in weight_map.items():
        if name not in tensors:
            raise HFError(f"{index_path} places tensor {name} in {shard}, which does not hold it")
    return tensors


def load_safetensors(path: str) -> dict:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise HFError("reading Hugging Face weights needs the safetensors package: pip install safetensors") from None
    try:
        return load_file(path, device="cpu")
    except Exception as e:  # SafetensorError (truncated, bad header), OSError
        raise HFError(f"cannot read {path} ({_one_line(e)})") from None
