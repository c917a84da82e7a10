"""The front door of the flash kernels: input checks, autograd, and the custom ops torch.compile traces.

    flash_attention(q, k, v, *, causal=True, sm_scale=None) -> (B, Hq, Nq, D)
    flash_attention_qkvpacked(qkv, n_head, n_kv_head=None, *, causal=True, sm_scale=None) -> (B, Hq, N, D)

Both forms check their inputs here (every ValueError before any launch), then take one of two paths to the
same launches (kernels/flash/launch.py): eager calls go through one torch.autograd.Function (_FlashAttention,
shared by both forms: its dispatch costs less per call than a custom op's); under torch.compile the forms are
the custom ops flashgpt::flash_attn_fwd / flash_attn_bwd and flashgpt::flash_attn_qkvpacked_fwd /
flash_attn_qkvpacked_bwd, with fake (meta) implementations and their autograd formula (register_autograd), so
torch.compile(fullgraph=True) traces through them without a graph break. Both paths save the same tensors and
compute the same gradients (_save, _grads). Double backward is not supported: it raises a RuntimeError.
"""
from __future__ import annotations

import math

import torch

from .. import _triton
from ..naive import check_qkv, split_qkv
from .configs import MAX_HEAD_DIM
from .launch import _bwd, _fwd, _layout, _packed_bwd, _packed_fwd


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale) -> float:
    """All checks happen here, before any launch. Returns the softmax scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    check_qkv(q, k, v)
    if q.dtype not in _triton.SUPPORTED_DTYPES:
        raise ValueError(f"flash_attention supports float16, bfloat16 and float32 inputs, got {q.dtype}")
    D = q.shape[-1]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"flash_attention supports head dims 1..{MAX_HEAD_DIM}, got D={D}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    _triton.check_device(q.device, "flash_attention")
    if max(q.shape[0], q.shape[1]) > 65535:
        raise ValueError(f"flash_attention: batch and head count must be <= 65535 (grid limits), got {q.shape}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        # offsets inside one (batch, head) slice are int32 in the kernels (batch/head offsets are int64)
        if (t.shape[2] - 1) * t.stride(2) + (t.shape[3] - 1) * t.stride(3) >= 2**31:
            raise ValueError(f"flash_attention: {name} is too long for int32 offsets within one head "
                             f"(shape {tuple(t.shape)}, strides {t.stride()})")
    if sm_scale is None:
        return 1.0 / math.sqrt(D)
    sm_scale = float(sm_scale)
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a finite number > 0, got {sm_scale}")
    return sm_scale


# ----------------------------------------------------------------------------------------------------------
# What a backward needs, and the gradients, for both forms. inputs: (q, k, v) with heads None (the plain form),
# or (qkv,) with heads = (n_head, n_kv_head) (the packed form). Beyond the inputs only O and the log-sum-exp
# are saved.
# ----------------------------------------------------------------------------------------------------------

def _save(ctx, inputs: tuple, o: torch.Tensor, lse: torch.Tensor, causal: bool, sm_scale: float, heads) -> None:
    ctx.save_for_backward(*inputs, o, lse)
    ctx.causal = causal
    ctx.sm_scale = sm_scale
    ctx.heads = heads


def _grads(ctx, do: torch.Tensor, bwd, packed_bwd) -> tuple:
    """The gradients of the saved inputs: (dq, dk, dv), or (d(qkv),) in one buffer. bwd, packed_bwd: the
    launches themselves (eager) or the backward custom ops (under torch.compile)."""
    *inputs, o, lse = ctx.saved_tensors
    if ctx.heads is None:
        return tuple(bwd(do, *inputs, o, lse, ctx.causal, ctx.sm_scale))
    return (packed_bwd(do, inputs[0], o, lse, *ctx.heads, ctx.causal, ctx.sm_scale),)


class _FlashAttention(torch.autograd.Function):
    """The eager path of both forms: a thin autograd.Function over the launches (less dispatch overhead per
    call than the custom ops, which matters for short sequences where the kernels take tens of microseconds).
    apply(heads, causal, sm_scale, *inputs), inputs and heads as for _save."""

    @staticmethod
    def forward(ctx, heads, causal, sm_scale, *inputs):
        if heads is None:
            o, lse = _fwd(*inputs, causal, sm_scale)
        else:
            o, lse = _packed_fwd(*inputs, *heads, causal, sm_scale)
        _save(ctx, inputs, o, lse, causal, sm_scale, heads)
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        return (None, None, None, *_grads(ctx, do, _bwd, _packed_bwd))


# ----------------------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile, with fake implementations and the autograd formula
# ----------------------------------------------------------------------------------------------------------

# Defined through torch.library's operator registration rather than the @custom_op decorator: the decorator's
# per-call wrappers (dynamo-disable, output aliasing checks) cost several microseconds of CPU per call on top of
# the dispatcher, and in a compiled training step the GPU waits for the host where the step starts.
_LIB = torch.library.Library("flashgpt", "DEF")


def _define(name: str, schema: str, impl, fake):
    """Register flashgpt::name(schema) with `impl` for every device and `fake` for tracing; returns the op."""
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake("flashgpt::" + name, fake, lib=_LIB)
    return getattr(torch.ops.flashgpt, name).default


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    """The fake (meta) twin of the outputs' allocation (_layout): the same shape AND strides as a real launch."""
    shape, perm = _layout(t)
    return t.new_empty(shape).permute(*perm)


def _fwd_fake(q, k, v, causal, sm_scale):
    B, Hq, Nq, D = q.shape
    return _fake_like(q), q.new_empty((B, Hq, Nq), dtype=torch.float32)


_flash_attn_fwd_op = _define(
    "flash_attn_fwd", "(Tensor q, Tensor k, Tensor v, bool causal, float sm_scale) -> (Tensor, Tensor)",
    _fwd, _fwd_fake)
_flash_attn_bwd_op = _define(
    "flash_attn_bwd", "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, "
                      "float sm_scale) -> (Tensor, Tensor, Tensor)",
    _bwd, lambda do, q, k, v, o, lse, causal, sm_scale: (_fake_like(q), _fake_like(k), _fake_like(v)))
_packed_fwd_op = _define(
    "flash_attn_qkvpacked_fwd", "(Tensor qkv, int n_head, int n_kv_head, bool causal, float sm_scale) "
                                "-> (Tensor, Tensor)",
    _packed_fwd, lambda qkv, n_head, n_kv_head, causal, sm_scale: _fwd_fake(
        split_qkv(qkv, n_head, n_kv_head)[0], None, None, causal, sm_scale))
_packed_bwd_op = _define(
    "flash_attn_qkvpacked_bwd", "(Tensor do, Tensor qkv, Tensor o, Tensor lse, int n_head, int n_kv_head, "
                                "bool causal, float sm_scale) -> Tensor",
    _packed_bwd, lambda do, qkv, o, lse, n_head, n_kv_head, causal, sm_scale: qkv.new_empty(qkv.shape))


def _register_autograd(op_name: str, n_tensors: int) -> None:
    """The autograd formula of a forward op whose first n_tensors inputs are differentiable, followed by the
    packed head counts (if any), causal and sm_scale; its backward runs the backward ops."""
    def setup_context(ctx, inputs, output):
        o, lse = output
        ctx.mark_non_differentiable(lse)
        *heads, causal, sm_scale = inputs[n_tensors:]
        _save(ctx, inputs[:n_tensors], o, lse, causal, sm_scale, tuple(heads) or None)

    def backward(ctx, do, dlse):
        grads = _grads(ctx, do, _flash_attn_bwd_op, _packed_bwd_op)
        return (*grads, *[None] * (5 - n_tensors))  # both forward ops take 5 inputs

    torch.library.register_autograd("flashgpt::" + op_name, backward, setup_context=setup_context, lib=_LIB)


_register_autograd("flash_attn_fwd", 3)
_register_autograd("flash_attn_qkvpacked_fwd", 1)


# ----------------------------------------------------------------------------------------------------------
# The public functions
# ----------------------------------------------------------------------------------------------------------

def _attend(inputs: tuple, heads, causal: bool, scale: float) -> torch.Tensor:
    if torch.compiler.is_compiling():
        if heads is None:
            o, _ = _flash_attn_fwd_op(*inputs, causal, scale)
        else:
            o, _ = _packed_fwd_op(*inputs, *heads, causal, scale)
        return o
    return _FlashAttention.apply(heads, causal, scale, *inputs)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    sm_scale: float | None = None) -> torch.Tensor:
    """softmax(Q Kᵀ · sm_scale + mask) V with the FlashAttention kernels; see kernels/flash/__init__.py.

    q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D), Hq % Hkv == 0. Returns (B, Hq, Nq, D) in q's dtype.
    """
    scale = _validate(q, k, v, sm_scale)
    return _attend((q, k, v), None, bool(causal), scale)


def flash_attention_qkvpacked(qkv: torch.Tensor, n_head: int, n_kv_head: int | None = None, *,
                              causal: bool = True, sm_scale: float | None = None) -> torch.Tensor:
    """flash_attention over the views q, k, v = split_qkv(qkv, n_head, n_kv_head) of one packed projection.

    qkv: (B, N, (Hq + 2·Hkv)·D) (per token: all query heads, then the key heads, then the value heads);
    n_kv_head defaults to n_head. Returns (B, Hq, N, D) in qkv's dtype, exactly flash_attention's result;
    its gradient w.r.t. qkv is written by the backward kernels into one (B, N, (Hq + 2·Hkv)·D) buffer.
    """
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    q, k, v = split_qkv(qkv, n_head, n_kv_head)
    scale = _validate(q, k, v, sm_scale)
    return _attend((qkv,), (n_head, n_kv_head), bool(causal), scale)
