"""Tile configs of the flash kernels: the autotune lists per (kernel, dtype class, padded head dim), the
autotuners built from them, and forced configs for tests and benchmarks.

A config is (BLOCK_M, BLOCK_N, num_warps, num_stages). fwd / dq: BLOCK_M query rows per program, BLOCK_N keys
per loop step; dkdv: BLOCK_N key rows per program, BLOCK_M queries per loop step. The first config of each list
is the default (the one launched when autotuning is off).
"""
from __future__ import annotations

import contextlib

import torch
import triton

from .. import _triton
from .backward import _attn_bwd_dkdv, _attn_bwd_dq, _attn_bwd_dq_out, _attn_bwd_prep
from .forward import _attn_fwd

MAX_HEAD_DIM = 256  # the largest padded head dim (BLOCK_D) the lists cover

INTERPRET_CONFIG = (64, 64, 4, 1)  # the interpreter pays per loop step: 64-row tiles (tests also force others)

GPU_CONFIGS = {
    # (kernel, dtype class, BLOCK_D) -> configs. The first of each list is the best or near-best on the
    # benchmark shapes (bench/NOTES.md); configs that never won there are not listed.
    ("fwd", "16", 64): [(128, 64, 8, 4), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 4, 3), (128, 64, 4, 3),
                        (64, 64, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3)],
    ("fwd", "16", 128): [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
                         (128, 32, 4, 4), (128, 128, 8, 3)],
    ("fwd", "16", 256): [(64, 32, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3)],
    ("dkdv", "16", 64): [(32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 4, 4), (32, 128, 8, 3), (16, 128, 4, 3),
                         (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2), (16, 64, 4, 3), (32, 64, 4, 4),
                         (16, 64, 4, 4)],
    ("dkdv", "16", 128): [(64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 3), (32, 64, 4, 4), (32, 64, 4, 2),
                          (16, 64, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3), (16, 128, 8, 3)],
    ("dkdv", "16", 256): [(32, 64, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2)],
    ("dq", "16", 64): [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 4), (64, 32, 4, 4),
                       (64, 128, 4, 3)],
    ("dq", "16", 128): [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3),
                        (64, 32, 4, 3)],
    ("dq", "16", 256): [(64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)],
    # float32 runs ieee dots on the CUDA cores: small tiles, accuracy path
    ("fwd", "32", 64): [(64, 32, 4, 2), (32, 32, 4, 2)],
    ("fwd", "32", 128): [(64, 32, 4, 2), (32, 32, 4, 2)],
    ("fwd", "32", 256): [(32, 32, 4, 1), (32, 16, 4, 2)],
    ("dkdv", "32", 64): [(32, 32, 4, 2), (16, 32, 4, 2)],
    ("dkdv", "32", 128): [(32, 32, 4, 2), (16, 32, 4, 2)],
    ("dkdv", "32", 256): [(16, 32, 8, 1), (16, 16, 4, 1)],
    ("dq", "32", 64): [(32, 32, 4, 2), (32, 16, 4, 2)],
    ("dq", "32", 128): [(32, 32, 4, 2), (32, 16, 4, 2)],
    ("dq", "32", 256): [(32, 16, 8, 1), (16, 16, 4, 1)],
}
# The fused backward: "dkdvq" is the dK/dV kernel that also adds dQ (its own autotuner, which zeroes the dQ
# accumulator before each trial), "prep" and "dqout" its two row-wise passes (one config each).
GPU_CONFIGS.update({("dkdvq", dcls, bd): list(cfgs) for (name, dcls, bd), cfgs in list(GPU_CONFIGS.items())
                    if name == "dkdv"})
GPU_CONFIGS.update({(name, dcls, bd): [(64 if bd < 256 else 32, 64, 4, 1)]
                    for name in ("prep", "dqout") for dcls in ("16", "32") for bd in (64, 128, 256)})

# The kernel each name launches (dkdvq: the dK/dV kernel with FUSED_DQ on).
KERNELS = {"fwd": _attn_fwd, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq, "dkdvq": _attn_bwd_dkdv,
           "prep": _attn_bwd_prep, "dqout": _attn_bwd_dq_out}


# Plain integer arithmetic: triton.next_power_of_2 is a constexpr-function wrapper costing microseconds per
# call, and these run several times per launch.
def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def block_d(head_dim: int) -> int:
    """The head dim a kernel is compiled for: a power of two >= 16 (the lanes past head_dim are masked)."""
    return max(16, next_pow2(head_dim))


def config_key(kernel: str, dtype: torch.dtype, padded_head_dim: int):
    return (kernel, "32" if dtype == torch.float32 else "16", max(64, padded_head_dim))


def gpu_configs(kernel: str, dtype: torch.dtype, head_dim: int) -> list[tuple[int, int, int, int]]:
    """The autotune list of one kernel ("fwd", "dkdv", "dq", "dkdvq") for a dtype and head dim (tests run them all)."""
    return list(GPU_CONFIGS[config_key(kernel, dtype, block_d(head_dim))])


def _as_config(c):
    return triton.Config({"BLOCK_M": c[0], "BLOCK_N": c[1]}, num_warps=c[2], num_stages=c[3])


def _tuners(kernels: dict) -> dict:
    """One autotuner per (kernel, dtype class, BLOCK_D) so each only tries the configs meant for it (none for a
    single config, or in the interpreter: those launch directly)."""
    out = {}
    for (name, dcls, bd), cfgs in GPU_CONFIGS.items():
        if _triton.INTERPRET or len(cfgs) == 1:
            continue
        key = ["HEAD_DIM", "CAUSAL", "TMA", "LPT", "q_bucket", "k_bucket"]  # + the tensor dtypes (triton)
        # dK/dV only, and the masking kernels only (newer Triton rejects key names that are not arguments)
        key += [arg for arg in ("GQA", "WINDOW", "VARLEN", "ROPE") if arg in kernels[name].arg_names]
        zero = ["DQACC"] if name == "dkdvq" else None  # each trial adds into it: start every one from zeros
        out[(name, dcls, bd)] = triton.autotune(configs=[_as_config(c) for c in cfgs], key=key,
                                                reset_to_zero=zero)(kernels[name])
    return out


TUNERS = _tuners(KERNELS)

forced: dict[str, tuple[int, int, int, int]] = {}  # kernel name -> config, set by forced_configs


@contextlib.contextmanager
def forced_configs(**cfgs):
    """Run with fixed tile configs, e.g. ``forced_configs(fwd=(64, 32, 4, 2), dq=..., dkdv=...)``.

    For tests (check every config of the autotune lists) and benchmarks; not thread-safe.
    """
    old = dict(forced)
    forced.update(cfgs)
    try:
        yield
    finally:
        forced.clear()
        forced.update(old)
