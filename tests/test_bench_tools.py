"""The parts of the kernel-development tools that run anywhere: the tile survey's and the backward-kernel
profile's checks of their arguments (and refusal without a GPU), the register report's compile for Hopper, and
the shared report writer."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.util import ROOT


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, f"{ROOT}/bench/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_tile_survey_needs_a_gpu(capsys):
    assert _load("tiles").main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_tile_survey_rejects_unknown_kernels(capsys):
    with pytest.raises(SystemExit) as exc:
        _load("tiles").main(["--kernels", "fwd,attn"])
    assert exc.value.code == 2 and "--kernels: expected some of fwd,dq,dkdv,dkdvq" in capsys.readouterr().err


def test_backward_kernel_profile_rejects_unknown_modes(capsys):
    with pytest.raises(SystemExit) as exc:
        _load("bwd_kernels").main(["--modes", "split,fused:3"])
    assert exc.value.code == 2 and "expected split or fused:1|2, got 'fused:3'" in capsys.readouterr().err


def test_register_report_compiles_the_dkdv_kernels_for_hopper():
    """bench/ptxas_regs.py compiles the split and the fused dK/dV kernel for sm_90a without a GPU (its own
    process: it needs the compiled kernels, the tests run the interpreter)."""
    code = ("import sys; sys.path.insert(0, 'bench'); import ptxas_regs as pr\n"
            "for kernel in ('dkdv', 'dkdvq'):\n"
            "    r = pr.compile_report(kernel, (64, 64, 4, 3), 64, True)\n"
            "    print(kernel, r['regs'], r['smem'])\n")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert [r[0] for r in rows] == ["dkdv", "dkdvq"] and all(0 < int(r[1]) <= 255 for r in rows)
    assert int(rows[1][2]) > int(rows[0][2])  # the fused kernel stages its dQ tile in shared memory


def test_write_report_prints_and_writes_one_markdown_text(tmp_path, capsys):
    from bench.report import write_report

    text = write_report(str(tmp_path / "new"), "r.md", ["# title", "", "| a |"])
    assert text == "# title\n\n| a |\n" and (tmp_path / "new" / "r.md").read_text() == text
    assert "| a |" in capsys.readouterr().out
