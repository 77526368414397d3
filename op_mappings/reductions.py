"""Reductions (sum, mean, extrema, variance, norms, logical all/any) and cumulative scans.

torch's result dtypes are spelled out here: integer sums widen to int64, and bfloat16/float16
accumulate in float32 before the result is rounded back.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from bridge.runtime.registry import aten, jnp_dtype, register_mapping
from .common import accumulator_dtype, default_float, is_integral


def _axes(self, dim):
    """jnp axes for torch's dim argument: None or [] means every dimension; a 0-dim input has none."""
    if self.ndim == 0 or dim is None:
        return None
    if isinstance(dim, int):
        return (dim,)
    return tuple(dim) if len(dim) else None


def _widened(self, dtype):
    """The result dtype of sum/prod/cumsum: an explicit dtype, else int64 for integers and bools."""
    if dtype is not None:
        return jnp_dtype(dtype)
    return jnp.dtype(jnp.int64) if is_integral(self) else self.dtype


# ---------------------------------------------------------------- sums and products


@register_mapping(aten.sum.default, aten.sum.dim_IntList)
def sum_reduction(self, dim=None, keepdim=False, *, dtype=None):
    result = _widened(self, dtype)
    total = jnp.sum(self, axis=_axes(self, dim), keepdims=keepdim, dtype=accumulator_dtype(result))
    return total.astype(result)


@register_mapping(aten.nansum.default)
def nansum(self, dim=None, keepdim=False, *, dtype=None):
    result = _widened(self, dtype)
    total = jnp.nansum(self, axis=_axes(self, dim), keepdims=keepdim, dtype=accumulator_dtype(result))
    return total.astype(result)


@register_mapping(aten.prod.default, aten.prod.dim_int)
def prod_reduction(self, dim=None, keepdim=False, *, dtype=None):
    result = _widened(self, dtype)
    total = jnp.prod(self, axis=_axes(self, dim), keepdims=keepdim, dtype=accumulator_dtype(result))
    return total.astype(result)


@register_mapping(aten.mean.default, aten.mean.dim)
def mean(self, dim=None, keepdim=False, *, dtype=None):
    result = jnp_dtype(dtype, self.dtype)
    average = jnp.mean(self.astype(accumulator_dtype(result)), axis=_axes(self, dim), keepdims=keepdim)
    return average.astype(result)


def _scan(function, self, dim, dtype):
    result = _widened(self, dtype)
    values = self.astype(accumulator_dtype(result))
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
    # torch's CPU kernel accumulates float32 in float64 (acc_type), and its backward is built on it.
    accumulator = jnp.float64 if self.dtype == jnp.float32 else accumulator_dtype(self.dtype)
    values = self.astype(accumulator)
    if self.ndim == 0:
        return self
    if jnp.issubdtype(self.dtype, jnp.complexfloating):
        return _complex_logcumsumexp(self, dim % self.ndim)
    return jax.lax.cumlogsumexp(values, axis=dim % self.ndim).astype(self.dtype)


def _complex_logcumsumexp(self, dim):
    """torch's sequential scan (in complex128): each step keeps the larger real part's imaginary
    part and adds a principal angle, so the result's imaginary part is not wrapped to (-pi, pi]."""

    def log_add_exp(total, value):
        is_nan = lambda number: jnp.isnan(number.real) | jnp.isnan(number.imag)
        value_smaller = value.real < total.real
        low = jnp.where(is_nan(total), total, jnp.where(is_nan(value), value, jnp.where(value_smaller, value, total)))
        high = jnp.where(is_nan(total), total, jnp.where(is_nan(value), value, jnp.where(value_smaller, total, value)))
        both_infinite = ~jnp.isfinite(low.real) & (low.real == high.real)
        result = jnp.log1p(jnp.exp(low - high)) + high
        result = jnp.where(both_infinite, jnp.where(low.real < 0, low, jnp.log(jnp.exp(low) + jnp.exp(high))), result)
        result = jnp.where(is_nan(low), jnp.asarray(complex(jnp.nan, jnp.nan), result.dtype), result)
        return result, result

    moved = jnp.moveaxis(self.astype(jnp.complex128), dim, 0)
    start = jnp.full(moved.shape[1:], -jnp.inf, dtype=jnp.complex128)
    _, scanned = lax.scan(log_add_exp, start, moved)
    return jnp.moveaxis(scanned, 0, dim).astype(self.dtype)


@register_mapping(aten.logsumexp.default)
def logsumexp(self, dim, keepdim=False):
    result = default_float() if is_integral(self) else self.dtype
    values = self.astype(accumulator_dtype(result))
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


@register_mapping(aten._is_all_true.default)
def is_all_true(self):
    # torch.distributions' argument checks (`torch._is_all_true(constraint.check(value))`)
    return jnp.all(self)


@register_mapping(aten._is_any_true.default)
def is_any_true(self):
    return jnp.any(self)


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
    values = self.astype(accumulator_dtype(self.dtype))
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


# The norm of a zero vector has gradient 0 in torch (NaN by JAX's quotient rule).
@register_mapping(aten.linalg_vector_norm.default, gradient="torch")
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    if dtype is not None:
        self = self.astype(jnp_dtype(dtype))
    result = jnp.real(jnp.zeros((), dtype=self.dtype)).dtype
    values = self.astype(accumulator_dtype(self.dtype))
    return _vector_norm(values, ord, _axes(self, dim), keepdim).astype(result)


@register_mapping(aten.norm.Scalar, aten.norm.ScalarOpt_dtype, gradient="torch")
def norm(self, p=2, *, dtype=None):
    return linalg_vector_norm(self, 2 if p is None else p, None, False, dtype=dtype)


@register_mapping(aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype, gradient="torch")
def norm_dim(self, p, dim, keepdim=False, *, dtype=None):
    return linalg_vector_norm(self, 2 if p is None else p, dim, keepdim, dtype=dtype)


# ---------------------------------------------------------------- order statistics: median, mode


def _flat_sorted(self):
    """The elements in ascending order with NaNs last, and how many are not NaN."""
    flat = self.reshape(-1)
    valid = jnp.sum(~jnp.isnan(flat)) if jnp.issubdtype(flat.dtype, jnp.inexact) else flat.size
    return jnp.sort(flat), valid


@register_mapping(aten.median.default)
def median(self):
    # torch returns the lower of the two middle values, and NaN if there is any NaN.
    ordered, valid = _flat_sorted(self)
    if ordered.size == 0:
        return jnp.full((), jnp.nan, dtype=self.dtype)
    middle = ordered[(ordered.size - 1) // 2]
    return jnp.where(valid < ordered.size, jnp.asarray(jnp.nan, self.dtype), middle) if _has_nan(self) else middle


@register_mapping(aten.nanmedian.default)
def nanmedian(self):
    ordered, valid = _flat_sorted(self)
    if ordered.size == 0:
        return jnp.full((), jnp.nan, dtype=self.dtype)
    return ordered[jnp.maximum(valid - 1, 0) // 2]


def _has_nan(array):
    return jnp.issubdtype(array.dtype, jnp.inexact)


def _median_along(self, dim, keepdim, ignore_nan):
    if self.ndim == 0:
        return self, jnp.zeros((), dtype=jnp.int64)
    dim = dim % self.ndim
    moved = jnp.moveaxis(self, dim, -1)
    order = jnp.argsort(moved, axis=-1, stable=True)  # NaNs last
    ordered = jnp.take_along_axis(moved, order, axis=-1)
    size = moved.shape[-1]
    if _has_nan(self):
        nans = jnp.isnan(moved)
        valid = size - jnp.sum(nans, axis=-1, keepdims=True)
    else:
        nans, valid = None, jnp.full(moved.shape[:-1] + (1,), size)
    # C++'s (valid - 1) / 2 truncates towards zero: 0 for an all-NaN row.
    position = jnp.maximum(valid - 1, 0) // 2 if ignore_nan else jnp.full_like(valid, (size - 1) // 2)
    values = jnp.take_along_axis(ordered, position, axis=-1)
    indices = jnp.take_along_axis(order, position, axis=-1)
    if nans is not None and not ignore_nan:
        # median: NaN and the index of the first NaN wherever a row has one.
        has_nan = valid < size
        first_nan = jnp.argmax(nans, axis=-1, keepdims=True)
        values = jnp.where(has_nan, jnp.asarray(jnp.nan, self.dtype), values)
        indices = jnp.where(has_nan, first_nan, indices)
    values, indices = values[..., 0], indices[..., 0].astype(jnp.int64)
    if keepdim:
        values, indices = jnp.expand_dims(values, dim), jnp.expand_dims(indices, dim)
    return values, indices


@register_mapping(aten.median.dim)
def median_dim(self, dim, keepdim=False):
    return _median_along(self, dim, keepdim, ignore_nan=False)


@register_mapping(aten.nanmedian.dim)
def nanmedian_dim(self, dim, keepdim=False):
    return _median_along(self, dim, keepdim, ignore_nan=True)


@register_mapping(aten.mode.default)
def mode(self, dim=-1, keepdim=False):
    """The most frequent value (the smallest of equally frequent ones) and its last index."""
    if self.ndim == 0:
        return self, jnp.zeros((), dtype=jnp.int64)
    dim = dim % self.ndim
    moved = jnp.moveaxis(self, dim, -1)
    size = moved.shape[-1]
    if size == 0:
        shape = moved.shape[:-1]
        values, indices = jnp.zeros(shape, self.dtype), jnp.zeros(shape, jnp.int64)
    else:
        order = jnp.argsort(moved, axis=-1, stable=True)
        ordered = jnp.take_along_axis(moved, order, axis=-1)
        positions = jnp.arange(size)
        same_as_previous = jnp.concatenate(
            [jnp.zeros(ordered.shape[:-1] + (1,), bool), ordered[..., 1:] == ordered[..., :-1]], axis=-1
        )
        same_as_next = jnp.concatenate(
            [ordered[..., 1:] == ordered[..., :-1], jnp.zeros(ordered.shape[:-1] + (1,), bool)], axis=-1
        )
        run_start = lax.cummax(jnp.where(same_as_previous, 0, positions), axis=ordered.ndim - 1)
        run_end = lax.cummin(jnp.where(same_as_next, size, positions), axis=ordered.ndim - 1, reverse=True)
        counts = run_end - run_start + 1
        best_start = jnp.argmax(counts, axis=-1, keepdims=True)  # the first run of the largest count
        best_end = jnp.take_along_axis(run_end, best_start, axis=-1)
        values = jnp.take_along_axis(ordered, best_start, axis=-1)[..., 0]
        # The stable sort keeps equal values in their order: the run's end is the last occurrence.
        indices = jnp.take_along_axis(order, best_end, axis=-1)[..., 0].astype(jnp.int64)
    if keepdim:
        values, indices = jnp.expand_dims(values, dim), jnp.expand_dims(indices, dim)
    return values, indices


# ---------------------------------------------------------------- running extrema


def _running_extremum(self, dim, later_wins):
    """values and indices of cummax/cummin: ties go to the later element, and NaN beats every number
    (a later NaN beats an earlier one), as torch's kernels compare."""
    if self.ndim == 0:
        return self, jnp.zeros((), dtype=jnp.int64)
    dim = dim % self.ndim
    shape = [1] * self.ndim
    shape[dim] = self.shape[dim]
    indices = jnp.broadcast_to(jnp.arange(self.shape[dim], dtype=jnp.int64).reshape(shape), self.shape)

    def combine(earlier, later):
        earlier_values, earlier_indices = earlier
        later_values, later_indices = later
        take_later = later_wins(earlier_values, later_values)
        if _has_nan(earlier_values):
            take_later = jnp.isnan(later_values) | (~jnp.isnan(earlier_values) & take_later)
        return jnp.where(take_later, later_values, earlier_values), jnp.where(take_later, later_indices, earlier_indices)

    if self.shape[dim] == 0:
        return self, indices
    return lax.associative_scan(combine, (self, indices), axis=dim)


@register_mapping(aten.cummax.default)
def cummax(self, dim):
    return _running_extremum(self, dim, lambda earlier, later: later >= earlier)


@register_mapping(aten.cummin.default)
def cummin(self, dim):
    return _running_extremum(self, dim, lambda earlier, later: later <= earlier)


# ---------------------------------------------------------------- comparisons returning Python bools


@register_mapping(aten.equal.default, meta="data-dependent")
def equal(self, other):
    # A Python bool is a host value by nature: this entry reads the device once.
    if self.shape != other.shape:
        return False
    return bool(jnp.all(self == other))


@register_mapping(aten.allclose.default, meta="data-dependent")
def allclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return bool(jnp.all(jnp.isclose(self, other, rtol=rtol, atol=atol, equal_nan=equal_nan)))


# ---------------------------------------------------------------- hashing


@register_mapping(aten.hash_tensor.default)
def hash_tensor(self, dim=(), *, keepdim=False, mode=0):
    # mode 0: xor of the elements' 64-bit patterns (floats as float64, integers as int64).
    wide = self.astype(jnp.float64) if jnp.issubdtype(self.dtype, jnp.floating) else self.astype(jnp.int64)
    bits = lax.bitcast_convert_type(wide, jnp.uint64)
    axes = _axes(self, dim)
    axes = tuple(range(self.ndim)) if axes is None else tuple(axis % self.ndim for axis in axes)
    hashed = lax.reduce(bits, jnp.uint64(0), lax.bitwise_xor, axes)
    if keepdim:
        hashed = jnp.expand_dims(hashed, axes)
    return hashed


# ---------------------------------------------------------------- histograms and counts

_range = range  # _histogramdd takes an argument named range


def _torch_linspace(start, end, steps, dtype):
    """torch's linspace: from the start for the first half of the points, from the end for the rest."""
    start, end = jnp.asarray(start, dtype), jnp.asarray(end, dtype)
    if steps == 1:
        return start.reshape(1)
    step = (end - start) / (steps - 1)
    index = jnp.arange(steps)
    from_start = start + index.astype(dtype) * step
    from_end = end - (steps - 1 - index).astype(dtype) * step
    return jnp.where(index < steps // 2, from_start, from_end)


def _bin_positions(values, edges, local_search, rounded=lambda value: value):
    """torch's bin of each value (-1 outside the edges): linear interpolation between the outer
    edges, corrected against the neighbouring edges for histogram (not for histc). `rounded`
    rounds each step as torch's kernel does in the input's dtype."""
    count = edges.shape[0]
    left, right = edges[0], edges[-1]
    inside = (values >= left) & (values <= right)
    scaled = rounded(rounded(values - left) * (count - 1))
    position = rounded(scaled / rounded(right - left)).astype(jnp.int64)
    position = jnp.clip(position, 0, count - 1)
    if local_search:
        low = jnp.maximum(position - 1, 0)
        high = jnp.minimum(position + 2, count)
        window = low[..., None] + jnp.arange(3)
        window_edges = edges[jnp.clip(window, 0, count - 1)]
        at_or_below = (window < high[..., None]) & (window_edges <= values[..., None])
        position = low + jnp.sum(at_or_below, axis=-1) - 1
    position = jnp.where(position == count - 1, position - 1, position)
    return jnp.where(inside, position, -1)


def _rounding_to(dtype):
    """Rounds a float32 to `dtype`'s precision and range, and stays float32 (reduce_precision,
    unlike a pair of converts, is never simplified away by XLA)."""
    info = jnp.finfo(dtype)
    return lambda value: lax.reduce_precision(value, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _outer_edges(values, low, high, widen):
    """The outer edges: the given range, else the data's; an empty range widened by `widen` each side."""
    if (low is None or low == high) and values.size == 0:
        return jnp.zeros((), values.dtype), jnp.ones((), values.dtype)  # torch's edges for no data
    if low is None or low == high:
        low, high = jnp.min(values), jnp.max(values)
    else:
        low, high = jnp.asarray(low, values.dtype), jnp.asarray(high, values.dtype)
    same = low == high
    return jnp.where(same, low - widen, low), jnp.where(same, high + widen, high)


def _count_bins(positions, bins, weights, dtype):
    """Sum of the weights (or counts) per flat bin; positions of -1 are dropped."""
    contributions = jnp.ones(positions.shape, dtype) if weights is None else weights.astype(dtype)
    contributions = jnp.where(positions >= 0, contributions, jnp.zeros((), dtype))
    return jnp.zeros((bins,), dtype).at[jnp.maximum(positions, 0)].add(contributions)


@register_mapping(aten.histc.default)
def histc(self, bins=100, min=0, max=0):
    values = self.reshape(-1)
    compute = accumulator_dtype(self.dtype)
    low, high = _outer_edges(values.astype(compute), min, max, 1)
    # torch's kernel computes in the input's dtype: bfloat16/float16 round after every step.
    edges = _torch_linspace(low, high, bins + 1, self.dtype).astype(compute)
    rounded = _rounding_to(self.dtype) if compute != self.dtype else (lambda value: value)
    positions = _bin_positions(values.astype(compute), edges, local_search=False, rounded=rounded)
    return _count_bins(positions, bins, None, compute).astype(self.dtype)


def _histogramdd(self, bins, range, weight, density):
    """Edges per dimension and the histogram of the rows of `self` (its last dim is the number of dims)."""
    dims = self.shape[-1]
    points = self.reshape(-1, dims)
    edges, flat, stride = [], jnp.zeros(points.shape[0], jnp.int64), 1
    inside = jnp.ones(points.shape[0], bool)
    for dim in reversed(_range(dims)):
        low, high = (None, None) if range is None else (range[2 * dim], range[2 * dim + 1])
        left, right = _outer_edges(points[:, dim], low, high, 0.5)
        dim_edges = _torch_linspace(left, right, bins[dim] + 1, self.dtype)
        positions = _bin_positions(points[:, dim], dim_edges, local_search=True)
        inside = inside & (positions >= 0)
        flat = flat + positions * stride
        stride *= bins[dim]
        edges.insert(0, dim_edges)
    weights = None if weight is None else weight.reshape(-1)
    hist = _count_bins(jnp.where(inside, flat, -1), stride, weights, self.dtype).reshape(tuple(bins))
    if density:
        total = jnp.sum(hist)
        for dim, dim_edges in enumerate(edges):
            shape = [1] * dims
            shape[dim] = bins[dim]
            hist = hist / (dim_edges[1:] - dim_edges[:-1]).reshape(shape)
        hist = hist / total
    return edges, hist


@register_mapping(aten.histogram.bin_ct)
def histogram(self, bins=100, *, range=None, weight=None, density=False):
    edges, hist = _histogramdd(self.reshape(-1, 1), [bins], range, None if weight is None else weight.reshape(-1), density)
    return hist, edges[0]


@register_mapping(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    """The histogram of the rows of `self` over given edges per dimension: torch's binary search
    (a value on the last edge falls in the last bin; values outside the edges are dropped)."""
    dims = self.shape[-1]
    points = self.reshape(-1, dims)
    flat, stride = jnp.zeros(points.shape[0], jnp.int64), 1
    inside = jnp.ones(points.shape[0], bool)
    for dim in reversed(_range(dims)):
        edges = bins[dim]
        count = edges.shape[0]
        values = points[:, dim].astype(edges.dtype)
        positions = jnp.searchsorted(edges, values, side="right") - 1
        positions = jnp.where(positions == count - 1, positions - 1, positions)
        inside = inside & (values >= edges[0]) & (values <= edges[-1])
        flat = flat + positions.astype(jnp.int64) * stride
        stride *= count - 1
    sizes = tuple(edges.shape[0] - 1 for edges in bins)
    weights = None if weight is None else weight.reshape(-1)
    hist = _count_bins(jnp.where(inside, flat, -1), stride, weights, self.dtype).reshape(sizes)
    if density:
        total = jnp.sum(hist)
        for dim, edges in enumerate(bins):
            shape = [1] * dims
            shape[dim] = sizes[dim]
            hist = hist / (edges[1:] - edges[:-1]).astype(self.dtype).reshape(shape)
        hist = hist / total
    return hist


@register_mapping(aten.histogram.bins_tensor)
def histogram_bins_tensor(self, bins, *, weight=None, density=False):
    weights = None if weight is None else weight.reshape(-1)
    return histogramdd_from_bin_tensors(self.reshape(-1, 1), [bins], weight=weights, density=density), bins


@register_mapping(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):
    return _histogramdd(self, bins, range, weight, density)[0]


@register_mapping(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_counts(self, bins, *, range=None, weight=None, density=False):
    return _histogramdd(self, bins, range, weight, density)[1]


@register_mapping(aten.bincount.default)
def bincount(self, weights=None, minlength=0):
    # The output's length is max(self) + 1: data-dependent by nature (torch has no meta kernel for
    # it either), so this entry reads the maximum on the host once and runs eagerly.
    size = minlength if self.size == 0 else max(int(jnp.max(self)) + 1, minlength)
    if weights is None:
        return jnp.zeros((size,), jnp.int64).at[self].add(1)
    dtype = weights.dtype if weights.dtype in (jnp.float32, jnp.float64) else jnp.float64
    return jnp.zeros((size,), dtype).at[self].add(weights.astype(dtype))


# ---------------------------------------------------------------- index_reduce


@register_mapping(aten.index_reduce.default)
def index_reduce(self, dim, index, source, reduce, *, include_self=True):
    if self.ndim == 0:
        self, source = self.reshape(1), source.reshape(1)
        squeeze = True
    else:
        squeeze = False
    dim = dim % self.ndim
    target = jnp.moveaxis(self, dim, 0)
    values = jnp.moveaxis(source, dim, 0)
    index = index.reshape(-1)
    touched = jnp.zeros(target.shape[0], bool).at[index].set(True).reshape((-1,) + (1,) * (target.ndim - 1))
    integral = is_integral(self)
    if reduce == "prod":
        start = target if include_self else jnp.where(touched, jnp.ones((), self.dtype), target)
        result = start.at[index].multiply(values)
    elif reduce in ("amax", "amin"):
        if integral:
            info = jnp.iinfo(self.dtype)
            identity = info.min if reduce == "amax" else info.max
        else:
            identity = -jnp.inf if reduce == "amax" else jnp.inf
        start = target if include_self else jnp.where(touched, jnp.asarray(identity, self.dtype), target)
        result = start.at[index].max(values) if reduce == "amax" else start.at[index].min(values)
    elif reduce == "mean":
        start = target if include_self else jnp.where(touched, jnp.zeros((), self.dtype), target)
        total = start.at[index].add(values)
        counts = jnp.zeros(target.shape[0], self.dtype).at[index].add(jnp.ones((), self.dtype))
        counts = counts + (1 if include_self else 0)
        counts = jnp.where(counts == 0, jnp.ones((), self.dtype), counts).reshape(touched.shape)
        result = jnp.floor_divide(total, counts) if integral else (total / counts).astype(self.dtype)
    else:
        raise ValueError(f"index_reduce(): unknown reduce {reduce!r}; torch takes prod, mean, amax or amin")
    result = jnp.moveaxis(result, 0, dim)
    return result.reshape(()) if squeeze else result


# ---------------------------------------------------------------- segment_reduce


def _segment_reduce(data, reduce, lengths, offsets, axis, initial):
    """Reduce consecutive segments of `data` along `axis` (the last dim of lengths/offsets; the dims
    before it are batch dims shared with data). An empty segment gives `initial`, else the
    reduction's identity (NaN for mean); `initial` also takes part in every non-empty segment."""
    if lengths is None:
        lengths = offsets[..., 1:] - offsets[..., :-1]
    axis = axis % data.ndim
    size = data.shape[axis]
    ends = jnp.cumsum(lengths, axis=-1)
    positions = jnp.arange(size)
    # segment of each position: how many segment ends lie at or before it
    segment = jnp.sum(ends[..., None, :] <= positions[:, None], axis=-1)  # (batch..., N)
    segments = lengths.shape[-1]
    mask = segment[..., None, :] == jnp.arange(segments)[:, None]  # (batch..., S, N)
    trailing = data.ndim - axis - 1
    mask = mask.reshape(mask.shape + (1,) * trailing)
    result_dtype = data.dtype
    expanded = jnp.expand_dims(data, axis)  # (batch..., 1, N, rest...)
    over = axis + 1
    counts = lengths.reshape(lengths.shape + (1,) * trailing).astype(data.dtype)
    if reduce in ("sum", "mean", "prod"):
        # torch adds (multiplies) each segment's elements in order in the data's own dtype, starting
        # from `initial`: a scan over the positions rounds as it does (bfloat16 included).
        combine = jnp.multiply if reduce == "prod" else jnp.add
        start = (1 if reduce == "prod" else 0) if initial is None else initial
        accumulator = jnp.full(mask.shape[:over] + data.shape[over:], start, data.dtype)

        def add_position(accumulator, position):
            selected = jnp.take(mask, position, axis=over)
            element = jnp.expand_dims(jnp.take(data, position, axis=axis), axis)
            return jnp.where(selected, combine(accumulator, element), accumulator), None

        result, _ = lax.scan(add_position, accumulator, jnp.arange(size))
        if reduce == "mean":
            result = jnp.where(counts > 0, result / jnp.where(counts > 0, counts, 1), jnp.nan if initial is None else initial)
    elif reduce in ("max", "min"):
        identity = -jnp.inf if reduce == "max" else jnp.inf
        chooser = jnp.max if reduce == "max" else jnp.min
        result = chooser(jnp.where(mask, expanded, identity), axis=over)
        if initial is not None:
            result = (jnp.maximum if reduce == "max" else jnp.minimum)(result, initial)
    else:
        raise ValueError(f"segment_reduce(): unknown reduce {reduce!r}; torch takes sum, mean, prod, max or min")
    return result.astype(result_dtype)


@register_mapping(aten.segment_reduce.default)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    return _segment_reduce(data, reduce, lengths, offsets, axis, initial)


@register_mapping(aten._segment_reduce_backward.default)
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None):
    # The vjp of the forward entry: ties of max/min share the gradient equally, as in torch.
    _, pullback = jax.vjp(lambda values: _segment_reduce(values, reduce, lengths, offsets, axis, initial), data)
    return pullback(grad.astype(data.dtype))[0]

