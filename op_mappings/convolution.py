"""Convolution, pooling, upsampling and im2col/col2im, with the backward ops torch's autograd calls;
also the bilinear form of nn.Bilinear (aten._trilinear).

Shapes here are static (they come from the schema's int lists), so window
bookkeeping (output sizes, divisors, source indices) is done in NumPy at trace time.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge.runtime import config
from bridge.runtime.registry import aten, register_mapping, use_torch_gradient

_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _accumulator(dtype):
    return jnp.dtype(jnp.float32) if dtype in _LOW_PRECISION else dtype


def _hashable(value):
    return tuple(_hashable(item) for item in value) if isinstance(value, list) else value


def _compiled(*static_names):
    """Compile a helper as one XLA program per signature, the named arguments static (lists become tuples).

    Op by op, a window computation or a vjp would dispatch and compile each primitive separately.
    """

    def decorate(function):
        compiled = jax.jit(function, static_argnames=static_names)

        @functools.wraps(function)
        def run(*args, **kwargs):
            return compiled(*map(_hashable, args), **{name: _hashable(value) for name, value in kwargs.items()})

        return run

    return decorate


def _expand(values, count):
    """An int list argument as a tuple of `count` entries (torch repeats a single entry)."""
    values = tuple(values) if isinstance(values, (list, tuple)) else (values,)
    return values * count if len(values) == 1 else values


# ---------------------------------------------------------------- convolution


def _dimension_numbers(spatial):
    letters = "DHW"[-spatial:] if spatial <= 3 else None
    return (f"NC{letters}", f"OI{letters}", f"NC{letters}")


def _transposed_weight(weight, groups):
    """A transposed convolution's weight (in, out/groups, *k) as the forward weight (out, in/groups, *k), flipped."""
    in_channels, out_per_group = weight.shape[:2]
    kernel = weight.shape[2:]
    grouped = weight.reshape((groups, in_channels // groups, out_per_group) + kernel)
    grouped = jnp.swapaxes(grouped, 1, 2)
    forward = grouped.reshape((groups * out_per_group, in_channels // groups) + kernel)
    return jnp.flip(forward, axis=tuple(range(2, 2 + len(kernel))))


@_compiled("stride", "padding", "dilation", "transposed", "output_padding", "groups", "channels_last")
def _convolve(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, channels_last=False):
    spatial = input.ndim - 2
    stride = _expand(stride, spatial)
    padding = _expand(padding, spatial)
    dilation = _expand(dilation, spatial)
    accumulator = _accumulator(input.dtype)
    if transposed:
        output_padding = _expand(output_padding, spatial)
        kernel = weight.shape[2:]
        # A transposed convolution is the input-gradient of a forward one: dilate the input by
        # the stride and pad by the dilated kernel extent less the forward padding.
        pads = [
            (dilation[i] * (kernel[i] - 1) - padding[i], dilation[i] * (kernel[i] - 1) - padding[i] + output_padding[i])
            for i in range(spatial)
        ]
        out = lax.conv_general_dilated(
            input,
            _transposed_weight(weight, groups),
            window_strides=(1,) * spatial,
            padding=pads,
            lhs_dilation=stride,
            rhs_dilation=dilation,
            dimension_numbers=_dimension_numbers(spatial),
            feature_group_count=groups,
            precision=config.conv_precision(),
            preferred_element_type=accumulator,
        )
    else:
        numbers = _dimension_numbers(spatial)
        if channels_last:  # config.conv_channels_last: NHWC out, NCHW after the transpose below
            numbers = numbers[:2] + ("NHWC",)
        out = lax.conv_general_dilated(
            input,
            weight,
            window_strides=stride,
            padding=[(p, p) for p in padding],
            rhs_dilation=dilation,
            dimension_numbers=numbers,
            feature_group_count=groups,
            precision=config.conv_precision(),
            preferred_element_type=accumulator,
        )
        if channels_last:
            if bias is not None:
                out = out + bias.astype(accumulator)
            return jnp.transpose(out, (0, 3, 1, 2)).astype(input.dtype)
    if bias is not None:
        out = out + bias.astype(accumulator).reshape((1, -1) + (1,) * spatial)
    return out.astype(input.dtype)


@register_mapping(aten.convolution.default)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    channels_last = input.ndim == 4 and not transposed and config.conv_channels_last()
    return _convolve(
        input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, channels_last=channels_last
    )


@register_mapping(aten.convolution_backward.default)
def convolution_backward(
    grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    return _convolution_backward(
        grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups, output_mask
    )


@_compiled("stride", "padding", "dilation", "transposed", "output_padding", "groups", "output_mask")
def _convolution_backward(grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups, output_mask):
    def forward(input, weight):
        return _convolve(input, weight, None, stride, padding, dilation, transposed, output_padding, groups)

    _, pullback = jax.vjp(forward, input, weight)
    grad_input, grad_weight = pullback(grad_output.astype(input.dtype))
    grad_bias = None
    if output_mask[2]:
        axes = (0,) + tuple(range(2, grad_output.ndim))
        grad_bias = jnp.sum(grad_output.astype(_accumulator(grad_output.dtype)), axis=axes).astype(grad_output.dtype)
    return (
        grad_input if output_mask[0] else None,
        grad_weight if output_mask[1] else None,
        grad_bias,
    )


# ---------------------------------------------------------------- pooling windows


def _pooled_size(size, kernel, stride, padding, dilation, ceil_mode):
    """torch's pooling output size, including its rule that the last window must start inside the input."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


_NO_INDEX = np.iinfo(np.int64).max


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


@_compiled("kernel_size", "stride", "padding", "dilation", "ceil_mode", "spatial")
def _max_pool(input, kernel_size, stride, padding, dilation, ceil_mode, spatial):
    kernel = _expand(kernel_size, spatial)
    stride = _expand(stride, spatial) if stride else kernel
    padding = _expand(padding, spatial)
    dilation = _expand(dilation, spatial)
    sizes = input.shape[-spatial:]
    batch_dims = input.ndim - spatial
    outs = [_pooled_size(sizes[i], kernel[i], stride[i], padding[i], dilation[i], ceil_mode) for i in range(spatial)]
    high = [
        max(0, (outs[i] - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1 - sizes[i] - padding[i])
        for i in range(spatial)
    ]
    if jnp.issubdtype(input.dtype, jnp.floating):
        lowest = jnp.asarray(-jnp.inf, dtype=input.dtype)
    else:
        lowest = jnp.asarray(jnp.iinfo(input.dtype).min, dtype=input.dtype)
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
    floating = jnp.issubdtype(input.dtype, jnp.floating)
    init = np.asarray(-np.inf if floating else np.iinfo(input.dtype).min, dtype=input.dtype)
    values = lax.reduce_window(input, init, lax.max, **window)
    _, indices = lax.reduce_window(
        (lax.stop_gradient(input), indices),
        (lowest, jnp.asarray(_NO_INDEX, dtype=jnp.int64)),
        _first_maximum,
        **window,
    )
    return values, indices


@_compiled("spatial")
def _max_pool_backward(grad_output, input, indices, spatial):
    """Scatter-add each output's gradient to the input element its index names."""
    if input.size == 0 or grad_output.size == 0:
        return jnp.zeros(input.shape, dtype=grad_output.dtype)
    batch = input.shape[:-spatial]
    plane = math.prod(input.shape[-spatial:])
    grad = grad_output.reshape(batch + (-1,)).astype(_accumulator(grad_output.dtype))
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


@_compiled("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override", "spatial")
def _avg_pool(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, spatial):
    kernel = _expand(kernel_size, spatial)
    stride = _expand(stride, spatial) if stride else kernel
    padding = _expand(padding, spatial)
    sizes = input.shape[-spatial:]
    outs = [_pooled_size(sizes[i], kernel[i], stride[i], padding[i], 1, ceil_mode) for i in range(spatial)]
    high = [max(0, (outs[i] - 1) * stride[i] + kernel[i] - sizes[i] - padding[i]) for i in range(spatial)]
    accumulator = _accumulator(input.dtype)
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


def _linear_backward(forward, grad_output, like):
    """The gradient of a linear map `forward` at input shape/dtype `like`, applied to grad_output."""
    _, pullback = jax.vjp(forward, jnp.zeros(like.shape, dtype=like.dtype))
    return pullback(grad_output.astype(like.dtype))[0]


@_compiled("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override", "spatial")
def _avg_pool_backward(grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, spatial):
    def forward(input):
        return _avg_pool(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, spatial)

    return _linear_backward(forward, grad_output, input)


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


@_compiled("output_size", "spatial")
def _adaptive_avg_pool(input, output_size, spatial):
    output_size = _expand(output_size, spatial)
    accumulator = _accumulator(input.dtype)
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


@_compiled("spatial")
def _adaptive_avg_pool_backward(grad_output, input, spatial):
    output_size = grad_output.shape[-spatial:]
    return _linear_backward(lambda input: _adaptive_avg_pool(input, output_size, spatial), grad_output, input)


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
    return _adaptive_max_pool2d(self, _expand(output_size, 2))


@_compiled("output_size")
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
    if jnp.issubdtype(self.dtype, jnp.floating):
        fill = -jnp.inf
    else:
        fill = jnp.iinfo(self.dtype).min
    windows = jnp.where(valid, windows, jnp.asarray(fill, dtype=self.dtype))
    flat = rows[:, :, None, None] * width + cols[None, None, :, :]
    # Bring the window axes last, in row-major order, for one argmax per window.
    windows = jnp.moveaxis(windows, -3, -2)
    span = row_span * col_span
    windows = windows.reshape(windows.shape[:-2] + (span,))
    flat = np.moveaxis(flat, 1, 2).reshape(output_size[0], output_size[1], span)
    # torch keeps the first of equal maxima but the last NaN (see _first_maximum).
    is_nan = windows != windows
    last_nan = span - 1 - jnp.argmax(is_nan[..., ::-1], axis=-1)
    choice = jnp.where(jnp.any(is_nan, axis=-1), last_nan, jnp.argmax(windows, axis=-1))
    values = jnp.take_along_axis(windows, choice[..., None], axis=-1)[..., 0]
    indices = jnp.asarray(flat)[np.arange(output_size[0])[:, None], np.arange(output_size[1])[None, :], choice]
    return values, indices.astype(jnp.int64)


@register_mapping(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _max_pool_backward(grad_output, self, indices, 2)


# ---------------------------------------------------------------- upsampling


def _upsample_scale(input_size, output_size, scale, align_corners=False, real=np.float32):
    """The source-per-destination ratio torch uses, in the `real` type its kernel computes it in."""
    if align_corners:
        return real((input_size - 1) / (output_size - 1)) if output_size > 1 else real(0)
    if scale is not None and scale > 0:
        return real(1.0 / scale)
    return real(input_size / output_size)


def _nearest_indices(input_size, output_size, scale):
    # torch's nearest kernels compute the ratio in float32 whatever the input dtype.
    ratio = _upsample_scale(input_size, output_size, scale)
    source = np.floor(np.arange(output_size, dtype=np.float32) * ratio).astype(np.int64)
    return np.minimum(source, input_size - 1)


@_compiled("output_size", "scales")
def _upsample_nearest(input, output_size, scales):
    out = input
    spatial = len(output_size)
    for i in range(spatial):
        axis = input.ndim - spatial + i
        out = jnp.take(out, _nearest_indices(input.shape[axis], output_size[i], scales[i]), axis=axis)
    return out


def _linear_weights(input_size, output_size, scale, align_corners, real):
    """Source indices and weights for linear interpolation along one dimension, as torch computes them.

    `real` is the type of torch's arithmetic: float64 for float64 inputs, float32 otherwise.
    """
    ratio = _upsample_scale(input_size, output_size, scale, align_corners, real)
    destination = np.arange(output_size, dtype=real)
    if align_corners:
        source = destination * ratio
    else:
        source = np.maximum((destination + real(0.5)) * ratio - real(0.5), real(0))
    low = np.minimum(source.astype(np.int64), input_size - 1)
    high = np.minimum(low + 1, input_size - 1)
    high_weight = (source - low).astype(real)
    return low, high, real(1) - high_weight, high_weight


@_compiled("output_size", "align_corners", "scales")
def _upsample_bilinear(input, output_size, align_corners, scales):
    accumulator = _accumulator(input.dtype)
    real = np.float64 if accumulator == jnp.float64 else np.float32
    rows_low, rows_high, rows_low_weight, rows_high_weight = _linear_weights(
        input.shape[-2], output_size[0], scales[0], align_corners, real
    )
    cols_low, cols_high, cols_low_weight, cols_high_weight = _linear_weights(
        input.shape[-1], output_size[1], scales[1], align_corners, real
    )
    values = input.astype(accumulator)

    def weights(array):
        return jnp.asarray(array, dtype=accumulator)

    def along_cols(rows):
        picked = jnp.take(values, rows, axis=-2)
        return weights(cols_low_weight) * jnp.take(picked, cols_low, axis=-1) + weights(cols_high_weight) * jnp.take(
            picked, cols_high, axis=-1
        )

    out = weights(rows_low_weight)[:, None] * along_cols(rows_low) + weights(rows_high_weight)[:, None] * along_cols(
        rows_high
    )
    return out.astype(input.dtype)


def _vec_output_size(input, output_size, scale_factors, spatial):
    if output_size is not None:
        return tuple(output_size), (None,) * spatial
    sizes = input.shape[-spatial:]
    return tuple(int(math.floor(sizes[i] * scale_factors[i])) for i in range(spatial)), tuple(scale_factors)


@register_mapping(aten.upsample_nearest2d.default)
def upsample_nearest2d(self, output_size, scales_h=None, scales_w=None):
    return _upsample_nearest(self, tuple(output_size), (scales_h, scales_w))


@register_mapping(aten.upsample_nearest2d.vec)
def upsample_nearest2d_vec(input, output_size, scale_factors):
    output_size, scales = _vec_output_size(input, output_size, scale_factors, 2)
    return _upsample_nearest(input, output_size, scales)


@_compiled("output_size", "input_size", "scales")
def _upsample_nearest_backward(grad_output, output_size, input_size, scales):
    like = jnp.zeros(input_size, dtype=_accumulator(grad_output.dtype))
    grad = _linear_backward(lambda input: _upsample_nearest(input, output_size, scales), grad_output, like)
    return grad.astype(grad_output.dtype)


@register_mapping(aten.upsample_nearest2d_backward.default)
def upsample_nearest2d_backward(grad_output, output_size, input_size, scales_h=None, scales_w=None):
    return _upsample_nearest_backward(grad_output, output_size, input_size, (scales_h, scales_w))


@register_mapping(aten.upsample_bilinear2d.default)
def upsample_bilinear2d(self, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_bilinear(self, tuple(output_size), align_corners, (scales_h, scales_w))


@register_mapping(aten.upsample_bilinear2d.vec)
def upsample_bilinear2d_vec(input, output_size, align_corners, scale_factors):
    output_size, scales = _vec_output_size(input, output_size, scale_factors, 2)
    return _upsample_bilinear(input, output_size, align_corners, scales)


@_compiled("output_size", "input_size", "align_corners", "scales")
def _upsample_bilinear_backward(grad_output, output_size, input_size, align_corners, scales):
    like = jnp.zeros(input_size, dtype=_accumulator(grad_output.dtype))

    def forward(input):
        return _upsample_bilinear(input, output_size, align_corners, scales)

    return _linear_backward(forward, grad_output, like).astype(grad_output.dtype)


@register_mapping(aten.upsample_bilinear2d_backward.default)
def upsample_bilinear2d_backward(grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_bilinear_backward(grad_output, output_size, input_size, align_corners, (scales_h, scales_w))


# ---------------------------------------------------------------- im2col / col2im (F.unfold / F.fold)


@_compiled("kernel_size", "dilation", "padding", "stride")
def _im2col(input, kernel_size, dilation, padding, stride):
    batched = input.ndim == 4
    if not batched:
        input = input[None]
    if input.size == 0:
        # conv_general_dilated_patches divides by the batch size; an empty input has empty columns.
        blocks = math.prod(
            (input.shape[2 + i] + 2 * padding[i] - dilation[i] * (kernel_size[i] - 1) - 1) // stride[i] + 1 for i in range(2)
        )
        columns = jnp.zeros((input.shape[0], input.shape[1] * math.prod(kernel_size), blocks), dtype=input.dtype)
        return columns if batched else columns[0]
    patches = lax.conv_general_dilated_patches(
        input,
        filter_shape=tuple(kernel_size),
        window_strides=tuple(stride),
        padding=[(p, p) for p in padding],
        rhs_dilation=tuple(dilation),
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
        precision=lax.Precision.HIGHEST,
    )
    # patches: (N, C * kh * kw, out_h, out_w) with channel-major features, the order torch uses.
    columns = patches.reshape(patches.shape[:2] + (-1,))
    return columns if batched else columns[0]


@register_mapping(aten.im2col.default)
def im2col(self, kernel_size, dilation, padding, stride):
    return _im2col(self, _expand(kernel_size, 2), _expand(dilation, 2), _expand(padding, 2), _expand(stride, 2))


@register_mapping(aten.col2im.default)
def col2im(self, output_size, kernel_size, dilation, padding, stride):
    return _col2im(self, _expand(output_size, 2), _expand(kernel_size, 2), _expand(dilation, 2), _expand(padding, 2), _expand(stride, 2))


@_compiled("output_size", "kernel_size", "dilation", "padding", "stride")
def _col2im(columns, output_size, kernel_size, dilation, padding, stride):
    batched = columns.ndim == 3
    channels = columns.shape[-2] // math.prod(kernel_size)
    image_shape = ((columns.shape[0],) if batched else ()) + (channels,) + tuple(output_size)
    like = jnp.zeros(image_shape, dtype=columns.dtype)

    def forward(image):
        return _im2col(image, kernel_size, dilation, padding, stride)

    # col2im is the adjoint of im2col: overlapping patches add up.
    return _linear_backward(forward, columns, like)


# ---------------------------------------------------------------- separable resampling (nearest, linear, cubic, antialiased)
#
# Each of these resamplings is a linear map applied along each spatial axis in turn: a (output,
# input) matrix per axis, built in NumPy at trace time with torch's index and weight arithmetic.
# The backward ops apply the transposed matrices.


def _nearest_matrix(input_size, output_size, scale, exact=False):
    if exact:
        # torch's nearest-exact: floor((i + 0.5) * ratio), the ratio in float32.
        ratio = _upsample_scale(input_size, output_size, scale)
        source = np.floor((np.arange(output_size, dtype=np.float32) + np.float32(0.5)) * ratio).astype(np.int64)
        source = np.minimum(source, input_size - 1)
    else:
        source = _nearest_indices(input_size, output_size, scale)
    matrix = np.zeros((output_size, input_size), dtype=np.float64)
    matrix[np.arange(output_size), source] = 1.0
    return matrix


def _linear_matrix(input_size, output_size, scale, align_corners, real):
    low, high, low_weight, high_weight = _linear_weights(input_size, output_size, scale, align_corners, real)
    matrix = np.zeros((output_size, input_size), dtype=real)
    rows = np.arange(output_size)
    np.add.at(matrix, (rows, low), low_weight)
    np.add.at(matrix, (rows, high), high_weight)
    return matrix


def _cubic_matrix(input_size, output_size, scale, align_corners, real):
    """torch's bicubic taps (A = -0.75) at the four neighbours, indices clamped to the input."""
    ratio = _upsample_scale(input_size, output_size, scale, align_corners, real)
    destination = np.arange(output_size, dtype=real)
    source = destination * ratio if align_corners else (destination + real(0.5)) * ratio - real(0.5)
    floor = np.floor(source)
    t = (source - floor).astype(real)
    a = real(-0.75)

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + real(1)

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    weights = [far(t + real(1)), near(t), near(real(1) - t), far(real(2) - t)]
    matrix = np.zeros((output_size, input_size), dtype=real)
    rows = np.arange(output_size)
    for tap, weight in enumerate(weights):
        columns = np.clip(floor.astype(np.int64) - 1 + tap, 0, input_size - 1)
        np.add.at(matrix, (rows, columns), weight.astype(real))
    return matrix


def _antialias_matrix(input_size, output_size, scale, align_corners, real):
    """torch's antialiased bilinear weights: a triangle filter stretched by the downscaling ratio,
    normalized over the input elements it covers."""
    ratio = _upsample_scale(input_size, output_size, scale, align_corners, real)
    support = real(ratio if ratio >= 1 else 1.0)
    inverse = real(1.0 / ratio) if ratio >= 1 else real(1.0)
    matrix = np.zeros((output_size, input_size), dtype=real)
    for i in range(output_size):
        center = ratio * real(i + 0.5)
        start = max(int(center - support + real(0.5)), 0)
        size = min(int(center + support + real(0.5)), input_size) - start
        offsets = (np.arange(size, dtype=real) + real(start) - center + real(0.5)) * inverse
        weights = np.maximum(real(1) - np.abs(offsets), real(0)).astype(real)
        total = weights.sum(dtype=real)
        if total != 0:
            weights = (weights / total).astype(real)
        matrix[i, start : start + size] = weights
    return matrix


def _resample_matrices(kind, input_sizes, output_sizes, scales, align_corners, real):
    if kind == "nearest" or kind == "nearest-exact":
        return [_nearest_matrix(i, o, s, exact=kind == "nearest-exact") for i, o, s in zip(input_sizes, output_sizes, scales)]
    build = {"linear": _linear_matrix, "cubic": _cubic_matrix, "antialias": _antialias_matrix}[kind]
    return [build(i, o, s, align_corners, real) for i, o, s in zip(input_sizes, output_sizes, scales)]


def _real_for(dtype):
    return np.float64 if _accumulator(dtype) == jnp.float64 else np.float32


def _apply_along_axes(values, matrices, transpose, last_first):
    """Contract each spatial axis of `values` with its matrix (output x input, or transposed)."""
    spatial = len(matrices)
    order = range(spatial - 1, -1, -1) if last_first else range(spatial)
    for i in order:
        axis = values.ndim - spatial + i
        matrix = jnp.asarray(matrices[i], dtype=values.dtype)
        contracted = 0 if transpose else 1
        values = jnp.moveaxis(
            jnp.tensordot(values, matrix, axes=((axis,), (contracted,)), precision=lax.Precision.HIGHEST), -1, axis
        )
    return values


@_compiled("kind", "output_size", "align_corners", "scales")
def _resample(input, kind, output_size, align_corners, scales):
    spatial = len(output_size)
    matrices = _resample_matrices(kind, input.shape[-spatial:], output_size, scales, align_corners, _real_for(input.dtype))
    # torch's separable kernels resample the last axis first.
    out = _apply_along_axes(input.astype(_accumulator(input.dtype)), matrices, False, last_first=True)
    return out.astype(input.dtype)


@_compiled("kind", "output_size", "input_size", "align_corners", "scales")
def _resample_backward(grad_output, kind, output_size, input_size, align_corners, scales):
    spatial = len(output_size)
    matrices = _resample_matrices(kind, input_size[-spatial:], output_size, scales, align_corners, _real_for(grad_output.dtype))
    grad = _apply_along_axes(grad_output.astype(_accumulator(grad_output.dtype)), matrices, True, last_first=False)
    return grad.astype(grad_output.dtype)


@register_mapping(aten.upsample_nearest1d_backward.default)
def upsample_nearest1d_backward(grad_output, output_size, input_size, scales=None):
    return _resample_backward(grad_output, "nearest", tuple(output_size), tuple(input_size), False, (scales,))


@register_mapping(aten._upsample_nearest_exact1d_backward.default)
def upsample_nearest_exact1d_backward(grad_output, output_size, input_size, scales=None):
    return _resample_backward(grad_output, "nearest-exact", tuple(output_size), tuple(input_size), False, (scales,))


@register_mapping(aten.upsample_nearest3d_backward.default)
def upsample_nearest3d_backward(grad_output, output_size, input_size, scales_d=None, scales_h=None, scales_w=None):
    scales = (scales_d, scales_h, scales_w)
    return _resample_backward(grad_output, "nearest", tuple(output_size), tuple(input_size), False, scales)


@register_mapping(aten._upsample_nearest_exact2d_backward.default)
def upsample_nearest_exact2d_backward(grad_output, output_size, input_size, scales_h=None, scales_w=None):
    scales = (scales_h, scales_w)
    return _resample_backward(grad_output, "nearest-exact", tuple(output_size), tuple(input_size), False, scales)


@register_mapping(aten._upsample_nearest_exact3d_backward.default)
def upsample_nearest_exact3d_backward(grad_output, output_size, input_size, scales_d=None, scales_h=None, scales_w=None):
    scales = (scales_d, scales_h, scales_w)
    return _resample_backward(grad_output, "nearest-exact", tuple(output_size), tuple(input_size), False, scales)


@register_mapping(aten.upsample_linear1d_backward.default)
def upsample_linear1d_backward(grad_output, output_size, input_size, align_corners, scales=None):
    return _resample_backward(grad_output, "linear", tuple(output_size), tuple(input_size), align_corners, (scales,))


@register_mapping(aten.upsample_trilinear3d_backward.default)
def upsample_trilinear3d_backward(grad_output, output_size, input_size, align_corners, scales_d=None, scales_h=None, scales_w=None):
    scales = (scales_d, scales_h, scales_w)
    return _resample_backward(grad_output, "linear", tuple(output_size), tuple(input_size), align_corners, scales)


@register_mapping(aten.upsample_bicubic2d_backward.default)
def upsample_bicubic2d_backward(grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    return _resample_backward(grad_output, "cubic", tuple(output_size), tuple(input_size), align_corners, (scales_h, scales_w))


@register_mapping(aten._upsample_bilinear2d_aa.default)
def upsample_bilinear2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    return _resample(self, "antialias", tuple(output_size), align_corners, (scales_h, scales_w))


@register_mapping(aten._upsample_bilinear2d_aa.vec)
def upsample_bilinear2d_aa_vec(input, output_size, align_corners, scale_factors):
    output_size, scales = _vec_output_size(input, output_size, scale_factors, 2)
    return _resample(input, "antialias", output_size, align_corners, scales)


@register_mapping(aten._upsample_bilinear2d_aa_backward.default)
def upsample_bilinear2d_aa_backward(grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    scales = (scales_h, scales_w)
    return _resample_backward(grad_output, "antialias", tuple(output_size), tuple(input_size), align_corners, scales)


@register_mapping(aten.adaptive_max_pool3d.default)
def adaptive_max_pool3d(self, output_size):
    return _adaptive_max_pool3d(self, _expand(output_size, 3))


@_compiled("output_size")
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
    if jnp.issubdtype(self.dtype, jnp.floating):
        fill = -jnp.inf
    else:
        fill = jnp.iinfo(self.dtype).min
    windows = jnp.where(mask, windows, jnp.asarray(fill, dtype=self.dtype))
    flat = np.broadcast_to((depth * sizes[1] + height) * sizes[2] + width, mask.shape)
    span = math.prod(mask.shape[3:])
    windows = windows.reshape(windows.shape[:-3] + (span,))
    flat = flat.reshape(tuple(output_size) + (span,))
    # torch keeps the first of equal maxima but the last NaN (see _first_maximum).
    is_nan = windows != windows
    last_nan = span - 1 - jnp.argmax(is_nan[..., ::-1], axis=-1)
    choice = jnp.where(jnp.any(is_nan, axis=-1), last_nan, jnp.argmax(windows, axis=-1))
    values = jnp.take_along_axis(windows, choice[..., None], axis=-1)[..., 0]
    indices = jnp.take_along_axis(jnp.broadcast_to(jnp.asarray(flat), windows.shape), choice[..., None], axis=-1)[..., 0]
    return values, indices.astype(jnp.int64)


@register_mapping(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return _max_pool_backward(grad_output, self, indices, 3)


# ---------------------------------------------------------------- _trilinear (F.bilinear)


@register_mapping(aten._trilinear.default)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """sum over `sumdim` of i1 * i2 * i3, each first unsqueezed at its `expand` dims.

    As torch's kernel does, in two contractions rounded to the dtype in between: i1 with i2 over
    the summed dims i3 lacks, then that with i3 over the rest.
    """
    operands = []
    for tensor, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        for dim in sorted(expand):
            tensor = jnp.expand_dims(tensor, dim)
        operands.append(tensor)
    ndim = operands[0].ndim
    # Broadcast sizes (a 0 wins over a 1).
    sizes = [next((o.shape[dim] for o in operands if o.shape[dim] != 1), 1) for dim in range(ndim)]
    letters = "abcdefghijklmnopqrstuvwxyz"[:ndim]
    present, squeezed = [], []
    for operand in operands:
        # Size-1 dims (the expanded ones, or broadcasting ones) are dropped from that operand.
        dropped = tuple(dim for dim in range(ndim) if operand.shape[dim] == 1 and sizes[dim] != 1)
        squeezed.append(jnp.squeeze(operand, dropped) if dropped else operand)
        present.append([dim for dim in range(ndim) if dim not in dropped])
    summed = set(sumdim)
    dtype = jnp.result_type(i1, i2, i3)
    accumulator = _accumulator(dtype)

    def contract(left, left_dims, right, right_dims, keep):
        text = "".join(letters[d] for d in left_dims) + "," + "".join(letters[d] for d in right_dims)
        return jnp.einsum(
            text + "->" + "".join(letters[d] for d in keep),
            left,
            right,
            precision=config.matmul_precision(),
            preferred_element_type=accumulator,
        ).astype(dtype)

    pair_dims = sorted(set(present[0]) | set(present[1]))
    pair_keep = [d for d in pair_dims if not (d in summed and d not in present[2])]
    pair = contract(squeezed[0], present[0], squeezed[1], present[1], pair_keep)
    keep = [d for d in range(ndim) if d not in summed and (d in pair_keep or d in present[2])]
    out = contract(pair, pair_keep, squeezed[2], present[2], keep)
    # Dims no operand has (size 1 everywhere) and that are not summed stay in the output.
    return out.reshape(tuple(1 if d not in keep else sizes[d] for d in range(ndim) if d not in summed))


# ---------------------------------------------------------------- max_unpool (the inverse of max pooling)


@_compiled("output_size")
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


@register_mapping(aten.max_unpool2d.default)
def max_unpool2d(self, indices, output_size):
    return _max_unpool(self, indices, tuple(output_size))


@register_mapping(aten.max_unpool3d.default)
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


@_compiled("kernel_size", "output_size")
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
    # torch keeps the first of equal maxima but the last NaN (see _first_maximum).
    is_nan = windows != windows
    span = windows.shape[-1]
    last_nan = span - 1 - jnp.argmax(is_nan[..., ::-1], axis=-1)
    choice = jnp.where(jnp.any(is_nan, axis=-1), last_nan, jnp.argmax(windows, axis=-1))
    values = jnp.take_along_axis(windows, choice[..., None], axis=-1)[..., 0]
    indices = jnp.take_along_axis(flat, choice[..., None], axis=-1)[..., 0]
    if not batched:
        values, indices = values[0], indices[0]
    return values, indices


@register_mapping(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, _expand(kernel_size, 2), _expand(output_size, 2), random_samples)


@register_mapping(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, _expand(kernel_size, 3), _expand(output_size, 3), random_samples)


@register_mapping(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad_output, self, kernel_size, output_size, indices):
    return _max_pool_backward(grad_output, self, indices, 2)


@register_mapping(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad_output, self, kernel_size, output_size, indices):
    return _max_pool_backward(grad_output, self, indices, 3)


# ---------------------------------------------------------------- grid sampling (backward)


def _grid_coordinates(padding_mode, align_corners):
    """(unnormalize, pad) of torch's grid samplers: grid coordinates in [-1, 1] to input positions,
    and the padding mode applied to them.

    Clamps, reflections and absolute values are written as `where`s so that their derivative at
    the boundary is 1, as in torch's backward kernels (JAX's min/max split ties in half).
    """

    def unnormalize(coords, size):
        scale = (size * 0.5 - 0.5) if align_corners else size * 0.5
        return coords * scale + (size * 0.5 - 0.5)

    def clamp(coords, size):
        return jnp.where(coords < 0, 0.0, jnp.where(coords > size - 1, size - 1.0, coords)).astype(coords.dtype)

    def reflect(coords, twice_low, twice_high):
        if twice_low == twice_high:
            return jnp.zeros_like(coords)
        low = twice_low / 2
        span = (twice_high - twice_low) / 2
        shifted = coords - low
        distance = jnp.where(shifted < 0, -shifted, shifted)
        extra = jnp.fmod(distance, span)
        flips = jnp.floor(distance / span).astype(jnp.int32)
        return jnp.where(flips % 2 == 0, extra + low, span + low - extra)

    def pad(coords, size):
        if padding_mode == 0:
            return coords
        if padding_mode == 1:
            return clamp(coords, size)
        if align_corners:
            return clamp(reflect(coords, 0, 2 * (size - 1)), size)
        return clamp(reflect(coords, -1, 2 * size - 1), size)

    return unnormalize, pad


def _grid_sample_2d(input, grid, interpolation_mode, padding_mode, align_corners):
    """torch's grid_sampler_2d (its decomposition, in JAX) for the backward's vjp."""
    batch, channels, height, width = input.shape

    unnormalize, pad = _grid_coordinates(padding_mode, align_corners)

    flat_input = input.reshape(batch, channels, height * width)

    def gather(taps):
        """sum over taps (xs, ys, weight) of input[ys, xs] * weight, as one gather (and one scatter in
        the vjp): compiling a gather per tap made bicubic's backward take seconds per signature."""
        xs = jnp.stack([tap[0] for tap in taps], axis=1)  # (N, taps, oH, oW)
        ys = jnp.stack([tap[1] for tap in taps], axis=1)
        weights = jnp.stack([jnp.broadcast_to(tap[2], xs.shape[:1] + xs.shape[2:]) for tap in taps], axis=1)
        inside = (xs >= 0) & (xs < width) & (ys >= 0) & (ys < height)
        flat = jnp.where(inside, ys * width + xs, 0).astype(jnp.int64).reshape(batch, 1, -1)
        values = jnp.take_along_axis(flat_input, flat, axis=2).reshape((batch, channels) + xs.shape[1:])
        weights = jnp.where(inside, weights, jnp.zeros((), input.dtype))
        return jnp.sum(values * weights[:, None], axis=2)

    x, y = grid[..., 0], grid[..., 1]
    if interpolation_mode == 0:
        ix, iy = pad(unnormalize(x, width), width), pad(unnormalize(y, height), height)
        west, north = jnp.floor(ix), jnp.floor(iy)
        east, south = west + 1, north + 1
        return gather(
            [
                (west, north, (east - ix) * (south - iy)),
                (east, north, (ix - west) * (south - iy)),
                (west, south, (east - ix) * (iy - north)),
                (east, south, (ix - west) * (iy - north)),
            ]
        )
    if interpolation_mode == 1:
        ix, iy = pad(unnormalize(x, width), width), pad(unnormalize(y, height), height)
        return gather([(jnp.round(ix), jnp.round(iy), jnp.ones_like(ix))])
    ix, iy = unnormalize(x, width), unnormalize(y, height)
    west, north = jnp.floor(ix), jnp.floor(iy)
    tx, ty = ix - west, iy - north
    a = -0.75

    def coefficients(t):
        near = lambda v: ((a + 2) * v - (a + 3)) * v * v + 1  # noqa: E731
        far = lambda v: ((a * v - 5 * a) * v + 8 * a) * v - 4 * a  # noqa: E731
        return far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)

    column_weights, row_weights = coefficients(tx), coefficients(ty)
    return gather(
        [
            (pad(west + (column - 1), width), pad(north + (row - 1), height), column_weights[column] * row_weights[row])
            for row in range(4)
            for column in range(4)
        ]
    )


@_compiled("interpolation_mode", "padding_mode", "align_corners", "output_mask", "spatial")
def _grid_sampler_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask, spatial):
    """grid_sampler_{2,3}d_backward: the vjp of the forward sampling, in the accumulation dtype."""
    accumulator = _accumulator(input.dtype)
    sample = _grid_sample_2d if spatial == 2 else _grid_sample_3d

    def forward(input, grid):
        return sample(input, grid, interpolation_mode, padding_mode, align_corners)

    _, pullback = jax.vjp(forward, input.astype(accumulator), grid.astype(accumulator))
    grad_input, grad_grid = pullback(grad_output.astype(accumulator))
    return (
        grad_input.astype(input.dtype) if output_mask[0] else None,
        grad_grid.astype(grid.dtype) if output_mask[1] else None,
    )


@register_mapping(aten.grid_sampler_2d_backward.default)
def grid_sampler_2d_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    return _grid_sampler_backward(
        grad_output, input, grid, interpolation_mode, padding_mode, align_corners, tuple(output_mask), 2
    )


def _grid_sample_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    """torch's grid_sampler_3d: trilinear (mode 0) or nearest (mode 1) sampling, one gather for all taps."""
    batch, channels, depth, height, width = input.shape
    unnormalize, pad = _grid_coordinates(padding_mode, align_corners)
    flat_input = input.reshape(batch, channels, depth * height * width)

    def gather(taps):
        xs, ys, zs = (jnp.stack([tap[axis] for tap in taps], axis=1) for axis in range(3))  # (N, taps, oD, oH, oW)
        weights = jnp.stack([jnp.broadcast_to(tap[3], xs.shape[:1] + xs.shape[2:]) for tap in taps], axis=1)
        inside = (xs >= 0) & (xs < width) & (ys >= 0) & (ys < height) & (zs >= 0) & (zs < depth)
        flat = jnp.where(inside, (zs * height + ys) * width + xs, 0).astype(jnp.int64).reshape(batch, 1, -1)
        values = jnp.take_along_axis(flat_input, flat, axis=2).reshape((batch, channels) + xs.shape[1:])
        weights = jnp.where(inside, weights, jnp.zeros((), input.dtype))
        return jnp.sum(values * weights[:, None], axis=2)

    ix = pad(unnormalize(grid[..., 0], width), width)
    iy = pad(unnormalize(grid[..., 1], height), height)
    iz = pad(unnormalize(grid[..., 2], depth), depth)
    if interpolation_mode == 1:
        return gather([(jnp.round(ix), jnp.round(iy), jnp.round(iz), jnp.ones_like(ix))])
    west, north, top = jnp.floor(ix), jnp.floor(iy), jnp.floor(iz)
    taps = []
    for dz in (0, 1):
        for dy in (0, 1):
            for dx in (0, 1):
                wx = (ix - west) if dx else (west + 1 - ix)
                wy = (iy - north) if dy else (north + 1 - iy)
                wz = (iz - top) if dz else (top + 1 - iz)
                taps.append((west + dx, north + dy, top + dz, wx * wy * wz))
    return gather(taps)


@_compiled("interpolation_mode", "padding_mode", "align_corners")
def _grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    accumulator = _accumulator(input.dtype)
    out = _grid_sample_3d(input.astype(accumulator), grid.astype(accumulator), interpolation_mode, padding_mode, align_corners)
    return out.astype(input.dtype)


@register_mapping(aten.grid_sampler_3d.default)
def grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners)


@register_mapping(aten.grid_sampler_3d_backward.default)
def grid_sampler_3d_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    return _grid_sampler_backward(
        grad_output, input, grid, interpolation_mode, padding_mode, align_corners, tuple(output_mask), 3
    )

# Indices that repeat: torch's formula gathers the gradient at each index (JAX's transpose of the
# scatter keeps only the last write's).
use_torch_gradient(aten.max_unpool2d, aten.max_unpool3d)
