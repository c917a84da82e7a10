"""train.cuda_graphs: where it cannot run, one line (CPU); on a CUDA GPU, replaying the compiled forward and
backward as CUDA graphs trains exactly as the compiled model does, with and without gradient accumulation."""
import json
import os

import pytest
import torch

import train as train_mod
from config import ConfigError, load_config
from tests.util import TINY_MODEL, write_corpus


def base_args(tmp_path, device):
    corpus = write_corpus(tmp_path)
    return [f"--dataset={corpus}", f"--cache_dir={tmp_path}/cache", "--num_proc=1", f"--device={device}",
            "--batch_size=4", "--learning_rate=3e-3", "--warmup_iters=2", "--eval_iters=2", "--log_interval=1",
            *TINY_MODEL]


@pytest.mark.parametrize("extra, problem", [
    ([], "needs train.compile=true"),
    (["--compile=true", "--parallel=fsdp"], "with train.parallel=fsdp"),
    (["--compile=true", "--doc_mask=true"], "with train.doc_mask=true"),
])
def test_config_refuses_what_graphs_cannot_replay(extra, problem):
    with pytest.raises(ConfigError, match=problem) as e:
        load_config(None, ["--cuda_graphs=true", *extra])
    assert "\n" not in str(e.value)


def test_off_cuda_is_one_line_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    args = [*base_args(tmp_path, "cpu"), f"--out_dir={out}", "--max_iters=2", "--compile=true", "--cuda_graphs=true"]
    assert train_mod.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: train.cuda_graphs=true on cpu: CUDA graphs run on one CUDA GPU") and "\n" not in err
    assert not (out / "metrics.jsonl").exists()


def _curve(folder, key):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [(r["iter"], r[key]) for r in rows if key in r]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("accum", [1, 3])
def test_graphs_train_as_the_compiled_model_does(tmp_path, accum):
    """Same seed, data and kernels: each step's loss and grad norm, and the evaluations, agree with the
    compiled run's (float32, so any difference would be the graphs' doing: stale inputs or gradients that a
    later micro-batch's replay overwrote would move them far more than the tolerance)."""
    common = [*base_args(tmp_path, "cuda"), "--dtype=float32", "--attention=flash", "--compile=true",
              "--max_iters=8", "--eval_interval=4", f"--grad_accum_steps={accum}"]
    for name, extra in (("compiled", []), ("graphs", ["--cuda_graphs=true"])):
        train_mod.train(load_config(None, [*common, f"--out_dir={tmp_path}/{name}", *extra]))
    for key in ("loss", "grad_norm", "val_loss"):
        ref, got = _curve(tmp_path / "compiled", key), _curve(tmp_path / "graphs", key)
        assert [i for i, _ in got] == [i for i, _ in ref] and len(ref) > 0, key
        gap = max(abs(a - b) for (_, a), (_, b) in zip(ref, got))
        assert gap <= 1e-4 * max(1.0, max(abs(a) for _, a in ref)), (key, gap, ref, got)
    losses = [v for _, v in _curve(tmp_path / "graphs", "loss")]
    assert losses[-1] < losses[0]  # it trains
