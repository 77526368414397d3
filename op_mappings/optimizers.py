"""torch's fused optimizer kernels (`fused=True`): Adam, AdamW, SGD and Adagrad.

Each entry is the functional form (`_fused_adam`); the runtime derives the in-place op the
optimizers call (`_fused_adam_`), so a fused step that reaches the tables (eager mode, a step
outside a captured region, `GradScaler` with a fused optimizer) is one compiled program for
all of its tensors. Captured mode usually never gets here: it runs the whole step as one
program of its own (bridge/patches/optim.py).

The arithmetic is the kernels': each element in the parameters' compute type (float32 for
bfloat16 and float16), the step counts read from their tensors, and with `grad_scale` the
gradients divided by it first (and written back so). A `found_inf` that is set leaves every
tensor as it was, as the kernels return early. Bias corrections `1 - beta**step` are computed
as `-expm1(step * log(beta))`, with `log(beta)` taken in double on the host: in float32,
`1 - 0.999**1` loses four digits, while torch's CPU kernel computes it in double.
"""

import math

import jax.numpy as jnp

from bridge.runtime.registry import aten, register_mapping


def _compute_type(dtype):
    return jnp.float32 if jnp.finfo(dtype).bits < 32 else dtype


def _one_minus_power(beta, step, dtype):
    """1 - beta**step for a step count held in an array."""
    if beta == 0:
        return jnp.ones((), dtype)
    return -jnp.expm1(step.astype(dtype) * jnp.asarray(math.log(beta), dtype))


def _unscaled(grads, grad_scale):
    if grad_scale is None:
        return grads
    return [(grad.astype(_compute_type(grad.dtype)) / grad_scale.astype(_compute_type(grad.dtype))).astype(grad.dtype) for grad in grads]


def _unless_found(found_inf, new, old):
    """The kernels return before writing anything when found_inf is set."""
    if found_inf is None:
        return new
    skip = found_inf.reshape(()) != 0
    return [[jnp.where(skip, before, after) for after, before in zip(news, olds)] for news, olds in zip(new, old)]


def _gradient(param, grad, maximize, weight_decay):
    """The compute type, the parameter and the gradient as the kernels start: negated for
    maximize, with L2 weight decay added."""
    dtype = _compute_type(param.dtype)
    p, g = param.astype(dtype), grad.astype(dtype)
    if maximize:
        g = -g
    if weight_decay != 0:
        g = g + p * jnp.asarray(weight_decay, dtype)
    return dtype, p, g


def _adam(decoupled):
    def fused_adam(
        self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2, weight_decay, eps,
        amsgrad, maximize, grad_scale=None, found_inf=None,
    ):
        grads_out = _unscaled(grads, grad_scale)
        params_out, avgs_out, sqs_out, maxes_out = [], [], [], []
        for i, (param, grad, exp_avg, exp_avg_sq, step) in enumerate(zip(self, grads_out, exp_avgs, exp_avg_sqs, state_steps)):
            dtype = _compute_type(param.dtype)
            rate = jnp.asarray(lr, dtype).reshape(())
            p, g = param.astype(dtype), grad.astype(dtype)
            if maximize:
                g = -g
            if weight_decay != 0:
                if decoupled:
                    p = p * (1 - rate * jnp.asarray(weight_decay, dtype))
                else:
                    g = g + p * jnp.asarray(weight_decay, dtype)
            m = exp_avg.astype(dtype) + (g - exp_avg.astype(dtype)) * jnp.asarray(1 - beta1, dtype)
            v = exp_avg_sq.astype(dtype) * jnp.asarray(beta2, dtype) + jnp.asarray(1 - beta2, dtype) * g * g
            second = v
            if amsgrad:
                second = jnp.maximum(max_exp_avg_sqs[i].astype(dtype), v)
                maxes_out.append(second.astype(max_exp_avg_sqs[i].dtype))
            bias1 = _one_minus_power(beta1, step, dtype)
            bias2_sqrt = jnp.sqrt(_one_minus_power(beta2, step, dtype))
            denom = jnp.sqrt(second) / bias2_sqrt + jnp.asarray(eps, dtype)
            p = p - (rate / bias1) * (m / denom)
            params_out.append(p.astype(param.dtype))
            avgs_out.append(m.astype(exp_avg.dtype))
            sqs_out.append(v.astype(exp_avg_sq.dtype))
        if not amsgrad:
            maxes_out = list(max_exp_avg_sqs)
        old = [self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs]
        return tuple(_unless_found(found_inf, [params_out, grads_out, avgs_out, sqs_out, maxes_out], old))

    return fused_adam


register_mapping(aten._fused_adam, family="optimizers")(_adam(decoupled=False))
register_mapping(aten._fused_adamw, family="optimizers")(_adam(decoupled=True))


@register_mapping(aten._fused_sgd, family="optimizers")
def fused_sgd(
    self, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov, maximize, is_first_step,
    grad_scale=None, found_inf=None,
):
    grads_out = _unscaled(grads, grad_scale)
    params_out, buffers_out = [], []
    for i, (param, grad) in enumerate(zip(self, grads_out)):
        dtype, p, g = _gradient(param, grad, maximize, weight_decay)
        if momentum != 0:
            buffer = momentum_buffer_list[i]
            if is_first_step:
                b = g
            else:
                b = buffer.astype(dtype) * jnp.asarray(momentum, dtype) + g * jnp.asarray(1 - dampening, dtype)
            buffers_out.append(b.astype(buffer.dtype))
            g = g + b * jnp.asarray(momentum, dtype) if nesterov else b
        p = p - jnp.asarray(lr, dtype).reshape(()) * g
        params_out.append(p.astype(param.dtype))
    if momentum == 0:
        buffers_out = list(momentum_buffer_list)
    old = [self, grads, momentum_buffer_list]
    return tuple(_unless_found(found_inf, [params_out, grads_out, buffers_out], old))


def _adagrad(
    self, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize, grad_scale=None, found_inf=None,
):
    grads_out = _unscaled(grads, grad_scale)
    params_out, sums_out = [], []
    for param, grad, state_sum, step in zip(self, grads_out, state_sums, state_steps):
        dtype, p, g = _gradient(param, grad, maximize, weight_decay)
        clr = jnp.asarray(lr, dtype).reshape(()) / (1 + (step.astype(dtype) - 1) * jnp.asarray(lr_decay, dtype))
        s = state_sum.astype(dtype) + g * g
        p = p - clr * g / (jnp.sqrt(s) + jnp.asarray(eps, dtype))
        params_out.append(p.astype(param.dtype))
        sums_out.append(s.astype(state_sum.dtype))
    return _unless_found(found_inf, [params_out, grads_out, sums_out], [self, grads, state_sums])


@register_mapping(aten._fused_adagrad.default, family="optimizers")
def fused_adagrad(self, grads, state_sums, state_steps, **kwargs):
    return (*_adagrad(self, grads, state_sums, state_steps, **kwargs), list(state_steps))


@register_mapping(aten._fused_adagrad.tensor_lr, family="optimizers")
def fused_adagrad_tensor_lr(self, grads, state_sums, state_steps, **kwargs):
    return tuple(_adagrad(self, grads, state_sums, state_steps, **kwargs))
