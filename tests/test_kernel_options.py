"""kernels.options (one typed object for every kernel switch, environment overrides read in one place),
kernels._triton's interpreter switch and device check, backend and loss-kernel names, the model's loss_kernel."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import kernels
import kernels._triton as kt
from kernels import options
from kernels.flash import launch
from kernels.options import KernelOptions
from model.config import ConfigError, GPTConfig
from tests.util import ROOT


def test_environment_overrides_parse_into_typed_options():
    assert options.from_env({}) == KernelOptions()
    env = {"FLASHGPT_AUTOTUNE": "0", "FLASHGPT_TMA": "off", "FLASHGPT_TMA_MIN_D": "16", "FLASHGPT_LPT": "false",
           "FLASHGPT_FAST_LAUNCH": "no", "FLASHGPT_BWD": "fused", "FLASHGPT_FUSED_DQ": "1", "FLASHGPT_PDL": "0",
           "FLASHGPT_CE": "torch", "FLASHGPT_DECODE_MIN_KEYS_PER_SPLIT": "64", "FLASHGPT_LLAMA_KERNELS": "triton",
           "FLASHGPT_HOPPER_FWD": "on", "FLASHGPT_DECODE_MERGE_IN_SPLIT": "on", "FLASHGPT_DECODE_SPLIT_ORDER": "chunks",
           "UNRELATED": "x"}
    assert options.from_env(env) == KernelOptions(autotune=False, tma=False, tma_min_block_d=16, lpt=False,
                                                  fast_launch=False, backward="fused", fused_dq=1, pdl=False,
                                                  loss_kernel="torch", decode_min_keys_per_split=64,
                                                  llama_kernels="triton", hopper_forward="on",
                                                  decode_merge_in_split=True, decode_split_order="chunks")
    assert set(options.ENV) == {f.name for f in dataclasses.fields(KernelOptions)}  # every option has one
    assert options.from_env({"FLASHGPT_TMA": "1", "FLASHGPT_LPT": "yes"}, tma=False, lpt=False).tma is True
    assert options.from_env({}, autotune=False).autotune is False  # a program's default, no override


@pytest.mark.parametrize("env,match", [
    ({"FLASHGPT_BWD": "atomic"}, "FLASHGPT_BWD='atomic': expected one of split, fused"),
    ({"FLASHGPT_TMA": "maybe"}, "FLASHGPT_TMA='maybe': expected 1 or 0"),
    ({"FLASHGPT_TMA_MIN_D": "big"}, "FLASHGPT_TMA_MIN_D='big': expected None or an int"),
    ({"FLASHGPT_FUSED_DQ": "3"}, "FLASHGPT_FUSED_DQ='3': expected 1"),
    ({"FLASHGPT_CE": "fused"}, "FLASHGPT_CE='fused': expected one of auto, triton, torch"),
    ({"FLASHGPT_DECODE_MIN_KEYS_PER_SPLIT": "0"}, "FLASHGPT_DECODE_MIN_KEYS_PER_SPLIT='0': expected an int >= 1"),
    ({"FLASHGPT_DECODE_MERGE_IN_SPLIT": "2"}, "FLASHGPT_DECODE_MERGE_IN_SPLIT='2': expected 1 or 0"),
    ({"FLASHGPT_DECODE_SPLIT_ORDER": "random"}, "FLASHGPT_DECODE_SPLIT_ORDER='random': expected one of strided, "
                                                "chunks"),
    ({"FLASHGPT_DECODE_MIN_ROWS": "48"}, "FLASHGPT_DECODE_MIN_ROWS='48': expected 16, 32 or 64"),
])
def test_a_bad_override_names_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        options.from_env(env)


def test_the_environment_is_read_once(monkeypatch):
    monkeypatch.setattr(options, "_current", None)  # as in a fresh process
    monkeypatch.setenv("FLASHGPT_BWD", "fused")
    assert options.get().backward == "fused"
    monkeypatch.setenv("FLASHGPT_BWD", "split")  # too late: the options are parsed
    assert options.get().backward == "fused"


def test_use_update_and_bad_values(monkeypatch):
    monkeypatch.setattr(options, "_current", KernelOptions())
    with options.use(lpt=False, backward="fused") as inside:
        assert options.get() is inside and (inside.lpt, inside.backward) == (False, "fused")
    assert options.get() == KernelOptions()
    with pytest.raises(RuntimeError):
        with options.use(tma=False):
            raise RuntimeError("boom")
    assert options.get().tma is True  # restored on the way out of an exception too
    assert options.update(loss_kernel="torch").loss_kernel == "torch" and options.get().loss_kernel == "torch"
    for bad, match in [(dict(backward="atomic"), "backward='atomic'"), (dict(tma="0"), "tma='0': expected True"),
                       (dict(fused_dq=True), "fused_dq=True"), (dict(tiles=1), "unknown kernel option 'tiles'")]:
        with pytest.raises(ValueError, match=match):
            options.update(**bad)
    assert options.get() == KernelOptions(loss_kernel="torch")  # failed updates change nothing
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.get().tma = False


def test_options_hash_as_values():
    """Launch plans are keyed by the options: equal options give one key, different ones another."""
    a, b = KernelOptions(lpt=False), KernelOptions(lpt=False)
    assert a is not b and a == b and hash(a) == hash(b) and len({a, b, KernelOptions()}) == 2


def test_plans_are_recorded_per_options(monkeypatch):
    """The same call under other options records (and replays) its own plan, never one recorded under others."""
    monkeypatch.setattr(launch, "_plans", {})
    q = torch.randn(1, 2, 17, 16, device="cuda" if torch.cuda.is_available() else "cpu")
    kernels.flash_attention(q, q, q)
    with options.use(lpt=False, fast_launch=False):
        kernels.flash_attention(q, q, q)
        kernels.flash_attention(q, q, q)  # replays the plan of these options
    keys = list(launch._plans)  # ("fwd", causal, sm_scale, options, ...)
    assert len(keys) == 2
    assert {k[3] for k in keys} == {options.get(), dataclasses.replace(options.get(), lpt=False, fast_launch=False)}


def test_importing_the_kernels_sets_nothing():
    """No import-time side effects: without TRITON_INTERPRET, importing the kernels leaves it unset (Triton
    compiles them), and a launch on CPU tensors is one clear error naming the switch."""
    code = ("import os, torch, kernels, kernels.decode, kernels.ln_linear\n"
            "assert 'TRITON_INTERPRET' not in os.environ and not kernels.interpreting()\n"
            "try:\n"
            "    kernels.flash_attention(*(torch.randn(1, 1, 4, 16) for _ in range(3)))\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == ("flash_attention runs on CUDA, got cpu (on a CPU it runs in Triton's interpreter: "
                                "start Python with TRITON_INTERPRET=1)")


def test_kernels_decorated_against_the_switch_are_refused(monkeypatch):
    """check_decorated: a kernel module whose kernels Triton decorated the other way than kernels._triton read
    TRITON_INTERPRET (it changed in between) refuses to load."""
    from kernels.flash.forward import _attn_fwd
    kt.check_decorated(_attn_fwd)
    monkeypatch.setattr(kt, "INTERPRET", not kt.INTERPRET)
    with pytest.raises(RuntimeError, match="set TRITON_INTERPRET before starting Python"):
        kt.check_decorated(_attn_fwd)


def test_backend_names_and_auto_in_one_place():
    assert kernels.BACKEND_CHOICES == ("auto", *kernels.BACKENDS)
    assert kernels.resolve_backend("auto", "cpu") == "sdpa" and kernels.resolve_backend("auto", "cuda") == "flash"
    assert all(kernels.resolve_backend(b, "cpu") == b for b in kernels.BACKENDS)
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        kernels.resolve_backend("fast", "cpu")
    with pytest.raises(ConfigError, match="model.attention='fast': must be one of auto, flash, sdpa, naive"):
        GPTConfig(attention="fast").validate()


def test_loss_kernel_is_a_config_key():
    """model.loss_kernel (TOML, or --loss_kernel=...) is validated; configs saved without it (older checkpoints)
    load with "auto"."""
    assert GPTConfig().loss_kernel == "auto"
    old = {k: v for k, v in dataclasses.asdict(GPTConfig(vocab_size=50)).items() if k != "loss_kernel"}
    assert GPTConfig(**old).validate().loss_kernel == "auto"
    for name in kernels.LOSS_KERNELS:
        GPTConfig(loss_kernel=name).validate()
    with pytest.raises(ConfigError, match="model.loss_kernel='fused': must be one of auto, triton, torch"):
        GPTConfig(loss_kernel="fused").validate()
