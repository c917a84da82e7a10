"""Inference: KV-cache generation vs recomputing everything, sampling, and generate.py as a user runs it.

The oracle of exactness is the slowest correct thing: at every step, the whole sequence so far through the
model with attention="naive" and no cache, and the argmax of the last position. Everything runs in float32 on
the CPU (the flash backend through Triton's interpreter, which tests/conftest.py turns on).
"""
from __future__ import annotations

import io
import os
import re
import sys

import pytest
import torch

from model import GPT, GPTConfig
from model.checkpoint import atomic_save, load_checkpoint
from model.generation import generate, prefill
from model.sampling import SamplingParams, sample
from tests.util import recompute_greedy, run_entry, write_corpus

VOCAB = 97
PROMPT_LENS = (1, 5, 17, 30)  # single tokens, < 16 (the decode kernel's prefill path), > 16, two chunk sizes
N_NEW = 10


def random_model(n_kv_head: int = 0, attention: str = "naive", seed: int = 0) -> GPT:
    """A tiny GPT with weights large enough that greedy choices have clear margins (no float near-ties)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=64, vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=64,
                          attention=attention)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model


def random_prompts(lens=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=N_NEW)


@pytest.fixture(scope="module")
def oracle():
    """{n_kv_head: (model, prompts, expected greedy tokens per prompt)}, computed once."""
    out = {}
    for n_kv_head in (0, 2):
        model = random_model(n_kv_head)
        prompts = random_prompts()
        out[n_kv_head] = (model, prompts, [recompute_greedy(model, p, N_NEW) for p in prompts])
    return out


# ----------------------------------------------------------------------------------------------- exactness

@pytest.mark.parametrize("n_kv_head", [0, 2])
@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("chunk", [0, 4, 13])
def test_greedy_with_cache_equals_recompute(oracle, backend, chunk, n_kv_head):
    model, prompts, expected = oracle[n_kv_head]
    model.set_attention_backend(backend)
    batch = generate(model, prompts, GREEDY, prefill_chunk=chunk)  # one batch, prompts of different lengths
    assert batch.sequences == expected
    for p, e in zip(prompts, expected):  # and each prompt alone
        assert generate(model, [p], GREEDY, prefill_chunk=chunk).sequences == [e]
    model.set_attention_backend("naive")


@pytest.mark.parametrize("chunk", [0, 7])
def test_greedy_flash_backend_equals_recompute(oracle, chunk):
    """The Triton path: flash prefill (or the split-KV kernel for chunks of <= 16 tokens) + split-KV decode.

    chunk=7 prefills every chunk through decode_attention with one length for the whole batch: a stride-0
    `lengths.expand(B)` there made the kernel read past the lengths tensor (garbage or a crash for B > 1).
    """
    if torch.cuda.is_available():
        pytest.skip("CPU tensors go through the Triton interpreter only without a GPU (see the CUDA tests)")
    model, prompts, expected = oracle[2]
    model.set_attention_backend("flash")
    try:
        assert generate(model, prompts, GREEDY, prefill_chunk=chunk).sequences == expected
    finally:
        model.set_attention_backend("naive")


def test_prefill_in_chunks_gives_the_same_logits(oracle):
    model, prompts, _ = oracle[0]
    lengths = torch.tensor([len(p) for p in prompts])
    idx = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        idx[b, :len(p)] = torch.tensor(p)
    full_model_logits = torch.stack([model(torch.tensor([p]))[0][0, -1] for p in prompts])  # (B, V)
    for chunk in (0, 1, 8, 29):
        model.setup_kv_cache(len(prompts), idx.shape[1])
        try:
            last = prefill(model, idx, lengths, chunk)  # (B, V)
        finally:
            model.clear_kv_cache()
        torch.testing.assert_close(last, full_model_logits, atol=1e-4, rtol=1e-4)


def test_stop_tokens_end_each_sequence_separately(oracle):
    model, prompts, expected = oracle[0]
    for stops in ((expected[1][3],), (expected[0][5], expected[2][2])):  # one end token; two (the first wins)
        stats = generate(model, prompts, SamplingParams(temperature=0.0, max_new_tokens=N_NEW, stop_tokens=stops))
        for seq, full in zip(stats.sequences, expected):
            first = min((full.index(s) for s in stops if s in full), default=len(full))
            assert seq == full[:first]
        assert any(len(seq) < N_NEW for seq in stats.sequences)
        assert stats.new_tokens == sum(len(s) for s in stats.sequences)
        assert stats.decode_tokens == stats.new_tokens - sum(1 for s in stats.sequences if s)


def test_streaming_callback_sees_every_token(oracle):
    model, prompts, expected = oracle[0]
    seen = []
    generate(model, prompts[:2], GREEDY, on_token=lambda step, toks, done: seen.append((step, toks, done)))
    assert [s for s, _, _ in seen] == list(range(N_NEW))
    assert [t for _, t, _ in seen] == [list(x) for x in zip(*expected[:2])]


def test_generate_refuses_bad_input(oracle):
    model = oracle[0][0]
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[1, 2], []], GREEDY)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[1]], SamplingParams(max_new_tokens=0))
    with pytest.raises(ValueError, match="block_size"):
        generate(model, [[1] * 60], GREEDY)


@pytest.mark.parametrize("n_kv_head", [0, 2])
def test_greedy_fused_decode_equals_recompute(oracle, n_kv_head):
    """model/fused_decode.py as the decode step (on CPU through the interpreter; generate's default on a GPU)."""
    if torch.cuda.is_available():
        pytest.skip("CPU tensors go through the Triton interpreter only without a GPU (see the CUDA tests)")
    model, prompts, expected = oracle[n_kv_head]
    stats = generate(model, prompts, GREEDY, fused=True)
    assert stats.decode_path == "fused" and stats.sequences == expected
    assert generate(model, prompts[:1], GREEDY).decode_path == "model"  # auto: the fused path is for CUDA
    with pytest.raises(ValueError, match="not for torch.compile"):
        generate(model, prompts, GREEDY, fused=True, compile=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", ["flash", "sdpa"])
@pytest.mark.parametrize("compile_step", [False, True], ids=["graph", "compile+graph"])
def test_cuda_graph_decode_equals_eager(backend, compile_step):
    """The graph's warm-up steps write cache position 0: it must be built before prefill (a bug it was not)."""
    model = random_model(2, attention=backend).cuda()
    prompts = random_prompts()
    eager = generate(model, prompts, GREEDY).sequences
    graphed = generate(model, prompts, GREEDY, cuda_graph=True, compile=compile_step).sequences
    assert graphed == eager == [recompute_greedy(model, p, N_NEW) for p in prompts]
    if backend == "flash" and not compile_step:  # the GPU default is the fused step; the model's own step too
        assert generate(model, prompts, GREEDY, cuda_graph=True).decode_path == "fused"
        assert generate(model, prompts, GREEDY, cuda_graph=True, fused=False).sequences == eager


# ------------------------------------------------------------------------------------------------ sampling

def test_top_k_1_and_tiny_top_p_are_greedy():
    torch.manual_seed(0)
    logits = torch.randn(64, 500) * 3
    g = torch.Generator().manual_seed(0)
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, SamplingParams(temperature=1.5, top_k=1), g), greedy)
    assert torch.equal(sample(logits, SamplingParams(temperature=1.5, top_p=1e-6), g), greedy)
    assert torch.equal(sample(logits, SamplingParams(temperature=0.0), g), greedy)


def test_top_k_1_generation_equals_greedy(oracle):
    model, prompts, expected = oracle[0]
    g = torch.Generator().manual_seed(3)
    assert generate(model, prompts, SamplingParams(temperature=2.0, top_k=1, max_new_tokens=N_NEW),
                    generator=g).sequences == expected


def test_seeded_sampling_is_reproducible(oracle):
    model, prompts, _ = oracle[0]
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, max_new_tokens=N_NEW)
    runs = [generate(model, prompts, params, generator=torch.Generator().manual_seed(s)).sequences
            for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def frequencies(logits_row: torch.Tensor, params: SamplingParams, n: int = 20000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    toks = sample(logits_row.expand(n, -1), params, g)  # (n,)
    return torch.bincount(toks, minlength=logits_row.numel()).double() / n


def test_temperature_samples_follow_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for t in (0.5, 1.0, 2.0):
        want = torch.softmax(logits.double() / t, -1)
        got = frequencies(logits, SamplingParams(temperature=t))
        assert (got - want).abs().max() < 0.015, (t, got, want)  # ~4 standard errors at n=20000
    # a higher temperature flattens the distribution
    assert frequencies(logits, SamplingParams(temperature=2.0))[0] < frequencies(logits, SamplingParams(temperature=0.5))[0]


def test_top_k_and_top_p_keep_only_their_set_renormalised():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    got = frequencies(logits, SamplingParams(temperature=1.0, top_k=2))
    assert got[2:].sum() == 0 and abs(got[0] - 0.4 / 0.7) < 0.015
    got = frequencies(logits, SamplingParams(temperature=1.0, top_p=0.8))  # 0.4 + 0.3 < 0.8 <= + 0.15
    assert got[3:].sum() == 0 and abs(got[2] - 0.15 / 0.85) < 0.015
    got = frequencies(logits, SamplingParams(temperature=1.0, top_p=0.7))  # exactly 0.4 + 0.3 (up to rounding)
    assert got[3:].sum() == 0


def test_min_p_keeps_the_tokens_near_the_most_likely_renormalised():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    got = frequencies(logits, SamplingParams(temperature=1.0, min_p=0.3))  # floor 0.12: 0.4, 0.3, 0.15 stay
    assert got[3:].sum() == 0 and abs(got[2] - 0.15 / 0.85) < 0.015 and abs(got[0] - 0.4 / 0.85) < 0.015
    got = frequencies(logits, SamplingParams(temperature=2.0, min_p=0.55))  # on the tempered probabilities,
    tempered = torch.softmax(logits.double() / 2.0, -1)  # ∝ p^½: 1, 0.87, 0.61 of the largest stay, 0.5, 0.35 go
    kept = tempered >= 0.55 * tempered.max()
    assert kept.tolist() == [True, True, True, False, False]
    want = torch.where(kept, tempered, 0.0) / tempered[kept].sum()
    assert (got - want).abs().max() < 0.015 and got[3:].sum() == 0
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits[None].expand(4, -1), SamplingParams(temperature=1.0, min_p=1.0), g),
                       torch.zeros(4, dtype=torch.long))  # only the most likely token


# ---------------------------------------------------------------------------------- generate.py, the CLI

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny GPT-2-tokenizer checkpoint trained by train.py (block_size 32), plus crafted variants."""
    import train as train_mod
    from config import load_config
    tmp = tmp_path_factory.mktemp("gen")
    corpus = write_corpus(tmp, n_lines=200)
    cfg = load_config(None, [f"--dataset={corpus}", "--tokenizer=gpt2", f"--cache_dir={tmp}/cache",
                             f"--out_dir={tmp}/run", "--num_proc=1", "--batch_size=4", "--max_iters=4",
                             "--eval_interval=4", "--eval_iters=1", "--warmup_iters=1", "--device=cpu",
                             "--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--dropout=0.0"])
    train_mod.train(cfg)
    run = str(tmp / "run")
    base = load_checkpoint(run)
    base.pop("path")
    # a model that always says end-of-text: ln_f outputs its bias b, and wte[EOT] = 10 b wins every argmax
    eot = dict(base, model=dict(base["model"]))
    m = eot["model"]
    m["transformer.ln_f.weight"] = torch.zeros_like(m["transformer.ln_f.weight"])
    m["transformer.ln_f.bias"] = torch.randn_like(m["transformer.ln_f.bias"])
    wte = m["transformer.wte.weight"].clone()
    wte[50256] = 10 * m["transformer.ln_f.bias"]
    m["transformer.wte.weight"] = m["lm_head.weight"] = wte
    atomic_save(eot, str(tmp / "eot.pt"))
    # incompatible: the right format, a tensor of the wrong shape
    bad = dict(base, model=dict(base["model"]))
    bad["model"]["transformer.wpe.weight"] = torch.zeros(16, 32)
    atomic_save(bad, str(tmp / "wrong_shapes.pt"))
    # a sliding-window model (the KV cache applies the window)
    windowed = dict(base, config=dict(base["config"], model=dict(base["config"]["model"], attention_window=8)))
    atomic_save(windowed, str(tmp / "windowed.pt"))
    (tmp / "corrupt.pt").write_bytes(b"\x80\x02not a checkpoint at all")
    (tmp / "prompt.txt").write_text("the queen")
    return tmp


def gen(*args, stdin=None):
    """generate.py on the CPU (the same on every machine); a later --device in args overrides it."""
    return run_entry("generate.py", "--device", "cpu", *args, stdin=stdin)


def test_cli_prompt_streams_and_reports_stats(ckpt):
    r = gen("--ckpt", ckpt / "run", "--prompt", "the king", "--max-new-tokens", "8", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("the king") and len(r.stdout) > len("the king\n")
    err = r.stderr.splitlines()
    assert err[0].startswith("attention: sdpa") and "cpu" in err[0]  # the backend in use, resolved from auto
    assert "time to first token" in err[-1] and "prefill" in err[-1] and "decode" in err[-1] and "tok/s" in err[-1]
    assert "Traceback" not in r.stderr


def test_cli_prompt_file_stdin_and_batches(ckpt):
    common = ["--ckpt", ckpt / "run", "--max-new-tokens", "5", "--temperature", "0", "--no-stop"]
    a = gen(*common, "--prompt-file", ckpt / "prompt.txt")
    b = gen(*common, "--prompt-file", "-", stdin="the queen\n")  # as `echo the queen |` sends it
    c = gen(*common, "--prompt", "the queen")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + b.stderr + c.stderr
    assert a.stdout == b.stdout == c.stdout and a.stdout.startswith("the queen")
    # several prompts of different lengths, several samples each: one batch, greedy → samples agree
    d = gen(*common, "--prompt", "the queen", "--prompt", "thou art fair and the crown", "--num-samples", "2")
    assert d.returncode == 0, d.stderr
    assert d.stdout.count("--- sample") == 4 and "(prompt 2)" in d.stdout
    samples = d.stdout.split("--- sample")[1:]
    assert samples[0].split("---\n", 1)[1] == samples[1].split("---\n", 1)[1] == "the queen" + \
        a.stdout[len("the queen"):]
    assert "[4 sequence(s)" in d.stderr


def test_cli_stops_at_end_of_text(ckpt):
    r = gen("--ckpt", ckpt / "eot.pt", "--prompt", "the king", "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "the king\n" and "0 new]" in r.stderr
    r = gen("--ckpt", ckpt / "eot.pt", "--prompt", "the king", "--max-new-tokens", "6", "--no-stop")
    assert r.returncode == 0 and r.stdout == "the king" + "<|endoftext|>" * 6 + "\n" and "6 new]" in r.stderr


def test_cli_long_prompt_is_truncated_with_a_note(ckpt):
    r = gen("--ckpt", ckpt / "run", "--prompt", "the king and the queen " * 20, "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^note: prompt of 10\d tokens truncated to its last 24 \(context 32 = prompt \+ 8 new",
                     r.stderr, re.M)
    assert r.stdout.startswith("the king and the queen") and "[1 sequence(s), 24 prompt tokens, 8 new]" in r.stderr
    # without --max-new-tokens: 200, capped at half the context (16 of 32), so that the demo's defaults work
    r = gen("--ckpt", ckpt / "run", "--prompt", "the king and the queen " * 20, "--no-stop")
    assert r.returncode == 0, r.stderr
    assert "truncated to its last 16" in r.stderr and "[1 sequence(s), 16 prompt tokens, 16 new]" in r.stderr


@pytest.mark.parametrize("args, stdin, message", [
    (["--prompt", ""], None, "prompt 1 is empty"),
    (["--prompt-file", "-"], "  \n", "prompt 1 is empty"),
    (["--prompt", "hi", "--temperature", "-1"], None, "--temperature=-1.0: must be a finite number >= 0"),
    (["--prompt", "hi", "--temperature", "nan"], None, "--temperature=nan: must be a finite number >= 0"),
    (["--prompt", "hi", "--top-p", "nan"], None, "--top-p=nan: must be in (0, 1]"),
    (["--prompt", "hi", "--top-p", "0"], None, "--top-p=0.0: must be in (0, 1]"),
    (["--prompt", "hi", "--top-p", "1.5"], None, "--top-p=1.5: must be in (0, 1]"),
    (["--prompt", "hi", "--min-p", "1.5"], None, "--min-p=1.5: must be in [0, 1]"),
    (["--prompt", "hi", "--min-p", "nan"], None, "--min-p=nan: must be in [0, 1]"),
    (["--prompt", "hi", "--repetition-penalty", "0"], None, "--repetition-penalty=0.0: must be a finite number > 0"),
    (["--prompt", "hi", "--top-k", "0"], None, "--top-k=0: must be >= 1"),
    (["--prompt", "hi", "--max-new-tokens", "32"], None, "leaves no room for a prompt"),
    (["--prompt-file", "/nonexistent/prompt.txt"], None, "cannot read prompt file"),
    (["--ckpt", "/nonexistent/run", "--prompt", "hi"], None, "checkpoint not found"),
    (["--ckpt", "{tmp}/corrupt.pt", "--prompt", "hi"], None, "corrupt or truncated checkpoint"),
    (["--ckpt", "{tmp}/wrong_shapes.pt", "--prompt", "hi"], None, "size mismatch for transformer.wpe.weight"),
    (["--prompt", "hi", "--device", "cuda:7"], None, "--device=cuda:7"),
], ids=["empty", "empty-stdin", "temperature", "temperature-nan", "top-p-nan", "top-p-0", "top-p-1.5", "min-p-1.5",
        "min-p-nan", "repetition-penalty-0", "top-k", "max-new-tokens", "prompt-file", "missing-ckpt", "corrupt-ckpt", "wrong-shapes", "device"])
def test_cli_errors_are_one_line(ckpt, args, stdin, message):
    args = [a.format(tmp=ckpt) for a in args]
    if "--ckpt" not in args:
        args = ["--ckpt", str(ckpt / "run"), *args]
    r = gen(*args, stdin=stdin)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert r.stdout == ""


def test_cli_generates_from_a_windowed_model(ckpt):
    """A model with attention_window = 8 generates past its window (tests/test_window_generation.py checks the
    tokens)."""
    r = gen("--ckpt", ckpt / "windowed.pt", "--prompt", "the king and the queen", "--max-new-tokens", "12",
            "--temperature", "0", "--no-stop")
    assert r.returncode == 0, r.stderr
    assert "[1 sequence(s), 5 prompt tokens, 12 new]" in r.stderr and r.stdout.startswith("the king and the queen")
    assert "decode: SDPA with the window's mask (8 tokens)" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, the interpreter is off unless TRITON_INTERPRET=1")
def test_cli_windowed_model_on_the_decode_kernel_and_the_fused_step(ckpt):
    """--attention flash decodes a windowed model through the split-KV kernel's window, and --fused through the
    fused step (the interpreter on the CPU): the same tokens as SDPA's masked path, past the window."""
    common = ["--ckpt", ckpt / "windowed.pt", "--prompt", "the king and the queen", "--max-new-tokens", "12",
              "--temperature", "0", "--no-stop", "--dtype", "float32"]
    s = gen(*common, "--attention", "sdpa")
    f = gen(*common, "--attention", "flash")
    fused = gen(*common, "--attention", "flash", "--fused")
    assert s.returncode == f.returncode == fused.returncode == 0, s.stderr + f.stderr + fused.stderr
    assert "decode: split-KV decode kernel over the window (8 tokens)" in f.stderr, f.stderr
    assert "decode: fused LN/matmul kernels + split-KV decode kernel over the window (8 tokens)" in fused.stderr
    assert f.stdout == s.stdout == fused.stdout and s.stdout.startswith("the king and the queen")


def test_cli_stop_strings_end_the_reply(ckpt):
    """--stop TEXT: the reply ends before the first occurrence of TEXT in its text, streamed or not, and the
    generation stops there (fewer new tokens)."""
    common = ["--ckpt", ckpt / "run", "--prompt", "the king", "--max-new-tokens", "24", "--temperature", "0",
              "--no-stop"]  # (a context of 32 tokens)
    plain = gen(*common)
    assert plain.returncode == 0, plain.stderr
    reply = plain.stdout[len("the king"):-1]
    space = reply.index(" ", 2)  # GPT-2's tokens start with their space: a stop across two tokens' texts
    stop = reply[space - 2:space + 2]
    assert len(stop) == 4 and len(reply) > 20, reply
    first = reply.find(stop)
    for extra, header in (((), ""), (("--no-stream",), "--- sample 1 (prompt 1) ---\n")):
        r = gen(*common, "--stop", stop, "--stop", "never in this text \u2603", *extra)
        assert r.returncode == 0, r.stderr
        assert r.stdout == header + "the king" + reply[:first] + "\n", (r.stdout, reply, stop)
        new = int(r.stderr.split(" new]")[0].rsplit(", ", 1)[1])
        assert new < 24, r.stderr
    r = gen(*common, "--stop", "")
    assert r.returncode != 0 and r.stderr.strip().splitlines() == ["error: --stop: a stop string must not be empty"]


def test_cli_streams_token_by_token_in_process(ckpt, monkeypatch):
    """Batch 1 streams: many small writes whose concatenation is the final text."""
    import generate as gen_mod
    writes = []

    class Recorder(io.StringIO):
        def write(self, s):
            writes.append(s)
            return super().write(s)

    monkeypatch.setattr(sys, "stdout", Recorder())
    rc = gen_mod.main(["--ckpt", str(ckpt / "run"), "--device", "cpu", "--prompt", "the king",
                       "--max-new-tokens", "12", "--no-stop", "--seed", "3"])
    assert rc == 0
    text = "".join(writes)
    assert writes[0] == "the king" and len(writes) >= 8 and text.endswith("\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, the interpreter is off unless TRITON_INTERPRET=1")
def test_cli_flash_backend_on_cpu_decodes_a_batch(ckpt):
    """--attention flash on the CPU: the Triton kernels through the interpreter, prompts of different lengths."""
    common = ["--ckpt", ckpt / "run", "--max-new-tokens", "4", "--temperature", "0", "--no-stop",
              "--prompt", "the king", "--prompt", "thou art fair and the crown"]
    f = gen(*common, "--attention", "flash")
    s = gen(*common, "--attention", "sdpa")
    assert f.returncode == 0 and s.returncode == 0, f.stderr + s.stderr
    assert f.stderr.startswith("attention: flash (prefill: flash, decode: split-KV decode kernel)")
    assert f.stdout == s.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cli_on_the_gpu_graph_equals_eager(ckpt):
    """The CLI's GPU defaults (bf16, flash, CUDA graph) stream, and the graph changes no token."""
    common = ["--ckpt", ckpt / "run", "--device", "cuda", "--prompt", "the king", "--max-new-tokens", "12",
              "--temperature", "0", "--no-stop"]
    g = gen(*common)
    e = gen(*common, "--no-cuda-graph")
    assert g.returncode == 0 and e.returncode == 0, g.stderr + e.stderr
    assert g.stderr.startswith("attention: flash (prefill: flash, decode: fused LN/matmul kernels + split-KV decode "
                               "kernel, CUDA graph) on cuda:0, bfloat16")
    assert g.stdout == e.stdout and g.stdout.startswith("the king")
    n = gen(*common, "--no-fused")
    assert n.returncode == 0 and "decode: split-KV decode kernel, CUDA graph" in n.stderr, n.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU (interpreter) path; a GPU runs the real "
                    "benchmark (the GPU machine's Triton 3.6 interpreter fails on these kernels, as in test_decode.py)")
def test_bench_generate_smoke(tmp_path):
    r = run_entry("bench/generate.py", "--smoke", "--out", tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    names = sorted(os.listdir(tmp_path))
    assert "generate_smoke.json" in names and "generate_smoke.md" in names
    md = (tmp_path / "generate_smoke.md").read_text()
    assert "python bench/generate.py --smoke" in md and "flashgpt" in md and "sdpa" in md


def test_same_device_ignores_index_spelling(monkeypatch):
    """A generator made on "cuda" reports device("cuda") while the logits are on device("cuda:0"): the same GPU.
    Comparing the device objects with != called them different and sent CUDA probabilities to the CPU with a
    CUDA generator (a crash on every sampling run on a GPU)."""
    from model.sampling import same_device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert same_device(torch.device("cuda"), torch.device("cuda:0"))
    assert same_device("cuda:0", "cuda")
    assert not same_device("cuda", "cuda:1")
    assert not same_device("cuda:0", "cpu")
    assert same_device("cpu", torch.device("cpu"))


def test_sampling_draws_on_the_generator_device():
    """Where the generator and the logits do sit on the same device, sample() uses the generator as it is:
    the draw equals torch.multinomial with an identically seeded generator."""
    logits = torch.randn(4, 50)
    p = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    got = sample(logits, p, torch.Generator().manual_seed(3))
    assert got.shape == (4,) and got.dtype == torch.long
    assert torch.equal(got, sample(logits, p, torch.Generator(device="cpu").manual_seed(3)))
