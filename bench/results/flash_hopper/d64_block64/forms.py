# python3 bench/results/flash_hopper/d64_block64/forms.py   (from the project root, one sm_90 GPU)
# The head-dim-64 Gluon forward on 128-key blocks (the default) against 64-key blocks
# (kernels/flash_hopper/launch.py: BLOCK_N and STAGES set in place), two and three consumers, lane sums on and off;
# four rounds (order reversed every other round), each a triton.testing.do_bench median in ms; every form's O is
# first checked against the default's (relative L2 < 1e-2). TFLOP/s of the best median per form at the end.
import torch, triton.testing as tt
from kernels import options
from kernels.flash_hopper import flash_hopper_forward as f, launch as L

FORMS = {  # name: (BLOCK_N, stages at d64, options)
    "default": (128, 3, dict()),
    "c3+lane": (128, 3, dict(hopper_consumers_d64=3, hopper_lane_sums="on")),
    "b64 c2 s4": (64, 4, dict(hopper_consumers_d64=2)),
    "b64 c3 s3": (64, 3, dict(hopper_consumers_d64=3, hopper_lane_sums="off")),
    "b64 c3 s4": (64, 4, dict(hopper_consumers_d64=3, hopper_lane_sums="off")),
    "b64 c3+lane s4": (64, 4, dict(hopper_consumers_d64=3, hopper_lane_sums="on")),
}


def run(name, q, k, v, causal):
    bn, stages, opts = FORMS[name]
    L.BLOCK_N, L.STAGES[64] = bn, stages
    try:
        with options.use(**opts):
            return f(q, k, v, causal=causal)[0]
    finally:
        L.BLOCK_N, L.STAGES[64] = 128, 3


for B, N, causal in ((4, 4096, True), (4, 4096, False), (2, 8192, True), (1, 16384, True)):
    q = torch.randn(B, 16, N, 64, device="cuda", dtype=torch.bfloat16); k = torch.randn_like(q); v = torch.randn_like(q)
    ref = run("default", q, k, v, causal).float()
    res = {}
    for rnd in range(4):
        for n in (list(FORMS) if rnd % 2 == 0 else list(FORMS)[::-1]):
            o = run(n, q, k, v, causal).float()
            err = ((o - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (n, err)
            res.setdefault(n, []).append(tt.do_bench(lambda: run(n, q, k, v, causal), rep=100, return_mode="median"))
    flops = 4 * B * 16 * N * N * 64 / (2 if causal else 1)
    print(B, N, "causal" if causal else "full", flush=True)
    for n, ms in res.items():
        print(f"  {n:16s} {' '.join(f'{m:.4f}' for m in ms)}  best {min(ms):.4f} ms {flops / min(ms) / 1e9:.0f} TFLOP/s"
              f"  default/this {min(res['default']) / min(ms):.3f}", flush=True)
