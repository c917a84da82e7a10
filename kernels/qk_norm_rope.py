"""q and k normalised over all their heads, then rotated, for the few rows of a decode step (OLMo 2 and 3).

    qk_norm_rope(q, k_cache, pos, q_gain, k_gain, eps, rope, *, pdl=False) -> q (M, Hq·D), rotated in place;
                                                                              k rotated in place in the cache

OLMo's q_norm and k_norm are RMSNorms over the whole q projection (Hq·D lanes) and the whole k projection (Hkv·D
lanes), so no tile of the QKV kernel (kernels/ln_linear.py) holds what one of them sums over. That kernel writes
q and the raw k (into the cache, at each row's position; v there too) and this one finishes them: per row, one
program for q and one for k, each summing its squares over all heads, then x / rms · w (the weight applied in
float32, rounded once: model/norms.py Fp32GainRMSNorm) and RoPE in the rotate-half layout, rounded as the eager
model rounds it (x·cos and rotate_half(x)·sin rounded, then their sum).

Supported (a ValueError before any launch otherwise):
    dtypes     q, the cache and the RoPE tables of one dtype (float16, bfloat16, float32); the gains of any of
               them; sums in float32
    shapes     q (M, Hq·D) with unit stride along its columns; k_cache (B', Hkv, L, D) with B' >= M; pos (M,)
               int; gains (Hq·D,) and (Hkv·D,); cos, sin (L', D) with unit stride along D; any even D (96,
               24: the half-lanes' tile padded to a power of 2 and masked), any Hq, Hkv
    devices    CUDA; CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, for tests)
Positions are not range-checked (the caller's KV cache owns them). Inference only (no backward).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _triton
from .pdl import pdl_enabled


@triton.jit
def _rounded(y, dtype: tl.constexpr):
    return y.to(dtype).to(tl.float32)


@triton.jit
def _qk_norm_rope_kernel(Q, KC, POS, QG, KG, COS, SIN, stride_q, stride_cb, stride_ch, stride_cn, stride_cd,
                         stride_pos, stride_rope, eps, HQ, HKV, D: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_I: tl.constexpr, USE_GDC: tl.constexpr):
    """grid = (M, 2): program (m, 0) normalises and rotates q[m] (HQ heads), program (m, 1) the k of row m at
    its position in KC (HKV heads); each in place, a (BLOCK_H, BLOCK_I) tile of lane pairs (i, i + D/2) per head
    (BLOCK_I = D/2 rounded up to a power of 2, the lanes past D/2 masked)."""
    m = tl.program_id(0)
    is_k = tl.program_id(1) == 1
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pos = tl.load(POS + m * stride_pos).to(tl.int64)
    heads = tl.where(is_k, HKV, HQ)
    h = tl.arange(0, BLOCK_H)                                                   # (BLOCK_H,)
    i = tl.arange(0, BLOCK_I)                                                   # (BLOCK_I,)
    in_half = i < D // 2
    ok = (h < heads)[:, None] & in_half[None, :]                               # (BLOCK_H, BLOCK_I)
    if is_k:  # the raw k the QKV kernel cached at the row's position
        base = KC + m.to(tl.int64) * stride_cb + pos * stride_cn
        ptr1 = base + h[:, None].to(tl.int64) * stride_ch + i[None, :] * stride_cd
        ptr2 = ptr1 + (D // 2) * stride_cd
        gain = KG
    else:
        ptr1 = Q + m.to(tl.int64) * stride_q + h[:, None] * D + i[None, :]
        ptr2 = ptr1 + D // 2
        gain = QG
    dtype = Q.dtype.element_ty
    x1 = tl.load(ptr1, mask=ok, other=0.0).to(tl.float32)                     # lanes i of each head
    x2 = tl.load(ptr2, mask=ok, other=0.0).to(tl.float32)                     # lanes i + D/2
    ss = tl.sum(tl.sum(x1 * x1 + x2 * x2, 1), 0)
    rstd = 1.0 / tl.sqrt(ss / (heads * D).to(tl.float32) + eps)
    lane = h[:, None] * D + i[None, :]                                          # the gain's index of lane i
    g1 = tl.load(gain + lane, mask=ok, other=0.0).to(tl.float32)
    g2 = tl.load(gain + lane + D // 2, mask=ok, other=0.0).to(tl.float32)
    n1 = _rounded(x1 * rstd * g1, dtype)                                        # the weight in fp32, rounded once
    n2 = _rounded(x2 * rstd * g2, dtype)
    cos = tl.load(COS + pos * stride_rope + i, mask=in_half, other=0.0).to(tl.float32)[None, :]  # (1, BLOCK_I)
    sin = tl.load(SIN + pos * stride_rope + i, mask=in_half, other=0.0).to(tl.float32)[None, :]  # all heads' angle
    r1 = _rounded(n1 * cos, dtype) + _rounded(-n2 * sin, dtype)
    r2 = _rounded(n2 * cos, dtype) + _rounded(n1 * sin, dtype)
    tl.store(ptr1, r1.to(dtype), mask=ok)
    tl.store(ptr2, r2.to(dtype), mask=ok)


_triton.check_decorated(_qk_norm_rope_kernel)


def qk_norm_rope(q: torch.Tensor, k_cache: torch.Tensor, pos: torch.Tensor, q_gain: torch.Tensor,
                 k_gain: torch.Tensor, eps: float, rope: tuple, *, pdl: bool = False) -> torch.Tensor:
    """q (M, Hq·D) and each row's k in k_cache (B', Hkv, L, D) at pos (M,): normalised over all their heads
    (weights q_gain (Hq·D,), k_gain (Hkv·D,), eps) and rotated by rope = (cos, sin) (L', D), both in place.
    Returns q. pdl: launch with programmatic dependent launch where the device has it (kernels/pdl.py)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k_cache, pos, q_gain, k_gain)):
        raise ValueError("qk_norm_rope: q, k_cache, pos and the gains must be tensors")
    if k_cache.dim() != 4 or q.dim() != 2 or q.shape[0] > k_cache.shape[0]:
        raise ValueError(f"qk_norm_rope: q (M, Hq·D) and k_cache (B >= M, Hkv, L, D), got {tuple(q.shape)} and "
                         f"{tuple(k_cache.shape)}")
    M, (_, Hkv, _, D) = q.shape[0], k_cache.shape
    if D % 2 or q.shape[1] % D or q.stride(1) != 1 or M == 0:
        raise ValueError(f"qk_norm_rope: an even head dim D={D} dividing q's {q.shape[1]} columns (unit stride)")
    Hq = q.shape[1] // D
    if tuple(q_gain.shape) != (Hq * D,) or tuple(k_gain.shape) != (Hkv * D,) or q_gain.stride(0) != 1 \
            or k_gain.stride(0) != 1:
        raise ValueError(f"qk_norm_rope: gains of ({Hq * D},) and ({Hkv * D},), got {tuple(q_gain.shape)} and "
                         f"{tuple(k_gain.shape)}")
    if pos.dim() != 1 or pos.shape[0] != M or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"qk_norm_rope: pos must be an int tensor of shape ({M},)")
    if (not isinstance(rope, tuple) or len(rope) != 2
            or any(not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != D or t.dtype != q.dtype
                   or t.stride(1) != 1 for t in rope) or rope[0].stride() != rope[1].stride()):
        raise ValueError(f"qk_norm_rope: rope must be (cos, sin), each (L, {D}) {q.dtype} with unit stride along D")
    if q.dtype not in _triton.SUPPORTED_DTYPES or k_cache.dtype != q.dtype:
        raise ValueError(f"qk_norm_rope: q and k_cache of one of float16/bfloat16/float32, got {q.dtype} and "
                         f"{k_cache.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"qk_norm_rope: eps must be a number >= 0, got {eps!r}")
    if len({t.device for t in (q, k_cache, pos, q_gain, k_gain, *rope)}) != 1:
        raise ValueError("qk_norm_rope: all tensors must be on one device")
    _triton.check_device(q.device, "qk_norm_rope")
    cos, sin = rope
    pdl = bool(pdl) and pdl_enabled(q.device)
    with _triton.device_guard(q):
        _qk_norm_rope_kernel[(M, 2)](q, k_cache, pos, q_gain, k_gain, cos, sin, q.stride(0), *k_cache.stride(),
                                     pos.stride(0), cos.stride(0), float(eps), Hq, Hkv, D=D,
                                     BLOCK_H=triton.next_power_of_2(max(Hq, Hkv)),
                                     BLOCK_I=triton.next_power_of_2(D // 2), USE_GDC=pdl,
                                     num_warps=4 if max(Hq, Hkv) * D <= 2048 else 8,
                                     **(dict(launch_pdl=True) if pdl else {}))
    return q


__all__ = ["qk_norm_rope"]
