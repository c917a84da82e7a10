"""bench/train.py's table logic (the measurement itself needs a GPU): medians over fresh-process runs, failed runs
kept visible, the flash/sdpa ratio and its per-round values; its fixed batch (random or real tokens)."""
import importlib.util
import json
import types

import numpy as np
import pytest
import torch

from tests.util import ROOT


def _bench_train():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT + "/bench/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_rejected(parse, bad_values) -> None:
    """parse(bad) raises a ValueError that names the bad value, for each of bad_values."""
    for bad in bad_values:
        try:
            parse(bad)
        except ValueError as e:
            assert repr(bad) in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def _run(step_ms: float, mem: float = 11.5) -> dict:
    tok_s = 16 * 1024 / (step_ms / 1e3)
    return {"step_ms": step_ms, "tokens_per_s": tok_s, "mfu": tok_s * 8.7e8 / 989e12, "peak_mem_gib": mem}


def test_rows_are_medians_over_runs_and_keep_failures(tmp_path, monkeypatch):
    bt = _bench_train()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "TEST GPU")
    flash = bt.combine("flash+compile", [_run(33.0), _run(34.0, 11.6), _run(33.2)])
    sdpa = bt.combine("sdpa+compile", [_run(33.6), {"error": "worker exit 1: OOM"}, _run(33.4)])
    naive = bt.combine("naive", [{"error": "worker exit 1: CUDA out of memory"}])
    assert flash["variant"] == "flash + compile" and flash["step_ms"] == 33.2 and flash["peak_mem_gib"] == 11.6
    assert abs(flash["tokens_per_s"] - 16 * 1024 / 0.0332) < 1e-6 * flash["tokens_per_s"]
    assert abs(flash["mfu"] - _run(33.2)["mfu"]) < 1e-12
    assert sdpa["step_ms"] == 33.5 and sdpa["runs_step_ms"] == [33.6, None, 33.4] and len(sdpa["errors"]) == 1
    assert "step_ms" not in naive and "out of memory" in naive["error"]

    args = types.SimpleNamespace(in_process=False, repeats=3, batch=16, block=1024, steps=30, out=str(tmp_path),
                                 tokens="", loss="auto")
    text = bt.write_results([flash, sdpa, naive], args, ["--repeats", "3"])
    assert "uniform random tokens" in text
    assert "| flash + compile | 33.20 |" in text and "33.00, 34.00, 33.20" in text
    assert "33.60, failed, 33.40" in text and "CUDA out of memory" in text
    assert f"**{33.5 / 33.2:.3f}×** (target ≥ 1.0×: met)" in text
    assert f"per round: {33.6 / 33.0:.3f}×, {33.4 / 33.2:.3f}×" in text  # the failed round is left out
    saved = json.loads((tmp_path / "train_step.json").read_text())
    assert saved["device"] == "TEST GPU" and [r["variant"] for r in saved["rows"]] == [
        "flash + compile", "sdpa + compile", "naive"]
    assert (tmp_path / "train_step.md").read_text() == text


def test_needs_a_gpu_and_valid_counts():
    bt = _bench_train()
    if not torch.cuda.is_available():
        assert bt.main(["--steps", "5"]) == 2
    else:
        assert bt.main(["--repeats", "0"]) == 2


def test_tiles_are_parsed_checked_and_listed_per_run(tmp_path, monkeypatch):
    bt = _bench_train()
    assert bt.parse_tiles("fwd=128x64x8x4,dkdv=32x128x4x3") == {"fwd": (128, 64, 8, 4), "dkdv": (32, 128, 4, 3)}
    assert bt.parse_tiles("") == {}
    _assert_rejected(bt.parse_tiles, ("dk=32x128x4x3", "dq=32x128x4", "fwd=128x64x8xfour", "fwd"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "TEST GPU")
    runs = [dict(_run(33.3), tiles={"fwd": "128x64x8x4", "dq": "128x64x8x3", "dkdv": "32x128x4x3"},
                 energy_j_per_step=22.0, power_w=660.0),
            dict(_run(33.7), tiles={"fwd": "128x64x8x4", "dq": "64x64x4x3", "dkdv": "64x128x8x3"},
                 energy_j_per_step=23.0, power_w=682.0)]
    flash = bt.combine("flash+compile", runs)
    args = types.SimpleNamespace(in_process=False, repeats=2, batch=16, block=1024, steps=20, out=str(tmp_path),
                                 tokens="data/train.bin", loss="torch")
    text = bt.write_results([flash, bt.combine("sdpa+compile", [_run(33.6), _run(33.6)])], args, [])
    assert "| flash + compile | 33.50 | " in text and "| 11.5 | 22.50, 671 | 33.30, 33.70 |" in text  # energy
    assert "| sdpa + compile | 33.60 | " in text and "| 11.5 | — | 33.60, 33.60 |" in text  # not measured
    assert "- flash + compile, 33.30 ms: fwd 128x64x8x4, dq 128x64x8x3, dkdv 32x128x4x3" in text
    assert "- flash + compile, 33.70 ms: fwd 128x64x8x4, dq 64x64x4x3, dkdv 64x128x8x3" in text
    assert bt.main(["--tiles", "dkdv=1x2"]) == 2  # bad --tiles: one line, exit 2 (no GPU needed to refuse it)


def test_variants_with_a_backward_mode(tmp_path, monkeypatch):
    bt = _bench_train()
    assert bt.parse_variant("flash+compile/fused") == ("flash", True, "fused")
    assert bt.parse_variant("sdpa") == ("sdpa", False, None)
    _assert_rejected(bt.parse_variant, ("sdpa+compile/fused", "flash/atomic", "flash+jit", "flashy"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "TEST GPU")
    rows = [bt.combine("flash+compile/split", [_run(33.6), _run(33.4)]),
            bt.combine("flash+compile/fused", [_run(33.0), _run(33.2)]),
            bt.combine("sdpa+compile", [_run(33.5), _run(33.5)])]
    args = types.SimpleNamespace(in_process=False, repeats=2, batch=16, block=1024, steps=20, out=str(tmp_path),
                                 tokens="data/train.bin", loss="torch")
    text = bt.write_results(rows, args, [])
    assert "tokens of data/train.bin; loss kernel torch" in text
    assert "| flash + compile, fused bwd | 33.10 |" in text
    assert f"flash + compile, split bwd / sdpa + compile = **{33.5 / 33.5:.3f}×** (target ≥ 1.0×: met)" in text
    assert f"flash + compile, fused bwd / sdpa + compile = **{33.5 / 33.1:.3f}×**" in text
    assert bt.main(["--variants", "flash+compile/atomic"]) == 2


def test_fixed_batch_random_or_windows_of_a_token_file(tmp_path):
    bt = _bench_train()
    x, y = bt.fixed_batch(3, 8, "", device="cpu")
    assert x.shape == y.shape == (3, 8) and int(x.max()) < 50304
    path = tmp_path / "train.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    x, y = bt.fixed_batch(3, 8, str(path), device="cpu")  # windows at 0, 45.5 -> 45, 91
    assert x[:, 0].tolist() == [0, 45, 91] and torch.equal(y, x + 1) and x.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    with pytest.raises(ValueError, match="fewer than batch x"):
        bt.fixed_batch(12, 8, str(path), device="cpu")


def test_model_from_a_config_and_its_llama_pieces():
    """--model takes a training config's [model] section (its vocabulary, GQA and Llama pieces) at --block, and the
    fixed batch's random tokens stay below that vocabulary; without --model, GPT-2 124M's shape."""
    bt = _bench_train()
    c = bt.model_config("flash", 256, ROOT + "/configs/smollm2_135m.toml", "triton")
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.vocab_size, c.block_size) == (30, 576, 9, 3, 49152, 256)
    assert (c.attention, c.llama_kernels, c.pos_emb, c.mlp) == ("flash", "triton", "rope", "swiglu")
    g = bt.model_config("sdpa", 128)
    assert (g.n_layer, g.n_embd, g.vocab_size, g.block_size, g.attention) == (12, 768, 50304, 128, "sdpa")
    x, y = bt.fixed_batch(64, 32, None, device="cpu", vocab=c.vocab_size)
    assert x.shape == y.shape == (64, 32) and int(x.max()) < 49152 and int(y.max()) < 49152
    args = types.SimpleNamespace(model=ROOT + "/configs/smollm2_135m.toml", block=2048, llama_kernels="torch")
    assert bt.describe_model(args).startswith("smollm2_135m.toml (30 layers, 576 wide, 9/3 heads, rope")
    assert bt.describe_model(types.SimpleNamespace(model="")) == "GPT-2 124M"
    with pytest.raises(ValueError, match="config file not found"):
        bt.model_config("flash", 256, ROOT + "/configs/missing.toml")
