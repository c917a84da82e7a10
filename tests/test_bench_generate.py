"""bench/generate.py on the CPU: its arguments, its shapes, and --smoke through the Llama-family fused decode path
and the transformers provider (the timed run needs a GPU)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.util import ROOT, run_entry


@pytest.fixture(scope="module")
def bench():
    """bench/generate.py imported as a module: its helpers, without running it."""
    spec = importlib.util.spec_from_file_location("bench_generate", f"{ROOT}/bench/generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments(bench):
    a = bench.parse_args([])
    assert a.model == "gpt2" and a.batches is None and not a.smoke
    a = bench.parse_args(["--model", "smollm2", "--batches", "1,16", "--new-tokens", "256", "--smoke"])
    assert a.model == "smollm2" and a.batches == [1, 16] and a.new_tokens == 256 and a.smoke


@pytest.mark.parametrize("args", [["--model", "llama"], ["--batches", "1,x"], ["--batches", "0"],
                                  ["--prompt-len", "-3"], ["--reps", "two"]])
def test_bad_arguments_are_one_line_errors(bench, args, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "error:" in err[-1] and err[-1].split("error: ")[1].startswith("argument --")
    assert "Traceback" not in "\n".join(err)


def test_smollm2_shape_is_smollm2_135m(bench):
    """The full shape, built on the meta device: SmolLM2-135M's 134,515,008 parameters, GQA 9 over 3 heads."""
    model = bench.build_model("smollm2", False, "meta", torch.bfloat16)
    c = model.config
    assert (c.n_layer, c.n_embd, c.n_head, c.kv_heads, c.mlp_hidden, c.vocab_size) == (30, 576, 9, 3, 1536, 49152)
    assert (c.pos_emb, c.norm, c.mlp, c.bias, c.tie_embeddings, c.rope_theta) == ("rope", "rmsnorm", "swiglu", False,
                                                                                 True, 100000.0)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert set(bench.variants("cuda", False, transformers=True)) >= {"flashgpt-fused+graph", "sdpa+graph",
                                                                     "transformers-static+compile"}


def test_ratio_targets_read_the_best_graph_variant_over_transformers(bench):
    rows = [dict(batch=1, variant="flashgpt-fused+graph", decode_tok_s=900.0),
            dict(batch=1, variant="flashgpt+graph", decode_tok_s=500.0),
            dict(batch=1, variant="flashgpt-fused", decode_tok_s=5000.0),  # eager: not a graph variant
            dict(batch=1, variant="transformers-static+compile", decode_tok_s=400.0),
            dict(batch=16, variant="flashgpt-fused+graph", decode_tok_s=1000.0),
            dict(batch=16, variant="transformers-static+compile", error="RuntimeError: boom")]
    t = bench.targets_of("smollm2", rows, smoke=False)
    assert t[1]["measured"] == 2.25 and t[1]["verdict"] == "met" and t[1]["variant"].startswith("flashgpt-fused+g")
    assert t[16]["measured"] is None and t[16]["verdict"] == "not measured"
    rows[3]["decode_tok_s"] = 500.0
    assert bench.targets_of("smollm2", rows, smoke=False)[1]["verdict"] == "NOT met"


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU (interpreter) path; a GPU runs the real "
                    "benchmark")
def test_smoke_runs_the_llama_shape_through_the_fused_step_and_transformers(tmp_path):
    r = run_entry("bench/generate.py", "--smoke", "--model", "smollm2", "--no-kernel-sweep", "--out", tmp_path,
                  timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads((tmp_path / "generate_smollm2_smoke.json").read_text())
    ran = {(row["batch"], row["variant"]): row for row in data["rows"]}
    for b in (1, 2):
        for v in ("flashgpt-fused", "flashgpt", "sdpa"):
            assert "error" not in ran[b, v] and ran[b, v]["decode_tokens"] == b * 5, ran[b, v]
        assert ran[b, "flashgpt-fused+graph"]["error"].startswith("skipped")
    hf_present = importlib.util.find_spec("transformers") is not None
    for b in (1, 2):
        row = ran[b, "transformers-static"]
        assert ("error" not in row and row["decode_tokens"] == b * 5) if hf_present else \
            row["error"].startswith("skipped: transformers is not installed")
    # the fused step and plain PyTorch (and transformers, with the same float32 weights) choose the same tokens
    compared = {c["compared"]: c for c in data["correctness"] if "error" not in c}
    assert compared["flashgpt-fused vs sdpa"]["fraction"] == 1.0
    if hf_present:
        assert compared["flashgpt-fused vs transformers-static"]["fraction"] == 1.0
    assert all(t["verdict"] == "not measured" for t in data["meta"]["targets"].values())
    md = (tmp_path / "generate_smollm2_smoke.md").read_text()
    assert "python bench/generate.py --smoke --model smollm2" in md and "rmsnorm" in md


def test_unmerged_sums_variant_runs_the_stack_without_its_option(bench):
    """flashgpt-fused-unmerged+graph: the default graph step with the kernel option decode_stack_merged_sums off,
    for an A/B run against flashgpt-fused+graph."""
    from kernels import options
    assert bench.variants("cuda", False)["flashgpt-fused-unmerged+graph"] == bench.variants("cuda", False)[
        "flashgpt-fused+graph"]
    assert options.get().decode_stack_merged_sums
    with bench.VARIANT_SETUP["flashgpt-fused-unmerged+graph"]():
        assert not options.get().decode_stack_merged_sums and options.get().decode_stack
    assert options.get().decode_stack_merged_sums


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU (interpreter) path; a GPU runs the real "
                    "benchmark")
@pytest.mark.parametrize("name,feature", [("qwen3", "qk_norm"), ("gemma3", "rmsnorm1p"), ("olmo2", "rmsnorm_fp32")])
def test_smoke_runs_the_normed_shapes_through_the_fused_step_and_transformers(tmp_path, name, feature):
    """Qwen3 (q and k norms in the fused QKV kernel), Gemma 3 (offset norms, GeGLU, windows) and OLMo 2 (norms after
    the sub-blocks, q/k norms over all heads): the fused step, plain PyTorch and transformers' own model on the same
    weights choose the same tokens."""
    r = run_entry("bench/generate.py", "--smoke", "--model", name, "--no-kernel-sweep", "--out", tmp_path,
                  "--variants", "flashgpt-fused,sdpa,transformers-static", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads((tmp_path / f"generate_{name}_smoke.json").read_text())
    ran = {(row["batch"], row["variant"]): row for row in data["rows"]}
    for b in (1, 2):
        assert "error" not in ran[b, "flashgpt-fused"] and ran[b, "flashgpt-fused"]["decode_tokens"] == b * 5
    compared = {c["compared"]: c for c in data["correctness"] if "error" not in c}
    assert compared["flashgpt-fused vs sdpa"]["fraction"] == 1.0
    if importlib.util.find_spec("transformers") is not None:
        assert compared["flashgpt-fused vs transformers-static"]["fraction"] == 1.0
    assert feature in (tmp_path / f"generate_{name}_smoke.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU (interpreter) path; a GPU runs the real "
                    "benchmark")
def test_smoke_takes_a_training_configs_shape(tmp_path):
    """--model FILE.toml: the [model] section of a training config (llama_demo's, narrowed for the interpreter),
    results named after the file."""
    demo = (Path(ROOT) / "configs" / "llama_demo.toml").read_text()
    assert "n_embd = 128" in demo and "vocab_size" not in demo
    toml = tmp_path / "narrow_llama.toml"
    toml.write_text(demo.replace("n_embd = 128", "n_embd = 64\nvocab_size = 96").replace("n_layer = 4", "n_layer = 1"))
    r = run_entry("bench/generate.py", "--smoke", "--model", toml, "--no-kernel-sweep",
                  "--out", tmp_path, "--variants", "flashgpt-fused,sdpa", "--batches", "1", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads((tmp_path / "generate_narrow_llama_smoke.json").read_text())
    assert "n_layer 1, n_head 4, n_kv_head 2" in data["meta"]["shape"] and "vocab 96" in data["meta"]["shape"]
    compared = {c["compared"]: c for c in data["correctness"] if "error" not in c}
    assert compared["flashgpt-fused vs sdpa"]["fraction"] == 1.0


def test_a_bad_config_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nn_head = 3\nn_embd = 64\n")
    r = run_entry("bench/generate.py", "--smoke", "--model", bad, "--out", tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {bad}: model.n_embd=64: must be divisible by n_head=3 (or set head_size)"]
    r = run_entry("bench/generate.py", "--model", tmp_path / "absent.toml", timeout=120)
    assert r.returncode == 2 and "no config file" in r.stderr
