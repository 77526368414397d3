"""torch.Generator objects made for "cuda" by scripts written for a GPU, and torch.cuda's seeding,
under the bridge. Eager torch on the CPU is the oracle: a bridge generator holds a torch CPU
generator's state, so factories drawing from it give the numbers torch gives for the same seed."""

import copy
import pickle

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from bridge.runtime import BridgeTensor, capture


def _host(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("make", [
    lambda: torch.Generator(device="cuda"),
    lambda: torch.Generator("cuda"),
    lambda: torch.Generator(torch.device("cuda", 0)),
    lambda: torch.Generator("cuda:0"),
], ids=["device=cuda", "positional", "torch.device", "cuda:0"])
def test_cuda_generator_is_a_generator_on_the_bridge_device(bridged, make):
    generator = make()
    assert isinstance(generator, torch.Generator)
    assert generator.device == torch.device("cuda", 0) and generator.device.type == "cuda"
    assert generator.manual_seed(42) is generator
    assert generator.initial_seed() == 42
    seed = generator.seed()
    assert isinstance(seed, int) and generator.initial_seed() == seed
    # torch's own generators still pass isinstance checks (DataLoader, transformers make them).
    assert isinstance(torch.default_generator, torch.Generator)
    assert isinstance(torch.Generator(), torch.Generator) and torch.Generator().device.type == "cpu"


def test_bad_generator_ordinal_is_a_clear_error(bridged):
    with pytest.raises(bridged.DeviceError, match="ordinal 7"):
        torch.Generator("cuda:7")


@pytest.mark.parametrize("draw", [
    lambda g, device: torch.randn(4, 3, generator=g, device=device),
    lambda g, device: torch.rand(5, generator=g, device=device, dtype=torch.float64),
    lambda g, device: torch.randint(0, 100, (6,), generator=g, device=device),
    lambda g, device: torch.randperm(10, generator=g, device=device),
    lambda g, device: torch.normal(2.0, 3.0, (4,), generator=g, device=device),
], ids=["randn", "rand", "randint", "randperm", "normal"])
def test_factories_with_a_cuda_generator_match_torch_for_the_seed(bridged, draw):
    generator = torch.Generator(device="cuda").manual_seed(123)
    first, second = draw(generator, "cuda"), draw(generator, "cuda")
    host = _host(123)
    expected_first, expected_second = draw(host, "cpu"), draw(host, "cpu")
    assert isinstance(first, BridgeTensor) and first.device.type == "cuda"
    assert torch.equal(first.cpu(), expected_first) and torch.equal(second.cpu(), expected_second)
    generator.manual_seed(123)
    assert torch.equal(draw(generator, "cuda").cpu(), expected_first)


def test_get_state_and_set_state_round_trip(bridged):
    generator = torch.Generator("cuda").manual_seed(7)
    torch.randn(3, generator=generator, device="cuda")
    state = generator.get_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    after = torch.randn(8, generator=generator, device="cuda").cpu()
    generator.set_state(state)
    assert torch.equal(torch.randn(8, generator=generator, device="cuda").cpu(), after)
    # The state is torch's: a host generator given it continues the same stream.
    host = torch.Generator()
    host.set_state(state)
    assert torch.equal(torch.randn(8, generator=host), after)
    clone = generator.clone_state()
    assert clone.device.type == "cuda"


def test_copies_and_pickles_keep_device_and_stream(bridged):
    generator = torch.Generator("cuda").manual_seed(11)
    for copied in (copy.deepcopy(generator), pickle.loads(pickle.dumps(generator))):
        assert copied.device == torch.device("cuda", 0) and copied.initial_seed() == 11
        assert torch.equal(torch.rand(4, generator=copied, device="cuda").cpu(), torch.rand(4, generator=_host(11)))


def test_ops_on_bridge_tensors_follow_the_generator_not_the_global_stream(bridged):
    """torch's bit streams are not reproduced on the device (docs/design.md); the draws must
    repeat for a seed, differ between seeds, follow the distributions, and leave the global
    generator where it was."""
    generator = torch.Generator(device="cuda")
    probabilities = torch.tensor([0.1, 0.2, 0.7], device="cuda")

    def draws(seed):
        generator.manual_seed(seed)
        zeros = torch.zeros(20_000, device="cuda")
        return (
            zeros.clone().normal_(generator=generator).cpu(),
            zeros.clone().uniform_(-1, 1, generator=generator).cpu(),
            torch.bernoulli(torch.full((20_000,), 0.3, device="cuda"), generator=generator).cpu(),
            torch.multinomial(probabilities, 20_000, replacement=True, generator=generator).cpu(),
        )

    torch.manual_seed(0)
    expected_global = torch.rand(5, device="cuda").cpu()
    torch.manual_seed(0)
    first = draws(1)
    assert torch.equal(torch.rand(5, device="cuda").cpu(), expected_global), "the global stream moved"
    second, other = draws(1), draws(2)
    for a, b, c in zip(first, second, other):
        assert torch.equal(a, b) and not torch.equal(a, c)
    normal, uniform, bernoulli, categories = first
    assert abs(normal.mean().item()) < 0.03 and abs(normal.std().item() - 1.0) < 0.03
    assert uniform.min() >= -1 and uniform.max() < 1 and abs(uniform.mean().item()) < 0.03
    assert abs(bernoulli.mean().item() - 0.3) < 0.02
    frequencies = torch.bincount(categories, minlength=3).double() / 20_000
    torch.testing.assert_close(frequencies, torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64), atol=0.02, rtol=0)


def test_dataloader_and_random_split_with_a_cuda_generator_match_torch(bridged):
    dataset = TensorDataset(torch.arange(30.0))

    def order(generator):
        loader = DataLoader(dataset, batch_size=7, shuffle=True, generator=generator)
        return [batch[0].tolist() for batch in loader]

    def split(generator):
        return [list(part.indices) for part in random_split(dataset, [0.5, 0.3, 0.2], generator=generator)]

    assert order(torch.Generator("cuda").manual_seed(3)) == order(_host(3))
    assert split(torch.Generator("cuda").manual_seed(4)) == split(_host(4))
    generator = torch.Generator("cuda").manual_seed(3)
    assert order(generator) != order(generator), "a second epoch reshuffles"


def test_cuda_manual_seed_reseeds_device_draws_only(bridged):
    def device_draws():
        return torch.randn(5, device="cuda").cpu(), nn.functional.dropout(torch.ones(100, device="cuda"), 0.5).cpu()

    for seed_cuda in (torch.cuda.manual_seed, torch.cuda.manual_seed_all):
        seed_cuda(5)
        first = device_draws()
        seed_cuda(5)
        second = device_draws()
        assert all(torch.equal(a, b) for a, b in zip(first, second))
    # As in torch, seeding the device leaves the host generator's stream alone.
    torch.manual_seed(1)
    expected = torch.randn(4)
    torch.manual_seed(1)
    torch.cuda.manual_seed_all(99)
    torch.randn(3, device="cuda")
    assert torch.equal(torch.randn(4), expected)
    torch.cuda.seed_all()
    assert torch.cuda.initial_seed() != 99


class _Noisy(nn.Module):
    def __init__(self, generator=None):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.generator = generator

    def forward(self, x):
        return self.linear(x) + torch.randn(3, device=x.device, generator=self.generator)


def test_random_factories_in_a_captured_module_draw_anew_on_each_call(bridged):
    previous = bridged.set_mode("captured")
    try:
        module = _Noisy().cuda()
        x = torch.zeros(2, 3, device="cuda")
        torch.manual_seed(0)
        first = [module(x).detach().cpu() for _ in range(3)]
        torch.manual_seed(0)
        second = [module(x).detach().cpu() for _ in range(3)]
        assert all(torch.equal(a, b) for a, b in zip(first, second))
        assert not torch.equal(first[1], first[2]), "a replay repeated the first call's numbers"
        assert not any(b.region.startswith("_Noisy") for b in capture.breaks)

        generator = torch.Generator("cuda")
        seeded = _Noisy(generator).cuda()
        generator.manual_seed(1)
        third = [seeded(x).detach().cpu() for _ in range(3)]
        generator.manual_seed(1)
        fourth = [seeded(x).detach().cpu() for _ in range(3)]
        assert all(torch.equal(a, b) for a, b in zip(third, fourth)) and not torch.equal(third[1], third[2])
        assert any("torch.Generator" in b.reason for b in capture.breaks), "a generator's draws run eagerly"
    finally:
        bridged.set_mode(previous)


def test_plain_generators_are_torch_s_own_after_deactivation():
    import bridge

    if bridge.is_active():
        pytest.skip("the bridge is active for the whole session")
    with bridge.active():
        generator = torch.Generator("cuda").manual_seed(2)
    assert torch.Generator is torch._C.Generator
    # What was made while active keeps working as a host generator.
    assert torch.equal(torch.rand(3, generator=generator), torch.rand(3, generator=_host(2)))
