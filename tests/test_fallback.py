"""The fallback ladder's last rung: an op with no mapping runs on the CPU, or fails under --strict."""

import warnings

import pytest
import torch

from conftest import run_python

# A custom operator nobody maps or decomposes: the bridge's tables can never cover it.
_CUSTOM_OP = '''
import torch

@torch.library.custom_op("bridgetest::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1

@mystery.register_fake
def _(x):
    return torch.empty_like(x)
'''


def _define_custom_op():
    if not hasattr(torch.ops.bridgetest, "mystery"):
        exec(compile(_CUSTOM_OP, "<custom op>", "exec"), {})
    return torch.ops.bridgetest.mystery


def test_unmapped_op_runs_on_cpu_and_warns_once(bridged):
    from bridge.runtime import stats

    mystery = _define_custom_op()
    x = torch.arange(3.0, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = mystery(x)
        second = mystery(x)
    assert first.device.type == "cuda"
    assert first.cpu().tolist() == [1.0, 3.0, 5.0]
    assert second.cpu().tolist() == [1.0, 3.0, 5.0]
    messages = [str(w.message) for w in caught if "bridgetest.mystery" in str(w.message)]
    assert len(messages) == 1, messages
    assert "host CPU" in messages[0]
    assert caught[0].filename == __file__  # attributed to the calling line, not to the bridge
    op = torch.ops.bridgetest.mystery.default
    assert stats.op_rung[op] == stats.CPU_FALLBACK


def test_strict_mode_names_op_and_line(bridged):
    from bridge.runtime.config import settings

    mystery = _define_custom_op()
    x = torch.arange(3.0, device="cuda")
    settings.strict = True
    try:
        with pytest.raises(bridged.UnsupportedOpError) as raised:
            mystery(x)  # the calling line
    finally:
        settings.strict = False
    message = str(raised.value)
    assert "bridgetest.mystery" in message
    assert f"{__file__}:" in message and "mystery(x)  # the calling line" in message
    assert "--strict" in message


SCRIPT = _CUSTOM_OP + '''
x = torch.ones(2, device="cuda")
y = mystery(x)
print(y.cpu().tolist())
'''


def test_runner_strict_fails_with_op_and_line(tmp_path):
    script = tmp_path / "uses_custom_op.py"
    script.write_text(SCRIPT)
    result = run_python("-m", "bridge", "run", "--strict", str(script))
    assert result.returncode == 1
    assert "UnsupportedOpError" in result.stderr
    assert "bridgetest.mystery" in result.stderr
    line = SCRIPT.splitlines().index("y = mystery(x)") + 1
    assert f"uses_custom_op.py:{line} in <module>: y = mystery(x)" in result.stderr


def test_runner_without_strict_falls_back_and_reports(tmp_path):
    script = tmp_path / "uses_custom_op.py"
    script.write_text(SCRIPT)
    result = run_python("-m", "bridge", "run", str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[3.0, 3.0]"
    assert result.stderr.count("CPUFallbackWarning") == 1
    assert "CPU fallback bridgetest.mystery.default ran 1 time(s)" in result.stderr


def test_derived_op_of_a_host_fallback_is_reported_as_one(bridged, monkeypatch):
    """An in-place op derived from a functional op that has no mapping runs on the host CPU:
    the report counts it there, with its calls, not as a mapping (it said 'calls: 0' and
    '0 cpu_fallback' for torch's fused AdamW before that had a mapping)."""
    from bridge.report import summary_text
    from bridge.runtime import dispatch, registry, stats

    aten = torch.ops.aten
    functional, inplace = aten.lerp.Scalar, aten.lerp_.Scalar
    saved = registry.MAPPINGS.pop(functional)
    decomposition = dispatch._decomposition
    monkeypatch.setattr(dispatch, "_decomposition", lambda op: None if op == functional else decomposition(op))
    for op in (functional, inplace):
        dispatch._plans.pop(op, None)
    stats.reset()
    try:
        x = torch.zeros(3, device="cuda")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x.lerp_(torch.ones(3, device="cuda"), 0.5)
            x.lerp_(torch.ones(3, device="cuda"), 0.5)
        assert x.cpu().tolist() == [0.75, 0.75, 0.75]
        summary = stats.summary()
        assert stats.op_rung[inplace] == stats.CPU_FALLBACK
        assert summary["by_rung"][stats.CPU_FALLBACK] == 2
        assert summary["cpu_fallbacks"] == [
            {"op": str(functional), "calls": 2, "first_call_site": summary["cpu_fallbacks"][0]["first_call_site"]}
        ]
        assert "CPU fallback aten.lerp.Scalar ran 2 time(s)" in summary_text()
    finally:
        registry.MAPPINGS[functional] = saved
        for op in (functional, inplace):
            dispatch._plans.pop(op, None)
            stats.op_rung.pop(op, None)
