"""Pairwise distances: cdist and pdist, forward and backward.

The backward ops are torch's closed forms (not a vjp of the forward): at a zero distance the
p-norm has no derivative, and torch's kernels give 0 there, where a vjp of `sqrt` gives NaN.
"""

import math

import jax.numpy as jnp
import numpy as np

from bridge.runtime import precision
from bridge.runtime.registry import aten, register_mapping
from .common import accumulator_dtype


def _norm(difference, p):
    """The p-norm over the last axis, with torch's special cases for p = 0, 1, 2 and inf."""
    magnitude = jnp.abs(difference)
    if p == 0:
        return jnp.sum((magnitude != 0).astype(difference.dtype), axis=-1)
    if p == 1:
        return jnp.sum(magnitude, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(magnitude * magnitude, axis=-1))
    if math.isinf(p):
        if difference.shape[-1] == 0:
            return jnp.zeros(difference.shape[:-1], dtype=difference.dtype)
        return jnp.max(magnitude, axis=-1)
    return jnp.power(jnp.sum(jnp.power(magnitude, p), axis=-1), 1.0 / p)


def _norm_gradient(difference, distance, grad, p):
    """d(p-norm of `difference`)/d(difference) times grad, with torch's value 0 where it has none.

    difference: (..., M); distance, grad: (...,).
    """
    distance = distance[..., None]
    grad = grad[..., None]
    zero = jnp.zeros((), dtype=difference.dtype)
    if p == 0:
        return jnp.zeros_like(difference)
    if p == 1:
        return grad * jnp.sign(difference)
    if p == 2:
        return jnp.where(distance == 0, zero, grad * difference / jnp.where(distance == 0, 1, distance))
    if math.isinf(p):
        return grad * jnp.sign(difference) * (jnp.abs(difference) == distance).astype(difference.dtype)
    magnitude = jnp.abs(difference)
    safe_distance = jnp.where(distance == 0, 1, distance)
    if p < 2:
        undefined = (distance == 0) | ((difference == 0) & (p < 1))
        value = jnp.sign(difference) * jnp.power(magnitude, p - 1) * grad / jnp.power(safe_distance, p - 1)
    else:
        undefined = distance == 0
        value = difference * jnp.power(magnitude, p - 2) * grad / jnp.power(safe_distance, p - 1)
    return jnp.where(undefined, zero, value)


def _broadcast_batches(x1, x2):
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    return jnp.broadcast_to(x1, batch + x1.shape[-2:]), jnp.broadcast_to(x2, batch + x2.shape[-2:])


def _uses_matmul(p, compute_mode, rows1, rows2):
    # torch's cdist: 0 (or None) = matrix products when either side has more than 25 rows,
    # 1 = always, 2 = never; only for p = 2.
    mode = 0 if compute_mode is None else compute_mode
    return p == 2 and (mode == 1 or (mode == 0 and (rows1 > 25 or rows2 > 25)))


def _euclidean_by_matmul(x1, x2):
    """torch's `_euclidean_dist`: |a|^2 + |b|^2 - 2 a.b as one matrix product, clamped at 0."""
    x1_norm = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    x2_norm = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    left = jnp.concatenate([x1 * -2, x1_norm, jnp.ones_like(x1_norm)], axis=-1)
    right = jnp.concatenate([x2, jnp.ones_like(x2_norm), x2_norm], axis=-1)
    products = jnp.matmul(left, jnp.swapaxes(right, -1, -2), precision=precision.matmul_precision())
    return jnp.sqrt(jnp.maximum(products, 0))


# Zero distances (equal rows, as at special points) have gradient 0 in torch (NaN or 4x off by
# JAX's rule of the norm).
@register_mapping(aten._cdist_forward.default, gradient="torch", reads=("precision",))
def cdist_forward(x1, x2, p, compute_mode):
    dtype = jnp.result_type(x1, x2)
    accumulator = accumulator_dtype(dtype)
    x1, x2 = _broadcast_batches(x1.astype(accumulator), x2.astype(accumulator))
    if _uses_matmul(p, compute_mode, x1.shape[-2], x2.shape[-2]) and x1.size and x2.size:
        return _euclidean_by_matmul(x1, x2).astype(dtype)
    difference = x1[..., :, None, :] - x2[..., None, :, :]
    return _norm(difference, p).astype(dtype)


@register_mapping(aten._cdist_backward.default)
def cdist_backward(grad, x1, x2, p, cdist):
    dtype = x1.dtype
    if 0 in grad.shape or x1.shape[-1] == 0:
        return jnp.zeros_like(x1)  # torch's kernel: zeros shaped as x1, batch not broadcast
    accumulator = accumulator_dtype(dtype)
    x1, x2 = _broadcast_batches(x1.astype(accumulator), x2.astype(accumulator))
    difference = x1[..., :, None, :] - x2[..., None, :, :]
    per_pair = _norm_gradient(difference, cdist.astype(accumulator), grad.astype(accumulator), p)
    return jnp.sum(per_pair, axis=-2).astype(dtype)


def _pairs(count):
    """The (i, j), i < j, of pdist's output, in its order."""
    return np.triu_indices(count, k=1)


@register_mapping(aten._pdist_forward.default)
def pdist_forward(self, p=2.0):
    accumulator = accumulator_dtype(self.dtype)
    rows, cols = _pairs(self.shape[0])
    values = self.astype(accumulator)
    difference = values[rows] - values[cols]
    return _norm(difference, p).astype(self.dtype)


@register_mapping(aten._pdist_backward.default)
def pdist_backward(grad, self, p, pdist):
    count = self.shape[0]
    accumulator = accumulator_dtype(self.dtype)
    rows, cols = _pairs(count)
    values = self.astype(accumulator)
    difference = values[rows] - values[cols]
    per_pair = _norm_gradient(difference, pdist.astype(accumulator), grad.astype(accumulator), p)
    # Pair (i, j) pushes x_i along +gradient and x_j along -gradient.
    out = jnp.zeros(values.shape, dtype=accumulator)
    out = out.at[rows].add(per_pair).at[cols].add(-per_pair)
    return out.astype(self.dtype)

