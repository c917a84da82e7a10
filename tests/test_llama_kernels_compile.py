"""The training-step kernels for Llama-family blocks (kernels/rmsnorm.py, swiglu.py, rope.py) compile for a Hopper
GPU (sm_90), checked on any machine.

Triton's interpreter, which runs tests/test_llama_kernels.py on a CPU, accepts kernels that its compiler rejects;
here each launch of the kernels' own wrappers is turned into a compile to PTX and a cubin (tests/gpu_compile.py),
in a child process started with TRITON_INTERPRET=0 and an empty Triton cache, at SmolLM2-135M's widths (n_embd
576, intermediate 1536, head dim 64) in bf16, RMSNorm also on float32 x and weight (the residual stream under
autocast) and on rows of 8192 and 16384 (the widest tiles), RoPE also with per-sequence tables and head dim 80.
The child prints a JSON list with a record per compiled variant.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

H200_SMS = 132
DTYPE_ARG = {"_rms_fwd": "X", "_rms_bwd": "X", "_sum_partials": "OUT", "_swiglu_fwd": "H", "_swiglu_bwd": "H",
             "_rope_qkv": "X"}  # the argument whose pointer dtype is the variant's dtype


def _record(c) -> dict:
    names = c.src.fn.arg_names
    consts = {names[path[0]]: v for path, v in c.src.constants.items() if isinstance(v, (bool, int, str))}
    return dict(kernel=c.name, dtype=c.src.signature[DTYPE_ARG[c.name]][1:], consts=consts,
                ptx_entry=f".entry {c.name}(" in c.asm["ptx"], cubin_bytes=len(c.asm.get("cubin") or b""))


def compile_launches() -> list[dict]:
    """Run in a process started with TRITON_INTERPRET=0: the forward and backward launches compiled for sm_90."""
    import torch

    import kernels._triton as kt
    import kernels.rmsnorm as rms
    import kernels.rope as rope
    import kernels.swiglu as sw
    from tests.gpu_compile import compiling_instead_of_launching

    kt.check_device = lambda device, what: None  # CPU tensors stand in for the GPU's; nothing is launched
    kt.sm_count = lambda device: H200_SMS
    M = 64
    launched = (rms._rms_fwd, rms._rms_bwd, rms._sum_partials, sw._swiglu_fwd, sw._swiglu_bwd, rope._rope_qkv)
    with compiling_instead_of_launching(*launched) as compiled, torch.no_grad():
        for x_dtype, w_dtype, N in ((torch.bfloat16, torch.bfloat16, 576), (torch.float32, torch.float32, 576),
                                    (torch.bfloat16, torch.float32, 576), (torch.bfloat16, torch.bfloat16, 8192),
                                    (torch.bfloat16, torch.bfloat16, 16384)):
            x, w = torch.randn(M, N, dtype=x_dtype), torch.ones(N, dtype=w_dtype)
            y, rstd = rms._fwd(x, w, 1e-5)
            rms._bwd(y, x, w, rstd)
        h = torch.randn(M, 2 * 1536, dtype=torch.bfloat16)  # (M, 2I)
        sw._bwd(sw._fwd(h), h)
        for B, T, D, per_seq in ((2, 32, 64, False), (2, 32, 80, True)):
            qkv = torch.randn(B, T, 15 * D, dtype=torch.bfloat16)  # 9 q heads, 3 kv heads
            cos = torch.randn(*((B, T, D) if per_seq else (T, D)), dtype=torch.bfloat16)
            rope._bwd(rope._fwd(qkv, cos, cos, 9, 3), cos, cos, 9, 3)
    return [_record(c) for c in compiled]


REQUIRED = [  # (kernel, pointer dtype, constexprs that must be among the variant's)
    ("_rms_fwd", "bf16", {"BLOCK_N": 1024}), ("_rms_bwd", "bf16", {"BLOCK_N": 1024}),
    ("_rms_fwd", "fp32", {"BLOCK_N": 1024}), ("_rms_bwd", "fp32", {"BLOCK_N": 1024}),
    ("_rms_fwd", "bf16", {"BLOCK_N": 8192}), ("_rms_bwd", "bf16", {"BLOCK_N": 8192}),
    ("_rms_fwd", "bf16", {"BLOCK_N": 16384}), ("_rms_bwd", "bf16", {"BLOCK_N": 16384}),
    ("_sum_partials", "bf16", {}), ("_sum_partials", "fp32", {}),
    ("_swiglu_fwd", "bf16", {"BLOCK_I": 1024}), ("_swiglu_bwd", "bf16", {"BLOCK_I": 1024}),
    ("_rope_qkv", "bf16", {"BACKWARD": False, "HALF": 32}), ("_rope_qkv", "bf16", {"BACKWARD": True, "HALF": 32}),
    ("_rope_qkv", "bf16", {"BACKWARD": False, "HALF": 40}), ("_rope_qkv", "bf16", {"BACKWARD": True, "HALF": 40}),
]


def test_llama_training_kernels_compile_for_hopper(tmp_path):
    """Every variant the wrappers launch at these shapes compiles to PTX with its entry and to a cubin, and the
    variants named in REQUIRED are among them."""
    from tests.util import ROOT, pythonpath

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton"),
               PYTHONPATH=pythonpath(ROOT))
    proc = subprocess.run([sys.executable, "-m", "tests.test_llama_kernels_compile"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = json.loads(proc.stdout)
    for rec in records:
        assert rec["ptx_entry"] and rec["cubin_bytes"] > 0, rec
    missing = [req for req in REQUIRED if not any(
        rec["kernel"] == req[0] and rec["dtype"] == req[1] and req[2].items() <= rec["consts"].items()
        for rec in records)]
    assert not missing, f"no compiled variant for: {missing}"


if __name__ == "__main__":
    json.dump(compile_launches(), sys.stdout)
