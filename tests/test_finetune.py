"""Fine-tuning from pretrained weights (train.init_from): a tiny random Llama saved with save_pretrained next to a
BPE tokenizer.json trained on the test corpus → configs/finetune_tiny.toml starts from exactly those weights,
tokenises with that tokenizer, the loss falls, the export at the end gives transformers' logits, and the run
resumes like any other (without the pretrained folder); a previous run folder works as a start too. Bad input is
one line each."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

import train as train_mod  # noqa: E402
from config import load_config  # noqa: E402
from model.checkpoint import load_checkpoint  # noqa: E402
from model.config import ConfigError  # noqa: E402
from model.hf_files import HFError  # noqa: E402
from model.hf_weights import state_dict_from_hf  # noqa: E402
from tests.hf_models import pretrained_llama, tiny_llama  # noqa: E402
from tests.util import ROOT, TINY_MODEL, run_entry, write_corpus  # noqa: E402

transformers.logging.set_verbosity_error()
CONFIG = os.path.join(ROOT, "configs", "finetune_tiny.toml")
MODEL_VOCAB = 320  # above the tokenizer's 300: a padded embedding, as hub models have


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """(folder of a random Llama + tokenizer.json, the transformers model, corpus path)."""
    return pretrained_llama(tmp_path_factory.mktemp("pretrained"), MODEL_VOCAB)


def finetune_cfg(pretrained, tmp, *extra):
    folder, _, corpus = pretrained
    return load_config(CONFIG, [f"--init_from=hf:{folder}", f"--dataset={corpus}", f"--out_dir={tmp}/run",
                                f"--cache_dir={tmp}/cache", "--num_proc=1", "--device=cpu", "--block_size=32",
                                "--batch_size=8", "--max_iters=12", "--eval_interval=6", "--eval_iters=2",
                                "--warmup_iters=2", "--learning_rate=3e-3", "--lr_decay_iters=12", "--log_interval=1",
                                "--keep_last=5",
                                *extra])


def rows(run, key):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [(r["iter"], r[key]) for r in map(json.loads, f) if key in r]


def test_finetune_starts_from_the_weights_loss_falls_and_exports(pretrained, tmp_path):
    folder, hf, _ = pretrained
    cfg = finetune_cfg(pretrained, tmp_path, "--eval_iters=4")
    summary = train_mod.train(cfg)
    run = cfg.train.out_dir
    start = load_checkpoint(os.path.join(run, "ckpt_0000000.pt"))
    # the shape and weights of the pretrained model, the training context of the config
    model_cfg = start["config"]["model"]
    assert (model_cfg["n_layer"], model_cfg["n_embd"], model_cfg["n_kv_head"], model_cfg["vocab_size"],
            model_cfg["pos_emb"], model_cfg["block_size"]) == (2, 64, 2, MODEL_VOCAB, "rope", 32)
    from safetensors.torch import load_file
    from model.hf_config import gpt_config_from_hf
    family, hf_cfg = gpt_config_from_hf(hf.config.to_dict())
    want = state_dict_from_hf(family, hf_cfg, load_file(os.path.join(folder, "model.safetensors")))
    for key, t in want.items():
        assert torch.equal(start["model"][key], t), key
    # the model's own tokenizer, stored whole
    with open(os.path.join(folder, "tokenizer.json")) as f:
        assert start["tokenizer"]["tokenizer_json"] == f.read()
    assert start["config"]["data"]["tokenizer"] == "model"
    # the loss falls
    val = rows(run, "val_loss")
    assert [i for i, _ in val] == [0, 6, 12] and val[-1][1] < val[0][1] - 0.3
    # the export of best.pt: transformers' logits and ids
    assert summary["export"] == os.path.join(run, "hf")
    exported = transformers.AutoModelForCausalLM.from_pretrained(summary["export"]).eval()
    best = load_checkpoint(run, prefer="best")
    from model import GPT, GPTConfig
    ours = GPT(GPTConfig(**best["config"]["model"]))
    ours.load_state_dict(best["model"])
    idx = torch.randint(0, MODEL_VOCAB, (2, 32))
    with torch.no_grad():
        assert (ours.eval()(idx)[0] - exported(idx).logits).abs().max() <= 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(summary["export"])
    assert tok("the king speaks").input_ids == transformers.AutoTokenizer.from_pretrained(folder)(
        "the king speaks").input_ids


def test_resume_needs_no_pretrained_folder_and_reproduces_the_run(pretrained, tmp_path):
    folder = pretrained[0]
    a = finetune_cfg(pretrained, tmp_path / "a", "--export_hf=false")
    train_mod.train(a)
    b = finetune_cfg(pretrained, tmp_path / "b", "--export_hf=false", "--max_iters=6")
    train_mod.train(b)
    hidden = folder + ".moved"
    os.rename(folder, hidden)  # init_from is not read again: the run's checkpoints hold weights and tokenizer
    try:
        train_mod.train(finetune_cfg(pretrained, tmp_path / "b", "--export_hf=false", "--init_from=resume"))
        r = run_entry("generate.py", "--ckpt", b.train.out_dir, "--prompt", "the king", "--max-new-tokens", "5",
                      "--device", "cpu")
    finally:
        os.rename(hidden, folder)
    assert rows(a.train.out_dir, "loss") == rows(b.train.out_dir, "loss")  # bit-identical on CPU
    assert rows(a.train.out_dir, "val_loss") == rows(b.train.out_dir, "val_loss")
    assert r.returncode == 0 and r.stdout.startswith("the king"), r.stderr


def test_finetune_on_shards_with_the_models_tokenizer_resumes_without_it(pretrained, tmp_path):
    """data.format = "shards", as a fine-tuning corpus of many documents is prepared: the shards hold the ids of
    the model's own tokenizer, each document ended by its eos_token; the loss falls; the run resumes without the
    pretrained folder (the checkpoint's copy of the tokenizer finds the same shards) to the losses of one run."""
    import glob

    import numpy as np

    from data.tokenizers import HFTokenizer
    folder, _, corpus = pretrained
    with open(corpus) as f:
        lines = f.read().splitlines()
    docs = ["\n".join(lines[i:i + 12]) for i in range(0, len(lines), 12)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    shard_args = ["--format=shards", f"--dataset={jsonl}", "--val_docs=5", "--shard_tokens=3000", "--export_hf=false"]
    # prepared beforehand as `python -m data.prepare --tokenizer hf:<folder>` does: the run finds that folder
    from data.shards import prepare_shards
    prepared = prepare_shards(str(jsonl), f"hf:{folder}", shard_tokens=3000, val_docs=5, verbose=False,
                              cache_dir=str(tmp_path / "a" / "cache"))
    a = finetune_cfg(pretrained, tmp_path / "a", *shard_args, "--eval_iters=4")
    train_mod.train(a)
    tok = HFTokenizer.from_folder(folder, f"hf:{folder}")
    assert load_checkpoint(os.path.join(a.train.out_dir, "ckpt_0000000.pt"))["tokenizer"] == tok.spec()
    (manifest_path,) = glob.glob(str(tmp_path / "a" / "cache" / "shards" / "*" / "manifest.json"))
    assert os.path.dirname(manifest_path) == prepared  # found, not prepared again
    manifest = json.loads(open(manifest_path).read())
    assert manifest["tokenizer"] == tok.spec() and manifest["documents"] == {"val": 5, "train": len(docs) - 5}
    train_ids = np.concatenate([np.fromfile(os.path.join(os.path.dirname(manifest_path), e["file"]),
                                            dtype=manifest["dtype"]) for e in manifest["shards"]
                                if e["split"] == "train"])
    assert train_ids.tolist() == sum((tok.encode(d) + [tok.eot_token] for d in docs[5:]), [])
    val = rows(a.train.out_dir, "val_loss")
    assert val[-1][1] < val[0][1] - 0.3
    b = finetune_cfg(pretrained, tmp_path / "b", *shard_args, "--eval_iters=4", "--max_iters=6",
                     f"--cache_dir={tmp_path / 'a' / 'cache'}")
    train_mod.train(b)
    hidden = folder + ".moved"
    os.rename(folder, hidden)
    try:
        train_mod.train(finetune_cfg(pretrained, tmp_path / "b", *shard_args, "--eval_iters=4",
                                     f"--cache_dir={tmp_path / 'a' / 'cache'}", "--init_from=resume"))
    finally:
        os.rename(hidden, folder)
    assert rows(a.train.out_dir, "loss") == rows(b.train.out_dir, "loss")
    assert rows(a.train.out_dir, "val_loss") == rows(b.train.out_dir, "val_loss")


def test_supervised_finetune_on_conversations_then_chat(pretrained, tmp_path):
    """data.format = "chat": conversations in the model's chat template, the loss on the assistant's turns; the
    loss falls, the run's checkpoints hold the template, and generate.py --chat answers from the run alone."""
    words = ["king", "queen", "night", "crown", "love", "sword"]
    convs = [[{"role": "user", "content": f"repeat {w}"}, {"role": "assistant", "content": f"{w} {w} {w}"}]
             for _ in range(20) for w in words]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    cfg = finetune_cfg(pretrained, tmp_path, "--format=chat", f"--dataset={chats}", "--export_hf=false",
                       "--eval_iters=4", "--max_iters=120", "--lr_decay_iters=120", "--eval_interval=60")
    summary = train_mod.train(cfg)
    val = rows(cfg.train.out_dir, "val_loss")
    assert [i for i, _ in val] == [0, 60, 120] and val[-1][1] < val[0][1] - 1.0
    # a model that learned the replies: its assistant-token loss ends far below the unigram baseline of the replies
    assert summary["val_loss"] < summary["unigram_val_loss"]
    ckpt = load_checkpoint(cfg.train.out_dir)
    assert ckpt["config"]["data"]["format"] == "chat" and ckpt["tokenizer"]["chat_template"]
    r = run_entry("generate.py", "--ckpt", cfg.train.out_dir, "--chat", "--prompt", "repeat crown",
                  "--max-new-tokens", "12", "--temperature", "0", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "crown crown crown\n", (r.stdout, r.stderr)  # the reply ends at the template's end-of-turn token
    new = int(r.stderr.split(" new]")[0].rsplit(", ", 1)[1])
    assert new < 12, r.stderr  # stopped there
    r = run_entry("generate.py", "--ckpt", cfg.train.out_dir, "--chat", "--prompt", "repeat crown", "--no-stop",
                  "--max-new-tokens", "12", "--temperature", "0", "--device", "cpu")
    assert r.stdout.startswith("crown crown crown<|im_end|>\n<|endoftext|>"), r.stdout  # the turn, end of text


@pytest.mark.parametrize("family", ["gpt2", "mistral", "phi3", "qwen2", "qwen3", "smollm3", "olmo2", "gemma3"])
def test_each_family_finetunes(family, pretrained, tmp_path):
    """The other families (llama: above) start from their weights and learn: the loss falls. Mistral's sliding
    window (8 tokens, in a 32-token context) trains as attention_window and exports as sliding_window again;
    SmolLM3's NoPE layers as nope_interval; OLMo 2's norms after the sub-blocks only (exported as OLMo 2 again);
    Gemma 3's window in its first layer only as full_attention_interval, exported as its layer_types again."""
    folder = str(tmp_path / family)
    os.makedirs(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(pretrained[0], name), folder)
    tiny_llama(folder, MODEL_VOCAB, family)
    cfg = finetune_cfg(pretrained, tmp_path, f"--init_from=hf:{folder}",
                       f"--export_hf={family in ('mistral', 'olmo2', 'gemma3')}",
                       "--eval_iters=4")
    summary = train_mod.train(cfg)
    start = load_checkpoint(os.path.join(cfg.train.out_dir, "ckpt_0000000.pt"))["config"]["model"]
    assert (start["pos_emb"], start["qkv_bias"], start["qk_norm"], start["attention_window"],
            start["nope_interval"]) == {
        "gpt2": ("learned", False, False, 0, 0), "mistral": ("rope", False, False, 8, 0),
        "phi3": ("rope", False, False, 0, 0),
        "qwen2": ("rope", True, False, 0, 0), "qwen3": ("rope", False, True, 0, 0),
        "smollm3": ("rope", False, False, 0, 2), "olmo2": ("rope", False, True, 0, 0),
        "gemma3": ("rope", False, True, 8, 0)}[family]
    val = rows(cfg.train.out_dir, "val_loss")
    assert val[-1][1] < val[0][1] - 0.3
    if family == "mistral":
        with open(os.path.join(summary["export"], "config.json")) as f:
            exported = json.load(f)
        assert (exported["architectures"], exported["sliding_window"]) == (["MistralForCausalLM"], 8)
    if family == "olmo2":
        assert (start["pre_norm"], start["sandwich_norm"], start["norm"], start["qk_norm_scope"]) == (
            False, True, "rmsnorm_fp32", "all")
        with open(os.path.join(summary["export"], "config.json")) as f:
            assert json.load(f)["architectures"] == ["Olmo2ForCausalLM"]
    if family == "gemma3":
        assert start["full_attention_interval"] == 2 and start["sandwich_norm"] and start["norm"] == "rmsnorm1p"
        with open(os.path.join(summary["export"], "config.json")) as f:
            exported = json.load(f)
        assert (exported["architectures"], exported["sliding_window"], exported["layer_types"]) == (
            ["Gemma3ForCausalLM"], 8, ["sliding_attention", "full_attention"])


def test_finetune_from_a_run_folder(tmp_path):
    """A GPT-2-shaped character-level run continued on a shorter context: its best.pt, its alphabet, its learned
    position table cut to the new block_size."""
    corpus = write_corpus(tmp_path)
    common = [f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", "--num_proc=1", "--device=cpu",
              "--batch_size=4", "--eval_iters=1", "--warmup_iters=1", "--keep_last=5"]
    train_mod.train(load_config(None, [*common, *TINY_MODEL, f"--out_dir={tmp_path}/src", "--max_iters=4",
                                       "--eval_interval=2"]))
    source = load_checkpoint(str(tmp_path / "src"), prefer="best")
    train_mod.train(load_config(None, [*common, f"--init_from={tmp_path}/src", f"--out_dir={tmp_path}/ft",
                                       "--block_size=16", "--dropout=0.1", "--max_iters=2", "--eval_interval=2"]))
    start = load_checkpoint(str(tmp_path / "ft" / "ckpt_0000000.pt"))
    assert start["tokenizer"] == source["tokenizer"]
    assert start["config"]["model"]["block_size"] == 16 and start["config"]["model"]["dropout"] == 0.1
    assert start["config"]["model"]["n_embd"] == source["config"]["model"]["n_embd"] == 32
    for key, t in source["model"].items():
        want = t[:16] if key == "transformer.wpe.weight" else t
        assert torch.equal(start["model"][key], want), key


def test_scratch_run_with_a_hub_tokenizer_resumes_without_it(pretrained, tmp_path):
    """data.tokenizer = "hf:<dir>" on a model trained from scratch: resume tokenises with the checkpoint's copy."""
    folder, _, corpus = pretrained
    common = [f"--dataset={corpus}", f"--tokenizer=hf:{folder}", f"--cache_dir={tmp_path}/cache", "--num_proc=1",
              "--device=cpu", "--batch_size=4", "--eval_iters=1", "--warmup_iters=1", f"--out_dir={tmp_path}/run",
              "--eval_interval=2", "--pos_emb=rope", "--norm=rmsnorm", "--mlp=swiglu", *TINY_MODEL]
    train_mod.train(load_config(None, [*common, "--max_iters=2"]))
    first = load_checkpoint(str(tmp_path / "run"))
    assert first["tokenizer"]["kind"] == "hf" and first["config"]["model"]["vocab_size"] == 300
    hidden = folder + ".moved"
    os.rename(folder, hidden)
    try:
        summary = train_mod.train(load_config(None, [*common, "--max_iters=4", "--init_from=resume"]))
    finally:
        os.rename(hidden, folder)
    assert summary["iters"] == 4 and load_checkpoint(str(tmp_path / "run"))["tokenizer"] == first["tokenizer"]


# ------------------------------------------------------------------------------------------------- bad input

def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


def test_config_that_contradicts_the_pretrained_model(pretrained, tmp_path):
    with pytest.raises(ConfigError) as e:
        train_mod.train(finetune_cfg(pretrained, tmp_path, "--n_layer=3", "--tokenizer=char", "--n_kv_head=2"))
    msg = one_line(e)
    assert "model.n_layer=3 (--n_layer=3) against the pretrained model's 2" in msg
    assert "data.tokenizer='char' (--tokenizer=char)" in msg and "n_kv_head" not in msg  # 2 agrees
    assert not os.path.exists(tmp_path / "run" / "ckpt_0000000.pt")


def test_context_extension_rescales_rope(pretrained, tmp_path):
    """A RoPE model fine-tuned for a longer context may set the RoPE keys (YaRN here, 4x the pretrained 256
    positions): the run's model has them, it learns, and its export carries them to transformers; a learned
    position table takes none."""
    cfg = finetune_cfg(pretrained, tmp_path, "--block_size=48", "--rope_scaling=yarn", "--rope_factor=4",
                       "--rope_original_max_pos=256", "--export_hf=true", "--eval_iters=4")
    summary = train_mod.train(cfg)
    start = load_checkpoint(os.path.join(cfg.train.out_dir, "ckpt_0000000.pt"))["config"]["model"]
    assert (start["rope_scaling"], start["rope_factor"], start["rope_original_max_pos"], start["n_layer"]) == \
        ("yarn", 4.0, 256, 2)
    val = rows(cfg.train.out_dir, "val_loss")
    assert val[-1][1] < val[0][1] - 0.3
    with open(os.path.join(summary["export"], "config.json")) as f:
        rope = json.load(f)["rope_scaling"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 256)
    folder = str(tmp_path / "gpt2")
    os.makedirs(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(pretrained[0], name), folder)
    tiny_llama(folder, MODEL_VOCAB, "gpt2")
    with pytest.raises(ConfigError) as e:
        train_mod.train(finetune_cfg(pretrained, tmp_path / "b", f"--init_from=hf:{folder}", "--rope_theta=500"))
    assert "model.rope_theta=500.0 (--rope_theta=500) against the pretrained model's 10000.0" in one_line(e)


def test_unexportable_shape_is_refused_before_training(tmp_path):
    corpus = write_corpus(tmp_path)
    cfg = load_config(None, [f"--dataset={corpus}", f"--out_dir={tmp_path}/run", "--export_hf=true",
                             "--pos_emb=rope", "--device=cpu", *TINY_MODEL])
    with pytest.raises(ConfigError) as e:
        train_mod.train(cfg)
    assert one_line(e).startswith("train.export_hf: no Hugging Face architecture represents pos_emb='rope' with "
                                  "norm='layernorm'")


def test_pretrained_folders_that_cannot_be_used(pretrained, tmp_path):
    folder = pretrained[0]
    bad = shutil.copytree(folder, tmp_path / "gemma")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(config, architectures=["GemmaForCausalLM"],
                                                     model_type="gemma")))
    with pytest.raises(HFError) as e:
        train_mod.train(finetune_cfg(pretrained, tmp_path / "a", f"--init_from=hf:{bad}"))
    assert f"cannot load 'hf:{bad}': unsupported architecture 'GemmaForCausalLM'" in one_line(e)
    no_tok = shutil.copytree(folder, tmp_path / "no-tok")
    os.remove(no_tok / "tokenizer.json")
    r = run_entry("train.py", CONFIG, f"--init_from=hf:{no_tok}", f"--out_dir={tmp_path}/b", "--device=cpu")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0] == f"error: hf:{no_tok} has no tokenizer.json (the only tokenizer format read here)"
    with pytest.raises(ConfigError) as e:
        train_mod.train(finetune_cfg(pretrained, tmp_path / "c", f"--init_from={tmp_path}/nothing-here"))
    assert "no such run folder or checkpoint file" in one_line(e)
    with pytest.raises(ConfigError, match="data.tokenizer='model' is the tokenizer of a pretrained model"):
        load_config(None, ["--tokenizer=model"])


def test_init_from_flag_is_the_config_key(pretrained, tmp_path):
    """train.py --init-from X (as generate.py and eval.py spell it) sets train.init_from: the run starts from
    the pretrained weights as --init_from=X does; with --resume it is refused in one line."""
    folder, _, corpus = pretrained
    common = [CONFIG, f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", "--num_proc=1", "--device=cpu",
              "--block_size=32", "--batch_size=8", "--max_iters=2", "--eval_interval=2", "--eval_iters=1",
              "--warmup_iters=1", "--lr_decay_iters=2", "--export_hf=false"]
    assert train_mod.main([*common, "--init-from", f"hf:{folder}", f"--out_dir={tmp_path}/flag"]) == 0
    assert train_mod.main([*common, f"--init_from=hf:{folder}", f"--out_dir={tmp_path}/key"]) == 0
    first = [rows(tmp_path / run, "val_loss") for run in ("flag", "key")]
    assert first[0] == first[1] and first[0]  # the same start, the same losses
    r = run_entry("train.py", CONFIG, "--init-from", f"hf:{folder}", "--resume", f"--out_dir={tmp_path}/r")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "--init-from and --resume" in lines[0], r.stderr
