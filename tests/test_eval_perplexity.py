"""evals/perplexity.py and `eval.py --task perplexity`: every token scored once, against transformers' own
log-likelihoods (a tiny random Llama with a BOS-adding and with a plain BPE tokenizer) and against a direct
float64 forward of a character model that has nothing to condition its first token on; the CLI; bad input."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from data.tokenizers import CharTokenizer, HFTokenizer
from evals import perplexity
from evals.perplexity import PerplexityError
from tests.eval_fixtures import save_tiny_checkpoint, tiny_gpt
from tests.util import run_entry

WORDS = "the king and the queen speak of love and night and the fair crown".split()


def texts(n: int, seed: int = 0, words: tuple[int, int] = (4, 40)) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(words[0], words[1], (1,), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g)) + ".")
    return out


def write_jsonl(path, docs) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    return str(path)


@pytest.mark.parametrize("bos", [None, "<|im_start|>"])
def test_matches_transformers_log_likelihoods(tmp_path, bos):
    """Documents within the context: the summed log-likelihood of transformers' model over the same tokens,
    conditioned on BOS (a tokenizer that adds it; BOS not scored) or on the end-of-text token."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from model import GPT
    from tests.hf_models import tiny_llama, write_tokenizer
    folder = write_tokenizer(tmp_path / "m", texts(200, seed=1), bos=bos)
    hf = tiny_llama(folder, 300).double()
    ours = GPT.from_pretrained(folder, dtype=torch.float64)
    tok = HFTokenizer.from_folder(folder)
    docs = texts(9, seed=2) + ["café — naïve"]  # multi-byte characters: bytes differ from characters
    got = perplexity.evaluate(ours, tok, docs, batch_size=4)
    nll, tokens = 0.0, 0
    for d in docs:
        ids = tok.encode(d)
        full = ids if bos else [tok.eot_token] + ids  # what the first scored token is conditioned on
        assert (full[0] == tok.bos_token) if bos else True
        with torch.no_grad():
            logp = hf(torch.tensor([full])).logits[0].log_softmax(-1)  # (T, V) float64
        nll -= sum(float(logp[i, full[i + 1]]) for i in range(len(full) - 1))
        tokens += len(full) - 1
    assert got["tokens"] == tokens and got["documents"] == len(docs) and got["windows"] == len(docs)
    assert got["nll"] == pytest.approx(nll, rel=1e-7)  # float64 but for RoPE's float32 tables
    nbytes = sum(len(d.encode()) for d in docs)
    assert got["bytes"] == nbytes > sum(map(len, docs))
    assert got["words"] == sum(len(d.split()) for d in docs)
    assert got["token_perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-7)
    assert got["bits_per_byte"] == pytest.approx(nll / nbytes / math.log(2), rel=1e-7)
    assert got["first_token_conditioned_on"] == ("the BOS token" if bos else "the end-of-text token")


def test_a_character_model_without_end_of_text_scores_from_the_second_token():
    """Nothing to condition on: the first character of each document is context, its byte and word left out;
    longer documents than the context are scored in windows, every token once."""
    docs = ["the king speaks", "a", "night and the queen and the fair crown of love" * 3]
    tok = CharTokenizer("".join(docs))
    model = tiny_gpt(tok.vocab_size, block_size=16, dtype=torch.float64)
    got = perplexity.evaluate(model, tok, docs, batch_size=2)
    assert got["documents"] == 2 and got["first_token_conditioned_on"] == "nothing (not scored)"  # "a": no token
    want, tokens = 0.0, 0
    for d in docs[::2]:
        ids = tok.encode(d)
        n = len(ids) - 1  # scored: ids[1:], in windows of 16; a window's input is the 16 ids before its end
        for i in range(1, len(ids)):
            s = (i - 1) // 16 * 16
            end = s + min(16, n - s)  # the window's last scored id is ids[end]
            ctx = ids[max(0, end - 16):i]
            with torch.no_grad():
                logp = model(torch.tensor([ctx]))[0][0, -1].log_softmax(-1)
            want -= float(logp[ids[i]])
            tokens += 1
    assert got["tokens"] == tokens == len(docs[0]) - 1 + len(docs[2]) - 1
    assert got["nll"] == pytest.approx(want, rel=1e-9)
    assert got["bytes"] == len(docs[0]) - 1 + len(docs[2]) - 1
    assert got["windows"] == 1 + math.ceil((len(docs[2]) - 1) / 16)


def test_limit_and_text_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", texts(5))
    assert perplexity.read_documents(path, limit=3) == texts(5)[:3]
    with open(tmp_path / "b.jsonl", "w") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in texts(2))
    assert perplexity.read_documents(str(tmp_path / "b.jsonl"), text_column="body") == texts(2)
    with pytest.raises(PerplexityError, match="no 'text'"):
        perplexity.read_documents(str(tmp_path / "b.jsonl"))


def char_run(tmp_path, seed: int):
    """Six held-out documents, a character model's run folder (random weights) and the documents as JSONL:
    (docs, tokenizer, model, folder, data path)."""
    docs = texts(6, seed=seed)
    tok = CharTokenizer("".join(docs), eot=True)
    model = tiny_gpt(tok.vocab_size, block_size=32)
    folder = str(tmp_path / "run")
    save_tiny_checkpoint(folder, model, tok.spec())
    return docs, tok, model, folder, write_jsonl(tmp_path / "held_out.jsonl", docs)


def test_cli_writes_its_metrics_and_bad_input_is_one_line(tmp_path):
    docs, tok, model, folder, data = char_run(tmp_path, seed=3)
    r = run_entry("eval.py", "--ckpt", folder, "--task", "perplexity", "--data", data, "--no-progress",
                  "--device", "cpu", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"perplexity (6 documents, {sum(map(len, docs))} tokens): token perplexity ")
    result = json.loads(open(os.path.join(folder, "eval_perplexity.json")).read())
    want = perplexity.evaluate(model, tok, docs)
    assert result["task"] == "perplexity" and result["data"] == data
    assert result["nll"] == pytest.approx(want["nll"], rel=1e-5)
    assert result["first_token_conditioned_on"] == "the end-of-text token"

    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    outside = write_jsonl(tmp_path / "outside.jsonl", ["zzz"])
    for args, message in (
            (["--task", "perplexity"], "--task perplexity needs --data"),
            (["--task", "perplexity", "--data", str(tmp_path / "nope.jsonl")], "nope.jsonl"),
            (["--task", "perplexity", "--data", str(empty)], "holds no text to score"),
            (["--task", "perplexity", "--data", outside], "character 'z' is not in this model's alphabet")):
        r = run_entry("eval.py", "--ckpt", folder, *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        assert message in lines[0], lines[0]
    h = run_entry("eval.py", "--help")
    assert h.returncode == 0 and "perplexity" in h.stdout and "--text-column" in h.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,rel", [("float32", 1e-3), ("bfloat16", 2e-2)])
def test_cli_on_the_gpu_scores_as_the_cpu_does(tmp_path, dtype, rel):
    """The CLI on CUDA (flash attention, the given dtype) against the CPU's float32 scores."""
    docs, tok, model, folder, data = char_run(tmp_path, seed=4)
    r = run_entry("eval.py", "--ckpt", folder, "--task", "perplexity", "--data", data, "--no-progress",
                  "--device", "cuda", "--dtype", dtype, "--attention", "flash")
    assert r.returncode == 0, r.stderr
    result = json.loads(open(os.path.join(folder, "eval_perplexity.json")).read())
    want = perplexity.evaluate(model, tok, docs)
    assert result["tokens"] == want["tokens"]
    assert result["nll"] == pytest.approx(want["nll"], rel=rel)
