"""Whether the split-KV decode's host plan (grid, tile, launches) in this tree is the one of another revision.

    python bench/decode_plan_diff.py --base 8c51b0f      # a line per differing case, exit 0 when none differs

decode_attention plans on the host from the shapes, the SM count and an SM's shared memory: the split count,
the tile (keys per step, stages) and whether a merge launch follows. A change to that planning (or to the
shared-memory model it uses) should say which plans it moves; this runs the default path of each tree over
SHAPES x GPUS x dtypes x LENGTHS, its launches recorded instead of made (a child process per tree under
Triton's interpreter, CPU tensors standing in for the GPU's: nothing is computed), and lists each case whose
launches differ. Default options only (the options of the two trees may differ). The base tree is
`git archive REV` of this repository (bench/decode_ptx_diff.py: the same check of the compiled instructions).
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from bench.tree_compare import child_result, compare_main  # noqa: E402
# (name, shared memory per SM in bytes, SMs): what kernels._triton reports for such a GPU
GPUS = [("H100/H200", 233472, 132), ("A100", 167936, 108), ("L4/RTX", 101376, 58), ("T4", 65536, 40)]
# (query heads, kv heads, head dim): GPT-2, Llama-3-style GQA, Qwen-style d128, Gemma-style d256, odd groups
SHAPES = [(12, 12, 64), (32, 8, 64), (16, 8, 128), (16, 16, 128), (8, 1, 256), (9, 3, 64), (15, 5, 64),
          (22, 22, 64)]
BATCHES = (1, 2, 3, 8, 16, 32)
LENGTHS = (600, 1024, 2048, 4096, 32768)
DTYPES = ("bfloat16", "float32")


def child(tree: str) -> None:
    """In a child process: the plans of `tree`'s decode_attention; print {case: [launch, ...]} as JSON."""
    sys.path.insert(0, tree)
    import torch

    import kernels._triton as kt
    import kernels.decode as decode
    if not os.path.abspath(decode.__file__).startswith(os.path.abspath(tree)):
        raise SystemExit(f"error: imported {decode.__file__}, not {tree}'s kernels")
    made: list = []

    def record(kernel, grid, tensors, scalars, consts, launch):
        name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
        made.append([name, list(grid), consts.get("BLOCK_N"), launch.get("num_warps"), launch.get("num_stages")])
    decode._launch = record
    kt.check_device = lambda device, what: None
    plans = {}
    for gpu, smem, sms in GPUS:
        kt.smem_per_sm = lambda device, smem=smem: smem
        kt.sm_count = lambda device, sms=sms: sms
        for hq, hkv, d in SHAPES:
            for batch in BATCHES:
                for dtype in DTYPES:
                    for length in LENGTHS:
                        q = torch.empty(batch, hq, 1, d, dtype=getattr(torch, dtype))      # (B, Hq, 1, D)
                        cache = torch.empty(batch, hkv, length, d, dtype=q.dtype)          # (B, Hkv, L, D)
                        made.clear()
                        decode.decode_attention(q, cache, cache, torch.full((batch,), length), check_lens=False)
                        plans[f"{gpu} B={batch} Hq={hq} Hkv={hkv} D={d} {dtype} L={length}"] = list(made)
    print(json.dumps(plans))


def plan_tree(tree: str) -> dict[str, list]:
    return child_result(os.path.abspath(__file__), tree, dict(TRITON_INTERPRET="1"), "planning the decode")


def describe(launches: list) -> str:
    """A case's launches in one line: kernel grid, keys per step, warps, stages."""
    return "; ".join(f"{name.strip('_')} grid={tuple(grid)} n={n} w={w} s={s}" for name, grid, n, w, s in launches)


def report(rev: str, base: dict[str, list], head: dict[str, list]) -> int:
    differ = [case for case in head if base.get(case) != head[case]]
    for case in differ:
        print(f"{case}\n    {rev}: {describe(base.get(case, []))}\n    here: {describe(head[case])}")
    print(f"{len(head)} cases planned: {len(differ)} not as in {rev}")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    return compare_main(argv, __doc__, child, plan_tree, report)


if __name__ == "__main__":
    sys.exit(main())
