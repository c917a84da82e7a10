"""evals/hellaswag.py and `eval.py --task hellaswag`: data formats, acc / acc_norm, bad input, the CLI."""
import json
import math
import os

import pytest

from evals import hellaswag
from evals.hellaswag import EvalDataError, Item, Tally, load_items
from evals.scoring import score_continuations
from tests.eval_fixtures import GPT2_VOCAB, HELLASWAG_FIXTURE, OracleModel, char_tokenizer_for, \
    save_tiny_checkpoint, tiny_gpt
from tests.util import run_entry


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def good(**over):
    rec = {"ctx": "A cat sits.", "endings": ["It sleeps.", "It flies."], "label": 0}
    rec.update(over)
    return json.dumps(rec)


# ------------------------------------------------------------------------------------------------ the data


def test_fixture_reads_both_formats_the_way_lm_eval_prompts_them():
    items = load_items(HELLASWAG_FIXTURE)
    assert len(items) == 5
    tea, _, wikihow, eggs, cafe = items
    # ctx_a + " " + ctx_b.capitalize(), after "activity_label: "
    assert tea.context == "Making tea: A man fills a kettle with water and sets it on the stove. He"
    assert tea.label == 2 and len(tea.endings) == 4
    assert wikihow.context == ("Home and Garden: How to water a houseplant. Check the soil. push a finger "
                               "into the soil")  # [title] -> ". ", other [brackets] dropped, double spaces folded
    assert wikihow.endings[1] == "up to the first knuckle. If it is dry, water the plant."
    assert eggs.label == 3  # the Hugging Face dataset's string label
    assert cafe.context == "Le café est chaud. Marie" and cafe.endings == ("boit son café lentement.",
                                                                            "mange la tasse.", "éteint le soleil.")
    assert tea.where.endswith("hellaswag_mini.jsonl line 1")
    assert [it.context for it in load_items(HELLASWAG_FIXTURE, limit=2)] == [tea.context, items[1].context]


def test_parquet_with_the_hub_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [json.loads(line) for line in open(HELLASWAG_FIXTURE, encoding="utf-8")][:2]
    for r in rows:
        r["label"] = str(r["label"])
    path = str(tmp_path / "validation.parquet")
    pq.write_table(pa.Table.from_pylist([{k: r[k] for k in ("activity_label", "ctx_a", "ctx_b", "endings", "label")}
                                         for r in rows]), path)
    assert load_items(path) == [it.__class__(it.context, it.endings, it.label, f"{path} row {n}")
                                for n, it in enumerate(load_items(HELLASWAG_FIXTURE, limit=2), start=1)]


@pytest.mark.parametrize("line3, message", [
    ('{"ctx": "A", "endings": ["b", "c"], "label": 0', "line 3: not valid JSON"),
    (good(label=2), "line 3: label 2 is not the index of one of its 2 endings"),
    (good(label="x"), "line 3: label 'x' is not the index"),
    (good(label=-1), "line 3: label -1"),
    (good(label=None), "line 3: label None"),
    (good(label=True), "line 3: label True"),
    (good(endings=["only one"]), "line 3: 'endings' must be a list of two or more"),
    (good(endings="ab"), "line 3: 'endings' must be a list"),
    (good(endings=["[header]", "b"]), "line 3: an ending is empty"),
    (json.dumps({"endings": ["a", "b"], "label": 0}), "line 3: no context"),
    ("[1, 2]", "line 3: expected a JSON object"),
])
def test_a_bad_line_is_named_by_its_number(tmp_path, line3, message):
    path = write_lines(tmp_path / "bad.jsonl", [good(), "", line3, good()])  # line 2 is blank: skipped
    with pytest.raises(EvalDataError) as e:
        load_items(path)
    assert message in str(e.value) and str(e.value).startswith(path)
    assert "\n" not in str(e.value)


def test_missing_empty_and_binary_files(tmp_path):
    with pytest.raises(EvalDataError, match="not found"):
        load_items(str(tmp_path / "nope.jsonl"))
    with pytest.raises(EvalDataError, match="no items"):
        load_items(write_lines(tmp_path / "empty.jsonl", [""]))
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(EvalDataError, match="not UTF-8"):
        load_items(str(tmp_path / "bin.jsonl"))
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(EvalDataError, match="not a readable Parquet"):
        load_items(str(tmp_path / "x.parquet"))


def test_default_data_offline_download_and_cache(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EvalDataError, match=r"offline\).*--data FILE"):
        hellaswag.default_data(cache)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    missing = (tmp_path / "missing.jsonl").as_uri()
    with pytest.raises(EvalDataError, match=r"cannot be reached .*--train.x=FILE"):
        hellaswag.default_data(cache, url=missing, option="--train.x=FILE")
    source = (tmp_path / "source.jsonl")
    source.write_text(open(HELLASWAG_FIXTURE, encoding="utf-8").read(), encoding="utf-8")
    with pytest.raises(EvalDataError, match="has 5 items, not 10042"):
        hellaswag.default_data(cache, url=source.as_uri())
    assert os.listdir(cache) == []  # the refused download left nothing behind
    path = hellaswag.default_data(cache, url=source.as_uri(), expected_items=5)
    assert path == os.path.join(cache, "hellaswag_val.jsonl") and len(load_items(path)) == 5
    assert hellaswag.default_data(cache, url=missing) == path  # cached: no download


def test_an_item_the_tokenizer_cannot_encode_or_too_long_an_ending():
    items = load_items(HELLASWAG_FIXTURE)
    with pytest.raises(EvalDataError, match=r"line 1: cannot be encoded with the model's char tokenizer"):
        hellaswag.encode_requests(items, char_tokenizer_for("abc"), 64)
    tok = char_tokenizer_for(*(it.context + "".join(it.endings) for it in items))
    with pytest.raises(EvalDataError, match=r"line 1: ending 0 is 49 tokens long, more than the model's context "
                                            r"of 40"):
        hellaswag.encode_requests(items, tok, 40)
    requests = hellaswag.encode_requests(items, tok, 80)
    assert len(requests) == sum(len(it.endings) for it in items) == 19
    assert requests[0] == (tok.encode(items[0].context), tok.encode(" " + items[0].endings[0]))


# --------------------------------------------------------------------------------------------- the metrics


def test_acc_norm_divides_by_characters_not_bytes():
    tally = Tally()
    item = Item("ctx", ("ééééé", "abcdef"), label=1, where="x")  # 5 characters (10 bytes), 6 characters
    pred, pred_norm = tally.add(item, [-5.5, -6.3])
    assert pred == 0           # -5.5 > -6.3
    assert pred_norm == 1      # per character -1.1 < -1.05 (per byte it would be -0.55 > -1.05)
    assert (tally.n, tally.correct, tally.correct_norm) == (1, 0, 1)
    tie = Tally()
    assert tie.add(Item("c", ("ab", "cd"), 1, "x"), [-1.0, -1.0]) == (0, 0)  # equal scores: the first, as argmax


def test_uniform_model_acc_picks_the_shortest_ending_acc_norm_the_longest():
    """Every token has log-probability -log V: an ending of n characters (n + 1 tokens with its space) scores
    -(n + 1)·log V, so acc prefers the shortest, and -(n + 1)/n·log V makes acc_norm prefer the longest."""
    items = [Item("one two", ("aa", "bbbbbb", "cccc"), label=0, where="1"),   # shortest labelled: acc only
             Item("three", ("dddddd", "ee", "ffff"), label=0, where="2"),      # longest labelled: acc_norm only
             Item("four", ("gg", "hhhh", "iiiiii"), label=1, where="3")]       # neither
    tok = char_tokenizer_for("onetwhrfu", "abcdefghi")
    model = OracleModel(tok.vocab_size, certain=[])
    m = hellaswag.evaluate(model, tok, items, batch_size=4)
    assert (m["acc"], m["acc_norm"], m["n"]) == (1 / 3, 1 / 3, 3)
    scores = [s.logprob for s in score_continuations(model, hellaswag.encode_requests(items, tok, 64))]
    assert scores[:3] == pytest.approx([-3 * math.log(tok.vocab_size), -7 * math.log(tok.vocab_size),
                                        -5 * math.log(tok.vocab_size)])
    _, preds = hellaswag.tally_items(items, scores)
    assert preds == [(0, 1), (1, 0), (0, 2)]
    assert m["acc_stderr"] == pytest.approx(math.sqrt((1 / 3) * (2 / 3) / 2))


def test_a_model_certain_of_the_labelled_endings_scores_one():
    items = load_items(HELLASWAG_FIXTURE)
    tok = char_tokenizer_for(*(it.context + "".join(it.endings) for it in items))
    right = [tok.encode(it.context + " " + it.endings[it.label]) for it in items]
    model = OracleModel(tok.vocab_size, certain=right, block_size=256)  # no context is cut
    m = hellaswag.evaluate(model, tok, items, batch_size=3)
    assert (m["acc"], m["acc_norm"], m["n"]) == (1.0, 1.0, 5)
    assert m["acc_stderr"] == 0.0
    wrong = [tok.encode(it.context + " " + it.endings[(it.label + 1) % len(it.endings)]) for it in items]
    m = hellaswag.evaluate(OracleModel(tok.vocab_size, certain=wrong, block_size=256), tok, items)
    assert (m["acc"], m["acc_norm"]) == (0.0, 0.0)


# ---------------------------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """A run folder holding a tiny random model with the GPT-2 tokenizer, and the model itself."""
    folder = tmp_path_factory.mktemp("run")
    model = tiny_gpt(GPT2_VOCAB, block_size=48, n_layer=1)
    save_tiny_checkpoint(folder, model, {"kind": "gpt2"})
    return str(folder), model


def test_cli_scores_the_fixture_and_writes_json(gpt2_run, tmp_path):
    from data.tokenizers import tokenizer_from_spec
    folder, model = gpt2_run
    out = tmp_path / "res.json"
    # on the CPU in float32, as the in-process reference below (a GPU would score in bf16)
    r = run_entry("eval.py", "--ckpt", folder, "--task", "hellaswag", "--data", HELLASWAG_FIXTURE,
                  "--batch-size", "3", "--out", out, "--device", "cpu", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    want = hellaswag.evaluate(model, tokenizer_from_spec({"kind": "gpt2"}), load_items(HELLASWAG_FIXTURE),
                              batch_size=1)
    for key in ("acc", "acc_norm", "n", "acc_stderr", "acc_norm_stderr"):
        assert res[key] == want[key], key
    assert res["checkpoint"].endswith("ckpt_0000000.pt") and res["dtype"] == "float32"
    assert f"acc {want['acc']:.4f}" in r.stdout and f"acc_norm {want['acc_norm']:.4f}" in r.stdout
    r = run_entry("eval.py", "--ckpt", folder, "--task", "hellaswag", "--data", HELLASWAG_FIXTURE, "--limit", "2")
    assert r.returncode == 0, r.stderr
    assert json.loads(open(os.path.join(folder, "eval_hellaswag.json")).read())["n"] == 2  # default --out


@pytest.mark.parametrize("args, message", [
    ([], "nothing to evaluate"),
    (["--task", "hellaswag", "--data", "{missing}"], "HellaSwag data file not found"),
    (["--task", "hellaswag", "--data", "{bad}"], "bad.jsonl line 2: label 7 is not the index"),
    (["--task", "hellaswag"], "pass it with --data FILE"),
    (["--task", "hellaswag", "--data", "{fixture}", "--batch-size", "0"], "--batch-size=0"),
    (["--task", "hellaswag", "--data", "{fixture}", "--limit", "0"], "--limit=0"),
    (["--task", "hellaswag", "--data", "{fixture}", "--device", "tpu"], "--device=tpu"),
    (["--lm-eval", "x", "--data", "{fixture}"], "--data is for --task hellaswag"),
])
def test_cli_bad_input_is_one_line(gpt2_run, tmp_path, args, message):
    folder, _ = gpt2_run
    bad = write_lines(tmp_path / "bad.jsonl", [good(), good(label=7)])
    args = [a.format(missing=tmp_path / "nope.jsonl", bad=bad, fixture=HELLASWAG_FIXTURE) for a in args]
    r = run_entry("eval.py", "--ckpt", folder, *args, "--cache-dir", tmp_path / "cache")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr


def test_cli_missing_checkpoint_and_help(tmp_path):
    r = run_entry("eval.py", "--ckpt", tmp_path / "none", "--task", "hellaswag", "--data", HELLASWAG_FIXTURE)
    assert r.returncode == 2 and r.stderr.strip() == f"error: checkpoint not found: {tmp_path / 'none'}"
    r = run_entry("eval.py", "--help")
    assert r.returncode == 0 and "--lm-eval" in r.stdout and "--data" in r.stdout


def test_cli_items_the_tokenizer_cannot_encode_are_one_line(tmp_path):
    """Found before anything else is printed: a character model whose alphabet lacks the fixture's capitals."""
    tok = char_tokenizer_for("abcdefghijklmnopqrstuvwxyz")
    save_tiny_checkpoint(tmp_path / "run", tiny_gpt(tok.vocab_size), tok.spec())
    r = run_entry("eval.py", "--ckpt", tmp_path / "run", "--task", "hellaswag", "--data", HELLASWAG_FIXTURE)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {HELLASWAG_FIXTURE} line 1: cannot be encoded with the model's char tokenizer: character 'M' is "
        "not in this model's alphabet"], r.stderr
