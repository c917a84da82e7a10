"""The front door of the flash kernels: input checks, autograd, and the custom ops torch.compile traces.

    flash_attention(q, k, v, *, causal=True, sm_scale=None, window=0, docs=None) -> (B, Hq, Nq, D)
    flash_attention_qkvpacked(qkv, n_head, n_kv_head=None, *, causal=True, sm_scale=None, window=0, docs=None,
                              rope=None) -> (B, Hq, N, D)
    flash_attention_varlen(q, k, v, cu_seqlens, max_seqlen=None, *, causal=True, window=0, sm_scale=None)
        -> (total, Hq, D)

Every form checks its inputs here (every ValueError before any launch), then takes one of two paths to the
same launches (kernels/flash/launch.py): eager calls go through one torch.autograd.Function (_FlashAttention,
shared by the forms: its dispatch costs less per call than a custom op's); under torch.compile the forms are
the custom ops flashgpt::flash_attn_fwd / flash_attn_bwd and flashgpt::flash_attn_qkvpacked_fwd /
flash_attn_qkvpacked_bwd, and flashgpt::flash_attn_qkvpacked_rope_fwd / _bwd for the packed form with RoPE (the
window and the document bounds are arguments of the same ops), with fake (meta)
implementations and their autograd formula (register_autograd), so torch.compile(fullgraph=True) traces
through them without a graph break. Both paths save the same tensors and compute the same gradients (_save,
_grads). Double backward is not supported: it raises a RuntimeError. The varlen form is flash_attention on a
(1, Hq, total, D) view with the document bounds of cu_seqlens (kernels/documents.py).
"""
from __future__ import annotations

import math

import torch

from .. import _triton
from .. import rope as _rope
from ..documents import bounds_from_cu_seqlens, check_cu_seqlens, check_docs
from ..naive import check_qkv, check_window, split_qkv
from .configs import MAX_HEAD_DIM
from .launch import _bwd, _fwd, _layout, _packed_bwd, _packed_fwd, _packed_rope_fwd


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale, causal: bool = True, window: int = 0,
              docs: torch.Tensor | None = None) -> float:
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
    check_window(window, causal)
    if docs is not None:
        check_docs(docs, q.shape[0], q.shape[2], q.device, "flash_attention")
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"flash_attention: documents need Nq = Nk (self-attention), got Nq={q.shape[2]}, "
                             f"Nk={k.shape[2]}")
    if sm_scale is None:
        return 1.0 / math.sqrt(D)
    sm_scale = float(sm_scale)
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a finite number > 0, got {sm_scale}")
    return sm_scale


# ----------------------------------------------------------------------------------------------------------
# What a backward needs, and the gradients, for both forms. inputs: (q, k, v) with heads None (the plain form),
# or (qkv,) with heads = (n_head, n_kv_head) (the packed form; with RoPE, the rotated qkv). Beyond the inputs
# only O and the log-sum-exp are saved (and the document bounds and the RoPE tables, when given).
# ----------------------------------------------------------------------------------------------------------

def _save(ctx, inputs: tuple, o: torch.Tensor, lse: torch.Tensor, causal: bool, sm_scale: float, heads,
          window: int, docs: torch.Tensor | None, rope=None) -> None:
    ctx.save_for_backward(*inputs, o, lse, docs, *(rope or (None, None)))
    ctx.causal = causal
    ctx.sm_scale = sm_scale
    ctx.heads = heads
    ctx.window = window
    ctx.rope = rope is not None


def _grads(ctx, do: torch.Tensor, bwd, packed_bwd, rope_bwd) -> tuple:
    """The gradients of the saved inputs: (dq, dk, dv), or (d(qkv),) in one buffer (with RoPE: w.r.t. qkv
    before the rotation). bwd, packed_bwd, rope_bwd: the launches themselves (eager) or the backward custom ops
    (under torch.compile)."""
    *inputs, o, lse, docs, cos, sin = ctx.saved_tensors
    if ctx.heads is None:
        return tuple(bwd(do, *inputs, o, lse, ctx.causal, ctx.sm_scale, ctx.window, docs))
    if ctx.rope:
        return (rope_bwd(do, inputs[0], o, lse, cos, sin, *ctx.heads, ctx.causal, ctx.sm_scale, ctx.window, docs),)
    return (packed_bwd(do, inputs[0], o, lse, *ctx.heads, ctx.causal, ctx.sm_scale, ctx.window, docs),)


def _packed_rope_bwd(do, qkv, o, lse, cos, sin, n_head: int, n_kv_head: int, causal: bool, sm_scale: float,
                     window: int = 0, docs=None) -> torch.Tensor:
    """d(qkv before the rotation) from the rotated qkv the forward saved: launch.py's _packed_bwd with rope."""
    return _packed_bwd(do, qkv, o, lse, n_head, n_kv_head, causal, sm_scale, window, docs, rope=(cos, sin))


class _FlashAttention(torch.autograd.Function):
    """The eager path of both forms: a thin autograd.Function over the launches (less dispatch overhead per
    call than the custom ops, which matters for short sequences where the kernels take tens of microseconds).
    apply(heads, causal, sm_scale, window, docs, rope, *inputs), inputs and heads as for _save; rope = (cos, sin)
    or None (with RoPE the saved input is the rotated qkv)."""

    @staticmethod
    def forward(ctx, heads, causal, sm_scale, window, docs, rope, *inputs):
        if heads is None:
            o, lse = _fwd(*inputs, causal, sm_scale, window, docs)
        elif rope is not None:
            o, lse, rotated = _packed_rope_fwd(*inputs, *rope, *heads, causal, sm_scale, window, docs)
            inputs = (rotated,)
        else:
            o, lse = _packed_fwd(*inputs, *heads, causal, sm_scale, window, docs)
        _save(ctx, inputs, o, lse, causal, sm_scale, heads, window, docs, rope)
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        return (None, None, None, None, None, None, *_grads(ctx, do, _bwd, _packed_bwd, _packed_rope_bwd))


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


def _fwd_fake(q, k, v, causal, sm_scale, window=0, docs=None):
    B, Hq, Nq, D = q.shape
    return _fake_like(q), q.new_empty((B, Hq, Nq), dtype=torch.float32)


# window and docs come last, with defaults: a call that leaves them out is the plain (dense) attention
_MASKS = "int window=0, Tensor? docs=None"
_flash_attn_fwd_op = _define(
    "flash_attn_fwd", f"(Tensor q, Tensor k, Tensor v, bool causal, float sm_scale, {_MASKS}) -> (Tensor, Tensor)",
    _fwd, _fwd_fake)
_flash_attn_bwd_op = _define(
    "flash_attn_bwd", "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, "
                      f"float sm_scale, {_MASKS}) -> (Tensor, Tensor, Tensor)",
    _bwd, lambda do, q, k, v, o, lse, causal, sm_scale, window=0, docs=None: (_fake_like(q), _fake_like(k),
                                                                               _fake_like(v)))
_packed_fwd_op = _define(
    "flash_attn_qkvpacked_fwd", f"(Tensor qkv, int n_head, int n_kv_head, bool causal, float sm_scale, {_MASKS}) "
                                "-> (Tensor, Tensor)",
    _packed_fwd, lambda qkv, n_head, n_kv_head, causal, sm_scale, window=0, docs=None: _fwd_fake(
        split_qkv(qkv, n_head, n_kv_head)[0], None, None, causal, sm_scale))
_packed_bwd_op = _define(
    "flash_attn_qkvpacked_bwd", "(Tensor do, Tensor qkv, Tensor o, Tensor lse, int n_head, int n_kv_head, "
                                f"bool causal, float sm_scale, {_MASKS}) -> Tensor",
    _packed_bwd, lambda do, qkv, o, lse, n_head, n_kv_head, causal, sm_scale, window=0, docs=None:
    qkv.new_empty(qkv.shape))
_packed_rope_fwd_op = _define(
    "flash_attn_qkvpacked_rope_fwd", "(Tensor qkv, Tensor cos, Tensor sin, int n_head, int n_kv_head, bool causal, "
                                     f"float sm_scale, {_MASKS}) -> (Tensor, Tensor, Tensor)",
    _packed_rope_fwd, lambda qkv, cos, sin, n_head, n_kv_head, causal, sm_scale, window=0, docs=None: (
        *_fwd_fake(split_qkv(qkv.new_empty(qkv.shape), n_head, n_kv_head)[0], None, None, causal, sm_scale),
        qkv.new_empty(qkv.shape)))  # (the forward attends over its rotated copy of qkv, which is contiguous)
_packed_rope_bwd_op = _define(
    "flash_attn_qkvpacked_rope_bwd", "(Tensor do, Tensor qkv, Tensor o, Tensor lse, Tensor cos, Tensor sin, "
                                     f"int n_head, int n_kv_head, bool causal, float sm_scale, {_MASKS}) -> Tensor",
    _packed_rope_bwd, lambda do, qkv, o, lse, cos, sin, n_head, n_kv_head, causal, sm_scale, window=0, docs=None:
    qkv.new_empty(qkv.shape))


def _register_autograd(op_name: str, n_tensors: int) -> None:
    """The autograd formula of a forward op whose first n_tensors inputs are differentiable, followed by the
    packed head counts (if any), causal, sm_scale, window and docs; its backward runs the backward ops."""
    def setup_context(ctx, inputs, output):
        o, lse = output
        ctx.mark_non_differentiable(lse)
        *heads, causal, sm_scale, window, docs = inputs[n_tensors:]  # (defaults filled in by torch.library)
        _save(ctx, inputs[:n_tensors], o, lse, causal, sm_scale, tuple(heads) or None, window, docs)

    def backward(ctx, do, dlse):
        grads = _grads(ctx, do, _flash_attn_bwd_op, _packed_bwd_op, _packed_rope_bwd_op)
        return (*grads, *[None] * (7 - n_tensors))  # both forward ops take 7 inputs

    torch.library.register_autograd("flashgpt::" + op_name, backward, setup_context=setup_context, lib=_LIB)


_register_autograd("flash_attn_fwd", 3)
_register_autograd("flash_attn_qkvpacked_fwd", 1)


def _rope_setup_context(ctx, inputs, output):
    """The RoPE form's autograd: differentiable in qkv only; the rotated qkv (its third output) is what the
    backward reads."""
    o, lse, rotated = output
    ctx.mark_non_differentiable(lse, rotated)
    _, cos, sin, n_head, n_kv_head, causal, sm_scale, window, docs = inputs
    _save(ctx, (rotated,), o, lse, causal, sm_scale, (n_head, n_kv_head), window, docs, (cos, sin))


def _rope_backward(ctx, do, dlse, drotated):
    return (*_grads(ctx, do, _flash_attn_bwd_op, _packed_bwd_op, _packed_rope_bwd_op), *[None] * 8)


torch.library.register_autograd("flashgpt::flash_attn_qkvpacked_rope_fwd", _rope_backward,
                                setup_context=_rope_setup_context, lib=_LIB)


# ----------------------------------------------------------------------------------------------------------
# The public functions
# ----------------------------------------------------------------------------------------------------------

def _attend(inputs: tuple, heads, causal: bool, scale: float, window: int, docs, rope=None) -> torch.Tensor:
    if torch.compiler.is_compiling():
        if heads is None:
            o, _ = _flash_attn_fwd_op(*inputs, causal, scale, window, docs)
        elif rope is not None:
            o, _, _ = _packed_rope_fwd_op(*inputs, *rope, *heads, causal, scale, window, docs)
        else:
            o, _ = _packed_fwd_op(*inputs, *heads, causal, scale, window, docs)
        return o
    return _FlashAttention.apply(heads, causal, scale, window, docs, rope, *inputs)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    sm_scale: float | None = None, window: int = 0,
                    docs: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q Kᵀ · sm_scale + mask) V with the FlashAttention kernels; see kernels/flash/__init__.py.

    q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D), Hq % Hkv == 0. Returns (B, Hq, Nq, D) in q's dtype.
    window > 0 (causal only): query i sees keys j with i + Nk - Nq - window < j <= i + Nk - Nq.
    docs: documents packed in each row, (B, 2, N) int32 (kernels.documents.document_bounds; Nq = Nk = N):
    query i sees only keys j with docs[b, 0, i] <= j < docs[b, 1, i] (and the causal mask and window).
    """
    scale = _validate(q, k, v, sm_scale, causal, window, docs)
    return _attend((q, k, v), None, bool(causal), scale, window, None if docs is None else docs.contiguous())


def flash_attention_qkvpacked(qkv: torch.Tensor, n_head: int, n_kv_head: int | None = None, *,
                              causal: bool = True, sm_scale: float | None = None, window: int = 0,
                              docs: torch.Tensor | None = None,
                              rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """flash_attention over the views q, k, v = split_qkv(qkv, n_head, n_kv_head) of one packed projection.

    qkv: (B, N, (Hq + 2·Hkv)·D) (per token: all query heads, then the key heads, then the value heads);
    n_kv_head defaults to n_head. Returns (B, Hq, N, D) in qkv's dtype, exactly flash_attention's result
    (window and docs as there); its gradient w.r.t. qkv is written by the backward kernels into one
    (B, N, (Hq + 2·Hkv)·D) buffer.

    rope = (cos, sin), each (N, D) or (B, N, D) (model/rope.py's tables of the tokens' positions): q and k are
    first rotated by RoPE (rotate-half layout, kernels.rope_qkv's rotation: one pass writing the rotated
    projection, which the backward keeps), and the gradient is w.r.t. qkv before the rotation. For head dims
    that are powers of two >= 16 the dQ and dK kernels store their tiles rotated back, so the rotation's
    backward costs no pass of its own; other head dims take one pass of kernels.rope_qkv's backward.
    """
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    q, k, v = split_qkv(qkv, n_head, n_kv_head)
    scale = _validate(q, k, v, sm_scale, causal, window, docs)
    if rope is not None:
        if not (isinstance(rope, (tuple, list)) and len(rope) == 2):
            raise ValueError("flash_attention_qkvpacked: rope must be a pair (cos, sin) of tensors")
        _rope._check(qkv, *rope, n_head, n_kv_head)
        rope = (rope[0].contiguous(), rope[1].contiguous())
    return _attend((qkv,), (n_head, n_kv_head), bool(causal), scale, window,
                   None if docs is None else docs.contiguous(), rope)


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int | None = None, *, causal: bool = True, window: int = 0,
                           sm_scale: float | None = None) -> torch.Tensor:
    """Attention within each of several sequences packed one after another (FlashAttention's varlen form).

    q: (total, Hq, D); k, v: (total, Hkv, D), Hq % Hkv == 0; cu_seqlens: (n + 1,) int32 or int64 on q's device,
    the sequences' offsets: sequence s is tokens [cu_seqlens[s], cu_seqlens[s + 1]), cu_seqlens[0] = 0,
    cu_seqlens[n] = total, non-decreasing (empty sequences allowed). Query t sees the keys of its own sequence
    only (causal: up to itself; window > 0: the last `window` of them). Returns (total, Hq, D) in q's dtype,
    differentiable in q, k and v. max_seqlen (optional, for FlashAttention's signature): an upper bound of the
    sequence lengths, checked when given; the kernels do not need it (their grid tiles the packed tokens).

    Checks cu_seqlens' values: one device-to-host read per call (skipped under torch.compile), so a training
    loop that builds its bounds itself passes docs to flash_attention instead.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"flash_attention_varlen: {name} must be a 3-d (total, H, D) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"flash_attention_varlen: q and k hold different token counts ({q.shape[0]} and "
                         f"{k.shape[0]})")
    total = q.shape[0]
    check_cu_seqlens(cu_seqlens, total, q.device, max_seqlen, check_values=not torch.compiler.is_compiling())
    docs = bounds_from_cu_seqlens(cu_seqlens, total)  # (1, 2, total)
    q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))  # (1, H, total, D) views
    scale = _validate(q4, k4, v4, sm_scale, causal, window, docs)
    o = _attend((q4, k4, v4), None, bool(causal), scale, window, docs)  # (1, Hq, total, D), laid out like q
    return o[0].transpose(0, 1)  # (total, Hq, D)
