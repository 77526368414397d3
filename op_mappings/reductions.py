"""Reductions (sum, mean, extrema, variance, norms, logical all/any) and cumulative scans.

torch's result dtypes are spelled out here: integer sums widen to int64, and bfloat16/float16
accumulate in float32 before the result is rounded back.
"""

import math

import jax
import jax.numpy as jnp
import torch

from runtime.registry import aten, jnp_dtype, register_mapping


_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _is_integral(array):
    return jnp.issubdtype(array.dtype, jnp.integer) or array.dtype == jnp.bool_


def _axes(self, dim):
    """jnp axes for torch's dim argument: None or [] means every dimension; a 0-dim input has none."""
    if self.ndim == 0 or dim is None:
        return None
    if isinstance(dim, int):
        return (dim,)
    return tuple(dim) if len(dim) else None


def _accumulator(dtype):
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) in _LOW_PRECISION else jnp.dtype(dtype)


def _widened(self, dtype):
    """The result dtype of sum/prod/cumsum: an explicit dtype, else int64 for integers and bools."""
    if dtype is not None:
        return jnp_dtype(dtype)
    return jnp.dtype(jnp.int64) if _is_integral(self) else self.dtype


# ---------------------------------------------------------------- sums and products


@register_mapping(aten.sum.default, aten.sum.dim_IntList)
def sum_reduction(self, dim=None, keepdim=False, *, dtype=None):
    result = _widened(self, dtype)
    total = jnp.sum(self, axis=_axes(self, dim), keepdims=keepdim, dtype=_accumulator(result))
    return total.astype(result)


@register_mapping(aten.nansum.default)
def nansum(self, dim=None, keepdim=False, *, dtype=None):
    result = _widened(self, dtype)
    total = jnp.nansum(self, axis=_axes(self, dim), keepdims=keepdim, dtype=_accumulator(result))
    return total.astype(result)


@register_mapping(aten.prod.default, aten.prod.dim_int)
def prod_reduction(self, dim=None, keepdim=False, *, dtype=None):
    result = _widened(self, dtype)
    total = jnp.prod(self, axis=_axes(self, dim), keepdims=keepdim, dtype=_accumulator(result))
    return total.astype(result)


@register_mapping(aten.mean.default, aten.mean.dim)
def mean(self, dim=None, keepdim=False, *, dtype=None):
    result = jnp_dtype(dtype, self.dtype)
    average = jnp.mean(self.astype(_accumulator(result)), axis=_axes(self, dim), keepdims=keepdim)
    return average.astype(result)


def _scan(function, self, dim, dtype):
    result = _widened(self, dtype)
    values = self.astype(_accumulator(result))
    if self.ndim == 0:
        return values.astype(result)
    # Accumulate in float32 for low precision, rounding each partial result once, as torch's kernels do.
    return function(values, axis=dim).astype(result)


@register_mapping(aten.cumsum.default)
def cumsum(self, dim, *, dtype=None):
    return _scan(jnp.cumsum, self, dim, dtype)


@register_mapping(aten.cumprod.default)
def cumprod(self, dim, *, dtype=None):
    return _scan(jnp.cumprod, self, dim, dtype)


@register_mapping(aten.logcumsumexp.default)
def logcumsumexp(self, dim):
    values = self.astype(_accumulator(self.dtype))
    if self.ndim == 0:
        return self
    return jax.lax.cumlogsumexp(values, axis=dim % self.ndim).astype(self.dtype)


@register_mapping(aten.logsumexp.default)
def logsumexp(self, dim, keepdim=False):
    result = jnp.dtype(jnp_dtype(torch.get_default_dtype())) if _is_integral(self) else self.dtype
    values = self.astype(_accumulator(result))
    return jax.nn.logsumexp(values, axis=_axes(self, dim), keepdims=keepdim).astype(result)


# ---------------------------------------------------------------- extrema


@register_mapping(aten.amax.default)
def amax(self, dim=(), keepdim=False):
    return jnp.max(self, axis=_axes(self, dim), keepdims=keepdim)


@register_mapping(aten.amin.default)
def amin(self, dim=(), keepdim=False):
    return jnp.min(self, axis=_axes(self, dim), keepdims=keepdim)


@register_mapping(aten.max.default)
def max_all(self):
    return jnp.max(self)


@register_mapping(aten.min.default)
def min_all(self):
    return jnp.min(self)


def _index_reduction(self, dim, keepdim, function):
    if self.ndim == 0:
        return jnp.zeros((), dtype=jnp.int64)
    if dim is None:
        # torch flattens; keepdim then keeps every dimension at size 1.
        index = function(self.reshape(-1))
        return index.reshape((1,) * self.ndim) if keepdim else index
    return function(self, axis=dim, keepdims=keepdim)


@register_mapping(aten.argmax.default)
def argmax(self, dim=None, keepdim=False):
    # jnp treats NaN as the largest value, as torch does, and both take the first of equal values.
    return _index_reduction(self, dim, keepdim, jnp.argmax).astype(jnp.int64)


@register_mapping(aten.argmin.default)
def argmin(self, dim=None, keepdim=False):
    return _index_reduction(self, dim, keepdim, jnp.argmin).astype(jnp.int64)


@register_mapping(aten.max.dim)
def max_dim(self, dim, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), dtype=jnp.int64)
    return jnp.max(self, axis=dim, keepdims=keepdim), argmax(self, dim, keepdim)


@register_mapping(aten.min.dim)
def min_dim(self, dim, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), dtype=jnp.int64)
    return jnp.min(self, axis=dim, keepdims=keepdim), argmin(self, dim, keepdim)


@register_mapping(aten.aminmax.default)
def aminmax(self, *, dim=None, keepdim=False):
    return amin(self, dim, keepdim), amax(self, dim, keepdim)


# ---------------------------------------------------------------- logical reductions


def _logical_reduction(function, self, dim, keepdim):
    # torch returns uint8 for uint8 inputs (an old convention) and bool otherwise.
    result = jnp.uint8 if self.dtype == jnp.uint8 else jnp.bool_
    return function(self != 0, axis=dim, keepdims=keepdim).astype(result)


@register_mapping(aten.all.default, aten.all.dim, aten.all.dims)
def all_reduction(self, dim=None, keepdim=False):
    if isinstance(dim, (list, tuple)) and not dim:
        dim = ()  # an explicitly empty list reduces nothing
    else:
        dim = _axes(self, dim)
    return _logical_reduction(jnp.all, self, dim, keepdim)


@register_mapping(aten.any.default, aten.any.dim, aten.any.dims)
def any_reduction(self, dim=None, keepdim=False):
    if isinstance(dim, (list, tuple)) and not dim:
        dim = ()
    else:
        dim = _axes(self, dim)
    return _logical_reduction(jnp.any, self, dim, keepdim)


@register_mapping(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero(self, dim=None):
    return jnp.sum(self != 0, axis=_axes(self, dim), dtype=jnp.int64)


# ---------------------------------------------------------------- variance and standard deviation


def _variance_and_mean(self, dim, correction, keepdim):
    values = self.astype(_accumulator(self.dtype))
    axes = _axes(self, dim)
    count = math.prod(self.shape[axis] for axis in axes) if axes is not None else self.size
    average = jnp.mean(values, axis=axes, keepdims=True)
    deviation = values - average
    squares = jnp.real(deviation * jnp.conj(deviation))
    correction = 1 if correction is None else correction
    # torch divides by max(0, N - correction): inf or nan when no degree of freedom is left.
    variance = jnp.sum(squares, axis=axes, keepdims=keepdim) / max(count - correction, 0)
    if not keepdim:
        average = average.reshape(variance.shape)
    real = jnp.real(jnp.zeros((), dtype=self.dtype)).dtype
    return variance.astype(real), average.astype(self.dtype)


@register_mapping(aten.var.correction)
def var(self, dim=None, *, correction=None, keepdim=False):
    return _variance_and_mean(self, dim, correction, keepdim)[0]


@register_mapping(aten.std.correction)
def std(self, dim=None, *, correction=None, keepdim=False):
    return jnp.sqrt(var(self, dim, correction=correction, keepdim=keepdim))


@register_mapping(aten.var_mean.correction)
def var_mean(self, dim=None, *, correction=None, keepdim=False):
    return _variance_and_mean(self, dim, correction, keepdim)


@register_mapping(aten.std_mean.correction)
def std_mean(self, dim=None, *, correction=None, keepdim=False):
    variance, average = _variance_and_mean(self, dim, correction, keepdim)
    return jnp.sqrt(variance), average


def _with_unbiased(function):
    """The older overloads take `unbiased` (correction 1 or 0) instead of `correction`."""

    def over_dims(self, dim=None, unbiased=True, keepdim=False):
        return function(self, dim, correction=1 if unbiased else 0, keepdim=keepdim)

    def over_all(self, unbiased=True):
        return function(self, None, correction=1 if unbiased else 0)

    return over_dims, over_all


for _function, _packet in ((var, aten.var), (std, aten.std), (var_mean, aten.var_mean), (std_mean, aten.std_mean)):
    _over_dims, _over_all = _with_unbiased(_function)
    register_mapping(_packet.dim, family="reductions")(_over_dims)
    register_mapping(_packet.default, family="reductions")(_over_all)


# ---------------------------------------------------------------- norms


def _vector_norm(self, ord, axes, keepdim):
    magnitude = jnp.abs(self)
    if ord == float("inf"):
        return jnp.max(magnitude, axis=axes, keepdims=keepdim)
    if ord == -float("inf"):
        return jnp.min(magnitude, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum(magnitude != 0, axis=axes, keepdims=keepdim).astype(magnitude.dtype)
    if ord == 1:
        return jnp.sum(magnitude, axis=axes, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(magnitude * magnitude, axis=axes, keepdims=keepdim))
    return jnp.power(jnp.sum(jnp.power(magnitude, ord), axis=axes, keepdims=keepdim), 1.0 / ord)


@register_mapping(aten.linalg_vector_norm.default)
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    if dtype is not None:
        self = self.astype(jnp_dtype(dtype))
    result = jnp.real(jnp.zeros((), dtype=self.dtype)).dtype
    values = self.astype(_accumulator(self.dtype))
    return _vector_norm(values, ord, _axes(self, dim), keepdim).astype(result)


@register_mapping(aten.norm.Scalar, aten.norm.ScalarOpt_dtype)
def norm(self, p=2, *, dtype=None):
    return linalg_vector_norm(self, 2 if p is None else p, None, False, dtype=dtype)


@register_mapping(aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype)
def norm_dim(self, p, dim, keepdim=False, *, dtype=None):
    return linalg_vector_norm(self, 2 if p is None else p, dim, keepdim, dtype=dtype)
