"""PEFT LoRA adapters read as models: an adapter folder or hub repo → its base model with the updates merged.

    files = resolve_model_files("someone/smollm2-lora")   # adapter_config.json names the base model
    family, cfg = gpt_config_from_hf(read_config(files.folder))
    tensors = read_merged_tensors(files, family)         # the base's tensors, each update folded in

An adapter folder holds adapter_config.json and adapter_model.safetensors (and no config.json); its
base_model_name_or_path names the base model (a hub id, read from the local cache first, or a folder). Each
update of module M is added to M's weight: W + s · B A (B A transposed for GPT-2's Conv1D layers, whose weights
are stored (in, out)), s = lora_alpha / r (lora_alpha / √r with use_rslora), r from each update's own A, so a
rank_pattern needs nothing more. The merged tensors are float32; the loader casts them as it casts any weights.
The tokenizer is the adapter's where it ships a tokenizer.json (an adapter trained with added tokens), else the
base model's. An image-text base (Gemma 3 4B) loads its text model: the updates of its vision tower are left out
with the tower. Not read, each refused in one line: other PEFT methods, DoRA, trained biases, modules_to_save,
alpha_pattern, updates of embeddings.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .hf_files import HFError, load_safetensors, read_json_object, resolve_model_dir
from .hf_weights import hf_name, normalize_names

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class ModelFiles:
    folder: str               # config.json and the weights: the model's, or an adapter's base model's
    tokenizer_folder: str     # tokenizer.json: an adapter's own where it has one, else `folder`
    adapter: str | None = None  # the adapter's folder, if the source is one


def is_adapter_folder(folder: str) -> bool:
    return (os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))
            and not os.path.isfile(os.path.join(folder, "config.json")))


def resolve_model_files(path_or_repo: str, label: str | None = None,
                        need: str = "config.json and *.safetensors") -> ModelFiles:
    """A model folder or hub id as resolve_model_dir gives it; an adapter → its base model's folder beside it."""
    label = label or repr(path_or_repo)
    folder = resolve_model_dir(path_or_repo, label, need)
    if not is_adapter_folder(folder):
        return ModelFiles(folder, folder)
    try:
        base = read_adapter_config(folder).get("base_model_name_or_path")
        if not isinstance(base, str) or not base:
            raise HFError(f"its {ADAPTER_CONFIG} names no base_model_name_or_path")
    except HFError as e:
        raise HFError(f"cannot load {label}: {e}") from None
    base_folder = resolve_model_dir(base, f"{label}'s base model {base!r}", need)
    if is_adapter_folder(base_folder):
        raise HFError(f"cannot load {label}: its base model {base!r} is an adapter itself")
    own_tokenizer = os.path.isfile(os.path.join(folder, "tokenizer.json"))
    return ModelFiles(base_folder, folder if own_tokenizer else base_folder, folder)


def read_adapter_config(folder: str) -> dict:
    """adapter_config.json, checked for what this loader merges (module docstring). HFError (one line) otherwise."""
    config = read_json_object(os.path.join(folder, ADAPTER_CONFIG))
    kind = config.get("peft_type")
    problem = (f"adapter type {kind!r} (LoRA adapters only)" if kind != "LORA"
               else "DoRA (use_dora)" if config.get("use_dora")
               else f"trained biases (bias={config.get('bias')!r})" if config.get("bias", "none") != "none"
               else f"modules_to_save {config['modules_to_save']}" if config.get("modules_to_save")
               else "alpha_pattern" if config.get("alpha_pattern")
               else None)
    if problem:
        raise HFError(f"{problem} is not supported")
    alpha, r = config.get("lora_alpha"), config.get("r")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise HFError(f"{ADAPTER_CONFIG} has lora_alpha={alpha!r}, expected a number")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise HFError(f"{ADAPTER_CONFIG} has r={r!r}, expected a positive rank")
    return config


def read_merged_tensors(files: ModelFiles, family: str) -> dict:
    """The model's tensors (read_tensors of files.folder), with an adapter's updates merged (float32). HFError with
    one line (the caller names the model)."""
    from .hf_files import read_tensors
    tensors = read_tensors(files.folder)
    if files.adapter is None:
        return tensors
    config = read_adapter_config(files.adapter)
    path = os.path.join(files.adapter, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise HFError(f"{files.adapter} has no {ADAPTER_WEIGHTS}")
    updates = _updates(load_safetensors(path))
    tensors = normalize_names(family, tensors)
    for module, (a, b) in updates.items():
        name = hf_name(family, module + ".weight")
        if name is None:  # a part of the model that is not loaded (an image-text model's vision tower)
            continue
        w = tensors.get(name)
        if w is None:
            raise HFError(f"it updates {module}, which the base model does not have")
        delta = b.float() @ a.float()  # (out, in)
        if family == "gpt2":
            delta = delta.t()  # Conv1D: (in, out)
        if tuple(delta.shape) != tuple(w.shape):
            raise HFError(f"the update of {module} is {tuple(delta.shape)}, its weight "
                          f"{tuple(w.shape)}")
        r = a.shape[0]
        scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
        tensors[name] = w.float() + scale * delta
    return tensors


def _updates(adapter: dict) -> dict:
    """{module path: (A (r, in), B (out, r))} from an adapter's tensors; anything else is one HFError."""
    halves: dict = {}
    for key, t in adapter.items():
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        name = name.replace(".default.", ".")  # saved with the adapter's name left in
        for half in ("lora_A", "lora_B"):
            suffix = f".{half}.weight"
            if name.endswith(suffix) and t.dim() == 2:
                halves.setdefault(name[:-len(suffix)], {})[half] = t
                break
        else:
            raise HFError(f"its tensor {key} is not a LoRA update of a linear layer "
                          "(not supported)")
    out = {}
    for module, pair in halves.items():
        if set(pair) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(pair)).pop()
            raise HFError(f"the update of {module} has no {missing}")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.shape[0] != b.shape[1]:
            raise HFError(f"the update of {module} has lora_A {tuple(a.shape)} and lora_B "
                          f"{tuple(b.shape)}, whose ranks differ")
        out[module] = (a, b)
    if not out:
        raise HFError(f"{ADAPTER_WEIGHTS} holds no updates")
    return out


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "ModelFiles", "is_adapter_folder", "read_adapter_config",
           "read_merged_tensors", "resolve_model_files"]
