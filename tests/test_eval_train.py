"""HellaSwag during training (train.eval_hellaswag_interval): metrics at the interval, resume, ranks, bad data."""
import json
import os
import sys

import pytest
import torch

import train as train_mod
from config import load_config
from data.tokenizers import tokenizer_from_spec
from evals import hellaswag
from model import GPT, GPTConfig
from model.checkpoint import load_checkpoint
from model.config import ConfigError
from tests.util import TINY_MODEL, write_corpus

# Items written with the letters of tests/util.write_corpus's words, so that the character tokenizer trained on
# that corpus encodes them.
ITEMS = [
    {"ctx": "the king and the queen", "endings": ["speak fair.", "sword sword sword", "night", "art thou"],
     "label": 0},
    {"ctx": "thou art fair and", "endings": ["the crown.", "love the night.", "queen", "and and"], "label": 1},
    {"ctx": "speak the", "endings": ["king.", "love", "the sword and the crown.", "fair"], "label": 2},
    {"ctx": "the night and the sword,", "endings": ["crown", "thou art", "king"], "label": 1},
    {"ctx": "love", "endings": ["the queen.", "art", "sword and night", "fair fair"], "label": 3},
    {"ctx": "the crown and the king.", "endings": ["queen and love", "thou", "speak", "night."], "label": 0},
    {"ctx": "fair", "endings": ["and", "the king speak.", "crown", "sword"], "label": 2},
]


def write_items(folder, items=ITEMS) -> str:
    path = os.path.join(str(folder), "hs.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps(it) + "\n" for it in items))
    return path


def cfg_for(tmp_path, *extra):
    corpus = write_corpus(tmp_path)
    return load_config(None, [f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", f"--out_dir={tmp_path}/run",
                              "--num_proc=1", "--batch_size=8", "--learning_rate=3e-3", "--warmup_iters=2",
                              "--eval_iters=2", "--log_interval=1", "--device=cpu", *TINY_MODEL, *extra])


def rows(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_hellaswag_is_logged_at_the_interval_and_the_last_step_and_resumes(tmp_path):
    data = write_items(tmp_path)
    cfg = cfg_for(tmp_path, "--max_iters=10", "--eval_interval=10", "--eval_hellaswag_interval=4",
                  f"--eval_hellaswag_data={data}")
    train_mod.train(cfg)
    hs = [r for r in rows(cfg.train.out_dir) if "hellaswag_acc" in r]
    assert [r["iter"] for r in hs] == [0, 4, 8, 10]
    assert all(r["hellaswag_n"] == len(ITEMS) and set(r) == {"iter", "hellaswag_acc", "hellaswag_acc_norm",
                                                               "hellaswag_n"} for r in hs)
    # the logged value is the evaluation of the weights at that step (its checkpoint), done independently
    ckpt = load_checkpoint(os.path.join(cfg.train.out_dir, "ckpt_0000010.pt"))
    model = GPT(GPTConfig(**ckpt["config"]["model"]))
    model.load_state_dict(ckpt["model"])
    want = hellaswag.evaluate(model, tokenizer_from_spec(ckpt["tokenizer"]), hellaswag.load_items(data))
    assert (hs[-1]["hellaswag_acc"], hs[-1]["hellaswag_acc_norm"]) == (want["acc"], want["acc_norm"])

    more = cfg_for(tmp_path, "--max_iters=15", "--eval_interval=10", "--eval_hellaswag_interval=5",
                   f"--eval_hellaswag_data={data}", "--init_from=resume")
    train_mod.train(more)
    hs = [r["iter"] for r in rows(cfg.train.out_dir) if "hellaswag_acc" in r]
    assert hs == [0, 4, 8, 10, 15]  # the resumed step 10 was logged before its checkpoint: not again


def test_off_means_not_imported(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "evals.train_hook", None)  # any import of it now raises ImportError
    cfg = cfg_for(tmp_path, "--max_iters=2", "--eval_interval=2")
    train_mod.train(cfg)
    assert not any("hellaswag_acc" in r for r in rows(cfg.train.out_dir))
    on = cfg_for(tmp_path / "on", "--max_iters=2", "--eval_interval=2", "--eval_hellaswag_interval=1",
                 f"--eval_hellaswag_data={write_items(tmp_path)}")
    with pytest.raises(ImportError):  # the check above is real: switched on, the module is imported
        train_mod.train(on)


@pytest.mark.parametrize("bad, message", [
    (None, "train.eval_hellaswag_data: HellaSwag data file not found"),
    ([{"ctx": "the king", "endings": ["fair", "love"], "label": 5}], "hs.jsonl line 1: label 5"),
    ([ITEMS[0], {"ctx": "the King", "endings": ["fair", "love"], "label": 0}],
     "hs.jsonl line 2: cannot be encoded with the model's char tokenizer: character 'K'"),
])
def test_bad_data_stops_the_run_before_its_first_step(tmp_path, bad, message):
    data = write_items(tmp_path, bad) if bad is not None else str(tmp_path / "missing.jsonl")
    cfg = cfg_for(tmp_path, "--max_iters=4", "--eval_interval=2", "--eval_hellaswag_interval=2",
                  f"--eval_hellaswag_data={data}")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        train_mod.train(cfg)
    assert not any(f.endswith(".pt") for f in os.listdir(cfg.train.out_dir))
    metrics = os.path.join(cfg.train.out_dir, "metrics.jsonl")
    assert not os.path.exists(metrics) or not [r for r in rows(cfg.train.out_dir) if "loss" in r]


def test_without_a_data_file_offline_the_error_names_the_key(tmp_path):
    cfg = cfg_for(tmp_path, "--max_iters=2", "--eval_hellaswag_interval=1")  # conftest sets HF_HUB_OFFLINE
    with pytest.raises(ConfigError, match=r"train.eval_hellaswag_data: .*--train.eval_hellaswag_data=FILE"):
        train_mod.train(cfg)


def test_negative_interval_is_refused():
    with pytest.raises(ConfigError, match="train.eval_hellaswag_interval=-1: must not be negative"):
        load_config(None, ["--eval_hellaswag_interval=-1"])


# ------------------------------------------------------------------------------------------- two ranks


def _rank(rank, world, init_file, data, out_dir):
    import torch.distributed as dist
    from evals.train_hook import HellaSwagHook
    from tests.eval_fixtures import char_tokenizer_for, tiny_gpt
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tok = char_tokenizer_for("the king and queen sword night love crown speak thou art fair,.")
        model = tiny_gpt(tok.vocab_size, block_size=32)  # the same seed: the same weights on every rank
        calls = []
        model.register_forward_hook(lambda *a: calls.append(1))
        hook = HellaSwagHook(hellaswag.load_items(data), tok, block_size=32, interval=1, batch_size=3, rank=rank,
                             world=world)
        record = hook.run(model, step=7)
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump({"record": record, "forwards": len(calls), "own": len(hook.requests),
                       "padded": hook.padded}, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_split_the_items_and_run_the_same_forward_passes(tmp_path):
    from evals.train_hook import HellaSwagHook
    from tests.eval_fixtures import char_tokenizer_for, tiny_gpt
    data = write_items(tmp_path)
    torch.multiprocessing.spawn(_rank, args=(2, str(tmp_path / "init"), data, str(tmp_path)), nprocs=2)
    r0, r1 = (json.load(open(tmp_path / f"{r}.json")) for r in (0, 1))
    tok = char_tokenizer_for("the king and queen sword night love crown speak thou art fair,.")
    one = HellaSwagHook(hellaswag.load_items(data), tok, block_size=32, interval=1, batch_size=3)
    single = one.run(tiny_gpt(tok.vocab_size, block_size=32), step=7)
    assert r0["record"] == r1["record"] == single
    assert (r0["own"], r1["own"]) == (16, 11)  # items 0, 2, 4, 6 and 1, 3, 5 (item 3 has three endings)
    assert r0["padded"] == r1["padded"] == 16
    assert r0["forwards"] == r1["forwards"] == 6  # 16 requests in batches of 3 (rank 1 alone would run 4)
