"""Shared helpers for the tests: a small corpus, a tiny config, running the entry points as a user does."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_MODEL = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--dropout=0.0"]


def seeded_generator(request):
    """A CPU torch.Generator seeded from the test's own id (pytest's `request`): inputs differ from test to
    test and stay the same from run to run, so a failure reproduces."""
    import zlib

    import torch

    g = torch.Generator(device="cpu")
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


def needs_sm90_gluon():
    """A pytest skip mark for tests of the Gluon Hopper kernels: they need a CUDA device of compute capability
    9.0 and a Triton with Gluon (the reason says which is missing)."""
    import pytest
    import torch

    from kernels import flash_hopper

    sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    return pytest.mark.skipif(
        not (sm90 and flash_hopper.AVAILABLE),
        reason="needs a CUDA device of compute capability 9.0" if not sm90 else flash_hopper.UNAVAILABLE_REASON or "")


def write_corpus(folder, n_lines: int = 400, seed: int = 0) -> str:
    """A small, learnable text file: a few verses repeated with variations."""
    import random
    rng = random.Random(seed)
    words = ["the", "king", "queen", "sword", "night", "love", "crown", "speak", "thou", "art", "fair", "and"]
    lines = []
    for i in range(n_lines):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + ("." if i % 3 else ","))
    os.makedirs(str(folder), exist_ok=True)
    path = os.path.join(str(folder), "corpus.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def run_entry(script: str, *args, stdin: str | None = None, timeout: int = 300, cwd=None):
    """Run an entry point as a user starts it: offline, without progress bars, and without the TRITON_INTERPRET
    that tests/conftest.py sets for this process on a CPU (each entry point turns Triton's interpreter on itself
    where no GPU exists; one that did not would fail here as it fails for users)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               TQDM_DISABLE="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT, env=env)


def pythonpath(first: str) -> str:
    """PYTHONPATH for a child process: `first`, then whatever this process was given (packages installed into
    a folder of their own stay importable)."""
    rest = os.environ.get("PYTHONPATH", "")
    return first + (os.pathsep + rest if rest else "")


def compiled_records(module: str, tmp_path, parts: tuple[str, ...] = ()) -> list[dict]:
    """Run `python -m module` in a child process with Triton's interpreter off (so its kernels compile for a GPU
    target, tests/gpu_compile.py) and a Triton cache of its own; its stdout is a JSON list of compiled-variant
    records, each of which must name its PTX entry and have a cubin. With parts, one child per part at once
    (`python -m module PART`, each compiling its share), their records joined in the order of parts: a long
    compile check then ends sooner where cores are free."""
    import json
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=pythonpath(ROOT))
    children = []  # (part, process, its stdout file, its stderr file): files, so that no child waits on a pipe
    for i, part in enumerate(parts or ("",)):
        out, err = open(tmp_path / f"records{i}.json", "w+"), open(tmp_path / f"stderr{i}.txt", "w+")
        child = subprocess.Popen([sys.executable, "-m", module, *([part] if part else [])], cwd=ROOT, stdout=out,
                                 stderr=err, env=dict(env, TRITON_CACHE_DIR=str(tmp_path / f"triton{i}")))
        children.append((part, child, out, err))
    records = []
    try:
        for part, child, out, err in children:
            child.wait(timeout=600)
            err.seek(0)
            assert child.returncode == 0, f"{module} {part}: {err.read()[-4000:]}"
            out.seek(0)
            records += json.load(out)
    finally:
        for _, child, out, err in children:
            child.kill()
            out.close()
            err.close()
    for rec in records:
        assert rec["ptx_entry"] and rec["cubin_bytes"] > 0, rec
    return records


def compile_child(module: str, parts: tuple[str, ...], compile_part) -> None:
    """The `__main__` of a compile check's child (compiled_records): the records of compile_part(PART), or of
    compile_part() without an argument, as JSON on stdout; an argument not in parts is one usage line and a
    non-zero exit."""
    import json
    if sys.argv[1:] and sys.argv[1] not in parts:
        sys.exit(f"usage: python -m {module} [{' | '.join(parts)}]")
    json.dump(compile_part(*sys.argv[1:2]), sys.stdout)


def recompute_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The greedy oracle of the generation tests: no cache, naive attention, the whole sequence again at every
    step; n new token ids."""
    import torch
    backend = model.config.attention
    model.set_attention_backend("naive")
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([seq], device=model.lm_head.weight.device))  # (1, T, V)
            out.append(int(logits[0, -1].argmax()))
            seq.append(out[-1])
    model.set_attention_backend(backend)
    return out


def assert_flash_matches_naive(model, idx):
    """The model's logits and gradients (loss on idx as targets) with flash equal those with naive attention;
    flash's logits."""
    import torch
    results = {}
    for backend in ("naive", "flash"):
        model.zero_grad()
        model.set_attention_backend(backend)
        logits, loss = model(idx, idx)
        loss.backward()
        results[backend] = (logits, [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(results["flash"][0], results["naive"][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(results["flash"][1], results["naive"][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    return results["flash"][0]


def train_losses(model, data, steps: int = 25, weight_decay: float = 0.0, lr: float = 3e-3) -> list[float]:
    """The losses of `steps` AdamW steps (the model's own optimizer, CPU) on data (B, T + 1): inputs data[:, :-1],
    targets data[:, 1:]."""
    opt = model.configure_optimizer(weight_decay, lr, (0.9, 0.95), "cpu")
    losses = []
    for _ in range(steps):
        _, loss = model(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def assert_compiles_as_one_graph(model, idx) -> None:
    """model(idx, idx) under torch.compile(fullgraph=True, aot_eager) gives the eager logits and loss (no graph
    break: fullgraph raises on one)."""
    import torch
    eager_logits, eager_loss = model(idx, idx)
    torch._dynamo.reset()
    logits, loss = torch.compile(model, fullgraph=True, backend="aot_eager")(idx, idx)
    torch.testing.assert_close(logits, eager_logits)
    torch.testing.assert_close(loss, eager_loss)
    torch._dynamo.reset()


class CompiledStandIn:
    """What a launch of recording_jit returns: a compiled kernel's stand-in (it has a launcher, run)."""

    def run(self):
        pass


def recording_jit(arg_names, calls: list):
    """A stand-in for a Triton JIT function with these parameters: kernel[grid](*args, **kwargs) appends (grid,
    len(args), the keyword names) to calls and returns a CompiledStandIn, as a launch returns the compiled
    kernel."""
    class RecordingJit:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append((grid, len(args), tuple(kwargs)))
                return CompiledStandIn()
            return launch

    jit = RecordingJit()
    jit.arg_names = list(arg_names)
    return jit

