"""A LoRA run's updates → a PEFT adapter folder, for the Hugging Face model the run started from.

    python -m model.export --ckpt runs/lora_smollm2_shakespeare --adapter --out exported/lora_adapter

writes into DIR:
    adapter_config.json        peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout, target_modules
                               (the Hugging Face names of the run's lora_targets), base_model_name_or_path (the
                               run's train.init_from without "hf:")
    adapter_model.safetensors  base_model.model.<module>.lora_A.weight (rank, in) / .lora_B.weight (out, rank)

so that `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR)` gives the run's logits
(its merged model's: `python -m model.export` without --adapter). A fused projection of ours is several of the
architecture's (model/hf_weights.py): its update B·A becomes one update per part, the part's rows of B with the
same A (Llama-family c_attn → q_proj, k_proj, v_proj; c_fc → gate_proj, up_proj); GPT-2's Conv1D layers keep
A and B as they are (fan_in_fan_out: PEFT transposes only the base weight).
"""
from __future__ import annotations

import torch

from .config import GPTConfig
from .hf_folder import DTYPES, ExportError, check_destination, hf_family, json_text, write_folder
from .hf_weights import tensor_rules
from .lora import LoRASettings

PEFT_PREFIX = "base_model.model."


def adapter_config(family: str, settings: LoRASettings, base: str, tensors: dict) -> dict:
    """adapter_config.json for the adapter `tensors` (adapter_tensors) of a model of `family`."""
    modules = {key[len(PEFT_PREFIX):-len(".lora_A.weight")] for key in tensors if key.endswith(".lora_A.weight")}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
            "target_modules": sorted({_target_name(m, family) for m in modules}),
            "fan_in_fan_out": family == "gpt2", "bias": "none", "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}


def adapter_tensors(family: str, cfg: GPTConfig, state: dict, settings: LoRASettings,
                    dtype: torch.dtype | None = None) -> dict:
    """The PEFT tensors of a LoRA run's state dict (our names): per Hugging Face module, lora_A and lora_B."""
    rules = {rule.ours: rule for rule in tensor_rules(family, cfg)}
    out = {}
    for i in range(cfg.n_layer):
        for target in settings.targets:
            ours = f"transformer.h.{i}.{target}"
            a, b = state[ours + ".lora_A"], state[ours + ".lora_B"]  # (rank, in), (out, rank)
            row = 0
            for hf_name, shape in rules[ours + ".weight"].parts:
                rows = shape[1] if rules[ours + ".weight"].transpose else shape[0]  # Conv1D: (in, out)
                module = PEFT_PREFIX + hf_name[:-len(".weight")]
                out[module + ".lora_A.weight"] = a.clone()
                out[module + ".lora_B.weight"] = b[row:row + rows].clone()  # (rows, rank)
                row += rows
            if row != b.shape[0]:
                raise ValueError(f"{ours}.lora_B has {b.shape[0]} rows, its weight {row}")
    return {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in out.items()}


def export_adapter(ckpt_path: str, out: str, prefer: str = "latest", dtype: str = "auto", force: bool = False) -> str:
    """Write the LoRA updates of checkpoint `ckpt_path` (a file, or a run folder: its latest, or best.pt with
    prefer="best") as a PEFT adapter into the folder `out`; returns `out`. Raises ExportError or CheckpointError
    (one line)."""
    from .checkpoint import load_checkpoint
    from .config import ConfigError
    check_destination(out, force)
    ckpt = load_checkpoint(ckpt_path, map_location="cpu", prefer=prefer)
    if not ckpt.get("lora"):
        raise ExportError(f"{ckpt['path']} holds no LoRA updates (a run with train.lora_rank = 0): export the "
                          "model itself, without --adapter")
    try:
        cfg = GPTConfig(**ckpt["config"]["model"]).validate()
        settings = LoRASettings.from_dict(ckpt["lora"])
        family = hf_family(cfg)
        tensors = adapter_tensors(family, cfg, ckpt["model"], settings, None if dtype == "auto" else DTYPES[dtype])
    except (TypeError, KeyError, ValueError, ConfigError) as e:
        raise ExportError(f"{ckpt['path']}: its LoRA updates cannot be exported "
                          f"({' '.join(str(e).split())[:200]})") from None
    base = ckpt["lora"].get("base", "")
    base = base[len("hf:"):] if base.startswith("hf:") else base
    write_folder(out, {"adapter_config.json": json_text(adapter_config(family, settings, base, tensors))}, tensors,
                  force, weights_file="adapter_model.safetensors")
    return out


def _target_name(path: str, family: str) -> str:
    """PEFT's target_modules entry (matched as a suffix of a module's path): GPT-2's attn.c_proj and mlp.c_proj
    share their last name, so GPT-2 keeps the owner too; the Llama family's last names are unique."""
    parts = path.split(".")
    return ".".join(parts[-2:]) if family == "gpt2" else parts[-1]


__all__ = ["adapter_config", "adapter_tensors", "export_adapter", "PEFT_PREFIX"]
