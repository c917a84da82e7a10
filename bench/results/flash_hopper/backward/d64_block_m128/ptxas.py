# TRITON_INTERPRET=0 PYTHONPATH=<triton 3.6.0>:. python bench/results/flash_hopper/backward/d64_block_m128/ptxas.py
# Compiles (on a CPU, for sm_90, nothing launched) the head-dim-64 Gluon backward with 64- and 128-row query
# blocks (kernels/flash_hopper/backward_launch.py: BLOCK_M set in place), split and fused forms 3 and 5, causal
# and not; prints ptxas's registers and spill bytes per thread and the shared memory of each.
import torch
import kernels._triton as kt
from kernels import options
from kernels.flash import launch
from kernels.flash.backward import _attn_bwd_dq, _attn_bwd_dq_out, _attn_bwd_prep
from kernels.flash_hopper import backward, backward_launch as BL, launch as hopper_launch
from tests.gpu_compile import compiling_instead_of_launching, ptxas_usage
kt.check_device = lambda device, what: None
kt.sm_count = lambda device: 132
hopper_launch._is_sm90 = lambda device: True
launch._hopper_or_newer = lambda index: True
for bm in (64, 128):
    BL.BLOCK_M = bm
    for stages in ((3,) if bm == 64 else (2, 3)):
        with compiling_instead_of_launching(backward._attn_bwd_dkdv_hopper, _attn_bwd_dq, _attn_bwd_prep,
                                            _attn_bwd_dq_out) as compiled, \
                options.use(autotune=False, fast_launch=False):
            for causal in (True, False):
                for fused in (None, 3, 5):
                    q = torch.randn(2, 4, 116, 64).to(torch.bfloat16)
                    kv = torch.randn(2, 2, 203, 64).to(torch.bfloat16)
                    launch._hopper_bwd(torch.randn_like(q), q, kv, kv, torch.randn_like(q), torch.zeros(2, 4, 116),
                                       causal, fused=fused, stages=stages)
        compiled = [c for c in compiled if c.name == "_attn_bwd_dkdv_hopper"]
        for c, (causal, fused) in zip(compiled, [(ca, fu) for ca in (True, False) for fu in (None, 3, 5)]):
            u = ptxas_usage(c)
            print(f"BLOCK_M {bm:3d} stages {stages} causal {causal!s:5} fused {fused!s:4} registers {u['registers']} "
                  f"spills {u['spill_stores']}/{u['spill_loads']} B shared {c.metadata.shared}", flush=True)
