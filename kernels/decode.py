"""Split-KV decode attention (flash-decoding) in Triton: a few new query tokens against a static KV cache.

    decode_attention(q, k_cache, v_cache, cache_lens, *, sm_scale=None, num_splits=None) -> (B, Hq, Nq, D)

Shapes:
    q        (B, Hq, Nq, D)        the Nq new tokens' queries (their keys/values are already in the cache)
    k_cache  (B, Hkv, max_len, D)  preallocated static cache; v_cache the same shape
    cache_lens (B,) int32/int64    valid positions per sequence, INCLUDING the Nq new tokens
Query i of sequence b sits at position p = cache_lens[b] - Nq + i and attends to cache positions j <= p
(causal, bottom-right aligned: the same semantics as `naive_attention` on the valid prefix). Positions
>= cache_lens[b] are never read into the result: they may hold anything, NaN included.

Supported, and checked with a ValueError before any launch:
    dtypes      float16, bfloat16, float32 (q, k_cache, v_cache alike); softmax and accumulation in float32,
                float32 inputs use exact ("ieee") dot products, not TF32
    head dim    16 <= D <= 256, any value (non-powers of two are padded to a power-of-two BLOCK_D and masked)
    queries     1 <= Nq <= 16 new tokens per sequence
    heads       Hq a multiple of Hkv (MHA, GQA, MQA); one program handles all the query heads of a kv head
                (up to 64 query rows = heads x tokens; more rows are split over several programs), so the
                cache is read once per kv group
    lengths     Nq <= cache_lens[b] <= max_len, may differ per sequence; any strides (views of a larger cache)
    devices     CUDA; CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, for tests)
Inference only: there is no backward, and inputs that require grad (with grad mode on) are refused.

The scheme: the valid prefix of each sequence is cut into `num_splits` chunks (a multiple of BLOCK_N keys each)
processed by separate programs, so that even batch 1 with a long cache fills the GPU. Each split writes its
partial output O_s (normalised, fp32) and its log-sum-exp lse_s; a second kernel merges them:
    out = sum_s 2^(lse_s - M) O_s / sum_s 2^(lse_s - M),   M = max_s lse_s
A split that holds no visible key for a row (short sequence, or the causal edge) has lse_s = -inf, weight 0.
`num_splits=None` picks a count from (B*Hkv, max_len, SM count, the decode_min_keys_per_split option);
`num_splits=1` runs the plain non-split kernel, which writes the output directly (the benchmark's baseline).

Checking cache_lens against [Nq, max_len] reads it back from the GPU (a sync); it is skipped while a CUDA graph
is being captured, and `check_lens=False` skips it explicitly.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _triton
from . import options as _options
from .pdl import pdl_enabled

MAX_NQ = 16           # new tokens per call
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
MAX_ROWS = 64         # query rows (heads of a group x new tokens) per program
MAX_SPLITS = 256
SINGLE_SPLIT_MAX_LEN = 512  # caches of at most this many positions run unsplit (one launch, no merge)


@triton.jit
def _attend_block(acc, l_i, m_i, q, K, V, start, hi, q_pos, offs_n, offs_d, d_ok,
                  stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, PRECISION: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N), of which those >= hi do not exist.

    Scores are in log2 units (qk_scale includes log2(e)), so exp2 replaces exp.
    """
    keys = start + offs_n                                                       # (BLOCK_N,)
    k_ok = keys < hi
    kT = tl.load(K + keys[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                 mask=d_ok[:, None] & k_ok[None, :], other=0.0)                 # (BLOCK_D, BLOCK_N)
    s = tl.dot(q, kT, input_precision=PRECISION) * qk_scale                    # (BLOCK_M, BLOCK_N)
    # causal, bottom-right; k_ok only matters for a split ending mid-block (the last: there keys >= L anyway)
    visible = k_ok[None, :] & (keys[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))                                       # (BLOCK_M,)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: keep exp2 finite
    alpha = tl.exp2(m_i - m_ref)                                                # rescales the old l, acc
    p = tl.exp2(s - m_ref[:, None])                                             # (BLOCK_M, BLOCK_N)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + keys[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=k_ok[:, None] & d_ok[None, :], other=0.0)                  # (BLOCK_N, BLOCK_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _decode_split_kernel(
        Q, K, V, LENS, O_PART, LSE, OUT,
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_on, stride_od,
        qk_scale, H_KV,
        N_Q: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
        USE_GDC: tl.constexpr):
    """grid = (NUM_SPLITS, B * H_KV, row blocks): one split of one kv head's cache, for BLOCK_M query rows.

    USE_GDC (launched with programmatic dependent launch, kernels/pdl.py): signal the next kernel, then wait for
    the previous one before reading anything (q, the cache and the lengths may all be its output).

    Row r of the GROUP * N_Q rows of a kv head is query head h_kv * GROUP + r // N_Q, new token r % N_Q.
    NUM_SPLITS > 1: writes O_PART (B*Hq*N_Q, NUM_SPLITS, HEAD_DIM) fp32 and LSE (B*Hq*N_Q, NUM_SPLITS) fp32.
    NUM_SPLITS == 1: writes the normalised result straight into OUT (B, Hq, N_Q, HEAD_DIM).
    """
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    split = tl.program_id(0)
    b = (tl.program_id(1) // H_KV).to(tl.int64)
    h_kv = (tl.program_id(1) % H_KV).to(tl.int64)
    L = tl.load(LENS + b).to(tl.int32)                                          # valid cache length

    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)                   # (BLOCK_M,)
    row_ok = rows < GROUP * N_Q
    h_q = h_kv * GROUP + rows // N_Q                                            # query head of each row
    i_q = rows % N_Q                                                            # new token of each row
    q_pos = L - N_Q + i_q                                                       # its position in the cache
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(Q + b * stride_qb + h_q[:, None] * stride_qh + i_q[:, None] * stride_qn
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    K += b * stride_kb + h_kv * stride_kh
    V += b * stride_vb + h_kv * stride_vh

    # This split's keys: [lo, hi), chunks a multiple of BLOCK_N; trailing splits of a short sequence are empty.
    chunk = tl.cdiv(tl.cdiv(L, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, L)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)                          # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)                                       # running sum of 2^(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)                              # running sum of 2^(s - m) v
    for start in range(lo, hi, BLOCK_N):
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, K, V, start, hi, q_pos, offs_n, offs_d, d_ok,
                                      stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, PRECISION)

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]                           # rows with no key: 0
    if NUM_SPLITS == 1:
        tl.store(OUT + b * stride_ob + h_q[:, None] * stride_oh + i_q[:, None] * stride_on
                 + offs_d[None, :] * stride_od, o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = ((b * (H_KV * GROUP) + h_q) * N_Q + i_q) * NUM_SPLITS + split    # (BLOCK_M,) row of O_PART
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(LSE + part, lse, mask=row_ok)
        tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_merge_kernel(O_PART, LSE, OUT, H_Q, stride_ob, stride_oh, stride_on, stride_od,
                         N_Q: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_S: tl.constexpr, TILE_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """grid = (B * Hq * N_Q,): merge one output row's NUM_SPLITS partials with their log-sum-exps."""
    row = tl.program_id(0).to(tl.int64)
    b, h, i = row // (H_Q * N_Q), (row // N_Q) % H_Q, row % N_Q
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(LSE + row * NUM_SPLITS + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))  # (BLOCK_S,)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp2(lse - m), 0)                                         # empty splits weigh 0

    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, NUM_SPLITS, TILE_S):                                     # tiles keep registers bounded
        offs_t = s0 + tl.arange(0, TILE_S)
        lse_t = tl.load(LSE + row * NUM_SPLITS + offs_t, mask=offs_t < NUM_SPLITS, other=float("-inf"))
        w = tl.exp2(lse_t - m)                                                  # (TILE_S,)
        o = tl.load(O_PART + (row * NUM_SPLITS + offs_t)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=(lse_t > float("-inf"))[:, None] & d_ok[None, :], other=0.0)  # (TILE_S, BLOCK_D)
        acc += tl.sum(w[:, None] * o, 0)
    out = acc / tl.where(denom == 0.0, 1.0, denom)
    tl.store(OUT + b * stride_ob + h * stride_oh + i * stride_on + offs_d * stride_od,
             out.to(OUT.dtype.element_ty), mask=d_ok)


_triton.check_decorated(_decode_split_kernel, _decode_merge_kernel)


def auto_num_splits(n_programs: int, max_len: int, device: torch.device) -> int:
    """Splits so that n_programs * splits ~ 4 programs per SM, never under the decode_min_keys_per_split option's
    keys of max_len (kernels.options).

    Depends only on shapes and options (no GPU sync), so it is safe inside CUDA graphs.
    """
    want = triton.cdiv(4 * _triton.sm_count(device), n_programs)
    if max_len <= SINGLE_SPLIT_MAX_LEN:
        return 1  # a short cache: the merge launch costs more than the split saves (bench/NOTES.md)
    useful = triton.cdiv(max_len, _options.get().decode_min_keys_per_split)
    return max(1, min(want, useful, MAX_SPLITS))


def _check(q, k_cache, v_cache, cache_lens, num_splits, out, check_lens) -> None:
    """Every ValueError the kernels could run into, raised before anything is launched."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_lens", cache_lens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"expected q (B, Hq, Nq, D) and caches (B, Hkv, max_len, D), got q{tuple(q.shape)} "
                         f"k_cache{tuple(k_cache.shape)} v_cache{tuple(v_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache{tuple(k_cache.shape)} and v_cache{tuple(v_cache.shape)} differ")
    B, Hq, Nq, D = q.shape
    Bk, Hkv, max_len, Dk = k_cache.shape
    if B != Bk or D != Dk:
        raise ValueError(f"q{tuple(q.shape)} and k_cache{tuple(k_cache.shape)} differ in batch or head dim")
    if B == 0 or Hq == 0 or Hkv == 0 or max_len == 0:
        raise ValueError(f"empty input: q{tuple(q.shape)} k_cache{tuple(k_cache.shape)}")
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if not 1 <= Nq <= MAX_NQ:
        raise ValueError(f"decode_attention takes 1..{MAX_NQ} new tokens, got Nq={Nq} (use flash attention "
                         "for prefill)")
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {D}")
    if Nq > max_len:
        raise ValueError(f"Nq={Nq} new tokens do not fit in a cache of max_len={max_len}")
    if q.dtype not in _triton.SUPPORTED_DTYPES or not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache, v_cache must share one dtype of float16/bfloat16/float32, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device == cache_lens.device):
        raise ValueError(f"all inputs must be on one device, got q on {q.device}, k_cache on {k_cache.device}, "
                         f"v_cache on {v_cache.device}, cache_lens on {cache_lens.device}")
    _triton.check_device(q.device, "decode_attention")
    if cache_lens.dtype not in (torch.int32, torch.int64) or tuple(cache_lens.shape) != (B,):
        raise ValueError(f"cache_lens must be an int32/int64 tensor of shape ({B},), got {cache_lens.dtype} "
                         f"{tuple(cache_lens.shape)}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be None or an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise ValueError("decode_attention is inference-only (no backward): call it under torch.no_grad()")
    capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if check_lens and not capturing:
        lo, hi = (int(x) for x in torch.aminmax(cache_lens))  # one sync
        if lo < Nq or hi > max_len:
            raise ValueError(f"cache_lens must lie in [Nq, max_len] = [{Nq}, {max_len}] (they include the new "
                             f"tokens), got values in [{lo}, {hi}]")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lens: torch.Tensor,
                     *, sm_scale: float | None = None, num_splits: int | None = None,
                     out: torch.Tensor | None = None, check_lens: bool = True) -> torch.Tensor:
    """Causal attention of q's Nq new tokens to each sequence's valid cache prefix. Returns (B, Hq, Nq, D).

    See the module docstring for what is supported. `out` (optional) receives the result; `check_lens=False`
    skips reading cache_lens back to validate it (a GPU sync).
    """
    _check(q, k_cache, v_cache, cache_lens, num_splits, out, check_lens)
    B, Hq, Nq, D = q.shape
    Hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    if out is None:
        out = _triton.empty(q.shape, q.dtype, q.device)  # contiguous

    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_M = min(max(16, triton.next_power_of_2(group * Nq)), MAX_ROWS)  # tl.dot needs >= 16 rows
    BLOCK_N = 64 if BLOCK_D <= 128 else 32
    row_blocks = triton.cdiv(group * Nq, BLOCK_M)
    if num_splits is None:
        num_splits = auto_num_splits(B * Hkv * row_blocks, max_len, q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    # Three K/V tiles in flight, two when a tile row is wide (fp32 or D > 128) to stay within shared memory.
    launch = dict(num_warps=4 if BLOCK_D <= 128 else 8, num_stages=3 if BLOCK_D * q.element_size() <= 256 else 2)
    pdl = pdl_enabled(q.device)

    if num_splits == 1:
        o_part = lse = out  # unused by the kernel
    else:
        o_part = _triton.empty((B * Hq * Nq, num_splits, D), torch.float32, q.device)
        lse = _triton.empty((B * Hq * Nq, num_splits), torch.float32, q.device)
    with _triton.device_guard(q):
        _decode_split_kernel[(num_splits, B * Hkv, row_blocks)](
            q, k_cache, v_cache, cache_lens, o_part, lse, out,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
            scale * _triton.LOG2E, Hkv,
            N_Q=Nq, GROUP=group, HEAD_DIM=D, NUM_SPLITS=num_splits,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, PRECISION=precision, USE_GDC=pdl,
            **launch, **(dict(launch_pdl=True) if pdl else {}))
        if num_splits > 1:
            _decode_merge_kernel[(B * Hq * Nq,)](
                o_part, lse, out, Hq, *out.stride(),
                N_Q=Nq, HEAD_DIM=D, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
                TILE_S=min(16, triton.next_power_of_2(num_splits)), BLOCK_D=BLOCK_D, num_warps=4)
    return out


__all__ = ["decode_attention", "auto_num_splits", "MAX_NQ", "MIN_HEAD_DIM", "MAX_HEAD_DIM"]
