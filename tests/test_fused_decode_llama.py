"""The fused decode path for Llama-family blocks (RMSNorm, SwiGLU, RoPE, GQA, qkv_bias, untied heads) against
float64 references.

Criterion as in tests/test_fused_decode.py (tests/error_budget.py): the fused result's max error against the
float64 reference is at most 2x the error of the unfused path in the same dtype (the eager op sequence, or the
model's own decode step), plus a floor of 1e-5 x max(1, |reference|). CUDA when present (bf16 included),
otherwise CPU through the Triton interpreter (fp16/fp32). Outputs and caches are poisoned with NaN first, so a
missed write or a stray one shows up.
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

from kernels import options  # noqa: E402
import kernels.ln_linear as ll  # noqa: E402
from kernels.ln_linear import embed_with_stats, forced_config, ln_linear, ln_qkv_to_cache, pick_config  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.fused_decode import fused_decode_step, rope_tables, unsupported_reason  # noqa: E402
from model.generation import DecodeGraph, decode_one_token, generate, prefill, use_fused_decode  # noqa: E402
from model.rope import RotaryEmbedding, apply_rope  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from tests.error_budget import assert_within_budget  # noqa: E402
from tests.test_fused_decode import DEVICE, DTYPES, check_step, oracle_step, row_sums  # noqa: E402

LLAMA = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)
# head dim 16: pair 0 (wavelength 6.3 tokens) is kept, pair 1 (13.6) blended, pairs 2..7 stretched 8x; the
# positions decoded pass rope_original_max_pos
ROPE_LLAMA3 = dict(rope_theta=500.0, rope_scaling="llama3", rope_original_max_pos=16, rope_low_freq_factor=1.0,
                   rope_high_freq_factor=2.0)


# ------------------------------------------------------------------------------------------- the kernels

def rms_norm_ref(x, g, eps, dtype):
    """model/norms.py's RMSNorm in `dtype`: normalised in float32 (float64 for float64), rounded, times the gain."""
    x = x.to(dtype)
    y = F.rms_norm(x.to(torch.promote_types(dtype, torch.float32)), (x.shape[-1],), eps=eps)
    return g.to(dtype) * y.to(dtype)


def mlp_ref(x, w, b, g, eps, swiglu, res, dtype):
    """The eager op sequence in `dtype` (float64: the oracle): RMSNorm (g given) → linear → SwiGLU → + residual."""
    x, w = x.to(dtype), w.to(dtype)
    if g is not None:
        x = rms_norm_ref(x, g, eps, dtype)
    y = F.linear(x, w, None if b is None else b.to(dtype))
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if res is None else y + res.to(dtype)


def make(M, N, K, dtype, seed, bias=True, res_cols=None):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)

    x = r(M, K, scale=3.0) + 1.5
    w = r(N, K, scale=K ** -0.5 * 2)  # SiLU's curved part, not only its linear tail
    b = r(N) if bias else None
    gain = r(K) * 0.3 + 1.0
    return x, w, b, gain, (r(M, res_cols) if res_cols else None)


MLP_VARIANTS = {  # (rms, bias, swiglu, residual)
    "rms": (True, False, False, False),             # RMSNorm → c_attn (no rope) / lm_head
    "rms-swiglu": (True, False, True, False),       # RMSNorm → c_fc → SwiGLU (Llama)
    "rms-swiglu-bias": (True, True, True, False),   # with biases (bias = true)
    "swiglu-residual": (False, True, True, True),   # every SwiGLU epilogue without a prologue
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 74, 50), (5, 200, 129), (17, 32, 300)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("variant", MLP_VARIANTS)
@torch.no_grad()
def test_rms_and_swiglu_match_reference(shape, variant, dtype):
    M, N, K = shape  # N: the weight's rows (SwiGLU: gate and up halves of N/2 each)
    rms, bias, swiglu, res = MLP_VARIANTS[variant]
    n_out = N // 2 if swiglu else N
    x, w, b, gain, r = make(M, N, K, dtype, seed=M * N + K, bias=bias, res_cols=n_out if res else None)
    ln = (gain, None, 1e-5) if rms else None
    out = torch.full((M, n_out), float("nan"), dtype=dtype, device=DEVICE)
    assert ln_linear(x, w, b, ln=ln, rms=rms, swiglu=swiglu, residual=r, out=out) is out
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    exact = mlp_ref(cpu(x), cpu(w), cpu(b), cpu(gain) if rms else None, 1e-5, swiglu, cpu(r), torch.float64)
    naive = mlp_ref(x, w, b, gain if rms else None, 1e-5, swiglu, r, dtype)
    assert_within_budget(f"ln_linear {variant}", out, exact, naive)


# the paired modes read two weight tiles per program: split-K (their sums at N and 2N of the workspace), several
# K steps, and one whole-K tile loaded first
@pytest.mark.parametrize("cfg", [(32, 64, 4, 1, 3), (16, 32, 2, 1, 8), (64, 64, 4, 2, 1), (32, 512, 4, 1, 1)],
                         ids=lambda c: "bn{}-bk{}-w{}-s{}-split{}".format(*c))
@torch.no_grad()
def test_swiglu_split_k_and_other_tiles(cfg):
    """Split-K leaves its workspace zeroed: a second call gives the same result."""
    x, w, b, gain, _ = make(5, 200, 300, torch.float32, seed=sum(cfg))
    outs = []
    with forced_config(cfg):
        for _ in range(2):
            outs.append(ln_linear(x, w, b, ln=(gain, None, 1e-5), rms=True, swiglu=True,
                                  out=torch.full((5, 100), float("nan"), device=DEVICE)))
    exact = mlp_ref(x.cpu(), w.cpu(), b.cpu(), gain.cpu(), 1e-5, True, None, torch.float64)
    assert_within_budget("swiglu split", outs[0], exact, mlp_ref(x, w, b, gain, 1e-5, True, None, x.dtype))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.no_grad()
def test_rms_statistics_handed_between_kernels(dtype):
    """RMSNorm from the row sums a residual-add kernel leaves behind = RMSNorm computed in place."""
    M, C = 5, 300
    x, w, b, _, r = make(M, C, C, dtype, seed=21, res_cols=C)
    stats = torch.zeros(M, 2, device=DEVICE)
    y = ln_linear(x, w, b, residual=r, stats_out=stats)                   # (M, C): the next residual stream
    torch.testing.assert_close(stats, row_sums(y), rtol=1e-5, atol=1e-3)
    _, w2, _, gain, _ = make(M, 128, C, dtype, seed=22)
    ln = (gain, None, 1e-5)
    with_stats = ln_linear(y, w2, ln=ln, rms=True, swiglu=True, ln_stats=stats)
    in_place = ln_linear(y, w2, ln=ln, rms=True, swiglu=True)
    exact = mlp_ref(y.cpu(), w2.cpu(), None, gain.cpu(), 1e-5, True, None, torch.float64)
    assert_within_budget("rms from handed statistics", with_stats, exact,
                         mlp_ref(y, w2, None, gain, 1e-5, True, None, dtype))
    torch.testing.assert_close(with_stats, in_place, rtol=1e-2, atol={torch.float32: 1e-4}.get(dtype, 5e-2))


def qkv_ref(x, w, b, gain, eps, cos, sin, pos, Hq, Hkv, D, dtype, qk_norm=None):
    """The eager attention input in `dtype`: RMSNorm → c_attn → (qk_norm: (q gain, k gain, eps), each head's
    RMSNorm) → rotate q and k (model/rope.py) → (q, k, v) per row, q (B, Hq·D), k and v (B, Hkv, D)."""
    B = x.shape[0]
    h = F.linear(rms_norm_ref(x.to(dtype), gain, eps, dtype), w.to(dtype), None if b is None else b.to(dtype))
    heads = h.view(B, 1, Hq + 2 * Hkv, D)                                  # (B, T=1, heads, D)
    qk = heads[:, :, :Hq + Hkv]
    if qk_norm is not None:
        qg, kg, qk_eps = qk_norm
        qk = torch.cat((rms_norm_ref(qk[:, :, :Hq], qg, qk_eps, dtype), rms_norm_ref(qk[:, :, Hq:], kg, qk_eps, dtype)),
                       dim=2)
    qk = apply_rope(qk, cos[pos][:, None].to(dtype), sin[pos][:, None].to(dtype))
    return qk[:, 0, :Hq].reshape(B, -1), qk[:, 0, Hq:], heads[:, 0, Hq + Hkv:]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Hq,Hkv,D,bias", [(4, 2, 16, False), (6, 2, 24, True), (3, 1, 64, False)],
                         ids=["gqa", "qkv_bias-d24", "mqa-d64"])
@torch.no_grad()
def test_rope_qkv_goes_to_the_cache_rotated(Hq, Hkv, D, bias, dtype):
    """RoPE inside the QKV kernel: q returned and k cached rotated at each row's position, v as it is; nothing
    else of the cache written."""
    B, C, max_len = 3, 40, 40
    cfg = GPTConfig(n_embd=C, n_head=Hq, head_size=D, pos_emb="rope", **ROPE_LLAMA3)
    cos, sin = RotaryEmbedding(cfg).to(DEVICE)(torch.arange(max_len, device=DEVICE), dtype)  # (L, D) each
    n_q, n_kv = Hq * D, Hkv * D
    x, w, b, gain, _ = make(B, n_q + 2 * n_kv, C, dtype, seed=Hq * D, bias=bias)
    kc = torch.full((B + 1, Hkv, max_len, D), float("nan"), dtype=dtype, device=DEVICE)  # one spare row
    vc = torch.full_like(kc, float("nan"))
    pos = torch.tensor([0, 17, max_len - 1], device=DEVICE)  # the first, past the llama3 band, the last
    q = ln_qkv_to_cache(x, w, b, (gain, None, 1e-6), kc, vc, pos, n_q, rms=True, rope=(cos, sin))  # (B, n_q)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    exact = qkv_ref(cpu(x), cpu(w), cpu(b), cpu(gain), 1e-6, cos.cpu(), sin.cpu(), pos.cpu(), Hq, Hkv, D, torch.float64)
    naive = qkv_ref(x, w, b, gain, 1e-6, cos, sin, pos, Hq, Hkv, D, dtype)
    assert_within_budget("rope q", q, exact[0], naive[0])
    rows = torch.arange(B, device=DEVICE)
    assert_within_budget("rope k in the cache", kc[rows, :, pos], exact[1], naive[1])
    assert_within_budget("v in the cache", vc[rows, :, pos], exact[2], naive[2])
    kc[rows, :, pos] = vc[rows, :, pos] = float("nan")
    assert kc.isnan().all() and vc.isnan().all(), "a write outside the rows' positions"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Hq,Hkv,D,bias,split", [(4, 2, 32, False, False), (3, 1, 64, True, False),
                                                 (4, 2, 32, False, True)],
                         ids=["gqa-d32", "mqa-d64-bias", "gqa-d32-split-k"])
@torch.no_grad()
def test_qk_norm_then_rope_in_the_qkv_kernel(Hq, Hkv, D, bias, split, dtype):
    """Qwen3's per-head RMSNorm of q and k (their own gains) before the rotation, one head per tile, in one
    launch (and with the K reduction split over programs); v untouched; nothing else of the cache written."""
    B, C, max_len = 3, 40, 40
    cfg = GPTConfig(n_embd=C, n_head=Hq, head_size=D, pos_emb="rope", rope_theta=1e4)
    cos, sin = RotaryEmbedding(cfg).to(DEVICE)(torch.arange(max_len, device=DEVICE), dtype)  # (L, D) each
    n_q, n_kv = Hq * D, Hkv * D
    x, w, b, gain, _ = make(B, n_q + 2 * n_kv, C, dtype, seed=Hq * D + 1, bias=bias)
    g = torch.Generator().manual_seed(D)
    qg, kg = ((torch.randn(D, generator=g) * 0.5 + 1.0).to(DEVICE, dtype) for _ in range(2))
    kc = torch.full((B + 1, Hkv, max_len, D), float("nan"), dtype=dtype, device=DEVICE)  # one spare row
    vc = torch.full_like(kc, float("nan"))
    pos = torch.tensor([0, 17, max_len - 1], device=DEVICE)
    # split: the reduction in two programs of 32 (the kernel's own block_n, one head, replaces the forced one)
    cfg_k = (16, 32, 4, 1, 2) if split else None
    with (forced_config(cfg_k) if split else contextlib.nullcontext()):
        q = ln_qkv_to_cache(x, w, b, (gain, None, 1e-6), kc, vc, pos, n_q, rms=True, rope=(cos, sin),
                            qk_norm=(qg, kg, 1e-6))                      # (B, n_q)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    exact = qkv_ref(cpu(x), cpu(w), cpu(b), cpu(gain), 1e-6, cos.cpu(), sin.cpu(), pos.cpu(), Hq, Hkv, D,
                    torch.float64, qk_norm=(qg.cpu(), kg.cpu(), 1e-6))
    naive = qkv_ref(x, w, b, gain, 1e-6, cos, sin, pos, Hq, Hkv, D, dtype, qk_norm=(qg, kg, 1e-6))
    plain = qkv_ref(cpu(x), cpu(w), cpu(b), cpu(gain), 1e-6, cos.cpu(), sin.cpu(), pos.cpu(), Hq, Hkv, D,
                    torch.float64)
    assert (plain[0] - exact[0]).abs().max() > 0.1  # the norms change q: the comparison below can fail
    assert_within_budget("normed, rotated q", q, exact[0], naive[0])
    rows = torch.arange(B, device=DEVICE)
    assert_within_budget("normed, rotated k in the cache", kc[rows, :, pos], exact[1], naive[1])
    assert_within_budget("v in the cache", vc[rows, :, pos], exact[2], naive[2])
    kc[rows, :, pos] = vc[rows, :, pos] = float("nan")
    assert kc.isnan().all() and vc.isnan().all(), "a write outside the rows' positions"


def test_qk_norm_input_checks():
    x, w, _, gain, _ = make(1, 4 * 16 * 3, 32, torch.float32, seed=1, bias=False)
    kc = torch.zeros(1, 4, 8, 16, device=DEVICE)
    tables = (torch.zeros(8, 16, device=DEVICE),) * 2
    g = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="qk_norm needs rope and a head dim that is a power of two >= 32"):
        ln_qkv_to_cache(x, w, None, None, kc, kc.clone(), torch.zeros(1, dtype=torch.long, device=DEVICE), 64,
                        rope=tables, qk_norm=(g, g, 1e-6))  # head dim 16: a tile of 8 pairs is too narrow
    x, w, _, gain, _ = make(1, 4 * 32 * 3, 32, torch.float32, seed=1, bias=False)
    kc = torch.zeros(1, 4, 8, 32, device=DEVICE)
    tables = (torch.zeros(8, 32, device=DEVICE),) * 2
    pos = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="qk_norm needs rope"):
        ln_qkv_to_cache(x, w, None, None, kc, kc.clone(), pos, 128, qk_norm=(g, g, 1e-6))
    with pytest.raises(ValueError, match=r"qk_norm must be \(q gain, k gain, eps\)"):
        ln_qkv_to_cache(x, w, None, None, kc, kc.clone(), pos, 128, rope=tables, qk_norm=(g, g, 1e-6))  # (16,)


# (n_embd, n_head, n_kv_head, head dim, intermediate) of the models the paired tiles were chosen for
PAIRED_TILE_MODELS = {"smollm2-135m": (576, 9, 3, 64, 1536), "qwen2-0.5b": (896, 14, 2, 64, 4864)}


@pytest.mark.parametrize("model", list(PAIRED_TILE_MODELS))
def test_paired_launches_pick_their_own_tiles_at_llama_shapes(model, monkeypatch):
    """Under PDL, up to PDL_FEW_ROWS rows, the paired launches (SwiGLU, RoPE-QKV) take PDL_PAIRED_TILES: 32 column
    pairs, one-tile shares of 256 along K, 8 warps (kernels/ln_linear.py gives the evidence); above it, and without
    PDL, the GPT-2 tile halved. The
    launches ask pick_config in pairs, so the table is what they run."""
    C, Hq, Hkv, D, inter = PAIRED_TILE_MODELS[model]
    pairs = {"rope-qkv": (Hq + 2 * Hkv) * D // 2, "swiglu": inter}
    for M in (1, 4, 8, 16):
        for mode, n in pairs.items():
            if M <= ll.PDL_FEW_ROWS:
                want = (32, 256, 8, 1, triton.cdiv(C, 256))
            else:  # above PDL_FEW_ROWS: the unpaired tile over 2n weight rows, its column block halved
                bn, bk, warps, stages, split = pick_config(M, 2 * n, C, DEVICE, pdl=True)
                want = (bn // 2, bk, warps, stages, split)
                assert want == (32, 1024, 8, 1, 1), mode
            assert pick_config(M, n, C, DEVICE, pdl=True, paired=True) == want, (mode, M)
            assert pick_config(M, n, C, DEVICE, paired=True) == (16, 256, 4, 3, 1), mode
        # an unpaired launch of the same width keeps the GPT-2 table
        assert pick_config(M, 2 * pairs["swiglu"], C, DEVICE, pdl=True) == (32 if M <= 4 else 64, 1024, 8, 1, 1)
    asked = []
    real = ll.pick_config
    monkeypatch.setattr(ll, "pick_config", lambda *a, **kw: asked.append(a) or real(*a, **kw))
    x, w, _, gain, _ = make(2, 2 * inter, C, torch.float32, seed=3, bias=False)
    # few programs for the interpreter; on a GPU a 512 x 1024 float32 tile would take minutes to compile
    big_tile = forced_config((512, 1024, 4, 1, 1)) if DEVICE.type == "cpu" else contextlib.nullcontext()
    with big_tile, torch.no_grad():
        ln_linear(x, w, ln=(gain, None, 1e-5), rms=True, swiglu=True)
        kc = torch.zeros(2, Hkv, 8, D, device=DEVICE)
        cos = torch.ones(8, D, device=DEVICE)
        ln_qkv_to_cache(x, w[:(Hq + 2 * Hkv) * D], None, (gain, None, 1e-5), kc, kc.clone(),
                        torch.tensor([1, 2], device=DEVICE), Hq * D, rms=True, rope=(cos, cos))
    launches = [a for a in asked if len(a) == 6]  # the launches' own calls, not pick_config asking itself
    assert [(a[1], a[2], a[5]) for a in launches] == [(pairs["swiglu"], C, True), (pairs["rope-qkv"], C, True)]


@torch.no_grad()
def test_paired_launches_with_their_pdl_tiles_match_reference():
    """The PDL tiles of the paired modes, run here without PDL: 32 pairs in shares of 256 along K = 600 (split 3,
    the last share short), column pairs that end inside a tile; SwiGLU, and RoPE-QKV with qkv biases into the
    cache. Split-K leaves its workspace zeroed: a second SwiGLU call gives the same result."""
    M, K, D, Hq, Hkv = 3, 600, 16, 6, 2
    cfg = pick_config(M, 40, K, DEVICE, pdl=True, paired=True)
    assert cfg == (32, 256, 8, 1, 3)
    x, w, b, gain, _ = make(M, 80, K, torch.float32, seed=7)          # 40 [gate | up] pairs
    rms = (gain, None, 1e-5)
    with forced_config(cfg):
        outs = [ln_linear(x, w, b, ln=rms, rms=True, swiglu=True,
                          out=torch.full((M, 40), float("nan"), device=DEVICE)) for _ in range(2)]
    exact = mlp_ref(x.cpu(), w.cpu(), b.cpu(), gain.cpu(), 1e-5, True, None, torch.float64)
    assert_within_budget("swiglu, PDL tiles", outs[0], exact, mlp_ref(x, w, b, gain, 1e-5, True, None, x.dtype))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)

    n_q, n_kv, max_len = Hq * D, Hkv * D, 12
    cos, sin = RotaryEmbedding(GPTConfig(n_embd=Hq * D, n_head=Hq, pos_emb="rope", **ROPE_LLAMA3)).to(DEVICE)(
        torch.arange(max_len, device=DEVICE), torch.float32)              # (L, D) each
    x, w, b, gain, _ = make(M, n_q + 2 * n_kv, K, torch.float32, seed=8)  # 80 pairs: the third tile half full
    kc = torch.full((M, Hkv, max_len, D), float("nan"), device=DEVICE)
    vc = torch.full_like(kc, float("nan"))
    pos = torch.tensor([0, 5, max_len - 1], device=DEVICE)
    with forced_config(cfg):
        q = ln_qkv_to_cache(x, w, b, (gain, None, 1e-5), kc, vc, pos, n_q, rms=True, rope=(cos, sin))
    exact = qkv_ref(x.cpu(), w.cpu(), b.cpu(), gain.cpu(), 1e-5, cos.cpu(), sin.cpu(), pos.cpu(), Hq, Hkv, D,
                    torch.float64)
    naive = qkv_ref(x, w, b, gain, 1e-5, cos, sin, pos, Hq, Hkv, D, torch.float32)
    rows = torch.arange(M, device=DEVICE)
    assert_within_budget("rope q, PDL tiles", q, exact[0], naive[0])
    assert_within_budget("rope k in the cache, PDL tiles", kc[rows, :, pos], exact[1], naive[1])
    assert_within_budget("v in the cache, PDL tiles", vc[rows, :, pos], exact[2], naive[2])
    kc[rows, :, pos] = vc[rows, :, pos] = float("nan")
    assert kc.isnan().all() and vc.isnan().all(), "a write outside the rows' positions"


@torch.no_grad()
def test_embedding_without_position_table():
    wte = torch.randn(50, 72).to(DEVICE)
    tok, pos = torch.tensor([3, 49, 3], device=DEVICE), torch.tensor([0, 1000, 7], device=DEVICE)
    stats = torch.full((3, 3, 2), float("nan"), device=DEVICE)
    x = embed_with_stats(tok, pos, wte, None, stats)  # positions beyond any table: RoPE models have none
    torch.testing.assert_close(x, wte[tok], rtol=0, atol=0)
    torch.testing.assert_close(stats[0], row_sums(x), rtol=1e-5, atol=1e-3)
    assert (stats[1:] == 0).all()


def test_bad_modes_raise_value_error():
    x = torch.randn(2, 8, device=DEVICE)
    w = torch.randn(6, 8, device=DEVICE)
    g = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="an RMSNorm has no bias"):
        ln_linear(x, w, ln=(g, g, 1e-5), rms=True)
    with pytest.raises(ValueError, match="rms=True without a norm"):
        ln_linear(x, w, rms=True)
    with pytest.raises(ValueError, match="pick one"):
        ln_linear(x, w, gelu=True, swiglu=True)
    with pytest.raises(ValueError, match="even-rowed"):
        ln_linear(x, torch.randn(5, 8, device=DEVICE), swiglu=True)
    with pytest.raises(ValueError, match=r"residual must be \(2, 3\)"):
        ln_linear(x, w, swiglu=True, residual=torch.zeros(2, 6, device=DEVICE))
    kc = torch.zeros(2, 1, 4, 2, device=DEVICE)
    p = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="rope must be"):
        ln_qkv_to_cache(x, w, None, None, kc, kc.clone(), p, 2, rope=(torch.zeros(4, 3, device=DEVICE),) * 2)


# ------------------------------------------------------------------------------------------- the model

SHAPES = {
    # GQA, llama3 frequency scaling whose band ends inside the positions decoded, untied LM head
    "llama": dict(n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96, tie_embeddings=False, **ROPE_LLAMA3),
    # qkv_bias, head_size != n_embd / n_head, MQA
    "qwen2": dict(n_head=4, n_kv_head=1, n_embd=48, head_size=16, qkv_bias=True, intermediate_size=80,
                  rope_theta=1e6),
    # SmolLM2's proportions: 3 query heads per kv head, rope_theta 1e5, tied embeddings
    "smollm2": dict(n_head=6, n_kv_head=2, n_embd=96, intermediate_size=128, rope_theta=1e5),
    # biases everywhere (bias = true) with Llama blocks
    "llama-bias": dict(n_head=4, n_kv_head=2, n_embd=64, bias=True),
    # YaRN: its band inside the positions decoded, cos and sin scaled by the attention factor (the fused step's
    # tables are the model's)
    "llama-yarn": dict(n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96, rope_scaling="yarn", rope_factor=4.0,
                       rope_original_max_pos=8, rope_attention_factor=1.2),
    # Qwen3: each q and k head RMS-normalised (own gains) before RoPE, head dim 32 != n_embd / n_head
    "qwen3": dict(n_head=4, n_kv_head=2, n_embd=48, head_size=32, qk_norm=True, intermediate_size=80, rope_theta=1e6),
    # SmolLM3: the second layer without RoPE (NoPE), its queries and keys as projected
    "smollm3": dict(n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96, nope_interval=2, rope_theta=2e6),
    # Gemma 3: norms scaled by 1 + weight, sandwich norms, GeGLU, embeddings times sqrt(C), offset q and k norms,
    # q scaled for query_scale_dim, a windowed first layer with its own RoPE base, a global second one
    "gemma3": dict(norm="rmsnorm1p", mlp="geglu", sandwich_norm=True, embed_scale=True, qk_norm=True, n_head=4,
                   n_kv_head=2, n_embd=48, head_size=32, intermediate_size=80, attention_window=5,
                   full_attention_interval=2, rope_theta=1e6, rope_local_theta=1e4, query_scale_dim=20,
                   norm_eps=1e-6),
}


def tiny_llama(name: str, dtype, block_size: int = 48) -> GPT:
    torch.manual_seed(5)
    kw = {**LLAMA, **SHAPES[name]}
    model = GPT(GPTConfig(block_size=block_size, vocab_size=61, n_layer=2, attention="naive", **kw)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():  # norm gains off 1, biases non-zero, weights with clear margins
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if n.endswith("norm.weight") or ".ln_" in n else 0.0))
    return model.to(DEVICE, dtype)


def decode_three_ways(model, lengths: list[int], max_len: int, steps: int, seed: int = 5) -> None:
    """Prefill prompts of `lengths`, then decode `steps` steps three ways fed the same tokens: fused (on a twin
    whose caches start as NaN), the model's own step in its dtype, and the same weights in float64 (the oracle);
    logits and caches checked with the 2x criterion at every step."""
    twin = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()  # the same (dtype-rounded) weights, float64 end to end
    B, T = len(lengths), max(lengths)
    lens = torch.tensor(lengths, device=DEVICE)
    idx = torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    for m in (model, twin, exact):
        m.setup_kv_cache(B, max_len)
        prefill(m, idx, lens)
    for block in twin.transformer.h:  # the fused path must never read past a sequence's length (poisoned after
        for b, n in enumerate(lengths):  # the prefill: the eager prefill's masked attention multiplies the
            block.attn.kv_cache.k[b, :, n:] = float("nan")  # masked-off positions by 0, and NaN · 0 is NaN)
            block.attn.kv_cache.v[b, :, n:] = float("nan")
    assert unsupported_reason(twin) is None
    pos = lens[:, None].clone()                                              # (B, 1) each at its own position
    tok = torch.randint(0, 61, (B, 1), generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    for step in range(steps):
        want = decode_one_token(model, tok, pos)                             # (B, V) the model's own step
        got = fused_decode_step(twin, tok, pos)
        check_step(got, want, oracle_step(exact, tok, pos), twin, model, exact, pos, f"step {step}")
        tok = want.argmax(-1, keepdim=True)
        pos = pos + 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SHAPES))
@torch.no_grad()
def test_fused_step_equals_the_models_step(name, dtype):
    """Three sequences from positions 1, 6 and 14 decode 4 steps (the llama shape's rope_original_max_pos is 16)."""
    decode_three_ways(tiny_llama(name, dtype), [1, 6, 14], max_len=24, steps=4)


@torch.no_grad()
def test_fused_step_past_the_first_rope_table():
    """Positions across 256, the shortest cached cos/sin table (a cache of 300 positions reads one of 512 rows):
    one sequence decodes across it while another starts near 0."""
    model = tiny_llama("smollm2", torch.float32, block_size=320)
    decode_three_ways(model, [3, 254], max_len=300, steps=4)


class LaunchLog:
    """Stands in for a kernel (ln_linear's, ln_mlp's): records each launch's switches (of `keys`), then launches."""

    def __init__(self, kernel, keys=("RMS", "SWIGLU", "ROPE", "PAIRED", "GELU", "QKV_CACHE"), into=None):
        self.kernel, self.keys = kernel, keys
        self.launches = [] if into is None else into

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append({k: kw[k] for k in self.keys})
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.parametrize("fused_mlp", [False, True], ids=["mlp_two_launches", "mlp_one_launch"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@torch.no_grad()
def test_fused_launches_per_layer_in_both_families(family, fused_mlp, monkeypatch):
    """GPT-2 blocks launch the fused kernels as before (no new switch on); Llama blocks the same number of times,
    with RMSNorm and RoPE in the QKV launch and RMSNorm and SwiGLU in the MLP's first (or only) launch."""
    import kernels.decode_mlp as dm
    launches: list = []
    monkeypatch.setattr(ll, "_ln_linear_kernel", LaunchLog(ll._ln_linear_kernel, into=launches))
    monkeypatch.setattr(dm, "_ln_mlp_kernel", LaunchLog(dm._ln_mlp_kernel, ("RMS", "SWIGLU"), into=launches))
    kw = dict(n_head=4, n_embd=64) if family == "gpt2" else {**LLAMA, **SHAPES["llama"]}
    model = GPT(GPTConfig(block_size=16, vocab_size=61, n_layer=2, attention="naive", **kw)).to(DEVICE).eval()
    model.setup_kv_cache(2, 16)
    with options.use(decode_fused_mlp=fused_mlp), dm.forced_tile(16):  # one MLP launch at any sm_count
        fused_decode_step(model, torch.tensor([[1], [2]], device=DEVICE), torch.tensor([[0], [3]], device=DEVICE))
    llama = family == "llama"
    qkv = dict(RMS=llama, SWIGLU=False, ROPE=llama, PAIRED=llama, GELU=False, QKV_CACHE=True)
    proj = dict(RMS=False, SWIGLU=False, ROPE=False, PAIRED=False, GELU=False, QKV_CACHE=False)
    fc = dict(RMS=llama, SWIGLU=llama, ROPE=False, PAIRED=llama, GELU=not llama, QKV_CACHE=False)
    mlp = dict(RMS=llama, SWIGLU=llama)
    assert launches == ([qkv, proj, mlp] if fused_mlp else [qkv, proj, fc, proj]) * 2


@pytest.mark.parametrize("mlp", ["two_launches", "one_launch"])
@pytest.mark.parametrize("name", list(SHAPES))
@torch.no_grad()
def test_fused_step_with_the_mlp_in_one_or_two_launches(name, mlp):
    """The MLP block as two ln_linear launches (option decode_fused_mlp off) or as one ln_mlp launch (forced,
    whatever the device's SM count makes of the default rule): still the model's step."""
    import kernels.decode_mlp as dm
    one = mlp == "one_launch"
    with options.use(decode_fused_mlp=one), (dm.forced_tile(16) if one else contextlib.nullcontext()):
        decode_three_ways(tiny_llama(name, torch.float32), [1, 6, 14], max_len=24, steps=2)


def test_rope_tables_are_the_models_and_kept():
    model = tiny_llama("llama", torch.float32)
    cos, sin = rope_tables(model, 40, torch.float32)
    assert cos.shape[0] >= 40 and cos.shape[1] == model.config.head_dim
    want_cos, want_sin = model.rotary(torch.tensor([0, 17, 39], device=DEVICE), torch.float32)
    torch.testing.assert_close(cos[[0, 17, 39]], want_cos, rtol=0, atol=0)
    torch.testing.assert_close(sin[[0, 17, 39]], want_sin, rtol=0, atol=0)
    assert rope_tables(model, 100, torch.float32)[0] is cos         # the same table, not recomputed
    longer = rope_tables(model, 1000, torch.float32)[0]
    assert longer.shape[0] >= 1000 and rope_tables(model, 40, torch.float32)[0] is cos  # the old one kept
    assert rope_tables(model, 40, torch.float16)[0].dtype == torch.float16
    other = tiny_llama("llama", torch.float32)                      # another model: its own tables
    assert rope_tables(other, 40, torch.float32)[0] is not cos


def test_unsupported_reason_for_llama_blocks():
    from model.fused_decode import stack_plan
    assert unsupported_reason(tiny_llama("llama", torch.float32), check_cache=False) is None
    qwen3 = tiny_llama("qwen3", torch.float32)
    assert unsupported_reason(qwen3, check_cache=False) is None and stack_plan(qwen3) is None  # per-layer launches
    smollm3 = tiny_llama("smollm3", torch.float32)
    assert unsupported_reason(smollm3, check_cache=False) is None and stack_plan(smollm3) is None
    narrow = GPT(GPTConfig(vocab_size=61, block_size=32, n_layer=1, n_head=4, n_kv_head=2, n_embd=64, qk_norm=True,
                           **LLAMA))  # head dim 16: a tile of 8 pairs
    assert "qk_norm with head dim 16" in unsupported_reason(narrow, check_cache=False)
    with pytest.raises(ValueError, match="qk_norm with head dim 16"):
        use_fused_decode(narrow, True, False, check_cache=False)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "smollm3"])
@torch.no_grad()
def test_greedy_generation_with_the_fused_step_equals_without(name):
    """The same tokens with the fused decode step as with the model's own (float32, prompts of different
    lengths, so each sequence decodes at its own positions). On a GPU: generate()'s own choice with the flash
    backend is the fused step, in a CUDA graph and without."""
    assert_fused_generation_equals_the_models(tiny_llama(name, torch.float32))


def assert_fused_generation_equals_the_models(model) -> None:
    """Greedy tokens of prompts of 1, 5 and 17 tokens (vocabulary 61) with the fused step equal those with the
    model's own step; on a GPU, generate()'s own choice with the flash backend is the fused step, in a CUDA graph
    and without."""
    prompts = [torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (1, 5, 17)]
    plain = generate(model, prompts, GREEDY, fused=False)
    assert plain.decode_path == "model" and all(len(s) == GREEDY.max_new_tokens for s in plain.sequences)
    if DEVICE.type == "cpu":
        fused = generate(model, prompts, GREEDY, fused=True)
        assert fused.decode_path == "fused" and fused.sequences == plain.sequences
        return
    model.set_attention_backend("flash")
    for graph in (False, True):
        auto = generate(model, prompts, GREEDY, cuda_graph=graph)
        assert auto.decode_path == "fused" and auto.sequences == plain.sequences, f"cuda_graph={graph}"


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs and programmatic dependent launch need a GPU")
@pytest.mark.parametrize("pdl", ["1", "0"], ids=["pdl", "no-pdl"])
@torch.no_grad()
def test_fused_llama_step_replayed_in_a_cuda_graph(pdl, monkeypatch):
    """SmolLM2-135M's widths in bf16 (576 wide, 9 heads over 3 kv heads, SwiGLU 1536: the down projection splits
    K under PDL) captured in a CUDA graph with and without programmatic dependent launch: every replay's logits
    and cache writes match the model's own step."""
    monkeypatch.setattr(options, "_current", options.get())
    options.update(pdl=pdl == "1")  # restored by monkeypatch at the end of the test
    torch.manual_seed(7)
    model = GPT(GPTConfig(block_size=320, vocab_size=512, n_layer=3, n_head=9, n_kv_head=3, n_embd=576,
                          intermediate_size=1536, rope_theta=1e5, attention="naive", **LLAMA))
    model = model.to(DEVICE, torch.bfloat16).eval()
    twin = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()
    B, max_len = 3, 320
    lengths = torch.tensor([1, 77, 300], device=DEVICE)
    idx = torch.randint(0, 512, (B, 300), device=DEVICE)
    for m in (model, twin, exact):
        m.setup_kv_cache(B, max_len)
    graph = DecodeGraph(twin, B, DEVICE, fused_decode_step)  # before prefill (its warm-up steps write position 0)
    for m in (model, twin, exact):
        prefill(m, idx, lengths)
    pos = lengths[:, None].clone()
    tok = torch.randint(0, 512, (B, 1), device=DEVICE)
    for step in range(6):
        want = decode_one_token(model, tok, pos)
        got = graph(twin, tok, pos).clone()
        check_step(got, want, oracle_step(exact, tok, pos), twin, model, exact, pos, f"replay {step}")
        tok = want.argmax(-1, keepdim=True)
        pos = pos + 1
