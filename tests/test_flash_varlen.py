"""The flash kernels' document (varlen) and sliding-window forms against a float64 reference.

Documents packed in rows (flash_attention(..., docs=bounds), and flash_attention_varlen on cu_seqlens): a query
sees the keys of its own document only; a window (window=w, causal): query i sees keys j with
i + Nk - Nq - w < j <= i + Nk - Nq. The reference is naive attention in float64 with an explicit mask built here,
independently of the kernels' helpers: a block-diagonal (per document) causal mask, narrowed by the window.

Every case checks the output and dQ, dK, dV with the suite's criterion (tests/error_budget.py: at most 2x the
error of naive attention with the same mask in the same dtype, plus a floor), on fresh random inputs seeded from
the test id, with every buffer the kernels allocate filled with NaN first. Tiles are forced small
((BLOCK_M, BLOCK_N) = (16, 32) and (32, 16), head dim 16), so documents of 1, 2, 31, 32, 33 tokens, several per
row and ones that start or end on a tile edge or span one all meet tile edges. On the CPU these run in Triton's
interpreter in float32 and float16 as each test names them; on a GPU every case runs in bfloat16 instead (the
training dtype: each window size and dtype compiles kernels of its own there, so the GPU run takes the one that
matters). `-m slow` adds an exhaustive sweep (float32 on the CPU, bfloat16 on a GPU).
"""
from __future__ import annotations

import itertools

import pytest
import torch

import kernels
import kernels._triton
import kernels.flash as fa
from kernels import flash_attention, flash_attention_varlen, naive_attention, options
from kernels.flash import launch, ops
from tests.error_budget import assert_within_budget
from tests.util import seeded_generator

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# The exhaustive sweeps (slow) run float32 (bfloat16 on a GPU); the default tests add float16. In float16 a
# gradient of magnitude 2-4 is one rounding step (2e-3) from the reference when naive's happens to be half that,
# which the sweep's hundreds of cases hit now and then: the float16 cases stay in the fixed selection below.
SLOW_DTYPES = [torch.bfloat16] if CUDA else [torch.float32]
HEAD_DIM = 16
TILES = {"m16n32": (16, 32, 4, 1), "m32n16": (32, 16, 4, 1)}  # forced on the forward, dQ and dK/dV kernels
TILE = 32  # the larger block size of both


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """NaN-fill every buffer the kernels allocate; launch plans recorded by this test only."""
    def poisoned_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(kernels._triton, "empty", poisoned_empty)
    monkeypatch.setattr(launch, "_plans", {})


def _rand(shape, dtype, g) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(DEVICE, dtype)


# ------------------------------------------------------------------------------------------- the reference

def _bounds(rows: list[list[int]]) -> torch.Tensor:
    """(B, 2, N) int32 document bounds of rows of document lengths, written out document by document."""
    N = sum(rows[0])
    docs = torch.zeros(len(rows), 2, N, dtype=torch.int32)
    for b, lengths in enumerate(rows):
        assert sum(lengths) == N
        start = 0
        for n in lengths:
            docs[b, 0, start:start + n] = start
            docs[b, 1, start:start + n] = start + n
            start += n
    return docs.to(DEVICE)


def _reference_mask(rows, Nq: int, Nk: int, causal: bool, window: int) -> torch.Tensor:
    """(B, 1, Nq, Nk) bool: the causal mask (bottom-right), narrowed to the window and to block-diagonal documents
    (rows of document lengths; None: one document per row)."""
    i = torch.arange(Nq)[:, None]
    j = torch.arange(Nk)[None, :]
    offset = Nk - Nq
    base = torch.ones(Nq, Nk, dtype=torch.bool)
    if causal:
        base &= j <= i + offset
    if window:
        base &= j > i + offset - window
    if rows is None:
        return base[None, None].to(DEVICE)
    masks = []
    for lengths in rows:
        same = torch.zeros(Nq, Nk, dtype=torch.bool)
        start = 0
        for n in lengths:
            same[start:start + n, start:start + n] = True  # one block per document
            start += n
        masks.append(base & same)
    return torch.stack(masks)[:, None].to(DEVICE)


def _grads(fn, q, k, v, do, **kw):
    """[O, dQ, dK, dV] of fn(q, k, v, **kw) on leaf copies of q, k, v."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, **kw)
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]


def _check(rows, heads, dtype, tiles, g, *, causal=True, window=0, Nq=None, Nk=None, fused=False):
    """One case: rows of document lengths (None: plain rows of Nq queries and Nk keys), forced tiles, forward
    and backward against float64 with the explicit mask. On a GPU the case runs in bfloat16 whatever `dtype`
    names (the interpreter's dtype)."""
    if CUDA:
        dtype = torch.bfloat16
    Hq, Hkv = heads
    B = 1 if rows is None else len(rows)
    if rows is not None:
        Nq = Nk = sum(rows[0])
    q = _rand((B, Hq, Nq, HEAD_DIM), dtype, g)
    k = _rand((B, Hkv, Nk, HEAD_DIM), dtype, g)
    v = _rand((B, Hkv, Nk, HEAD_DIM), dtype, g)
    do = _rand((B, Hq, Nq, HEAD_DIM), dtype, g)
    mask = _reference_mask(rows, Nq, Nk, causal, window)
    ref = _grads(naive_attention, q.double(), k.double(), v.double(), do.double(), causal=False, mask=mask)
    plain = _grads(naive_attention, q, k, v, do, causal=False, mask=mask)  # the same dtype: the error budget
    docs = None if rows is None else _bounds(rows)
    forced = dict(fwd=tiles, dq=tiles, **{"dkdvq" if fused else "dkdv": tiles})
    with fa.forced_configs(**forced), options.use(backward="fused" if fused else "split"):
        out = _grads(flash_attention, q, k, v, do, causal=causal, window=window, docs=docs)
    where = f"rows {rows} Nq={Nq} Nk={Nk} heads {Hq}/{Hkv} {dtype} tiles {tiles[:2]} causal={causal} window={window}"
    for name, got, r, p in zip(("out", "dq", "dk", "dv"), out, ref, plain):
        assert got.dtype == dtype, f"{name}: dtype {got.dtype}, {where}"
        assert_within_budget(f"{name}, {where}", got, r, p)
    blind = ~mask.any(dim=-1, keepdim=True)  # (B, 1, Nq, 1) rows that see no key: exactly 0 out and dQ
    if blind.any():
        assert (out[0].masked_select(blind) == 0).all() and (out[1].masked_select(blind) == 0).all(), where
    return out


# --------------------------------------------------------------------------------------------- documents

# Rows of document lengths (every row of a case holds the same number of tokens). With tiles of 16 and 32:
# lengths 1, 2, tile - 1, tile, tile + 1; many documents per row; documents that start and end on tile edges
# (32 + 32), that span a tile edge (16 + 32 + 16: [16, 48) crosses 32), and rows whose documents differ.
DOC_ROWS = {
    "1-2-31-32-33": [[1, 2, TILE - 1, TILE, TILE + 1]],
    "tile-aligned": [[TILE, TILE, 1, TILE]],
    "spans-edge": [[16, TILE, 16, 33], [97]],
    "many-short": [[1] * 9 + [2] * 6 + [5, 3, 17, 20, 1, 2]],
    "two-rows": [[40, 1, 23], [2, 31, 31]],
}


@pytest.mark.parametrize("tiles", list(TILES.values()), ids=list(TILES))
@pytest.mark.parametrize("name", list(DOC_ROWS))
def test_documents_causal(name, tiles, request):
    """Block-diagonal causal attention: MHA in float32, GQA (two query heads per kv head) in float16 (both in
    bfloat16 on a GPU)."""
    g = seeded_generator(request)
    rows = DOC_ROWS[name]
    _check(rows, (1, 1), torch.float32, tiles, g)
    _check(rows, (2, 1), torch.float16, tiles, g)


@pytest.mark.parametrize("window", [1, 16, 33, 47, 63])
def test_documents_with_window(window, request):
    """Documents and a window together: the window (1 = each token alone, up to longer than a tile) cuts inside
    documents, the document start cuts inside the window."""
    g = seeded_generator(request)
    tiles = list(TILES.values())[window % 2]
    _check(DOC_ROWS["1-2-31-32-33"] + [[20, 79]], (2, 1), torch.float32, tiles, g, window=window)


@pytest.mark.parametrize("tiles", list(TILES.values()), ids=list(TILES))
def test_documents_without_causal_mask(tiles, request):
    """causal=False: every query sees its whole document, later tokens included."""
    g = seeded_generator(request)
    _check(DOC_ROWS["spans-edge"], (2, 1), torch.float32, tiles, g, causal=False)
    _check(DOC_ROWS["1-2-31-32-33"], (1, 1), torch.float16, tiles, g, causal=False)


@pytest.mark.parametrize("causal", [True, False])
def test_documents_fused_backward_and_load_paths(causal, request, monkeypatch):
    """The fused backward (dK/dV adding dQ) with documents, both load paths (TMA descriptors and pointers), and
    the causal longest-first grid."""
    g = seeded_generator(request)
    for tma in (True, False):
        with options.use(tma=tma):
            _check(DOC_ROWS["spans-edge"], (2, 1), torch.float32, TILES["m16n32"], g, causal=causal, fused=True)
            _check(DOC_ROWS["two-rows"], (2, 2), torch.float16, TILES["m32n16"], g, causal=causal)
    monkeypatch.setattr(launch, "_lpt_group", lambda t, rows, heads: 2)
    monkeypatch.setattr(launch, "LPT_MIN_GROUP", 1)
    _check(DOC_ROWS["two-rows"], (4, 2), torch.float32, TILES["m16n32"], g, causal=causal, window=7 * causal)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the NaN rows themselves, in the interpreter
def test_blocks_outside_a_document_or_window_are_never_read(request):
    """Q, K, V and dO hold NaN where the mask hides them from the rows checked. A kernel that read one of those
    blocks (even masked: 0 · NaN) would spread NaN. Three documents aligned to tiles, the first and the last
    NaN: the middle one's outputs and gradients stay finite and right, with the causal mask and without. A
    window of half a tile, the first tile NaN: so do the rows and keys two tiles on, whose tiles the window
    keeps away from the first one."""
    g = seeded_generator(request)
    rows = [[TILE, TILE, TILE]]
    N = 3 * TILE
    for tiles in TILES.values():
        for causal, window, docs, check in ((True, 0, _bounds(rows), slice(TILE, 2 * TILE)),
                                            (False, 0, _bounds(rows), slice(TILE, 2 * TILE)),
                                            (True, TILE // 2, None, slice(2 * TILE, N))):
            q, k, v, do = (_rand((1, 2, N, HEAD_DIM), torch.float32, g) for _ in range(4))
            for t in (q, k, v, do):
                t[:, :, :TILE] = float("nan")
                if docs is not None:
                    t[:, :, 2 * TILE:] = float("nan")
            seen = slice(TILE, 2 * TILE) if docs is not None else slice(TILE, N)  # what the checked rows see
            mask = _reference_mask(rows if docs is not None else None, N, N, causal, window)[:, :, seen, seen]
            ref = _grads(naive_attention, *(t[:, :, seen].double() for t in (q, k, v, do)), causal=False, mask=mask)
            with fa.forced_configs(fwd=tiles, dq=tiles, dkdv=tiles):
                out = _grads(flash_attention, q, k, v, do, causal=causal, window=window, docs=docs)
            part = slice(check.start - seen.start, check.stop - seen.start)
            for name, got, r in zip(("out", "dq", "dk", "dv"), out, ref):
                assert torch.allclose(got[:, :, check].double(), r[:, :, part], atol=1e-5), (
                    name, tiles, causal, window)


# ----------------------------------------------------------------------------------------- dense window

# (Nq, Nk, window): Nq = Nk, Nq < Nk (a KV cache: bottom-right aligned), Nq > Nk (the first rows see no key),
# windows of 1 (the diagonal alone) to longer than both lengths. A tile has key blocks that every row sees
# (unmasked) only from window >= BLOCK_M + BLOCK_N - 1 = 47 on: windows within 1 of 48 and 64 with offsets
# Nk - Nq of 0 and +-32 put the window's edge on a tile edge there.
WINDOW_CASES = [(70, 70, 1), (70, 70, 16), (70, 70, 33), (45, 90, 31), (90, 45, 7), (40, 40, 100), (1, 50, 32),
                (130, 130, 47), (130, 130, 63), (130, 130, 64), (130, 130, 65), (98, 130, 49), (130, 98, 47)]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"Nq{c[0]}-Nk{c[1]}-w{c[2]}")
def test_sliding_window(case, request):
    Nq, Nk, window = case
    g = seeded_generator(request)
    for i, (name, tiles) in enumerate(TILES.items()):
        dtype = (torch.float32, torch.float16)[(i + window) % 2]
        _check(None, (2, 1), dtype, tiles, g, Nq=Nq, Nk=Nk, window=window)


def test_sliding_window_fused_backward(request):
    g = seeded_generator(request)
    _check(None, (2, 1), torch.float32, TILES["m32n16"], g, Nq=64, Nk=97, window=33, fused=True)


# ------------------------------------------------------------------------------------------- cu_seqlens

@pytest.mark.parametrize("dtype", [torch.bfloat16] if CUDA else [torch.float32, torch.float16], ids=str)
def test_varlen_cu_seqlens(dtype, request):
    """flash_attention_varlen: (total, H, D) tokens of sequences packed one after another (empty sequences
    included), against the reference on the same tokens as one row of documents; with a window too."""
    g = seeded_generator(request)
    lengths = [1, 2, 0, TILE - 1, TILE, TILE + 1, 0, 16, 5]
    total = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
    q = _rand((total, 2, HEAD_DIM), dtype, g)
    k, v = _rand((total, 1, HEAD_DIM), dtype, g), _rand((total, 1, HEAD_DIM), dtype, g)
    do = _rand((total, 2, HEAD_DIM), dtype, g)
    rows = [[n for n in lengths if n]]
    for window, tiles in ((0, TILES["m16n32"]), (9, TILES["m32n16"])):
        mask = _reference_mask(rows, total, total, True, window)
        as_rows = [t.transpose(0, 1)[None] for t in (q, k, v, do)]  # (1, H, total, D)
        ref = _grads(naive_attention, *(t.double() for t in as_rows), causal=False, mask=mask)
        plain = _grads(naive_attention, *as_rows, causal=False, mask=mask)
        with fa.forced_configs(fwd=tiles, dq=tiles, dkdv=tiles):
            out = _grads(flash_attention_varlen, q, k, v, do, cu_seqlens=cu, max_seqlen=TILE + 1, window=window)
        assert out[0].shape == q.shape and out[0].is_contiguous()
        for name, got, r, p in zip(("out", "dq", "dk", "dv"), out, ref, plain):
            assert_within_budget(f"{name} window={window}", got, r[0].transpose(0, 1), p[0].transpose(0, 1))


def test_document_bounds_from_tokens_and_offsets():
    """document_bounds: a document ends after each end-of-text token (consecutive ones, one at the start or the
    end of a row included) and at the row's end; bounds_from_cu_seqlens agrees with the written-out bounds."""
    E = 9
    idx = torch.tensor([[1, 2, E, 3, 4, 5, E, E, 6],
                        [E, 1, 2, 3, 4, 5, 6, 7, E],
                        [1, 2, 3, 4, 5, 6, 7, 8, 0]])
    want = _bounds([[3, 4, 1, 1], [1, 8], [9]]).cpu()
    assert torch.equal(kernels.document_bounds(idx, E), want)
    assert torch.equal(kernels.document_positions(want)[0], torch.tensor([0, 1, 2, 0, 1, 2, 3, 0, 0]))
    cu = torch.tensor([0, 3, 3, 7, 8, 9])
    assert torch.equal(kernels.bounds_from_cu_seqlens(cu, 9), want[:1])
    assert torch.equal(kernels.document_mask(want)[0, 0], _reference_mask([[3, 4, 1, 1]], 9, 9, False, 0)[0, 0].cpu())


# ---------------------------------------------------------------------------------------- plans and ops

def test_plans_keep_masks_apart(request, monkeypatch):
    """The same q, k, v with no mask, a window, documents and both, twice each: the second round replays the
    plans the first recorded, bit for bit, and no call replays another mask's plan."""
    g = seeded_generator(request)
    q, k, v, do = (_rand((2, 2, 70, HEAD_DIM), torch.float32, g) for _ in range(4))
    docs = _bounds([[30, 40], [1, 69]])
    variants = [dict(), dict(window=9), dict(docs=docs), dict(window=9, docs=docs)]
    with fa.forced_configs(fwd=TILES["m16n32"], dq=TILES["m16n32"], dkdv=TILES["m16n32"]):
        first = [_grads(flash_attention, q, k, v, do, **kw) for kw in variants]
        assert len(launch._plans) == 2 * len(variants)  # forward and backward per variant
        second = [_grads(flash_attention, q, k, v, do, **kw) for kw in variants]
    for a, b in zip(first, second):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for a, b in itertools.combinations(first, 2):
        assert not torch.equal(a[0], b[0])
    masks = [_reference_mask(rows, 70, 70, True, window)  # as the variants: none, window, docs, both
             for rows in (None, [[30, 40], [1, 69]]) for window in (0, 9)]
    for got, mask in zip(second, masks):
        ref = naive_attention(q.double(), k.double(), v.double(), causal=False, mask=mask)
        assert torch.allclose(got[0].double(), ref, atol=1e-5)


def test_custom_ops_and_torch_compile(request):
    """The forward and backward custom ops pass opcheck with a window and documents, and a function calling the
    packed form with documents compiles with fullgraph=True (aot_eager on the CPU, inductor on a GPU)."""
    g = seeded_generator(request)
    q, k, v = (_rand((2, 2, 17, HEAD_DIM), torch.float32, g) for _ in range(3))
    docs = _bounds([[5, 12], [17]])
    torch.library.opcheck(ops._flash_attn_fwd_op, (q, k, v, True, 0.3, 4, docs))
    o, lse = ops._flash_attn_fwd_op(q, k, v, True, 0.3, 4, docs)
    torch.library.opcheck(ops._flash_attn_bwd_op, (torch.randn_like(o), q, k, v, o, lse, True, 0.3, 4, docs))
    qkv = _rand((2, 17, 3 * 2 * HEAD_DIM), torch.float32, g).requires_grad_()
    x = qkv.detach()
    o, lse = ops._packed_fwd_op(x, 2, 2, True, 0.3, 0, docs)
    torch.library.opcheck(ops._packed_bwd_op, (torch.randn_like(o), x, o, lse, 2, 2, True, 0.3, 0, docs))

    torch._dynamo.reset()

    def f(qkv, docs):
        return kernels.attention_qkvpacked(qkv * 1.5, 2, 2, backend="flash", window=5, docs=docs).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    (want,) = torch.autograd.grad(f(qkv, docs), qkv)
    (got,) = torch.autograd.grad(compiled(qkv, docs), qkv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    mask = _reference_mask([[5, 12], [17]], 17, 17, True, 5)
    ref = kernels.naive_attention(*kernels.split_qkv(x.double() * 1.5, 2, 2), causal=False, mask=mask)
    assert torch.allclose(kernels.attention_qkvpacked(x * 1.5, 2, 2, backend="flash", window=5, docs=docs).double(),
                          ref, atol=1e-5)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_other_backends_take_the_same_masks(backend, request):
    """kernels.attention with a window and documents: naive and sdpa (explicit masks) agree with flash, and
    refuse the windows flash refuses."""
    g = seeded_generator(request)
    q, k, v = (_rand((2, 2, 40, HEAD_DIM), torch.float32, g) for _ in range(3))
    docs = _bounds([[7, 33], [40]])
    for kw in (dict(window=6), dict(docs=docs), dict(window=6, docs=docs), dict(docs=docs, causal=False)):
        want = kernels.attention(q, k, v, backend="flash", **kw)
        torch.testing.assert_close(kernels.attention(q, k, v, backend=backend, **kw), want, atol=1e-5, rtol=1e-5)
    for bad in (dict(window=-1), dict(window=2.0), dict(window=3, causal=False)):
        with pytest.raises(ValueError, match="window"):
            kernels.attention(q, k, v, backend=backend, **bad)
    q2 = _rand((1, 2, 50, HEAD_DIM), torch.float32, g)  # Nq > Nk with a window: blind rows are 0, not NaN
    out = kernels.attention(q2, k[:1], v[:1], backend=backend, window=6)
    torch.testing.assert_close(out, kernels.attention(q2, k[:1], v[:1], backend="flash", window=6), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("bad", ["window=-1", "window=1.5", "window+full", "docs int64", "docs shape", "docs Nq!=Nk",
                                 "cu start", "cu end", "cu decreasing", "cu float", "cu 2-d", "max_seqlen", "q 4-d",
                                 "total mismatch"])
def test_bad_input_raises_before_any_launch(bad, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("a kernel was launched")
    monkeypatch.setattr(launch, "_launch", no_launch)
    q = k = v = torch.randn(1, 2, 8, HEAD_DIM, device=DEVICE)
    docs = _bounds([[3, 5]])
    if bad.startswith(("window", "docs")):
        kw = dict(docs=docs)
        if bad == "window=-1":
            kw = dict(window=-1)
        elif bad == "window=1.5":
            kw = dict(window=1.5)
        elif bad == "window+full":
            kw = dict(window=3, causal=False)
        elif bad == "docs int64":
            kw = dict(docs=docs.long())
        elif bad == "docs shape":
            kw = dict(docs=docs[:, :, :7])
        elif bad == "docs Nq!=Nk":
            q = torch.randn(1, 2, 7, HEAD_DIM, device=DEVICE)
            kw = dict(docs=_bounds([[2, 5]]))
        with pytest.raises(ValueError):
            flash_attention(q, k, v, **kw)
        return
    t = torch.randn(8, 2, HEAD_DIM, device=DEVICE)
    cu, args, kw = torch.tensor([0, 3, 8], device=DEVICE), (t, t, t), {}
    if bad == "cu start":
        cu = torch.tensor([1, 3, 8], device=DEVICE)
    elif bad == "cu end":
        cu = torch.tensor([0, 3, 7], device=DEVICE)
    elif bad == "cu decreasing":
        cu = torch.tensor([0, 5, 3, 8], device=DEVICE)
    elif bad == "cu float":
        cu = cu.float()
    elif bad == "cu 2-d":
        cu = cu[None]
    elif bad == "max_seqlen":
        kw = dict(max_seqlen=4)
    elif bad == "q 4-d":
        args = (t[None], t, t)
    elif bad == "total mismatch":
        args = (t, t[:7], t[:7])
    with pytest.raises(ValueError, match="flash_attention"):
        flash_attention_varlen(*args, cu, **kw)


# -------------------------------------------------------------------------------------- benchmark hook

def test_varlen_benchmark_arguments_and_counts():
    """bench/attention.py --varlen (a GPU benchmark) parses its arguments on any machine, draws the same
    document lengths for a seed, and counts the visible (query, key) pairs as the mask does."""
    from bench import attention as bench
    args = bench.parse_args(["--varlen", "--doc-mean", "100", "--doc-seed", "3", "--window", "40",
                             "--shapes", "2,4,512,64"])
    assert args.varlen and args.providers == ["flex", "flash"] and args.shapes == [(2, 4, 512, 64)]
    assert args.tag == "attention_varlen" and args.window == 40
    assert bench.parse_args([]).providers == bench.PROVIDERS and bench.parse_args([]).tag == "attention"
    for bad in (["--varlen", "--providers", "sdpa-flash"], ["--window", "8"], ["--shapes", "1,2,3"],
                ["--varlen", "--doc-mean", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    lengths = bench.doc_lengths(1024, 100.0, seed=3)
    assert sum(lengths) == 1024 and min(lengths) >= 1 and lengths == bench.doc_lengths(1024, 100.0, seed=3)
    assert lengths != bench.doc_lengths(1024, 100.0, seed=4) and 4 <= len(lengths) <= 40
    rows = [lengths[:3]]
    n = sum(rows[0])
    for window in (0, 1, 7, 40):
        mask = _reference_mask(rows, n, n, True, window)
        assert bench.visible_pairs(rows[0], window) == int(mask.sum())
    assert bench.varlen_flops([4], 2, 8, 0, "bwd") == 2.5 * 4 * 2 * 8 * 10
    timing = dict(peak_gib=0.5, fwd_ms=1.0, bwd_ms=2.0)
    row = dict(shape=[2, 4, 512, 64], causal=True, window=40, doc_mean=100.0, doc_seed=3, n_docs=len(lengths),
               providers={"flex": dict(timing, fwd_tflops=200.0, bwd_tflops=100.0, diff=None),
                          "flash": dict(timing, fwd_tflops=300.0, bwd_tflops=200.0, diff=1e-3),
                          })
    table = bench.render_varlen([row], dict(gpu="GPU", command="c", date="d", torch="t", triton="tr"))
    assert f"| 1024, 4, 64 | {len(lengths)} (100) | 40 | 200 / 100" in table and "| 1.50 / 2.00 |" in table


# ---------------------------------------------------------------------------------------------- slow

def _partitions(n_docs: int, seed: int) -> list[list[int]]:
    """Rows of 97 tokens cut into n_docs documents at seeded places within 2 of tile edges."""
    import random
    rng = random.Random(seed)
    edges = sorted(e + d for e in range(16, 97, 16) for d in (-2, -1, 0, 1, 2) if 0 < e + d < 97)
    rows = []
    for _ in range(3):
        cuts = sorted(rng.sample(edges, n_docs - 1))
        rows.append([b - a for a, b in zip([0, *cuts], [*cuts, 97])])
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("dtype", SLOW_DTYPES, ids=str)
@pytest.mark.parametrize("n_docs", [2, 3, 5, 8])
@pytest.mark.parametrize("tiles", list(TILES.values()), ids=list(TILES))
def test_documents_exhaustive(tiles, n_docs, dtype, fused, request):
    """Rows cut into documents at every kind of place near a tile edge, causal and not, with and without a window
    (within 1 of a tile), MHA and GQA, both backward structures."""
    g = seeded_generator(request)
    for seed in range(4):
        rows = _partitions(n_docs, seed)
        for causal, window in ((True, 0), (False, 0), (True, 15), (True, 33)):
            _check(rows, (2, 1) if seed % 2 else (1, 1), dtype, tiles, g, causal=causal, window=window, fused=fused)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", SLOW_DTYPES, ids=str)
@pytest.mark.parametrize("tiles", list(TILES.values()), ids=list(TILES))
def test_sliding_window_exhaustive(tiles, dtype, request):
    """Windows within 2 of every tile multiple up to 66, and lengths Nq, Nk around the tile edges both ways."""
    g = seeded_generator(request)
    windows = sorted({e + d for e in (16, 32, 48, 64) for d in (-2, -1, 0, 1, 2)} | {1, 2})
    for i, window in enumerate(windows):
        Nq, Nk = [(64, 64), (33, 97), (97, 33), (31, 65), (65, 31)][i % 5]
        _check(None, (2, 1), dtype, tiles, g, Nq=Nq, Nk=Nk, window=window)
