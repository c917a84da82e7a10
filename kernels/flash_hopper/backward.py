"""The Hopper dK/dV backward kernel in Gluon: dK and dV of softmax(Q Kᵀ · scale + mask) V from the forward's
log-sum-exp and the rows' delta = rowsum(dO * O).

FlashAttention-3's backward structure on sm_90 for the key side, written with Gluon's explicit primitives:

* one program per tile of 2·BLOCK_N keys of one (kv head, batch); grid (cdiv(Nk, 2·BLOCK_N), Hkv, B). Its K and
  V stay in shared memory for the whole program; it loops over the query blocks that see the tile, for each of
  the GROUP query heads that read the kv head (GQA: the group's sum, no atomics). Causal, the last heads of the
  grid take their tiles dealt across them, longest first (_program_tile, TAIL_HEADS), so that the run's last long
  programs do not start last.
* warp specialization (gl.warp_specialize): a producer warp that only issues TMA copies (K and V once, then Q
  and dO blocks through a STAGES-deep shared-memory ring, one mbarrier pair (ready, empty) per stage), and two
  consumer warpgroups (the default partition and a 4-warp worker) that only compute. Consumer warpgroup w owns
  keys [w·BLOCK_N, (w + 1)·BLOCK_N) of the tile and its dK, dV accumulators; both read every Q/dO stage, which
  is refilled once both released it (empty barriers count two arrivals). setmaxnreg moves registers from the
  producer (PRODUCER_REGS) to the consumers (CONSUMER_REGS), as in the forward.
* per query block, transposed (keys along rows, as kernels/flash/backward.py's _dkdv_inner), all wgmma:
      sT  = K Qᵀ                 (BLOCK_N, BLOCK_M)   K and Q in shared memory
      dPᵀ = V dOᵀ                (BLOCK_N, BLOCK_M)   issued with sT, runs while Pᵀ is computed
      Pᵀ  = exp2(sT · qk_scale - lse)                 (causal: 0 above the diagonal)
      dV += Pᵀ dO                (BLOCK_N, HEAD_D)    Pᵀ in registers (the A operand), dO in shared memory
      dSᵀ = Pᵀ (dPᵀ - delta)
      dK += dSᵀ Q                (BLOCK_N, HEAD_D)    dSᵀ in registers
  The lse and delta of the block's rows come with ROWS_TMA (the default, FA3's way) as TMA loads by the producer
  into the stage beside Q and dO, read from shared memory, and otherwise (Nq not a multiple of 4, so that a head's
  rows do not start on 16 bytes, or flat buffers smaller than one 1-d TMA box) as global loads issued while the
  matmuls run. Under Triton 3.6 at sm_90 the TMA form cuts the fused
  form's spills at d128 from 120 to 68 B per thread (causal 204 to 96) and the kernel's time by 5-11 % on an
  H100 (kernels/flash_hopper/backward_launch.py: rows_through_tma). With AHEAD (FA3's
  intra-warpgroup overlap) the next block's sT and dPᵀ are issued before this block's Pᵀ and dSᵀ are
  computed. Every block is masked (the causal mask elementwise, rows past Nq through lse = +inf) in one loop
  without a branch: loops or branches per kind of block spilled at d128.
* the epilogue writes dV and sm_scale · dK through the program's own K and V buffers (no longer read) and TMA
  stores; rows past Nk are clipped by the descriptors' bounds.

dQ: by default not computed here: the launcher (kernels/flash_hopper/backward_launch.py) runs the tl dQ kernel
(kernels/flash/backward.py: _attn_bwd_dq) first, which also stores delta. With DQ = 1 (a fused form) each step
also computes this warpgroup's part of dQ, dS K (BLOCK_M, HEAD_D), from a copy of dSᵀ in shared memory (read
back transposed) and adds it, unscaled, into an fp32 accumulator with atomics, in
column slices of at most 64; the launcher zeroes the accumulator and stores delta before (the tl _attn_bwd_prep)
and scales and converts dQ after (_attn_bwd_dq_out). With DQ = 2 both warpgroups put their dSᵀ into one
buffer per step parity (mbarriers in both directions), and each computes half of dQ's columns over all
2·BLOCK_N keys: half the atomic adds. DQ = 3 (FA3's, the one kernels.flash_attention runs) is DQ = 2 with each
warpgroup's half stored into its own fp32 shared buffer and added by one TMA reduce-add per step
(cp.reduce.async.bulk.tensor), whole lines added in L2 instead of an atomic per element: 1.1-1.3x DQ = 2's
backward, 1.3-1.7x DQ = 1's at 4096 tokens (bench/results/flash_hopper/fused_backward/). DQ = 4 is DQ = 3 with
each step's dQ computed one step later, after the next step's dK matmul is issued, so that a warpgroup does not
wait for the other's dSᵀ of the step it has just computed: 1.05-1.07x DQ = 3 at d64 without a mask, 0.81-0.89x
at d128 without one (it spills more there), level causal (same folder); with the rows through TMA, 5.0-6.4 %
shorter than DQ = 3 at d64 causal on the H200, where kernels.flash_attention runs it. DQ = 5 is
DQ = 3 with each step's dK matmul issued after its two dQ matmuls (FA3's order), so that dK's matmul runs while
dQ goes through shared memory to its reduce-add: 1.1-3.3 % shorter than DQ = 3 at d128 causal and 0.5-2.3 % at
d64 without a mask in three runs on an H100, mostly longer at the other two (bench/results/flash_hopper/backward/
dk_after_dq/); kernels.flash_attention runs it at d128 causal. DQ = 6 is DQ = 4 with DQ = 5's order inside each
step: publish this step's dSᵀ, issue the previous step's two dQ matmuls, then this step's dK matmul, and wait for
dQ's alone (neither the other warpgroup's dSᵀ of this step nor dQ's store holds up dK's matmul): 4.6-5.4 %
shorter than DQ = 5 at d64 without a mask in three runs on the H200, where kernels.flash_attention runs it
(bench/results/flash_hopper/backward/lagged_dq_h200/; kernels/flash/launch.py: hopper_bwd_form).

Supported: float16 and bfloat16 (q, k, v, dO, dK, dV one dtype; fp32 accumulation); HEAD_D 64 or 128; any Nq,
Nk >= 1; causal (bottom-right aligned, offset = Nk - Nq; rows that see no key carry lse = +inf and contribute
nothing) or not; GQA and MQA; compute capability 9.0 only. Numerics as the tl kernel: fp32 scores, Pᵀ and dSᵀ
rounded to the input dtype before their matmuls, dK scaled by sm_scale at the end.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .forward import _tma_load, _tma_store

try:  # Triton >= 3.7 names it; 3.6 (what the H200 runs) has the op behind its builder only
    _tma_reduce_add = tma.async_atomic_add
except AttributeError:
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile src into global memory at coord through TMA (cp.reduce.async.bulk.tensor
        .add); completes like a TMA store (tma.store_wait)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

# Partitions and register budgets as the forward's (kernels/flash_hopper/forward.py): 24 + 240 + 240 = 3 x 168.
PRODUCER_WARPS = gl.constexpr(1)
PRODUCER_REGS = gl.constexpr(24)  # the producer holds only scalars (tile coordinates, ring counters)
CONSUMER_REGS = gl.constexpr(240)  # each consumer: dK, dV, sT/Pᵀ, dPᵀ/dSᵀ and their 16-bit operands
MAX_REGS = 168  # the kernel's register cap at entry (a launch option)


# ----------------------------------------------------------------------------------------------------------
# What every partition computes the same way: the program's tile and its query blocks
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _query_blocks(start_n, Nq, offset, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, TILE_N: gl.constexpr):
    """Query blocks of the key tile [start_n, start_n + TILE_N): (lo, n_blocks), the tile reads n_blocks blocks
    from row lo up to the last (partial or not) block of Nq. Causal (bottom-right aligned: query i sees key j
    <= i + offset): the blocks before lo see no key of the tile and are skipped. Not causal: lo = 0."""
    m_end = gl.cdiv(Nq, BLOCK_M) * BLOCK_M
    if CAUSAL:
        lo = gl.minimum((gl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M, m_end)  # the first row's block
    else:
        lo = 0
    return lo, (m_end - lo) // BLOCK_M


@gluon.jit
def _program_tile(TAIL_HEADS: gl.constexpr):
    """(key tile, kv head, batch) of this program of the (n_tiles, Hkv, B) grid. Programs start in launch order
    (axis 0 fastest); the first Hkv·B - TAIL_HEADS (batch, kv head) pairs take theirs head by head, each head's
    tiles in order, and the last TAIL_HEADS pairs' tiles are dealt across those pairs, tile 0 of each, then
    tile 1, ... Causal, tile 0 sees the most query blocks, so the longest programs of the run's end start while
    TAIL_HEADS heads' work is left to fill in around them (kernels/flash_hopper/backward_launch.py:
    tail_heads_for). TAIL_HEADS = 0: the program ids themselves (the same code as without the option)."""
    if TAIL_HEADS == 0:
        tile = gl.program_id(0)
        hk = gl.program_id(1)
        b = gl.program_id(2)
    else:
        n_tiles = gl.num_programs(0)
        n_heads = gl.num_programs(1) * gl.num_programs(2)
        pid = gl.program_id(0) + n_tiles * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
        body = (n_heads - TAIL_HEADS) * n_tiles  # the programs taken head by head
        if pid < body:
            head = pid // n_tiles
            tile = pid - head * n_tiles
        else:
            r = pid - body
            tile = r // TAIL_HEADS
            head = n_heads - TAIL_HEADS + (r - tile * TAIL_HEADS)
        hk = head % gl.num_programs(1)
        b = head // gl.num_programs(1)
    return tile, hk, b


@gluon.jit
def _step_coords(i, first, n_blocks, GQA: gl.constexpr, BLOCK_M: gl.constexpr):
    """(query head within the group, first query row) of step i of a flat loop over the group's heads and the
    n_blocks query blocks from row `first` (head-major: each head's blocks in order)."""
    if GQA:
        per_head = gl.maximum(n_blocks, 1)  # (>= 1 only to keep the division defined without steps)
        g = i // per_head
        start_m = first + (i - g * per_head) * BLOCK_M
    else:
        g = 0
        start_m = first + i * BLOCK_M
    return g, start_m


# ----------------------------------------------------------------------------------------------------------
# The producer: one warp issuing TMA copies
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _load_steps(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, ready, empty, b, hk,
                Hq, GROUP, Nq, first, n_blocks, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                GQA: gl.constexpr, ROWS_TMA: gl.constexpr):
    """Q and dO of the n_blocks query blocks from row `first` of each of the group's heads into the ring (step
    i: stage i % STAGES), each stage once both consumers released it."""
    q_bytes: gl.constexpr = BLOCK_M * HEAD_D * q_desc.dtype.primitive_bitwidth // 8
    for i in range(n_blocks * GROUP):
        g, start_m = _step_coords(i, first, n_blocks, GQA, BLOCK_M)
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        if ROWS_TMA:  # the step's lse and delta too: rows of the flat (B·Hq·Nq) buffers, BLOCK_M fp32 each
            mbarrier.expect(ready.index(s), 2 * q_bytes + 2 * BLOCK_M * 4)
        else:
            mbarrier.expect(ready.index(s), 2 * q_bytes)
        _tma_load(q_desc, [b, hk * GROUP + g, start_m, 0], ready.index(s), q_smem.index(s))
        _tma_load(do_desc, [b, hk * GROUP + g, start_m, 0], ready.index(s), do_smem.index(s))
        if ROWS_TMA:
            row = (b * Hq + hk * GROUP + g) * Nq + start_m  # rows past Nq (the next head's): masked by the consumers
            _tma_load(lse_desc, [row], ready.index(s), lse_smem.index(s))
            _tma_load(delta_desc, [row], ready.index(s), delta_smem.index(s))


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem,
              v_smem, kv_ready, ready, empty, Hq, GROUP, Nq, offset, TAIL_HEADS: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              GQA: gl.constexpr, ROWS_TMA: gl.constexpr):
    """K and V of each consumer's keys (once), then Q and dO of every step into the ring. Out-of-range rows
    (past Nq or Nk: the 4-d descriptors' bounds) arrive as zeros."""
    pid_n, hk, b = _program_tile(TAIL_HEADS)
    start_n = pid_n * (2 * BLOCK_N)
    kv_bytes: gl.constexpr = BLOCK_N * HEAD_D * k_desc.dtype.primitive_bitwidth // 8
    for w in gl.static_range(2):
        mbarrier.expect(kv_ready.index(w), 2 * kv_bytes)
        _tma_load(k_desc, [b, hk, start_n + w * BLOCK_N, 0], kv_ready.index(w), k_smem.index(w))
        _tma_load(v_desc, [b, hk, start_n + w * BLOCK_N, 0], kv_ready.index(w), v_smem.index(w))
    lo, n_blocks = _query_blocks(start_n, Nq, offset, CAUSAL, BLOCK_M, 2 * BLOCK_N)
    _load_steps(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, ready, empty, b, hk, Hq,
                GROUP, Nq, lo, n_blocks, BLOCK_M, HEAD_D, STAGES, GQA, ROWS_TMA)


# ----------------------------------------------------------------------------------------------------------
# The consumers: two warpgroups, BLOCK_N keys each
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _issue_scores(k, v, q_smem, do_smem, ready, i, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
                  HEAD_D: gl.constexpr, s_zero):
    """Wait for ring step i's Q and dO, then issue its two score matmuls without waiting for them:
    sT = K Qᵀ and dPᵀ = V dOᵀ, each (BLOCK_N, BLOCK_M) fp32 (in flight: pass them through warpgroup_mma_wait)."""
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    q = q_smem.index(s).reshape([BLOCK_M, HEAD_D])  # (BLOCK_M, HEAD_D)
    do = do_smem.index(s).reshape([BLOCK_M, HEAD_D])
    sT = warpgroup_mma(k, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # (BLOCK_N, BLOCK_M)
    dpT = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # (BLOCK_N, BLOCK_M)
    return sT, dpT


@gluon.jit
def _add_dq_part(dq, dqacc_ptr, row_base, start_m, Nq, COL0: gl.constexpr, BLOCK_M: gl.constexpr,
                 HEAD_D: gl.constexpr, DQ_COLS: gl.constexpr):
    """Add dq (BLOCK_M, DQ_COLS) fp32, dQ's columns COL0 .. COL0 + DQ_COLS of BLOCK_M query rows from start_m,
    into the fp32 accumulator dqacc_ptr (rows row_base + start_m + (0 .. BLOCK_M) of HEAD_D columns) with
    atomics; rows past Nq are dropped."""
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    q_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))  # (BLOCK_M,) query rows
    d_cols = COL0 + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))  # (DQ_COLS,)
    ptrs = dqacc_ptr + gl.expand_dims((row_base + q_rows) * HEAD_D, 1) + gl.expand_dims(d_cols, 0)
    gl.atomic_add(ptrs, dq, mask=gl.expand_dims(q_rows < Nq, 1), sem="relaxed")  # fp32, not yet scaled


@gluon.jit
def _publish_ds(dsT_op, ds_smem, ds_bars, i, BLOCK_N: gl.constexpr, WG: gl.constexpr, DS_RING: gl.constexpr):
    """Put this warpgroup's dSᵀ (BLOCK_N, BLOCK_M) of step i into its half of the step parity's shared buffer
    (ds_smem: (2, 2·BLOCK_N, BLOCK_M)), once both warpgroups' dQ matmuls of step i - 2 have read that buffer.
    ds_bars: [ready(0), ready(1), free(0), free(1)], two arrivals each. DS_RING: one buffer per ring stage
    (ds_smem: (STAGES, 2·BLOCK_N, BLOCK_M), step i's in i % STAGES) and no free barriers: both warpgroups release
    a stage only after the step's dQ matmuls retired, so step i's Q in the ring (this warpgroup waited for it)
    means both are done with step i - STAGES's buffer."""
    par = i % 2
    if DS_RING:
        buf = ds_smem.index(i % ds_smem.shape[0])
    else:
        mbarrier.wait(ds_bars.index(2 + par), ((i // 2) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        buf = ds_smem.index(par)
    buf.slice(WG * BLOCK_N, BLOCK_N, dim=0).store(dsT_op)  # this warpgroup's keys
    fence_async_shared()
    mbarrier.arrive(ds_bars.index(par), count=1)


@gluon.jit
def _dq_of_step(j, first, n_blocks, k_dq, ds_smem, ds_bars, dqacc_ptr, dq_smem, rows0, Nq, bh0,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, GQA: gl.constexpr,
                DQ: gl.constexpr, WG: gl.constexpr, DS_RING: gl.constexpr, dk=None, dsT_op=None, q=None,
                DK_AFTER: gl.constexpr = False):
    """This warpgroup's half of dQ's columns of step j, dS K over both warpgroups' 2·BLOCK_N keys, once both
    published their dSᵀ of step j (_publish_ds); added into dqacc_ptr with atomics (DQ = 2) or through dq_smem and
    one TMA reduce-add (DQ >= 3). Retires every wgmma this warpgroup has in flight, except with DK_AFTER (forms
    5 and 6): there it issues dK += dSᵀ Q (BLOCK_N, HEAD_D) from the given dsT_op and q (the current step's,
    which is step j in form 5 and step j + 1 in form 6) after dQ's matmuls and returns dk still in flight, so
    that dK's matmul runs while dQ goes out (FlashAttention-3's order)."""
    g, start_m = _step_coords(j, first, n_blocks, GQA, BLOCK_M)
    par = j % 2
    buf = ds_smem.index(j % ds_smem.shape[0] if DS_RING else par)  # (2·BLOCK_N, BLOCK_M)
    mbarrier.wait(ds_bars.index(par), (j // 2) & 1)  # both warpgroups' keys are there
    HALF: gl.constexpr = HEAD_D // 2
    half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, HALF, 16])
    dq = warpgroup_mma(buf.slice(0, BLOCK_N, dim=0).permute((1, 0)),
                       k_dq.index(0).reshape([BLOCK_N, HEAD_D]).slice(WG * HALF, HALF, dim=1),
                       gl.zeros([BLOCK_M, HALF], gl.float32, layout=half_layout), use_acc=False,
                       is_async=True)  # (BLOCK_M, HALF) over warpgroup 0's keys
    dq = warpgroup_mma(buf.slice(BLOCK_N, BLOCK_N, dim=0).permute((1, 0)),
                       k_dq.index(1).reshape([BLOCK_N, HEAD_D]).slice(WG * HALF, HALF, dim=1), dq,
                       is_async=True)  # ... and over warpgroup 1's
    if DK_AFTER:
        dk = warpgroup_mma(dsT_op, q, dk, is_async=True)  # (BLOCK_N, HEAD_D), dSᵀ from registers
        dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq, ))  # dK's matmul may still run
    else:
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
    if not DS_RING:  # (with it, the ring's release at the step's end frees the buffer: _publish_ds)
        mbarrier.arrive(ds_bars.index(2 + par), count=1)
    if DQ == 2:
        _add_dq_part(dq, dqacc_ptr, rows0 + g * Nq, start_m, Nq, WG * HALF, BLOCK_M, HEAD_D, HALF)
    else:
        # DQ >= 3 (FA3's): dq goes through this warpgroup's fp32 buffer and one TMA reduce-add per step, whole
        # lines added in L2 instead of an atomic per element; rows past Nq are clipped by the descriptor. The
        # previous step's reduce, a step ago, has read the buffer by now (its wait rarely stalls)
        tma.store_wait(0)
        dq_smem.reshape([BLOCK_M, HALF]).store(dq)  # (BLOCK_M, HALF) fp32
        fence_async_shared()
        _tma_reduce_add(dqacc_ptr, [bh0 + g, start_m, WG * HALF], dq_smem)
    if DK_AFTER:
        return dk


@gluon.jit
def _causal_p(sT, lse, keys, offset, start_m, qk_scale, BLOCK_M: gl.constexpr):
    """Pᵀ (BLOCK_N, BLOCK_M) of a causal block: exp2(sT · qk_scale - lse), 0 where key j > query i + offset."""
    col_s: gl.constexpr = gl.SliceLayout(0, sT.type.layout)
    first_row = gl.expand_dims(keys - offset - start_m, 1)  # (BLOCK_N, 1)
    visible = gl.expand_dims(gl.arange(0, BLOCK_M, layout=col_s), 0) >= first_row  # (BLOCK_N, BLOCK_M)
    return gl.where(visible, gl.exp2(sT * qk_scale - gl.expand_dims(lse, 0)), 0.0)


@gluon.jit
def _grad_step(dk, dv, sT, dpT, q_smem, do_smem, lse_ptr, delta_ptr,
               lse_smem, delta_smem, rows0, keys, key_last, Nq, offset, qk_scale, i,
               first, n_blocks, k_dq, ds_smem, ds_bars, dqacc_ptr, dq_smem, bh0, AHEAD: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, GQA: gl.constexpr, DQ: gl.constexpr, WG: gl.constexpr,
               PREV: gl.constexpr = False, ROWS_TMA: gl.constexpr = False, DS_RING: gl.constexpr = False):
    """Ring step i once its score matmuls sT, dPᵀ (BLOCK_N, BLOCK_M) are issued: Pᵀ, dV += Pᵀ dO, dSᵀ,
    dK += dSᵀ Q; returns dk, dv and the 16-bit operands, all still in flight (the caller waits for them, then
    releases the stage). AHEAD: how many matmuls were issued after sT and dPᵀ (2 when the next step's score
    matmuls already run, else 0); the waits leave those in flight.

    Every block is masked the same way, without a branch: rows past Nq get lse = +inf (Pᵀ = 0) and delta = 0,
    and CAUSAL hides key j from query i unless j <= i + offset. (Separate loops for the diagonal, the Nq tail
    and the unmasked blocks spilled more at d128 (sm_90, both Triton versions), and so did one loop with a
    runtime branch on the mask under Triton 3.6.) CAUSAL = 2 takes that branch all the same (the launcher's
    option at d64, off: on an H100 the split form's kernel 6-8 % shorter, the fused form 3 3-4 % longer,
    bench/results/flash_hopper/backward/mask_skip_d64/): the blocks wholly below the diagonal skip the mask.
    At d64 it compiles without spills (Triton 3.6 and 3.9); at d128 the split form with GQA spills 8 B per
    thread instead of 4 under Triton 3.6 and 124 instead of 76 under 3.9, the fused form 3 116 instead of 96."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    g, start_m = _step_coords(i, first, n_blocks, GQA, BLOCK_M)
    s = i % STAGES
    q = q_smem.index(s).reshape([BLOCK_M, HEAD_D])  # (BLOCK_M, HEAD_D)
    do = do_smem.index(s).reshape([BLOCK_M, HEAD_D])
    # the rows' lse and delta load while the matmuls run (loaded before the wait, they held registers across
    # it and ptxas spilled in the loop)
    cols = start_m + gl.arange(0, BLOCK_M, layout=col_s)  # (BLOCK_M,) query rows of this step
    col_ok = cols < Nq
    row_ptr = rows0 + g * Nq + cols  # (BLOCK_M,) their lse and delta
    if ROWS_TMA:  # brought into the stage by the producer; rows past Nq hold another head's values
        lse = gl.where(col_ok, lse_smem.index(s).load(col_s), float("inf"))  # (BLOCK_M,) +inf: Pᵀ = 0
    else:
        lse = gl.load(lse_ptr + row_ptr, mask=col_ok, other=float("inf"))  # (BLOCK_M,) +inf: Pᵀ = 0
    sT = warpgroup_mma_wait(num_outstanding=1 + AHEAD, deps=(sT, ))  # sT done, dPᵀ (and later ones) may run
    if CAUSAL:
        # key j <= query i + offset, as (i - start_m) >= j - offset - start_m: a per-row bound against the
        # columns' fixed offsets within the block (fewer live registers than comparing against cols). The mask
        # applies after the exponential: one FFMA per score as without a mask, instead of a multiply, a select
        # and a subtraction (hidden scores may overflow to +inf there; the select drops them): 5-6 % less time
        # for this kernel at d128 (bench/results/flash_hopper/backward/causal_mask_after_exp/)
        if CAUSAL == 2:  # blocks below the diagonal skip the mask: a runtime branch
            if start_m + offset >= key_last:  # every row of the block sees every key of this warpgroup
                pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse, 0))
            else:
                pT = _causal_p(sT, lse, keys, offset, start_m, qk_scale, BLOCK_M)
        else:
            pT = _causal_p(sT, lse, keys, offset, start_m, qk_scale, BLOCK_M)
    else:
        pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse, 0))  # (BLOCK_N, BLOCK_M) fp32
    pT_op = gl.convert_layout(pT.to(dtype), op_layout)  # (BLOCK_N, BLOCK_M) the A operand of dV's matmul
    dv = warpgroup_mma(pT_op, do, dv, is_async=True)  # (BLOCK_N, HEAD_D)
    if ROWS_TMA:
        delta = gl.where(col_ok, delta_smem.index(s).load(col_s), 0.0)  # (BLOCK_M,)
    else:
        delta = gl.load(delta_ptr + row_ptr, mask=col_ok, other=0.0)  # (BLOCK_M,)
    dpT = warpgroup_mma_wait(num_outstanding=1 + AHEAD, deps=(dpT, ))  # dPᵀ done, dV's matmul may still run
    dsT = pT * (dpT - gl.expand_dims(delta, 0))  # (BLOCK_N, BLOCK_M) gradient w.r.t. the scaled scores
    dsT_op = gl.convert_layout(dsT.to(dtype), op_layout)
    if DQ == 5:  # form 3 with dK's matmul issued after dQ's (_dq_of_step): it runs while dQ goes out
        _publish_ds(dsT_op, ds_smem, ds_bars, i, BLOCK_N, WG, DS_RING)
        dk = _dq_of_step(i, first, n_blocks, k_dq, ds_smem, ds_bars, dqacc_ptr, dq_smem, rows0, Nq, bh0, BLOCK_M,
                         BLOCK_N, HEAD_D, GQA, DQ, WG, DS_RING, dk, dsT_op, q, DK_AFTER=True)
    elif DQ == 6:  # form 4 (dQ one step behind) with this step's dK matmul issued after the previous step's dQ
        _publish_ds(dsT_op, ds_smem, ds_bars, i, BLOCK_N, WG, DS_RING)
        if PREV:
            dk = _dq_of_step(i - 1, first, n_blocks, k_dq, ds_smem, ds_bars, dqacc_ptr, dq_smem, rows0, Nq, bh0,
                             BLOCK_M, BLOCK_N, HEAD_D, GQA, DQ, WG, DS_RING, dk, dsT_op, q, DK_AFTER=True)
        else:  # the first step: no dQ before it
            dk = warpgroup_mma(dsT_op, q, dk, is_async=True)  # (BLOCK_N, HEAD_D)
    else:
        dk = warpgroup_mma(dsT_op, q, dk, is_async=True)  # (BLOCK_N, HEAD_D)
    if DQ == 1:
        # dSᵀ also goes to shared memory, read back transposed as the A operand of this warpgroup's part of dQ,
        # dS K (the previous step's dQ matmuls, its last readers, retired at that step's end). As dK's A operand
        # too, in place of the registers, it spilled more at d128 (Triton 3.6: 212 against 192 B)
        ds_smem.store(dsT_op)  # (BLOCK_N, BLOCK_M)
        fence_async_shared()
        # dQ in column slices of DQ_COLS (an fp32 (BLOCK_M, 128) accumulator beside dK and dV spilled)
        DQ_COLS: gl.constexpr = 64 if HEAD_D > 64 else HEAD_D
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_COLS, 16])
        for c in gl.static_range(HEAD_D // DQ_COLS):
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k_dq.slice(c * DQ_COLS, DQ_COLS, dim=1),
                               gl.zeros([BLOCK_M, DQ_COLS], gl.float32, layout=dq_layout), use_acc=False,
                               is_async=True)  # (BLOCK_M, DQ_COLS)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))  # dK's and dV's matmuls retire with it
            _add_dq_part(dq, dqacc_ptr, rows0 + g * Nq, start_m, Nq, c * DQ_COLS, BLOCK_M, HEAD_D, DQ_COLS)
    elif DQ >= 2 and DQ < 5:
        # both warpgroups' dSᵀ in one shared buffer per step parity (2·BLOCK_N keys, BLOCK_M queries); each
        # warpgroup then computes half of dQ's columns over all 2·BLOCK_N keys (_dq_of_step): one add per element
        # and program instead of two. DQ = 4 takes the previous step's dQ here (PREV), so that neither warpgroup
        # waits for the other's dSᵀ of the step it has just computed
        _publish_ds(dsT_op, ds_smem, ds_bars, i, BLOCK_N, WG, DS_RING)
        if DQ < 4:
            _dq_of_step(i, first, n_blocks, k_dq, ds_smem, ds_bars, dqacc_ptr, dq_smem, rows0, Nq, bh0, BLOCK_M,
                        BLOCK_N, HEAD_D, GQA, DQ, WG, DS_RING)
        elif PREV:
            _dq_of_step(i - 1, first, n_blocks, k_dq, ds_smem, ds_bars, dqacc_ptr, dq_smem, rows0, Nq, bh0, BLOCK_M,
                        BLOCK_N, HEAD_D, GQA, DQ, WG, DS_RING)
    return dk, dv, pT_op, dsT_op


@gluon.jit
def _dkdv_steps(dk, dv, k, v, q_smem, do_smem, ready, empty, lse_ptr, delta_ptr,
                lse_smem, delta_smem, rows0, keys, key_last, Nq, offset,
                qk_scale, GROUP, first, n_blocks, k_dq, ds_smem, ds_bars, dqacc_ptr, dq_smem, bh0,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, GQA: gl.constexpr, AHEAD: gl.constexpr, DQ: gl.constexpr, WG: gl.constexpr,
                ROWS_TMA: gl.constexpr = False, DS_RING: gl.constexpr = False):
    """Accumulate dK, dV (BLOCK_N, HEAD_D) fp32 of this warpgroup's keys `keys` (K, V: its shared-memory
    tiles) over the n_blocks query blocks from row `first` of each of the group's heads, in the producer's
    order (ring step i: stage i % STAGES). rows0: the group's first head in lse and delta.

    AHEAD False, per step: wait for the stage; issue sT = K Qᵀ and dPᵀ = V dOᵀ and load the rows' lse; wait
    for sT only and compute Pᵀ while dPᵀ runs; issue dV += Pᵀ dO and load delta; wait for dPᵀ and compute dSᵀ
    while dV's matmul runs; issue dK += dSᵀ Q; wait for both, release the stage.

    AHEAD True (FA3's intra-warpgroup overlap): step i + 1's score matmuls are issued before step i's
    elementwise work, so Pᵀ and dSᵀ of one step are computed while the next step's sT and dPᵀ run; their
    results wait one step in registers (2 · BLOCK_N · BLOCK_M fp32 more per warpgroup). Measured slower on an
    H200 (the dK/dV kernel 1.28× the time at d64, 1.78× at d128, causal; bench/results/flash_hopper/backward/).
    Needs
    n_blocks · GROUP >= 1, which every tile has (its keys are < Nk, and the last query row sees every key)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    n = n_blocks * GROUP
    if AHEAD:
        sT, dpT = _issue_scores(k, v, q_smem, do_smem, ready, 0, STAGES, BLOCK_M, HEAD_D, s_zero)
        for i in range(n - 1):
            sT_next, dpT_next = _issue_scores(k, v, q_smem, do_smem, ready, i + 1, STAGES, BLOCK_M, HEAD_D,
                                              s_zero)
            dk, dv, pT_op, dsT_op = _grad_step(dk, dv, sT, dpT, q_smem, do_smem, lse_ptr, delta_ptr,
                                               lse_smem, delta_smem, rows0, keys, key_last,
                                               Nq, offset, qk_scale, i, first, n_blocks, k_dq, ds_smem, ds_bars,
                                               dqacc_ptr, dq_smem, bh0, 2, BLOCK_M, BLOCK_N, HEAD_D, STAGES,
                                               CAUSAL, GQA, DQ, WG, ROWS_TMA=ROWS_TMA, DS_RING=DS_RING)
            # every matmul of step i retired (the next step's score matmuls, issued earlier, too; their
            # values are taken by the next step's waits)
            dv, dk, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pT_op, dsT_op))
            mbarrier.arrive(empty.index(i % STAGES), count=1)
            sT = sT_next
            dpT = dpT_next
        dk, dv, pT_op, dsT_op = _grad_step(dk, dv, sT, dpT, q_smem, do_smem, lse_ptr, delta_ptr,
                                           lse_smem, delta_smem, rows0, keys, key_last, Nq,
                                           offset, qk_scale, n - 1, first, n_blocks, k_dq, ds_smem, ds_bars,
                                           dqacc_ptr, dq_smem, bh0, 0, BLOCK_M, BLOCK_N, HEAD_D, STAGES,
                                           CAUSAL, GQA, DQ, WG, ROWS_TMA=ROWS_TMA, DS_RING=DS_RING)
        dv, dk, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pT_op, dsT_op))
        mbarrier.arrive(empty.index((n - 1) % STAGES), count=1)
    elif DQ == 4 or DQ == 6:
        # dQ one step behind: step 0 only publishes its dSᵀ, step i computes dQ of step i - 1 after issuing its
        # own dK (form 6: before issuing it), and the last step's dQ follows the loop
        sT, dpT = _issue_scores(k, v, q_smem, do_smem, ready, 0, STAGES, BLOCK_M, HEAD_D, s_zero)
        dk, dv, pT_op, dsT_op = _grad_step(dk, dv, sT, dpT, q_smem, do_smem, lse_ptr, delta_ptr,
                                           lse_smem, delta_smem, rows0, keys, key_last, Nq,
                                           offset, qk_scale, 0, first, n_blocks, k_dq, ds_smem, ds_bars, dqacc_ptr,
                                           dq_smem, bh0, 0, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, GQA, DQ, WG,
                                           False, ROWS_TMA=ROWS_TMA, DS_RING=DS_RING)
        dv, dk, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pT_op, dsT_op))
        mbarrier.arrive(empty.index(0), count=1)
        for i in range(1, n):
            sT, dpT = _issue_scores(k, v, q_smem, do_smem, ready, i, STAGES, BLOCK_M, HEAD_D, s_zero)
            dk, dv, pT_op, dsT_op = _grad_step(dk, dv, sT, dpT, q_smem, do_smem, lse_ptr, delta_ptr,
                                               lse_smem, delta_smem, rows0, keys, key_last,
                                               Nq, offset, qk_scale, i, first, n_blocks, k_dq, ds_smem, ds_bars,
                                               dqacc_ptr, dq_smem, bh0, 0, BLOCK_M, BLOCK_N, HEAD_D, STAGES,
                                               CAUSAL, GQA, DQ, WG, True, ROWS_TMA=ROWS_TMA, DS_RING=DS_RING)
            dv, dk, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pT_op, dsT_op))
            mbarrier.arrive(empty.index(i % STAGES), count=1)
        _dq_of_step(n - 1, first, n_blocks, k_dq, ds_smem, ds_bars, dqacc_ptr, dq_smem, rows0, Nq, bh0, BLOCK_M,
                    BLOCK_N, HEAD_D, GQA, DQ, WG, DS_RING)
    else:
        for i in range(n):
            sT, dpT = _issue_scores(k, v, q_smem, do_smem, ready, i, STAGES, BLOCK_M, HEAD_D, s_zero)
            dk, dv, pT_op, dsT_op = _grad_step(dk, dv, sT, dpT, q_smem, do_smem, lse_ptr, delta_ptr,
                                               lse_smem, delta_smem, rows0, keys, key_last,
                                               Nq, offset, qk_scale, i, first, n_blocks, k_dq, ds_smem, ds_bars,
                                               dqacc_ptr, dq_smem, bh0, 0, BLOCK_M, BLOCK_N, HEAD_D, STAGES,
                                               CAUSAL, GQA, DQ, WG, ROWS_TMA=ROWS_TMA, DS_RING=DS_RING)
            # the 16-bit operands stay live until their matmuls retire: their registers are the wgmmas' A
            # operands
            dv, dk, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, pT_op, dsT_op))
            mbarrier.arrive(empty.index(i % STAGES), count=1)
    return dk, dv


@gluon.jit
def _consumer(WG: gl.constexpr, dk_desc, dv_desc, lse_ptr, delta_ptr,
              lse_smem, delta_smem, q_smem, do_smem, k_smem, v_smem, kv_ready,
              ready, empty, Hq, GROUP, Nq, offset, qk_scale, sm_scale, ds_smem, ds_bars, dqacc_ptr, dq_smem,
              TAIL_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, GQA: gl.constexpr, AHEAD: gl.constexpr, DQ: gl.constexpr,
              ROWS_TMA: gl.constexpr, DS_RING: gl.constexpr):
    """Consumer warpgroup WG (0 or 1): dK, dV of keys [WG·BLOCK_N, (WG + 1)·BLOCK_N) of the program's tile over
    the query blocks of every head of the group that see the tile; then the epilogue."""
    dtype: gl.constexpr = dk_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    pid_n, hk, b = _program_tile(TAIL_HEADS)
    start_n = pid_n * (2 * BLOCK_N)
    row0 = start_n + WG * BLOCK_N  # this warpgroup's first key
    lo, n_blocks = _query_blocks(start_n, Nq, offset, CAUSAL, BLOCK_M, 2 * BLOCK_N)
    keys = row0 + gl.arange(0, BLOCK_N, layout=row_s)  # (BLOCK_N,) this warpgroup's keys
    key_last = row0 + BLOCK_N - 1
    rows0 = (b * Hq + hk * GROUP).to(gl.int64) * Nq  # the group's first head in lse and delta (B, Hq, Nq)
    k = k_smem.index(WG).reshape([BLOCK_N, HEAD_D])  # (BLOCK_N, HEAD_D)
    v = v_smem.index(WG).reshape([BLOCK_N, HEAD_D])
    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_ready.index(WG), 0)
    if DQ >= 2:  # dQ's matmuls read both warpgroups' K tiles
        mbarrier.wait(kv_ready.index(1 - WG), 0)
        k_dq = k_smem
        ds_mine = ds_smem
    else:
        k_dq = k
        ds_mine = ds_smem.index(WG)
    if DQ >= 3:
        dq_mine = dq_smem.index(WG)  # (1, BLOCK_M, HEAD_D // 2) fp32
    else:
        dq_mine = dq_smem  # (not used)
    dk, dv = _dkdv_steps(dk, dv, k, v, q_smem, do_smem, ready, empty, lse_ptr, delta_ptr,
                         lse_smem, delta_smem, rows0, keys, key_last, Nq,
                         offset, qk_scale, GROUP, lo, n_blocks, k_dq, ds_mine, ds_bars, dqacc_ptr, dq_mine,
                         b * Hq + hk * GROUP, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, GQA, AHEAD, DQ, WG,
                         ROWS_TMA=ROWS_TMA, DS_RING=DS_RING)
    if DQ >= 2:  # the other warpgroup's last dQ matmuls read this one's K, which the epilogue overwrites
        last = n_blocks * GROUP - 1
        if DS_RING:  # both released the last step's stage after its dQ matmuls
            mbarrier.wait(empty.index(last % STAGES), (last // STAGES) & 1)
        else:
            mbarrier.wait(ds_bars.index(2 + last % 2), (last // 2) & 1)

    # epilogue: this warpgroup's K and V buffers are no longer read (its matmuls retired): dV and dK go out
    # through them. The tile is mapped again from the program ids rather than held through the loop (under
    # Triton 3.6 that took the non-causal d128 fused forms from 68 / 76 to 48 / 48 B of spills per thread)
    pid_n, hk, b = _program_tile(TAIL_HEADS)
    row0 = pid_n * (2 * BLOCK_N) + WG * BLOCK_N
    v_out = v_smem.index(WG)  # (1, 1, BLOCK_N, HEAD_D)
    k_out = k_smem.index(WG)
    v_out.reshape([BLOCK_N, HEAD_D]).store(dv.to(dtype))
    k_out.reshape([BLOCK_N, HEAD_D]).store((dk * sm_scale).to(dtype))  # dS was taken w.r.t. the scaled scores
    fence_async_shared()
    _tma_store(dv_desc, [b, hk, row0, 0], v_out)  # rows past Nk are clipped by the descriptor's bounds
    _tma_store(dk_desc, [b, hk, row0, 0], k_out)
    tma.store_wait(0)


@gluon.jit
def _consumer_default(dk_desc, dv_desc, lse_ptr, delta_ptr,
                      lse_smem, delta_smem, q_smem, do_smem, k_smem, v_smem, kv_ready, ready,
                      empty, Hq, GROUP, Nq, offset, qk_scale, sm_scale, ds_smem, ds_bars, dqacc_ptr, dq_smem,
                      TAIL_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                      STAGES: gl.constexpr, CAUSAL: gl.constexpr, GQA: gl.constexpr, AHEAD: gl.constexpr,
                      DQ: gl.constexpr, ROWS_TMA: gl.constexpr, DS_RING: gl.constexpr):
    """Consumer 0, in the default partition (the kernel's own num_warps = 4)."""
    _consumer(0, dk_desc, dv_desc, lse_ptr, delta_ptr,
              lse_smem, delta_smem, q_smem, do_smem, k_smem, v_smem, kv_ready, ready, empty,
              Hq, GROUP, Nq, offset, qk_scale, sm_scale, ds_smem, ds_bars, dqacc_ptr, dq_smem, TAIL_HEADS, BLOCK_M,
              BLOCK_N, HEAD_D, STAGES, CAUSAL, GQA, AHEAD, DQ, ROWS_TMA, DS_RING)


@gluon.jit
def _consumer_worker(dk_desc, dv_desc, lse_ptr, delta_ptr,
                     lse_smem, delta_smem, q_smem, do_smem, k_smem, v_smem, kv_ready, ready,
                     empty, Hq, GROUP, Nq, offset, qk_scale, sm_scale, ds_smem, ds_bars, dqacc_ptr, dq_smem,
                     TAIL_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                     STAGES: gl.constexpr, CAUSAL: gl.constexpr, GQA: gl.constexpr, AHEAD: gl.constexpr,
                     DQ: gl.constexpr, ROWS_TMA: gl.constexpr, DS_RING: gl.constexpr):
    """Consumer 1, in a 4-warp worker partition."""
    _consumer(1, dk_desc, dv_desc, lse_ptr, delta_ptr,
              lse_smem, delta_smem, q_smem, do_smem, k_smem, v_smem, kv_ready, ready, empty,
              Hq, GROUP, Nq, offset, qk_scale, sm_scale, ds_smem, ds_bars, dqacc_ptr, dq_smem, TAIL_HEADS, BLOCK_M,
              BLOCK_N, HEAD_D, STAGES, CAUSAL, GQA, AHEAD, DQ, ROWS_TMA, DS_RING)


# ----------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------


@gluon.jit(do_not_specialize=["Hq", "GROUP", "Nq", "offset"])
def _attn_bwd_dkdv_hopper(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr, lse_desc, delta_desc,
                          Hq, GROUP, Nq,
                          offset, qk_scale, sm_scale, dqacc_ptr, TAIL_HEADS: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr,
                          HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, GQA: gl.constexpr,
                          AHEAD: gl.constexpr, DQ: gl.constexpr, ROWS_TMA: gl.constexpr,
                          DS_RING: gl.constexpr = False):
    """dK, dV on sm_90 (Hopper) of 2·BLOCK_N keys of one (kv head, batch), summed over the GROUP query heads
    that read them.

    Supports: float16 and bfloat16 (every tensor one dtype; fp32 accumulation); HEAD_D 64 or 128 (exactly: no
    padding lanes); any Nq, Nk >= 1 (tails: the descriptors' bounds, lse = +inf past Nq); causal (bottom-right
    aligned, offset = Nk - Nq) or not; GQA and MQA (GQA: GROUP > 1 query heads per kv head, h = hk·GROUP + g).
    No sliding window, no documents, no RoPE tables, no dropout, no fp32, no fp8. CAUSAL: 0 or False none, 1 or
    True every block masked, 2 the blocks wholly below the diagonal unmasked (a runtime branch per step).

    q_desc, do_desc: 4-d TMA descriptors over (B, Hq, Nq, HEAD_D), blocks (1, 1, BLOCK_M, HEAD_D); k_desc,
    v_desc, dk_desc, dv_desc: over (B, Hkv, Nk, HEAD_D), blocks (1, 1, BLOCK_N, HEAD_D), dk_desc's and dv_desc's
    shared layouts those of k_desc and v_desc (any strides that are 16-byte multiples, unit stride along the
    head dim). lse_ptr, delta_ptr: (B, Hq, Nq) fp32, contiguous: the forward's log-sum-exp (base 2, scaled:
    qk_scale = sm_scale · log2 e; +inf for rows that see no key) and rowsum(dO * O). grid: (cdiv(Nk, 2·BLOCK_N),
    Hkv, B). Launched with num_warps=4 (consumer 0), plus a 4-warp consumer and a PRODUCER_WARPS producer
    partition, maxnreg=MAX_REGS. AHEAD: each consumer issues the next query block's score matmuls before this
    block's elementwise work (_dkdv_steps); right at both head dims, slower at both (the launcher's default is
    off). DQ (1 to 6; 0: not; 4 and 6 not with AHEAD): also add dS K into dqacc_ptr ((B, Hq, Nq, HEAD_D) fp32,
    contiguous, zeroed; not read without DQ; with DQ >= 3 a 3-d TMA descriptor over it as (B·Hq, Nq, HEAD_D),
    blocks (1, BLOCK_M, HEAD_D / 2) fp32). ROWS_TMA: lse_desc, delta_desc are 1-d TMA descriptors over the same
    lse and delta flattened to (B·Hq·Nq), blocks (BLOCK_M,), unswizzled (B·Hq·Nq < 2**31: the rows' coordinates
    are int32); without it they are not read. DS_RING (DQ 2, 3 or 5 only): one dSᵀ buffer per ring stage,
    counted free through the ring's releases instead of their own barriers (_publish_ds). TAIL_HEADS: how many
    of the last (batch, kv head) pairs in launch order have their key tiles dealt across them, tile by tile
    (_program_tile; 0: every pair's tiles in order).
    """
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)  # the Q ring
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, HEAD_D], do_desc.layout)  # the dO ring
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)  # one per consumer
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    if DQ == 1:  # each consumer's dSᵀ, read back transposed as the A operand of its dQ matmul
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    elif DQ >= 2:  # both consumers' dSᵀ, per step parity
        ds_smem = gl.allocate_shared_memory(dtype, [STAGES if DS_RING else 2, 2 * BLOCK_N, BLOCK_M], ds_layout)
    else:
        ds_smem = k_smem  # (not used)
    if DQ >= 3:  # each consumer's half of dQ's columns, fp32, the source of its TMA reduce-adds
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BLOCK_M, HEAD_D // 2], dqacc_ptr.layout)
    else:
        dq_smem = k_smem  # (not used)
    if ROWS_TMA:  # each stage's lse and delta rows, BLOCK_M fp32 each
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    else:
        lse_smem = q_smem  # (not used)
        delta_smem = q_smem
    ds_bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())  # DQ >= 2: ready x2, free x2

    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(kv_ready.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumers release each stage
    for s in gl.static_range(4):
        mbarrier.init(ds_bars.index(s), count=2)  # both consumers arrive

    # (the argument tuples are written inline: a tuple assigned to a name would turn its constexprs into tensors)
    gl.warp_specialize([
        (_consumer_default, (dk_desc, dv_desc, lse_ptr, delta_ptr,
                             lse_smem, delta_smem, q_smem, do_smem, k_smem, v_smem, kv_ready,
                             ready, empty, Hq, GROUP, Nq, offset, qk_scale, sm_scale, ds_smem, ds_bars, dqacc_ptr,
                             dq_smem, TAIL_HEADS, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, GQA, AHEAD, DQ, ROWS_TMA,
                             DS_RING)),
        (_consumer_worker, (dk_desc, dv_desc, lse_ptr, delta_ptr,
                            lse_smem, delta_smem, q_smem, do_smem, k_smem, v_smem, kv_ready,
                            ready, empty, Hq, GROUP, Nq, offset, qk_scale, sm_scale, ds_smem, ds_bars, dqacc_ptr,
                            dq_smem, TAIL_HEADS, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, GQA, AHEAD, DQ, ROWS_TMA,
                            DS_RING)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem,
                     k_smem, v_smem, kv_ready, ready, empty, Hq, GROUP, Nq, offset, TAIL_HEADS, BLOCK_M, BLOCK_N,
                     HEAD_D, STAGES,
                     CAUSAL, GQA, ROWS_TMA)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
