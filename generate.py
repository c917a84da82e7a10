"""Generate text from a checkpoint: prefill the prompt(s), then decode with a KV cache.

    python generate.py --ckpt runs/demo --prompt "ROMEO:"
    python generate.py --ckpt runs/demo --prompt "To be" --prompt "JULIET:" --temperature 0
    echo "Once upon" | python generate.py --ckpt runs/x/best.pt --prompt-file -
    python generate.py --init-from gpt2 --prompt "Hello"      # Hugging Face GPT-2 weights (needs the hub)
    python generate.py --init-from hf:HuggingFaceTB/SmolLM2-135M-Instruct --chat --prompt "What is 2+2?"
    python generate.py --init-from hf:HuggingFaceTB/SmolLM2-135M-Instruct --chat    # a conversation on stdin

--init-from hf:<repo-or-dir> loads a Hugging Face model (GPT-2, Llama, Mistral, Phi-3, Qwen2, Qwen3, SmolLM3,
OLMo 2/3, Gemma 3 families, or a PEFT LoRA adapter on one of them) with its own tokenizer.json (training/pretrained.py); --chat wraps
each prompt as a user message in the tokenizer's chat template (rendered in a Jinja sandbox, data/chat.py) and
prints only the reply, which ends at the template's end-of-turn token (data/conversation.py) as well as at end of
text. --chat without --prompt or --prompt-file is a conversation: each line on stdin is a user message, answered in
the context of the conversation so far (the whole conversation is prefilled again each turn; the oldest exchanges
are dropped, with a note, when it no longer fits the context); /reset starts over, /exit or the end of input ends
it.

Context policy: prompt + max-new-tokens must fit in the model's block_size; a longer prompt keeps its last
block_size − max_new_tokens tokens (a note says so on stderr). max-new-tokens >= block_size is an error; its
default is 200, or block_size // 2 when that is smaller.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

if not torch.cuda.is_available():  # flash on a CPU runs in Triton's interpreter, chosen before kernels load
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels  # noqa: E402

from data import stop_text  # noqa: E402
from data.conversation import Conversation, ConversationError, end_of_turn_token  # noqa: E402
from data.tokenizers import HFTokenizer, TokenizerError, tokenizer_from_spec  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.config import ConfigError  # noqa: E402
from model.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from model.device import pick_device, pick_dtype  # noqa: E402
from model.generation import generate, use_fused_decode  # noqa: E402
from model.lora import inference_weights  # noqa: E402
from model.sampling import SAMPLING_FIELDS, SamplingParams, from_generation_config  # noqa: E402


DEFAULT_MAX_NEW_TOKENS = 200  # capped at block_size // 2 so that a prompt fits too


class GenerateError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Generate text from a flashgpt checkpoint (or Hugging Face weights).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("model")
    src.add_argument("--ckpt", help="checkpoint file, or a run folder (its latest checkpoint)")
    src.add_argument("--best", action="store_true", help="with a run folder: use best.pt instead of the latest")
    src.add_argument("--init-from", metavar="hf:REPO_OR_DIR | gpt2[-medium|-large|-xl]",
                     help="Hugging Face weights instead of a checkpoint: hf:<hub id or local folder> (GPT-2, Llama, "
                          "Mistral, Phi-3, Qwen2, Qwen3, SmolLM3, OLMo 2/3, Gemma 3 families, with the model's "
                          "tokenizer.json; or a "
                          "PEFT LoRA adapter: its base model with the updates merged), or a GPT-2 size (with the "
                          "GPT-2 tokenizer); hub ids are read from the local cache first")
    src.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    src.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="auto: bfloat16 on CUDA, float32 on CPU")
    src.add_argument("--attention", default="auto", choices=kernels.BACKEND_CHOICES,
                     help="attention backend (auto: flash on CUDA, sdpa on CPU)")
    src.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                     help="replay the decode step as a CUDA graph (CUDA only)")
    src.add_argument("--compile", action="store_true", help="torch.compile the decode step (slow start)")
    src.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                     help="decode with the fused Triton kernels of model/fused_decode.py (default: on CUDA with "
                          "flash attention and without --compile)")
    src.add_argument("--prefill-chunk", type=int, default=512,
                     help="prompts longer than this are prefilled in chunks against the cache (0 = whole prompt)")
    inp = p.add_argument_group("prompts")
    inp.add_argument("--prompt", action="append", help="a prompt; repeat for a batch of prompts")
    inp.add_argument("--prompt-file", help="read one prompt from a file ('-' = stdin); one final newline is dropped")
    inp.add_argument("--chat", action="store_true",
                     help="each prompt is a user message, written with the tokenizer's chat template (Hugging "
                          "Face tokenizers that have one); only the reply is printed. Without --prompt or "
                          "--prompt-file: a conversation, one user message per line on stdin (/reset starts over, "
                          "/exit or end of input ends it)")
    inp.add_argument("--system", help="with --chat: a system message before the user's")
    smp = p.add_argument_group("sampling")
    smp.add_argument("--max-new-tokens", type=int, default=None,
                     help="tokens to generate per sample (default: 200, at most half the model's context); prompt "
                          "+ these must fit in the context, so a longer prompt keeps only its last "
                          "(block_size - max_new_tokens) tokens, with a note")
    smp.add_argument("--temperature", type=float, default=None,
                     help="0 = greedy (default 0.8, or what a Hugging Face model's generation_config.json sets, "
                          "as for the options below)")
    smp.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default off)")
    smp.add_argument("--top-p", type=float, default=None,
                     help="nucleus sampling: keep the smallest set with mass p (default 1 = off)")
    smp.add_argument("--min-p", type=float, default=None,
                     help="keep the tokens at least min-p times as likely as the most likely one (default 0 = off)")
    smp.add_argument("--stop", action="append", metavar="TEXT",
                     help="end a reply where its text first holds TEXT (excluded); repeat for several")
    smp.add_argument("--repetition-penalty", type=float, default=None,
                     help="> 1 makes the tokens of the prompt and of the reply so far less likely (default 1 = off)")
    smp.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    smp.add_argument("--seed", type=int, default=1337)
    smp.add_argument("--no-stop", action="store_true",
                     help="do not stop at the end-of-text tokens (the tokenizer's eos_token and "
                          "generation_config.json's eos_token_id)")
    smp.add_argument("--no-stream", action="store_true", help="print each sample at the end instead of streaming")
    return p


def load_model(args, device: torch.device):
    """(model, tokenizer, generation_config.json's settings ({} but for a Hugging Face folder or repo)) from
    --ckpt or --init-from."""
    if args.init_from:
        from model.hf import HF_NAMES, build, load_hf_gpt2
        if args.init_from in HF_NAMES:
            return load_hf_gpt2(args.init_from), tokenizer_from_spec({"kind": "gpt2"}), {}
        if not args.init_from.startswith("hf:") or args.init_from == "hf:":
            raise GenerateError(f"--init-from={args.init_from!r}: expected hf:<repo-or-dir> (a Hugging Face hub id "
                                f"or model folder) or one of {', '.join(HF_NAMES)}")
        from training.pretrained import load_pretrained
        pre = load_pretrained(args.init_from, what="--init-from")
        return build(pre.config, pre.state), pre.tokenizer, pre.generation
    if not args.ckpt:
        raise GenerateError("give --ckpt RUN_DIR_OR_FILE or --init-from hf:REPO_OR_DIR")
    ckpt = load_checkpoint(args.ckpt, map_location="cpu", prefer="best" if args.best else "latest")
    try:
        cfg = GPTConfig(**ckpt["config"]["model"])
        cfg.validate()
        model = GPT(cfg)
        model.load_state_dict(inference_weights(ckpt))  # a LoRA run's updates merged
        tokenizer = tokenizer_from_spec(ckpt["tokenizer"])
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"its {tokenizer.name} tokenizer has {tokenizer.vocab_size} tokens, the model only "
                             f"{cfg.vocab_size}")
    except (TypeError, KeyError, RuntimeError, ValueError) as e:
        detail = " ".join(str(e).replace("Error(s) in loading state_dict for GPT:", "").split())  # one line
        raise CheckpointError(f"incompatible checkpoint {ckpt['path']}: {detail[:400]}") from None
    return model, tokenizer, {}


def sampling_settings(args, generation: dict) -> tuple[dict, list[str]]:
    """The sampling fields of SamplingParams: each option given on the command line, else what the model's
    generation_config.json asks for (model.sampling.from_generation_config), else SamplingParams' default; and
    the names of the fields the model's file set."""
    given = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                 repetition_penalty=args.repetition_penalty)
    model_own = from_generation_config(generation) or {}
    base = SamplingParams()
    out, from_model = {}, []
    for name in SAMPLING_FIELDS:
        if given[name] is not None:
            out[name] = given[name]
        elif name in model_own:
            out[name] = model_own[name]
            from_model.append(name)
        else:
            out[name] = getattr(base, name)
    return out, from_model


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:  # the file's text as it is, less one final newline (`echo text |` adds one)
        try:
            if args.prompt_file == "-":
                text = sys.stdin.read()
            else:
                with open(args.prompt_file, encoding="utf-8") as f:
                    text = f.read()
        except OSError as e:
            raise GenerateError(f"cannot read prompt file {args.prompt_file!r}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise GenerateError(f"prompt file {args.prompt_file!r} is not UTF-8 text") from None
        prompts.append(text[:-1] if text.endswith("\n") else text)
    if not prompts:
        raise GenerateError("no prompt: give --prompt TEXT or --prompt-file FILE (or - for stdin)")
    for i, text in enumerate(prompts):
        if not text.strip():
            raise GenerateError(f"prompt {i + 1} is empty")
    return prompts


def new_conversation(tok, system: str | None) -> Conversation:
    """An empty conversation in the tokenizer's chat template, or a GenerateError naming the tokenizer that has
    none."""
    template = tok.chat_template if isinstance(tok, HFTokenizer) else None
    if not template:
        if isinstance(tok, HFTokenizer):
            where = (f"{tok.source} has no chat template (no chat_template in tokenizer_config.json, no "
                     "chat_template.jinja or chat_template.json)")
        else:
            where = f"the {tok.name} tokenizer has no chat template"
        raise GenerateError(f"--chat: {where}; leave out --chat to continue the prompt as plain text")
    return Conversation(tok, system=system)


def check_args(args) -> None:
    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise GenerateError(f"--temperature={args.temperature}: must be a finite number >= 0 (0 = greedy)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise GenerateError(f"--top-p={args.top_p}: must be in (0, 1]")
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        raise GenerateError(f"--min-p={args.min_p}: must be in [0, 1]")
    if args.stop and not all(args.stop):
        raise GenerateError("--stop: a stop string must not be empty")
    if args.repetition_penalty is not None and not (math.isfinite(args.repetition_penalty)
                                                    and args.repetition_penalty > 0):
        raise GenerateError(f"--repetition-penalty={args.repetition_penalty}: must be a finite number > 0 (1 = off)")
    if args.top_k is not None and args.top_k < 1:
        raise GenerateError(f"--top-k={args.top_k}: must be >= 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens={args.max_new_tokens}: must be >= 1")
    if args.num_samples < 1:
        raise GenerateError(f"--num-samples={args.num_samples}: must be >= 1")
    if args.prefill_chunk < 0:
        raise GenerateError(f"--prefill-chunk={args.prefill_chunk}: must be >= 0 (0 = the whole prompt at once)")
    if args.ckpt and args.init_from:
        raise GenerateError("give either --ckpt or --init-from, not both")
    if args.system is not None and not args.chat:
        raise GenerateError("--system needs --chat")
    if is_conversation(args) and args.num_samples > 1:
        raise GenerateError("--num-samples > 1 needs prompts: a conversation (--chat without --prompt) answers "
                            "each message once")


def is_conversation(args) -> bool:
    """--chat without prompts: a conversation on stdin."""
    return args.chat and not args.prompt and not args.prompt_file


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


class Printer:
    """Prints replies (streamed token by token where one sequence is generated) and the stats line of each; with
    stop strings, each reply ends before the first of them (data/stop_text.py), and a stream holds back the
    characters that may still become one."""

    def __init__(self, tok, label: str, stream: bool, stops: tuple[str, ...] = ()):
        self.tok, self.label, self.stream, self.stops = tok, label, stream, stops

    def text(self, reply: list[int]) -> str:
        """A reply's text, up to its first stop string."""
        return stop_text.cut(self.tok.decode(reply), self.stops)

    def generate(self, model, batch: list[list[int]], params, gen, opts: dict, shown: list[str],
                 headers: bool = True):
        """Generate for `batch` and print each sample after its `shown` text (unstreamed: under a header line
        naming it, unless headers=False); returns the stats."""
        tok = self.tok
        stream = self.stream and len(batch) == 1
        streamed: list[int] = []  # tokens of sequence 0 so far
        printed = [""]            # their text as printed so far

        def on_token(step, tokens, done):  # stream the decoded text of a single sequence as it grows
            if done[0]:
                return
            streamed.append(tokens[0])
            text = tok.decode(streamed)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                text = text[:len(text) - stop_text.held_back(text, self.stops)]  # (what may become a stop string)
                sys.stdout.write(text[len(printed[0]):])
                sys.stdout.flush()
                printed[0] = text

        if stream:
            sys.stdout.write(shown[0])
            sys.stdout.flush()
        check = stop_text.stop_check(tok.decode, self.stops) if self.stops else None
        stats = generate(model, batch, params, generator=gen, on_token=on_token if stream else None,
                         stop_check=check, **opts)
        if stream:
            sys.stdout.write(self.text(stats.sequences[0])[len(printed[0]):] + "\n")
        else:
            per_prompt = len(batch) // len(shown)
            for i, seq in enumerate(stats.sequences):
                if headers:
                    print(f"--- sample {i + 1} (prompt {i // per_prompt + 1}) ---")
                print(shown[i // per_prompt] + self.text(seq))
        sys.stdout.flush()
        print(f"[{len(batch)} sequence(s), {stats.prompt_tokens} prompt tokens, {stats.new_tokens} new] "
              f"time to first token {stats.time_to_first_token * 1e3:.1f} ms, prefill "
              f"{stats.prefill_tokens_per_s:,.0f} tok/s, decode {stats.decode_tokens_per_s:,.1f} tok/s "
              f"({self.label})", file=sys.stderr, flush=True)
        return stats


def encode_prompts(args, prompts: list[str], tok, block_size: int) -> tuple[list[list[int]], list[str]]:
    """The batch of token-id sequences (each prompt num_samples times, fitted to the context) and what is printed
    before each prompt's samples (the prompt it continues; nothing for a chat reply)."""
    shown = [""] * len(prompts) if args.chat else prompts
    if args.chat:  # each prompt a one-message conversation (after the system message, if any)
        conv = new_conversation(tok, args.system)
    encoded = []
    for text in prompts:
        try:
            ids = conv.encode(conv.messages(text)) if args.chat else tok.encode(text)
        except ConversationError as e:
            raise GenerateError(f"--chat: {e}") from None
        except TokenizerError as e:
            raise GenerateError(f"prompt cannot be encoded with this model's tokenizer: {e}") from None
        if not ids:
            raise GenerateError("prompt encodes to no tokens")
        encoded.append(fit_context(ids, args.max_new_tokens, block_size))
    return [ids for ids in encoded for _ in range(args.num_samples)], shown  # (num prompts * num samples)


def start_conversation(tok, system: str | None, max_new: int, block_size: int) -> tuple[Conversation, int]:
    """The conversation and the room its prompts have (block_size − max_new tokens), or a GenerateError."""
    conv = new_conversation(tok, system)
    if max_new >= block_size:
        raise GenerateError(f"--max-new-tokens={max_new} leaves no room for a message in the context of "
                            f"{block_size} tokens")
    return conv, block_size - max_new


def read_line(stream, answered: int) -> str:
    """One line of a text stream ("" at its end), decoded line by line as UTF-8 where the stream has bytes
    underneath, so that the lines before a bad one are answered first."""
    raw = getattr(stream, "buffer", None)
    if raw is None:
        return stream.readline()
    try:
        return raw.readline().decode("utf-8")
    except UnicodeDecodeError:
        raise GenerateError(f"standard input is not UTF-8 text (after {answered} answered message(s))") from None


def converse(model, tok, conv: Conversation, room: int, params, gen, opts: dict, printer: Printer) -> int:
    """A conversation on stdin: each line a user message, each reply printed on its own line. A message that
    cannot be answered gets an error line and the conversation goes on; the exit status is then 2."""
    interactive = sys.stdin.isatty()
    if interactive:
        print("one message per line; /reset starts over, /exit or Ctrl-D ends", file=sys.stderr)
    refused = turns = 0
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = read_line(sys.stdin, turns)
        if not line:
            break
        user = line.rstrip("\r\n")
        command = user.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            conv.reset()
            print("(conversation reset)", file=sys.stderr, flush=True)
            continue
        try:
            ids, dropped = conv.prompt_ids(user, room)
        except ConversationError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            refused += 1
            continue
        if dropped:
            print(f"note: the {dropped} oldest exchange(s) of the conversation left out to fit the context of "
                  f"{model.config.block_size} tokens", file=sys.stderr, flush=True)
        stats = printer.generate(model, [ids], params, gen, opts, [""], headers=False)
        conv.add_exchange(user, printer.text(stats.sequences[0]))
        turns += 1
    return 2 if refused else 0


def run(args) -> int:
    check_args(args)
    prompts = [] if is_conversation(args) else read_prompts(args)
    device = pick_device(args.device, what="--device")
    dtype = pick_dtype(args.dtype, device, what="--dtype")
    backend = kernels.resolve_backend(args.attention, device)
    if backend == "flash" and device.type == "cpu":  # the Triton kernels on CPU tensors: only the interpreter
        if not kernels.interpreting():  # on when the process started without CUDA, or with TRITON_INTERPRET=1
            raise GenerateError("--attention flash on the CPU needs Triton's interpreter: start with "
                                "TRITON_INTERPRET=1 (slow), or use --attention sdpa")
        if dtype == torch.bfloat16:
            raise GenerateError("--attention flash on CPU runs in Triton's interpreter, which gets bfloat16 wrong: "
                                "use --dtype float32 or --attention sdpa")
    model, tok, generation = load_model(args, device)
    model.set_attention_backend(backend)
    model = model.to(device=device, dtype=dtype).eval()
    if args.max_new_tokens is None:
        args.max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, model.config.block_size // 2)
    stop = () if args.no_stop else tok.stop_tokens
    if args.chat and not args.no_stop:  # a reply also ends at the template's end-of-turn token
        turn_end = end_of_turn_token(tok)
        stop = tuple(dict.fromkeys(stop + ((turn_end,) if turn_end is not None else ())))
    sampling, from_model = sampling_settings(args, generation)
    if from_model:
        print("sampling: " + ", ".join(f"{name.replace('_', '-')} {sampling[name]:g}" for name in from_model)
              + " (the model's generation_config.json; options given override it)", file=sys.stderr, flush=True)
    params = SamplingParams(**sampling, max_new_tokens=args.max_new_tokens, stop_tokens=stop)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    if is_conversation(args):
        conv, room = start_conversation(tok, args.system, args.max_new_tokens, model.config.block_size)
    else:
        batch, shown = encode_prompts(args, prompts, tok, model.config.block_size)
    cuda_graph = args.cuda_graph and device.type == "cuda"
    try:
        fused = use_fused_decode(model, args.fused, args.compile, check_cache=False)
    except ValueError as e:
        raise GenerateError(str(e)) from None
    opts = dict(cuda_graph=cuda_graph, compile=args.compile, prefill_chunk=args.prefill_chunk, fused=fused)
    decode_path = {"flash": "split-KV decode kernel", "sdpa": "SDPA over the cache",
                   "naive": "naive attention"}[backend]
    if model.config.attention_window:  # model/kv_cache.py: the decode kernel's window, or a mask over the cache
        window = model.config.attention_window
        masked = "naive attention" if backend == "naive" else "SDPA"
        decode_path = (f"split-KV decode kernel over the window ({window} tokens)" if backend == "flash" else
                       f"{masked} with the window's mask ({window} tokens)")
    decode_path = f"fused LN/matmul kernels + {decode_path}" if fused else decode_path
    print(f"attention: {backend} (prefill: {backend}, decode: {decode_path}"
          f"{', CUDA graph' if cuda_graph else ''}{', torch.compile' if args.compile else ''}) on {device}, "
          f"{str(dtype).replace('torch.', '')}", file=sys.stderr, flush=True)
    printer = Printer(tok, f"{backend} attention, {device}, {str(dtype).replace('torch.', '')}",
                      stream=not args.no_stream, stops=tuple(args.stop or ()))
    if is_conversation(args):
        return converse(model, tok, conv, room, params, gen, opts, printer)
    printer.generate(model, batch, params, gen, opts, shown)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (GenerateError, CheckpointError, TokenizerError, ConfigError) as e:  # HFError is a CheckpointError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
