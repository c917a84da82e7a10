"""bench/train.py's table logic (the measurement itself needs a GPU): medians over fresh-process runs, failed runs
kept visible, the flash/sdpa ratio and its per-round values, the sharded/in-memory loader ratio; its fixed batch
(random or real tokens); the loaders' folders and the batches they feed (train.py's data path)."""
import glob
import importlib.util
import json
import os
import types

import numpy as np
import pytest
import torch

import kernels
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
    queued = lambda run, ms: dict(run, queued_step_ms=ms)  # noqa: E731
    flash = bt.combine("flash+compile", [queued(_run(33.0), 32.0), _run(34.0, 11.6), queued(_run(33.2), 32.4)])
    sdpa = bt.combine("sdpa+compile", [queued(_run(33.6), 32.5), {"error": "worker exit 1: OOM"},
                                       queued(_run(33.4), 32.1)])
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
    # queued figures: medians over the runs that have one (32.2 and 32.3 ms); rounds paired where both have one
    assert f"32.20 against 32.30 ms, **{32.3 / 32.2:.3f}×**" in text
    assert f"queued, per round: {32.5 / 32.0:.3f}×, {32.1 / 32.4:.3f}×\n" in text
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


def test_rope_pass_variant(tmp_path, monkeypatch):
    """flash/rope-pass: the model rotates q and k itself (rope_in_flash off in that process); its row is named
    and paired with the sdpa row of the same mode like any flash row."""
    bt = _bench_train()
    assert bt.parse_variant("flash+graphs/rope-pass") == ("flash", "graphs", "rope-pass")
    _assert_rejected(bt.parse_variant, ("sdpa+graphs/rope-pass", "flash/rope"))
    with kernels.options.use():
        assert bt.use_variant("flash+compile/rope-pass") == ("flash", True)
        assert kernels.options.get().rope_in_flash is False
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "TEST GPU")
    rows = [bt.combine("flash+compile", [_run(33.0)]), bt.combine("flash+compile/rope-pass", [_run(33.6)]),
            bt.combine("sdpa+compile", [_run(33.5)])]
    args = types.SimpleNamespace(in_process=False, repeats=1, batch=16, block=1024, steps=20, out=str(tmp_path),
                                 tokens=None, loss="auto")
    text = bt.write_results(rows, args, [])
    assert "| flash + compile, RoPE pass | 33.60 |" in text
    assert f"flash + compile, RoPE pass / sdpa + compile = **{33.5 / 33.6:.3f}×** (target ≥ 1.0×: NOT met)" in text
    assert f"flash + compile / sdpa + compile = **{33.5 / 33.0:.3f}×** (target ≥ 1.0×: met)" in text


def test_graphs_variants_pair_with_sdpa_of_the_same_mode(tmp_path, monkeypatch):
    bt = _bench_train()
    assert bt.parse_variant("flash+graphs") == ("flash", "graphs", None)
    assert bt.parse_variant("flash+graphs/fused") == ("flash", "graphs", "fused")
    _assert_rejected(bt.parse_variant, ("flash+graphs+compile", "sdpa+graph", "flash+"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "TEST GPU")
    graphs_runs = [{**_run(32.0), "reserved_gib": 9.5}, {**_run(32.2), "reserved_gib": 9.7}]
    rows = [bt.combine("flash+graphs", graphs_runs),
            bt.combine("sdpa+compile", [_run(33.5), _run(33.5)]),
            bt.combine("sdpa+graphs", [_run(32.4), _run(32.4)]),
            bt.combine("flash+compile", [_run(33.0), _run(33.0)])]
    assert [r["variant"] for r in rows] == ["flash + graphs", "sdpa + compile", "sdpa + graphs", "flash + compile"]
    args = types.SimpleNamespace(in_process=False, repeats=2, batch=16, block=1024, steps=20, out=str(tmp_path),
                                 tokens="", loss="torch")
    text = bt.write_results(rows, args, [])
    # each flash row is compared with the sdpa row of its own compile mode, not the first compiled one
    assert f"flash + graphs / sdpa + graphs = **{32.4 / 32.1:.3f}×**" in text
    assert f"flash + compile / sdpa + compile = **{33.5 / 33.0:.3f}×**" in text
    assert "flash + graphs / sdpa + compile" not in text
    # the graphs' pool is reserved before the timed steps: their rows show it beside the peak
    assert "| flash + graphs | 32.10 | " in text and " | 11.5 (9.7 reserved) | " in text
    assert "| sdpa + graphs | 32.40 | " in text and "| flash + compile | 33.00 | " in text
    assert text.count("reserved)") == 1  # only rows whose runs recorded it, only for graphs


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


def test_bad_data_kind_is_one_line_before_anything_runs(capsys):
    bt = _bench_train()
    assert bt.parse_data("memory,shards") == ["memory", "shards"] and bt.parse_data("random") == ["random"]
    _assert_rejected(bt.parse_data, ("disk", "shards,shards", ""))
    for argv, named in ((["--data", "memory,disk"], "'memory,disk'"),
                        (["--data", "shards", "--model", ROOT + "/configs/smollm2_135m.toml"], "vocabulary of 49152")):
        assert bt.main(argv) == 2  # refused for its own reason, on any machine (checked before the GPU)
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err


def test_loaders_read_one_corpus_through_trains_data_path(tmp_path):
    """Both loaders' folders come from one corpus, and loader_batch (train.py's fetch and copy) gives (x, y) windows
    of that corpus's token stream: the sharded loader the stream after its validation document, in order, never a
    token twice; the in-memory loader random windows of the stream's start (its train split). So a window both
    loaders read is the same (x, y) from either. The temporary folder is gone afterwards."""
    from data.batches import open_train_data
    from data.tokenizers import GPT2Tokenizer
    bt = _bench_train()
    B, T, steps = 2, 16, 5
    need = bt.loader_tokens(steps - 1, 1, B, T)  # what warm-up and timed steps read: steps batches and one token
    with bt.loader_folders(["memory", "shards"], need, B, T) as folders:
        work = os.path.dirname(folders["shards"])
        tok = GPT2Tokenizer()
        docs = [tok.encode(open(f, encoding="utf-8").read()) + [tok.eot_token]
                for f in sorted(glob.glob(os.path.join(work, "corpus", "*.txt")))]
        stream = np.concatenate(docs).astype(np.int64)  # every document, then end-of-text
        windows = np.lib.stride_tricks.sliding_window_view(stream, T + 1)  # (n - T, T + 1)
        sharded = open_train_data(folders["shards"], T, sharded=True, seed=0, device="cpu")
        memory = open_train_data(folders["memory"], T, sharded=False, seed=0, device="cpu")
        assert sharded.train.total >= need and len(sharded.train.entries) > 2  # the steps cross shards
        at = len(docs[0])  # the sharded train stream starts after the validation document
        for _ in range(steps):
            x, y = bt.loader_batch(sharded, B, "cpu")
            assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
            rows = stream[at:at + B * T + 1]
            assert torch.equal(x.flatten(), torch.from_numpy(rows[:-1]))
            assert torch.equal(y.flatten(), torch.from_numpy(rows[1:]))
            at += B * T
        n_train = memory.meta["train_tokens"]
        for _ in range(steps):
            x, y = bt.loader_batch(memory, B, "cpu")
            assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
            for xi, yi in zip(x.numpy(), y.numpy()):
                found = np.flatnonzero((windows[:, :T] == xi).all(axis=1))
                assert len(found) == 1 and found[0] + T < n_train  # one window of the train split
                assert (windows[found[0], 1:] == yi).all()
    assert not os.path.exists(work)


def test_corpus_from_a_token_file_is_checked(tmp_path):
    bt = _bench_train()
    short, wide = tmp_path / "short.bin", tmp_path / "wide.bin"
    np.arange(100, dtype=np.uint16).tofile(short)
    np.full(4 * 8 * 4, 60000, dtype=np.uint16).tofile(wide)
    with pytest.raises(ValueError, match="100 tokens, fewer than the 128"):
        bt.write_corpus(str(tmp_path / "c1"), 64, 8, str(short))  # 2 documents of 32 + 2 for validation
    with pytest.raises(ValueError, match="holds id 60000, not GPT-2 tokens"):
        bt.write_corpus(str(tmp_path / "c2"), 64, 8, str(wide))


def test_loader_rows_and_their_ratio(tmp_path, monkeypatch):
    bt = _bench_train()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "TEST GPU")

    def runs(*ms):
        return [dict(_run(m), mean_step_ms=m + 0.5) for m in ms]
    rows = [bt.combine("flash+compile", runs(33.0, 33.4), "memory"),
            bt.combine("flash+compile", runs(33.2, 33.3), "shards"),
            bt.combine("sdpa+compile", runs(30.0, 30.0), "memory"),
            bt.combine("sdpa+compile", runs(31.0, 31.0), "shards")]
    args = types.SimpleNamespace(in_process=False, repeats=2, batch=16, block=1024, steps=20, warmup=5,
                                 out=str(tmp_path), tokens="", loss="auto", data="memory,shards")
    text = bt.write_results(rows, args, [])
    assert "| flash + compile, in-memory loader | 33.20 |" in text and "| flash + compile, sharded loader | 33.25 |" in text
    assert "memory (in-memory loader) and shards (sharded loader)" in text and "409,601 tokens read per run" in text
    assert (f"flash + compile: sharded / in-memory loader = **{33.2 / 33.25:.3f}×** tokens/s (target ≥ 0.99×: met); "
            "mean step 33.75 ms sharded, 33.70 ms in-memory") in text
    assert f"per round: {33.0 / 33.2:.3f}×, {33.4 / 33.3:.3f}×" in text
    assert f"sdpa + compile: sharded / in-memory loader = **{30 / 31:.3f}×** tokens/s (target ≥ 0.99×: NOT met)" in text
    # flash against sdpa: each loader's rows against the same loader's
    assert f"flash + compile, sharded loader / sdpa + compile, sharded loader = **{31 / 33.25:.3f}×**" in text
    saved = json.loads((tmp_path / "train_step.json").read_text())
    assert [r["data"] for r in saved["rows"]] == ["memory", "shards", "memory", "shards"] and saved["commit"]


def test_each_variant_runs_on_each_loader_with_its_folder(tmp_path, monkeypatch):
    """main's orchestration, its processes replaced: every (variant, data) pair runs --repeats times, the order
    reversed every other round, each loader run given its prepared folder; the folders are removed at the end."""
    bt = _bench_train()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "TEST GPU")
    calls = []

    def fake_run(variant, data, folder, args):
        assert (folder == "") == (data == "random") and (not folder or os.path.isdir(folder))
        calls.append((variant, data, folder))
        return dict(_run({"memory": 33.0, "shards": 33.1, "random": 32.9}[data]), mean_step_ms=33.0)
    monkeypatch.setattr(bt, "run_isolated", fake_run)
    argv = ["--out", str(tmp_path), "--steps", "2", "--warmup", "1", "--batch", "2", "--block", "16", "--repeats",
            "2", "--variants", "flash+compile", "--data", "memory,shards"]
    assert bt.main(argv) == 0
    assert [(v, d) for v, d, _ in calls] == [("flash+compile", "memory"), ("flash+compile", "shards"),
                                             ("flash+compile", "shards"), ("flash+compile", "memory")]
    assert not any(os.path.exists(f) for _, _, f in calls)
    text = (tmp_path / "train_step.md").read_text()
    assert f"flash + compile: sharded / in-memory loader = **{33.0 / 33.1:.3f}×** tokens/s (target ≥ 0.99×: met)" in text


def test_lora_rank_trains_the_updates_only_and_is_named(tmp_path):
    """--lora-rank R: the model of every variant trains rank-R updates with the rest frozen (its optimizer holds
    them alone), the table's title says so, and a negative rank is one line."""
    bt = _bench_train()
    cfg = bt.model_config("sdpa", 32, "", "torch")
    cfg.n_layer, cfg.n_head, cfg.n_embd = 2, 2, 64
    model = bt.build_model(cfg, 4, "cpu")
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trained) == 2 * 4 * 2 and all(n.endswith(("lora_A", "lora_B")) for n in trained)
    opt = model.configure_optimizer(0.1, 6e-4, (0.9, 0.95), "cpu")
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trained)
    assert all(p.requires_grad for p in bt.build_model(cfg, 0, "cpu").parameters())  # rank 0: every weight
    args = types.SimpleNamespace(model="", lora_rank=16)
    assert bt.describe_model(args) == "GPT-2 124M, LoRA rank 16 (the rest frozen)"
    assert bt.main(["--lora-rank", "-1"]) == 2
