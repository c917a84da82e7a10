"""The Hugging Face tokenizer kind (a repo's tokenizer.json through `tokenizers`), its chat templates and the data
it tokenises, against transformers' AutoTokenizer on tokenizers built offline in the test."""
from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

from data.chat import ChatTemplateError, render_chat
from data.errors import DataError
from data.prepare import load_meta, prepare
from data.tokenizers import CharTokenizer, HFTokenizer, TokenizerError, hf_tokenizer, tokenizer_from_spec
from tests.hf_models import CHAT_TEMPLATE, write_tokenizer
from tests.util import write_corpus

TEXTS = ["the king and the queen", "Thou art fair, é 日本!\n\nend", "  spaces\tand<|im_end|>tabs", ""]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, corpus):
    with open(corpus) as f:
        return write_tokenizer(tmp_path_factory.mktemp("tok"), f.read().splitlines())


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory, corpus):
    with open(corpus) as f:
        return write_tokenizer(tmp_path_factory.mktemp("bos"), f.read().splitlines(), bos="<|im_start|>")


@pytest.mark.parametrize("folder", ["tok_dir", "bos_dir"])
def test_same_ids_as_transformers(folder, request):
    transformers = pytest.importorskip("transformers")
    folder = request.getfixturevalue(folder)
    ours, theirs = HFTokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False).input_ids
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    assert 2 in ours.encode(TEXTS[2])  # "<|im_end|>" written in the text is the special token
    assert ours.eot_token == theirs.eos_token_id == 0
    assert ours.vocab_size == len(theirs)


def test_bos_comes_from_the_post_processor(bos_dir, tok_dir):
    with_bos, without = HFTokenizer.from_folder(bos_dir), HFTokenizer.from_folder(tok_dir)
    assert with_bos.encode("the king")[0] == with_bos.bos_token == 1
    assert with_bos.encode("the king", add_special_tokens=False)[0] != 1
    assert without.encode("the king") == without.encode("the king", add_special_tokens=False)
    assert without.bos_token is None


def test_spec_rebuilds_the_tokenizer_without_its_folder(tok_dir, tmp_path):
    copy = shutil.copytree(tok_dir, tmp_path / "copy")
    tok = HFTokenizer.from_folder(str(copy))
    spec = json.loads(json.dumps(tok.spec()))  # JSON-able, as meta.json and checkpoints store it
    shutil.rmtree(copy)
    again = tokenizer_from_spec(spec)
    assert [again.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
    assert (again.eot_token, again.vocab_size, again.chat_template) == (tok.eot_token, tok.vocab_size, CHAT_TEMPLATE)
    damaged = dict(spec, tokenizer_json=spec["tokenizer_json"].replace("<|im_end|>", "<|im_fin|>", 1))
    assert damaged["tokenizer_json"] != spec["tokenizer_json"]
    with pytest.raises(TokenizerError, match="damaged: its tokenizer.json does not match its sha256"):
        tokenizer_from_spec(damaged)


def test_special_tokens_map_and_template_files(tok_dir, tmp_path):
    """special_tokens_map.json fills special tokens tokenizer_config.json leaves out; a template list, a
    chat_template.jinja file or (last) an image-text model's chat_template.json is read too."""
    folder = shutil.copytree(tok_dir, tmp_path / "t")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["eos_token"], config["chat_template"]
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "X"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    tok = HFTokenizer.from_folder(str(folder))
    assert tok.eot_token == 2 and tok.chat_template == "X"
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "from the processor"}))
    assert HFTokenizer.from_folder(str(folder)).chat_template == "from the processor"  # the last resort
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert HFTokenizer.from_folder(str(folder)).chat_template == "{{ messages[0]['content'] }}"


def test_generation_config_end_ids_are_stop_tokens(tok_dir, tmp_path):
    """generation_config.json's eos_token_id (an id or a list) joins eos_token as where generation stops, is kept
    in the spec, and leaves the spec as it was when it adds nothing."""
    folder = shutil.copytree(tok_dir, tmp_path / "gen")
    assert HFTokenizer.from_folder(str(folder)).stop_tokens == (0,)  # no generation_config.json: eos_token only
    for value, stops in ((1, (0, 1)), ([2, 0, 2], (0, 2)), ([], (0,)), (None, (0,))):
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        tok = HFTokenizer.from_folder(str(folder))
        assert tok.stop_tokens == stops and tok.eot_token == 0
        spec = json.loads(json.dumps(tok.spec()))
        assert ("generation_eos" in spec) == (stops != (0,))
        assert tokenizer_from_spec(spec).stop_tokens == stops
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    same = HFTokenizer.from_folder(str(folder), "x").spec(), HFTokenizer.from_folder(tok_dir, "x").spec()
    assert same[0] == same[1]
    for value, message in ((300, "eos_token_id 300 is outside the vocabulary of 300 tokens"),
                           ([1, -1], "eos_token_id -1 is outside the vocabulary"),
                           ("<|im_end|>", "eos_token_id must be a token id or a list of ids, not '<|im_end|>'"),
                           ([True], "must be a token id or a list of ids")):
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        with pytest.raises(TokenizerError, match=re.escape(message)):
            HFTokenizer.from_folder(str(folder), "hf:org/m")
    (folder / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="generation_config.json is not a JSON object"):
        HFTokenizer.from_folder(str(folder))


def test_bad_folders_are_one_line(tok_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(TokenizerError) as e:
        HFTokenizer.from_folder(str(tmp_path / "empty"), "hf:org/m")
    assert str(e.value) == ("hf:org/m has no tokenizer.json (the only tokenizer format read here; it has "
                            "tokenizer.model)")
    folder = shutil.copytree(tok_dir, tmp_path / "eos")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, eos_token="</s>")))
    with pytest.raises(TokenizerError, match=r"eos_token '</s>' is not in tokenizer.json"):
        HFTokenizer.from_folder(str(folder))
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json is not a valid tokenizers file"):
        HFTokenizer.from_folder(str(folder))


def test_hub_id_offline_names_the_repo_and_file(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TokenizerError) as e:
        hf_tokenizer("HuggingFaceTB/SmolLM2-135M")
    msg = str(e.value)
    assert "'HuggingFaceTB/SmolLM2-135M'" in msg and "HF_HUB_OFFLINE" in msg and "tokenizer.json" in msg
    assert "\n" not in msg


# ------------------------------------------------------------------------------------------------ chat templates

LLAMA3_LIKE = ("{{ bos_token }}{% for m in messages %}{% if loop.index0 > 5 %}{% break %}{% endif %}"
               "<|start|>{{ m['role'] }}\n\n{{ m['content'] | trim }}<|eot|>{% endfor %}"
               "{% if add_generation_prompt %}<|start|>assistant\n\n{% endif %}{{ {'x': 'é'} | tojson }}")


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, LLAMA3_LIKE], ids=["chatml", "llama3-like"])
def test_render_chat_as_transformers_renders_it(template, tok_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = shutil.copytree(tok_dir, tmp_path / "t")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template,
                                                                  bos_token="<|im_start|>")))
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Who art thou?"}]
    for gen in (True, False):
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        got = render_chat(template, messages, bos_token="<|im_start|>", eos_token="<|endoftext|>",
                          add_generation_prompt=gen)
        assert got == want and "Who art thou?" in got


@pytest.mark.parametrize("template, needle", [
    ("{{ messages.__class__.__mro__ }}", "unsafe operation, refused"),
    ("{{ messages.append(1) }}", "unsafe operation, refused"),
    ("{% if messages|length > 0 %}{{ raise_exception('only one turn') }}{% endif %}",
     "the chat template refused the conversation: only one turn"),
    ("{% for m in messages %}", "cannot be rendered (TemplateSyntaxError"),
])
def test_render_chat_refuses_in_one_line(template, needle):
    with pytest.raises(ChatTemplateError) as e:
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- tokenised data

def test_prepare_with_a_hub_tokenizer(corpus, tok_dir, tmp_path):
    cache = str(tmp_path / "cache")
    folder = prepare(corpus, f"hf:{tok_dir}", cache_dir=cache, num_proc=2, verbose=False)
    meta = load_meta(folder)
    tok = tokenizer_from_spec(meta["tokenizer"])
    assert meta["tokenizer"]["kind"] == "hf" and meta["vocab_size"] == tok.vocab_size
    ids = np.concatenate([np.fromfile(os.path.join(folder, f"{s}.bin"), dtype=meta["dtype"]) for s in ("train", "val")])
    with open(corpus) as f:
        text = f.read()
    assert ids[-1] == tok.eot_token and (ids == tok.eot_token).sum() == 1  # one document, ended by EOS
    assert tok.decode(ids[:-1].tolist()) == text
    # the spec itself (what a checkpoint holds) names the same token files: no second tokenisation
    assert prepare(corpus, meta["tokenizer"], cache_dir=cache, verbose=False) == folder


def test_prepare_with_a_fixed_alphabet(corpus, tmp_path):
    with open(corpus) as f:
        alphabet = "".join(sorted(set(f.read())))
    folder = prepare(corpus, CharTokenizer(alphabet + "Z").spec(), cache_dir=str(tmp_path), verbose=False)
    assert load_meta(folder)["vocab_size"] == len(alphabet) + 1  # the given alphabet, not the corpus's
    with pytest.raises(DataError, match=r"characters the model's alphabet lacks: 'k'"):
        prepare(corpus, CharTokenizer(alphabet.replace("k", "")).spec(), cache_dir=str(tmp_path), verbose=False)
