# python3 bench/results/flash_hopper/d64_causal_long/ring_depth.py   (from the project root, one sm_90 GPU)
# The Gluon forward's K/V ring depth at head dim 64 (kernels/flash_hopper/launch.py: STAGES, set in place), three
# rounds (the order reversed in the second), do_bench medians in ms; every depth's O bitwise the default's.
import torch, triton.testing as tt
import kernels.flash_hopper.launch as L
from kernels.flash_hopper import flash_hopper_forward as f
for N in (4096, 16384):
  B = 4 if N == 4096 else 1
  for causal in (True, False):
    q=torch.randn(B,16,N,64,device='cuda',dtype=torch.bfloat16); k=torch.randn_like(q); v=torch.randn_like(q)
    L.STAGES[64]=3; ref=f(q,k,v,causal=causal)[0]
    res={}
    for rnd in range(3):
      for s in ((2,3,4,5) if rnd%2==0 else (5,4,3,2)):
        L.STAGES[64]=s
        o=f(q,k,v,causal=causal)[0]
        assert torch.equal(o,ref), s
        res.setdefault(s,[]).append(tt.do_bench(lambda: f(q,k,v,causal=causal), rep=100, return_mode='median'))
    print(B,N,'causal' if causal else 'full', {s: ' '.join(f'{m:.4f}' for m in v) for s,v in res.items()}, flush=True)
