# python3 bench/results/flash_hopper/d64_causal_long/forms_8_shapes.py   (from the project root, one sm_90 GPU)
# Two consumers (the default before) against three, and three with lane sums, causal head dim 64, five rounds
# (order reversed every other round), do_bench medians in ms; the ratios are of the medians of the five.
import torch, triton.testing as tt
from kernels import options
from kernels.flash_hopper import flash_hopper_forward as f
forms = {'c2': dict(), 'c3': dict(hopper_consumers_d64=3), 'c3+lane': dict(hopper_consumers_d64=3, hopper_lane_sums='on')}
for B, H, N in ((8, 16, 4096), (2, 16, 6144), (4, 16, 8192), (2, 16, 8192), (1, 12, 8192), (1, 16, 16384), (2, 16, 16384), (1, 16, 32768)):
  q=torch.randn(B,H,N,64,device='cuda',dtype=torch.bfloat16); k=torch.randn_like(q); v=torch.randn_like(q)
  ref=f(q,k,v,causal=True)[0].float()
  res={}
  for rnd in range(5):
    names = list(forms) if rnd % 2 == 0 else list(forms)[::-1]
    for n in names:
      with options.use(**forms[n]):
        o=f(q,k,v,causal=True)[0].float()
        err=((o-ref).norm()/ref.norm()).item(); assert err < 1e-2, (n, err)
        res.setdefault(n,[]).append(tt.do_bench(lambda: f(q,k,v,causal=True), rep=100, return_mode='median'))
  med = {n: sorted(v)[len(v)//2] for n, v in res.items()}
  print(B,H,N,'causal', {n: ' '.join(f'{m:.4f}' for m in v) for n,v in res.items()}, 'c3+lane/c2 %.3f c3/c2 %.3f' % (med['c2']/med['c3+lane'], med['c2']/med['c3']), flush=True)
