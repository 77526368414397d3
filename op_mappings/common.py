"""Helpers shared by the mapping tables: accumulation dtypes, per-signature compilation, int-list arguments."""

import functools

import jax
import jax.numpy as jnp
import torch

from bridge.runtime.dtypes import TORCH_TO_JAX

# Half-precision floats, which torch's kernels accumulate in float32. (runtime/dtypes.py's
# _LOW_PRECISION is the same set as torch dtypes, for promotion.)
LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def accumulator_dtype(dtype):
    """The dtype torch's kernels accumulate `dtype` in: float32 for half precision, else `dtype` itself."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if dtype in LOW_PRECISION else dtype


def is_integral(array):
    """Whether torch counts the array's dtype as integral (bool included)."""
    return jnp.issubdtype(array.dtype, jnp.integer) or array.dtype == jnp.bool_


def default_float():
    """torch's default float dtype (torch.get_default_dtype()) as a JAX dtype."""
    return TORCH_TO_JAX[torch.get_default_dtype()]


def _hashable(value):
    return tuple(_hashable(item) for item in value) if isinstance(value, list) else value


def compiled(*static_names):
    """Compile a helper as one XLA program per signature, the named arguments static (lists become tuples).

    Op by op, a window computation or a vjp would dispatch and compile each primitive separately.
    """

    def decorate(function):
        program = jax.jit(function, static_argnames=static_names)

        @functools.wraps(function)
        def run(*args, **kwargs):
            return program(*map(_hashable, args), **{name: _hashable(value) for name, value in kwargs.items()})

        return run

    return decorate


def expand_ints(values, count):
    """An int list argument as a tuple of `count` entries (torch repeats a single entry)."""
    values = tuple(values) if isinstance(values, (list, tuple)) else (values,)
    return values * count if len(values) == 1 else values


def linear_backward(forward, grad_output, like):
    """The gradient of a linear map `forward` at input shape/dtype `like`, applied to grad_output."""
    _, pullback = jax.vjp(forward, jnp.zeros(like.shape, dtype=like.dtype))
    return pullback(grad_output.astype(like.dtype))[0]
