# python3 bench/results/flash_hopper/d64_causal_long/d128_blocks.py   (from the project root, one sm_90 GPU)
# Head dim 128: 64-key blocks with 3 or 4 ring stages (kernels/flash_hopper/launch.py: BLOCK_N, STAGES, set in
# place) against the default 128-key blocks with 2, and whole-row sums (hopper_lane_sums off); four rounds, the
# order reversed every other round, do_bench medians in ms; every form's O checked against the default's.
import torch, triton.testing as tt
from kernels import options
import kernels.flash_hopper.launch as L
from kernels.flash_hopper import flash_hopper_forward as f
forms = {'n128s2': (128, 2, {}), 'n64s3': (64, 3, {}), 'n64s4': (64, 4, {}), 'n128s2-rowsums': (128, 2, dict(hopper_lane_sums='off'))}
for B, N in ((4, 4096), (1, 16384)):
  for causal in (False, True):
    q=torch.randn(B,16,N,128,device='cuda',dtype=torch.bfloat16); k=torch.randn_like(q); v=torch.randn_like(q)
    ref=f(q,k,v,causal=causal)[0].float()
    res={}
    for rnd in range(4):
      names = list(forms) if rnd % 2 == 0 else list(forms)[::-1]
      for n in names:
        bn, st, opt = forms[n]
        L.BLOCK_N = bn; L.STAGES[128] = st
        try:
          with options.use(**opt):
            o=f(q,k,v,causal=causal)[0].float()
            err=((o-ref).norm()/ref.norm()).item(); assert err < 1e-2, (n, err)
            res.setdefault(n,[]).append(tt.do_bench(lambda: f(q,k,v,causal=causal), rep=100, return_mode='median'))
        except Exception as e:
          res.setdefault(n,[]).append(float('nan')); print(n, 'failed', str(e)[:200])
    L.BLOCK_N = 128; L.STAGES[128] = 2
    print(B,N,causal, {n: ' '.join(f'{m:.4f}' for m in v) for n,v in res.items()}, flush=True)
