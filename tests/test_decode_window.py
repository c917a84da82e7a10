"""Split-KV decode attention with a sliding window vs the float64 naive reference with the same window.

The token at position p sees positions p - window + 1 .. p. Besides the cache past each sequence's length, the
positions before its earliest new token's window are poisoned (NaN / inf): the kernel must never read them. Runs
on CUDA when present (bf16 included), otherwise through the Triton interpreter (test_decode sets it up).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import kernels._triton as kt
from kernels import options
from kernels.decode import SINGLE_SPLIT_MAX_LEN, auto_num_splits, decode_attention, short_grid_splits
from tests.test_decode import DEVICE, DTYPES, ROOT, check, make_case, workspaces  # noqa: F401 (a fixture)
from tests.util import pythonpath


def make_window_case(B, Hq, Hkv, Nq, D, lens, max_len, dtype, window, seed=0):
    """make_case, with every position before a sequence's first visible key poisoned as well."""
    q, k, v, lens_t = make_case(B, Hq, Hkv, Nq, D, lens, max_len, dtype, seed=seed)
    for b, L in enumerate(lens):
        first = max(L - Nq - window + 1, 0)  # the earliest new token (position L - Nq) sees from here on
        k[b, :, :first] = float("nan")
        v[b, :, :first] = float("inf") if b % 2 == 0 else float("nan")
    return q, k, v, lens_t


LENS_NQ1 = [1, 17, 100, 257, 1000]
LENS_NQ4 = [4, 17, 100, 257, 1000]


@pytest.mark.parametrize("window", [1, 7, 64, 200])
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["nosplit", "split3", "auto"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Nq, lens", [(1, LENS_NQ1), (4, LENS_NQ4)], ids=["nq1", "nq4"])
@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_window_matches_the_reference(window, num_splits, dtype, Nq, lens, Hq, Hkv, monkeypatch):
    # windows shorter than the new tokens (1), than a block (7), one block (64) and several; caches both shorter
    # and far longer than the window, in one batch
    monkeypatch.setattr(kt, "sm_count", lambda device: 64)  # a GPU's worth of SMs: the automatic plan splits
    q, k, v, lens_t = make_window_case(len(lens), Hq, Hkv, Nq, 48, lens, max_len=1040, dtype=dtype, window=window,
                                       seed=window + Nq + Hq)
    with options.use(decode_min_keys_per_split=32):
        check(q, k, v, lens_t, dtype, num_splits=num_splits, window=window, check_lens=False)


@pytest.mark.parametrize("order", ["strided", "chunks"])
@pytest.mark.parametrize("merge_in_split", [False, True], ids=["merge-launch", "merge-in-split"])
def test_window_in_both_split_orders_and_either_merge(order, merge_in_split, monkeypatch):
    monkeypatch.setattr(kt, "sm_count", lambda device: 64)
    lens, window = [5, 300, 1500, 1999], 700
    q, k, v, lens_t = make_window_case(len(lens), 6, 2, 3, 40, lens, max_len=2048, dtype=torch.float16,
                                       window=window, seed=3)
    with options.use(decode_min_keys_per_split=128, decode_split_order=order, decode_merge_in_split=merge_in_split):
        for num_splits in (None, 5):
            check(q, k, v, lens_t, torch.float16, num_splits=num_splits, window=window, check_lens=False)


def test_the_split_plan_follows_the_window_not_the_cache(workspaces, monkeypatch):  # noqa: F811
    monkeypatch.setattr(kt, "sm_count", lambda device: 64)
    dtype = torch.float32
    q, k, v, lens = make_window_case(1, 2, 2, 1, 32, [4000], max_len=4096, dtype=dtype, window=300, seed=4)
    with options.use(decode_min_keys_per_split=128):
        check(q, k, v, lens, dtype, window=300)
        assert not workspaces  # 300 keys to read (<= SINGLE_SPLIT_MAX_LEN): one split, no parts, no merge
        assert 300 <= SINGLE_SPLIT_MAX_LEN
        q, k, v, lens = make_case(1, 2, 2, 1, 32, [4000], max_len=4096, dtype=dtype, seed=4)
        check(q, k, v, lens, dtype)  # without the window the same 4,000 keys are split
        assert workspaces and workspaces[-1].shape[1] == auto_num_splits(2, 4000, DEVICE) > 1
        # a longer window: the grid is sized for its keys (the window and the later new tokens), not the capacity
        q, k, v, lens = make_window_case(1, 2, 2, 1, 32, [4000], max_len=4096, dtype=dtype, window=1500, seed=5)
        check(q, k, v, lens, dtype, window=1500, check_lens=False)
        span = 1500 + 1 - 1
        grid = short_grid_splits(2, auto_num_splits(2, span, DEVICE), span, DEVICE)
        assert workspaces[-1].shape[1] == grid < auto_num_splits(2, 4096, DEVICE)


def test_a_window_as_long_as_the_cache_cuts_nothing():
    q, k, v, lens = make_case(2, 4, 2, 2, 32, [40, 64], max_len=64, dtype=torch.float32, seed=6)
    plain = check(q, k, v, lens, torch.float32, num_splits=2)
    for window in (64, 1000):
        torch.testing.assert_close(check(q, k, v, lens, torch.float32, num_splits=2, window=window), plain,
                                   atol=0, rtol=0)


@pytest.mark.parametrize("window", [-1, True, 2.0, None])
def test_bad_window_is_refused_before_launch(window):
    q, k, v, lens = make_case(1, 2, 2, 1, 32, [8], max_len=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        decode_attention(q, k, v, lens, window=window)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="--smoke is the CPU (interpreter) path; a GPU runs the real benchmark")
def test_bench_with_a_window(tmp_path):
    """bench/decode_attention.py --window: the decode providers with the window, SDPA on the window's slice and
    with its mask over the capacity, each checked against the windowed reference; bytes count the window."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath(str(ROOT)))
    r = subprocess.run([sys.executable, "bench/decode_attention.py", "--smoke", "--out", str(tmp_path), "--window",
                        "100", "--providers", "split,nosplit,sdpa,sdpa-mask,copy", "--batches", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "decode_attention_smoke.json").read_text())
    assert data["meta"]["window"] == 100 and not data["meta"]["correctness_failures"]
    assert [row["L"] for row in data["rows"]] == [64, 600]
    for row in data["rows"]:
        assert set(row["providers"]) == {"split", "nosplit", "sdpa", "sdpa-mask", "copy"}, row
        assert all("max_err" in m for n, m in row["providers"].items() if n != "copy"), row
        keys = min(row["L"], 100)
        assert row["nbytes"] == 2 * row["Hkv"] * keys * row["D"] * 4, row  # fp32 in the smoke run
    assert "window 100" in (tmp_path / "decode_attention_smoke.md").read_text()
