"""Generate text from a checkpoint: prefill the prompt(s), then decode with a KV cache.

    python generate.py --ckpt runs/demo --prompt "ROMEO:"
    python generate.py --ckpt runs/demo --prompt "To be" --prompt "JULIET:" --temperature 0
    echo "Once upon" | python generate.py --ckpt runs/x/best.pt --prompt-file -
    python generate.py --init-from gpt2 --prompt "Hello"      # Hugging Face GPT-2 weights (needs the hub)

Context policy: prompt + max-new-tokens must fit in the model's block_size; a longer prompt keeps its last
block_size − max_new_tokens tokens (a note says so on stderr).
"""
from __future__ import annotations

import argparse
import sys

import torch

import kernels

from data.tokenizers import TokenizerError, tokenizer_from_spec
from model import GPT, GPTConfig
from model.checkpoint import CheckpointError, load_checkpoint
from model.sampling import SamplingParams, generate


class GenerateError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Generate text from a flashgpt checkpoint (or GPT-2 weights).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("model")
    src.add_argument("--ckpt", help="checkpoint file, or a run folder (its latest checkpoint)")
    src.add_argument("--best", action="store_true", help="with a run folder: use best.pt instead of the latest")
    src.add_argument("--init-from", choices=["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"],
                     help="Hugging Face GPT-2 weights instead of a checkpoint (needs transformers and the hub)")
    src.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    src.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="auto: bfloat16 on CUDA, float32 on CPU")
    src.add_argument("--attention", default="auto", choices=["auto", "flash", "sdpa", "naive"],
                     help="attention backend (auto: flash on CUDA, sdpa on CPU)")
    src.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                     help="replay the decode step as a CUDA graph (CUDA only)")
    src.add_argument("--prefill-chunk", type=int, default=0, help="prefill long prompts in chunks (0 = whole)")
    inp = p.add_argument_group("prompts")
    inp.add_argument("--prompt", action="append", help="a prompt; repeat for a batch of prompts")
    inp.add_argument("--prompt-file", help="read one prompt from a file ('-' = stdin)")
    smp = p.add_argument_group("sampling")
    smp.add_argument("--max-new-tokens", type=int, default=200)
    smp.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    smp.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    smp.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set with mass p")
    smp.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    smp.add_argument("--seed", type=int, default=1337)
    smp.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    smp.add_argument("--no-stream", action="store_true", help="print each sample at the end instead of streaming")
    return p


def load_model(args, device: torch.device):
    """(model, tokenizer) from --ckpt or --init-from."""
    if args.init_from:
        from model.hf import load_hf_gpt2
        return load_hf_gpt2(args.init_from), tokenizer_from_spec({"kind": "gpt2"})
    if not args.ckpt:
        raise GenerateError("give --ckpt RUN_DIR_OR_FILE or --init-from gpt2")
    ckpt = load_checkpoint(args.ckpt, map_location="cpu", prefer="best" if args.best else "latest")
    try:
        cfg = GPTConfig(**ckpt["config"]["model"])
        cfg.validate()
        model = GPT(cfg)
        model.load_state_dict(ckpt["model"])
        tokenizer = tokenizer_from_spec(ckpt["tokenizer"])
    except (TypeError, KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"incompatible checkpoint {ckpt['path']}: {str(e).splitlines()[0]}") from None
    return model, tokenizer


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        if args.prompt_file == "-":
            prompts.append(sys.stdin.read())
        else:
            try:
                with open(args.prompt_file, encoding="utf-8") as f:
                    prompts.append(f.read())
            except OSError as e:
                raise GenerateError(f"cannot read prompt file {args.prompt_file!r}: {e.strerror}") from None
    if not prompts:
        raise GenerateError("no prompt: give --prompt TEXT or --prompt-file FILE (or - for stdin)")
    for i, text in enumerate(prompts):
        if not text.strip():
            raise GenerateError(f"prompt {i + 1} is empty")
    return prompts


def check_args(args) -> None:
    if args.temperature < 0:
        raise GenerateError(f"--temperature={args.temperature}: must be >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        raise GenerateError(f"--top-p={args.top_p}: must be in (0, 1]")
    if args.top_k is not None and args.top_k < 1:
        raise GenerateError(f"--top-k={args.top_k}: must be >= 1")
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens={args.max_new_tokens}: must be >= 1")
    if args.num_samples < 1:
        raise GenerateError(f"--num-samples={args.num_samples}: must be >= 1")


def fit_context(ids: list[int], max_new: int, block_size: int) -> list[int]:
    """Apply the context policy: keep the last block_size − max_new tokens of a prompt that is too long."""
    if max_new >= block_size:
        raise GenerateError(f"--max-new-tokens={max_new} leaves no room for a prompt in the context "
                            f"of {block_size} tokens")
    room = block_size - max_new
    if len(ids) > room:
        print(f"note: prompt of {len(ids)} tokens truncated to its last {room} "
              f"(context {block_size} = prompt + {max_new} new tokens)", file=sys.stderr)
        return ids[-room:]
    return ids


def run(args) -> int:
    check_args(args)
    prompts = read_prompts(args)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32}.get(args.dtype) \
        or getattr(torch, args.dtype)
    model, tok = load_model(args, device)
    model.set_attention_backend(args.attention)
    model = model.to(device=device, dtype=dtype).eval()
    encoded = []
    for text in prompts:
        try:
            ids = tok.encode(text)
        except TokenizerError as e:
            raise GenerateError(f"prompt cannot be encoded with this model's tokenizer: {e}") from None
        if not ids:
            raise GenerateError("prompt encodes to no tokens")
        encoded.append(fit_context(ids, args.max_new_tokens, model.config.block_size))
    batch = [ids for ids in encoded for _ in range(args.num_samples)]
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k or 0, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens,
                            stop_token=None if args.no_stop else tok.eot_token)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    stream = len(batch) == 1 and not args.no_stream
    printed = [""]

    def on_token(step, tokens, done):  # stream the decoded text of a single sequence as it grows
        if done[0]:
            return
        text = tok.decode(streamed + [tokens[0]])
        streamed.append(tokens[0])
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(printed[0]):])
            sys.stdout.flush()
            printed[0] = text

    streamed: list[int] = []
    if stream:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
    stats = generate(model, batch, params, generator=gen, on_token=on_token if stream else None,
                     cuda_graph=args.cuda_graph and device.type == "cuda", prefill_chunk=args.prefill_chunk)
    if stream:
        rest = tok.decode(stats.sequences[0])[len(printed[0]):]
        sys.stdout.write(rest + "\n")
    else:
        for i, seq in enumerate(stats.sequences):
            print(f"--- sample {i + 1} (prompt {i // args.num_samples + 1}) ---")
            print(prompts[i // args.num_samples] + tok.decode(seq))
    print(f"\n[{len(batch)} sequence(s), {stats.prompt_tokens} prompt tokens, {stats.new_tokens + len(batch)} new] "
          f"time to first token {stats.time_to_first_token * 1e3:.1f} ms, prefill "
          f"{stats.prefill_tokens_per_s:,.0f} tok/s, decode {stats.decode_tokens_per_s:,.1f} tok/s "
          f"({kernels.resolve_backend(model.config.attention, device)} attention, {device}, {str(dtype).replace('torch.', '')})", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (GenerateError, CheckpointError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
