"""ablate.py: the I/O byte model, the reduced ablation end to end, and its one-line errors."""
import json
import os

import pytest
import torch

from ablation.matched import compare_runs
from ablation import io_model
from tests.util import run_entry, write_corpus


# ----------------------------------------------------------------------------------------------- I/O model

def test_naive_bytes_exact_on_a_small_case():
    # per head: 4·N² + 4·N·D elements forward, 7·N² + 8·N·D backward
    assert io_model.naive_fwd_bytes(1, 1, 4, 2, 2) == 2 * (4 * 16 + 4 * 8) == 192
    assert io_model.naive_bwd_bytes(1, 1, 4, 2, 2) == 2 * (7 * 16 + 8 * 8) == 352
    assert io_model.naive_fwd_bytes(3, 5, 4, 2, 2) == 15 * 192  # linear in B·H


def test_streamed_rows():
    assert io_model.streamed_rows(256, 64, 64, causal=False) == 4 * 256
    assert io_model.streamed_rows(256, 64, 64, causal=True) == 64 * (1 + 2 + 3 + 4)
    assert io_model.streamed_rows(256, 64, 64, causal=True, keys_outer=True) == 256 + 192 + 128 + 64
    # ragged: query tiles of 64 over N=100 with key blocks of 32 -> keys [0, 64) and [0, 100)
    assert io_model.streamed_rows(100, 64, 32, causal=True) == 64 + 100
    assert io_model.streamed_rows(100, 64, 32, causal=False) == 2 * 100
    with pytest.raises(ValueError):
        io_model.streamed_rows(0, 64, 64, causal=True)


def test_flash_bytes_exact_on_a_small_case():
    N, D, e = 256, 64, 2
    # Q once + K, V once per query tile (4 tiles) + O, in bf16, plus the fp32 log-sum-exp
    non_causal = e * (N * D + 2 * 4 * N * D + N * D) + 4 * N
    assert io_model.flash_fwd_bytes(1, 1, N, D, e, block_m=64, block_n=64, causal=False) == non_causal == 328704
    causal = e * (N * D + 2 * 640 * D + N * D) + 4 * N
    assert io_model.flash_fwd_bytes(1, 1, N, D, e, block_m=64, block_n=64, causal=True) == causal == 230400
    # backward: delta (read O, dO; write delta) + dK/dV + dQ, non-causal, 64-row tiles everywhere
    delta = e * 2 * N * D + 4 * N
    dkdv = e * (2 * N * D + 2 * 4 * N * D + 2 * N * D) + 8 * 4 * N
    dq = e * (2 * N * D + 2 * 4 * N * D + N * D) + 8 * N
    got = io_model.flash_bwd_bytes(1, 1, N, D, e, dq_tiles=(64, 64), dkdv_tiles=(64, 64), causal=False)
    assert got == delta + dkdv + dq


def test_naive_grows_as_n_squared_flash_as_n_squared_over_tile():
    D, e, Br = 64, 2, 128
    naive = [io_model.naive_fwd_bytes(1, 1, n, D, e) for n in (16384, 32768)]
    flash = [io_model.flash_fwd_bytes(1, 1, n, D, e, block_m=Br, block_n=64, causal=False) for n in (16384, 32768)]
    assert naive[1] / naive[0] == pytest.approx(4, rel=0.01)
    assert flash[1] / flash[0] == pytest.approx(4, rel=0.01)  # N²·D/Br: still quadratic, but divided by Br
    # large N: naive ≈ 4·N², flash ≈ 2·N²·D/Br  →  ratio ≈ 2·Br/D
    assert naive[1] / flash[1] == pytest.approx(2 * Br / D, rel=0.02)
    # a taller tile moves fewer bytes; a causal mask about halves the streamed K/V
    taller = io_model.flash_fwd_bytes(1, 1, 32768, D, e, block_m=2 * Br, block_n=64, causal=False)
    causal = io_model.flash_fwd_bytes(1, 1, 32768, D, e, block_m=Br, block_n=64, causal=True)
    assert taller < flash[1] and causal / flash[1] == pytest.approx(0.5, rel=0.03)


def test_memory_model_n_squared_vs_n():
    a = [io_model.naive_activation_bytes(2, 4, n, 64, 2) for n in (1024, 2048)]
    f = [io_model.flash_activation_bytes(2, 4, n, 64, 2) for n in (1024, 2048)]
    assert a[1] / a[0] == pytest.approx(4, rel=0.05) and f[1] / f[0] == 2
    assert f[0] == 2 * 4 * (1024 * 64 * 2 + 4 * 1024)


def test_naive_impl_counts_more_passes_than_the_standard_model():
    std = io_model.naive_fwd_bytes(1, 1, 1024, 64, 2)
    impl = io_model.naive_impl_fwd_bytes(1, 1, 1024, 64, 2)
    assert impl > 3 * std
    assert io_model.fmt_bytes(1536) == "1.5 KiB" and io_model.fmt_bytes(12) == "12 B"


def test_compare_runs_measures_the_gap():
    runs = {"naive": {"step_loss": {1: 4.0, 2: 3.5, 3: 3.0}, "val": {0: 4.2, 2: 3.6}},
            "flash": {"step_loss": {1: 4.0, 2: 3.51, 3: 2.98}, "val": {0: 4.2, 2: 3.59}}}
    c = compare_runs(runs, "naive")["flash"]
    assert c["steps"] == 3 and c["max_abs_dloss"] == pytest.approx(0.02)
    assert c["val_iter"] == 2 and c["val_gap"] == pytest.approx(-0.01)


# ----------------------------------------------------------------------------------------------- end to end

def test_reduced_ablation_end_to_end(tmp_path):
    corpus = write_corpus(tmp_path)
    out = tmp_path / "ablate"
    r = run_entry("ablate.py", "--quick", "--out", out, "--seq-lens=32,64", "--train-iters=6",
                  f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", "--num_proc=1", "--n_layer=1",
                  "--n_embd=16", "--block_size=16", "--batch_size=4", "--eval_interval=3", "--eval_iters=1",
                  timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    report = (out / "report.md").read_text()
    for section in ("## Headline", "## 1. Kernel sweep", "## 2. Matched training runs",
                    "## 3. Largest context that fits", "## The I/O model"):
        assert section in report
    assert "## Why FlashAttention" in (out / "readme_section.md").read_text()
    for png in ("sweep_time.png", "sweep_memory.png", "sweep_bytes_time.png", "train_loss.png"):
        assert (out / png).stat().st_size > 5000, png
        assert f"({png})" in report
    assert "| 64 | flash |" in report and "| 64 | naive |" in report and "| 32 | sdpa |" in report
    res = json.loads((out / "results.json").read_text())
    rows = res["sweep"]["rows"]
    assert {(r["N"], r["backend"]) for r in rows} == {(n, b) for n in (32, 64) for b in ("naive", "flash", "sdpa")}
    assert all(r["status"] == "ok" and r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 for r in rows)
    m = res["matched"]
    assert set(m["runs"]) == {"naive", "flash", "sdpa"} and all(run["iters"] == 6 for run in m["runs"].values())
    assert m["compare"]["flash"]["steps"] == 6
    assert os.path.isfile(out / "train-flash" / "metrics.jsonl")
    assert "max |Δ|" in report
    if torch.cuda.is_available():  # bf16 on the GPU: measured memory, the largest-context probe runs
        assert "Memory: measured" in report, report[:3000]  # the sweep's memory column: CUDA's peak allocation
        assert "interpreter" not in report.split("## 3.")[0], report[:3000]
        assert all(r["err_vs_sdpa"] < 2e-2 for r in rows if r["backend"] != "sdpa")
        assert m["compare"]["flash"]["max_abs_dloss"] < 5e-2  # bf16 rounding of a 6-step run
        assert res["probe"] and "Skipped on the CPU" not in report
    else:  # fp32 on the CPU: analytical memory, flash through the interpreter, no probe
        assert "Memory: analytical" in report and "interpreter" in report, report[:3000]
        assert all(r["err_vs_sdpa"] < 1e-5 for r in rows if r["backend"] != "sdpa")
        assert m["compare"]["flash"]["max_abs_dloss"] < 1e-4  # the same model up to rounding
        assert "Skipped on the CPU" in report


def test_bad_config_is_one_line_and_exit_2(tmp_path):
    r = run_entry("ablate.py", "--out", tmp_path / "x", "--n_layerz=3")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("error:") and "n_layerz" in r.stderr
    r = run_entry("ablate.py", "--out", tmp_path / "x", "--seq-lens=64,abc")
    assert r.returncode == 2 and "--seq-lens" in r.stderr and r.stderr.strip().count("\n") == 0
    r = run_entry("ablate.py", str(tmp_path / "missing.toml"))
    assert r.returncode == 2 and "config file not found" in r.stderr
    assert not (tmp_path / "x").exists()  # nothing was started


def test_help():
    r = run_entry("ablate.py", "--help")
    assert r.returncode == 0 and "--seq-lens" in r.stdout and "--skip-train" in r.stdout


def test_sweep_records_where_naive_runs_out_of_memory(monkeypatch):
    """The OOM path of the GPU sweep, simulated: naive 'runs out of memory' from N=64 on."""
    import torch

    import kernels
    from ablation import report, sweep

    real = kernels._IMPLS["naive"]

    def naive_with_a_memory_limit(q, k, v, **kw):
        if q.shape[2] >= 64:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")
        return real(q, k, v, **kw)

    monkeypatch.setitem(kernels._IMPLS, "naive", naive_with_a_memory_limit)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where flash runs (no interpreter on a GPU)
    s = sweep.SweepSettings(device, torch.float32, 1, 1, 16, [32, 64, 128], cpu_reps=1)
    res = sweep.run_sweep(s, log=lambda line: None)
    assert res["oom"] == {"naive": 64}
    status = {(r["N"], r["backend"]): r["status"] for r in res["rows"]}
    assert status[(32, "naive")] == "ok" and status[(64, "naive")] == "OOM at N=64"
    assert status[(128, "naive")].startswith("not run") and status[(128, "flash")] == "ok"
    oom_row = next(r for r in res["rows"] if r["N"] == 128 and r["backend"] == "naive")
    assert oom_row["model_fwd_bytes"] == io_model.naive_fwd_bytes(1, 1, 128, 16, 4)  # still shown
    lines = "\n".join(report.headline({"sweep": res}) + report.sweep_section(res))
    assert "runs out of memory at N=64" in lines and "Out of memory: naive at N=64" in lines
