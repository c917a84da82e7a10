"""Whether the split-KV decode kernels of this tree compile to the same sm_90 instructions as another revision's.

    python bench/decode_ptx_diff.py --base 254701c        # a line per variant, exit 0 when every one is the same

A change to kernels/decode.py that should leave the default path as it was (a new option, off; a refactor) is
checked here without a GPU: each tree's decode_attention runs the variants of VARIANTS through
tests/gpu_compile.py (every launch compiled for sm_90 by Triton's own launch code, nothing launched), in a child
process per tree started with TRITON_INTERPRET=0, and the PTX of each compiled variant is compared with its
debug information and the labels of inlined scopes left out. The base tree is `git archive REV` of this
repository. Variants are matched by kernel, dtype, warps, stages and constexprs (a constexpr the base lacks is
left out of the key when it has its default value, False).
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from bench.tree_compare import child_result, compare_main  # noqa: E402
SMS = 132  # the H100 / H200
# (batch, heads, valid length, cache capacity, head dim, window): GPT-2's batch 1 (the automatic split count) and
# batch 16 (the full grid's one split), head dim 128, a short cache with a window
VARIANTS = [(1, 12, 4096, 4096, 64, 0), (16, 12, 1000, 1024, 64, 0), (1, 8, 600, 1024, 128, 0),
            (2, 4, 300, 512, 64, 128)]


def normalised_ptx(ptx: str) -> str:
    """The PTX without its DWARF sections, comments and the bare labels that mark inlined scopes."""
    lines = ptx.splitlines()
    end = next((i for i, line in enumerate(lines) if re.match(r"\s*\.section\s+\.debug", line)), len(lines))
    keep = [line for line in lines[:end] if line.strip() and not line.strip().startswith((".loc", ".file", "//"))]
    return "\n".join(re.sub(r"\$L__\w+", "L", line) for line in keep if not re.fullmatch(r"\s*\$?L\w*:\s*", line))


def child(tree: str) -> None:
    """In a TRITON_INTERPRET=0 process: compile VARIANTS with `tree`'s kernels; print {key: PTX digest}."""
    sys.path.insert(0, tree)
    spec = importlib.util.spec_from_file_location("_gpu_compile", os.path.join(ROOT, "tests", "gpu_compile.py"))
    gpu_compile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_compile)
    import torch

    import kernels._triton as kt
    import kernels.decode as decode
    from kernels import options
    from kernels.pdl import triton_has_gdc
    if not os.path.abspath(decode.__file__).startswith(os.path.abspath(tree)):
        raise SystemExit(f"error: imported {decode.__file__}, not {tree}'s kernels")
    kt.check_device = lambda device, what: None  # CPU tensors stand in for the GPU's
    kt.sm_count = lambda device: SMS
    decode.pdl_enabled = lambda device: triton_has_gdc() and options.get().pdl
    kernels = (decode._decode_split_kernel, decode._decode_merge_kernel)
    digests = {}
    with gpu_compile.compiling_instead_of_launching(*kernels) as compiled, torch.no_grad():
        for dtype in (torch.float16, torch.bfloat16):
            for merge in (False, True):
                for B, H, L, cap, D, window in VARIANTS:
                    q, cache = torch.randn(B, H, 1, D).to(dtype), torch.randn(B, H, cap, D).to(dtype)
                    with options.use(pdl=True, decode_merge_in_split=merge):
                        decode.decode_attention(q, cache, cache, torch.full((B,), L), check_lens=False,
                                                window=window)
    # a constexpr at its signature default is left out of the key, so that one added with a default (the
    # launches that leave it out) compares with a tree that does not have it
    defaults = {k.fn.__name__: {n: p.default for n, p in inspect.signature(k.fn).parameters.items()
                                if p.default is not inspect.Parameter.empty} for k in kernels}
    for c in compiled:
        rec = gpu_compile.describe(c, {"_decode_split_kernel": "Q", "_decode_merge_kernel": "OUT"})
        dflt = defaults.get(rec["kernel"], {})
        consts = {k: v for k, v in rec["consts"].items() if v is not False and not (k in dflt and v == dflt[k])}
        key = (f"{rec['kernel']} {rec['dtype']} warps={c.metadata.num_warps} stages={c.metadata.num_stages} "
               + " ".join(f"{k}={v}" for k, v in sorted(consts.items())))
        n = sum(k.split(" #")[0] == key for k in digests)  # one key specialised twice (argument divisibility)
        digests[f"{key} #{n + 1}"] = hashlib.sha256(normalised_ptx(c.asm["ptx"]).encode()).hexdigest()[:16]
    print(json.dumps(digests))


def compile_tree(tree: str) -> dict[str, str]:
    env = dict(TRITON_INTERPRET="0", TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="ptx-diff-cache-"))
    return child_result(os.path.abspath(__file__), tree, env, "compiling the decode kernels")


def report(rev: str, base: dict[str, str], head: dict[str, str]) -> int:
    differ = 0
    for key in sorted(set(base) | set(head)):
        verdict = ("same" if base[key] == head[key] else "DIFFERS") if key in base and key in head else \
            ("only in the base" if key in base else "only in this tree")
        differ += verdict != "same"
        print(f"{verdict:17s} {key}")
    print(f"{len(head)} variants compiled here, {len(base)} in {rev}: {differ} not the same")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    return compare_main(argv, __doc__, child, compile_tree, report)


if __name__ == "__main__":
    sys.exit(main())
