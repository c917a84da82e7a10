# TRITON_INTERPRET=0 PYTHONPATH=<triton 3.6.0>:. python bench/results/flash_hopper/d64_causal_long/block64_ptxas.py
# Compiles (on a CPU, for sm_90, nothing launched) the causal head-dim-64 Gluon forward with 128- and 64-key blocks
# (kernels/flash_hopper/launch.py: BLOCK_N, STAGES set in place): two consumers, three with and without lane
# sums, in that order; prints ptxas's registers and spill bytes per thread and the shared memory of each.
import json, sys, torch
import kernels, kernels._triton as kt
from kernels import options
from kernels.flash_hopper import forward, launch as hopper_launch
from tests.gpu_compile import compiling_instead_of_launching, ptxas_usage
kt.check_device = lambda device, what: None
kt.sm_count = lambda device: 132
hopper_launch._is_sm90 = lambda device: True
out = []
for bn in (128, 64):
    hopper_launch.BLOCK_N = bn
    for stages in ((3, 4) if bn == 64 else (3,)):
        hopper_launch.STAGES[64] = stages
        with compiling_instead_of_launching(forward._attn_fwd_hopper) as compiled, torch.no_grad(), \
                options.use(hopper_forward="on", fast_launch=False):
            q = torch.randn(2, 4, 113, 64).to(torch.bfloat16); kv = torch.randn(2, 2, 203, 64).to(torch.bfloat16)
            for c, lane in ((2, "off"), (3, "on"), (3, "off")):
                with options.use(hopper_consumers_d64=c, hopper_lane_sums=lane):
                    kernels.flash_attention(q, kv, kv, causal=True)
        for cc in compiled:
            u = ptxas_usage(cc)
            out.append(dict(bn=bn, stages=stages, consumers=cc.src.constants.get("CONSUMERS") if hasattr(cc.src, "constants") else None,
                            shared=cc.metadata.shared, **{k: u[k] for k in u}))
json.dump(out, sys.stdout)
