"""Batch, layer, group and RMS normalization, with the backward ops torch's autograd calls.

Statistics are computed in float32 for half-precision inputs (float64 stays float64),
and saved statistics have the dtype torch's meta kernels give them. Each body is compiled as
one XLA program (`jax.jit`, non-array arguments static): op by op, its dozen primitives would
each be dispatched and compiled separately.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from bridge.runtime import config
from bridge.runtime.registry import MAPPINGS, Vjp, aten, register_mapping
from .common import accumulator_dtype


def _channel_shape(input):
    """Shape that broadcasts a per-channel vector against an (N, C, ...) input."""
    return (1, -1) + (1,) * (input.ndim - 2)


def _masked(values, output_mask):
    return tuple(value if wanted else None for value, wanted in zip(values, output_mask))


# ---------------------------------------------------------------- batch norm


def _batch_statistics(values):
    axes = (0,) + tuple(range(2, values.ndim))
    mean = jnp.mean(values, axis=axes)
    variance = jnp.mean(jnp.square(values - mean.reshape(_channel_shape(values))), axis=axes)
    return mean, variance


def _affine(values, weight, bias, mean, inverse_std):
    shape = _channel_shape(values)
    out = (values - mean.reshape(shape)) * inverse_std.reshape(shape)
    if weight is not None:
        out = out * weight.astype(values.dtype).reshape(shape)
    if bias is not None:
        out = out + bias.astype(values.dtype).reshape(shape)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _training_normalization(values, weight, bias, eps):
    """(normalized output, batch mean, biased batch variance) of training-mode batch norm, in the
    accumulator dtype, differentiated by torch's closed form (native_batch_norm_backward's): the
    backward reads the input and the gradient once for both per-channel sums and once more for
    the input's gradient, where JAX differentiating the statistics and the affine map makes more
    passes. Used in captured regions, where JAX differentiates the mappings."""
    mean, variance = _batch_statistics(values)
    return _affine(values, weight, bias, mean, 1 / jnp.sqrt(variance + eps)), mean, variance


def _training_normalization_forward(values, weight, bias, eps):
    # Named, so that a captured region's backward keeps these per-channel vectors instead of
    # reading the input twice more to recompute them.
    mean, variance = (checkpoint_name(value, config.KEEP_FOR_BACKWARD) for value in _batch_statistics(values))
    inverse_std = 1 / jnp.sqrt(variance + eps)
    out = _affine(values, weight, bias, mean, inverse_std)
    return (out, mean, variance), (values, weight, bias, mean, inverse_std)


def _training_normalization_backward(eps, saved, cotangents):
    values, weight, bias, mean, inverse_std = saved
    grad = cotangents[0]  # the statistics get none: _batch_norm stops their gradient
    grad_input, grad_weight, grad_bias = _batch_norm_backward(
        grad, values, weight, None, None, mean, inverse_std, True, eps, (True, weight is not None, bias is not None)
    )
    return grad_input, grad_weight, None if bias is None else grad_bias.astype(bias.dtype)


_training_normalization.defvjp(_training_normalization_forward, _training_normalization_backward)


# momentum stays dynamic: nn.BatchNorm with momentum=None passes a new factor every step.
@functools.partial(jax.jit, static_argnames=("training", "eps", "traced"))
def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, traced=False):
    """(output, saved mean, saved inverse std, {running stat: new value})."""
    accumulator = accumulator_dtype(input.dtype)
    values = input.astype(accumulator)
    updates = {}
    out = None
    if training or running_mean is None:
        if traced:
            out, mean, variance = _training_normalization(values, weight, bias, eps)
        else:
            mean, variance = _batch_statistics(values)
        if training and running_mean is not None:
            count = input.size // input.shape[1]
            # The running variance is the unbiased estimate, the normalization uses the biased one.
            unbiased = variance * (count / max(count - 1, 1))
            updates["running_mean"] = (
                (1 - momentum) * running_mean.astype(accumulator) + momentum * mean
            ).astype(running_mean.dtype)
            updates["running_var"] = (
                (1 - momentum) * running_var.astype(accumulator) + momentum * unbiased
            ).astype(running_var.dtype)
    else:
        mean = running_mean.astype(accumulator)
        variance = running_var.astype(accumulator)
    inverse_std = 1 / jnp.sqrt(variance + eps)
    if out is None:
        out = _affine(values, weight, bias, mean, inverse_std)
    if traced:
        # torch's saved statistics are not differentiable outputs: a loss that reads them gets
        # no gradient through them in eager torch.
        mean, inverse_std = lax.stop_gradient(mean), lax.stop_gradient(inverse_std)
    return out.astype(input.dtype), mean, inverse_std, updates


def _traced_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    # In a captured region JAX differentiates the body: the statistics take torch's backward.
    return _batch_norm(
        input, weight, bias, running_mean, running_var, training, momentum, eps, traced=bool(config.settings.tracing)
    )


def _empty_reserve():
    # The reserve buffer is cuDNN's workspace; torch returns an empty uint8 tensor elsewhere.
    return jnp.zeros((0,), dtype=jnp.uint8)


# native_batch_norm's schema does not mark the running stats as written, yet torch's kernel
# updates them in training mode, and nn.BatchNorm relies on it: it is declared as mutating.
@register_mapping(aten.native_batch_norm.default, mutates=("running_mean", "running_var"))
def native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    out, mean, inverse_std, updates = _traced_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return (out, mean, inverse_std), updates


@register_mapping(aten._native_batch_norm_legit.default, mutates=("running_mean", "running_var"))
def native_batch_norm_legit(input, weight, bias, running_mean, running_var, training, momentum, eps):
    out, mean, inverse_std, updates = _traced_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return (out, mean, inverse_std), updates


@register_mapping(aten._native_batch_norm_legit.no_stats)
def native_batch_norm_legit_no_stats(input, weight, bias, training, momentum, eps):
    out, mean, inverse_std, _ = _traced_batch_norm(input, weight, bias, None, None, True, momentum, eps)
    return out, mean, inverse_std


@register_mapping(aten._native_batch_norm_legit_functional.default)
def native_batch_norm_legit_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    out, mean, inverse_std, updates = _traced_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
    return (
        out,
        mean,
        inverse_std,
        updates.get("running_mean", running_mean),
        updates.get("running_var", running_var),
    )


@register_mapping(aten._native_batch_norm_legit_no_training.default)
def native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, inverse_std, _ = _traced_batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)
    return out, mean, inverse_std


@register_mapping(aten._batch_norm_with_update.default, mutates=("running_mean", "running_var"))
def batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, inverse_std, updates = _traced_batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps)
    return (out, mean, inverse_std, _empty_reserve()), updates


@register_mapping(aten._batch_norm_with_update_functional.default)
def batch_norm_with_update_functional(input, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, inverse_std, updates = _traced_batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, mean, inverse_std, _empty_reserve(), updates["running_mean"], updates["running_var"]


@register_mapping(aten._batch_norm_no_update.default)
def batch_norm_no_update(input, weight, bias, running_mean, running_var, momentum, eps):
    out, mean, inverse_std, _ = _traced_batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)
    return out, mean, inverse_std, _empty_reserve()


@functools.partial(jax.jit, static_argnames=("train", "eps", "output_mask"))
def _batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask):
    accumulator = accumulator_dtype(input.dtype)
    shape = _channel_shape(input)
    axes = (0,) + tuple(range(2, input.ndim))
    if train:
        mean, inverse_std = save_mean.astype(accumulator), save_invstd.astype(accumulator)
    else:
        mean = running_mean.astype(accumulator)
        inverse_std = 1 / jnp.sqrt(running_var.astype(accumulator) + eps)
    grad = grad_out.astype(accumulator)
    normalized = (input.astype(accumulator) - mean.reshape(shape)) * inverse_std.reshape(shape)
    scale = inverse_std if weight is None else weight.astype(accumulator) * inverse_std
    grad_bias = jnp.sum(grad, axis=axes)
    grad_weight = jnp.sum(grad * normalized, axis=axes)
    if train:
        count = input.size // input.shape[1]
        # The batch statistics depend on every element: subtract their share of the gradient.
        grad_input = scale.reshape(shape) * (
            grad - (grad_bias / count).reshape(shape) - normalized * (grad_weight / count).reshape(shape)
        )
    else:
        grad_input = grad * scale.reshape(shape)
    parameter_dtype = input.dtype if weight is None else weight.dtype
    return _masked(
        (grad_input.astype(input.dtype), grad_weight.astype(parameter_dtype), grad_bias.astype(parameter_dtype)),
        output_mask,
    )


@register_mapping(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(
    grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
):
    return _batch_norm_backward(
        grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, tuple(output_mask)
    )


@register_mapping(aten.batch_norm_backward.default)
def batch_norm_backward(
    grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps, output_mask, reserve
):
    # save_var holds the inverse standard deviation, as in native_batch_norm_backward.
    return _batch_norm_backward(
        grad_out, input, weight, running_mean, running_var, save_mean, save_var, update, eps, tuple(output_mask)
    )


# ---------------------------------------------------------------- layer norm


def _trailing_axes(input, normalized_shape):
    return tuple(range(input.ndim - len(normalized_shape), input.ndim))


# In captured regions layer norm's gradient keeps the input and the statistics, as torch's
# does, instead of JAX's intermediate values (the centred and the normalized input).
def _layer_norm_saved(args, kwargs, out):
    input, _, weight, bias, _ = args
    return input, weight, bias, out[1], out[2]


def _layer_norm_pullback(saved, grads, args, kwargs):
    input, weight, bias, mean, rstd = saved
    normalized_shape = args[1]
    mask = (True, weight is not None, bias is not None)
    grad_input, grad_weight, grad_bias = MAPPINGS[aten.native_layer_norm_backward.default].call(
        grads[0], input, normalized_shape, mean, rstd, weight, bias, mask
    )
    # One gradient per array argument: the weight and the bias only where they were given.
    present = (True, weight is not None, bias is not None)
    return tuple(grad for grad, given in zip((grad_input, grad_weight, grad_bias), present) if given)


def _shifted(values, axes):
    """The values less each row's first one (over `axes`), and the mean of that: float32 holds
    these differences exactly, so the mean and the variance taken from them keep their digits on
    rows far from zero. Centred on the mean of the values themselves, a row at -3e5 with a
    spread of 1 (where float32's steps are 0.03) put 1/std off by 7e-4; torch's kernel is exact
    there to float32's digits, and so is this."""
    if any(values.shape[axis] == 0 for axis in axes):
        shift = jnp.zeros((), values.dtype)
    else:
        first = tuple(slice(0, 1) if axis in axes else slice(None) for axis in range(values.ndim))
        shift = lax.stop_gradient(values[first])
    shifted = values - shift
    return shift, shifted, jnp.mean(shifted, axis=axes, keepdims=True)


@register_mapping(aten.native_layer_norm.default, gradient=Vjp(_layer_norm_saved, _layer_norm_pullback))
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    return _layer_norm(input, tuple(normalized_shape), weight, bias, eps)


@functools.partial(jax.jit, static_argnames=("normalized_shape", "eps"))
def _layer_norm(input, normalized_shape, weight, bias, eps):
    accumulator = accumulator_dtype(input.dtype)
    values = input.astype(accumulator)
    axes = _trailing_axes(input, normalized_shape)
    shift, shifted, shifted_mean = _shifted(values, axes)
    centred = shifted - shifted_mean
    inverse_std = 1 / jnp.sqrt(jnp.mean(jnp.square(centred), axis=axes, keepdims=True) + eps)
    mean = shift + shifted_mean
    out = centred * inverse_std
    if weight is not None:
        out = out * weight.astype(accumulator)
    if bias is not None:
        out = out + bias.astype(accumulator)
    return out.astype(input.dtype), mean, inverse_std


@register_mapping(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    return _layer_norm_backward(grad_out, input, tuple(normalized_shape), mean, rstd, weight, bias, tuple(output_mask))


@functools.partial(jax.jit, static_argnames=("normalized_shape", "output_mask"))
def _layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    accumulator = accumulator_dtype(input.dtype)
    axes = _trailing_axes(input, normalized_shape)
    batch_axes = tuple(range(input.ndim - len(normalized_shape)))
    grad = grad_out.astype(accumulator)
    inverse_std = rstd.astype(accumulator)
    normalized = (input.astype(accumulator) - mean.astype(accumulator)) * inverse_std
    grad_normalized = grad if weight is None else grad * weight.astype(accumulator)
    grad_input = inverse_std * (
        grad_normalized
        - jnp.mean(grad_normalized, axis=axes, keepdims=True)
        - normalized * jnp.mean(grad_normalized * normalized, axis=axes, keepdims=True)
    )
    grad_weight = grad_bias = None
    if weight is not None:
        grad_weight = jnp.sum(grad * normalized, axis=batch_axes).astype(weight.dtype)
    if bias is not None:
        grad_bias = jnp.sum(grad, axis=batch_axes).astype(bias.dtype)
    return _masked((grad_input.astype(input.dtype), grad_weight, grad_bias), output_mask)




# ---------------------------------------------------------------- group norm


def _grouped(values, batch, group):
    """(N, C, *) as (N, group, C // group * prod(*))."""
    # The last size is spelled out: reshape cannot infer a -1 when N is 0.
    return values.reshape(batch, group, math.prod(values.shape[1:]) // group)


@register_mapping(aten.native_group_norm.default)
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    return _group_norm(input, weight, bias, N, C, HxW, group, eps)


@functools.partial(jax.jit, static_argnames=("N", "C", "HxW", "group", "eps"))
def _group_norm(input, weight, bias, N, C, HxW, group, eps):
    accumulator = accumulator_dtype(input.dtype)
    values = _grouped(input.astype(accumulator), N, group)
    mean = jnp.mean(values, axis=-1)
    variance = jnp.mean(jnp.square(values - mean[..., None]), axis=-1)
    inverse_std = 1 / jnp.sqrt(variance + eps)
    out = ((values - mean[..., None]) * inverse_std[..., None]).reshape(N, C, HxW)
    if weight is not None:
        out = out * weight.astype(accumulator)[None, :, None]
    if bias is not None:
        out = out + bias.astype(accumulator)[None, :, None]
    # torch's group norm keeps its statistics in the input's dtype.
    return out.reshape(input.shape).astype(input.dtype), mean.astype(input.dtype), inverse_std.astype(input.dtype)


@register_mapping(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    return _group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, tuple(output_mask))


@functools.partial(jax.jit, static_argnames=("N", "C", "HxW", "group", "output_mask"))
def _group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    accumulator = accumulator_dtype(input.dtype)
    grad = grad_out.astype(accumulator).reshape(N, C, HxW)
    values = input.astype(accumulator).reshape(N, C, HxW)
    per_channel = C // group
    # Broadcast the (N, group) statistics over each group's channels.
    mean_channels = jnp.repeat(mean.astype(accumulator), per_channel, axis=1)[..., None]
    inverse_std_channels = jnp.repeat(rstd.astype(accumulator), per_channel, axis=1)[..., None]
    normalized = (values - mean_channels) * inverse_std_channels
    grad_normalized = grad if weight is None else grad * weight.astype(accumulator)[None, :, None]

    def group_mean(array):
        means = jnp.mean(_grouped(array, N, group), axis=-1)
        return jnp.repeat(means, per_channel, axis=1)[..., None]

    grad_input = inverse_std_channels * (
        grad_normalized - group_mean(grad_normalized) - normalized * group_mean(grad_normalized * normalized)
    )
    parameter_dtype = input.dtype if weight is None else weight.dtype
    grad_weight = jnp.sum(grad * normalized, axis=(0, 2)).astype(parameter_dtype)
    grad_bias = jnp.sum(grad, axis=(0, 2)).astype(parameter_dtype)
    return _masked((grad_input.reshape(input.shape).astype(input.dtype), grad_weight, grad_bias), output_mask)


# ---------------------------------------------------------------- RMS norm


def _rms_epsilon(accumulator, eps):
    if eps is not None:
        return eps
    return float(jnp.finfo(accumulator).eps)


@register_mapping(aten._fused_rms_norm.default)
def fused_rms_norm(input, normalized_shape, weight, eps):
    return _rms_norm(input, tuple(normalized_shape), weight, eps)


@functools.partial(jax.jit, static_argnames=("normalized_shape", "eps"))
def _rms_norm(input, normalized_shape, weight, eps):
    accumulator = accumulator_dtype(input.dtype)
    values = input.astype(accumulator)
    axes = _trailing_axes(input, normalized_shape)
    inverse_rms = 1 / jnp.sqrt(jnp.mean(jnp.square(values), axis=axes, keepdims=True) + _rms_epsilon(accumulator, eps))
    out = values * inverse_rms
    if weight is not None:
        out = out * weight.astype(accumulator)
    return out.astype(input.dtype), inverse_rms


@register_mapping(aten._fused_rms_norm_backward.default)
def fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    return _rms_norm_backward(grad_out, input, tuple(normalized_shape), rstd, weight, tuple(output_mask))


@functools.partial(jax.jit, static_argnames=("normalized_shape", "output_mask"))
def _rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    accumulator = accumulator_dtype(input.dtype)
    axes = _trailing_axes(input, normalized_shape)
    batch_axes = tuple(range(input.ndim - len(normalized_shape)))
    grad = grad_out.astype(accumulator)
    inverse_rms = rstd.astype(accumulator)
    normalized = input.astype(accumulator) * inverse_rms
    grad_normalized = grad if weight is None else grad * weight.astype(accumulator)
    grad_input = inverse_rms * (grad_normalized - normalized * jnp.mean(grad_normalized * normalized, axis=axes, keepdims=True))
    grad_weight = None
    if weight is not None:
        grad_weight = jnp.sum(grad * normalized, axis=batch_axes).astype(weight.dtype)
    return _masked((grad_input.astype(input.dtype), grad_weight), output_mask)
