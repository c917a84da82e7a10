"""Naive multi-head attention: the reference, the CPU fallback and the test oracle.

It materialises the full score matrix S = Q Kᵀ (B, Hq, Nq, Nk) and the probabilities P in memory —
exactly what FlashAttention avoids — so it is simple and obviously right, and O(N²) in memory. The sliding
window and packed documents are explicit (Nq, Nk) and (B, 1, N, N) masks here (window_mask, document_mask).
"""
from __future__ import annotations

import math

import torch

from .documents import document_mask


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) fit together."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-d (B, H, N, D) tensors, got q{tuple(q.shape)} "
                         f"k{tuple(k.shape)} v{tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k{tuple(k.shape)} v{tuple(v.shape)}")
    B, Hq, Nq, D = q.shape
    Bk, Hkv, Nk, Dk = k.shape
    if B != Bk or D != Dk:
        raise ValueError(f"q{tuple(q.shape)} and k{tuple(k.shape)} differ in batch or head dim")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if Nq == 0 or Nk == 0 or D == 0:
        raise ValueError(f"empty attention input: Nq={Nq}, Nk={Nk}, D={D}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def split_qkv(qkv: torch.Tensor, n_head: int, n_kv_head: int):
    """Views q (B, Hq, N, D), k and v (B, Hkv, N, D) of one packed projection qkv (B, N, (Hq + 2·Hkv)·D).

    The packed layout is what a fused QKV matmul gives: per token all query heads, then the key heads, then
    the value heads, D values each. Nothing is copied. Raises ValueError on a shape that does not split.
    """
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 3:
        raise ValueError(f"packed qkv must be a 3-d (B, N, (Hq + 2*Hkv) * D) tensor, got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}")
    if not (isinstance(n_head, int) and isinstance(n_kv_head, int) and n_head > 0 and n_kv_head > 0):
        raise ValueError(f"n_head and n_kv_head must be positive ints, got {n_head!r}, {n_kv_head!r}")
    B, N, W = qkv.shape
    if W % (n_head + 2 * n_kv_head) != 0:
        raise ValueError(f"packed qkv width {W} is not (n_head + 2 * n_kv_head) * head_dim for "
                         f"n_head={n_head}, n_kv_head={n_kv_head}")
    D = W // (n_head + 2 * n_kv_head)
    heads = qkv.view(B, N, n_head + 2 * n_kv_head, D).transpose(1, 2)  # (B, Hq + 2·Hkv, N, D)
    return heads.split_with_sizes([n_head, n_kv_head, n_kv_head], 1)  # q (B, Hq, N, D), k and v (B, Hkv, N, D)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); cos, sin: (T, D) or (B, T, D) → x rotated by RoPE, (B, T, H, D) in x's dtype.

    rotate-half (Hugging Face's layout): (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin) for the halves
    x1 = x[..., :D/2] and x2 = x[..., D/2:]; cos and sin are rounded to x's dtype first.
    """
    cos, sin = cos.to(x.dtype).unsqueeze(-2), sin.to(x.dtype).unsqueeze(-2)  # (T | B T, 1, D): one angle, all heads
    x1, x2 = x.chunk(2, dim=-1)                      # (B, T, H, D/2) each
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_head: int,
                   n_kv_head: int) -> torch.Tensor:
    """The packed projection qkv (B, N, (Hq + 2·Hkv)·D) with its q and k heads rotated by apply_rope, v heads
    as they were: a new (B, N, (Hq + 2·Hkv)·D) tensor (what kernels.rope_qkv computes in one launch)."""
    B, N, W = qkv.shape
    heads = qkv.reshape(B, N, n_head + 2 * n_kv_head, W // (n_head + 2 * n_kv_head))  # (B, N, Hq + 2·Hkv, D)
    qk = apply_rope(heads[:, :, :n_head + n_kv_head], cos, sin)  # (B, N, Hq + Hkv, D)
    return torch.cat((qk, heads[:, :, n_head + n_kv_head:]), dim=2).reshape(B, N, W)


def causal_mask(Nq: int, Nk: int, device=None) -> torch.Tensor:
    """(Nq, Nk) bool, True where query i may see key j: j <= i + (Nk - Nq) (bottom-right aligned)."""
    i = torch.arange(Nq, device=device)[:, None]
    j = torch.arange(Nk, device=device)[None, :]
    return j <= i + (Nk - Nq)


def check_window(window, causal: bool) -> None:
    """ValueError (one line) unless window is an int >= 0 (0: no window), and a window > 0 comes with causal."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0 = no window), got {window!r}")
    if window and not causal:
        raise ValueError(f"window={window} needs causal=True (a window reaches back from the diagonal)")


def window_mask(Nq: int, Nk: int, window: int, device=None) -> torch.Tensor:
    """(Nq, Nk) bool, True where key j is among the last `window` keys up to query i's diagonal:
    i + (Nk - Nq) - window < j (bottom-right aligned; combine with causal_mask)."""
    i = torch.arange(Nq, device=device)[:, None]
    j = torch.arange(Nk, device=device)[None, :]
    return j > i + (Nk - Nq) - window


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    sm_scale: float | None = None, mask: torch.Tensor | None = None, window: int = 0,
                    docs: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q Kᵀ · sm_scale + mask) V, computed in q's dtype (the softmax itself in float32, or in float64 for
    float64 inputs; P is rounded to q's dtype before P V).

    q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D) with Hq % Hkv == 0 (GQA/MQA: each group of Hq/Hkv query
    heads shares one key/value head). Causal masks are bottom-right aligned (query i sees keys
    j <= i + Nk - Nq), so a query block at the end of a KV cache sees the whole prefix. A query row
    that sees no key at all (only when Nq > Nk) returns zeros. Returns (B, Hq, Nq, D).
    mask (optional): a bool tensor broadcastable to (B, Hq, Nq, Nk), True where a query may see a key; it is
    combined with the causal mask (the KV cache's per-sequence lengths use it with causal=False).
    window > 0 (causal only): query i also sees no key j <= i + Nk - Nq - window. docs (optional, Nq = Nk = N):
    (B, 2, N) int32 document bounds (kernels.documents): query i sees the keys of its own document only.
    """
    check_qkv(q, k, v)
    check_window(window, causal)
    if docs is not None and q.shape[2] != k.shape[2]:
        raise ValueError(f"documents need Nq = Nk (self-attention), got Nq={q.shape[2]}, Nk={k.shape[2]}")
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    if Hkv != Hq:  # expand shared kv heads: (B, Hkv, Nk, D) -> (B, Hq, Nk, D)
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    s = (q @ k.transpose(-2, -1)) * scale  # (B, Hq, Nq, Nk)
    if causal:
        visible = causal_mask(Nq, Nk, device=q.device)  # (Nq, Nk)
        if window:
            visible = visible & window_mask(Nq, Nk, window, device=q.device)
        s = s.masked_fill(~visible, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if docs is not None:
        s = s.masked_fill(~document_mask(docs), float("-inf"))  # (B, 1, N, N)
    # the softmax runs in float32 for 16- and 32-bit inputs (P then rounded to q's dtype, as the kernels round it)
    # and in float64 for float64 inputs, so that the float64 oracle is float64 end to end
    p = torch.softmax(s if s.dtype == torch.float64 else s.float(), dim=-1).to(q.dtype)  # (B, Hq, Nq, Nk)
    if (causal and Nq > Nk) or mask is not None:  # rows with no visible key: softmax gave NaN, define them as 0
        p = torch.nan_to_num(p, nan=0.0)
    return p @ v  # (B, Hq, Nq, D)
