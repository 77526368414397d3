"""The RNG model: a JAX PRNG key seeded from torch's seed, split once per random op.

Bit parity with torch's generators is not a goal; reproducibility from
`torch.manual_seed` and torch's distributions are.
"""

import jax
import numpy as np

_state = {"key": None, "seed": 0}


def seed(value):
    """Reseed the bridge's generator (called from torch.manual_seed and friends)."""
    _state["seed"] = int(value) & 0xFFFFFFFFFFFFFFFF
    _state["key"] = None


def next_key():
    """A fresh key for one random op; advances the state."""
    key = _state["key"]
    if key is None:
        key = jax.random.key(np.uint64(_state["seed"]) if _state["seed"] >= 2**63 else _state["seed"])
    key, sub = jax.random.split(key)
    _state["key"] = key
    return sub


def get_state():
    return dict(_state)


def set_state(state):
    _state.update(state)
