"""Activation contract: idempotent activate/deactivate, nesting, and exact restoration of torch."""

import importlib
import types

import torch

import bridge

_SURFACES = [
    torch,
    torch.Tensor,
    torch.cuda,
    torch.random,
    torch.nn.Module,
    importlib.import_module("torch.utils._foreach_utils"),
    importlib.import_module("torch.optim.optimizer"),
    importlib.import_module("torch.nn.utils.clip_grad"),
    importlib.import_module("torch.optim.swa_utils"),
    importlib.import_module("torch.utils._device"),
]


def _snapshot():
    return [dict(vars(owner)) for owner in _SURFACES]


def _assert_same(before, after):
    for owner, old, new in zip(_SURFACES, before, after):
        removed = old.keys() - new.keys()
        # Submodules imported lazily by torch itself (torch._dynamo, ...) are not patches.
        added = {name for name in new.keys() - old.keys() if not isinstance(new[name], types.ModuleType)}
        assert not removed and not added, f"{owner}: attributes added {added} or removed {removed}"
        changed = [name for name in old if old[name] is not new[name]]
        assert not changed, f"{owner}: attributes not restored: {changed}"


def test_deactivate_restores_every_patched_attribute_exactly():
    assert not bridge.is_active()
    before = _snapshot()
    bridge.activate()
    during = _snapshot()
    assert torch.cuda.is_available()
    assert any(old is not new for old, new in zip(before[0].values(), during[0].values()))
    bridge.deactivate()
    _assert_same(before, _snapshot())


def test_activate_twice_is_idempotent():
    before = _snapshot()
    bridge.activate()
    first = _snapshot()
    bridge.activate()
    _assert_same(first, _snapshot())
    bridge.deactivate()
    bridge.deactivate()  # a second deactivate is a no-op
    _assert_same(before, _snapshot())


def test_nested_active_blocks():
    before = _snapshot()
    with bridge.active():
        assert bridge.is_active()
        with bridge.active():
            x = torch.ones(2, device="cuda")
            assert x.device.type == "cuda"
        assert bridge.is_active(), "leaving the inner block must not deactivate the outer one"
        assert (x + 1).tolist() == [2.0, 2.0]
    assert not bridge.is_active()
    _assert_same(before, _snapshot())


def test_tensors_made_while_active_stay_usable_after_deactivation():
    with bridge.active():
        x = torch.arange(4.0, device="cuda")
    assert x.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_import_bridge_auto_before_torch(tmp_path):
    from conftest import run_python

    script = tmp_path / "auto_first.py"
    script.write_text(
        "import bridge.auto\nimport torch\n"
        "x = torch.ones(3, device='cuda') * 2\n"
        "print(torch.cuda.is_available(), x.device, x.sum().item())\n"
    )
    result = run_python(str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True cuda:0 6.0"
    assert "torch ops ran" in result.stderr  # the exit summary


def test_import_bridge_auto_after_torch(tmp_path):
    from conftest import run_python

    script = tmp_path / "auto_after.py"
    script.write_text(
        "import torch\nimport bridge.auto\n"
        "x = torch.ones(3, device='cuda') * 2\n"
        "print(torch.cuda.is_available(), x.device, x.sum().item())\n"
    )
    result = run_python(str(script), env={"BRIDGE_QUIET": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True cuda:0 6.0"
    assert "torch ops ran" not in result.stderr
