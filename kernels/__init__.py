"""Attention implementations and the one dispatch point the model calls (and the loss's).

    attention(q, k, v, backend="flash" | "sdpa" | "naive", causal=True, sm_scale=None, window=0, docs=None)
    attention_qkvpacked(qkv, n_head, n_kv_head, backend=..., causal=True, sm_scale=None, window=0, docs=None,
                        rope=None)
    resolve_backend("auto" | backend, device) -> backend          BACKENDS, BACKEND_CHOICES (with "auto")
    cross_entropy(logits, targets, ignore_index=-1, kernel="auto" | "triton" | "torch")
    resolve_loss_kernel(kernel, device) -> "triton" | "torch"     LOSS_KERNELS
    resolve_llama_kernels(kernel, device) -> "triton" | "torch"   LLAMA_KERNELS: what the model's RMSNorm, SwiGLU
        and RoPE run; the Triton forms are triton_rms_norm, triton_swiglu, triton_rope_qkv

q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D), Hq a multiple of Hkv; causal masks are bottom-right aligned.
qkv: one packed projection (B, N, (Hq + 2·Hkv)·D), the model's training/prefill path without a KV cache;
rope = (cos, sin): q and k of qkv are rotated by RoPE first (flash: in its packed call, backward included).
window > 0 (causal only): query i sees only the last `window` keys up to its diagonal. docs: documents packed in
each row, as (B, 2, N) int32 bounds (kernels/documents.py: document_bounds): query i sees its own document's
keys only. Every backend supports both: flash in its kernels, naive and sdpa through explicit masks (O(N²)).
The kernels' switches are kernels.options (kernels/options.py); what they share, kernels/_triton.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import options
from ._triton import SUPPORTED_DTYPES, interpreting
# The Triton kernels are imported here, not inside attention(): an import inside a region that torch.compile
# traces is a graph break.
from .ce_loss import cross_entropy as triton_cross_entropy
from .documents import bounds_from_cu_seqlens, document_bounds, document_mask, document_positions
from .flash import flash_attention, flash_attention_qkvpacked, flash_attention_varlen
from .naive import (apply_rope, causal_mask, check_qkv, check_window, naive_attention, rope_reference, split_qkv,
                    window_mask)
from .options import LLAMA_KERNELS, LOSS_KERNELS
from .rmsnorm import rms_norm as triton_rms_norm
from .rope import rope_qkv as triton_rope_qkv
from .swiglu import swiglu as triton_swiglu

BACKENDS = ("flash", "sdpa", "naive")
BACKEND_CHOICES = ("auto", *BACKENDS)  # what a config or command line may name: "auto" resolves per device


def sdpa_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None, window: int = 0,
                   docs: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch's fused scaled_dot_product_attention with the same semantics as naive_attention.

    A window or documents become one explicit boolean mask ((Nq, Nk), or (B, 1, N, N) with documents): correct,
    but SDPA then runs its memory-efficient or math kernels, not FlashAttention's."""
    check_qkv(q, k, v)
    check_window(window, causal)
    Nq, Nk = q.shape[2], k.shape[2]
    if window or docs is not None:
        if (causal and Nq > Nk) or (window and not causal) or (docs is not None and Nq != Nk):
            # rows that see no key (NaN in SDPA), or arguments only the reference explains: the reference
            return naive_attention(q, k, v, causal=causal, sm_scale=sm_scale, window=window, docs=docs)
        mask = causal_mask(Nq, Nk, device=q.device) if causal else torch.ones(Nq, Nk, dtype=torch.bool,
                                                                             device=q.device)
        if window:
            mask = mask & window_mask(Nq, Nk, window, device=q.device)
        if docs is not None:
            mask = mask & document_mask(docs)  # (B, 1, N, N)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    if causal and Nq != Nk:
        # SDPA's is_causal is top-left aligned; use an explicit bottom-right mask instead.
        mask = causal_mask(Nq, Nk, device=q.device)
        if Nq > Nk:  # fully masked rows would be NaN: route through the reference semantics
            return naive_attention(q, k, v, causal=True, sm_scale=sm_scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


_IMPLS = {"naive": naive_attention, "sdpa": sdpa_attention, "flash": flash_attention}


def _unknown_backend(backend) -> ValueError:
    return ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKEND_CHOICES)}")


def attention(q, k, v, *, backend: str = "naive", causal: bool = True, sm_scale: float | None = None,
              window: int = 0, docs: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch to one attention backend by name. Returns (B, Hq, Nq, D) in q's dtype."""
    try:
        impl = _IMPLS[backend]
    except KeyError:
        raise _unknown_backend(backend) from None
    return impl(q, k, v, causal=causal, sm_scale=sm_scale, window=window, docs=docs)


def attention_qkvpacked(qkv, n_head: int, n_kv_head: int, *, backend: str = "naive", causal: bool = True,
                        sm_scale: float | None = None, window: int = 0, docs: torch.Tensor | None = None,
                        rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """attention() over the views q, k, v = split_qkv(qkv, n_head, n_kv_head). Returns (B, Hq, N, D).

    "flash" runs its packed form, whose backward writes d(qkv) in one buffer (no concatenation of dq, dk,
    dv); the other backends attend over the views exactly as attention() does. rope = (cos, sin), each (N, D)
    or (B, N, D): q and k are rotated by RoPE (rotate-half layout) before attending, and the gradient is
    w.r.t. qkv before the rotation; flash rotates in its own call (flash_attention_qkvpacked), the others with
    rope_reference.
    """
    if backend == "flash":
        return flash_attention_qkvpacked(qkv, n_head, n_kv_head, causal=causal, sm_scale=sm_scale, window=window,
                                         docs=docs, rope=rope)
    if rope is not None:
        qkv = rope_reference(qkv, *rope, n_head, n_kv_head)
    return attention(*split_qkv(qkv, n_head, n_kv_head), backend=backend, causal=causal, sm_scale=sm_scale,
                     window=window, docs=docs)


def resolve_backend(name: str, device) -> str:
    """"auto" → "flash" on CUDA (the Triton kernel), "sdpa" elsewhere; a backend's name → itself. The one place
    that resolves "auto"; any other name is a ValueError."""
    if name == "auto":
        return "flash" if torch.device(device).type == "cuda" else "sdpa"
    if name not in BACKENDS:
        raise _unknown_backend(name)
    return name


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -1,
                  kernel: str | None = None) -> torch.Tensor:
    """Mean cross-entropy of logits (N, V) against targets (N,) over the rows whose target is not ignore_index,
    computed in fp32 (float64 logits: in float64) whatever the logits' dtype. kernel: "triton"
    (kernels/ce_loss.py: one read of the logits forward, one read and one write backward; float16, bfloat16,
    float32), "torch" (F.cross_entropy on logits.float()), "auto" / None: resolve_loss_kernel's choice, except that
    float64 logits (a reference model's) always take the torch path."""
    if logits.dtype == torch.float64 and kernel != "triton":  # a reference model's: in float64
        return F.cross_entropy(logits, targets, ignore_index=ignore_index)
    if resolve_loss_kernel(kernel, logits.device) == "triton":
        return triton_cross_entropy(logits, targets, ignore_index)
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)


def resolve_loss_kernel(kernel: str | None, device) -> str:
    """The loss kernel cross_entropy runs on `device`: "triton" or "torch". "auto" (or None) takes the
    loss_kernel option (FLASHGPT_CE), whose own "auto" is the Triton kernel on CUDA and PyTorch elsewhere (the
    interpreter is for tests)."""
    if kernel is None or kernel == "auto":
        kernel = options.get().loss_kernel
    elif kernel not in LOSS_KERNELS:
        raise ValueError(f"unknown loss kernel {kernel!r}; choose one of {', '.join(LOSS_KERNELS)}")
    if kernel == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return kernel


def resolve_llama_kernels(kernel: str | None, device) -> str:
    """What the model's RMSNorm, SwiGLU and RoPE run on `device`: "triton" (kernels/rmsnorm.py, swiglu.py,
    rope.py) or "torch" (model/norms.py, model/rope.py, the MLP's F.silu). "auto" (or None) takes the
    llama_kernels option (FLASHGPT_LLAMA_KERNELS, default "torch"), whose own "auto" is Triton on CUDA and
    PyTorch elsewhere."""
    if kernel is None or kernel == "auto":
        kernel = options.get().llama_kernels
    elif kernel not in LLAMA_KERNELS:
        raise ValueError(f"unknown llama kernel choice {kernel!r}; choose one of {', '.join(LLAMA_KERNELS)}")
    if kernel == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return kernel


__all__ = ["attention", "attention_qkvpacked", "resolve_backend", "naive_attention", "sdpa_attention",
           "flash_attention", "flash_attention_qkvpacked", "flash_attention_varlen", "document_bounds",
           "bounds_from_cu_seqlens", "document_positions", "document_mask", "window_mask", "split_qkv", "BACKENDS",
           "BACKEND_CHOICES", "check_qkv", "check_window", "apply_rope", "rope_reference",
           "cross_entropy", "triton_cross_entropy", "resolve_loss_kernel", "LOSS_KERNELS", "options",
           "interpreting", "SUPPORTED_DTYPES", "resolve_llama_kernels", "LLAMA_KERNELS", "triton_rms_norm",
           "triton_swiglu", "triton_rope_qkv"]
