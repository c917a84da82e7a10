"""Inference: prefill, then decode one token at a time against the KV cache (gpt-fast's split).

    prefill(model, idx, lengths)         prompt(s) → first new token; fills the cache (chunked)
    decode_one_token(model, tok, pos)    one step for every sequence at its own position
    generate(...)                        the loop, with streaming callback and timing

Prompts of different lengths share one batch: they are right-padded and prefilled together (padding sits
after each prompt, so the causal mask keeps real tokens from seeing it), then each sequence decodes from its
own position, overwriting its padding. CUDA graphs wrap the decode step from outside (DecodeGraph).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.8   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    max_new_tokens: int = 200
    stop_token: int | None = None


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) → next tokens (B,) int64: greedy, or temperature with top-k / top-p (nucleus) filtering."""
    if p.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # (B, V)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > p.top_p  # keep the smallest prefix reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def prefill(model, idx: torch.Tensor, lengths: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """idx: (B, T) right-padded prompts, lengths: (B,) → logits (B, V) at each prompt's last token.

    chunk > 0 runs the prompt in pieces of `chunk` tokens, each attending to the cache so far.
    """
    B, T = idx.shape
    chunk = chunk if chunk > 0 else T
    last = torch.empty(B, model.config.vocab_size, device=idx.device, dtype=torch.float32)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        pos = torch.arange(start, end, device=idx.device)  # (t,)
        logits, _ = model(idx[:, start:end], input_pos=pos)  # (B, t, V)
        inside = (lengths - 1 >= start) & (lengths - 1 < end)  # (B,) sequences whose last token is here
        if inside.any():
            rows = inside.nonzero().squeeze(-1)
            last[rows] = logits[rows, lengths[rows] - 1 - start].float()
    return last


@torch.no_grad()
def decode_one_token(model, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """tok: (B, 1) the latest tokens, pos: (B, 1) their positions → logits (B, V)."""
    logits, _ = model(tok, input_pos=pos)  # (B, 1, V)
    return logits[:, -1].float()


class DecodeGraph:
    """decode_one_token captured once in a CUDA graph and replayed: one launch per step instead of hundreds."""

    def __init__(self, model, batch: int, device):
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm up (triton autotune, cuBLAS handles) outside the capture
            for _ in range(2):
                self.out = decode_one_token(model, self.tok, self.pos)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = decode_one_token(model, self.tok, self.pos)

    def __call__(self, tok, pos):
        self.tok.copy_(tok)
        self.pos.copy_(pos)
        self.graph.replay()
        return self.out


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    sequences: list = field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / max(self.decode_seconds, 1e-9)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model, prompts: list[list[int]], params: SamplingParams, *, generator=None, on_token=None,
             cuda_graph: bool = False, prefill_chunk: int = 0) -> GenerationStats:
    """Generate for a batch of token-id prompts. on_token(step, tokens (B,) list, done (B,) list) streams.

    Returns stats with `sequences`: each prompt's new tokens (stopping at params.stop_token, excluded).
    """
    device = model.lm_head.weight.device
    B = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # (B,)
    T = int(lengths.max())
    max_len = T + params.max_new_tokens
    idx = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        idx[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    model.setup_kv_cache(B, max_len)
    stats = GenerationStats(prompt_tokens=int(lengths.sum()))
    try:
        _sync(device)
        t0 = time.perf_counter()
        logits = prefill(model, idx, lengths, prefill_chunk)  # (B, V)
        tok = sample(logits, params, generator)  # (B,)
        _sync(device)
        stats.prefill_seconds = stats.time_to_first_token = time.perf_counter() - t0
        step_fn = DecodeGraph(model, B, device) if cuda_graph else (lambda t, p: decode_one_token(model, t, p))
        done = torch.zeros(B, dtype=torch.bool, device=device)
        out: list[list[int]] = [[] for _ in range(B)]
        pos = lengths.clone()[:, None]  # (B, 1): where each sequence's next token goes
        t1 = time.perf_counter()
        for step in range(params.max_new_tokens):
            if params.stop_token is not None:
                done |= tok == params.stop_token
            tok_list, done_list = tok.tolist(), done.tolist()
            for b in range(B):
                if not done_list[b]:
                    out[b].append(tok_list[b])
            if on_token is not None:
                on_token(step, tok_list, done_list)
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            logits = step_fn(tok[:, None], pos)
            tok = sample(logits, params, generator)
            pos = pos + 1
            stats.decode_steps += 1
        _sync(device)
        stats.decode_seconds = time.perf_counter() - t1
        stats.sequences = out
        stats.new_tokens = sum(len(o) for o in out) - sum(1 for o in out if o)  # first tokens came from prefill
    finally:
        model.clear_kv_cache()
    return stats
