# python3 bench/results/flash_hopper/d64_causal_long/forms_3_shapes.py   (from the project root, one sm_90 GPU)
# The causal head-dim-64 Gluon forward in four forms, four rounds (order reversed every other round), each a
# triton.testing.do_bench median in ms; every form's O first checked against the default's (relative L2 < 1e-2).
import torch, triton.testing as tt
from kernels import options
from kernels.flash_hopper import flash_hopper_forward as f
forms = {'c2': dict(), 'c2+lane': dict(hopper_lane_sums='on'), 'c3': dict(hopper_consumers_d64=3), 'c3+lane': dict(hopper_consumers_d64=3, hopper_lane_sums='on')}
for B, N in ((4, 4096), (2, 8192), (1, 16384)):
  q=torch.randn(B,16,N,64,device='cuda',dtype=torch.bfloat16); k=torch.randn_like(q); v=torch.randn_like(q)
  ref=f(q,k,v,causal=True)[0].float()
  res={}
  for rnd in range(4):
    names = list(forms) if rnd % 2 == 0 else list(forms)[::-1]
    for n in names:
      with options.use(**forms[n]):
        o=f(q,k,v,causal=True)[0].float()
        err=((o-ref).norm()/ref.norm()).item(); assert err < 1e-2, (n, err)
        res.setdefault(n,[]).append(tt.do_bench(lambda: f(q,k,v,causal=True), rep=100, return_mode='median'))
  print(B,N,'causal', {n: ' '.join(f'{m:.4f}' for m in v) for n,v in res.items()}, flush=True)
