"""1x1 case with the rows' TMA forced on: does a box wider than the flat buffer fault?"""
import sys
import torch
from kernels.flash import launch
from kernels.flash_hopper import backward_launch as bl
n = int(sys.argv[1])
if sys.argv[2] == "force":
    bl.rows_fit_tma = lambda rows: True
g = torch.Generator().manual_seed(0)
q, k, v, do = [torch.randn((1, 2, n, 64), generator=g).to("cuda", torch.bfloat16) for _ in range(4)]
o, lse = launch._fwd(q, k, v, True, 0.125)
with bl.rows_through_tma():
    dq, dk, dv = launch._hopper_bwd(do, q, k, v, o, lse, True, 0.125)
torch.cuda.synchronize()
print("n", n, sys.argv[2], "ok, finite:", bool(dk.isfinite().all()))
