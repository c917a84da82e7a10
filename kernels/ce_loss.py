"""Cross-entropy over a vocabulary in Triton: a language model's loss without fp32 copies of the logits.

    cross_entropy(logits, targets, ignore_index=-1) -> mean loss (fp32 scalar) over the rows whose target is
                                                       not ignore_index; differentiable in logits

Same value and gradient as ``F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)`` (mean
reduction; all rows ignored gives NaN, as there). Each row is read in its own dtype and summed in fp32 by one
program: the forward streams the row once through an online log-sum-exp (running max and sum, rescaled when
the max grows) and stores the row's loss and log-sum-exp; the backward reads the row again and writes
softmax - onehot, times the row's incoming gradient, in the logits' dtype. Memory traffic is one read of the
logits forward and one read plus one write backward — what a bf16 training step of GPT-2 (16k rows of 50k
logits, 1.6 GB) spends most of its loss time on.

Supports: logits (N, V) float16, bfloat16 or float32 with unit stride along V (any row stride), any N >= 1 and
V >= 1; targets (N,) of any integer dtype. A target outside [0, V) that is not ignore_index gives a NaN loss
for that row (no device-side assert; a training loop's non-finite check sees it). CUDA tensors, or CPU tensors
through Triton's interpreter (TRITON_INTERPRET=1, see kernels/_triton.py). Under torch.compile the launches
are the custom ops ``flashgpt::cross_entropy_fwd`` / ``cross_entropy_bwd``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _triton

LOG2E = tl.constexpr(_triton.LOG2E)  # the kernels read it: Triton kernels may read only constexpr globals

# (BLOCK_V, num_warps): the fastest of the candidates bench/cross_entropy.py times (bench/NOTES.md). The
# interpreter pays per program and per loop step: small blocks keep the CPU tests quick.
GPU_CONFIG = (2048, 4)
INTERPRET_CONFIG = (256, 4)


@triton.jit
def _ce_fwd(LOGITS, TARGETS, LOSS, LSE, stride_row, V, ignore_index, BLOCK_V: tl.constexpr):
    """One row: LSE = log(sum(exp(x))) and LOSS = LSE - x[target] in fp32 (0 for ignore_index, NaN for a target
    outside [0, V)). Any float dtype of LOGITS, unit stride along V. grid (N,)."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    offs = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), 0)  # running max (a scalar)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)  # running sum of exp(x - m)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)  # (BLOCK_V,)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.math.exp2((m - m_new) * LOG2E) + tl.sum(tl.math.exp2((x - m_new) * LOG2E), 0)
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(TARGETS + row).to(tl.int64)
    in_range = (t >= 0) & (t < V)
    x_t = tl.load(base + tl.where(in_range, t, 0)).to(tl.float32)
    loss = tl.where(in_range, lse - x_t, float("nan"))
    tl.store(LOSS + row, tl.where(t == ignore_index, 0.0, loss))
    tl.store(LSE + row, lse)


@triton.jit
def _ce_bwd(LOGITS, TARGETS, LSE, DLOSS, DLOGITS, stride_row, stride_drow, V, ignore_index,
            BLOCK_V: tl.constexpr):
    """One row: DLOGITS = (softmax(x) - onehot(target)) * DLOSS[row] in DLOGITS' dtype (zeros for
    ignore_index), from the forward's LSE. Same support as _ce_fwd. grid (N,)."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(TARGETS + row).to(tl.int64)
    g = tl.load(DLOSS + row).to(tl.float32)
    g = tl.where(t == ignore_index, 0.0, g)
    lse = tl.load(LSE + row)
    base = LOGITS + row * stride_row
    dbase = DLOGITS + row * stride_drow
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        ok = cols < V
        x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)  # (BLOCK_V,)
        p = tl.math.exp2((x - lse) * LOG2E)
        grad = (p - tl.where(cols == t, 1.0, 0.0)) * g
        tl.store(dbase + cols, grad.to(DLOGITS.dtype.element_ty), mask=ok)


_triton.check_decorated(_ce_fwd, _ce_bwd)


def _config() -> tuple[int, int]:
    return INTERPRET_CONFIG if _triton.INTERPRET else GPU_CONFIG


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise ValueError("cross_entropy: logits and targets must be tensors")
    if logits.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(f"cross_entropy: expected logits (N, V) and targets (N,), got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        raise ValueError(f"cross_entropy: empty logits {tuple(logits.shape)}")
    if logits.dtype not in _triton.SUPPORTED_DTYPES:
        raise ValueError(f"cross_entropy supports float16, bfloat16 and float32 logits, got {logits.dtype}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"cross_entropy: targets must be integers, got {targets.dtype}")
    if logits.device != targets.device:
        raise ValueError(f"cross_entropy: logits on {logits.device}, targets on {targets.device}")
    _triton.check_device(logits.device, "cross_entropy's Triton kernel")


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(1) == 1 else logits.contiguous()


def _fwd(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    """Launch the forward: (per-row loss (N,) fp32, per-row log-sum-exp (N,) fp32)."""
    logits, targets = _rows(logits), targets.contiguous()
    N, V = logits.shape
    loss = _triton.empty((N,), torch.float32, logits.device)
    lse = _triton.empty((N,), torch.float32, logits.device)
    block_v, warps = _config()
    with _triton.device_guard(logits):
        _ce_fwd[(N,)](logits, targets, loss, lse, logits.stride(0), V, ignore_index, BLOCK_V=block_v,
                      num_warps=warps)
    return loss, lse


def _bwd(dloss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
         ignore_index: int) -> torch.Tensor:
    """Launch the backward: d(logits) (N, V) in the logits' dtype."""
    logits, targets, dloss = _rows(logits), targets.contiguous(), dloss.contiguous()
    N, V = logits.shape
    dlogits = _triton.empty((N, V), logits.dtype, logits.device)
    block_v, warps = _config()
    with _triton.device_guard(logits):
        _ce_bwd[(N,)](logits, targets, lse, dloss, dlogits, logits.stride(0), dlogits.stride(0), V, ignore_index,
                      BLOCK_V=block_v, num_warps=warps)
    return dlogits


# Custom ops, so that torch.compile traces through the loss without a graph break (kernels/flash/ops.py defines the
# namespace; this library adds to it).
_LIB = torch.library.Library("flashgpt", "FRAGMENT")
_LIB.define("cross_entropy_fwd(Tensor logits, Tensor targets, int ignore_index) -> (Tensor, Tensor)")
_LIB.define("cross_entropy_bwd(Tensor dloss, Tensor logits, Tensor targets, Tensor lse, int ignore_index) -> Tensor")
_LIB.impl("cross_entropy_fwd", _fwd, "CompositeExplicitAutograd")
_LIB.impl("cross_entropy_bwd", _bwd, "CompositeExplicitAutograd")
torch.library.register_fake(
    "flashgpt::cross_entropy_fwd",
    lambda logits, targets, ignore_index: (logits.new_empty(logits.shape[0], dtype=torch.float32),
                                           logits.new_empty(logits.shape[0], dtype=torch.float32)),
    lib=_LIB)
torch.library.register_fake(
    "flashgpt::cross_entropy_bwd",
    lambda dloss, logits, targets, lse, ignore_index: logits.new_empty(logits.shape),
    lib=_LIB)


def _setup_context(ctx, inputs, output):
    logits, targets, ignore_index = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits, targets, output[1])
    ctx.ignore_index = ignore_index


def _backward(ctx, dloss, dlse):
    logits, targets, lse = ctx.saved_tensors
    return torch.ops.flashgpt.cross_entropy_bwd(dloss, logits, targets, lse, ctx.ignore_index), None, None


torch.library.register_autograd("flashgpt::cross_entropy_fwd", _backward, setup_context=_setup_context, lib=_LIB)


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -1) -> torch.Tensor:
    """Per-row losses (N,) fp32 (0 where the target is ignore_index), differentiable in logits."""
    _check(logits, targets)
    return torch.ops.flashgpt.cross_entropy_fwd(logits, targets, int(ignore_index))[0]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -1) -> torch.Tensor:
    """Mean loss over the rows whose target is not ignore_index (F.cross_entropy's default reduction)."""
    rows = cross_entropy_rows(logits, targets, ignore_index)
    return rows.sum() / (targets != ignore_index).sum()
