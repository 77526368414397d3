"""Softmax and log-softmax (with their backward ops) and the loss functions torch dispatches as ATen ops.

`reduction` follows torch's enum: 0 none, 1 mean, 2 sum.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from bridge.runtime import dtypes
from bridge.runtime.registry import TolerantNamespace, aten, jnp_dtype, register_mapping
from .common import accumulator_dtype

_NONE, _MEAN, _SUM = 0, 1, 2


def _reduce(losses, reduction):
    if reduction == _MEAN:
        return jnp.mean(losses)
    if reduction == _SUM:
        return jnp.sum(losses)
    return losses


def _scale_for(reduction, like):
    """The factor a reduced loss's gradient carries per element."""
    return 1.0 / like.size if reduction == _MEAN else 1.0


# ---------------------------------------------------------------- softmax family


def _along(function, values, dim):
    # torch accepts dim 0 / -1 on a 0-dim tensor; jax.nn needs an axis to exist.
    if values.ndim == 0:
        return function(values.reshape(1), 0).reshape(())
    return function(values, dim)


@register_mapping(aten._softmax.default)
def softmax(self, dim, half_to_float):
    result = jnp.dtype(jnp.float32) if half_to_float else self.dtype
    out = _along(lambda values, axis: jax.nn.softmax(values, axis=axis), self.astype(accumulator_dtype(self.dtype)), dim)
    return out.astype(result)


@register_mapping(aten._log_softmax.default)
def log_softmax(self, dim, half_to_float):
    result = jnp.dtype(jnp.float32) if half_to_float else self.dtype
    out = _along(lambda values, axis: jax.nn.log_softmax(values, axis=axis), self.astype(accumulator_dtype(self.dtype)), dim)
    return out.astype(result)


# Rows masked entirely (-inf everywhere) have softmax 0 and gradient 0 in torch (NaN by JAX's
# rule); CTC's gradient is torch's formula over its own alpha/beta tables.
@register_mapping(aten._safe_softmax.default, gradient="torch")
def safe_softmax(self, dim, dtype=None):
    """Softmax whose fully masked rows (all -inf) give zeros instead of NaN (attention's math path)."""
    result = jnp_dtype(dtype, self.dtype)
    values = self.astype(accumulator_dtype(result))

    def safe(values, axis):
        masked = jnp.all(values == -jnp.inf, axis=axis, keepdims=True)
        return jnp.where(masked, jnp.zeros((), dtype=values.dtype), jax.nn.softmax(values, axis=axis))

    return _along(safe, values, dim).astype(result)


@register_mapping(aten._softmax_backward_data.default)
def softmax_backward_data(grad_output, output, dim, input_dtype):
    accumulator = accumulator_dtype(grad_output.dtype)
    grad, out = grad_output.astype(accumulator), output.astype(accumulator)
    keep = out.ndim > 0
    total = jnp.sum(grad * out, axis=dim, keepdims=True) if keep else grad * out
    return (out * (grad - total)).astype(jnp_dtype(input_dtype))


@register_mapping(aten._log_softmax_backward_data.default)
def log_softmax_backward_data(grad_output, output, dim, input_dtype):
    accumulator = accumulator_dtype(grad_output.dtype)
    grad, out = grad_output.astype(accumulator), output.astype(accumulator)
    total = jnp.sum(grad, axis=dim, keepdims=True) if out.ndim > 0 else grad
    return (grad - jnp.exp(out) * total).astype(jnp_dtype(input_dtype))


# ---------------------------------------------------------------- negative log likelihood


def _nll_parts(self, target, weight, ignore_index):
    """(class axis, target with ignored entries replaced by class 0, per-element weight, 0 where ignored)."""
    class_axis = 1 if self.ndim >= 2 else 0
    ignored = target == ignore_index
    safe_target = jnp.where(ignored, 0, target)
    accumulator = accumulator_dtype(self.dtype)
    if weight is None:
        element_weight = jnp.ones(target.shape, dtype=accumulator)
    else:
        element_weight = weight.astype(accumulator)[safe_target]
    element_weight = jnp.where(ignored, jnp.zeros((), dtype=accumulator), element_weight)
    return class_axis, safe_target, element_weight


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _picked(values, target, class_axis):
    """Each row's entry at its target class: a gather, which reads one entry a row. Its
    derivative is the masked sum's (below), not the gather's: the gather's transpose is a scatter
    into a materialized zero tensor of the log-probabilities' size (in a captured GPT-2 step at
    batch 8 x 1024, three extra passes over its 0.4 G logits), the masked sum's a select that
    fuses into the log-softmax backward. A masked sum as the value itself would read every row
    whole in the forward (nanoGPT's bench.py, batch 12 x 1024: a pass over 0.6 G logits a step).
    One entry plus zeros: both values are exact."""
    return jnp.squeeze(jnp.take_along_axis(values, jnp.expand_dims(target, class_axis), axis=class_axis), class_axis)


@_picked.defjvp
def _picked_tangent(class_axis, primals, tangents):
    values, target = primals
    tangent = tangents[0]
    classes = lax.broadcasted_iota(target.dtype, values.shape, class_axis)
    chosen = classes == jnp.expand_dims(target, class_axis)
    return _picked(values, target, class_axis), jnp.sum(jnp.where(chosen, tangent, jnp.zeros((), tangent.dtype)), axis=class_axis)


# The nll bodies run a dozen primitives: compiled as one program, they dispatch (and compile) once.
@functools.partial(jax.jit, static_argnames=("reduction", "ignore_index"))
def _nll_forward(self, target, weight, reduction, ignore_index):
    class_axis, safe_target, element_weight = _nll_parts(self, target, weight, ignore_index)
    accumulator = element_weight.dtype
    picked = _picked(self, safe_target, class_axis)
    # A select, not the product by a zero weight alone: when this body is differentiated (a captured
    # region's backward is its vjp), ignored targets must get a zero gradient, not 0 * (grad / 0).
    ignored = target == ignore_index
    losses = jnp.where(ignored, jnp.zeros((), dtype=accumulator), -picked.astype(accumulator) * element_weight)
    if reduction == _NONE:
        return losses.astype(self.dtype), jnp.zeros((), dtype=self.dtype)
    total_weight = jnp.sum(element_weight)
    total = jnp.sum(losses)
    if reduction == _MEAN:
        total = total / total_weight
    return total.astype(self.dtype), total_weight.astype(self.dtype)


@functools.partial(jax.jit, static_argnames=("reduction", "ignore_index"))
def _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    class_axis, safe_target, element_weight = _nll_parts(self, target, weight, ignore_index)
    accumulator = element_weight.dtype
    grad = grad_output.astype(accumulator)
    if reduction == _MEAN:
        grad = grad / total_weight.astype(accumulator)
    # Ignored targets get no gradient, as in torch's kernel, which skips them: with every target
    # ignored, total_weight is 0 and 0 * (grad / 0) would be nan.
    per_element = jnp.where(target == ignore_index, jnp.zeros((), dtype=accumulator), -element_weight * grad)
    one_hot = jax.nn.one_hot(safe_target, self.shape[class_axis], dtype=accumulator, axis=class_axis)
    return (one_hot * jnp.expand_dims(per_element, class_axis)).astype(self.dtype)


@register_mapping(aten.nll_loss_forward.default)
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    # Traced (a captured region), JAX differentiates this body (_picked's derivative).
    return _nll_forward(self, target, weight, reduction, ignore_index)


@register_mapping(aten.nll_loss_backward.default)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    return _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)


@register_mapping(aten.nll_loss2d_forward.default)
def nll_loss2d_forward(self, target, weight, reduction, ignore_index):
    return _nll_forward(self, target, weight, reduction, ignore_index)


@register_mapping(aten.nll_loss2d_backward.default)
def nll_loss2d_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    return _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)


# ---------------------------------------------------------------- regression losses

_PAIR = ("self", "target")
_GRAD_PAIR = ("grad_output", "self", "target")


@register_mapping(aten.mse_loss.default, promote=dtypes.DEFAULT, operands=_PAIR)
def mse_loss(self, target, reduction=_MEAN):
    return _reduce(jnp.square(self - target), reduction)


@register_mapping(aten.mse_loss_backward.default, promote=dtypes.DEFAULT, operands=_GRAD_PAIR)
def mse_loss_backward(grad_output, self, target, reduction):
    return 2 * (self - target) * grad_output * _scale_for(reduction, self)


@register_mapping(aten.smooth_l1_loss.default, promote=dtypes.DEFAULT, operands=_PAIR)
def smooth_l1_loss(self, target, reduction=_MEAN, beta=1.0):
    distance = jnp.abs(self - target)
    if beta == 0:
        return _reduce(distance, reduction)
    return _reduce(jnp.where(distance < beta, 0.5 * distance * distance / beta, distance - 0.5 * beta), reduction)


@register_mapping(aten.smooth_l1_loss_backward.default, promote=dtypes.DEFAULT, operands=_GRAD_PAIR)
def smooth_l1_loss_backward(grad_output, self, target, reduction, beta):
    difference = self - target
    if beta == 0:
        slope = jnp.sign(difference)
    else:
        slope = jnp.where(jnp.abs(difference) < beta, difference / beta, jnp.sign(difference))
    return slope * grad_output * _scale_for(reduction, self)


@register_mapping(aten.huber_loss.default, promote=dtypes.DEFAULT, operands=_PAIR)
def huber_loss(self, target, reduction=_MEAN, delta=1.0):
    distance = jnp.abs(self - target)
    return _reduce(jnp.where(distance < delta, 0.5 * distance * distance, delta * (distance - 0.5 * delta)), reduction)


@register_mapping(aten.huber_loss_backward.default, promote=dtypes.DEFAULT, operands=_GRAD_PAIR)
def huber_loss_backward(grad_output, self, target, reduction, delta):
    slope = jnp.clip(self - target, -delta, delta)
    return slope * grad_output * _scale_for(reduction, self)


# ---------------------------------------------------------------- classification losses on probabilities / logits


@register_mapping(aten.binary_cross_entropy.default, promote=dtypes.DEFAULT, operands=_PAIR)
def binary_cross_entropy(self, target, weight=None, reduction=_MEAN):
    # torch clamps each log term at -100 so that a probability of exactly 0 or 1 gives a finite loss.
    log_probability = jnp.maximum(jnp.log(self), -100)
    log_complement = jnp.maximum(jnp.log1p(-self), -100)
    losses = -(target * log_probability + (1 - target) * log_complement)
    if weight is not None:
        losses = losses * weight.astype(losses.dtype)
    return _reduce(losses, reduction)


@register_mapping(aten.binary_cross_entropy_backward.default, promote=dtypes.DEFAULT, operands=_GRAD_PAIR)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=_MEAN):
    grad = grad_output * (self - target) / jnp.maximum((1 - self) * self, 1e-12)
    if weight is not None:
        grad = grad * weight.astype(grad.dtype)
    return grad * _scale_for(reduction, self)


@register_mapping(aten.binary_cross_entropy_with_logits.default, promote=dtypes.DEFAULT, operands=_PAIR)
def binary_cross_entropy_with_logits(self, target, weight=None, pos_weight=None, reduction=_MEAN):
    # log(1 + exp(-x)) written to stay finite for large |x|.
    softplus_negative = jnp.log1p(jnp.exp(-jnp.abs(self))) + jnp.maximum(-self, 0)
    if pos_weight is None:
        losses = (1 - target) * self + softplus_negative
    else:
        log_weight = (pos_weight.astype(self.dtype) - 1) * target + 1
        losses = (1 - target) * self + log_weight * softplus_negative
    if weight is not None:
        losses = losses * weight.astype(losses.dtype)
    return _reduce(losses, reduction)


@register_mapping(aten.soft_margin_loss.default, promote=dtypes.DEFAULT, operands=_PAIR)
def soft_margin_loss(self, target, reduction=_MEAN):
    return _reduce(jnp.logaddexp(0, -target * self), reduction)


@register_mapping(aten.soft_margin_loss_backward.default, promote=dtypes.DEFAULT, operands=_GRAD_PAIR)
def soft_margin_loss_backward(grad_output, self, target, reduction):
    return -target * jax.nn.sigmoid(-target * self) * grad_output * _scale_for(reduction, self)


# ---------------------------------------------------------------- margin losses on class scores (backward ops)


def _per_sample_grad(grad_output, reduction, samples, dtype):
    """grad_output as one factor per sample: a scalar for reduced losses, a vector otherwise."""
    grad = grad_output.astype(dtype)
    if reduction == _NONE and grad.ndim:
        return grad.reshape(samples, 1)
    return grad.reshape(())


@register_mapping(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=_MEAN):
    # torch's kernel: every class i != y with z = margin - x[y] + x[i] > 0 gets g * (1 or 2z) * w[y],
    # and the target class minus their sum; g = 1/C, over N as well for the mean.
    accumulator = accumulator_dtype(self.dtype)
    scores = self.astype(accumulator).reshape(-1, self.shape[-1]) if self.ndim else self.astype(accumulator).reshape(1, 1)
    samples, classes = scores.shape
    target = target.reshape(samples)
    picked = jnp.take_along_axis(scores, target[:, None], axis=1)
    z = margin - picked + scores
    scale = 1.0 / (samples * classes) if reduction == _MEAN else 1.0 / classes
    h = jnp.where(z > 0, scale if p == 1 else 2 * scale * z, 0.0).astype(accumulator)
    if weight is not None:
        h = h * weight.astype(accumulator)[target][:, None]
    is_target = jax.nn.one_hot(target, classes, dtype=jnp.bool_)
    h = jnp.where(is_target, jnp.zeros((), accumulator), h)
    grad = h - is_target.astype(accumulator) * jnp.sum(h, axis=1, keepdims=True)
    grad = grad * _per_sample_grad(grad_output, reduction, samples, accumulator)
    return grad.reshape(self.shape).astype(self.dtype)


def _multilabel_targets(self, target):
    """Scores as (N, C) in the accumulation dtype, and the targets up to each row's first -1:
    (accumulator, C, scores, N, listed mask, targets with the padding replaced by class 0)."""
    accumulator = accumulator_dtype(self.dtype)
    classes = self.shape[-1] if self.ndim else 1
    scores = self.astype(accumulator).reshape(-1, classes)
    samples = scores.shape[0]
    target = target.reshape(samples, classes)
    listed = jnp.cumprod(target >= 0, axis=1).astype(jnp.bool_)
    return accumulator, classes, scores, samples, listed, jnp.where(listed, target, 0)


@register_mapping(aten.multilabel_margin_loss_forward.default, meta="shape-differs")
def multilabel_margin_loss_forward(self, target, reduction):
    # torch's decomposition lets the -1 padding of the targets count as class 0 (it gathers the
    # padded slots from class 0 and never masks them out); its kernel, followed here, stops at the first -1.
    accumulator, classes, scores, samples, listed, safe_target = _multilabel_targets(self, target)
    is_target = jnp.zeros((samples, classes), jnp.bool_).at[jnp.arange(samples)[:, None], safe_target].max(listed)
    picked = jnp.take_along_axis(scores, safe_target, axis=1)
    hinge = jnp.maximum(1 - picked[:, :, None] + scores[:, None, :], 0)
    hinge = jnp.where(listed[:, :, None] & ~is_target[:, None, :], hinge, jnp.zeros((), accumulator))
    # reduction 'none' gives one loss per sample, and a 0-dim loss for a vector input, as torch's
    # CPU and CUDA kernels do (its meta kernel says (1,)).
    losses = _reduce(jnp.sum(hinge, axis=(1, 2)) / classes, reduction)
    if self.ndim <= 1:
        losses = losses.reshape(())
    return losses.astype(self.dtype), is_target.reshape(self.shape).astype(self.dtype)


@register_mapping(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    # torch's kernel: for each target class y (up to the first -1) and each non-target class d
    # with 1 - x[y] + x[d] > 0, x[d] gains g and x[y] loses g; g = 1/C, over N as well for the mean.
    accumulator, classes, scores, samples, listed, safe_target = _multilabel_targets(self, target)
    picked = jnp.take_along_axis(scores, safe_target, axis=1)  # (N, J): x[y_j]
    others = is_target.reshape(samples, classes) == 0  # (N, C)
    z = 1 - picked[:, :, None] + scores[:, None, :]  # (N, J, C)
    active = (z > 0) & listed[:, :, None] & others[:, None, :]
    scale = 1.0 / (samples * classes) if reduction == _MEAN else 1.0 / classes
    counts = active.astype(accumulator)
    gained = jnp.sum(counts, axis=1)  # per non-target class d
    lost = jnp.zeros((samples, classes), accumulator).at[jnp.arange(samples)[:, None], safe_target].add(
        jnp.sum(counts, axis=2)
    )
    grad = (gained - lost) * scale
    grad = grad * _per_sample_grad(grad_output, reduction, samples, accumulator)
    return grad.reshape(self.shape).astype(self.dtype)


# ---------------------------------------------------------------- connectionist temporal classification
#
# torch's CPU kernels, batched: log_alpha over (time, batch, extended target) by a scan over time,
# log-sum-exps with torch's "max, or 0 when all are -inf" shift. The lengths are static int lists.


def _log_sum_exp(*terms):
    maximum = terms[0]
    for term in terms[1:]:
        maximum = jnp.maximum(maximum, term)
    shift = jnp.where(maximum == -jnp.inf, jnp.zeros((), maximum.dtype), maximum)
    return jnp.log(sum(jnp.exp(term - shift) for term in terms)) + shift


def _ctc_parts(log_probs, targets, input_lengths, target_lengths, blank):
    """(log_probs as (T, N, C), extended targets (N, 2S+1), lengths as arrays, batched?)."""
    batched = log_probs.ndim == 3
    if not batched:
        log_probs = log_probs[:, None, :]
    batch = log_probs.shape[1]
    max_target = max(target_lengths) if len(target_lengths) else 0
    if targets.ndim == 1:
        # Concatenated targets: batch b's start is the sum of the lengths before it.
        starts = np.concatenate([[0], np.cumsum(target_lengths)[:-1]]).astype(np.int64)
        positions = np.minimum(starts[:, None] + np.arange(max_target)[None, :], max(targets.shape[0] - 1, 0))
        padded = targets[positions] if targets.shape[0] else jnp.zeros((batch, max_target), jnp.int64)
    else:
        padded = targets.reshape(batch, -1)[:, :max_target]
    extended = jnp.full((batch, 2 * max_target + 1), blank, dtype=jnp.int64)
    extended = extended.at[:, 1::2].set(padded.astype(jnp.int64))
    return (
        log_probs,
        extended,
        jnp.asarray(np.asarray(input_lengths, dtype=np.int64)),
        jnp.asarray(np.asarray(target_lengths, dtype=np.int64)),
        batched,
    )


@register_mapping(aten._ctc_loss.default, gradient="torch")
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    log_probs, extended, input_length, target_length, _ = _ctc_parts(log_probs, targets, input_lengths, target_lengths, blank)
    time, batch, _ = log_probs.shape
    states = extended.shape[1]
    negative_infinity = jnp.asarray(-jnp.inf, log_probs.dtype)
    state = jnp.arange(states)
    valid = state[None, :] < (2 * target_length + 1)[:, None]
    shifted_label = jnp.concatenate([jnp.full((batch, 2), -1, jnp.int64), extended[:, :-2]], axis=1)
    skip = (state[None, :] >= 2) & (extended != blank) & (extended != shifted_label)
    emitted = jnp.take_along_axis(log_probs, jnp.broadcast_to(extended[None], (time,) + extended.shape), axis=2)
    first = jnp.where((state[None, :] == 0) | ((state[None, :] == 1) & (target_length[:, None] > 0)), emitted[0], negative_infinity)

    def step(previous, inputs):
        emitted_t, t = inputs
        one = jnp.concatenate([jnp.full((batch, 1), negative_infinity), previous[:, :-1]], axis=1)
        two = jnp.concatenate([jnp.full((batch, 2), negative_infinity), previous[:, :-2]], axis=1)
        two = jnp.where(skip, two, negative_infinity)
        current = _log_sum_exp(previous, one, two) + emitted_t
        current = jnp.where(valid & (t < input_length)[:, None], current, negative_infinity)
        return current, current

    if time > 1:
        _, rest = lax.scan(step, first, (emitted[1:], jnp.arange(1, time)))
        alphas = jnp.concatenate([first[None], rest], axis=0)  # (T, N, S)
    else:
        alphas = first[None]
    last = jnp.take_along_axis(alphas, jnp.clip(input_length - 1, 0, time - 1)[None, :, None], axis=0)[0]
    end = jnp.take_along_axis(last, (2 * target_length)[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(last, jnp.maximum(2 * target_length - 1, 0)[:, None], axis=1)[:, 0]
    likelihood = jnp.where(target_length > 0, _log_sum_exp(end, before), end)
    empty_input = jnp.where(target_length == 0, jnp.zeros((), log_probs.dtype), negative_infinity)
    likelihood = jnp.where(input_length == 0, empty_input, likelihood)
    log_alpha = jnp.where(jnp.arange(time)[:, None, None] < input_length[None, :, None], alphas, negative_infinity)
    return -likelihood, jnp.transpose(log_alpha, (1, 0, 2))


@register_mapping(aten._ctc_loss_backward.default)
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank, zero_infinity=False):
    shape = log_probs.shape
    log_probs, extended, input_length, target_length, _ = _ctc_parts(log_probs, targets, input_lengths, target_lengths, blank)
    time, batch, classes = log_probs.shape
    states = extended.shape[1]
    negative_infinity = jnp.asarray(-jnp.inf, log_probs.dtype)
    state = jnp.arange(states)
    valid = state[None, :] < (2 * target_length + 1)[:, None]
    shifted_label = jnp.concatenate([extended[:, 2:], jnp.full((batch, 2), -1, jnp.int64)], axis=1)
    skip = (state[None, :] < (2 * target_length - 1)[:, None]) & (extended != shifted_label)
    emitted = jnp.take_along_axis(log_probs, jnp.broadcast_to(extended[None], (time,) + extended.shape), axis=2)
    last_time = input_length - 1
    start = jnp.where(
        (state[None, :] == (2 * target_length)[:, None])
        | ((state[None, :] == (2 * target_length - 1)[:, None]) & (target_length[:, None] > 0)),
        emitted[jnp.clip(last_time, 0, time - 1), jnp.arange(batch)],
        negative_infinity,
    )

    def step(following, inputs):
        emitted_t, t = inputs
        one = jnp.concatenate([following[:, 1:], jnp.full((batch, 1), negative_infinity)], axis=1)
        two = jnp.concatenate([following[:, 2:], jnp.full((batch, 2), negative_infinity)], axis=1)
        one = jnp.where(state[None, :] < (2 * target_length)[:, None], one, negative_infinity)
        two = jnp.where(skip, two, negative_infinity)
        current = jnp.where(valid, _log_sum_exp(following, one, two) + emitted_t, negative_infinity)
        current = jnp.where((t == last_time)[:, None], start, jnp.where((t < last_time)[:, None], current, negative_infinity))
        return current, current

    initial = jnp.full((batch, states), negative_infinity)
    _, betas = lax.scan(step, initial, (emitted, jnp.arange(time)), reverse=True)  # (T, N, S)
    alphas = jnp.transpose(log_alpha, (1, 0, 2))
    both = alphas + betas
    # Per class: the log-sum-exp of alpha + beta over the extended-target states carrying it.
    batch_index = jnp.arange(batch)[:, None]
    maximum = jnp.full((time, batch, classes), negative_infinity).at[:, batch_index, extended].max(both)
    shift = jnp.where(maximum == -jnp.inf, jnp.zeros((), both.dtype), maximum)
    total = jnp.zeros((time, batch, classes), both.dtype).at[:, batch_index, extended].add(
        jnp.exp(both - jnp.take_along_axis(shift, jnp.broadcast_to(extended[None], both.shape), axis=2))
    )
    occupancy = jnp.log(total) + shift
    nll = neg_log_likelihood.reshape(batch)
    gradient = (jnp.exp(log_probs) - jnp.exp(occupancy + nll[None, :, None] - log_probs)) * grad.reshape(batch)[None, :, None]
    keep = jnp.arange(time)[:, None] < input_length[None, :]
    if zero_infinity:
        keep = keep & (nll != jnp.inf)[None, :]
    gradient = jnp.where(keep[..., None], gradient, jnp.zeros((), gradient.dtype))
    return gradient.reshape(shape)


# The lengths as tensors: log_alpha's shape depends on their values, so they are read on the host
# (eager only, as for the other ops with data-dependent shapes).
@register_mapping(aten._ctc_loss.Tensor, gradient="torch")
def ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    return ctc_loss(
        log_probs, targets, np.asarray(input_lengths).tolist(), np.asarray(target_lengths).tolist(), blank, zero_infinity
    )


@register_mapping(aten._ctc_loss_backward.Tensor)
def ctc_loss_backward_tensor(
    grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha, blank, zero_infinity=False
):
    return ctc_loss_backward(
        grad, log_probs, targets, np.asarray(input_lengths).tolist(), np.asarray(target_lengths).tolist(),
        neg_log_likelihood, log_alpha, blank, zero_infinity,
    )


# ---------------------------------------------------------------- linear + cross entropy (F.linear_cross_entropy, chunked)

try:  # the ops exist once their module is imported (torch 2.13; missing ones register nothing)
    import torch.nn.modules.linear_cross_entropy  # noqa: F401
except ImportError:  # pragma: no cover - older torch
    pass

_torch_nn = TolerantNamespace(torch.ops.torch_nn, "torch_nn")


def _linear_cross_entropy_losses(input, linear_weight, target, linear_bias, weight, ignore_index, label_smoothing, accumulate):
    """Per-sample (nll, smoothing term, target weight) of cross entropy on input @ linear_weight.T + bias."""
    logits = jnp.matmul(input.astype(accumulate), linear_weight.astype(accumulate).T, precision=lax.Precision.HIGHEST)
    if linear_bias is not None:
        logits = logits + linear_bias.astype(accumulate)
    log_probabilities = jax.nn.log_softmax(logits, axis=-1)
    classes = logits.shape[-1]
    ignored = target == ignore_index
    safe_target = jnp.where(ignored, 0, target)
    class_weight = jnp.ones((classes,), accumulate) if weight is None else weight.astype(accumulate)
    target_weight = jnp.where(ignored, jnp.zeros((), accumulate), class_weight[safe_target])
    picked = jnp.take_along_axis(log_probabilities, safe_target[..., None], axis=-1)[..., 0]
    nll = -picked * target_weight
    smooth = jnp.where(ignored, jnp.zeros((), accumulate), -jnp.sum(log_probabilities * class_weight, axis=-1))
    return nll, smooth * (label_smoothing / classes), target_weight


def _chunked_accumulator(input, acc_dtype):
    accumulate = jnp_dtype(acc_dtype, None) if acc_dtype is not None else None
    return accumulate if accumulate is not None else accumulator_dtype(input.dtype)


@register_mapping(_torch_nn._linear_cross_entropy_batch_chunked.default)
def linear_cross_entropy_batch_chunked(
    input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, batch_chunk_size,
    acc_policy, acc_dtype, allow_retain_graph, compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad,
):
    """The scalar loss and, computed at once as torch's op does, its gradients (scaled by the upstream
    gradient in the backward)."""
    return _linear_cross_entropy_with_gradients(
        input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing,
        _chunked_accumulator(input, acc_dtype), compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad,
    )


# One program per signature: value_and_grad op by op would dispatch (and compile) every primitive.
@functools.partial(
    jax.jit,
    static_argnames=(
        "reduction", "ignore_index", "label_smoothing", "accumulate", "compute_input_grad",
        "compute_linear_weight_grad", "compute_linear_bias_grad",
    ),
)
def _linear_cross_entropy_with_gradients(
    input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, accumulate,
    compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad,
):
    def loss(input, linear_weight, linear_bias):
        nll, smooth, target_weight = _linear_cross_entropy_losses(
            input, linear_weight, target, linear_bias, weight, ignore_index, label_smoothing, accumulate
        )
        total = jnp.sum(nll) * (1 - label_smoothing) + jnp.sum(smooth)
        return total / jnp.sum(target_weight) if reduction == "mean" else total

    bias = linear_bias if linear_bias is not None else jnp.zeros(linear_weight.shape[:-1], accumulate)
    value, (grad_input, grad_weight, grad_bias) = jax.value_and_grad(loss, argnums=(0, 1, 2))(
        input.astype(accumulate), linear_weight.astype(accumulate), bias.astype(accumulate)
    )
    dtype = input.dtype
    empty = jnp.zeros((0, 0), dtype)
    return (
        value.astype(dtype),
        grad_input.astype(dtype) if compute_input_grad else empty,
        grad_weight.astype(dtype) if compute_linear_weight_grad else empty,
        grad_bias.astype(dtype) if compute_linear_bias_grad else jnp.zeros((0,), dtype),
    )


@register_mapping(_torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default)
def linear_cross_entropy_batch_chunked_no_reduction(
    input, linear_weight, target, linear_bias, weight, ignore_index, batch_chunk_size, acc_policy, acc_dtype
):
    nll, _, _ = _linear_cross_entropy_losses(
        input, linear_weight, target, linear_bias, weight, ignore_index, 0.0, _chunked_accumulator(input, acc_dtype)
    )
    return nll.astype(input.dtype)

