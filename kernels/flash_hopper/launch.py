"""Host side of the Hopper forward: which inputs it takes, its TMA descriptors, grid and launch.

    unsupported(q, k, v, window=0, docs=None) -> str | None   why these inputs go to the tl kernel (None: they
                                                              do not, the Gluon kernel takes them)
    forward_into(q, k, v, o, lse, causal, sm_scale) -> None   launch into the caller's O and lse
    flash_hopper_forward(q, k, v, causal=True, sm_scale=None) -> (o, lse)   allocate and launch (tests, benches)
    AVAILABLE, UNAVAILABLE_REASON                             whether this Triton has the Gluon API the kernel uses

The kernel (kernels/flash_hopper/forward.py) takes float16/bfloat16 q, k, v with head dim 64 or 128, any
lengths, causal or not, GQA, on a CUDA device of compute capability 9.0 (H100, H200), when every stride of
q, k, v along a dimension longer than 1 is a multiple of 16 bytes with unit stride along the head dim, and the
data pointers are 16-byte aligned (TMA). Anything else — fp32, other head dims, windows, documents, other
GPUs, the interpreter — is for the tl kernel (kernels/flash), which the caller falls back to.

q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D); o like q (any such strides); lse (B, Hq, Nq) float32, contiguous,
base 2 and scaled, +inf for rows that see no key — what kernels/flash's backward reads.
"""
from __future__ import annotations

import functools
import inspect
import math

import torch

from .. import _triton
from .. import options as _options
from . import schedule as _schedule

try:
    import triton
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import forward as _forward
    _missing = [name for name in ("warp_specialize", "NVMMADistributedLayout", "DotOperandLayout", "SliceLayout",
                                  "NVMMASharedLayout", "allocate_shared_memory") if not hasattr(gl, name)]
    if not _missing and next(iter(inspect.signature(gl.warp_specialize).parameters)) != "functions_and_args":
        _missing = ["warp_specialize([(partition, args), ...], warps, registers)"]  # older Gluon: other form
    UNAVAILABLE_REASON = (f"this Triton ({triton.__version__}) has Gluon without {', '.join(_missing)}"
                          if _missing else None)
except (ImportError, AttributeError, TypeError, ValueError) as e:  # no Gluon, or not the Hopper API the kernel uses
    UNAVAILABLE_REASON = f"this Triton lacks the Gluon Hopper API the kernel uses: {e}"
AVAILABLE = UNAVAILABLE_REASON is None

HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
BLOCK_M = 64  # query rows per consumer warpgroup (a tile is consumers x BLOCK_M)
BLOCK_N = 128  # keys per K/V block
STAGES = {64: 3, 128: 2}  # K/V ring depth per head dim (shared memory: Q, O and the ring fit in 227 KB)
NUM_WARPS = 4  # the default partition: consumer 0


@functools.lru_cache(maxsize=None)
def _is_sm90(device: torch.device) -> bool:
    """Compute capability exactly 9.0: wgmma and setmaxnreg exist on Hopper only (not on Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _tma_ok(t: torch.Tensor) -> bool:
    """Unit stride along D, 16-byte aligned start, every other stride of a dim longer than 1 a positive
    multiple of 16 bytes (a dim of size 1 is never stepped along: its stride is replaced in _desc)."""
    size = t.element_size()
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(n == 1 or (st > 0 and (st * size) % 16 == 0) for n, st in zip(t.shape[:-1], t.stride()[:-1]))


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0, docs=None) -> str | None:
    """Why the Gluon kernel does not take these (already validated) inputs, or None when it does."""
    if not AVAILABLE:
        return UNAVAILABLE_REASON
    if window or docs is not None:
        return "sliding windows and documents are the tl kernel's"
    if _triton.INTERPRET or not _is_sm90(q.device):
        return f"needs a CUDA device of compute capability 9.0, got {q.device}"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype}: float16 and bfloat16 only"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]}: {' and '.join(map(str, HEAD_DIMS))} only"
    if q.numel() == 0 or k.numel() == 0:
        return "empty inputs"
    if not all(_tma_ok(t) for t in (q, k, v)):
        return "a stride or start of q, k or v is not 16-byte aligned (TMA)"
    return None


def _desc(t: torch.Tensor, block_rows: int):
    """A 4-d TMA descriptor over t (B, H, N, D), read and written in (1, 1, block_rows, D) blocks. The stride of
    a dim of size 1 (any value in torch, never used) becomes a contiguous one, as TMA wants 16-byte multiples."""
    shape = list(t.shape)
    strides = list(t.stride())
    inner = shape[-1]
    for i in (2, 1, 0):
        if shape[i] == 1:
            strides[i] = inner
        inner = strides[i] * shape[i]
    block = [1, 1, block_rows, shape[-1]]
    return TensorDescriptor(t, shape, strides, block, _smem_layout(block_rows, shape[-1], t.dtype))


@functools.lru_cache(maxsize=None)
def _smem_layout(block_rows: int, head_dim: int, dtype: torch.dtype):
    """The shared-memory layout of a (1, 1, block_rows, head_dim) block: the widest swizzle its rows allow."""
    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([1, 1, block_rows, head_dim], gl_dtype)


def forward_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                 causal: bool, sm_scale: float, l2_bytes: int = _schedule.L2_BYTES) -> None:
    """Launch the Gluon forward on inputs that unsupported() accepted: O into o (like q: (B, Hq, Nq, D), any
    strides TMA takes), the log-sum-exp into lse ((B, Hq, Nq) float32, contiguous). On q's device. Causal,
    with the hopper_tile_lists option: each program runs its own tile list, groups of heads sized to l2_bytes
    (kernels/flash_hopper/schedule.py)."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if not _tma_ok(o) or o.shape != q.shape or o.dtype != q.dtype:
        raise ValueError(f"flash_hopper: the output buffer {tuple(o.shape)} {o.dtype} (strides {o.stride()}) "
                         "does not match q or is not TMA-aligned")
    if lse.shape != (B, Hq, Nq) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"flash_hopper: lse must be a contiguous (B, Hq, Nq) float32 buffer, got "
                         f"{tuple(lse.shape)} {lse.dtype}")
    opts = _options.get()
    consumers = consumer_count(D, causal, opts, Nk)
    n_m = -(-Nq // (consumers * BLOCK_M))
    n_tiles = n_m * B * Hq
    programs = min(n_tiles, _triton.sm_count(q.device))  # persistent: at most one program per SM
    starts = tiles = None
    if causal and opts.hopper_tile_lists:
        kv_bytes = 2 * Nk * D * k.element_size()  # one (batch, head)'s K and V
        starts, tiles = _schedule.device_tile_lists(n_m, B * Hq, Nk, Nk - Nq, consumers * BLOCK_M, BLOCK_N,
                                                    kv_bytes, programs, l2_bytes, q.device)
    lists = starts is not None
    args = (_desc(q, BLOCK_M), _desc(k, BLOCK_N), _desc(v, BLOCK_N), _desc(o, BLOCK_M), lse,
            Hq, Hq // Hkv, Nq, Nk, Nk - Nq, sm_scale * _triton.LOG2E, n_m, B * Hq, n_tiles,
            starts if lists else lse, tiles if lists else lse)  # (the lists are not read without LISTS)
    consts = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_D=D, STAGES=STAGES[D], CAUSAL=bool(causal), LISTS=lists,
                  EARLY_Q=early_q(causal, Nk, opts), CONSUMERS=consumers,
                  OWN_BLOCKS=bool(causal) and opts.hopper_own_blocks, LANE_SUMS=lane_sums(D, opts, causal, Nk))
    _launch((programs,), args, consts, q, opts.fast_launch)


# Q released after a tile's last QKᵀ (early) or its last PV (late): early is 1.05-1.16x at 1024 tokens and
# 1.00-1.04x causal from 4096 (bench/results/flash_hopper/tile_lists/early_q/); without a causal mask from 4096
# keys late was 0.3-3.4 % faster in every run that timed both (d64 and d128; tile_lists/early_q/, poly_exp2/,
# three_consumers/ and three_consumers/own_blocks/).
EARLY_Q_LATE_FROM_KEYS = 4096


def early_q(causal: bool, Nk: int, opts=None) -> bool:
    """Whether the consumers release Q after a tile's last QKᵀ: the hopper_early_q option ("on", "off", or
    "auto": early except without a causal mask from EARLY_Q_LATE_FROM_KEYS keys)."""
    mode = (opts or _options.get()).hopper_early_q
    return mode == "on" or (mode == "auto" and (causal or Nk < EARLY_Q_LATE_FROM_KEYS))


def lane_sums(head_dim: int, opts=None, causal: bool = False, Nk: int = 0) -> bool:
    """Whether the consumers keep the row sums as per-thread partial sums (reduced once per tile): the
    hopper_lane_sums option ("on", "off", or "auto": on at head dim 128, where it was 0.4-2.2 % faster at 4096
    and 16384 tokens, causal and not, in three runs; at 64 it was 2.2 % slower to 1.4 % faster,
    bench/results/flash_hopper/lane_sums/; and at 64 with three consumers, causal from
    D64_CAUSAL_THREE_FROM_KEYS keys, as consumer_count runs them there)."""
    mode = (opts or _options.get()).hopper_lane_sums
    if mode != "auto":
        return mode == "on"
    return head_dim == 128 or (head_dim == 64 and _d64_causal_long(causal, Nk, opts))


# Three consumers hold S and P of 64 x 128 and O of 64 x 64 in 160 registers: ptxas spills 60-128 bytes per
# thread with Triton 3.6 (the version measured faster, bench/results/flash_hopper/three_consumers/), 444-476 with
# 3.9 (compiled for sm_90 on a CPU, not timed), so the automatic choice takes three only with the measured one.
THREE_CONSUMERS_TRITON = ("3.6.",)


# Causal at head dim 64, three consumers with lane sums against two: 0.977x at 4096 tokens (4,16 and 8,16 heads),
# 1.015-1.089x from 6144 to 32768 (five rounds at eight shapes, one H100:
# bench/results/flash_hopper/d64_causal_long/); causal calls from this many keys take them.
D64_CAUSAL_THREE_FROM_KEYS = 6144


def _d64_causal_long(causal: bool, Nk: int, opts=None) -> bool:
    """A causal head-dim-64 call long enough for three consumers with lane sums, under the measured Triton and
    with hopper_consumers_d64 left to the default."""
    return (causal and Nk >= D64_CAUSAL_THREE_FROM_KEYS and not (opts or _options.get()).hopper_consumers_d64
            and triton.__version__.startswith(THREE_CONSUMERS_TRITON))


def consumer_count(head_dim: int, causal: bool, opts=None, Nk: int = 0) -> int:
    """Consumer warpgroups of the Gluon forward. Head dim 64: the hopper_consumers_d64 option, whose auto (0)
    is three (192-row tiles) without a causal mask and two with one below D64_CAUSAL_THREE_FROM_KEYS keys, as
    measured (bench/results/flash_hopper/three_consumers/, d64_causal_long/), and two under a Triton not in
    THREE_CONSUMERS_TRITON. Head dim 128: two (three would not fit S, P and O of 64 x 128 in 160 registers
    each)."""
    opts = opts or _options.get()
    if head_dim != 64:
        return 2
    if opts.hopper_consumers_d64:
        return opts.hopper_consumers_d64
    if not triton.__version__.startswith(THREE_CONSUMERS_TRITON):
        return 2
    return 3 if not causal or _d64_causal_long(causal, Nk, opts) else 2


# The compiled kernel per launch signature, so that a repeated launch calls its launcher directly
# (_triton.launch_compiled) instead of JITFunction.run, which binds and specialises the 22 arguments again on
# every call (as kernels/flash/launch.py does for the tl kernels; the fast_launch option switches both off).
# The key holds what Triton specialises on: the constexprs, the dtype (the descriptors' element type and
# layouts follow from it and the block shapes; unsupported() has checked their TMA alignment) and each
# pointer's dtype and 16-byte alignment; the integers are do_not_specialize and the scale a float.
_compiled: dict[tuple, object] = {}


def _launch(grid: tuple, args: tuple, consts: dict, q: torch.Tensor, fast: bool) -> None:
    launch_cached(_forward._attn_fwd_hopper, _compiled, grid, args, consts, q, fast, num_warps=NUM_WARPS,
                  maxnreg=_forward.MAX_REGS[consts["CONSUMERS"]])


def launch_cached(kernel_fn, cache: dict, grid: tuple, args: tuple, consts: dict, q: torch.Tensor, fast: bool,
                  **launch_opts) -> None:
    """Launch the Gluon kernel kernel_fn on grid with its arguments args (in order, numbers and tensors or
    descriptors) then the constexprs consts (in the kernel's parameter order), and launch_opts (num_warps,
    maxnreg: fixed per set of constexprs). With fast (the fast_launch option) and not under the interpreter, the
    first launch of a signature goes through the JIT, which compiles and returns the kernel, and a repeat calls
    its launcher directly; cache: the kernel's compiled launches by signature (q's device and dtype, the
    constexprs, each tensor argument's dtype and 16-byte alignment; the descriptors' element types and layouts
    follow from the dtype and the constexprs)."""
    if not fast or _triton.INTERPRET:
        kernel_fn[grid](*args, **consts, **launch_opts)
        return
    key = (q.device.index, q.dtype, *consts.values(),
           *[(a.dtype, a.data_ptr() % 16 == 0) for a in args if isinstance(a, torch.Tensor)])
    kernel = cache.get(key)
    if kernel is None:
        kernel = kernel_fn[grid](*args, **consts, **launch_opts)
        # a compiled kernel (what a launch returns) whose launcher takes the arguments, then the constexprs
        if hasattr(kernel, "run") and list(kernel_fn.arg_names[len(args):]) == list(consts):
            cache[key] = kernel
        return
    _triton.launch_compiled(kernel, grid, (*args, *consts.values()))


def flash_hopper_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                         sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """O (B, Hq, Nq, D) in q's dtype and lse (B, Hq, Nq) float32 of inputs the kernel takes (a ValueError naming
    the reason otherwise). No autograd: kernels.flash_attention with the hopper_forward option is the
    differentiable path."""
    B, Hq, Nq, D = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    if (q.dim() != 4 or k.dim() != 4 or k.shape[0] != B or k.shape != v.shape or k.shape[-1] != D
            or k.shape[1] < 1 or Hq % k.shape[1] or k.shape[2] < 1 or Nq < 1 or not q.dtype == k.dtype == v.dtype
            or not q.device == k.device == v.device):
        raise ValueError(f"flash_hopper: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v "
                         f"{tuple(v.shape)} {v.dtype} are not (B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D) of "
                         "one dtype and device, Nq, Nk >= 1, Hq a multiple of Hkv")
    reason = unsupported(q, k, v)
    if reason is not None:
        raise ValueError(f"flash_hopper: {reason}")
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"flash_hopper: sm_scale must be a finite number > 0, got {sm_scale}")
    o = _triton.empty((B, Hq, Nq, D), q.dtype, q.device)
    lse = _triton.empty((B, Hq, Nq), torch.float32, q.device)
    with _triton.device_guard(q):
        forward_into(q, k, v, o, lse, causal, scale)
    return o, lse
