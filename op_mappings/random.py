"""Random ops: factories (rand, randn, randint, randperm), distributions that fill a tensor's shape, dropout.

Every entry is `rng=True`: dispatch hands it a fresh JAX key as `key=`. The samples follow
torch's distributions but not its bit streams. In-place forms (`uniform_`, `normal_`,
`bernoulli_`, `random_`, ...) are derived by the runtime from the functional entries here.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge.runtime.dtypes import is_lifted_float
from bridge.runtime.registry import aten, jnp_dtype, register_mapping
from .common import default_float


def _sampling_dtype(dtype):
    """The float dtype to draw in: float64 stays, everything else draws in float32."""
    return jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


def _uniform(key, shape, dtype, low=0.0, high=1.0):
    """Uniform on [low, high); drawn in the target float dtype itself so rounding cannot reach `high`."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jax.random.uniform(key, shape, dtype=dtype, minval=low, maxval=high)
    return jax.random.uniform(key, shape, dtype=jnp.float32, minval=low, maxval=high).astype(dtype)


def _normal(key, shape, dtype):
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jax.random.normal(key, shape, dtype=dtype)
    return jax.random.normal(key, shape, dtype=_sampling_dtype(dtype)).astype(dtype)


def _open_uniform(key, shape, dtype):
    """Uniform on (0, 1), for the inverse-CDF samplers that take a logarithm."""
    sampling = _sampling_dtype(dtype)
    return jax.random.uniform(key, shape, dtype=sampling, minval=jnp.finfo(sampling).tiny, maxval=1.0)


def _integers(key, shape, low, high_inclusive, dtype):
    """Integers uniform on [low, high_inclusive], including ranges as wide as int64's."""
    if high_inclusive < np.iinfo(np.int64).max:
        return jax.random.randint(key, shape, low, high_inclusive + 1, dtype=jnp.int64).astype(dtype)
    # [low, 2**63 - 1]: draw 64 random bits and fold them into the range in unsigned arithmetic.
    width = high_inclusive - low + 1
    bits = jax.random.bits(key, shape, dtype=jnp.uint64)
    if width < 2**64:
        bits = bits % jnp.asarray(width, dtype=jnp.uint64)
    shifted = bits + jnp.asarray(low % 2**64, dtype=jnp.uint64)
    return lax.bitcast_convert_type(shifted, jnp.int64).astype(dtype)


def _full_range(dtype):
    """The largest value `random_()` draws for a dtype: 2**mantissa digits for floats, the max for integers."""
    if dtype == jnp.bool_:
        return 1
    if jnp.issubdtype(dtype, jnp.floating):
        return 2 ** (jnp.finfo(dtype).nmant + 1)
    return int(jnp.iinfo(dtype).max)


# ---------------------------------------------------------------- factories


@register_mapping(aten.rand, rng=True)
def rand(size, *, key, dtype=None, generator=None, **ignored):
    return _uniform(key, tuple(size), jnp_dtype(dtype, default_float()))


@register_mapping(aten.randn, rng=True)
def randn(size, *, key, dtype=None, generator=None, **ignored):
    return _normal(key, tuple(size), jnp_dtype(dtype, default_float()))


@register_mapping(aten.rand_like, rng=True)
def rand_like(self, *, key, dtype=None, generator=None, **ignored):
    return _uniform(key, self.shape, jnp_dtype(dtype, self.dtype))


@register_mapping(aten.randn_like, rng=True)
def randn_like(self, *, key, dtype=None, generator=None, **ignored):
    return _normal(key, self.shape, jnp_dtype(dtype, self.dtype))


@register_mapping(aten.randint.default, aten.randint.generator, rng=True)
def randint(high, size, *, key, dtype=None, generator=None, **ignored):
    return _integers(key, tuple(size), 0, high - 1, jnp_dtype(dtype, jnp.dtype(jnp.int64)))


@register_mapping(aten.randint.low, aten.randint.low_generator, rng=True)
def randint_low(low, high, size, *, key, dtype=None, generator=None, **ignored):
    return _integers(key, tuple(size), low, high - 1, jnp_dtype(dtype, jnp.dtype(jnp.int64)))


@register_mapping(aten.randint_like.default, aten.randint_like.generator, rng=True)
def randint_like(self, high, *, key, dtype=None, generator=None, **ignored):
    return _integers(key, self.shape, 0, high - 1, jnp_dtype(dtype, self.dtype))


@register_mapping(aten.randint_like.Tensor, aten.randint_like.Tensor_generator, rng=True)
def randint_like_tensor(self, high, *, key, dtype=None, generator=None, **ignored):
    # `high` is a 0-dim tensor: its value is only known on the device, so no host-side range logic.
    values = jax.random.randint(key, self.shape, 0, high.astype(jnp.int64), dtype=jnp.int64)
    return values.astype(jnp_dtype(dtype, self.dtype))


@register_mapping(aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype, rng=True)
def randint_like_low(self, low, high, *, key, dtype=None, generator=None, **ignored):
    return _integers(key, self.shape, low, high - 1, jnp_dtype(dtype, self.dtype))


@register_mapping(aten.randperm, rng=True)
def randperm(n, *, key, dtype=None, generator=None, **ignored):
    return jax.random.permutation(key, n).astype(jnp_dtype(dtype, jnp.dtype(jnp.int64)))


# ---------------------------------------------------------------- distributions over a tensor's shape and dtype


@register_mapping(aten.uniform, rng=True)
def uniform(self, low=0.0, high=1.0, *, key, generator=None):
    # The schema names these `from` and `to`; torch passes them positionally.
    return _uniform(key, self.shape, self.dtype, low, high)


@register_mapping(aten.normal_functional, rng=True)
def normal_functional(self, mean=0.0, std=1.0, *, key, generator=None):
    return (mean + std * _normal(key, self.shape, _sampling_dtype(self.dtype))).astype(self.dtype)


@register_mapping(aten.normal.Tensor_float, rng=True)
def normal_tensor_float(mean, std=1.0, *, key, generator=None):
    return (mean + std * _normal(key, mean.shape, _sampling_dtype(mean.dtype))).astype(mean.dtype)


@register_mapping(aten.normal.float_Tensor, rng=True)
def normal_float_tensor(mean, std, *, key, generator=None):
    return (mean + std * _normal(key, std.shape, _sampling_dtype(std.dtype))).astype(std.dtype)


@register_mapping(aten.normal.Tensor_Tensor, rng=True)
def normal_tensor_tensor(mean, std, *, key, generator=None):
    dtype = jnp.promote_types(mean.dtype, std.dtype)
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    return (mean + std * _normal(key, shape, _sampling_dtype(dtype))).astype(dtype)


@register_mapping(aten.normal.float_float, rng=True)
def normal_float_float(mean, std, size, *, key, dtype=None, generator=None, **ignored):
    dtype = jnp_dtype(dtype, default_float())
    return (mean + std * _normal(key, tuple(size), _sampling_dtype(dtype))).astype(dtype)


@register_mapping(aten.log_normal, rng=True)
def log_normal(self, mean=1.0, std=2.0, *, key, generator=None):
    return jnp.exp(mean + std * _normal(key, self.shape, _sampling_dtype(self.dtype))).astype(self.dtype)


@register_mapping(aten.exponential, rng=True)
def exponential(self, lambd=1.0, *, key, generator=None):
    samples = -jnp.log(_open_uniform(key, self.shape, self.dtype)) / lambd
    return samples.astype(self.dtype)


@register_mapping(aten.geometric, rng=True)
def geometric(self, p, *, key, generator=None):
    # Number of Bernoulli(p) trials up to and including the first success: support {1, 2, ...}.
    samples = jnp.ceil(jnp.log(_open_uniform(key, self.shape, self.dtype)) / jnp.log1p(-p))
    return jnp.maximum(samples, 1).astype(self.dtype)


@register_mapping(aten.cauchy, rng=True)
def cauchy(self, median=0.0, sigma=1.0, *, key, generator=None):
    samples = jax.random.cauchy(key, self.shape, dtype=_sampling_dtype(self.dtype))
    return (median + sigma * samples).astype(self.dtype)


@register_mapping(aten.random.default, rng=True)
def random(self, *, key, generator=None):
    return _integers(key, self.shape, 0, _full_range(self.dtype), self.dtype)


@register_mapping(aten.random.to, rng=True)
def random_to(self, to, *, key, generator=None):
    return _integers(key, self.shape, 0, to - 1, self.dtype)


# The overload and its first argument are both named `from`, a Python keyword; torch passes
# them positionally.
@register_mapping(getattr(aten.random, "from"), rng=True)
def random_from(self, low, high=None, *, key, generator=None):
    high_inclusive = _full_range(self.dtype) if high is None else high - 1
    return _integers(key, self.shape, low, high_inclusive, self.dtype)


# ---------------------------------------------------------------- bernoulli and dropout


def _bernoulli(key, probability, shape, dtype):
    number = not hasattr(probability, "dtype") or is_lifted_float(probability)  # a Python number
    sampling = _sampling_dtype(dtype if number else probability.dtype)
    return (jax.random.uniform(key, shape, dtype=sampling) < probability).astype(dtype)


@register_mapping(aten.bernoulli.default, rng=True)
def bernoulli(self, *, key, generator=None):
    return _bernoulli(key, self, self.shape, self.dtype)


@register_mapping(aten.bernoulli.p, rng=True)
def bernoulli_p(self, p, *, key, generator=None):
    return _bernoulli(key, p, self.shape, self.dtype)


@register_mapping(aten.bernoulli.Tensor, rng=True)
def bernoulli_tensor(self, p, *, key, generator=None):
    return _bernoulli(key, p, self.shape, self.dtype)


@register_mapping(aten.multinomial, rng=True)
def multinomial(self, num_samples, replacement=False, *, key, generator=None):
    logits = jnp.log(self.astype(_sampling_dtype(self.dtype)))
    if replacement:
        batch = self.shape[:-1]
        samples = jax.random.categorical(key, logits, axis=-1, shape=(num_samples,) + batch)
        return jnp.moveaxis(samples, 0, -1).astype(jnp.int64)
    # Without replacement: the top num_samples of Gumbel-perturbed logits are a draw in order.
    perturbed = logits + jax.random.gumbel(key, logits.shape, dtype=logits.dtype)
    return lax.top_k(perturbed, num_samples)[1].astype(jnp.int64)


@register_mapping(aten.native_dropout, rng=True)
def native_dropout(input, p, train, *, key):
    if train is not None and not train:
        return input, jnp.ones(input.shape, dtype=jnp.bool_)
    keep = 1.0 - p
    scale = 0.0 if keep == 0 else 1.0 / keep
    mask = jax.random.bernoulli(key, keep, input.shape)
    return (input * mask * scale).astype(input.dtype), mask


@register_mapping(aten.native_dropout_backward)
def native_dropout_backward(grad_output, mask, scale):
    # torch computes (grad * mask) * scale: an integral or bool gradient becomes the default float.
    masked = grad_output * mask.astype(grad_output.dtype)
    if not jnp.issubdtype(grad_output.dtype, jnp.inexact):
        masked = masked.astype(default_float())
    return (masked * scale).astype(masked.dtype)
