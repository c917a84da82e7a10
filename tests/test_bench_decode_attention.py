"""bench/decode_attention.py's own logic on the CPU: arguments, cache rotation, split candidates, and a sweep
that records a failing candidate and goes on (the smoke run itself: tests/test_decode.py)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels.decode is imported (triton decorates then)

import bench.decode_attention as bd  # noqa: E402


def test_bad_arguments_are_one_line_errors(capsys):
    for argv, message in ((["--lens", "1k"], "--lens: expected comma-separated integers"),
                          (["--batches", "0"], "--batches: values must be >= 1"),
                          (["--heads", "12", "--kv-heads", "5"], "must be a positive multiple of --kv-heads"),
                          (["--lens", "2048", "--capacity", "1024"], "below the longest length"),
                          (["--providers", "split,nope"], "--providers: unknown nope"),
                          (["--sweep-tiles", "128:4"], "--sweep-tiles: expected BLOCK_N:WARPS:STAGES[:vec]"),
                          (["--sweep-tiles", "128:4:2:dot"], "--sweep-tiles: expected BLOCK_N:WARPS:STAGES[:vec]"),
                          (["--sweep-orders", "random"], "--sweep-orders: expected some of strided, chunks")):
        with pytest.raises(SystemExit) as e:
            bd.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    a = bd.parse_args(["--heads", "12", "--kv-heads", "4", "--lens", "1024,4096"])
    assert a.kv_heads == 4 and a.lens == [1024, 4096] and a.batches is None
    a = bd.parse_args(["--sweep-tiles", "128:4:3,64:2:1:vec", "--sweep-splits", "11,44", "--sweep-min-keys", "",
                       "--sweep-orders", "chunks,strided", "--providers", "split,sdpa"])
    assert a.sweep_tiles == [(128, 4, 3, True), (64, 2, 1, False)] and a.sweep_splits == [11, 44]
    assert a.sweep_min_keys == [] and a.sweep_orders == ["chunks", "strided"] and a.providers == ["split", "sdpa"]


def test_rotation_reads_three_l2s_between_visits_of_one_copy():
    l2 = 50 << 20
    assert bd.rotation_count(3 << 20, l2) == 51       # batch 1, 1k cache, GPT-2 shape: 3 MiB per call
    assert bd.rotation_count(1 << 30, l2) == 2        # a long cache still alternates two copies
    for nbytes in (1, 4096, 7 << 20, 200 << 20):
        n = bd.rotation_count(nbytes, l2)
        assert (n - 1) * nbytes >= bd.L2_FACTOR * l2 and n >= 2


def test_every_sweep_tile_is_a_valid_config_and_splits_keep_a_block():
    from kernels.decode import DecodeTile
    tiles = [DecodeTile(*t) for t in bd.SWEEP_TILES + bd.SMOKE_TILES]
    assert len(set(tiles)) == len(tiles) and any(not t.dot for t in tiles)
    assert bd.candidate_splits(1024, 64) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert bd.candidate_splits(100, 128) == [1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the --smoke settings (CPU tensors) need the interpreter; a GPU "
                    "runs the real sweep")
def test_sweep_records_a_failing_candidate_and_keeps_going(monkeypatch, tmp_path):
    run = bd.Run(bd.parse_args(["--smoke", "--sweep", "--out", str(tmp_path), "--batches", "1", "--lens", "600"]),
                 None)
    run.tiles, run.splits_grid, run.min_keys_grid = [(16, 4, 1, True), (32, 4, 1, True)], (1, 3), ()
    real = run.decode.decode_attention

    def flaky(*a, tile=None, **kw):
        if tile is not None and tile.block_n == 32:
            raise RuntimeError("out of resource: shared memory\nsecond line")
        return real(*a, tile=tile, **kw)
    monkeypatch.setattr(run.decode, "decode_attention", flaky)
    with torch.no_grad():
        res = run.sweep_shape(run.shape(1, 600), {"providers": {}})
    bad = [c for c in res["candidates"] if "error" in c]
    assert [c["tile"] for c in bad] == ["n32 w4 s1 dot"]
    assert bad[0]["error"] == "RuntimeError: out of resource: shared memory"
    ok = [c for c in res["candidates"] if "us" in c]
    assert {(c["tile"], c["splits"]) for c in ok} >= {(str(run.default), "auto"), ("n16 w4 s1 dot", 3)}
    assert res["best"] in ok and all(c["max_err"] <= 1e-4 for c in ok)
