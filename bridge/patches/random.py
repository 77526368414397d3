"""Randomness: torch's seeding functions also seed the bridge's JAX generator."""

import torch

from runtime import random

from . import collect, replace, wrap


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
