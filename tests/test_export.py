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


@pytest.mark.parametrize("decomposed", [False, True], ids=["as exported", "decomposed"])
def test_training_program_returns_what_it_writes(decomposed):
    """BatchNorm's running statistics and the input the graph adds to come back (a translator
    that returns only the user outputs drops them), also from a decomposed (functional) program,
    which returns them as outputs of their own."""
    net, exported, x, y = _exported()
    if decomposed:
        exported = exported.run_decompositions()
        assert {spec.kind.name for spec in exported.graph_signature.output_specs} >= {"BUFFER_MUTATION",
                                                                                      "USER_INPUT_MUTATION"}
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


# ---------------------------------------------------------------- dynamic dimensions


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))

    def forward(self, x):
        return self.layers(x).softmax(-1)


class AttentionBlock(torch.nn.Module):
    """A pre-norm transformer block: positions from arange(seq), a causal mask made in the graph,
    heads split by view(b, s, h, d), and the MLP over a view(b * s, d)."""

    def __init__(self, width=16, heads=4):
        super().__init__()
        self.heads = heads
        self.positions = torch.nn.Embedding(32, width)
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))

    def forward(self, x):
        batch, length, width = x.shape
        x = x + self.positions(torch.arange(length))
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x).view(batch * length, width)).view(batch, length, width)


class ConvNet(torch.nn.Module):
    """Convolutions, BatchNorm (its running statistics written in training mode), pooling."""

    def __init__(self):
        super().__init__()
        self.conv1, self.norm = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.conv2, self.head = torch.nn.Conv2d(8, 16, 3, stride=2), torch.nn.Linear(16, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(self.norm(self.conv1(x)).relu(), 2)
        return self.head(torch.nn.functional.adaptive_avg_pool2d(self.conv2(x).relu(), 1).flatten(1))


# model, its example input, its dynamic dimensions, the input shapes it is run at
DYNAMIC_MODELS = {
    "mlp": (Mlp, (5, 4), {0: torch.export.Dim("batch", max=1024)}, [(2, 4), (7, 4), (64, 4)]),
    "attention": (
        AttentionBlock,
        (3, 5, 16),
        {0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("seq", max=32)},
        [(2, 7, 16), (4, 3, 16), (6, 32, 16)],
    ),
    "conv": (ConvNet, (3, 3, 16, 16), {0: torch.export.Dim("batch", max=64)}, [(2, 3, 16, 16), (5, 3, 16, 16), (9, 3, 16, 16)]),
}


def _dynamic(name, training=False):
    model_class, example, dimensions, sizes = DYNAMIC_MODELS[name]
    torch.manual_seed(0)
    model = model_class().train(training)
    exported = torch.export.export(copy.deepcopy(model), (torch.randn(example),), dynamic_shapes=(dimensions,))
    return model, exported, sizes


def _export_symbolically(function, state, exported):
    state_types = {name: jax.ShapeDtypeStruct(value.shape, value.dtype) for name, value in state.items()}
    return jax.export.export(jax.jit(function))(state_types, *export.symbolic_input_types(exported))


@pytest.mark.parametrize("name", list(DYNAMIC_MODELS))
def test_dynamic_dimensions_are_traced_once_for_every_size(name):
    """A program exported with dynamic dimensions traces once under jax.export's shape
    polymorphism and runs at several sizes with torch's results (training mode for the conv net:
    BatchNorm's running statistics over a symbolic batch)."""
    training = name == "conv"
    model, exported, sizes = _dynamic(name, training)
    with bridge.active():
        function, state = export.to_jax(exported)
        traced = _export_symbolically(function, state, exported)
    symbolic_input = traced.in_avals[-1].shape
    assert [isinstance(size, int) for size in symbolic_input] == [axis not in DYNAMIC_MODELS[name][2] for axis in range(len(symbolic_input))]
    for shape in sizes:
        x = torch.randn(shape)
        reference = copy.deepcopy(model)
        out, new_state, _ = traced.call(state, _array(x))
        _close(out, reference(x))
        for buffer, value in reference.named_buffers():
            _close(new_state[buffer], value)


def test_symbolic_program_survives_serialization():
    """jax.export's round trip (serialize, deserialize) of the symbolic program, run at two
    batch sizes; the bounds of the dynamic dimension are kept (a batch past them is refused)."""
    pytest.importorskip("flatbuffers", reason="jax.export's serialization needs flatbuffers")
    model, exported, _ = _dynamic("attention")
    with bridge.active():
        function, state = export.to_jax(exported)
        traced = _export_symbolically(lambda state, x: function(state, x)[0], state, exported)
    loaded = jax.export.deserialize(traced.serialize())
    for shape in [(2, 9, 16), (5, 4, 16)]:
        x = torch.randn(shape)
        _close(loaded.call(state, _array(x)), model(x))
    with pytest.raises(ValueError):  # (XLA refines the shapes and finds the bound broken)
        loaded.call(state, _array(torch.randn(2, 33, 16)))


def test_a_dynamic_program_still_runs_at_concrete_shapes():
    """The same function under jax.jit with concrete shapes (each shape traced on its own)."""
    model, exported, sizes = _dynamic("attention")
    with bridge.active():
        function, state = export.to_jax(exported)
        compiled = jax.jit(function)
        for shape in sizes:
            x = torch.randn(shape)
            _close(compiled(state, _array(x))[0], model(x))


def test_load_runs_a_dynamic_pt2_at_several_batch_sizes(tmp_path):
    model, exported, sizes = _dynamic("mlp")
    torch.export.save(exported, tmp_path / "mlp.pt2")
    with bridge.active():
        program = bridge.load(tmp_path / "mlp.pt2")
        for shape in sizes:
            x = torch.randn(shape)
            torch.testing.assert_close(program(x).cpu(), model(x), rtol=RTOL, atol=ATOL)


class Pool(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.max_pool2d(x, 2)


def test_an_op_that_needs_a_dynamic_size_as_a_number_says_which():
    """max_pool2d's entry numbers the elements of its input's plane (torch's indices): with
    symbolic spatial dimensions that is one clear error, naming the node, its op and the
    dimension, before anything runs."""
    exported = torch.export.export(Pool(), (torch.randn(2, 3, 8, 8),), dynamic_shapes=({2: torch.export.Dim("height", min=4, max=64)},))
    with bridge.active():
        function, state = export.to_jax(exported)
        (height,) = {str(size) for size in export.symbolic_input_types(exported)[0].shape if not isinstance(size, int)}
        with pytest.raises(bridge.SymbolicShapeError, match=rf"node max_pool2d \(aten\.max_pool2d\.default\).*{height}"):
            _export_symbolically(function, state, exported)


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


def _dynamic_exportdb():
    return {name: case for name, case in _exportdb().items() if case.dynamic_shapes or "torch.dynamic-shape" in case.tags}


def _grown(value, axes):
    """A tensor like `value`, one larger along `axes`."""
    shape = [size + 1 if axis in axes else size for axis, size in enumerate(value.shape)]
    return torch.randn(shape).to(value.dtype) if value.is_floating_point() else torch.randint(0, 3, shape).to(value.dtype)


@pytest.mark.parametrize("name", list(_dynamic_exportdb()))
def test_exportdb_dynamic_example_runs_symbolically(name):
    """The ExportDB examples about dynamic shapes, exported with their own dynamic_shapes (else
    every dimension Dim.AUTO, torch.export's choice of which stay dynamic), translated once under
    jax.export's shape polymorphism and run at the example's sizes and, where the program
    accepts them, at sizes one larger in every dynamic dimension."""
    case = _dynamic_exportdb()[name]
    args, kwargs = case.example_args, case.example_kwargs or {}
    dimensions = case.dynamic_shapes
    if dimensions is None:
        auto = lambda value: {axis: torch.export.Dim.AUTO for axis in range(value.dim())} if isinstance(value, torch.Tensor) else None  # noqa: E731
        dimensions = tuple(auto(value) for value in args) if not kwargs else pytree.tree_map(auto, (tuple(args), dict(kwargs)))
    try:
        exported = torch.export.export(case.model, args, kwargs, dynamic_shapes=dimensions, strict=False)
    except Exception as error:  # noqa: BLE001 - the examples include programs torch refuses
        pytest.skip(f"torch.export refuses the example ({type(error).__name__}), as ExportDB documents")
    flat_inputs = pytree.tree_leaves((tuple(args), dict(kwargs)))
    with bridge.active():
        function, state = export.to_jax(exported)
        types = export.symbolic_input_types(exported)

        def flat_function(state, *flat):
            call_args, call_kwargs = pytree.tree_unflatten(list(flat), exported.call_spec.in_spec)
            return function(state, *call_args, **call_kwargs)[0]

        traced = jax.export.export(jax.jit(flat_function))({key: jax.ShapeDtypeStruct(v.shape, v.dtype) for key, v in state.items()}, *types)
    dynamic_axes = [{axis for axis, size in enumerate(kind.shape) if not isinstance(size, int)} for kind in types]
    assert any(dynamic_axes), "torch.export kept no dimension dynamic"
    samples = [flat_inputs, [_grown(value, axes) for value, axes in zip(flat_inputs, dynamic_axes)]]
    for number, flat in enumerate(samples):
        call_args, call_kwargs = pytree.tree_unflatten(list(flat), exported.call_spec.in_spec)
        try:
            expected = exported.module()(*copy.deepcopy(call_args), **copy.deepcopy(call_kwargs))
        except Exception:  # noqa: BLE001 - the larger sizes break one of the program's own constraints
            assert number, "the program refuses its own example"
            continue
        out = traced.call(state, *[_array(value) for value in flat])
        actual, wanted = pytree.tree_leaves(out), pytree.tree_leaves(expected)
        assert len(actual) == len(wanted)
        for got, want in zip(actual, wanted):
            if isinstance(want, torch.Tensor):
                _close(got, want)
            else:  # a size the program returns: a 0-dim array of the trace
                assert int(got) == int(want)


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

    results = exported.sweep(["nn.Linear", "nn.BatchNorm2d", "nn.LSTM", "nn.MultiheadAttention", "nn.Embedding"])["moduleinfo"]
    assert {name for name, *_ in results} == {"nn.Linear", "nn.BatchNorm2d", "nn.LSTM", "nn.MultiheadAttention", "nn.Embedding"}
    failed = [result for result in results if result[2] != exported.PASSED]
    assert not failed, failed


def test_corpus_models_through_export():
    """compat/exported.py's corpus section on two scripts: each model the script calls, at its
    first call, gives torch's outputs and (trained) torch's gradients through jax.grad; the
    custom autograd.Function's gradient is the listed expected failure."""
    from bridge.compat import exported

    rows = exported.check_script("gan") + exported.check_script("custom_function")
    assert [(script, model) for script, model, *_ in rows] == [("gan", "Sequential #1"), ("gan", "Sequential #2"), ("custom_function", "QuantisedMLP")]
    assert [status for _, _, _, status, *_ in rows] == [exported.PASSED, exported.PASSED, exported.EXPECTED_FAILURE], rows
    assert all(detail.startswith("gradients of") for *_, detail, _ in rows[:2])
