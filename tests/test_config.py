import glob
import os

import pytest

from config import ConfigError, RunConfig, apply_changes, apply_overrides, format_config, load_config, resume_config
from tests.util import ROOT, run_entry


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_defaults_file_and_overrides(tmp_path):
    path = write(tmp_path, '[model]\nn_layer = 3\nn_head = 2\nn_embd = 64\n[train]\nlearning_rate = 1e-3\n')
    cfg = load_config(path, ["--n_layer=5", "--train.batch_size=7", "--bias=false", "--lr_decay_iters=10"])
    assert cfg.model.n_layer == 5 and cfg.model.n_head == 2 and cfg.model.n_embd == 64
    assert cfg.train.batch_size == 7 and cfg.model.bias is False and cfg.train.learning_rate == 1e-3
    assert isinstance(cfg.train.learning_rate, float)


def test_all_shipped_configs_load():
    files = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))
    assert files
    for f in files:
        load_config(f)


def test_round_trip_through_dict():
    cfg = load_config(None, ["--n_layer=2", "--tokenizer=gpt2"])
    again = RunConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert "n_layer = 2" in format_config(cfg)


@pytest.mark.parametrize("toml, overrides, needle", [
    ("[model]\nn_layers = 3\n", [], "model.n_layers"),               # unknown key in the file
    ("[modle]\nn_layer = 3\n", [], "[modle]"),                         # unknown section
    ("[model]\nn_layer = 'six'\n", [], "model.n_layer"),               # wrong type in the file
    ("[train]\nbatch_size = 2.5\n", [], "train.batch_size"),
    ("", ["--n_layer=three"], "model.n_layer"),                        # wrong type on the command line
    ("", ["--nlayer=3"], "nlayer"),                                    # unknown override
    ("", ["n_layer=3"], "--key=value"),                                # malformed override
    ("", ["--learning_rate=0"], "train.learning_rate"),                # non-positive lr
    ("", ["--fsdp_blocks_per_unit=-1"], "train.fsdp_blocks_per_unit"), # a number of blocks, or 0 (automatic)
    ("", ["--learning_rate=-1e-3"], "train.learning_rate"),
    ("", ["--batch_size=0"], "train.batch_size"),                      # non-positive batch
    ("", ["--n_embd=100", "--n_head=6"], "model.n_embd"),              # not divisible
    ("", ["--block_size=10000000"], "model.block_size"),               # above what the model allows
    ("", ["--attention=fast"], "model.attention"),
    ("", ["--dropout=1.5"], "model.dropout"),
    ("", ["--bias=maybe"], "model.bias"),
    ("", ["--tokenizer=bpe"], "data.tokenizer"),
    ("", ["--n_kv_head=4", "--n_head=6"], "model.n_kv_head"),
])
def test_bad_values_name_the_key(tmp_path, toml, overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, toml), overrides)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_missing_and_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\nn_layer = 3"))


def test_cli_rejects_bad_config_with_one_line(tmp_path):
    r = run_entry("train.py", os.path.join(ROOT, "configs", "demo.toml"), "--n_embd=100", "--n_head=3",
                  f"--out_dir={tmp_path}/run")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.n_embd" in lines[0] and "Traceback" not in r.stderr
    r = run_entry("train.py", str(tmp_path / "missing.toml"))
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr


def test_override_ambiguity_is_reported():
    # every key is unique today; a dotted name is always accepted
    cfg = apply_overrides(RunConfig(), ["--model.n_layer=2"])
    assert cfg.model.n_layer == 2


@pytest.mark.parametrize("toml, overrides, needle", [
    ("", ["--grad_clip=nan"], "train.grad_clip"),
    ("", ["--weight_decay=nan"], "train.weight_decay"),
    ("", ["--learning_rate=inf"], "train.learning_rate"),
    ("", ["--min_lr=NaN"], "train.min_lr"),
    ("", ["--max_time=-inf"], "train.max_time"),
    ("", ["--beta2=1e999"], "train.beta2"),                            # overflows to inf
    ("", ["--peak_tflops=infinity"], "train.peak_tflops"),
    ("", ["--dropout=nan"], "model.dropout"),
    ("", ["--val_fraction=nan"], "data.val_fraction"),
    ("[train]\ngrad_clip = nan\n", [], "train.grad_clip"),              # TOML has nan and inf literals
    ("[train]\nmax_time = inf\n", [], "train.max_time"),
])
def test_non_finite_floats_are_rejected_by_name(tmp_path, toml, overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, toml), overrides)
    msg = str(e.value)
    assert msg.startswith(needle + "=") and "finite" in msg and "\n" not in msg


def test_cli_rejects_nan_with_one_line(tmp_path):
    r = run_entry("train.py", os.path.join(ROOT, "configs", "demo.toml"), "--grad_clip=nan",
                  f"--out_dir={tmp_path}/run")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: train.grad_clip=nan: must be a finite number"]
    assert not os.path.exists(tmp_path / "run")


def test_origins_name_where_each_key_was_set(tmp_path):
    path = write(tmp_path, "[model]\nn_layer = 3\nn_head = 3\n")
    cfg = load_config(path, ["--n_layer=5", "--lr_decay_iters=10"])
    assert cfg.origins == {"model.n_layer": "--n_layer=5", "model.n_head": path,
                           "train.lr_decay_iters": "--lr_decay_iters=10"}
    assert "origins" not in cfg.to_dict() and RunConfig.from_dict(cfg.to_dict()).origins == {}


def test_resume_config_keeps_the_checkpoints_model_and_data_and_names_contradictions():
    saved = load_config(None, ["--n_layer=2", "--attention=sdpa", "--vocab_size=65", "--dataset=a.txt",
                               "--num_proc=4"])
    saved.origins.clear()
    # defaults, "auto" and 0 ("whatever the run resolved") never contradict; [train] and how-to keys apply
    asked = load_config(None, ["--attention=auto", "--vocab_size=0", "--learning_rate=1e-4", "--num_proc=1",
                               "--cache_dir=/c"])
    cfg, changes = resume_config(asked, saved)
    assert changes == [] and cfg.model == saved.model and cfg.train.learning_rate == 1e-4
    assert cfg.data.dataset == "a.txt" and cfg.data.num_proc == 1 and cfg.data.cache_dir == "/c"
    asked = load_config(None, ["--n_layer=8", "--dataset=b.txt", "--attention=naive", "--dropout=0.0"])
    cfg, changes = resume_config(asked, saved)
    assert [(c.key, c.saved, c.asked, c.origin) for c in changes] == [
        ("model.n_layer", 2, 8, "--n_layer=8"), ("data.dataset", "a.txt", "b.txt", "--dataset=b.txt"),
        ("model.attention", "sdpa", "naive", "--attention=naive")]
    assert cfg.model.n_layer == 2 and cfg.data.dataset == "a.txt"  # not applied ...
    apply_changes(cfg, changes)
    assert cfg.model.n_layer == 8 and cfg.data.dataset == "b.txt" and cfg.model.attention == "naive"  # ... until asked
