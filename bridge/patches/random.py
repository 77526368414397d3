"""Randomness: torch's seeding functions also seed the bridge's JAX generator, and
`torch.Generator("cuda")` makes a generator for the bridge device."""

import torch

from bridge.runtime import devices, random

from . import collect, replace, wrap

_TorchGenerator = torch._C.Generator


@wrap(torch, "manual_seed")
def manual_seed(wrapped, instance, args, kwargs):
    generator = wrapped(*args, **kwargs)
    random.seed(torch.initial_seed())
    return generator


@wrap(torch.random, "manual_seed")
def random_manual_seed(wrapped, instance, args, kwargs):
    generator = wrapped(*args, **kwargs)
    random.seed(torch.initial_seed())
    return generator


@wrap(torch, "seed")
def seed(wrapped, instance, args, kwargs):
    value = wrapped(*args, **kwargs)
    random.seed(value)
    return value


def _seed_bridge(wrapped, instance, args, kwargs):
    seed_value = args[0] if args else kwargs["seed"]
    random.seed(int(seed_value))


@wrap(torch.cuda, "manual_seed")
def cuda_manual_seed(wrapped, instance, args, kwargs):
    _seed_bridge(wrapped, instance, args, kwargs)


@wrap(torch.cuda, "manual_seed_all")
def cuda_manual_seed_all(wrapped, instance, args, kwargs):
    _seed_bridge(wrapped, instance, args, kwargs)


@replace(torch.cuda, "seed")
def cuda_seed():
    random.seed(_TorchGenerator().seed())


@replace(torch.cuda, "seed_all")
def cuda_seed_all():
    cuda_seed()


class BridgeGenerator(_TorchGenerator):
    """A `torch.Generator` of a bridge device ('cuda:N'), what `torch.Generator("cuda")` returns.

    Its state is that of a torch CPU generator, so `manual_seed`, `seed`, `initial_seed`,
    `get_state` and `set_state` are torch's own. Factories that name the bridge device and this
    generator draw on the host with it (the numbers torch's CPU generator gives for the seed) and
    copy the result; random ops on bridge tensors take their JAX key from 63 bits drawn from it
    (runtime.random.generator_key). Either way the draws follow its seed and state alone.
    """

    def __new__(cls, index=0):
        devices.jax_device(index)  # validates the ordinal
        generator = super().__new__(cls)
        generator._index = index
        return generator

    @property
    def device(self):
        return devices.torch_device(self._index)

    def clone_state(self):
        clone = BridgeGenerator(self._index)
        clone.set_state(self.get_state())
        return clone

    def __reduce__(self):
        _cls, _device, state = super().__reduce__()
        return BridgeGenerator, (self._index,), state


class _AnyTorchGenerator(type(_TorchGenerator)):
    """Metaclass of the patched `torch.Generator`: `isinstance(g, torch.Generator)` stays true
    for every generator, torch's own (`torch.default_generator`, ...) included."""

    def __instancecheck__(cls, instance):
        return isinstance(instance, _TorchGenerator)

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, _TorchGenerator)


@replace(torch, "Generator")
class Generator(_TorchGenerator, metaclass=_AnyTorchGenerator):
    """`torch.Generator(device)`: a BridgeGenerator for a bridge device, torch's own for any other
    (torch's CPU build cannot make a CUDA generator: it has no CUDA library)."""

    def __new__(cls, device="cpu"):
        index = devices.bridge_index(device)
        if index is None:
            return _TorchGenerator(device)
        return BridgeGenerator(index)


def _state_tensor():
    return torch.frombuffer(bytearray(random.get_state()), dtype=torch.uint8)


@replace(torch.cuda, "get_rng_state")
def get_rng_state(device="cuda"):
    return _state_tensor()


@replace(torch.cuda, "set_rng_state")
def set_rng_state(new_state, device="cuda"):
    random.set_state(new_state.to(torch.uint8).cpu().numpy().tobytes())


@replace(torch.cuda, "get_rng_state_all")
def get_rng_state_all():
    # One generator serves every bridge device.
    return [_state_tensor() for _ in range(torch.cuda.device_count())]


@replace(torch.cuda, "set_rng_state_all")
def set_rng_state_all(new_states):
    set_rng_state(new_states[0])


@replace(torch.cuda, "initial_seed")
def initial_seed():
    return random.get_seed()


PATCHES = collect(dict(globals()))
