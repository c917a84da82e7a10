"""The 8,192-token case of `bench/attention.py --varlen` (8,12,1024,64, mean document 512, seed 0) with the
benchmark's own providers and timing: each call timed twice, without autograd, as a CUDA graph, the backward,
the host time to enqueue one call, and each kernel's GPU time per forward + backward from torch.profiler.
Run from the repository root: python bench/results/attention_varlen/profile_8192.py"""
import sys, time, torch, triton
sys.path[:0] = ["bench", "."]
from attention import doc_lengths, make_varlen_provider, varlen_flops
from triton.testing import do_bench, do_bench_cudagraph
from torch.profiler import profile, ProfilerActivity
from kernels import options

B, H, N, D = 8, 12, 1024, 64
lengths = doc_lengths(B * N, 512, 0)
g = torch.Generator(device="cuda").manual_seed(4321 + N + D)
q, k, v, do = (torch.randn(1, H, B * N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_()

def kernel_sums(fn, iters=20):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            o = fn(q, k, v); o.backward(do)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / iters, e.count / iters, e.key[:70]))
    rows.sort(reverse=True)
    return rows[:8]

def one(label, fn):
    o = fn(q, k, v); o.backward(do); torch.cuda.synchronize()
    for t in (q, k, v): t.grad = None
    f = do_bench(lambda: fn(q, k, v), warmup=25, rep=200, return_mode="median")
    f2 = do_bench(lambda: fn(q, k, v), warmup=25, rep=200, return_mode="median")
    with torch.no_grad():
        fng = do_bench(lambda: fn(q, k, v), warmup=25, rep=200, return_mode="median")
        try:
            fcg = do_bench_cudagraph(lambda: fn(q, k, v), rep=100, return_mode="median")
        except Exception as e:  # noqa: BLE001
            fcg = float("nan"); print(label, "cudagraph failed:", type(e).__name__, str(e)[:120])
    out = fn(q, k, v)
    b = do_bench(lambda: out.backward(do, retain_graph=True), warmup=25, rep=200, grad_to_none=[q, k, v],
                 return_mode="median")
    # host time of one call: wall clock of 200 back-to-back calls, no sync between
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(200): fn(q, k, v)
    host = (time.perf_counter() - t0) / 200 * 1e6; torch.cuda.synchronize()
    tf = varlen_flops(lengths, H, D, 0, "fwd") / (f * 1e-3) / 1e12
    print(f"{label:14s} fwd {f:.4f}/{f2:.4f} ms ({tf:.0f} TF)  fwd no-grad {fng:.4f}  fwd cudagraph no-grad {fcg:.4f}  "
          f"bwd {b:.4f} ms  host-enqueue {host:.1f} us/call", flush=True)
    for t, c, key in kernel_sums(fn):
        print(f"    {t:8.1f} us/iter  x{c:.0f}  {key}", flush=True)

one("flex", make_varlen_provider("flex", lengths, 0))
one("flash", make_varlen_provider("flash", lengths, 0))
with options.use(lpt=False):
    one("flash lpt=off", make_varlen_provider("flash", lengths, 0))
one("flash again", make_varlen_provider("flash", lengths, 0))
