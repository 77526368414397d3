"""Discrete Fourier transforms: the _fft_c2c/_fft_r2c/_fft_c2r kernels torch.fft lowers to.

Each kernel computes the unnormalized transform over `dim` and then scales it by ATen's
`normalization` code (0: none, 1: 1/sqrt(n), 2: 1/n, n the product of the signal sizes), which
applies alike to forward and inverse transforms. XLA transforms at most three axes at once, so
longer axis lists are done in groups (the transform is separable).
"""

import math

import jax.numpy as jnp

from bridge.runtime.registry import aten, register_mapping

_MOST_AXES = 3


def _scaled(values, normalization, signal_size):
    if normalization == 0 or signal_size == 0:
        return values
    factor = 1 / math.sqrt(signal_size) if normalization == 1 else 1 / signal_size
    return values * jnp.asarray(factor, dtype=jnp.finfo(values.dtype).dtype)


def _c2c_unnormalized(values, axes, forward):
    # jnp's norm="backward" leaves the forward transform unscaled, norm="forward" the inverse.
    for start in range(0, len(axes), _MOST_AXES):
        group = axes[start : start + _MOST_AXES]
        if forward:
            values = jnp.fft.fftn(values, axes=group, norm="backward")
        else:
            values = jnp.fft.ifftn(values, axes=group, norm="forward")
    return values


def _axes(values, dim):
    return [axis % values.ndim for axis in dim]


@register_mapping(aten._fft_c2c.default)
def fft_c2c(self, dim, normalization, forward):
    axes = _axes(self, dim)
    result = _c2c_unnormalized(self, axes, forward)
    return _scaled(result, normalization, math.prod(self.shape[axis] for axis in axes))


@register_mapping(aten._fft_r2c.default)
def fft_r2c(self, dim, normalization, onesided):
    axes = _axes(self, dim)
    signal_size = math.prod(self.shape[axis] for axis in axes)
    if not onesided:
        complex_dtype = jnp.result_type(self.dtype, jnp.complex64)
        result = _c2c_unnormalized(self.astype(complex_dtype), axes, True)
    else:
        # The last axis is halved (its Hermitian half kept), the others transformed in full.
        result = jnp.fft.rfft(self, axis=axes[-1], norm="backward")
        result = _c2c_unnormalized(result, axes[:-1], True)
    return _scaled(result, normalization, signal_size)


@register_mapping(aten._fft_c2r.default)
def fft_c2r(self, dim, normalization, last_dim_size):
    axes = _axes(self, dim)
    result = _c2c_unnormalized(self, axes[:-1], False)
    result = jnp.fft.irfft(result, n=last_dim_size, axis=axes[-1], norm="forward")
    signal_size = math.prod(self.shape[axis] for axis in axes[:-1]) * last_dim_size
    return _scaled(result, normalization, signal_size)


# torch.fft.ihfft2/ihfftn conjugate their one-sided result with the physical (non-lazy) kernel.
@register_mapping(aten._conj_physical.default)
def conj_physical(self):
    return jnp.conj(self)
