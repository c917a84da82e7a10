"""Does Triton's automatic warp specialization (Hopper) speed up a causal attention forward at GPT-2's shape?

    python bench/ws_probe.py [--shape 16,12,1024,64] [--out DIR]

A probe, not a kernel of the framework: a minimal causal forward (bf16, (B·H, N, D) contiguous, N a multiple
of every tile, D = 64 or 128) whose K/V loop is `tl.range(..., warp_specialize=WS)` with every load through TMA
descriptors, in two forms Triton's Hopper pass accepts: one loop over every key block up to the diagonal with
the causal mask applied to every tile ("mask-all"), and an unmasked loop followed by the diagonal blocks
unrolled ("split-diag"). Local compiles (Triton 3.9, sm_90) showed that the pass rejects a kernel with a second
loop after the specialised one and silently skips a loop with a branch inside — the shape of kernels/flash.py's
kernels — so this measures what specialisation would buy before restructuring them. Each variant is checked
against PyTorch's SDPA and timed (do_bench median) next to kernels/flash.py's forward and SDPA itself.
Writes ws_probe.md into --out.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.report import write_report  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _probe_step(acc, l_i, m_i, q, kd, vd, start_n, offs_m, offs_n, qk_scale, MASK: tl.constexpr):
    k = kd.load([start_n, 0])  # (BLOCK_N, D)
    qk = tl.dot(q, k.T) * qk_scale  # (BLOCK_M, BLOCK_N) base-2 scores
    if MASK:
        qk = tl.where(start_n + offs_n[None, :] <= offs_m[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # (BLOCK_M,)
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = vd.load([start_n, 0])  # (BLOCK_N, D)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # (BLOCK_M, D)
    return acc, l_i, m_new


@triton.jit
def _probe_fwd(Q, K, V, O, N, qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WS: tl.constexpr, SPLIT_DIAG: tl.constexpr):
    """Causal forward of BLOCK_M query rows of one (batch, head): bf16/fp16, (B·H, N, D) contiguous, N a multiple
    of BLOCK_M and BLOCK_N, BLOCK_M a multiple of BLOCK_N. grid (N // BLOCK_M, B·H), heaviest blocks first."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    base = tl.program_id(1).to(tl.int64) * N * D
    qd = tl.make_tensor_descriptor(Q + base, shape=[N, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    kd = tl.make_tensor_descriptor(K + base, shape=[N, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    vd = tl.make_tensor_descriptor(V + base, shape=[N, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    od = tl.make_tensor_descriptor(O + base, shape=[N, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    q = qd.load([start_m, 0])  # (BLOCK_M, D)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if SPLIT_DIAG:
        for start_n in tl.range(0, start_m, BLOCK_N, warp_specialize=WS):
            acc, l_i, m_i = _probe_step(acc, l_i, m_i, q, kd, vd, start_n, offs_m, offs_n, qk_scale, False)
        for i in tl.static_range(BLOCK_M // BLOCK_N):
            acc, l_i, m_i = _probe_step(acc, l_i, m_i, q, kd, vd, start_m + i * BLOCK_N, offs_m, offs_n, qk_scale,
                                        True)
    else:
        for start_n in tl.range(0, start_m + BLOCK_M, BLOCK_N, warp_specialize=WS):
            acc, l_i, m_i = _probe_step(acc, l_i, m_i, q, kd, vd, start_n, offs_m, offs_n, qk_scale, True)
    od.store([start_m, 0], (acc / l_i[:, None]).to(O.dtype.element_ty))


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="16,12,1024,64", help="B,H,N,D (causal, bf16)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/ws_probe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import torch.nn.functional as F

    from kernels import flash as fa

    B, H, N, D = (int(x) for x in args.shape.split(","))
    triton.set_allocator(_alloc)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    scale = D ** -0.5
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")  # noqa: E731
    rows = [("SDPA (torch's pick)", bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), 0.0, ""),
            ("kernels/flash.py forward (autotuned)", bench(lambda: fa._fwd(q, k, v, True, scale)),
             (fa._fwd(q, k, v, True, scale)[0].float() - ref.float()).abs().max().item(), "")]
    for form, split_diag in (("mask-all", False), ("split-diag", True)):
        for bm, bn, warps, stages in ((128, 64, 4, 2), (128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3),
                                      (128, 128, 4, 2), (128, 64, 8, 3)):
            for ws in (False, True):
                name = f"probe {form} {bm}x{bn} w{warps} s{stages}{' WS' if ws else ''}"
                o = torch.full_like(q, float("nan"))
                fn = lambda: _probe_fwd[(N // bm, B * H)](q, k, v, o, N, scale * 1.4426950408889634, D=D,  # noqa: E731
                                                          BLOCK_M=bm, BLOCK_N=bn, WS=ws, SPLIT_DIAG=split_diag,
                                                          num_warps=warps, num_stages=stages)
                try:
                    kernel = fn()
                    torch.cuda.synchronize()
                except Exception as e:  # the pass rejects some forms: record it, go on
                    rows.append((name, None, None, f"compile failed: {str(e).splitlines()[0][:80]}"))
                    print(rows[-1], flush=True)
                    continue
                err = (o.float() - ref.float()).abs().max().item()
                warps_run = getattr(getattr(kernel, "metadata", None), "num_warps", "?")
                rows.append((name, bench(fn), err, f"{warps_run} warps launched"))
                print(rows[-1], flush=True)
    lines = [f"# Warp-specialised causal forward probe at (B, H, N, D) = ({B}, {H}, {N}, {D}), bf16 — "
             f"{torch.cuda.get_device_name()}", "",
             f"`python bench/ws_probe.py {' '.join(argv if argv is not None else sys.argv[1:])}` — "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, torch {torch.__version__}, "
             f"triton {triton.__version__}; do_bench medians; error = max |O - SDPA's O|", "",
             "| variant | µs | max error | note |", "| --- | --- | --- | --- |"]
    for name, t, err, note in rows:
        lines.append(f"| {name} | {'—' if t is None else f'{t * 1e3:.1f}'} | "
                     f"{'—' if err is None else f'{err:.2e}'} | {note} |")
    write_report(args.out, "ws_probe.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
