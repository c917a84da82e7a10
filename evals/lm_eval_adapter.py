"""A flashgpt model behind lm-evaluation-harness's `LM` interface, so that any of its tasks can score it.

    lm = harness_lm(model, tokenizer, batch_size=16)   # an lm_eval.api.model.LM (needs `pip install lm-eval`)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

`FlashGPTLM` holds the three request types of the interface and needs nothing from lm-eval (it reads only
`request.args`); `harness_lm` makes it a subclass of lm-eval's abstract `LM` and imports lm-eval for that.

    loglikelihood([(context, continuation)])  -> [(log P(continuation | context), is_greedy)]
    loglikelihood_rolling([(text,)])          -> [log P(text | end-of-text)], every token scored once, each with
                                                 as much context as the model's block_size holds
    generate_until([(context, gen_kwargs)])   -> [greedy continuation cut before its first stop string]

Tokenisation follows lm-eval's Hugging Face model: trailing whitespace of a context moves to the front of its
continuation; context + continuation is encoded whole and split after the context's own tokens (when those are
a prefix of the whole's; otherwise the two are encoded apart); an empty context is the end-of-text token.
Scores come from evals/scoring.py (batched, contexts cut from the left to fit block_size); generation from
model.generation.generate (the project's prefill + KV-cache decode), always greedy: `until` stop strings (and
the end-of-text token) end a sequence, `max_gen_toks` (default 256, at most block_size − 1) bounds it, and a
prompt keeps its last block_size − max_gen_toks tokens. Sampling options in gen_kwargs are ignored.

A model whose tokenizer has no end-of-text token (the character tokenizer) cannot score an empty context or
a rolling log-likelihood: those raise AdapterError.
"""
from __future__ import annotations

import functools

from .scoring import rolling_windows, score_with_progress

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until


class AdapterError(ValueError):
    """A request this model cannot serve; one line."""


class _AllStopped(Exception):
    """Raised from generate's token callback once every sequence of the batch has met a stop string."""


class FlashGPTLM:
    """lm-eval's LM request types over a flashgpt GPT and its tokenizer (see the module's doc).

    model: a GPT in eval-ready form (on its device and dtype); batch_size: sequences per forward pass;
    autocast: a context manager around scoring passes (or None); progress: show progress bars.
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 16, autocast=None, progress: bool = True):
        super().__init__()  # lm-eval's LM.__init__ when this is harness_lm's subclass
        self.model, self.tokenizer = model, tokenizer
        self._batch_size, self.autocast, self.progress = batch_size, autocast, progress

    # -------------------------------------------------------------- what lm-eval reads of a model, besides requests

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eot_token

    @property
    def max_length(self) -> int:
        return self.model.config.block_size

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self):
        return self.model.lm_head.weight.device

    @property
    def tokenizer_name(self) -> str:
        return f"flashgpt-{self.tokenizer.name}"

    def tok_encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    # ------------------------------------------------------------------------------------------ requests

    def _prefix(self, what: str) -> list[int]:
        if self.eot_token_id is None:
            raise AdapterError(f"{what} needs an end-of-text token to condition on, and this model's "
                               f"{self.tokenizer.name} tokenizer has none")
        return [self.eot_token_id]

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) for one loglikelihood request (see the module's doc)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return self._prefix("a request with an empty context"), self.tok_encode(continuation)
        whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
        if whole[:len(ctx)] == ctx and len(whole) > len(ctx):
            return ctx, whole[len(ctx):]
        return ctx, self.tok_encode(continuation)

    def _score(self, pairs, desc: str, disable_tqdm: bool):
        try:
            return score_with_progress(self.model, pairs, desc=desc if self.progress and not disable_tqdm else None,
                                       batch_size=self._batch_size, autocast=self.autocast)
        except ValueError as e:
            raise AdapterError(str(e)) from None

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*r.args) for r in requests]
        return [(s.logprob, s.greedy) for s in self._score(pairs, "loglikelihood", disable_tqdm)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for n, r in enumerate(requests):
            (text,) = r.args
            ids = self.tok_encode(text)
            prefix = self._prefix("loglikelihood_rolling")[0] if ids else 0
            for w in rolling_windows(ids, prefix, self.max_length):
                windows.append(w)
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, s in zip(owner, self._score(windows, "loglikelihood_rolling", disable_tqdm)):
            totals[n] += s.logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[tuple, list[int]] = {}  # (stop strings, max new tokens) → request indices
        prompts = []
        for n, r in enumerate(requests):
            context, kwargs = r.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(until)
            max_new = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            if max_new < 1:
                raise AdapterError(f"max_gen_toks={max_new}: must be >= 1")
            max_new = min(max_new, self.max_length - 1)
            ids = self.tok_encode(context) if context else self._prefix("generation from an empty context")
            prompts.append(ids[-(self.max_length - max_new):])
            groups.setdefault((tuple(s for s in until if s), max_new), []).append(n)
        out: list[str | None] = [None] * len(requests)
        bar = None
        if self.progress and not disable_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(requests), desc="generate_until", dynamic_ncols=True)
        try:
            for (until, max_new), members in groups.items():
                members = sorted(members, key=lambda n: -len(prompts[n]))  # similar lengths share a batch
                for start in range(0, len(members), self._batch_size):
                    batch = members[start:start + self._batch_size]
                    texts = self._generate([prompts[n] for n in batch], until, max_new)
                    for n, text in zip(batch, texts):
                        out[n] = text
                    if bar is not None:
                        bar.update(len(batch))
        finally:
            if bar is not None:
                bar.close()
        return out

    def _generate(self, prompts: list[list[int]], until: tuple[str, ...], max_new: int) -> list[str]:
        """Greedy continuations of `prompts`, each cut before the first of `until`; stops as soon as every
        sequence has ended (end-of-text token, a stop string, or max_new tokens)."""
        from model.generation import generate
        from model.sampling import SamplingParams
        tokens: list[list[int]] = [[] for _ in prompts]
        stopped = [False] * len(prompts)

        def on_token(step, new, done):  # mirrors generate's own bookkeeping, checks stop strings as it goes
            for b, tok in enumerate(new):
                if not done[b]:
                    tokens[b].append(tok)
                    if until and not stopped[b]:
                        text = self.tok_decode(tokens[b])
                        stopped[b] = any(s in text for s in until)
            if all(d or s for d, s in zip(done, stopped)):
                raise _AllStopped

        params = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_tokens=self.tokenizer.stop_tokens)
        was_training = self.model.training
        self.model.eval()
        try:
            generate(self.model, prompts, params, on_token=on_token)
        except _AllStopped:
            pass
        finally:
            self.model.train(was_training)
        return [cut_at_stops(self.tok_decode(t), until) for t in tokens]


def cut_at_stops(text: str, until: tuple[str, ...]) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string."""
    end = min((i for i in (text.find(s) for s in until if s) if i >= 0), default=len(text))
    return text[:end]


@functools.lru_cache(maxsize=1)
def harness_class() -> type:
    """FlashGPTLM as a subclass of lm_eval.api.model.LM. Raises ImportError when lm-eval is not installed."""
    from lm_eval.api.model import LM

    class FlashGPTHarnessLM(FlashGPTLM, LM):
        """A flashgpt model for lm-evaluation-harness (see evals/lm_eval_adapter.py)."""

    return FlashGPTHarnessLM


def harness_lm(model, tokenizer, **kwargs):
    """A FlashGPTLM that lm-eval's evaluator accepts as a model (an instance of its LM)."""
    return harness_class()(model, tokenizer, **kwargs)
