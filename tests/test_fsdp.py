"""train.parallel = "fsdp" (FSDP2) on CPU with gloo: the same losses as one process, activation checkpointing,
sharded (DCP) checkpoints that resume exactly and on another world size, and load without a process group.

Tolerances: one process and N ranks add the same numbers in a different order (the gradient reduce-scatter),
so their fp32 losses differ by a few ulps (measured over 12 steps of the tiny model: at most 4.8e-7 with 2
ranks, 2.4e-7 with 4); runs that
do the same arithmetic in the same order (resume, world size 1, activation checkpointing) are compared exactly.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import train as train_mod
import training.trainer as trainer_mod
from config import load_config
from model import GPT, GPTConfig
from model.checkpoint import CheckpointError, load_checkpoint
from tests.util import ROOT, TINY_MODEL, run_entry, write_corpus

# Every test here runs gloo ranks on the CPU (train.device=cpu): on a CUDA machine they would only repeat the CPU
# suite's run, at the cost of minutes of its CPU cores. FSDP on GPUs needs several of them (NCCL).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU gloo ranks: the CPU suite runs these")

REDUCTION_ORDER_TOL = 1e-5
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TQDM_DISABLE="1", HF_DATASETS_OFFLINE="1")


def rows(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def curve(folder, key="loss"):
    return [(r["iter"], r[key]) for r in rows(folder) if key in r]


def assert_close(a, b, tol=REDUCTION_ORDER_TOL):
    assert [i for i, _ in a] == [i for i, _ in b]
    gap = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
    assert gap <= tol, (gap, a, b)


def cli_args(tmp, corpus, out, *extra):
    return [os.path.join(ROOT, "configs", "demo.toml"), f"--dataset={corpus}", f"--cache_dir={tmp}/cache",
            "--num_proc=1", "--max_iters=12", "--eval_interval=6", "--eval_iters=2", "--log_interval=1",
            "--batch_size=4", "--device=cpu", "--attention=naive", "--learning_rate=3e-3", "--warmup_iters=2",
            f"--out_dir={out}", *TINY_MODEL, *extra]


def torchrun(nproc, args, timeout=600):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", os.path.join(ROOT, "train.py"), *args],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def single(args, timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (DDP mode, 4 micro-batches) and two FSDP ranks (2 micro-batches each): the same global batch,
    12 steps, checkpoints at 6 and 12."""
    tmp = tmp_path_factory.mktemp("fsdp")
    corpus = write_corpus(tmp)
    one = single(cli_args(tmp, corpus, tmp / "one", "--grad_accum_steps=4"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun(2, cli_args(tmp, corpus, tmp / "two", "--grad_accum_steps=2", "--parallel=fsdp"))
    assert two.returncode == 0, two.stderr[-3000:]
    return {"tmp": tmp, "corpus": corpus, "one": tmp / "one", "two": tmp / "two", "two_stdout": two.stdout}


def test_two_fsdp_ranks_match_one_process(runs):
    one, two = runs["one"], runs["two"]
    assert "world size 2" in runs["two_stdout"] and runs["two_stdout"].count("[model]") == 1
    for key in ("loss", "grad_norm", "val_loss"):
        assert_close(curve(one, key), curve(two, key))
    assert len(curve(two)) == 12 and curve(two)[-1][1] < curve(two)[0][1]
    best = min(curve(two, "val_loss"), key=lambda r: r[1])[0]
    assert sorted(os.listdir(two)) == sorted([f"best_{best:07d}", "ckpt_0000006", "ckpt_0000012", "config.toml",
                                              "loss.png", "metrics.jsonl"])
    files = sorted(os.listdir(two / "ckpt_0000012"))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "flashgpt.json", "rank_00000.pt", "rank_00001.pt"]
    assert sorted(os.listdir(two / f"best_{best:07d}")) == files


def test_fsdp_checkpoint_loads_on_one_process_without_a_group(runs):
    """What generate.py and exporters use: the sharded folder, whole, in the single-file checkpoint's format."""
    ckpt = load_checkpoint(str(runs["two"]))
    plain = load_checkpoint(str(runs["one"]))
    assert ckpt["path"].endswith("ckpt_0000012") and ckpt["verified"] and ckpt["iter"] == 12
    assert ckpt["world_size"] == 2 and ckpt["tokenizer"] == plain["tokenizer"]
    assert set(ckpt["model"]) == set(plain["model"])  # the tied head included
    assert ckpt["model"]["lm_head.weight"] is ckpt["model"]["transformer.wte.weight"]
    for k, v in plain["model"].items():
        assert torch.allclose(ckpt["model"][k], v, atol=1e-5), k
    model = GPT(GPTConfig(**ckpt["config"]["model"]))
    model.load_state_dict(ckpt["model"])
    # the optimizer state comes back in optimizer.state_dict()'s format: a plain optimizer loads it
    optimizer = model.configure_optimizer(0.1, 1e-3, (0.9, 0.95), "cpu")
    optimizer.load_state_dict(ckpt["optimizer"])
    for i, state in plain["optimizer"]["state"].items():
        assert torch.allclose(ckpt["optimizer"]["state"][i]["exp_avg"], state["exp_avg"], atol=1e-6)
        assert ckpt["optimizer"]["state"][i]["step"] == state["step"] == 12
    assert "optimizer" not in load_checkpoint(str(runs["two"]), with_optimizer=False)
    best = min(curve(runs["two"], "val_loss"), key=lambda r: r[1])[0]
    assert load_checkpoint(str(runs["two"]), prefer="best")["iter"] == best
    g = run_entry("generate.py", "--ckpt", runs["two"], "--prompt", "the king", "--max-new-tokens", "12",
                  "--seed", "1", "--temperature", "0")
    assert g.returncode == 0, g.stderr
    g1 = run_entry("generate.py", "--ckpt", runs["two"] / "ckpt_0000012", "--prompt", "the king",
                   "--max-new-tokens", "12", "--seed", "1", "--temperature", "0")
    assert g1.stdout == g.stdout and g.stdout.startswith("the king") and len(g.stdout) > len("the king")
    assert "Warning" not in g.stderr


def copy_run_until(src, dst, step):
    """The run folder as it was after its checkpoint of `step` (later checkpoints removed)."""
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        if name.startswith(("ckpt_", "best_")) and int(name.split("_")[1]) > step:
            shutil.rmtree(dst / name)


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_two_rank_checkpoint_resumes_on_one_process(parallel, runs):
    """Saved by 2 FSDP ranks at step 6, resumed by one process (4 micro-batches, the same global batch): model,
    optimizer, schedule and data position load exactly (DCP reshards 2 → 1); the losses of steps 7..12 then
    differ from the 2-rank run's only by reduction order. Under ddp the folder is read whole instead."""
    resumed = runs["tmp"] / f"resumed-{parallel}"
    copy_run_until(runs["two"], resumed, 6)
    r = single(cli_args(runs["tmp"], runs["corpus"], resumed, "--grad_accum_steps=4", f"--parallel={parallel}",
                        "--resume"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming at step 6" in r.stdout
    assert [i for i, _ in curve(resumed)] == list(range(1, 13))  # rows of steps 1..6 kept, 7..12 new
    assert_close(curve(resumed), curve(runs["two"]))
    assert_close(curve(resumed, "val_loss"), curve(runs["two"], "val_loss"))
    assert os.path.isdir(resumed / "ckpt_0000012") == (parallel == "fsdp")
    assert os.path.isfile(resumed / "ckpt_0000012.pt") == (parallel == "ddp")


def test_exact_resume_with_two_ranks(runs):
    """Stopped at step 6 and resumed on the same two ranks: every later loss is bit-identical."""
    resumed = runs["tmp"] / "resumed-two"
    copy_run_until(runs["two"], resumed, 6)
    r = torchrun(2, cli_args(runs["tmp"], runs["corpus"], resumed, "--grad_accum_steps=2", "--parallel=fsdp",
                             "--resume"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert curve(resumed) == curve(runs["two"])
    assert curve(resumed, "val_loss") == curve(runs["two"], "val_loss")


def test_four_fsdp_ranks_match_one_process_and_resume_on_two(runs, tmp_path):
    four = torchrun(4, cli_args(runs["tmp"], runs["corpus"], tmp_path / "four", "--grad_accum_steps=1",
                                "--parallel=fsdp"))
    assert four.returncode == 0, four.stderr[-3000:]
    assert_close(curve(runs["one"]), curve(tmp_path / "four"))
    assert_close(curve(runs["one"], "val_loss"), curve(tmp_path / "four", "val_loss"))
    assert len([f for f in os.listdir(tmp_path / "four" / "ckpt_0000012") if f.endswith(".distcp")]) == 4

    # saved by 4 ranks at step 6, resumed by 2 (2 micro-batches each, the same global batch) with both blocks in
    # one FSDP unit: DCP reshards 4 → 2 and the curve continues the 4-rank run's
    halved = tmp_path / "four-then-two"
    copy_run_until(tmp_path / "four", halved, 6)
    two = torchrun(2, cli_args(runs["tmp"], runs["corpus"], halved, "--grad_accum_steps=2", "--parallel=fsdp",
                               "--fsdp_blocks_per_unit=2", "--resume"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert "resuming at step 6" in two.stdout
    assert [i for i, _ in curve(halved)] == list(range(1, 13))
    assert_close(curve(halved), curve(tmp_path / "four"))
    assert_close(curve(halved, "val_loss"), curve(tmp_path / "four", "val_loss"))
    assert len([f for f in os.listdir(halved / "ckpt_0000012") if f.endswith(".distcp")]) == 2


# ------------------------------------------------------------------------------------ in one process

def cfg_for(tmp_path, name, *extra):
    corpus = write_corpus(tmp_path)
    return load_config(None, [f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", f"--out_dir={tmp_path}/{name}",
                              "--num_proc=1", "--batch_size=4", "--learning_rate=3e-3", "--warmup_iters=2",
                              "--eval_iters=2", "--log_interval=1", "--device=cpu", "--attention=naive",
                              "--max_iters=8", "--eval_interval=4", *TINY_MODEL, *extra])


def test_fsdp_on_one_process_matches_ddp_and_checkpointing_changes_nothing(tmp_path, monkeypatch):
    """World size 1: FSDP2 (one shard) does what plain training does; activation checkpointing changes nothing,
    bit for bit, under either mode, with dropout (the recomputation replays the forward's RNG state)."""
    from model.gpt import Block
    calls = {"n": 0}
    real_forward = Block.forward

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(Block, "forward", counted)
    switches = []  # gradient sync is switched off at a step's first micro-batch and on at its last, not between
    real_switch = trainer_mod.set_gradient_sync
    monkeypatch.setattr(trainer_mod, "set_gradient_sync", lambda model, sync: (switches.append(sync),
                                                                             real_switch(model, sync)))
    common = ["--grad_accum_steps=3", "--dropout=0.1"]
    block_calls = {}
    for name, extra in {"ddp": [], "fsdp": ["--parallel=fsdp"], "ddp-ac": ["--activation_checkpointing=true"],
                        "fsdp-ac": ["--parallel=fsdp", "--activation_checkpointing=true"]}.items():
        calls["n"] = 0
        train_mod.train(cfg_for(tmp_path, name, *common, *extra))
        block_calls[name] = calls["n"]
    assert switches == [False, True] * 8 * 2  # 8 steps, in each of the two sharded runs
    reference = curve(tmp_path / "ddp")
    assert len(reference) == 8
    # recomputing a block replays its forward exactly, under either mode: bit for bit
    for plain, checkpointed in (("ddp", "ddp-ac"), ("fsdp", "fsdp-ac")):
        for key in ("loss", "val_loss"):
            assert curve(tmp_path / checkpointed, key) == curve(tmp_path / plain, key), checkpointed
    # one shard against plain training: the same sums (bit for bit with torch 2.13 on the CPU; another torch may
    # order FSDP2's one-rank gradient reduction differently, hence the reduction-order tolerance)
    for key in ("loss", "val_loss"):
        assert_close(curve(tmp_path / "fsdp", key), curve(tmp_path / "ddp", key))
    # checkpointed blocks run forward again in backward: 8 steps x 3 micro-batches x 2 blocks more
    assert block_calls["ddp"] == block_calls["fsdp"]
    assert block_calls["ddp-ac"] == block_calls["fsdp-ac"] == block_calls["ddp"] + 8 * 3 * 2
    import torch.distributed as dist
    assert not dist.is_initialized()  # the one-process group ended with the run


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_compiled_checkpointed_blocks_match_eager(parallel, tmp_path, monkeypatch):
    """Activation checkpointing under torch.compile: per block under fully_shard, the whole model under ddp
    (torch.compile's aot_eager backend here: the traced graph without Inductor's code generation, which a CPU run
    of the test suite cannot afford)."""
    import functools
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    common = ["--grad_accum_steps=2", f"--parallel={parallel}", "--activation_checkpointing=true", "--max_iters=4"]
    train_mod.train(cfg_for(tmp_path, "eager", *common))
    counters.clear()
    train_mod.train(cfg_for(tmp_path, "compiled", *common, "--compile=true"))
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks did run compiled
    assert_close(curve(tmp_path / "eager"), curve(tmp_path / "compiled"))
    torch._dynamo.reset()


def test_units_of_blocks_match_ddp_and_resume_under_another_unit_size(tmp_path):
    """fsdp_blocks_per_unit=2 on 3 blocks: units [0, 1] and [2] (one FSDP state each), the same losses as DDP;
    a run saved with units of 2 resumes with units of 1 and continues the uninterrupted curve exactly."""
    from model.parallel import _units, end_single_process_group, shard_model, start_single_process_group
    three = ["--n_layer=3", "--grad_accum_steps=3", "--lr_decay_iters=8"]
    train_mod.train(cfg_for(tmp_path, "ddp", *three))
    train_mod.train(cfg_for(tmp_path, "units", *three, "--parallel=fsdp", "--fsdp_blocks_per_unit=2"))
    for key in ("loss", "val_loss"):
        assert_close(curve(tmp_path / "units", key), curve(tmp_path / "ddp", key))
    train_mod.train(cfg_for(tmp_path / "b", "units", *three, "--parallel=fsdp", "--fsdp_blocks_per_unit=2",
                            "--max_iters=4"))
    train_mod.train(cfg_for(tmp_path / "b", "units", *three, "--parallel=fsdp", "--fsdp_blocks_per_unit=1",
                            "--init_from=resume"))
    assert curve(tmp_path / "b" / "units") == curve(tmp_path / "units")
    # the units themselves
    shape = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=32, vocab_size=64)
    assert start_single_process_group(torch.device("cpu"))
    try:
        model = shard_model(GPT(shape), torch.device("cpu"), None, blocks_per_unit=2)
        blocks = list(model.transformer.h)
        assert [[blocks.index(b) for b in unit] for unit in _units[model]] == [[0, 1], [2]]
        state = lambda m: m._get_fsdp_state()  # noqa: E731
        assert state(blocks[0]) is state(blocks[1]) and state(blocks[1]) is not state(blocks[2])
        with pytest.raises(ValueError, match="blocks_per_unit=0"):
            shard_model(GPT(shape), torch.device("cpu"), None, blocks_per_unit=0)
    finally:
        end_single_process_group()


@pytest.mark.parametrize("log_interval", [1, 2])  # 2: one step in two is read back late
def test_sharded_resume_reproduces_the_uninterrupted_run(log_interval, tmp_path):
    common = ["--parallel=fsdp", "--dropout=0.1", "--grad_accum_steps=2", f"--log_interval={log_interval}",
              "--lr_decay_iters=8"]
    train_mod.train(cfg_for(tmp_path / "a", "run", *common))
    train_mod.train(cfg_for(tmp_path / "b", "run", *common, "--max_iters=4"))
    train_mod.train(cfg_for(tmp_path / "b", "run", *common, "--init_from=resume"))
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert curve(a) == curve(b)
    assert curve(a, "val_loss") == curve(b, "val_loss")


def test_keep_last_and_best_with_folders(tmp_path):
    cfg = cfg_for(tmp_path, "run", "--parallel=fsdp", "--max_iters=9", "--eval_interval=3", "--keep_last=1")
    train_mod.train(cfg)
    names = sorted(os.listdir(cfg.train.out_dir))
    best = min(curve(cfg.train.out_dir, "val_loss"), key=lambda r: r[1])[0]
    assert [n for n in names if n.startswith(("ckpt_", "best"))] == [f"best_{best:07d}", "ckpt_0000009"]
    assert load_checkpoint(cfg.train.out_dir, prefer="best")["iter"] == best
    assert not [n for n in names if n.startswith(".tmp-")]


def test_compiled_blocks_trace_once_and_match_eager():
    """compile_blocks: one compiled function serves every block (traced once); with activation checkpointing
    and dropout the losses and gradients equal eager ones (aot_eager: the graph, without code generation)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from model.parallel import compile_blocks, enable_activation_checkpointing
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=40, attention="naive", dropout=0.1)
    torch.manual_seed(0)
    eager = GPT(cfg)
    compiled = GPT(cfg)
    compiled.load_state_dict(eager.state_dict())
    enable_activation_checkpointing(compiled)
    torch._dynamo.reset()
    counters.clear()
    compile_blocks(compiled, backend="aot_eager")
    x = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (eager, compiled):
        torch.manual_seed(5)
        _, loss = model(x, x)
        loss.backward()
        losses.append(loss)
    assert losses[0].item() == losses[1].item()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert counters["stats"]["unique_graphs"] == 1
    assert list(compiled.state_dict()) == list(eager.state_dict())  # names unchanged
    torch._dynamo.reset()


def test_automatic_units():
    """fsdp_blocks_per_unit = 0: one block per unit on several ranks; on one, as few units of at most
    AUTO_UNIT_MAX blocks as there can be, evened out (at most two unit lengths, so at most two compiled graphs)."""
    from model.parallel import AUTO_UNIT_MAX, auto_blocks_per_unit
    assert auto_blocks_per_unit(12, world=2) == auto_blocks_per_unit(48, world=8) == 1
    assert [auto_blocks_per_unit(n, world=1) for n in (1, 2, 12, 13, 30, 48)] == [1, 2, 12, 7, 10, 12]
    for n in range(1, 100):
        k = auto_blocks_per_unit(n, world=1)
        units = [min(k, n - i) for i in range(0, n, k)]
        assert max(units) <= AUTO_UNIT_MAX and len(units) == -(-n // AUTO_UNIT_MAX) and len(set(units)) <= 2, n


@pytest.mark.parametrize("checkpointed", [False, True])
def test_compiled_units_run_as_one_call_each_and_match_eager_blocks(checkpointed):
    """compile_blocks with units under FSDP2 (one process): units [0, 1] and [2] of 3 blocks each run as one
    compiled call from their first block (the second block passes its input through), two micro-batches with
    gradient sync off then on; losses and gradients equal eager FSDP2 with units of one block, and the module
    hooks still gather and reduce where they should (a reduce before the unit's backward would lose its
    gradients)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from model.parallel import (_UnitForward, compile_blocks, enable_activation_checkpointing,
                                end_single_process_group, set_gradient_sync, shard_model, start_single_process_group)
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=40, attention="naive")
    torch.manual_seed(0)
    weights = GPT(cfg).state_dict()
    batches = [torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    calls = {"n": 0}
    real_call = _UnitForward.__call__

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return real_call(self, *args, **kwargs)

    assert start_single_process_group(torch.device("cpu"))
    torch._dynamo.reset()
    counters.clear()
    try:
        results = []
        for unit in (1, 2):
            model = GPT(cfg)
            model.load_state_dict(weights)
            if checkpointed:
                enable_activation_checkpointing(model)
            if unit > 1:
                compile_blocks(model, unit, backend="aot_eager")
            shard_model(model, torch.device("cpu"), None, unit)
            losses = []
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(_UnitForward, "__call__", counted)
                for i, x in enumerate(batches):
                    set_gradient_sync(model, i == len(batches) - 1)
                    _, loss = model(x, x)
                    (loss / len(batches)).backward()
                    losses.append(loss.item())
            grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
            results.append((losses, grads))
        assert calls["n"] == 2 * len(batches)  # two units per forward, under units only
        assert counters["stats"]["unique_graphs"] == 2  # one graph per unit length (2 and 1), traced once each
        (eager_losses, eager_grads), (unit_losses, unit_grads) = results
        assert unit_losses == pytest.approx(eager_losses, rel=1e-6)
        assert eager_grads.keys() == unit_grads.keys()
        for name, g in eager_grads.items():
            assert g.abs().sum() > 0, name
            torch.testing.assert_close(unit_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        end_single_process_group()
        torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="activation checkpointing before"):
        compiled = GPT(cfg)
        compile_blocks(compiled, 2, backend="aot_eager")
        enable_activation_checkpointing(compiled)
    with pytest.raises(ValueError, match="blocks_per_unit=0"):
        compile_blocks(GPT(cfg), 0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_root_under_fsdp_matches_eager_and_plain(family):
    """compile_root under FSDP2 (one process, with compile_blocks on one unit of both blocks): the embeddings
    and the final norm, head and loss run as compiled graphs of their own (the module hooks outside), one call
    each per forward; two steps of two micro-batches with dropout give the losses and gradients of eager FSDP2
    and of the plain model, the parameter names stay, and a second compile_root is refused. gpt2: learned
    positions and the tied head; llama: RoPE, RMSNorm, SwiGLU and an untied head."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from model.parallel import (_RootPart, compile_blocks, compile_root, end_single_process_group,
                                set_gradient_sync, shard_model, start_single_process_group)
    shape = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", tie_embeddings=False) if family == "llama" else {}
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=40, attention="naive", dropout=0.1,
                    **shape)
    torch.manual_seed(0)
    weights = GPT(cfg).state_dict()
    batches = [torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    counter = CompileCounterWithBackend("aot_eager")  # the graphs it compiles, kept
    assert start_single_process_group(torch.device("cpu"))
    torch._dynamo.reset()
    try:
        results = {}
        for mode in ("plain", "fsdp", "fsdp-compiled"):
            model = GPT(cfg)
            model.load_state_dict(weights)
            if mode == "fsdp-compiled":
                compile_blocks(model, 2, backend=counter)
                compile_root(model, backend=counter)
                assert isinstance(model.embed, _RootPart) and isinstance(model.head, _RootPart)
                with pytest.raises(RuntimeError, match="call it once"):
                    compile_root(model, backend=counter)
            if mode != "plain":
                shard_model(model, torch.device("cpu"), None, 2)
            optimizer = model.configure_optimizer(0.1, 1e-2, (0.9, 0.95), "cpu")
            losses = []
            torch.manual_seed(5)  # the same dropout masks in every mode
            for step in range(2):
                for i, x in enumerate(batches[2 * step:2 * step + 2]):
                    if mode != "plain":
                        set_gradient_sync(model, i == 1)
                    _, loss = model(x, x)
                    (loss / 2).backward()
                    losses.append(loss.item())
                grads = {name: p.grad.full_tensor() if mode != "plain" else p.grad.clone()
                         for name, p in model.named_parameters()}
                optimizer.step()
                optimizer.zero_grad()
            results[mode] = (losses, grads, list(model.state_dict()))
        # three graphs, each traced once: the unit of blocks, embed, head (nothing left to recompile)
        assert counter.frame_count == 3
        ops = [{str(n.target) for n in g.graph.nodes if n.op == "call_function"} for g in counter.graphs]
        embeds = [graph for graph in ops if any("embedding" in op for op in graph)]
        heads = [graph for graph in ops if any("cross_entropy" in op for op in graph)]
        assert len(embeds) == len(heads) == 1 and embeds != heads
        plain_losses, plain_grads, names = results["plain"]
        for mode in ("fsdp", "fsdp-compiled"):
            losses, grads, mode_names = results[mode]
            assert mode_names == names  # the checkpoint keys
            assert losses == pytest.approx(plain_losses, rel=1e-6, abs=0), mode
            for name, g in plain_grads.items():
                assert g.abs().sum() > 0, name
                torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")
    finally:
        end_single_process_group()
        torch._dynamo.reset()


@pytest.mark.parametrize("max_norm", [0.5, float("inf")])
def test_clipping_on_local_shards_matches_clip_grad_norm(max_norm):
    """Under FSDP2 clip_grad_norm works on each rank's local shards (one all-reduce of their squared norms):
    the same total norm and clipped gradients as torch's clip_grad_norm_ on the same gradients unsharded."""
    from model.parallel import _local_shards, clip_grad_norm, shard_model, start_single_process_group
    import torch.distributed as dist
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=40, attention="naive")
    torch.manual_seed(0)
    plain = GPT(cfg)
    grads = {name: torch.randn_like(p) for name, p in plain.named_parameters()}
    assert start_single_process_group(torch.device("cpu"))
    try:
        sharded = GPT(cfg)
        sharded.load_state_dict(plain.state_dict())
        shard_model(sharded, torch.device("cpu"), None, 1)
        for model in (plain, sharded):
            for name, p in model.named_parameters():
                g = grads[name]
                p.grad = g.clone() if model is plain else dist.tensor.distribute_tensor(g, p.device_mesh,
                                                                                        p.placements)
        assert _local_shards([p.grad for p in sharded.parameters()]) is not None  # the local path is taken
        assert _local_shards([p.grad for p in plain.parameters()]) is None
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
        total = clip_grad_norm(sharded, max_norm)
        assert type(total) is torch.Tensor and total.dim() == 0
        torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
        assert expected > 1.0  # the 0.5 case does clip
        for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
            torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-6, atol=1e-7, msg=name)
    finally:
        dist.destroy_process_group()


def test_bf16_policy_gathers_blocks_in_bf16_and_keeps_the_root_fp32():
    """The mixed-precision policy a CUDA run gets (train.py passes bf16 there): blocks are stored as fp32 shards
    and gathered in bf16; the root (embeddings, tied head, final norm) is gathered in fp32."""
    import torch.distributed as dist
    from model.parallel import shard_model, start_single_process_group
    assert start_single_process_group(torch.device("cpu"))
    try:
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=40))
        shard_model(model, torch.device("cpu"), torch.bfloat16)
        block = model.transformer.h[0]
        assert type(block.ln_1.weight).__name__ == "DTensor" and block.ln_1.weight.dtype == torch.float32
        block.unshard()
        assert block.ln_1.weight.dtype == block.attn.c_attn.weight.dtype == torch.bfloat16
        block.reshard()
        model.unshard()
        assert model.transformer.wte.weight.dtype == model.lm_head.weight.dtype == torch.float32
        model.reshard()
        assert block.ln_1.weight.dtype == torch.float32
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- bad input

def test_fsdp_where_it_cannot_run_is_one_line(tmp_path, monkeypatch, capsys):
    import model.parallel
    corpus = write_corpus(tmp_path)
    base = [f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", "--num_proc=1", "--device=cpu",
            "--max_iters=2", *TINY_MODEL]
    monkeypatch.setattr(model.parallel, "fsdp_available", lambda: False)
    assert train_mod.main([*base, f"--out_dir={tmp_path}/a", "--parallel=fsdp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: train.parallel=fsdp: this torch") and "\n" not in err
    monkeypatch.undo()
    assert train_mod.main([*base, f"--out_dir={tmp_path}/b", "--parallel=fsdp", "--dtype=float16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "train.parallel=fsdp with train.dtype=float16" in err and "\n" not in err
    assert train_mod.main([*base, f"--out_dir={tmp_path}/c", "--parallel=zero"]) == 2
    assert "train.parallel='zero': must be 'ddp' or 'fsdp'" in capsys.readouterr().err


@pytest.fixture
def sharded_run(tmp_path):
    cfg = cfg_for(tmp_path, "run", "--parallel=fsdp", "--max_iters=4", "--eval_interval=2")
    train_mod.train(cfg)
    return cfg


def resume_main(cfg, capsys):
    args = [f"--dataset={cfg.data.dataset}", f"--cache_dir={cfg.data.cache_dir}", f"--out_dir={cfg.train.out_dir}",
            "--num_proc=1", "--device=cpu", "--attention=naive", "--batch_size=4", "--eval_iters=2",
            "--max_iters=6", "--eval_interval=2", "--parallel=fsdp", "--resume", *TINY_MODEL]
    code = train_mod.main(args)
    return code, capsys.readouterr().err.strip()


def test_missing_shard_is_named(sharded_run, capsys):
    folder = os.path.join(sharded_run.train.out_dir, "ckpt_0000004")
    os.remove(os.path.join(folder, "__0_0.distcp"))
    with pytest.raises(CheckpointError, match=r"incomplete: its shard __0_0\.distcp \(written by rank 0 of 1\) "
                                              r"is missing"):
        load_checkpoint(sharded_run.train.out_dir)
    code, err = resume_main(sharded_run, capsys)
    assert code == 1 and "\n" not in err and "__0_0.distcp" in err and "missing" in err


def test_damaged_shard_and_description_are_refused(sharded_run):
    folder = os.path.join(sharded_run.train.out_dir, "ckpt_0000004")
    shard = os.path.join(folder, "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in .*__0_0\.distcp"):
        load_checkpoint(folder)
    meta_path = os.path.join(folder, "flashgpt.json")
    meta = json.load(open(meta_path))
    meta["iter"] = 3
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(CheckpointError, match=r"checksum mismatch in .*flashgpt\.json"):
        load_checkpoint(folder)
    os.remove(meta_path)
    with pytest.raises(CheckpointError, match="not a whole sharded checkpoint"):
        load_checkpoint(folder)


def test_pickle_payload_in_dcp_metadata_is_refused(sharded_run, tmp_path):
    """DCP's .metadata is a pickle: one that names anything but DCP's own classes is never unpickled."""
    import pickle
    folder = os.path.join(sharded_run.train.out_dir, "ckpt_0000004")
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = os.path.join(folder, ".metadata")
    with open(path, "wb") as f:
        pickle.dump(Payload(), f)
    meta_path = os.path.join(folder, "flashgpt.json")
    meta = json.load(open(meta_path))  # re-describe the file, as an attacker who can write the folder would
    meta.pop("checksum")
    from model.sharded_checkpoint import _describe, _json_checksum
    meta["files"][".metadata"] = _describe(path)
    meta["checksum"] = _json_checksum(meta)
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(CheckpointError, match=r"refusing to unpickle: .*\.metadata names posix\.system"):
        load_checkpoint(folder)
    assert not marker.exists()


def test_failed_write_keeps_the_last_checkpoint_and_leaves_no_folder(tmp_path, monkeypatch, capsys):
    import torch.distributed.checkpoint as dcp
    cfg = cfg_for(tmp_path, "run", "--parallel=fsdp", "--max_iters=6", "--eval_interval=2")
    real_save, calls = dcp.save, {"n": 0}

    def failing_save(state, *, storage_writer=None, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # the checkpoint of step 4: part of it written, then the disk is full
            os.makedirs(storage_writer.path, exist_ok=True)
            open(os.path.join(storage_writer.path, "__0_0.distcp"), "wb").write(b"partial")
            raise OSError(28, "No space left on device")
        return real_save(state, storage_writer=storage_writer, **kw)

    monkeypatch.setattr(dcp, "save", failing_save)
    with pytest.raises(train_mod.TrainError, match=r"could not write .*ckpt_0000004 \(.*No space left on device"
                                                   r".*last whole checkpoint is .*ckpt_0000002"):
        train_mod.train(cfg)
    monkeypatch.undo()
    names = os.listdir(cfg.train.out_dir)
    assert "ckpt_0000004" not in names and not [n for n in names if n.startswith(".tmp-")]
    assert load_checkpoint(cfg.train.out_dir)["iter"] == 2
    # a temporary folder that a kill left behind is removed when the run resumes
    os.makedirs(os.path.join(cfg.train.out_dir, ".tmp-ckpt_0000004"))
    open(os.path.join(cfg.train.out_dir, ".tmp-ckpt_0000004", "__0_0.distcp"), "wb").write(b"x" * 10)
    code, err = resume_main(cfg, capsys)
    assert code == 0, err
    assert "removed 1 temporary folder(s)" in err
    assert load_checkpoint(cfg.train.out_dir)["iter"] == 6


def test_sigterm_to_one_rank_saves_one_sharded_checkpoint_and_resume_continues(tmp_path):
    """Every rank stops after the same step and writes its shards of one checkpoint; rank 0 reports it."""
    import signal
    from tests.test_train_faults import run_dir, start_training, wait_for_steps, worker_pids
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        pytest.skip("needs /proc/<pid>/task/<tid>/children")
    proc = start_training(tmp_path, "--batch_size=4", "--attention=naive", "--parallel=fsdp", torchrun=2)
    folder = run_dir(tmp_path)
    wait_for_steps(proc, folder, n=2)
    os.kill(worker_pids(proc.pid)[1], signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    said = [line for line in err.splitlines() if "interrupted at step" in line]
    assert len(said) == 1, err[-3000:]
    step = load_checkpoint(folder)["iter"]
    assert step >= 2 and f"ckpt_{step:07d}" in said[0] and "a signal to another rank" in said[0]
    names = os.listdir(folder)
    assert sorted(n for n in names if n.startswith("ckpt_")) == ["ckpt_0000000", f"ckpt_{step:07d}"]
    assert not [n for n in names if n.startswith(".tmp-")]
    r = torchrun(2, [os.path.join(folder, "config.toml"), "--resume", f"--max_iters={step + 2}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming at step {step}" in r.stdout and load_checkpoint(folder)["iter"] == step + 2
