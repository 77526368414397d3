"""The ONNX-op table, neural-network family: convolution and pooling, normalization, softmax,
dropout, resizing and the recurrent layers (see onnx_ops.py for how an entry is written).

ONNX writes pads as [begin of each spatial axis..., end of each...]; lax takes (begin, end)
pairs. Products and convolutions run at full float32 precision, as torch's CPU kernels.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge.runtime.onnx_graph import known, known_ints, register_onnx_op

HIGHEST = lax.Precision.HIGHEST


def _pairs(pads, spatial):
    pads = list(pads) if pads else [0] * (2 * spatial)
    return [(pads[axis], pads[axis + spatial]) for axis in range(spatial)]


def _auto_pads(auto_pad, sizes, kernel, strides, dilations, pads):
    """Explicit (begin, end) pads for each spatial axis, from ONNX's auto_pad."""
    spatial = len(sizes)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        result = []
        for size, k, stride, dilation in zip(sizes, kernel, strides, dilations):
            out = -(-size // stride)
            total = max((out - 1) * stride + (k - 1) * dilation + 1 - size, 0)
            small, large = total // 2, total - total // 2
            result.append((small, large) if auto_pad == "SAME_UPPER" else (large, small))
        return result
    if auto_pad == "VALID":
        return [(0, 0)] * spatial
    return _pairs(pads, spatial)


# ---------------------------------------------------------------------------- convolution


@register_onnx_op("Conv")
def conv(x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    spatial = x.ndim - 2
    kernel = w.shape[2:]
    strides = strides or [1] * spatial
    dilations = dilations or [1] * spatial
    padding = _auto_pads(auto_pad, x.shape[2:], kernel, strides, dilations, pads)
    result = lax.conv_general_dilated(
        x, w.astype(x.dtype), strides, padding, rhs_dilation=dilations, feature_group_count=group, precision=HIGHEST
    )
    if b is not None:
        result = result + b.reshape((1, -1) + (1,) * spatial)
    return result.astype(x.dtype)


@register_onnx_op("ConvTranspose")
def conv_transpose(x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                   output_padding=None, output_shape=None, pads=None, strides=None):
    spatial = x.ndim - 2
    kernel = w.shape[2:]
    strides = strides or [1] * spatial
    dilations = dilations or [1] * spatial
    output_padding = output_padding or [0] * spatial
    sizes = x.shape[2:]
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        targets = output_shape[-spatial:] if output_shape is not None else [size * stride for size, stride in zip(sizes, strides)]
        padding = []
        for axis in range(spatial):
            total = strides[axis] * (sizes[axis] - 1) + output_padding[axis] + (kernel[axis] - 1) * dilations[axis] + 1 - targets[axis]
            if auto_pad == "SAME_UPPER":
                padding.append((total // 2, total - total // 2))
            else:
                padding.append((total - total // 2, total // 2))
    elif auto_pad == "VALID":
        padding = [(0, 0)] * spatial
    else:
        padding = _pairs(pads, spatial)
    # A transposed convolution is a convolution of the input dilated by the strides with the
    # kernel flipped and its in/out channels swapped within each group.
    in_channels = w.shape[0]
    out_per_group = w.shape[1]
    kernel_array = w.reshape((group, in_channels // group, out_per_group) + kernel)
    kernel_array = jnp.swapaxes(kernel_array, 1, 2).reshape((group * out_per_group, in_channels // group) + kernel)
    kernel_array = jnp.flip(kernel_array, axis=tuple(range(2, 2 + spatial)))
    conv_padding = [
        ((kernel[axis] - 1) * dilations[axis] - padding[axis][0], (kernel[axis] - 1) * dilations[axis] - padding[axis][1] + output_padding[axis])
        for axis in range(spatial)
    ]
    result = lax.conv_general_dilated(
        x, kernel_array.astype(x.dtype), [1] * spatial, conv_padding, lhs_dilation=strides, rhs_dilation=dilations,
        feature_group_count=group, precision=HIGHEST,
    )
    if b is not None:
        result = result + b.reshape((1, -1) + (1,) * spatial)
    return result.astype(x.dtype)


# -------------------------------------------------------------------------------- pooling


def _pool_geometry(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    spatial = x.ndim - 2
    strides = strides or [1] * spatial
    dilations = dilations or [1] * spatial
    padding = _auto_pads(auto_pad, x.shape[2:], kernel_shape, strides, dilations, pads)
    extra = []
    for axis in range(spatial):
        size = x.shape[2 + axis] + sum(padding[axis])
        span = (kernel_shape[axis] - 1) * dilations[axis] + 1
        if ceil_mode:
            out = -(-(size - span) // strides[axis]) + 1
            # A last window must start inside the input or its begin padding (torch and ONNX agree).
            if (out - 1) * strides[axis] >= x.shape[2 + axis] + padding[axis][0]:
                out -= 1
        else:
            out = (size - span) // strides[axis] + 1
        extra.append(max((out - 1) * strides[axis] + span - size, 0))
    return strides, dilations, padding, extra


@register_onnx_op("MaxPool", ignores=("storage_order",))
def max_pool(x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape, pads=None, strides=None, outputs=1):
    strides, dilations, padding, extra = _pool_geometry(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    window_padding = [(0, 0), (0, 0)] + [(begin, end + more) for (begin, end), more in zip(padding, extra)]
    lowest = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    init = jnp.asarray(lowest, x.dtype)
    result = lax.reduce_window(
        x, init, lax.max, (1, 1) + tuple(kernel_shape), (1, 1) + tuple(strides), window_padding,
        window_dilation=(1, 1) + tuple(dilations),
    )
    if outputs == 1:
        return result
    # Indices into the flattened input (row-major), as ONNX's second output.
    flat = jnp.arange(int(np.prod(x.shape[2:])), dtype=jnp.int64).reshape(x.shape[2:])
    flat = jnp.broadcast_to(flat, x.shape)
    packed = lax.reduce_window(
        (x, flat), (init, jnp.asarray(-1, jnp.int64)), _max_with_index, (1, 1) + tuple(kernel_shape),
        (1, 1) + tuple(strides), window_padding, window_dilation=(1, 1) + tuple(dilations),
    )[1]
    channel = (jnp.arange(x.shape[0] * x.shape[1], dtype=jnp.int64) * int(np.prod(x.shape[2:]))).reshape(x.shape[:2] + (1,) * (x.ndim - 2))
    return result, packed + channel


def _max_with_index(left, right):
    left_value, left_index = left
    right_value, right_index = right
    take_right = (right_value > left_value) | ((right_value == left_value) & (right_index < left_index) & (right_index >= 0))
    take_right = take_right | (left_index < 0)
    return jnp.where(take_right, right_value, left_value), jnp.where(take_right, right_index, left_index)


@register_onnx_op("AveragePool")
def average_pool(x, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None, kernel_shape, pads=None, strides=None):
    strides, dilations, padding, extra = _pool_geometry(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    window = (1, 1) + tuple(kernel_shape)
    step = (1, 1) + tuple(strides)
    dilation = (1, 1) + tuple(dilations)
    window_padding = [(0, 0), (0, 0)] + [(begin, end + more) for (begin, end), more in zip(padding, extra)]
    total = lax.reduce_window(x, jnp.zeros((), x.dtype), lax.add, window, step, window_padding, window_dilation=dilation)
    with jax.ensure_compile_time_eval():  # counts depend on shapes only: computed now, not folded by XLA
        ones = jnp.ones((1, 1) + x.shape[2:], x.dtype)
        if count_include_pad:
            # Explicit pads count; what ceil_mode adds past them does not.
            ones = jnp.pad(ones, [(0, 0), (0, 0)] + list(padding), constant_values=1)
            count_padding = [(0, 0), (0, 0)] + [(0, more) for more in extra]
        else:
            count_padding = window_padding
        counts = np.asarray(lax.reduce_window(ones, jnp.zeros((), x.dtype), lax.add, window, step, count_padding, window_dilation=dilation))
    return (total / counts).astype(x.dtype)


@register_onnx_op("LpPool")
def lp_pool(x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape, p=2, pads=None, strides=None):
    strides, dilations, padding, extra = _pool_geometry(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    window_padding = [(0, 0), (0, 0)] + [(begin, end + more) for (begin, end), more in zip(padding, extra)]
    total = lax.reduce_window(
        jnp.abs(x) ** p, jnp.zeros((), x.dtype), lax.add, (1, 1) + tuple(kernel_shape), (1, 1) + tuple(strides),
        window_padding, window_dilation=(1, 1) + tuple(dilations),
    )
    return (total ** (1.0 / p)).astype(x.dtype)


@register_onnx_op("GlobalAveragePool")
def global_average_pool(x):
    return jnp.mean(x, axis=tuple(range(2, x.ndim)), keepdims=True)


@register_onnx_op("GlobalMaxPool")
def global_max_pool(x):
    return jnp.max(x, axis=tuple(range(2, x.ndim)), keepdims=True)


@register_onnx_op("GlobalLpPool")
def global_lp_pool(x, *, p=2):
    return (jnp.sum(jnp.abs(x) ** p, axis=tuple(range(2, x.ndim)), keepdims=True) ** (1.0 / p)).astype(x.dtype)


# ---------------------------------------------------------------------------- normalization


def _stash(x, stash_type):
    # stash_type 1: statistics in float32 (low-precision inputs are computed in float32).
    return jnp.float32 if stash_type == 1 and x.dtype in (jnp.float16, jnp.bfloat16) else x.dtype


@register_onnx_op("BatchNormalization", ignores=("spatial", "is_test", "consumed_inputs"))
def batch_normalization(x, scale, bias, mean, var, *, epsilon=1e-5, momentum=0.9, training_mode=0):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    if training_mode:
        axes = (0,) + tuple(range(2, x.ndim))
        batch_mean = jnp.mean(x, axes)
        batch_var = jnp.var(x, axes)
        y = (x - batch_mean.reshape(shape)) / jnp.sqrt(batch_var.reshape(shape) + epsilon) * scale.reshape(shape) + bias.reshape(shape)
        running_mean = mean * momentum + batch_mean * (1 - momentum)
        running_var = var * momentum + batch_var * (1 - momentum)
        return y.astype(x.dtype), running_mean.astype(mean.dtype), running_var.astype(var.dtype)
    inverse = (scale / jnp.sqrt(var + epsilon)).reshape(shape)
    return ((x - mean.reshape(shape)) * inverse + bias.reshape(shape)).astype(x.dtype)


@register_onnx_op("InstanceNormalization")
def instance_normalization(x, scale, bias, *, epsilon=1e-5):
    axes = tuple(range(2, x.ndim))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    mean = jnp.mean(x, axes, keepdims=True)
    var = jnp.var(x, axes, keepdims=True)
    return ((x - mean) / jnp.sqrt(var + epsilon) * scale.reshape(shape) + bias.reshape(shape)).astype(x.dtype)


@register_onnx_op("LayerNormalization")
def layer_normalization(x, scale, bias=None, *, axis=-1, epsilon=1e-5, stash_type=1):
    axis = axis + x.ndim if axis < 0 else axis
    axes = tuple(range(axis, x.ndim))
    compute = x.astype(_stash(x, stash_type))
    mean = jnp.mean(compute, axes, keepdims=True)
    var = jnp.mean(jnp.square(compute - mean), axes, keepdims=True)
    inverse_std = lax.rsqrt(var + epsilon)
    y = ((compute - mean) * inverse_std).astype(x.dtype) * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype), mean, inverse_std


@register_onnx_op("RMSNormalization")
def rms_normalization(x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    axis = axis + x.ndim if axis < 0 else axis
    compute = x.astype(_stash(x, stash_type))
    inverse = lax.rsqrt(jnp.mean(jnp.square(compute), tuple(range(axis, x.ndim)), keepdims=True) + epsilon)
    return ((compute * inverse).astype(x.dtype) * scale).astype(x.dtype)


@register_onnx_op("GroupNormalization")
def group_normalization(x, scale, bias, *, epsilon=1e-5, num_groups, stash_type=1, opset):
    batch, channels = x.shape[:2]
    compute = x.astype(_stash(x, stash_type)).reshape((batch, num_groups, -1))
    mean = jnp.mean(compute, -1, keepdims=True)
    var = jnp.var(compute, -1, keepdims=True)
    normalized = ((compute - mean) / jnp.sqrt(var + epsilon)).reshape(x.shape).astype(x.dtype)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    if opset < 21:  # scale and bias per group before opset 21
        scale, bias = jnp.repeat(scale, channels // num_groups), jnp.repeat(bias, channels // num_groups)
    return (normalized * scale.reshape(shape) + bias.reshape(shape)).astype(x.dtype)


@register_onnx_op("LpNormalization")
def lp_normalization(x, *, axis=-1, p=2):
    norm = jnp.sum(jnp.abs(x) ** p, axis=axis, keepdims=True) ** (1.0 / p) if p != 1 else jnp.sum(jnp.abs(x), axis=axis, keepdims=True)
    return jnp.where(norm == 0, 0, x / jnp.where(norm == 0, 1, norm)).astype(x.dtype)


@register_onnx_op("MeanVarianceNormalization")
def mean_variance_normalization(x, *, axes=(0, 2, 3)):
    axes = tuple(axes)
    mean = jnp.mean(x, axes, keepdims=True)
    return ((x - mean) / (jnp.sqrt(jnp.mean(jnp.square(x - mean), axes, keepdims=True)) + 1e-9)).astype(x.dtype)


@register_onnx_op("LRN")
def local_response_normalization(x, *, alpha=1e-4, beta=0.75, bias=1.0, size):
    square = jnp.square(x)
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    padded = jnp.pad(square, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))
    total = sum(lax.slice_in_dim(padded, offset, offset + x.shape[1], axis=1) for offset in range(size))
    return (x / (bias + alpha / size * total) ** beta).astype(x.dtype)


# ---------------------------------------------------------------------------------- softmax


def _softmax_family(function):
    def entry(x, *, axis=None, opset):
        if opset >= 13:
            return function(x, -1 if axis is None else axis).astype(x.dtype)
        # Before opset 13 the input is read as a 2-D matrix split at `axis` (default 1).
        axis = 1 if axis is None else (axis + x.ndim if axis < 0 else axis)
        flat = x.reshape((int(np.prod(x.shape[:axis])), -1))
        return function(flat, 1).reshape(x.shape).astype(x.dtype)

    return entry


def _hardmax(x, axis):
    return jax.nn.one_hot(jnp.argmax(x, axis=axis), x.shape[axis], axis=axis, dtype=x.dtype)


register_onnx_op("Softmax")(_softmax_family(lambda x, axis: jax.nn.softmax(x, axis=axis)))
register_onnx_op("LogSoftmax")(_softmax_family(lambda x, axis: jax.nn.log_softmax(x, axis=axis)))
register_onnx_op("Hardmax")(_softmax_family(_hardmax))


@register_onnx_op("Dropout", rng=True)
def dropout(data, ratio_input=None, training_mode=None, *, ratio=0.5, seed=None, key, outputs=1, opset):
    # Before opset 12 the ratio is an attribute and the op never drops at inference.
    rate = float(known(ratio_input, "ratio of Dropout")) if ratio_input is not None else ratio
    training = training_mode is not None and bool(known(training_mode, "training_mode of Dropout"))
    if not training or rate == 0:
        mask = jnp.ones(data.shape, jnp.bool_)
        return (data, mask) if outputs > 1 else data
    if seed is not None:
        key = jax.random.key(seed)
    mask = jax.random.bernoulli(key, 1 - rate, data.shape)
    result = jnp.where(mask, data / (1 - rate), 0).astype(data.dtype)
    return (result, mask) if outputs > 1 else result


# --------------------------------------------------------------------------------- resizing


def _cubic_weights(offset, a):
    distance = np.abs(offset)
    near = ((a + 2) * distance - (a + 3)) * distance * distance + 1
    far = ((a * distance - 5 * a) * distance + 8 * a) * distance - 4 * a
    return np.where(distance <= 1, near, np.where(distance < 2, far, 0.0))


def _source_coordinates(out_size, in_size, scale, mode, roi_start, roi_end):
    resized = np.arange(out_size, dtype=np.float64)
    if mode == "half_pixel":
        return (resized + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        adjustment = out_size / (scale * in_size)
        center = in_size / 2
        offset = center * (1 - adjustment)
        return offset + (resized + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (resized + 0.5) / scale - 0.5 if out_size > 1 else np.zeros(out_size)
    if mode == "align_corners":
        return resized * (in_size - 1) / (out_size - 1) if out_size > 1 else np.zeros(out_size)
    if mode == "asymmetric":
        return resized / scale
    if mode == "tf_half_pixel_for_nn":
        return (resized + 0.5) / scale
    if mode == "tf_crop_and_resize":
        if out_size > 1:
            return roi_start * (in_size - 1) + resized * (roi_end - roi_start) * (in_size - 1) / (out_size - 1)
        return np.full(out_size, 0.5 * (roi_start + roi_end) * (in_size - 1))
    raise NotImplementedError(f"Resize's coordinate_transformation_mode {mode!r}")


def _nearest(coordinates, mode):
    if mode == "round_prefer_floor":
        return np.where(coordinates == np.floor(coordinates) + 0.5, np.floor(coordinates), np.round(coordinates))
    if mode == "round_prefer_ceil":
        return np.where(coordinates == np.floor(coordinates) + 0.5, np.ceil(coordinates), np.round(coordinates))
    if mode == "floor":
        return np.floor(coordinates)
    return np.ceil(coordinates)


def _resize_matrix(out_size, in_size, scale, options, roi_start, roi_end):
    """The (out, in) matrix of weights that resizes one axis, and which outputs fall outside the
    input (tf_crop_and_resize's extrapolation)."""
    mode, coordinate_mode = options["mode"], options["coordinate_transformation_mode"]
    source = _source_coordinates(out_size, in_size, scale, coordinate_mode, roi_start, roi_end)
    outside = (source < 0) | (source > in_size - 1) if coordinate_mode == "tf_crop_and_resize" else np.zeros(out_size, bool)
    matrix = np.zeros((out_size, in_size))
    rows = np.arange(out_size)
    if mode == "nearest":
        index = np.clip(_nearest(source, options["nearest_mode"]), 0, in_size - 1).astype(np.int64)
        matrix[rows, index] = 1
        return matrix, outside
    antialias = options["antialias"] and scale < 1
    support_scale = scale if antialias else 1.0
    if mode == "linear":
        radius = 1.0 / support_scale
        kernel = lambda offset: np.maximum(0.0, 1 - np.abs(offset) * support_scale)  # noqa: E731
    else:
        radius = 2.0 / support_scale
        a = options["cubic_coeff_a"]
        kernel = lambda offset: _cubic_weights(offset * support_scale, a)  # noqa: E731
    base = np.floor(source)
    for step in range(-int(np.ceil(radius)) + 1, int(np.ceil(radius)) + 1):
        taps = base + step
        weights = kernel(source - taps)
        inside = (taps >= 0) & (taps <= in_size - 1)
        if options["exclude_outside"] or antialias:
            weights = np.where(inside, weights, 0.0)
        np.add.at(matrix, (rows, np.clip(taps, 0, in_size - 1).astype(np.int64)), weights)
    if options["exclude_outside"] or antialias:
        totals = matrix.sum(1, keepdims=True)
        matrix = matrix / np.where(totals == 0, 1, totals)
    return matrix, outside


@register_onnx_op("Resize")
def resize(x, roi=None, scales=None, sizes=None, *, antialias=0, axes=None, coordinate_transformation_mode="half_pixel",
           cubic_coeff_a=-0.75, exclude_outside=0, extrapolation_value=0.0, keep_aspect_ratio_policy="stretch",
           mode="nearest", nearest_mode="round_prefer_floor", opset):
    if opset < 11 and roi is not None and scales is None:  # opset 10: (X, scales)
        roi, scales = None, roi
    rank = x.ndim
    axes = list(range(rank)) if axes is None else [axis + rank if axis < 0 else axis for axis in axes]
    scale_values = None if scales is None or np.size(known(scales, "scales of Resize")) == 0 else known(scales, "scales of Resize").astype(np.float64)
    if scale_values is not None:
        out_sizes = [int(np.floor(x.shape[axis] * scale)) for axis, scale in zip(axes, scale_values)]
    else:
        wanted = known_ints(sizes, "sizes of Resize")
        scale_values = np.asarray([size / x.shape[axis] for axis, size in zip(axes, wanted)])
        if keep_aspect_ratio_policy != "stretch":
            chosen = scale_values.min() if keep_aspect_ratio_policy == "not_larger" else scale_values.max()
            scale_values = np.full(len(axes), chosen)
            out_sizes = [int(np.floor(x.shape[axis] * chosen + 0.5)) for axis in axes]
        else:
            out_sizes = list(wanted)
    roi_values = None if roi is None or np.size(known(roi, "roi of Resize")) == 0 else known(roi, "roi of Resize").astype(np.float64)
    options = dict(mode=mode, coordinate_transformation_mode=coordinate_transformation_mode, nearest_mode=nearest_mode,
                   cubic_coeff_a=cubic_coeff_a, exclude_outside=exclude_outside, antialias=antialias)
    result = x
    for position, axis in enumerate(axes):
        in_size, out_size, scale = x.shape[axis], out_sizes[position], scale_values[position]
        if out_size == in_size and scale == 1 and coordinate_transformation_mode != "tf_crop_and_resize":
            continue
        if roi_values is not None:
            count = len(roi_values) // 2
            roi_start, roi_end = roi_values[position if count == len(axes) else axis], roi_values[(position if count == len(axes) else axis) + count]
        else:
            roi_start, roi_end = 0.0, 1.0
        matrix, outside = _resize_matrix(out_size, in_size, scale, options, roi_start, roi_end)
        compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
        moved = jnp.moveaxis(result, axis, -1).astype(compute)
        resized = jnp.matmul(moved, jnp.asarray(matrix.T, compute), precision=HIGHEST)
        if outside.any():
            resized = jnp.where(jnp.asarray(outside), jnp.asarray(extrapolation_value, compute), resized)
        result = jnp.moveaxis(resized, -1, axis)
    if jnp.issubdtype(x.dtype, jnp.integer):
        result = jnp.round(result)
    return result.astype(x.dtype)


@register_onnx_op("Upsample")
def upsample(x, scales_input=None, *, mode="nearest", scales=None):
    scales = scales_input if scales_input is not None else np.asarray(scales, np.float32)
    return resize(x, None, scales, mode=mode, coordinate_transformation_mode="asymmetric", nearest_mode="floor", opset=11)


# -------------------------------------------------------------------------------- recurrent

_ACTIVATIONS = {
    "Sigmoid": jax.nn.sigmoid,
    "Tanh": jnp.tanh,
    "Relu": jax.nn.relu,
}


def _recurrent(cell, x, w, r, b, initial_states, direction, layout, hidden_size, gates, clip, sequence_lens=None):
    """Run `cell` over the sequence in each direction; returns Y and each final state. With
    `sequence_lens`, a batch entry's steps past its length leave its states as they are and give
    zeros in Y (a packed sequence's padding), so the reverse direction starts at its last step."""
    if layout == 1:  # batch first
        x = jnp.swapaxes(x, 0, 1)
        initial_states = [None if state is None else jnp.swapaxes(state, 0, 1) for state in initial_states]
    directions = 2 if direction == "bidirectional" else 1
    batch = x.shape[1]
    outputs, finals = [], [[] for _ in initial_states]
    for index in range(directions):
        reverse = direction == "reverse" or index == 1
        bias = None if b is None else b[index]
        states = tuple(
            jnp.zeros((batch, hidden_size), x.dtype) if state is None else state[index] for state in initial_states
        )

        def step(carry, inputs, index=index, bias=bias):
            x_t, time = inputs
            updated = cell(x_t, carry, w[index], r[index], bias, index, clip)
            if sequence_lens is None:
                return updated, updated[0]
            active = (time < sequence_lens)[:, None]
            updated = tuple(jnp.where(active, new, old) for new, old in zip(updated, carry))
            return updated, jnp.where(active, updated[0], jnp.zeros_like(updated[0]))

        carry, ys = lax.scan(step, states, (x, jnp.arange(x.shape[0])), reverse=reverse)
        outputs.append(ys)
        for position, state in enumerate(carry):
            finals[position].append(state)
    y = jnp.stack(outputs, 1)  # (seq, directions, batch, hidden)
    finals = [jnp.stack(states, 0) for states in finals]
    if layout == 1:
        y = jnp.transpose(y, (2, 0, 1, 3))
        finals = [jnp.swapaxes(state, 0, 1) for state in finals]
    return (y, *finals)


def _activation_functions(activations, count, directions, alphas=None, betas=None):
    names = activations or []
    functions = [_ACTIVATIONS[name] for name in names]
    if not functions:
        return None
    per = len(functions) // directions if len(functions) >= count * directions else len(functions)
    return [functions[index * per : (index + 1) * per] for index in range(directions)]


def _clip(value, clip):
    return value if clip is None else jnp.clip(value, -clip, clip)


@register_onnx_op("RNN")
def rnn(x, w, r, b=None, sequence_lens=None, initial_h=None, *, activation_alpha=None, activation_beta=None, activations=None,
        clip=None, direction="forward", hidden_size, layout=0):
    directions = 2 if direction == "bidirectional" else 1
    functions = _activation_functions(activations, 1, directions) or [[jnp.tanh]] * directions

    def cell(x_t, carry, w_d, r_d, bias, index, clip):
        (h,) = carry
        pre = jnp.matmul(x_t, w_d.T, precision=HIGHEST) + jnp.matmul(h, r_d.T, precision=HIGHEST)
        if bias is not None:
            pre = pre + bias[:hidden_size] + bias[hidden_size:]
        return (functions[index][0](_clip(pre, clip)),)

    return _recurrent(cell, x, w, r, b, [initial_h], direction, layout, hidden_size, 1, clip, sequence_lens)


@register_onnx_op("GRU")
def gru(x, w, r, b=None, sequence_lens=None, initial_h=None, *, activation_alpha=None, activation_beta=None, activations=None,
        clip=None, direction="forward", hidden_size, layout=0, linear_before_reset=0):
    directions = 2 if direction == "bidirectional" else 1
    functions = _activation_functions(activations, 2, directions) or [[jax.nn.sigmoid, jnp.tanh]] * directions
    size = hidden_size

    def cell(x_t, carry, w_d, r_d, bias, index, clip):
        (h,) = carry
        gate_f, candidate_g = functions[index][0], functions[index][1]
        wb = bias[: 3 * size] if bias is not None else jnp.zeros(3 * size, x_t.dtype)
        rb = bias[3 * size :] if bias is not None else jnp.zeros(3 * size, x_t.dtype)
        xw = jnp.matmul(x_t, w_d.T, precision=HIGHEST) + wb
        z = gate_f(_clip(xw[:, :size] + jnp.matmul(h, r_d[:size].T, precision=HIGHEST) + rb[:size], clip))
        reset = gate_f(_clip(xw[:, size : 2 * size] + jnp.matmul(h, r_d[size : 2 * size].T, precision=HIGHEST) + rb[size : 2 * size], clip))
        if linear_before_reset:
            hidden = reset * (jnp.matmul(h, r_d[2 * size :].T, precision=HIGHEST) + rb[2 * size :])
        else:
            hidden = jnp.matmul(reset * h, r_d[2 * size :].T, precision=HIGHEST) + rb[2 * size :]
        candidate = candidate_g(_clip(xw[:, 2 * size :] + hidden, clip))
        return ((1 - z) * candidate + z * h,)

    return _recurrent(cell, x, w, r, b, [initial_h], direction, layout, hidden_size, 3, clip, sequence_lens)


@register_onnx_op("LSTM")
def lstm(x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None, *, activation_alpha=None,
         activation_beta=None, activations=None, clip=None, direction="forward", hidden_size, input_forget=0, layout=0):
    directions = 2 if direction == "bidirectional" else 1
    functions = _activation_functions(activations, 3, directions) or [[jax.nn.sigmoid, jnp.tanh, jnp.tanh]] * directions
    size = hidden_size

    def cell(x_t, carry, w_d, r_d, bias, index, clip):
        h, c = carry
        gate_f, cell_g, out_h = functions[index]
        gates = jnp.matmul(x_t, w_d.T, precision=HIGHEST) + jnp.matmul(h, r_d.T, precision=HIGHEST)
        if bias is not None:
            gates = gates + bias[: 4 * size] + bias[4 * size :]
        peephole = p[index] if p is not None else jnp.zeros(3 * size, x_t.dtype)
        i = gate_f(_clip(gates[:, :size] + peephole[:size] * c, clip))
        f = gate_f(_clip(gates[:, 2 * size : 3 * size] + peephole[2 * size :] * c, clip))
        if input_forget:
            f = 1 - i
        g = cell_g(_clip(gates[:, 3 * size :], clip))
        c = f * c + i * g
        o = gate_f(_clip(gates[:, size : 2 * size] + peephole[size : 2 * size] * c, clip))
        return (o * out_h(c), c)

    return _recurrent(cell, x, w, r, b, [initial_h, initial_c], direction, layout, hidden_size, 4, clip, sequence_lens)
