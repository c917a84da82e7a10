"""Generation from a model with a sliding window (model.attention_window): the KV cache applies the window.

The oracle is tests/test_generate.py's: the whole sequence through the model without a cache (naive attention,
which applies the window as the training forward does) at every step. Prompts shorter and longer than the
window, of different lengths in one batch (per-sequence positions) and alone (positions shared by the batch),
prefilled whole and in chunks; naive, sdpa and flash (Triton's interpreter on the CPU; the GPU in the CUDA
tests), GPT-2, Llama-family (RoPE, GQA) and Gemma 3 blocks (the window in the first layer only, whose RoPE
has a base of its own; the second attends to the whole prefix). The same weights without the window generate other tokens
from the longer prompts, so the window is what these tokens depend on.
"""
from __future__ import annotations

import pytest
import torch

from model import GPT, GPTConfig
from model.generation import generate
from model.kv_cache import KVCache
from model.sampling import SamplingParams
from tests.util import recompute_greedy

VOCAB = 97
WINDOW = 6
PROMPT_LENS = (2, 5, 19, 30)  # inside the window, then past it (and past the decode kernel's 16 new tokens)
N_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=N_NEW)
ARCHS = {"gpt2": dict(), "llama-gqa": dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2),
         "gemma3": dict(pos_emb="rope", norm="rmsnorm1p", mlp="geglu", bias=False, n_kv_head=2, sandwich_norm=True,
                        embed_scale=True, qk_norm=True, query_scale_dim=12, full_attention_interval=2,
                        rope_local_theta=100.0)}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["naive", "sdpa", "flash"]  # flash: the interpreter on CPU tensors (tests/conftest.py), else the GPU


def windowed_model(arch: str, window: int = WINDOW, seed: int = 0) -> GPT:
    """A tiny model with weights large enough that greedy choices have clear margins."""
    torch.manual_seed(seed)
    arch_options = ARCHS[arch] if window else {k: v for k, v in ARCHS[arch].items()
                                               if k not in ("full_attention_interval", "rope_local_theta")}
    model = GPT(GPTConfig(block_size=64, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64, attention="naive",
                          attention_window=window, **arch_options)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
            elif arch == "gemma3":  # norm weights off 0 (Gemma's norms scale by 1 + weight)
                p.normal_(0.0, 0.2)
        if arch == "gemma3":  # embeddings times sqrt(64) would otherwise drown the blocks' outputs
            model.transformer.wte.weight.normal_(0.0, 0.3 / 8)
    return model.to(DEVICE)


def prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def oracle():
    """{arch: (model, prompts, greedy tokens recomputed without a cache)}."""
    out = {}
    for arch in ARCHS:
        model, ps = windowed_model(arch), prompts()
        out[arch] = (model, ps, [recompute_greedy(model, p, N_NEW) for p in ps])
    return out


# prefill whole and in chunks of 4 and 13 tokens (flash: one chunk size, each shape compiling kernels of its own)
CASES = [(b, c) for b in BACKENDS for c in (0, 4, 13) if not (b == "flash" and c == 4)]


@pytest.mark.parametrize("backend, chunk", CASES)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_windowed_greedy_with_cache_equals_recompute(oracle, arch, backend, chunk):
    model, ps, expected = oracle[arch]
    model.set_attention_backend(backend)
    try:
        assert generate(model, ps, GREEDY, prefill_chunk=chunk).sequences == expected  # per-sequence positions
        for p, e in zip(ps, expected):  # each prompt alone: positions shared by the batch
            assert generate(model, [p], GREEDY, prefill_chunk=chunk).sequences == [e], (len(p), backend)
    finally:
        model.set_attention_backend("naive")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_window_changes_what_is_generated(oracle, arch):
    """Without the window the same weights generate other tokens from the prompts longer than it (and the same
    from the first prompt, which the window never cuts during its first tokens): the test above can fail."""
    model, ps, expected = oracle[arch]
    plain = windowed_model(arch)
    plain.load_state_dict(model.state_dict())
    for block in plain.transformer.h:  # the window alone removed (Gemma 3's layers keep their RoPE bases)
        block.attn.window = 0
    unwindowed = [recompute_greedy(plain, p, N_NEW) for p in ps]
    assert unwindowed[0][:WINDOW - len(ps[0])] == expected[0][:WINDOW - len(ps[0])]
    changed = [u != e for u, e in zip(unwindowed[2:], expected[2:])]  # (gemma3: its first layer's window)
    assert all(changed), changed
    assert generate(plain, ps, GREEDY).sequences == unwindowed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", ["flash", "sdpa"])
@pytest.mark.parametrize("compile_step", [False, True], ids=["graph", "compile+graph"])
@pytest.mark.parametrize("arch", ["llama-gqa", "gemma3"])
def test_windowed_cuda_graph_decode_equals_eager(oracle, arch, backend, compile_step):
    """On the GPU: the decode step as a CUDA graph (and compiled) with the window (the decode kernel's for flash,
    a mask for sdpa); flash without compile takes the fused step, the GPU's default, where the blocks are
    fused (Gemma 3's are not: the model's own step)."""
    model, ps, expected = oracle[arch]
    model.set_attention_backend(backend)
    try:
        stats = generate(model, ps, GREEDY, cuda_graph=True, compile=compile_step)
        fused = backend == "flash" and not compile_step and arch != "gemma3"
        assert stats.sequences == expected and stats.decode_path == ("fused" if fused else "model")
    finally:
        model.set_attention_backend("naive")


@pytest.mark.parametrize("arch", ["gpt2", "llama-gqa"])
def test_fused_decode_with_a_window_equals_recompute(oracle, arch):
    """The fused step passes each layer's window to the split-KV decode kernel (per-layer launches: the
    one-launch stack has no window), batched and one sequence at a time."""
    from model.fused_decode import stack_plan
    model, ps, expected = oracle[arch]
    model.set_attention_backend("flash")
    try:
        stats = generate(model, ps, GREEDY, fused=True)
        assert stats.decode_path == "fused" and stats.sequences == expected
        for p, e in zip(ps[2:], expected[2:]):  # batch 1 (where the stack would run), prompts past the window
            assert generate(model, [p], GREEDY, fused=True).sequences == [e], len(p)
        assert stack_plan(model) is None
    finally:
        model.set_attention_backend("naive")


def test_a_window_that_covers_the_cache_is_dropped():
    """A window at least as long as the cache cuts nothing: the cache attends as without one (the decode kernel
    then serves flash)."""
    assert KVCache(1, 2, 32, 16, torch.float32, "cpu", window=32).window == 0
    assert KVCache(1, 2, 32, 16, torch.float32, "cpu", window=31).window == 31
    assert KVCache(1, 2, 32, 16, torch.float32, "cpu").window == 0
