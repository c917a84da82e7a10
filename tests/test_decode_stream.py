"""The stream order of decode attention (kernels/decode_stream.py) against the float64 reference.

The key blocks of every (sequence, kv head, row block) end to end, cut into equal ranges over a fixed grid: rows
split across programs in every way (a range inside one row, a range over several whole rows, a row over many
ranges, empty ranges), with the cache past each length poisoned and the output poisoned before each call (the
helpers of tests/test_decode.py). On CUDA bf16 too; on the CPU through the Triton interpreter.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (triton decorates then)

import pytest  # noqa: E402

import kernels._triton as kt  # noqa: E402
from kernels import options  # noqa: E402
from tests.test_decode import DEVICE, DTYPES, FLOOR, check, make_case, reference, run_decode, workspaces  # noqa: E402, F401

# lengths not multiples of any tile's BLOCK_N, one of a single key, one longer than the rest together
LENS = [1, 17, 100, 257, 1000]


def stream(**kw):
    return options.use(decode_split_order="stream", **kw)


@pytest.fixture
def stream_launches(monkeypatch):
    """(kernel name, grid, consts) of each stream launch (they still run)."""
    import kernels.decode_stream as ds
    made = []
    real = ds._launch

    def recording(kernel, grid, tensors, scalars, consts, launch):
        made.append((kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, grid, consts, launch))
        return real(kernel, grid, tensors, scalars, consts, launch)
    monkeypatch.setattr(ds, "_launch", recording)
    return made


@pytest.mark.parametrize("sms, per_sm", [(5, 1), (3, 3), (64, 4)], ids=["5x1", "3x3", "64x4-empty-ranges"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Nq", [1, 4], ids=["nq1", "nq4"])
@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_stream_matches_the_reference(sms, per_sm, dtype, Nq, Hq, Hkv, monkeypatch, stream_launches):
    monkeypatch.setattr(kt, "sm_count", lambda device: sms)
    lens = [max(L, Nq) for L in LENS]
    q, k, v, lens_t = make_case(len(lens), Hq, Hkv, Nq, 48, lens, max_len=1024, dtype=dtype, seed=sms + Hq + Nq)
    with stream(decode_stream_per_sm=per_sm):
        check(q, k, v, lens_t, dtype, check_lens=False)
    (kernel, grid, _, _), (merge, merge_grid, _, _) = stream_launches
    assert kernel == "_stream_decode_kernel" and grid == (sms * per_sm, 1, 1)
    assert merge == "_stream_merge_kernel" and merge_grid == (len(lens) * Hq * Nq, 1, 1)


def test_stream_equals_the_split_plan_up_to_summation_order(monkeypatch):
    monkeypatch.setattr(kt, "sm_count", lambda device: 7)
    dtype = torch.float16
    q, k, v, lens = make_case(len(LENS), 8, 2, 2, 64, [max(L, 2) for L in LENS], max_len=1024, dtype=dtype, seed=3)
    with stream(decode_stream_per_sm=2):
        streamed = check(q, k, v, lens, dtype, check_lens=False)
    split = check(q, k, v, lens, dtype, check_lens=False)
    torch.testing.assert_close(streamed, split, atol=FLOOR[dtype], rtol=FLOOR[dtype])


def test_parts_only_for_rows_that_span_programs(monkeypatch, workspaces):  # noqa: F811
    """One sequence, 4 heads of 6 blocks (64 keys each, fp32 at D = 64) over 4 programs of 6 blocks: every row in
    one range, so no part is written and the merge leaves the output alone; over 5 programs (4.8 blocks each) rows
    span two ranges, and each program writes a part in its first and/or second slot."""
    monkeypatch.setattr(kt, "sm_count", lambda device: 1)
    q, k, v, lens = make_case(1, 4, 4, 1, 64, [6 * 64], max_len=6 * 64, dtype=torch.float32, seed=8)
    with stream(decode_stream_per_sm=4):
        check(q, k, v, lens, torch.float32, check_lens=False)
    o_part, lse = workspaces[-2:]
    assert lse.shape == (2 * 4 * 16,) and torch.isnan(lse).all()          # 16 rows per program step (dot)
    with stream(decode_stream_per_sm=5):
        check(q, k, v, lens, torch.float32, check_lens=False)
    lse = workspaces[-1].view(5, 2, 16)[:, :, 0]                           # (programs, slots) of query row 0
    # ranges [0, 4.8), [4.8, 9.6), ...: blocks 0-3, 4-8, 9-13, 14-18, 19-23 of rows of 6 blocks
    written = torch.isfinite(lse)
    assert written.tolist() == [[True, False], [True, True], [True, True], [True, True], [True, False]]


def test_several_row_blocks_and_the_vector_tile(monkeypatch):
    from kernels.decode import DecodeTile
    monkeypatch.setattr(kt, "sm_count", lambda device: 3)
    # MQA with 24 query heads x 4 new tokens = 96 rows of one kv head: two row blocks per kv head
    q, k, v, lens = make_case(2, 24, 1, 4, 32, [77, 200], max_len=256, dtype=torch.float32, seed=5)
    with stream(decode_stream_per_sm=2):
        check(q, k, v, lens, torch.float32, check_lens=False)
    # one query row per program step (dot=False): a vector product per block, 24 ranges over 2 rows
    q, k, v, lens = make_case(2, 3, 3, 1, 64, [1500, 40], max_len=1536, dtype=torch.float16, seed=6)
    with stream(decode_stream_per_sm=8):
        check(q, k, v, lens, torch.float16, check_lens=False, tile=DecodeTile(32, 4, 1, dot=False))


def test_lengths_outside_the_cache_are_clamped(monkeypatch):
    monkeypatch.setattr(kt, "sm_count", lambda device: 3)
    q, k, v, _ = make_case(2, 2, 2, 1, 32, [64, 64], max_len=64, dtype=torch.float32, seed=4)
    with stream():
        out = run_decode(q, k, v, torch.tensor([500, -3], dtype=torch.int32, device=DEVICE), check_lens=False)
    torch.testing.assert_close(out[:1].double(), reference(q[:1], k[:1], v[:1], torch.tensor([64])),
                               atol=1e-5, rtol=1e-5)
    assert (out[1] == 0).all()


def test_explicit_split_counts_and_large_batches_keep_the_split_kernel(monkeypatch, stream_launches):
    import kernels.decode_stream as ds
    monkeypatch.setattr(kt, "sm_count", lambda device: 4)
    q, k, v, lens = make_case(3, 2, 2, 1, 32, [40, 300, 90], max_len=320, dtype=torch.float32, seed=2)
    with stream():
        check(q, k, v, lens, torch.float32, num_splits=3)
        assert stream_launches == []
        monkeypatch.setattr(ds, "STREAM_MAX_BATCH", 2)
        check(q, k, v, lens, torch.float32)
        assert stream_launches == []
        monkeypatch.setattr(ds, "STREAM_MAX_BATCH", 3)
        check(q, k, v, lens, torch.float32)
        assert [name for name, *_ in stream_launches] == ["_stream_decode_kernel", "_stream_merge_kernel"]


def test_one_program_per_sm_takes_the_deep_tile(monkeypatch, stream_launches):
    monkeypatch.setattr(kt, "sm_count", lambda device: 4)
    q, k, v, lens = make_case(2, 4, 4, 1, 64, [300, 129], max_len=512, dtype=torch.float16, seed=1)
    with stream(decode_stream_per_sm=1):
        check(q, k, v, lens, torch.float16, check_lens=False)
    with stream(decode_stream_per_sm=2):
        check(q, k, v, lens, torch.float16, check_lens=False)
    stages = [launch["num_stages"] for name, _, _, launch in stream_launches if name == "_stream_decode_kernel"]
    assert stages == [4, 3]


def test_bad_programs_per_sm_is_refused():
    with pytest.raises(ValueError, match="decode_stream_per_sm"):
        options.KernelOptions(decode_stream_per_sm=-1)
    with pytest.raises(ValueError, match="decode_split_order"):
        options.KernelOptions(decode_split_order="streamed")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("B", [1, 16])
def test_graph_replays_follow_the_lengths_on_the_device(B):
    """Captured once with the grid for the capacity; each replay plans its ranges from the lengths it finds."""
    H, D, cap = 12, 64, 4096
    q, k, v, lens = make_case(B, H, H, 1, D, [cap] * B, max_len=cap, dtype=torch.bfloat16, seed=B)
    out = torch.empty_like(q)
    with stream(), torch.no_grad():
        from kernels.decode import decode_attention
        decode_attention(q, k, v, lens, out=out, check_lens=False)  # compile before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_attention(q, k, v, lens, out=out, check_lens=False)
    g = torch.Generator().manual_seed(B)
    for _ in range(3):
        new = torch.randint(1, cap + 1, (B,), generator=g, dtype=torch.int32)
        lens.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = (out.double() - reference(q, k, v, lens)).abs().max().item()
        assert err <= 2e-2, (new.tolist(), err)
