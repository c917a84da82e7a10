"""The HBM traffic of attention by the standard I/O model: how many bytes each algorithm must move.

Pure functions of the shape; no torch. Every count is for B·H (batch × heads) independent heads of length N
and head dim D, with ``elem`` bytes per element of Q, K, V, O, S, P and their gradients (2 for bf16/fp16, 4 for
fp32). Softmax statistics (the log-sum-exp L and delta = rowsum(dO ∘ O)) are float32: 4 bytes per row.
"Read" and "write" mean HBM (global memory) accesses; on-chip (SRAM/register) reuse is free.

Naive (standard) attention, per head — FlashAttention paper, Algorithms 0 and 3:

    forward   S = Q Kᵀ        read Q, K (2·N·D)     write S (N²)
              P = softmax(S)  read S (N²)           write P (N²)
              O = P V         read P (N²), V (N·D)  write O (N·D)
              total = 4·N² + 4·N·D elements
    backward  dV = Pᵀ dO           read P (N²), dO (N·D)    write dV (N·D)
              dP = dO Vᵀ           read dO, V (2·N·D)       write dP (N²)
              dS = P ∘ (dP − rowsum(dP ∘ P))   read P, dP (2·N²)   write dS (N²)
              dQ = dS K            read dS (N²), K (N·D)    write dQ (N·D)
              dK = dSᵀ Q           read dS (N²), Q (N·D)    write dK (N·D)
              total = 7·N² + 8·N·D elements

The N² terms dominate: naive traffic (and memory: S and P are kept) grows as N².

FlashAttention (FA2, as kernels/flash.py runs it), per head, with query tiles of Br rows and key
tiles of Bc rows (the kernel's BLOCK_M and BLOCK_N). Non-causal: every program streams the whole of K and V.

    forward   one program per query tile (Tr = ⌈N/Br⌉ programs):
              read Q once (N·D), read K and V once per query tile (Tr·2·N·D), write O (N·D) and L (4·N bytes)
              total = (2·N·D + 2·Tr·N·D)·elem + 4·N bytes
    backward  delta:  read O, dO (2·N·D)                                   write delta (4·N bytes)
              dK/dV:  one program per key tile (⌈N/Bc⌉): read K, V once (2·N·D); stream Q, dO (2·D per query
                      row) and L, delta (8 bytes per query row) over the query rows it sees; write dK, dV (2·N·D)
              dQ:     one program per query tile (⌈N/Br⌉): read Q, dO once (2·N·D) and L, delta (8·N bytes);
                      stream K, V (2·D per key row) over the key rows it sees; write dQ (N·D)

With a causal mask a program skips the key (or query) tiles that are fully hidden, so the streamed rows are
counted exactly by ``streamed_rows`` (about half, (T+1)/2 tiles instead of T). Flash traffic is
O(N²·D/Br): the N² term is divided by the tile height, and memory (O and L only) grows as N.

Bytes per head × B·H gives the totals below. The model counts compulsory traffic only: cache hits (L2) make
a real run move less, extra elementwise passes make it move more (see ``naive_impl_fwd_bytes``).
"""
from __future__ import annotations

import math

STAT_BYTES = 4  # float32 softmax statistics (log-sum-exp, delta)


def streamed_rows(n: int, outer: int, inner: int, causal: bool, *, keys_outer: bool = False) -> int:
    """Rows of the streamed operand read in total by all programs of one head.

    Programs own ``outer`` rows each (⌈n/outer⌉ programs) and stream the other operand in ``inner``-row
    blocks. Non-causal: every program streams all n rows. Causal, query-tile programs (forward, dQ): program i
    streams keys [0, min(n, ⌈min((i+1)·outer, n)/inner⌉·inner)). Causal, key-tile programs (dK/dV,
    ``keys_outer=True``): program j streams queries from ⌊j·outer/inner⌋·inner to n.
    """
    if n <= 0 or outer <= 0 or inner <= 0:
        raise ValueError(f"n, outer and inner must be positive, got {n}, {outer}, {inner}")
    programs = math.ceil(n / outer)
    if not causal:
        return programs * n
    total = 0
    for i in range(programs):
        if keys_outer:
            total += n - (i * outer // inner) * inner
        else:
            hi = min((i + 1) * outer, n)
            total += min(n, math.ceil(hi / inner) * inner)
    return total


def naive_fwd_bytes(B: int, H: int, N: int, D: int, elem: int) -> int:
    """Standard attention forward: read Q, K, V; write and read S; write and read P; write O."""
    return B * H * elem * (4 * N * N + 4 * N * D)


def naive_bwd_bytes(B: int, H: int, N: int, D: int, elem: int) -> int:
    """Standard attention backward from the saved P: dV, dP, dS, dQ, dK (7·N² + 8·N·D elements per head)."""
    return B * H * elem * (7 * N * N + 8 * N * D)


def flash_fwd_bytes(B: int, H: int, N: int, D: int, elem: int, *, block_m: int, block_n: int,
                    causal: bool = True) -> int:
    """FlashAttention forward: Q once, K and V once per query tile (causal: the visible tiles), O and L written."""
    kv_rows = streamed_rows(N, block_m, block_n, causal)
    per_head = elem * (N * D + 2 * kv_rows * D + N * D) + STAT_BYTES * N
    return B * H * per_head


def flash_bwd_bytes(B: int, H: int, N: int, D: int, elem: int, *, dq_tiles: tuple[int, int],
                    dkdv_tiles: tuple[int, int], causal: bool = True) -> int:
    """FlashAttention-2 backward: the delta, dK/dV and dQ kernels (see the module docstring).

    dq_tiles = (BLOCK_M query rows per program, BLOCK_N keys per step);
    dkdv_tiles = (BLOCK_M queries per step, BLOCK_N key rows per program), as in the kernel's config tuples.
    """
    delta = elem * 2 * N * D + STAT_BYTES * N
    q_rows = streamed_rows(N, dkdv_tiles[1], dkdv_tiles[0], causal, keys_outer=True)
    dkdv = elem * (2 * N * D + 2 * q_rows * D + 2 * N * D) + 2 * STAT_BYTES * q_rows
    k_rows = streamed_rows(N, dq_tiles[0], dq_tiles[1], causal)
    dq = elem * (2 * N * D + 2 * k_rows * D + N * D) + 2 * STAT_BYTES * N
    return B * H * (delta + dkdv + dq)


def naive_impl_fwd_bytes(B: int, H: int, N: int, D: int, elem: int, *, causal: bool = True) -> int:
    """kernels/naive.py's forward counted pass by pass (each PyTorch op is a separate kernel):

    S = Q Kᵀ (read Q, K; write S) → ·scale (read, write) → masked_fill (read S and the N×N bool mask, write;
    causal only) → .float() (read, write fp32; skipped when elem == 4) → softmax (read, write fp32) →
    .to(dtype) (read fp32, write; skipped when elem == 4) → P V (read P, V; write O).
    The mask is shared by all heads and counted once. Compare with ``naive_fwd_bytes`` (4·N² elements).
    """
    n2 = N * N
    per_head = elem * 2 * N * D + elem * n2          # S = Q Kᵀ
    per_head += 2 * elem * n2                        # scale
    if causal:
        per_head += 2 * elem * n2                    # masked_fill (mask counted below)
    if elem != 4:
        per_head += (elem + 4) * n2 * 2              # .float() and .to(dtype)
    per_head += 8 * n2                               # softmax in float32
    per_head += elem * n2 + elem * 2 * N * D         # P V: read P, V; write O
    return B * H * per_head + (n2 if causal else 0)


def naive_activation_bytes(B: int, H: int, N: int, D: int, elem: int) -> int:
    """Memory the standard naive forward holds above its inputs: S and P (N² each) and O."""
    return B * H * elem * (2 * N * N + N * D)


def flash_activation_bytes(B: int, H: int, N: int, D: int, elem: int) -> int:
    """Memory the flash forward holds above its inputs: O and the log-sum-exp L (float32)."""
    return B * H * (elem * N * D + STAT_BYTES * N)


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
