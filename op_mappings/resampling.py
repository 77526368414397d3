"""Resampling: upsampling (nearest, linear, cubic, antialiased) and grid sampling, with their backward ops.

Source indices and interpolation weights are built in NumPy at trace time with torch's arithmetic.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge.runtime.registry import aten, register_mapping
from .common import accumulator_dtype, compiled, linear_backward


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


@compiled("output_size", "scales")
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


@compiled("output_size", "align_corners", "scales")
def _upsample_bilinear(input, output_size, align_corners, scales):
    accumulator = accumulator_dtype(input.dtype)
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


@compiled("output_size", "input_size", "scales")
def _upsample_nearest_backward(grad_output, output_size, input_size, scales):
    like = jnp.zeros(input_size, dtype=accumulator_dtype(grad_output.dtype))
    grad = linear_backward(lambda input: _upsample_nearest(input, output_size, scales), grad_output, like)
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


@compiled("output_size", "input_size", "align_corners", "scales")
def _upsample_bilinear_backward(grad_output, output_size, input_size, align_corners, scales):
    like = jnp.zeros(input_size, dtype=accumulator_dtype(grad_output.dtype))

    def forward(input):
        return _upsample_bilinear(input, output_size, align_corners, scales)

    return linear_backward(forward, grad_output, like).astype(grad_output.dtype)


@register_mapping(aten.upsample_bilinear2d_backward.default)
def upsample_bilinear2d_backward(grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_bilinear_backward(grad_output, output_size, input_size, align_corners, (scales_h, scales_w))


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
    return np.float64 if accumulator_dtype(dtype) == jnp.float64 else np.float32


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


@compiled("kind", "output_size", "align_corners", "scales")
def _resample(input, kind, output_size, align_corners, scales):
    spatial = len(output_size)
    matrices = _resample_matrices(kind, input.shape[-spatial:], output_size, scales, align_corners, _real_for(input.dtype))
    # torch's separable kernels resample the last axis first.
    out = _apply_along_axes(input.astype(accumulator_dtype(input.dtype)), matrices, False, last_first=True)
    return out.astype(input.dtype)


@compiled("kind", "output_size", "input_size", "align_corners", "scales")
def _resample_backward(grad_output, kind, output_size, input_size, align_corners, scales):
    spatial = len(output_size)
    matrices = _resample_matrices(kind, input_size[-spatial:], output_size, scales, align_corners, _real_for(grad_output.dtype))
    grad = _apply_along_axes(grad_output.astype(accumulator_dtype(grad_output.dtype)), matrices, True, last_first=False)
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
        the vjp): a gather per tap made bicubic's backward (16 taps) slow to compile."""
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


@compiled("interpolation_mode", "padding_mode", "align_corners", "output_mask", "spatial")
def _grid_sampler_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask, spatial):
    """grid_sampler_{2,3}d_backward: the vjp of the forward sampling, in the accumulation dtype."""
    accumulator = accumulator_dtype(input.dtype)
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


@compiled("interpolation_mode", "padding_mode", "align_corners")
def _grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    accumulator = accumulator_dtype(input.dtype)
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
