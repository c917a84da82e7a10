"""Evaluate a checkpoint on HellaSwag, its perplexity on held-out text, or any lm-evaluation-harness task.

    python eval.py --ckpt runs/gpt2 --task hellaswag --data hellaswag_val.jsonl
    python eval.py --ckpt runs/ft --task perplexity --data held_out.jsonl       # or .txt, .parquet, a folder
    python eval.py --init-from hf:HuggingFaceTB/SmolLM2-135M --task perplexity --data held_out.jsonl
    python eval.py --ckpt runs/gpt2 --task hellaswag --limit 500 --batch-size 64
    python eval.py --ckpt runs/gpt2 --lm-eval hellaswag,arc_easy --limit 200      # needs pip install lm-eval
    python eval.py --init-from gpt2 --task hellaswag --data hellaswag_val.jsonl   # Hugging Face GPT-2 weights

HellaSwag is scored as multiple choice by the summed log-likelihood of each ending given its context:
acc (argmax of the sum) and acc_norm (argmax of the sum divided by the ending's length in characters), as
lm-evaluation-harness does (evals/hellaswag.py says exactly how). Without --data it reads the dataset's
validation file from a cache folder, downloading it the first time. Perplexity scores every token of every
document of --data once (token, word and byte perplexity, bits per byte; evals/perplexity.py says exactly how):
bits per byte compares models with different tokenizers, such as a fine-tuned model and its base.

The results are printed and written as JSON to --out (default: eval_<task>.json next to the checkpoint).
The model comes from the checkpoint as generate.py loads it (generate.load_model).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

if not torch.cuda.is_available():  # flash on a CPU runs in Triton's interpreter, chosen before kernels load
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels  # noqa: E402
from data.tokenizers import TokenizerError  # noqa: E402
from model.checkpoint import CheckpointError, find_checkpoint  # noqa: E402
from model.config import ConfigError  # noqa: E402
from model.device import pick_device, pick_dtype  # noqa: E402
from training.runfolder import write_text_atomic  # noqa: E402

TASKS = ("hellaswag", "perplexity")
INSTALL_LM_EVAL = "pip install 'flashgpt[eval]' (or pip install lm-eval)"


class EvalError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Evaluate a flashgpt checkpoint (or Hugging Face weights) on HellaSwag, "
                                            "by its perplexity on held-out text, or on lm-evaluation-harness tasks.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("model")
    src.add_argument("--ckpt", help="checkpoint file, or a run folder (its latest checkpoint)")
    src.add_argument("--best", action="store_true", help="with a run folder: use best.pt instead of the latest")
    src.add_argument("--init-from", metavar="hf:REPO_OR_DIR | gpt2[-medium|-large|-xl]",
                     help="Hugging Face weights instead of a checkpoint, as generate.py takes them: hf:<hub id or "
                          "local folder> (with the model's tokenizer.json; a PEFT LoRA adapter loads as its base model "
                          "with the updates merged) or a GPT-2 size")
    src.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    src.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="auto: bfloat16 on CUDA, float32 on CPU")
    src.add_argument("--attention", default="auto", choices=["auto", "flash", "sdpa", "naive"],
                     help="attention backend (auto: flash on CUDA, sdpa on CPU)")
    task = p.add_argument_group("task (one of)")
    what = task.add_mutually_exclusive_group()
    what.add_argument("--task", choices=TASKS, help="a built-in task")
    what.add_argument("--lm-eval", metavar="TASKS",
                      help="comma-separated lm-evaluation-harness task names (needs: " + INSTALL_LM_EVAL + ")")
    run = p.add_argument_group("evaluation")
    run.add_argument("--data", help="--task hellaswag: local data file, JSONL (hellaswag_val.jsonl, or the columns "
                                    "of the HF dataset Rowan/hellaswag) or Parquet; default: the cached download. "
                                    "--task perplexity (required): the text to score, as data.dataset takes it: "
                                    ".txt files (one document each), .jsonl(.gz) or .parquet rows, a folder or "
                                    "glob of them, or hf:NAME[:CONFIG]")
    run.add_argument("--text-column", default="text",
                     help="--task perplexity: the field of .jsonl/.parquet/hub rows that holds the text")
    run.add_argument("--cache-dir", default=".cache/data",
                     help="--task hellaswag without --data: the download goes to CACHE_DIR/eval/")
    run.add_argument("--limit", type=int, help="evaluate only the first N items (per task for --lm-eval)")
    run.add_argument("--batch-size", type=int, default=32, help="sequences per forward pass")
    run.add_argument("--num-fewshot", type=int, help="--lm-eval: few-shot examples (default: each task's own)")
    run.add_argument("--include-path", help="--lm-eval: a folder of extra task YAML files (e.g. local datasets)")
    run.add_argument("--out", help="results JSON (default: eval_<task>.json beside the checkpoint)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_args(args) -> None:
    if not args.task and not args.lm_eval:
        raise EvalError("nothing to evaluate: give --task hellaswag, --task perplexity --data FILE or "
                        "--lm-eval TASKS")
    if not args.ckpt and not args.init_from:
        raise EvalError("no model: give --ckpt RUN_DIR_OR_FILE or --init-from gpt2")
    if args.ckpt and args.init_from:
        raise EvalError("give either --ckpt or --init-from, not both")
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit={args.limit}: must be >= 1")
    if args.batch_size < 1:
        raise EvalError(f"--batch-size={args.batch_size}: must be >= 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise EvalError(f"--num-fewshot={args.num_fewshot}: must be >= 0")
    if args.lm_eval and args.data:
        raise EvalError("--data is for --task hellaswag or perplexity; an lm-eval task reads its own data (see "
                        "--include-path)")
    if args.task == "perplexity" and not args.data:
        raise EvalError("--task perplexity needs --data: the text to score (a .txt/.jsonl/.parquet file, a folder "
                        "or glob of them, or hf:NAME[:CONFIG])")
    if args.task and (args.num_fewshot is not None or args.include_path):
        raise EvalError("--num-fewshot and --include-path are for --lm-eval")


def out_path(args, name: str) -> str:
    if args.out:
        return args.out
    folder = "." if args.init_from else (args.ckpt if os.path.isdir(args.ckpt) else os.path.dirname(args.ckpt))
    suffix = "_" + re.sub(r"[^A-Za-z0-9._-]+", "_", args.init_from.removeprefix("hf:")) if args.init_from else ""
    return os.path.join(folder or ".", f"eval_{name}{suffix}.json")


def load(args):
    """(model on its device and dtype in eval mode, tokenizer, description of the set-up)."""
    from generate import GenerateError, load_model  # the checkpoint → (GPT, tokenizer) path that generate.py uses
    device = pick_device(args.device, what="--device")
    dtype = pick_dtype(args.dtype, device, what="--dtype")
    backend = kernels.resolve_backend(args.attention, device)
    if backend == "flash" and device.type == "cpu":
        if not kernels.interpreting() or dtype == torch.bfloat16:
            raise EvalError("--attention flash on the CPU needs Triton's interpreter (TRITON_INTERPRET=1) and "
                            "float32: use --attention sdpa")
    try:
        model, tokenizer, _ = load_model(args, device)  # (generation_config.json: generation only)
    except GenerateError as e:
        raise EvalError(str(e)) from None
    model.set_attention_backend(backend)
    model = model.to(device=device, dtype=dtype).eval()
    setup = {"checkpoint": find_checkpoint(args.ckpt, "best" if args.best else "latest") if args.ckpt
             else args.init_from if args.init_from.startswith("hf:") else f"hf:{args.init_from}", "device": str(device), "dtype": str(dtype).replace("torch.", ""),
             "attention": backend, "batch_size": args.batch_size}
    return model, tokenizer, setup


def run_hellaswag(args) -> tuple[dict, str]:
    from evals import hellaswag
    path = args.data or hellaswag.default_data(os.path.join(args.cache_dir, "eval"))
    items = hellaswag.load_items(path, args.limit)
    model, tokenizer, setup = load(args)
    requests = hellaswag.encode_requests(items, tokenizer, model.config.block_size)  # bad items: before any output
    print(f"hellaswag: {len(items)} items from {path}; {setup['checkpoint']} on {setup['device']} "
          f"({setup['dtype']}, {setup['attention']} attention)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    metrics = hellaswag.evaluate(model, tokenizer, items, batch_size=args.batch_size,
                                 progress=not args.no_progress, requests=requests)
    result = {"task": "hellaswag", **metrics,
              "acc_norm_divides_by": "the ending's length in characters (lm-evaluation-harness's acc_norm)",
              "data": path, "limit": args.limit, **setup, "seconds": round(time.perf_counter() - t0, 3)}
    print(f"hellaswag ({metrics['n']} items): acc {metrics['acc']:.4f} ± {metrics['acc_stderr'] or 0:.4f}, "
          f"acc_norm {metrics['acc_norm']:.4f} ± {metrics['acc_norm_stderr'] or 0:.4f}")
    return result, "hellaswag"


def run_perplexity(args) -> tuple[dict, str]:
    from evals import perplexity
    docs = perplexity.read_documents(args.data, args.limit, args.text_column)
    model, tokenizer, setup = load(args)
    encoded = perplexity.encode_documents(tokenizer, docs, model.config.vocab_size)
    print(f"perplexity: {len(docs)} documents from {args.data}; {setup['checkpoint']} on {setup['device']} "
          f"({setup['dtype']}, {setup['attention']} attention, context {model.config.block_size})",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    metrics = perplexity.evaluate(model, tokenizer, encoded, batch_size=args.batch_size,
                                  progress=not args.no_progress)
    result = {"task": "perplexity", **metrics, "data": args.data, "limit": args.limit, **setup,
              "seconds": round(time.perf_counter() - t0, 3)}
    bpb = metrics["bits_per_byte"]
    print(f"perplexity ({metrics['documents']} documents, {metrics['tokens']:,} tokens): token perplexity "
          f"{metrics['token_perplexity']:.4f}, bits per byte {bpb:.4f}" if bpb is not None else
          f"perplexity ({metrics['documents']} documents, {metrics['tokens']:,} tokens): token perplexity "
          f"{metrics['token_perplexity']:.4f}")
    return result, "perplexity"


def run_lm_eval(args) -> tuple[dict, str]:
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise EvalError(f"--lm-eval needs lm-evaluation-harness, which is not installed: {INSTALL_LM_EVAL}") from None
    from evals.lm_eval_adapter import AdapterError, harness_lm
    tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
    if not tasks:
        raise EvalError("--lm-eval: no task named")
    if args.include_path and not os.path.isdir(args.include_path):
        raise EvalError(f"--include-path {args.include_path}: not a folder")
    model, tokenizer, setup = load(args)
    lm = harness_lm(model, tokenizer, batch_size=args.batch_size, progress=not args.no_progress)
    t0 = time.perf_counter()
    try:
        manager = TaskManager(include_path=args.include_path) if args.include_path else None
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
                                      task_manager=manager, log_samples=False)
    except AdapterError:
        raise
    except Exception as e:  # the harness's own failures (unknown task, data it cannot fetch): one line
        detail = " ".join(str(e).split())[:400]
        raise EvalError(f"lm-eval could not run {','.join(tasks)}: {type(e).__name__}: {detail}") from None
    if out is None:  # a non-zero rank of a distributed harness run
        raise EvalError("lm-eval returned no results")
    from lm_eval.utils import make_table
    print(make_table(out))
    result = {"tasks": tasks, "results": out.get("results"), "versions": out.get("versions"),
              "n-shot": out.get("n-shot"), "n-samples": out.get("n-samples"), "limit": args.limit, **setup,
              "lm_eval_version": getattr(lm_eval, "__version__", None),
              "seconds": round(time.perf_counter() - t0, 3)}
    return result, "lm_eval"


def run(args) -> int:
    check_args(args)
    runner = {"hellaswag": run_hellaswag, "perplexity": run_perplexity}.get(args.task, run_lm_eval)
    result, name = runner(args)
    path = out_path(args, name)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_text_atomic(path, json.dumps(result, indent=2, default=str) + "\n")
    except OSError as e:
        raise EvalError(f"could not write the results to {path} ({e.strerror or e})") from None
    print(f"results written to {path}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from evals.hellaswag import EvalDataError
    from evals.lm_eval_adapter import AdapterError
    from evals.perplexity import PerplexityError
    try:
        return run(args)
    except (EvalError, EvalDataError, AdapterError, PerplexityError, CheckpointError, TokenizerError,
            ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
