"""`bridge convert` (bridge/convert.py): the written module runs where torch is not importable and
gives torch's outputs, for a vision-and-text model, an LSTM with attention, torch.cond and a
TorchScript archive; --to stablehlo's round trip through jax.export; bad files."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch

import bridge
from bridge import convert as convert_module
from bridge.cli import main

from test_interop import ConvNet

RTOL, ATOL = 1e-5, 1e-5


# torch.export can start Dynamo, which turns torch.distributions' argument validation off for the
# whole process (conftest.distribution_validation_kept restores it after each test).
pytestmark = pytest.mark.usefixtures("distribution_validation_kept")


class Sequence(torch.nn.Module):
    """An LSTM (a scan), attention, GroupNorm, a cumulative sum, argmax and sort."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(4, 5, batch_first=True)
        self.attention = torch.nn.MultiheadAttention(5, 1, batch_first=True)
        self.norm = torch.nn.GroupNorm(1, 5)

    def forward(self, x):
        hidden, _ = self.lstm(x)
        attended, _ = self.attention(hidden, hidden, hidden)
        return self.norm(attended.transpose(1, 2)).cumsum(-1), attended.argmax(-1), torch.sort(attended, -1).values


class Branch(torch.nn.Module):
    """A branch on data: torch.cond, written as lax.switch."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: self.linear(t).relu(), lambda t: t.cos() - 1, (x,))


# Runs in a child process where `import torch` (and the bridge) fails: each converted module's
# forward, called directly and under jax.jit, on the inputs saved beside it.
_RUNNER = """
import json, sys
sys.modules["torch"] = None
sys.modules["bridge"] = None
directory, names = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, directory)
import importlib
import jax
import numpy as np
results = {}
for name in names:
    module = importlib.import_module(name)
    params = module.load_params()
    with np.load(f"{directory}/{name}_inputs.npz") as archive:
        inputs = [archive[f"arr_{i}"] for i in range(len(archive.files))]
    direct = jax.tree_util.tree_leaves(module.forward(params, *inputs))
    jitted = jax.tree_util.tree_leaves(jax.jit(module.forward)(params, *inputs))
    for number, (value, again) in enumerate(zip(direct, jitted)):
        results[f"{name}.{number}"] = np.asarray(value)
        results[f"{name}.{number}.jit"] = np.asarray(again)
np.savez(f"{directory}/results.npz", **results)
"""


def _run_without_torch(directory, names):
    completed = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(directory), json.dumps(names)], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return dict(np.load(directory / "results.npz"))


def _save_inputs(directory, name, inputs):
    np.savez(directory / f"{name}_inputs.npz", *[tensor.numpy() for tensor in inputs])


def _expect(results, name, expected):
    leaves = jax.tree_util.tree_leaves(expected, is_leaf=lambda value: isinstance(value, torch.Tensor))
    assert len([key for key in results if key.startswith(f"{name}.") and not key.endswith(".jit")]) == len(leaves)
    for number, tensor in enumerate(leaves):
        for key in (f"{name}.{number}", f"{name}.{number}.jit"):
            np.testing.assert_allclose(results[key], tensor.detach().numpy(), rtol=RTOL, atol=ATOL, err_msg=key)


def test_converted_modules_run_without_torch(tmp_path, monkeypatch):
    """Three programs converted (one through the command line, the others with numpy's .npz for
    their parameters), then run in a process where torch cannot be imported."""
    torch.manual_seed(0)
    net, x, ids = ConvNet().eval(), torch.randn(2, 3, 8, 8), torch.tensor([1, 5])
    torch.export.save(torch.export.export(net, (x, ids), strict=False), tmp_path / "net.pt2")
    assert main(["convert", str(tmp_path / "net.pt2"), "-o", str(tmp_path / "net_jax.py")]) == 0
    _save_inputs(tmp_path, "net_jax", [x, ids])

    monkeypatch.setattr(convert_module, "params_suffix", lambda: ".npz")
    sequence, sequence_input = Sequence().eval(), torch.randn(2, 6, 4)
    branch, positive, negative = Branch(), torch.randn(4, 3).abs(), -torch.randn(4, 3).abs()
    exported = {
        "sequence": torch.export.export(sequence, (sequence_input,), strict=False),
        "branch": torch.export.export(branch, (positive,), strict=False),
    }
    for name, program in exported.items():
        assert convert_module.convert(program, str(tmp_path / f"{name}_jax.py")) == [
            str(tmp_path / f"{name}_jax.py"), str(tmp_path / f"{name}_jax.npz")
        ]
    _save_inputs(tmp_path, "sequence_jax", [sequence_input])
    _save_inputs(tmp_path, "branch_jax", [negative])  # the other branch than the example's

    results = _run_without_torch(tmp_path, ["net_jax", "sequence_jax", "branch_jax"])
    _expect(results, "net_jax", net(x, ids))
    _expect(results, "sequence_jax", sequence(sequence_input))
    _expect(results, "branch_jax", branch(negative))

    source = (tmp_path / "net_jax.py").read_text()
    imports = {line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"importlib", "json", "os", "jax", "jax.numpy", "numpy"}, imports
    # names from the graph's nodes, and a comment with each node's ATen call
    assert "    conv2d = " in source and "# linear: aten.linear.default(flatten, p_linear_weight, p_linear_bias)" in source
    assert "def forward(params, x, ids):" in source and "lax.scan(" in (tmp_path / "sequence_jax.py").read_text()
    assert "lax.switch(" in (tmp_path / "branch_jax.py").read_text()
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".partial")]


def test_a_torchscript_archive_converts_with_given_shapes(tmp_path):
    """A program that does not record its inputs' shapes (TorchScript) converts with --input."""
    torch.manual_seed(0)

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x):
            return torch.sigmoid(self.linear(x)) * 2

    module, x = Small(), torch.randn(5, 4)
    torch.jit.save(torch.jit.trace(module, (x,)), str(tmp_path / "small.pt"))
    target = str(tmp_path / "small_jax.py")
    assert main(["convert", str(tmp_path / "small.pt"), "-o", target]) == 1  # no shapes: says to give them
    assert not os.path.exists(target)
    assert main(["convert", str(tmp_path / "small.pt"), "-o", target, "--input", "5x4:float32"]) == 0
    _save_inputs(tmp_path, "small_jax", [x])
    _expect(_run_without_torch(tmp_path, ["small_jax"]), "small_jax", module(x))


# jax.export's serialization needs the flatbuffers package, which JAX does not install itself.
STABLEHLO_NEEDS = "flatbuffers"


def test_stablehlo_round_trip(tmp_path):
    pytest.importorskip(STABLEHLO_NEEDS, reason="--to stablehlo needs flatbuffers (jax.export's serialization format)")
    torch.manual_seed(0)
    net, x, ids = ConvNet().eval(), torch.randn(2, 3, 8, 8), torch.tensor([1, 5])
    torch.export.save(torch.export.export(net, (x, ids), strict=False), tmp_path / "net.pt2")
    assert main(["convert", str(tmp_path / "net.pt2"), "--to", "stablehlo"]) == 0
    exported = jax.export.deserialize(bytearray((tmp_path / "net.stablehlo").read_bytes()))
    params_file = next(name for name in os.listdir(tmp_path) if name.startswith("net.") and name.endswith((".safetensors", ".npz")))
    sys.path.insert(0, str(tmp_path))
    with bridge.active():  # (x64 on, as the artifact's int64 inputs need)
        params = _read_params(tmp_path / params_file)
        out = exported.call(params, x.numpy(), ids.numpy())
    expected = net(x, ids)
    for name in expected:
        np.testing.assert_allclose(np.asarray(out[name]), expected[name].detach().numpy(), rtol=RTOL, atol=ATOL)


def test_stablehlo_keeps_a_dynamic_batch_symbolic(tmp_path):
    """A program exported with a dynamic batch (torch.export.Dim) writes an artifact whose batch
    is a symbolic dimension: one file runs at several batch sizes."""
    pytest.importorskip(STABLEHLO_NEEDS, reason="--to stablehlo needs flatbuffers (jax.export's serialization format)")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    batch = torch.export.Dim("batch", min=2, max=512)
    torch.export.save(torch.export.export(net, (torch.randn(3, 4),), dynamic_shapes=({0: batch},)), tmp_path / "net.pt2")
    assert main(["convert", str(tmp_path / "net.pt2"), "--to", "stablehlo"]) == 0
    exported = jax.export.deserialize(bytearray((tmp_path / "net.stablehlo").read_bytes()))
    assert not isinstance(exported.in_avals[-1].shape[0], int) and exported.out_avals[0].shape[1] == 2
    params_file = next(name for name in os.listdir(tmp_path) if name.startswith("net.") and name.endswith((".safetensors", ".npz")))
    params = _read_params(tmp_path / params_file)
    for size in (2, 9):
        x = torch.randn(size, 4)
        np.testing.assert_allclose(np.asarray(exported.call(params, x.numpy())), net(x).detach().numpy(), rtol=RTOL, atol=ATOL)


def _read_params(path):
    if str(path).endswith(".npz"):
        with np.load(path) as archive:
            return {name: archive[name] for name in archive.files}
    from safetensors.numpy import load_file

    return load_file(str(path))


def test_bad_files_give_one_clear_error_and_leave_nothing(tmp_path, capsys):
    torch.manual_seed(0)
    net, x, ids = ConvNet().eval(), torch.randn(2, 3, 8, 8), torch.tensor([1, 5])
    torch.export.save(torch.export.export(net, (x, ids), strict=False), tmp_path / "net.pt2")
    (tmp_path / "broken.pt2").write_bytes((tmp_path / "net.pt2").read_bytes()[:300])
    capsys.readouterr()
    cases = {
        "broken.pt2": r"broken\.pt2 could not be read as a saved program.*save it again",
        "missing.pt2": r"no such file: .*missing\.pt2",
        "model.onnx": r"model\.onnx",
    }
    (tmp_path / "model.onnx").write_bytes(b"not a model")
    for name, message in cases.items():
        before = set(os.listdir(tmp_path))
        assert main(["convert", str(tmp_path / name), "-o", str(tmp_path / "out_jax.py")]) == 2
        error = capsys.readouterr().err
        assert len(error.strip().splitlines()) == 1, error
        assert __import__("re").search(message, error), error
        assert set(os.listdir(tmp_path)) == before  # no output, no temporary left behind
