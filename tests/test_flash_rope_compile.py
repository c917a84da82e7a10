"""The flash backward with RoPE tables (ROPE) compiles for a Hopper GPU (sm_90) on any machine, and its rotation
costs the kernels no spills.

The split backward of the packed call (kernels/flash/launch.py: _packed_bwd) runs through the project's own
launch code with each launch turned into a compile (tests/gpu_compile.py), in a child process started with
TRITON_INTERPRET=0, for the SmolLM2-135M attention shape (9 query, 3 KV heads, head dim 64) and a head dim 128
one, bf16, with and without the tables, each kernel in the first (default) config of its list. `ptxas -v`
counts registers and spill bytes per variant: a ROPE variant may spill no more than the same launch without
the tables, and take at most 8 more registers. No variant may have its wgmmas serialised by ptxas.
"""
from __future__ import annotations

import json
import sys

SHAPES = {64: (9, 3), 128: (8, 2)}  # head dim -> (query heads, kv heads)
N = 2048


def compile_rope_backward() -> list[dict]:
    """Run in a process started with TRITON_INTERPRET=0: the split backward's launches, with and without the
    RoPE tables, compiled for sm_90."""
    import torch

    import kernels._triton as kt
    from kernels import options
    from kernels.flash import launch
    from kernels.flash.backward import _attn_bwd_dkdv, _attn_bwd_dq
    from tests.gpu_compile import compiling_instead_of_launching, ptxas_usage

    kt.check_device = lambda device, what: None  # CPU tensors stand in for the GPU's; nothing is launched
    launch._hopper_or_newer = lambda index: True  # sm_90: the TMA loads a Hopper launch takes
    records = []
    for D, (nh, nkv) in SHAPES.items():
        qkv = torch.empty(2, N, (nh + 2 * nkv) * D, dtype=torch.bfloat16)
        o = torch.empty(2, N, nh, D, dtype=torch.bfloat16).transpose(1, 2)  # (B, H, N, D), laid out like q
        lse = torch.empty(2, nh, N)
        tables = (torch.empty(N, D, dtype=torch.bfloat16), torch.empty(N, D, dtype=torch.bfloat16))
        for rope in (None, tables):
            with options.use(autotune=False, fast_launch=False, backward="split"), \
                    compiling_instead_of_launching(_attn_bwd_dq, _attn_bwd_dkdv) as compiled:
                launch._packed_bwd(torch.empty_like(o), qkv, o, lse, nh, nkv, True, D ** -0.5, rope=rope)
            for c in compiled:
                consts = {c.src.fn.arg_names[path[0]]: v for path, v in c.src.constants.items()}
                records.append(dict(kernel=c.name, head_dim=D, rope=bool(consts["ROPE"]),
                                    ptx_entry=f".entry {c.name}(" in c.asm["ptx"],
                                    cubin_bytes=len(c.asm.get("cubin") or b""), **ptxas_usage(c)))
    return records


def test_rope_backward_compiles_for_hopper_without_more_spills(tmp_path):
    from tests.util import compiled_records
    records = compiled_records("tests.test_flash_rope_compile", tmp_path)
    found = {(r["kernel"], r["head_dim"], r["rope"]): r for r in records}
    assert set(found) == {(k, d, rope) for k in ("_attn_bwd_dq", "_attn_bwd_dkdv") for d in SHAPES
                          for rope in (False, True)}
    for (kernel, d, rope), rec in found.items():
        assert not rec["wgmma_serialized"], rec  # ptxas's C751x notes: the kernel's wgmmas serialised
        if not rope:
            continue
        plain = found[(kernel, d, False)]
        assert rec["spill_stores"] <= plain["spill_stores"] and rec["spill_loads"] <= plain["spill_loads"], (rec, plain)
        assert rec["registers"] <= plain["registers"] + 8, (rec, plain)


if __name__ == "__main__":
    json.dump(compile_rope_backward(), sys.stdout)
