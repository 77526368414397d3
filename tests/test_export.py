"""torch.export programs as one JAX function (runtime/export.py) and `bridge.load`: torch's results,
the buffers and inputs the graph writes, gradients through jax.grad, `.pt2` files, and PyTorch's
ExportDB."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

import bridge
from bridge.runtime import export

RTOL, ATOL = 1e-5, 1e-6


# torch.export can start Dynamo, which turns torch.distributions' argument validation off for the
# whole process (conftest.distribution_validation_kept restores it after each test).
pytestmark = pytest.mark.usefixtures("distribution_validation_kept")


class Net(torch.nn.Module):
    """A linear layer, BatchNorm (its running statistics are written in training mode) and a
    user input written in place."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, x, y):
        y.add_(1)
        return self.norm(self.linear(x)).relu() + y.sum()


def _exported(training=True):
    torch.manual_seed(0)
    net = Net().train(training)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    return net, torch.export.export(copy.deepcopy(net), (x, y.clone())), x, y


def _array(tensor):
    return jnp.asarray(tensor.detach().numpy())


def _close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), expected.detach().numpy(), rtol=RTOL, atol=ATOL)


def test_training_program_returns_what_it_writes():
    """BatchNorm's running statistics and the input the graph adds to come back (a translator
    that returns only the user outputs drops them)."""
    net, exported, x, y = _exported()
    with bridge.active():
        function, state = export.to_jax(exported)
        out, new_state, new_inputs = jax.jit(function)(state, _array(x), _array(y))
    y_torch = y.clone()
    _close(out, net(x, y_torch))
    for name in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
        _close(new_state[name], net.state_dict()[name])
    _close(new_inputs[1], y_torch)
    assert new_inputs[0] is None  # not written
    np.testing.assert_array_equal(np.asarray(new_state["linear.weight"]), np.asarray(state["linear.weight"]))


def test_gradients_through_jax_grad_are_torch_s():
    net, exported, x, y = _exported()
    with bridge.active():
        function, state = export.to_jax(exported)
        names = dict(exported.named_parameters())

        def loss(params):
            out, _, _ = function({**state, **params}, _array(x), _array(y))
            return out.sum()

        gradients = jax.grad(loss)({name: state[name] for name in names})
    net(x, y.clone()).sum().backward()
    # The linear layer's bias has no effect through training-mode BatchNorm: its true gradient is
    # 0, and both sides give rounding noise there. Tolerances as tests/test_hf_models.py's: atol
    # relative to the largest gradient.
    largest = max(parameter.grad.abs().max().item() for parameter in net.parameters())
    for name, parameter in net.named_parameters():
        np.testing.assert_allclose(np.asarray(gradients[name]), parameter.grad.numpy(), rtol=RTOL, atol=ATOL * largest)


def test_load_runs_a_pt2_file_and_keeps_its_state(tmp_path):
    """`bridge.load` of a saved program: torch tensors in, bridge tensors out, the running
    statistics carried from call to call and the written input written, as in torch."""
    net, exported, x, y = _exported()
    path = tmp_path / "net.pt2"
    torch.export.save(exported, path)
    with bridge.active():
        program = bridge.load(path)
        for _ in range(2):
            y_bridge, y_torch = y.clone(), y.clone()
            out = program(x.to("cuda"), y_bridge)
            expected = net(x, y_torch)
            assert isinstance(out, torch.Tensor) and out.device.type == "cuda"
            torch.testing.assert_close(out.cpu(), expected, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(y_bridge, y_torch)
        state = program.state_dict()
    torch.testing.assert_close(state["norm.running_mean"], net.norm.running_mean, rtol=RTOL, atol=ATOL)
    assert int(state["norm.num_batches_tracked"]) == 2


def test_a_program_made_on_the_host_runs_on_the_device():
    """A factory the graph recorded with the export's device (`ones(..., device="cpu")`) makes
    its tensor on the bridge device."""

    class Ones(torch.nn.Module):
        def forward(self, x):
            return x + torch.ones(x.shape[-1])

    x = torch.randn(2, 3)
    exported = torch.export.export(Ones(), (x,))
    with bridge.active():
        out = bridge.load(exported)(x)
    torch.testing.assert_close(out.cpu(), x + 1)


def test_files_it_cannot_read_say_so(tmp_path):
    # (.onnx files are read since the ONNX route: tests/test_onnx.py tests their errors)
    with bridge.active(), pytest.raises(NotImplementedError, match=r"model\.tflite.*this kind of file.*torch\.export\.save"):
        bridge.load(tmp_path / "model.tflite")


# ---------------------------------------------------------------- ExportDB

# Examples the translator cannot run yet, with the reason.
EXPORTDB_FAILURES = {}


def _exportdb():
    try:
        from torch._export.db.examples import all_examples
    except ImportError:  # not in every torch release
        return {}
    return dict(sorted(all_examples().items()))


@pytest.mark.parametrize("name", list(_exportdb()))
def test_exportdb_example(name):
    case = _exportdb()[name]
    args, kwargs = case.example_args, case.example_kwargs or {}
    try:
        exported = torch.export.export(case.model, args, kwargs, dynamic_shapes=case.dynamic_shapes, strict=False)
    except Exception as error:  # noqa: BLE001 - the examples include programs torch refuses
        pytest.skip(f"torch.export refuses the example ({type(error).__name__}), as ExportDB documents")
    expected = exported.module()(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    to_array = lambda value: _array(value) if isinstance(value, torch.Tensor) else value  # noqa: E731
    with bridge.active():
        function, state = export.to_jax(exported)
        if name in EXPORTDB_FAILURES:
            with pytest.raises(NotImplementedError):
                function(state, *pytree.tree_map(to_array, list(args)), **pytree.tree_map(to_array, dict(kwargs)))
            pytest.xfail(EXPORTDB_FAILURES[name])
        out, _, _ = function(state, *pytree.tree_map(to_array, list(args)), **pytree.tree_map(to_array, dict(kwargs)))
    actual, wanted = pytree.tree_leaves(out), pytree.tree_leaves(expected)
    assert len(actual) == len(wanted)
    for got, want in zip(actual, wanted):
        if isinstance(want, torch.Tensor):
            _close(got, want)
        else:
            assert got == want


def test_torch_cond_on_data_runs_as_one_program():
    """A branch on data (`torch.cond`) becomes jax.lax.cond: the jitted function takes either
    branch as torch does, from one program."""

    class Branch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)

        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda t: self.linear(t).relu(), lambda t: t.cos() - 1, (x,))

    torch.manual_seed(0)
    module, x = Branch(), torch.randn(4, 3)
    exported = torch.export.export(module, (x,))
    with bridge.active():
        function, state = export.to_jax(exported)
        compiled = jax.jit(function)
        for sample in (x.abs(), -x.abs()):
            out, _, _ = compiled(state, _array(sample))
            _close(out, module(sample))
        # and in a script under the bridge (torch.cond compiles its branches: one region)
        with torch.no_grad():
            bridged = copy.deepcopy(module).to("cuda")
            for sample in (x.abs(), -x.abs()):
                torch.testing.assert_close(bridged(sample.to("cuda")).cpu(), module(sample), rtol=RTOL, atol=ATOL)


def test_check_lists_a_saved_graph_s_ops_by_rung(tmp_path, capsys):
    """`bridge check FILE` reads a .pt2 and says how each op would run, without running it."""
    from bridge.cli import main

    _, exported, _, _ = _exported()
    path = tmp_path / "net.pt2"
    torch.export.save(exported, path)
    with bridge.active():
        code = main(["check", str(path)])
        printed = capsys.readouterr().out
        assert code == 0, printed
        assert "mapped:" in printed and "aten.relu.default" in printed
        assert "decomposed:" in printed and "aten.linear.default" in printed
        assert main(["check", str(tmp_path / "model.onnx")]) == 2


def test_moduleinfo_modules_through_export():
    """compat/exported.py's sweep on a few ModuleInfo modules (the whole sweep writes
    compat/reports/exported.md): torch's outputs and written buffers, in both modes."""
    from bridge.compat import exported

    results = exported.sweep(["nn.Linear", "nn.BatchNorm2d", "nn.LSTM", "nn.MultiheadAttention", "nn.Embedding"])
    assert {name for name, *_ in results} == {"nn.Linear", "nn.BatchNorm2d", "nn.LSTM", "nn.MultiheadAttention", "nn.Embedding"}
    failed = [result for result in results if result[2] != exported.PASSED]
    assert not failed, failed
