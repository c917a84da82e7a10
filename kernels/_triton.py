"""What every Triton kernel module here shares: the interpreter switch, device checks and guards, constants.

    INTERPRET / interpreting()      Triton's interpreter is on for this process (kernels then run on CPU tensors)
    check_decorated(*kernels)       at import of a kernel module: its kernels were decorated as INTERPRET says
    check_device(device, what)      one-line ValueError unless the kernels can run on tensors of `device`
    device_guard(t)                 launch on t's GPU (a no-op when it is the current device, or on the CPU)
    sm_count(device)                streaming multiprocessors of a GPU (4 in the interpreter)
    empty(shape, dtype, device)     the kernels' output buffers (tests replace it to poison outputs with NaN)
    launch_compiled(kernel, grid, vals)   call a compiled kernel's launcher directly (no JITFunction.run)
    LOG2E, SUPPORTED_DTYPES

Triton decides between its compiler and its interpreter when it decorates a kernel, i.e. when a kernel module
is imported, from TRITON_INTERPRET. Nothing here sets it: whoever starts Python decides (tests/conftest.py and
the entry points do where no GPU exists). INTERPRET is read once, when this module is imported, just before
the kernel modules decorate their kernels; each of them checks that it agrees (check_decorated).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton


def _interpreter_requested() -> bool:
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4 reads TRITON_INTERPRET through its knobs
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


INTERPRET = _interpreter_requested()
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """Whether this process runs the Triton kernels in Triton's interpreter (on CPU tensors)."""
    return INTERPRET


def check_decorated(*kernels) -> None:
    """Raise RuntimeError unless every kernel was decorated for the interpreter exactly when INTERPRET is on
    (TRITON_INTERPRET changed between importing this module and a kernel module)."""
    for kernel in kernels:
        if type(kernel).__name__.startswith("Interpreted") != INTERPRET:
            raise RuntimeError(f"{kernel.__module__}.{kernel.__name__} was decorated with Triton's interpreter "
                               f"{'off' if INTERPRET else 'on'}, kernels._triton found it "
                               f"{'on' if INTERPRET else 'off'}: set TRITON_INTERPRET before starting Python")


def check_device(device: torch.device, what: str) -> None:
    """One-line ValueError unless the kernels can run on tensors of `device`: CUDA tensors with compiled
    kernels, CPU tensors in the interpreter."""
    if device.type == ("cpu" if INTERPRET else "cuda"):
        return
    if INTERPRET:
        raise ValueError(f"{what} runs in Triton's interpreter here (TRITON_INTERPRET=1), on CPU tensors: got "
                         f"{device}")
    raise ValueError(f"{what} runs on CUDA, got {device} (on a CPU it runs in Triton's interpreter: start Python "
                     "with TRITON_INTERPRET=1)")


def device_guard(t: torch.Tensor):
    """Launch on t's GPU (Triton launches on the current device); no context switch when it is current."""
    if t.device.type != "cuda" or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter: a token GPU, so that the
    heuristics that fill a GPU with programs still split work in tests)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.lru_cache(maxsize=None)
def hopper_or_newer(device_index: int) -> bool:
    """Whether CUDA device `device_index` is a Hopper (sm_90) or newer GPU: TMA descriptor loads exist there."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _smem_per_sm(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_multiprocessor


def smem_per_sm(device: torch.device) -> int | None:
    """Shared memory of one streaming multiprocessor of a CUDA device, in bytes; None elsewhere."""
    return _smem_per_sm(device.index or 0) if device.type == "cuda" else None


def empty(shape, dtype, device) -> torch.Tensor:
    """Every buffer a kernel writes its outputs into comes from here (tests replace it to poison outputs with
    NaN; modules call it as _triton.empty so that the replacement reaches them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def launch_compiled(kernel, grid: tuple, vals: tuple) -> None:
    """Call a compiled kernel (what a launch `kernel[grid](...)` returned) through its launcher on the current
    device and stream, skipping JITFunction.run's per-call binding and specialisation (microseconds of host
    time per launch). vals: every kernel parameter in order, constexprs included (pointer parameters may be
    tensors or plain integer addresses); the caller keys its cache of compiled kernels so that vals always have
    the signature the kernel was compiled for."""
    device = triton.runtime.driver.active.get_current_device()
    stream = triton.runtime.driver.active.get_current_stream(device)
    hooks = triton.knobs.runtime
    kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, kernel.function,
               kernel.packed_metadata, kernel.launch_metadata(grid, stream, *vals), hooks.launch_enter_hook,
               hooks.launch_exit_hook, *vals)
