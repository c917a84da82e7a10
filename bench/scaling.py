"""Data-parallel scaling on one node: train.py under torchrun on N = 1, 2, 4, 8 GPUs, DDP and FSDP2.

    python bench/scaling.py                                   # every case below, on 1, 2, 4, 8 GPUs (those present)
    python bench/scaling.py --cases 124m:ddp,124m:fsdp --gpus 1,8 --steps 40
    python bench/scaling.py --cases 1.5b:fsdp --launcher c10d # rendezvous as on several nodes (--nnodes=1:1)
    python bench/scaling.py --smoke --out /tmp/s               # CPU, gloo, tiny models: checks that it all runs

Cases (MODEL:MODE):
    124m:ddp, 124m:fsdp   GPT-2 124M (configs/gpt2_124m.toml: 12 layers, 12 heads, 768 wide, no biases,
                          torch.compile on), micro-batch 16 x 1024
    1.5b:fsdp             the GPT-2 XL shape (48 layers, 25 heads, 1600 wide) with FSDP2 and activation
                          checkpointing, compile on, micro-batch 8 x 1024 (1.5b:ddp runs too, when asked for)
Every run of a case takes the same optimizer steps: --micro-batches micro-batches per step in all (default 8),
spread over the N ranks (N x accumulation = 8), so a step sees the same global batch at every N. Data: the
Shakespeare corpus in GPT-2 BPE tokens (--dataset), bf16 autocast (FSDP2: bf16 block parameters, fp32 gradient
reduction). Each run is `torchrun --standalone --nproc_per_node=N train.py ...` (or the c10d rendezvous with
--launcher c10d); NCCL_NVLS_ENABLE=0 (NVLink multicast off) for every run.

Reported per run, from its metrics.jsonl (after the first quarter of the steps, which includes compilation):
tokens/s (median; all ranks together), tokens/s per GPU, scaling efficiency = tokens/s(N) / (N x tokens/s(1))
against the 1-GPU run of the same case in the same invocation, MFU per GPU (model FLOPs only, nanoGPT's 6N +
12·L·H·Dh·T per token; activation checkpointing's recomputation is not counted), peak memory per GPU (GiB,
torch.cuda.max_memory_allocated) and the largest per-step loss difference from the 1-GPU run (bf16; reduction
order). Writes scaling.json and scaling.md (scaling_smoke.* with --smoke) into --out and into $OUT when set:
rows of earlier invocations for other (case, N) stay, each with its own command and commit; a row of the same
(case, N) is replaced. A run that fails is recorded with the end of its log and the others go on.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.report import git_commit  # noqa: E402

MODELS = {
    "124m": {"shape": [], "micro_batch": 16, "describe": "GPT-2 124M (12 layers, 12 heads, 768 wide)"},
    "1.5b": {"shape": ["--n_layer=48", "--n_head=25", "--n_embd=1600"], "micro_batch": 8,
             "describe": "GPT-2 XL shape, 1.5B (48 layers, 25 heads, 1600 wide)"},
}
SMOKE_MODELS = {  # the same two cases in miniature: deeper for "1.5b"
    "124m": {"shape": ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--vocab_size=0"],
             "micro_batch": 2, "describe": "tiny (2 layers, 32 wide)"},
    "1.5b": {"shape": ["--n_layer=3", "--n_head=2", "--n_embd=32", "--block_size=32", "--vocab_size=0"],
             "micro_batch": 2, "describe": "tiny (3 layers, 32 wide)"},
}
DEFAULT_CASES = "124m:ddp,124m:fsdp,1.5b:fsdp"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated MODEL:MODE (default {DEFAULT_CASES})")
    p.add_argument("--gpus", default=None,
                   help="world sizes to run (default 1,2,4,8; those above the GPUs present are skipped; smoke: 1,2)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--micro-batches", type=int, default=8,
                   help="micro-batches per optimizer step over all ranks (each world size must divide it)")
    p.add_argument("--dataset", default="shakespeare", help="data.dataset for every run")
    p.add_argument("--launcher", choices=["standalone", "c10d"], default="standalone",
                   help="torchrun --standalone, or --nnodes=1:1 --rdzv_backend=c10d --rdzv_endpoint=localhost:PORT")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile (GPU)")
    p.add_argument("--out", default=None, help="results folder (default bench/results/scaling)")
    p.add_argument("--work", default=None, help="run folders, removed after each run (default runs/scaling)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny models, 4 steps: checks that it runs")
    p.add_argument("overrides", nargs="*", help="extra --key=value for train.py (after --)")
    args = p.parse_args(argv)
    try:
        args.case_list = [tuple(c.split(":")) for c in args.cases.split(",") if c]
        args.gpu_list = sorted({int(g) for g in (args.gpus or ("1,2" if args.smoke else "1,2,4,8")).split(",") if g})
    except ValueError:
        p.error(f"--cases / --gpus: expected MODEL:MODE,... and N,..., got {args.cases!r} / {args.gpus!r}")
    for case in args.case_list:
        if len(case) != 2 or case[0] not in MODELS or case[1] not in ("ddp", "fsdp"):
            p.error(f"--cases: {':'.join(case)!r} is not MODEL:MODE with MODEL in {', '.join(MODELS)} and MODE "
                    "ddp or fsdp")
    for n in args.gpu_list:
        if n < 1 or args.micro_batches % n:
            p.error(f"--gpus: {n} does not divide --micro-batches={args.micro_batches}")
    return args




def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(n: int, kind: str) -> list[str]:
    base = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}"]
    if kind == "standalone":
        return base + ["--standalone"]
    return base + ["--nnodes=1:1", "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{free_port()}",
                   "--rdzv_id=scaling"]


def train_args(args, model: str, mode: str, n: int, out_dir: Path) -> list[str]:
    spec = (SMOKE_MODELS if args.smoke else MODELS)[model]
    accum = args.micro_batches // n
    common = [f"--out_dir={out_dir}", f"--dataset={args.dataset}", f"--max_iters={args.steps}",
              "--eval_interval=1000000", "--eval_iters=1", "--log_interval=1", "--warmup_iters=2", "--keep_last=1",
              f"--batch_size={spec['micro_batch']}", f"--grad_accum_steps={accum}", f"--parallel={mode}",
              f"--activation_checkpointing={str(model == '1.5b').lower()}", "--wandb=false", *spec["shape"]]
    if args.smoke:
        return [str(ROOT / "configs" / "demo.toml"), *common, "--device=cpu", "--compile=false", "--num_proc=1",
                "--tokenizer=char", *args.overrides]
    return [str(ROOT / "configs" / "gpt2_124m.toml"), *common, f"--compile={str(args.compile).lower()}",
            *args.overrides]


def read_metrics(out_dir: Path) -> dict:
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    steps = [r for r in rows if "tokens_per_s" in r]
    steady = steps[len(steps) // 4:] or steps
    peak = [r["peak_mem_gib"] for r in steady if "peak_mem_gib" in r]
    mfu = [r["mfu"] for r in steady if "mfu" in r]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "mfu": statistics.median(mfu) if mfu else None, "peak_mem_gib": max(peak) if peak else None,
            "losses": [r["loss"] for r in steps], "steps_measured": len(steady)}


def run_one(args, model: str, mode: str, n: int, work: Path, env: dict) -> dict:
    out_dir = work / f"{model}-{mode}-{n}"
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [*launcher(n, args.launcher), str(ROOT / "train.py"), *train_args(args, model, mode, n, out_dir)]
    shown = " ".join(os.path.relpath(c, ROOT) if c.startswith(str(ROOT)) else c for c in cmd[1:])
    print(f"+ {model}:{mode} on {n}: python {shown}", flush=True)
    row = {"model": model, "mode": mode, "gpus": n, "command": f"NCCL_NVLS_ENABLE=0 python {shown}"}
    started = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            row["error"] = f"exit {proc.returncode}: " + " | ".join(proc.stderr.strip().splitlines()[-6:])[-1500:]
        else:
            row.update(read_metrics(out_dir))
    except subprocess.TimeoutExpired:
        row["error"] = f"timed out after {args.timeout} s"
    except (OSError, ValueError, KeyError) as e:
        row["error"] = f"no metrics ({type(e).__name__}: {e})"
    row["wall_s"] = round(time.time() - started, 1)
    shutil.rmtree(out_dir, ignore_errors=True)  # a 1.5B checkpoint is ~19 GB
    return row


def add_comparisons(rows: list[dict]) -> None:
    """Efficiency and loss gap of each row against the 1-GPU row of its case in the same invocation."""
    for row in rows:
        row.pop("efficiency", None)
        row.pop("max_loss_gap", None)
        base = next((r for r in rows if r["model"] == row["model"] and r["mode"] == row["mode"] and r["gpus"] == 1
                     and r.get("invocation") == row.get("invocation") and "error" not in r), None)
        if base is None or "error" in row:
            continue
        row["efficiency"] = row["tokens_per_s"] / (row["gpus"] * base["tokens_per_s"])
        row["max_loss_gap"] = max((abs(a - b) for a, b in zip(row["losses"], base["losses"])), default=0.0)


def machine() -> dict:
    import torch
    info = {"torch": torch.__version__, "host_cpus": os.cpu_count(), "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpus_present"] = torch.cuda.device_count()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def render(results: dict) -> str:
    lines = ["# Data-parallel scaling: DDP and FSDP2 " + ("(smoke: CPU, gloo, tiny models)" if results["smoke"]
                                                         else "on one node"), ""]
    for inv in results["invocations"]:
        m = inv["machine"]
        where = (f"{m.get('gpus_present', 0)} x {m['gpu']}, NCCL {m.get('nccl')}" if "gpu" in m
                 else f"CPU ({m['host_cpus']} cores), gloo")
        lines.append(f"- invocation {inv['id']}: `{inv['command']}` at commit {inv['commit']}, {inv['date']}; "
                     f"{where}, torch {m['torch']}; NCCL_NVLS_ENABLE=0")
    lines += ["", "Same global batch at every N (micro-batches per step split over the ranks); tokens/s: median "
              "after the first quarter of the steps; efficiency = tokens/s(N) / (N x tokens/s(1)), against the "
              "1-GPU run of the same case and invocation; MFU per GPU counts model FLOPs only (no recomputation); "
              "loss gap: largest per-step difference from the 1-GPU run.", "",
              "| case | GPUs | tokens/s | per GPU | efficiency | MFU per GPU | peak GiB per GPU | loss gap | "
              "invocation |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    order = {m: i for i, m in enumerate(MODELS)}
    for row in sorted(results["rows"], key=lambda r: (order[r["model"]], r["mode"], r["gpus"])):
        case = f"{row['model']}:{row['mode']}" + (" + act. ckpt" if row["model"] == "1.5b" else "")
        if "error" in row:
            lines.append(f"| {case} | {row['gpus']} | failed: {row['error'][:300]} | | | | | | {row['invocation']} |")
            continue
        fmt = lambda v, f: "–" if v is None else format(v, f)  # noqa: E731
        lines.append(f"| {case} | {row['gpus']} | {row['tokens_per_s']:,.0f} | {row['tokens_per_s'] / row['gpus']:,.0f}"
                     f" | {fmt(row.get('efficiency'), '.1%')} | {fmt(row['mfu'], '.1%')} "
                     f"| {fmt(row['peak_mem_gib'], '.1f')} | {fmt(row.get('max_loss_gap'), '.2e')} "
                     f"| {row['invocation']} |")
    lines += ["", "Commands (each run):", ""] + [f"- `{r['command']}`" for r in results["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.smoke and present == 0:
        print("error: the scaling benchmark needs CUDA GPUs (use --smoke on CPU)", file=sys.stderr)
        return 2
    gpus = [n for n in args.gpu_list if args.smoke or n <= present]
    skipped = [n for n in args.gpu_list if n not in gpus]
    if skipped:
        print(f"note: skipping world sizes {skipped}: only {present} GPU(s) here", file=sys.stderr)
    name = "scaling_smoke" if args.smoke else "scaling"
    out_dirs = [Path(args.out) if args.out else ROOT / "bench" / "results" / "scaling"]
    if os.environ.get("OUT") and Path(os.environ["OUT"]).resolve() != out_dirs[0].resolve():
        out_dirs.append(Path(os.environ["OUT"]))
    work = Path(args.work) if args.work else ROOT / "runs" / "scaling"
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    if args.smoke:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")

    previous = out_dirs[0] / f"{name}.json"
    results = json.loads(previous.read_text()) if previous.is_file() else {"smoke": args.smoke, "invocations": [],
                                                                            "rows": []}
    invocation = {"id": len(results["invocations"]) + 1, "commit": git_commit(),
                  "command": "python " + " ".join(["bench/scaling.py", *(argv if argv is not None else sys.argv[1:])]),
                  "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine()}
    results["invocations"].append(invocation)

    def save() -> None:
        kept = {(r["model"], r["mode"], r["gpus"]) for r in results["rows"] if r["invocation"] == invocation["id"]}
        results["rows"] = [r for r in results["rows"] if r["invocation"] == invocation["id"]
                           or (r["model"], r["mode"], r["gpus"]) not in kept]
        used = {r["invocation"] for r in results["rows"]}
        results["invocations"] = [i for i in results["invocations"] if i["id"] in used or i is invocation]
        add_comparisons(results["rows"])
        text = render(results)
        for d in out_dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
            (d / f"{name}.md").write_text(text)

    for model, mode in args.case_list:
        for n in gpus:
            row = run_one(args, model, mode, n, work, env)
            row["invocation"] = invocation["id"]
            results["rows"].append(row)
            save()  # after every run: a benchmark cut short keeps what it measured
    save()
    print(render(results))
    return 0 if all("error" not in r for r in results["rows"] if r["invocation"] == invocation["id"]) else 1


if __name__ == "__main__":
    sys.exit(main())
