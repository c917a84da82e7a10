"""Inference: prefill, then decode one token at a time against the KV cache (gpt-fast's split).

    prefill(model, idx, lengths)         prompt(s) → first new token; fills the cache (chunked)
    decode_one_token(model, tok, pos)    one step for every sequence at its own position
    generate(...)                        the loop, with streaming callback and timing

Prompts of different lengths share one batch: they are right-padded and prefilled together (padding sits
after each prompt, so the causal mask keeps real tokens from seeing it), then each sequence decodes from its
own position, overwriting its padding. CUDA graphs (DecodeGraph), torch.compile and the fused kernels of
model/fused_decode.py wrap the decode step from outside the model. The loop keeps LOOKAHEAD decode steps
queued on the GPU while it streams earlier tokens on the host, so that host work (streaming, stop checks)
overlaps the GPU's.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import torch

import kernels

from .fused_decode import fused_decode_step, supported, unsupported_reason
from .sampling import SamplingParams, penalize, sample


LOOKAHEAD = 2  # decode steps the generation loop keeps queued on the GPU ahead of the host


@torch.no_grad()
def prefill(model, idx: torch.Tensor, lengths: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """idx: (B, T) right-padded prompts, lengths: (B,) → logits (B, V) at each prompt's last token.

    chunk > 0 runs the prompt in pieces of `chunk` tokens, each attending to the cache so far.
    """
    B, T = idx.shape
    chunk = chunk if chunk > 0 else T
    last = torch.empty(B, model.config.vocab_size, device=idx.device, dtype=torch.float32)
    for start in range(0, T, chunk):
        end = min(T, start + chunk)
        pos = torch.arange(start, end, device=idx.device)  # (t,)
        logits, _ = model(idx[:, start:end], input_pos=pos)  # (B, t, V)
        inside = (lengths - 1 >= start) & (lengths - 1 < end)  # (B,) sequences whose last token is here
        if inside.any():
            rows = inside.nonzero().squeeze(-1)
            last[rows] = logits[rows, lengths[rows] - 1 - start].float()
    return last


@torch.no_grad()
def decode_one_token(model, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """tok: (B, 1) the latest tokens, pos: (B, 1) their positions → logits (B, V) in float32."""
    logits, _ = model(tok, input_pos=pos)  # (B, 1, V)
    return logits[:, -1].float()


class DecodeGraph:
    """A decode step captured once in a CUDA graph and replayed: one launch per step instead of hundreds.

    Build it right after `model.setup_kv_cache` and BEFORE prefill: the warm-up runs before the capture are
    real decode steps (token 0 at position 0, and 1 when greedy) that write those cache positions, which
    prefill or the first decode steps overwrite before anything reads them. (Built after prefill, they would corrupt the
    first prompt tokens' keys and values.) `step` is decode_one_token, or a torch.compile'd or fused version.

    greedy=True also captures the argmax and feeds it back: each replay reads the static (tok, pos), writes
    the next tokens into tok and advances pos, so that a greedy loop is `prime(tok, pos)` once and then one
    `advance()` per step, with no copies or sampling kernels outside the graph.
    """

    def __init__(self, model, batch: int, device, step=decode_one_token, greedy: bool = False):
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)  # (B, 1) static input
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)  # (B, 1) static input
        self.greedy = greedy

        def body():
            out = step(model, self.tok, self.pos)  # (B, V)
            if greedy:
                self.tok.copy_(out.argmax(dim=-1, keepdim=True))  # the next tokens become the next inputs
                self.pos.add_(1)
            return out

        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm up (triton compilation, cuBLAS handles) outside capture
            for _ in range(2):
                body()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = body()  # (B, V) static output, rewritten by each replay

    def __call__(self, model, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One step from (tok, pos) → logits (B, V) (a static buffer: read it before the next replay)."""
        self.tok.copy_(tok)
        self.pos.copy_(pos)
        self.graph.replay()
        return self.out

    def prime(self, tok: torch.Tensor, pos: torch.Tensor) -> None:
        """greedy: set the first inputs, tok (B, 1) and pos (B, 1)."""
        self.tok.copy_(tok)
        self.pos.copy_(pos)

    def advance(self) -> torch.Tensor:
        """greedy: one step → the next tokens (B,), a view of the static input (copy it before the next one)."""
        assert self.greedy, "advance() needs DecodeGraph(..., greedy=True)"
        self.graph.replay()
        return self.tok[:, 0]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0          # real prompt tokens (padding not counted)
    new_tokens: int = 0             # tokens returned in `sequences` (stop tokens excluded)
    decode_tokens: int = 0          # of those, the ones the decode steps produced (the first came from prefill)
    setup_seconds: float = 0.0      # cache allocation, compilation, CUDA graph capture (once per call)
    prefill_seconds: float = 0.0    # the prompt's forward pass(es)
    time_to_first_token: float = 0.0  # prefill + sampling + the first tokens on the host
    decode_seconds: float = 0.0     # from the first tokens on the host to the last ones
    decode_steps: int = 0
    sequences: list = field(default_factory=list)
    decode_path: str = ""           # "fused" (model/fused_decode.py) or "model" (the model's own forward)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / max(self.decode_seconds, 1e-9)


def use_fused_decode(model, fused: bool | None, compile: bool, check_cache: bool = True) -> bool:
    """Whether the decode step runs through model/fused_decode.py (see generate's `fused`).

    check_cache=False answers before the KV cache is attached (the CLI asks first, to print the path)."""
    device = model.lm_head.weight.device
    if fused is None:
        backends = {kernels.resolve_backend(b.attn.backend, device) for b in model.transformer.h}
        return device.type == "cuda" and backends == {"flash"} and not compile and supported(model, check_cache)
    if fused:
        if compile:
            raise ValueError("fused=True and compile=True: the fused decode step is not for torch.compile")
        reason = unsupported_reason(model, check_cache)
        if reason is not None:
            raise ValueError(f"fused decode step unavailable: {reason}")
    return bool(fused)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _start_host_copy(t: torch.Tensor):
    """Start copying t to the host now; the returned function waits for it and gives t.tolist()."""
    if t.device.type != "cuda":
        return t.tolist
    host = t.to("cpu", non_blocking=True)  # into pinned memory, ordered after the kernels that produce t
    done = torch.cuda.Event()
    done.record()
    return lambda: (done.synchronize(), host.tolist())[1]


@torch.no_grad()
def generate(model, prompts: list[list[int]], params: SamplingParams, *, generator=None, on_token=None,
             cuda_graph: bool = False, compile: bool = False, prefill_chunk: int = 0,
             fused: bool | None = None, stop_check=None) -> GenerationStats:
    """Generate for a batch of token-id prompts. on_token(step, tokens (B,) list, done (B,) list) streams.

    cuda_graph: replay the decode step as a CUDA graph (CUDA only). compile: torch.compile the decode step
    (inside the graph when both are on). fused: decode with model/fused_decode.py (a few fused Triton kernels
    per layer); None = automatically on CUDA with the flash backend and without compile; True where it cannot
    run raises ValueError. Returns stats with `sequences`: each prompt's new tokens, stopping at
    the first of params.stop_tokens (excluded); stats.decode_path says which step ran. A repetition penalty
    (params.repetition_penalty != 1) keeps a (B, V) mask of the tokens each sequence holds on the device and
    penalises their logits before each choice (greedy then chooses outside the CUDA graph too). stop_check(b,
    reply tokens so far) -> bool, called after each token a sequence keeps: True ends sequence b there, that
    token kept (data/stop_text.py's stop strings).
    """
    device = model.lm_head.weight.device
    B = len(prompts)
    if B == 0 or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and no empty prompt")
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={params.max_new_tokens}: must be >= 1")
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA model, this one is on {device}")
    lengths = torch.tensor([len(p) for p in prompts], device=device)  # (B,)
    T = int(lengths.max())
    max_len = T + params.max_new_tokens  # the longest prompt and all its new tokens fit
    idx = torch.zeros(B, T, dtype=torch.long, device=device)  # (B, T) right-padded with token 0
    for b, p in enumerate(prompts):
        idx[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    stats = GenerationStats(prompt_tokens=int(lengths.sum()))
    t_setup = time.perf_counter()
    model.setup_kv_cache(B, max_len)
    try:
        use_fused = use_fused_decode(model, fused, compile)
        stats.decode_path = "fused" if use_fused else "model"
        step_fn = fused_decode_step if use_fused else decode_one_token
        step_fn = torch.compile(step_fn, dynamic=False) if compile else step_fn
        # the tokens each sequence holds (prompt and reply), for the repetition penalty: (B, V) bool
        seen = _prompt_tokens(idx, lengths, model.config.vocab_size) if params.repetition_penalty != 1.0 else None

        def choose(logits: torch.Tensor) -> torch.Tensor:  # (B, V) → the next tokens (B,), on the device
            if seen is not None:
                logits = penalize(logits, seen, params.repetition_penalty)
            chosen = sample(logits, params, generator)
            if seen is not None:
                seen.scatter_(1, chosen[:, None], True)
            return chosen

        in_graph_argmax = cuda_graph and params.temperature == 0 and seen is None
        if cuda_graph:  # before prefill: see DecodeGraph
            step_fn = DecodeGraph(model, B, device, step_fn, greedy=in_graph_argmax)
        _sync(device)
        t0 = time.perf_counter()
        stats.setup_seconds = t0 - t_setup
        logits = prefill(model, idx, lengths, prefill_chunk)  # (B, V)
        _sync(device)
        stats.prefill_seconds = time.perf_counter() - t0
        tok = choose(logits)                     # (B,) on the device
        tokens = tok.tolist()                    # (B,) on the host
        t1 = time.perf_counter()
        stats.time_to_first_token = t1 - t0

        done = [False] * B
        stop = frozenset(params.stop_tokens)
        out: list[list[int]] = [[] for _ in range(B)]
        pos = lengths[:, None].clone()  # (B, 1): where each sequence's next token goes
        if in_graph_argmax:
            step_fn.prime(tok[:, None], pos)

        def next_tokens() -> torch.Tensor:  # queue one decode step → its tokens (B,) on the device
            nonlocal tok, pos
            if in_graph_argmax:
                return step_fn.advance()  # the graph feeds itself: no sampling or copies out here
            tok = choose(step_fn(model, tok[:, None], pos))  # (B,)
            pos = pos + 1
            return tok

        pending = collections.deque()  # host fetches of the queued steps' tokens, oldest first
        launched = 0                     # decode steps queued so far (at most max_new_tokens - 1)
        for step in range(params.max_new_tokens):
            # Keep LOOKAHEAD decode steps queued on the GPU BEFORE handling this step's tokens on the host: each
            # step feeds the next on the device, so the GPU never waits for the host's streaming and stop
            # checks (after the last stop, at most LOOKAHEAD wasted steps).
            while launched < params.max_new_tokens - 1 and len(pending) < LOOKAHEAD and not all(done):
                launched += 1
                stats.decode_steps += 1
                pending.append(_start_host_copy(next_tokens()))
            for b in range(B):
                if not done[b]:
                    if tokens[b] in stop:
                        done[b] = True
                    else:
                        out[b].append(tokens[b])
                        stats.new_tokens += 1
                        stats.decode_tokens += step > 0
                        if stop_check is not None and stop_check(b, out[b]):
                            done[b] = True
            if on_token is not None:
                on_token(step, tokens, done)
            if not pending or all(done):
                break
            tokens = pending.popleft()()
        _sync(device)
        stats.decode_seconds = time.perf_counter() - t1
        stats.sequences = out
    finally:
        model.clear_kv_cache()
    return stats


def _prompt_tokens(idx: torch.Tensor, lengths: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) bool: the tokens of each right-padded prompt in idx (B, T), its padding left out."""
    real = torch.arange(idx.shape[1], device=idx.device)[None, :] < lengths[:, None]  # (B, T)
    counts = torch.zeros(idx.shape[0], vocab, dtype=torch.int32, device=idx.device)
    return counts.scatter_add_(1, idx, real.to(torch.int32)) > 0
