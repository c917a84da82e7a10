"""RMSNorm, SwiGLU and RoPE of a Llama-family training step: the Triton kernels against eager PyTorch and
torch.compile, forward and forward + backward, in one run.

    python bench/llama_kernels.py [--sweep]        # GPU: SmolLM2-135M's training shape, bf16
    python bench/llama_kernels.py --smoke          # CPU, Triton interpreter, tiny shapes: checks the script runs

Shape (the defaults, SmolLM2-135M trained at batch 16 x 2048 tokens): n_embd 576, 9 query heads and 3 kv heads
of 64, SwiGLU intermediate 1536, 30 layers. Pieces:

    rmsnorm       RMSNorm of (B, T, 576), x and weight bf16 (a bf16 model): output bf16
    rmsnorm_fp32  the same on float32 x and weight: the residual stream and master weights of a bf16-autocast
                  step (what train.py runs), output float32
    swiglu        SiLU(gate) · up of c_fc's (B, T, 2·1536) bf16 output
    rope          the model's rotate_qk on the packed (B, T, (9 + 2·3)·64) bf16 projection: q and k heads
                  rotated, the packed tensor rebuilt for the attention call

Providers: triton (the model's modules with llama_kernels = "triton", so the hooks a training step runs),
torch eager (llama_kernels = "torch") and torch compiled (torch.compile of the eager module or function, Inductor's
default mode; --smoke: the "eager" backend, which traces but generates no code). Every provider's output and
input gradients are first checked against the PyTorch implementation in float64: the Triton kernels' max error
must be at most 2x eager's plus 1e-5 x max(1, |reference|) (exit 1 otherwise). Times: triton.testing.do_bench
medians (µs); GB/s counts the least traffic each piece needs (forward: read its input, write its output;
backward: read the saved input and d(output), write d(input)). The per-step line adds up one training step of
--layers layers under autocast: (2·layers + 1) x rmsnorm_fp32 + layers x (swiglu + rope). --sweep also times
the Triton kernels with each tile setting of SWEEP changed alone, each variant checked against float64 too.
Writes llama_kernels.json and .md (llama_kernels_smoke.* with --smoke) into --out, with the command and the
commit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.report import git_commit  # noqa: E402

PROVIDERS = ("triton", "torch eager", "torch compiled")
PIECES = ("rmsnorm", "rmsnorm_fp32", "swiglu", "rope")
SWEEP = {  # piece -> (module, tile setting, values): what --sweep varies, one setting at a time
    "rmsnorm": [("kernels.rmsnorm", "TILE", (1024, 2048, 4096, 8192)),
                ("kernels.rmsnorm", "BWD_PROGRAMS_PER_SM", (1, 2, 4, 8))],
    "swiglu": [("kernels.swiglu", "TILE", (1024, 2048, 4096, 8192)),
               ("kernels.swiglu", "MAX_BLOCK_I", (256, 512, 1024))],
    "rope": [("kernels.rope", "TILE", (512, 1024, 2048, 4096, 8192))],
}
SMOKE_SHAPE = dict(batch=2, seq=8, n_embd=48, heads=3, kv_heads=1, head_dim=16, intermediate=40, layers=2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "llama_kernels"),
                   help="folder for the JSON and markdown results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--n-embd", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=30, help="layers of the per-step sum")
    p.add_argument("--pieces", default=",".join(PIECES), help=f"comma-separated subset of {', '.join(PIECES)}")
    p.add_argument("--sweep", action="store_true", help="also time the Triton kernels at other tile settings")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE_SHAPE.items():
            setattr(args, key, value)
    for key in ("batch", "seq", "n_embd", "heads", "kv_heads", "head_dim", "intermediate", "layers"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be at least 1")
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads={args.kv_heads} must divide --heads={args.heads}")
    if args.head_dim % 2:
        p.error(f"--head-dim={args.head_dim} must be even (RoPE turns lane pairs)")
    args.pieces = [x for x in args.pieces.split(",") if x]
    unknown = sorted(set(args.pieces) - set(PIECES))
    if unknown or not args.pieces:
        p.error(f"--pieces: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(PIECES)}")
    return args




def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (Triton decorates them then)
    sys.path.insert(0, str(ROOT))
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("error: bench/llama_kernels.py needs a CUDA GPU (use --smoke on CPU)", file=sys.stderr)
        return 2
    bench = Bench(args)
    rows, failures = bench.run()
    meta = dict(
        command="python " + " ".join(["bench/llama_kernels.py", *(sys.argv[1:] if argv is None else argv)]),
        commit=git_commit(), date=datetime.datetime.now().isoformat(timespec="seconds"), smoke=args.smoke,
        device=(torch.cuda.get_device_name() if bench.device.type == "cuda"
                else f"CPU, Triton interpreter ({platform.machine()})"),
        torch=torch.__version__, triton=bench.triton.__version__,
        shape=dict(batch=args.batch, seq=args.seq, n_embd=args.n_embd, heads=args.heads, kv_heads=args.kv_heads,
                   head_dim=args.head_dim, intermediate=args.intermediate, layers=args.layers),
        dtype=str(bench.dtype).replace("torch.", ""), compile_backend=bench.compile_backend,
        timing="triton.testing.do_bench median" if bench.device.type == "cuda" else "perf_counter median (smoke)",
        correctness_failures=failures)
    meta["per_step_us"] = per_step(rows, args.layers)
    out = Path(args.out)
    name = "llama_kernels_smoke" if args.smoke else "llama_kernels"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows, sweep=bench.sweep_rows), indent=2)
                                      + "\n")
    table = render_markdown(meta, rows, bench.sweep_rows)
    (out / f"{name}.md").write_text(table)
    print("\n" + table + f"\nwrote {out / name}.json and .md")
    if failures:
        print("CORRECTNESS FAILURES:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


class Bench:
    """The pieces at one shape: inputs, the providers' callables, the float64 references, the timings."""

    def __init__(self, args):
        import torch
        import triton
        self.torch, self.triton, self.args = torch, triton, args
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter truncates to bf16
        self.compile_backend = "eager" if args.smoke else "inductor"
        self.gen = torch.Generator(device="cpu").manual_seed(0)
        self.sweep_rows = []

    def randn(self, *shape, dtype, scale=1.0):
        t = self.torch.randn(*shape, generator=self.gen, dtype=self.torch.float64) * scale
        return t.to(self.device, dtype)

    def compile(self, fn):
        return self.torch.compile(fn, backend=self.compile_backend)

    def time_us(self, fn, leaves) -> float:
        """Median µs per call, the leaves' gradients reset before each (no accumulation timed): do_bench on CUDA;
        a plain timer in the interpreter (smoke only, meaningless)."""
        if self.device.type == "cuda":
            return self.triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=leaves,
                                                return_mode="median") * 1e3
        times = []
        for _ in range(3):
            for t in leaves:
                t.grad = None
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    # ----------------------------------------------------------------------------------------- the pieces

    def rmsnorm(self, x_dtype):
        """RMSNorm modules over (B, T, C): (providers, leaves, reference, dy, bytes fwd, bytes bwd)."""
        from model.norms import RMSNorm
        a = self.args
        C, M = a.n_embd, a.batch * a.seq
        x = self.randn(a.batch, a.seq, C, dtype=x_dtype, scale=2.0).requires_grad_()  # (B, T, C)
        w = 1 + self.randn(C, dtype=self.torch.float64, scale=0.1)
        mods = {}
        for kernel in ("triton", "torch"):
            mods[kernel] = RMSNorm(C, eps=1e-5, kernel=kernel).to(self.device, x_dtype)
            with self.torch.no_grad():
                mods[kernel].weight.copy_(w)
        ref_mod = RMSNorm(C, eps=1e-5, kernel="torch").to(self.device, self.torch.float64)
        with self.torch.no_grad():
            ref_mod.weight.copy_(w)
        compiled = self.compile(mods["torch"])
        providers = {"triton": (lambda: mods["triton"](x), [x, mods["triton"].weight]),
                     "torch eager": (lambda: mods["torch"](x), [x, mods["torch"].weight]),
                     "torch compiled": (lambda: compiled(x), [x, mods["torch"].weight])}
        x64 = x.detach().double().requires_grad_()
        reference = (lambda: ref_mod(x64), [x64, ref_mod.weight])
        dy = self.randn(a.batch, a.seq, C, dtype=x_dtype)  # (B, T, C)
        s = x.element_size()
        return providers, reference, dy, M * C * 2 * s, M * C * 3 * s

    def swiglu(self):
        import torch.nn.functional as F
        import kernels
        a = self.args
        M, I = a.batch * a.seq, a.intermediate

        def eager(h):  # the model's MLP
            gate, up = h.chunk(2, dim=-1)  # (B, T, I) each
            return F.silu(gate) * up

        h = self.randn(a.batch, a.seq, 2 * I, dtype=self.dtype, scale=2.0).requires_grad_()  # (B, T, 2I)
        compiled = self.compile(eager)
        providers = {"triton": (lambda: kernels.triton_swiglu(h), [h]), "torch eager": (lambda: eager(h), [h]),
                     "torch compiled": (lambda: compiled(h), [h])}
        h64 = h.detach().double().requires_grad_()
        dy = self.randn(a.batch, a.seq, I, dtype=self.dtype)  # (B, T, I)
        s = h.element_size()
        return providers, (lambda: eager(h64), [h64]), dy, M * I * 3 * s, M * I * 5 * s

    def rope(self):
        from model.config import GPTConfig
        from model.gpt import CausalSelfAttention
        from model.rope import RotaryEmbedding
        a = self.args
        M, W = a.batch * a.seq, (a.heads + 2 * a.kv_heads) * a.head_dim
        attn = {}
        for kernel in ("triton", "torch"):
            cfg = GPTConfig(block_size=a.seq, n_embd=a.n_embd, n_head=a.heads, n_kv_head=a.kv_heads,
                            head_size=a.head_dim, pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                            llama_kernels=kernel)
            attn[kernel] = CausalSelfAttention(cfg).to(self.device)
        rotary = RotaryEmbedding(cfg).to(self.device)
        pos = self.torch.arange(a.seq, device=self.device)
        tables, tables64 = rotary(pos, self.dtype), rotary(pos, self.torch.float64)  # cos, sin: (T, hd)
        qkv = self.randn(a.batch, a.seq, W, dtype=self.dtype, scale=2.0).requires_grad_()  # (B, T, W)
        compiled = self.compile(attn["torch"].rotate_qk)
        providers = {"triton": (lambda: attn["triton"].rotate_qk(qkv, tables), [qkv]),
                     "torch eager": (lambda: attn["torch"].rotate_qk(qkv, tables), [qkv]),
                     "torch compiled": (lambda: compiled(qkv, tables), [qkv])}
        qkv64 = qkv.detach().double().requires_grad_()
        dy = self.randn(a.batch, a.seq, W, dtype=self.dtype)  # (B, T, W)
        s = qkv.element_size()
        return providers, (lambda: attn["torch"].rotate_qk(qkv64, tables64), [qkv64]), dy, M * W * 2 * s, \
            M * W * 2 * s

    # ------------------------------------------------------------------------------------------ the runs

    def outputs(self, fn, leaves, dy):
        """fn()'s output and the gradients of its leaves for d(output) = dy (float64 on the CPU)."""
        for t in leaves:
            t.grad = None
        y = fn()
        y.backward(dy.to(y.dtype))
        return [y.detach().cpu().double()] + [t.grad.detach().cpu().double() for t in leaves]

    def run(self):
        rows, failures = [], []
        for piece in self.args.pieces:
            if piece == "rmsnorm":
                spec = self.rmsnorm(self.dtype)
            elif piece == "rmsnorm_fp32":
                spec = self.rmsnorm(self.torch.float32)
            else:
                spec = getattr(self, piece)()
            providers, (ref_fn, ref_leaves), dy, bytes_fwd, bytes_bwd = spec
            ref = self.outputs(ref_fn, ref_leaves, dy.double())
            errors = {}
            for name, (fn, leaves) in providers.items():
                got = self.outputs(fn, leaves, dy)  # also the warm-up (compiles)
                errors[name] = [(g - r).abs().max().item() for g, r in zip(got, ref)]
            bounds = [2 * e + 1e-5 * max(1.0, r.abs().max().item()) for e, r in zip(errors["torch eager"], ref)]
            for what, e, bound in zip(["output"] + [f"grad {i}" for i in range(len(ref) - 1)], errors["triton"],
                                      bounds):
                if not e <= bound:
                    failures.append(f"{piece} triton {what}: max error {e:.3g} > {bound:.3g} (2x eager + floor)")
            for name, (fn, leaves) in providers.items():
                def both(fn=fn):
                    fn().backward(dy)
                t_fwd = self.time_us(fn, leaves)  # with autograd recording, as in a training step
                t_both = self.time_us(both, leaves)
                row = dict(piece=piece, provider=name, fwd_us=round(t_fwd, 2), fwd_bwd_us=round(t_both, 2),
                           fwd_GBps=round(bytes_fwd / (t_fwd * 1e-6) / 1e9, 1),
                           fwd_bwd_GBps=round((bytes_fwd + bytes_bwd) / (t_both * 1e-6) / 1e9, 1),
                           max_err_output=errors[name][0], max_err_grads=max(errors[name][1:]))
                rows.append(row)
                print(f"{piece:13s} {name:15s} fwd {t_fwd:9.1f} µs  fwd+bwd {t_both:9.1f} µs  "
                      f"({row['fwd_bwd_GBps']:.0f} GB/s)  err {row['max_err_output']:.2e} / "
                      f"{row['max_err_grads']:.2e}", flush=True)
            if self.args.sweep:
                failures += self.sweep(piece, providers["triton"], dy, bytes_fwd + bytes_bwd, ref, bounds)
            del providers, spec
        return rows, failures

    def sweep(self, piece, provider, dy, nbytes, ref, bounds) -> list[str]:
        """The Triton provider's fwd+bwd time with each tile setting of SWEEP changed alone (the others at their
        defaults), each variant's output and gradients checked against float64 with the default's bounds.
        Returns the failures."""
        import importlib
        fn, leaves = provider
        failures = []
        for module_name, attr, values in SWEEP[piece.split("_")[0]]:
            module = importlib.import_module(module_name)
            default = getattr(module, attr)
            for value in values:
                setattr(module, attr, value)
                try:
                    got = self.outputs(fn, leaves, dy)  # also the warm-up (compiles this variant)
                    t_both = self.time_us(lambda: fn().backward(dy), leaves)
                finally:
                    setattr(module, attr, default)
                errs = [(g - r).abs().max().item() for g, r in zip(got, ref)]
                err = max(errs)
                if not all(e <= b for e, b in zip(errs, bounds)):
                    failures.append(f"{piece} triton {module_name}.{attr}={value}: max error {err:.3g} above "
                                    "2x eager's + floor")
                row = dict(piece=piece, setting=f"{module_name}.{attr}={value}", default=value == default,
                           fwd_bwd_us=round(t_both, 2), fwd_bwd_GBps=round(nbytes / (t_both * 1e-6) / 1e9, 1),
                           max_err=err)
                self.sweep_rows.append(row)
                print(f"{piece:13s} sweep {row['setting']:32s} fwd+bwd {t_both:9.1f} µs  err {err:.2e}", flush=True)
        return failures


def per_step(rows, layers: int) -> dict:
    """fwd+bwd µs of the pieces in one autocast training step, per provider (None when a piece was not run)."""
    t = {(r["piece"], r["provider"]): r["fwd_bwd_us"] for r in rows}
    counts = {"rmsnorm_fp32": 2 * layers + 1, "swiglu": layers, "rope": layers}
    out = {}
    for provider in PROVIDERS:
        parts = [t.get((piece, provider)) for piece in counts]
        out[provider] = None if None in parts else round(sum(n * p for n, p in zip(counts.values(), parts)), 1)
    return out


def render_markdown(meta, rows, sweep_rows) -> str:
    s = meta["shape"]
    lines = [f"# RMSNorm, SwiGLU and RoPE of a training step: Triton vs eager vs torch.compile ({meta['dtype']})", "",
             f"`{meta['command']}` at commit {meta['commit']} — {meta['device']}, torch {meta['torch']}, triton "
             f"{meta['triton']}, {meta['date']}; {meta['timing']}; torch.compile backend {meta['compile_backend']}.",
             "", f"Shape: batch {s['batch']} x {s['seq']} tokens, n_embd {s['n_embd']}, {s['heads']} heads / "
             f"{s['kv_heads']} kv heads of {s['head_dim']}, intermediate {s['intermediate']}. GB/s: the least "
             "traffic of each piece over its time. vs compiled: torch compiled's fwd+bwd time / this one's.", "",
             "| piece | provider | fwd µs | fwd+bwd µs | fwd GB/s | fwd+bwd GB/s | vs compiled | max err out | "
             "max err grads |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    compiled = {r["piece"]: r["fwd_bwd_us"] for r in rows if r["provider"] == "torch compiled"}
    for r in rows:
        lines.append(f"| {r['piece']} | {r['provider']} | {r['fwd_us']:.1f} | {r['fwd_bwd_us']:.1f} | "
                     f"{r['fwd_GBps']:.0f} | {r['fwd_bwd_GBps']:.0f} | {compiled[r['piece']] / r['fwd_bwd_us']:.2f}x | "
                     f"{r['max_err_output']:.1e} | {r['max_err_grads']:.1e} |")
    lines.append("")
    step = meta["per_step_us"]
    if all(v is not None for v in step.values()):
        lines.append(f"Per training step ({s['layers']} layers, bf16 autocast: {2 * s['layers'] + 1} x rmsnorm_fp32 "
                     f"+ {s['layers']} x (swiglu + rope)), fwd+bwd µs: " + ", ".join(
                         f"{p} {v:.0f}" for p, v in step.items()))
    if meta["correctness_failures"]:
        lines.append("Correctness failures: " + "; ".join(meta["correctness_failures"]))
    else:
        lines.append("Correctness: the Triton kernels' output and gradients within 2x eager's max error (+ 1e-5 "
                     "floor) of the float64 PyTorch implementation.")
    if sweep_rows:
        lines += ["", "Tile settings of the Triton kernels (--sweep; one changed at a time, * the default):", "",
                  "| piece | setting | fwd+bwd µs | fwd+bwd GB/s | max err |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['piece']} | {r['setting']}{' *' if r['default'] else ''} | {r['fwd_bwd_us']:.1f} | "
                  f"{r['fwd_bwd_GBps']:.0f} | {r['max_err']:.1e} |" for r in sweep_rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
