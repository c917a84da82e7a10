"""The Triton cross-entropy (kernels/ce_loss.py) against a float64 reference: loss and d(logits).

Criterion (as for the attention kernels): the kernel's max error against F.cross_entropy in float64 is at most
2x the error of the path it replaces (F.cross_entropy on logits.float(), the gradient rounded to the logits'
dtype) plus a small floor. Fresh random inputs per test (seeded from the test id), output buffers poisoned
with NaN, odd shapes. On the CPU through Triton's interpreter; on a GPU the same tests plus the GPT-2 size and
torch.compile.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import kernels
import kernels._triton as kt
import kernels.ce_loss as ce
from kernels import options
from tests.util import seeded_generator

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(kt, "empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                             device=device))


def _inputs(N, V, dtype, g, scale=3.0, ignore_every=0, row_pad=0):
    """logits (N, V) (a column slice of a wider buffer when row_pad > 0: row stride V + row_pad), targets (N,)."""
    wide = torch.randn(N, V + row_pad, generator=g) * scale
    logits = wide.to(DEVICE, dtype)[:, :V]
    targets = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        targets[::ignore_every] = -1
    return logits, targets.to(DEVICE)


def _loss_and_grad(fn, logits, targets, dloss=1.0, dtype=None):
    """Loss and d(logits) of fn on a leaf copy of logits (in `dtype`: the float64 reference's gradient must
    not be rounded back to the logits' dtype)."""
    x = logits.detach().to(dtype or logits.dtype).requires_grad_()
    loss = fn(x, targets)
    (loss * dloss).backward()
    return loss.detach(), x.grad.detach()


def _torch_rows(logits, targets, n_valid, dloss, reference):
    """Torch's loss summed over these rows / n_valid (the mean's share of them) and its d(logits): the reference
    in float64 throughout, or torch's usual path (float32 math, the gradient in the logits' dtype)."""
    x = logits.detach().to(torch.float64 if reference else logits.dtype).requires_grad_()
    loss = F.cross_entropy(x if reference else x.float(), targets, ignore_index=-1, reduction="sum") / n_valid
    (loss * dloss).backward()
    return loss.detach(), x.grad.detach()


def _check(logits, targets, dloss=1.0, rows=2048):
    """The kernel's loss and d(logits) against torch's in float64 (the reference) and torch's float32 path (the
    error budget: twice its error). The references are formed `rows` rows at a time, so the largest case (16k rows
    of a 50k vocabulary) needs a few GiB of GPU memory instead of tens; each row's gradient is unchanged by it."""
    dtype = logits.dtype
    loss, grad = _loss_and_grad(lambda x, t: kernels.cross_entropy(x, t, kernel="triton"), logits, targets, dloss)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert not torch.isnan(grad).any(), "d(logits): NaN (an element was never written)"
    n_valid = (targets != -1).sum()
    ref_loss = old_loss = 0.0
    err_max = old_err_max = ref_max = 0.0
    for start in range(0, logits.shape[0], rows):
        part = slice(start, start + rows)
        ref_l, ref_grad = _torch_rows(logits[part], targets[part], n_valid, dloss, True)
        old_l, old_grad = _torch_rows(logits[part], targets[part], n_valid, dloss, False)
        ref_loss, old_loss = ref_loss + ref_l, old_loss + old_l.double()
        err = (grad[part].double() - ref_grad).abs()
        err_max = max(err_max, err.max().item())
        old_err_max = max(old_err_max, (old_grad.double() - ref_grad).abs().max().item())
        ref_max = max(ref_max, ref_grad.abs().max().item())
        if dtype == torch.bfloat16 and not CUDA:
            # Triton's interpreter converts fp32 to bf16 by truncation (up to 1 ulp; a GPU rounds to nearest, half
            # an ulp): bound each element by one bf16 ulp of the reference instead (and the row-wide floor below)
            bad = err > 2.0 ** -7 * ref_grad.abs() + 1e-6 * ref_grad.abs().max().item()
            assert not bad.any(), f"d(logits): {int(bad.sum())} elements off by more than 1 bf16 ulp"
    loss_err = (loss.double() - ref_loss).abs().item()
    assert loss_err <= 2 * (old_loss - ref_loss).abs().item() + 1e-6 * max(1.0, ref_loss.abs().item()), \
        f"loss {loss.item()} vs reference {ref_loss.item()}"
    if dtype == torch.bfloat16 and not CUDA:
        return  # bounded element by element above
    budget = 2 * old_err_max + 1e-6 * ref_max
    assert err_max <= budget, f"d(logits) error {err_max:.3g} > {budget:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,V", [(1, 1), (3, 7), (5, 256), (9, 257), (4, 1000)])
def test_matches_float64(request, dtype, N, V):
    logits, targets = _inputs(N, V, dtype, seeded_generator(request))
    _check(logits, targets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ignored_rows_strided_logits_and_a_scaled_gradient(request, dtype):
    """Rows with target -1 add nothing (their gradient is exactly 0); the logits may be a column slice of a
    wider buffer; the incoming gradient (here 0.25, as with gradient accumulation) scales d(logits)."""
    logits, targets = _inputs(11, 300, dtype, seeded_generator(request), ignore_every=3, row_pad=5)
    assert logits.stride(0) == 305
    _check(logits, targets, dloss=0.25)
    x = logits.detach().requires_grad_()
    kernels.cross_entropy(x, targets, kernel="triton").backward()
    assert torch.equal(x.grad[targets == -1], torch.zeros_like(x.grad[targets == -1]))


def test_large_logits_stay_finite(request):
    """The online log-sum-exp rescales: logits of +-1e4 (exp overflows fp32) give the reference's loss."""
    logits, targets = _inputs(4, 600, torch.float32, seeded_generator(request), scale=1e4)
    _check(logits, targets)


def test_per_row_losses_and_edge_targets(request):
    logits, targets = _inputs(6, 50, torch.float32, seeded_generator(request))
    targets[1] = -1
    targets[2] = 49  # the last column
    targets[3] = 0
    rows = ce.cross_entropy_rows(logits, targets)
    ref = F.cross_entropy(logits.double(), targets, ignore_index=-1, reduction="none")
    assert rows[1].item() == 0.0
    torch.testing.assert_close(rows.double(), ref, rtol=1e-6, atol=1e-6)


def test_all_rows_ignored_is_nan_like_torch(request):
    logits, targets = _inputs(3, 20, torch.float32, seeded_generator(request))
    targets[:] = -1
    assert torch.isnan(kernels.cross_entropy(logits, targets, kernel="triton"))
    assert torch.isnan(F.cross_entropy(logits, targets, ignore_index=-1))


def test_out_of_range_target_gives_nan_not_a_crash(request):
    logits, targets = _inputs(4, 20, torch.float32, seeded_generator(request))
    targets[2] = 20
    rows = ce.cross_entropy_rows(logits, targets)
    assert torch.isnan(rows[2]) and torch.isfinite(rows[[0, 1, 3]]).all()


@pytest.mark.parametrize("logits,targets,match", [
    (torch.zeros(4, 5, 6), torch.zeros(4, dtype=torch.long), "expected logits"),
    (torch.zeros(4, 5), torch.zeros(3, dtype=torch.long), "expected logits"),
    (torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), "empty logits"),
    (torch.zeros(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.long), "float64"),
    (torch.zeros(4, 5), torch.zeros(4), "integers"),
])
def test_bad_input_is_one_clear_error(logits, targets, match):
    with pytest.raises(ValueError, match=match):
        kernels.cross_entropy(logits.to(DEVICE), targets.to(DEVICE), kernel="triton")


def test_unsupported_device_is_one_clear_error(monkeypatch):
    logits, targets = torch.zeros(4, 5, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="cross_entropy's Triton kernel runs .*got meta"):
        kernels.cross_entropy(logits, targets, kernel="triton")
    monkeypatch.setattr(kt, "INTERPRET", False)  # compiled kernels: CPU tensors are refused, naming the way out
    with pytest.raises(ValueError, match=r"runs on CUDA, got cpu \(on a CPU .* TRITON_INTERPRET=1\)"):
        kernels.cross_entropy(torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), kernel="triton")


def test_dispatch(request, monkeypatch):
    """auto: the Triton kernel on CUDA, F.cross_entropy elsewhere; an unknown name is an error."""
    logits, targets = _inputs(4, 30, torch.float32, seeded_generator(request))
    calls = []
    real = kernels.triton_cross_entropy
    monkeypatch.setattr(kernels, "triton_cross_entropy", lambda *a: calls.append(1) or real(*a))
    kernels.cross_entropy(logits, targets)
    assert len(calls) == (1 if CUDA else 0)
    kernels.cross_entropy(logits, targets, kernel="torch")
    assert len(calls) == (1 if CUDA else 0)
    with pytest.raises(ValueError, match="unknown loss kernel"):
        kernels.cross_entropy(logits, targets, kernel="fused")
    assert kernels.resolve_loss_kernel(None, "cpu") == "torch"
    assert kernels.resolve_loss_kernel("auto", "cuda") == "triton"
    assert kernels.resolve_loss_kernel("torch", "cuda") == "torch"
    with options.use(loss_kernel="torch"):  # FLASHGPT_CE=torch: what "auto" means
        assert kernels.resolve_loss_kernel(None, "cuda") == "torch"
        assert kernels.resolve_loss_kernel("auto", "cuda") == "torch"
        assert kernels.resolve_loss_kernel("triton", "cuda") == "triton"  # an explicit choice wins
    assert options.from_env({"FLASHGPT_CE": "torch"}).loss_kernel == "torch"
    with pytest.raises(ValueError, match="FLASHGPT_CE='fused': expected one of auto, triton, torch"):
        options.from_env({"FLASHGPT_CE": "fused"})


def test_model_loss_is_the_same_with_either_kernel(monkeypatch):
    """The model's loss (and its gradients) through the Triton kernel equal F.cross_entropy's; the model runs the
    kernel its config's loss_kernel names."""
    from model.config import GPTConfig
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=97, dropout=0.0,
                          attention="naive")).to(DEVICE)
    idx = torch.randint(0, 97, (3, 8), device=DEVICE)
    targets = torch.randint(0, 97, (3, 8), device=DEVICE)
    targets[0, :2] = -1
    results = []
    calls = []
    real = kernels.triton_cross_entropy
    monkeypatch.setattr(kernels, "triton_cross_entropy", lambda *a: calls.append(1) or real(*a))
    for kernel in ("torch", "triton"):
        model.config.loss_kernel = kernel
        model.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        results.append((loss.detach(), model.lm_head.weight.grad.clone()))
    assert len(calls) == 1  # the Triton kernel ran for "triton" only
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-6)


@cuda_only
def test_gpt2_size_bf16(request):
    """The training shape (16 x 1024 rows of GPT-2's padded vocabulary), bf16."""
    logits, targets = _inputs(16 * 1024, 50304, torch.bfloat16, seeded_generator(request), scale=2.0)
    _check(logits, targets)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []), ids=str)
def test_compiles_without_graph_break(request, dtype):
    """torch.compile(fullgraph=True) traces through the custom ops (inductor on a GPU; aot_eager on the CPU, where
    the interpreter has no inductor codegen), and the compiled loss and d(logits) have the eager kernel's values:
    equal to the eager call's up to rounding, and within the float64 criterion of _check."""
    torch._dynamo.reset()
    logits, targets = _inputs(64, 1000, dtype, seeded_generator(request), ignore_every=7)
    fn = torch.compile(lambda a, t: kernels.cross_entropy(a, t, kernel="triton"), fullgraph=True,
                       backend="inductor" if CUDA else "aot_eager")
    loss, grad = _loss_and_grad(fn, logits, targets, dloss=0.5)
    eager_loss, eager_grad = _loss_and_grad(lambda a, t: kernels.cross_entropy(a, t, kernel="triton"),
                                            logits, targets, dloss=0.5)
    assert loss.dtype == torch.float32 and grad.dtype == dtype and not torch.isnan(grad).any()
    # the same kernels; inductor may sum the rows' losses (and so form each row's incoming gradient) in another
    # order: the last bits of the loss, and one rounding step of a bf16 gradient, may differ
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad.float(), eager_grad.float(), rtol=2.0 ** -7 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-12)

    ref_loss, ref_grad = _loss_and_grad(lambda a, t: F.cross_entropy(a, t, ignore_index=-1), logits, targets,
                                        dloss=0.5, dtype=torch.float64)
    old_loss, old_grad = _loss_and_grad(lambda a, t: F.cross_entropy(a.float(), t, ignore_index=-1), logits,
                                        targets, dloss=0.5)
    assert abs(loss.double() - ref_loss).item() <= (2 * abs(old_loss.double() - ref_loss).item()
                                                     + 1e-6 * max(1.0, ref_loss.abs().item())), \
        f"compiled loss {loss.item()} vs float64 {ref_loss.item()}"
    err = (grad.double() - ref_grad).abs().max().item()
    budget = 2 * (old_grad.double() - ref_grad).abs().max().item() + 1e-6 * ref_grad.abs().max().item()
    assert err <= budget, f"compiled d(logits) error {err:.3g} > {budget:.3g}"


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.ce_loss as ce
common = {"LOGITS": "*bf16", "TARGETS": "*i64", "stride_row": "i32", "V": "i32", "ignore_index": "i32",
          "BLOCK_V": "constexpr"}
fwd = {**common, "LOSS": "*fp32", "LSE": "*fp32"}
bwd = {**common, "LSE": "*fp32", "DLOSS": "*fp32", "DLOGITS": "*bf16", "stride_drow": "i32"}
for fn, sig in ((ce._ce_fwd, fwd), (ce._ce_bwd, bwd)):
    sig = {name: sig[name] for name in fn.arg_names}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={"BLOCK_V": ce.GPU_CONFIG[0]}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=ce.GPU_CONFIG[1]))
    print(fn.__name__, "ld.global" in c.asm["ptx"])
"""


def test_kernels_compile_for_hopper():
    """Triton's GPU compiler is stricter than its interpreter (a kernel may read only constexpr globals, for
    one): compile both kernels for sm_90 ahead of time, as on a GPU, on any machine (own process: the tests
    run the interpreter)."""
    import subprocess
    import sys

    from tests.util import ROOT

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["_ce_fwd", "True", "_ce_bwd", "True"]


def test_float64_logits_take_the_torch_loss_whatever_the_option(request):
    """A float64 reference model's loss (on a GPU, where "auto" means the Triton kernel) is computed in float64 by
    PyTorch; asking for the Triton kernel by name still refuses float64."""
    g = seeded_generator(request)
    logits = torch.randn(7, 33, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 33, (7,), generator=g)
    targets[2] = -1
    with options.use(loss_kernel="triton"):
        got = kernels.cross_entropy(logits, targets)
    assert got.dtype == torch.float64
    assert torch.equal(got, F.cross_entropy(logits, targets, ignore_index=-1))
    with pytest.raises(ValueError, match="float64"):
        kernels.cross_entropy(logits, targets, kernel="triton")
