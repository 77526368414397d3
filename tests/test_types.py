"""The typed surface (the public API, the registry, the tensor) passes the type checker, and its
public functions are annotated."""

import inspect
import os

import pytest

import bridge
from bridge import activation
from bridge.runtime import registry, tensor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_type_checker_passes():
    api = pytest.importorskip("mypy.api")
    previous = os.getcwd()
    os.chdir(REPO)  # mypy reads [tool.mypy] of pyproject.toml, with its list of files
    try:
        report, errors, status = api.run([])
    finally:
        os.chdir(previous)
    assert status == 0, report + errors


@pytest.mark.parametrize("module", [bridge, activation, registry, tensor], ids=lambda module: module.__name__)
def test_public_functions_are_annotated(module):
    missing = []
    for name, function in vars(module).items():
        if name.startswith("_") or not inspect.isfunction(function) or function.__module__ != module.__name__:
            continue
        signature = inspect.signature(function)
        if signature.return_annotation is inspect.Signature.empty or any(
            parameter.annotation is inspect.Parameter.empty for parameter in signature.parameters.values()
        ):
            missing.append(name)
    assert not missing, f"{module.__name__}: annotate {missing}"
