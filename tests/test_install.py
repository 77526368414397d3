"""Installation and versions: one import name, supported releases, `bridge doctor`."""

import os
import subprocess
import sys
import types
import warnings

import pytest
import torch

from conftest import REPO, run_python

USER_MODULES = {
    name: f'MARK = "the user\'s own {name}"\n' for name in ("runtime", "compat", "op_mappings")
}

SCRIPT = """
import runtime, compat, op_mappings
import torch
for module in (runtime, compat, op_mappings):
    print(module.__name__, module.MARK, module.__file__.startswith(__file__.rsplit('/', 1)[0]))
x = torch.ones(2, 3, device="cuda")
print("sum", (x * 2).sum().item(), x.device)
"""


def _user_project(tmp_path, header=""):
    for name, text in USER_MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
    script = tmp_path / "train.py"
    script.write_text(header + SCRIPT)
    return str(script)


def _check_user_modules(result):
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in ("runtime", "compat", "op_mappings"):
        assert f"{name} the user's own {name} True" in lines
    assert "sum 12.0 cuda:0" in lines


def test_script_beside_its_own_runtime_compat_op_mappings_under_the_runner(tmp_path):
    script = _user_project(tmp_path)
    # Started from the script's folder, where `python -m` puts the user's modules first on sys.path.
    _check_user_modules(run_python("-m", "bridge", "run", "--quiet", script, cwd=str(tmp_path)))


def test_script_beside_its_own_runtime_compat_op_mappings_with_bridge_auto(tmp_path):
    script = _user_project(tmp_path, header="import bridge.auto\n")
    _check_user_modules(run_python(script, cwd=str(tmp_path), env={"BRIDGE_QUIET": "1"}))


def test_the_layers_import_only_under_bridge():
    import bridge.compat
    import bridge.op_mappings
    import bridge.runtime

    for module in (bridge.runtime, bridge.op_mappings, bridge.compat):
        assert module.__name__.startswith("bridge.")
    assert not {"runtime", "op_mappings", "compat"} & set(sys.modules)


def test_a_folder_named_bridge_shadowing_the_package_is_explained(monkeypatch):
    from bridge import _layers

    shadow = types.ModuleType("bridge")
    shadow.__path__ = ["/somewhere/bridge"]  # a namespace package: no __file__, no activate
    monkeypatch.setitem(sys.modules, "bridge", shadow)
    with pytest.raises(SystemExit) as stopped:
        _layers.check_not_shadowed("python -m bridge")
    message = str(stopped.value)
    assert "/somewhere/bridge" in message and "__init__.py" in message and "bridge run" in message


def test_python_m_bridge_beside_a_folder_named_bridge(tmp_path):
    """The clone's parent: `python -m bridge` there either runs (the installed package wins) or
    says what happened; it never fails with an AttributeError."""
    (tmp_path / "bridge" / "bridge").mkdir(parents=True)  # a checkout named bridge, no __init__.py
    (tmp_path / "script.py").write_text("print('ran')\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    found = subprocess.run(
        [sys.executable, "-c", "import bridge; print(getattr(bridge, '__file__', None))"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )
    if "No module named" in found.stderr:
        pytest.skip("the bridge is not installed in this environment (it runs from PYTHONPATH)")
    result = subprocess.run(
        [sys.executable, "-m", "bridge", "run", "--quiet", "script.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert "AttributeError" not in result.stderr
    if found.stdout.strip() == "None":  # the folder shadows the installed package
        assert result.returncode != 0
        assert "shadows the installed package" in result.stderr
        assert str(tmp_path / "bridge") in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "ran"


def test_activation_refuses_an_unsupported_torch(monkeypatch):
    import bridge
    from bridge.runtime import versions

    assert not bridge.is_active()
    monkeypatch.setattr(versions, "TORCH", (2, 10))
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    monkeypatch.delenv("BRIDGE_ALLOW_UNSUPPORTED", raising=False)
    with pytest.raises(bridge.UnsupportedVersionError) as refused:
        bridge.activate()
    assert "torch 2.10.0 (the bridge supports torch 2.11 to 2.15)" in str(refused.value)
    assert "BRIDGE_ALLOW_UNSUPPORTED=1" in str(refused.value)
    assert not bridge.is_active()


def test_allow_unsupported_warns_and_goes_on(monkeypatch):
    import bridge
    from bridge.runtime import versions

    monkeypatch.setattr(versions, "JAX", (0, 13))
    monkeypatch.setattr(versions.jax, "__version__", "0.13.0")
    monkeypatch.setenv("BRIDGE_ALLOW_UNSUPPORTED", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bridge.activate()
    try:
        assert bridge.is_active()
        assert any("jax 0.13.0 (the bridge supports jax 0.10 to 0.12)" in str(w.message) for w in caught)
    finally:
        bridge.deactivate()


def test_installed_versions_are_supported():
    from bridge.runtime import versions

    assert versions.unsupported() == []


def test_ops_the_installed_torch_lacks_are_listed_version_differences():
    """A table naming an op the installed torch does not have is a typo unless runtime/versions.py
    lists the op as added in a later release or removed in this one."""
    import bridge.op_mappings  # noqa: F401
    import bridge.patches.capture  # noqa: F401
    from bridge.runtime import registry, versions

    typos = sorted(name for name in registry.MISSING_OPS if not versions.expected_missing(name))
    assert typos == []


def test_release_parsing():
    from bridge.runtime.versions import release

    assert release("2.14.1+cu130") == (2, 14)
    assert release("0.12.0.1") == (0, 12)
    assert release("2.16.0.dev20261101") == (2, 16)


def test_doctor_prints_versions_backend_and_cache(tmp_path):
    result = run_python("-m", "bridge", "doctor", env={"BRIDGE_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"torch        {torch.__version__.split('+')[0]}" in result.stdout
    assert "JAX backend  cpu" in result.stdout
    assert f"{tmp_path / 'cache'}: writable" in result.stdout
    assert "Everything the bridge needs is in place." in result.stdout


def test_doctor_says_when_the_cache_is_not_writable(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    result = run_python("-m", "bridge", "doctor", env={"BRIDGE_CACHE_DIR": str(blocked / "cache")})
    assert result.returncode == 1
    assert "not writable" in result.stdout and "BRIDGE_CACHE_DIR" in result.stdout
