"""Optimizer updates as one compiled program per step: Adam/AdamW and SGD.

torch's optimizers update each parameter with a dozen small ops (the `foreach` path for
device tensors); on the bridge each is a dispatch. Here the whole update of a parameter
group is one `jax.jit` program. The arithmetic follows torch's non-capturable `foreach`
implementation op for op, in the parameters' dtype: per-step scalars (learning rate, bias
corrections) are computed on the host in Python floats exactly as torch computes them and
passed in as arrays, so a learning-rate schedule never recompiles; the remaining
hyperparameters are part of the program's static key.
"""

import functools

import jax
import jax.numpy as jnp


def _lerp(start, end, weight):
    # torch's lerp: start + w * (end - start) below w = 0.5, else end - (end - start) * (1 - w).
    return jnp.where(
        jnp.abs(weight) < 0.5, start + weight * (end - start), end - (end - start) * (1 - weight)
    )


@functools.partial(
    jax.jit,
    static_argnames=("beta1", "beta2", "eps", "weight_decay", "decoupled", "amsgrad", "maximize"),
    donate_argnums=(2, 3, 4),
)
def adam_update(
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, scalars,
    *, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize
):
    """One Adam/AdamW step over lists of arrays; returns the new (params, exp_avgs,
    exp_avg_sqs, max_exp_avg_sqs). `scalars` (one transfer from the host) holds
    1 - lr * weight_decay, then -lr / (1 - beta1**step) per parameter, then
    sqrt(1 - beta2**step) per parameter."""
    count = len(params)
    decay, step_sizes, bias2_sqrts = scalars[0], scalars[1 : 1 + count], scalars[1 + count :]
    new_params, new_avgs, new_sqs, new_maxes = [], [], [], []
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        dtype = param.dtype
        if maximize:
            grad = -grad
        if weight_decay != 0:
            if decoupled:
                param = param * decay.astype(dtype)
            else:
                grad = grad + jnp.asarray(weight_decay, dtype) * param
        exp_avg = _lerp(exp_avg, grad, jnp.asarray(1 - beta1, dtype))
        exp_avg_sq = exp_avg_sq * jnp.asarray(beta2, dtype)
        exp_avg_sq = exp_avg_sq + jnp.asarray(1 - beta2, dtype) * grad * grad
        if amsgrad:
            largest = jnp.maximum(max_exp_avg_sqs[i], exp_avg_sq)
            new_maxes.append(largest)
            denom = jnp.sqrt(largest)
        else:
            denom = jnp.sqrt(exp_avg_sq)
        denom = denom / bias2_sqrts[i].astype(dtype) + jnp.asarray(eps, dtype)
        param = param + step_sizes[i].astype(dtype) * (exp_avg / denom)
        new_params.append(param)
        new_avgs.append(exp_avg)
        new_sqs.append(exp_avg_sq)
    return new_params, new_avgs, new_sqs, new_maxes


@functools.partial(
    jax.jit,
    static_argnames=("momentum", "dampening", "weight_decay", "nesterov", "maximize", "first"),
    donate_argnums=(2,),
)
def sgd_update(params, grads, buffers, lr, *, momentum, dampening, weight_decay, nesterov, maximize, first):
    """One SGD step; returns (new params, new momentum buffers). `first`: no buffers yet
    (torch starts them as a copy of the gradient)."""
    new_params, new_buffers = [], []
    for i, (param, grad) in enumerate(zip(params, grads)):
        dtype = param.dtype
        if maximize:
            grad = -grad
        if weight_decay != 0:
            grad = grad + jnp.asarray(weight_decay, dtype) * param
        if momentum != 0:
            if first:
                buffer = grad
            else:
                buffer = buffers[i] * jnp.asarray(momentum, dtype) + jnp.asarray(1 - dampening, dtype) * grad
            new_buffers.append(buffer)
            grad = grad + jnp.asarray(momentum, dtype) * buffer if nesterov else buffer
        param = param + (-lr).astype(dtype) * grad
        new_params.append(param)
    return new_params, new_buffers
