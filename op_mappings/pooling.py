"""Pooling: max and average windows, adaptive, fractional max pooling and max_unpool, with their backward ops.

Shapes here are static (they come from the schema's int lists), so window bookkeeping (output
sizes, divisors, source indices) is done in NumPy at trace time.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge.runtime.registry import aten, register_mapping
from .common import accumulator_dtype, compiled, expand_ints, linear_backward


# ---------------------------------------------------------------- pooling windows


def _pooled_size(size, kernel, stride, padding, dilation, ceil_mode):
    """torch's pooling output size, including its rule that the last window must start inside the input."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


_NO_INDEX = np.iinfo(np.int64).max


def _lowest(dtype):
    """The identity of a maximum over `dtype` (-inf, or the smallest integer), as a NumPy constant."""
    return np.asarray(-np.inf if jnp.issubdtype(dtype, jnp.floating) else np.iinfo(dtype).min, dtype=dtype)


def _first_maximum(left, right):
    """Reducer over (value, index) pairs picking what torch's scan picks: the first of equal
    maxima, but the last NaN (its kernels replace the running maximum on `val > max || isnan(val)`).

    Being commutative, it gives the same choice whatever order XLA reduces in.
    """
    left_value, left_index = left
    right_value, right_index = right
    left_nan, right_nan = left_value != left_value, right_value != right_value
    both_nan = left_nan & right_nan
    left_wins = (
        (left_value > right_value)
        | (left_nan & ~right_nan)
        | ((left_value == right_value) & (left_index < right_index))
        | (both_nan & (left_index > right_index))
    )
    return jnp.where(left_wins, left_value, right_value), jnp.where(left_wins, left_index, right_index)


def _window_maximum(windows):
    """(maximum, its position) along the last axis of `windows`, chosen as _first_maximum chooses:
    the first of equal maxima, but the last NaN."""
    is_nan = windows != windows
    last_nan = windows.shape[-1] - 1 - jnp.argmax(is_nan[..., ::-1], axis=-1)
    choice = jnp.where(jnp.any(is_nan, axis=-1), last_nan, jnp.argmax(windows, axis=-1))
    return jnp.take_along_axis(windows, choice[..., None], axis=-1)[..., 0], choice


@compiled("kernel_size", "stride", "padding", "dilation", "ceil_mode", "spatial")
def _max_pool(input, kernel_size, stride, padding, dilation, ceil_mode, spatial):
    kernel = expand_ints(kernel_size, spatial)
    stride = expand_ints(stride, spatial) if stride else kernel
    padding = expand_ints(padding, spatial)
    dilation = expand_ints(dilation, spatial)
    sizes = input.shape[-spatial:]
    batch_dims = input.ndim - spatial
    outs = [_pooled_size(sizes[i], kernel[i], stride[i], padding[i], dilation[i], ceil_mode) for i in range(spatial)]
    high = [
        max(0, (outs[i] - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1 - sizes[i] - padding[i])
        for i in range(spatial)
    ]
    # torch's index of an element is its flat position in the input's spatial plane.
    flat = np.arange(math.prod(sizes), dtype=np.int64).reshape(sizes)
    indices = jnp.broadcast_to(jnp.asarray(flat), input.shape)
    window = dict(
        window_dimensions=(1,) * batch_dims + tuple(kernel),
        window_strides=(1,) * batch_dims + tuple(stride),
        padding=[(0, 0)] * batch_dims + [(padding[i], high[i]) for i in range(spatial)],
        window_dilation=(1,) * batch_dims + tuple(dilation),
    )
    # The values by a plain max (which JAX can differentiate, for captured regions); the indices
    # by a (value, index) reduction on a gradient-free copy (JAX has no derivative rule for it).
    # (A NumPy init value: JAX linearizes reduce_window only with a constant one.)
    values = lax.reduce_window(input, _lowest(input.dtype), lax.max, **window)
    _, indices = lax.reduce_window(
        (lax.stop_gradient(input), indices),
        (jnp.asarray(_lowest(input.dtype)), jnp.asarray(_NO_INDEX, dtype=jnp.int64)),
        _first_maximum,
        **window,
    )
    return values, indices


@compiled("spatial")
def _max_pool_backward(grad_output, input, indices, spatial):
    """Scatter-add each output's gradient to the input element its index names."""
    if input.size == 0 or grad_output.size == 0:
        return jnp.zeros(input.shape, dtype=grad_output.dtype)
    batch = input.shape[:-spatial]
    plane = math.prod(input.shape[-spatial:])
    grad = grad_output.reshape(batch + (-1,)).astype(accumulator_dtype(grad_output.dtype))
    flat_indices = indices.reshape(batch + (-1,))
    grad_input = jnp.zeros(batch + (plane,), dtype=grad.dtype)
    grad_input = jax.vmap(lambda g, i, z: z.at[i].add(g))(
        grad.reshape((-1, grad.shape[-1])), flat_indices.reshape((-1, flat_indices.shape[-1])), grad_input.reshape((-1, plane))
    )
    return grad_input.reshape(input.shape).astype(grad_output.dtype)


@register_mapping(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 2)


@register_mapping(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _max_pool_backward(grad_output, self, indices, 2)


@register_mapping(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 3)


@register_mapping(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _max_pool_backward(grad_output, self, indices, 3)


def _average_divisors(size, kernel, stride, padding, out, count_include_pad):
    """Per-output divisors along one dimension, as torch computes them."""
    starts = np.arange(out) * stride - padding
    ends = np.minimum(starts + kernel, size + padding)
    if count_include_pad:
        return (ends - starts).astype(np.float64)
    return (np.minimum(ends, size) - np.maximum(starts, 0)).astype(np.float64)


@compiled("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override", "spatial")
def _avg_pool(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, spatial):
    kernel = expand_ints(kernel_size, spatial)
    stride = expand_ints(stride, spatial) if stride else kernel
    padding = expand_ints(padding, spatial)
    sizes = input.shape[-spatial:]
    outs = [_pooled_size(sizes[i], kernel[i], stride[i], padding[i], 1, ceil_mode) for i in range(spatial)]
    high = [max(0, (outs[i] - 1) * stride[i] + kernel[i] - sizes[i] - padding[i]) for i in range(spatial)]
    accumulator = accumulator_dtype(input.dtype)
    batch_dims = input.ndim - spatial
    total = lax.reduce_window(
        input.astype(accumulator),
        np.zeros((), dtype=accumulator),  # a concrete init lets JAX see a differentiable window sum
        lax.add,
        window_dimensions=(1,) * batch_dims + tuple(kernel),
        window_strides=(1,) * batch_dims + tuple(stride),
        padding=[(0, 0)] * batch_dims + [(padding[i], high[i]) for i in range(spatial)],
    )
    if divisor_override:
        return (total / jnp.asarray(divisor_override, dtype=accumulator)).astype(input.dtype)
    divisor = np.ones((), dtype=np.float64)
    for i in range(spatial):
        along = _average_divisors(sizes[i], kernel[i], stride[i], padding[i], outs[i], count_include_pad)
        divisor = np.multiply.outer(divisor, along)
    return (total / jnp.asarray(divisor, dtype=accumulator)).astype(input.dtype)


@register_mapping(aten.avg_pool2d.default)
def avg_pool2d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2)


@register_mapping(aten.avg_pool3d.default)
def avg_pool3d(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3)


@compiled("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override", "spatial")
def _avg_pool_backward(grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, spatial):
    def forward(input):
        return _avg_pool(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, spatial)

    return linear_backward(forward, grad_output, input)


@register_mapping(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _avg_pool_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2)


@register_mapping(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return _avg_pool_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3)


# ---------------------------------------------------------------- adaptive pooling


def _adaptive_bounds(size, out):
    """torch's adaptive windows: [floor(i * size / out), ceil((i + 1) * size / out))."""
    index = np.arange(out)
    starts = (index * size) // out
    ends = -((-(index + 1) * size) // out)
    return starts, ends


def _adaptive_average_matrix(size, out):
    starts, ends = _adaptive_bounds(size, out)
    matrix = np.zeros((out, size), dtype=np.float64)
    for i in range(out):
        matrix[i, starts[i] : ends[i]] = 1.0 / (ends[i] - starts[i])
    return matrix


@compiled("output_size", "spatial")
def _adaptive_avg_pool(input, output_size, spatial):
    output_size = expand_ints(output_size, spatial)
    accumulator = accumulator_dtype(input.dtype)
    out = input.astype(accumulator)
    # One averaging matrix per spatial dimension: windows are separable.
    for i in range(spatial):
        axis = input.ndim - spatial + i
        matrix = jnp.asarray(_adaptive_average_matrix(input.shape[axis], output_size[i]), dtype=accumulator)
        out = jnp.moveaxis(
            jnp.tensordot(out, matrix, axes=((axis,), (1,)), precision=lax.Precision.HIGHEST), -1, axis
        )
    return out.astype(input.dtype)


@register_mapping(aten._adaptive_avg_pool2d.default)
def adaptive_avg_pool2d(self, output_size):
    return _adaptive_avg_pool(self, output_size, 2)


@compiled("spatial")
def _adaptive_avg_pool_backward(grad_output, input, spatial):
    output_size = grad_output.shape[-spatial:]
    return linear_backward(lambda input: _adaptive_avg_pool(input, output_size, spatial), grad_output, input)


@register_mapping(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(grad_output, self):
    return _adaptive_avg_pool_backward(grad_output, self, 2)


@register_mapping(aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool3d(self, output_size):
    return _adaptive_avg_pool(self, output_size, 3)


@register_mapping(aten._adaptive_avg_pool3d_backward.default)
def adaptive_avg_pool3d_backward(grad_output, self):
    return _adaptive_avg_pool_backward(grad_output, self, 3)


@register_mapping(aten.adaptive_max_pool2d.default)
def adaptive_max_pool2d(self, output_size):
    return _adaptive_max_pool2d(self, expand_ints(output_size, 2))


@compiled("output_size")
def _adaptive_max_pool2d(self, output_size):
    height, width = self.shape[-2:]
    rows_start, rows_end = _adaptive_bounds(height, output_size[0])
    cols_start, cols_end = _adaptive_bounds(width, output_size[1])
    row_span = int((rows_end - rows_start).max())
    col_span = int((cols_end - cols_start).max())
    # Gather a fixed-size window per output (the largest one), masking the elements past each window's end.
    rows = rows_start[:, None] + np.arange(row_span)[None, :]
    cols = cols_start[:, None] + np.arange(col_span)[None, :]
    row_valid = rows < rows_end[:, None]
    col_valid = cols < cols_end[:, None]
    rows = np.minimum(rows, height - 1)
    cols = np.minimum(cols, width - 1)
    # windows: batch + (out_h, row_span, out_w, col_span)
    windows = self[..., rows[:, :, None, None], cols[None, None, :, :]]
    valid = row_valid[:, :, None, None] & col_valid[None, None, :, :]
    windows = jnp.where(valid, windows, _lowest(self.dtype))
    flat = rows[:, :, None, None] * width + cols[None, None, :, :]
    # Bring the window axes last, in row-major order, for one argmax per window.
    windows = jnp.moveaxis(windows, -3, -2)
    span = row_span * col_span
    windows = windows.reshape(windows.shape[:-2] + (span,))
    flat = np.moveaxis(flat, 1, 2).reshape(output_size[0], output_size[1], span)
    values, choice = _window_maximum(windows)
    indices = jnp.asarray(flat)[np.arange(output_size[0])[:, None], np.arange(output_size[1])[None, :], choice]
    return values, indices.astype(jnp.int64)


@register_mapping(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _max_pool_backward(grad_output, self, indices, 2)


@register_mapping(aten.adaptive_max_pool3d.default)
def adaptive_max_pool3d(self, output_size):
    return _adaptive_max_pool3d(self, expand_ints(output_size, 3))


@compiled("output_size")
def _adaptive_max_pool3d(self, output_size):
    """As _adaptive_max_pool2d, in three dimensions: a fixed-size (largest) window per output,
    gathered with the elements past each window's end masked."""
    sizes = self.shape[-3:]
    positions, valid = [], []
    for axis in range(3):
        starts, ends = _adaptive_bounds(sizes[axis], output_size[axis])
        span = int((ends - starts).max())
        along = starts[:, None] + np.arange(span)[None, :]
        valid.append(along < ends[:, None])
        positions.append(np.minimum(along, sizes[axis] - 1))
    # Index grids shaped (out_d, out_h, out_w, span_d, span_h, span_w).
    def grid(values, axis):
        shape = [1] * 6
        shape[axis], shape[3 + axis] = values.shape
        return values.reshape(shape)

    depth, height, width = (grid(positions[axis], axis) for axis in range(3))
    mask = grid(valid[0], 0) & grid(valid[1], 1) & grid(valid[2], 2)
    windows = self[..., depth, height, width]
    windows = jnp.where(mask, windows, _lowest(self.dtype))
    flat = np.broadcast_to((depth * sizes[1] + height) * sizes[2] + width, mask.shape)
    span = math.prod(mask.shape[3:])
    windows = windows.reshape(windows.shape[:-3] + (span,))
    flat = flat.reshape(tuple(output_size) + (span,))
    values, choice = _window_maximum(windows)
    indices = jnp.take_along_axis(jnp.broadcast_to(jnp.asarray(flat), windows.shape), choice[..., None], axis=-1)[..., 0]
    return values, indices.astype(jnp.int64)


@register_mapping(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return _max_pool_backward(grad_output, self, indices, 3)


# ---------------------------------------------------------------- max_unpool (the inverse of max pooling)


@compiled("output_size")
def _max_unpool(self, indices, output_size):
    """Each value written at the flat position its index names in the output plane (later
    duplicates win, as in torch's sequential kernel)."""
    spatial = len(output_size)
    batch = self.shape[: self.ndim - spatial]
    plane = math.prod(output_size)
    values = self.reshape((-1, math.prod(self.shape[self.ndim - spatial :])))
    flat_indices = indices.reshape(values.shape)
    out = jnp.zeros((values.shape[0], plane), dtype=self.dtype)
    out = jax.vmap(lambda o, i, v: o.at[i].set(v, mode="drop"))(out, flat_indices, values)
    return out.reshape(batch + tuple(output_size))


# Indices that repeat: torch's formula gathers the gradient at each index (JAX's transpose of the
# scatter keeps only the last write's).
@register_mapping(aten.max_unpool2d.default, gradient="torch")
def max_unpool2d(self, indices, output_size):
    return _max_unpool(self, indices, tuple(output_size))


@register_mapping(aten.max_unpool3d.default, gradient="torch")
def max_unpool3d(self, indices, output_size, stride, padding):
    return _max_unpool(self, indices, tuple(output_size))


# ---------------------------------------------------------------- fractional max pooling


def _fractional_starts(sample, input_size, output_size, pool_size):
    """torch's window starts from one random sample u in [0, 1): int((i + u) * alpha) - int(u * alpha),
    alpha = (input - pool) / (output - 1), in the samples' dtype; the last window ends at the input's end."""
    dtype = sample.dtype
    last = jnp.full(sample.shape + (1,), input_size - pool_size, dtype=jnp.int64)
    if output_size == 1:
        return last
    alpha = (jnp.asarray(input_size - pool_size, dtype) / jnp.asarray(output_size - 1, dtype)).astype(dtype)
    steps = jnp.arange(output_size - 1, dtype=dtype)
    scaled = ((steps + sample[..., None]).astype(dtype) * alpha).astype(dtype)
    starts = jnp.trunc(scaled).astype(jnp.int64) - jnp.trunc((sample * alpha).astype(dtype)).astype(jnp.int64)[..., None]
    return jnp.concatenate([starts, last], axis=-1)


@compiled("kernel_size", "output_size")
def _fractional_max_pool(input, kernel_size, output_size, random_samples):
    spatial = len(kernel_size)
    batched = input.ndim == spatial + 2
    if not batched:
        input = input[None]
    sizes = input.shape[2:]
    if input.size == 0:
        values = jnp.zeros(input.shape[:2] + tuple(output_size), dtype=input.dtype)
        indices = jnp.zeros(values.shape, dtype=jnp.int64)
        return (values, indices) if batched else (values[0], indices[0])
    # torch reads the samples of the first N batch entries (the first only for an unbatched input).
    samples = random_samples[: input.shape[0]].astype(input.dtype)
    # 2d samples are (w, h); 3d samples are (t, h, w).
    order = (1, 0) if spatial == 2 else (0, 1, 2)
    starts = [_fractional_starts(samples[..., order[i]], sizes[i], output_size[i], kernel_size[i]) for i in range(spatial)]
    # positions[i]: (N, C, out_i, kernel_i) source positions along spatial axis i.
    positions = [starts[i][..., None] + jnp.arange(kernel_size[i]) for i in range(spatial)]
    flat_input = input.reshape(input.shape[:2] + (-1,))
    # Flat index of every window element, axes (N, C, out_0, k_0, out_1, k_1[, out_2, k_2]).
    flat = jnp.zeros((), dtype=jnp.int64)
    for i in range(spatial):
        stride = math.prod(sizes[i + 1 :])
        shape = [input.shape[0], input.shape[1]] + [1] * (2 * spatial)
        shape[2 + 2 * i] = output_size[i]
        shape[3 + 2 * i] = kernel_size[i]
        flat = flat + (positions[i] * stride).reshape(shape)
    flat = jnp.broadcast_to(flat, input.shape[:2] + tuple(x for i in range(spatial) for x in (output_size[i], kernel_size[i])))
    # Bring the window axes last (row-major within the window), one row per output.
    permutation = (0, 1) + tuple(2 + 2 * i for i in range(spatial)) + tuple(3 + 2 * i for i in range(spatial))
    flat = jnp.transpose(flat, permutation).reshape(input.shape[:2] + tuple(output_size) + (-1,))
    windows = jnp.take_along_axis(flat_input, flat.reshape(input.shape[:2] + (-1,)), axis=2).reshape(flat.shape)
    values, choice = _window_maximum(windows)
    indices = jnp.take_along_axis(flat, choice[..., None], axis=-1)[..., 0]
    if not batched:
        values, indices = values[0], indices[0]
    return values, indices


@register_mapping(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, expand_ints(kernel_size, 2), expand_ints(output_size, 2), random_samples)


@register_mapping(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, expand_ints(kernel_size, 3), expand_ints(output_size, 3), random_samples)


@register_mapping(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad_output, self, kernel_size, output_size, indices):
    return _max_pool_backward(grad_output, self, indices, 2)


@register_mapping(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad_output, self, kernel_size, output_size, indices):
    return _max_pool_backward(grad_output, self, indices, 3)
