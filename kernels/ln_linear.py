"""Fused norm → linear → bias → activation / residual for a few rows: the matmuls of a decode step.

    ln_linear(x, weight, bias=None, *, ln=None, rms=False, gelu=False, swiglu=False, residual=None,
              ln_stats=None, stats_out=None, pdl=False)
    ln_qkv_to_cache(x, weight, bias, ln, k_cache, v_cache, pos, n_q, *, rms=False, rope=None, pdl=False)
        -> q (M, n_q)                                                       [k, v into the caches; q, k rotated]
    embed_with_stats(tok, pos, wte, wpe, stats) -> x (M, C)                 [token (+ position) embedding]

At decode time every linear layer of a small transformer is a matrix-vector product: a few kilobytes of
activations against megabytes of weights. Each such op is bound by its launch and memory latency, not by
FLOPs, so the lever is the number of kernels: this one kernel does what eager PyTorch does in up to six (norm,
matmul, bias, activation, residual add, RoPE), and the QKV variant also writes k and v straight into the KV
cache at each sequence's position (no scatter kernels).

    y = act(N(x) @ Wᵀ + b) + residual       N, b, act and residual optional
    N     LayerNorm (GPT-2) or RMSNorm (rms=True: x / sqrt(mean(x²) + eps) · g, Llama)
    act   GELU (tanh approximation), or SwiGLU (swiglu=True: W holds [gate (I) | up (I)] rows and
          y = SiLU(N(x) W_gateᵀ + b_gate) · (N(x) W_upᵀ + b_up), I columns)
    RoPE  (ln_qkv_to_cache(rope=(cos, sin))) each q and k head rotated in the rotate-half layout: the pair of
          lanes (i, i + D/2) of a head of the token at position p turns by the angle whose cos and sin are
          cos[p, i] and sin[p, i]; v is stored as it is

SwiGLU and RoPE need two output columns per result (gate and up; a lane and its partner D/2 away), so in
those modes each program computes BLOCK_N column pairs with two accumulators from two sets of weight rows.

The norm needs each row's statistics before the first matmul step. Computed in place, that is a pass over x
that every program makes before it streams its weights; instead, the kernel that writes a residual stream can
leave the row sums (Σy, Σy²) behind (stats_out) and the next norm read them (ln_stats; RMSNorm uses Σy² only).

Supported (checked with a ValueError before any launch):
    dtypes     float16, bfloat16, float32; x, weight, residual, output, caches and RoPE tables of one dtype;
               norm statistics and accumulation in float32; float32 uses exact ("ieee") dots
    shapes     x (M, K) with unit stride along K, any M >= 1 (rows in blocks of 16); weight (N, K) as
               nn.Linear stores it, unit stride along K; any N, K >= 1 (tails masked; SwiGLU: N even; RoPE:
               head dim even)
    devices    CUDA; CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, for tests)
Rounding follows eager PyTorch in the model's dtype: LayerNorm(x) is rounded to the dtype before the matmul;
RMSNorm rounds x / rms before the gain and the product after (model/norms.py); the linear output (with bias) is
rounded before the activation, RoPE and the residual add; SiLU(gate) and its product with up are rounded, and
so are RoPE's two products and their sum (model/rope.py). Inference only (no backward).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import _triton
from .pdl import pdl_enabled

BLOCK_M = 16  # rows per program (tl.dot needs 16); a decode step has batch-size rows


@triton.jit
def _x_tile(x_rows, LN_W, LN_B, offs_k, k_ok, m_ok, mean, rstd, dtype: tl.constexpr,
            HAS_LN: tl.constexpr, LN_HAS_BIAS: tl.constexpr, RMS: tl.constexpr, OFFSET: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) activation tile at columns offs_k, normalised and rounded to dtype if HAS_LN
    (OFFSET: an RMSNorm whose gain is 1 + LN_W, all in fp32 and rounded once, as Gemma's)."""
    xk = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
    if HAS_LN:
        g = tl.load(LN_W + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if OFFSET:  # Gemma: x / rms · (1 + w) in fp32, rounded once
            xk = (xk.to(tl.float32) * rstd[:, None] * (1.0 + g[None, :])).to(dtype)
        elif RMS:  # eager rounds x / rms to dtype, then the product with the gain
            xn = (xk.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
            xk = (xn * g[None, :]).to(dtype)
        else:
            xn = (xk.to(tl.float32) - mean[:, None]) * rstd[:, None] * g[None, :]
            if LN_HAS_BIAS:
                xn += tl.load(LN_B + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            xk = xn.to(dtype)                                                   # eager rounds LN(x) here
    return xk


@triton.jit(do_not_specialize=["M"])  # one binary serves every batch size
def _ln_linear_kernel(X, W, BIAS, LN_W, LN_B, RES, OUT, KC, VC, POS, WS, CNT, STATS_IN, STATS_OUT, COS, SIN,
                      QN, KN, M, N, K, stride_xm, stride_wn, stride_rm, stride_om, eps, qk_eps, q_scale,
                      N_Q, N_KV, stride_cb, stride_ch, stride_cn, stride_cd, stride_pos, stride_rope, PAIR_H,
                      stride_ws,
                      HAS_LN: tl.constexpr, LN_STATS_IN: tl.constexpr, STATS_OUT_ON: tl.constexpr,
                      LN_HAS_BIAS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      GELU: tl.constexpr, HAS_RES: tl.constexpr, QKV_CACHE: tl.constexpr, HEAD_DIM: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ONE_TILE: tl.constexpr,
                      USE_GDC: tl.constexpr, RMS: tl.constexpr, SWIGLU: tl.constexpr, ROPE: tl.constexpr,
                      PAIRED: tl.constexpr, QK_NORM: tl.constexpr, OFFSET: tl.constexpr, GEGLU: tl.constexpr,
                      Q_SCALED: tl.constexpr):
    """grid = (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K): BLOCK_N output columns of BLOCK_M rows per program,
    over the program's share of K.

    ONE_TILE: the share is at most BLOCK_K long, so the program loads its weights as one tile, first.
    USE_GDC (launched with programmatic dependent launch, kernels/pdl.py): the program signals the next kernel
    at once, loads its weight tile (ONE_TILE), then waits for the previous kernel before it reads anything that
    kernel may have written (x, statistics, residual, positions, workspace) or writes anything.

    SPLIT_K > 1 (split-K, for few output tiles over a long K): each program adds its partial sums into the fp32
    workspace WS (zeros; row stride stride_ws: N columns, or 2N when PAIRED with the second rows' sums at + N)
    with atomics and counts itself in CNT[tile]; the last one of a tile reads the sums, zeroes the workspace tile
    and the counter again (for the next call) and runs the epilogue.

    LN_STATS_IN: the norm's row sums (Σx, Σx²) come from STATS_IN (M, 2) instead of a pass over x.
    STATS_OUT_ON: the epilogue adds its stored outputs' (Σy, Σy²) per row into STATS_OUT (M, 2) (zeros before the
    launch): the next norm's statistics, produced by the kernel that writes the residual stream.
    RMS: the norm is an RMSNorm (rstd from Σx² alone, no centring, no bias).

    PAIRED (SWIGLU or ROPE): N counts column pairs. Pair n takes weight rows r1 = (n // PAIR_H)·2·PAIR_H +
    n % PAIR_H and r2 = r1 + PAIR_H: SWIGLU has PAIR_H = N (gate row n, up row N + n) and writes SiLU(gate)·up
    to column n; ROPE (with QKV_CACHE) has PAIR_H = HEAD_DIM / 2, so r1 and r2 are lanes i and i + D/2 of one
    head, rotated by COS/SIN[POS[m], i] (tables of row stride stride_rope) when that head is a q or k head.
    QK_NORM (with ROPE, BLOCK_N = HEAD_DIM / 2: a tile is one head): a q or k head is RMS-normalised over its
    HEAD_DIM lanes (eps qk_eps) and scaled by the QN (q heads) or KN (k heads) gain (HEAD_DIM,) before the
    rotation, each step rounded as the eager model rounds it (Qwen3's q_norm and k_norm).
    OFFSET (with RMS): every norm gain, LN_W and (QK_NORM) QN and KN, is stored as its offset from 1: the norm is
    x / rms · (1 + w) in fp32, rounded once (Gemma's RMSNorm).
    GEGLU (with SWIGLU's pairing): GELU(gate) (tanh approximation) in SiLU's place (Gemma's MLP).
    Q_SCALED (with ROPE): the q heads multiplied by q_scale (rounded) after their norm, before the rotation
    (Gemma's query_pre_attn_scalar, as the model's q_scale).

    QKV_CACHE: columns [0, N_Q) go to OUT (the queries); [N_Q, N_Q + N_KV) are keys and [N_Q + N_KV, ...)
    values, column c of them being head c // HEAD_DIM, lane c % HEAD_DIM, written into KC / VC
    (B, Hkv, max_len, D) at row m's position POS[m].
    """
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)                # (BLOCK_M,)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)                # (BLOCK_N,)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm                      # (BLOCK_M, 1)
    if PAIRED:
        rows1 = (offs_n // PAIR_H) * (2 * PAIR_H) + offs_n % PAIR_H            # (BLOCK_N,) weight rows of pair n
        rows2 = rows1 + PAIR_H
    else:
        rows1 = offs_n
        rows2 = offs_n
    w_rows = W + rows1.to(tl.int64)[:, None] * stride_wn                       # (BLOCK_N, 1)
    w_rows2 = W + rows2.to(tl.int64)[:, None] * stride_wn                      # (BLOCK_N, 1) (paired modes)
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K                     # this program's share of K
    k_lo = tl.program_id(2) * k_per
    k_hi = tl.minimum(k_lo + k_per, K)

    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start streaming its own weights
    if ONE_TILE:  # weights first: with USE_GDC this load overlaps the end of the previous kernel
        offs_k1 = k_lo + tl.arange(0, BLOCK_K)                                  # (BLOCK_K,)
        k_ok1 = offs_k1 < k_hi
        w1 = tl.load(w_rows + offs_k1[None, :], mask=n_ok[:, None] & k_ok1[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
        if PAIRED:
            w1b = tl.load(w_rows2 + offs_k1[None, :], mask=n_ok[:, None] & k_ok1[None, :], other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # the previous kernel is done and its writes are visible

    mean = tl.zeros([BLOCK_M], tl.float32)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if HAS_LN:  # row statistics over all K, one pass: var = E[x²] - mean² in fp32
        if LN_STATS_IN:
            s1 = tl.load(STATS_IN + offs_m * 2, mask=m_ok, other=0.0)           # (BLOCK_M,)
            s2 = tl.load(STATS_IN + offs_m * 2 + 1, mask=m_ok, other=0.0)
        else:
            s1 = tl.zeros([BLOCK_M], tl.float32)
            s2 = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                xs = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :],
                             other=0.0).to(tl.float32)                          # (BLOCK_M, BLOCK_K)
                s1 += tl.sum(xs, 1)
                s2 += tl.sum(xs * xs, 1)
        if RMS:
            rstd = 1.0 / tl.sqrt(s2 / K + eps)                                  # (BLOCK_M,)
        else:
            mean = s1 / K                                                       # (BLOCK_M,)
            rstd = 1.0 / tl.sqrt(tl.maximum(s2 / K - mean * mean, 0.0) + eps)   # (BLOCK_M,)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)                            # paired modes: the second rows
    if ONE_TILE:
        xk = _x_tile(x_rows, LN_W, LN_B, offs_k1, k_ok1, m_ok, mean, rstd, W.dtype.element_ty, HAS_LN, LN_HAS_BIAS,
                     RMS, OFFSET)
        acc = tl.dot(xk, tl.trans(w1), acc, input_precision=PRECISION)        # (BLOCK_M, BLOCK_N)
        if PAIRED:
            acc2 = tl.dot(xk, tl.trans(w1b), acc2, input_precision=PRECISION)
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)                                 # (BLOCK_K,)
            k_ok = offs_k < k_hi
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
            xk = _x_tile(x_rows, LN_W, LN_B, offs_k, k_ok, m_ok, mean, rstd, W.dtype.element_ty, HAS_LN,
                         LN_HAS_BIAS, RMS, OFFSET)                              # (BLOCK_M, BLOCK_K)
            acc = tl.dot(xk, tl.trans(w), acc, input_precision=PRECISION)      # (BLOCK_M, BLOCK_N)
            if PAIRED:
                w2 = tl.load(w_rows2 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                acc2 = tl.dot(xk, tl.trans(w2), acc2, input_precision=PRECISION)

    epi = (BIAS, RES, OUT, KC, VC, POS, STATS_OUT, COS, SIN, QN, KN, qk_eps, q_scale, offs_m, offs_n, rows1, rows2,
           m_ok, n_ok, N, stride_rm, stride_om, N_Q, N_KV, stride_cb, stride_ch, stride_cn, stride_cd, stride_pos,
           stride_rope)
    if SPLIT_K == 1:
        _epilogue(acc, acc2, *epi, HAS_BIAS, GELU, HAS_RES, QKV_CACHE, HEAD_DIM, STATS_OUT_ON, SWIGLU, ROPE,
                  QK_NORM, OFFSET, GEGLU, Q_SCALED)
    else:
        ws_ptrs = WS + offs_m.to(tl.int64)[:, None] * stride_ws + offs_n[None, :]  # (BLOCK_M, BLOCK_N)
        mn_ok = m_ok[:, None] & n_ok[None, :]
        # acq_rel: each thread's adds are performed before it reaches the barrier, so that the counter's release
        # below (one thread) covers the whole tile's partial sums
        tl.atomic_add(ws_ptrs, acc, mask=mn_ok, sem="acq_rel")
        if PAIRED:
            tl.atomic_add(ws_ptrs + N, acc2, mask=mn_ok, sem="acq_rel")
        tl.debug_barrier()
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(CNT + tile, 1, sem="acq_rel") == SPLIT_K - 1:  # the last program of this tile
            zero = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            total = tl.atomic_add(ws_ptrs, zero, mask=mn_ok)  # read at the point of coherence (not a stale L1)
            total = tl.where(mn_ok, total, 0.0)  # masked lanes of an atomic return nothing defined
            tl.store(ws_ptrs, zero, mask=mn_ok)  # left zeroed: every other program of the tile is done with it
            total2 = zero
            if PAIRED:
                total2 = tl.atomic_add(ws_ptrs + N, zero, mask=mn_ok)
                total2 = tl.where(mn_ok, total2, 0.0)
                tl.store(ws_ptrs + N, zero, mask=mn_ok)
            tl.atomic_xchg(CNT + tile, 0)
            _epilogue(total, total2, *epi, HAS_BIAS, GELU, HAS_RES, QKV_CACHE, HEAD_DIM, STATS_OUT_ON, SWIGLU,
                      ROPE, QK_NORM, OFFSET, GEGLU, Q_SCALED)


@triton.jit
def _rounded(y, dtype: tl.constexpr):
    """y rounded to dtype (as eager stores an intermediate), back in fp32."""
    return y.to(dtype).to(tl.float32)


@triton.jit
def _gelu_tanh(y):
    """GELU's tanh approximation in fp32; tanh(z) = 1 - 2 / (exp(2z) + 1), 2z clamped where tanh is 1 anyway."""
    z = 0.7978845608028654 * (y + 0.044715 * y * y * y)
    return 0.5 * y * (2.0 - 2.0 / (tl.exp(tl.minimum(2.0 * z, 60.0)) + 1.0))


@triton.jit
def _biased(acc, BIAS, rows, n_ok, dtype: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc + bias[rows], rounded to dtype (the linear's output, as eager stores it), back in fp32."""
    if HAS_BIAS:
        acc += tl.load(BIAS + rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return acc.to(dtype).to(tl.float32)


@triton.jit
def _store_qkv(y, OUT, KC, VC, pos, offs_m, cols, ok, stride_om, N_Q, N_KV, stride_cb, stride_ch, stride_cn,
               stride_cd, HEAD_DIM: tl.constexpr):
    """Columns cols (BLOCK_N,) of the packed [q | k | v] projection of rows offs_m: q into OUT, k and v into the
    caches at each row's position pos (BLOCK_M,); ok (BLOCK_M, BLOCK_N) masks the tile."""
    out_ptrs = OUT + offs_m.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, y, mask=ok & (cols < N_Q)[None, :])
    row = offs_m.to(tl.int64)[:, None] * stride_cb + pos[:, None] * stride_cn  # (BLOCK_M, 1)
    c = tl.where(cols >= N_Q + N_KV, cols - N_Q - N_KV, tl.maximum(cols - N_Q, 0))  # within k or v
    col = (c // HEAD_DIM) * stride_ch + (c % HEAD_DIM) * stride_cd             # (BLOCK_N,)
    is_k = (cols >= N_Q) & (cols < N_Q + N_KV)
    tl.store(KC + row + col[None, :], y, mask=ok & is_k[None, :])
    tl.store(VC + row + col[None, :], y, mask=ok & (cols >= N_Q + N_KV)[None, :])


@triton.jit
def _epilogue(acc, acc2, BIAS, RES, OUT, KC, VC, POS, STATS_OUT, COS, SIN, QN, KN, qk_eps, q_scale, offs_m, offs_n,
              rows1,
              rows2, m_ok, n_ok, N, stride_rm, stride_om, N_Q, N_KV, stride_cb, stride_ch, stride_cn, stride_cd,
              stride_pos, stride_rope, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, HAS_RES: tl.constexpr,
              QKV_CACHE: tl.constexpr, HEAD_DIM: tl.constexpr, STATS_OUT_ON: tl.constexpr, SWIGLU: tl.constexpr,
              ROPE: tl.constexpr, QK_NORM: tl.constexpr, OFFSET: tl.constexpr, GEGLU: tl.constexpr,
              Q_SCALED: tl.constexpr):
    """bias, activation, residual, store (or q / k norms, RoPE and the q / k-cache / v-cache split) of one
    (BLOCK_M, BLOCK_N) fp32 tile (acc2: the second rows of each pair in the paired modes)."""
    mn_ok = m_ok[:, None] & n_ok[None, :]
    if ROPE:  # QKV_CACHE with column pairs (lane i, lane i + D/2) of one head
        y1 = _biased(acc, BIAS, rows1, n_ok, OUT.dtype.element_ty, HAS_BIAS)  # (BLOCK_M, BLOCK_N) lanes i
        y2 = _biased(acc2, BIAS, rows2, n_ok, OUT.dtype.element_ty, HAS_BIAS)  # lanes i + D/2
        pos = tl.load(POS + offs_m * stride_pos, mask=m_ok, other=0).to(tl.int64)  # (BLOCK_M,)
        lane = rows1 % HEAD_DIM                                                 # (BLOCK_N,) < HEAD_DIM / 2
        turn = mn_ok & (rows1 < N_Q + N_KV)[None, :]                            # q and k heads only
        if QK_NORM:  # the tile is one head: x / sqrt(mean(x²) + eps) over its lanes, rounded, times the gain
            ss = tl.sum(tl.where(mn_ok, y1 * y1 + y2 * y2, 0.0), 1)             # (BLOCK_M,)
            rstd = 1.0 / tl.sqrt(ss / HEAD_DIM + qk_eps)
            is_q = (rows1 < N_Q)[None, :]                                       # (1, BLOCK_N)
            g1 = tl.where(is_q, tl.load(QN + lane, mask=n_ok, other=0.0)[None, :],
                          tl.load(KN + lane, mask=n_ok, other=0.0)[None, :]).to(tl.float32)  # (1, BLOCK_N)
            g2 = tl.where(is_q, tl.load(QN + lane + HEAD_DIM // 2, mask=n_ok, other=0.0)[None, :],
                          tl.load(KN + lane + HEAD_DIM // 2, mask=n_ok, other=0.0)[None, :]).to(tl.float32)
            if OFFSET:  # Gemma: x / rms · (1 + w) in fp32, rounded once
                n1 = _rounded(y1 * rstd[:, None] * (1.0 + g1), OUT.dtype.element_ty)
                n2 = _rounded(y2 * rstd[:, None] * (1.0 + g2), OUT.dtype.element_ty)
            else:
                n1 = _rounded(_rounded(y1 * rstd[:, None], OUT.dtype.element_ty) * g1, OUT.dtype.element_ty)
                n2 = _rounded(_rounded(y2 * rstd[:, None], OUT.dtype.element_ty) * g2, OUT.dtype.element_ty)
            y1 = tl.where(turn, n1, y1)                                         # v heads as they are
            y2 = tl.where(turn, n2, y2)
        if Q_SCALED:  # q · q_scale, rounded as eager multiplies it (RoPE is linear: before it is the same)
            scaled = mn_ok & (rows1 < N_Q)[None, :]
            y1 = tl.where(scaled, _rounded(y1 * q_scale, OUT.dtype.element_ty), y1)
            y2 = tl.where(scaled, _rounded(y2 * q_scale, OUT.dtype.element_ty), y2)
        angle = pos[:, None] * stride_rope + lane[None, :]                      # (BLOCK_M, BLOCK_N)
        cos = tl.load(COS + angle, mask=turn, other=1.0).to(tl.float32)
        sin = tl.load(SIN + angle, mask=turn, other=0.0).to(tl.float32)
        # rotate-half as eager rounds it: x·cos and rotate_half(x)·sin rounded, then their sum
        r1 = _rounded(y1 * cos, OUT.dtype.element_ty) + _rounded(-y2 * sin, OUT.dtype.element_ty)  # (BLOCK_M, BLOCK_N)
        r2 = _rounded(y2 * cos, OUT.dtype.element_ty) + _rounded(y1 * sin, OUT.dtype.element_ty)
        _store_qkv(r1.to(OUT.dtype.element_ty), OUT, KC, VC, pos, offs_m, rows1, mn_ok, stride_om, N_Q, N_KV,
                   stride_cb, stride_ch, stride_cn, stride_cd, HEAD_DIM)
        _store_qkv(r2.to(OUT.dtype.element_ty), OUT, KC, VC, pos, offs_m, rows2, mn_ok, stride_om, N_Q, N_KV,
                   stride_cb, stride_ch, stride_cn, stride_cd, HEAD_DIM)
    else:
        if SWIGLU:  # SiLU(gate) · up (GEGLU: GELU(gate) · up), each step rounded as eager
            gate = _biased(acc, BIAS, rows1, n_ok, OUT.dtype.element_ty, HAS_BIAS)  # (BLOCK_M, BLOCK_N)
            up = _biased(acc2, BIAS, rows2, n_ok, OUT.dtype.element_ty, HAS_BIAS)
            if GEGLU:
                act = _rounded(_gelu_tanh(gate), OUT.dtype.element_ty)
            else:
                act = _rounded(gate / (1.0 + tl.exp(-gate)), OUT.dtype.element_ty)
            y = act * up
        else:
            if HAS_BIAS:
                acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            y = acc.to(OUT.dtype.element_ty).to(tl.float32)                   # the linear's output dtype
        if GELU:
            y = _gelu_tanh(y)
        if HAS_RES:
            y = y.to(OUT.dtype.element_ty).to(tl.float32) + tl.load(
                RES + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :], mask=mn_ok, other=0.0).to(tl.float32)
        y = y.to(OUT.dtype.element_ty)
        if QKV_CACHE:
            pos = tl.load(POS + offs_m * stride_pos, mask=m_ok, other=0).to(tl.int64)  # (BLOCK_M,)
            _store_qkv(y, OUT, KC, VC, pos, offs_m, offs_n, mn_ok, stride_om, N_Q, N_KV, stride_cb, stride_ch,
                       stride_cn, stride_cd, HEAD_DIM)
        else:
            tl.store(OUT + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], y, mask=mn_ok)
        if STATS_OUT_ON:  # this tile's share of the next norm's row sums, from the values as stored
            ys = tl.where(mn_ok, y.to(tl.float32), 0.0)
            tl.atomic_add(STATS_OUT + offs_m * 2, tl.sum(ys, 1), mask=m_ok, sem="relaxed")
            tl.atomic_add(STATS_OUT + offs_m * 2 + 1, tl.sum(ys * ys, 1), mask=m_ok, sem="relaxed")
_forced: tuple | None = None  # (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) for every launch


@contextlib.contextmanager
def forced_config(cfg: tuple):
    """Run every launch with one config (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): tests, sweeps.

    BLOCK_N is the kernel's: column pairs in the paired modes (SwiGLU, RoPE), as pick_config(paired=True) gives it.
    A qk_norm launch (ln_qkv_to_cache) still takes a tile of one head: its BLOCK_N, and BLOCK_K and SPLIT_K in
    proportion, are set from the head dim as for any config.
    """
    global _forced
    old, _forced = _forced, cfg
    try:
        yield
    finally:
        _forced = old


# Tiles under programmatic dependent launch (kernels/pdl.py), chosen on whole decode steps (bench/NOTES.md):
# every program's share of K is one tile, loaded before the wait on the previous kernel; one-tile launches 32
# columns wide with 8 warps for up to PDL_FEW_ROWS rows, 64 wide above; the down projection in shares of
# 512 x 64 with 8 warps. Chosen at batch 1 and 16: where between them the 64-column tiles start to win is open.
PDL_TILES = dict(preload=True, block_n_few_rows=32, block_n=64, warps=8, split_block_k=512, split_block_n=64,
                 split_warps=8, max_one_tile_k=1024)
PDL_FEW_ROWS = 4
# The paired modes (SwiGLU, RoPE-QKV) have tiles of their own under PDL (K up to max_one_tile_k): their two dots
# share one activation tile, which a program over the whole K holds in registers for both. `ptxas -v` at sm_90
# (Triton 3.9, fp16 and bf16, SmolLM2-135M and Qwen2-0.5B shapes): the GPT-2 tiles halved, 16 pairs x 1024
# (batch <= PDL_FEW_ROWS) and 32 x 1024 (above), 8 warps, spill 1,848-1,896 B per thread at 128 registers and
# 272-296 B at 255; 16, 32 or 64 pairs x 1024 at 1 to 8 warps and 16 x 512 at 2 to 8 warps spill too. One-tile
# shares of 256 along K (split-K: 3 shares at K = 576, 4 at 896) of 32 pairs (64 weight rows, as a 64-column
# GPT-2 tile) with 8 warps: 106 (SwiGLU) and 114 (RoPE-QKV) registers, no spills, at batch 1, 8 and 16.
# Without PDL the halved GPT-2 tile (16 pairs x 256 steps, 4 warps, 3 stages) stays: 168 registers, no spills.
# Only up to PDL_FEW_ROWS rows: at SmolLM2-135M's shape the decode step took 784 instead of 1,899 us at batch 1
# but 994 instead of 796 us at batch 16 (bench/results/generate_smollm2/), so above it the halved GPT-2 tile
# (32 pairs x 1024, 272-296 B of spills) stays.
PDL_PAIRED_TILES = dict(block_n=32, block_k=256, warps=8)


def pick_config(M: int, N: int, K: int, device: torch.device, pdl: bool = False, paired: bool = False) -> tuple:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) for one launch; shapes only, so graph-safe.

    paired (SwiGLU, RoPE): N counts column pairs (two weight rows each) and so does the BLOCK_N returned. Under
    PDL with K up to PDL_TILES["max_one_tile_k"] and at most PDL_FEW_ROWS rows, PDL_PAIRED_TILES in one-tile
    shares of K; otherwise the tile of the unpaired launch over the 2N weight rows, its column block halved.

    Without PDL (chosen on the GPT-2 decode shapes at batch 1 and 16, bench/NOTES.md): 16-column tiles for
    N <= 1024, 32 above; split-K (32 x 128 tiles, up to 8 splits of >= 3 steps) only for a long K over fewer
    tiles than SMs (the MLP's down projection).
    With PDL (pdl=True): K up to PDL_TILES["max_one_tile_k"] in one tile per program; a longer K over fewer
    tiles than SMs split into one-tile shares of split_block_k; otherwise (or with preload off) the non-PDL choice.
    With PDL a kernel's own time matters less than how it overlaps its neighbours, so PDL_TILES comes from
    whole decode steps.
    """
    if _forced is not None:
        return _forced
    if paired:
        t = PDL_PAIRED_TILES
        if pdl and PDL_TILES["preload"] and K <= PDL_TILES["max_one_tile_k"] and M <= PDL_FEW_ROWS:
            block_k = min(t["block_k"], triton.next_power_of_2(K))
            return t["block_n"], block_k, t["warps"], 1, triton.cdiv(K, block_k)
        block_n, block_k, warps, stages, split = pick_config(M, 2 * N, K, device, pdl)
        return max(16, block_n // 2), block_k, warps, stages, split
    if pdl and PDL_TILES["preload"]:
        t = PDL_TILES
        if K <= t["max_one_tile_k"]:
            block_n = t["block_n_few_rows"] if M <= PDL_FEW_ROWS else t["block_n"]
            return block_n, triton.next_power_of_2(K), t["warps"], 1, 1
        tiles = triton.cdiv(N, t["split_block_n"]) * triton.cdiv(M, BLOCK_M)
        if tiles < _triton.sm_count(device):
            return t["split_block_n"], t["split_block_k"], t["split_warps"], 1, triton.cdiv(K, t["split_block_k"])
    block_n = 16 if N <= 1024 else 32  # more, narrower tiles for the short outputs
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, BLOCK_M)
    if K >= 2048 and tiles < _triton.sm_count(device):  # a long reduction over few tiles: split K
        block_n, block_k, split = 32, 128, 1
        while split < 8 and K // (2 * split) >= 3 * block_k:
            split *= 2
        return block_n, block_k, 4, 3, split
    return block_n, 256, 4, 3, 1


_workspaces: dict = {}


def _workspace(device: torch.device, rows: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K fp32 sums (rows, N) and per-tile counters, zeros; every launch leaves them zeroed again.

    Allocated once per (device, rows, N) and kept, so that a CUDA graph captures stable addresses. Launches
    on one device run in stream order, so consecutive ones can share them.
    """
    key = (device, rows, N)
    if key not in _workspaces:
        _workspaces[key] = (torch.zeros(rows, N, dtype=torch.float32, device=device),
                            torch.zeros(triton.cdiv(rows, BLOCK_M) * triton.cdiv(N, 16), dtype=torch.int32,
                                        device=device))
    return _workspaces[key]


def _check(x, weight, bias, ln, residual, caches, n_out: int | None = None) -> None:
    """n_out: the result's columns (default the weight's rows); the residual must have as many."""
    tensors = [("x", x), ("weight", weight)] + [(n, t) for n, t in (("bias", bias), ("residual", residual))
                                                if t is not None]
    if ln is not None:
        tensors += [("ln weight", ln[0])] + ([("ln bias", ln[1])] if ln[1] is not None else [])
    tensors += [(f"cache {i}", t) for i, t in enumerate(caches)]
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"ln_linear: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != x.device:
            raise ValueError(f"ln_linear: {name} is on {t.device}, x on {x.device}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"ln_linear: expected x (M, K) and weight (N, K), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.shape[0] == 0 or weight.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"ln_linear: empty input x{tuple(x.shape)} weight{tuple(weight.shape)}")
    if (x.dtype not in _triton.SUPPORTED_DTYPES or weight.dtype != x.dtype or any(t.dtype != x.dtype for t in caches)
            or (residual is not None and residual.dtype != x.dtype)):
        raise ValueError(f"ln_linear: x, weight, residual and caches must share one of float16/bfloat16/float32, "
                         f"got x {x.dtype}, weight {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("ln_linear: x and weight need unit stride along K")
    N, K = weight.shape
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"ln_linear: bias must have shape ({N},), got {tuple(bias.shape)}")
    if ln is not None and (tuple(ln[0].shape) != (K,) or (ln[1] is not None and tuple(ln[1].shape) != (K,))):
        raise ValueError(f"ln_linear: norm weight/bias must have shape ({K},)")
    n_out = N if n_out is None else n_out
    if residual is not None and (tuple(residual.shape) != (x.shape[0], n_out) or residual.stride(1) != 1):
        raise ValueError(f"ln_linear: residual must be ({x.shape[0]}, {n_out}) with unit stride along N")
    _triton.check_device(x.device, "ln_linear")
    if torch.is_grad_enabled() and any(t.requires_grad for _, t in tensors):
        raise ValueError("ln_linear is inference-only (no backward): call it under torch.no_grad()")


def _check_stats(x, ln_stats, stats_out, ln) -> None:
    for name, t in (("ln_stats", ln_stats), ("stats_out", stats_out)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device != x.device
                              or tuple(t.shape) != (x.shape[0], 2) or t.stride() != (2, 1)):
            raise ValueError(f"ln_linear: {name} must be a contiguous float32 ({x.shape[0]}, 2) tensor on {x.device}")
    if ln_stats is not None and ln is None:
        raise ValueError("ln_linear: ln_stats given without a LayerNorm (ln=None)")


def _launch(x, weight, bias, ln, residual, out, gelu, qkv=None, ln_stats=None, stats_out=None, pdl=False,
            rms=False, swiglu=False, rope=None, qk_norm=None, norm_offset=False, geglu=False, q_scale=1.0):
    M, K = x.shape
    N = out.shape[1] if qkv is None else weight.shape[0]  # output columns (SwiGLU: half the weight's rows)
    ln_w, ln_b, eps = ln if ln is not None else (None, None, 0.0)
    if qkv is None:
        kc = vc = pos = out  # unused
        n_q = n_kv = head_dim = 1
        cache_strides, stride_pos = (0, 0, 0, 0), 0
    else:
        kc, vc, pos, n_q = qkv
        head_dim = kc.shape[3]
        n_kv = kc.shape[1] * head_dim
        cache_strides, stride_pos = kc.stride(), pos.stride(0)
    paired = swiglu or rope is not None
    # the paired modes count column pairs: pair n reads weight rows r1 = (n // h)·2h + n % h and r1 + h
    pair_h = N if swiglu else head_dim // 2 if rope is not None else 1
    n_cols = N // 2 if rope is not None else N  # tiles of the grid: output columns, or pairs under RoPE
    cos, sin = rope if rope is not None else (out, out)  # unused without RoPE
    dummy = weight  # pointer for the absent optional tensors (never read: their flags are off)
    q_gain, k_gain, qk_eps = qk_norm if qk_norm is not None else (dummy, dummy, 0.0)
    args = (x, weight, bias if bias is not None else dummy, ln_w if ln_w is not None else dummy,
            ln_b if ln_b is not None else dummy, residual if residual is not None else dummy, out, kc, vc, pos)
    scalars = (M, n_cols, K, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0,
               out.stride(0), float(eps), float(qk_eps), float(q_scale), n_q, n_kv, *cache_strides, stride_pos,
               cos.stride(0) if rope is not None else 0, pair_h)
    flags = dict(HAS_LN=ln is not None, LN_STATS_IN=ln_stats is not None, STATS_OUT_ON=stats_out is not None,
                 LN_HAS_BIAS=ln_b is not None, HAS_BIAS=bias is not None, GELU=bool(gelu),
                 HAS_RES=residual is not None, QKV_CACHE=qkv is not None, HEAD_DIM=head_dim,
                 PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=BLOCK_M,
                 RMS=bool(rms), SWIGLU=bool(swiglu), ROPE=rope is not None, PAIRED=paired,
                 QK_NORM=qk_norm is not None, OFFSET=bool(norm_offset), GEGLU=bool(geglu),
                 Q_SCALED=q_scale != 1.0)
    row_blocks = triton.cdiv(M, BLOCK_M)
    pdl = bool(pdl) and pdl_enabled(x.device)
    block_n, block_k, warps, stages, split = pick_config(M, n_cols, K, x.device, pdl, paired)  # paired: in pairs
    if qk_norm is not None:  # a tile is one head, whose lanes the norm sums over: as many weights per step
        wider = max(1, (head_dim // 2) // block_n)
        one_tile = triton.cdiv(K, split) <= block_k
        block_n, block_k = head_dim // 2, max(16, block_k // wider)
        if one_tile:  # shares of one tile each, as before (under PDL: loaded before the wait)
            split = triton.cdiv(K, block_k)
    ws_cols = 2 * n_cols if paired else n_cols
    ws, cnt = _workspace(x.device, row_blocks * BLOCK_M, ws_cols) if split > 1 else (out, out)
    grid = (triton.cdiv(n_cols, block_n), row_blocks, split)
    one_tile = triton.cdiv(K, split) <= block_k  # each program's share of K is a single tile
    launch = dict(launch_pdl=True) if pdl else {}
    with _triton.device_guard(x):
        _ln_linear_kernel[grid](*args, ws, cnt, ln_stats if ln_stats is not None else ws,
                                stats_out if stats_out is not None else ws, cos, sin, q_gain, k_gain, *scalars,
                                ws_cols, **flags,
                                BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, ONE_TILE=one_tile, USE_GDC=pdl,
                                num_warps=warps, num_stages=stages, **launch)
    return out


def _check_modes(x, weight, ln, rms, gelu, swiglu, what: str, norm_offset: bool = False,
                 geglu: bool = False) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or (ln is not None and len(ln) != 3):
        return  # _check names the problem
    if norm_offset and not rms:
        raise ValueError(f"{what}: norm_offset (gains stored as offsets from 1) is an RMSNorm's: it needs rms=True")
    if geglu and not swiglu:
        raise ValueError(f"{what}: geglu is the gated MLP's activation: it needs swiglu=True ([gate | up] rows)")
    if rms and ln is None:
        raise ValueError(f"{what}: rms=True without a norm (ln=None)")
    if rms and ln[1] is not None:
        raise ValueError(f"{what}: an RMSNorm has no bias (ln[1] must be None with rms=True)")
    if gelu and swiglu:
        raise ValueError(f"{what}: gelu and swiglu are two activations; pick one")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"{what}: swiglu needs the [gate | up] rows of an even-rowed weight, got "
                         f"{weight.shape[0]} rows")


def ln_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              ln: tuple | None = None, rms: bool = False, gelu: bool = False, swiglu: bool = False,
              residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
              ln_stats: torch.Tensor | None = None, stats_out: torch.Tensor | None = None,
              pdl: bool = False, norm_offset: bool = False, geglu: bool = False) -> torch.Tensor:
    """x (M, K), weight (N, K) → act(N(x) @ weightᵀ + bias) + residual, (M, N) in x's dtype ((M, N/2) with swiglu).

    ln: (weight (K,), bias (K,) or None, eps) of a norm applied to x first, or None; a LayerNorm, or an RMSNorm
    with rms=True (bias None). gelu: GELU (tanh approximation). swiglu: weight holds [gate (N/2) | up (N/2)]
    rows (MLP.c_fc of a SwiGLU model) and the result is SiLU(gate) · up; with geglu too, GELU(gate) · up (tanh
    approximation, Gemma's MLP). norm_offset (with rms): the norm's gain is stored as its offset from 1 and the
    norm is x / rms · (1 + w) in fp32, rounded once (Gemma's RMSNorm). out: an optional buffer for the result
    (unit stride along its columns; it must not overlap x).
    ln_stats: (M, 2) float32 row sums (Σx, Σx²) of x, used by the norm instead of a pass over x.
    stats_out: (M, 2) float32, zeros: receives the row sums (Σy, Σy²) of the result, for the next norm.
    pdl: launch with programmatic dependent launch where the device has it (kernels/pdl.py): the weights are
    loaded while the previous kernel in the stream may still run, so the caller guarantees that no kernel
    queued before this one writes weight (a decode step's chain: model/fused_decode.py). Off by default.
    """
    _check_modes(x, weight, ln, rms, gelu, swiglu, "ln_linear", norm_offset, geglu)
    shape = (x.shape[0], weight.shape[0] // 2 if swiglu else weight.shape[0])
    _check(x, weight, bias, ln, residual, (), n_out=shape[1])
    _check_stats(x, ln_stats, stats_out, ln)
    if out is None:
        out = _triton.empty(shape, x.dtype, x.device)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != x.dtype
          or out.device != x.device or out.stride(1) != 1):
        raise ValueError(f"ln_linear: out must be a {x.dtype} tensor of shape {shape} on {x.device} with unit "
                         "stride along N")
    return _launch(x, weight, bias, ln, residual, out, gelu, ln_stats=ln_stats, stats_out=stats_out, pdl=pdl,
                   rms=rms, swiglu=swiglu, norm_offset=norm_offset, geglu=geglu)


def ln_qkv_to_cache(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ln: tuple | None,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, n_q: int,
                    ln_stats: torch.Tensor | None = None, pdl: bool = False, *, rms: bool = False,
                    rope: tuple | None = None, qk_norm: tuple | None = None, norm_offset: bool = False,
                    q_scale: float = 1.0) -> torch.Tensor:
    """The attention input projection of one decode token per row, its keys and values written to the cache.

    x (B, K); weight (n_q + 2·Hkv·D, K) (queries, then keys, then values, as the model's c_attn); caches
    (B', Hkv, max_len, D) with B' >= B; pos (B,) int the position of row b's token. Returns q (B, n_q).
    rope: (cos, sin), each (L, D) in x's dtype with unit stride along D, row p holding the rotate-half angles of
    position p (model/rope.py's RotaryEmbedding over positions 0..L-1): q and k are rotated before q is returned
    and k is cached. Positions are not range-checked here (the caller's KV cache owns them; L must cover them).
    qk_norm: (q gain, k gain, eps), each gain (D,) in x's dtype: every q and k head RMS-normalised and scaled by
    its gain before the rotation (Qwen3; with rope only, D / 2 a power of two >= 16: a tile of the launch is one
    head). norm_offset (with rms): the gains of the input norm and of qk_norm are stored as offsets from 1
    (Gemma's RMSNorm: x / rms · (1 + w), rounded once). q_scale (with rope): q multiplied by it (rounded) after its
    norm, before the rotation (the model's q_scale, Gemma's query_pre_attn_scalar). ln_stats, pdl, rms: as for
    ln_linear.
    """
    _check(x, weight, bias, ln, None, (k_cache, v_cache))
    _check_modes(x, weight, ln, rms, False, False, "ln_qkv_to_cache", norm_offset)
    if isinstance(q_scale, bool) or not isinstance(q_scale, (int, float)) or not q_scale > 0 \
            or (q_scale != 1.0 and rope is None):
        raise ValueError(f"ln_qkv_to_cache: q_scale must be a positive number (other than 1 only with rope), got "
                         f"{q_scale!r}")
    _check_stats(x, ln_stats, None, ln)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("ln_qkv_to_cache: k_cache and v_cache must be (B, Hkv, max_len, D) with equal strides")
    n_kv = k_cache.shape[1] * k_cache.shape[3]
    if weight.shape[0] != n_q + 2 * n_kv or k_cache.shape[0] < x.shape[0]:
        raise ValueError(f"ln_qkv_to_cache: weight rows {weight.shape[0]} != n_q {n_q} + 2 x {n_kv}, or the "
                         f"cache batch {k_cache.shape[0]} < {x.shape[0]} rows")
    if (not isinstance(pos, torch.Tensor) or pos.dim() != 1 or pos.shape[0] != x.shape[0]
            or pos.dtype not in (torch.int32, torch.int64) or pos.device != x.device):
        raise ValueError(f"ln_qkv_to_cache: pos must be an int tensor of shape ({x.shape[0]},) on {x.device}")
    if rope is not None:
        D = k_cache.shape[3]
        if D % 2 or n_q % D:
            raise ValueError(f"ln_qkv_to_cache: RoPE needs an even head dim and n_q a multiple of it, got D={D}, "
                             f"n_q={n_q}")
        if (not isinstance(rope, tuple) or len(rope) != 2
                or any(not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != D or t.dtype != x.dtype
                       or t.device != x.device or t.stride(1) != 1 for t in rope)
                or rope[0].stride() != rope[1].stride()):
            raise ValueError(f"ln_qkv_to_cache: rope must be (cos, sin), each (L, {D}) {x.dtype} on {x.device} "
                             "with unit stride along D and equal strides")
    if qk_norm is not None:
        D = k_cache.shape[3]
        if rope is None or D // 2 < 16 or D & (D - 1):
            raise ValueError(f"ln_qkv_to_cache: qk_norm needs rope and a head dim that is a power of two >= 32, got "
                             f"D={D}{' without rope' if rope is None else ''}")
        if (not isinstance(qk_norm, tuple) or len(qk_norm) != 3 or isinstance(qk_norm[2], bool)
                or not isinstance(qk_norm[2], (int, float))
                or any(not isinstance(g, torch.Tensor) or tuple(g.shape) != (D,) or g.dtype != x.dtype
                       or g.device != x.device or g.stride(0) != 1 for g in qk_norm[:2])):
            raise ValueError(f"ln_qkv_to_cache: qk_norm must be (q gain, k gain, eps), each gain ({D},) {x.dtype} on "
                             f"{x.device}")
    q = _triton.empty((x.shape[0], n_q), x.dtype, x.device)
    return _launch(x, weight, bias, ln, None, q, False, qkv=(k_cache, v_cache, pos, n_q), ln_stats=ln_stats,
                   pdl=pdl, rms=rms, rope=rope, qk_norm=qk_norm, norm_offset=norm_offset, q_scale=q_scale)


@triton.jit
def _embed_kernel(TOK, POS, WTE, WPE, X, STATS, C, n_slots, stride_tok, stride_pos, stride_wte, stride_wpe,
                  stride_slot, scale, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, HAS_WPE: tl.constexpr,
                  SCALED: tl.constexpr):
    """grid = (B,): x[b] = wte[tok[b]] + wpe[pos[b]] (rounded as eager; wte[tok[b]] alone without HAS_WPE;
    SCALED: wte[tok[b]] · scale, rounded, before the positions), its (Σx, Σx²) into STATS[0, b], and STATS[1:, b]
    zeroed for the producers of the later norms' statistics."""
    b = tl.program_id(0)
    t = tl.load(TOK + b * stride_tok).to(tl.int64)
    p = tl.load(POS + b * stride_pos).to(tl.int64)
    s1 = tl.zeros([BLOCK_C], tl.float32)
    s2 = tl.zeros([BLOCK_C], tl.float32)
    for c0 in range(0, C, BLOCK_C):
        offs = c0 + tl.arange(0, BLOCK_C)
        ok = offs < C
        e = tl.load(WTE + t * stride_wte + offs, mask=ok, other=0.0)
        if SCALED:  # Gemma's embedding times sqrt(C), rounded to the dtype as eager multiplies it
            e = (e.to(tl.float32) * scale).to(e.dtype)
        if HAS_WPE:
            x = (e.to(tl.float32) + tl.load(WPE + p * stride_wpe + offs, mask=ok, other=0.0).to(tl.float32)).to(e.dtype)
        else:
            x = e
        tl.store(X + b.to(tl.int64) * C + offs, x, mask=ok)
        s1 += x.to(tl.float32)
        s2 += x.to(tl.float32) * x.to(tl.float32)
    tl.store(STATS + b * 2, tl.sum(s1, 0))
    tl.store(STATS + b * 2 + 1, tl.sum(s2, 0))
    slots = 1 + tl.arange(0, BLOCK_S)
    zero = tl.zeros([BLOCK_S], tl.float32)
    tl.store(STATS + slots * stride_slot + b * 2, zero, mask=slots < n_slots)
    tl.store(STATS + slots * stride_slot + b * 2 + 1, zero, mask=slots < n_slots)


_triton.check_decorated(_ln_linear_kernel, _embed_kernel)


def embed_with_stats(tok: torch.Tensor, pos: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor | None,
                     stats: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """tok, pos (B,) int → x (B, C) = wte[tok] + wpe[pos] in one launch (wpe None: wte[tok], a RoPE model).
    scale: the embeddings multiplied by it first, rounded to their dtype (Gemma's sqrt(C), as the model's
    embed_scales hold it), or None.

    stats (S, B, 2) float32: slot 0 receives x's row sums (Σx, Σx²) for the first norm; slots 1..S-1 are
    zeroed, ready for the ln_linear(stats_out=...) calls of the same step. Token ids and positions are not
    range-checked here (the caller's embedding tables and cache own them).
    """
    for name, t in (("tok", tok), ("pos", pos)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"embed_with_stats: {name} must be a 1-d int tensor")
    B, C = tok.shape[0], wte.shape[1]
    table = wte if wpe is None else wpe
    if (pos.shape[0] != B or table.shape[1] != C or wte.dtype != table.dtype or wte.stride(1) != 1
            or table.stride(1) != 1 or wte.dtype not in _triton.SUPPORTED_DTYPES):
        raise ValueError("embed_with_stats: tok and pos of one length, wte and wpe (rows, C) of one float dtype "
                         "with unit stride along C")
    if (stats.dtype != torch.float32 or stats.dim() != 3 or stats.shape[1:] != (B, 2)
            or stats.stride()[1:] != (2, 1) or stats.shape[0] < 1):
        raise ValueError(f"embed_with_stats: stats must be float32 (S, {B}, 2), contiguous in its last two dims")
    if len({t.device for t in (tok, pos, wte, table, stats)}) != 1:
        raise ValueError("embed_with_stats: all tensors must be on one device")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
        raise ValueError(f"embed_with_stats: scale must be a positive number or None, got {scale!r}")
    _triton.check_device(wte.device, "embed_with_stats")
    x = _triton.empty((B, C), wte.dtype, wte.device)
    with _triton.device_guard(x):
        _embed_kernel[(B,)](tok, pos, wte, table, x, stats, C, stats.shape[0], tok.stride(0), pos.stride(0),
                            wte.stride(0), table.stride(0), stats.stride(0),
                            float(scale) if scale is not None else 1.0,
                            BLOCK_C=min(1024, triton.next_power_of_2(C)),
                            BLOCK_S=triton.next_power_of_2(max(stats.shape[0], 2)), HAS_WPE=wpe is not None,
                            SCALED=scale is not None, num_warps=4)
    return x


__all__ = ["ln_linear", "ln_qkv_to_cache", "embed_with_stats"]
