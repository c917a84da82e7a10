import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.profiler import profile, ProfilerActivity
from triton.testing import do_bench
from kernels import flash_attention

def mk(B, H, N, D):
    t = [torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    return t

def bwd_time(fn, q, k, v):
    o = fn(q, k, v)
    g = torch.randn_like(o)
    return do_bench(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True), rep=200)

fl = lambda q, k, v: flash_attention(q, k, v, causal=True)
def cu(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

big = mk(1, 16, 16384, 128)
print("flash 16k alone", bwd_time(fl, *big))
small = mk(4, 16, 4096, 128)
print("flash 4k", bwd_time(fl, *small)); print("cudnn 4k", bwd_time(cu, *small))
print("flash 16k after", bwd_time(fl, *big))
print("cudnn 16k", bwd_time(cu, *big))
print("flash 16k again", bwd_time(fl, *big))
o = fl(*big); g = torch.randn_like(o)
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(5):
        torch.autograd.grad(o, big, g, retain_graph=True)
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=8))
print(torch.cuda.clock_rate() if hasattr(torch.cuda, "clock_rate") else "")
