import pytest

from data.tokenizers import CharTokenizer, GPT2Tokenizer, TokenizerError, tokenizer_from_spec


def test_gpt2_offline_ids():
    tok = GPT2Tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    text = "To be, or not to be: that is the question.\n¿Qué? 日本"
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 50257 and tok.eot_token == 50256


def test_char_round_trip_and_spec():
    tok = CharTokenizer.from_text("hello world\n")
    ids = tok.encode("hold")
    assert tok.decode(ids) == "hold"
    assert tok.vocab_size == len(set("hello world\n"))
    again = tokenizer_from_spec(tok.spec())
    assert again.encode("hello") == tok.encode("hello")
    with pytest.raises(TokenizerError, match="'z'"):
        tok.encode("z")


def test_bad_spec():
    with pytest.raises(TokenizerError):
        tokenizer_from_spec({"kind": "sentencepiece"})
