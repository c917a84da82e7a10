"""Perplexity of a model on held-out text: every token of every document scored once.

    docs = read_documents("held_out.jsonl", limit=None)      # .txt (one document a file), .jsonl(.gz), .parquet,
    metrics = evaluate(model, tokenizer, docs)                # a folder or glob of them, or hf:NAME[:CONFIG]

Each document is tokenised whole (the tokenizer's own special tokens included) and scored by rolling windows
(evals/scoring.rolling_windows, lm-evaluation-harness's loglikelihood_rolling): the windows cut the tokens into
block_size pieces, each scored with as much of the text before it as the context holds, so a document longer
than the model's context is scored at that context, as the harness scores wikitext. What the first token is
conditioned on:
  - a tokenizer that starts every encoding with its BOS token (Llama-3's post-processor): that BOS token, which
    is then not scored (Hugging Face's convention for perplexity);
  - else the end-of-text token (GPT-2's <|endoftext|>, a fine-tuned model's eos_token), as the harness does;
  - else (a character model trained on token files, with no such token) nothing: the first token of each
    document is the context and is not scored; its bytes and words are left out of the counts.

Metrics, as the harness's wikitext task names them (natural-log likelihoods; bytes are UTF-8 bytes, words are
whitespace-separated): token_perplexity = exp(nll / tokens), word_perplexity = exp(nll / words),
byte_perplexity = exp(nll / bytes), bits_per_byte = nll / (bytes · ln 2). Bits per byte compares models with
different tokenizers; token perplexity does not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .scoring import rolling_windows, score_with_progress


class PerplexityError(ValueError):
    """Data or a model that cannot be scored; one line."""


@dataclass(frozen=True)
class Encoded:
    prefix: int          # the id the first scored token is conditioned on
    tokens: list[int]    # the scored ids
    words: int           # whitespace-separated words of the scored text
    bytes: int           # UTF-8 bytes of the scored text
    conditioned_on: str  # what `prefix` is, in words


def read_documents(source: str, limit: int | None = None, text_column: str = "text") -> list[str]:
    """The non-empty texts of `source` (any corpus data.dataset takes), the first `limit` of them."""
    from data.errors import DataError
    from data.sources import Source
    docs = []
    try:
        for text in Source(source, text_column).rows():
            if text:
                docs.append(text)
                if limit is not None and len(docs) >= limit:
                    break
    except DataError as e:
        raise PerplexityError(str(e).removeprefix("data.dataset: ")) from None
    if not docs:
        raise PerplexityError(f"{source!r} holds no text to score")
    return docs


def encode(tokenizer, text: str) -> Encoded | None:
    """What of `text` is scored and what it is conditioned on (see the module's doc); None for a text of one
    token under a tokenizer with nothing to condition on."""
    ids = list(tokenizer.encode(text))
    bos = getattr(tokenizer, "bos_token", None)
    if bos is not None and len(ids) > 1 and ids[0] == bos:
        return Encoded(bos, ids[1:], len(text.split()), len(text.encode("utf-8")), "the BOS token")
    if tokenizer.eot_token is not None:
        return Encoded(tokenizer.eot_token, ids, len(text.split()), len(text.encode("utf-8")),
                       "the end-of-text token")
    if len(ids) < 2:
        return None
    scored = tokenizer.decode(ids[1:])  # the character tokenizer: the text less its first character
    return Encoded(ids[0], ids[1:], len(scored.split()), len(scored.encode("utf-8")), "nothing (not scored)")


def encode_documents(tokenizer, docs: list[str], vocab_size: int) -> list[Encoded]:
    """Each document's Encoded (those with nothing to score left out); PerplexityError when none is left, a
    document holds what the tokenizer cannot encode, or an id falls outside the model's vocabulary."""
    try:
        encoded = [e for e in (encode(tokenizer, d) for d in docs) if e is not None and e.tokens]
    except ValueError as e:  # TokenizerError: a character outside a character model's alphabet
        raise PerplexityError(str(e)) from None
    if not encoded:
        raise PerplexityError("no document has a token to score (each is a single token, with nothing to "
                              "condition it on)")
    too_big = max(max(e.tokens) for e in encoded)
    if too_big >= vocab_size:
        raise PerplexityError(f"the tokenizer gives id {too_big}, outside the model's vocabulary of {vocab_size}")
    return encoded


def evaluate(model, tokenizer, docs: list[str] | list[Encoded], *, batch_size: int = 16, autocast=None,
             progress: bool = False) -> dict:
    """The metrics of the module's doc over `docs` (texts, or what encode_documents made of them), with their
    counts."""
    block_size = model.config.block_size
    encoded = docs if docs and isinstance(docs[0], Encoded) else \
        encode_documents(tokenizer, docs, model.config.vocab_size)
    windows = [w for e in encoded for w in rolling_windows(e.tokens, e.prefix, block_size)]
    scored = score_with_progress(model, windows, desc="perplexity" if progress else None, unit="window",
                                 batch_size=batch_size, autocast=autocast)
    nll = -math.fsum(s.logprob for s in scored)
    tokens = sum(len(e.tokens) for e in encoded)
    words, nbytes = sum(e.words for e in encoded), sum(e.bytes for e in encoded)

    def per(n: int) -> float | None:
        return nll / n if n else None

    return {"documents": len(encoded), "tokens": tokens, "words": words, "bytes": nbytes, "nll": nll,
            "nll_per_token": per(tokens), "token_perplexity": math.exp(per(tokens)),
            "word_perplexity": math.exp(per(words)) if words else None,
            "byte_perplexity": math.exp(per(nbytes)) if nbytes else None,
            "bits_per_byte": per(nbytes) / math.log(2) if nbytes else None,
            "context": block_size, "windows": len(windows),
            "first_token_conditioned_on": encoded[0].conditioned_on}
