"""Semantics the issue of the core bridge needs beyond single ops: views and in-place writes,
devices, sync points, seeding. Eager torch on the CPU is the oracle."""

import copy

import jax
import pytest
import torch
import torch.nn as nn

from bridge.runtime import BridgeTensor


def _pair(tensor):
    return tensor.clone(), tensor.to("cuda")


def _same(cpu, bridged, **tolerance):
    assert isinstance(bridged, BridgeTensor)
    torch.testing.assert_close(bridged.cpu(), cpu, **tolerance)


# ------------------------------------------------------------ views and in-place


def test_inplace_through_select_updates_base(bridged):
    cpu, gpu = _pair(torch.arange(12.0).reshape(3, 4))
    for x in (cpu, gpu):
        x[:, 0] += 1
        x[1] = 7.0
    _same(cpu, gpu)


def test_writes_into_blocks_and_strided_views_of_a_flat_buffer(bridged):
    """As FSDP writes its all-gather and reduce-scatter buffers: a block at an offset
    (as_strided, narrow, a split's piece), a transposed block and a stepped slice; each lands
    where torch puts it."""
    cpu, gpu = _pair(torch.zeros(60))
    for flat in (cpu, gpu):
        torch.as_strided(flat, (2, 3), (3, 1), 4).copy_(torch.arange(6.0).reshape(2, 3).to(flat.device))
        flat.narrow(0, 12, 6).view(3, 2).t().mul_(0).add_(torch.arange(6.0).reshape(2, 3).to(flat.device) + 10)
        flat.view(6, 10)[2:4, ::3].fill_(-1.0)
        torch.split(flat[40:], [7, 13])[1].copy_(torch.arange(13.0).to(flat.device))
    _same(cpu, gpu)


def test_storage_freed_and_given_back_as_fsdp_does(bridged):
    """FSDP frees each block's gathered parameters with `untyped_storage().resize_(0)` and gives
    the memory back before the next all-gather writes through a view: the data goes, the size
    reads 0, and the written values come back."""
    from bridge.runtime.tensor import root_of

    x = torch.arange(6.0).cuda()
    view = x.view(2, 3)
    x.untyped_storage().resize_(0)
    assert x.untyped_storage().size() == 0 and root_of(x)._value.size == 0
    x.untyped_storage().resize_(6 * x.element_size())
    view.copy_(torch.ones(2, 3))
    assert x.untyped_storage().size() == 24 and x.cpu().tolist() == [1.0] * 6
    with pytest.raises(NotImplementedError, match="only to 0"):
        x.untyped_storage().resize_(8)


def test_inplace_through_chain_of_views(bridged):
    cpu, gpu = _pair(torch.arange(24.0).reshape(2, 3, 4))
    for x in (cpu, gpu):
        view = x.transpose(0, 2)[1]  # a view of a view
        view.mul_(10)
        x.view(-1)[5] = -1.0
        x.t_() if x.dim() == 2 else None
    _same(cpu, gpu)


def test_inplace_view_ops_change_the_tensors_shape(bridged):
    # squeeze_/unsqueeze_/t_/resize_ give the tensor new sizes; on a view, writes still reach the base.
    cpu, gpu = _pair(torch.arange(12.0).reshape(3, 4))
    results = []
    for x in (cpu, gpu):
        view = x[1:]
        view.t_()
        view.mul_(3)
        row = (x[:1] * 2).squeeze_(0)
        column = (x[:, 0] + 1).unsqueeze_(1)
        resized = x.clone().resize_(2, 3)
        results.append((view, row, column, resized))
    for cpu_result, bridge_result in zip(*results):
        _same(cpu_result, bridge_result)
    _same(cpu, gpu)


def test_inplace_squeeze_keeps_autograd_shapes(bridged):
    cpu, gpu = _pair(torch.randn(5))
    weight_cpu, weight_gpu = _pair(torch.randn(5, 4))
    for x, weight in ((cpu, weight_cpu), (gpu, weight_gpu)):
        x.requires_grad_(True)
        torch.matmul(x, weight).sum().backward()  # 1-d matmul ends in aten.squeeze_
    _same(cpu.grad, gpu.grad)


def test_views_see_later_writes_to_base(bridged):
    cpu, gpu = _pair(torch.zeros(4, 4))
    views = []
    for x in (cpu, gpu):
        row = x[2]
        column = x.t()[1]
        x.add_(torch.arange(16.0).reshape(4, 4).to(x.device))
        views.append((row, column))
    _same(views[0][0], views[1][0])
    _same(views[0][1], views[1][1])


def test_sibling_views_share_writes(bridged):
    cpu, gpu = _pair(torch.zeros(6))
    results = []
    for x in (cpu, gpu):
        a = x[1:4]
        b = x[2:]
        a.fill_(3.0)
        b[0] = 9.0
        results.append((a.clone(), b.clone(), x.clone()))
    for expected, actual in zip(results[0], results[1]):
        _same(expected, actual)


def test_repeated_views_read_their_base_when_read(bridged):
    """A view op repeated with the same shapes and arguments makes its view without running a
    program (runtime.dispatch._view_plan); read later, it has its base's value as of the read:
    unchanged, written in place since, or written through another view, as torch's views."""
    results = []
    for device in ("cpu", "cuda"):
        x = torch.arange(12.0).reshape(3, 4).to(device)
        seen = []
        for step in range(4):
            column = x[:, 0]
            flat = x.view(12)
            row_of_t = x.t()[1]  # a view of a view
            seen.append(column.clone())
            x.add_(1.0)
            seen += [flat.clone(), row_of_t.clone()]
            x[0, 1] = 100.0 + step
            x[:, 2].mul_(2.0)  # a write through a repeated view
            seen += [row_of_t.clone(), column.clone(), x.t()[2].clone()]
        results.append(seen)
    assert len(results[1]) == 24
    for expected, actual in zip(*results):
        _same(expected, actual)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_slices_at_moving_offsets_are_views_as_in_torch(bridged, dtype):
    """A loop's `source[i:i + 35]` at a new offset each call (word_language_model's batches)
    makes its view without running anything once a slice of that length was seen
    (runtime.dispatch._moving_slice); its values, bounds (negative, past the end, a step), writes
    through it, later writes to the base and gradients are torch's."""
    # (more elements than integer work goes to the host with: runtime.dispatch._NEW_SHAPE_ELEMENTS)
    cpu = (torch.arange(70_000 * 4) % 97).reshape(70_000, 4).to(dtype)
    gpu = cpu.to("cuda")
    bounds = lambda i: [(i, i + 35), (i, None), (-i - 40, -i - 5), (i, i + 10_000), (i, i + 35, 2), (i + 1, i)]
    lazy = 0
    for i in range(0, 250, 7):
        for bound in bounds(i):
            view = gpu[slice(*bound)]
            lazy += isinstance(view._value, jax.ShapeDtypeStruct)  # made without a program
            _same(cpu[slice(*bound)], view)
        _same(cpu[i + 1 : i + 36].view(-1), gpu[i + 1 : i + 36].view(-1))
        _same(cpu[:, 1:3][i : i + 9], gpu[:, 1:3][i : i + 9])  # a slice of a view
    assert lazy > 150
    for x in (cpu, gpu):
        for i in range(20):
            row = x[i : i + 3]
            row.add_(1)  # a write through the view reaches the base
            later = x[i + 5 : i + 7]
            x.mul_(2)  # and the view reads the base's later value
            seen = later.clone()
            x.sub_(seen.sum())
    _same(cpu, gpu)
    if dtype == torch.float32:
        grads = []
        for device in ("cpu", "cuda"):
            weight = torch.zeros(50, 3, device=device, requires_grad=True)
            sum(weight[i : i + 10].sum() * (i + 1) for i in range(12)).backward()
            grads.append(weight.grad)
        _same(*grads)


# Writes through the views between complex and real numbers land on the right components.
COMPLEX_VIEW_WRITES = {
    "real zero_": (lambda z: z.real.zero_(), True),
    "imag mul_": (lambda z: z.imag.mul_(2), True),
    "view_as_real select fill_": (lambda z: torch.view_as_real(z)[:, :, 1].fill_(7), True),
    "transposed imag row add_": (lambda z: z.t().imag[0].add_(10), True),
    "row real copy_": (lambda z: z[1].real.copy_(torch.tensor([9.0, 8.0])), True),
    "complex row mul_": (lambda z: z[0].mul_(2j), True),
    "view_as_complex mul_": (lambda x: torch.view_as_complex(x).mul_(1j), False),
    "view_as_complex imag fill_": (lambda x: torch.view_as_complex(x)[1].imag.fill_(-1), False),
}


@pytest.mark.parametrize("name", COMPLEX_VIEW_WRITES)
def test_writes_through_complex_and_real_views(bridged, name):
    write, complex_root = COMPLEX_VIEW_WRITES[name]
    start = torch.tensor([[1 + 2j, 3 + 4j], [5 + 6j, 7 + 8j]]) if complex_root else torch.arange(8.0).reshape(2, 2, 2)
    cpu, gpu = _pair(start)
    for x in (cpu, gpu):
        write(x)
    _same(cpu, gpu, rtol=0, atol=0)


def test_complex_and_polar_build_complex_numbers(bridged):
    real, imag = torch.tensor([1.0, -3.0, 0.5]), torch.tensor([2.0, 4.0, -0.25])
    _same(torch.complex(real, imag), torch.complex(real.cuda(), imag.cuda()), rtol=0, atol=0)
    _same(torch.polar(real.abs(), imag), torch.polar(real.abs().cuda(), imag.cuda()))


def test_data_and_param_data_copy(bridged):
    layer = nn.Linear(3, 2)
    bridged_layer = copy.deepcopy(layer).to("cuda")
    for module in (layer, bridged_layer):
        module.weight.data.copy_(torch.ones(2, 3))
        module.bias.data.mul_(0)
        with torch.no_grad():
            module.weight[0, 0] = 5.0
    _same(layer.weight.detach(), bridged_layer.weight.detach())
    _same(layer.bias.detach(), bridged_layer.bias.detach())


def test_nn_init_writes_parameters(bridged):
    layer = nn.Linear(4, 4).to("cuda")
    nn.init.zeros_(layer.bias)
    nn.init.constant_(layer.weight, 0.5)
    assert layer.bias.cpu().tolist() == [0.0] * 4
    assert layer.weight.cpu().eq(0.5).all().item()


def test_out_argument(bridged):
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    out_cpu = torch.empty(3, 3)
    out_gpu = torch.empty(3, 3, device="cuda")
    torch.add(a, b, out=out_cpu)
    result = torch.add(a.cuda(), b.cuda(), out=out_gpu)
    assert result is out_gpu
    _same(out_cpu, out_gpu)


def test_inplace_on_leaf_requiring_grad_is_refused_like_torch(bridged):
    x = torch.ones(3, device="cuda", requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x.add_(1)


def test_module_to_keeps_parameter_identity(bridged):
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    parameters = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to("cuda")
    assert [p is q for p, q in zip(parameters, model.parameters())] == [True] * 4
    assert all(isinstance(p, nn.Parameter) and p.is_cuda for p in model.parameters())
    loss = model(torch.randn(5, 3, device="cuda")).sum()
    loss.backward()
    before = parameters[0].detach().clone()
    optimizer.step()
    assert not torch.equal(before.cpu(), parameters[0].detach().cpu())


# ------------------------------------------------------------ devices


def test_devices_as_scripts_see_them(bridged):
    x = torch.randn(2, 2).cuda()
    assert x.is_cuda and not x.is_cpu
    assert x.device == torch.device("cuda", 0)
    assert x.device.type == "cuda" and str(x.device) == "cuda:0"
    assert x.get_device() == 0
    assert torch.zeros(1, device=0).device == torch.device("cuda:0")
    assert x.to("cpu").device == torch.device("cpu")
    assert type(x.cpu()) is torch.Tensor
    assert torch.ones(2, device=torch.device("cuda")).device.type == "cuda"
    y = torch.ones(2).to(x.device, torch.float64)
    assert y.dtype == torch.float64 and y.is_cuda
    assert x.to(torch.float16).dtype == torch.float16 and x.to(torch.float16).is_cuda


def test_cuda_queries(bridged):
    assert torch.cuda.is_available()
    assert torch.cuda.device_count() >= 1
    assert torch.cuda.current_device() == 0
    torch.cuda.set_device(0)
    assert isinstance(torch.cuda.get_device_name(), str)
    assert torch.cuda.is_bf16_supported()
    torch.cuda.synchronize()
    torch.cuda.manual_seed(1)
    torch.cuda.manual_seed_all(1)
    assert torch.cuda.memory_allocated() >= 0


def test_bad_device_ordinal_is_a_clear_error(bridged):
    with pytest.raises(bridged.DeviceError, match="ordinal 7"):
        torch.zeros(2, device="cuda:7")


def test_gradient_flows_across_cpu_and_bridge(bridged):
    w = torch.randn(3, requires_grad=True)  # a CPU leaf
    loss = (w.cuda() * 2).sum().cpu() * 3
    loss.backward()
    assert w.grad.tolist() == [6.0, 6.0, 6.0]


# ------------------------------------------------------------ sync points


def test_sync_points_behave_as_torch(bridged):
    x = torch.tensor([[1.5, -2.0], [3.0, 4.25]])
    y = x.cuda()
    assert y.sum().item() == x.sum().item()
    assert y.tolist() == x.tolist()
    assert repr(y) == repr(x).replace("])", "], device='cuda:0')")
    assert f"{y[0, 0]:.3f}" == "1.500"
    assert y.cpu().numpy().tolist() == x.numpy().tolist()
    with pytest.raises(TypeError, match="Use Tensor.cpu"):
        y.numpy()
    assert "grad_fn=<MulBackward0>" in repr(y.requires_grad_() * 2)


def test_int64_and_float64_are_real(bridged):
    big = torch.tensor([2**40 + 1], dtype=torch.int64, device="cuda")
    assert (big * 2).item() == 2**41 + 2
    precise = torch.tensor([1.0 + 1e-12], dtype=torch.float64, device="cuda")
    assert (precise - 1.0).item() == pytest.approx(1e-12, rel=1e-6)
    assert (torch.ones(2, dtype=torch.int32, device="cuda") + 1.5).dtype == torch.float32


# ------------------------------------------------------------ randomness


def test_manual_seed_reproduces_bridge_randomness(bridged):
    def draw():
        torch.manual_seed(1234)
        x = torch.ones(1000, device="cuda")
        return torch.nn.functional.dropout(x, 0.5).cpu(), torch.rand(5, device="cuda").cpu()

    first, second = draw(), draw()
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    kept = (first[0] > 0).float().mean().item()
    assert 0.4 < kept < 0.6
    assert set(first[0].unique().tolist()) <= {0.0, 2.0}
    torch.manual_seed(4321)
    assert not torch.equal(torch.nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5).cpu(), first[0])


def test_dropout_is_identity_in_eval(bridged):
    layer = nn.Dropout(0.5).to("cuda").eval()
    x = torch.randn(10, device="cuda")
    assert torch.equal(layer(x).cpu(), x.cpu())


def test_cuda_rng_state_round_trips_and_fork_rng(bridged):
    torch.manual_seed(7)
    state = torch.cuda.get_rng_state()
    first = torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5).cpu()
    torch.cuda.set_rng_state(state)
    again = torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5).cpu()
    assert torch.equal(first, again)
    with torch.random.fork_rng(device_type="cuda"):
        torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)
    after_fork = torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5).cpu()
    torch.cuda.set_rng_state(state)
    torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)
    expected = torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5).cpu()
    assert torch.equal(after_fork, expected), "fork_rng must restore the bridge generator"
    assert torch.cuda.initial_seed() == 7


def test_streams_and_events_for_timing(bridged):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    (torch.randn(64, 64, device="cuda") @ torch.randn(64, 64, device="cuda")).sum().item()
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0
    assert not torch.cuda.current_stream().is_capturing()
    with torch.cuda.stream(torch.cuda.Stream()):
        assert torch.ones(1, device="cuda").item() == 1.0
    assert torch.accelerator.current_accelerator().type == "cuda"
    assert torch.accelerator.device_count() == torch.cuda.device_count()


def test_every_public_factory_taking_a_device_is_routed():
    """Each public torch function whose ATen schema takes `device=` makes bridge tensors for
    `device="cuda"` (a factory left out would reach torch's real CUDA backend), or refuses
    clearly: sparse constructors. torch.Generator is a class the random patches replace."""
    from bridge.patches.devices import _FACTORIES, _SPARSE_FACTORIES

    takes_device = set()
    for schema in torch._C._jit_get_all_schemas():
        name = schema.name.removeprefix("aten::")
        if schema.name.startswith("aten::") and not name.startswith("_") and hasattr(torch, name):
            if any(argument.name == "device" for argument in schema.arguments):
                takes_device.add(name)
    handled_elsewhere = {"Generator", "empty_quantized"}  # quantized tensors: not on the bridge
    assert takes_device and not takes_device - set(_FACTORIES) - set(_SPARSE_FACTORIES) - handled_elsewhere


def test_sparse_constructors_refuse_the_bridge_device_clearly(bridged):
    with pytest.raises(bridged.DeviceError, match="sparse tensors cannot live on the bridge"):
        torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,), device="cuda")
    on_host = torch.sparse_coo_tensor([[0, 1]], [1.0, 2.0], (3,), device="cpu")
    _same(on_host.to_dense(), on_host.to_dense().to("cuda"))


def test_asarray_and_empty_permuted_on_the_bridge(bridged):
    import numpy as np

    made = {
        "asarray list": torch.asarray([1, 2], device="cuda"),
        "asarray numpy": torch.asarray(np.ones(2), device="cuda", dtype=torch.float32),
        "asarray tensor": torch.asarray(torch.arange(3.0), device="cuda"),
        "empty_permuted": torch.empty_permuted((2, 3, 4), (2, 0, 1), device="cuda"),
    }
    for name, tensor in made.items():
        assert isinstance(tensor, BridgeTensor) and tensor.device.type == "cuda", name
    _same(torch.asarray([1, 2]), made["asarray list"])
    _same(torch.ones(2), made["asarray numpy"])
    assert made["empty_permuted"].shape == (2, 3, 4)
    on_bridge = torch.ones(3, device="cuda")
    assert torch.asarray(on_bridge, device="cuda") is on_bridge  # no copy, as torch


def test_factories_with_a_host_device_make_host_tensors(bridged):
    """`device="cpu"` wins over a bridge tensor argument, as in torch with a CUDA tensor."""
    x = torch.randn(3, 2, device="cuda")
    cases = {
        "zeros_like": torch.zeros_like(x, device="cpu"),
        "ones_like float64": torch.ones_like(x, device="cpu", dtype=torch.float64),
        "full_like": torch.full_like(x, 2.5, device="cpu"),
        "as_tensor": torch.as_tensor(x, device="cpu"),
        "tensor": torch.tensor(x.detach(), device="cpu"),
    }
    for name, result in cases.items():
        assert type(result) is torch.Tensor and result.device.type == "cpu", name
    torch.testing.assert_close(cases["as_tensor"], x.cpu())
    torch.testing.assert_close(cases["tensor"], x.cpu())
    torch.testing.assert_close(cases["full_like"], torch.full((3, 2), 2.5))
    assert cases["ones_like float64"].dtype == torch.float64 and bool((cases["ones_like float64"] == 1).all())
    torch.manual_seed(3)
    drawn = torch.rand_like(x, device="cpu")
    torch.manual_seed(3)
    torch.testing.assert_close(drawn, torch.rand(3, 2))  # the host generator, as torch draws it


def test_tensor_split_at_points_held_by_a_bridge_tensor(bridged):
    # torch's C++ reads the split points' data, which a bridge tensor keeps on the device.
    x = torch.arange(20.0).reshape(10, 2)
    for points in (torch.tensor([2, 5]), torch.tensor(3), torch.tensor([7])):
        for split in (lambda t, p: torch.tensor_split(t, p), lambda t, p: t.tensor_split(p, dim=0)):
            expected = split(x, points)
            actual = split(x.cuda(), points.cuda())
            assert len(actual) == len(expected)
            for got, want in zip(actual, expected):
                _same(want, got, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="long dtype"):
        torch.tensor_split(x.cuda(), torch.tensor([2.0]).cuda())


# ------------------------------------------------------------ the eager path's shortcuts


_OPERATOR_CALLS = {
    "tensor + tensor": lambda a, b: a + b,
    "tensor + int": lambda a, b: a + 2,
    "int + tensor": lambda a, b: 2 + a,
    "float * tensor": lambda a, b: 2.5 * a,
    "tensor - tensor": lambda a, b: a - b,
    "tensor / tensor": lambda a, b: a / b,
    "add with alpha": lambda a, b: a.add(b, alpha=2),
    "div with rounding mode": lambda a, b: a.div(b, rounding_mode="trunc"),
    "mul method": lambda a, b: a.mul(b),
    "sub by keyword": lambda a, b: a.sub(other=b),
    "tensor + True": lambda a, b: a + True,
    "0-dim host + bridge": lambda a, b: a.cpu()[0, 0] + b if isinstance(a, BridgeTensor) else a[0, 0] + b,
    "bridge * 0-dim host": lambda a, b: a * b.cpu()[1, 2] if isinstance(b, BridgeTensor) else a * b[1, 2],
}


@pytest.mark.parametrize("name", sorted(_OPERATOR_CALLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_arithmetic_operators_match_torch(bridged, name, dtype):
    # Arithmetic operators on bridge tensors skip torch's dispatcher when it adds nothing
    # (runtime/tensor.py); the second and third calls take the compiled program's shortcut.
    call = _OPERATOR_CALLS[name]
    if dtype is torch.int64 and name in ("float * tensor", "tensor / tensor", "div with rounding mode"):
        a, b = torch.arange(1, 13).reshape(3, 4), torch.arange(2, 14).reshape(3, 4)
    else:
        a, b = (torch.randn(3, 4) * 10).to(dtype), (torch.randn(3, 4) * 10 + 20).to(dtype)
    want = call(a, b)
    # XLA's GPU division is within an ulp of torch's CPU one, not equal to it.
    tolerance = {} if "/" in name or "div" in name else {"rtol": 0, "atol": 0}
    for _ in range(3):
        got = call(a.to("cuda"), b.to("cuda"))
        assert got.device.type == "cuda" and got.dtype == want.dtype
        torch.testing.assert_close(got.cpu(), want, **tolerance)


def test_operators_keep_scalar_kinds_and_signed_zeros_apart(bridged):
    # 1, 1.0 and True hash alike, as do 0.0 and -0.0; the compiled programs must not be shared.
    ints = torch.arange(4)
    ones = torch.ones(4)
    for _ in range(2):
        assert (ints.to("cuda") + 1).dtype == torch.int64
        assert (ints.to("cuda") + 1.0).dtype == torch.float32
        assert (ints.to("cuda") * True).dtype == torch.int64
        assert not (ones.to("cuda") * 0.0).cpu().signbit().any()
        assert (ones.to("cuda") * -0.0).cpu().signbit().all()
        assert torch.equal((ones.to("cuda") * -0.0).cpu(), ones * -0.0)


def test_compiled_entries_key_scalars_exactly(bridged):
    # A fresh entry (a shared one may have stopped compiling floats after other tests' calls).
    import jax.numpy as jnp

    from bridge.runtime.compiled_ops import CompiledEntry

    entry = CompiledEntry(torch.ops.aten.mul.Tensor, jnp.multiply)
    ones = jnp.ones(4, dtype=jnp.float32)
    assert not jnp.signbit(entry([ones, 0.0], {})).any()
    assert jnp.signbit(entry([ones, -0.0], {})).all()
    assert jnp.issubdtype(entry([jnp.arange(4), 1], {}).dtype, jnp.integer)
    assert jnp.issubdtype(entry([jnp.arange(4), 1.0], {}).dtype, jnp.floating)
    assert jnp.isnan(entry([ones, float("nan")], {})).all()


def test_operators_read_views_after_writes(bridged):
    base = torch.zeros(3, 4).to("cuda")
    row = base[1]
    for step in range(3):
        torch.testing.assert_close((row + 1).cpu(), torch.full((4,), float(step) + 1))
        base.add_(1)


def test_operators_still_go_through_autograd_modes_and_autocast(bridged):
    from torch.utils._python_dispatch import TorchDispatchMode

    leaf = torch.randn(3).to("cuda").requires_grad_()
    (leaf * 2 + 1).sum().backward()
    torch.testing.assert_close(leaf.grad.cpu(), torch.full((3,), 2.0))

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.ones(3).to("cuda")
    with Recorder() as recorder:
        x + x
        2 * x
    assert recorder.ops == [torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor]
    with torch.inference_mode():
        assert (x + x).is_inference()
    # torch's own exception class, which changed in 2.14 (RuntimeError before, NotImplementedError now).
    with pytest.raises(Exception, match="bool tensors is not supported") as on_cpu:
        torch.ones(2, dtype=torch.bool) - torch.ones(2, dtype=torch.bool)
    with pytest.raises(on_cpu.type, match="bool tensors is not supported"):
        torch.ones(2, dtype=torch.bool).to("cuda") - torch.ones(2, dtype=torch.bool).to("cuda")


def test_changing_matmul_precision_recompiles_eager_matmuls(bridged, monkeypatch):
    # An op compiled for eager mode whose trace read torch's precision setting is keyed on it:
    # a script that changes the setting mid-run gets programs traced under the new one.
    from bridge.runtime import precision

    reads = []
    real = precision.matmul_precision
    monkeypatch.setattr(precision, "matmul_precision", lambda: reads.append(1) or real())
    a, b = torch.randn(8, 8).to("cuda"), torch.randn(8, 8).to("cuda")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        a @ b
        a @ b
        traced = len(reads)
        assert traced > 0
        torch.set_float32_matmul_precision("high")
        a @ b
        assert len(reads) > traced
        retraced = len(reads)
        a @ b
        assert len(reads) == retraced  # and cached again under the new setting
    finally:
        torch.set_float32_matmul_precision(before)


# ------------------------------------------------------------ below autograd


def test_composite_ops_below_autograd_match_torch(bridged):
    """Under torch.inference_mode torch's autograd layer is skipped, so composite ops such as
    aten.nll_loss reach the bridge whole. torch's registered Python decompositions of some of
    them take other positional arguments than the op (a reduction of 'sum' was read as
    size_average and gave a weighted mean)."""
    torch.manual_seed(0)
    logits, target, weight = torch.randn(8, 5), torch.randint(0, 5, (8,)), torch.linspace(0.5, 2.0, 5)
    calls = [
        lambda z, y, w: torch.nn.functional.cross_entropy(z, y, weight=w, reduction="sum"),
        lambda z, y, w: torch.nn.functional.nll_loss(z.log_softmax(1), y, weight=w, reduction="none"),
        lambda z, y, w: torch.var(z, False),
        lambda z, y, w: torch.std(z, False),
        lambda z, y, w: torch.var_mean(z, False)[0],
    ]
    for call in calls:
        want = call(logits, target, weight)
        with torch.inference_mode():
            got = call(logits.to("cuda"), target.to("cuda"), weight.to("cuda"))
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


def test_data_is_an_alias_without_autograd(bridged):
    """`.data` (made without torch's dispatch for a whole tensor): writes through it reach the
    tensor, later writes to the tensor show through it, it never requires grad; a view's `.data`
    is the view's."""
    for device in ("cpu", "cuda"):
        weight = nn.Parameter(torch.arange(6.0).reshape(2, 3).to(device))
        alias = weight.data
        assert not alias.requires_grad and alias.grad_fn is None and type(alias) is not nn.Parameter
        alias.add_(torch.ones(2, 3).to(device), alpha=-0.5)
        with torch.no_grad():
            weight.mul_(2)
        assert weight.tolist() == alias.tolist() == [[-1.0, 1.0, 3.0], [5.0, 7.0, 9.0]], device
        column = weight.detach()[:, 1]
        column.data.zero_()
        assert weight[:, 1].tolist() == [0.0, 0.0], device


@pytest.mark.parametrize("make", [
    lambda device: torch.zeros(300, 300, device=device),
    lambda device: torch.ones((70_000,), dtype=torch.int32, device=device),
    lambda device: torch.full((300, 300), -2.5, device=device),
    lambda device: torch.full((300, 300), 7, device=device),
    lambda device: torch.full((300, 300), True, device=device),
    lambda device: torch.zeros(2, 70_000, dtype=torch.float64, requires_grad=True, device=device),
])
def test_large_factories_of_one_value_are_made_on_the_device_as_torch_makes_them(bridged, make):
    """Made there by a program (FSDP2's all-gather buffers: a host copy took 260 ms on an H200)."""
    from bridge.runtime.tensor import BridgeTensor

    made, expected = make("cuda"), make("cpu")
    assert isinstance(made, BridgeTensor) and made.requires_grad == expected.requires_grad
    assert made.dtype == expected.dtype and made.shape == expected.shape
    torch.testing.assert_close(made.detach().cpu(), expected.detach())
    empty = torch.empty(3, 70_000, dtype=torch.bfloat16, device="cuda")
    assert empty.shape == (3, 70_000) and empty.dtype == torch.bfloat16
