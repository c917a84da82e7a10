"""Split-KV decode attention (flash-decoding) in Triton: a few new query tokens against a static KV cache.

    decode_attention(q, k_cache, v_cache, cache_lens, *, sm_scale=None, num_splits=None, tile=None, window=0)
        -> (B, Hq, Nq, D)

Shapes:
    q        (B, Hq, Nq, D)        the Nq new tokens' queries (their keys/values are already in the cache)
    k_cache  (B, Hkv, max_len, D)  preallocated static cache; v_cache the same shape
    cache_lens (B,) int32/int64    valid positions per sequence, INCLUDING the Nq new tokens
Query i of sequence b sits at position p = cache_lens[b] - Nq + i and attends to cache positions j <= p
(causal, bottom-right aligned: the same semantics as `naive_attention` on the valid prefix). Positions
>= cache_lens[b] are never read into the result: they may hold anything, NaN included.
window > 0 (a sliding window, Mistral's and Gemma's local layers): query i at position p sees positions
p - window + 1 .. p only. The split programs then cover the key blocks from the earliest new token's window on,
so a step reads window + Nq - 1 keys whatever the cache length (blocks counted from the window's first key), and
positions before that token's window are never read either; the split count below is planned for those keys
(the L of the plan is that span). window >= max_len cuts nothing.

Supported, and checked with a ValueError before any launch:
    dtypes      float16, bfloat16, float32 (q, k_cache, v_cache alike); softmax and accumulation in float32,
                float32 inputs use exact ("ieee") dot products, not TF32
    head dim    16 <= D <= 256, any value (non-powers of two are padded to a power-of-two BLOCK_D and masked)
    queries     1 <= Nq <= 16 new tokens per sequence
    heads       Hq a multiple of Hkv (MHA, GQA, MQA); one program handles all the query heads of a kv head
                (up to 64 query rows = heads x tokens; more rows are split over several programs), so the
                cache is read once per kv group
    lengths     Nq <= cache_lens[b] <= max_len, may differ per sequence; any strides (views of a larger cache).
                With check_lens=False nothing checks them; a length outside [0, max_len] is clamped into it on
                the device, so the kernels never read outside the cache
    devices     CUDA; CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, for tests)
Inference only: there is no backward, and inputs that require grad (with grad mode on) are refused.

The scheme: the valid prefix of each sequence is cut into chunks (a multiple of BLOCK_N keys each) processed
by separate programs, so that even batch 1 with a long cache fills the GPU. Each split writes its partial
output O_s (normalised, fp32) and its log-sum-exp lse_s; a second kernel merges them (or, as an option, the
last split program to finish; see below):
    out = sum_s 2^(lse_s - M) O_s / sum_s 2^(lse_s - M),   M = max_s lse_s
A row that sees no key of a split (the causal edge of Nq > 1 tokens) has lse_s = -inf there, weight 0.

The grid holds `num_splits` split programs per (sequence, kv head, row block); the split count a sequence
actually uses, and the chunk of each split, are computed ON THE DEVICE from its own cache_lens[b]
(split_plan below, the same formula in both kernels), so a launch sized on the host for the longest possible
cache stays right inside a CUDA graph whose lengths change at every replay:
    num_splits=None  (auto) the long count from auto_num_splits(rows of work, length, programs_per_sm(tile)):
                     `length` is the longest cache_lens when the host reads them (check_lens=True outside
                     graph capture), else max_len. The grid holds that count, or more where it leaves no SM
                     more than one program (short_grid_splits, option decode_short_splits: at batch 1 a
                     sequence of up to SHORT_SPLITS_MAX_LEN keys may then use more splits than the long
                     count, one block each; 2k keys of GPT-2 1.07x SDPA instead of 0.95-0.97x on an H200,
                     bench/results/decode_attention/short_splits/). On the device a sequence uses
                     L // decode_min_keys_per_split splits where that fits the grid (in a short grid
                     cdiv(L, decode_min_keys_per_split), so lengths between multiples of it get one split
                     per block too), else the long count
                     (one when L <= SINGLE_SPLIT_MAX_LEN), so a split gets about L / splits >= the option's
                     keys (chunks are rounded up to BLOCK_N; the last split holds the remainder). The long
                     count's programs start first (_split_and_sequence).
    num_splits=k     exactly k splits of ceil(L / k) keys each (rounded up to BLOCK_N; the last splits of a
                     short sequence may then be empty)
    num_splits=1     the plain non-split kernel, which writes the output directly (the benchmark's baseline)
Which blocks a used split reads (kernels.options decode_split_order): "strided" (the default) blocks s,
s + used, s + 2 * used, ... of the whole prefix, so that at any moment a sequence's splits read neighbouring
blocks; "chunks" its contiguous chunk [s * chunk, (s + 1) * chunk). Either way a split holds about L / used
keys, in whole blocks, and the merge is the same.
Splits a sequence does not use exit at once and write nothing; the merge reads only the used ones, and when
a sequence uses one split, that split writes the output itself and the merge skips the row.

Merging inside the split kernel (kernels.options decode_merge_in_split, FLASHGPT_DECODE_MERGE_IN_SPLIT=1; off
by default): no merge launch. Each split program of a multi-split sequence stores its
part, then adds 1 to an int32 counter of its (sequence, kv head, row block) with an acq_rel atomic; the
program that finds used - 1 there merges the used parts with the same code as the merge kernel (reading them
past L1) and sets the counter back to 0. The counters are one zeroed buffer per device (merge_counters),
shared by every call: calls must follow each other in one stream order (as eager calls, a CUDA graph's layers
and its replays do), and the first call needing a larger buffer must come before CUDA graph capture.

A full grid (kernels.options decode_full_grid, on by default): where the call's (sequence, kv head, row block)
programs are at least as many as the GPU's SMs (batch 16 of GPT-2's 12 heads on 132 SMs) and the length the
automatic count is planned for is at most the decode_full_grid_max_len option (32,768), the grid has one split:
one launch, no merge. Such a launch is not a PDL dependent (option decode_full_grid_pdl, off): it starts once
the kernel before it has ended (it still lets the next kernel start early). On an H200 at batch 16 and a
capacity of 32k that was 0.96-1.00x SDPA at 1k-32k keys against 0.81-1.01x for two splits and their merge, and
the launch without PDL made back-to-back unsplit calls 7-11 % faster and GPT-2's decode step 1 % faster
(bench/results/decode_attention/full_grid_nodep/). With the decode_full_grid_long_splits option (0, off: the
automatic count) a full-grid call planned for more keys than decode_full_grid_max_len gets that many splits,
and its sequences of up to decode_full_grid_max_len keys run unsplit on the device (split_plan's UNSPLIT_MAX),
so that a graph sized for a long capacity still runs short caches in one split.

TMA loads (kernels.options decode_tma, FLASHGPT_DECODE_TMA=1; off by default): the split kernel reads K and V
through TMA tensor descriptors over the whole (B, Hkv, max_len, D) caches, (1, 1, BLOCK_N, BLOCK_D) blocks built
on the host (no per-program descriptor set-up), instead of pointer loads, where decode_tma_ok allows it: a
Hopper-or-newer GPU, 16-bit caches, unit stride along D, a 16-byte aligned base and strides. Rows past a
sequence's length are then read as they are and masked in registers (scores to -inf, V rows to 0). Triton's TMA
pipeline keeps one K/V tile more in shared memory than its pointer pipeline (program_smem counts it), and such
a launch keeps the three-stage tile where pointer loads would get deep_tile's four. Timed on one H100
(bench/results/decode_attention/tma_h100/, four stages at batch 1): 1-2 % slower than pointer loads at 32k keys.

Query rows per program (kernels.options decode_min_rows, FLASHGPT_DECODE_MIN_ROWS; 16 by default): the dot
path pads a kv head's group x new tokens to at least this many rows. At 16 Triton gives each of a program's
warps a quarter of the keys, so every block's row max and row sum cross the warps through shared memory (seven
CTA barriers in the key loop's SASS at sm_90, Triton 3.9); at 64 sm_90 runs the two products as warpgroup MMAs
whose warps own 16 rows each, so the softmax stays within each warp (two barriers in the loop), at four times
the padded rows' arithmetic and with every stage's K and V tile and the Q tile in shared memory (program_smem).

Key parts per program (kernels.options decode_key_parts, FLASHGPT_DECODE_KEY_PARTS; 1 by default): with P > 1
parts, a program of the dot path with pointer loads splits each block of BLOCK_N keys into P parts of
BLOCK_N / P keys (at least 16) and keeps P online-softmax states, one per part (a batched dot over the parts:
scores (P, BLOCK_M, BLOCK_N / P)). Each part's row max and row sum stay within the part, so the key loop does no
reduction across warps; the P states are merged once, after the loop (the log-sum-exp merge of the splits,
within the program). With P = num_warps Triton gives each warp its own part: the loop's CTA barriers are the
software pipeline's alone (two at sm_90 against seven at 16 rows over four warps, PTX of Triton 3.9), at the
same tensor-core work and four times the accumulator registers (P x BLOCK_M x BLOCK_D fp32); with fewer parts
than warps the loop keeps its seven. TMA launches and the vec path keep one part. Off by default: on one H100
the merge after the loop cost more than the barriers saved wherever a program reads few blocks (batch 1 1.28x
the time at 1k keys), and programs streaming long caches were 0.5-2 % faster
(bench/results/decode_attention/key_parts_h100/).

Tile configs: `tile=DecodeTile(block_n, num_warps, num_stages, dot)` overrides the default (default_tile, or
deep_tile's four stages where the automatic split count leaves at most one split program per SM);
dot=False computes the scores and the weighted sum of V with broadcast multiplies and row sums instead of
tensor-core dots, and applies only where one program holds one query row (group * Nq == 1).

Checking cache_lens against [Nq, max_len] reads it back from the GPU (a sync); it is skipped while a CUDA graph
is being captured, and `check_lens=False` skips it explicitly.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import _triton
from . import options as _options
from .pdl import pdl_enabled

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host-side descriptors: pointer loads only
    TensorDescriptor = None

MAX_NQ = 16           # new tokens per call
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
MAX_ROWS = 64         # query rows (heads of a group x new tokens) per program
MAX_SPLITS = 256
SINGLE_SPLIT_MAX_LEN = 512  # caches of at most this many positions run unsplit (one launch, no merge)
SHORT_SPLITS_MAX_LEN = 2048  # up to this many keys a sequence may get a split per block (short_grid_splits)
PROGRAMS_PER_SM = 4   # the automatic split count plans at most this many resident split programs per SM
SMEM_MARGIN = 10 << 10  # a split program's shared memory besides its pipelined K/V tiles (sm_90: 5-9 KB)
WGMMA_ROWS = 64       # query rows from which the split kernel's dots are warpgroup MMAs at sm_90
WGMMA_MARGIN = 2 << 10  # ... and such a program's shared memory besides its tiles (barriers)
MERGE_TILE = 16       # splits the merge kernel reads per step
MERGE_STEP = 4096     # part elements the merge inside the split kernel reads per step (rows x splits x BLOCK_D)


def program_smem(block_n: int, num_stages: int, block_d: int, elem_size: int, tma: bool = False,
                 rows: int = 16) -> int:
    """Shared memory of one split program in bytes: its num_stages - 1 K and V tiles in flight (as Triton's
    software pipeline keeps them), one tile more with TMA loads (Triton 3.6 and 3.9 at sm_90: 88,096 against
    71,680 bytes for the three-stage 128 x 64 bf16 tile), plus SMEM_MARGIN. With WGMMA_ROWS query rows or more
    (the decode_min_rows option) sm_90 runs warpgroup MMAs, which read K, V and the Q tile from shared memory:
    num_stages K and V tiles and the Q tile, with TMA loads too (Triton 3.9: 106,496 bytes for that tile, 106,544
    with TMA, 139,264 with four stages), plus WGMMA_MARGIN; counted so on every GPU (elsewhere it is more than
    the program takes)."""
    if rows >= WGMMA_ROWS:
        return (num_stages * 2 * block_n + rows) * block_d * elem_size + WGMMA_MARGIN
    tiles = max(num_stages - 1, 0) * 2 + (1 if tma else 0)
    return tiles * block_n * block_d * elem_size + SMEM_MARGIN


WIDE_ROW_SMEM = program_smem(128, 3, 128, 2)  # the 128-key, 3-stage tile of 16-bit D = 128 (256-byte rows)


# The host's integer helpers are plain Python: triton.cdiv and triton.next_power_of_2 cost microseconds per call,
# and decode_attention runs once per layer and token.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class DecodeTile:
    """A launch config of the split kernel: keys per step, warps, software-pipeline stages, and whether the
    two products run as tensor-core dots (dot=False: broadcast multiply + row sum, one query row only)."""
    block_n: int
    num_warps: int
    num_stages: int
    dot: bool = True

    def __post_init__(self):
        ok = (self.block_n in (16, 32, 64, 128, 256) and self.num_warps in (1, 2, 4, 8, 16)
              and 1 <= self.num_stages <= 8 and isinstance(self.dot, bool))
        if not ok:
            raise ValueError(f"bad decode tile {self}: block_n in 16..256 (a power of two), num_warps in "
                             "1..16 (a power of two), 1 <= num_stages <= 8, dot a bool")

    def __str__(self) -> str:
        return f"n{self.block_n} w{self.num_warps} s{self.num_stages} {'dot' if self.dot else 'vec'}"


@functools.lru_cache(maxsize=None)
def default_tile(block_d: int, elem_size: int, rows: int, smem: int | None = None) -> DecodeTile:
    """The split kernel's config for a padded head dim, an element size in bytes, the query rows per kv head and
    the shared memory of one SM in bytes (None: not known, as on the CPU).

    128 keys per step where a tile row is at most 128 bytes (16-bit, D <= 64: the H200 sweep in
    bench/results/decode_attention/ timed it faster than 64 keys at every batch and cache length), and for
    16-bit rows of 256 bytes (D = 128) where an SM holds one such program (WIDE_ROW_SMEM: the H100 sweeps in
    bench/results/decode_attention/d128_tiles_h100/ timed it faster than 64 keys); else 64 (32 above a head dim
    of 128); three K/V tiles in flight, two when a tile row is wide (fp32 or D > 128) to stay within shared
    memory.
    """
    del rows  # one table for every row count (dot products throughout)
    row_bytes = block_d * elem_size
    wide_ok = row_bytes == 256 and elem_size == 2 and smem is not None and smem >= WIDE_ROW_SMEM
    block_n = 128 if row_bytes <= 128 or wide_ok else 64 if block_d <= 128 else 32
    return DecodeTile(block_n=block_n, num_warps=4 if block_d <= 128 else 8,
                      num_stages=3 if row_bytes <= 256 else 2, dot=True)


def deep_tile(tile: DecodeTile, block_d: int, elem_size: int) -> DecodeTile | None:
    """The default tile with one more K/V tile in flight (four stages), for a grid of split programs that gives
    no SM more than one: the H200 sweep (bench/results/decode_attention/) timed it 2-9 % faster than three stages
    at batch 1 (GPT-2's 12 heads, 11 splits, 1k-32k keys but 8k, where it was 1 % slower), while at two or more
    programs per SM (batch 16) its larger shared memory costs a resident program and it was slower. None where
    it was not measured: tiles whose rows are wider than 128 bytes, or not the three-stage default."""
    if block_d * elem_size > 128 or tile.num_stages != 3 or not tile.dot:
        return None
    return DecodeTile(tile.block_n, tile.num_warps, tile.num_stages + 1, tile.dot)


@triton.jit
def split_plan(L, NUM_SPLITS, LONG_SPLITS, MIN_CHUNK, UNSPLIT_MAX, BLOCK_N: tl.constexpr):
    """(chunk, used) for a sequence of L valid keys: the keys per split (a multiple of BLOCK_N, at least one
    block) and how many of the NUM_SPLITS splits hold any key (at least 1). Used splits: L <= UNSPLIT_MAX
    gives one; otherwise, where L <= NUM_SPLITS * MIN_CHUNK, L // MIN_CHUNK (or, in a short grid, LONG_SPLITS <
    NUM_SPLITS: cdiv(L, MIN_CHUNK), so that such a sequence gets one split per MIN_CHUNK keys whether or not L
    is a multiple of it), else LONG_SPLITS (<= NUM_SPLITS); at least one. The host's twin: plan_splits."""
    short = tl.where(LONG_SPLITS < NUM_SPLITS, tl.cdiv(L, MIN_CHUNK), L // MIN_CHUNK)
    n = tl.where(L <= NUM_SPLITS * MIN_CHUNK, short, LONG_SPLITS)
    n = tl.where(L <= UNSPLIT_MAX, 1, tl.maximum(n, 1))
    chunk = tl.maximum(tl.cdiv(tl.cdiv(L, n), BLOCK_N), 1) * BLOCK_N
    used = tl.maximum(tl.cdiv(L, chunk), 1)
    return chunk, used


def plan_splits(L: int, num_splits: int, min_chunk: int, unsplit_max: int, block_n: int,
                long_splits: int | None = None) -> tuple[int, int]:
    """split_plan on the host (same integer arithmetic): (chunk, used) for L valid keys; long_splits None:
    num_splits."""
    long_splits = num_splits if long_splits is None else long_splits
    if L <= num_splits * min_chunk:
        n = _cdiv(L, min_chunk) if long_splits < num_splits else L // min_chunk
    else:
        n = long_splits
    n = 1 if L <= unsplit_max else max(n, 1)
    chunk = max(_cdiv(_cdiv(L, n), block_n), 1) * block_n
    return chunk, max(_cdiv(L, chunk), 1)


@triton.jit
def _first_key(L, WINDOW, N_Q: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The first cache position any of a sequence's N_Q new tokens sees (L valid keys, the new tokens last):
    0 without a window; with one, the earliest new token (position L - N_Q) sees positions from
    L - N_Q - WINDOW + 1. The split plan covers the L - first keys [first, L), in blocks of BLOCK_N keys
    counted from `first` (a block need not start at a multiple of BLOCK_N: each key's row is read on its own,
    so nothing before `first` is ever loaded and no block needs a lower bound on its loads)."""
    if HAS_WINDOW:
        first = tl.maximum(L - N_Q - WINDOW + 1, 0)
    else:
        first = L * 0
    return first


@triton.jit
def _load_kv_tile(X, b, h_kv, start, keys, offs_d, kv_ok, stride_xn, stride_xd, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """The (BLOCK_N, BLOCK_D) tile of cache rows start .. start + BLOCK_N - 1 of sequence b, kv head h_kv.
    TMA: X is a tensor descriptor over the whole (B, H_KV, max_len, D) cache, (1, 1, BLOCK_N, BLOCK_D) blocks
    (zeros past max_len and past D); rows past the sequence's length are read as they are (the caller masks
    them). Otherwise X points at this kv head's first row and the load is masked by kv_ok (zeros)."""
    if TMA:
        x = tl.reshape(X.load([b.to(tl.int32), h_kv.to(tl.int32), start, 0]), [BLOCK_N, BLOCK_D])
    else:
        x = tl.load(X + keys[:, None] * stride_xn + offs_d[None, :] * stride_xd, mask=kv_ok, other=0.0)
    return x


@triton.jit
def _attend_block(acc, l_i, m_i, q, K, V, b, h_kv, start, hi, q_pos, offs_n, offs_d, d_ok,
                  stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, WINDOW, DOT: tl.constexpr,
                  PRECISION: tl.constexpr, ROW_WINDOW: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N), of which those >= hi do not exist.

    K and V are loaded as (BLOCK_N, BLOCK_D) tiles, rows of D contiguous elements (_load_kv_tile; TMA: whatever
    the rows >= hi hold, NaN included, never reaches the result: their scores are masked to -inf and their V
    rows to 0). Scores are in log2 units (qk_scale includes log2(e)), so exp2 replaces exp. DOT=False: q holds
    one row (BLOCK_M == 1). ROW_WINDOW (a window with several new tokens): a row at q_pos sees only keys
    > q_pos - WINDOW (with one new token the key range itself starts at its window).
    """
    keys = start + offs_n                                                       # (BLOCK_N,)
    k_ok = keys < hi
    kv_ok = k_ok[:, None] & d_ok[None, :]                                       # (BLOCK_N, BLOCK_D)
    k = _load_kv_tile(K, b, h_kv, start, keys, offs_d, kv_ok, stride_kn, stride_kd, BLOCK_N, BLOCK_D, TMA)
    if DOT:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)                  # (BLOCK_M, BLOCK_N)
    else:
        s = tl.sum(q.to(tl.float32) * k.to(tl.float32), 1)[None, :]            # (1, BLOCK_N)
    s = s * qk_scale
    # causal, bottom-right; k_ok only matters for a split ending mid-block
    visible = k_ok[None, :] & (keys[None, :] <= q_pos[:, None])
    if ROW_WINDOW:
        visible = visible & (keys[None, :] > q_pos[:, None] - WINDOW)          # (BLOCK_M, BLOCK_N)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))                                       # (BLOCK_M,)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: keep exp2 finite
    alpha = tl.exp2(m_i - m_ref)                                                # rescales the old l, acc
    p = tl.exp2(s - m_ref[:, None])                                             # (BLOCK_M, BLOCK_N)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv_tile(V, b, h_kv, start, keys, offs_d, kv_ok, stride_vn, stride_vd, BLOCK_N, BLOCK_D, TMA)
    if TMA:
        v = tl.where(k_ok[:, None], v, 0.0)                                     # 0 * NaN would be NaN
    if DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)               # (BLOCK_M, BLOCK_D)
    else:
        pv = tl.sum(tl.sum(p, 0)[:, None] * v.to(tl.float32), 0)[None, :]      # (1, BLOCK_D)
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new


@triton.jit
def _attend_parts_block(acc, l_i, m_i, q, K, V, start, hi, q_pos, offs_d, d_ok, stride_kn, stride_kd, stride_vn,
                        stride_vd, qk_scale, WINDOW, PRECISION: tl.constexpr, ROW_WINDOW: tl.constexpr,
                        PARTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """_attend_block over keys [start, start + BLOCK_N) split into PARTS parts of PN = BLOCK_N / PARTS keys, each
    with its own online-softmax state: acc (PARTS, BLOCK_M, BLOCK_D), l_i and m_i (PARTS, BLOCK_M); q is the
    (PARTS, BLOCK_M, BLOCK_D) broadcast of the query tile. Part p holds keys start + p * PN .. + PN - 1; pointer
    loads (K and V point at this kv head's first row), masked past hi (zeros)."""
    PN: tl.constexpr = BLOCK_N // PARTS
    part = tl.arange(0, PARTS)
    key_rows = start + part[:, None, None] * PN + tl.arange(0, PN)[None, :, None]  # (PARTS, PN, 1)
    kv_ok = (key_rows < hi) & d_ok[None, None, :]                              # (PARTS, PN, BLOCK_D)
    k = tl.load(K + key_rows * stride_kn + offs_d[None, None, :] * stride_kd, mask=kv_ok, other=0.0)
    s = tl.dot(q, tl.trans(k, 0, 2, 1), input_precision=PRECISION)            # (PARTS, BLOCK_M, PN)
    s = s * qk_scale
    keys = start + part[:, None, None] * PN + tl.arange(0, PN)[None, None, :]   # (PARTS, 1, PN)
    visible = (keys < hi) & (keys <= q_pos[None, :, None])                     # (PARTS, BLOCK_M, PN)
    if ROW_WINDOW:
        visible = visible & (keys > q_pos[None, :, None] - WINDOW)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 2))                                       # (PARTS, BLOCK_M)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a part with no visible key yet: keep exp2 finite
    alpha = tl.exp2(m_i - m_ref)                                                # rescales the old l, acc
    p = tl.exp2(s - m_ref[:, :, None])                                          # (PARTS, BLOCK_M, PN)
    l_i = l_i * alpha + tl.sum(p, 2)
    v = tl.load(V + key_rows * stride_vn + offs_d[None, None, :] * stride_vd, mask=kv_ok, other=0.0)
    pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)                   # (PARTS, BLOCK_M, BLOCK_D)
    acc = acc * alpha[:, :, None] + pv
    return acc, l_i, m_new


@triton.jit
def _attend_parts(q, K, V, lo, L, split, used, chunk, q_pos, offs_d, d_ok, stride_kn, stride_kd, stride_vn,
                  stride_vd, qk_scale, WINDOW, PRECISION: tl.constexpr, ROW_WINDOW: tl.constexpr,
                  STRIDED: tl.constexpr, PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """A split's blocks (the kernel's STRIDED or chunk order) through _attend_parts_block, then its PARTS states
    merged into one: returns acc (BLOCK_M, BLOCK_D), l_i and m_i (BLOCK_M,) as the one-part loop leaves them
    (l_i and acc relative to 2^m_i; m_i -inf and l_i 0 where no key was seen)."""
    q3 = tl.broadcast_to(q[None, :, :], (PARTS, BLOCK_M, BLOCK_D))              # (PARTS, BLOCK_M, BLOCK_D)
    m3 = tl.full([PARTS, BLOCK_M], float("-inf"), tl.float32)
    l3 = tl.zeros([PARTS, BLOCK_M], tl.float32)
    acc3 = tl.zeros([PARTS, BLOCK_M, BLOCK_D], tl.float32)
    if STRIDED:
        for start in range(lo + split * BLOCK_N, L, used * BLOCK_N):
            acc3, l3, m3 = _attend_parts_block(acc3, l3, m3, q3, K, V, start, L, q_pos, offs_d, d_ok, stride_kn,
                                               stride_kd, stride_vn, stride_vd, qk_scale, WINDOW, PRECISION,
                                               ROW_WINDOW, PARTS, BLOCK_N)
    else:
        c_lo = lo + split * chunk
        c_hi = tl.minimum(c_lo + chunk, L)
        for start in range(c_lo, c_hi, BLOCK_N):
            acc3, l3, m3 = _attend_parts_block(acc3, l3, m3, q3, K, V, start, c_hi, q_pos, offs_d, d_ok, stride_kn,
                                               stride_kd, stride_vn, stride_vd, qk_scale, WINDOW, PRECISION,
                                               ROW_WINDOW, PARTS, BLOCK_N)
    m_i = tl.max(m3, 0)                                                         # (BLOCK_M,)
    m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
    w = tl.exp2(m3 - m_ref[None, :])                                            # (PARTS, BLOCK_M) -inf: weight 0
    l_i = tl.sum(l3 * w, 0)                                                     # (BLOCK_M,)
    acc = tl.sum(acc3 * w[:, :, None], 0)                                       # (BLOCK_M, BLOCK_D)
    return acc, l_i, m_i


@triton.jit
def _merge_splits(O_PART, LSE, rows, row_ok, used, NUM_SPLITS, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                  TILE_S: tl.constexpr, BLOCK_D: tl.constexpr, CACHE: tl.constexpr):
    """The merged outputs (BLOCK_R, BLOCK_D) fp32 of output rows `rows` (BLOCK_R,) from their first `used` parts
    in O_PART (rows, NUM_SPLITS, HEAD_DIM) and LSE (rows, NUM_SPLITS):
        out = sum_s 2^(lse_s - M) O_s / sum_s 2^(lse_s - M),   M = max_s lse_s
    reading TILE_S splits of every row per step. A part with lse = -inf (no key seen) weighs 0; a row with none
    (or not row_ok) merges to 0. The merge kernel's code (one row) and the split kernel's with MERGE (a row
    block); CACHE is the loads' cache modifier (".cg" there: parts other programs have just written)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_s = tl.arange(0, TILE_S)
    base = rows * NUM_SPLITS                                                    # (BLOCK_R,) first part of a row

    m_t = tl.full([BLOCK_R, TILE_S], float("-inf"), tl.float32)                 # per-lane max of lse
    for s0 in range(0, used, TILE_S):
        ok = row_ok[:, None] & (s0 + offs_s < used)[None, :]                    # (BLOCK_R, TILE_S)
        lse_t = tl.load(LSE + base[:, None] + s0 + offs_s[None, :], mask=ok, other=float("-inf"),
                        cache_modifier=CACHE)
        m_t = tl.maximum(m_t, lse_t)
    m = tl.max(m_t, 1)                                                          # (BLOCK_R,)
    m = tl.where(m == float("-inf"), 0.0, m)

    denom_t = tl.zeros([BLOCK_R, TILE_S], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s0 in range(0, used, TILE_S):
        parts = base[:, None] + s0 + offs_s[None, :]                            # (BLOCK_R, TILE_S)
        ok = row_ok[:, None] & (s0 + offs_s < used)[None, :]
        lse_t = tl.load(LSE + parts, mask=ok, other=float("-inf"), cache_modifier=CACHE)
        w = tl.exp2(lse_t - m[:, None])                                         # (BLOCK_R, TILE_S) -inf: weight 0
        o = tl.load(O_PART + parts[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                    mask=(lse_t > float("-inf"))[:, :, None] & d_ok[None, None, :], other=0.0,
                    cache_modifier=CACHE)                                       # (BLOCK_R, TILE_S, BLOCK_D)
        denom_t += w
        acc += tl.sum(w[:, :, None] * o, 1)
    denom = tl.sum(denom_t, 1)                                                  # (BLOCK_R,)
    return acc / tl.where(denom == 0.0, 1.0, denom)[:, None]


@triton.jit
def _split_and_sequence(NUM_SPLITS, LONG_SPLITS):
    """(split, sequence · H_KV + kv head) of this program of the split kernel's grid (NUM_SPLITS, n, row blocks).
    Taken in launch order (axis 0 fastest), the first LONG_SPLITS · n programs are splits 0 .. LONG_SPLITS - 1
    of every (sequence, kv head) and the rest the splits beyond, which only short sequences use (split_plan):
    so the programs of the long plan start first, one per SM where it planned one, and the extra ones, which
    exit at once for a long sequence, do not take their places. NUM_SPLITS == LONG_SPLITS: (axis 0, axis 1)."""
    n = tl.num_programs(1)
    lin = tl.program_id(1) * NUM_SPLITS + tl.program_id(0)
    first = LONG_SPLITS * n
    extra = tl.maximum(NUM_SPLITS - LONG_SPLITS, 1)
    late = tl.maximum(lin - first, 0)
    split = tl.where(lin < first, lin % LONG_SPLITS, LONG_SPLITS + late % extra)
    bh = tl.where(lin < first, lin // LONG_SPLITS, late // extra)
    return split, bh


@triton.jit(do_not_specialize=["MAX_LEN", "NUM_SPLITS", "LONG_SPLITS", "MIN_CHUNK", "UNSPLIT_MAX", "WINDOW"])
def _decode_split_kernel(
        Q, K, V, LENS, O_PART, LSE, OUT, COUNTERS,
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_on, stride_od,
        qk_scale, H_KV, MAX_LEN, NUM_SPLITS, LONG_SPLITS, MIN_CHUNK, UNSPLIT_MAX, WINDOW,
        N_Q: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
        PRECISION: tl.constexpr, USE_GDC: tl.constexpr, MERGE: tl.constexpr, MERGE_TILE_S: tl.constexpr,
        STRIDED: tl.constexpr, HAS_WINDOW: tl.constexpr, TMA: tl.constexpr, PARTS: tl.constexpr = 1):
    """grid = (NUM_SPLITS, B * H_KV, row blocks): one split of one kv head's cache, for BLOCK_M query rows
    (which split of which one: _split_and_sequence, the long plan's programs first).

    USE_GDC (launched with programmatic dependent launch, kernels/pdl.py): signal the next kernel, then wait for
    the previous one before reading anything (q, the cache and the lengths may all be its output).

    Row r of the GROUP * N_Q rows of a kv head is query head h_kv * GROUP + r // N_Q, new token r % N_Q.
    SPLIT: the split plan of each sequence comes from split_plan; a split beyond the used ones returns at once;
    with one used split the output goes straight to OUT, otherwise O_PART (B*Hq*N_Q, NUM_SPLITS, HEAD_DIM)
    fp32 and LSE (B*Hq*N_Q, NUM_SPLITS) fp32 receive the split's part. Not SPLIT: one program per row block
    over the whole prefix, writing OUT (B, Hq, N_Q, HEAD_DIM).

    STRIDED (with SPLIT): split s reads key blocks s, s + used, s + 2 * used, ... instead of the chunk
    [s * chunk, (s + 1) * chunk); each used split still holds at least one block (used <= blocks), and the
    merge is the same.

    MERGE (with SPLIT): after storing its part, a split program counts itself in COUNTERS (B * H_KV * row
    blocks,) int32, one zero per (sequence, kv head, row block), with an acq_rel atomic; the program that
    counts last (used - 1 before it) resets the counter to 0 and merges the used parts into OUT
    (_merge_splits, the loads bypassing L1), so no merge launch follows.

    TMA: K and V are tensor descriptors over the whole caches (decode_tma_ok), not pointers.

    PARTS > 1 (DOT, not TMA): each block's keys in PARTS parts with a softmax state each, merged after the loop
    (_attend_parts).

    HAS_WINDOW: a sliding window of WINDOW positions (the row at q_pos sees q_pos - WINDOW < j <= q_pos); the
    splits cover only the keys from the earliest row's window on (_first_key), so the keys read, and the
    split plan, follow the window rather than the cache length.
    """
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    split, bh = _split_and_sequence(NUM_SPLITS, LONG_SPLITS)
    b = (bh // H_KV).to(tl.int64)
    h_kv = (bh % H_KV).to(tl.int64)
    L = tl.minimum(tl.maximum(tl.load(LENS + b).to(tl.int32), 0), MAX_LEN)     # valid cache length
    lo = _first_key(L, WINDOW, N_Q, HAS_WINDOW)                                # keys [lo, L) are planned
    if SPLIT:
        chunk, used = split_plan(L - lo, NUM_SPLITS, LONG_SPLITS, MIN_CHUNK, UNSPLIT_MAX, BLOCK_N)
    else:
        chunk, used = L - lo, 1
    if split >= used:
        return  # nothing of this sequence falls in this split: the merge does not read it

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
    if not TMA:  # descriptors take (b, h_kv) as coordinates
        K += b * stride_kb + h_kv * stride_kh
        V += b * stride_vb + h_kv * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)                          # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)                                       # running sum of 2^(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)                              # running sum of 2^(s - m) v
    ROW_WINDOW: tl.constexpr = HAS_WINDOW and N_Q > 1
    if PARTS > 1:  # a softmax state per part of each block, merged once (_attend_parts)
        acc, l_i, m_i = _attend_parts(q, K, V, lo, L, split, used, chunk, q_pos, offs_d, d_ok, stride_kn, stride_kd,
                                      stride_vn, stride_vd, qk_scale, WINDOW, PRECISION, ROW_WINDOW, STRIDED, PARTS,
                                      BLOCK_M, BLOCK_N, BLOCK_D)
    elif STRIDED:  # blocks split, split + used, ...: at any moment the used splits read neighbouring blocks
        for start in range(lo + split * BLOCK_N, L, used * BLOCK_N):
            acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, K, V, b, h_kv, start, L, q_pos, offs_n, offs_d,
                                          d_ok, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, WINDOW, DOT,
                                          PRECISION, ROW_WINDOW, TMA, BLOCK_N, BLOCK_D)
    else:  # one contiguous chunk
        c_lo = lo + split * chunk
        c_hi = tl.minimum(c_lo + chunk, L)
        for start in range(c_lo, c_hi, BLOCK_N):
            acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, K, V, b, h_kv, start, c_hi, q_pos, offs_n, offs_d,
                                          d_ok, stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, WINDOW, DOT,
                                          PRECISION, ROW_WINDOW, TMA, BLOCK_N, BLOCK_D)

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]                           # rows with no key: 0
    out_mask = row_ok[:, None] & d_ok[None, :]
    if used == 1:
        tl.store(OUT + b * stride_ob + h_q[:, None] * stride_oh + i_q[:, None] * stride_on
                 + offs_d[None, :] * stride_od, o.to(OUT.dtype.element_ty), mask=out_mask)
    else:
        out_row = (b * (H_KV * GROUP) + h_q) * N_Q + i_q                        # (BLOCK_M,) output row
        part = out_row * NUM_SPLITS + split                                     # (BLOCK_M,) row of O_PART
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(LSE + part, lse, mask=row_ok)
        tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=out_mask)
        if MERGE:  # the last of the used splits to arrive merges them all
            tl.debug_barrier()  # every thread's part is stored before the release below
            counter = COUNTERS + bh * tl.num_programs(2) + tl.program_id(2)
            if tl.atomic_add(counter, 1, sem="acq_rel") == used - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed")  # zero for the next launch (kernel end orders it)
                tl.debug_barrier()  # the acquire above comes before any thread's loads of the other parts
                merged = _merge_splits(O_PART, LSE, out_row, row_ok, used, NUM_SPLITS, HEAD_DIM, BLOCK_M,
                                       MERGE_TILE_S, BLOCK_D, ".cg")           # (BLOCK_M, BLOCK_D)
                tl.store(OUT + b * stride_ob + h_q[:, None] * stride_oh + i_q[:, None] * stride_on
                         + offs_d[None, :] * stride_od, merged.to(OUT.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["MAX_LEN", "NUM_SPLITS", "LONG_SPLITS", "MIN_CHUNK", "UNSPLIT_MAX", "WINDOW"])
def _decode_merge_kernel(O_PART, LSE, OUT, LENS, H_Q, stride_ob, stride_oh, stride_on, stride_od,
                         MAX_LEN, NUM_SPLITS, LONG_SPLITS, MIN_CHUNK, UNSPLIT_MAX, WINDOW,
                         N_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                         TILE_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr,
                         HAS_WINDOW: tl.constexpr):
    """grid = (B * Hq * N_Q,): merge one output row's used splits with their log-sum-exps (_merge_splits).

    The used count comes from the same _first_key and split_plan as the split kernel's (BLOCK_N is the split
    kernel's); a row whose sequence used one split was written by that split, and is left alone here.
    """
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    b, h, i = row // (H_Q * N_Q), (row // N_Q) % H_Q, row % N_Q
    L = tl.minimum(tl.maximum(tl.load(LENS + b).to(tl.int32), 0), MAX_LEN)
    lo = _first_key(L, WINDOW, N_Q, HAS_WINDOW)
    chunk, used = split_plan(L - lo, NUM_SPLITS, LONG_SPLITS, MIN_CHUNK, UNSPLIT_MAX, BLOCK_N)
    if used == 1:
        return
    rows = row + tl.arange(0, 1)                                                # (1,)
    out = _merge_splits(O_PART, LSE, rows, tl.full([1], True, tl.int1), used, NUM_SPLITS, HEAD_DIM, 1, TILE_S,
                        BLOCK_D, "")                                            # (1, BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(OUT + b * stride_ob + h * stride_oh + i * stride_on + offs_d[None, :] * stride_od,
             out.to(OUT.dtype.element_ty), mask=(offs_d < HEAD_DIM)[None, :])  # (1, BLOCK_D)


_triton.check_decorated(_decode_split_kernel, _decode_merge_kernel)


def auto_num_splits(n_programs: int, length: int, device: torch.device,
                    per_sm: int = PROGRAMS_PER_SM) -> int:
    """Grid splits for n_programs (sequence, kv head, row block) programs over caches of at most `length`
    valid keys: the count whose programs spread most evenly over the SMs (n_programs * splits of them, as
    equal a number on every SM as can be), the smallest such count, within one round of per_sm resident
    programs per SM (programs_per_sm: what the tile's shared memory allows), never more than length //
    decode_min_keys_per_split (kernels.options), one for length <= SINGLE_SPLIT_MAX_LEN.

    On an H200 (132 SMs) GPT-2's 12 heads at batch 1 get 11 splits: one program per SM, each reading a long
    stretch of the cache, which the sweep in bench/results/decode_attention/ timed faster than 33 or 44 splits
    (several programs per SM) at 4k-32k keys. Batch 16 (192 programs) gets 2: 384 programs in one round of 3.

    Depends only on its arguments and the options (no GPU sync), so it is safe inside CUDA graphs.
    """
    if length <= SINGLE_SPLIT_MAX_LEN:
        return 1  # a short cache: the merge launch costs more than the split saves (bench/NOTES.md)
    sms = _triton.sm_count(device)
    cap = max(1, min(length // _options.get().decode_min_keys_per_split, MAX_SPLITS,
                     per_sm * sms // max(n_programs, 1)))
    return _most_even_splits(n_programs, cap, sms)


def short_grid_splits(n_programs: int, long_splits: int, length: int, device: torch.device,
                      per_sm: int = PROGRAMS_PER_SM) -> int:
    """The grid's splits given the automatic count long_splits: more where that count leaves no SM more than
    one program (batch 1) and the decode_short_splits option is on, so that a sequence of up to
    SHORT_SPLITS_MAX_LEN keys can use up to one split per decode_min_keys_per_split keys (split_plan: its
    cdiv(L, min keys) splits, the chunk rounded up to whole blocks; LONG_SPLITS beyond), as long as one round
    of per_sm resident programs per SM holds them all. At GPT-2's 12 heads on 132 SMs: 16 splits for 2,000 or
    2,048 keys (8 of 256 keys each with the 11 of the long plan)."""
    opts = _options.get()
    if not opts.decode_short_splits or long_splits <= 1:
        return long_splits
    sms = _triton.sm_count(device)
    short = _cdiv(min(length, SHORT_SPLITS_MAX_LEN), opts.decode_min_keys_per_split)
    if n_programs * long_splits > sms or short <= long_splits or n_programs * short > per_sm * sms:
        return long_splits
    return min(short, MAX_SPLITS)


def fills_gpu(n_programs: int, device: torch.device) -> bool:
    """Whether a call's unsplit programs (sequence, kv head, row block) are at least the GPU's SMs, with the
    decode_full_grid option on: such a call gets the full-grid plan (the module docstring)."""
    return _options.get().decode_full_grid and n_programs >= _triton.sm_count(device)


def full_grid_unsplit(n_programs: int, length: int, device: torch.device) -> bool:
    """Whether the automatic plan runs unsplit because the grid is full (the module docstring): fills_gpu and
    length <= the decode_full_grid_max_len option."""
    return fills_gpu(n_programs, device) and length <= _options.get().decode_full_grid_max_len


@functools.lru_cache(maxsize=4096)
def _most_even_splits(n_programs: int, cap: int, sms: int) -> int:
    """The smallest count in 1..cap whose n_programs * count programs spread most evenly over sms SMs (cached:
    an eager decode loop asks the same question at every layer and token)."""
    return max(range(1, cap + 1), key=lambda splits: (_even_share(n_programs * splits, sms), -splits))


def _even_share(programs: int, sms: int) -> float:
    """How evenly `programs` programs spread over `sms` SMs: programs over (the most on one SM) x sms."""
    return programs / (_cdiv(programs, sms) * sms)


def programs_per_sm(tile: DecodeTile, block_d: int, elem_size: int, device: torch.device, tma: bool = False,
                    rows: int = 16) -> int:
    """Split programs of this tile that one SM holds at once, for the automatic split count: the SM's shared
    memory over a program's (program_smem; tma: read through TMA descriptors), at most PROGRAMS_PER_SM
    (PROGRAMS_PER_SM off CUDA). The H200 gives 3 for the 64-key tiles at head dims 64 and 128 in 16 bits (Triton
    reported 70 KB each), 1 for the 128-key tile of head dim 128."""
    smem = _triton.smem_per_sm(device)
    if smem is None:
        return PROGRAMS_PER_SM
    per_program = program_smem(tile.block_n, tile.num_stages, block_d, elem_size, tma, rows)
    return max(1, min(PROGRAMS_PER_SM, smem // per_program))


def _check(q, k_cache, v_cache, cache_lens, num_splits, out, check_lens, tile, window) -> int | None:
    """Every ValueError the kernels could run into, raised before anything is launched. Returns the longest
    cache length when it was read back (check_lens outside graph capture), else None."""
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
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no window), got {window!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be None or an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}")
    if tile is not None and (not isinstance(tile, DecodeTile) or (not tile.dot and (Hq // Hkv) * Nq != 1)):
        raise ValueError(f"tile must be None or a DecodeTile, with dot=False only for one query row per kv head "
                         f"(Hq/Hkv * Nq = {(Hq // Hkv) * Nq}), got {tile!r}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise ValueError("decode_attention is inference-only (no backward): call it under torch.no_grad()")
    capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if check_lens and not capturing:
        lo, hi = (int(x) for x in torch.aminmax(cache_lens))  # one sync
        if lo < Nq or hi > max_len:
            raise ValueError(f"cache_lens must lie in [Nq, max_len] = [{Nq}, {max_len}] (they include the new "
                             f"tokens), got values in [{lo}, {hi}]")
        return hi
    return None


# The merge-in-split counters, one int32 buffer per device, shared by every launch on it (see merge_counters).
_counters: dict[torch.device, torch.Tensor] = {}
_retired_counters: list[torch.Tensor] = []


def merge_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 zeros on `device`: the split kernel's merge counters (option decode_merge_in_split).

    Every launch leaves its counters at zero again, so launches in one stream order (eager calls, the layers of
    a CUDA graph, graph replays) share one buffer; launches that may run at the same time on other streams must
    not use the option. The buffer is allocated on first use and grown (doubled) when a launch needs more; a
    buffer outgrown is kept alive, since a CUDA graph captured with it keeps using it. Allocating is refused
    during CUDA graph capture (a zero fill captured there would not have run yet): make one call of each shape
    before capturing, as the warm-up before a capture does.
    """
    buf = _counters.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"decode_merge_in_split needs {n} merge counters on {device}, allocated before CUDA "
                           "graph capture: call decode_attention once with these shapes before capturing")
    if buf is not None:
        _retired_counters.append(buf)
    size = max(n, 2 * (0 if buf is None else buf.numel()))
    buf = torch.zeros(size, dtype=torch.int32, device=device)                  # (size,)
    _counters[device] = buf
    return buf


# Compiled split/merge kernels per launch signature, so that a repeated launch (every decode step of an eager
# loop) calls Triton's launcher directly instead of JITFunction.run's per-call argument binding and cache-key
# work. The key holds every runtime argument by value and each tensor's dtype and 16-byte alignment (what
# Triton specialises on: _arg_key), so a hit always matches the variant compiled.
_compiled: dict[tuple, object] = {}
_COMPILED_MAX = 1024
_direct_launch_ok = True  # switched off for the process if a direct launch ever raises


def _arg_key(t) -> tuple:
    """What Triton specialises a tensor argument on: its dtype and 16-byte alignment; a host tensor descriptor
    (passed as it is to the compiled kernel's launcher, which encodes it): its base's, and its block shape."""
    if isinstance(t, torch.Tensor):
        return t.dtype, t.data_ptr() % 16 == 0
    return "descriptor", t.base.dtype, t.base.data_ptr() % 16 == 0, tuple(t.block_shape)


def _launch(kernel, grid: tuple, tensors: tuple, scalars: tuple, consts: dict, launch: dict) -> None:
    """kernel[grid](*tensors, *scalars, **consts, **launch), through the compiled kernel's own launcher once
    this signature has been launched before (CUDA, fast_launch option on)."""
    global _direct_launch_ok
    direct = (_direct_launch_ok and not _triton.INTERPRET and _options.get().fast_launch
              and tensors[0].device.type == "cuda")
    if not direct:
        kernel[grid](*tensors, *scalars, **consts, **launch)
        return
    key = (id(kernel), tensors[0].device.index, *scalars,
           *consts.values(), *launch.values(), *[_arg_key(t) for t in tensors])
    compiled = _compiled.get(key)
    if compiled is not None:
        try:
            compiled[grid](*tensors, *scalars, *consts.values())
            return
        except Exception:  # noqa: BLE001 - an unexpected launcher API: launch through Triton from now on
            _direct_launch_ok = False
    compiled = kernel[grid](*tensors, *scalars, **consts, **launch)
    if _direct_launch_ok and hasattr(compiled, "run") and list(kernel.arg_names) == [
            *kernel.arg_names[:len(tensors) + len(scalars)], *consts]:
        if len(_compiled) >= _COMPILED_MAX:
            _compiled.clear()
        _compiled[key] = compiled


def key_parts(tile: DecodeTile, tma: bool) -> int:
    """The parts a split program keeps a softmax state for (the decode_key_parts option): 1 on the vec path,
    with TMA loads, or where a part would hold fewer than 16 keys (a tensor-core dot's depth)."""
    parts = _options.get().decode_key_parts
    if parts == 1 or not tile.dot or tma or tile.block_n // parts < 16:
        return 1
    return parts


def _tma_device(device: torch.device) -> bool:
    """A device whose kernels can read through TMA: a Hopper-or-newer GPU, or any under the interpreter."""
    return _triton.INTERPRET or (device.type == "cuda" and _triton.hopper_or_newer(device.index or 0))


def decode_tma_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the split kernel reads these caches through TMA tensor descriptors: the decode_tma option on,
    Triton's host TensorDescriptor, a Hopper-or-newer GPU (or the interpreter), 16-bit elements, unit stride
    along D, and the base and every other stride a multiple of 16 bytes (no copy is made to get there:
    otherwise pointer loads)."""
    if not _options.get().decode_tma or TensorDescriptor is None:
        return False
    if not _tma_device(k_cache.device):
        return False
    for t in (k_cache, v_cache):
        size = t.element_size()
        if size != 2 or t.stride(-1) != 1 or t.data_ptr() % 16 or any((st * size) % 16 for st in t.stride()[:-1]):
            return False
    return True


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lens: torch.Tensor,
                     *, sm_scale: float | None = None, num_splits: int | None = None,
                     out: torch.Tensor | None = None, check_lens: bool = True,
                     tile: DecodeTile | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention of q's Nq new tokens to each sequence's valid cache prefix. Returns (B, Hq, Nq, D).

    See the module docstring for what is supported. `out` (optional) receives the result; `check_lens=False`
    skips reading cache_lens back to validate it (a GPU sync); `tile` overrides the split kernel's config;
    `window` > 0 limits the token at position p to positions p - window + 1 .. p (a sliding window).
    """
    longest = _check(q, k_cache, v_cache, cache_lens, num_splits, out, check_lens, tile, window)
    opts = _options.get()
    B, Hq, Nq, D = q.shape
    Hkv, max_len = k_cache.shape[1], k_cache.shape[2]
    window = window if window < max_len else 0  # a window as long as the cache cuts nothing
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    if out is None:
        out = _triton.empty(q.shape, q.dtype, q.device)  # contiguous

    BLOCK_D = _next_pow2(D)
    default = tile is None
    if default:
        tile = default_tile(BLOCK_D, q.element_size(), group * Nq, _triton.smem_per_sm(q.device))
    # dot: at least decode_min_rows rows (16, what a tensor-core dot takes; 64: sm_90's warpgroup MMA)
    BLOCK_M = 1 if not tile.dot else min(max(opts.decode_min_rows, _next_pow2(group * Nq)), MAX_ROWS)
    row_blocks = _cdiv(group * Nq, BLOCK_M)
    full = fills_gpu(B * Hkv * row_blocks, q.device)
    tma = decode_tma_ok(k_cache, v_cache)
    if num_splits is None:  # grid for the longest length known here; each sequence plans its own on the device
        length = max_len if longest is None else longest
        if window:  # a sequence's planned keys [first, L): the window and the later new tokens
            length = min(length, window + Nq - 1)
        min_chunk, unsplit_max = opts.decode_min_keys_per_split, SINGLE_SPLIT_MAX_LEN
        if full and length <= opts.decode_full_grid_max_len:  # full_grid_unsplit, its fills_gpu already known
            num_splits = 1
        elif full and opts.decode_full_grid_long_splits:  # longer: this many splits, shorter sequences unsplit
            num_splits = max(1, min(opts.decode_full_grid_long_splits, MAX_SPLITS, length // min_chunk))
            unsplit_max = max(unsplit_max, opts.decode_full_grid_max_len)
        else:
            num_splits = auto_num_splits(B * Hkv * row_blocks, length, q.device,
                                         programs_per_sm(tile, BLOCK_D, q.element_size(), q.device, tma, BLOCK_M))
        long_splits = num_splits  # what sequences longer than the grid's one-block-per-split plan use
        # TMA loads keep three stages: their pipeline holds a tile more already, and the four-stage tile's
        # 121 KB leaves an SM one program, two rounds for GPT-2's batch-1 short grid of 192
        deep = deep_tile(tile, BLOCK_D, q.element_size()) if default and long_splits > 1 and not tma else None
        if deep is not None and B * Hkv * row_blocks * long_splits <= _triton.sm_count(q.device):
            tile = deep  # at most one split program per SM: more bytes in flight per program
        num_splits = short_grid_splits(B * Hkv * row_blocks, long_splits, length, q.device,
                                       programs_per_sm(tile, BLOCK_D, q.element_size(), q.device, tma, BLOCK_M))
    else:  # exactly num_splits chunks per sequence
        min_chunk, unsplit_max, long_splits = 1, 0, num_splits
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    pdl = pdl_enabled(q.device)
    # launched as a PDL dependent (its programs resident before the previous kernel ends) unless its unsplit
    # programs fill the GPU and the decode_full_grid_pdl option is off; either way it lets the next kernel start
    dependent = pdl and not (full and not opts.decode_full_grid_pdl)
    launch = dict(num_warps=tile.num_warps, num_stages=tile.num_stages,
                  **(dict(launch_pdl=True) if dependent else {}))

    merge_in_split = num_splits > 1 and opts.decode_merge_in_split
    parts = key_parts(tile, tma)
    strided = num_splits > 1 and opts.decode_split_order == "strided"
    if num_splits == 1:
        o_part = lse = out  # unused by the kernel
    else:
        o_part = _triton.empty((B * Hq * Nq, num_splits, D), torch.float32, q.device)
        lse = _triton.empty((B * Hq * Nq, num_splits), torch.float32, q.device)
    counters = merge_counters(q.device, B * Hkv * row_blocks) if merge_in_split else out  # else unused
    merge_tile_s = min(MERGE_TILE, max(1, MERGE_STEP // (BLOCK_M * BLOCK_D)))  # splits per in-split merge step
    k_in, v_in = k_cache, v_cache
    if tma:  # (1, 1, BLOCK_N, BLOCK_D) blocks of the whole (B, Hkv, max_len, D) caches
        k_in, v_in = (TensorDescriptor.from_tensor(t, [1, 1, tile.block_n, BLOCK_D]) for t in (k_cache, v_cache))
    with _triton.device_guard(q):
        _launch(_decode_split_kernel, (num_splits, B * Hkv, row_blocks),
                (q, k_in, v_in, cache_lens, o_part, lse, out, counters),
                (*q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
                 scale * _triton.LOG2E, Hkv, max_len, num_splits, long_splits, min_chunk, unsplit_max, window),
                dict(N_Q=Nq, GROUP=group, HEAD_DIM=D, SPLIT=num_splits > 1, BLOCK_M=BLOCK_M, BLOCK_N=tile.block_n,
                     BLOCK_D=BLOCK_D, DOT=tile.dot, PRECISION=precision, USE_GDC=pdl, MERGE=merge_in_split,
                     MERGE_TILE_S=merge_tile_s, STRIDED=strided, HAS_WINDOW=window > 0, TMA=tma,
                     **(dict(PARTS=parts) if parts > 1 else {})), launch)
        if num_splits > 1 and not merge_in_split:
            _launch(_decode_merge_kernel, (B * Hq * Nq, 1, 1), (o_part, lse, out, cache_lens),
                    (Hq, *out.stride(), max_len, num_splits, long_splits, min_chunk, unsplit_max, window),
                    dict(N_Q=Nq, HEAD_DIM=D, BLOCK_N=tile.block_n, TILE_S=MERGE_TILE, BLOCK_D=BLOCK_D, USE_GDC=pdl,
                         HAS_WINDOW=window > 0),
                    dict(num_warps=4, **(dict(launch_pdl=True) if pdl else {})))
    return out


__all__ = ["decode_attention", "decode_tma_ok", "key_parts", "auto_num_splits", "full_grid_unsplit", "plan_splits",
           "DecodeTile", "default_tile", "deep_tile", "MAX_NQ", "MIN_HEAD_DIM", "MAX_HEAD_DIM"]
