"""Compile Triton kernels for a GPU on a machine without one, through the project's own launch code.

    with compiling_instead_of_launching(kernel_a, kernel_b) as compiled:
        wrapper(...)                      # every kernel_a[grid](...) inside compiles, launches nothing
    compiled                              # [CompiledKernel], in launch order (repeats of one variant: once)
    describe(c, dtype_arg)                # one compiled variant as plain data (for the parent process)
    ptxas_usage(c)                        # its registers and spill bytes per thread, from `ptxas -v`,
                                          # and whether ptxas serialised its wgmmas

Triton's interpreter accepts kernels that its compiler rejects (a plain Python global read inside a kernel, for
one), so a kernel tested only on the CPU can still fail to build on a GPU. Inside the context each launch goes
through Triton's own JITFunction.run with warmup=True against a stand-in driver whose target is TARGET (sm_90):
Triton binds and specialises the arguments exactly as at a GPU launch (pointer dtypes, integers equal to 1 as
constants, divisibility by 16) and compiles them to PTX and, with the ptxas Triton ships, a cubin, without
touching a device. The wrappers themselves must accept the tensors given (CPU tensors: the caller switches off
their CUDA device checks).

Needs a process whose kernels were decorated with TRITON_INTERPRET=0 (the tests run the interpreter: start a
subprocess). Nothing is launched, so results of the wrapped calls are unwritten buffers.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile

from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)  # Hopper (H100 / H200)


class _TargetOnlyDriver:
    """What JITFunction.run asks the active driver for before it compiles: a device, a stream, a target."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


@contextlib.contextmanager
def compiling_instead_of_launching(*kernels: JITFunction, target: GPUTarget = TARGET):
    """Within the context, launching any of `kernels` compiles it for `target` and launches nothing; yields
    the list that receives each newly compiled variant (CompiledKernel)."""
    for k in kernels:
        if not isinstance(k, JITFunction):
            raise TypeError(f"{k!r} is not a compiled-mode Triton kernel (is TRITON_INTERPRET=1 set?)")
    compiled: list = []
    seen: set = set()

    def compile_only(kernel):
        def run(*args, grid, warmup, **kwargs):
            c = JITFunction.run(kernel, *args, grid=grid, warmup=True, **kwargs)
            if id(c) not in seen:  # Triton's per-kernel cache returns the same object for a repeated variant
                seen.add(id(c))
                compiled.append(c)
            return c
        return run

    previous = driver._active  # not driver.active: that would create the default driver, which needs a GPU
    driver.set_active(_TargetOnlyDriver(target))
    for k in kernels:
        k.run = compile_only(k)  # an instance attribute: k[grid](...) calls it instead of JITFunction.run
    try:
        yield compiled
    finally:
        for k in kernels:
            del k.run
        driver._active = previous


def describe(c, dtype_arg: dict) -> dict:
    """One compiled variant: kernel name, dtype (of the pointer argument dtype_arg[name] names), constexprs by
    name, whether the PTX holds its entry, cubin size."""
    names = c.src.fn.arg_names
    consts = {names[path[0]]: v for path, v in c.src.constants.items() if isinstance(v, (bool, int, str))}
    return dict(kernel=c.name, dtype=c.src.signature[dtype_arg[c.name]][1:], consts=consts,
                ptx_entry=f".entry {c.name}(" in c.asm["ptx"], cubin_bytes=len(c.asm.get("cubin") or b""))


def ptxas_usage(c) -> dict:
    """registers, spill_stores, spill_loads (bytes per thread) of one compiled variant: its PTX assembled again by
    the ptxas Triton ships, with `-v` and the options Triton 3.9's own cubin step passes (line info, register
    allocation level 2, fused multiply-add as the variant was compiled), for the variant's target."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    arch = c.metadata.target.arch
    options = ["-lineinfo", "-v", "--regAllocOptLevel=2"] + ([] if c.metadata.enable_fp_fusion else ["--fmad=false"])
    options += (c.metadata.ptx_options or "").split()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(c.asm["ptx"])
        cmd = [get_ptxas(arch).path, *options, f"--gpu-name={sm_arch_from_capability(arch)}", src,
               "-o", os.path.join(tmp, "kernel.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output for {c.name}: {log[-2000:]}")
    # ptxas's notes C7510-C7519: "wgmma.mma_async instructions are serialized due to ..." (a wgmma in flight
    # across a loop's back edge, accumulator registers touched by other instructions, too few registers)
    serialized = sorted(set(re.findall(r"\((C751\d)\) Potential Performance Loss: wgmma", log)))
    return dict(registers=int(regs.group(1)), spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)),
                wgmma_serialized=serialized)
