"""A default device that names "cuda" (`torch.set_default_device`, `with torch.device("cuda"):`)
under the bridge: factories make bridge tensors, modules built in the block have their parameters
on the bridge device. Eager torch on the CPU is the oracle for the values."""


import pytest
import torch
import torch.nn as nn
import torch.utils._device

from bridge.runtime import BridgeTensor
from bridge.runtime.tensor import read_value

FACTORIES = {
    "zeros": lambda: torch.zeros(2, 3),
    "ones": lambda: torch.ones(4, dtype=torch.float64),
    "full": lambda: torch.full((2, 2), 7),
    "empty": lambda: torch.empty(3).zero_(),
    "arange": lambda: torch.arange(10),
    "linspace": lambda: torch.linspace(0, 1, 5),
    "eye": lambda: torch.eye(3),
    "tensor": lambda: torch.tensor([[1.5, -2.0], [3.0, 4.0]]),
    "as_tensor": lambda: torch.as_tensor([1, 2, 3]),
    "scalar_tensor": lambda: torch.scalar_tensor(2.5),
    "tril_indices": lambda: torch.tril_indices(3, 3),
}


@pytest.fixture
def default_device_reset():
    try:
        yield
    finally:
        torch.set_default_device(None)


def _assert_on_bridge(actual, expected):
    assert isinstance(actual, BridgeTensor) and actual.device == torch.device("cuda", 0)
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.cpu(), expected)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_set_default_device_makes_factories_create_bridge_tensors(bridged, default_device_reset, name):
    expected = FACTORIES[name]()
    torch.set_default_device("cuda")
    _assert_on_bridge(FACTORIES[name](), expected)
    torch.set_default_device(None)
    plain = FACTORIES[name]()
    assert type(plain) is torch.Tensor and plain.device.type == "cpu"
    torch.testing.assert_close(plain, expected)


def test_default_device_queries_and_explicit_devices(bridged, default_device_reset):
    assert torch.get_default_device() == torch.device("cpu")
    torch.set_default_device("cuda")
    assert torch.get_default_device() == torch.device("cuda", 0)
    random = torch.randn(3, 4)
    assert isinstance(random, BridgeTensor) and random.shape == (3, 4) and random.is_cuda
    assert type(torch.zeros(2, device="cpu")) is torch.Tensor
    assert torch.zeros(2, device="meta").device.type == "meta"
    assert torch.ones(2, device="cuda:0").device == torch.device("cuda", 0)
    assert (torch.arange(4) * 2).tolist() == [0, 2, 4, 6]
    torch.set_default_device("cpu")
    assert torch.get_default_device() == torch.device("cpu")
    assert type(torch.zeros(2)) is torch.Tensor


def test_default_device_draws_are_reproducible_from_the_seed(bridged, default_device_reset):
    torch.set_default_device("cuda")
    torch.manual_seed(3)
    first = torch.randn(100), torch.randint(0, 10, (50,)), torch.randperm(20)
    torch.manual_seed(3)
    second = torch.randn(100), torch.randint(0, 10, (50,)), torch.randperm(20)
    for a, b in zip(first, second):
        assert isinstance(a, BridgeTensor) and torch.equal(a.cpu(), b.cpu())
    assert sorted(first[2].tolist()) == list(range(20))


def _state_from(module):
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def test_module_built_in_a_device_block_lives_on_the_bridge_and_trains_as_torch(bridged):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 2))
    with torch.device("cuda"):
        model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 2))
        assert torch.zeros(1).is_cuda
    assert type(torch.zeros(1)) is torch.Tensor, "leaving the block restores the host default"
    for parameter in model.parameters():
        assert isinstance(parameter, nn.Parameter) and isinstance(parameter, BridgeTensor)
        assert parameter.device == torch.device("cuda", 0) and parameter.requires_grad
    # nn.init ran on the bridge device: different numbers than torch's, torch's distribution.
    bound = 1 / 6**0.5
    weight = model[0].weight.detach().cpu()
    assert weight.abs().max() <= bound and weight.std() > bound / 3
    model.load_state_dict(_state_from(reference))

    x, y = torch.randn(5, 6), torch.randn(5, 2)
    results = []
    for net, device in ((reference, "cpu"), (model, "cuda")):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(net(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
        results.append((loss.item(), [p.detach().cpu() for p in net.parameters()]))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    for actual, expected in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_nested_device_blocks(bridged):
    with torch.device("cuda"):
        with torch.device("cpu"):
            assert type(torch.ones(1)) is torch.Tensor
        assert isinstance(torch.ones(1), BridgeTensor)
    assert type(torch.ones(1)) is torch.Tensor


def test_plain_torch_unaffected_when_the_bridge_is_not_active():
    import bridge

    if bridge.is_active():
        pytest.skip("the bridge is active for the whole session")
    original = torch.utils._device.DeviceContext
    with bridge.active():
        assert torch.utils._device.DeviceContext is not original
        with torch.device("cuda"):
            assert torch.zeros(1).is_cuda
    assert torch.utils._device.DeviceContext is original
    with torch.device("cpu"):
        layer = nn.Linear(2, 3)
    assert type(layer.weight) is nn.Parameter and layer.weight.device.type == "cpu"
    torch.set_default_device("cpu")
    try:
        assert type(torch.zeros(2)) is torch.Tensor and torch.get_default_device() == torch.device("cpu")
    finally:
        torch.set_default_device(None)
    with torch.device("meta"):
        assert torch.empty(2).device.type == "meta"


def test_default_device_set_before_activation_is_kept(default_device_reset):
    """A script may set a default device before `import bridge.auto` runs: torch's bookkeeping
    of the mode stack must still recognise that context once the class is patched."""
    import bridge

    if bridge.is_active():
        pytest.skip("the bridge is active for the whole session")
    torch.set_default_device("cpu")
    with bridge.active():
        with torch.device("cuda"):
            assert torch.zeros(1).is_cuda
        assert type(torch.zeros(1)) is torch.Tensor
        torch.set_default_device("cuda")
        assert torch.zeros(1).is_cuda
        torch.set_default_device(None)
        assert type(torch.zeros(1)) is torch.Tensor


def test_cuda_device_context_switches_the_current_device(bridged):
    with torch.cuda.device(0):
        assert torch.cuda.current_device() == 0
        assert torch.zeros(1, device="cuda").device == torch.device("cuda", 0)
    with torch.cuda.device_of(torch.ones(1, device="cuda")):
        assert torch.cuda.current_device() == 0
    with torch.cuda.device(-1):  # torch: a negative index is a no-op
        assert torch.cuda.current_device() == 0
    assert torch.cuda.is_initialized() and torch.cuda._initialized


def test_repeated_factories_give_fresh_tensors_of_the_same_values(bridged):
    """A small deterministic factory's integer or bool result is kept (its host value, and its
    device copy once made) and shared by later calls with the same arguments: each call still
    returns a tensor of its own, and what the arguments tell apart (1, 1.0 and True; 0.0 and
    -0.0; the default dtype) stays apart."""
    first = torch.arange(5, device="cuda")
    first.add_(10)  # written in place: the next call's tensor is not
    second = torch.arange(5, device="cuda")
    assert second is not first and second.tolist() == [0, 1, 2, 3, 4]
    made = {repr(value): torch.full((2,), value, device="cuda") for value in (1, 1.0, True, 0.0, -0.0)}
    for value in (1, 1.0, True, 0.0, -0.0):
        expected = torch.full((2,), value)
        assert made[repr(value)].dtype == expected.dtype and torch.equal(made[repr(value)].cpu(), expected)
    assert torch.copysign(torch.ones(2), made["-0.0"].cpu()).tolist() == [-1.0, -1.0]
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert torch.zeros(3, device="cuda").dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert torch.zeros(3, device="cuda").dtype == previous
    # An array freed under a shared tensor is made anew.
    read_value(torch.ones(4, dtype=torch.long, device="cuda")).delete()
    assert torch.ones(4, dtype=torch.long, device="cuda").tolist() == [1] * 4
    assert (read_value(torch.ones(4, dtype=torch.long, device="cuda")) == 1).all()
    # Floating-point results are not shared: an optimizer step donates parameters' arrays.
    first, second = torch.zeros(3, device="cuda"), torch.zeros(3, device="cuda")
    assert first._value is not second._value


def test_a_default_device_still_reaches_factories_that_were_stand_ins_when_torch_first_listed_them(
    bridged, default_device_reset, monkeypatch
):
    """torch caches its list of factories on first use: where a stand-in replaced `torch.linspace`
    then (another library's, a test's), torch's own list misses the real one (an order-dependent
    failure of the suite); the bridge's default device keeps its own list."""
    constructors = torch.utils._device._device_constructors
    original = torch.linspace
    constructors.cache_clear()
    with monkeypatch.context() as patched:
        patched.setattr(torch, "linspace", lambda *args, **kwargs: original(*args, **kwargs))
        constructors()
    try:
        torch.set_default_device("cuda")
        _assert_on_bridge(torch.linspace(0, 1, 5), torch.linspace(0, 1, 5, device="cpu"))
    finally:
        constructors.cache_clear()
