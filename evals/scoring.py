"""Log-likelihood of token continuations given token contexts, several per forward pass.

    score_continuations(model, [(context_ids, continuation_ids), ...], batch_size=16) -> [Scored, ...]
    score_with_progress(model, requests, desc="task")    # the same behind a progress bar (desc=None: none)
    rolling_windows(token_ids, prefix_id, block_size) -> [(context_ids, continuation_ids), ...]

A request (context, continuation) is scored as one sequence `context + continuation` through the model; the
score is the sum over the continuation's tokens of log P(token | every token before it), and `greedy` says
whether each of them is also the most likely token at its position (ties broken as torch.argmax does).

Context policy: a sequence longer than the model's block_size + 1 keeps its last block_size + 1 tokens (the
context is cut from the left; the continuation is always scored whole, so it must fit in block_size tokens).

Batching: requests are sorted longest first (the first batch is the largest, so running out of memory shows at
once, and rows of similar length share a batch), right-padded to the longest in their batch with token 0 and
run together. Causal attention keeps a row's real tokens from seeing its padding, so a request scores the
same in any batch (up to the last bits of floating-point sums). Results come back in the requests' order.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch

PAD_ID = 0  # any valid token id: padding sits after each row's real tokens and is never scored


@dataclass(frozen=True)
class Scored:
    logprob: float  # sum of log P(token | everything before it) over the continuation's tokens (natural log)
    greedy: bool    # every continuation token is the argmax of the model's prediction at its position
    tokens: int     # the continuation's length in tokens


def fit_window(context: Sequence[int], continuation: Sequence[int], block_size: int) -> list[int]:
    """The model input for a request: (context + continuation) cut to its last block_size + 1 tokens, less the
    last token (which is only predicted). Raises ValueError when the request cannot be scored."""
    if not continuation:
        raise ValueError("empty continuation: nothing to score")
    if not context:
        raise ValueError("empty context: the first continuation token has nothing to be predicted from "
                         "(prefix it with the end-of-text token)")
    if len(continuation) > block_size:
        raise ValueError(f"continuation of {len(continuation)} tokens does not fit the model's context of "
                         f"{block_size} tokens")
    return (list(context) + list(continuation))[-(block_size + 1):-1]


@torch.no_grad()
def score_continuations(model, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *, batch_size: int = 16,
                        autocast=None, progress=None) -> list[Scored]:
    """Score each (context ids, continuation ids) request with `model` (a flashgpt GPT); see the module's doc.

    autocast: a context manager entered around each forward pass (e.g. torch.autocast), or None.
    progress: called with the number of requests just scored after each batch (a progress bar's update).
    Log-softmax runs in float32, or float64 for a float64 model. The model is put in eval mode for the call
    and left in the mode it had. Raises ValueError for a request that cannot be scored (see fit_window).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    block_size = model.config.block_size
    inputs = [fit_window(ctx, cont, block_size) for ctx, cont in requests]
    conts = [list(cont) for _, cont in requests]
    order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
    device = model.lm_head.weight.device
    results: list[Scored | None] = [None] * len(requests)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            T = len(inputs[rows[0]])  # the longest of this batch (sorted)
            idx = torch.full((len(rows), T), PAD_ID, dtype=torch.long)      # (B, T) right-padded inputs
            targets = torch.full((len(rows), T), -1, dtype=torch.long)      # (B, T) -1 = not scored
            for b, i in enumerate(rows):
                L, n = len(inputs[i]), len(conts[i])
                idx[b, :L] = torch.tensor(inputs[i])
                targets[b, L - n:L] = torch.tensor(conts[i])  # position t predicts token t + 1 of the window
            idx, targets = idx.to(device), targets.to(device)
            with autocast if autocast is not None else contextlib.nullcontext():
                logits, _ = model(idx)  # (B, T, V)
            scored = targets >= 0                                           # (B, T)
            picked = logits[scored]                                         # (N, V) the scored positions only
            picked = picked.to(torch.promote_types(picked.dtype, torch.float32))
            wanted = targets[scored]                                        # (N,)
            logp = picked.log_softmax(-1).gather(1, wanted[:, None])[:, 0]  # (N,)
            hit = picked.argmax(-1) == wanted                               # (N,)
            row = scored.nonzero()[:, 0]                                    # (N,) batch row of each
            sums = torch.zeros(len(rows), dtype=logp.dtype, device=device).index_add_(0, row, logp)  # (B,)
            misses = torch.zeros(len(rows), dtype=torch.long, device=device).index_add_(0, row, (~hit).long())
            for b, (s, m) in enumerate(zip(sums.tolist(), misses.tolist())):
                results[rows[b]] = Scored(logprob=s, greedy=m == 0, tokens=len(conts[rows[b]]))
            if progress is not None:
                progress(len(rows))
    finally:
        model.train(was_training)
    return results


def score_with_progress(model, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *, desc: str | None,
                        unit: str = "request", batch_size: int = 16, autocast=None) -> list[Scored]:
    """score_continuations behind a tqdm progress bar named `desc` over the requests; desc None: no bar."""
    if desc is None:
        return score_continuations(model, requests, batch_size=batch_size, autocast=autocast)
    from tqdm import tqdm
    with tqdm(total=len(requests), desc=desc, unit=unit, dynamic_ncols=True) as bar:
        return score_continuations(model, requests, batch_size=batch_size, autocast=autocast, progress=bar.update)


def rolling_windows(tokens: Sequence[int], prefix_id: int, block_size: int) -> list[tuple[list[int], list[int]]]:
    """Requests that score every token of `tokens` exactly once, each with as much context as fits.

    The text is conditioned on `prefix_id` (the end-of-text token). Window k scores tokens
    [k·block_size, (k+1)·block_size) with everything before them as context (cut to fit by the context
    policy), so the sum of the windows' scores is log P(tokens | prefix) under a model of context block_size.
    """
    if not tokens:
        return []
    full = [prefix_id, *tokens]
    return [(full[max(0, s + 1 - block_size):s + 1], list(tokens[s:s + block_size]))
            for s in range(0, len(tokens), block_size)]
