"""View bookkeeping: the steps of a view chain, and writes scattered back into a root."""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def freeze(value):
    """A hashable form of a view op's argument (lists of sizes become tuples)."""
    if isinstance(value, list):
        return tuple(freeze(item) for item in value)
    return value


class ViewStep:
    """One view op applied to the previous value in a chain: op(value, *args, **kwargs)[output]."""

    __slots__ = ("call", "op", "args", "kwargs", "output", "_hash")

    def __init__(self, mapping, args, kwargs, output):
        self.call = mapping.call
        self.op = mapping.op
        self.args = tuple(freeze(argument) for argument in args)
        self.kwargs = tuple(sorted((name, freeze(value)) for name, value in kwargs.items()))
        self.output = output
        self._hash = hash((self.op, self.args, self.kwargs, self.output))

    def __call__(self, value):
        result = self.call(value, *self.args, **dict(self.kwargs))
        return result if self.output is None else result[self.output]

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return (
            isinstance(other, ViewStep)
            and (self.op, self.args, self.kwargs, self.output) == (other.op, other.args, other.kwargs, other.output)
        )

    def __repr__(self):
        return f"ViewStep({self.op}, {self.args}, {self.kwargs}, {self.output})"


@functools.lru_cache(maxsize=4096)
def _index_map(shape, chain):
    """Flat root positions of every element of the view (None when the view is the whole root in order)."""
    with jax.ensure_compile_time_eval():
        size = int(np.prod(shape, dtype=np.int64))
        positions = jnp.arange(size, dtype=jnp.int64).reshape(shape)
        for step in chain:
            positions = step(positions)
        positions = np.asarray(positions).reshape(-1)
    if positions.size == size and np.array_equal(positions, np.arange(size)):
        return None
    return positions


def scatter_into_root(root_value, chain, value):
    """The root's new value after `value` is written into the view that `chain` makes of it."""
    positions = _index_map(tuple(root_value.shape), chain)
    if value.dtype != root_value.dtype:
        value = value.astype(root_value.dtype)
    if positions is None:
        return jnp.reshape(value, root_value.shape)
    flat = jnp.ravel(root_value).at[positions].set(jnp.ravel(value))
    return flat.reshape(root_value.shape)
