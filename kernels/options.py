"""Every switch of the Triton kernels in one typed, immutable object.

    kernels.options.get() -> KernelOptions            the options in force
    kernels.options.update(**changes) -> KernelOptions replace some for the rest of the process (a benchmark's flag)
    with kernels.options.use(**changes): ...           replace some inside a block (tests, A/B runs in one process)
    with kernels.options.use_defaults(**defaults): ... a program's own defaults, the environment's overrides on top
    kernels.options.from_env(environ, **defaults)      the defaults with the environment's overrides applied

The kernels read get() on every call (an attribute read, nothing is parsed), so a change takes effect at the
next call; cached launch plans are keyed by the options they were recorded under. The defaults are the
measured choices (bench/NOTES.md). Each option has one documented environment override, read once, by the
first get() of the process (a bad value is a ValueError naming the variable):

    option                     environment override              default
    autotune                   FLASHGPT_AUTOTUNE=0|1             True   autotune tile configs on a GPU; off: each
                                                                        kernel's first (default) config
    autotune_min_keys          FLASHGPT_AUTOTUNE_MIN_KEYS=<int>  256    the flash kernels autotune only calls whose
                                                                        key-length bucket is at least this; shorter
                                                                        ones (a chat turn's prefill) run the first
                                                                        config: a tuning compiles every config,
                                                                        seconds, for a kernel of microseconds
    autotune_cache             FLASHGPT_AUTOTUNE_CACHE=0|1       True   keep the flash autotuners' timings in
                                                                        Triton's cache folder (TRITON_CACHE_DIR), so
                                                                        a later process reuses the pick instead of
                                                                        tuning again (empty the folder to re-tune)
    tma                        FLASHGPT_TMA=0|1                  True   TMA descriptor loads where the kernel's policy
                                                                        uses them (Hopper); off: pointer loads
    tma_min_block_d            FLASHGPT_TMA_MIN_D=<int>          None   descriptors in every flash kernel from this
                                                                        padded head dim (None: each kernel's policy)
    lpt                        FLASHGPT_LPT=0|1                  True   longest-first causal grids where they help;
                                                                        off: the per-head grid
    fast_launch                FLASHGPT_FAST_LAUNCH=0|1          True   reuse Triton's compiled kernel's launcher;
                                                                        off: every launch through JITFunction.run
    backward                   FLASHGPT_BWD=split|fused          split  flash backward: dQ then dK/dV (deterministic),
                                                                        or delta, dK/dV adding dQ with atomics, dQ
    fused_dq                   FLASHGPT_FUSED_DQ=1|2             2      the fused backward adds dQ with TMA
                                                                        reduce-adds where possible (2) or element
                                                                        atomics (1)
    pdl                        FLASHGPT_PDL=0|1                  True   programmatic dependent launch of the decode
                                                                        kernels (Hopper)
    loss_kernel                FLASHGPT_CE=auto|triton|torch     auto   what kernels.cross_entropy runs for "auto":
                                                                        auto = Triton on CUDA, PyTorch elsewhere
    decode_min_keys_per_split  FLASHGPT_DECODE_MIN_KEYS_PER_SPLIT=<int>   128   the split-KV decode never cuts
                                                                        the cache finer (automatic split count)
    llama_kernels              FLASHGPT_LLAMA_KERNELS=auto|triton|torch   torch   what the model's RMSNorm,
                                                                        SwiGLU and RoPE run for "auto"
                                                                        (model.llama_kernels): auto = Triton on
                                                                        CUDA, PyTorch elsewhere
    hopper_forward             FLASHGPT_HOPPER_FWD=auto|on|off   auto   where the flash forward runs the Gluon
                                                                        kernel (kernels/flash_hopper) on sm_90:
                                                                        auto = for the inputs it takes where it was
                                                                        measured faster than the tl kernel (head
                                                                        dim 128, >= 4096 queries and keys, or
                                                                        >= 1024 with B*Hq*Nq >= 262,144; head
                                                                        dim 64 not causal the same from 2048,
                                                                        causal from 4096;
                                                                        kernels/flash/launch.py: HOPPER_AUTO_*),
                                                                        on = for every input it takes, off = never
    hopper_backward            FLASHGPT_HOPPER_BWD=auto|on|off   auto   where the flash backward runs the Gluon
                                                                        kernel (kernels/flash_hopper: dK, dV and
                                                                        dQ by TMA reduce-adds in one kernel) on
                                                                        sm_90: auto = for the inputs it takes where
                                                                        it was measured faster than the tl
                                                                        backward (head dim 128 from 2048
                                                                        queries and keys, head dim 64 not causal
                                                                        from 4096, causal from 16384; other
                                                                        lengths than multiples of 4: head dim
                                                                        128 not causal from 4096;
                                                                        kernels/flash/launch.py:
                                                                        HOPPER_BWD_AUTO_MIN_LEN), on = for every
                                                                        input it takes (no window, documents or
                                                                        RoPE tables), off = never
    decode_merge_in_split      FLASHGPT_DECODE_MERGE_IN_SPLIT=0|1   False   the split-KV decode's last split
                                                                        program of each row block merges the
                                                                        parts (one launch); off: a merge launch
    decode_full_grid           FLASHGPT_DECODE_FULL_GRID=0|1     True   a decode call whose unsplit programs are
                                                                        at least the SMs runs unsplit where its
                                                                        grid is planned for at most
                                                                        decode_full_grid_max_len keys (one
                                                                        launch, no merge; kernels/decode.py)
    decode_full_grid_max_len   FLASHGPT_DECODE_FULL_GRID_MAX_LEN=<int>   32768   that length
    decode_full_grid_long_splits  FLASHGPT_DECODE_FULL_GRID_LONG_SPLITS=<int>   0   such a call planned for
                                                                        more keys than that gets this many
                                                                        splits, its sequences of up to that
                                                                        length running unsplit (0: the
                                                                        automatic count)
    decode_full_grid_pdl       FLASHGPT_DECODE_FULL_GRID_PDL=0|1   False   such a call is launched as a PDL
                                                                        dependent like the other decode
                                                                        kernels; off: it starts once the previous
                                                                        kernel has ended (and still lets the next
                                                                        one start early)
    decode_short_splits        FLASHGPT_DECODE_SHORT_SPLITS=0|1   True   where the automatic split count leaves
                                                                        no SM more than one program (batch 1),
                                                                        the grid holds more splits so that a
                                                                        sequence of up to 2,048 keys can use up
                                                                        to one per decode_min_keys_per_split
                                                                        keys (kernels/decode.py:
                                                                        short_grid_splits)
    decode_split_order         FLASHGPT_DECODE_SPLIT_ORDER=strided|chunks   strided   which key blocks a split
                                                                        of the split-KV decode reads: every
                                                                        used-th block from its own index (at any
                                                                        moment the splits read neighbouring
                                                                        blocks), or one contiguous chunk
    decode_tma                 FLASHGPT_DECODE_TMA=0|1           False   the split-KV decode reads K and V through
                                                                        TMA tensor descriptors over the whole
                                                                        cache (Hopper, 16-bit caches with unit
                                                                        stride along D and 16-byte aligned
                                                                        strides); off: pointer loads
    decode_min_rows            FLASHGPT_DECODE_MIN_ROWS=16|32|64   16   query rows a split-KV decode program of the
                                                                        dot path holds at least (padding rows
                                                                        beyond a kv head's group x new tokens):
                                                                        64 lets sm_90 run the two products as
                                                                        warpgroup MMAs, each warp's rows its own
                                                                        (no cross-warp softmax reductions), at 4x
                                                                        the padded rows' arithmetic
    decode_key_parts           FLASHGPT_DECODE_KEY_PARTS=1|2|4|8  1     softmax states a split-KV decode program of
                                                                        the dot path keeps, one per part of each
                                                                        key block (pointer loads, parts of at
                                                                        least 16 keys): no cross-warp reductions
                                                                        in the key loop, the states merged once
    rope_in_flash              FLASHGPT_ROPE_IN_FLASH=0|1        True   a RoPE model's training/prefill call without
                                                                        a KV cache hands its RoPE tables to the
                                                                        packed flash call, whose backward kernels
                                                                        store dQ and dK rotated back (no RoPE
                                                                        backward pass); off: the model rotates q
                                                                        and k itself before the call (its
                                                                        llama_kernels choice). Models with qk_norm
                                                                        always rotate themselves
    lora_addmm                 FLASHGPT_LORA_ADDMM=0|1           False  a LoRA projection adds its update in the
                                                                        update GEMM's epilogue (addmm onto the
                                                                        frozen output, alpha = s), so no tensor of
                                                                        the update's size is written and re-read;
                                                                        off: the update as its own tensor, added
                                                                        after (model/lora.py; on an H100 0.8%
                                                                        slower, bench/results/train_smollm2/lora/
                                                                        addmm_h100/)
    hopper_tile_lists          FLASHGPT_HOPPER_TILE_LISTS=0|1    True   the Gluon forward's causal tiles come from a
                                                                        list per program (longest first within
                                                                        groups of heads whose K/V fit in L2,
                                                                        dealt so that the programs end together;
                                                                        kernels/flash_hopper/schedule.py); off:
                                                                        heaviest first across all heads, strided
    hopper_early_q             FLASHGPT_HOPPER_EARLY_Q=auto|on|off  auto  the Gluon forward's consumers release
                                                                        their Q tile after a tile's last QKᵀ, so
                                                                        the next tile's Q and K/V load during its
                                                                        last softmax, PV and epilogue (on), or
                                                                        after its last PV (off); auto: on, except
                                                                        without a causal mask from 4096 keys
    hopper_own_blocks          FLASHGPT_HOPPER_OWN_BLOCKS=0|1    True   the Gluon forward's consumers, causal, skip
                                                                        the matmuls of the tile's key blocks their
                                                                        own rows do not see; off: every consumer
                                                                        runs every block of the tile (masked)
    hopper_consumers_d64       FLASHGPT_HOPPER_CONSUMERS_D64=0|2|3  0   consumer warpgroups of the Gluon forward at
                                                                        head dim 64: 2 (128-row tiles), 3 (192-row
                                                                        tiles, 160 registers each) or 0: 3 without
                                                                        a causal mask, and with one from 6144 keys
                                                                        (flash_hopper/launch.py:
                                                                        D64_CAUSAL_THREE_FROM_KEYS), else 2
    hopper_lane_sums           FLASHGPT_HOPPER_LANE_SUMS=auto|on|off  auto  the Gluon forward's consumers keep
                                                                        each row's running sum of exp2 as
                                                                        per-thread partial sums (their own key
                                                                        columns; no shuffles per key block),
                                                                        summed across the row's threads once per
                                                                        tile (on), or sum the whole row every key
                                                                        block (off); auto: on at head dim 128
                                                                        (0.4-2.2 % faster there, mixed at 64:
                                                                        bench/results/flash_hopper/lane_sums/)
                                                                        and at 64 where 3 consumers run causal
    decode_fused_mlp           FLASHGPT_DECODE_FUSED_MLP=0|1     True   the fused decode step runs each MLP block
                                                                        (norm, up projection, activation, down
                                                                        projection, residual) as one launch
                                                                        (kernels/decode_mlp.py) where it takes the
                                                                        shape; off: two ln_linear launches
    decode_stack               FLASHGPT_DECODE_STACK=0|1         True   the fused decode step of one sequence runs
                                                                        every layer in one persistent launch
                                                                        (kernels/decode_stack.py, grid barriers
                                                                        between the phases) where the shape fits;
                                                                        off: the per-layer launches
    decode_stack_merged_sums   FLASHGPT_DECODE_STACK_MERGED_SUMS=0|1   True    the stack's phases A and D take
                                                                        their norm's sums (LayerNorm: Σx and Σx²
                                                                        together) in one CTA-wide reduction over
                                                                        the width as one power-of-two block, phase
                                                                        A its QKV lane pairs as two such blocks in
                                                                        one two-operand reduction, phase D its
                                                                        gate and up rows in one per column block
                                                                        (kernels/decode_stack.py); off: each sum
                                                                        over two column blocks, each reduced alone

Boolean overrides take 1/0, true/false, yes/no, on/off. Not thread-safe: set options before starting threads
that launch kernels (autograd's backward threads read the same, process-wide, object).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

BACKWARDS = ("split", "fused")
LOSS_KERNELS = ("auto", "triton", "torch")
LLAMA_KERNELS = ("auto", "triton", "torch")
HOPPER_FORWARDS = ("auto", "on", "off")
DECODE_SPLIT_ORDERS = ("strided", "chunks")


@dataclass(frozen=True)
class KernelOptions:
    autotune: bool = True
    autotune_min_keys: int = 256
    autotune_cache: bool = True
    tma: bool = True
    tma_min_block_d: int | None = None
    lpt: bool = True
    fast_launch: bool = True
    backward: str = "split"
    fused_dq: int = 2
    pdl: bool = True
    loss_kernel: str = "auto"
    decode_min_keys_per_split: int = 128
    llama_kernels: str = "torch"
    hopper_forward: str = "auto"
    hopper_backward: str = "auto"
    decode_merge_in_split: bool = False
    decode_full_grid: bool = True
    decode_full_grid_max_len: int = 32768
    decode_full_grid_long_splits: int = 0
    decode_full_grid_pdl: bool = False
    decode_short_splits: bool = True
    rope_in_flash: bool = True
    lora_addmm: bool = False
    decode_split_order: str = "strided"
    decode_tma: bool = False
    decode_min_rows: int = 16
    decode_key_parts: int = 1
    hopper_tile_lists: bool = True
    hopper_early_q: str = "auto"
    hopper_consumers_d64: int = 0
    hopper_own_blocks: bool = True
    hopper_lane_sums: str = "auto"
    decode_fused_mlp: bool = True
    decode_stack: bool = True
    decode_stack_merged_sums: bool = True

    def __post_init__(self):
        for f in dataclasses.fields(self):
            problem = _problem(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(f"kernel option {f.name}={getattr(self, f.name)!r}: {problem}")
        # launch plans are keyed by the options on every call: hash them once
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_EXPECTED = {  # option -> (accepts, what it expects)
    "autotune": (lambda v: isinstance(v, bool), "expected True or False"),
    "autotune_min_keys": (lambda v: _is_int(v) and v >= 0, "expected an int >= 0"),
    "autotune_cache": (lambda v: isinstance(v, bool), "expected True or False"),
    "tma": (lambda v: isinstance(v, bool), "expected True or False"),
    "tma_min_block_d": (lambda v: v is None or (_is_int(v) and v >= 1), "expected None or an int >= 1"),
    "lpt": (lambda v: isinstance(v, bool), "expected True or False"),
    "fast_launch": (lambda v: isinstance(v, bool), "expected True or False"),
    "backward": (lambda v: v in BACKWARDS, f"expected one of {', '.join(BACKWARDS)}"),
    "fused_dq": (lambda v: _is_int(v) and v in (1, 2), "expected 1 (element atomics) or 2 (TMA reduce-adds)"),
    "pdl": (lambda v: isinstance(v, bool), "expected True or False"),
    "loss_kernel": (lambda v: v in LOSS_KERNELS, f"expected one of {', '.join(LOSS_KERNELS)}"),
    "decode_min_keys_per_split": (lambda v: _is_int(v) and v >= 1, "expected an int >= 1"),
    "llama_kernels": (lambda v: v in LLAMA_KERNELS, f"expected one of {', '.join(LLAMA_KERNELS)}"),
    "hopper_forward": (lambda v: v in HOPPER_FORWARDS, f"expected one of {', '.join(HOPPER_FORWARDS)}"),
    "hopper_backward": (lambda v: v in HOPPER_FORWARDS, f"expected one of {', '.join(HOPPER_FORWARDS)}"),
    "decode_merge_in_split": (lambda v: isinstance(v, bool), "expected True or False"),
    "decode_full_grid": (lambda v: isinstance(v, bool), "expected True or False"),
    "decode_full_grid_max_len": (lambda v: _is_int(v) and v >= 0, "expected an int >= 0"),
    "decode_full_grid_long_splits": (lambda v: _is_int(v) and v >= 0, "expected an int >= 0"),
    "decode_full_grid_pdl": (lambda v: isinstance(v, bool), "expected True or False"),
    "decode_short_splits": (lambda v: isinstance(v, bool), "expected True or False"),
    "rope_in_flash": (lambda v: isinstance(v, bool), "expected True or False"),
    "lora_addmm": (lambda v: isinstance(v, bool), "expected True or False"),
    "decode_split_order": (lambda v: v in DECODE_SPLIT_ORDERS, f"expected one of {', '.join(DECODE_SPLIT_ORDERS)}"),
    "decode_tma": (lambda v: isinstance(v, bool), "expected True or False"),
    "decode_min_rows": (lambda v: _is_int(v) and v in (16, 32, 64), "expected 16, 32 or 64"),
    "decode_key_parts": (lambda v: _is_int(v) and v in (1, 2, 4, 8), "expected 1, 2, 4 or 8"),
    "hopper_tile_lists": (lambda v: isinstance(v, bool), "expected True or False"),
    "hopper_early_q": (lambda v: v in HOPPER_FORWARDS, f"expected one of {', '.join(HOPPER_FORWARDS)}"),
    "hopper_consumers_d64": (lambda v: _is_int(v) and v in (0, 2, 3), "expected 0 (by the mask), 2 or 3"),
    "hopper_own_blocks": (lambda v: isinstance(v, bool), "expected True or False"),
    "hopper_lane_sums": (lambda v: v in HOPPER_FORWARDS, f"expected one of {', '.join(HOPPER_FORWARDS)}"),
    "decode_fused_mlp": (lambda v: isinstance(v, bool), "expected True or False"),
    "decode_stack": (lambda v: isinstance(v, bool), "expected True or False"),
    "decode_stack_merged_sums": (lambda v: isinstance(v, bool), "expected True or False"),
}


def _problem(name: str, value) -> str | None:
    accepts, expected = _EXPECTED[name]
    return None if accepts(value) else expected


ENV = {"autotune": "FLASHGPT_AUTOTUNE", "autotune_min_keys": "FLASHGPT_AUTOTUNE_MIN_KEYS",
       "autotune_cache": "FLASHGPT_AUTOTUNE_CACHE", "tma": "FLASHGPT_TMA", "tma_min_block_d": "FLASHGPT_TMA_MIN_D",
       "lpt": "FLASHGPT_LPT", "fast_launch": "FLASHGPT_FAST_LAUNCH", "backward": "FLASHGPT_BWD",
       "fused_dq": "FLASHGPT_FUSED_DQ", "pdl": "FLASHGPT_PDL", "loss_kernel": "FLASHGPT_CE",
       "decode_min_keys_per_split": "FLASHGPT_DECODE_MIN_KEYS_PER_SPLIT", "llama_kernels": "FLASHGPT_LLAMA_KERNELS",
       "hopper_forward": "FLASHGPT_HOPPER_FWD", "hopper_backward": "FLASHGPT_HOPPER_BWD",
       "decode_merge_in_split": "FLASHGPT_DECODE_MERGE_IN_SPLIT", "decode_full_grid": "FLASHGPT_DECODE_FULL_GRID",
       "decode_full_grid_max_len": "FLASHGPT_DECODE_FULL_GRID_MAX_LEN",
       "decode_full_grid_long_splits": "FLASHGPT_DECODE_FULL_GRID_LONG_SPLITS",
       "decode_full_grid_pdl": "FLASHGPT_DECODE_FULL_GRID_PDL",
       "decode_short_splits": "FLASHGPT_DECODE_SHORT_SPLITS",
       "rope_in_flash": "FLASHGPT_ROPE_IN_FLASH", "lora_addmm": "FLASHGPT_LORA_ADDMM",
       "decode_split_order": "FLASHGPT_DECODE_SPLIT_ORDER", "decode_tma": "FLASHGPT_DECODE_TMA",
       "decode_min_rows": "FLASHGPT_DECODE_MIN_ROWS", "decode_key_parts": "FLASHGPT_DECODE_KEY_PARTS",
       "hopper_tile_lists": "FLASHGPT_HOPPER_TILE_LISTS", "hopper_early_q": "FLASHGPT_HOPPER_EARLY_Q",
       "hopper_consumers_d64": "FLASHGPT_HOPPER_CONSUMERS_D64", "hopper_own_blocks": "FLASHGPT_HOPPER_OWN_BLOCKS",
       "hopper_lane_sums": "FLASHGPT_HOPPER_LANE_SUMS",
       "decode_fused_mlp": "FLASHGPT_DECODE_FUSED_MLP", "decode_stack": "FLASHGPT_DECODE_STACK",
       "decode_stack_merged_sums": "FLASHGPT_DECODE_STACK_MERGED_SUMS"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _parse(text: str, default):
    """An override's value, of the default's type."""
    value = text.strip()
    if isinstance(default, bool):
        return True if value.lower() in _TRUE else False if value.lower() in _FALSE else text
    if isinstance(default, int) or default is None:  # the int options (tma_min_block_d defaults to None)
        try:
            return int(value)
        except ValueError:
            return text
    return value


def from_env(environ=None, **defaults) -> KernelOptions:
    """The default options (KernelOptions's, or those given) with the overrides found in `environ` (default:
    os.environ) applied on top; a bad value is a ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    defaults, changes = KernelOptions(**defaults), {}
    for f in dataclasses.fields(KernelOptions):
        var = ENV[f.name]
        if var in environ:
            value = _parse(environ[var], getattr(defaults, f.name))
            problem = _problem(f.name, value)
            if problem:
                raise ValueError(f"{var}={environ[var]!r}: {problem.replace('True or False', '1 or 0')}")
            changes[f.name] = value
    return dataclasses.replace(defaults, **changes)


_current: KernelOptions | None = None


def get() -> KernelOptions:
    """The options in force (the environment's overrides are read by the first call)."""
    global _current
    if _current is None:
        _current = from_env()
    return _current


def _replaced(changes: dict) -> KernelOptions:
    names = {f.name for f in dataclasses.fields(KernelOptions)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ValueError(f"unknown kernel option {unknown[0]!r}; options: {', '.join(sorted(names))}")
    return dataclasses.replace(get(), **changes)


def update(**changes) -> KernelOptions:
    """Replace the given options for the rest of the process; returns the options now in force."""
    global _current
    _current = _replaced(changes)
    return _current


@contextlib.contextmanager
def use(**changes):
    """Replace the given options inside a with-block (restored on exit); yields the options in force."""
    with _using(_replaced(changes)) as new:
        yield new


@contextlib.contextmanager
def use_defaults(**defaults):
    """Inside a with-block, the given defaults (a program's own choices) with the environment's overrides on top,
    in place of the options in force; yields them."""
    with _using(from_env(**defaults)) as new:
        yield new


@contextlib.contextmanager
def _using(new: KernelOptions):
    global _current
    old, _current = get(), new
    try:
        yield new
    finally:
        _current = old
