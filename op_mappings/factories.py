"""Tensor factories (empty, zeros, full, arange, linspace, eye, ...) and the ops that hand values to the host.

Layout, device and memory-format arguments are accepted and ignored: the runtime places results.
`empty*` returns zeros so that runs are deterministic.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import torch

from bridge.runtime import dtypes, versions
from bridge.runtime.registry import aten, jnp_dtype, register_mapping
from .common import default_float


def _scalar_dtype(value):
    """The dtype torch infers from a Python number: bool, int64, the default float, or its complex."""
    inferred = dtypes.result_type([value])
    return dtypes.TORCH_TO_JAX[inferred]


# ---------------------------------------------------------------- constant fills


@register_mapping(aten.empty.memory_format, aten.zeros.default)
def zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(tuple(size), dtype=jnp_dtype(dtype, default_float()))


@register_mapping(aten.empty_strided.default)
def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return zeros(size, dtype=dtype)


@register_mapping(aten.empty_permuted.default)
def empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):
    return zeros(size, dtype=dtype)


@register_mapping(aten.ones.default)
def ones(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), dtype=jnp_dtype(dtype, default_float()))


@register_mapping(aten.full.default)
def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value, dtype=jnp_dtype(dtype, _scalar_dtype(fill_value)))


@register_mapping(aten.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    # Unlike torch.tensor, scalar_tensor makes the default float dtype whatever the number.
    return jnp.asarray(s, dtype=jnp_dtype(dtype, default_float()))


# ---------------------------------------------------------------- fills shaped like another tensor


@register_mapping(aten.zeros_like.default, aten.empty_like.default)
def zeros_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(self.shape, dtype=jnp_dtype(dtype, self.dtype))


@register_mapping(aten.ones_like.default)
def ones_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(self.shape, dtype=jnp_dtype(dtype, self.dtype))


@register_mapping(aten.full_like.default)
def full_like(self, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.full(self.shape, fill_value, dtype=jnp_dtype(dtype, self.dtype))


@register_mapping(aten.new_zeros.default, aten.new_empty.default)
def new_zeros(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), dtype=jnp_dtype(dtype, self.dtype))


@register_mapping(aten.new_empty_strided.default)
def new_empty_strided(self, size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return new_zeros(self, size, dtype=dtype)


@register_mapping(aten.new_ones.default)
def new_ones(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), dtype=jnp_dtype(dtype, self.dtype))


@register_mapping(aten.new_full.default)
def new_full(self, size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value, dtype=jnp_dtype(dtype, self.dtype))


# ---------------------------------------------------------------- ranges


@register_mapping(aten.arange.default)
def arange(end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return arange_start_step(0, end, 1, dtype=dtype)


@register_mapping(aten.arange.start)
def arange_start(start, end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return arange_start_step(start, end, 1, dtype=dtype)


@register_mapping(aten.arange.start_step)
def arange_start_step(start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    result = jnp_dtype(dtype, _scalar_dtype_of_range(start, end, step))
    if any(jax.export.is_symbolic_dim(bound) for bound in (start, end, step)):
        # a dynamic dimension of a jax.export trace (arange(seq_len)): its length in integers
        length = max(0, -(-(end - start) // step))
        return (start + jnp.arange(length, dtype=jnp.int64) * step).astype(result)
    if not jnp.issubdtype(result, jnp.inexact):
        # Integer ranges step from their bounds read as integers: arange(0.5, 5, 1.5, dtype=int64)
        # steps by 1 from 0 (its length: runtime/versions.py).
        if versions.ARANGE_LENGTH_FROM_FLOAT_BOUNDS:
            length = max(0, math.ceil((end - start) / step))
        start, end, step = int(start), int(end), int(step)
        if not versions.ARANGE_LENGTH_FROM_FLOAT_BOUNDS:
            length = max(0, -(-(end - start) // step))
        return (start + jnp.arange(length, dtype=jnp.int64) * step).astype(result)
    length = max(0, math.ceil((end - start) / step))
    # torch computes start + i * step in double and rounds once to the result dtype.
    return (start + jnp.arange(length, dtype=jnp.float64) * step).astype(result)


def _scalar_dtype_of_range(*bounds):
    # Any float bound makes a float range (the default dtype); all-integer bounds make int64.
    if any(isinstance(bound, float) for bound in bounds):
        return default_float()
    return jnp.dtype(jnp.int64)


def _interpolation_dtype(result):
    # torch interpolates float results in their own dtype and integer results in double.
    return result if jnp.issubdtype(result, jnp.inexact) else jnp.dtype(jnp.float64)


def _linspace_values(start, end, steps, result, compute):
    """torch's linspace: the first half counts up from start, the second half down from end, so both ends are exact."""
    # The bounds are first read in the result dtype: linspace(0.1, 3.3, dtype=int64) runs from 0 to 3.
    start = jnp.asarray(start).astype(result).astype(compute)
    end = jnp.asarray(end).astype(result).astype(compute)
    if steps == 1:
        return jnp.reshape(start, (1,))
    rounded = _each_op_rounded(compute)
    if rounded is not None:
        start, end = start.astype(jnp.float32), end.astype(jnp.float32)
    else:
        rounded = lambda value: value  # noqa: E731
    arithmetic = start.dtype
    position = jnp.arange(steps, dtype=jnp.int64)
    step = rounded(rounded(end - start) / jnp.asarray(steps - 1, dtype=arithmetic))
    from_start = rounded(start + rounded(step * position.astype(arithmetic)))
    from_end = rounded(end - rounded(step * (steps - 1 - position).astype(arithmetic)))
    return jnp.where(position < steps // 2, from_start, from_end).astype(compute)


def _each_op_rounded(compute):
    """For float16/bfloat16: a function rounding a float32 value to that format. torch's kernel
    rounds after each operation; XLA fuses 16-bit arithmetic in float32 and would round once
    (linspace(-2., 50., 50, dtype=float16) differs in 18 of 50 values), so the arithmetic runs in
    float32 with an explicit rounding after each step."""
    if compute == jnp.float16:
        return lambda value: lax.reduce_precision(value, exponent_bits=5, mantissa_bits=10)
    if compute == jnp.bfloat16:
        return lambda value: lax.reduce_precision(value, exponent_bits=8, mantissa_bits=7)
    return None


@register_mapping(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar, aten.linspace.Scalar_Tensor)
def linspace(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=None):
    result = jnp_dtype(dtype, default_float())
    return _linspace_values(start, end, steps, result, _interpolation_dtype(result)).astype(result)


@register_mapping(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar, aten.logspace.Scalar_Tensor)
def logspace(start, end, steps, base=10.0, *, dtype=None, layout=None, device=None, pin_memory=None):
    result = jnp_dtype(dtype, default_float())
    # torch raises base to exponents computed in double.
    if steps == 1:
        # torch fills base ** start with start read in double, not first rounded to the result
        # dtype (logspace(4.3, 4, 1, dtype=bfloat16) is 10 ** 4.3 rounded once, not 10 ** 4.3125).
        wide = jnp.complex128 if jnp.issubdtype(result, jnp.complexfloating) else jnp.float64
        exponents = jnp.reshape(jnp.asarray(start).astype(wide), (1,))
        return jnp.power(jnp.asarray(base, dtype=wide), exponents).astype(result)
    exponents = _linspace_values(start, end, steps, result, jnp.dtype(jnp.float64))
    return jnp.power(jnp.asarray(base, dtype=jnp.float64), exponents).astype(result)


@register_mapping(aten.eye.default)
def eye(n, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, dtype=jnp_dtype(dtype, default_float()))


@register_mapping(aten.eye.m)
def eye_m(n, m, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, m, dtype=jnp_dtype(dtype, default_float()))


@register_mapping(aten.tril_indices.default)
def tril_indices(row, col, offset=0, *, dtype=torch.int64, layout=None, device=None, pin_memory=None):
    return jnp.stack(jnp.tril_indices(row, offset, col)).astype(jnp_dtype(dtype, jnp.dtype(jnp.int64)))


@register_mapping(aten.triu_indices.default)
def triu_indices(row, col, offset=0, *, dtype=torch.int64, layout=None, device=None, pin_memory=None):
    return jnp.stack(jnp.triu_indices(row, offset, col)).astype(jnp_dtype(dtype, jnp.dtype(jnp.int64)))


# ---------------------------------------------------------------- values from and to the host


@register_mapping(aten.lift_fresh.default, aten.lift_fresh_copy.default, identity_view=True, host_tensors=True)
def lift_fresh(self):
    return self


@register_mapping(aten._local_scalar_dense.default, meta="data-dependent")
def local_scalar_dense(self):
    # `.item()`: a host sync by definition, so the one entry that is not traceable on purpose.
    # torch allows it on any one-element tensor, not only 0-dim ones. The copy to the host
    # waits for this value only: a device-side reshape would queue behind everything already
    # launched (a training step's optimizer update), so `loss.item()` would return later and
    # the next step's host work would start on an idle device.
    self = np.asarray(self).reshape(())
    kind = self.dtype.kind
    if kind == "b":
        return bool(self)
    if kind in "iu":
        return int(self)
    if kind == "c":
        return complex(self)
    return float(self)
