"""LoRA fine-tuning (train.lora_rank, model/lora.py): the wrapped model starts exactly at the pretrained one, only
the updates train and every pretrained weight stays as it was, the merged weights compute what the wrapped model
computes, the run resumes to the losses of one run, its checkpoints generate, export (transformers' logits) and
start another run as the merged model; bad settings are one line each."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import train as train_mod  # noqa: E402
from config import load_config  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from model.config import ConfigError  # noqa: E402
from model.lora import (LORA_TARGETS, LoRALinear, LoRASettings, apply_lora, inference_weights,  # noqa: E402
                        is_lora_key, merged_state)
from tests.hf_models import pretrained_llama, tiny_llama  # noqa: E402
from tests.util import ROOT, run_entry  # noqa: E402

peft = pytest.importorskip("peft")  # a dev dependency, as transformers is

transformers.logging.set_verbosity_error()
CONFIG = os.path.join(ROOT, "configs", "finetune_tiny.toml")
MODEL_VOCAB = 320
SHAPES = {"gpt2": dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=50),
          "llama": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16, vocab_size=50, pos_emb="rope",
                        norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)}


def double_model(family: str, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**SHAPES[family], attention="naive")).double().eval()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_wrapped_model_starts_at_the_base_trains_only_the_updates_and_merges(family):
    base = double_model(family, 0)
    wrapped = double_model(family, 0)
    settings = LoRASettings(rank=3, alpha=6.0, targets=("attn.c_attn", "mlp.c_fc", "mlp.c_proj"))
    trained = apply_lora(wrapped, settings)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(wrapped(idx)[0], base(idx)[0])  # B = 0: exactly the pretrained model
    cfg = wrapped.config
    widths = {"attn.c_attn": (cfg.n_embd, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim),
              "mlp.c_fc": (cfg.n_embd, cfg.mlp_hidden * (2 if cfg.mlp == "swiglu" else 1)),
              "mlp.c_proj": (cfg.mlp_hidden, cfg.n_embd)}
    assert trained == cfg.n_layer * sum(3 * (i + o) for i, o in widths.values())
    names = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert names == {f"transformer.h.{i}.{t}.{ab}" for i in range(cfg.n_layer) for t in settings.targets
                     for ab in ("lora_A", "lora_B")}
    assert isinstance(wrapped.transformer.h[0].attn.c_attn, LoRALinear)
    assert not isinstance(wrapped.transformer.h[0].attn.c_proj, LoRALinear)  # not a target
    # GPT's own names stay: the base's keys plus the updates'
    state = wrapped.state_dict()
    assert {k for k in state if not is_lora_key(k)} == set(base.state_dict())
    # a trained update: the merged weights give the wrapped model's logits
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in wrapped.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    merged = double_model(family, 5)  # other weights: all of them come from the merged state
    merged.load_state_dict(merged_state(wrapped.state_dict(), settings))
    with torch.no_grad():
        want, got = wrapped(idx)[0], merged(idx)[0]
        assert (want - base(idx)[0]).abs().max() > 1e-2  # the update changed the model
        assert (want - got).abs().max() <= 1e-10
    # gradients reach the updates only
    wrapped.train()
    wrapped(idx, targets=idx)[1].backward()
    assert all((p.grad is not None) == p.requires_grad for p in wrapped.parameters())
    assert any(p.grad.abs().max() > 0 for n, p in wrapped.named_parameters() if n.endswith("lora_A"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_update_added_in_the_gemm_epilogue_computes_the_same(dtype):
    """Kernel option lora_addmm: the update added by addmm onto the frozen output gives the same outputs and the
    same gradients of A and B and of the input as the update as its own tensor."""
    from kernels import options
    torch.manual_seed(3)
    layer = LoRALinear(torch.nn.Linear(24, 40).to(dtype).requires_grad_(False), LoRASettings(rank=4, alpha=12.0))
    with torch.no_grad():
        layer.lora_B.normal_()  # a trained update (B starts at zeros)
    x = torch.randn(3, 5, 24, dtype=dtype)
    results = []
    for on in (False, True):
        xi = x.clone().requires_grad_(True)
        with options.use(lora_addmm=on):
            y = layer(xi)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad, layer.lora_A.grad.clone(), layer.lora_B.grad.clone()))
        layer.lora_A.grad = layer.lora_B.grad = None
    tol = 1e-12 if dtype == torch.float64 else 1e-4  # float32: other summation orders (gradients ~100)
    assert results[0][0].shape == (3, 5, 40)
    for plain, fused in zip(*results):
        torch.testing.assert_close(fused, plain, atol=tol, rtol=tol)
    assert layer.weight.grad is None and layer.bias.grad is None  # the base stays frozen


def test_merged_state_names_a_missing_half():
    state = double_model("gpt2", 0)
    apply_lora(state, LoRASettings(rank=2, alpha=2.0))
    sd = state.state_dict()
    for drop, missing in (("transformer.h.1.mlp.c_fc.lora_B", "lora_B"),
                          ("transformer.h.0.attn.c_proj.lora_A", "lora_A")):
        broken = {k: v for k, v in sd.items() if k != drop}
        with pytest.raises(ValueError, match=f"{drop.rsplit('.', 1)[0]}: its {missing}"):
            merged_state(broken, LoRASettings(rank=2, alpha=2.0))
    assert inference_weights({"model": sd}) is sd  # no "lora" entry: a plain run's weights as they are


# ------------------------------------------------------------------------------------------------- training runs

@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """(folder of a random Llama + tokenizer.json, corpus path)."""
    folder, _, corpus = pretrained_llama(tmp_path_factory.mktemp("pretrained"), MODEL_VOCAB)
    return folder, corpus


def lora_cfg(pretrained, tmp, *extra):
    folder, corpus = pretrained
    return load_config(CONFIG, [f"--init_from=hf:{folder}", f"--dataset={corpus}", f"--out_dir={tmp}/run",
                                f"--cache_dir={tmp}/cache", "--num_proc=1", "--device=cpu", "--block_size=32",
                                "--batch_size=8", "--max_iters=12", "--eval_interval=6", "--eval_iters=4",
                                "--warmup_iters=2", "--learning_rate=2e-2", "--lr_decay_iters=12",
                                "--log_interval=1", "--keep_last=5", "--lora_rank=4", "--lora_alpha=8",
                                *extra])


def rows(run, key):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [(r["iter"], r[key]) for r in map(json.loads, f) if key in r]


def test_lora_run_learns_keeps_the_base_and_exports_the_merged_model(pretrained, tmp_path):
    cfg = lora_cfg(pretrained, tmp_path)
    summary = train_mod.train(cfg)
    run = cfg.train.out_dir
    start = load_checkpoint(os.path.join(run, "ckpt_0000000.pt"))
    end = load_checkpoint(os.path.join(run, "ckpt_0000012.pt"))
    assert end["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": list(LORA_TARGETS),
                           "base": f"hf:{pretrained[0]}"}
    lora_keys = [k for k in end["model"] if is_lora_key(k)]
    assert len(lora_keys) == 2 * 2 * len(LORA_TARGETS)  # 2 layers
    for key, t in end["model"].items():
        if is_lora_key(key):
            assert key.endswith("lora_A") or not torch.equal(t, start["model"][key]), key  # B left zero: trained
        else:
            assert torch.equal(t, start["model"][key]), key  # every pretrained weight as it was
    # the optimizer holds state for the updates alone
    state = end["optimizer"]["state"]
    assert len(state) == len(lora_keys) and all(s["exp_avg"].dim() == 2 for s in state.values())
    val = rows(run, "val_loss")
    assert [i for i, _ in val] == [0, 6, 12] and val[-1][1] < val[0][1] - 0.2, val
    # the export is the merged model: transformers gives its logits
    exported = transformers.AutoModelForCausalLM.from_pretrained(summary["export"]).eval()
    best = load_checkpoint(run, prefer="best")
    ours = GPT(GPTConfig(**best["config"]["model"]))
    ours.load_state_dict(inference_weights(best))
    wrapped = GPT(GPTConfig(**best["config"]["model"]))
    apply_lora(wrapped, LoRASettings.from_dict(best["lora"]))
    wrapped.load_state_dict(best["model"])
    idx = torch.randint(0, MODEL_VOCAB, (2, 32))
    with torch.no_grad():
        want = wrapped.eval()(idx)[0]
        assert (ours.eval()(idx)[0] - want).abs().max() <= 1e-5
        assert (exported(idx).logits - want).abs().max() <= 1e-4
    # the PEFT adapter on the pretrained model gives them too
    adapter = json.loads(open(os.path.join(summary["export_adapter"], "adapter_config.json")).read())
    assert adapter["base_model_name_or_path"] == pretrained[0] and (adapter["r"], adapter["lora_alpha"]) == (4, 8.0)
    assert adapter["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    peft_model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(pretrained[0]), summary["export_adapter"]).eval()
    with torch.no_grad():
        assert (peft_model(idx).logits - want).abs().max() <= 1e-4
        # and read back here as a model: the adapter on its base, merged (model/hf_adapter.py)
        assert (GPT.from_pretrained(summary["export_adapter"])(idx)[0] - want).abs().max() <= 1e-5
    # generate.py reads the run as the merged model
    r = run_entry("generate.py", "--ckpt", run, "--prompt", "the king", "--max-new-tokens", "5", "--device", "cpu",
                  "--temperature", "0")
    assert r.returncode == 0 and r.stdout.startswith("the king"), r.stderr
    # and a run started from it begins at the merged weights, with no LoRA of its own unless asked
    nxt = load_config(CONFIG, [f"--init_from={run}", f"--dataset={pretrained[1]}", f"--out_dir={tmp_path}/next",
                               f"--cache_dir={tmp_path}/cache", "--num_proc=1", "--device=cpu", "--block_size=32",
                               "--batch_size=8", "--max_iters=1", "--eval_interval=1", "--eval_iters=1",
                               "--warmup_iters=0", "--export_hf=false"])
    train_mod.train(nxt)
    first = load_checkpoint(os.path.join(nxt.train.out_dir, "ckpt_0000000.pt"))
    assert "lora" not in first and set(first["model"]) == set(ours.state_dict())
    for key, t in inference_weights(best).items():
        assert torch.equal(first["model"][key], t), key


def test_lora_run_resumes_to_the_losses_of_one_run(pretrained, tmp_path):
    a = lora_cfg(pretrained, tmp_path / "a", "--export_hf=false", "--lora_dropout=0.1")
    train_mod.train(a)
    b = lora_cfg(pretrained, tmp_path / "b", "--export_hf=false", "--lora_dropout=0.1", "--max_iters=6")
    train_mod.train(b)
    train_mod.train(lora_cfg(pretrained, tmp_path / "b", "--export_hf=false", "--lora_dropout=0.1",
                             "--init_from=resume"))
    assert rows(a.train.out_dir, "loss") == rows(b.train.out_dir, "loss")  # bit-identical on CPU
    assert rows(a.train.out_dir, "val_loss") == rows(b.train.out_dir, "val_loss")
    # another LoRA (or none) on resume: one line, nothing written
    for extra, asked in ((["--lora_rank=8"], "rank 8"), (["--lora_rank=0"], "no LoRA")):
        with pytest.raises(ConfigError) as e:
            train_mod.train(lora_cfg(pretrained, tmp_path / "b", "--export_hf=false", "--lora_dropout=0.1",
                                     "--max_iters=14", "--init_from=resume", *extra))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"--resume: train.lora_* ask for {asked}") and \
            "holds rank 4, alpha 8, dropout 0.1" in msg, msg
    assert not os.path.exists(os.path.join(b.train.out_dir, "ckpt_0000014.pt"))


def test_a_damaged_lora_checkpoint_is_one_line(pretrained, tmp_path):
    cfg = lora_cfg(pretrained, tmp_path, "--export_hf=false", "--max_iters=2", "--eval_interval=2")
    train_mod.train(cfg)
    path = os.path.join(cfg.train.out_dir, "ckpt_0000002.pt")
    ckpt = load_checkpoint(path)
    del ckpt["model"]["transformer.h.0.mlp.c_fc.lora_B"]
    save_checkpoint(ckpt, path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    for r in (run_entry("generate.py", "--ckpt", path, "--prompt", "a", "--max-new-tokens", "1", "--device", "cpu"),
              subprocess.run([sys.executable, "-m", "model.export", "--ckpt", path, "--out", str(tmp_path / "hf")],
                             capture_output=True, text=True, cwd=ROOT, env=env)):
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1, r.stderr
        assert "LoRA update transformer.h.0.mlp.c_fc: its lora_B or its weight is missing" in lines[0], lines


@pytest.mark.parametrize("flag, message", [
    ("--lora_rank=-1", "train.lora_rank=-1: must be a rank, or 0"),
    ("--lora_alpha=0", "train.lora_alpha=0.0: must be positive"),
    ("--lora_dropout=1", "train.lora_dropout=1.0: must be in [0, 1)"),
    ("--lora_targets=attn.c_attn,attn.q", "train.lora_targets='attn.c_attn,attn.q': unknown 'attn.q'; choose from"),
    ("--lora_targets=mlp.c_fc,mlp.c_fc", "a projection named twice"),
    ("--init_from=scratch", "train.lora_rank=4: LoRA adapts pretrained weights"),
    ("--parallel=fsdp", "train.lora_rank=4 with train.parallel=fsdp: not supported"),
])
def test_bad_lora_settings_are_one_line(flag, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--lora_rank=4", "--init_from=hf:./x", flag])
    assert message in str(e.value) and "\n" not in str(e.value)
    r = run_entry("train.py", "--lora_rank=4", "--init_from=hf:./x", flag)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("flag", ["--compile=true", "--activation_checkpointing=true"])
def test_compiled_or_checkpointed_lora_run_gives_the_eager_losses(flag, pretrained, tmp_path):
    """train.compile, or activation checkpointing (the first block's input then needs no gradient: only the
    updates inside do), with the LoRA layers in the model: the same losses as eager, to float32 rounding."""
    eager = lora_cfg(pretrained, tmp_path / "eager", "--export_hf=false", "--max_iters=4", "--eval_interval=4")
    compiled = lora_cfg(pretrained, tmp_path / "compiled", "--export_hf=false", "--max_iters=4", "--eval_interval=4",
                        flag)
    train_mod.train(eager)
    train_mod.train(compiled)
    want, got = rows(eager.train.out_dir, "loss"), rows(compiled.train.out_dir, "loss")
    assert [i for i, _ in got] == [1, 2, 3, 4] and want[-1][1] < want[0][1] - 0.3, want
    assert all(abs(a - b) <= 1e-4 for (_, a), (_, b) in zip(want, got)), (want, got)


def test_gpt2_adapter_of_some_projections_loads_in_peft(pretrained, tmp_path):
    """A GPT-2 model (Conv1D layers, attn.c_proj and mlp.c_proj sharing a last name) with updates on two of its
    projections: PEFT puts them on exactly those modules and gives the run's logits."""
    import shutil
    folder = str(tmp_path / "gpt2")
    os.makedirs(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(pretrained[0], name), folder)
    tiny_llama(folder, MODEL_VOCAB, "gpt2")
    cfg = lora_cfg(pretrained, tmp_path, f"--init_from=hf:{folder}", "--lora_targets=mlp.c_proj,attn.c_attn",
                   "--max_iters=4", "--eval_interval=4")
    summary = train_mod.train(cfg)
    adapter = json.loads(open(os.path.join(summary["export_adapter"], "adapter_config.json")).read())
    assert adapter["target_modules"] == ["attn.c_attn", "mlp.c_proj"] and adapter["fan_in_fan_out"] is True
    peft_model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(folder), summary["export_adapter"]).eval()
    wrapped_modules = {n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)}
    assert {n.split("transformer.")[-1] for n in wrapped_modules} == {"h.0.attn.c_attn", "h.1.attn.c_attn",
                                                                      "h.0.mlp.c_proj", "h.1.mlp.c_proj"}
    best = load_checkpoint(cfg.train.out_dir, prefer="best")
    ours = GPT(GPTConfig(**best["config"]["model"]))
    ours.load_state_dict(inference_weights(best))
    idx = torch.randint(0, MODEL_VOCAB, (2, 32))
    with torch.no_grad():
        want = ours.eval()(idx)[0]
        assert (peft_model(idx).logits - want).abs().max() <= 1e-4
    # a run without LoRA has no adapter to export: one line
    r = subprocess.run([sys.executable, "-m", "model.export", "--ckpt", os.path.join(ROOT, "nothing-here"),
                        "--adapter", "--out", str(tmp_path / "x")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
