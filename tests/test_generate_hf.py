"""generate.py --init-from hf:<folder> and --chat on a tiny random Llama with a BPE tokenizer.json built offline:
the same greedy text as transformers' generate, the chat template applied as transformers applies it; what cannot
be used is one line."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

import generate as generate_mod  # noqa: E402
from tests.hf_models import tiny_llama, write_tokenizer  # noqa: E402
from tests.util import run_entry, write_corpus  # noqa: E402

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    with open(write_corpus(tmp / "corpus")) as f:
        lines = f.read().splitlines()
    folder = write_tokenizer(tmp / "tiny-llama", lines, eos="<|im_end|>")
    return folder, tiny_llama(folder, 300, eos_token_id=2)


def greedy_text(hf, tok, ids: list[int], n: int) -> str:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                      eos_token_id=None)[0, len(ids):]
    return tok.decode(out.tolist())


def test_init_from_hf_folder_greedy_text_equals_transformers(llama):
    folder, hf = llama
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = "the king and"
    want = prompt + greedy_text(hf, tok, tok(prompt).input_ids, 12) + "\n"
    r = run_entry("generate.py", "--init-from", f"hf:{folder}", "--prompt", prompt, "--temperature", "0",
                  "--max-new-tokens", "12", "--no-stop", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want


def test_chat_uses_the_template_and_prints_the_reply(llama, capsys):
    folder, hf = llama
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": "speak, fair queen"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert tok.decode(ids).startswith("<|im_start|>user\nspeak, fair queen<|im_end|>")
    want = greedy_text(hf, tok, list(ids), 10)
    code = generate_mod.main(["--init-from", f"hf:{folder}", "--chat", "--prompt", "speak, fair queen",
                              "--temperature", "0", "--max-new-tokens", "10", "--no-stop", "--no-stream",
                              "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert out == f"--- sample 1 (prompt 1) ---\n{want}\n"


def test_generation_stops_at_every_end_id_of_generation_config(llama, tmp_path, capsys):
    """generation_config.json's eos_token_id list stops generation as it stops transformers' generate (Llama-3.x
    and Qwen2.5 name more ends there than the tokenizer's eos_token)."""
    folder, hf = llama
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok("the king and").input_ids
    free = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                       eos_token_id=None)[0, len(ids):].tolist()
    end = next(t for t in free[2:] if t != 2)  # a token greedy decoding reaches after a few steps
    ends = shutil.copytree(folder, tmp_path / "ends")
    generation = json.loads((ends / "generation_config.json").read_text())
    (ends / "generation_config.json").write_text(json.dumps(dict(generation, eos_token_id=[2, end])))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(ends).generate(
        torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    assert theirs[-1] == end and len(theirs) < 12  # transformers stopped at the new end id
    code = generate_mod.main(["--init-from", f"hf:{ends}", "--prompt", "the king and", "--temperature", "0",
                              "--max-new-tokens", "12", "--no-stream", "--device", "cpu"])
    assert code == 0
    assert capsys.readouterr().out == f"--- sample 1 (prompt 1) ---\nthe king and{tok.decode(theirs[:-1])}\n"
    code = generate_mod.main(["--init-from", f"hf:{ends}", "--prompt", "the king and", "--temperature", "0",
                              "--max-new-tokens", "12", "--no-stream", "--device", "cpu", "--no-stop"])
    assert code == 0 and tok.decode(free) in capsys.readouterr().out


def cli_error(capsys, *args) -> str:
    code = generate_mod.main([*map(str, args), "--device", "cpu"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and captured.out == "", captured.err
    return lines[0]


def test_bad_input_is_one_line(llama, tmp_path, capsys, monkeypatch):
    folder, _ = llama
    no_template = shutil.copytree(folder, tmp_path / "no-template")
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    assert cli_error(capsys, "--init-from", f"hf:{no_template}", "--chat", "--prompt", "hi") == (
        f"error: --chat: hf:{no_template} has no chat template (no chat_template in tokenizer_config.json, no "
        "chat_template.jinja or chat_template.json); leave out --chat to continue the prompt as plain text")
    no_tok = shutil.copytree(folder, tmp_path / "no-tok")
    (no_tok / "tokenizer.json").unlink()
    assert "has no tokenizer.json" in cli_error(capsys, "--init-from", f"hf:{no_tok}", "--prompt", "hi")
    gemma = shutil.copytree(folder, tmp_path / "gemma")
    hf_config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps(dict(hf_config, architectures=["GemmaForCausalLM"])))
    assert "unsupported architecture 'GemmaForCausalLM'" in cli_error(capsys, "--init-from", f"hf:{gemma}",
                                                                       "--prompt", "hi")
    assert "--init-from='llama': expected hf:<repo-or-dir>" in cli_error(capsys, "--init-from", "llama",
                                                                          "--prompt", "hi")
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    msg = cli_error(capsys, "--init-from", "hf:HuggingFaceTB/SmolLM2-135M", "--prompt", "hi")
    assert "'hf:HuggingFaceTB/SmolLM2-135M'" in msg and "HF_HUB_OFFLINE" in msg and "tokenizer.json" in msg


def test_eval_takes_the_same_init_from(llama, tmp_path):
    """eval.py --init-from hf:<folder> loads the model as generate.py does and scores with its tokenizer."""
    from tests.eval_fixtures import HELLASWAG_FIXTURE
    folder, _ = llama
    out = tmp_path / "res.json"
    r = run_entry("eval.py", "--init-from", f"hf:{folder}", "--task", "hellaswag", "--data", HELLASWAG_FIXTURE,
                  "--limit", "2", "--device", "cpu", "--out", out)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["n"] == 2 and res["checkpoint"] == f"hf:{folder}" and 0 <= res["acc"] <= 1


def test_sampling_defaults_from_generation_config(llama, tmp_path):
    """A model's generation_config.json sets the sampling the command line leaves open: do_sample false is
    greedy (transformers' text); an option given overrides it; do_sample absent says nothing."""
    from model.sampling import from_generation_config
    folder, hf = llama
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = "the king and"
    greedy = prompt + greedy_text(hf, tok, tok(prompt).input_ids, 12) + "\n"
    own = shutil.copytree(folder, tmp_path / "own")
    (own / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    common = ["generate.py", "--init-from", f"hf:{own}", "--prompt", prompt, "--max-new-tokens", "12", "--no-stop",
              "--device", "cpu"]
    r = run_entry(*common)
    assert r.returncode == 0 and r.stdout == greedy, r.stderr
    assert "sampling: temperature 0, top-k 50, top-p 1, min-p 0, repetition-penalty 1 (the model's" in r.stderr
    (own / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_k": 20}))
    r = run_entry(*common, "--temperature", "0")  # given: greedy, whatever the file says
    assert r.returncode == 0 and r.stdout == greedy, r.stderr
    assert "sampling: top-k 20," in r.stderr and "temperature" not in r.stderr.split("sampling:")[1].split("\n")[0]
    assert from_generation_config({"temperature": 0.6}) is None  # no do_sample: the file says nothing
    assert from_generation_config({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 1.5, "min_p": True}) == \
        dict(temperature=0.6, top_k=20, top_p=1.0, min_p=0.0, repetition_penalty=1.0)  # bad values left out
