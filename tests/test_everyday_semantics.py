"""What scripts do around their arithmetic, as torch does it: storage identity (what safetensors
and `save_pretrained` read), moving modules back to the host, refusing tensors on two devices,
TorchScript and forward-mode AD while the bridge is active, tracebacks that show the script's
frames, the runner's checks before a run, and torch.distributions' argument checks."""

import copy
import gc
import os
import textwrap

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn as nn
import torch.nn.functional as F

from conftest import run_python
from bridge.runtime import BridgeTensor, stats


# ------------------------------------------------------------ storage identity


def test_distinct_tensors_have_distinct_stable_storages(bridged):
    tensors = [torch.randn(3, 5, device="cuda") for _ in range(50)]
    addresses = [tensor.untyped_storage().data_ptr() for tensor in tensors]
    assert len(set(addresses)) == len(tensors) and 0 not in addresses
    gc.collect()
    more = [torch.randn(3, 5, device="cuda") for _ in range(50)]  # made after others were freed
    assert not set(addresses) & {tensor.untyped_storage().data_ptr() for tensor in more}
    assert [tensor.untyped_storage().data_ptr() for tensor in tensors] == addresses
    assert all(tensor.untyped_storage().nbytes() == 60 for tensor in tensors)


@pytest.mark.parametrize("make_view", [
    lambda x: x[1:],
    lambda x: x[:, 2],
    lambda x: x.t()[1],
    lambda x: x.view(-1)[7:11],
    lambda x: x.detach(),
    lambda x: x[2:, 1:].unsqueeze(0),
], ids=["rows", "column", "transposed row", "flat slice", "detach", "block"])
def test_views_share_their_base_storage_where_torch_puts_them(bridged, make_view):
    host = torch.arange(24.0).reshape(4, 6)
    bridge_base = host.to("cuda")
    expected, view = make_view(host), make_view(bridge_base)
    assert view.untyped_storage().data_ptr() == bridge_base.untyped_storage().data_ptr()
    assert view.untyped_storage().nbytes() == host.untyped_storage().nbytes()
    assert view.storage_offset() == expected.storage_offset()
    assert view.data_ptr() - bridge_base.data_ptr() == expected.data_ptr() - host.data_ptr()
    assert view.data_ptr() == view.untyped_storage().data_ptr() + view.storage_offset() * view.element_size()


def test_complex_views_and_tied_parameters_share_storage(bridged):
    host = torch.zeros(3, 2, dtype=torch.complex64)
    base = host.to("cuda")
    for make_view in (lambda z: torch.view_as_real(z)[1], lambda z: z.imag, lambda z: z[2]):
        assert make_view(base).storage_offset() == make_view(host).storage_offset()
        assert make_view(base).data_ptr() - base.data_ptr() == make_view(host).data_ptr() - host.data_ptr()
    embedding, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    model = nn.ModuleDict({"embedding": embedding, "head": head}).to("cuda")
    state = model.state_dict()
    assert state["embedding.weight"].data_ptr() == state["head.weight"].data_ptr()
    other = nn.Linear(4, 10, bias=False).to("cuda").weight
    assert other.untyped_storage().data_ptr() != state["head.weight"].untyped_storage().data_ptr()


def test_as_strided_counts_storage_offset_from_the_base(bridged):
    host = torch.arange(24.0).reshape(4, 6)
    for device_tensor, plain in ((host.to("cuda"), host),):
        view, expected_view = device_tensor[1:, 2:], plain[1:, 2:]
        got = view.as_strided((3,), (1,), view.storage_offset() + 1)
        torch.testing.assert_close(got.cpu(), expected_view.as_strided((3,), (1,), expected_view.storage_offset() + 1))
        assert torch.equal(view.as_strided(view.size(), view.stride(), view.storage_offset()).cpu(), expected_view)
        torch.testing.assert_close(torch.narrow(view, 1, 1, 2).cpu(), torch.narrow(expected_view, 1, 1, 2))


@pytest.mark.hf
def test_safetensors_saves_and_loads_bridge_tensors(bridged, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch", reason='needs safetensors: pip install -e ".[hf]"')
    model = _net().to("cuda")
    state = model.state_dict()
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file(state, path)
    for device in ("cpu", "cuda"):
        loaded = safetensors_torch.load_file(path, device=device)
        assert sorted(loaded) == sorted(state)
        for name, value in loaded.items():
            assert isinstance(value, BridgeTensor) == (device == "cuda")
            assert torch.equal(value.cpu(), state[name].cpu())
    # tensors that share memory are refused as in torch: here a view and its base
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors_torch.save_file({"a": state["0.weight"], "b": state["0.weight"][1:]}, path)


@pytest.mark.hf
def test_save_pretrained_from_the_bridge_loads_in_plain_torch(tmp_path):
    transformers = pytest.importorskip("transformers", reason='needs transformers: pip install -e ".[hf]"')
    import bridge

    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    torch.manual_seed(0)
    bridge.activate()
    try:
        model = transformers.GPT2LMHeadModel(config).to("cuda")
        assert model.lm_head.weight is model.transformer.wte.weight
        model.save_pretrained(tmp_path)
        expected = {name: value.cpu() for name, value in model.state_dict().items()}
    finally:
        bridge.deactivate()
    assert (tmp_path / "model.safetensors").exists()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    state = loaded.state_dict()
    assert sorted(state) == sorted(expected)
    for name, value in state.items():
        assert type(value) is torch.Tensor and torch.equal(value, expected[name]), name


# ------------------------------------------------------------ moving modules and optimizers


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


@pytest.mark.parametrize("to_host", [
    lambda model: model.cpu(),
    lambda model: model.to("cpu"),
    lambda model: model.to(torch.device("cpu")),
], ids=["cpu()", "to('cpu')", "to(torch.device('cpu'))"])
def test_modules_move_to_the_host_and_back(bridged, to_host):
    model = _net().to("cuda")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    weight = model[0].weight
    model(torch.randn(5, 3, device="cuda")).sum().backward()
    optimizer.step()
    to_host(model)
    assert type(model[0].weight) is nn.Parameter and model[0].weight is weight
    assert all(tensor.device.type == "cpu" and not isinstance(tensor, BridgeTensor)
               for tensor in list(model.parameters()) + list(model.buffers()) + [model[0].weight.grad])
    host_out = model(torch.randn(5, 3))
    assert type(host_out) is torch.Tensor
    # Unlike torch, the move swaps parameter objects, which torch refuses while a graph holds
    # them: said clearly, with what to do.
    with pytest.raises(RuntimeError, match="no autograd graph holds the parameter"):
        model.to("cuda")
    del host_out
    model.to("cuda")
    assert model[0].weight is weight and isinstance(weight, BridgeTensor) and weight.grad.device.type == "cuda"
    assert model[1].running_mean.device.type == "cuda"


def test_state_moves_between_devices_through_state_dicts(bridged, tmp_path):
    model = _net().to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3, device="cuda")).sum().backward()
    optimizer.step()
    host_model = _net()
    host_model.load_state_dict(model.state_dict())
    host_optimizer = torch.optim.AdamW(host_model.parameters(), lr=0.1)
    host_optimizer.load_state_dict(optimizer.state_dict())
    state = host_optimizer.state[host_model[0].weight]
    assert type(state["exp_avg"]) is torch.Tensor and state["exp_avg"].device.type == "cpu"
    torch.testing.assert_close(state["exp_avg"], optimizer.state[model[0].weight]["exp_avg"].cpu())
    # and back onto the bridge, through a file and map_location
    torch.save({"model": host_model.state_dict(), "optimizer": host_optimizer.state_dict()}, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", map_location="cuda")
    assert isinstance(loaded["model"]["0.weight"], BridgeTensor)
    again = _net().to("cuda")
    again.load_state_dict(loaded["model"])
    again_optimizer = torch.optim.AdamW(again.parameters(), lr=0.1)
    again_optimizer.load_state_dict(loaded["optimizer"])
    assert isinstance(again_optimizer.state[again[0].weight]["exp_avg"], BridgeTensor)
    torch.testing.assert_close(again[0].weight.cpu(), model[0].weight.cpu())


# ------------------------------------------------------------ tensors on two devices


def test_tensors_on_two_devices_are_refused_as_torch_refuses_them(bridged):
    on_device = torch.ones(2, 3, device="cuda")
    for mix in (
        lambda: on_device + torch.ones(2, 3),
        lambda: torch.ones(2, 3) * on_device,
        lambda: torch.cat([on_device, torch.ones(2, 3)]),
        lambda: F.linear(torch.ones(4, 3), on_device),
        lambda: nn.Linear(3, 2).to("cuda")(torch.ones(4, 3)),
        lambda: on_device.scatter(0, torch.tensor([[0, 1, 0]]), on_device),
    ):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            mix()
    # what torch allows: a 0-dim host tensor, host indices, copies between devices
    torch.testing.assert_close((on_device * torch.tensor(2.0)).cpu(), torch.full((2, 3), 2.0))
    torch.testing.assert_close(on_device[torch.tensor([1, 0])].cpu(), torch.ones(2, 3))
    target = torch.zeros(2, 3, device="cuda")
    target.copy_(torch.full((2, 3), 5.0))
    target[torch.tensor([0])] = torch.full((1, 3), 7.0)
    torch.testing.assert_close(target.cpu(), torch.tensor([[7.0] * 3, [5.0] * 3]))
    torch.testing.assert_close(F.one_hot(torch.tensor([0, 2, 1], device="cuda")).cpu(), F.one_hot(torch.tensor([0, 2, 1])))


def test_one_hot_checks_as_torch(bridged):
    with pytest.raises(RuntimeError, match="LongTensor"):
        F.one_hot(torch.tensor([0.0], device="cuda"))
    with pytest.raises(RuntimeError, match="empty tensor"):
        F.one_hot(torch.zeros(0, dtype=torch.long, device="cuda"))
    assert F.one_hot(torch.zeros(0, dtype=torch.long, device="cuda"), 3).shape == (0, 3)


# ------------------------------------------------------------ TorchScript and forward-mode AD


def _scripted_source():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 2)

        def forward(self, x):
            return torch.relu(self.linear(x)) + torch.zeros(2) + torch.ones(2, device=torch.device("cpu"))

    return Net


def test_torchscript_compiles_calls_of_patched_functions(bridged):
    @torch.jit.script
    def function(a: torch.Tensor):
        return a + torch.zeros(3) + torch.arange(3.0)

    torch.testing.assert_close(function(torch.ones(3)), torch.tensor([1.0, 2.0, 3.0]))
    torch.manual_seed(0)
    module = _scripted_source()()
    scripted = torch.jit.script(module)
    x = torch.randn(4, 3)
    torch.testing.assert_close(scripted(x), module(x))
    traced = torch.jit.trace(module, x)
    torch.testing.assert_close(traced(x), module(x))


def test_torchscript_still_works_after_deactivation():
    import bridge

    bridge.activate()
    bridge.deactivate()

    @torch.jit.script
    def function(a: torch.Tensor):
        return a + torch.zeros(3)

    torch.testing.assert_close(function(torch.ones(3)), torch.ones(3))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_func_transforms(bridged, device):
    x = torch.tensor([1.0, 2.0, -0.5], device=device)

    def cubes(z):
        return (z ** 3).sum()

    expected = 3 * torch.tensor([1.0, 2.0, -0.5]) ** 2
    for transform in (torch.func.grad, torch.func.jacrev, torch.func.jacfwd):
        torch.testing.assert_close(transform(cubes)(x).cpu(), expected)
    torch.testing.assert_close(torch.func.jvp(torch.sin, (x,), (torch.ones_like(x),))[1].cpu(), torch.cos(x.cpu()))
    # hessian is forward over reverse: TorchScript's JVP decompositions (compiled while the
    # bridge is active) on the host, and autograd's zero tensors on the bridge
    for transform in (torch.func.hessian, lambda f: torch.func.jacrev(torch.func.jacrev(f)),
                      lambda f: torch.func.jacfwd(torch.func.jacfwd(f))):
        torch.testing.assert_close(transform(cubes)(x).cpu(), torch.diag(6 * x.cpu()))


@pytest.mark.parametrize("mode", ["eager", "captured"])
def test_forward_mode_ad_on_bridge_tensors(bridged, mode):
    previous = bridged.set_mode(mode)
    try:
        torch.manual_seed(0)
        host_model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        model = copy.deepcopy(host_model).to("cuda")
        x, tangent = torch.randn(5, 3), torch.randn(5, 3)
        with forward_ad.dual_level():
            reference = forward_ad.make_dual(x, tangent)
            expected = forward_ad.unpack_dual((host_model(reference) * reference.sum()).sin())
        for _ in range(2):  # the second call replays what the first captured
            with forward_ad.dual_level():
                dual = forward_ad.make_dual(x.to("cuda"), tangent.to("cuda"))
                out = forward_ad.unpack_dual((model(dual) * dual.sum()).sin())
            torch.testing.assert_close(out.primal.cpu(), expected.primal)
            torch.testing.assert_close(out.tangent.cpu(), expected.tangent)
        _, jvp = torch.func.jvp(model, (x.to("cuda"),), (tangent.to("cuda"),))
        torch.testing.assert_close(jvp.cpu(), torch.func.jvp(host_model, (x,), (tangent,))[1])
    finally:
        bridged.set_mode(previous)


# ------------------------------------------------------------ what an error shows


_SHAPE_ERROR = textwrap.dedent("""
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 4)

        def forward(self, x):
            return self.fc(x)

    model = Net().to(DEVICE)
    print(model(torch.randn(8, 16, device=DEVICE)))
""")


def _traceback_lines(output):
    return [line for line in output.splitlines() if not line.startswith("bridge: ") and line.strip()]


def test_an_error_in_a_model_reads_as_torchs(tmp_path):
    (tmp_path / "plain.py").write_text('DEVICE = "cpu"\n' + _SHAPE_ERROR)
    (tmp_path / "bridged.py").write_text('DEVICE = "cuda"\n' + _SHAPE_ERROR)
    (tmp_path / "auto.py").write_text('import bridge.auto\nDEVICE = "cuda"\n' + _SHAPE_ERROR)
    plain = run_python(str(tmp_path / "plain.py"))
    torch_lines = _traceback_lines(plain.stderr)
    assert torch_lines[-1] == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x16 and 32x4)"
    for command in (["-m", "bridge", "run", str(tmp_path / "bridged.py")], [str(tmp_path / "auto.py")]):
        result = run_python(*command)
        assert result.returncode == 1
        lines = _traceback_lines(result.stderr)
        assert lines[-1] == torch_lines[-1], result.stderr
        assert len(lines) <= 2 * len(torch_lines), result.stderr
        assert "During handling" not in result.stderr and "graph break in" not in result.stderr, result.stderr
        assert not any("/runtime/" in line or "/bridge/" in line or "op_mappings" in line for line in lines), result.stderr
        assert "BRIDGE_DEBUG=1" in result.stderr
    debug = run_python(str(tmp_path / "auto.py"), env={"BRIDGE_DEBUG": "1"})
    assert "runtime/dispatch.py" in debug.stderr and debug.stderr.strip().splitlines()[-3].startswith("RuntimeError")


def test_runner_checks_report_folder_and_device_before_running(tmp_path):
    script = tmp_path / "script.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    result = run_python("-m", "bridge", "run", "--report", str(tmp_path / "missing" / "r.json"), str(script))
    assert result.returncode == 2 and "does not exist" in result.stderr and not marker.exists()
    result = run_python("-m", "bridge", "run", "--device", "tpu", str(script), env={"JAX_PLATFORMS": ""})
    assert result.returncode == 2 and "'tpu'" in result.stderr and not marker.exists(), result.stderr
    auto = tmp_path / "auto.py"
    auto.write_text(f"import bridge.auto\nopen({str(marker)!r}, 'w').close()\n")
    result = run_python(str(auto), env={"BRIDGE_REPORT": str(tmp_path / "missing" / "r.json")})
    assert result.returncode == 1 and "BRIDGE_REPORT" in result.stderr and not marker.exists()


# ------------------------------------------------------------ torch.distributions


def test_distributions_check_arguments_on_the_device(bridged):
    stats.reset()
    with forward_ad.dual_level():  # make_dual asks whether the storages match: answered on the device
        forward_ad.make_dual(torch.ones(2, device="cuda"), torch.ones(2, device="cuda"))
    normal = torch.distributions.Normal(torch.zeros(3, device="cuda"), torch.ones(3, device="cuda"))
    log_prob = normal.log_prob(torch.ones(3, device="cuda"))
    torch.testing.assert_close(log_prob.cpu(), torch.distributions.Normal(torch.zeros(3), torch.ones(3)).log_prob(torch.ones(3)))
    with pytest.raises(ValueError, match="scale"):
        torch.distributions.Normal(torch.zeros(3, device="cuda"), -torch.ones(3, device="cuda"))
    # (op_rung describes every plan made in the process; op_counts only this test's calls)
    assert not [op for op, count in stats.op_counts().items() if count and stats.op_rung.get(op) == stats.CPU_FALLBACK]
    assert torch._is_all_true(torch.tensor([True, False], device="cuda")).item() is False
    assert torch._is_any_true(torch.tensor([True, False], device="cuda")).item() is True
