"""Generation benchmark: GPT-2 124M shape in bf16, prompt 128, 256 new tokens, greedy, batch 1 and 16.

    python bench/generate.py                  # GPU: the decode variants side by side, then the decode-kernel sweep
    python bench/generate.py --compile        # + a torch.compile'd decode step inside the CUDA graph (~1 min more)
    python bench/generate.py --smoke          # CPU, tiny model, Triton interpreter: checks that the script runs

One randomly initialised model (n_layer 12, n_head 12, n_embd 768, block_size 1024, vocab 50304, bf16; random
weights cost the same time as trained ones), random prompt tokens, and `model.generation.generate` for every
variant, so all of them share the static KV cache, the prefill/decode split and the host loop:

    flashgpt-fused+graph   flash prefill, then model/fused_decode.py (fused LayerNorm/matmul/bias/GELU/residual
                     Triton kernels, k/v written into the cache by the QKV kernel, split-KV decode attention)
                     replayed as a CUDA graph: generate()'s default on a GPU
    flashgpt-fused   the same, eager
    flashgpt+graph   flash prefill + the model's own decode step (split-KV decode kernel for attention, PyTorch
                     for the rest) replayed as a CUDA graph
    flashgpt         the same, eager
    sdpa             plain PyTorch: attention="sdpa" (F.scaled_dot_product_attention over the same static cache,
                     with a mask), eager
    sdpa+graph       the same plain PyTorch decode step under a CUDA graph
    flashgpt+compile+graph   (--compile) torch.compile'd decode step inside the CUDA graph

Per variant and batch, medians over --reps runs after one warm-up run:
    prefill ms   the prompt's forward pass (synchronised)
    TTFT ms      prefill + sampling + the first tokens on the host (graph capture happens before, once per call)
    decode tok/s tokens produced by the decode steps (B x 255) / the time from the first tokens on the host to
                 the last ones: the whole loop, host work included
    step µs      that time / decode steps
    graph replay µs   (graph variants) the GPU time of one bare replay of the captured step, at cache length
                 prompt + new/2, without the host loop or sampling: what the loop could reach
Correctness first: the greedy tokens of flashgpt-fused+graph (flashgpt-fused on CPU) against plain PyTorch (sdpa, eager); bf16 rounding may
flip a near-tie and the sequences then diverge, so the agreement is reported, not required. Each variant runs
in its own try/except: a failure is recorded and the others go on. Then bench/decode_attention.py (imported, not
copied) sweeps the decode attention kernel over cache lengths 1k..32k against the non-split kernel and SDPA.
Writes generate.json and generate.md (generate_smoke.* with --smoke) to --out (default bench/results/) and to
$OUT when that is set, after every stage, so that a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for JSON + markdown (default bench/results/)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (Triton interpreter): seconds")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per sequence (default 128)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per sequence (default 256)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per variant (median)")
    p.add_argument("--compile", action="store_true", help="add the torch.compile + CUDA graph variant")
    p.add_argument("--no-kernel-sweep", action="store_true", help="skip bench/decode_attention.py")
    p.add_argument("--variants", default=None, help="comma-separated subset of the variant names (default: all)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None  # imported (bench/pdl_sweep.py): its helpers only
if ARGS is not None and ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model import GPT, GPTConfig  # noqa: E402
from model.fused_decode import fused_decode_step  # noqa: E402
from model.generation import DecodeGraph, decode_one_token, generate  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402

COPY_BW = 4.30e12  # bytes/s, the H200's device-to-device copy (ANCHORS.md): the memory-bandwidth limit below
TARGETS = {1: 3000.0, 16: 40000.0}  # decode tok/s of the best flashgpt graph variant on the H200 (the issue)


def build_model(smoke: bool, device, dtype) -> GPT:
    if smoke:
        cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=128)
    else:
        cfg = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    return model.to(dtype).eval()


def variants(device, compile_variant: bool):
    """name → (attention backend, cuda_graph, compile, fused)."""
    out = {"flashgpt-fused+graph": ("flash", True, False, True), "flashgpt-fused": ("flash", False, False, True),
           "flashgpt+graph": ("flash", True, False, False), "flashgpt": ("flash", False, False, False),
           "sdpa": ("sdpa", False, False, False), "sdpa+graph": ("sdpa", True, False, False)}
    if compile_variant:
        out["flashgpt+compile+graph"] = ("flash", True, True, False)
    return out


def run_variant(model, prompts, new_tokens, backend, cuda_graph, compile_step, fused, reps):
    """One warm-up run, then `reps` timed runs → dict of medians and the greedy tokens of the last run."""
    model.set_attention_backend(backend)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)

    def once():
        return generate(model, prompts, params, cuda_graph=cuda_graph, compile=compile_step, fused=fused)

    t = time.perf_counter()
    once()  # warm-up: autotuning, compilation, cuBLAS handles
    warmup_s = time.perf_counter() - t
    runs = [once() for _ in range(reps)]
    med = lambda f: statistics.median(f(s) for s in runs)  # noqa: E731
    return dict(prefill_ms=med(lambda s: s.prefill_seconds * 1e3),
                ttft_ms=med(lambda s: s.time_to_first_token * 1e3),
                decode_tok_s=med(lambda s: s.decode_tokens_per_s),
                step_us=med(lambda s: s.decode_seconds / max(s.decode_steps, 1) * 1e6),
                setup_ms=med(lambda s: s.setup_seconds * 1e3),
                warmup_s=round(warmup_s, 2), decode_tokens=runs[-1].decode_tokens,
                decode_steps=runs[-1].decode_steps), runs[-1].sequences


def graph_replay_us(model, B: int, max_len: int, pos: int, compile_step: bool, fused: bool,
                    iters: int = 200) -> float:
    """GPU time of one decode step as a bare graph replay (no host loop, no sampling): the loop's floor."""
    device = model.lm_head.weight.device
    model.setup_kv_cache(B, max_len)
    try:
        step = fused_decode_step if fused else decode_one_token
        step = torch.compile(step, dynamic=False) if compile_step else step
        graph = DecodeGraph(model, B, device, step)
        graph(model, torch.randint(0, model.config.vocab_size, (B, 1), device=device),
              torch.full((B, 1), pos, device=device))  # attend to pos + 1 cached keys
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            graph.graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    finally:
        model.clear_kv_cache()


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Fraction of positions with the same token, and where each sequence first differs (median)."""
    same = total = 0
    first = []
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        same += sum(int(p == q) for p, q in zip(x[:n], y[:n]))
        total += max(len(x), len(y))
        first.append(next((i for i in range(n) if x[i] != y[i]), n))
    return dict(fraction=round(same / max(total, 1), 4), first_difference_median=statistics.median(first),
                identical_sequences=sum(int(x == y) for x, y in zip(a, b)), sequences=len(a))


def weights_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied lm_head counted once


def kernel_sweep(out_dirs, smoke: bool) -> dict:
    """bench/decode_attention.py, imported and run with its own arguments (it parses sys.argv at import)."""
    argv = sys.argv
    sys.argv = ["bench/decode_attention.py", "--out", str(out_dirs[0])] + (["--smoke"] if smoke else [])
    try:
        spec = importlib.util.spec_from_file_location("bench_decode_attention", ROOT / "bench" / "decode_attention.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        rc = mod.main()
    finally:
        sys.argv = argv
    name = "decode_attention_smoke" if smoke else "decode_attention"
    data = json.loads((Path(out_dirs[0]) / f"{name}.json").read_text())
    md = (Path(out_dirs[0]) / f"{name}.md").read_text()
    for d in out_dirs[1:]:
        (Path(d) / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
        (Path(d) / f"{name}.md").write_text(md)
    return dict(returncode=rc, target=data["meta"]["target"], failures=data["meta"]["correctness_failures"],
                markdown=md, files=f"{name}.json, {name}.md")


def render_markdown(meta, rows, checks, sweep) -> str:
    lines = [f"# Generation: flashgpt vs plain PyTorch decode ({meta['shape']}, {meta['dtype']})", "",
             f"`{meta['command']}`", "",
             f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. Prompt "
             f"{meta['prompt_len']} random tokens, {meta['new_tokens']} new tokens, greedy; medians of "
             f"{meta['reps']} runs after a warm-up. {meta['definitions']}", "",
             "| batch | variant | prefill ms | TTFT ms | decode tok/s | step µs | graph replay µs | vs sdpa eager "
             "| vs sdpa+graph | bandwidth limit tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            what = r["error"] if r["error"].startswith("skipped") else f"failed: {r['error']}"
            lines.append(f"| {r['batch']} | {r['variant']} | {what} | | | | | | | |")
            continue
        ratio = lambda key: f"{r[key]:.2f}x" if r.get(key) else "–"  # noqa: E731
        lines.append(f"| {r['batch']} | {r['variant']} | {r['prefill_ms']:.2f} | {r['ttft_ms']:.2f} "
                     f"| {r['decode_tok_s']:,.0f} | {r['step_us']:.0f} "
                     f"| {format(r['graph_replay_us'], '.0f') if 'graph_replay_us' in r else '–'} "
                     f"| {ratio('vs_sdpa')} | {ratio('vs_sdpa_graph')} "
                     f"| {r['bandwidth_limit_tok_s']:,.0f} |")
    lines.append("")
    for b, t in meta["targets"].items():
        lines.append(f"- Target batch {b}: flashgpt decode >= {t['target']:,.0f} tok/s: "
                     f"{'n/a' if t['measured'] is None else format(t['measured'], ',.0f') + ' (' + t['variant'] + ')'}"
                     f" → {t['verdict']}")
    lines.append("")
    lines.append("Correctness (greedy tokens against plain PyTorch; bf16 may flip a near-tie, then they diverge):")
    for c in checks:
        lines.append(f"- batch {c['batch']}: " + (c["error"] if "error" in c else
                     f"{c['compared']}: {c['fraction'] * 100:.1f}% of positions agree, "
                     f"{c['identical_sequences']}/{c['sequences']} "
                     f"sequences identical, first difference at median position {c['first_difference_median']}; "
                     f"first tokens (prefill) agree: {c['first_tokens_agree']}"))
    if sweep:
        lines += ["", "## Decode attention kernel sweep (bench/decode_attention.py)", ""]
        if "error" in sweep:
            lines.append(f"failed: {sweep['error']}")
        else:
            lines.append(sweep["markdown"].split("\n", 2)[2] if sweep["markdown"].startswith("#") else sweep["markdown"])
    return "\n".join(lines) + "\n"


def main() -> int:
    smoke = ARGS.smoke
    if not smoke and not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU (use --smoke on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16  # the interpreter's tl.dot is wrong for bf16
    batches = [int(x) for x in ARGS.batches.split(",")] if ARGS.batches else ([1, 2] if smoke else [1, 16])
    prompt_len = ARGS.prompt_len or (8 if smoke else 128)
    new_tokens = ARGS.new_tokens or (6 if smoke else 256)
    reps = 1 if smoke else ARGS.reps
    out_dirs = [Path(ARGS.out) if ARGS.out else ROOT / "bench" / "results"]
    if os.environ.get("OUT") and Path(os.environ["OUT"]).resolve() != out_dirs[0].resolve():
        out_dirs.append(Path(os.environ["OUT"]))
    for d in out_dirs:
        d.mkdir(parents=True, exist_ok=True)
    name = "generate_smoke" if smoke else "generate"

    model = build_model(smoke, device, dtype)
    c = model.config
    wbytes = weights_bytes(model)
    meta = dict(command="python " + " ".join(["bench/generate.py", *sys.argv[1:]]),
                date=datetime.datetime.now().isoformat(timespec="seconds"), smoke=smoke,
                device=torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({platform.machine()}), "
                "Triton interpreter",
                torch=torch.__version__, triton=__import__("triton").__version__, dtype=str(dtype).replace("torch.", ""),
                shape=f"n_layer {c.n_layer}, n_head {c.n_head}, n_embd {c.n_embd}, vocab {c.vocab_size}",
                params=sum(p.numel() for p in model.parameters()), prompt_len=prompt_len, new_tokens=new_tokens,
                reps=reps, batches=batches,
                definitions="decode tok/s = B x decode steps / loop time (host included); bandwidth limit = "
                            f"B x {COPY_BW / 1e12:.2f} TB/s / (weight bytes + KV cache bytes read per step).")
    rows, checks, sweep = [], [], None

    def save():
        targets = {}
        for b, t in TARGETS.items():  # the best flashgpt graph variant (with or without torch.compile)
            ok = [r for r in rows if r["batch"] == b and r["variant"].endswith("graph")
                  and r["variant"].startswith("flashgpt") and "error" not in r]
            r = max(ok, key=lambda r: r["decode_tok_s"], default=None)
            targets[b] = dict(target=t, measured=r and r["decode_tok_s"], variant=r and r["variant"],
                              verdict="not measured" if r is None or smoke else
                              ("met" if r["decode_tok_s"] >= t else "NOT met"))
        meta["targets"] = targets
        md = render_markdown(meta, rows, checks, sweep)
        for d in out_dirs:
            (d / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows, correctness=checks,
                                                            kernel_sweep={k: v for k, v in (sweep or {}).items()
                                                                          if k != "markdown"}), indent=2) + "\n")
            (d / f"{name}.md").write_text(md)
        return md

    g = torch.Generator().manual_seed(1)
    for B in batches:
        prompts = torch.randint(0, c.vocab_size, (B, prompt_len), generator=g).tolist()
        kv_bytes = 2 * c.n_layer * B * c.kv_heads * c.head_dim * (prompt_len + new_tokens // 2) * dtype.itemsize
        limit = B * COPY_BW / (wbytes + kv_bytes)
        tokens = {}
        for vname, (backend, graph, comp, fused) in variants(device, ARGS.compile and not smoke).items():
            if ARGS.variants and vname not in ARGS.variants.split(","):
                continue
            if graph and device.type != "cuda":
                rows.append(dict(batch=B, variant=vname, error="skipped: CUDA graphs need a GPU"))
                continue
            try:
                res, tokens[vname] = run_variant(model, prompts, new_tokens, backend, graph, comp, fused, reps)
                if graph:  # the same step's GPU time alone, at the middle of the generation's cache lengths
                    try:
                        res["graph_replay_us"] = graph_replay_us(model, B, prompt_len + new_tokens,
                                                                 prompt_len + new_tokens // 2, comp, fused)
                    except Exception as e:
                        res["graph_replay_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
                rows.append(dict(batch=B, variant=vname, **res, bandwidth_limit_tok_s=round(limit)))
                print(f"B={B:3d} {vname:24s} prefill {res['prefill_ms']:8.2f} ms  TTFT {res['ttft_ms']:8.2f} ms  "
                      f"decode {res['decode_tok_s']:10,.0f} tok/s  ({res['step_us']:7.0f} µs/step)", flush=True)
            except Exception as e:  # record and go on with the other variants
                err = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                rows.append(dict(batch=B, variant=vname, error=err))
                print(f"B={B:3d} {vname:24s} FAILED {err}", flush=True)
                traceback.print_exc()
            finally:
                model.clear_kv_cache()
        base = {r["variant"]: r["decode_tok_s"] for r in rows if r["batch"] == B and "error" not in r}
        for r in rows:
            if r["batch"] == B and "error" not in r:
                r["vs_sdpa"] = base.get("sdpa") and round(r["decode_tok_s"] / base["sdpa"], 2)
                r["vs_sdpa_graph"] = base.get("sdpa+graph") and round(r["decode_tok_s"] / base["sdpa+graph"], 2)
        mine = next((v for v in ("flashgpt-fused+graph", "flashgpt-fused", "flashgpt+graph", "flashgpt")
                     if v in tokens), None)
        ours = tokens.get(mine)
        if ours is not None and "sdpa" in tokens:
            a = dict(compared=f"{mine} vs sdpa", **agreement(ours, tokens["sdpa"]))
            a["first_tokens_agree"] = sum(int(x[:1] == y[:1]) for x, y in zip(ours, tokens["sdpa"]))
            checks.append(dict(batch=B, **a))
        else:
            missing = "a variant failed" if any("error" in r for r in rows if r["batch"] == B) else \
                "sdpa (eager) was not among --variants"
            checks.append(dict(batch=B, error=f"not compared: {missing}"))
        save()

    if not ARGS.no_kernel_sweep:
        try:
            sweep = kernel_sweep(out_dirs, smoke)
        except Exception as e:
            sweep = dict(error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
            traceback.print_exc()
    md = save()
    print("\n" + md)
    print(f"wrote {', '.join(str(d / name) for d in out_dirs)}.json and .md")
    failed = [r for r in rows if "error" in r and not r["error"].startswith("skipped")]
    return 1 if failed or (sweep and (sweep.get("error") or sweep.get("returncode"))) else 0


if __name__ == "__main__":
    sys.exit(main())
