"""The RNG model: a JAX PRNG key seeded from torch's seed, split once per random op.

Bit parity with torch's generators is not a goal; reproducibility from
`torch.manual_seed` and torch's distributions are.
"""

import jax
import numpy as np
import torch

from . import devices
from .config import settings
from .errors import GraphBreak

_state = {"key": None, "seed": 0}


def seed(value):
    """Reseed the bridge's generator (called from torch.manual_seed and friends)."""
    _state["seed"] = int(value) & 0xFFFFFFFFFFFFFFFF
    _state["key"] = None


def get_seed():
    return _state["seed"]


def _seeded_key():
    key = jax.random.key(np.uint64(_state["seed"]) if _state["seed"] >= 2**63 else _state["seed"])
    return _placed(key)


def _placed(key):
    """The key on the first bridge device (devices.first_device), committed there, as the captured programs that take
    and return it leave it: an uncommitted first key made the first program compile again on
    its second call."""
    return jax.device_put(key, devices.first_device())


def current_key():
    """The generator's key, without advancing it (what a captured program takes and returns)."""
    if _state["key"] is None:
        _state["key"] = _seeded_key()
    return _state["key"]


def key_on(index):
    """The generator's key on bridge device `index`: a region's program runs on its tensors'
    device (a model on `cuda:1`) and takes the key there."""
    return _on(current_key(), index)


def _on(key, index):
    """The key on bridge device `index`, moved there where it is on another (the stream's key
    lives on the first device: an op's or program's key must be on its device)."""
    if index is None or isinstance(key, jax.core.Tracer):
        return key
    device = devices.jax_device(index)
    return key if key.devices() == {device} else jax.device_put(key, device)  # (a key array's .sharding costs 30 us)


def swap_key(key):
    """Make `key` the generator's key and return the one it replaces (None if unseeded yet): a
    captured program's trace draws from its traced key, and a run leaves the key it returns."""
    previous = _state["key"]
    _state["key"] = key
    return previous


def next_key(index=None):
    """A fresh key for one random op; advances the state. `index`: the bridge device the op
    runs on, where the key is put."""
    key, sub = _split(current_key())
    _state["key"] = key
    return _on(sub, index)


# jax.random.split called directly costs about 300 us of Python on a 2-core CPU; as one jitted
# call, 40 (each eager random op draws a key).
_split = jax.jit(lambda key: tuple(jax.random.split(key)))


def get_state():
    """The generator's state as bytes (what torch.cuda.get_rng_state returns as a uint8 tensor)."""
    data = np.asarray(jax.random.key_data(current_key()), dtype=np.uint32)
    return np.uint64(_state["seed"]).tobytes() + data.tobytes()


def set_state(state):
    """Restore a state from get_state()."""
    state = bytes(state)
    _state["seed"] = int(np.frombuffer(state[:8], dtype=np.uint64)[0])
    data = np.frombuffer(state[8:], dtype=np.uint32)
    _state["key"] = _placed(jax.random.wrap_key_data(jax.numpy.asarray(data)))


def generator_key(generator, index=None):
    """A key for one random op called with `generator=`: seeded from 63 bits drawn from that
    torch generator, so the op follows the generator's seed and state, not the global stream.

    A region being captured cannot take the draw (it happens on the host, once, and a replay
    would repeat its numbers): the region runs eagerly instead.
    """
    refuse_host_draw_in_trace("a random op")
    seed_value = torch.empty((), dtype=torch.int64, device="cpu").random_(generator=generator).item()
    return _on(jax.random.key(seed_value), index)


def refuse_host_draw_in_trace(what):
    """Inside a region being captured, a draw from a torch.Generator (on the host, once) would
    enter the program as a constant and repeat on every replay: the region runs eagerly instead."""
    if settings.tracing:
        raise GraphBreak(f"{what} draws from a torch.Generator passed to it (its state lives on the host)")
