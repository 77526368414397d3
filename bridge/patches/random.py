"""Randomness: torch's seeding functions also seed the bridge's JAX generator."""

import torch

from runtime import random

from . import collect, wrap


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


PATCHES = collect(dict(globals()))
