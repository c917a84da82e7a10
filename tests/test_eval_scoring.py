"""evals/scoring.py: summed log-likelihoods of continuations, batched, against a naive float64 recomputation."""
import random

import pytest
import torch

from evals.scoring import Scored, fit_window, rolling_windows, score_continuations
from tests.eval_fixtures import tiny_gpt

VOCAB, BLOCK = 23, 16


def random_requests(n: int, seed: int = 0, max_ctx: int = 3 * BLOCK, max_cont: int = 6):
    rng = random.Random(seed)
    return [([rng.randrange(VOCAB) for _ in range(rng.randint(1, max_ctx))],
             [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_cont))]) for _ in range(n)]


@torch.no_grad()
def naive_score(model, context, continuation):
    """One forward pass per continuation token, float64, over the window the context policy keeps:
    the last block_size + 1 tokens of context + continuation; token p of the window is predicted from
    window[:p] alone."""
    window = (list(context) + list(continuation))[-(model.config.block_size + 1):]
    first = len(window) - len(continuation)
    total, greedy = 0.0, True
    for p in range(first, len(window)):
        logits, _ = model(torch.tensor([window[:p]]))  # (1, p, V)
        logp = torch.log_softmax(logits[0, -1].double(), dim=-1)  # (V,)
        total += logp[window[p]].item()
        greedy &= int(logp.argmax()) == window[p]
    return total, greedy


def test_scores_match_a_naive_float64_computation():
    model = tiny_gpt(VOCAB, BLOCK, dtype=torch.float64)
    requests = random_requests(12)
    assert any(len(c) + len(x) > BLOCK + 1 for c, x in requests)  # some contexts are cut
    model.train()  # the call scores in eval mode and gives the mode back
    got = score_continuations(model, requests, batch_size=5)
    assert model.training
    for (ctx, cont), s in zip(requests, got):
        want, greedy = naive_score(model.eval(), ctx, cont)
        assert s.tokens == len(cont)
        assert abs(s.logprob - want) < 1e-10, (s.logprob, want)
        assert s.greedy == greedy
    assert len({round(s.logprob, 6) for s in got}) == len(got)  # the requests really score differently


def test_greedy_continuation_is_flagged_greedy():
    model = tiny_gpt(VOCAB, BLOCK, dtype=torch.float64)
    ctx = [3, 1, 4, 1, 5]
    seq = list(ctx)
    with torch.no_grad():
        for _ in range(4):  # the model's own argmax continuation, token by token
            seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
    greedy_cont = seq[len(ctx):]
    other = greedy_cont[:-1] + [(greedy_cont[-1] + 1) % VOCAB]
    a, b = score_continuations(model, [(ctx, greedy_cont), (ctx, other)])
    assert a.greedy and not b.greedy
    assert a.logprob > b.logprob


@pytest.mark.parametrize("batch_size", [2, 3, 7, 100])
def test_batching_gives_the_scores_of_batch_one(batch_size):
    model = tiny_gpt(VOCAB, BLOCK)  # float32: padding must not change a row's result beyond rounding
    requests = random_requests(15, seed=1)
    one = score_continuations(model, requests, batch_size=1)
    many = score_continuations(model, requests, batch_size=batch_size)
    for a, b in zip(one, many):
        assert a.tokens == b.tokens and a.greedy == b.greedy
        assert abs(a.logprob - b.logprob) <= 1e-4 * max(1.0, abs(a.logprob))


def test_context_is_cut_from_the_left_at_block_size():
    model = tiny_gpt(VOCAB, BLOCK, dtype=torch.float64)
    cont = [7, 8, 9]
    kept = BLOCK + 1 - len(cont)  # context tokens that fit in the window
    tail = [(5 * i + 2) % VOCAB for i in range(kept)]
    long_a = [1] * (2 * BLOCK) + tail  # two contexts that differ only before the window
    long_b = [2, 3] * BLOCK + tail
    short = score_continuations(model, [(tail, cont)])[0]
    a, b = score_continuations(model, [(long_a, cont), (long_b, cont)], batch_size=2)
    assert a.logprob == pytest.approx(short.logprob, abs=1e-12)
    assert b.logprob == pytest.approx(short.logprob, abs=1e-12)
    cut_one_less = score_continuations(model, [(tail[1:], cont)])[0]  # a window one token shorter differs
    assert abs(cut_one_less.logprob - short.logprob) > 1e-6
    assert fit_window(long_a, cont, BLOCK) == (tail + cont)[:-1]
    assert len(fit_window(long_a, cont, BLOCK)) == BLOCK


def test_requests_that_cannot_be_scored():
    model = tiny_gpt(VOCAB, BLOCK)
    with pytest.raises(ValueError, match="empty continuation"):
        score_continuations(model, [([1], [])])
    with pytest.raises(ValueError, match="empty context"):
        score_continuations(model, [([], [1])])
    with pytest.raises(ValueError, match="does not fit"):
        score_continuations(model, [([1], [2] * (BLOCK + 1))])
    assert score_continuations(model, [([1], [2] * BLOCK)])[0].tokens == BLOCK  # exactly block_size fits
    assert score_continuations(model, []) == []


def test_rolling_windows_score_every_token_once_with_the_most_context():
    tokens = list(range(1, 41))  # 40 tokens, block 16: windows of 16, 16, 8
    windows = rolling_windows(tokens, prefix_id=0, block_size=BLOCK)
    assert [len(cont) for _, cont in windows] == [16, 16, 8]
    assert sum((cont for _, cont in windows), []) == tokens
    assert windows[0][0] == [0]  # the first token is predicted from the prefix alone
    for ctx, cont in windows:
        full = [0] + tokens
        start = full.index(cont[0])
        assert ctx == full[max(0, start - BLOCK):start]  # everything before, as much as a window holds
        assert len(fit_window(ctx, cont, BLOCK)) == min(BLOCK, start + len(cont) - 1)
    assert rolling_windows([], 0, BLOCK) == []
    assert Scored(0.0, True, 1).tokens == 1
