"""evals/lm_eval_adapter.py: lm-eval's LM request types on tiny models, and lm-evaluation-harness itself.

The request methods are tested on any install (they read only `request.args`); the tests that run the harness
need lm-eval (`pip install 'flashgpt[eval]'`, part of the dev extra) and are skipped without it.
"""
import json
import math
import os
import re
import sys

import pytest
import torch

from data.tokenizers import tokenizer_from_spec
from evals import hellaswag
from evals.lm_eval_adapter import AdapterError, FlashGPTLM, cut_at_stops
from model.generation import generate
from model.sampling import SamplingParams
from tests.eval_fixtures import GPT2_VOCAB, HELLASWAG_FIXTURE, char_tokenizer_for, save_tiny_checkpoint, tiny_gpt
from tests.util import run_entry

GPT2 = tokenizer_from_spec({"kind": "gpt2"})
EOT = GPT2.eot_token
CHARS = char_tokenizer_for("the king and queen sword night love crown speak thou art fair,.")


class Req:
    """The part of lm-eval's Instance that the adapter reads."""

    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def gpt2_model():
    return tiny_gpt(GPT2_VOCAB, block_size=16, n_layer=1, dtype=torch.float64)


@pytest.fixture(scope="module")
def char_model():
    return tiny_gpt(CHARS.vocab_size, block_size=24, seed=3)


def greedy_text(model, tok, context: str, n: int) -> str:
    out = generate(model, [tok.encode(context)], SamplingParams(temperature=0, max_new_tokens=n))
    return tok.decode(out.sequences[0])


@torch.no_grad()
def naive_logprob(model, context_ids, target_ids) -> float:
    """log P(targets | context) under the context policy (the last block_size + 1 tokens of context + targets
    form one window), one forward pass per target token."""
    window = (list(context_ids) + list(target_ids))[-(model.config.block_size + 1):]
    total = 0.0
    for p in range(len(window) - len(target_ids), len(window)):
        total += torch.log_softmax(model(torch.tensor([window[:p]]))[0][0, -1].double(), -1)[window[p]].item()
    return total


# ------------------------------------------------------------------------------------------------ requests


def test_loglikelihood_follows_lm_eval_tokenisation(gpt2_model):
    lm = FlashGPTLM(gpt2_model, GPT2, progress=False)
    assert lm.encode_pair("Hello ", "world") == (GPT2.encode("Hello"), GPT2.encode(" world"))  # space moves
    assert lm.encode_pair("", "Hi there") == ([EOT], GPT2.encode("Hi there"))  # empty context: end-of-text
    assert lm.encode_pair("The cat sat on the", " mat") == (GPT2.encode("The cat sat on the"), GPT2.encode(" mat"))
    requests = [Req("The cat sat on the", " mat"), Req("Hello ", "world"), Req("", "Hi there"),
                Req("Once upon a time there was a very long context that does not fit", " at all, no")]
    got = lm.loglikelihood(requests)
    for (ctx, cont), (logprob, greedy) in zip((lm.encode_pair(*r.args) for r in requests), got):
        assert logprob == pytest.approx(naive_logprob(gpt2_model, ctx, cont), abs=1e-9)
        assert isinstance(greedy, bool)
    assert len({round(lp, 6) for lp, _ in got}) == 4


def test_is_greedy_is_true_for_the_models_own_continuation(char_model):
    lm = FlashGPTLM(char_model, CHARS, progress=False)
    text = greedy_text(char_model, CHARS, "the king", 5)
    other = text[:-1] + ("a" if text[-1] != "a" else "e")
    (lp_greedy, is_greedy), (lp_other, not_greedy) = lm.loglikelihood([Req("the king", text), Req("the king", other)])
    assert is_greedy and not not_greedy and lp_greedy > lp_other


def test_loglikelihood_rolling_scores_every_token_with_as_much_context_as_fits(gpt2_model):
    lm = FlashGPTLM(gpt2_model, GPT2, batch_size=2, progress=False)
    long_text = "The quick brown fox jumps over the lazy dog. " * 4  # 44 tokens: windows of 16, 16, 12
    short_text = "A short one."
    ids = GPT2.encode(long_text)
    assert len(ids) > 2 * gpt2_model.config.block_size
    # every token predicted once; token i of window k (tokens [16k, 16k + 16)) sees the window's context
    full, want = [EOT] + ids, 0.0
    B = gpt2_model.config.block_size
    for start in range(0, len(ids), B):
        end = min(start + B, len(ids))      # the window predicts ids[start:end] = full[start + 1:end + 1]
        first = max(0, end - B)             # its inputs are full[first:end]
        for j in range(start + 1, end + 1):  # full[j] predicted from full[first:j]
            want += naive_logprob(gpt2_model, full[first:j], [full[j]])
    long_lp, short_lp, empty_lp = lm.loglikelihood_rolling([Req(long_text), Req(short_text), Req("")])
    assert long_lp == pytest.approx(want, abs=1e-9)
    assert short_lp == pytest.approx(lm.loglikelihood([Req("", short_text)])[0][0], abs=1e-9)
    assert empty_lp == 0.0


def test_generate_until_is_greedy_and_cuts_at_the_first_stop_string(char_model):
    lm = FlashGPTLM(char_model, CHARS, batch_size=2, progress=False)
    full = greedy_text(char_model, CHARS, "the king", 16)
    stop = full[5:7]
    calls = []
    handle = char_model.register_forward_hook(lambda *a: calls.append(1))
    try:
        out = lm.generate_until([Req("the king", {"until": [stop, "zzz"], "max_gen_toks": 16}),
                                 Req("the queen", {"until": [], "max_gen_toks": 5}),
                                 Req("the king", {"until": stop, "max_gen_toks": 3})])
    finally:
        handle.remove()
    assert out[0] == full[:full.find(stop)] and len(out[0]) <= 5
    assert out[1] == greedy_text(char_model, CHARS, "the queen", 5) and len(out[1]) == 5
    assert out[2] == cut_at_stops(full[:3], (stop,))
    assert len(calls) < 16  # the first batch stopped once both of its sequences had ended, not at 16 tokens
    assert cut_at_stops("abcXdefY", ("Y", "X", "")) == "abc" and cut_at_stops("abc", ("Z",)) == "abc"


def test_contexts_too_long_and_max_gen_toks_beyond_the_block(char_model):
    lm = FlashGPTLM(char_model, CHARS, progress=False)
    long_ctx = ("the king and the queen speak " * 3).strip()  # 86 characters, block 24
    (text,) = lm.generate_until([Req(long_ctx, {"until": [], "max_gen_toks": 100})])
    assert len(text) == char_model.config.block_size - 1  # capped so that one context token remains
    (lp, _), = lm.loglikelihood([Req(long_ctx, " fair")])
    keep = char_model.config.block_size + 1 - len(" fair")
    assert lp == pytest.approx(naive_logprob(char_model, CHARS.encode(long_ctx)[-keep:], CHARS.encode(" fair")),
                               abs=1e-4)


def test_a_tokenizer_without_end_of_text_cannot_condition_on_nothing(char_model):
    lm = FlashGPTLM(char_model, CHARS, progress=False)
    with pytest.raises(AdapterError, match="empty context needs an end-of-text token"):
        lm.loglikelihood([Req("", "the")])
    with pytest.raises(AdapterError, match="loglikelihood_rolling needs an end-of-text token"):
        lm.loglikelihood_rolling([Req("the king")])
    with pytest.raises(AdapterError, match="does not fit"):
        lm.loglikelihood([Req("the", " king" * 10)])


def test_cli_without_lm_eval_says_how_to_install(monkeypatch, capsys, tmp_path):
    import eval as eval_cli
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed
    save_tiny_checkpoint(tmp_path, tiny_gpt(CHARS.vocab_size, 24), {"kind": "char", "chars": CHARS.chars})
    assert eval_cli.main(["--ckpt", str(tmp_path), "--lm-eval", "hellaswag"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'flashgpt[eval]' (or pip install lm-eval)" in err


# -------------------------------------------------------------------------------------- the real harness


def write_tasks(folder) -> dict:
    """Three local lm-eval tasks (multiple choice, rolling log-likelihood, generation) on files in `folder`."""
    items = hellaswag.load_items(HELLASWAG_FIXTURE)
    texts = ["The quick brown fox jumps over the lazy dog. " * 3, "A short line."]
    questions = [{"question": "Q: one plus one?\nA:", "answer": " two"}, {"question": "Say hi:", "answer": " hi"}]
    data = {"mc": [{"query": it.context, "choices": list(it.endings), "gold": it.label} for it in items],
            "rolling": [{"text": t} for t in texts], "gen": questions}
    for name, rows in data.items():
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    head = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    yaml = {
        "mc": "output_type: multiple_choice\ndoc_to_text: '{{query}}'\ndoc_to_choice: choices\n"
              "doc_to_target: gold\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                   "metric_list:\n  - metric: word_perplexity\n",
        "gen": "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
               "generation_kwargs:\n  until: ['\\n', '.']\n  max_gen_toks: 6\n  do_sample: false\n"
               "metric_list:\n  - metric: exact_match\n",
    }
    for name, body in yaml.items():
        with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
            f.write(f"task: fixture_{name}\n" + head.format(path=os.path.join(folder, f"{name}.jsonl")) + body)
    return {"items": items, "texts": texts, "questions": questions}


def test_the_harness_runs_local_tasks_through_the_adapter(tmp_path):
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager
    from evals.lm_eval_adapter import harness_lm
    data = write_tasks(tmp_path)
    model = tiny_gpt(GPT2_VOCAB, block_size=48, n_layer=1)
    lm = harness_lm(model, GPT2, batch_size=4, progress=False)
    assert isinstance(lm, LM) and isinstance(lm, FlashGPTLM)
    out = lm_eval.simple_evaluate(model=lm, tasks=["fixture_mc", "fixture_rolling", "fixture_gen"],
                                  task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    res = out["results"]
    # multiple choice: lm-eval's acc and acc_norm equal evals/hellaswag.py's on the same prompts
    mine = hellaswag.evaluate(model, GPT2, data["items"], batch_size=3)
    assert res["fixture_mc"]["acc,none"] == pytest.approx(mine["acc"])
    assert res["fixture_mc"]["acc_norm,none"] == pytest.approx(mine["acc_norm"])
    # rolling: the harness got our log-likelihoods, and its word perplexity is exp(-their sum / words), words
    # counted as lm-eval does (pieces between runs of whitespace)
    lls = lm.loglikelihood_rolling([Req(t) for t in data["texts"]])
    got = [s["resps"][0][0] for s in sorted(out["samples"]["fixture_rolling"], key=lambda s: s["doc_id"])]
    assert got == pytest.approx(lls, abs=1e-6)
    words = sum(len(re.split(r"\s+", t)) for t in data["texts"])
    assert res["fixture_rolling"]["word_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / words))
    # generation: the harness got our greedy continuations, cut at its stop strings
    want = lm.generate_until([Req(q["question"], {"until": ["\n", "."], "max_gen_toks": 6})
                              for q in data["questions"]])
    got = [s["resps"][0][0] for s in sorted(out["samples"]["fixture_gen"], key=lambda s: s["doc_id"])]
    assert got == want
    assert res["fixture_gen"]["exact_match,none"] == sum(
        w.strip() == q["answer"].strip() for w, q in zip(want, data["questions"])) / 2


def test_hellaswag_prompts_match_lm_evals_own_preprocessing():
    pytest.importorskip("lm_eval")
    import datasets
    from lm_eval.tasks.hellaswag.utils import process_docs
    rows = [json.loads(line) for line in open(HELLASWAG_FIXTURE, encoding="utf-8")]
    rows = [{k: (str(r[k]) if k == "label" else r[k]) for k in ("activity_label", "ctx_a", "ctx_b", "endings",
                                                                    "label")} for r in rows if "ctx_a" in r]
    docs = process_docs(datasets.Dataset.from_list(rows))
    items = hellaswag.load_items(HELLASWAG_FIXTURE)[:len(rows)]
    assert [(d["query"], tuple(d["choices"]), d["gold"]) for d in docs] == \
        [(it.context, it.endings, it.label) for it in items]


def test_cli_runs_an_lm_eval_task(tmp_path):
    pytest.importorskip("lm_eval")
    write_tasks(tmp_path)
    model = tiny_gpt(GPT2_VOCAB, block_size=48, n_layer=1)
    save_tiny_checkpoint(tmp_path / "run", model, {"kind": "gpt2"})
    r = run_entry("eval.py", "--ckpt", tmp_path / "run", "--lm-eval", "fixture_mc", "--include-path", tmp_path,
                  "--limit", "3", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.load(open(tmp_path / "run" / "eval_lm_eval.json"))
    mine = hellaswag.evaluate(model, GPT2, hellaswag.load_items(HELLASWAG_FIXTURE, limit=3))
    assert res["results"]["fixture_mc"]["acc,none"] == pytest.approx(mine["acc"])
    assert res["results"]["fixture_mc"]["acc_norm,none"] == pytest.approx(mine["acc_norm"])
    assert "fixture_mc" in r.stdout  # the results table
    r = run_entry("eval.py", "--ckpt", tmp_path / "run", "--lm-eval", "no_such_task_anywhere")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: lm-eval could not run")
