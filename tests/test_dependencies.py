"""Dependency floors that keep unsafe behaviour out: each floor is checked against pyproject.toml."""
import os
import tomllib

from packaging.requirements import Requirement

from tests.util import ROOT


def requirement(name: str) -> Requirement:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    return next(r for r in reqs if r.name == name)


def test_datasets_floor_excludes_hub_loading_scripts():
    """datasets < 2.20 runs a hub dataset's Python loading script unasked (trust_remote_code defaulted to True)."""
    spec = requirement("datasets").specifier
    assert not spec.contains("2.19.2") and not spec.contains("2.0.0")
    assert spec.contains("2.20.0")
