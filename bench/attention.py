"""Attention benchmark on a GPU: this repo's Triton FlashAttention against PyTorch's fused kernels.

    python bench/attention.py [--out DIR] [--deadline-s S] [--shapes 8,12,1024,64 ...]
    python bench/attention.py --varlen [--doc-mean 512] [--doc-seed 0] [--window W] [--shapes ...]

For each (B, H, N, D) in the issue's list, causal and not, bf16: forward and backward TFLOP/s and peak memory
(one forward + backward, above the inputs) of

* flash       kernels.flash_attention as the model calls it: the forward and backward the hopper_forward and
              hopper_backward options' defaults (auto) pick per shape and device (the tl kernels autotuned on
              first use of each shape bucket),
* flash-tl    the same with both options off: the portable tl kernels everywhere,
* flash-hopper the same with both on: the Gluon forward and fused backward of kernels/flash_hopper/ (sm_90,
              bf16/fp16, head dims 64 and 128; skipped where the Gluon kernel cannot run),
* sdpa-flash  F.scaled_dot_product_attention restricted to the FLASH_ATTENTION backend (FlashAttention-2),
* sdpa-cudnn  the same restricted to the CUDNN_ATTENTION backend (skipped where that backend does not take the
              shape or dtype),
* fa4         FlashAttention-4 (package flash-attn-4, CuTe-DSL kernels: flash_attn.cute.flash_attn_func), given
              (B, N, H, D) views of the same tensors (transpose(1, 2), no copy; skipped where it is not
              installed or the GPU is not sm_90 / sm_100),
* flex        torch.compile(flex_attention) with a causal block mask (no mask when non-causal),
* naive       kernels.naive.naive_attention (skipped at N = 16384: it would need tens of GiB),

all in the same run, timed with triton.testing.do_bench medians (it flushes L2 between runs). FLOPs:
4·B·H·N²·D, halved when causal; the backward counts 2.5x the forward. Inputs are random (never zeros), and
before timing each provider's output and gradients are compared with SDPA-flash's (relative L2 difference,
column "diff"). Writes attention.json and attention.md into bench/results/ (and into --out / $OUT when given)
and prints one table, then the target ratios.

--varlen: documents packed into one sequence of B·N tokens (lengths drawn from a seeded exponential distribution
of mean --doc-mean, at least 1 token; the last one cut to fit), causal within each document (and a sliding
window with --window), bf16: the flash kernels with the documents' bounds (flash_attention(..., docs=...), the
training path: no cu_seqlens read-back) against torch.compile(flex_attention) with the document mask as a block
mask (create_block_mask), in the same run. FLOPs count the visible (query, key) pairs exactly: 4·H·D per pair,
backward 2.5x. Writes attention_varlen.json/.md (--tag) and prints the table with flash / flex, of the calls'
do_bench times and of their kernels' GPU time alone (torch.profiler), which a short call's host time cannot move.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import pathlib
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

SHAPES = [(8, 12, 1024, 64), (4, 16, 4096, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)]
PROVIDERS = ["flash", "flash-tl", "flash-hopper", "sdpa-flash", "sdpa-cudnn", "fa4", "flex", "naive"]
VARLEN_PROVIDERS = ["flex", "flash"]  # flex first: its result is the reference of the "diff" column
NAIVE_MAX_N = 8192
FA4_MODULE = "flash_attn.cute"   # flash-attn-4's CuTe-DSL interface (../shared/tools/fa4-wheels.sh installs it)
FA4_ARCH_MAJORS = (9, 10)        # the GPUs its kernels are written for: sm_90 (Hopper), sm_100 (Blackwell)


class Unavailable(RuntimeError):
    """A provider that cannot run here (the reason is its message, one line): reported as skipped."""


def _sdpa_params(q, causal):
    from torch.backends.cuda import SDPAParams
    try:
        return SDPAParams(q, q, q, None, 0.0, causal, False)  # torch >= 2.5: enable_gqa
    except TypeError:
        return SDPAParams(q, q, q, None, 0.0, causal)


def skip_reason(name, q, causal):
    """Why provider `name` cannot run on inputs like q (B, H, N, D) here, or None. Only the peers that need
    something this machine may lack are checked: SDPA's cuDNN backend, FA4 and the Gluon forward."""
    if name not in ("sdpa-cudnn", "fa4", "flash-hopper"):
        return None
    if not torch.cuda.is_available():
        return "no CUDA device"
    if name == "flash-hopper":
        from kernels.flash_hopper import unsupported
        return unsupported(q, q, q)
    if name == "sdpa-cudnn":
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available in this torch build"
        try:
            usable = torch.backends.cuda.can_use_cudnn_attention(_sdpa_params(q, causal), False)
        except (AttributeError, RuntimeError, TypeError):  # no such check in this torch: the run itself tells
            return None
        if not usable:
            return (f"SDPA's cuDNN backend does not take {str(q.dtype).replace('torch.', '')} "
                    f"(B, H, N, D) = {tuple(q.shape)} causal={causal} here")
        return None
    major, minor = torch.cuda.get_device_capability(q.device)
    if major not in FA4_ARCH_MAJORS:
        return f"FA4's kernels are for sm_90 / sm_100 GPUs, this one is sm_{major}{minor}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"FA4 takes float16 / bfloat16, not {q.dtype}"
    from importlib import import_module
    try:
        module = import_module(FA4_MODULE)
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install failing at import
        return f"flash-attn-4 is not installed ({FA4_MODULE}: {type(e).__name__}: {str(e).splitlines()[0][:120]})"
    if not hasattr(module, "flash_attn_func"):
        return f"{FA4_MODULE} has no flash_attn_func (flash-attn-4 {getattr(module, '__version__', '?')})"
    return None


def flops(B, H, N, D, causal, mode):
    f = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
    return f * (2.5 if mode == "bwd" else 1.0)


# kernel options held while a provider is measured (its forward, and its backward, which autograd runs later)
PINNED = {"flash-tl": dict(hopper_forward="off", hopper_backward="off"),
          "flash-hopper": dict(hopper_forward="on", hopper_backward="on")}


def make_provider(name, N, causal, q=None):
    """Returns fn(q, k, v) -> o on (B, H, N, D) tensors, or raises (Unavailable: it cannot run here; checked
    against q's shape and dtype when given)."""
    reason = skip_reason(name, q, causal) if q is not None else None
    if reason:
        raise Unavailable(reason)
    if name == "flash":
        from kernels.flash import flash_attention
        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if name in ("flash-tl", "flash-hopper"):  # the options are pinned around the whole measurement (PINNED)
        from kernels.flash import flash_attention
        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if name in ("sdpa-flash", "sdpa-cudnn"):
        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa-flash" else SDPBackend.CUDNN_ATTENTION

        def sdpa(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return sdpa
    if name == "fa4":
        from importlib import import_module
        fa4 = import_module(FA4_MODULE).flash_attn_func

        def fa4_attention(q, k, v):  # (B, H, N, D) -> (B, N, H, D) views -> FA4 -> (B, H, N, D)
            o = fa4(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
            o = o[0] if isinstance(o, tuple) else o  # (out, lse) in the 4.0 betas, out alone before
            return o.transpose(1, 2)
        return fa4_attention
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        compiled = _flex_compiled(flex_attention)
        mask = None
        if causal:
            mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, N, N, device="cuda")
        return lambda q, k, v: compiled(q, k, v, block_mask=mask)
    if name == "naive":
        if N > NAIVE_MAX_N:
            raise Unavailable(f"N={N} > {NAIVE_MAX_N} (O(N^2) memory)")
        from kernels.naive import naive_attention
        return lambda q, k, v: naive_attention(q, k, v, causal=causal)
    raise ValueError(name)


_FLEX = None


def _flex_compiled(flex_attention):
    global _FLEX
    if _FLEX is None:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        # the timed backward reruns one graph (retain_graph=True): compiled backwards must not donate buffers
        torch._functorch.config.donated_buffer = False
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


# ---------------------------------------------------------------------------------- documents (--varlen)

def doc_lengths(total: int, mean: float, seed: int) -> list[int]:
    """Document lengths summing to `total`: drawn from an exponential distribution of the given mean (seeded,
    rounded up, so at least 1 token each), the last one cut to fit."""
    import random
    rng = random.Random(seed)
    lengths, left = [], total
    while left > 0:
        n = min(max(1, int(rng.expovariate(1.0 / mean)) + 1), left)
        lengths.append(n)
        left -= n
    return lengths


def visible_pairs(lengths, window: int = 0) -> int:
    """(query, key) pairs a causal document mask (and window) leaves visible: sum over documents of
    sum_i min(i + 1, window or infinity)."""
    total = 0
    for n in lengths:
        if window and n > window:
            total += window * (window + 1) // 2 + (n - window) * window
        else:
            total += n * (n + 1) // 2
    return total


def varlen_flops(lengths, H: int, D: int, window: int, mode: str) -> float:
    f = 4 * H * D * visible_pairs(lengths, window)
    return f * (2.5 if mode == "bwd" else 1.0)


def make_varlen_provider(name, lengths, window: int, device="cuda"):
    """fn(q, k, v) -> o on (1, H, total, D) inputs holding the documents `lengths` one after another."""
    total = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device=device)
    if name == "flash":
        from kernels import bounds_from_cu_seqlens, flash_attention
        docs = bounds_from_cu_seqlens(cu, total)  # (1, 2, total): built once, as a training step builds its own
        return lambda q, k, v: flash_attention(q, k, v, causal=True, window=window, docs=docs)
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        doc = torch.searchsorted(cu[1:], torch.arange(total, device=device), right=True)  # (total,) document ids

        def document_causal(b, h, q_idx, kv_idx):
            visible = (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
            if window:
                visible = visible & (q_idx - kv_idx < window)
            return visible
        mask = create_block_mask(document_causal, None, None, total, total, device=device)
        compiled = _flex_compiled(flex_attention)
        return lambda q, k, v: compiled(q, k, v, block_mask=mask)
    raise ValueError(name)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def fwd_bwd(fn, q, k, v, do):
    for t in (q, k, v):
        t.grad = None
    o = fn(q, k, v)
    o.backward(do)
    return [o.detach(), q.grad.detach().clone(), k.grad.detach().clone(), v.grad.detach().clone()]


def _tuners():
    try:
        from kernels.flash.configs import TUNERS
    except Exception:  # noqa: BLE001
        return {}
    return {k: t for k, t in TUNERS.items() if t is not None}


def _cfg_str(cfg):
    kw = cfg.all_kwargs()
    return f"{kw.get('BLOCK_M')}x{kw.get('BLOCK_N')} w{kw.get('num_warps')} s{kw.get('num_stages')}"


def kernels_ms_per_call(run, iters: int = 10) -> float:
    """GPU time (ms) of the kernels one call of run() launches: torch.profiler over `iters` calls, summed and
    divided by them. Kernels only (memsets and copies the call makes count too): what a call costs without the
    host time that do_bench's timing of a short call can include."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return us / iters / 1e3


def kernel_ms(fn, q, k, v, do, iters: int = 10) -> dict:
    """GPU time of the kernels that one forward call and one backward call launch (kernels_ms_per_call)."""
    out = fn(q, k, v)

    def backward():
        for t in (q, k, v):
            t.grad = None
        out.backward(do, retain_graph=True)
    times = dict(fwd_kernel_ms=kernels_ms_per_call(lambda: fn(q, k, v), iters),
                 bwd_kernel_ms=kernels_ms_per_call(backward, iters))
    for t in (q, k, v):
        t.grad = None
    return times


def measure(name, fn, q, k, v, do, ref, warmup, rep, kernels: bool = False):
    from triton.testing import do_bench
    before = {tk: set(t.cache) for tk, t in _tuners().items()}
    t0 = time.time()
    res = fwd_bwd(fn, q, k, v, do)  # first call: compile / autotune
    compile_s = time.time() - t0
    tuning = {}
    for tk, t in _tuners().items():  # the autotuner's timing of every config, for the keys tuned just now
        if set(t.cache) - before.get(tk, set()) and getattr(t, "configs_timings", None):
            timings = {_cfg_str(c): (ms[0] if isinstance(ms, (list, tuple)) else ms)
                       for c, ms in t.configs_timings.items()}
            tuning[tk[0]] = dict(best=_cfg_str(t.cache[list(set(t.cache) - before.get(tk, set()))[0]]),
                                 default=_cfg_str(t.configs[0]), ms=timings)
            print(f"  autotune {tk[0]:5s}: best {tuning[tk[0]]['best']} "
                  f"({min(timings.values()):.3f} ms); default {tuning[tk[0]]['default']} "
                  f"({timings.get(tuning[tk[0]]['default'], float('nan')):.3f} ms); all "
                  + ", ".join(f"{c}: {ms:.3f}" for c, ms in timings.items()), flush=True)
    if any(torch.isnan(t).any().item() for t in res):
        raise RuntimeError("NaN in output or gradients")
    diff = max(rel(a, b) for a, b in zip(res, ref)) if ref is not None else None
    del res
    fwd_ms = do_bench(lambda: fn(q, k, v), warmup=warmup, rep=rep, return_mode="median")
    out = [fn(q, k, v)]
    bwd_ms = do_bench(lambda: out[0].backward(do, retain_graph=True), warmup=warmup, rep=rep,
                      grad_to_none=[q, k, v], return_mode="median")
    out.clear()
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(q, k, v).backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in (q, k, v):
        t.grad = None
    out = dict(fwd_ms=fwd_ms, bwd_ms=bwd_ms, peak_gib=peak / 2**30, diff=diff, first_call_s=compile_s)
    if kernels:
        try:
            out.update(kernel_ms(fn, q, k, v, do))
        except Exception as e:  # noqa: BLE001 - the profiler's column is extra: the call times stand without it
            out["kernel_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if tuning:
        out["autotune"] = tuning
    return out


def autotune_picks():
    """The configs the flash autotuners chose, per key (for bench/NOTES.md)."""
    out = {}
    for (kern, dcls, bd), tuner in _tuners().items():
        if tuner is None:
            continue
        for key, cfg in tuner.cache.items():
            kw = cfg.all_kwargs()
            out[f"{kern}/{dcls}/{bd}/{key}"] = (kw.get("BLOCK_M"), kw.get("BLOCK_N"), kw.get("num_warps"),
                                                kw.get("num_stages"))
    return out


def fmt(x, nd=0):
    return "—" if x is None else f"{x:.{nd}f}"


def render(results, meta):
    """One markdown table (TFLOP/s fwd / bwd, peak GiB, diff) plus the target ratios."""
    lines = [f"# Attention benchmark ({meta['gpu']})", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; torch {meta['torch']}, triton "
             f"{meta['triton']}; bf16; do_bench medians; FLOPs 4·B·H·N²·D (×0.5 causal, bwd ×2.5).", "",
             "TFLOP/s forward / backward (peak GiB of one fwd+bwd above the inputs; diff = max relative L2 "
             "difference of out, dq, dk, dv vs SDPA-flash):", "",
             "| B,H,N,D | causal | " + " | ".join(PROVIDERS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in PROVIDERS) + " |"]
    for r in results:
        cells = []
        for p in PROVIDERS:
            m = r["providers"].get(p, {})
            if "fwd_tflops" in m:
                diff = "ref" if m["diff"] is None else f"diff {m['diff']:.1e}"
                cells.append(f"{m['fwd_tflops']:.0f} / {m['bwd_tflops']:.0f} ({m['peak_gib']:.2f} GiB, {diff})")
            else:
                cells.append("—")
        lines.append(f"| {','.join(map(str, r['shape']))} | {'yes' if r['causal'] else 'no'} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Targets (N ≥ 4096): flash ≥ 1.0× Flex and ≥ 1.3× SDPA-flash, forward and backward; "
              "stretch ≥ 0.9× cuDNN. Ratios flash / peer:", "",
              "| B,H,N,D | causal | vs flex fwd / bwd | vs sdpa-flash fwd / bwd | vs cudnn fwd / bwd "
              "| vs fa4 fwd / bwd | met |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        pr = r["providers"]
        f = pr.get("flash", {})

        def ratio(peer, mode):
            m = pr.get(peer, {})
            if f.get(f"{mode}_tflops") and m.get(f"{mode}_tflops"):
                return f[f"{mode}_tflops"] / m[f"{mode}_tflops"]
            return None
        rf, rb = ratio("flex", "fwd"), ratio("flex", "bwd")
        sf, sb = ratio("sdpa-flash", "fwd"), ratio("sdpa-flash", "bwd")
        cf, cb = ratio("sdpa-cudnn", "fwd"), ratio("sdpa-cudnn", "bwd")
        af, ab = ratio("fa4", "fwd"), ratio("fa4", "bwd")
        if r["shape"][2] >= 4096:
            checks = [x is not None and x >= t for x, t in ((rf, 1.0), (rb, 1.0), (sf, 1.3), (sb, 1.3))]
            met = "yes" if all(checks) else "no"
            if all(x is not None and x >= 0.9 for x in (cf, cb)):
                met += " (+cuDNN stretch)"
        else:
            met = "n/a (N < 4096)"
        lines.append(f"| {','.join(map(str, r['shape']))} | {'yes' if r['causal'] else 'no'} | "
                     f"{fmt(rf, 2)} / {fmt(rb, 2)} | {fmt(sf, 2)} / {fmt(sb, 2)} | {fmt(cf, 2)} / {fmt(cb, 2)} | "
                     f"{fmt(af, 2)} / {fmt(ab, 2)} | {met} |")
    skips = {}  # (provider, reason) -> cases: one line per distinct reason
    for r in results:
        for p, m in r["providers"].items():
            if "skipped" in m:
                skips.setdefault((p, m["skipped"]), []).append(r)
    if skips:
        lines += ["", "Skipped:", ""] + [f"- {p}: {why} ({len(rs)} of {len(results)} cases)"
                                         for (p, why), rs in skips.items()]
    errs = [(r["shape"], r["causal"], p, m["error"]) for r in results for p, m in r["providers"].items()
            if "error" in m]
    if errs:
        lines += ["", "Not measured:", ""] + [f"- {s} causal={c} {p}: {e}" for s, c, p, e in errs]
    return "\n".join(lines) + "\n"


def render_varlen(results, meta):
    """The --varlen table: TFLOP/s forward / backward of each provider (visible pairs only) and flash / flex."""
    lines = [f"# Document-masked attention benchmark ({meta['gpu']})", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; torch {meta['torch']}, triton "
             f"{meta['triton']}; bf16; do_bench medians; documents of seeded exponential lengths packed into B·N "
             "tokens, causal within each; FLOPs 4·H·D per visible (query, key) pair, bwd ×2.5.", "",
             "| B·N tokens, H, D | documents (mean len) | window | " + " | ".join(VARLEN_PROVIDERS)
             + " | flash / flex fwd / bwd | kernels only: flash / flex fwd / bwd |",
             "| --- | --- | --- | " + " | ".join("---" for _ in VARLEN_PROVIDERS) + " | --- | --- |"]
    for r in results:
        pr = r["providers"]
        cells = []
        for p in VARLEN_PROVIDERS:
            m = pr.get(p, {})
            if "fwd_tflops" in m:
                diff = "ref" if m["diff"] is None else f"diff {m['diff']:.1e}"
                cells.append(f"{m['fwd_tflops']:.0f} / {m['bwd_tflops']:.0f} ({m['peak_gib']:.2f} GiB, {diff})")
            else:
                cells.append("—")
        f, x = pr.get("flash", {}), pr.get("flex", {})
        ratios = [f[f"{mode}_tflops"] / x[f"{mode}_tflops"] if f.get(f"{mode}_tflops") and x.get(f"{mode}_tflops")
                  else None for mode in ("fwd", "bwd")]
        kratios = [x[f"{mode}_kernel_ms"] / f[f"{mode}_kernel_ms"] if f.get(f"{mode}_kernel_ms")
                   and x.get(f"{mode}_kernel_ms") else None for mode in ("fwd", "bwd")]
        B, H, N, D = r["shape"]
        lines.append(f"| {B * N}, {H}, {D} | {r['n_docs']} ({r['doc_mean']:g}) | {r['window'] or '—'} | "
                     + " | ".join(cells) + f" | {fmt(ratios[0], 2)} / {fmt(ratios[1], 2)} | "
                     f"{fmt(kratios[0], 2)} / {fmt(kratios[1], 2)} |")
    lines += ["", "Target: flash ≥ 1.0× flex, forward and backward. The ratios are of do_bench's call times; the "
              "last column divides the GPU time of each call's kernels alone (torch.profiler), which leaves out "
              "any host time a short call's timing includes."]
    errs = [(r["shape"], p, m["error"]) for r in results for p, m in r["providers"].items() if "error" in m]
    if errs:
        lines += ["", "Not measured:", ""] + [f"- {s} {p}: {e}" for s, p, e in errs]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (no GPU needed to parse it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="extra folder for the JSON/markdown copies")
    ap.add_argument("--deadline-s", type=float, default=None, help="skip what would start after this")
    ap.add_argument("--providers", default=None,
                    help=f"comma-separated (default: {','.join(PROVIDERS)}; --varlen: {','.join(VARLEN_PROVIDERS)})")
    ap.add_argument("--shapes", nargs="*", default=None, help="B,H,N,D ...")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--warm-compile-only", action="store_true",
                    help="only compile Flex for every case (to fill the inductor cache), no timing")
    ap.add_argument("--tag", default=None, help="file name stem under bench/results/ (default: attention, "
                                                "attention_varlen with --varlen)")
    ap.add_argument("--varlen", action="store_true",
                    help="documents packed in B·N tokens: flash with document bounds against Flex's document mask")
    ap.add_argument("--doc-mean", type=float, default=512.0, help="--varlen: mean document length in tokens")
    ap.add_argument("--doc-seed", type=int, default=0, help="--varlen: seed of the document lengths")
    ap.add_argument("--window", type=int, default=0, help="--varlen: sliding window (0 = none)")
    args = ap.parse_args(argv)
    try:
        args.shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES)
    except ValueError:
        ap.error(f"--shapes: expected B,H,N,D integers, got {' '.join(args.shapes)}")
    if any(len(s) != 4 or min(s) < 1 for s in args.shapes):
        ap.error("--shapes: each shape is four positive integers B,H,N,D")
    known = VARLEN_PROVIDERS if args.varlen else PROVIDERS
    args.providers = args.providers.split(",") if args.providers else list(known)
    unknown = [p for p in args.providers if p not in known]
    if unknown:
        ap.error(f"--providers: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.doc_mean < 1 or args.window < 0:
        ap.error("--doc-mean must be >= 1 and --window >= 0")
    if args.window and not args.varlen:
        ap.error("--window applies to --varlen")
    args.tag = args.tag or ("attention_varlen" if args.varlen else "attention")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/attention.py needs a CUDA GPU")
    t_start = time.time()
    shapes, providers = args.shapes, args.providers
    causals = {"both": [True, False], "yes": [True], "no": [False]}[args.causal]
    import triton

    from kernels import options
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                command="python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:])
                + (f" (run by `{os.environ['ATTN_BENCH_VIA']}`)" if os.environ.get("ATTN_BENCH_VIA") else ""))
    dtype = torch.bfloat16
    if args.varlen:
        return run_varlen(args, meta, t_start)
    results = []
    for shape in shapes:
        B, H, N, D = shape
        for causal in causals:
            g = torch.Generator(device="cuda").manual_seed(1234 + N + D + int(causal))
            q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=g) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()
            row = dict(shape=list(shape), causal=causal, providers={})
            ref = None
            order = ["sdpa-flash"] + [p for p in providers if p != "sdpa-flash"]
            for p in order:
                if p not in providers and p != "sdpa-flash":
                    continue
                if args.warm_compile_only and p != "flex":
                    continue
                if args.deadline_s is not None and time.time() - t_start > args.deadline_s:
                    row["providers"][p] = dict(error="skipped: benchmark deadline reached")
                    continue
                try:
                    fn = make_provider(p, N, causal, q=q)
                    if args.warm_compile_only:
                        t0 = time.time()
                        fwd_bwd(fn, q, k, v, do)
                        torch.cuda.synchronize()
                        print(f"warm {p} {shape} causal={causal}: {time.time() - t0:.1f}s", flush=True)
                        continue
                    with options.use(**PINNED.get(p, {})):
                        m = measure(p, fn, q, k, v, do, ref, args.warmup, args.rep)
                    if p == "sdpa-flash":
                        ref = fwd_bwd(fn, q, k, v, do)
                    m["fwd_tflops"] = flops(B, H, N, D, causal, "fwd") / (m["fwd_ms"] * 1e-3) / 1e12
                    m["bwd_tflops"] = flops(B, H, N, D, causal, "bwd") / (m["bwd_ms"] * 1e-3) / 1e12
                    row["providers"][p] = m
                    print(f"{shape} causal={causal!s:5} {p:10s} fwd {m['fwd_tflops']:6.1f} TFLOP/s "
                          f"({m['fwd_ms']:.3f} ms)  bwd {m['bwd_tflops']:6.1f} TFLOP/s ({m['bwd_ms']:.3f} ms)  "
                          f"peak {m['peak_gib']:.2f} GiB  diff {m['diff'] if m['diff'] is None else format(m['diff'], '.1e')}  first call {m['first_call_s']:.1f}s",
                          flush=True)
                except Unavailable as e:  # a peer this machine cannot run: one note in the report
                    row["providers"][p] = dict(skipped=str(e))
                    print(f"{shape} causal={causal} {p}: skipped: {e}", flush=True)
                except Exception as e:  # noqa: BLE001 - a provider that cannot run is reported, not fatal
                    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    row["providers"][p] = dict(error=msg)
                    print(f"{shape} causal={causal} {p}: {msg}", flush=True)
                    if p == "flash":
                        traceback.print_exc()
                torch.cuda.empty_cache()
            del q, k, v, do, ref
            torch.cuda.empty_cache()
            results.append(row)
            if not args.warm_compile_only:
                _write(results, meta, args)
    if args.warm_compile_only:
        return
    meta["autotune_picks"] = autotune_picks()
    meta["wall_s"] = time.time() - t_start
    _write(results, meta, args)
    print()
    print(render(results, meta))


def varlen_cases(shapes):
    """The shapes of distinct --varlen cases: packed into one sequence, (B, H, N, D) is the case (B·N, H, D), so
    two shapes with the same B·N, H and D (e.g. 4,16,4096,128 and 1,16,16384,128) are one case; the first
    is kept."""
    seen, out = set(), []
    for B, H, N, D in shapes:
        if (B * N, H, D) not in seen:
            seen.add((B * N, H, D))
            out.append((B, H, N, D))
    return out


def run_varlen(args, meta, t_start):
    """--varlen: per shape, one packed sequence of documents; every provider on the same tensors."""
    dtype = torch.bfloat16
    results = []
    for shape in varlen_cases(args.shapes):
        B, H, N, D = shape
        lengths = doc_lengths(B * N, args.doc_mean, args.doc_seed)
        g = torch.Generator(device="cuda").manual_seed(4321 + N + D)
        q, k, v, do = (torch.randn(1, H, B * N, D, device="cuda", dtype=dtype, generator=g) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        row = dict(shape=list(shape), causal=True, window=args.window, doc_mean=args.doc_mean,
                   doc_seed=args.doc_seed, n_docs=len(lengths), providers={})
        ref = None
        for p in args.providers:
            if args.deadline_s is not None and time.time() - t_start > args.deadline_s:
                row["providers"][p] = dict(error="skipped: benchmark deadline reached")
                continue
            try:
                fn = make_varlen_provider(p, lengths, args.window)
                m = measure(p, fn, q, k, v, do, ref, args.warmup, args.rep, kernels=True)
                if ref is None:
                    ref = fwd_bwd(fn, q, k, v, do)
                m["fwd_tflops"] = varlen_flops(lengths, H, D, args.window, "fwd") / (m["fwd_ms"] * 1e-3) / 1e12
                m["bwd_tflops"] = varlen_flops(lengths, H, D, args.window, "bwd") / (m["bwd_ms"] * 1e-3) / 1e12
                row["providers"][p] = m
                print(f"{shape} docs={len(lengths)} window={args.window} {p:6s} fwd {m['fwd_tflops']:6.1f} TFLOP/s "
                      f"({m['fwd_ms']:.3f} ms)  bwd {m['bwd_tflops']:6.1f} TFLOP/s ({m['bwd_ms']:.3f} ms)  kernels "
                      + (f"{m['fwd_kernel_ms']:.3f} / {m['bwd_kernel_ms']:.3f} ms" if "fwd_kernel_ms" in m
                         else m.get("kernel_error", "—")), flush=True)
            except Exception as e:  # noqa: BLE001 - a provider that cannot run is reported, not fatal
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                row["providers"][p] = dict(error=msg)
                print(f"{shape} {p}: {msg}", flush=True)
                if p == "flash":
                    traceback.print_exc()
            torch.cuda.empty_cache()
        del q, k, v, do, ref
        results.append(row)
        _write(results, meta, args)
    meta["autotune_picks"] = autotune_picks()
    meta["wall_s"] = time.time() - t_start
    _write(results, meta, args)
    print()
    print(render_varlen(results, meta))


def _write(results, meta, args):
    blob = json.dumps(dict(meta=meta, results=results), indent=1)
    md = render_varlen(results, meta) if args.varlen else render(results, meta)
    dirs = [ROOT / "bench" / "results"] + ([pathlib.Path(args.out)] if args.out else [])
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{args.tag}.json").write_text(blob)
        (d / f"{args.tag}.md").write_text(md)


if __name__ == "__main__":
    main()
