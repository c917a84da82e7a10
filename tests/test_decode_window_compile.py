"""The split-KV decode kernels with a sliding window compile for a Hopper GPU (sm_90) on any machine, at no cost
in spills.

decode_attention runs through its own launch code with each launch turned into a compile (tests/gpu_compile.py),
in a child process started with TRITON_INTERPRET=0, at three model shapes (GPT-2's 12 heads, SmolLM2's 9 query
and 3 kv heads, a Llama-style 32 / 8 at head dim 128), batch 1 (split, then merged) and 16, bf16, with and
without a window. `ptxas -v` counts registers and spill bytes: no variant spills, and a windowed one takes no
more registers than leave three of its 4-warp programs resident per SM (what the shared memory of these tiles
allows, kernels.decode.programs_per_sm), nor more than the launch without the window where a full grid runs it unsplit.
(With several splits, the windowed split kernel measured 128-137 registers against 103-105: the key range's
start is a runtime value there; at one program per SM, as batch 1 plans, that costs no residency.)
"""
from __future__ import annotations

import json
import sys

SHAPES = {"gpt2": (12, 12, 64), "smollm2": (9, 3, 64), "llama": (32, 8, 128)}  # name -> Hq, Hkv, head dim
CAPACITY, LENGTH, WINDOW = 8192, 8000, 4096


def compile_decode() -> list[dict]:
    """Run in a process started with TRITON_INTERPRET=0: decode_attention's launches compiled for sm_90."""
    import torch

    import kernels._triton as kt
    from kernels import decode as dec
    from tests.gpu_compile import compiling_instead_of_launching, ptxas_usage

    kt.check_device = lambda device, what: None  # CPU tensors stand in for the GPU's; nothing is launched
    kt.sm_count = lambda device: 132             # an H100 / H200: the split plan of a real launch
    records = []
    for name, (hq, hkv, d) in SHAPES.items():
        for batch in (1, 16):
            q = torch.empty(batch, hq, 1, d, dtype=torch.bfloat16)
            cache = torch.empty(batch, hkv, CAPACITY, d, dtype=torch.bfloat16)
            lens = torch.full((batch,), LENGTH, dtype=torch.int32)
            for window in (0, WINDOW):
                with torch.no_grad(), compiling_instead_of_launching(dec._decode_split_kernel,
                                                                     dec._decode_merge_kernel) as compiled:
                    dec.decode_attention(q, cache, cache, lens, check_lens=False, window=window)
                for c in compiled:
                    records.append(dict(kernel=c.name, shape=name, batch=batch, window=window,
                                        ptx_entry=f".entry {c.name}(" in c.asm["ptx"],
                                        cubin_bytes=len(c.asm.get("cubin") or b""), **ptxas_usage(c)))
    return records


def test_windowed_decode_compiles_for_hopper_without_spills(tmp_path):
    from tests.util import compiled_records
    records = compiled_records("tests.test_decode_window_compile", tmp_path)
    found = {(r["kernel"], r["shape"], r["batch"], r["window"]): r for r in records}
    # every shape's split kernel with and without the window; batch 1 splits, so its merge kernel too
    for name in SHAPES:
        for window in (0, WINDOW):
            assert ("_decode_split_kernel", name, 16, window) in found
            assert ("_decode_merge_kernel", name, 1, window) in found
    for (kernel, name, batch, window), rec in found.items():
        assert rec["spill_stores"] == 0 and rec["spill_loads"] == 0, rec
        assert rec["registers"] * 32 * 4 * 3 <= 65536, rec  # three 4-warp programs in an SM's register file
        if window and batch * SHAPES[name][1] >= 132:  # a full grid (GPT-2 at 16): unsplit, the plain code
            plain = found[(kernel, name, batch, 0)]
            assert rec["registers"] <= plain["registers"], (rec, plain)


if __name__ == "__main__":
    json.dump(compile_decode(), sys.stdout)
