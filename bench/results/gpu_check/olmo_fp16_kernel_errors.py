"""Per-call error of each fused-decode kernel in fp16 against the same kernel run in fp32 on the same inputs, for
tests/test_fused_decode_olmo.py's OLMo 2 model in fp16, with the logits' and caches' errors against float64 per step.

    python bench/results/gpu_check/olmo_fp16_kernel_errors.py [SEED ...]    # from the repository root; seed 0: the test's

"ulp-of-max": max |fp16 kernel - fp32 kernel| in units of fp16 at the largest |output|; "elementwise": the largest
error in units of fp16 at each element's own magnitude (large where a small element comes from cancellation).
"""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import model.fused_decode as fd  # noqa: E402
import tests.error_budget as eb  # noqa: E402
from tests.test_fused_decode_olmo import tiny_olmo  # noqa: E402
from tests.test_fused_decode_llama import decode_three_ways  # noqa: E402
import tests.test_fused_decode as tf  # noqa: E402
import tests.test_fused_decode_llama as tl_  # noqa: E402

H = torch.float16
cur = {"step": -1, "calls": {}}


def conv(t):
    if torch.is_tensor(t) and t.dtype == H:
        return t.float().clone()
    if isinstance(t, tuple):
        return tuple(conv(x) for x in t)
    return t


def ulp_err(got, ref):
    ok = torch.isfinite(ref)
    got, ref = got.float()[ok], ref[ok]
    if ref.numel() == 0:
        return 0.0, 0.0
    r16 = ref.to(H).float()
    mag = r16.abs().clamp_min(2 ** -14)
    ulp = 2.0 ** (torch.floor(torch.log2(mag)) - 10)
    e = (got - ref).abs()
    return (e / ulp).max().item(), (e.max() / ref.abs().max().clamp_min(1e-30)).item()


def wrap(name, fn, cache_pos=()):
    def wrapped(*args, **kw):
        a32, k32 = [conv(a) for a in args], {k: conv(v) for k, v in kw.items()}
        ref = fn(*a32, **k32)
        out = fn(*args, **kw)
        n = cur["calls"].get(name, 0); cur["calls"][name] = n + 1
        u, rel = ulp_err(out, ref)
        extra = ""
        for i in cache_pos:  # in-place caches: compare the whole cache where the fp32 one is finite
            cu, crel = ulp_err(args[i], a32[i])
            extra += f" cache{i}: {cu:.2f} ulp"
        print(f"step {cur['step']} {name}#{n}: {rel * 2048:.2f} ulp-of-max ({u:.1f} elementwise){extra}", flush=True)
        return out
    return wrapped


fd.ln_qkv_to_cache = wrap("ln_qkv_to_cache", fd.ln_qkv_to_cache, cache_pos=(4, 5))
fd.qk_norm_rope = wrap("qk_norm_rope", fd.qk_norm_rope, cache_pos=(1,))
fd.decode_attention = wrap("decode_attention", fd.decode_attention)
fd.ln_linear = wrap("ln_linear", fd.ln_linear)
fd.add_rms_norm = wrap("add_rms_norm", fd.add_rms_norm)
fd.embed_with_stats = wrap("embed", fd.embed_with_stats)

orig_fused = fd.fused_decode_step
def stepping(*a, **k):
    cur["step"] += 1; cur["calls"] = {}
    return orig_fused(*a, **k)
tl_.fused_decode_step = stepping

orig = eb.assert_within_budget
def spy(name, got, ref, plain, **kw):
    e, p = eb.max_error(got, ref), eb.max_error(plain, ref)
    print(f"  BUDGET {name}: fused {e:.5f} plain {p:.5f} ratio {e / max(p, 1e-12):.2f} max|ref| {ref.abs().max().item():.3f}", flush=True)
tf.assert_within_budget = spy
seeds = [int(s) for s in sys.argv[1:]] or [0]
for seed in seeds:
    print(f"==== seed {seed}", flush=True)
    cur["step"] = -1
    torch.manual_seed(seed)
    with torch.no_grad():
        decode_three_ways(tiny_olmo(H), [1, 6, 14], max_len=24, steps=4, seed=5 + seed)
