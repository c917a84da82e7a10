"""The Hopper forward kernel in Gluon: O and the row log-sum-exp of softmax(Q Kᵀ · scale + mask) V.

The structure of FlashAttention-3's forward on sm_90, written with Gluon's explicit primitives:

* warp specialization (gl.warp_specialize): a producer warp that only issues TMA copies, and CONSUMERS (2 or
  3) consumer warpgroups (the default partition and 4-warp workers) that only compute. The register budget
  moves from the producer (PRODUCER_REGS) to the consumers (CONSUMER_REGS) with setmaxnreg.
* a tile is CONSUMERS x BLOCK_M query rows; consumer warpgroup w owns rows [w·BLOCK_M, (w + 1)·BLOCK_M) of it.
  All read the same K/V blocks, streamed by the producer through a STAGES-deep shared-memory ring: one mbarrier
  pair (ready, empty) per stage for K and another for V, so QKᵀ of a block can start before its V has landed.
  A stage is refilled once every consumer has released it (empty barriers count CONSUMERS arrivals).
* wgmma for both matmuls: S = Q Kᵀ with Q and K in shared memory, O += P V with P in registers (the fp32
  accumulator layout of S becomes the 16-bit A-operand layout of P without a trip through shared memory).
* intra-warpgroup overlap: QKᵀ of block j is issued together with PV of block j - 1, and the softmax of block
  j runs while that PV is still in flight; O is rescaled after it retires.
* causal, each consumer's own key range (OWN_BLOCKS): the tile's last key blocks that its own rows do not see
  are not multiplied; the consumer only takes its turns and releases their ring stages.
* the row maximum is reduced across a row's threads every key block (the scores need it); with LANE_SUMS the
  row sum only once per tile, each thread keeping partial sums of its own columns until then.
* ping-pong between the consumers: one mbarrier per consumer hands the tensor cores from one warpgroup to the
  next (in a ring), so each one issues its two matmuls of a step while the others run their softmax.
* a persistent grid: each program loops over its tiles. With a causal mask (LISTS) each program runs a list
  of its own, made on the host (kernels/flash_hopper/schedule.py): longest first within groups of heads whose
  K/V fit in L2, dealt so that the programs end together. Otherwise tiles program_id, program_id +
  num_programs, ... of the arithmetic order (the query blocks of one head side by side; causal without lists:
  the bottom query blocks of every head first). The producer runs ahead into the next tile (Q and K/V) while
  the consumers finish the current one.
* the output goes out through shared memory and a TMA store; the log-sum-exp with a masked store.

Numerics as kernels/flash/forward.py: fp32 scores and statistics, the online softmax in base 2 with the scale
folded into one multiply (qk_scale = sm_scale · log2 e), P rounded to the input dtype before PV, rows that see
no key give O = 0 and lse = +inf. Launched by kernels/flash_hopper/launch.py.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# The TMA copy builtins were renamed between Triton releases (3.6: async_copy_*; later: async_load/async_store,
# with the old names raising). Either is a Gluon builtin, so the kernels may call it through these names.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

# Partition sizes and register budgets (constexprs: the kernel reads them). A warpgroup is 4 warps; with two
# consumers the kernel runs 3 (consumer 0, consumer 1, the producer's), so MAX_REGS x 3 x 128 threads stays
# within the 64K registers of an SM, and setmaxnreg moves registers from the producer to the consumers:
# 24 + 240 + 240 = 3 x 168. With three consumers (4 warpgroups): 24 + 3 x 160 <= 4 x 128.
PRODUCER_WARPS = gl.constexpr(1)
PRODUCER_REGS = gl.constexpr(24)  # the producer holds only scalars (tile coordinates, ring counters)
CONSUMER_REGS = gl.constexpr(240)  # each of two consumers: S (and the next S), P, O and the row statistics
CONSUMER_REGS_3 = gl.constexpr(160)  # each of three (head dim 64 only: S and P of 64 x 128, O of 64 x 64)
MAX_REGS = {2: 168, 3: 128}  # the kernel's register cap at entry (a launch option), per consumer count


# ----------------------------------------------------------------------------------------------------------
# What every partition computes the same way: the tile order and each tile's key blocks
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _tile_range(starts_ptr, n_tiles, LISTS: gl.constexpr):
    """(first, end, step) of the loop over this program's tiles: with LISTS its own list, entries
    starts[pid] .. starts[pid + 1] of the tile list (kernels/flash_hopper/schedule.py); otherwise tiles pid,
    pid + num_programs, ... < n_tiles of the arithmetic order."""
    pid = gl.program_id(0)
    if LISTS:
        first = gl.load(starts_ptr + pid)
        end = gl.load(starts_ptr + pid + 1)
        step = 1
    else:
        first = pid
        end = n_tiles
        step = gl.num_programs(0)
    return first, end, step


@gluon.jit
def _tile_coords(i, tiles_ptr, n_m, n_bh, Hq, CAUSAL: gl.constexpr, LISTS: gl.constexpr):
    """(query block, head, batch) of this program's tile i (an entry of the tile list with LISTS, coded
    m · n_bh + bh; otherwise a tile number of n_m x n_bh). Without lists, causal: level by level from the bottom
    query block of every (batch, head) up (longest first); otherwise the query blocks of one head side by side
    (they share its K/V in L2)."""
    if LISTS:
        code = gl.load(tiles_ptr + i)
        m_block = code // n_bh
        bh = code - m_block * n_bh
    elif CAUSAL:
        level = i // n_bh
        bh = i - level * n_bh
        m_block = n_m - 1 - level
    else:
        bh = i // n_m
        m_block = i - bh * n_m
    h = bh % Hq
    return m_block, h, bh // Hq


@gluon.jit
def _key_blocks(start_m, Nk, offset, CAUSAL: gl.constexpr, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key blocks of the query tile [start_m, start_m + TILE_M): (n_blocks, n_full). The tile reads blocks
    [0, n_blocks); blocks [0, n_full) are visible to every row of the tile (no mask), the later ones cross the
    causal diagonal (bottom-right aligned: offset = Nk - Nq) or the Nk tail and are masked. n_blocks = 0 when
    no row of the tile sees a key (causal with Nq > Nk)."""
    n_full = Nk // BLOCK_N
    if CAUSAL:
        hi = gl.minimum(gl.maximum(start_m + TILE_M + offset, 0), Nk)  # past the last row's last key
        n_full = gl.minimum(gl.maximum(start_m + offset + 1, 0) // BLOCK_N, n_full)  # the first row's
    else:
        hi = Nk
    return gl.cdiv(hi, BLOCK_N), n_full


# ----------------------------------------------------------------------------------------------------------
# The producer: one warp issuing TMA copies
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
              v_empty, Hq, GROUP, Nk, offset, n_m, n_bh, n_tiles, starts_ptr, tiles_ptr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, LISTS: gl.constexpr, CONSUMERS: gl.constexpr):
    """Per tile: each consumer's rows of Q (once it released the previous tile's), then the K and V blocks
    of the tile into the ring, each stage once every consumer released it. Out-of-range rows (past Nq or Nk,
    the 4-d descriptors' bounds) arrive as zeros."""
    q_bytes: gl.constexpr = BLOCK_M * HEAD_D * q_desc.dtype.primitive_bitwidth // 8
    kv_bytes: gl.constexpr = BLOCK_N * HEAD_D * k_desc.dtype.primitive_bitwidth // 8
    it = 0  # K/V blocks loaded so far: stage it % STAGES, round it // STAGES
    t = 0  # tiles so far
    first, end, step = _tile_range(starts_ptr, n_tiles, LISTS)
    for i in range(first, end, step):
        m_block, h, b = _tile_coords(i, tiles_ptr, n_m, n_bh, Hq, CAUSAL, LISTS)
        start_m = m_block * (CONSUMERS * BLOCK_M)
        hk = h // GROUP
        for w in gl.static_range(CONSUMERS):
            mbarrier.wait(q_empty.index(w), (t & 1) ^ 1)  # a fresh barrier passes phase 1 at once
            mbarrier.expect(q_ready.index(w), q_bytes)
            _tma_load(q_desc, [b, h, start_m + w * BLOCK_M, 0], q_ready.index(w), q_smem.index(w))
        n_blocks, n_full = _key_blocks(start_m, Nk, offset, CAUSAL, CONSUMERS * BLOCK_M, BLOCK_N)
        for j in range(n_blocks):
            s = it % STAGES
            ph = (it // STAGES) & 1
            mbarrier.wait(k_empty.index(s), ph ^ 1)
            mbarrier.expect(k_ready.index(s), kv_bytes)
            _tma_load(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
            mbarrier.wait(v_empty.index(s), ph ^ 1)
            mbarrier.expect(v_ready.index(s), kv_bytes)
            _tma_load(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))
            it += 1
        t += 1


# ----------------------------------------------------------------------------------------------------------
# The consumers: two or three warpgroups, BLOCK_M query rows each
# ----------------------------------------------------------------------------------------------------------


@gluon.jit
def _softmax_step(s, m_i, l_i, rows, cols, Nk, offset, qk_scale, masked, CAUSAL: gl.constexpr,
                  LANE_SUMS: gl.constexpr):
    """One online-softmax step on the unscaled scores s (BLOCK_M, BLOCK_N) of key columns `cols`: returns
    (p, m_new, l_new, alpha), p = exp2(s·qk_scale - m_new) in fp32, alpha = exp2(m_i - m_new) rescales the old
    statistics and O. masked: hide keys past Nk and (CAUSAL) above the diagonal (key j <= row i + offset); a row
    that has seen no key yet keeps m = -inf and gets p = 0, alpha = 0 (not NaN). The running sum l_i is (BLOCK_M,)
    or, LANE_SUMS, (BLOCK_M, 8): p's columns summed in groups that one thread holds in the wgmma accumulator
    layout (column c into c % 8), which needs no shuffles between the row's threads; l_i may then start as the
    scalar 0."""
    if masked:
        visible = gl.expand_dims(cols, 0) < Nk  # (1, BLOCK_N)
        if CAUSAL:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + offset)  # (BLOCK_M, BLOCK_N)
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))  # (BLOCK_M,)
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_sub, 1))  # (BLOCK_M, BLOCK_N)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)  # qk_scale > 0
        m_sub = m_new
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_sub, 1))
    alpha = gl.exp2(m_i - m_sub)  # (BLOCK_M,) 0 on a row's first visible block
    if LANE_SUMS:  # l_i: (BLOCK_M, 8) partial sums, each thread its own columns' (no shuffles)
        p_part = gl.sum(gl.reshape(p, [p.shape[0], p.shape[1] // 8, 8]), axis=1)  # (BLOCK_M, 8)
        alpha_part = gl.convert_layout(alpha, gl.SliceLayout(1, p_part.type.layout))
        l_new = l_i * gl.expand_dims(alpha_part, 1) + p_part
    else:
        l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _consumer(WG: gl.constexpr, o_desc, lse_ptr, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready,
              k_empty, v_ready, v_empty, turn, Hq, Nq, Nk, offset, qk_scale, n_m, n_bh, n_tiles, starts_ptr,
              tiles_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, LISTS: gl.constexpr, EARLY_Q: gl.constexpr, CONSUMERS: gl.constexpr,
              OWN_BLOCKS: gl.constexpr, LANE_SUMS: gl.constexpr):
    """Consumer warpgroup WG (0 .. CONSUMERS - 1): rows [WG·BLOCK_M, (WG + 1)·BLOCK_M) of each tile of this
    program.

    Step j (j >= 1) of a tile: take the tensor cores (turn[WG]), issue S_j = Q K_jᵀ and O += P_{j-1} V_{j-1},
    hand them to the next consumer (turn[(WG + 1) % CONSUMERS]); wait for S_j only, release K_j, run the softmax
    of block j while PV runs;
    then wait for PV, release V_{j-1}, rescale O by alpha_j. EARLY_Q: this warpgroup's Q is released as soon
    as the tile's last QKᵀ retires, so that the producer loads the next tile's Q (and then its K/V) while the
    last softmax, PV and the epilogue run; otherwise after the last PV. Block 0 (QKᵀ and softmax) comes before the
    loop, the last PV after it."""
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q = q_smem.index(WG).reshape([BLOCK_M, HEAD_D])  # (BLOCK_M, HEAD_D) this warpgroup's rows of Q
    o_tile = o_smem.index(WG)  # (1, 1, BLOCK_M, HEAD_D), the TMA store's source
    it = 0  # K/V blocks consumed so far (the producer's count)
    t = 0
    turns = 0  # tensor-core turns taken so far
    first, end, step = _tile_range(starts_ptr, n_tiles, LISTS)
    for i in range(first, end, step):
        m_block, h, b = _tile_coords(i, tiles_ptr, n_m, n_bh, Hq, CAUSAL, LISTS)
        start_m = m_block * (CONSUMERS * BLOCK_M)
        row0 = start_m + WG * BLOCK_M
        rows = row0 + gl.arange(0, BLOCK_M, layout=row_s)  # (BLOCK_M,) query rows
        n_blocks, n_full = _key_blocks(start_m, Nk, offset, CAUSAL, CONSUMERS * BLOCK_M, BLOCK_N)
        if CAUSAL and OWN_BLOCKS:  # this warpgroup's rows see fewer blocks than the tile's last rows
            n_mine, _ = _key_blocks(row0, Nk, offset, CAUSAL, BLOCK_M, BLOCK_N)
            n_mine = gl.minimum(n_mine, n_blocks)
        else:
            n_mine = n_blocks

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)  # running max (base 2, scaled)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)  # running sum of exp2
        acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)  # running unnormalised O
        mbarrier.wait(q_ready.index(WG), t & 1)
        if n_mine > 0:
            # block 0: S_0 = Q K_0ᵀ and its softmax
            ks = it % STAGES
            mbarrier.wait(k_ready.index(ks), (it // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(ks).reshape([BLOCK_N, HEAD_D]).permute((1, 0)),
                              gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), use_acc=False,
                              is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))  # (BLOCK_M, BLOCK_N) fp32
            mbarrier.arrive(k_empty.index(ks), count=1)
            if EARLY_Q:  # a one-block tile's last QKᵀ has retired: the producer may load the next tile's Q
                mbarrier.arrive(q_empty.index(WG), count=1, pred=n_mine == 1)
            cols = gl.arange(0, BLOCK_N, layout=col_s)  # (BLOCK_N,) key columns of block 0
            # (the running sum starts as 0: (BLOCK_M,) or, LANE_SUMS, (BLOCK_M, 8) partial sums until the tile ends)
            p32, m_i, l_part, alpha = _softmax_step(s, m_i, 0.0, rows, cols, Nk, offset, qk_scale, n_full == 0,
                                                    CAUSAL, LANE_SUMS)
            p = gl.convert_layout(p32.to(dtype), p_layout)  # (BLOCK_M, BLOCK_N) the A operand of PV
            for j in range(1, n_mine):
                cur = it + j
                prev = cur - 1
                ks = cur % STAGES
                vs = prev % STAGES
                mbarrier.wait(turn.index(WG), turns & 1)
                mbarrier.wait(k_ready.index(ks), (cur // STAGES) & 1)
                s = warpgroup_mma(q, k_smem.index(ks).reshape([BLOCK_N, HEAD_D]).permute((1, 0)),
                                  gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), use_acc=False,
                                  is_async=True)
                mbarrier.wait(v_ready.index(vs), (prev // STAGES) & 1)
                acc = warpgroup_mma(p, v_smem.index(vs).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
                mbarrier.arrive(turn.index((WG + 1) % CONSUMERS), count=1)
                turns += 1
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # S_j done, PV_{j-1} may still run
                mbarrier.arrive(k_empty.index(ks), count=1)
                if EARLY_Q:  # the tile's last QKᵀ has retired
                    mbarrier.arrive(q_empty.index(WG), count=1, pred=j == n_mine - 1)
                cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_s)
                p32, m_i, l_part, alpha = _softmax_step(s, m_i, l_part, rows, cols, Nk, offset, qk_scale,
                                                        j >= n_full, CAUSAL, LANE_SUMS)
                # P_{j-1} stays live until its PV retires: the registers are the wgmma's operand
                acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
                mbarrier.arrive(v_empty.index(vs), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                p = gl.convert_layout(p32.to(dtype), p_layout)
            # the last block's PV
            last = it + n_mine - 1
            vs = last % STAGES
            mbarrier.wait(v_ready.index(vs), (last // STAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(vs).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
            mbarrier.arrive(v_empty.index(vs), count=1)
            if LANE_SUMS:
                l_i = gl.convert_layout(gl.sum(l_part, axis=1), row_s)  # (BLOCK_M,)
            else:
                l_i = l_part
        # the tile's blocks this warpgroup's rows do not see (all masked): take the turns and release the stages
        # as the others expect, without the matmuls (ready waited first: the stage holds this round's block)
        for j in range(n_mine, n_blocks):
            cur = it + j
            if j > 0:
                mbarrier.wait(turn.index(WG), turns & 1)
                mbarrier.arrive(turn.index((WG + 1) % CONSUMERS), count=1)
                turns += 1
            st = cur % STAGES
            mbarrier.wait(k_ready.index(st), (cur // STAGES) & 1)
            mbarrier.arrive(k_empty.index(st), count=1)
            mbarrier.wait(v_ready.index(st), (cur // STAGES) & 1)
            mbarrier.arrive(v_empty.index(st), count=1)
        it += n_blocks
        if EARLY_Q:  # released above after this warpgroup's last QKᵀ, here only when its rows see no key
            mbarrier.arrive(q_empty.index(WG), count=1, pred=n_mine == 0)
        else:  # released after the tile's last PV
            mbarrier.arrive(q_empty.index(WG), count=1)
        t += 1

        # epilogue: rows that saw no key get O = 0 and lse = +inf (the backward's P is then exactly 0)
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        lse = gl.where(l_i == 0.0, float("inf"), m_i + gl.log2(l_safe))  # (BLOCK_M,) base 2, scaled
        o = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)  # (BLOCK_M, HEAD_D)
        bh = b * Hq + h
        gl.store(lse_ptr + bh.to(gl.int64) * Nq + rows, lse, mask=rows < Nq)
        tma.store_wait(0)  # the previous tile's O has left o_tile
        o_tile.reshape([BLOCK_M, HEAD_D]).store(o.to(dtype))
        fence_async_shared()
        _tma_store(o_desc, [b, h, row0, 0], o_tile)  # rows past Nq are clipped by the descriptor's bounds
    tma.store_wait(0)


# ----------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------


@gluon.jit(do_not_specialize=["Hq", "GROUP", "Nq", "Nk", "offset", "n_m", "n_bh", "n_tiles"])
def _attn_fwd_hopper(q_desc, k_desc, v_desc, o_desc, lse_ptr, Hq, GROUP, Nq, Nk, offset, qk_scale, n_m, n_bh,
                     n_tiles, starts_ptr, tiles_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, LISTS: gl.constexpr,
                     EARLY_Q: gl.constexpr, CONSUMERS: gl.constexpr, OWN_BLOCKS: gl.constexpr,
                     LANE_SUMS: gl.constexpr):
    """Forward attention on sm_90 (Hopper): O (through o_desc) and the row log-sum-exp (lse_ptr) of q, k, v.

    Supports: float16 and bfloat16 (q, k, v and O one dtype; fp32 accumulation); HEAD_D 64 or 128 (exactly:
    no padding lanes); any Nq, Nk >= 1 (tails handled by the descriptors' bounds and the mask); causal
    (bottom-right aligned, offset = Nk - Nq; rows that see no key: O = 0, lse = +inf) or not; GQA and MQA
    (query head h reads kv head h // GROUP). No sliding window, no documents, no dropout, no fp32, no fp8.

    q_desc, o_desc: 4-d TMA descriptors over (B, Hq, Nq, HEAD_D), blocks (1, 1, BLOCK_M, HEAD_D); k_desc,
    v_desc: over (B, Hkv, Nk, HEAD_D), blocks (1, 1, BLOCK_N, HEAD_D) (any strides that are 16-byte multiples,
    unit stride along the head dim). lse_ptr: (B, Hq, Nq) fp32, contiguous, base 2 and scaled (log2 of the
    row's sum of exp2(s · qk_scale)); qk_scale = sm_scale · log2(e). Tiles: CONSUMERS·BLOCK_M query rows of one
    (batch, head), CONSUMERS 2 or 3 (3 with HEAD_D 64 only: the register budget); n_m = cdiv(Nq, CONSUMERS·BLOCK_M),
    n_bh = B·Hq, n_tiles = n_m·n_bh; the grid is persistent
    (any size >= 1, at most n_tiles useful). LISTS: program p runs the tiles tiles_ptr[starts_ptr[p] ..
    starts_ptr[p + 1]) (int32 codes m · n_bh + bh, every tile in exactly one list; the grid has one program per
    list); without LISTS the two pointers are not read. EARLY_Q: each consumer releases its Q after the tile's
    last QKᵀ rather than its last PV (see _consumer). OWN_BLOCKS (causal): each consumer multiplies only the key
    blocks its own rows see. LANE_SUMS: the row sums as per-thread partial sums, reduced across the row's threads
    once per tile (see _softmax_step). Launched with num_warps=4 (consumer 0), plus CONSUMERS - 1
    4-warp consumers and a PRODUCER_WARPS producer partition, maxnreg=MAX_REGS[CONSUMERS].
    """
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)  # one per consumer
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)  # the K ring
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)  # the V ring
    o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, BLOCK_M, HEAD_D], o_desc.layout)  # one per consumer

    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())  # whose matmuls
    for w in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(q_empty.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=CONSUMERS)  # every consumer releases each stage
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(v_empty.index(s), count=CONSUMERS)
    mbarrier.arrive(turn.index(0), count=1)  # consumer 0 takes the tensor cores first

    # (the argument tuples are written inline: a tuple assigned to a name would turn its constexprs into tensors)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (0, o_desc, lse_ptr, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready,
                                 k_empty, v_ready, v_empty, turn, Hq, Nq, Nk, offset, qk_scale, n_m, n_bh, n_tiles,
                                 starts_ptr, tiles_ptr, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, LISTS, EARLY_Q,
                                 CONSUMERS, OWN_BLOCKS, LANE_SUMS)),
            (_consumer, (1, o_desc, lse_ptr, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready,
                                k_empty, v_ready, v_empty, turn, Hq, Nq, Nk, offset, qk_scale, n_m, n_bh, n_tiles,
                                starts_ptr, tiles_ptr, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, LISTS, EARLY_Q,
                                CONSUMERS, OWN_BLOCKS, LANE_SUMS)),
            (_consumer, (2, o_desc, lse_ptr, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready,
                                  k_empty, v_ready, v_empty, turn, Hq, Nq, Nk, offset, qk_scale, n_m, n_bh,
                                  n_tiles, starts_ptr, tiles_ptr, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, LISTS,
                                  EARLY_Q, CONSUMERS, OWN_BLOCKS, LANE_SUMS)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                         v_ready, v_empty, Hq, GROUP, Nk, offset, n_m, n_bh, n_tiles, starts_ptr, tiles_ptr,
                         BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, LISTS, CONSUMERS)),
        ], [4, 4, PRODUCER_WARPS], [CONSUMER_REGS_3, CONSUMER_REGS_3, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, o_desc, lse_ptr, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready,
                                 k_empty, v_ready, v_empty, turn, Hq, Nq, Nk, offset, qk_scale, n_m, n_bh, n_tiles,
                                 starts_ptr, tiles_ptr, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, LISTS, EARLY_Q,
                                 CONSUMERS, OWN_BLOCKS, LANE_SUMS)),
            (_consumer, (1, o_desc, lse_ptr, q_smem, k_smem, v_smem, o_smem, q_ready, q_empty, k_ready,
                                k_empty, v_ready, v_empty, turn, Hq, Nq, Nk, offset, qk_scale, n_m, n_bh, n_tiles,
                                starts_ptr, tiles_ptr, BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, LISTS, EARLY_Q,
                                CONSUMERS, OWN_BLOCKS, LANE_SUMS)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                         v_ready, v_empty, Hq, GROUP, Nk, offset, n_m, n_bh, n_tiles, starts_ptr, tiles_ptr,
                         BLOCK_M, BLOCK_N, HEAD_D, STAGES, CAUSAL, LISTS, CONSUMERS)),
        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
