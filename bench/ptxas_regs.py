"""Registers, spills and shared memory of the attention kernels' tile configs on sm_90a, without a GPU.

    TRITON_INTERPRET=0 python bench/ptxas_regs.py [--out DIR] [--kernels fwd,dq,dkdv,dkdvq] [--head-dims 64,128]

Compiles each config of kernels/flash.py's autotune lists for Hopper (Triton's ahead-of-time compile to PTX,
then ptxas from Triton's wheel with -v) for bf16, causal and not, with the load path the host would pick
(TMA descriptors per TMA_MIN_BLOCK_D), the per-head grid (LPT off) and the pointer/stride specialisation of
contiguous (B, N, H, D) inputs. dkdvq is the fused backward's dK/dV kernel (FLASHGPT_BWD=fused) adding dQ
with TMA reduce-adds.
A kernel that sits at 255 registers or spills is register-bound: the dK/dV kernel's did before its loop over
the GQA heads was flattened (bench/NOTES.md). Static numbers only: the benchmark is bench/attention.py.
Writes ptxas_regs.md into --out.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile the real kernels (kernels/flash.py reads this at import)
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels.flash as fa  # noqa: E402

_PTRS = ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "LSE", "DELTA", "DQACC")
_FP32_PTRS = ("LSE", "DELTA", "DQACC")
_SCALARS = ("qk_scale", "sm_scale")


def compile_report(kernel: str, cfg, head_dim: int, causal: bool) -> dict:
    fn = {"fwd": fa._attn_fwd, "dq": fa._attn_bwd_dq, "dkdv": fa._attn_bwd_dkdv, "dkdvq": fa._attn_bwd_dkdv}[kernel]
    bm, bn, warps, stages = cfg
    tma = fa._block_d(head_dim) >= fa.TMA_MIN_BLOCK_D["dkdv" if kernel == "dkdvq" else kernel]
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=fa._block_d(head_dim), CAUSAL=causal, DOT_PRECISION="tf32", TMA=tma,
                  LPT=False, BLOCK_M=bm, BLOCK_N=bn)
    if "GQA" in fn.arg_names:
        consts["GQA"] = False
        consts["FUSED_DQ"] = 2 if kernel == "dkdvq" else 0  # dkdvq: the fused backward's, dQ by TMA reduce-adds
    consts.update({n: 1 for n in fn.arg_names if n.startswith("stride") and n.endswith("d")})  # unit D stride
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in _PTRS:
            sig[name] = "*fp32" if name in _FP32_PTRS else "*bf16"
        elif name in _SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or (name.startswith("stride") and name not in consts):
            attrs[(i,)] = [["tt.divisibility", 16]]  # 16-byte aligned pointers, strides divisible by 16
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
    if not ptxas.exists():
        ptxas = ptxas.with_name("ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = pathlib.Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        r = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                           capture_output=True, text=True)
    text = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"kernel": kernel, "cfg": cfg, "D": head_dim, "causal": causal, "tma": tma,
            "regs": int(regs.group(1)) if regs else None,
            "spill_st": int(spill.group(1)) if spill else None, "spill_ld": int(spill.group(2)) if spill else None,
            "smem": compiled.metadata.shared, "serialised": "C7515" in text}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--kernels", default="fwd,dq,dkdv")
    p.add_argument("--head-dims", default="64,128")
    args = p.parse_args(argv)
    rows = []
    for kernel in args.kernels.split(","):
        for head_dim in map(int, args.head_dims.split(",")):
            for cfg in fa.gpu_configs(kernel, torch.bfloat16, head_dim):
                for causal in (True, False):
                    r = compile_report(kernel, cfg, head_dim, causal)
                    rows.append(r)
                    print(r, flush=True)
    cmd = "TRITON_INTERPRET=0 python bench/ptxas_regs.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# Registers per thread on sm_90a (ptxas -v), triton {triton.__version__}", "",
             f"`{cmd.strip()}` — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; bf16. "
             "255 registers or any spill: register-bound. `serialised`: ptxas warning C7515 (wgmma serialised).", "",
             "| kernel | D | causal | BLOCK_M×BLOCK_N, warps, stages | TMA | registers | spill st/ld (B) | smem (B) | "
             "serialised |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        bm, bn, w, s = r["cfg"]
        lines.append(f"| {r['kernel']} | {r['D']} | {'yes' if r['causal'] else 'no'} | {bm}×{bn}, w{w}, s{s} | "
                     f"{'yes' if r['tma'] else 'no'} | {r['regs']} | {r['spill_st']}/{r['spill_ld']} | {r['smem']} | "
                     f"{'yes' if r['serialised'] else ''} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ptxas_regs.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
