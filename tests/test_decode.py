"""Split-KV decode attention vs a float64 naive reference on each sequence's valid prefix.

Runs on CUDA when present (bf16 included), otherwise on CPU through the Triton interpreter (fp16/fp32: the
interpreter's tl.dot is wrong for bf16). The cache past each sequence's length is filled with NaN / huge values,
and the output is poisoned with NaN before each call, so a read of garbage or a missed write shows up.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels.decode is imported (triton decorates then)

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernels._triton as kt  # noqa: E402
from kernels import options  # noqa: E402
from kernels.decode import (MAX_SPLITS, _split_and_sequence, auto_num_splits, decode_attention,  # noqa: E402
                            decode_tma_ok, default_tile, short_grid_splits)
from kernels.naive import naive_attention  # noqa: E402
from tests.util import pythonpath  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
FLOOR = {torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}  # small absolute floor per dtype
ROOT = Path(__file__).resolve().parents[1]


def make_case(B, Hq, Hkv, Nq, D, lens, max_len, dtype, seed=0):
    """Fresh random q, caches and lens; everything past lens[b] is garbage (NaN, inf, huge) that must not leak."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hkv, max_len, D, generator=g)
    v = torch.randn(B, Hkv, max_len, D, generator=g)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    huge = torch.finfo(dtype).max
    for b, L in enumerate(lens):
        k[b, :, L:] = float("nan") if b % 2 == 0 else huge
        v[b, :, L:] = float("nan") if b % 2 == 1 else float("inf")
    lens = torch.tensor(lens, dtype=torch.int32)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), lens.to(DEVICE)


def reference(q, k, v, lens, sm_scale=None, dtype=torch.float64, window=0):
    """naive_attention per sequence on its valid prefix, in `dtype` (float64: the oracle); window > 0: with that
    sliding window, on the keys from the earliest new token's window on (those before it may be garbage)."""
    outs = []
    for b, L in enumerate(lens.tolist()):
        lo = max(L - q.shape[2] - window + 1, 0) if window else 0
        outs.append(naive_attention(q[b:b + 1].to(dtype), k[b:b + 1, :, lo:L].to(dtype),
                                    v[b:b + 1, :, lo:L].to(dtype), causal=True, sm_scale=sm_scale, window=window))
    return torch.cat(outs)


def run_decode(q, k, v, lens, **kw):
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    res = decode_attention(q, k, v, lens, out=out, **kw)
    assert res is out
    assert torch.isfinite(out).all(), "NaN/inf in the output: garbage read or element not written"
    return out


def check(q, k, v, lens, dtype, sm_scale=None, **kw):
    """Max error vs float64 <= 2 x naive attention's own error in the same dtype + a small floor."""
    out = run_decode(q, k, v, lens, sm_scale=sm_scale, **kw)
    window = kw.get("window", 0)
    ref = reference(q, k, v, lens, sm_scale, window=window)
    err = (out.double() - ref).abs().max().item()
    naive_err = (reference(q, k, v, lens, sm_scale, dtype=dtype, window=window).double() - ref).abs().max().item()
    assert err <= 2 * naive_err + FLOOR[dtype], f"error {err:.3g} vs naive {naive_err:.3g} ({dtype})"
    return out


# Lengths that are not multiples of the split chunk or of BLOCK_N, different per sequence in one batch.
LENS_NQ1 = [1, 17, 100, 257, 1000]
LENS_NQ4 = [4, 17, 100, 257, 1000]


@pytest.mark.parametrize("num_splits", [1, 6], ids=["nosplit", "split6"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Nq, lens", [(1, LENS_NQ1), (4, LENS_NQ4)], ids=["nq1", "nq4"])
@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_mixed_lengths_heads_and_tokens(num_splits, dtype, Nq, lens, Hq, Hkv):
    q, k, v, lens_t = make_case(len(lens), Hq, Hkv, Nq, 64, lens, max_len=1040, dtype=dtype, seed=Nq + Hq)
    check(q, k, v, lens_t, dtype, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["nosplit", "split3"])
@pytest.mark.parametrize("D", [16, 48, 80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dims(num_splits, D, dtype):
    q, k, v, lens = make_case(2, 4, 2, 2, D, [130, 33], max_len=160, dtype=dtype, seed=D)
    check(q, k, v, lens, dtype, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [2, 3, 7, 16, 64])
def test_split_counts_agree_with_non_split(num_splits):
    # 64 splits of lens 65 and 300 leave most splits empty (lse = -inf); 1 split is the plain kernel.
    q, k, v, lens = make_case(2, 4, 2, 3, 48, [300, 65], max_len=320, dtype=torch.float32, seed=num_splits)
    base = check(q, k, v, lens, torch.float32, num_splits=1)
    split = check(q, k, v, lens, torch.float32, num_splits=num_splits)
    torch.testing.assert_close(split, base, atol=2e-6, rtol=1e-5)


def test_auto_splits_matches_non_split(monkeypatch):
    monkeypatch.setattr(kt, "sm_count", lambda device: 64)  # more SMs than the 4 heads: the auto path splits
    q, k, v, lens = make_case(1, 4, 4, 1, 64, [2000], max_len=2048, dtype=torch.float16, seed=3)
    auto = check(q, k, v, lens, torch.float16)  # batch 1, long cache
    assert auto_num_splits(4, 2048, DEVICE) > 1
    base = check(q, k, v, lens, torch.float16, num_splits=1)
    torch.testing.assert_close(auto, base, atol=2e-3, rtol=2e-3)


def test_many_query_rows_split_over_programs():
    # MQA with 24 query heads x 4 new tokens = 96 rows of one kv head: more than one program's 64.
    q, k, v, lens = make_case(2, 24, 1, 4, 32, [77, 200], max_len=256, dtype=torch.float32, seed=5)
    check(q, k, v, lens, torch.float32, num_splits=3)
    check(q, k, v, lens, torch.float32, num_splits=1)


def test_full_cache_nq_16_and_scale():
    q, k, v, lens = make_case(2, 2, 1, 16, 64, [16, 96], max_len=96, dtype=torch.float16, seed=7)
    check(q, k, v, lens, torch.float16, sm_scale=0.3, num_splits=4)


def test_strided_cache_views_and_int64_lens():
    # A cache stored as (B, max_len, Hkv, D) and viewed as (B, Hkv, max_len, D); q non-contiguous too.
    q, k, v, lens = make_case(2, 4, 2, 2, 64, [50, 129], max_len=140, dtype=torch.float32, seed=9)
    k_store, v_store = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    q_store = q.transpose(1, 2).contiguous()
    out = check(q_store.transpose(1, 2), k_store.transpose(1, 2), v_store.transpose(1, 2), lens.long(),
                torch.float32, num_splits=2)
    torch.testing.assert_close(out, run_decode(q, k, v, lens, num_splits=2), atol=1e-6, rtol=1e-6)


def test_default_out_is_allocated():
    q, k, v, lens = make_case(1, 2, 2, 1, 32, [40], max_len=64, dtype=torch.float32)
    out = decode_attention(q, k, v, lens)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()


def test_auto_num_splits_heuristic():
    cpu = torch.device("cpu")
    assert auto_num_splits(1000, 32768, cpu) == 1          # plenty of programs already: no split
    assert auto_num_splits(1, 100, cpu) == 1               # short cache: nothing to split
    assert 1 < auto_num_splits(1, 32768, cpu) <= MAX_SPLITS
    assert auto_num_splits(1, 1024, cpu) <= 8              # never finer than 128 keys of max_len
    assert auto_num_splits(1, 512, cpu) == 1               # a short cache runs unsplit (no merge launch)
    with options.use(decode_min_keys_per_split=512):       # the option (FLASHGPT_DECODE_MIN_KEYS_PER_SPLIT)
        assert auto_num_splits(1, 1024, cpu) == 2


def test_auto_num_splits_spreads_programs_evenly_over_the_sms(monkeypatch):
    """On an H200's 132 SMs: the smallest count whose programs spread most evenly over the SMs, within one round
    of the resident programs per SM (3 for the default tiles: programs_per_sm)."""
    monkeypatch.setattr(kt, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert auto_num_splits(12, 32768, cpu, 3) == 11   # GPT-2's 12 heads at batch 1: 132 programs, one per SM
    assert auto_num_splits(3, 32768, cpu, 3) == 44    # SmolLM2's 3 kv heads: 132 again
    assert auto_num_splits(1, 32768, cpu, 3) == 132
    assert auto_num_splits(48, 32768, cpu, 3) == 8    # 384 programs: 120 SMs hold 3, 12 hold 2 (11 would be 4)
    assert auto_num_splits(192, 32768, cpu, 3) == 2   # batch 16: 384 programs in one round of 396
    assert auto_num_splits(96, 32768, cpu, 3) == 4    # batch 8: 384
    assert auto_num_splits(288, 32768, cpu, 3) == 1   # two splits would not fit one round
    assert auto_num_splits(96, 32768, cpu, 4) == 4    # 5 fits 4 per SM, but spreads less evenly (480 of 528)
    assert auto_num_splits(192, 1024, cpu, 3) == 2
    assert auto_num_splits(12, 1024, cpu, 3) == 8     # the length's cap (8 of 128 keys) applies first
    assert auto_num_splits(600, 32768, cpu, 3) == 1


def test_programs_per_sm_from_shared_memory(monkeypatch):
    import kernels.decode as dec
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(kt, "smem_per_sm", lambda device: 233472 if device.type == "cuda" else None)  # H200: 228 KB
    assert dec.programs_per_sm(default_tile(64, 2, 1), 64, 2, cuda) == 3     # two 32 KB K/V stages + margin
    assert dec.programs_per_sm(default_tile(128, 2, 1), 128, 2, cuda) == 3
    assert dec.programs_per_sm(dec.DecodeTile(128, 4, 2), 64, 2, cuda) == 4  # 5 fit: capped at PROGRAMS_PER_SM
    assert dec.programs_per_sm(dec.DecodeTile(64, 8, 8), 256, 4, cuda) == 1  # more than an SM holds: still 1
    assert dec.programs_per_sm(default_tile(64, 2, 1), 64, 2, torch.device("cpu")) == dec.PROGRAMS_PER_SM
    # TMA loads keep one K/V tile more in shared memory (Triton at sm_90: 88 against 72 KB for this tile)
    assert dec.programs_per_sm(default_tile(64, 2, 1), 64, 2, cuda, tma=True) == 2
    deep = dec.deep_tile(default_tile(64, 2, 1), 64, 2)
    assert dec.programs_per_sm(deep, 64, 2, cuda) == 2 and dec.programs_per_sm(deep, 64, 2, cuda, tma=True) == 1
    # 64 query rows (warpgroup MMAs at sm_90): every stage's K and V tile and the Q tile in shared memory
    assert dec.program_smem(128, 3, 64, 2, rows=64) == 106496 + dec.WGMMA_MARGIN  # Triton 3.9's figure + margin
    assert dec.program_smem(128, 3, 64, 2, tma=True, rows=64) == dec.program_smem(128, 3, 64, 2, rows=64)
    assert dec.programs_per_sm(default_tile(64, 2, 1), 64, 2, cuda, rows=64) == 2
    assert dec.programs_per_sm(deep, 64, 2, cuda, rows=64) == 1
    assert dec.programs_per_sm(default_tile(64, 2, 1), 64, 2, cuda, rows=32) == 3  # below 64: as for 16



def test_default_tile_takes_128_keys_of_wide_rows_where_shared_memory_holds_one():
    import kernels.decode as dec
    h100 = 233472  # 228 KB per SM
    assert default_tile(128, 2, 2, h100).block_n == 128                       # 16-bit D = 128: 256-byte rows
    assert default_tile(128, 2, 2, dec.WIDE_ROW_SMEM - 1).block_n == 64       # too little shared memory
    assert default_tile(128, 2, 2, None).block_n == 64                        # not known (CPU)
    assert default_tile(64, 4, 2, h100).block_n == 64                         # fp32 D = 64: 256-byte rows too
    assert default_tile(128, 4, 2, h100) == default_tile(128, 4, 2, None)     # fp32 D = 128: unchanged
    assert default_tile(256, 2, 2, h100) == default_tile(256, 2, 2, None)     # D = 256: unchanged
    assert default_tile(64, 2, 2, None).block_n == 128                        # narrow rows: 128 as before
    tile = default_tile(128, 2, 2, h100)
    assert (tile.num_warps, tile.num_stages, tile.dot) == (4, 3, True)


def test_launch_passes_the_devices_shared_memory_to_the_default_tile(monkeypatch):
    """With an SM of 228 KB the default launch at 16-bit D = 128 takes 128-key tiles, with its size unknown 64;
    the result is the reference's either way."""
    import kernels.decode as dec
    tiles = []
    real = dec._launch

    def recording(kernel, grid, tensors, scalars, consts, launch):
        if kernel is dec._decode_split_kernel:
            tiles.append(consts["BLOCK_N"])
        return real(kernel, grid, tensors, scalars, consts, launch)
    monkeypatch.setattr(dec, "_launch", recording)
    q, k, v, lens = make_case(2, 4, 2, 1, 128, [700, 333], max_len=1024, dtype=torch.float16, seed=5)
    monkeypatch.setattr(kt, "smem_per_sm", lambda device: None)
    check(q, k, v, lens, torch.float16, check_lens=False)
    monkeypatch.setattr(kt, "smem_per_sm", lambda device: 233472)
    check(q, k, v, lens, torch.float16, check_lens=False)
    assert tiles[0] == 64 and tiles[-1] == 128, tiles


def _good():
    q = torch.randn(2, 4, 2, 32, device=DEVICE)
    k = torch.randn(2, 2, 64, 32, device=DEVICE)
    return q, k, k.clone(), torch.tensor([10, 64], device=DEVICE)


@pytest.mark.parametrize("change, message", [
    (lambda a: dict(a, q=a["q"][0]), "expected q"),
    (lambda a: dict(a, v=a["v"][:, :, :32]), "differ"),
    (lambda a: dict(a, q=torch.randn(3, 4, 2, 32, device=DEVICE)), "batch or head dim"),
    (lambda a: dict(a, q=torch.randn(2, 3, 2, 32, device=DEVICE)), "multiple"),
    (lambda a: dict(a, q=torch.randn(2, 4, 17, 32, device=DEVICE)), "new tokens"),
    (lambda a: dict(a, q=torch.randn(2, 4, 2, 8, device=DEVICE), k=torch.randn(2, 2, 64, 8, device=DEVICE),
                    v=torch.randn(2, 2, 64, 8, device=DEVICE)), "head dim"),
    (lambda a: dict(a, q=a["q"].double(), k=a["k"].double(), v=a["v"].double()), "dtype"),
    (lambda a: dict(a, q=a["q"].half()), "dtype"),
    (lambda a: dict(a, lens=a["lens"].float()), "cache_lens"),
    (lambda a: dict(a, lens=a["lens"][:1]), "cache_lens"),
    (lambda a: dict(a, lens=torch.tensor([1, 10], device=DEVICE)), r"\[Nq, max_len\]"),
    (lambda a: dict(a, lens=torch.tensor([10, 65], device=DEVICE)), r"\[Nq, max_len\]"),
    (lambda a: dict(a, num_splits=0), "num_splits"),
    (lambda a: dict(a, num_splits=MAX_SPLITS + 1), "num_splits"),
    (lambda a: dict(a, out=torch.empty(1, device=DEVICE)), "out must be"),
    (lambda a: dict(a, q=a["q"].requires_grad_()), "inference-only"),
])
def test_errors_before_launch(change, message):
    q, k, v, lens = _good()
    a = change(dict(q=q, k=k, v=v, lens=lens, num_splits=None, out=None))
    with pytest.raises(ValueError, match=message):
        decode_attention(a["q"], a["k"], a["v"], a["lens"], num_splits=a["num_splits"], out=a["out"])


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(kt, "INTERPRET", False)  # compiled kernels (as without TRITON_INTERPRET)
    q = torch.randn(1, 2, 1, 32)
    k = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match="runs on CUDA"):
        decode_attention(q, k, k, torch.tensor([8]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU (interpreter) path; a GPU runs the real benchmark")
def test_bench_smoke(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath(str(ROOT)))
    r = subprocess.run([sys.executable, "bench/decode_attention.py", "--smoke", "--sweep", "--out", str(tmp_path),
                        "--sweep-orders", "strided,chunks"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "split" in r.stdout and (tmp_path / "decode_attention_smoke.json").exists()
    assert (tmp_path / "decode_attention_smoke.md").exists()
    data = json.loads((tmp_path / "decode_attention_smoke.json").read_text())
    assert len(data["rows"]) == 4 and not data["meta"]["correctness_failures"]
    for row in data["rows"]:  # every provider checked and timed
        assert set(row["providers"]) == {"split", "split-merged", "split-chunks", "split-nofull", "split-dep",
                                         "split-noshort", "split-long", "split-long-merged", "split-tma",
                                         "split-rows32", "split-parts4", "split-rows64", "split-fit", "nosplit",
                                         "sdpa", "copy"}
        assert all("eager" in m for m in row["providers"].values()), row
    sweep = json.loads((tmp_path / "decode_attention_smoke_sweep.json").read_text())["shapes"]
    assert len(sweep) == 4 and all(s["best"]["us"] > 0 for s in sweep)
    assert all("error" not in c for s in sweep for c in s["candidates"]), sweep
    assert all({c["order"] for c in s["candidates"]} == {"chunks", "strided"} for s in sweep), sweep


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU (interpreter) path; a GPU runs the real benchmark")
def test_bench_narrowed_to_some_providers_and_tiles(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath(str(ROOT)))
    r = subprocess.run([sys.executable, "bench/decode_attention.py", "--smoke", "--sweep", "--out", str(tmp_path),
                        "--batches", "1", "--lens", "600", "--providers", "split,sdpa", "--sweep-tiles", "32:2:1",
                        "--sweep-splits", "2", "--sweep-min-keys", ""],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "decode_attention_smoke.json").read_text())
    assert [set(row["providers"]) for row in data["rows"]] == [{"split", "sdpa"}]
    (shape,) = json.loads((tmp_path / "decode_attention_smoke_sweep.json").read_text())["shapes"]
    # the default tile and the one asked for, with the automatic count, then each with 2 splits
    default = shape["candidates"][0]["tile"]
    assert sorted((c["tile"], str(c["splits"])) for c in shape["candidates"]) == sorted(
        (t, s) for t in (default, "n32 w2 s1 dot") for s in ("auto", "2")), shape


# ------------------------------------------------------------------ the split plan each sequence makes on the device

@pytest.fixture
def workspaces(monkeypatch):
    """Every buffer the kernels allocate starts as NaN; yields the list of them, in allocation order."""
    made = []

    def poisoned_empty(shape, dtype, device):
        t = torch.full(shape, float("nan"), dtype=dtype, device=device)
        made.append(t)
        return t
    monkeypatch.setattr(kt, "empty", poisoned_empty)
    return made


def used_splits(L, grid, min_keys, block_n):
    from kernels.decode import SINGLE_SPLIT_MAX_LEN, plan_splits
    return plan_splits(L, grid, min_keys, SINGLE_SPLIT_MAX_LEN, block_n)[1]


# one split (<= 512 keys, length 1 included) and several, lengths not multiples of BLOCK_N (64); a grid of 16
# splits sized for the capacity leaves most of them empty for every sequence
LENS_PLAN = [1, 65, 513, 700, 1000, 1999]


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_auto_plan_from_each_length_on_the_device(group, dtype, monkeypatch, workspaces):
    monkeypatch.setattr(kt, "sm_count", lambda device: 64)  # a GPU's worth of SMs: the grid gets 16 splits
    q, k, v, lens = make_case(len(LENS_PLAN), 2 * group, 2, 1, 32, LENS_PLAN, max_len=2048, dtype=dtype, seed=group)
    with options.use(decode_min_keys_per_split=128):
        check(q, k, v, lens, dtype, check_lens=False)  # the host does not know the lengths: grid from max_len
    o_part, lse = workspaces[-2:]                       # the parts (run_decode passes its own out)
    grid = lse.shape[1]
    assert grid == 16 and o_part.shape[1] == grid
    lse = lse.view(len(LENS_PLAN), 2 * group, grid)     # (B, Hq, splits)
    block_n = default_tile(32, torch.tensor([], dtype=dtype).element_size(), group).block_n
    for b, L in enumerate(LENS_PLAN):
        used = used_splits(L, grid, 128, block_n)
        written = torch.isfinite(lse[b])                # a used split of a multi-split sequence: finite lse
        if used == 1:                                   # written straight to the output, no parts at all
            assert not written.any() and torch.isnan(lse[b]).all(), (L, lse[b])
        else:
            assert written[:, :used].all() and torch.isnan(lse[b, :, used:]).all(), (L, used, lse[b])


def test_auto_plan_with_several_tokens_and_the_causal_edge(workspaces, monkeypatch):
    # 4 new tokens x 3 heads per kv head: the last used split of a sequence may hold keys only the later tokens see
    monkeypatch.setattr(kt, "sm_count", lambda device: 64)
    lens = [4, 520, 777, 1030]
    q, k, v, lens_t = make_case(len(lens), 6, 2, 4, 48, lens, max_len=1100, dtype=torch.float32, seed=11)
    with options.use(decode_min_keys_per_split=64):
        check(q, k, v, lens_t, torch.float32, check_lens=False)


def test_check_lens_sizes_the_grid_for_the_longest_real_length(workspaces, monkeypatch):
    monkeypatch.setattr(kt, "sm_count", lambda device: 64)
    q, k, v, lens = make_case(1, 2, 2, 1, 32, [600], max_len=4096, dtype=torch.float32, seed=2)
    check(q, k, v, lens, torch.float32)                 # check_lens=True reads 600 back: 600 // 128 = 4 splits,
    assert auto_num_splits(2, 600, DEVICE) == 4          # and 8 programs on 64 SMs: a short grid of one split
    assert workspaces[-1].shape[1] == short_grid_splits(2, 4, 600, DEVICE) == 5  # per 128 keys, cdiv(600, 128)
    check(q, k, v, lens, torch.float32, check_lens=False)  # max_len: 32 splits of 2 sequences on 64 SMs, 4 used
    assert workspaces[-1].shape[1] == auto_num_splits(2, 4096, DEVICE) == 32


def test_lengths_outside_the_cache_are_clamped_without_a_check():
    # check_lens=False reads nothing back: a length above max_len reads max_len keys, a negative one none
    q, k, v, _ = make_case(2, 2, 2, 1, 32, [64, 64], max_len=64, dtype=torch.float32, seed=4)
    out = run_decode(q, k, v, torch.tensor([500, -3], dtype=torch.int32, device=DEVICE), check_lens=False,
                     num_splits=3)
    ref = reference(q[:1], k[:1], v[:1], torch.tensor([64]))
    torch.testing.assert_close(out[:1].double(), ref, atol=1e-5, rtol=1e-5)
    assert (out[1] == 0).all()


def test_plan_splits_covers_each_length_in_blocks():
    from kernels.decode import plan_splits
    for L in [0, 1, 2, 63, 64, 65, 511, 512, 513, 1000, 4095, 32768, 100_000]:
        for grid, min_chunk, unsplit, bn in [(44, 256, 512, 64), (3, 256, 512, 32), (8, 1, 0, 64), (256, 1, 0, 16)]:
            chunk, used = plan_splits(L, grid, min_chunk, unsplit, bn)
            assert chunk % bn == 0 and chunk >= bn and 1 <= used <= grid
            assert used * chunk >= L and (used - 1) * chunk < max(L, 1)  # every key once, no empty used split
            if L <= unsplit:
                assert used == 1
            elif min_chunk > 1 and used > 1:
                assert L // used >= min_chunk - bn  # never much finer than the option asks (rounding aside)


@pytest.mark.parametrize("tile", [(16, 4, 1, True), (32, 2, 2, True), (128, 4, 2, True), (16, 4, 1, False),
                                  (64, 2, 1, False), (128, 8, 1, False)], ids=str)
@pytest.mark.parametrize("num_splits", [None, 1, 5], ids=["auto", "nosplit", "split5"])
def test_tile_configs(tile, num_splits, workspaces, monkeypatch):
    from kernels.decode import DecodeTile
    monkeypatch.setattr(kt, "sm_count", lambda device: 64)
    lens = [1, 100, 700]
    q, k, v, lens_t = make_case(len(lens), 3, 3, 1, 48, lens, max_len=768, dtype=torch.float16, seed=tile[0])
    with options.use(decode_min_keys_per_split=128):
        check(q, k, v, lens_t, torch.float16, num_splits=num_splits, tile=DecodeTile(*tile), check_lens=False)


def test_vector_tile_needs_one_row_per_kv_head():
    from kernels.decode import DecodeTile
    q, k, v, lens = make_case(1, 4, 2, 1, 32, [40], max_len=64, dtype=torch.float32)
    with pytest.raises(ValueError, match="dot=False only for one query row"):
        decode_attention(q, k, v, lens, tile=DecodeTile(64, 4, 1, dot=False))
    with pytest.raises(ValueError, match="bad decode tile"):
        DecodeTile(48, 4, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="direct launches are the compiled kernels' (CUDA) path")
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_repeated_launch_goes_through_the_cached_launcher(tma):
    """A repeated launch calls the compiled kernel's launcher (TMA: with host descriptors, which it encodes at
    each call): the same result, and a cache at another address (V negated) gives the negated result."""
    import kernels.decode as dec
    if tma:
        _needs_tma_device()
    dec._compiled.clear()
    q, k, v, lens = make_case(2, 4, 2, 1, 64, [700, 3000], max_len=4096, dtype=torch.bfloat16, seed=8)
    with options.use(decode_tma=tma):
        assert dec.decode_tma_ok(k, v) == tma
        first = run_decode(q, k, v, lens, check_lens=False).clone()
        assert len(dec._compiled) == 2 and dec._direct_launch_ok  # the split and the merge kernel
        again = run_decode(q, k, v, lens, check_lens=False)
        assert dec._direct_launch_ok and torch.equal(first, again)
        negated = run_decode(q, k, -v, lens, check_lens=False)
        assert dec._direct_launch_ok and torch.equal(negated, -first)


# ------------------------------------------------------------------ the merge inside the split kernel (an option)

@pytest.fixture
def launches(monkeypatch):
    """The kernels decode_attention launches, in order (they still run)."""
    import kernels.decode as dec
    made = []
    real = dec._launch

    def recording(kernel, *args):
        made.append(kernel)
        return real(kernel, *args)
    monkeypatch.setattr(dec, "_launch", recording)
    return made


def merged_in_split(q, k, v, lens, dtype, **kw):
    """check() with decode_merge_in_split on, twice in a row on the same counters: the counters back at zero
    after each call, the same output both times."""
    import kernels.decode as dec
    outs = []
    with options.use(decode_merge_in_split=True):
        for _ in range(2):
            outs.append(check(q, k, v, lens, dtype, **kw))
            assert (dec._counters[q.device] == 0).all(), dec._counters[q.device]
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
    return outs[0]


# one split (<= 512 keys) and several in one batch, lengths not multiples of BLOCK_N or of the chunk
LENS_MERGE = [4, 65, 513, 777, 1999]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Nq", [1, 4], ids=["nq1", "nq4"])
@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_merge_in_split_matches_the_reference_and_the_merge_launch(dtype, Nq, Hq, Hkv, monkeypatch, launches):
    import kernels.decode as dec
    monkeypatch.setattr(kt, "sm_count", lambda device: 64)  # a GPU's worth of SMs: several splits in the grid
    q, k, v, lens = make_case(len(LENS_MERGE), Hq, Hkv, Nq, 48, LENS_MERGE, max_len=2048, dtype=dtype,
                              seed=Hq + Nq)
    with options.use(decode_min_keys_per_split=128):
        merged = merged_in_split(q, k, v, lens, dtype, check_lens=False)  # grid from max_len, plans per length
        assert launches == [dec._decode_split_kernel] * 2                   # no merge launch
        separate = check(q, k, v, lens, dtype, check_lens=False)
        assert launches[2:] == [dec._decode_split_kernel, dec._decode_merge_kernel]
    torch.testing.assert_close(merged, separate, atol=FLOOR[dtype], rtol=FLOOR[dtype])


@pytest.mark.parametrize("num_splits", [2, 7, 64])
def test_merge_in_split_with_explicit_split_counts(num_splits):
    # 64 splits of lens 65 and 300 leave most splits empty (lse = -inf, or not used at all)
    q, k, v, lens = make_case(3, 4, 2, 3, 80, [300, 65, 3], max_len=320, dtype=torch.float32, seed=num_splits)
    merged = merged_in_split(q, k, v, lens, torch.float32, num_splits=num_splits)
    torch.testing.assert_close(merged, check(q, k, v, lens, torch.float32, num_splits=num_splits),
                               atol=2e-6, rtol=1e-5)


def test_merge_in_split_over_several_row_blocks_and_the_vector_tile():
    from kernels.decode import DecodeTile
    # MQA with 24 query heads x 4 new tokens = 96 rows of one kv head: two row blocks, a counter each
    q, k, v, lens = make_case(2, 24, 1, 4, 32, [77, 200], max_len=256, dtype=torch.float32, seed=5)
    merged_in_split(q, k, v, lens, torch.float32, num_splits=3)
    # one query row per program (dot=False): 16 splits per merge step, 24 used by the first sequence
    q, k, v, lens = make_case(2, 3, 3, 1, 64, [1500, 40], max_len=1536, dtype=torch.float16, seed=6)
    merged_in_split(q, k, v, lens, torch.float16, num_splits=40, tile=DecodeTile(32, 4, 1, dot=False))


def test_merge_counters_grow_and_are_not_allocated_during_capture(monkeypatch):
    import kernels.decode as dec
    monkeypatch.setattr(dec, "_counters", {})
    monkeypatch.setattr(dec, "_retired_counters", [])
    cpu = torch.device("cpu")
    small = dec.merge_counters(cpu, 6)
    assert small.dtype == torch.int32 and small.shape == (6,) and (small == 0).all()
    assert dec.merge_counters(cpu, 4) is small                      # big enough: the same buffer
    big = dec.merge_counters(cpu, 7)
    assert big.shape == (12,) and (big == 0).all()
    assert len(dec._retired_counters) == 1 and dec._retired_counters[0] is small  # kept alive for CUDA graphs
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before CUDA graph capture"):
        dec.merge_counters(torch.device("cuda", 0), 8)


@pytest.mark.parametrize("num_splits", [None, 3, 64], ids=["auto", "split3", "split64"])
@pytest.mark.parametrize("Nq", [1, 4], ids=["nq1", "nq4"])
@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_strided_split_order(num_splits, Nq, Hq, Hkv, monkeypatch):
    """Both split orders (strided, the default: split s reads blocks s, s + used, ...; chunks: one contiguous
    chunk) give the reference's result, and the same up to summation order; 64 explicit splits leave short
    sequences with fewer blocks than splits."""
    monkeypatch.setattr(kt, "sm_count", lambda device: 64)
    dtype = torch.float16
    q, k, v, lens = make_case(len(LENS_MERGE), Hq, Hkv, Nq, 40, LENS_MERGE, max_len=2048, dtype=dtype, seed=Hq + Nq)
    with options.use(decode_min_keys_per_split=128):
        with options.use(decode_split_order="chunks"):
            chunks = check(q, k, v, lens, dtype, num_splits=num_splits, check_lens=False)
        with options.use(decode_split_order="strided"):
            strided = check(q, k, v, lens, dtype, num_splits=num_splits, check_lens=False)
            merged = merged_in_split(q, k, v, lens, dtype, num_splits=num_splits, check_lens=False)
    torch.testing.assert_close(strided, chunks, atol=FLOOR[dtype], rtol=FLOOR[dtype])
    torch.testing.assert_close(merged, strided, atol=FLOOR[dtype], rtol=FLOOR[dtype])


@pytest.mark.parametrize("batch, sms, stages", [(1, 64, 4), (2, 12, 3)], ids=["one-per-sm", "more"])
def test_four_stages_where_the_split_programs_leave_each_sm_at_most_one(batch, sms, stages, monkeypatch):
    """The default tile at 16-bit D = 64 gains a stage (deep_tile) where the automatic count gives no SM more than
    one split program (4 heads x 16 splits on 64 SMs), and keeps three where it gives more (2 x 4 heads x 3
    splits on 12 SMs); the result is the reference's either way."""
    import kernels.decode as dec
    monkeypatch.setattr(kt, "sm_count", lambda device: sms)
    configs = []
    real = dec._launch

    def recording(kernel, grid, tensors, scalars, consts, launch):
        if kernel is dec._decode_split_kernel:
            configs.append((grid[0], consts["BLOCK_N"], launch["num_stages"]))
        return real(kernel, grid, tensors, scalars, consts, launch)
    monkeypatch.setattr(dec, "_launch", recording)
    q, k, v, lens = make_case(batch, 4, 4, 1, 64, [2000, 1500][:batch], max_len=2048, dtype=torch.float16, seed=9)
    check(q, k, v, lens, torch.float16, check_lens=False)
    splits, block_n, got = configs[-1]
    assert (block_n, got) == (128, stages) and batch * 4 * splits <= sms * (1 if stages == 4 else 3), configs
    check(q, k, v, lens, torch.float16, check_lens=False, num_splits=4)  # an explicit count keeps the default
    assert configs[-1][1:] == (128, 3)
    assert dec.deep_tile(default_tile(128, 2, 1), 128, 2) is None  # 256-byte rows: not measured, not deepened


@pytest.mark.parametrize("tma, stages", [(False, 4), (True, 3)], ids=["pointers", "tma"])
def test_short_grid_keeps_one_round_with_the_tile_it_gets(tma, stages, monkeypatch):
    """GPT-2's batch-1 plan at 2,048 keys on 132 SMs of 228 KB: 16 splits, one block each (short_grid_splits),
    192 programs; with pointer loads the four-stage tile (two programs per SM) holds them in one round; TMA loads
    keep three stages (their four-stage tile would leave one program per SM: two rounds)."""
    import kernels.decode as dec
    monkeypatch.setattr(kt, "sm_count", lambda device: 132)
    monkeypatch.setattr(kt, "smem_per_sm", lambda device: 233472)
    configs = []
    monkeypatch.setattr(dec, "_launch", lambda kernel, grid, tensors, scalars, consts, launch: configs.append(
        (kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, grid[0], launch.get("num_stages"),
         consts.get("TMA"))))
    q, k, v, lens = make_case(1, 12, 12, 1, 64, [2048], max_len=2048, dtype=torch.bfloat16, seed=5)
    with options.use(decode_tma=tma):
        decode_attention(q, k, v, lens, check_lens=False)
    assert configs[0] == ("_decode_split_kernel", 16, stages, tma), configs
    assert 12 * 16 <= 132 * dec.programs_per_sm(dec.DecodeTile(128, 4, stages), 64, 2, q.device, tma)


# ------------------------------------------------------------------ the full grid (option decode_full_grid)

@pytest.fixture
def launched(monkeypatch):
    """(kernel name, grid) of each launch decode_attention makes (they still run)."""
    import kernels.decode as dec
    made = []
    real = dec._launch

    def recording(kernel, grid, *rest):
        made.append((kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, grid))
        return real(kernel, grid, *rest)
    monkeypatch.setattr(dec, "_launch", recording)
    return made


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_full_grid_of_short_capacity_runs_unsplit(dtype, monkeypatch, launched):
    """Unsplit programs at least the SMs (6 sequence-kv-heads on a token GPU of 4 SMs) and a capacity of at
    most decode_full_grid_max_len (256 here): one launch of one split, within the float64 budget, as close to
    the split plan (the option off: a split grid and its merge) as the budget allows. A longer capacity, fewer
    programs than SMs or an explicit split count keep the split plan."""
    import kernels.decode as dec
    monkeypatch.setattr(dec, "SINGLE_SPLIT_MAX_LEN", 64)  # below it every grid has one split anyway
    monkeypatch.setattr(kt, "sm_count", lambda device: 4)
    lens = [3, 170, 250]
    with options.use(decode_min_keys_per_split=32, decode_full_grid_max_len=256):
        q, k, v, lens_t = make_case(3, 4, 2, 1, 32, lens, max_len=256, dtype=dtype, seed=11)
        full = check(q, k, v, lens_t, dtype, check_lens=False)
        assert launched == [("_decode_split_kernel", (1, 6, 1))]
        launched.clear()
        with options.use(decode_full_grid=False):
            plain = check(q, k, v, lens_t, dtype, check_lens=False)
        assert [name for name, _ in launched] == ["_decode_split_kernel", "_decode_merge_kernel"]
        assert launched[0][1][0] > 1
        torch.testing.assert_close(full, plain, atol=2 * FLOOR[dtype], rtol=FLOOR[dtype])
        for case, kw in (((3, 4, 2, 1, 32, lens, 257), {}),              # capacity past the limit
                         ((1, 4, 2, 1, 32, lens[1:2], 256), {}),         # 2 programs < 4 SMs
                         ((3, 4, 2, 1, 32, lens, 256), {"num_splits": 3})):
            launched.clear()
            q, k, v, lens_t = make_case(*case, dtype=dtype, seed=12)
            check(q, k, v, lens_t, dtype, check_lens=False, **kw)
            assert [name for name, _ in launched] == ["_decode_split_kernel", "_decode_merge_kernel"], case


@pytest.mark.parametrize("merge_in_split", [False, True], ids=["merge-launch", "merge-in-split"])
def test_full_grid_long_splits_and_short_sequences_unsplit(merge_in_split, monkeypatch, launched):
    """decode_full_grid_long_splits: a full-grid call (6 sequence-kv-heads on a token GPU of 4 SMs) planned for
    more keys than decode_full_grid_max_len (64 here) gets that many splits (3), and on the device its sequences
    of up to 64 keys run unsplit while longer ones split (up to the 3, in whole key blocks): within the
    float64 budget with the merge launched or inside the split kernel, and as close to the automatic plan
    (the option off) as the budget allows. The option off or a capacity within the limit keep their plans."""
    import kernels.decode as dec
    monkeypatch.setattr(dec, "SINGLE_SPLIT_MAX_LEN", 16)
    monkeypatch.setattr(kt, "sm_count", lambda device: 4)
    lens = [3, 64, 200, 250]  # unsplit, unsplit at the limit, split past it
    unsplit_max = []  # the UNSPLIT_MAX each split launch passes to the device's plan (its scalars' last but one)
    inner = dec._launch
    monkeypatch.setattr(dec, "_launch", lambda kernel, grid, tensors, scalars, *rest: (
        unsplit_max.append(scalars[-2]) if kernel is dec._decode_split_kernel else None,
        inner(kernel, grid, tensors, scalars, *rest))[1])
    base = dict(decode_min_keys_per_split=32, decode_full_grid_max_len=64, decode_merge_in_split=merge_in_split)
    with options.use(**base):
        q, k, v, lens_t = make_case(4, 3, 3, 1, 32, lens, max_len=256, dtype=torch.float32, seed=31)
        with options.use(decode_full_grid_long_splits=3):
            long = check(q, k, v, lens_t, torch.float32, check_lens=False)
        names = [name for name, _ in launched]
        assert names == (["_decode_split_kernel"] if merge_in_split else ["_decode_split_kernel",
                                                                         "_decode_merge_kernel"])
        assert launched[0][1][0] == 3 and unsplit_max == [64]  # three splits per sequence-kv-head in the grid
        block_n = dec.default_tile(32, 4, 1).block_n
        for L in lens:  # the device's plan, by its host twin: one split up to the limit, more past it
            used = dec.plan_splits(L, 3, 32, 64, block_n)[1]
            assert (used == 1) if L <= 64 else (1 < used <= 3), (L, used, block_n)
        launched.clear()
        auto = check(q, k, v, lens_t, torch.float32, check_lens=False)  # the option off: the automatic count
        assert launched[0][1][0] != 3 and unsplit_max[-1] == 16
        torch.testing.assert_close(long, auto, atol=2 * FLOOR[torch.float32], rtol=FLOOR[torch.float32])
        launched.clear()
        q, k, v, lens_t = make_case(4, 3, 3, 1, 32, [3, 40, 60, 64], max_len=64, dtype=torch.float32, seed=32)
        with options.use(decode_full_grid_long_splits=3):  # a capacity within the limit: the full grid, unsplit
            check(q, k, v, lens_t, torch.float32, check_lens=False)
        assert launched == [("_decode_split_kernel", (1, 12, 1))]


@pytest.mark.parametrize("dependent", [False, True], ids=["not-dependent", "dependent"])
def test_full_grid_launch_as_pdl_dependent_or_not(dependent, monkeypatch):
    """With PDL available, a call whose unsplit programs fill the GPU is launched as a PDL dependent only under
    decode_full_grid_pdl; it signals the next kernel either way (USE_GDC), and a call that does not fill the
    GPU keeps both. The launches are recorded and then run plainly (the interpreter has no PDL), within the
    float64 budget; on a GPU, test_full_grid_pdl_or_not_same_result runs the real launches."""
    import kernels.decode as dec
    made = []
    real = dec._launch

    def recording(kernel, grid, tensors, scalars, consts, launch):
        made.append((kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, grid, consts["USE_GDC"],
                     launch.get("launch_pdl", False)))
        plain = {k: v for k, v in launch.items() if k != "launch_pdl"}
        return real(kernel, grid, tensors, scalars, dict(consts, USE_GDC=False), plain)
    monkeypatch.setattr(dec, "_launch", recording)
    monkeypatch.setattr(dec, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(dec, "SINGLE_SPLIT_MAX_LEN", 64)  # below it every grid has one split anyway
    monkeypatch.setattr(kt, "sm_count", lambda device: 4)
    with options.use(decode_full_grid_pdl=dependent, decode_min_keys_per_split=32):
        q, k, v, lens = make_case(3, 4, 2, 1, 32, [3, 170, 250], max_len=256, dtype=torch.float32, seed=21)
        check(q, k, v, lens, torch.float32, check_lens=False)  # 6 unsplit programs on 4 SMs: full
        assert made == [("_decode_split_kernel", (1, 6, 1), True, dependent)]
        made.clear()
        q, k, v, lens = make_case(1, 4, 2, 1, 32, [250], max_len=256, dtype=torch.float32, seed=22)
        check(q, k, v, lens, torch.float32, check_lens=False)  # 2 programs: not full, split and merged
        assert [(name, gdc, pdl) for name, _, gdc, pdl in made] == [("_decode_split_kernel", True, True),
                                                                    ("_decode_merge_kernel", True, True)]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="PDL launches exist on a GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_full_grid_pdl_or_not_same_result(dtype):
    """On the GPU: GPT-2's batch-16 shape (192 unsplit programs fill any GPU up to 192 SMs) with and without
    the full grid's PDL launch, back to back in one stream: each within the float64 budget, and equal."""
    q, k, v, lens = make_case(16, 12, 12, 1, 64, [1 + 97 * i for i in range(16)], max_len=1600, dtype=dtype,
                              seed=23)
    outs = []
    for dependent in (False, True):
        with options.use(decode_full_grid_pdl=dependent):
            outs.append(check(q, k, v, lens, dtype, check_lens=False))
            outs.append(check(q, k, v, lens, dtype, check_lens=False))  # the second call follows the first
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


# ------------------------------------------------------------------ more splits for short sequences at batch 1

def test_short_grid_splits_where_the_long_plan_leaves_sms_idle(monkeypatch):
    """GPT-2's 12 heads at batch 1 on 132 SMs: the automatic count is 11 (one program per SM); the grid holds
    16 so that 2,048 keys get 16 one-block splits. Not where the long plan already gives an SM two programs,
    not past one round of resident programs, not with the option off, and never fewer than the long count."""
    import kernels.decode as dec
    monkeypatch.setattr(kt, "sm_count", lambda device: 132)
    assert dec.auto_num_splits(12, 32768, DEVICE, 3) == 11
    assert dec.short_grid_splits(12, 11, 32768, DEVICE, 3) == 16
    assert dec.short_grid_splits(12, 11, 2048, DEVICE, 3) == 16
    assert dec.short_grid_splits(12, 11, 2000, DEVICE, 3) == 16      # 16 blocks, the last one partly full
    assert dec.short_grid_splits(12, 11, 1408, DEVICE, 3) == 11      # 11 blocks: the long count covers them
    assert dec.short_grid_splits(12, 11, 1409, DEVICE, 3) == 12
    assert dec.short_grid_splits(12, 11, 1024, DEVICE, 3) == 11      # 8 blocks: the long count covers them
    assert dec.short_grid_splits(24, 11, 32768, DEVICE, 3) == 11     # 264 programs: two on some SMs already
    assert dec.short_grid_splits(12, 11, 32768, DEVICE, 1) == 11     # 192 programs > one round of 132
    assert dec.short_grid_splits(12, 1, 32768, DEVICE, 3) == 1       # unsplit stays unsplit
    with options.use(decode_short_splits=False):
        assert dec.short_grid_splits(12, 11, 32768, DEVICE, 3) == 11
    with options.use(decode_min_keys_per_split=256):
        assert dec.short_grid_splits(12, 11, 32768, DEVICE, 3) == 11  # 2,048 keys in 8 splits of 256


def test_plan_splits_with_a_long_count():
    """Up to grid x min_chunk keys a sequence in a short grid (long count < grid) gets cdiv(L, min_chunk)
    splits, one block each at min_chunk == block_n, whatever its length; beyond, the long count. Without a
    long count the plan is the grid's: L // min_chunk splits up to grid x min_chunk keys."""
    from kernels.decode import plan_splits
    assert plan_splits(2048, 16, 128, 512, 128, 11) == (128, 16)
    assert plan_splits(2049, 16, 128, 512, 128, 11) == (256, 9)      # 11 splits of 187 keys, in whole blocks
    assert plan_splits(4096, 16, 128, 512, 128, 11) == (384, 11)
    assert plan_splits(1024, 16, 128, 512, 128, 11) == (128, 8)
    assert plan_splits(400, 16, 128, 512, 128, 11) == (512, 1)       # up to 512 keys: unsplit
    assert plan_splits(2000, 16, 128, 512, 128, 11) == (128, 16)     # 16 blocks, the last partly full
    assert plan_splits(1500, 16, 128, 512, 128, 11) == (128, 12)
    assert plan_splits(1500, 11, 128, 512, 128) == (256, 6)          # the long plan alone: 11 rounds to 256
    for L in range(513, 2049):
        assert plan_splits(L, 16, 128, 512, 128, 11) == (128, -(-L // 128)), L
    for L in range(513, 40000, 97):
        assert plan_splits(L, 11, 128, 512, 128) == plan_splits(L, 11, 128, 512, 128, 11)
        chunk, used = plan_splits(L, 16, 128, 512, 128, 11)
        assert used * chunk >= L and (used - 1) * chunk < L and used <= (16 if L <= 2048 else 11)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_short_grid_plan_on_the_device(dtype, monkeypatch, workspaces):
    """A grid with more splits than the long count (8 SMs, 2 kv heads, 256-key splits: long count 4, grid 8):
    the kernels use plan_splits' splits for each length (the parts written exactly there) and the result is
    within the float64 budget, for lengths below, at and above the short plan's 2,048 keys."""
    import kernels.decode as dec
    monkeypatch.setattr(kt, "sm_count", lambda device: 8)
    lens = [2000, 1100, 3000, 600, 2048]
    with options.use(decode_min_keys_per_split=256):
        q, k, v, lens_t = make_case(len(lens), 4, 2, 1, 32, lens, max_len=4096, dtype=dtype, seed=31)
        with monkeypatch.context() as m:  # one sequence at a time keeps the long plan's one program per SM
            m.setattr(dec, "auto_num_splits", lambda n, length, device, per_sm=3: 4)
            for b, L in enumerate(lens):
                workspaces.clear()
                check(q[b:b + 1], k[b:b + 1], v[b:b + 1], lens_t[b:b + 1], dtype, check_lens=False)
                o_part, lse = workspaces[-2:]
                assert lse.shape[1] == 8, (L, lse.shape)             # the grid: 2,048 // 256 splits
                block_n = default_tile(32, q.element_size(), 2).block_n
                used = dec.plan_splits(L, 8, 256, dec.SINGLE_SPLIT_MAX_LEN, block_n, 4)[1]
                long_used = dec.plan_splits(L, 4, 256, dec.SINGLE_SPLIT_MAX_LEN, block_n)[1]
                assert used > long_used if L <= 2048 else used == long_used, (L, used, long_used)
                written = torch.isfinite(lse.view(4, 8))             # (Hq, splits)
                assert written[:, :used].all() and torch.isnan(lse.view(4, 8)[:, used:]).all(), (L, used, lse)


@triton.jit
def _probe_split_and_sequence(OUT, NUM_SPLITS, LONG_SPLITS):
    split, bh = _split_and_sequence(NUM_SPLITS, LONG_SPLITS)
    lin = tl.program_id(1) * NUM_SPLITS + tl.program_id(0)  # launch order
    tl.store(OUT + 2 * lin, split)
    tl.store(OUT + 2 * lin + 1, bh)


def test_split_and_sequence_orders_the_long_plan_first():
    """The split kernel's program -> (split, sequence-kv-head) map: every pair exactly once, and in launch
    order the first LONG_SPLITS · n programs are exactly splits 0 .. LONG_SPLITS - 1 (the long plan's)."""
    for num, long, n in [(16, 11, 12), (8, 4, 3), (5, 5, 7), (1, 1, 4), (9, 1, 2)]:
        out = torch.full((num * n, 2), -1, dtype=torch.int32, device=DEVICE)
        _probe_split_and_sequence[(num, n, 1)](out, num, long)
        pairs = [tuple(p) for p in out.tolist()]
        assert sorted(pairs) == [(s, b) for s in range(num) for b in range(n)], (num, long, n)
        assert all(s < long for s, _ in pairs[:long * n]) and all(s >= long for s, _ in pairs[long * n:])


def _needs_tma_device() -> None:
    import kernels.decode as dec
    if not dec._tma_device(DEVICE):
        pytest.skip("TMA descriptor loads need a Hopper-or-newer GPU (or the interpreter)")


def _split_consts(monkeypatch, name: str, **missing) -> list:
    """The constexpr `name` of each split-kernel launch decode_attention makes (they still run); a launch that
    does not pass it records missing["default"] where given (the kernel's own default)."""
    import kernels.decode as dec
    values = []
    inner = dec._launch

    def recording(kernel, grid, tensors, scalars, consts, *rest):
        if kernel is dec._decode_split_kernel:
            values.append(consts[name] if name in consts or "default" not in missing else missing["default"])
        return inner(kernel, grid, tensors, scalars, consts, *rest)
    monkeypatch.setattr(dec, "_launch", recording)
    return values


def _tma_flags(monkeypatch) -> list:
    """The TMA constexpr of each split-kernel launch decode_attention makes (they still run)."""
    return _split_consts(monkeypatch, "TMA")


@pytest.mark.parametrize("dtype", [t for t in DTYPES if t.itemsize == 2], ids=str)
@pytest.mark.parametrize("Hq, Hkv, Nq, D, lens, max_len, window, num_splits, merged", [
    (4, 4, 1, 64, LENS_NQ1, 1040, 0, None, False),
    (8, 2, 4, 64, LENS_NQ4, 1040, 0, 6, False),
    (8, 2, 4, 64, LENS_NQ4, 1040, 0, None, True),
    (6, 1, 2, 40, [2, 90, 333], 400, 50, None, False),
    (4, 2, 1, 128, [1, 129, 300], 300, 0, 1, False),
], ids=["mha-auto", "gqa-split6", "gqa-merged", "mqa-d40-window", "d128-nosplit-full"])
def test_tma_loads_give_the_pointer_loads_result(dtype, Hq, Hkv, Nq, D, lens, max_len, window, num_splits,
                                                  merged, monkeypatch):
    """decode_tma: the split kernel reads K and V through tensor descriptors over the whole caches (zeros past
    D, NaN/inf/huge garbage past each length masked), within the float64 budget, for MHA/GQA/MQA, several new
    tokens, a padded head dim, a window, forced, automatic and single splits, the merge launched or inside the
    split kernel (equal to the pointer loads' result in the interpreter)."""
    _needs_tma_device()
    flags = _tma_flags(monkeypatch)
    q, k, v, lens_t = make_case(len(lens), Hq, Hkv, Nq, D, lens, max_len=max_len, dtype=dtype, seed=D + Nq)
    kw = dict(num_splits=num_splits, window=window)
    with options.use(decode_merge_in_split=merged):
        plain = run_decode(q, k, v, lens_t, **kw)
        with options.use(decode_tma=True):
            assert decode_tma_ok(k, v)
            tma = check(q, k, v, lens_t, dtype, **kw)
    assert flags[-1] is True and not any(flags[:len(flags) // 2]), flags
    if DEVICE.type == "cpu":  # the interpreter: the same values in the same order (a GPU may pick other MMAs)
        assert torch.equal(tma, plain)


@pytest.mark.parametrize("min_rows", [32, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Hq, Hkv, Nq, D, lens, max_len, num_splits, tma", [
    (4, 4, 1, 64, LENS_NQ1, 1040, None, False),
    (8, 2, 4, 64, LENS_NQ4, 1040, 6, False),
    (6, 1, 2, 80, [2, 90, 333], 400, 1, False),
    (4, 2, 1, 128, [1, 129, 300], 300, 3, False),
    (8, 2, 4, 64, LENS_NQ4, 1040, None, True),
], ids=["mha-auto", "gqa-split6", "mqa-d80-nosplit", "d128-split3", "gqa-tma"])
def test_more_query_rows_per_program_match_the_reference(min_rows, dtype, Hq, Hkv, Nq, D, lens, max_len, num_splits,
                                                          tma, monkeypatch):
    """decode_min_rows: a program of the dot path holds at least that many query rows (64: sm_90's warpgroup
    MMAs), the rows past a kv head's group x new tokens padding; within the float64 budget with garbage past
    each length, for MHA/GQA/MQA, several new tokens, a padded head dim, head dim 128, automatic, forced and
    single splits, and TMA loads (16-bit caches); the launches take that many rows."""
    if tma:  # (a 32-bit cache takes pointer loads under the option)
        _needs_tma_device()
    rows = _split_consts(monkeypatch, "BLOCK_M")
    q, k, v, lens_t = make_case(len(lens), Hq, Hkv, Nq, D, lens, max_len=max_len, dtype=dtype, seed=D + Nq + min_rows)
    with options.use(decode_min_rows=min_rows, decode_tma=tma):
        check(q, k, v, lens_t, dtype, num_splits=num_splits)
    assert rows == [min_rows], rows


@pytest.mark.parametrize("parts", [2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Hq, Hkv, Nq, D, lens, max_len, window, num_splits, order, merged", [
    (4, 4, 1, 64, LENS_NQ1, 1040, 0, None, "strided", False),
    (8, 2, 4, 64, LENS_NQ4, 1040, 0, 6, "strided", False),
    (8, 2, 4, 64, LENS_NQ4, 1040, 0, 5, "chunks", True),
    (6, 1, 2, 80, [2, 90, 333], 400, 50, None, "strided", False),
    (4, 2, 1, 128, [1, 129, 300], 300, 0, 1, "strided", False),
], ids=["mha-auto", "gqa-split6", "gqa-chunks-merged", "mqa-d80-window", "d128-nosplit"])
def test_key_parts_match_the_reference(parts, dtype, Hq, Hkv, Nq, D, lens, max_len, window, num_splits, order,
                                       merged, monkeypatch):
    """decode_key_parts: a program keeps a softmax state per part of each key block and merges them after its
    loop; within the float64 budget with garbage past each length, for MHA/GQA/MQA, several new tokens, a
    padded head dim, head dim 128, a window with several new tokens (each row its own window), automatic,
    forced and single splits, the strided and chunk orders, the merge launched or inside the split kernel; the
    launches take that many parts where a part holds at least 16 keys (8 parts of a 64-key tile: one), and
    sequences shorter than a part (1 and 2 keys) leave parts empty."""
    from kernels.decode import _next_pow2, default_tile
    used = _split_consts(monkeypatch, "PARTS", default=1)
    q, k, v, lens_t = make_case(len(lens), Hq, Hkv, Nq, D, lens, max_len=max_len, dtype=dtype,
                                seed=D + Nq + parts)
    with options.use(decode_key_parts=parts, decode_split_order=order, decode_merge_in_split=merged):
        check(q, k, v, lens_t, dtype, num_splits=num_splits, window=window)
    from kernels import _triton
    tile = default_tile(_next_pow2(D), q.element_size(), Hq // Hkv * Nq, _triton.smem_per_sm(q.device))
    assert used == [parts if tile.block_n // parts >= 16 else 1], (used, tile)


def test_key_parts_apply_to_the_dot_path_with_pointer_loads_only(monkeypatch):
    """key_parts: the option's count on the dot path with pointer loads; 1 on the vec path, with TMA loads, or
    where a part would hold fewer than 16 keys; the default launch passes no PARTS (the one-part kernel)."""
    from kernels.decode import DecodeTile, key_parts
    dot, vec = DecodeTile(128, 4, 3), DecodeTile(128, 4, 3, dot=False)
    assert key_parts(dot, False) == 1                                           # the option off
    with options.use(decode_key_parts=4):
        assert key_parts(dot, False) == 4
        assert key_parts(vec, False) == 1 and key_parts(dot, True) == 1
        assert key_parts(DecodeTile(32, 4, 3), False) == 1                      # 8 keys a part
        assert key_parts(DecodeTile(64, 4, 3), False) == 4                      # 16
    with options.use(decode_key_parts=8):
        assert key_parts(DecodeTile(64, 4, 3), False) == 1
    recorded = _split_consts(monkeypatch, "PARTS", default="not passed")
    q, k, v, lens_t = make_case(2, 4, 4, 1, 64, [30, 200], max_len=256, dtype=torch.float16, seed=5)
    check(q, k, v, lens_t, torch.float16)
    assert recorded and recorded[-1] == "not passed", recorded


def test_tma_refuses_what_descriptors_cannot_read(monkeypatch):
    """decode_tma_ok: off unless the option is on; never for 32-bit caches, rows that are not a multiple of 16
    bytes, or a view whose start is not 16-byte aligned (pointer loads then give the float64-budget result); a
    view of a larger cache whose strides and start are aligned still takes descriptors."""
    _needs_tma_device()
    flags = _tma_flags(monkeypatch)
    q, k, v, lens_t = make_case(2, 4, 2, 1, 64, [5, 200], max_len=256, dtype=torch.float16, seed=3)
    assert not decode_tma_ok(k, v)                                              # the option off
    with options.use(decode_tma=True):
        assert decode_tma_ok(k, v) and decode_tma_ok(k[:, :, :210], v[:, :, :210])
        assert not decode_tma_ok(k.float(), v.float())
        q36, k36, v36, lens36 = make_case(2, 4, 2, 1, 36, [5, 200], max_len=256, dtype=torch.float16, seed=4)
        assert not decode_tma_ok(k36, v36)                                      # 72-byte rows
        check(q36, k36, v36, lens36, torch.float16)
        wide = torch.cat([k, k[..., :8]], -1)                                    # (B, Hkv, 256, 72): 144-byte rows
        shifted_k = wide[..., 4:68]                                              # starts 8 bytes in
        assert not decode_tma_ok(shifted_k, v)
        check(q, shifted_k, v, lens_t, torch.float16)
    assert flags == [False, False], flags
