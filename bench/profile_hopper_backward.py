r"""One call of each attention backward at one shape, for Nsight Compute: the kernels to profile, once each.

    ncu --profile-from-start off --set full -o REPORT \
        python bench/profile_hopper_backward.py --shape 4,16,4096,128 --causal no [--form 3]

For (B, H, N, D), bf16, the forward runs once (kernels/flash/launch.py: _fwd), every backward below runs once
to compile and warm up, and then, between cudaProfilerStart and cudaProfilerStop (what `ncu --profile-from-start
off` profiles), once more each, in this order:

* split   kernels/flash/launch.py: _hopper_bwd, the tl dQ kernel, then the Gluon dK/dV kernel (DQ = 0)
* fused   the same with fused=FORM, by default the form kernels.flash_attention's backward runs at this head dim
          and mask (kernels/flash/launch.py: hopper_bwd_form; --form another): the tl pass storing delta and
          zeroing an fp32 dQ, the Gluon kernel adding dS K into it (forms 3 and 5 through TMA reduce-adds), the
          tl pass converting dQ
* tl      the tl split backward (hopper_backward off)
* cudnn   SDPA's cuDNN backend: one backward of its forward's graph

Kernel names tell them apart in the report (_attn_bwd_dq, _attn_bwd_dkdv, _attn_bwd_dkdv_hopper with its DQ
constant, _attn_bwd_prep, _attn_bwd_dq_out, and cuDNN's). Nothing is timed here: bench/hopper_backward.py times.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.report import attention_shape  # noqa: E402

PROVIDERS = ("split", "fused", "tl", "cudnn")
FORMS = (1, 2, 3, 4, 5)  # kernels/flash/launch.py: _hopper_bwd(fused=...)


def backwards(B: int, H: int, N: int, D: int, causal: bool, form: int) -> dict:
    """provider -> a callable running its backward once on fresh bf16 inputs of this shape ("fused": the Gluon
    kernel's fused form `form`)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import options
    from kernels.flash import launch
    scale = D ** -0.5
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    o, lse = launch._fwd(q, k, v, causal, scale)  # (B, H, N, D), (B, H, N)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)

    def tl():
        with options.use(hopper_backward="off"):
            launch._bwd(do, q, k, v, o, lse, causal, scale)

    return {"split": lambda: launch._hopper_bwd(do, q, k, v, o, lse, causal, scale),
            "fused": lambda: launch._hopper_bwd(do, q, k, v, o, lse, causal, scale, fused=form),
            "tl": tl,
            "cudnn": lambda: out.backward(do, retain_graph=True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", type=attention_shape, default=attention_shape("4,16,4096,128"), help="B,H,N,D (bf16)")
    p.add_argument("--causal", choices=["yes", "no"], default="no")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--form", type=int, choices=FORMS, default=None,
                   help="the fused form of the 'fused' provider (default: the one kernels.flash_attention runs "
                        "at this head dim and mask, kernels/flash/launch.py: hopper_bwd_form)")
    args = p.parse_args(argv)
    B, H, N, D = args.shape
    if D not in (64, 128):
        print(f"error: --shape {B},{H},{N},{D}: the Gluon backward takes head dims 64 and 128", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("error: the Hopper backward needs an sm_90 GPU (none here)", file=sys.stderr)
        return 2
    from kernels.flash.launch import hopper_bwd_form
    causal = args.causal == "yes"
    form = hopper_bwd_form(D, causal) if args.form is None else args.form
    runs = backwards(B, H, N, D, causal, form)
    for name in args.providers:  # compile, tune and warm up outside the profiled range
        runs[name]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name in args.providers:
        runs[name]()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one backward each of {', '.join(args.providers)} at {B},{H},{N},{D} causal={args.causal}"
          + (f" (fused form {form})" if "fused" in args.providers else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
