"""`pip install .` (not editable) gives a working install: every module the entry points import is in the wheel,
the console scripts are declared, and each entry point answers --help from a folder that is not the checkout."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.util import ROOT

SCRIPTS = {"flashgpt-train": "train:main", "flashgpt-generate": "generate:main", "flashgpt-eval": "eval:main",
           "flashgpt-ablate": "ablate:main", "flashgpt-prepare": "data.prepare:main",
           "flashgpt-export": "model.export:main"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The project built as a wheel (no build isolation: setuptools from this environment) and unpacked into a
    folder of its own; returns (wheel path, that folder)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # from a copy of the sources: setuptools builds in the source folder and would pack a stale build/ of it
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", ".base", "build", "*.egg-info", "runs",
                                                             ".cache", "__pycache__", ".whl", "wandb"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("flashgpt-*.whl")
    target = tmp / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    return wheel, target


def test_wheel_declares_the_console_scripts(installed):
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        (entry,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = z.read(entry).decode()
    for name, target in SCRIPTS.items():
        assert f"{name} = {target}" in text, text


@pytest.mark.parametrize("module", ["train", "generate", "eval", "ablate", "data.prepare", "model.export"])
def test_entry_points_run_from_the_installed_copy(installed, module, tmp_path):
    """--help from an unrelated folder with only the installed copy on the path (the checkout is not): a module
    the wheel lacks fails the import; ablate also needs its default config, which travels as package data."""
    _, target = installed
    code = (f"import sys, runpy; sys.argv = ['{module}', '--help']\n"
            f"import {module.split('.')[0]} as m\n"
            f"assert m.__file__.startswith({str(target)!r}), m.__file__\n"
            f"runpy.run_module('{module}', run_name='__main__')\n")
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "usage:" in r.stdout
    if module == "ablate":
        assert (target / "ablation" / "ablate.toml").is_file()
