"""Every layer of a one-sequence decode step in one persistent launch: the phases hand their outputs on as
self-validating words, with no grid barrier.

    plan = StackPlan(layers, ...)                 the layers' weights and caches as a table of addresses
    x_out = decode_stack(plan, x, pos, rope)      x (1, C) the embedded token → the last layer's output (1, C)
    fits(...) -> str | None                       why a model's shape cannot run here (None: it can)

A decode step of a narrow model at batch 1 is a chain of ~4 small kernels per layer (ln_linear.py,
decode.py, decode_mlp.py): each pays its launch, its ramp and its memory latency, so a 30-layer model's step
is bound by ~120 launch boundaries, not by its weights' bytes (bench/NOTES.md). Here one launch of one program
per SM runs the whole stack, six phases per layer:

    A   q, k, v = rope(N₁(x) W_qkvᵀ + b)      PA lane pairs (i, i + D/2) of one head a program; k, v also into
                                            the cache at pos (read by later steps)
    B   attention of one kv group over one strided share of the cache's key tiles → a partial (acc, m, l)
                                            per head; share 0 adds the token's own key and value
    M   one head's partials merged → y       (one program per head)
    C   x_mid = x + round(y W_oᵀ + b_o)        OC_N output columns a program
    D1  h = act(N₂(x_mid) W_fcᵀ + b_fc)       IB_N intermediate columns a program
    D2  x = x_mid + round(h W_downᵀ + b_down)  the same OC_N columns as C (x_mid and x never leave the program)

Every value a phase hands on travels as one 64-bit word: the fp32 value in the low half, a flag in the high half
(the launch's epoch and the layer). A consumer loads the words it needs (volatile loads, which read L2) until
every one carries the flag it expects; an 8-byte store is seen whole or not at all, so the flag vouches for its
value and no fence, counter or barrier is needed (the low-latency protocol of NCCL's LL). Each program loads
its next phase's weights before it polls that phase's inputs, so the weights stream while the producers
finish. A program polls only in the phases where it has work: every buffer is rewritten only after all its
readers have finished (each phase needs all of the one before it), so no word is overwritten before it is
read. The last program to leave a launch advances the epoch (SYNC[0]) for the next.

Rounding follows the eager model in its dtype as ln_linear's does (norm outputs, each linear's output with its
bias, RoPE's products, SiLU and h, the attention output, each residual add); the attention itself and every
sum run in fp32. Each phase's arithmetic runs in one program in a fixed order: the output is deterministic.

Supported (checked by fits / StackPlan with a ValueError naming the problem):
    dtypes   float16, bfloat16, float32 (one for x, weights, caches and RoPE tables)
    shapes   one sequence (batch 1); C <= MAX_C and the MLP width each held as two power-of-two blocks (576 =
             512 + 64); head dim a power of two 16..128 with caches (B', Hkv, max_len, D) unit-strided along D;
             Hq a multiple of Hkv; each phase's rows within one program per SM; at most MAX_LAYERS layers
    models   LayerNorm or RMSNorm (a gain, optional bias), GELU (tanh) or SwiGLU (w_fc rows [gate | up]),
             optional biases on every linear, RoPE (rotate-half tables) or none, GQA
    devices  CUDA, every program resident at once (one per SM: on a GPU shared with other work at the same
             time, or partitioned below its SM count, a program can wait for one that never runs; it gives up
             after seconds with a device trap, and decode_stack=False avoids the stack); under Triton's
             interpreter, where programs run one after another and could not wait for each other, each phase
             is its own launch (phase_by_phase=True), the same code reading words that are already there:
             that is what the CPU tests run.
Weights are read through 64-bit addresses from the plan's table (no copies); every address must be 16-byte
aligned. Inference only.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _triton
from .decode_mlp import _parts  # a width as two power-of-two blocks

MAX_C = 768        # C held in registers as two power-of-two blocks, as decode_mlp's
MAX_I_TILE = 32768  # phase D2's (OC, I) weight tile, elements
MAX_LAYERS = 1000  # a flag holds the layer in its low 10 bits
WARPS = 8
MAX_SPLITS = 16    # key shares per kv group in phase B (a head's merge reads at most this many partials)
BLOCK_N = 32       # keys per tile in phase B
MAX_POLLS: tl.constexpr = tl.constexpr(1 << 24)  # a consumer's polls before it gives up (~0.5 µs each)

# the per-layer address table's columns (TABLE the tensor each holds; absent biases are address 0)
TABLE = ("w_qkv", "b_qkv", "ln1_w", "ln1_b", "w_o", "b_o", "ln2_w", "ln2_b", "w_fc", "b_fc", "w_down", "b_down",
         "k_cache", "v_cache")
W_QKV: tl.constexpr = tl.constexpr(0)
B_QKV: tl.constexpr = tl.constexpr(1)
LN1_W: tl.constexpr = tl.constexpr(2)
LN1_B: tl.constexpr = tl.constexpr(3)
W_O: tl.constexpr = tl.constexpr(4)
B_O: tl.constexpr = tl.constexpr(5)
LN2_W: tl.constexpr = tl.constexpr(6)
LN2_B: tl.constexpr = tl.constexpr(7)
W_FC: tl.constexpr = tl.constexpr(8)
B_FC: tl.constexpr = tl.constexpr(9)
W_DN: tl.constexpr = tl.constexpr(10)
B_DN: tl.constexpr = tl.constexpr(11)
K_CACHE: tl.constexpr = tl.constexpr(12)
V_CACHE: tl.constexpr = tl.constexpr(13)
N_PTRS: tl.constexpr = tl.constexpr(len(TABLE))
N_STAMPS: tl.constexpr = tl.constexpr(16)  # timeline stamps per layer (k = 2p, 2p + 1 for phase p = 0..5)


@triton.jit
def _addr(PTRS, layer, j: tl.constexpr, dtype: tl.constexpr):
    """Column j of the address table's row `layer`, as a pointer to dtype (16-byte aligned: the plan checks)."""
    a = tl.multiple_of(tl.load(PTRS + layer * N_PTRS + j), 16)
    return a.to(tl.pointer_type(dtype))


@triton.jit
def _stamp(TIMES, pid, layer, k: tl.constexpr, ON: tl.constexpr):
    """With ON: the GPU's global nanosecond timer into TIMES[pid, layer, k] (the phase timeline)."""
    if ON:
        tl.debug_barrier()
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                      pack=1)
        tl.store(TIMES + (pid * 1024 + layer) * N_STAMPS + k, t)


@triton.jit
def _trap():
    return tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


# ----------------------------------------------------------------------------------------------------------
# Words that carry their own flag: (flag << 32) | bits(fp32 value)

@triton.jit
def _put(P, v, ok, flag, RELAXED: tl.constexpr):
    """fp32 values v into words P (where ok) with this exchange's flag. RELAXED: relaxed GPU-scope stores (what
    the one-launch form polls on); else plain stores (phase-by-phase launches, ordered by the launches)."""
    bits = v.to(tl.int32, bitcast=True).to(tl.uint32, bitcast=True).to(tl.int64)
    w = ((bits * 0 + flag) << 32) | bits
    if RELAXED:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.relaxed.gpu.global.b64 [$1], $2; }\n\tmov.u32 $0, 0;",
            "=r,l,l,r", [P, w, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(P, w, mask=ok)


@triton.jit
def _look(P, ok, flag):
    """Words P (where ok), read from L2, and how many of them do not carry flag yet."""
    w = tl.load(P, mask=ok, other=0, volatile=True)
    return w, tl.sum(tl.where(ok & ((w >> 32).to(tl.int32) != flag), 1, 0), axis=None)


@triton.jit
def _value(w, ok, flag):
    """The fp32 values of words w: 0 where not ok, NaN where a word does not carry flag."""
    v = w.to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where(ok, tl.where((w >> 32).to(tl.int32) == flag, v, float("nan")), 0.0)


@triton.jit
def _give_up(polls):
    if polls > MAX_POLLS:  # a producer that never runs (not resident): an error on the host instead of a hang
        _trap()


@triton.jit
def _poll1(P, ok, flag, WAIT: tl.constexpr):
    """Values of words P (where ok; 0 elsewhere) once they all carry flag (WAIT), or as they are (NaN where
    stale: phase-by-phase launches, where they are there already)."""
    w, stale = _look(P, ok, flag)
    if WAIT:
        polls = 0
        while stale > 0:
            w, stale = _look(P, ok, flag)
            polls += 1
            _give_up(polls)
    return _value(w, ok, flag)


@triton.jit
def _poll2(P1, ok1, P2, ok2, flag, WAIT: tl.constexpr):
    """_poll1 of two sets of words at once."""
    w1, s1 = _look(P1, ok1, flag)
    w2, s2 = _look(P2, ok2, flag)
    if WAIT:
        polls = 0
        while s1 + s2 > 0:
            w1, s1 = _look(P1, ok1, flag)
            w2, s2 = _look(P2, ok2, flag)
            polls += 1
            _give_up(polls)
    return _value(w1, ok1, flag), _value(w2, ok2, flag)


@triton.jit
def _poll3(P1, ok1, P2, ok2, P3, ok3, flag, WAIT: tl.constexpr):
    """_poll1 of three sets of words at once."""
    w1, s1 = _look(P1, ok1, flag)
    w2, s2 = _look(P2, ok2, flag)
    w3, s3 = _look(P3, ok3, flag)
    if WAIT:
        polls = 0
        while s1 + s2 + s3 > 0:
            w1, s1 = _look(P1, ok1, flag)
            w2, s2 = _look(P2, ok2, flag)
            w3, s3 = _look(P3, ok3, flag)
            polls += 1
            _give_up(polls)
    return _value(w1, ok1, flag), _value(w2, ok2, flag), _value(w3, ok3, flag)


# ----------------------------------------------------------------------------------------------------------
# Shared pieces

@triton.jit
def _rows2(W, rows, ok, stride, offs_a, a_ok, offs_b, b_ok):
    """Weight rows `rows` (R,) over the two column blocks: (R, A), (R, B), masked by ok (R,)."""
    base = W + rows.to(tl.int64)[:, None] * stride
    wa = tl.load(base + offs_a[None, :], mask=ok[:, None] & a_ok[None, :], other=0.0)
    wb = tl.load(base + offs_b[None, :], mask=ok[:, None] & b_ok[None, :], other=0.0)
    return wa, wb


@triton.jit
def _vec2(V, offs_a, a_ok, offs_b, b_ok, ON: tl.constexpr):
    """A (C,) vector over the two column blocks, fp32 (zeros where not ON)."""
    if ON:
        va = tl.load(V + offs_a, mask=a_ok, other=0.0).to(tl.float32)
        vb = tl.load(V + offs_b, mask=b_ok, other=0.0).to(tl.float32)
    else:
        va = tl.zeros(offs_a.shape, tl.float32)
        vb = tl.zeros(offs_b.shape, tl.float32)
    return va, vb


@triton.jit
def _gemv(wa, wb, xa, xb):
    """Σ_c w[r, c] x[c] over both column blocks, fp32: (R,)."""
    return tl.sum(wa.to(tl.float32) * xa[None, :], 1) + tl.sum(wb.to(tl.float32) * xb[None, :], 1)


@triton.jit
def _normed(xa, xb, ga, gb, ba, bb, a_ok, b_ok, eps, C: tl.constexpr, RMS: tl.constexpr, dtype: tl.constexpr):
    """N(x) over the two blocks (gain ga/gb, bias ba/bb: zeros without one), rounded as eager, fp32."""
    if RMS:  # eager rounds x / rms to dtype, then the product with the gain
        rstd = 1.0 / tl.sqrt((tl.sum(xa * xa, 0) + tl.sum(xb * xb, 0)) / C + eps)
        na = ((xa * rstd).to(dtype).to(tl.float32) * ga).to(dtype).to(tl.float32)
        nb = ((xb * rstd).to(dtype).to(tl.float32) * gb).to(dtype).to(tl.float32)
    else:
        mean = (tl.sum(xa, 0) + tl.sum(xb, 0)) / C
        da = tl.where(a_ok, xa - mean, 0.0)
        db = tl.where(b_ok, xb - mean, 0.0)
        rstd = 1.0 / tl.sqrt((tl.sum(da * da, 0) + tl.sum(db * db, 0)) / C + eps)
        na = (da * rstd * ga + ba).to(dtype).to(tl.float32)
        nb = (db * rstd * gb + bb).to(dtype).to(tl.float32)
    return na, nb


@triton.jit
def _bias_rows(B, rows, ok, ON: tl.constexpr):
    """bias[rows] fp32 (zeros where not ON)."""
    if ON:
        return tl.load(B + rows, mask=ok, other=0.0).to(tl.float32)
    return tl.zeros(rows.shape, tl.float32)


@triton.jit
def _kv_tile(KC, VC, n, T, d, stride_cn):
    """Keys and values n (BLOCK_N,) of one kv head (rows >= T zero), in the cache's dtype: (BLOCK_N, D) each."""
    n_ok = n < T
    at = n.to(tl.int64)[:, None] * stride_cn + d[None, :]
    k = tl.load(KC + at, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
    v = tl.load(VC + at, mask=n_ok[:, None], other=0.0, cache_modifier=".cg")
    return k, v


# ----------------------------------------------------------------------------------------------------------
# The phases (each one program's share; every weight arrives prefetched)

@triton.jit
def _phase_qkv(X0, LR, LQ, KC, VC, COS, SIN, layer, pos, flag, eps, stride_ch, stride_cn, stride_rope,
               w1a, w1b, w2a, w2b, g1a, g1b, l1a, l1b, bq1, bq2, rows1, rows2, r_ok,
               offs_a, a_ok, offs_b, b_ok, C: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
               RMS: tl.constexpr, ROPE: tl.constexpr, WAIT: tl.constexpr, dtype: tl.constexpr, TIMES, pid,
               TL: tl.constexpr):
    """Phase A: the residual stream entering `layer` (the embedding at layer 0, else the words of D2), N₁, the
    QKV rows1/rows2 (lane pairs) with their biases bq1/bq2, RoPE; q, k, v into LQ, k and v also into the
    layer's cache at pos."""
    if layer == 0:
        xa = tl.load(X0 + offs_a, mask=a_ok, other=0.0).to(tl.float32)      # (A,)
        xb = tl.load(X0 + offs_b, mask=b_ok, other=0.0).to(tl.float32)      # (B,)
    else:
        xa, xb = _poll2(LR + offs_a, a_ok, LR + offs_b, b_ok, flag - 1, WAIT)
    _stamp(TIMES, pid, layer, 0, TL)
    na, nb = _normed(xa, xb, g1a, g1b, l1a, l1b, a_ok, b_ok, eps, C, RMS, dtype)
    y1 = (_gemv(w1a, w1b, na, nb) + bq1).to(dtype).to(tl.float32)            # (PA,) lanes i
    y2 = (_gemv(w2a, w2b, na, nb) + bq2).to(dtype).to(tl.float32)            # (PA,) lanes i + D/2
    N_Q: tl.constexpr = HQ * D
    N_KV: tl.constexpr = HKV * D
    if ROPE:  # rotate-half as eager rounds it: x·cos and rotate_half(x)·sin rounded, then their sum
        lane = rows1 % D                                                     # (PA,) < D / 2
        turn = r_ok & (rows1 < N_Q + N_KV)                                   # q and k heads only
        cos = tl.load(COS + pos * stride_rope + lane, mask=turn, other=1.0).to(tl.float32)
        sin = tl.load(SIN + pos * stride_rope + lane, mask=turn, other=0.0).to(tl.float32)
        r1 = (y1 * cos).to(dtype).to(tl.float32) + (-y2 * sin).to(dtype).to(tl.float32)
        r2 = (y2 * cos).to(dtype).to(tl.float32) + (y1 * sin).to(dtype).to(tl.float32)
        y1 = r1.to(dtype).to(tl.float32)
        y2 = r2.to(dtype).to(tl.float32)
    _put(LQ + rows1, y1, r_ok, flag, WAIT)
    _put(LQ + rows2, y2, r_ok, flag, WAIT)
    _store_kv(y1.to(dtype), rows1, r_ok, KC, VC, pos, stride_ch, stride_cn, N_Q, N_KV, D)
    _store_kv(y2.to(dtype), rows2, r_ok, KC, VC, pos, stride_ch, stride_cn, N_Q, N_KV, D)


@triton.jit
def _store_kv(y, rows, r_ok, KC, VC, pos, stride_ch, stride_cn, N_Q: tl.constexpr, N_KV: tl.constexpr,
              D: tl.constexpr):
    """The k and v among QKV rows `rows` (R,) into the caches at position pos (for the steps after this one)."""
    c = tl.where(rows >= N_Q + N_KV, rows - N_Q - N_KV, tl.maximum(rows - N_Q, 0))  # within k or v
    at = (c // D) * stride_ch + pos * stride_cn + c % D                      # (R,)
    tl.store(KC + at, y, mask=r_ok & (rows >= N_Q) & (rows < N_Q + N_KV))
    tl.store(VC + at, y, mask=r_ok & (rows >= N_Q + N_KV))


@triton.jit
def _phase_attention(LQ, LP, KC, VC, pid, Tc, S, flag, qk_scale, stride_ch, stride_cn,
                     D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, GP: tl.constexpr,
                     BLOCK_N: tl.constexpr, MAX_S: tl.constexpr, PRECISION: tl.constexpr, WAIT: tl.constexpr,
                     dtype: tl.constexpr, TIMES, layer, TL: tl.constexpr):
    """Phase B: program (g, s) attends kv group g's query heads (GP rows, the group's padded to 16 for tl.dot)
    to key tiles s, s + S, ... of the Tc keys cached before this token (S shares); share 0 also to the token's
    own key and value (from LQ: the cache's copy is not read in the launch that writes it). Its partial (acc,
    m, l) per head (base-2 logits) goes to LP. QKᵀ and PV on the tensor cores (P as the sum of two dtype
    terms, so PV keeps about fp32's accuracy); each tile's keys and values are loaded one tile ahead, the first
    before q is polled."""
    G: tl.constexpr = HQ // HKV
    N_Q: tl.constexpr = HQ * D
    N_KV: tl.constexpr = HKV * D
    n_tiles = tl.cdiv(Tc, BLOCK_N)
    g = pid // S
    s = pid % S
    mine = (n_tiles - s + S - 1) // S                                        # this program's tiles
    j = tl.arange(0, GP)                                                     # (GP,)
    d = tl.arange(0, D)                                                      # (D,)
    h = g * G + j
    h_ok = j < G
    kc = KC + g.to(tl.int64) * stride_ch
    vc = VC + g.to(tl.int64) * stride_ch
    n = s * BLOCK_N + tl.arange(0, BLOCK_N)                                  # (BLOCK_N,) the first tile
    k, v = _kv_tile(kc, vc, tl.where(mine > 0, n, Tc), Tc, d, stride_cn)
    own = (d * 0 + s) == 0                                                   # (D,) share 0 (a tensor & a tensor)
    q, kn, vn = _poll3(LQ + h[:, None] * D + d[None, :], h_ok[:, None] & (d < D)[None, :],
                       LQ + N_Q + g * D + d, own, LQ + N_Q + N_KV + g * D + d, own, flag, WAIT)
    _stamp(TIMES, pid, layer, 2, TL)
    q = q.to(dtype)                                                          # (GP, D) (dtype values)
    first = (j * 0 + s) == 0                                                 # (GP,)
    sn = tl.sum(q.to(tl.float32) * kn[None, :], 1) * qk_scale               # (GP,) the own key's logit
    m = tl.where(first, sn, float("-inf"))
    l_sum = tl.where(first, 1.0, 0.0)
    acc = tl.where(first[:, None], vn[None, :] + tl.zeros([GP, D], tl.float32), 0.0)  # (GP, D)
    for it in range(0, mine):
        n_ok = n < Tc
        nxt = n + S * BLOCK_N
        k_next, v_next = _kv_tile(kc, vc, tl.where(it + 1 < mine, nxt, Tc), Tc, d, stride_cn)
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale    # (GP, BLOCK_N), base 2
        sc = tl.where(n_ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        p_hi = p.to(dtype)                                                   # P as two dtype terms: PV
        p_lo = (p - p_hi.to(tl.float32)).to(dtype)                           # to ~fp32 accuracy
        acc = tl.dot(p_hi, v, acc * alpha[:, None], input_precision=PRECISION)  # (GP, D)
        acc = tl.dot(p_lo, v, acc, input_precision=PRECISION)
        m = m_new
        k = k_next
        v = v_next
        n = nxt
    cell = (h * MAX_S + s) * (D + 2)                                         # (GP,) words: acc, m, l
    _put(LP + cell[:, None] + d[None, :], acc, h_ok[:, None] & (d < D)[None, :], flag, WAIT)
    _put(LP + cell + D, m, h_ok, flag, WAIT)
    _put(LP + cell + D + 1, l_sum, h_ok, flag, WAIT)


@triton.jit
def _phase_merge(LP, LY, head, S, flag, D: tl.constexpr, MAX_S: tl.constexpr, WAIT: tl.constexpr,
                 dtype: tl.constexpr, TIMES, pid, layer, TL: tl.constexpr):
    """Phase M: head `head`'s S partials merged into its attention output y (D,), rounded, into LY."""
    s = tl.arange(0, MAX_S)
    d = tl.arange(0, D)
    ok = s < S
    cell = (head * MAX_S + s) * (D + 2)                                      # (MAX_S,)
    acc, ms, ls = _poll3(LP + cell[:, None] + d[None, :], ok[:, None] & (d < D)[None, :], LP + cell + D, ok,
                         LP + cell + D + 1, ok, flag, WAIT)                  # (MAX_S, D), (MAX_S,) x 2
    _stamp(TIMES, pid, layer, 4, TL)
    ms = tl.where(ok, ms, float("-inf"))
    w = tl.where(ok, tl.exp2(ms - tl.max(ms, 0)), 0.0)                       # (MAX_S,)
    y = tl.sum(acc * w[:, None], 0) / tl.sum(w * ls, 0)                      # (D,)
    _put(LY + head * D + d, y.to(dtype).to(tl.float32), d < D, flag, WAIT)


@triton.jit
def _phase_out(LY, LXM, xres, flag, woa, wob, bo, cols, c_ok, offs_ya, ya_ok, offs_yb, yb_ok,
               WAIT: tl.constexpr, dtype: tl.constexpr, TIMES, pid, layer, TL: tl.constexpr):
    """Phase C: every head's y (LY, HQ·D words over two blocks), this program's output columns of y W_oᵀ + b_o
    rounded, plus the residual xres at those columns: x_mid (OC,) into LXM, and returned."""
    ya, yb = _poll2(LY + offs_ya, ya_ok, LY + offs_yb, yb_ok, flag, WAIT)
    _stamp(TIMES, pid, layer, 6, TL)
    o = _gemv(woa, wob, ya, yb) + bo                                         # (OC,)
    xmid = (o.to(dtype).to(tl.float32) + xres).to(dtype).to(tl.float32)
    _put(LXM + cols, xmid, c_ok, flag, WAIT)
    return xmid


@triton.jit
def _phase_up(LXM, LH, flag, eps, fa, fb, ua, ub, g2a, g2b, l2a, l2b, bf1, bf2, offs_i, i_ok,
              offs_a, a_ok, offs_b, b_ok, C: tl.constexpr, RMS: tl.constexpr, SWIGLU: tl.constexpr,
              WAIT: tl.constexpr, dtype: tl.constexpr, TIMES, pid, layer, TL: tl.constexpr):
    """Phase D1: N₂(x_mid), this program's intermediate columns h (fc / gate, up biases bf1, bf2) into LH."""
    xa, xb = _poll2(LXM + offs_a, a_ok, LXM + offs_b, b_ok, flag, WAIT)
    _stamp(TIMES, pid, layer, 8, TL)
    na, nb = _normed(xa, xb, g2a, g2b, l2a, l2b, a_ok, b_ok, eps, C, RMS, dtype)
    y = (_gemv(fa, fb, na, nb) + bf1).to(dtype).to(tl.float32)               # (IB,) gate / fc
    if SWIGLU:
        up = (_gemv(ua, ub, na, nb) + bf2).to(dtype).to(tl.float32)
        h = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32) * up
    else:  # GELU, tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1), 2z clamped where tanh is 1 anyway
        z = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        h = 0.5 * y * (2.0 - 2.0 / (tl.exp(tl.minimum(2.0 * z, 60.0)) + 1.0))
    _put(LH + offs_i, h.to(dtype).to(tl.float32), i_ok, flag, WAIT)


@triton.jit
def _phase_down(LH, LR, OUT, xmid, is_last, flag, wda, wdb, bdn, cols, c_ok, offs_ia, ia_ok, offs_ib, ib_ok,
                WAIT: tl.constexpr, dtype: tl.constexpr, TIMES, pid, layer, TL: tl.constexpr):
    """Phase D2: every intermediate column h (LH), this program's output columns of h W_downᵀ + b_down rounded,
    plus x_mid: the residual stream leaving the layer at those columns, into LR (and OUT after the last layer),
    and returned."""
    ha, hb = _poll2(LH + offs_ia, ia_ok, LH + offs_ib, ib_ok, flag, WAIT)
    _stamp(TIMES, pid, layer, 10, TL)
    dn = _gemv(wda, wdb, ha, hb) + bdn                                       # (OC,)
    x = (dn.to(dtype).to(tl.float32) + xmid).to(dtype).to(tl.float32)
    _put(LR + cols, x, c_ok, flag, WAIT)
    tl.store(OUT + cols, x.to(dtype), mask=c_ok & ((cols * 0 + is_last.to(tl.int32)) != 0))
    return x


@triton.jit
def _up_weights(PTRS, layer, offs_i, i_ok, offs_a, a_ok, offs_b, b_ok, C: tl.constexpr, I: tl.constexpr,
                LN_BIAS: tl.constexpr, SWIGLU: tl.constexpr, FC_BIAS: tl.constexpr, dtype: tl.constexpr):
    """Phase D1's weights for this program's intermediate columns offs_i: fc / gate rows, up rows (SwiGLU; else
    the fc rows again), each over the two column blocks, N₂'s gain and bias, the fc biases."""
    wf = _addr(PTRS, layer, W_FC, dtype)
    fa, fb = _rows2(wf, offs_i, i_ok, C, offs_a, a_ok, offs_b, b_ok)          # (IB, A), (IB, B)
    ua = fa
    ub = fb
    if SWIGLU:
        ua, ub = _rows2(wf, offs_i + I, i_ok, C, offs_a, a_ok, offs_b, b_ok)
    g2a, g2b = _vec2(_addr(PTRS, layer, LN2_W, dtype), offs_a, a_ok, offs_b, b_ok, True)
    l2a, l2b = _vec2(_addr(PTRS, layer, LN2_B, dtype), offs_a, a_ok, offs_b, b_ok, LN_BIAS)
    bf1 = _bias_rows(_addr(PTRS, layer, B_FC, dtype), offs_i, i_ok, FC_BIAS)
    bf2 = _bias_rows(_addr(PTRS, layer, B_FC, dtype), offs_i + I, i_ok, FC_BIAS and SWIGLU)
    return fa, fb, ua, ub, g2a, g2b, l2a, l2b, bf1, bf2


@triton.jit(do_not_specialize=["layer0", "n_layers", "last"])
def _decode_stack_kernel(PTRS, X0, LQ, LP, LY, LXM, LH, LR, POS, COS, SIN, OUT, SYNC, TIMES,
                         layer0, n_layers, last, eps1, eps2, qk_scale, stride_ch, stride_cn, stride_rope,
                         C: tl.constexpr, PART_A: tl.constexpr, PART_B: tl.constexpr, I: tl.constexpr,
                         I_A: tl.constexpr, I_B: tl.constexpr, Y_A: tl.constexpr, Y_B: tl.constexpr,
                         D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, GP: tl.constexpr, PA: tl.constexpr,
                         OC: tl.constexpr, OC_N: tl.constexpr, IB: tl.constexpr, IB_N: tl.constexpr,
                         M0: tl.constexpr, BLOCK_N: tl.constexpr, MAX_S: tl.constexpr, RMS: tl.constexpr,
                         LN_BIAS: tl.constexpr, SWIGLU: tl.constexpr, ROPE: tl.constexpr, QKV_BIAS: tl.constexpr,
                         O_BIAS: tl.constexpr, FC_BIAS: tl.constexpr, DN_BIAS: tl.constexpr,
                         PRECISION: tl.constexpr, PHASE: tl.constexpr, TIMELINE: tl.constexpr):
    """grid = (programs,), one per SM: layers layer0 .. layer0 + n_layers - 1 of a one-token decode step.

    PHASE -1: every phase of every layer, the programs polling each other's words (all must be resident);
    PHASE 0..5: only that phase (A, B, M, C, D1, D2) of layer layer0; 6: only the epoch's advance (the launches
    in order hand the words on). Word buffers (int64, module docstring): LQ ((HQ + 2·HKV)·D,) q, k, v;
    LP (HQ, MAX_S, D + 2) partials; LY (HQ·D,) attention outputs; LXM (C,) x_mid; LH (I,) h; LR (C,) the
    residual stream leaving a layer. SYNC (2,) int32: the epoch, then the departures (0 between launches).
    `last`: the layer after which D2 writes OUT. Roles by program: A those with lane pairs, B the first
    HKV·S, M programs M0 .. M0 + HQ - 1, C and D2 those with output columns, D1 those with h columns.
    TIMELINE (PHASE -1 only): TIMES (programs, 1024, N_STAMPS) int64 receives the global timer where a program
    has its phase p's inputs (k = 2p) and at its end (k = 2p + 1), per layer; programs without work in a phase
    leave its two stamps as they were.
    """
    dtype: tl.constexpr = X0.dtype.element_ty
    ALL: tl.constexpr = PHASE < 0
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    pos = tl.load(POS).to(tl.int64)                                          # the token's position
    Tc = pos.to(tl.int32)                                                    # keys cached before it
    S = tl.maximum(tl.minimum(tl.cdiv(Tc, BLOCK_N), MAX_S), 1)               # key shares per kv group
    base = tl.load(SYNC) * 1024                                              # this launch's flags: base + layer + 1
    offs_a = tl.arange(0, PART_A)
    offs_b = PART_A + tl.arange(0, PART_B)
    a_ok = offs_a < C
    b_ok = offs_b < C
    offs_ia = tl.arange(0, I_A)
    offs_ib = I_A + tl.arange(0, I_B)
    ia_ok = offs_ia < I
    ib_ok = offs_ib < I
    offs_ya = tl.arange(0, Y_A)                                              # HQ·D as two blocks
    offs_yb = Y_A + tl.arange(0, Y_B)
    ya_ok = offs_ya < HQ * D
    yb_ok = offs_yb < HQ * D
    # this program's rows and columns in each phase (fixed across layers)
    PAIRS: tl.constexpr = D // 2 // PA                                       # lane-pair blocks per head
    N_A: tl.constexpr = (HQ + 2 * HKV) * PAIRS                               # programs with lane pairs
    rows1 = (pid // PAIRS) * D + (pid % PAIRS) * PA + tl.arange(0, PA)       # (PA,) lanes i of a head
    rows2 = rows1 + D // 2                                                   # lanes i + D/2
    r_ok = rows1 < (HQ + 2 * HKV) * D
    cols = pid * OC_N + tl.arange(0, OC)                                     # (OC,) phases C and D2's columns
    c_ok = (tl.arange(0, OC) < OC_N) & (cols < C)
    offs_i = pid * IB_N + tl.arange(0, IB)                                   # (IB,) phase D1's h columns
    i_ok = (tl.arange(0, IB) < IB_N) & (offs_i < I)
    xres = tl.load(X0 + cols, mask=c_ok, other=0.0).to(tl.float32)           # (OC,) the residual at cols
    xmid = xres
    if ALL or PHASE == 0:  # phase A's prefetch for the first layer
        layer = layer0
        w1a, w1b = _rows2(_addr(PTRS, layer, W_QKV, dtype), rows1, r_ok, C, offs_a, a_ok, offs_b, b_ok)  # (PA, A/B)
        w2a, w2b = _rows2(_addr(PTRS, layer, W_QKV, dtype), rows2, r_ok, C, offs_a, a_ok, offs_b, b_ok)
        g1a, g1b = _vec2(_addr(PTRS, layer, LN1_W, dtype), offs_a, a_ok, offs_b, b_ok, True)
        l1a, l1b = _vec2(_addr(PTRS, layer, LN1_B, dtype), offs_a, a_ok, offs_b, b_ok, LN_BIAS)
        bq1 = _bias_rows(_addr(PTRS, layer, B_QKV, dtype), rows1, r_ok, QKV_BIAS)
        bq2 = _bias_rows(_addr(PTRS, layer, B_QKV, dtype), rows2, r_ok, QKV_BIAS)
    for layer in range(layer0, layer0 + n_layers):
        flag = base + layer + 1
        KC = _addr(PTRS, layer, K_CACHE, dtype)
        VC = _addr(PTRS, layer, V_CACHE, dtype)
        if ALL or PHASE == 0:
            if pid < N_A:
                _phase_qkv(X0, LR, LQ, KC, VC, COS, SIN, layer, pos, flag, eps1, stride_ch, stride_cn,
                           stride_rope, w1a, w1b, w2a, w2b, g1a, g1b, l1a, l1b, bq1, bq2, rows1, rows2, r_ok,
                           offs_a, a_ok, offs_b, b_ok, C, D, HQ, HKV, RMS, ROPE, ALL, dtype, TIMES, pid,
                           TIMELINE)
                _stamp(TIMES, pid, layer, 1, TIMELINE)
        if ALL or PHASE == 3:  # phase C's weights stream in during attention
            woa, wob = _rows2(_addr(PTRS, layer, W_O, dtype), cols, c_ok, HQ * D, offs_ya, ya_ok, offs_yb,
                              yb_ok)                                         # (OC, Y_A), (OC, Y_B)
            bo = _bias_rows(_addr(PTRS, layer, B_O, dtype), cols, c_ok, O_BIAS)
        if ALL or PHASE == 1:
            if pid < HKV * S:
                _phase_attention(LQ, LP, KC, VC, pid, Tc, S, flag, qk_scale, stride_ch, stride_cn, D, HQ, HKV, GP,
                                 BLOCK_N, MAX_S, PRECISION, ALL, dtype, TIMES, layer, TIMELINE)
                _stamp(TIMES, pid, layer, 3, TIMELINE)
        if ALL or PHASE == 2:
            if (pid >= M0) & (pid < M0 + HQ):
                _phase_merge(LP, LY, pid - M0, S, flag, D, MAX_S, ALL, dtype, TIMES, pid, layer, TIMELINE)
                _stamp(TIMES, pid, layer, 5, TIMELINE)
        if ALL or PHASE == 3:
            if pid * OC_N < C:
                if not ALL:  # the residual at cols from the words the launch before left
                    if layer > 0:
                        xres = _poll1(LR + cols, c_ok, flag - 1, False)
                xmid = _phase_out(LY, LXM, xres, flag, woa, wob, bo, cols, c_ok, offs_ya, ya_ok, offs_yb, yb_ok,
                                  ALL, dtype, TIMES, pid, layer, TIMELINE)
                _stamp(TIMES, pid, layer, 7, TIMELINE)
        if ALL or PHASE == 4:
            fa, fb, ua, ub, g2a, g2b, l2a, l2b, bf1, bf2 = _up_weights(
                PTRS, layer, offs_i, i_ok, offs_a, a_ok, offs_b, b_ok, C, I, LN_BIAS, SWIGLU, FC_BIAS, dtype)
            if pid * IB_N < I:
                _phase_up(LXM, LH, flag, eps2, fa, fb, ua, ub, g2a, g2b, l2a, l2b, bf1, bf2, offs_i, i_ok,
                          offs_a, a_ok, offs_b, b_ok, C, RMS, SWIGLU, ALL, dtype, TIMES, pid, layer, TIMELINE)
                _stamp(TIMES, pid, layer, 9, TIMELINE)
        if ALL or PHASE == 5:
            wda, wdb = _rows2(_addr(PTRS, layer, W_DN, dtype), cols, c_ok, I, offs_ia, ia_ok, offs_ib, ib_ok)
            bdn = _bias_rows(_addr(PTRS, layer, B_DN, dtype), cols, c_ok, DN_BIAS)
            if pid * OC_N < C:
                if not ALL:  # x_mid at cols from phase C's launch
                    xmid = _poll1(LXM + cols, c_ok, flag, False)
                xres = _phase_down(LH, LR, OUT, xmid, layer == last, flag, wda, wdb, bdn, cols, c_ok, offs_ia,
                                   ia_ok, offs_ib, ib_ok, ALL, dtype, TIMES, pid, layer, TIMELINE)
                _stamp(TIMES, pid, layer, 11, TIMELINE)
        if ALL:  # the next layer's phase A prefetch (the last layer: a harmless reload of its own rows)
            nl = tl.minimum(layer + 1, layer0 + n_layers - 1)
            w1a, w1b = _rows2(_addr(PTRS, nl, W_QKV, dtype), rows1, r_ok, C, offs_a, a_ok, offs_b, b_ok)
            w2a, w2b = _rows2(_addr(PTRS, nl, W_QKV, dtype), rows2, r_ok, C, offs_a, a_ok, offs_b, b_ok)
            g1a, g1b = _vec2(_addr(PTRS, nl, LN1_W, dtype), offs_a, a_ok, offs_b, b_ok, True)
            l1a, l1b = _vec2(_addr(PTRS, nl, LN1_B, dtype), offs_a, a_ok, offs_b, b_ok, LN_BIAS)
            bq1 = _bias_rows(_addr(PTRS, nl, B_QKV, dtype), rows1, r_ok, QKV_BIAS)
            bq2 = _bias_rows(_addr(PTRS, nl, B_QKV, dtype), rows2, r_ok, QKV_BIAS)
    if ALL or PHASE == 6:  # the last program to leave advances the epoch (the next launch's flags)
        if tl.atomic_add(SYNC + 1, 1, sem="acq_rel", scope="gpu") == nprog - 1:
            tl.atomic_xchg(SYNC + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(SYNC, 1, sem="relaxed", scope="gpu")


_triton.check_decorated(_decode_stack_kernel)


def _pow2_at_least(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(n))


class StackPlan:
    """What decode_stack needs of a model, built once: the table of each layer's addresses, the shape
    constants and the step's word buffers (fixed addresses, so a CUDA graph can hold them).

    layers: per layer a dict with w_qkv (Nqkv, C), b_qkv, ln1 (weight, bias or None, eps), w_o (C, Hq·D),
    b_o, ln2, w_fc ((2)I, C), b_fc, w_down (C, I), b_down, k_cache, v_cache ((B', Hkv, max_len, D));
    absent biases None. n_head, n_kv_head, head_dim; rms, swiglu, rope (bool): the model's kinds.
    programs: the grid (default the SM count; tests pass what their shape needs).
    """

    def __init__(self, layers: list[dict], *, n_head: int, n_kv_head: int, head_dim: int, rms: bool,
                 swiglu: bool, rope: bool, programs: int | None = None):
        if not layers:
            raise ValueError("decode_stack: no layers")
        if len(layers) > MAX_LAYERS:
            raise ValueError(f"decode_stack: {len(layers)} layers above {MAX_LAYERS}")
        first = layers[0]
        w = first["w_qkv"]
        dtype, device = w.dtype, w.device
        C = w.shape[1]
        I = first["w_down"].shape[1]
        D, HQ, HKV = head_dim, n_head, n_kv_head
        self.programs = programs or _triton.sm_count(device)
        why = fits(C, I, D, HQ, HKV, dtype, self.programs)
        if why:
            raise ValueError(f"decode_stack: {why}")
        self.C, self.I, self.D, self.HQ, self.HKV = C, I, D, HQ, HKV
        self.rms, self.swiglu, self.rope = bool(rms), bool(swiglu), bool(rope)
        self.dtype, self.device, self.n_layers = dtype, device, len(layers)
        self.blocks = _blocks(C, I, D, HQ, HKV, self.programs)
        # phase B's HKV x splits programs fit the grid; a power of two (a head's merge loads its partials as one tile)
        self.max_splits = _max_splits(HKV, self.programs)
        shapes = {"w_qkv": ((HQ + 2 * HKV) * D, C), "w_o": (C, HQ * D), "w_fc": ((2 * I if swiglu else I), C),
                  "w_down": (C, I)}
        biases = {"b_qkv": shapes["w_qkv"][0], "b_o": C, "b_fc": shapes["w_fc"][0], "b_down": C}
        k0 = first["k_cache"]
        self.eps = (float(first["ln1"][2]), float(first["ln2"][2]))
        self.has = {b: first[b] is not None for b in biases}
        self.ln_bias = first["ln1"][1] is not None
        rows = []
        for i, lay in enumerate(layers):
            for name, shape in shapes.items():
                t = lay[name]
                if tuple(t.shape) != shape or not t.is_contiguous():
                    raise ValueError(f"decode_stack: layer {i} {name} must be a contiguous {shape}, got "
                                     f"{tuple(t.shape)}")
            for name, n in biases.items():
                t = lay[name]
                if (t is not None) != self.has[name] or (t is not None and tuple(t.shape) != (n,)):
                    raise ValueError(f"decode_stack: layer {i} {name} must be ({n},) in every layer or none")
            for name in ("ln1", "ln2"):
                g, b, eps = lay[name]
                if (tuple(g.shape) != (C,) or (b is not None) != self.ln_bias or (b is not None and tuple(b.shape) != (C,))
                        or float(eps) != self.eps[name == "ln2"] or (self.rms and b is not None)):
                    raise ValueError(f"decode_stack: layer {i} {name}: a ({C},) gain, the same bias use and eps "
                                     "in every layer (RMSNorm: no bias)")
            kc, vc = lay["k_cache"], lay["v_cache"]
            if (kc.dim() != 4 or kc.shape != k0.shape or kc.stride() != k0.stride() or vc.shape != kc.shape
                    or vc.stride() != kc.stride() or kc.shape[1] != HKV or kc.shape[3] != D or kc.stride(3) != 1):
                raise ValueError(f"decode_stack: layer {i} caches must be (B', {HKV}, max_len, {D}) with unit "
                                 "stride along D, the same shape and strides in every layer")
            row = []
            for t in _table_tensors(lay):
                if t is None:
                    row.append(0)
                    continue
                if t.dtype != dtype or t.device != device:
                    raise ValueError(f"decode_stack: layer {i}: every weight and cache must be {dtype} on {device}")
                if t.data_ptr() % 16:
                    raise ValueError(f"decode_stack: layer {i}: a tensor's address is not 16-byte aligned")
                row.append(t.data_ptr())
            rows.append(row)
        self.addresses = rows
        self.ptrs = torch.tensor(rows, dtype=torch.int64, device=device)      # (L, N_PTRS)
        self.max_len = k0.shape[2]
        self.stride_ch, self.stride_cn = k0.stride(1), k0.stride(2)
        words = dict(q=(HQ + 2 * HKV) * D, part=HQ * self.max_splits * (D + 2), y=HQ * D, xmid=C, h=I, x=C)
        # word buffers (module docstring); flags start at 0, which no launch's flag equals
        self.words = {k: torch.zeros(n, dtype=torch.int64, device=device) for k, n in words.items()}
        self.sync = torch.zeros(2, dtype=torch.int32, device=device)          # epoch, departures
        self.keep = layers  # the tensors whose addresses the table holds stay alive with the plan

    def same_tensors(self, layers: list[dict]) -> bool:
        """Whether `layers` still has the tensors (addresses) this plan was built from."""
        if len(layers) != self.n_layers:
            return False
        return all([0 if t is None else t.data_ptr() for t in _table_tensors(lay)] == row
                   for row, lay in zip(self.addresses, layers))


def _table_tensors(lay: dict) -> list:
    """A layer's tensors in the address table's column order (TABLE; None for an absent bias)."""
    ln1, ln2 = lay["ln1"], lay["ln2"]
    by_name = dict(lay, ln1_w=ln1[0], ln1_b=ln1[1], ln2_w=ln2[0], ln2_b=ln2[1])
    return [by_name[name] for name in TABLE]


def _max_splits(HKV: int, programs: int) -> int:
    return min(MAX_SPLITS, 1 << (max(programs // HKV, 1).bit_length() - 1))


def _blocks(C: int, I: int, D: int, HQ: int, HKV: int, programs: int) -> dict:
    """Each phase's share of a program: PA lane pairs (a power of two), OC_N output columns (C, D2) and IB_N
    intermediate columns (D1) spread as evenly as the grid allows, in tiles OC, IB (powers of two); M0 the
    first of the HQ merging programs (the grid's last, which have the least else to do)."""
    pa = 1
    while (HQ + 2 * HKV) * (D // 2) // pa > programs and pa < D // 2:
        pa *= 2
    oc_n, ib_n = triton.cdiv(C, programs), triton.cdiv(I, programs)
    return {"PA": pa, "OC": triton.next_power_of_2(oc_n), "OC_N": oc_n, "IB": triton.next_power_of_2(ib_n),
            "IB_N": ib_n, "M0": max(programs - HQ, 0)}


def fits(C: int, I: int, D: int, HQ: int, HKV: int, dtype: torch.dtype, programs: int) -> str | None:
    """Why decode_stack cannot take this shape on `programs` programs, or None."""
    if dtype not in _triton.SUPPORTED_DTYPES:
        return f"dtype {dtype}"
    if not 1 <= C <= MAX_C:
        return f"width {C} above {MAX_C}"
    if D & (D - 1) or not 16 <= D <= 128:
        return f"head dim {D} (a power of two 16..128)"
    if HKV < 1 or HQ % HKV:
        return f"{HQ} query heads not a multiple of {HKV} kv heads"
    if HKV > programs or HQ > programs:
        return f"{HQ} query heads above {programs} programs"
    b = _blocks(C, I, D, HQ, HKV, programs)
    if (HQ + 2 * HKV) * (D // 2) // b["PA"] > programs:
        return f"{HQ + 2 * HKV} heads of QKV rows above one program per SM"
    if b["IB"] > 64 or b["OC"] > 64 or b["OC"] * sum(_parts(I)) > MAX_I_TILE:
        return f"an intermediate width {I} or width {C} needing more than one program per SM can hold"
    return None


def decode_stack(plan: StackPlan, x: torch.Tensor, pos: torch.Tensor, rope: tuple | None = None, *,
                 phase_by_phase: bool | None = None, timeline: torch.Tensor | None = None) -> torch.Tensor:
    """x (1, C) the embedded token at position pos ((1,) int tensor, on the device) → (1, C) the residual
    stream after the plan's last layer (a new tensor); writes the token's k and v into every layer's cache.

    rope: (cos, sin) tables (L, D) in x's dtype, unit stride along D, row p the angles of position p
    (plan.rope models). phase_by_phase: one launch per phase instead of one for everything (default: in
    Triton's interpreter only). timeline: an int64 (programs, 1024, N_STAMPS) tensor that receives each
    program's global-timer stamps around every phase (the one-launch form on a GPU only; bench/stack_timeline.py).
    """
    if x.dim() != 2 or tuple(x.shape) != (1, plan.C) or x.dtype != plan.dtype or x.device != plan.device \
            or not x.is_contiguous():
        raise ValueError(f"decode_stack: x must be a contiguous (1, {plan.C}) {plan.dtype} tensor on {plan.device}")
    if (not isinstance(pos, torch.Tensor) or pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64)
            or pos.device != x.device):
        raise ValueError(f"decode_stack: pos must be a one-element int tensor on {x.device}")
    if plan.rope != (rope is not None):
        raise ValueError("decode_stack: rope tables are needed exactly for a RoPE model")
    if rope is not None:
        cos, sin = rope
        if (cos.dim() != 2 or cos.shape[1] != plan.D or cos.dtype != x.dtype or cos.device != x.device
                or cos.stride(1) != 1 or sin.shape != cos.shape or sin.stride() != cos.stride()
                or sin.dtype != x.dtype):
            raise ValueError(f"decode_stack: rope must be (cos, sin), each (L, {plan.D}) {x.dtype} with unit "
                             "stride along D")
    _triton.check_device(x.device, "decode_stack")
    if phase_by_phase is None:
        phase_by_phase = _triton.INTERPRET
    if timeline is not None and (phase_by_phase or timeline.dtype != torch.int64 or timeline.device != x.device
                                 or tuple(timeline.shape) != (plan.programs, 1024, N_STAMPS.value)):
        raise ValueError(f"decode_stack: timeline must be an int64 ({plan.programs}, 1024, {N_STAMPS.value}) "
                         f"tensor on {x.device}, with the one-launch form")
    out = _triton.empty((1, plan.C), x.dtype, x.device)
    cos, sin = rope if rope is not None else (x, x)
    pa, pb = _parts(plan.C)
    ia, ib = _parts(plan.I)
    ya, yb = _parts(plan.HQ * plan.D)
    consts = dict(C=plan.C, PART_A=pa, PART_B=pb, I=plan.I, I_A=ia, I_B=ib, Y_A=ya, Y_B=yb, D=plan.D, HQ=plan.HQ,
                  HKV=plan.HKV, GP=_pow2_at_least(plan.HQ // plan.HKV, 16),
                  BLOCK_N=BLOCK_N, MAX_S=plan.max_splits, RMS=plan.rms, LN_BIAS=plan.ln_bias, SWIGLU=plan.swiglu,
                  ROPE=plan.rope, QKV_BIAS=plan.has["b_qkv"], O_BIAS=plan.has["b_o"],
                  FC_BIAS=plan.has["b_fc"], DN_BIAS=plan.has["b_down"], **plan.blocks)
    consts["PRECISION"] = "ieee" if plan.dtype == torch.float32 else "tf32"  # fp32 models: exact dots
    qk_scale = _triton.LOG2E / math.sqrt(plan.D)
    w = plan.words
    args = (plan.ptrs, x, w["q"], w["part"], w["y"], w["xmid"], w["h"], w["x"], pos, cos, sin, out, plan.sync,
            timeline if timeline is not None else plan.sync)
    scal = (plan.eps[0], plan.eps[1], qk_scale, plan.stride_ch, plan.stride_cn, cos.stride(0))
    grid = (plan.programs,)
    last = plan.n_layers - 1
    with _triton.device_guard(x):
        if not phase_by_phase:
            _decode_stack_kernel[grid](*args, 0, plan.n_layers, last, *scal, **consts, PHASE=-1,
                                       TIMELINE=timeline is not None, num_warps=WARPS, num_stages=1)
            return out
        for layer in range(plan.n_layers):
            for phase in range(6):
                _decode_stack_kernel[grid](*args, layer, 1, last, *scal, **consts, PHASE=phase, TIMELINE=False,
                                           num_warps=WARPS, num_stages=1)
        _decode_stack_kernel[grid](*args, 0, 0, last, *scal, **consts, PHASE=6, TIMELINE=False, num_warps=WARPS,
                                   num_stages=1)
    return out


__all__ = ["StackPlan", "decode_stack", "fits", "MAX_C", "MAX_SPLITS", "N_STAMPS"]
