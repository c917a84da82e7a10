"""Conversations for supervised fine-tuning (data/chat_data.py, data.format = "chat"): the chat template's text,
the assistant's turns (reply and end-of-turn marker) as the only targets, the windows a run trains on, and bad
input as one line."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from data.chat_data import ChatData, _messages, conversation_of, encode_conversation, prepare_chat
from data.errors import DataError
from data.tokenizers import HFTokenizer
from tests.hf_models import write_tokenizer

WORDS = "the king and queen speak of love night fair crown sword".split()


def conversation(i: int, turns: int = 2, system: bool = False) -> list[dict]:
    msgs = [{"role": "system", "content": "be brief"}] if system else []
    for t in range(turns):
        w = WORDS[(i + t) % len(WORDS)]
        msgs += [{"role": "user", "content": f"say {w} {i}"}, {"role": "assistant", "content": f"{w} {w}"}]
    return msgs


def write_jsonl(path, rows, column="messages") -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps({column: r, "id": n}) + "\n" for n, r in enumerate(rows))
    return str(path)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [m["content"] for i in range(40) for m in conversation(i, system=True)]
    return HFTokenizer.from_folder(write_tokenizer(tmp_path_factory.mktemp("tok") / "t", texts))


def test_only_the_assistant_turns_are_targets(tok):
    msgs = conversation(3, turns=2, system=True)
    ids, mask = encode_conversation(tok, msgs)
    assert len(ids) == len(mask) and ids[-1] == tok.eot_token and mask[-1] == 1  # ends with the reply: stop here
    from data.chat import render_chat
    text = render_chat(tok.chat_template, msgs, add_generation_prompt=False)
    assert tok.decode(ids[:-1]) == text  # the template's text, encoded whole
    runs, current = [], []
    for i, m in zip(ids, mask):  # the targets in contiguous runs
        if m:
            current.append(i)
        elif current:
            runs.append(tok.decode(current))
            current = []
    runs.append(tok.decode(current))
    assert runs == [f"{m['content']}<|im_end|>\n" for m in msgs if m["role"] == "assistant"][:-1] + [
        f"{msgs[-1]['content']}<|im_end|>\n<|endoftext|>"]
    # a conversation that ends with the user's turn: its end-of-text token is not a target
    ids, mask = encode_conversation(tok, msgs + [{"role": "user", "content": "thanks"}])
    assert ids[-1] == tok.eot_token and mask[-1] == 0


def test_sharegpt_rows_are_the_same_conversation(tmp_path, tok):
    msgs = conversation(5)
    share = [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in msgs]
    assert encode_conversation(tok, msgs) == encode_conversation(tok, _messages(share, "row"))


def test_instruction_rows_are_one_exchange(tmp_path, tok):
    """Alpaca (instruction / input / output) and Dolly (instruction / context / response) rows, from .jsonl and
    .parquet: the user's message is the instruction, a blank line and the input where there is one; a system
    field comes first. The prepared folder holds the same tokens as the same conversations as messages."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    alpaca = [{"instruction": f"say {w}", "input": "" if i % 2 else f"twice {i}", "output": f"{w} {w}"}
              for i, w in enumerate(WORDS[:6])]
    dolly = [{"instruction": f"name {w}", "context": f"of {i}", "response": w, "category": "qa", "system": "be brief"}
             for i, w in enumerate(WORDS[:6])]
    want = [[{"role": "user", "content": r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")},
             {"role": "assistant", "content": r["output"]}] for r in alpaca]
    want += [[{"role": "system", "content": "be brief"},
              {"role": "user", "content": f"{r['instruction']}\n\n{r['context']}"},
              {"role": "assistant", "content": r["response"]}] for r in dolly]
    assert [conversation_of(r, "messages", "row") for r in alpaca + dolly] == want
    with open(tmp_path / "inst.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in alpaca + dolly)
    pq.write_table(pa.Table.from_pylist(alpaca), tmp_path / "alpaca.parquet")
    as_messages = write_jsonl(tmp_path / "m.jsonl", want)
    kw = dict(val_fraction=0.25, verbose=False)
    folders = [prepare_chat(src, tok.spec(), cache_dir=str(tmp_path / f"cache{n}"), **kw)
               for n, src in enumerate([str(tmp_path / "inst.jsonl"), as_messages])]
    for name in ("train.bin", "train.mask", "val.bin", "val.mask", "train.starts"):
        a, b = (open(os.path.join(f, name), "rb").read() for f in folders)
        assert a == b and a, name
    parquet = prepare_chat(str(tmp_path / "alpaca.parquet"), tok.spec(), cache_dir=str(tmp_path / "cache2"), **kw)
    jsonl = prepare_chat(write_jsonl(tmp_path / "a.jsonl", want[:6]), tok.spec(), cache_dir=str(tmp_path / "c3"), **kw)
    assert open(os.path.join(parquet, "train.bin"), "rb").read() == open(os.path.join(jsonl, "train.bin"), "rb").read()


def test_prepared_folder_and_its_windows(tmp_path, tok):
    rows = [conversation(i, turns=1 + i % 3, system=i % 2 == 0) for i in range(30)]
    src = write_jsonl(tmp_path / "chats.jsonl", rows)
    folder = prepare_chat(src, tok.spec(), val_fraction=0.2, cache_dir=str(tmp_path / "cache"), verbose=False)
    assert prepare_chat(src, tok.spec(), val_fraction=0.2, cache_dir=str(tmp_path / "cache"), verbose=False) == folder
    meta = json.load(open(os.path.join(folder, "meta.json")))
    assert (meta["train_conversations"], meta["val_conversations"]) == (24, 6)
    encoded = [encode_conversation(tok, r) for r in rows]
    want_train = [t for i, _ in encoded[:24] for t in i]
    assert np.fromfile(os.path.join(folder, "train.bin"), dtype=meta["dtype"]).tolist() == want_train
    assert meta["val_targets"] == sum(sum(m) for _, m in encoded[24:])
    block = 24
    data = ChatData(folder, block, seed=1)
    starts = np.cumsum([0] + [len(i) for i, _ in encoded[:24]])[:-1]
    flat_ids = np.array(want_train)
    flat_mask = np.array([t for _, m in encoded[:24] for t in m])
    (x, y), = data.train_batches(batch_size=16, accum=1)
    assert x.shape == y.shape == (16, block)
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        s = next(p for p in starts if (flat_ids[p:p + block] == row_x[:len(flat_ids[p:p + block])]).all())
        nxt = flat_ids[s + 1:s + 1 + block]
        targets = flat_mask[s + 1:s + 1 + block] == 1
        assert (row_y[:len(nxt)] == np.where(targets, nxt, -1)).all()  # -1 exactly where not a target
        assert (row_y != -1).any()  # every window holds a target
    # the data position resumes exactly
    state = data.state_dict()
    a = data.train_batches(4, 2)
    data.load_state_dict(state)
    b = data.train_batches(4, 2)
    assert all((xa == xb).all() and (ya == yb).all() for (xa, ya), (xb, yb) in zip(a, b))
    # past the split's end a window is padded and masked
    val = ChatData(folder, 4096, seed=0)
    vx, vy = val.eval_batch("val", 2)
    assert vx.shape == (2, 4096) and (vy[:, -100:] == -1).all()
    assert 0 < data.unigram_loss() < np.log(tok.vocab_size) + 1


def test_conversations_without_a_target_in_the_window_are_never_drawn(tmp_path, tok):
    long_prompt = [{"role": "user", "content": " ".join(WORDS * 8)}, {"role": "assistant", "content": "king"}]
    rows = [long_prompt] + [conversation(i) for i in range(6)]
    folder = prepare_chat(write_jsonl(tmp_path / "c.jsonl", rows), tok.spec(), val_fraction=0.3,
                          cache_dir=str(tmp_path / "cache"), verbose=False)
    data = ChatData(folder, 32, seed=0)
    assert data.dropped == {"train": 1, "val": 0} and len(data.starts["train"]) == 4
    with pytest.raises(DataError, match="no train conversation .* within the first 4 tokens"):
        ChatData(folder, 4, seed=0)


@pytest.mark.parametrize("row, message", [
    ([{"role": "user", "content": "hi"}], "row 2: no assistant turn"),
    ("just text", "row 2: not a conversation"),
    ([{"role": "robot", "content": "hi"}], "row 2: message 0 needs a role"),
    ([{"role": "user", "content": 3}], "row 2: message 0 needs a role"),
    ({"text": "hi"}, "row 2: no 'messages' field (data.messages_column) and no instruction / output (Alpaca) or "
                     "instruction / response (Dolly) fields; its fields: text"),
    ({"instruction": "hi", "output": None}, "row 2: field 'output' holds null, not text"),
    ({"instruction": "hi", "input": 3, "output": "yo"}, "row 2: field 'input' holds 3, not text"),
])
def test_bad_rows_are_one_line(tmp_path, tok, row, message):
    rows = [{"messages": conversation(0)}, row if isinstance(row, dict) else {"messages": row},
            {"messages": conversation(1)}]
    src = str(tmp_path / "c.jsonl")
    with open(src, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with pytest.raises(DataError) as e:
        prepare_chat(src, tok.spec(), cache_dir=str(tmp_path / "cache"), verbose=False)
    assert message in str(e.value) and "\n" not in str(e.value) and "c.jsonl" in str(e.value)
    assert not os.path.exists(tmp_path / "cache" / "chat") or not any(
        os.path.isfile(os.path.join(tmp_path / "cache" / "chat", d, "meta.json"))
        for d in os.listdir(tmp_path / "cache" / "chat"))


def test_tokenizers_and_templates_that_cannot_serve(tmp_path, tok):
    src = write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(4)])
    for name in ("gpt2", "char"):
        with pytest.raises(DataError, match=f"the {name} tokenizer has none"):
            prepare_chat(src, name, cache_dir=str(tmp_path / "cache"), verbose=False)
    # a template that writes the last message differently from the same message followed by others
    odd = dict(tok.spec(), chat_template="{% for m in messages %}{% if loop.last %}[{{ m['content'] }}]{% else %}"
                                        "{{ m['content'] }}|{% endif %}{% endfor %}")
    with pytest.raises(DataError, match="row 1: the chat template does not write the conversation up to message 1"):
        prepare_chat(src, odd, cache_dir=str(tmp_path / "cache"), verbose=False)
    (tmp_path / "t.txt").write_text("plain text")
    with pytest.raises(DataError, match="is a .txt file"):
        prepare_chat(str(tmp_path / "t.txt"), tok.spec(), cache_dir=str(tmp_path / "cache"), verbose=False)
