"""The fused decode path: kernels/ln_linear.py and model/fused_decode.py against float64 references.

Criterion (tests/error_budget.py, as for the attention kernels): the fused result's max error against the
float64 reference is at most 2x the error of the unfused path in the same dtype (the eager op sequence, or the
model's own decode step), plus a floor of 1e-5 x max(1, |reference|). CUDA when present (bf16 included),
otherwise CPU through the Triton interpreter (fp16/fp32). Outputs and the KV cache are poisoned with NaN before
each call, so a missed write or a stray one shows up.
"""
import contextlib
import copy
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (triton decorates then)

import pytest  # noqa: E402
import triton  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.ln_linear import embed_with_stats, forced_config, ln_linear, ln_qkv_to_cache, pick_config  # noqa: E402
import kernels._triton as kt  # noqa: E402
import kernels.decode_mlp as dm  # noqa: E402
from kernels import options  # noqa: E402
from kernels.pdl import pdl_enabled  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.fused_decode import fused_decode_step, unsupported_reason  # noqa: E402
from model.generation import DecodeGraph, decode_one_token, prefill  # noqa: E402
from tests.error_budget import assert_within_budget  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
# two fused results that differ only in where the LayerNorm statistics come from agree to about this
AGREE_ATOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-1}


def reference(x, w, b, ln, gelu, res, dtype):
    """The eager op sequence in `dtype` (float64: the oracle; x's dtype: the error a naive version makes)."""
    x, w = x.to(dtype), w.to(dtype)
    if ln is not None:
        g, lb, eps = ln
        x = F.layer_norm(x, (x.shape[1],), g.to(dtype), None if lb is None else lb.to(dtype), eps)
    y = F.linear(x, w, None if b is None else b.to(dtype))
    if gelu:
        y = F.gelu(y, approximate="tanh")
    return y if res is None else y + res.to(dtype)


def check_close(out, x, w, b, ln, gelu, res):
    assert torch.isfinite(out).all(), "NaN/inf in the output: an element was not written"
    exact = reference(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in (x, w, b)),
                      None if ln is None else tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in ln),
                      gelu, None if res is None else res.cpu(), torch.float64)
    naive = reference(x, w, b, ln, gelu, res, x.dtype)
    assert_within_budget("ln_linear", out, exact, naive)


def make(M, N, K, dtype, seed, ln=True, bias=True, ln_bias=True, res=False):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)

    x = r(M, K, scale=3.0) + 1.5  # an offset so that LayerNorm's centring matters
    w = r(N, K, scale=K ** -0.5)
    b = r(N) if bias else None
    lnp = (r(K) + 1.0, r(K) if ln_bias else None, 1e-5) if ln else None
    return x, w, b, lnp, (r(M, N) if res else None)


VARIANTS = {  # (ln, bias, ln_bias, gelu, residual)
    "ln": (True, True, True, False, False),              # LN₁ → c_attn
    "residual": (False, True, False, False, True),       # c_proj + residual
    "ln-gelu": (True, True, True, True, False),          # LN₂ → c_fc → GELU
    "ln-nobias": (True, False, False, False, False),     # LN_f → lm_head (no biases anywhere)
    "gelu-residual": (False, False, False, True, True),   # every epilogue without a prologue
}
CASES = [(shape, v) for shape in [(1, 37, 50), (5, 100, 129), (17, 16, 300)] for v in VARIANTS]
CASES += [((3, 2304, 768), "ln")]  # GPT-2's c_attn at batch 3 (one variant: the interpreter is slow)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,variant", CASES, ids=[f"{v}-{'x'.join(map(str, s))}" for s, v in CASES])
@torch.no_grad()
def test_ln_linear_matches_reference(shape, variant, dtype, request):
    M, N, K = shape
    ln, bias, ln_bias, gelu, res = VARIANTS[variant]
    seed = abs(hash(request.node.name)) % 2**31
    x, w, b, lnp, r = make(M, N, K, dtype, seed, ln, bias, ln_bias, res)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    assert ln_linear(x, w, b, ln=lnp, gelu=gelu, residual=r, out=out) is out
    check_close(out, x, w, b, lnp, gelu, r)


# the last two: each program's share of K (300) is one tile, loaded whole before the activations (ONE_TILE)
@pytest.mark.parametrize("cfg", [(16, 64, 4, 1, 3), (32, 128, 4, 2, 2), (16, 32, 2, 1, 8), (64, 64, 4, 2, 1),
                                 (16, 512, 4, 1, 1), (32, 128, 4, 1, 3)],
                         ids=lambda c: "bn{}-bk{}-w{}-s{}-split{}".format(*c))
@pytest.mark.parametrize("variant", ["ln", "residual", "ln-gelu"])
@torch.no_grad()
def test_split_k_and_other_tiles(cfg, variant):
    """Split-K sums through the fp32 workspace and must leave it zeroed: a second call gives the same result."""
    ln, bias, ln_bias, gelu, res = VARIANTS[variant]
    x, w, b, lnp, r = make(5, 100, 300, torch.float32, seed=sum(cfg), ln=ln, bias=bias, ln_bias=ln_bias, res=res)
    with forced_config(cfg):
        outs = [ln_linear(x, w, b, ln=lnp, gelu=gelu, residual=r,
                          out=torch.full((5, 100), float("nan"), device=DEVICE)) for _ in range(2)]
    check_close(outs[0], x, w, b, lnp, gelu, r)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)


def test_pick_config_splits_k_only_when_the_grid_is_small():
    gpu = torch.device("cuda") if torch.cuda.is_available() else None
    for device in filter(None, [torch.device("cpu"), gpu]):
        assert pick_config(1, 50304, 768, device)[4] == 1         # the LM head: thousands of tiles already
        bn, bk, _, _, split = pick_config(1, 768, 3072, device)   # the MLP's down projection: 48 tiles
        assert split >= 2 or 768 // bn >= (132 if device.type == "cuda" else 4)
        assert 3072 // split >= 3 * bk
        # under programmatic dependent launch every program's share of K is one tile (on the H200's 132 SMs
        # also the long K of the down projection, split; the CPU's token 4 "SMs" need no split there)
        for M, N, K in [(1, 2304, 768), (16, 3072, 768), (1, 768, 3072), (16, 768, 3072)]:
            bn, bk, _, _, split = pick_config(M, N, K, device, pdl=True)
            if K <= 1024 or device.type == "cuda":
                assert triton.cdiv(K, split) <= bk and (split > 1) == (K > 1024)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 4, 16), (6, 2, 32), (3, 1, 24)])  # MHA, GQA, MQA with D not 2^k
@torch.no_grad()
def test_qkv_goes_to_the_cache_at_each_position(Hq, Hkv, D, dtype):
    B, C, max_len = 3, 40, 11
    n_q, n_kv = Hq * D, Hkv * D
    x, w, b, lnp, _ = make(B, n_q + 2 * n_kv, C, dtype, seed=Hq * 100 + D)
    kc = torch.full((B + 1, Hkv, max_len, D), float("nan"), dtype=dtype, device=DEVICE)  # one spare row
    vc = torch.full_like(kc, float("nan"))
    pos = torch.tensor([0, 7, max_len - 1], device=DEVICE)
    q = ln_qkv_to_cache(x, w, b, lnp, kc, vc, pos, n_q)  # (B, n_q)
    full = torch.empty(B, n_q + 2 * n_kv, dtype=dtype, device=DEVICE)
    ln_linear(x, w, b, ln=lnp, out=full)  # the same projection, not split
    check_close(full, x, w, b, lnp, False, None)
    torch.testing.assert_close(q, full[:, :n_q], rtol=0, atol=0)
    for bi, p in enumerate(pos.tolist()):
        torch.testing.assert_close(kc[bi, :, p], full[bi, n_q:n_q + n_kv].view(Hkv, D), rtol=0, atol=0)
        torch.testing.assert_close(vc[bi, :, p], full[bi, n_q + n_kv:].view(Hkv, D), rtol=0, atol=0)
        kc[bi, :, p] = vc[bi, :, p] = float("nan")
    assert kc.isnan().all() and vc.isnan().all(), "a write outside the rows' positions"


def row_sums(t: torch.Tensor) -> torch.Tensor:
    """(M, K) → (M, 2) float32 (Σt, Σt²) computed in float64."""
    t = t.double()
    return torch.stack([t.sum(1), (t * t).sum(1)], dim=1).float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", [1, 4])
@torch.no_grad()
def test_layer_norm_statistics_handed_between_kernels(dtype, split):
    """stats_out of a residual-add kernel = the row sums of what it stored; ln_stats = computing them in place."""
    M, C = 5, 300
    x, w, b, _, r = make(M, C, C, dtype, seed=11 + split, ln=False, res=True)
    stats = torch.full((M, 2), float("nan"), device=DEVICE)
    stats.zero_()
    with forced_config((16, 64, 4, 1, split)):
        y = ln_linear(x, w, b, residual=r, stats_out=stats)  # (M, C): the next residual stream
    torch.testing.assert_close(stats, row_sums(y), rtol=1e-5, atol=1e-3)
    _, w2, b2, lnp, _ = make(M, 64, C, dtype, seed=12)
    with_stats = ln_linear(y, w2, b2, ln=lnp, ln_stats=stats)
    in_place = ln_linear(y, w2, b2, ln=lnp)
    check_close(with_stats, y, w2, b2, lnp, False, None)
    torch.testing.assert_close(with_stats, in_place, rtol=1e-2, atol=AGREE_ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.no_grad()
def test_embedding_kernel(dtype):
    B, C, V, T, S = 4, 200, 50, 30, 5
    wte = torch.randn(V, C).to(DEVICE, dtype)
    wpe = torch.randn(T, C).to(DEVICE, dtype)
    tok = torch.tensor([0, 49, 7, 7], device=DEVICE)
    pos = torch.tensor([29, 0, 3, 3], device=DEVICE)
    stats = torch.full((S, B, 2), float("nan"), device=DEVICE)
    x = embed_with_stats(tok, pos, wte, wpe, stats)
    torch.testing.assert_close(x, wte[tok] + wpe[pos], rtol=0, atol=0)  # the eager sum, rounded the same way
    torch.testing.assert_close(stats[0], row_sums(x), rtol=1e-5, atol=1e-3)
    assert (stats[1:] == 0).all(), "the later slots must be zeroed for the producers of the next statistics"
    with pytest.raises(ValueError, match="stats must be float32"):
        embed_with_stats(tok, pos, wte, wpe, torch.zeros(S, B, 3, device=DEVICE))


def test_bad_input_raises_value_error():
    x = torch.randn(2, 8, device=DEVICE)
    w = torch.randn(5, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"x \(M, K\) and weight \(N, K\)"):
        ln_linear(x, torch.randn(5, 7, device=DEVICE))
    with pytest.raises(ValueError, match="share one of"):
        ln_linear(x, w.half())
    with pytest.raises(ValueError, match="unit stride"):
        ln_linear(torch.randn(8, 2, device=DEVICE).t(), w)
    with pytest.raises(ValueError, match="bias must have shape"):
        ln_linear(x, w, torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="residual must be"):
        ln_linear(x, w, residual=torch.zeros(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="inference-only"):
        ln_linear(x, w.requires_grad_())
    with pytest.raises(ValueError, match="ln_stats given without a LayerNorm"):
        ln_linear(x, w.detach(), ln_stats=torch.zeros(2, 2, device=DEVICE))
    with pytest.raises(ValueError, match="stats_out must be a contiguous float32"):
        ln_linear(x, w.detach(), stats_out=torch.zeros(2, 3, device=DEVICE))
    with pytest.raises(ValueError, match="weight rows"):
        ln_qkv_to_cache(x, torch.randn(12, 8, device=DEVICE), None, None, torch.zeros(2, 1, 4, 2, device=DEVICE),
                        torch.zeros(2, 1, 4, 2, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE), 4)


def tiny_gpt(bias: bool, n_kv_head: int, dtype) -> GPT:
    torch.manual_seed(3)
    model = GPT(GPTConfig(block_size=48, vocab_size=61, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=64,
                          bias=bias, attention="naive")).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-trivial LayerNorm gains and biases, weights with clear margins
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 0.5) + (1.0 if p.dim() == 1 else 0.0))
    return model.to(DEVICE, dtype)


def oracle_step(model, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """decode_one_token without its float32 cast: (B, V) logits in the model's dtype (float64 for the oracle)."""
    logits, _ = model(tok, input_pos=pos)  # (B, 1, V)
    return logits[:, -1]


def valid_cache(model, pos: torch.Tensor, which: str) -> torch.Tensor:
    """Every layer's cached keys ("k") or values ("v") at the positions 0..pos[b] each sequence holds, flat."""
    return torch.cat([getattr(block.attn.kv_cache, which)[b, :, :p + 1].flatten()
                      for block in model.transformer.h for b, p in enumerate(pos[:, 0].tolist())])


def check_step(got, want, oracle, twin, model, exact, pos, what: str) -> None:
    """The fused step's logits (got) and the caches it wrote (twin's) against the float64 model (exact, its
    logits: oracle), with the model's own step in the same dtype (want, model's caches) as the error budget."""
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # both steps' logits leave the LM head in the model's dtype: one unit of it is rounding alone
    assert_within_budget(f"logits, {what}", got, oracle, want, rounded_to=model.lm_head.weight.dtype)
    for which in ("k", "v"):
        assert_within_budget(f"cache {which}, {what}", valid_cache(twin, pos, which),
                             valid_cache(exact, pos, which), valid_cache(model, pos, which))


@pytest.mark.parametrize("mlp", ["default", "one_launch", "two_launches"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias,n_kv_head", [(True, 0), (False, 2)], ids=["gpt2-mha", "nobias-gqa"])
@torch.no_grad()
def test_fused_step_equals_the_models_step(bias, n_kv_head, dtype, mlp):
    """Prefill three prompts of different lengths, then decode 5 steps three ways from the same prompts: fused,
    the model's own step in `dtype`, and the same weights in float64 (the oracle); all fed the same tokens.
    The MLP blocks as the device's default picks, forced into one launch (kernels/decode_mlp.py), or as two."""
    with options.use(decode_fused_mlp=mlp != "two_launches"), \
            (dm.forced_tile(16) if mlp == "one_launch" else contextlib.nullcontext()):
        fused_step_three_ways(bias, n_kv_head, dtype)


def fused_step_three_ways(bias, n_kv_head, dtype):
    model = tiny_gpt(bias, n_kv_head, dtype)
    twin = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()  # the same (dtype-rounded) weights, float64 end to end
    B, max_len = 3, 24
    lengths = torch.tensor([1, 6, 13], device=DEVICE)
    idx = torch.randint(0, 61, (B, 13), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    for m in (model, twin, exact):
        m.setup_kv_cache(B, max_len)
    for block in twin.transformer.h:  # the fused path must never read past a sequence's length
        block.attn.kv_cache.k.fill_(float("nan"))  # (the model's exact path masks the whole cache: zeros there)
        block.attn.kv_cache.v.fill_(float("nan"))
    for m in (model, twin, exact):
        prefill(m, idx, lengths)
    assert unsupported_reason(model) is None
    pos = lengths[:, None].clone()                                # (B, 1)
    tok = torch.tensor([[3], [17], [60]], device=DEVICE)          # (B, 1)
    for step in range(5):
        want = decode_one_token(model, tok, pos)                  # (B, V) the model's own step (naive attention)
        got = fused_decode_step(twin, tok, pos)
        check_step(got, want, oracle_step(exact, tok, pos), twin, model, exact, pos, f"step {step}")
        tok = want.argmax(-1, keepdim=True)
        pos = pos + 1


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs and programmatic dependent launch need a GPU")
@pytest.mark.parametrize("pdl", ["1", "0"], ids=["pdl", "no-pdl"])
@torch.no_grad()
def test_fused_step_replayed_in_a_cuda_graph_at_gpt2_widths(pdl, monkeypatch):
    """GPT-2's widths in bf16 (768, MLP 3072: the down projection splits K), the fused step captured in a CUDA
    graph with and without programmatic dependent launch (the pdl option): every replay's logits and cache writes
    match the model's own step. A kernel reading its input before the previous kernel finished writing it
    (a broken wait) would read the last step's activations and fail this."""
    monkeypatch.setattr(options, "_current", options.get())
    options.update(pdl=pdl == "1")  # restored by monkeypatch at the end of the test
    torch.manual_seed(7)
    model = GPT(GPTConfig(block_size=320, vocab_size=512, n_layer=3, n_head=12, n_embd=768,
                          attention="naive")).to(DEVICE, torch.bfloat16).eval()
    twin = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()  # the float64 oracle with the same (bf16-rounded) weights
    B, max_len = 3, 320
    lengths = torch.tensor([1, 77, 300], device=DEVICE)
    idx = torch.randint(0, 512, (B, 300), device=DEVICE)
    for m in (model, twin, exact):
        m.setup_kv_cache(B, max_len)
    graph = DecodeGraph(twin, B, DEVICE, fused_decode_step)  # before prefill (its warm-up steps write position 0)
    for m in (model, twin, exact):
        prefill(m, idx, lengths)
    pos = lengths[:, None].clone()                                # (B, 1)
    tok = torch.randint(0, 512, (B, 1), device=DEVICE)            # (B, 1)
    for step in range(6):
        want = decode_one_token(model, tok, pos)                  # (B, V)
        got = graph(twin, tok, pos).clone()
        check_step(got, want, oracle_step(exact, tok, pos), twin, model, exact, pos, f"replay {step}")
        tok = want.argmax(-1, keepdim=True)
        pos = pos + 1


def test_pdl_only_where_it_can_run(monkeypatch):
    """Programmatic dependent launch: never on CPU or under the interpreter, and the pdl option off
    (FLASHGPT_PDL=0) turns it off."""
    assert not pdl_enabled(torch.device("cpu"))
    with options.use(pdl=False):
        assert not pdl_enabled(torch.device("cuda"))
    assert options.from_env({"FLASHGPT_PDL": "0"}).pdl is False
    monkeypatch.setattr(kt, "INTERPRET", True)
    assert not pdl_enabled(torch.device("cuda"))


def test_unsupported_reason_names_the_problem():
    model = tiny_gpt(True, 0, torch.float32)
    assert "no KV cache" in unsupported_reason(model)
    assert unsupported_reason(model, check_cache=False) is None
    model.setup_kv_cache(1, 8, dtype=torch.float16)
    assert "KV cache dtype" in unsupported_reason(model)
