"""Generation benchmark: a GPT-2 124M or SmolLM2-135M shape in bf16, prompt 128, 256 new tokens, greedy, batch 1 and 16.

    python bench/generate.py                  # GPU, GPT-2 shape: the decode variants side by side, then the
                                              # decode-kernel sweep
    python bench/generate.py --model smollm2  # GPU, SmolLM2-135M shape: the same variants and transformers
    python bench/generate.py --model qwen3    # GPU, Qwen3-0.6B shape (q and k norms): the same
    python bench/generate.py --model gemma3   # GPU, Gemma 3 270M shape (sandwich norms, GeGLU, windows): the same
    python bench/generate.py --model olmo2    # GPU, OLMo 2 1B shape (norms after the sub-blocks, q/k norms over all
                                              # heads): the same
    python bench/generate.py --model configs/llama_demo.toml   # GPU, the [model] shape of any training config
    python bench/generate.py --compile        # + a torch.compile'd decode step inside the CUDA graph (~1 min more)
    python bench/generate.py --smoke [--model smollm2]   # CPU, tiny model, Triton interpreter: checks the script

One randomly initialised model (random weights cost the same time as trained ones), random prompt tokens:

    gpt2      n_layer 12, n_head 12, n_embd 768, block_size 1024, vocab 50304: learned positions, LayerNorm,
              GELU MLP, biases, tied LM head
    smollm2   SmolLM2-135M: n_layer 30, n_embd 576, n_head 9 over n_kv_head 3 (GQA), SwiGLU 1536 wide, vocab 49152,
              RoPE (theta 100000), RMSNorm, no biases, tied LM head
    qwen3     Qwen3-0.6B (configs/qwen3_0_6b.toml): n_layer 28, n_embd 1024, n_head 16 over n_kv_head 8 of 128,
              qk_norm, SwiGLU 3072 wide, vocab 151936, RoPE (theta 1e6), RMSNorm, no biases, tied LM head
    gemma3    Gemma 3 270M (configs/gemma3_270m.toml): n_layer 18, n_embd 640, n_head 4 over n_kv_head 1 of 256,
              RMSNorms scaled by 1 + weight (sandwich norms, q and k norms), GeGLU 2048 wide, vocab 262144,
              embeddings times sqrt(640), five of six layers windowed (512, RoPE theta 1e4), the rest global (1e6)
    olmo2     OLMo 2 1B (configs/olmo2_1b.toml): n_layer 16, n_embd 2048, n_head 16 of 128 (no GQA), SwiGLU 8192
              wide, vocab 100352, RMSNorms (weight in float32) only after the attention and the MLP, one q norm and
              one k norm over all heads, RoPE (theta 5e5), no biases, untied LM head

and `model.generation.generate` for every flashgpt variant, so all of them share the static KV cache, the
prefill/decode split and the host loop:

    flashgpt-fused+graph   flash prefill, then model/fused_decode.py (fused norm/matmul/bias/activation/residual
                     Triton kernels, RoPE and the k/v cache writes inside the QKV kernel, split-KV decode
                     attention) replayed as a CUDA graph: generate()'s default on a GPU
    flashgpt-fused   the same, eager
    flashgpt-fused-layers+graph flashgpt-fused+graph with the kernel option decode_stack off: one sequence's step
                     as per-layer launches too, instead of every layer in one persistent launch
                     (kernels/decode_stack.py, which the default uses at batch 1 where its fits() takes the shape)
    flashgpt-fused-unmerged+graph flashgpt-fused+graph with the kernel option decode_stack_merged_sums off: the
                     one-launch stack's norm sums, QKV lane halves, gate and up and down projection each reduced
                     over two column blocks instead of one (kernels/decode_stack.py; the option applies up to
                     MERGED_MAX_C, SmolLM2-135M's width: GPT-2 124M's step is flashgpt-fused+graph's there)
    flashgpt-fused-mlp2+graph   flashgpt-fused+graph with the kernel option decode_fused_mlp off: each MLP block
                     as two launches (up projection + activation, down projection + residual), never as one
                     (kernels/decode_mlp.py, which the default uses where its fusable() takes the shape)
    flashgpt-fused-mlp1+graph   the same step with every MLP block as one launch (decode_mlp.forced_tile: programs
                     of 16 intermediate columns, 8 warps), at any batch and width it takes
    flashgpt-fused-mlp1w4+graph the same with 4 warps per program
    flashgpt+graph   flash prefill + the model's own decode step (split-KV decode kernel for attention, PyTorch
                     for the rest) replayed as a CUDA graph
    flashgpt         the same, eager
    sdpa             plain PyTorch: attention="sdpa" (F.scaled_dot_product_attention over the same static cache,
                     with a mask), eager
    sdpa+graph       the same plain PyTorch decode step under a CUDA graph
    flashgpt+compile+graph   (--compile) torch.compile'd decode step inside the CUDA graph
    transformers-static+compile   (all but gpt2 by default; needs transformers, skipped with a note without it) the
                     same weights in transformers' own architecture (model/export.py's config and tensor names),
                     `generate(cache_implementation="static")`, greedy, its decode forward under torch.compile:
                     where transformers has CompileConfig it compiles that forward itself (mode "reduce-overhead":
                     CUDA graphs), older versions get `forward = torch.compile(forward, mode="reduce-overhead",
                     fullgraph=True)`. On the CPU (--smoke) it runs as transformers-static, uncompiled.

Per variant and batch, medians over --reps runs after one warm-up run (two for transformers: compilation):
    prefill ms   the prompt's forward pass (synchronised; flashgpt only)
    TTFT ms      prefill + sampling + the first tokens on the host (graph capture happens before, once per call)
    decode tok/s tokens produced by the decode steps (B x 255) / the time from the first tokens on the host to
                 the last ones: the whole loop, host work included. transformers: from the first generated
                 token (a logits processor synchronises once and reads the clock there) to the end of generate()
    step µs      that time / decode steps
    weight GB/s  the weights' bytes / step time: the decode speed per byte of weights, comparable across shapes
    graph replay µs   (graph variants) the GPU time of one bare replay of the captured step, at cache length
                 prompt + new/2, without the host loop or sampling: what the loop could reach
Targets: gpt2, decode tok/s of the best flashgpt graph variant (TARGETS); smollm2 (and qwen3, gemma3, olmo2,
reported the same way), that variant's decode tok/s over transformers-static+compile's (RATIO_TARGETS: >= 2x at batch 1, >= 1.5x at 16).
Correctness first: the greedy tokens of flashgpt-fused+graph (flashgpt-fused on CPU) against plain PyTorch (sdpa,
eager) and against transformers (the same weights); bf16 rounding may flip a near-tie and the sequences then
diverge, so the agreement is reported, not required. Each variant runs in its own try/except: a failure is
recorded and the others go on. Then bench/decode_attention.py (imported, not copied) sweeps the decode attention
kernel over cache lengths 1k..32k against the non-split kernel and SDPA.
Writes generate[_<model>].json and .md (generate[_<model>]_smoke.* with --smoke) to --out (default
bench/results/) and to $OUT when that is set, after every stage, so that a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
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


MODELS = ("gpt2", "smollm2", "qwen3", "gemma3", "olmo2")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _model(text: str) -> str:
    if text in MODELS:
        return text
    if text.endswith(".toml"):
        if not Path(text).is_file():
            raise argparse.ArgumentTypeError(f"no config file {text}")
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a shape ({', '.join(MODELS)}) nor a .toml config")


def _batches(text: str) -> list[int]:
    return [_positive_int(x) for x in text.split(",")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=_model, default="gpt2",
                   help=f"the shape to decode: one of {', '.join(MODELS)} (default gpt2), or a training config's "
                        "TOML file (its [model] section; results named after the file)")
    p.add_argument("--out", default=None, help="directory for JSON + markdown (default bench/results/)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (Triton interpreter): seconds")
    p.add_argument("--batches", type=_batches, default=None, help="comma-separated batch sizes (default 1,16)")
    p.add_argument("--prompt-len", type=_positive_int, default=None, help="prompt tokens per sequence (default 128)")
    p.add_argument("--new-tokens", type=_positive_int, default=None,
                   help="new tokens per sequence (default 256; at least 2)")
    p.add_argument("--reps", type=_positive_int, default=3, help="timed runs per variant (median)")
    p.add_argument("--compile", action="store_true", help="add the torch.compile + CUDA graph variant")
    p.add_argument("--no-kernel-sweep", action="store_true", help="skip bench/decode_attention.py")
    p.add_argument("--variants", default=None, help="comma-separated subset of the variant names (default: all)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None  # imported (bench/pdl_sweep.py): its helpers only
if ARGS is not None and ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kernels.decode_mlp as decode_mlp  # noqa: E402
from kernels import options as kernel_options  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.fused_decode import fused_decode_step  # noqa: E402
from model.generation import DecodeGraph, decode_one_token, generate  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402

COPY_BW = 4.30e12  # bytes/s, the H200's device-to-device copy (ANCHORS.md): the memory-bandwidth limit below
TARGETS = {1: 3000.0, 16: 40000.0}  # gpt2: decode tok/s of the best flashgpt graph variant on the H200
RATIO_TARGETS = {1: 2.0, 16: 1.5}  # smollm2: that variant's decode tok/s over transformers-static+compile's
LLAMA = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)
GEMMA3 = dict(pos_emb="rope", norm="rmsnorm1p", mlp="geglu", bias=False, sandwich_norm=True, embed_scale=True,
              qk_norm=True, norm_eps=1e-6, attention_window=512, full_attention_interval=6, rope_theta=1e6,
              rope_local_theta=1e4)
OLMO2 = dict(pos_emb="rope", norm="rmsnorm_fp32", mlp="swiglu", bias=False, pre_norm=False, sandwich_norm=True,
             qk_norm=True, qk_norm_scope="all", norm_eps=1e-6, rope_theta=5e5, tie_embeddings=False)
SHAPES = {  # (full size, --smoke)
    "gpt2": (dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
             dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=128)),
    "smollm2": (dict(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, intermediate_size=1536, vocab_size=49152,
                     block_size=2048, rope_theta=100000.0, **LLAMA),
                dict(n_layer=2, n_head=3, n_kv_head=1, n_embd=48, intermediate_size=64, vocab_size=128,
                     block_size=64, rope_theta=100000.0, **LLAMA)),
    "qwen3": (dict(n_layer=28, n_head=16, n_kv_head=8, n_embd=1024, head_size=128, intermediate_size=3072,
                   vocab_size=151936, block_size=2048, rope_theta=1e6, norm_eps=1e-6, qk_norm=True, **LLAMA),
              dict(n_layer=2, n_head=2, n_kv_head=1, n_embd=48, head_size=32, intermediate_size=64, vocab_size=128,
                   block_size=64, rope_theta=1e6, norm_eps=1e-6, qk_norm=True, **LLAMA)),
    "gemma3": (dict(n_layer=18, n_head=4, n_kv_head=1, n_embd=640, head_size=256, intermediate_size=2048,
                    vocab_size=262144, block_size=2048, **GEMMA3),
               dict(n_layer=3, n_head=2, n_kv_head=1, n_embd=48, head_size=32, intermediate_size=64, vocab_size=128,
                    block_size=64, **{**GEMMA3, "attention_window": 8, "full_attention_interval": 3})),
    "olmo2": (dict(n_layer=16, n_head=16, n_kv_head=16, n_embd=2048, intermediate_size=8192, vocab_size=100352,
                   block_size=2048, **OLMO2),
              dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=48, intermediate_size=64, vocab_size=128, block_size=64,
                   **OLMO2)),
}
HF_VARIANTS = ("transformers-static+compile", "transformers-static")  # GPU (compiled), CPU (--smoke)


def shape_config(name: str, smoke: bool) -> GPTConfig:
    """The model config of `name`: a shape of SHAPES (its --smoke size with smoke), or a training config's TOML
    file, whose [model] section is taken as it is (vocab_size 0, the GPT-2 tokenizer's padded 50304)."""
    if name in SHAPES:
        return GPTConfig(**SHAPES[name][1 if smoke else 0])
    from bench.train import toml_model_config  # here: after --smoke has chosen the interpreter
    return toml_model_config(name)


def build_model(name: str, smoke: bool, device, dtype) -> GPT:
    """The benchmark's model of shape `name` (shape_config), randomly initialised (seed 0), in eval mode."""
    cfg = shape_config(name, smoke)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    return model.to(dtype).eval()


def variants(device, compile_variant: bool, transformers: bool = False) -> dict:
    """name → (provider, attention backend, cuda_graph, compile, fused); provider "flashgpt" or "transformers"
    (with transformers=True: compiled on a GPU, eager on the CPU)."""
    out = {"flashgpt-fused+graph": ("flashgpt", "flash", True, False, True),
           "flashgpt-fused-layers+graph": ("flashgpt", "flash", True, False, True),
           "flashgpt-fused-unmerged+graph": ("flashgpt", "flash", True, False, True),
           "flashgpt-fused-mlp2+graph": ("flashgpt", "flash", True, False, True),
           "flashgpt-fused-mlp1+graph": ("flashgpt", "flash", True, False, True),
           "flashgpt-fused-mlp1w4+graph": ("flashgpt", "flash", True, False, True),
           "flashgpt-fused": ("flashgpt", "flash", False, False, True),
           "flashgpt+graph": ("flashgpt", "flash", True, False, False),
           "flashgpt": ("flashgpt", "flash", False, False, False),
           "sdpa": ("flashgpt", "sdpa", False, False, False), "sdpa+graph": ("flashgpt", "sdpa", True, False, False)}
    if compile_variant:
        out["flashgpt+compile+graph"] = ("flashgpt", "flash", True, True, False)
    if transformers:
        on_gpu = torch.device(device).type == "cuda"
        out[HF_VARIANTS[0] if on_gpu else HF_VARIANTS[1]] = ("transformers", "sdpa", False, on_gpu, False)
    return out


VARIANT_SETUP = {  # variant -> a context that sets what the variant changes (kernel options, tiles)
    "flashgpt-fused-layers+graph": lambda: kernel_options.use(decode_stack=False),
    "flashgpt-fused-unmerged+graph": lambda: kernel_options.use(decode_stack_merged_sums=False),
    "flashgpt-fused-mlp2+graph": lambda: kernel_options.use(decode_fused_mlp=False),
    "flashgpt-fused-mlp1+graph": lambda: decode_mlp.forced_tile(16, 8),
    "flashgpt-fused-mlp1w4+graph": lambda: decode_mlp.forced_tile(16, 4),
}


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


def transformers_model(model: GPT, device, dtype):
    """model's weights in transformers' own architecture for its config (model/export.py: config.json keys and
    tensor names), on `device` in `dtype`, eval mode. ImportError without transformers."""
    import transformers

    from model.export import hf_config, hf_family, hf_tensors
    cfg = model.config
    family = hf_family(cfg)
    conf = hf_config(family, cfg, dtype, None, None)  # no bos/eos: generation runs its full length
    for key in ("architectures", "torch_dtype"):
        conf.pop(key)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(conf.pop("model_type"),
                                                                                          **conf))
    missing, unexpected = hf.load_state_dict(hf_tensors(family, cfg, model.state_dict(), dtype), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_embeddings else set()):
        raise RuntimeError(f"transformers' {family} model does not take these weights: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf.to(device=device, dtype=dtype).eval()


def _transformers_compile(hf, device) -> tuple[dict, str]:
    """generate() arguments that put the decode forward under torch.compile on a GPU, and how (for the report)."""
    import transformers
    if torch.device(device).type != "cuda":
        return {}, "eager (CPU)"
    if hasattr(transformers, "CompileConfig"):  # generate() compiles the decode forward of a static cache itself
        return dict(compile_config=transformers.CompileConfig()), "transformers' CompileConfig (reduce-overhead)"
    if not getattr(hf, "_flashgpt_compiled", False):
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        hf._flashgpt_compiled = True
    return {}, "forward = torch.compile(mode='reduce-overhead', fullgraph=True)"


def run_transformers(hf, prompts, new_tokens: int, compiled: bool, reps: int) -> tuple[dict, list]:
    """transformers' greedy generate() with a static cache: warm-up runs, then `reps` timed runs → dict of
    medians (as run_variant) and the tokens of the last run."""
    import transformers
    device = hf.device
    ids = torch.tensor(prompts, dtype=torch.long, device=device)  # (B, T): the prompts have one length
    B, T = ids.shape

    class FirstTokenClock(transformers.LogitsProcessor):
        """Reads the clock once, when the first new token's logits exist (after the prefill)."""

        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                _sync(device)
                self.t = time.perf_counter()
            return scores

    extra, how = _transformers_compile(hf, device) if compiled else ({}, "eager")

    def once():
        clock = FirstTokenClock()
        _sync(device)
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          cache_implementation="static", pad_token_id=0,
                          logits_processor=transformers.LogitsProcessorList([clock]), **extra)
        _sync(device)
        t1 = time.perf_counter()
        if out.shape[1] != T + new_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - T} tokens, not {new_tokens}")
        return dict(ttft=clock.t - t0, decode=t1 - clock.t), out[:, T:].tolist()

    t = time.perf_counter()
    for _ in range(2 if compiled else 1):  # compilation, then CUDA graph recording
        once()
    warmup_s = time.perf_counter() - t
    runs = [once() for _ in range(reps)]
    steps = new_tokens - 1
    med = lambda f: statistics.median(f(r) for r, _ in runs)  # noqa: E731
    return dict(prefill_ms=None, ttft_ms=med(lambda r: r["ttft"] * 1e3),
                decode_tok_s=med(lambda r: B * steps / max(r["decode"], 1e-9)),
                step_us=med(lambda r: r["decode"] / max(steps, 1) * 1e6), setup_ms=None,
                warmup_s=round(warmup_s, 2), decode_tokens=B * steps, decode_steps=steps, compile=how), runs[-1][1]


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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
    """bench/decode_attention.py, imported and run with its own arguments (its main() reads sys.argv)."""
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


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def best_graph_row(rows, batch: int):
    """The fastest flashgpt CUDA-graph variant (with or without torch.compile) that ran at this batch, or None."""
    ok = [r for r in rows if r["batch"] == batch and r["variant"].startswith("flashgpt")
          and r["variant"].endswith("graph") and "error" not in r]
    return max(ok, key=lambda r: r["decode_tok_s"], default=None)


def targets_of(model_name: str, rows, smoke: bool) -> dict:
    """batch → the target, what was measured and the verdict: gpt2, the best flashgpt graph variant's decode
    tok/s (TARGETS); smollm2, its ratio to transformers-static+compile's (RATIO_TARGETS). --smoke measures none."""
    out = {}
    if model_name == "gpt2":
        for b, t in TARGETS.items():
            r = best_graph_row(rows, b)
            out[b] = dict(kind="tok/s", target=t, measured=r and r["decode_tok_s"], variant=r and r["variant"],
                          verdict="not measured" if r is None or smoke else
                          ("met" if r["decode_tok_s"] >= t else "NOT met"))
        return out
    for b, t in RATIO_TARGETS.items():
        r = best_graph_row(rows, b)
        hf = next((x for x in rows if x["batch"] == b and x["variant"] == HF_VARIANTS[0] and "error" not in x), None)
        ratio = r and hf and round(r["decode_tok_s"] / hf["decode_tok_s"], 3)
        out[b] = dict(kind="ratio", target=t, measured=ratio, variant=r and f"{r['variant']} / {HF_VARIANTS[0]}",
                      verdict="not measured" if ratio is None or smoke else ("met" if ratio >= t else "NOT met"))
    return out


def render_markdown(meta, rows, checks, sweep) -> str:
    lines = [f"# Generation: flashgpt vs plain PyTorch decode ({meta['model']}: {meta['shape']}, {meta['dtype']})",
             "", f"`{meta['command']}`", "",
             f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, "
             f"{meta['date']}. Prompt {meta['prompt_len']} random tokens, {meta['new_tokens']} new tokens, greedy; "
             f"medians of {meta['reps']} runs after a warm-up. {meta['definitions']}", "",
             "| batch | variant | prefill ms | TTFT ms | decode tok/s | step µs | weight GB/s | graph replay µs "
             "| vs sdpa eager | vs sdpa+graph | vs transformers | bandwidth limit tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            what = r["error"] if r["error"].startswith("skipped") else f"failed: {r['error']}"
            lines.append(f"| {r['batch']} | {r['variant']} | {what} | | | | | | | | | |")
            continue
        ratio = lambda key: f"{r[key]:.2f}x" if r.get(key) else "–"  # noqa: E731
        lines.append(f"| {r['batch']} | {r['variant']} | {_fmt(r['prefill_ms'], '.2f')} | {r['ttft_ms']:.2f} "
                     f"| {r['decode_tok_s']:,.0f} | {r['step_us']:.0f} | {r['weight_gb_s']:,.1f} "
                     f"| {_fmt(r.get('graph_replay_us'), '.0f')} "
                     f"| {ratio('vs_sdpa')} | {ratio('vs_sdpa_graph')} | {ratio('vs_transformers')} "
                     f"| {r['bandwidth_limit_tok_s']:,.0f} |")
    compiled = [r["compile"] for r in rows if r.get("compile")]
    if compiled:
        lines += ["", f"transformers' decode forward: {compiled[0]}."]
    lines.append("")
    for b, t in meta["targets"].items():
        if t["kind"] == "ratio":
            goal = f"flashgpt decode >= {t['target']:g}x transformers-static+compile"
            got = "n/a" if t["measured"] is None else f"{t['measured']:.2f}x ({t['variant']})"
        else:
            goal = f"flashgpt decode >= {t['target']:,.0f} tok/s"
            got = "n/a" if t["measured"] is None else f"{t['measured']:,.0f} ({t['variant']})"
        lines.append(f"- Target batch {b}: {goal}: {got} → {t['verdict']}")
    lines.append("")
    lines.append("Correctness (greedy tokens against plain PyTorch and transformers with the same weights; bf16 may "
                 "flip a near-tie, then they diverge):")
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


def compare_tokens(batch: int, tokens: dict, rows) -> list[dict]:
    """The greedy tokens of our fastest decode path against sdpa (eager) and transformers, where they ran."""
    mine = next((v for v in ("flashgpt-fused+graph", "flashgpt-fused", "flashgpt+graph", "flashgpt")
                 if v in tokens), None)
    out = []
    for other in ["sdpa"] + [v for v in HF_VARIANTS if v in tokens]:
        if mine is None or other not in tokens:
            missing = "a variant failed" if any("error" in r for r in rows if r["batch"] == batch) else \
                f"{other} was not among --variants"
            out.append(dict(batch=batch, error=f"{mine or 'flashgpt'} vs {other} not compared: {missing}"))
            continue
        a = dict(compared=f"{mine} vs {other}", **agreement(tokens[mine], tokens[other]))
        a["first_tokens_agree"] = sum(int(x[:1] == y[:1]) for x, y in zip(tokens[mine], tokens[other]))
        out.append(dict(batch=batch, **a))
    return out


def main() -> int:
    smoke = ARGS.smoke
    if not smoke and not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU (use --smoke on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16  # the interpreter's tl.dot is wrong for bf16
    batches = ARGS.batches or ([1, 2] if smoke else [1, 16])
    prompt_len = ARGS.prompt_len or (8 if smoke else 128)
    new_tokens = ARGS.new_tokens or (6 if smoke else 256)
    reps = 1 if smoke else ARGS.reps
    try:
        block_size = shape_config(ARGS.model, smoke).block_size
    except (ValueError, KeyError, TypeError) as e:  # a bad config file: its one line
        print(f"error: {ARGS.model}: {e}", file=sys.stderr)
        return 2
    if new_tokens < 2 or prompt_len + new_tokens > block_size:
        print(f"error: --new-tokens must be at least 2 (decode steps to time) and prompt + new tokens at most the "
              f"{ARGS.model} shape's block_size {block_size}, got {prompt_len} + {new_tokens}", file=sys.stderr)
        return 2
    out_dirs = [Path(ARGS.out) if ARGS.out else ROOT / "bench" / "results"]
    if os.environ.get("OUT") and Path(os.environ["OUT"]).resolve() != out_dirs[0].resolve():
        out_dirs.append(Path(os.environ["OUT"]))
    for d in out_dirs:
        d.mkdir(parents=True, exist_ok=True)
    label = Path(ARGS.model).stem if ARGS.model.endswith(".toml") else ARGS.model
    name = "generate" + ("" if label == "gpt2" else f"_{label}") + ("_smoke" if smoke else "")
    wanted = ARGS.variants.split(",") if ARGS.variants else None

    model = build_model(ARGS.model, smoke, device, dtype)
    c = model.config
    wbytes = weights_bytes(model)
    hf_version = importlib.util.find_spec("transformers") and __import__("transformers").__version__
    meta = dict(command="python " + " ".join(["bench/generate.py", *sys.argv[1:]]),
                date=datetime.datetime.now().isoformat(timespec="seconds"), smoke=smoke, model=ARGS.model,
                device=torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({platform.machine()}), "
                "Triton interpreter",
                torch=torch.__version__, triton=__import__("triton").__version__, transformers=hf_version or "absent",
                dtype=str(dtype).replace("torch.", ""),
                shape=f"n_layer {c.n_layer}, n_head {c.n_head}, n_kv_head {c.kv_heads}, head dim {c.head_dim}, "
                      f"n_embd {c.n_embd}, MLP {c.mlp} {c.mlp_hidden}, vocab {c.vocab_size}, {c.pos_emb} positions, "
                      f"{c.norm}{', qk_norm' if c.qk_norm else ''}",
                params=sum(p.numel() for p in model.parameters()), weight_bytes=wbytes, prompt_len=prompt_len,
                new_tokens=new_tokens, reps=reps, batches=batches,
                definitions="decode tok/s = B x decode steps / loop time (host included); weight GB/s = weight "
                            "bytes / step time; bandwidth limit = "
                            f"B x {COPY_BW / 1e12:.2f} TB/s / (weight bytes + KV cache bytes read per step).")
    rows, checks, sweep = [], [], None
    hf_model = None  # built once, on first use

    def save():
        meta["targets"] = targets_of(ARGS.model, rows, smoke)
        md = render_markdown(meta, rows, checks, sweep)
        for d in out_dirs:
            (d / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows, correctness=checks,
                                                            kernel_sweep={k: v for k, v in (sweep or {}).items()
                                                                          if k != "markdown"}), indent=2) + "\n")
            (d / f"{name}.md").write_text(md)
        return md

    g = torch.Generator().manual_seed(1)
    all_variants = variants(device, ARGS.compile and not smoke,
                            transformers=ARGS.model != "gpt2" or bool(wanted and set(wanted) & set(HF_VARIANTS)))
    for B in batches:
        prompts = torch.randint(0, c.vocab_size, (B, prompt_len), generator=g).tolist()
        kv_bytes = 2 * c.n_layer * B * c.kv_heads * c.head_dim * (prompt_len + new_tokens // 2) * dtype.itemsize
        limit = B * COPY_BW / (wbytes + kv_bytes)
        tokens = {}
        for vname, (provider, backend, graph, comp, fused) in all_variants.items():
            if wanted and vname not in wanted:
                continue
            if graph and device.type != "cuda":
                rows.append(dict(batch=B, variant=vname, error="skipped: CUDA graphs need a GPU"))
                continue
            if provider == "transformers" and not hf_version:
                rows.append(dict(batch=B, variant=vname, error="skipped: transformers is not installed "
                                 "(pip install transformers)"))
                continue
            with VARIANT_SETUP.get(vname, contextlib.nullcontext)():
                try:
                    if provider == "transformers":
                        if hf_model is None:
                            hf_model = transformers_model(model, device, dtype)
                        res, tokens[vname] = run_transformers(hf_model, prompts, new_tokens, comp, reps)
                    else:
                        res, tokens[vname] = run_variant(model, prompts, new_tokens, backend, graph, comp, fused,
                                                         reps)
                    if graph:  # the same step's GPU time alone, at the middle of the generation's cache lengths
                        try:
                            res["graph_replay_us"] = graph_replay_us(model, B, prompt_len + new_tokens,
                                                                     prompt_len + new_tokens // 2, comp, fused)
                        except Exception as e:
                            res["graph_replay_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
                    res["weight_gb_s"] = round(wbytes / (res["step_us"] * 1e-6) / 1e9, 1)
                    rows.append(dict(batch=B, variant=vname, **res, bandwidth_limit_tok_s=round(limit)))
                    print(f"B={B:3d} {vname:28s} prefill {_fmt(res['prefill_ms'], '8.2f')} ms  "
                          f"TTFT {res['ttft_ms']:8.2f} ms  decode {res['decode_tok_s']:10,.0f} tok/s  "
                          f"({res['step_us']:7.0f} µs/step)", flush=True)
                except Exception as e:  # record and go on with the other variants
                    err = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                    rows.append(dict(batch=B, variant=vname, error=err))
                    print(f"B={B:3d} {vname:28s} FAILED {err}", flush=True)
                    traceback.print_exc()
                finally:
                    model.clear_kv_cache()
        base = {r["variant"]: r["decode_tok_s"] for r in rows if r["batch"] == B and "error" not in r}
        hf_base = next((base[v] for v in HF_VARIANTS if v in base), None)
        for r in rows:
            if r["batch"] == B and "error" not in r:
                r["vs_sdpa"] = base.get("sdpa") and round(r["decode_tok_s"] / base["sdpa"], 2)
                r["vs_sdpa_graph"] = base.get("sdpa+graph") and round(r["decode_tok_s"] / base["sdpa+graph"], 2)
                r["vs_transformers"] = hf_base and round(r["decode_tok_s"] / hf_base, 2)
        checks.extend(compare_tokens(B, tokens, rows))
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
