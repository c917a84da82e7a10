"""Chat generation: replies end at the template's end-of-turn token, and `generate.py --chat` without prompts holds
a conversation on stdin (each prompt the whole conversation rendered again, the oldest exchanges left out when it
no longer fits, /reset, /exit, a message that cannot be answered refused in one line while the conversation goes
on). A tiny random Llama with a BPE tokenizer and a ChatML template, built offline."""
from __future__ import annotations

import io
import sys

import pytest

pytest.importorskip("transformers")

from data.chat import render_chat  # noqa: E402
from data.conversation import Conversation, ConversationError, end_of_turn_token  # noqa: E402
from data.tokenizers import HFTokenizer  # noqa: E402
from tests.hf_models import SPECIAL, tiny_llama, write_tokenizer  # noqa: E402
from tests.util import run_entry, write_corpus  # noqa: E402

BLOCK = 256  # the tiny model's max_position_embeddings: its context


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat_model")
    with open(write_corpus(tmp / "corpus", n_lines=300)) as f:
        lines = f.read().splitlines()
    path = write_tokenizer(tmp / "tiny", lines)
    tiny_llama(path, 320)
    return path


def render(tok, messages) -> list[int]:
    text = render_chat(tok.chat_template, messages, bos_token=tok.bos_text, eos_token=tok.eos_text)
    return tok.encode(text, add_special_tokens=False)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_end_of_turn_token_of_each_kind_of_template(folder, tmp_path):
    tok = HFTokenizer.from_folder(folder)
    assert end_of_turn_token(tok) == SPECIAL.index("<|im_end|>")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_token(tok) is None  # a newline ends a turn: no token to stop at
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} and more words{% endfor %}"
    assert end_of_turn_token(tok) is None  # what follows is text of several tokens
    tok.chat_template = "{{ raise_exception('no') }}"
    assert end_of_turn_token(tok) is None
    tok.chat_template = None
    assert end_of_turn_token(tok) is None


def test_conversation_renders_every_turn_and_leaves_out_the_oldest(folder):
    tok = HFTokenizer.from_folder(folder)
    conv = Conversation(tok, system="be brief")
    ids, dropped = conv.prompt_ids("first question", room=BLOCK)
    assert dropped == 0 and ids == render(tok, [{"role": "system", "content": "be brief"}, user("first question")])
    conv.add_exchange("first question", "first answer")
    conv.add_exchange("second question", "second answer")
    whole = render(tok, [{"role": "system", "content": "be brief"}, user("first question"), assistant("first answer"),
                         user("second question"), assistant("second answer"), user("third")])
    ids, dropped = conv.prompt_ids("third", room=BLOCK)
    assert dropped == 0 and ids == whole
    last_only = render(tok, [{"role": "system", "content": "be brief"}, user("second question"),
                             assistant("second answer"), user("third")])
    ids, dropped = conv.prompt_ids("third", room=len(whole) - 1)
    assert dropped == 1 and ids == last_only and conv.exchanges == [("second question", "second answer")]
    with pytest.raises(ConversationError, match=r"takes \d+ tokens .* and the system message; the context leaves "
                                                r"room for 3"):
        conv.prompt_ids("third", room=3)
    assert conv.exchanges == [("second question", "second answer")]  # a refused message changes nothing
    conv.reset()
    assert conv.exchanges == [] and conv.prompt_ids("x", BLOCK)[0] == render(
        tok, [{"role": "system", "content": "be brief"}, user("x")])
    tok.chat_template = None
    with pytest.raises(ConversationError, match="no chat template"):
        Conversation(tok)


def test_conversation_on_stdin_answers_in_context(folder, monkeypatch):
    """Every prompt is the conversation so far; /reset starts over (greedy: the same reply again); /exit ends
    before the lines after it; each reply is printed on its own line."""
    import generate as gen_mod
    calls = []
    real = gen_mod.generate

    def recording(model, prompts, params, **kw):
        stats = real(model, prompts, params, **kw)
        calls.append((prompts[0], stats.sequences[0], params.stop_tokens))
        return stats

    monkeypatch.setattr(gen_mod, "generate", recording)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n\n  and then?\n/reset\nhello there\n/exit\nnever\n"))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    rc = gen_mod.main(["--init-from", f"hf:{folder}", "--chat", "--device", "cpu", "--temperature", "0",
                       "--max-new-tokens", "6", "--no-stream"])
    assert rc == 0 and len(calls) == 3
    tok = HFTokenizer.from_folder(folder)
    replies = [tok.decode(seq) for _, seq, _ in calls]
    assert calls[0][0] == render(tok, [user("hello there")])
    assert calls[1][0] == render(tok, [user("hello there"), assistant(replies[0]), user("  and then?")])
    assert calls[2][0] == calls[0][0] and calls[2][1] == calls[0][1]
    assert set(calls[0][2]) == {tok.eot_token, SPECIAL.index("<|im_end|>")}
    assert out.getvalue() == "".join(r + "\n" for r in replies)


def test_conversation_cli_streams_leaves_out_old_turns_and_refuses_long_messages(folder):
    """Through the CLI as a user pipes it: 200 new tokens leave room for 56; a reply from the random model runs
    to its limit, so the next prompt leaves out the first exchange; a message longer than the room is refused in
    one line, the next one still answered, and the exit status says one was refused."""
    long = " ".join(["word"] * 80)
    r = run_entry("generate.py", "--init-from", f"hf:{folder}", "--chat", "--device", "cpu", "--max-new-tokens",
                  "200", "--no-stop", "--system", "be brief", stdin=f"hello\nagain\n{long}\nlast\n")
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "and the system message; the context leaves room for 56" in errors[0], r.stderr
    assert r.stderr.count("note: the 1 oldest exchange(s) of the conversation left out to fit the context of 256 "
                          "tokens") == 2, r.stderr
    assert r.stderr.count(" new] time to first token") == 3 and r.stdout.count("\n") >= 3


@pytest.mark.parametrize("args,stdin,message", [
    (["--system", "x", "--prompt", "hi"], None, "--system needs --chat"),
    (["--chat", "--num-samples", "2"], "hi\n", "--num-samples > 1 needs prompts"),
    (["--chat", "--max-new-tokens", "256"], "hi\n", "leaves no room for a message"),
])
def test_conversation_bad_arguments_are_one_line(folder, args, stdin, message):
    r = run_entry("generate.py", "--init-from", f"hf:{folder}", "--device", "cpu", *args, stdin=stdin)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines[-1].startswith("error: ") and message in lines[-1], r.stderr
    assert sum(line.startswith("error: ") for line in lines) == 1 and r.stdout == ""


def test_one_prompt_with_a_system_message(folder, monkeypatch):
    """--chat --prompt with --system: one conversation of the system message and the prompt, per prompt."""
    import generate as gen_mod
    seen = []
    real = gen_mod.generate

    def recording(model, prompts, params, **kw):
        seen.extend(prompts)
        return real(model, prompts, params, **kw)

    monkeypatch.setattr(gen_mod, "generate", recording)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    rc = gen_mod.main(["--init-from", f"hf:{folder}", "--chat", "--system", "be brief", "--prompt", "a",
                       "--prompt", "b c", "--device", "cpu", "--max-new-tokens", "3"])
    tok = HFTokenizer.from_folder(folder)
    system = {"role": "system", "content": "be brief"}
    assert rc == 0 and seen == [render(tok, [system, user("a")]), render(tok, [system, user("b c")])]


def test_stdin_that_is_not_utf8_is_one_line(folder):
    """A message in another encoding: the messages before it are answered, then one error line and exit 2."""
    import os
    import subprocess

    from tests.util import ROOT
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"), "--init-from", f"hf:{folder}", "--chat",
                        "--device", "cpu", "--max-new-tokens", "3"], input="hello\ncaf\u00e9\n".encode("latin-1"),
                       capture_output=True, timeout=300, cwd=ROOT, env=dict(env, PYTHONIOENCODING="utf-8"))
    lines = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2 and lines[-1] == "error: standard input is not UTF-8 text (after 1 answered message(s))", lines
    assert sum(" new] time to first token" in line for line in lines) == 1
