"""Choosing the next token from logits: greedy, or temperature with top-k, top-p (nucleus) and min-p filtering;
a repetition penalty on the tokens a sequence already holds.

    sample(logits (B, V), SamplingParams(...), generator) -> tokens (B,)
    penalize(logits (B, V), seen (B, V) bool, penalty) -> logits (B, V)   (before sample, as the loop does)
    from_generation_config(dict) -> {field: value} | None                  a Hugging Face model's own settings

The generation engine (model/generation.py) calls it once per decode step outside a CUDA graph (greedy decoding
keeps its argmax inside the graph instead).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.8   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    min_p: float = 0.0         # 0 = off; else drop tokens less likely than min_p x the most likely one's probability
    repetition_penalty: float = 1.0  # 1 = off; > 1 makes the tokens of the prompt and of the reply so far less likely
    max_new_tokens: int = 200
    stop_tokens: tuple[int, ...] = ()  # a sequence ends at the first of these (excluded from its output)


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) → next tokens (B,) int64: greedy, or temperature with top-k, top-p (nucleus) and min-p
    filtering (applied in that order, each to what the one before kept; min-p on the temperature-scaled
    probabilities: a token stays where p ≥ min_p · max p, i.e. logit ≥ max logit + log(min_p))."""
    if p.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # (B, V)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p  # keep the smallest prefix reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if p.min_p > 0.0:
        floor = logits.max(dim=-1, keepdim=True).values + math.log(p.min_p)  # (B, 1)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    if generator is not None and not same_device(generator.device, probs.device):
        # draw where the generator lives (its state is what makes runs reproducible), then come back
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty (CTRL's, as transformers applies it): the logit of every token a sequence already
    holds (seen (B, V) bool) divided by `penalty` where positive and multiplied by it where negative, so that
    penalty > 1 makes those tokens less likely whatever their sign. logits (B, V) → a new (B, V) float32."""
    logits = logits.float()
    hit = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, hit, logits)


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
# transformers' GenerationConfig defaults for sampling, which a generation_config.json with do_sample leaves out
HF_SAMPLING_DEFAULTS = dict(temperature=1.0, top_k=50, top_p=1.0, min_p=0.0, repetition_penalty=1.0)


def from_generation_config(gen: dict) -> dict | None:
    """The sampling a Hugging Face model's generation_config.json asks for, as SamplingParams fields, or None where
    it does not say (no boolean do_sample): do_sample false is greedy (temperature 0); true takes its temperature,
    top_k, top_p, min_p and repetition_penalty, transformers' defaults for those it leaves out. A value out of
    its range (or of the wrong type) is left out too."""
    do_sample = gen.get("do_sample")
    if not isinstance(do_sample, bool):
        return None
    out = dict(HF_SAMPLING_DEFAULTS)  # (keys: SAMPLING_FIELDS)
    if not do_sample:
        out["temperature"] = 0.0
    ok = dict(temperature=lambda v: math.isfinite(v) and v > 0, top_k=lambda v: v >= 0 and float(v).is_integer(),
              top_p=lambda v: 0 < v <= 1, min_p=lambda v: 0 <= v <= 1,
              repetition_penalty=lambda v: math.isfinite(v) and v > 0)
    for key, valid in ok.items():
        v = gen.get(key)
        if key == "temperature" and not do_sample:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) and valid(v):
            out[key] = int(v) if key == "top_k" else float(v)
    return out


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether a and b name the same device: "cuda" (no index) is the current CUDA device, so it equals
    "cuda:0" when GPU 0 is current (torch.device("cuda") != torch.device("cuda:0") as objects)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda" or (a.index is None and b.index is None):
        return a.index == b.index or a.type == "cpu"
    current = torch.cuda.current_device() if a.index is None or b.index is None else None
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)
