"""Programmatic dependent launch (PDL, Hopper and later): a kernel starts while the one before it finishes.

A decode step is a chain of small kernels, each bound by its own start-up and memory latency rather than by
bandwidth. With PDL a kernel is launched as soon as every program of the previous kernel has signalled
(`gdc_launch_dependents`), so its programs can already stream the step's weights — which no kernel of the
step writes — and only then block in `gdc_wait` until the previous kernel has finished and its writes are
visible. CUDA-graph capture keeps these programmatic edges.

The contract every kernel launched with `launch_pdl=True` here keeps: before its `gdc_wait` it writes nothing
and reads only tensors that no kernel of the chain writes. The decode attention (kernels/decode.py) reads
nothing before its wait, so it uses PDL wherever the device has it. The fused matmuls (kernels/ln_linear.py)
read their weights before the wait, so they use it only when the caller says that no kernel queued before
them writes those weights (`pdl=True`, as model/fused_decode.py does). Because each kernel waits for its
predecessor, which waited for its own, a kernel's wait also covers every earlier kernel.

    pdl_enabled(device) -> bool    CUDA, compute capability >= 9, a Triton with grid dependency control
                                   (3.3 and later), not the interpreter, the pdl option on (kernels.options)
"""
from __future__ import annotations

import functools

import torch

from . import _triton
from . import options as _options


def triton_has_gdc() -> bool:
    """Whether this Triton exposes gdc_wait / gdc_launch_dependents (older ones launch everything plainly)."""
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


@functools.lru_cache(maxsize=None)
def _capability_ok(device: torch.device) -> bool:
    return triton_has_gdc() and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Launch with PDL on this device? The pdl option off (FLASHGPT_PDL=0) turns it off everywhere."""
    if device.type != "cuda" or _triton.INTERPRET or not _options.get().pdl:
        return False
    return _capability_ok(device)
