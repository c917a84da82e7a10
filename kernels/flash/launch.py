"""Host side of the flash kernels: from validated tensors to launches.

    _fwd(q, k, v, causal, sm_scale, window=0, docs=None) -> (o, lse)
    _bwd(do, q, k, v, o, lse, causal, sm_scale, window=0, docs=None, out=None, rope=None) -> (dq, dk, dv)
    _dq_into(do, q, k, v, o, lse, dq, delta, causal, sm_scale) -> None   the dQ kernel alone (and delta), for
                                                                        the Gluon dK/dV backward
    _packed_fwd(qkv, n_head, n_kv_head, causal, sm_scale, window=0, docs=None) -> (o, lse)
    _packed_bwd(do, qkv, o, lse, n_head, n_kv_head, causal, sm_scale, window=0, docs=None, rope=None) -> d(qkv)
    _packed_rope_fwd(qkv, cos, sin, n_head, n_kv_head, causal, sm_scale, window=0, docs=None)
        -> (o, lse, rotated qkv)

window > 0: the sliding window (WINDOW, a constexpr: one compiled kernel per window size); docs: the (B, 2, N)
int32 document bounds (VARLEN), the kernels' DOCS argument. Without documents DOCS is None, which Triton compiles
as a constant: the kernels without a window or documents have exactly the signature and code they have without
these options. rope = (cos, sin): q and k were rotated by RoPE before the forward (_packed_rope_fwd: one pass of
kernels/rope.py), and the backward returns the gradient w.r.t. the projection before the rotation: the dQ and
dK kernels store their tiles rotated back (ROPE) where the head dim is a power of two >= 16, otherwise one
rotation pass over d(qkv) follows them.

What it decides per call: the outputs' memory layout (that of the inputs), the load path (TMA descriptors or
pointers), the grid order (per head, or longest-first), the backward's structure, the tile config (forced,
autotuned or the default). Three caches keep repeated calls cheap on the host: the autotuner's pick per key
(_picked), Triton's compiled kernel per launch signature, called through its launcher directly (_compiled, the
"fast launcher"), and a launch plan per input signature (_plans: everything above, recorded once and
replayed). Every decision reads kernels.options (one object per call); the plans are keyed by it, so a
change of options never replays a plan recorded under other options.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _triton
from .. import flash_hopper as _hopper
from ..flash_hopper import backward_launch as _hopper_bwd_launch
from .. import options as _options
from .. import rope as _rope
from ..naive import split_qkv
from .configs import (GPU_CONFIGS, INTERPRET_CONFIG, KERNELS, MAX_HEAD_DIM, TUNERS, block_d, config_key, forced,
                      next_pow2)

# ----------------------------------------------------------------------------------------------------------
# Output buffers
# ----------------------------------------------------------------------------------------------------------


def _bucket(n: int) -> int:
    """Power-of-two length bucket for the autotune key (so every new length does not re-tune)."""
    return min(next_pow2(n), 1 << 16)


def _memory_order(t: torch.Tensor) -> list[int]:
    """t's dims from outermost to innermost in memory (stride-0 broadcast dims count as outermost)."""
    return sorted(range(4), key=lambda i: (-(t.stride(i) or 2**62), i))


def _layout(t: torch.Tensor) -> tuple[tuple, tuple]:
    """(shape in memory order, permutation back to (B, H, N, D)) of a buffer laid out like t.

    A model hands q, k, v as (B, N, H, D) memory seen as (B, H, N, D); returning O and dQ/dK/dV in that same
    order makes the model's `y.transpose(1, 2).contiguous()` (and the gradients' way back) free instead of a
    copy, as with PyTorch's SDPA. The head dim stays innermost; ties keep the (B, H, N, D) order.
    """
    order = _memory_order(t) if t.stride(3) == 1 else [0, 1, 2, 3]
    return tuple(t.shape[i] for i in order), tuple(order.index(i) for i in range(4))


def _empty_like_layout(layout, dtype, device) -> torch.Tensor:
    shape, perm = layout
    return _triton.empty(shape, dtype, device).permute(*perm)


# ----------------------------------------------------------------------------------------------------------
# Load path, grid order, backward structure
# ----------------------------------------------------------------------------------------------------------

_TRITON_HAS_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")
_TRITON_HAS_DESC_REDUCE = _TRITON_HAS_DESCRIPTORS and hasattr(tl.core.tensor_descriptor_base, "atomic_add")


_hopper_or_newer = _triton.hopper_or_newer  # a name of this module's own, which tests replace


def _tma_available(device: torch.device, opts: _options.KernelOptions) -> bool:
    """Triton with on-device tensor descriptors, on a Hopper-or-newer GPU (or the interpreter), and the tma
    option on."""
    if not _TRITON_HAS_DESCRIPTORS or not opts.tma:
        return False
    return _triton.INTERPRET or _hopper_or_newer(torch.device(device).index or 0)


# The padded head dim (BLOCK_D) from which each kernel reads through TMA descriptors (_NEVER: pointers only).
# At BLOCK_D = 128 descriptors take fewer registers than pointer tiles, which made the dK/dV kernel faster and
# the forward and dQ kernels slower; at 64 all were slower or even (bench/NOTES.md, "TMA"). The
# tma_min_block_d option replaces all three.
_NEVER = MAX_HEAD_DIM * 2
TMA_MIN_BLOCK_D = {"fwd": _NEVER, "dq": _NEVER, "dkdv": 128}


def _tma_ok(kernel: str, opts: _options.KernelOptions, *tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can and should read these (B, H, N, D) tensors in `kernel`: head dim padded to at
    least the kernel's TMA_MIN_BLOCK_D (the interpreter: any), unit stride along D, and every head's start and
    row stride a multiple of 16 bytes (a copy is never made to get there: otherwise pointer loads)."""
    min_d = TMA_MIN_BLOCK_D[kernel] if opts.tma_min_block_d is None else opts.tma_min_block_d
    if block_d(tensors[0].shape[-1]) < min_d and not _triton.INTERPRET:
        return False
    if not _tma_available(tensors[0].device, opts):
        return False
    for t in tensors:
        size = t.element_size()
        sb, sh, sn, sd = t.stride()
        if sd != 1 or sn <= 0 or (sn * size) % 16 or (sb * size) % 16 or (sh * size) % 16 or t.data_ptr() % 16:
            return False
    return True


# Causal grids in longest-first order (blocks._lpt_tile), in groups of heads whose streamed tiles stay in L2:
# the budget is about half of a Hopper GPU's 50 MB L2. Used only when a group holds at least LPT_MIN_GROUP
# (batch, head) pairs: with fewer (long sequences, wide heads) the order lost more than it gained
# (bench/NOTES.md, "LPT").
LPT_L2_BYTES = 24 << 20
LPT_MIN_GROUP = 8


def _lpt(causal: bool, group: int, opts: _options.KernelOptions) -> bool:
    return bool(causal) and group >= LPT_MIN_GROUP and opts.lpt


def _lpt_group(t: torch.Tensor, rows: int, heads: int) -> int:
    """How many (batch, head) pairs one LPT group holds: a program streams `rows` rows of two tensors like t
    (K and V, or Q and dO) per head; the group's share fits LPT_L2_BYTES."""
    per_head = 2 * rows * t.shape[-1] * t.element_size()
    return max(1, min(heads, LPT_L2_BYTES // per_head))


# The fused dK/dV kernel's dQ accumulation (FUSED_DQ): 2 = one TMA reduce-add per tile (cp.reduce.async.bulk:
# the tile goes through shared memory, the adds happen in L2) where Triton has descriptor reductions and the GPU
# has TMA (the tma option off turns it off); 1 = element atomic adds (older GPUs and Triton, the interpreter,
# which has no descriptor reductions).
def _fused_dq_mode(device: torch.device, opts: _options.KernelOptions) -> int:
    if (opts.fused_dq == 2 and not _triton.INTERPRET and _TRITON_HAS_DESC_REDUCE
            and _tma_available(device, opts)):
        return 2
    return 1


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


# ----------------------------------------------------------------------------------------------------------
# Launching one kernel
# ----------------------------------------------------------------------------------------------------------

_picked: dict[tuple, tuple[int, int, int, int]] = {}  # autotuner's choice per key, reused without the tuner


def _autotune_enabled() -> bool:
    return not _triton.INTERPRET and _options.get().autotune


def _tma_scratch(size: int, alignment: int, stream):
    """Global scratch for the descriptors the kernels build on the device (128 bytes per descriptor)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")  # the current device: _launch runs under its guard


def _grid(name: str, length: int, heads: int, batch: int, lpt: bool, block_m: int, block_n: int):
    """(blocks, heads, batch), or the same count in 1-D for the LPT order; fwd/dq tile queries, dkdv keys."""
    blocks = -(-length // (block_n if name in ("dkdv", "dkdvq") else block_m))  # ceil
    return (blocks * heads * batch,) if lpt else (blocks, heads, batch)


# Triton's compiled kernel per launch signature, so that a repeated launch calls its launcher directly and skips
# JITFunction.run's per-call work (binding and specialising ~45 arguments, building its cache key: microseconds
# of host time per launch, which the GPU waits for where a training step starts). With the fast_launch option
# off, every launch goes through JITFunction.run.
_compiled: dict[tuple, object] = {}
_COMPILED_MAX = 4096  # signatures kept (one per distinct shape/stride set); the cache starts over beyond it
# Tensors lead the arguments (DOCS, the last of them in fwd, dq and dk/dv, may be None).
_N_TENSOR_ARGS = {"fwd": 6, "dq": 11, "dkdv": 12, "dkdvq": 12, "prep": 4, "dqout": 4}


def _tensor_sig(t):
    return None if t is None else (t.dtype, t.data_ptr() % 16 == 0)


def _fast_launch() -> bool:
    return _options.get().fast_launch and not _triton.INTERPRET


def _run(name: str, grid: tuple, cfg, args, kwargs):
    """Launch the plain kernel `name` with tile config cfg (the cached compiled kernel when there is one).
    Returns the compiled kernel that later launches of this signature can call directly (_triton.launch_compiled),
    or None (direct launches off, or not cacheable).

    The cache key is stricter than Triton's specialisation: the tensors' dtypes and 16-byte alignment (what
    Triton specialises a pointer on) and every other argument by value, so a hit always has the signature the
    kernel was compiled for."""
    bm, bn, warps, stages = cfg
    if not _fast_launch():
        KERNELS[name][grid](*args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        return None
    n = _N_TENSOR_ARGS[name]
    key = (name, cfg, args[0].device.index, *kwargs.values(), *args[n:], *[_tensor_sig(t) for t in args[:n]])
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = KERNELS[name][grid](*args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        # the launcher takes every parameter in the kernel's order: the positional args, then the constexprs
        if (hasattr(kernel, "run") and list(KERNELS[name].arg_names[len(args):]) == [*kwargs, "BLOCK_M", "BLOCK_N"]
                and all((isinstance(a, torch.Tensor) or (a is None and i < n)) == (i < n)
                        for i, a in enumerate(args))):
            if len(_compiled) >= _COMPILED_MAX:
                _compiled.clear()
            _compiled[key] = kernel
            return kernel
        return None
    _triton.launch_compiled(kernel, grid, (*args, *kwargs.values(), bm, bn))
    return kernel


def _uses_descriptors(kwargs: dict) -> bool:
    """Whether the launch builds tensor descriptors on the device (then Triton needs its scratch allocator)."""
    return bool(kwargs.get("TMA")) or kwargs.get("FUSED_DQ") == 2


def _exec(name: str, grid: tuple, cfg, args, kwargs):
    if _uses_descriptors(kwargs) and not _triton.INTERPRET:
        triton.set_allocator(_tma_scratch)  # a context variable: set per launch (autograd runs in its own thread)
    return _run(name, grid, cfg, args, kwargs)


def _launch(name: str, grid_axis0_len: int, heads: int, batch: int, dtype, args, kwargs):
    """Launch kernel `name` with a forced config, the autotuner, or the default config. Returns (grid, config,
    compiled kernel or None: see _run) of a launch with a fixed config, None after the autotuner's first run for
    its key."""
    cfgs = GPU_CONFIGS[config_key(name, dtype, kwargs["BLOCK_D"])]
    short = args[-1] < _options.get().autotune_min_keys  # the key-length bucket (the last arg)
    if name in forced or _triton.INTERPRET or not _autotune_enabled() or len(cfgs) == 1 or short:
        if name in forced:
            cfg = forced[name]
        elif _triton.INTERPRET:
            cfg = INTERPRET_CONFIG
        else:
            cfg = cfgs[0]
    else:
        # after the autotuner has picked a config for this key, launch the plain kernel with it directly
        # (skips the autotuner's per-call bookkeeping: ~tens of microseconds of CPU per launch)
        tkey = (name, dtype, kwargs["HEAD_DIM"], kwargs["CAUSAL"], kwargs["TMA"], kwargs["LPT"], kwargs.get("GQA"),
                kwargs.get("FUSED_DQ"), kwargs.get("WINDOW"), kwargs.get("VARLEN"), kwargs.get("ROPE"), args[-2],
                args[-1], args[0].device.index)  # the buckets are the last two args
        cfg = _picked.get(tkey)
        if cfg is None:
            grid = lambda meta: _grid(name, grid_axis0_len, heads, batch, kwargs["LPT"],  # noqa: E731
                                      meta["BLOCK_M"], meta["BLOCK_N"])
            if _uses_descriptors(kwargs):
                triton.set_allocator(_tma_scratch)
            tuner = TUNERS[config_key(name, dtype, kwargs["BLOCK_D"])]
            tuner.cache_results = _options.get().autotune_cache  # timings kept in Triton's cache folder
            tuner[grid](*args, **kwargs)
            best = tuner.best_config
            _picked[tkey] = (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps, best.num_stages)
            return None
    grid = _grid(name, grid_axis0_len, heads, batch, kwargs.get("LPT", False), cfg[0], cfg[1])
    return grid, cfg, _exec(name, grid, cfg, args, kwargs)


# ----------------------------------------------------------------------------------------------------------
# Launch plans
# ----------------------------------------------------------------------------------------------------------
# What _fwd and _bwd compute on the host (output layouts, grids, tile configs, the stride and scalar arguments,
# the constexprs, the compiled kernels) depends only on the inputs' shapes, strides, dtypes, device and 16-byte
# alignment, the mask and scale, the kernel options and the forced configs. The first call with such a
# signature records a plan; later calls allocate the outputs and launch from it. Nothing is recorded from the
# autotuner's first run for a key (its launch is not a fixed one).
_plans: dict[tuple, tuple] = {}
_PLANS_MAX = 4096


def _plan_key(kind: str, opts: _options.KernelOptions, tensors, *scalars) -> tuple | None:
    return (kind, *scalars, opts,
            *sorted(forced.items()),  # a plan replays the configs it was recorded with
            *TMA_MIN_BLOCK_D.values(), LPT_MIN_GROUP,
            *[(t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors])


def _masked(kind: str, window: int, docs, rope=None) -> str:
    """The plan kind of a call with a window, documents or RoPE tables ("bwd" → "bwd/window=8/docs/rope");
    plain calls keep theirs. (The documents' and the tables' tensors also end the key's tensors.)"""
    return (kind + (f"/window={window}" if window else "") + ("/docs" if docs is not None else "")
            + ("/rope" if rope is not None else ""))


def _planned(name: str, launched, idx: tuple, tail: tuple, kwargs: dict):
    """A plan's record of one launch (None when _launch gave none): the kernel, grid, config, compiled kernel,
    the indices of its tensors in the replay's pool, the other arguments, the constexprs, and (with a compiled
    kernel) everything after the tensors as its launcher takes it."""
    if launched is None:
        return None
    grid, cfg, kernel = launched
    after = None if kernel is None else (*tail, *kwargs.values(), cfg[0], cfg[1])
    return name, grid, cfg, kernel, idx, tail, kwargs, after


def _record(key, plan) -> None:
    if key is not None and all(launch is not None for launch in plan[-1]):
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        _plans[key] = plan


def _replay(launches, pool, like: torch.Tensor) -> None:
    """Run a plan's launches on the tensors (or, for compiled kernels only, integer addresses) in pool."""
    with _triton.device_guard(like):
        for name, grid, cfg, kernel, idx, tail, kwargs, after in launches:
            if kernel is None:
                _exec(name, grid, cfg, (*[pool[i] for i in idx], *tail), kwargs)
                continue
            if _uses_descriptors(kwargs):
                triton.set_allocator(_tma_scratch)
            _triton.launch_compiled(kernel, grid, (*[pool[i] for i in idx], *after))


# ----------------------------------------------------------------------------------------------------------
# Forward and backward of q, k, v
# ----------------------------------------------------------------------------------------------------------


def _with_docs(tensors: tuple, docs, rope=None) -> tuple:
    return (*tensors, *(() if docs is None else (docs,)), *(rope or ()))


def _hopper_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float):
    """The Gluon forward (kernels/flash_hopper) into outputs laid out as the tl forward's."""
    B, Hq, Nq, _ = q.shape
    o = _empty_like_layout(_layout(q), q.dtype, q.device)  # (B, Hq, Nq, D), laid out like q
    lse = _triton.empty((B, Hq, Nq), torch.float32, q.device)
    with _triton.device_guard(q):
        _hopper.launch.forward_into(q, k, v, o, lse, causal, sm_scale)
    return o, lse


# hopper_forward = "auto" sends the forward to the Gluon kernel only where the H200 timed it faster than the tl
# forward (bench/results/flash_hopper/tile_lists/: 1.17-1.43x at head dim 128 with 1024 to 16384 tokens, causal
# or not, every shape with 262,144 query rows in all; tile_lists/call_eb068b8/: through the model's call too);
# at head dim 64 with a causal mask the two are level below 4096 tokens (0.99-1.01x, tile_lists/early_q/,
# three_consumers/), which stay with the tl kernel, and from 4096 the Gluon kernel is 0.99-1.01x at 4096 and
# 1.03-1.05x at 16384 (three_consumers/, poly_exp2/); without a causal mask its three consumer warpgroups are
# 1.07-1.10x the tl forward at 2048 to 16384 tokens (three_consumers/own_blocks/), from 2048.
# Below 4096 tokens it also takes as many query rows (B * Hq * Nq) as measured: a
# smaller call's kernel is shorter than the Gluon launch's host time (0.12-0.26 ms per call against 0.06-0.07 for
# the tl launch, tile_lists/call_eb068b8/), so there the host would decide and the tl call's is the shorter.
HOPPER_AUTO_HEAD_DIM = 128
HOPPER_AUTO_MIN_LEN = 1024
HOPPER_AUTO_D64_MIN_LEN = 2048  # head dim 64, not causal
HOPPER_AUTO_LONG_LEN = 4096  # from here any batch and head count (as before the shorter lengths were measured)
HOPPER_AUTO_MIN_ROWS = 16 * 16 * 1024  # below HOPPER_AUTO_LONG_LEN: B * Hq * Nq at least the measured shapes'


def _hopper_auto(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """The shape rule of hopper_forward = "auto" (q: (B, Hq, Nq, D), k: (B, Hkv, Nk, D))."""
    length = min(q.shape[-2], k.shape[-2])
    if q.shape[-1] == HOPPER_AUTO_HEAD_DIM:
        min_len = HOPPER_AUTO_MIN_LEN
    elif q.shape[-1] == 64:
        min_len = HOPPER_AUTO_LONG_LEN if causal else HOPPER_AUTO_D64_MIN_LEN
    else:
        return False
    return length >= min_len and (length >= HOPPER_AUTO_LONG_LEN
                                  or q.shape[0] * q.shape[1] * q.shape[2] >= HOPPER_AUTO_MIN_ROWS)


def _hopper_takes(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, docs,
                  causal: bool = True) -> bool:
    """Whether the forward goes to the Gluon kernel under hopper_forward = mode ("auto" | "on" | "off"). The
    shape test comes first: the other inputs of "auto" cost no more host time than "off"."""
    if mode == "off" or (mode == "auto" and not _hopper_auto(q, k, causal)):
        return False
    return _hopper.unsupported(q, k, v, window, docs) is None


# hopper_backward = "auto" sends the backward to the Gluon kernel's fused form (dQ added by TMA reduce-adds) where
# it was timed faster than the tl backward. With each step's lse and delta through the producer's TMA (Nq a
# multiple of 4), on an H100 (bench/results/flash_hopper/backward/rows_through_tma/): head dim 128 from 2048 tokens,
# causal or not (1.10-1.26x); head dim 64 not causal from 4096 (1.05-1.09x) and causal at 16384 (1.09x; level at
# 4096, slower at 1024 and 2048). With the causal grid's last heads dealt (backward_launch.TAIL_ROUNDS) head dim 64
# causal from 8192 (1.06-1.14x at 2,16,8192; level at 4096: bench/results/flash_hopper/backward/tail_dealt_d64/);
# with form 4 (HOPPER_BWD_FORM) from 4096: 1.06-1.07x tl there, 1.09-1.11x at 8192 and 1.06x at 16384 on the H200
# (bench/results/flash_hopper/backward/lagged_dq_h200/); 1.00-1.03x tl at 4096 on one H100 (lagged_dq_h100/).
# Without it (other Nq), head dim 128 not causal from 4096 tokens (1.08-1.20x on
# the H200, bench/results/flash_hopper/fused_backward/). The tl backward keeps the rest.
HOPPER_BWD_AUTO_MIN_LEN = {  # (head dim, causal): the shortest min(Nq, Nk) the Gluon backward takes
    True: {(128, False): 2048, (128, True): 2048, (64, False): 4096, (64, True): 4096},  # rows through TMA
    False: {(128, False): 4096},  # rows loaded by the consumers
}


# The fused form the Gluon backward runs per (head dim, causal). Head dim 128 causal: 5 (each step's dK matmul
# issued after its dQ matmuls), timed faster than form 3 in all of three runs on one H100, either form first, by
# 1.1-3.3 % at 2048-16384 tokens (bench/results/flash_hopper/backward/dk_after_dq/), and shorter than form 4 in
# five of six pairs at 4096-16384 tokens on one H100 (lagged_dq_h100/); 128 without a mask: 3. Head
# dim 64, where each step's dQ one step behind lets the two warpgroups run out of lockstep: causal 4 (its dK
# matmul before the previous step's dQ), 5.0-6.4 % shorter than form 3 at 4096-16384 tokens and 1.0-1.6 % shorter
# than form 6 in every pair; without a mask 6 (form 4 with 5's order inside the step), 4.6-5.4 % shorter than
# form 5 in three runs on the H200 in changing orders, level with form 4 (-0.5 to +1.2 %)
# (bench/results/flash_hopper/backward/lagged_dq_h200/; the same order of forms on one H100: lagged_dq_h100/).
# At the d64 ring depths taken since (4 causal, 5 without a mask: backward_launch.default_stages) the order holds
# on one H100: causal form 4 0.948 / 0.952 ms against form 6's 0.957 / 0.966 at 4,16,4096, without a mask form 6
# 1.686 / 1.684 against form 4's 1.715 / 1.714 (bench/results/flash_hopper/backward/stages_d64_h100/sweep/).
HOPPER_BWD_FORM = {(128, True): 5, (64, True): 4, (64, False): 6}


def hopper_bwd_form(head_dim: int, causal: bool) -> int:
    """The fused form (_hopper_bwd's fused=) kernels.flash_attention's backward runs on the Gluon kernel."""
    return HOPPER_BWD_FORM.get((int(head_dim), bool(causal)), 3)


def _hopper_bwd_auto(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """Whether hopper_backward = "auto" gives these shapes to the Gluon backward (HOPPER_BWD_AUTO_MIN_LEN)."""
    rows_tma = _hopper_bwd_launch.rows_through_tma_for(q.shape[-2])
    min_len = HOPPER_BWD_AUTO_MIN_LEN[rows_tma].get((q.shape[-1], bool(causal)))
    return min_len is not None and min(q.shape[-2], k.shape[-2]) >= min_len


def _hopper_bwd_takes(mode: str, do, q, k, v, o, causal: bool, window: int, docs, rope, out) -> bool:
    """Whether the backward goes to the Gluon kernel under hopper_backward = mode ("auto" | "on" | "off"): no
    window, documents or RoPE tables, inputs (and out's dk, dv) the kernel takes."""
    if mode == "off" or window or docs is not None or rope is not None:
        return False
    if mode == "auto" and not _hopper_bwd_auto(q, k, causal):
        return False
    if _hopper_bwd_launch.unsupported_backward(do, q, k, v, o) is not None:
        return False
    return out is None or all(_hopper.launch._tma_ok(t) for t in out[1:])


def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float, window: int = 0,
         docs: torch.Tensor | None = None):
    """Launch the forward. Returns O (B, Hq, Nq, D) in q's dtype and lse (B, Hq, Nq) fp32 (base 2, scaled).
    Inputs that the hopper_forward option gives to the Gluon kernel go to it instead of the tl kernel."""
    opts = _options.get()
    if _hopper_takes(opts.hopper_forward, q, k, v, window, docs, causal):
        return _hopper_fwd(q, k, v, causal, sm_scale)
    key = _plan_key(_masked("fwd", window, docs), opts, _with_docs((q, k, v), docs), causal, sm_scale)
    plan = _plans.get(key)
    if plan is not None:
        o_layout, lse_shape, launches = plan
        o = _empty_like_layout(o_layout, q.dtype, q.device)
        lse = _triton.empty(lse_shape, torch.float32, q.device)
        _replay(launches, (q, k, v, o, lse, docs), q)
        return o, lse
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    o_layout = _layout(q)
    o = _empty_like_layout(o_layout, q.dtype, q.device)  # (B, Hq, Nq, D), laid out like q
    lse = _triton.empty((B, Hq, Nq), torch.float32, q.device)
    group = _lpt_group(k, Nk, B * Hq)
    args = (q, k, v, o, lse, docs, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            Hq, Hq // Hkv, Nq, Nk, Nk - Nq, sm_scale * _triton.LOG2E, group, _bucket(Nq), _bucket(Nk))
    kwargs = dict(HEAD_DIM=D, BLOCK_D=block_d(D), CAUSAL=bool(causal), DOT_PRECISION=_dot_precision(q.dtype),
                  TMA=_tma_ok("fwd", opts, k, v), LPT=_lpt(causal, group, opts), WINDOW=int(window),
                  VARLEN=docs is not None)
    with _triton.device_guard(q):
        launched = _launch("fwd", Nq, Hq, B, q.dtype, args, kwargs)
    _record(key, (o_layout, (B, Hq, Nq), [_planned("fwd", launched, range(6), args[6:], kwargs)]))
    return o, lse


def _bwd(do, q, k, v, o, lse, causal: bool, sm_scale: float, window: int = 0, docs: torch.Tensor | None = None,
         out=None, rope=None):
    """Launch the backward (the backward option: "split": dQ, which also stores delta, then dK/dV; "fused":
    delta pass, dK/dV adding dQ, dQ pass). Returns dq, dk, dv shaped like q, k, v, written into `out` =
    (dq, dk, dv) when given (views of one packed gradient), else new buffers. rope = (cos, sin) (contiguous
    (N, D) or (B, N, D) tables; Nq = Nk = N, D a power of two >= 16): q and k are RoPE-rotated, and dq, dk
    come back rotated back (the ROPE kernels)."""
    opts = _options.get()
    if _hopper_bwd_takes(opts.hopper_backward, do, q, k, v, o, causal, window, docs, rope, out):
        with _triton.device_guard(q):  # (no launch plan: the Gluon launch builds its TMA descriptors per call)
            return _hopper_bwd(do, q, k, v, o, lse, causal, sm_scale, fused=hopper_bwd_form(q.shape[-1], causal),
                               out=out)
    key = _plan_key(_masked("bwd", window, docs, rope), opts,
                    _with_docs((do, q, k, v, o, lse, *(out or ())), docs, rope), causal, sm_scale)
    cos, sin = rope or (None, None)
    plan = _plans.get(key)
    if plan is not None:
        delta_shape, layouts, acc_shape, launches = plan
        delta = _triton.empty(delta_shape, torch.float32, q.device)
        acc = delta if acc_shape is None else _triton.empty(acc_shape, torch.float32, q.device)
        dq, dk, dv = out or [_empty_like_layout(lay, q.dtype, q.device) for lay in layouts]
        _replay(launches, (q, k, v, o, do, lse, delta, dq, dk, dv, acc, docs, cos, sin), q)
        return dq, dk, dv
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    BLOCK_D = block_d(D)
    fused = opts.backward == "fused"
    delta = _triton.empty((B, Hq, Nq), torch.float32, q.device)
    acc_shape = (B, Hq, Nq, BLOCK_D) if fused else None
    acc = delta if acc_shape is None else _triton.empty(acc_shape, torch.float32, q.device)  # fused: dQ accumulator
    layouts = None
    if out is None:
        layouts = [_layout(t) for t in (q, k, v)]
        dq, dk, dv = [_empty_like_layout(lay, q.dtype, q.device) for lay in layouts]  # laid out like q, k, v
    else:
        dq, dk, dv = out
    kwargs = dict(HEAD_DIM=D, BLOCK_D=BLOCK_D, CAUSAL=bool(causal), DOT_PRECISION=_dot_precision(q.dtype))
    masks = dict(WINDOW=int(window), VARLEN=docs is not None, ROPE=rope is not None)  # the last constexprs
    tables = _table_strides(cos)
    dkdv_group = _lpt_group(q, Nq * (Hq // Hkv), B * Hkv)
    qk_scale = sm_scale * _triton.LOG2E
    dkdv_args = (q, k, v, do, lse, delta, dk, dv, acc, docs, cos, sin, *q.stride(), *k.stride(), *v.stride(),
                 *do.stride(), *dk.stride(), *dv.stride(), *tables, Hq, Hkv, Hq // Hkv, Nq, Nk, Nk - Nq, qk_scale,
                 sm_scale, dkdv_group, _bucket(Nq), _bucket(Nk))
    dkdv_kwargs = dict(kwargs, TMA=_tma_ok("dkdv", opts, q, do), LPT=_lpt(causal, dkdv_group, opts), GQA=Hq > Hkv,
                       FUSED_DQ=_fused_dq_mode(q.device, opts) if fused else 0, **masks)
    # pool order of a replay: q, k, v, o, do, lse, delta, dq, dk, dv, acc (= delta when not fused), docs, cos, sin
    dkdv_idx = (0, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13)
    if fused:
        rows = dict(HEAD_DIM=D, BLOCK_D=BLOCK_D)
        prep_args = (o, do, delta, acc, *o.stride(), *do.stride(), Hq, Nq)
        out_args = (acc, dq, cos, sin, *dq.stride(), *tables, Hq, Nq, sm_scale)
        out_kwargs = dict(rows, ROPE=rope is not None)
        with _triton.device_guard(q):
            launched = [_launch("prep", Nq, Hq, B, q.dtype, prep_args, rows),
                        _launch("dkdvq", Nk, Hkv, B, q.dtype, dkdv_args, dkdv_kwargs),
                        _launch("dqout", Nq, Hq, B, q.dtype, out_args, out_kwargs)]
        launches = [_planned("prep", launched[0], (3, 4, 6, 10), prep_args[4:], rows),
                    _planned("dkdvq", launched[1], dkdv_idx, dkdv_args[12:], dkdv_kwargs),
                    _planned("dqout", launched[2], (10, 7, 12, 13), out_args[4:], out_kwargs)]
    else:
        dq_args, dq_kwargs = _dq_launch_args(do, q, k, v, o, lse, dq, delta, causal, sm_scale, opts, window, docs,
                                             rope)
        with _triton.device_guard(q):
            dq_launch = _launch("dq", Nq, Hq, B, q.dtype, dq_args, dq_kwargs)
            dkdv_launch = _launch("dkdv", Nk, Hkv, B, q.dtype, dkdv_args, dkdv_kwargs)  # after dQ: reads its delta
        launches = [_planned("dq", dq_launch, (0, 1, 2, 3, 4, 5, 6, 7, 11, 12, 13), dq_args[11:], dq_kwargs),
                    _planned("dkdv", dkdv_launch, dkdv_idx, dkdv_args[12:], dkdv_kwargs)]
    _record(key, ((B, Hq, Nq), layouts, acc_shape, launches))
    return dq, dk, dv


def _table_strides(cos: torch.Tensor | None) -> tuple[int, int]:
    """RoPE tables' (batch, row) strides as the backward kernels take them: (0, 0) without tables."""
    return (0, 0) if cos is None else (cos.stride(0) if cos.dim() == 3 else 0, cos.stride(-2))


def _dq_launch_args(do, q, k, v, o, lse, dq, delta, causal: bool, sm_scale: float, opts, window: int = 0,
                    docs=None, rope=None) -> tuple[tuple, dict]:
    """The dQ kernel's arguments and constexprs for _launch("dq", ...): dQ into dq and delta = rowsum(dO * O)
    into delta ((B, Hq, Nq) float32, contiguous). The arguments are _bwd's."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    cos, sin = rope or (None, None)
    group = _lpt_group(k, Nk, B * Hq)
    args = (q, k, v, o, do, lse, delta, dq, docs, cos, sin, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            *do.stride(), *dq.stride(), *_table_strides(cos), Hq, Hq // Hkv, Nq, Nk, Nk - Nq,
            sm_scale * _triton.LOG2E, sm_scale, group, _bucket(Nq), _bucket(Nk))
    kwargs = dict(HEAD_DIM=D, BLOCK_D=block_d(D), CAUSAL=bool(causal), DOT_PRECISION=_dot_precision(q.dtype),
                  TMA=_tma_ok("dq", opts, k, v), LPT=_lpt(causal, group, opts),
                  WINDOW=int(window), VARLEN=docs is not None, ROPE=rope is not None)  # the last constexprs
    return args, kwargs


def _hopper_bwd(do, q, k, v, o, lse, causal: bool = True, sm_scale: float | None = None, stages: int | None = None,
                ahead: bool | None = None, fused: int = 0, out=None):
    """The backward through the Gluon dK/dV kernel (kernels/flash_hopper/backward_launch.py) on inputs it takes
    (a ValueError naming the reason otherwise): dq, dk, dv laid out like q, k, v, or written into out =
    (dq, dk, dv) when given (views of one packed gradient). fused (the kernel's dq_mode; 0: not): the kernel
    computes dQ too, into an fp32 accumulator between the fused backward's delta-and-zeroing pass and its dQ
    conversion, instead of the tl dQ kernel running first; 3 (TMA reduce-adds) is the fastest form and what
    _bwd runs (bench/results/flash_hopper/fused_backward/). stages, ahead: dkdv_into's. No launch plan."""
    scale = _hopper_bwd_launch.checked_scale(do, q, k, v, o, lse, sm_scale)
    B, Hq, Nq, D = q.shape
    if out is None:
        dq, dk, dv = (_empty_like_layout(_layout(t), q.dtype, q.device) for t in (q, k, v))
    else:  # views of one packed gradient (dk, dv TMA-aligned: dkdv_into checks)
        dq, dk, dv = out
    delta = _triton.empty((B, Hq, Nq), torch.float32, q.device)
    with _triton.device_guard(q):
        if fused:
            acc = _triton.empty((B, Hq, Nq, D), torch.float32, q.device)  # dQ, summed in fp32 by the kernel
            rows = dict(HEAD_DIM=D, BLOCK_D=D)
            _launch("prep", Nq, Hq, B, q.dtype, (o, do, delta, acc, *o.stride(), *do.stride(), Hq, Nq), rows)
            _hopper_bwd_launch.dkdv_into(do, q, k, v, lse, delta, dk, dv, causal, scale, stages, ahead, dqacc=acc,
                                         dq_mode=int(fused))
            _launch("dqout", Nq, Hq, B, q.dtype, (acc, dq, None, None, *dq.stride(), *_table_strides(None), Hq, Nq,
                                                  scale), dict(rows, ROPE=False))
        else:
            _dq_into(do, q, k, v, o, lse, dq, delta, causal, scale)  # dQ, and delta for the dK/dV kernel
            _hopper_bwd_launch.dkdv_into(do, q, k, v, lse, delta, dk, dv, causal, scale, stages, ahead)
    return dq, dk, dv


def _dq_into(do, q, k, v, o, lse, dq, delta, causal: bool, sm_scale: float) -> None:
    """The split backward's dQ kernel alone, without a window, documents or RoPE tables: dQ into dq and
    delta = rowsum(dO * O) into delta ((B, Hq, Nq) float32, contiguous). The Gluon dK/dV kernel
    (_hopper_bwd) runs after it and reads delta. The arguments are _bwd's for the
    same launch; no launch plan is recorded."""
    B, Hq, Nq, _ = q.shape
    args, kwargs = _dq_launch_args(do, q, k, v, o, lse, dq, delta, causal, sm_scale, _options.get())
    with _triton.device_guard(q):
        _launch("dq", Nq, Hq, B, q.dtype, args, kwargs)


# ----------------------------------------------------------------------------------------------------------
# Packed projections: qkv (B, N, (Hq + 2·Hkv)·D) in, O out; the backward returns d(qkv) in one buffer
# ----------------------------------------------------------------------------------------------------------
# A model's fused QKV matmul gives one tensor; q, k, v are views of it. Through the per-view form, autograd
# would concatenate dq, dk, dv into d(qkv) with a copy kernel (a read and a write of the whole gradient per
# layer); here the two backward kernels write their slices of d(qkv) directly.
#
# A packed call whose launches all have compiled kernels (on a GPU) is also planned by qkv's own signature: the
# launchers then take q, k, v (and dq, dk, dv) as integer addresses at the split's fixed byte offsets, so a
# replay skips building the views (split_qkv) and the per-view plan key.

def _offsets(packed: torch.Tensor, views) -> tuple:
    return tuple(t.data_ptr() - packed.data_ptr() for t in views)


def _record_packed(key, inner_key, offsets: tuple) -> None:
    """Plan a packed call as the per-view plan `inner_key` that its first call recorded, plus the offsets
    (or mark the signature _UNPACKABLE when that plan launches through Triton's JITFunction.run)."""
    inner = _plans.get(inner_key) if key is not None else None
    if inner is not None:
        _record(key, (offsets, *inner) if all(launch[3] is not None for launch in inner[-1]) else _UNPACKABLE)


# The plan recorded for a packed signature whose per-view plan launches through JITFunction.run (the interpreter,
# the fast_launch option off): such calls take the per-view path without trying to record again. Its last item
# is an empty list of launches, so _record accepts it.
_UNPACKABLE = ((),)


def _packed_fwd(qkv, n_head: int, n_kv_head: int, causal: bool, sm_scale: float, window: int = 0,
                docs: torch.Tensor | None = None):
    opts = _options.get()
    key = _plan_key(_masked("packed_fwd", window, docs), opts, _with_docs((qkv,), docs), n_head, n_kv_head, causal,
                    sm_scale)
    plan = _plans.get(key)
    if plan is not None and plan is not _UNPACKABLE:
        offsets, o_layout, lse_shape, launches = plan
        o = _empty_like_layout(o_layout, qkv.dtype, qkv.device)
        lse = _triton.empty(lse_shape, torch.float32, qkv.device)
        at = qkv.data_ptr()
        _replay(launches, (*[at + off for off in offsets], o, lse, docs), qkv)
        return o, lse
    q, k, v = split_qkv(qkv, n_head, n_kv_head)
    o, lse = _fwd(q, k, v, causal, sm_scale, window, docs)
    if plan is None:
        _record_packed(key, _plan_key(_masked("fwd", window, docs), opts, _with_docs((q, k, v), docs), causal,
                                      sm_scale), _offsets(qkv, (q, k, v)))
    return o, lse


def _rope_in_kernels(qkv: torch.Tensor, n_head: int, n_kv_head: int) -> bool:
    """Whether the backward kernels rotate dQ and dK back themselves (ROPE): head dims that are the kernels'
    BLOCK_D (powers of two >= 16), whose two halves are the two halves of a tile."""
    D = qkv.shape[-1] // (n_head + 2 * n_kv_head)
    return block_d(D) == D


def _packed_bwd(do, qkv, o, lse, n_head: int, n_kv_head: int, causal: bool, sm_scale: float, window: int = 0,
                docs: torch.Tensor | None = None, rope=None) -> torch.Tensor:
    """d(qkv) in one new buffer. rope = (cos, sin): qkv is the RoPE-rotated projection (_packed_rope_fwd), and
    the result is the gradient w.r.t. the projection before the rotation."""
    if rope is not None and not _rope_in_kernels(qkv, n_head, n_kv_head):
        d_rotated = _packed_bwd(do, qkv, o, lse, n_head, n_kv_head, causal, sm_scale, window, docs)
        return _rope._bwd(d_rotated, *rope, n_head, n_kv_head)  # one pass: the transposed rotation
    opts = _options.get()
    dqkv = _triton.empty(tuple(qkv.shape), qkv.dtype, qkv.device)  # (B, N, (Hq + 2·Hkv)·D), contiguous
    key = _plan_key(_masked("packed_bwd", window, docs, rope), opts, _with_docs((do, qkv, o, lse, dqkv), docs, rope),
                    n_head, n_kv_head, causal, sm_scale)
    cos, sin = rope or (None, None)
    plan = _plans.get(key)
    if plan is not None and plan is not _UNPACKABLE:
        offsets, delta_shape, _, acc_shape, launches = plan
        delta = _triton.empty(delta_shape, torch.float32, qkv.device)
        acc = delta if acc_shape is None else _triton.empty(acc_shape, torch.float32, qkv.device)
        at, grad_at = qkv.data_ptr(), dqkv.data_ptr()
        _replay(launches, (*[at + off for off in offsets[:3]], o, do, lse, delta,
                           *[grad_at + off for off in offsets[3:]], acc, docs, cos, sin), qkv)
        return dqkv
    q, k, v = split_qkv(qkv, n_head, n_kv_head)
    out = split_qkv(dqkv, n_head, n_kv_head)
    _bwd(do, q, k, v, o, lse, causal, sm_scale, window, docs, out=out, rope=rope)
    if plan is None:
        _record_packed(key, _plan_key(_masked("bwd", window, docs, rope), opts,
                                      _with_docs((do, q, k, v, o, lse, *out), docs, rope), causal, sm_scale),
                       _offsets(qkv, (q, k, v)) + _offsets(dqkv, out))
    return dqkv


def _packed_rope_fwd(qkv, cos, sin, n_head: int, n_kv_head: int, causal: bool, sm_scale: float, window: int = 0,
                     docs: torch.Tensor | None = None):
    """RoPE on q and k of qkv (one pass of kernels/rope.py into a new packed tensor, v copied), then the packed
    forward on it. Returns (o, lse, the rotated qkv), the last for the backward (_packed_bwd with rope)."""
    rotated = _rope._fwd(qkv, cos, sin, n_head, n_kv_head)  # (B, N, (Hq + 2·Hkv)·D), contiguous
    o, lse = _packed_fwd(rotated, n_head, n_kv_head, causal, sm_scale, window, docs)
    return o, lse, rotated
