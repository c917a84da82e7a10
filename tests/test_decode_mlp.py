"""kernels/decode_mlp.py (the decode step's MLP block in one launch) against float64 references.

Criterion (tests/error_budget.py, as for the other kernels): the kernel's max error against the float64 eager
op sequence is at most 2x the error of the same sequence in the kernel's dtype, plus a floor. CUDA when present
(bf16 included), otherwise CPU through the Triton interpreter. The result buffer is poisoned with NaN (the
kernels' allocator replaced), so a row or column the last program misses shows up; the workspace must be left
zeroed, so a second call meets the criterion too.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (triton decorates then)

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels._triton as kt  # noqa: E402
import kernels.decode_mlp as dm  # noqa: E402
from kernels.decode_mlp import forced_tile, fusable, ln_mlp, pick_block_i  # noqa: E402
from kernels.ln_linear import ln_linear  # noqa: E402
from tests.error_budget import assert_within_budget  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(kt, "empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                              device=device))


def eager(x, w_fc, b_fc, w_dn, b_dn, ln, rms, swiglu, dtype):
    """The model's MLP block with its residual, as eager ops in `dtype` (float64: the oracle)."""
    c = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    x = x.to(dtype)
    g, lb, eps = ln
    if rms:  # model/norms.py: x / rms rounded to the dtype, then the gain
        n = F.rms_norm(x.to(torch.promote_types(dtype, torch.float32)), (x.shape[1],), eps=eps).to(dtype) * c(g)
    else:
        n = F.layer_norm(x, (x.shape[1],), c(g), c(lb), eps)
    y = F.linear(n, c(w_fc), c(b_fc))
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = F.gelu(y, approximate="tanh")
    return x + F.linear(h, c(w_dn), c(b_dn))


def make(M, C, I, dtype, seed, swiglu, rms, bias):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(DEVICE, dtype)

    x = r(M, C, scale=2.0, shift=0.5)                         # an offset so that LayerNorm's centring matters
    w_fc = r((2 if swiglu else 1) * I, C, scale=C ** -0.5)
    w_dn = r(C, I, scale=I ** -0.5)
    b_fc, b_dn = (r(w_fc.shape[0], scale=0.3), r(C, scale=0.3)) if bias else (None, None)
    ln = (r(C, scale=0.3, shift=1.0), None if rms else r(C, scale=0.3), 1e-5)
    return x, w_fc, b_fc, w_dn, b_dn, ln


VARIANTS = {  # (swiglu, rms, bias)
    "llama": (True, True, False),       # RMSNorm, SwiGLU, no biases
    "gpt2": (False, False, True),       # LayerNorm, GELU, biases
    "swiglu-bias": (True, False, True),  # the other two combinations
    "gelu-rms": (False, True, False),
}
# (M, C, I, block_i): one row block and two (17 rows); C a power of two (two halves), one just above (the second
# block mostly masked) and SmolLM2-135M's 576 (512 + 64); I over several programs with a masked tail
SHAPES = [(1, 40, 48, 16), (5, 64, 33, 16), (17, 24, 100, 32), (3, 576, 64, 16), (2, 130, 40, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@torch.no_grad()
def test_ln_mlp_matches_reference(shape, variant, dtype, request):
    M, C, I, block_i = shape
    swiglu, rms, bias = VARIANTS[variant]
    seed = abs(hash(request.node.name)) % 2**31
    x, w_fc, b_fc, w_dn, b_dn, ln = make(M, C, I, dtype, seed, swiglu, rms, bias)
    stats = torch.full((M, 2), float("nan"), device=DEVICE)   # written whole by the last program
    outs = [ln_mlp(x, w_fc, b_fc, w_dn, b_dn, ln=ln, rms=rms, swiglu=swiglu, stats_out=stats, block_i=block_i)
            for _ in range(2)]
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    exact = eager(*(cpu(t) for t in (x, w_fc, b_fc, w_dn, b_dn)), tuple(cpu(t) if isinstance(t, torch.Tensor)
                                                                       else t for t in ln), rms, swiglu,
                  torch.float64)
    plain = eager(x, w_fc, b_fc, w_dn, b_dn, ln, rms, swiglu, dtype)
    for out in outs:  # the second call too: the workspace and counters were left zeroed (on a GPU the atomics
        assert_within_budget("ln_mlp", out, exact, plain)  # add in any order, so the two may differ in rounding)
    y = outs[-1].double()  # stats_out holds the sums of the last call's output (the two may differ in rounding)
    torch.testing.assert_close(stats.double(), torch.stack([y.sum(1), (y * y).sum(1)], 1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("variant", ["llama", "gpt2"])
@torch.no_grad()
def test_ln_mlp_equals_the_two_launches_it_replaces(variant):
    """Norm statistics handed in (ln_stats) as the decode step does; against ln_linear twice (the same rounding
    points), in float32."""
    swiglu, rms, bias = VARIANTS[variant]
    x, w_fc, b_fc, w_dn, b_dn, ln = make(4, 72, 80, torch.float32, 3, swiglu, rms, bias)
    xd = x.double()
    stats_in = torch.stack([xd.sum(1), (xd * xd).sum(1)], 1).float()
    got = ln_mlp(x, w_fc, b_fc, w_dn, b_dn, ln=ln, rms=rms, swiglu=swiglu, ln_stats=stats_in)
    h = ln_linear(x, w_fc, b_fc, ln=ln, rms=rms, gelu=not swiglu, swiglu=swiglu, ln_stats=stats_in)
    want = ln_linear(h, w_dn, b_dn, residual=x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_block_i_keeps_one_wave_and_fusable_bounds(monkeypatch):
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(kt, "sm_count", lambda device: 132)  # an H200
    assert pick_block_i(1536, dev) == 16     # SmolLM2-135M: 96 programs
    assert pick_block_i(3072, dev) == 32     # GPT-2 124M: 96 rather than 192
    assert pick_block_i(8192, dev) == 64
    assert fusable(1, 576, 1536, dev) and fusable(dm.MAX_ROWS, 768, 2048, dev)
    assert not fusable(dm.MAX_ROWS + 1, 576, 1536, dev)   # the atomics of many rows
    assert not fusable(1, 768, 3072, dev)                 # programs of 32 columns
    assert not fusable(1, dm.MAX_C + 1, 1536, dev)        # weights beyond a program's registers
    with forced_tile(16, 4):
        assert fusable(16, 768, 3072, dev) and not fusable(1, dm.MAX_C + 1, 1536, dev)


@torch.no_grad()
def test_forced_tile_is_the_default_inside_its_block(monkeypatch):
    seen = []
    kernel = dm._ln_mlp_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((grid, kw["BLOCK_I"], kw["num_warps"]))
                return kernel[grid](*args, **kw)
            return launch
    monkeypatch.setattr(dm, "_ln_mlp_kernel", Spy())
    x, w_fc, b_fc, w_dn, b_dn, ln = make(2, 32, 40, torch.float32, 1, True, True, False)
    with forced_tile(32, 2):
        ln_mlp(x, w_fc, b_fc, w_dn, b_dn, ln=ln, rms=True, swiglu=True)
    ln_mlp(x, w_fc, b_fc, w_dn, b_dn, ln=ln, rms=True, swiglu=True)
    assert seen == [((2, 1), 32, 2), ((3, 1), 16, dm.WARPS)]


@torch.no_grad()
def test_bad_input_raises_value_error():
    x, w_fc, b_fc, w_dn, b_dn, ln = make(2, 32, 16, torch.float32, 1, True, True, False)
    with pytest.raises(ValueError, match="w_down must be"):
        ln_mlp(x, w_fc, None, w_dn[:, :8], None, ln=ln, rms=True, swiglu=True)
    with pytest.raises(ValueError, match="b_down must have"):
        ln_mlp(x, w_fc, None, w_dn, torch.zeros(5, device=DEVICE), ln=ln, rms=True, swiglu=True)
    with pytest.raises(ValueError, match="norm is required"):
        ln_mlp(x, w_fc, None, w_dn, None, ln=None, swiglu=True)
    with pytest.raises(ValueError, match="block_i"):
        ln_mlp(x, w_fc, None, w_dn, None, ln=ln, rms=True, swiglu=True, block_i=24)
    with pytest.raises(ValueError, match="w_down must be a"):
        ln_mlp(x, w_fc, None, w_dn.double(), None, ln=ln, rms=True, swiglu=True)
    with pytest.raises(ValueError, match="even-rowed"):
        ln_mlp(x, w_fc[:-1], None, w_dn, None, ln=ln, rms=True, swiglu=True)
    wide = torch.zeros(1, dm.MAX_C + 1, device=DEVICE)
    with pytest.raises(ValueError, match="above"):
        ln_mlp(wide, torch.zeros(32, dm.MAX_C + 1, device=DEVICE), None, torch.zeros(dm.MAX_C + 1, 16, device=DEVICE),
               None, ln=(torch.ones(dm.MAX_C + 1, device=DEVICE), None, 1e-5), rms=True, swiglu=True)
