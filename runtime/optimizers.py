"""Optimizer updates as one compiled program per step: Adam/AdamW and SGD.

torch's optimizers update each parameter with a dozen small ops (the `foreach` path for
device tensors); on the bridge each is a dispatch. Here the whole update of a parameter
group is one `jax.jit` program. The arithmetic follows torch's non-capturable `foreach`
implementation op for op, in the parameters' dtype: per-step scalars (learning rate, bias
corrections) are computed on the host in Python floats exactly as torch computes them and
passed in as arrays, so a learning-rate schedule never recompiles; the remaining
hyperparameters are part of the program's static key.

The optimizer state (Adam's moments, SGD's momentum buffers) lives in one flat array per
kind, and each parameter's state tensor is a view into it (`flat_state`): the update program
then takes and returns two arrays instead of two per parameter. Each array crossing a program
boundary costs the host a few microseconds in JAX and XLA's runtime; for GPT-2's 148
parameters, per-parameter state made the update's call cost about as much as its kernels.
"""

import functools
import math

import jax
import jax.numpy as jnp

from .registry import MAPPINGS, aten
from .tensor import BridgeTensor, read_value
from .views import ViewStep


def _split(flat, like):
    """The per-parameter pieces of a flat array, shaped like `like`."""
    pieces, start = [], 0
    for array in like:
        pieces.append(flat[start : start + array.size].reshape(array.shape))
        start += array.size
    return pieces


def _join(arrays):
    return jnp.concatenate([array.reshape(-1) for array in arrays]) if arrays else jnp.zeros((0,))


_join_jit = jax.jit(_join)


def _make_members(root, tensors, shapes):
    """Make each tensor a view of its span of the flat root, one after another."""
    slice_mapping, view_mapping = MAPPINGS[aten.slice.Tensor], MAPPINGS[aten.view.default]
    start = 0
    for tensor, shape in zip(tensors, shapes):
        stop = start + math.prod(shape)
        tensor._root = root
        tensor._chain = (
            ViewStep(slice_mapping, (0, start, stop, 1), {}, None),
            ViewStep(view_mapping, (tuple(shape),), {}, None),
        )
        tensor._seen = -1  # read from the root when first read
        start = stop
    root._flat_members = tuple(map(id, tensors))


def flat_state(tensors):
    """The flat root holding `tensors` (state tensors, one per parameter) one after another.

    Made on first use: the tensors keep their identity (the optimizer's state and any
    reference a script holds) and become views into the root, so reading one (state_dict,
    a checkpoint) gives its current value, and writing one writes the root. State replaced
    since (load_state_dict makes new tensors) is gathered into a new root."""
    first = tensors[0]
    root = first._root
    if root is not None and getattr(root, "_flat_members", None) == tuple(map(id, tensors)):
        return root
    values = [read_value(tensor) for tensor in tensors]
    root = BridgeTensor(_join_jit(values), first._index)
    _make_members(root, tensors, [tuple(value.shape) for value in values])
    return root


def flat_members(flat, params):
    """New state tensors, one per parameter, as views into a new root holding `flat`."""
    root = BridgeTensor(flat, params[0]._index)
    # Placeholders until first read: _make_members marks them stale, so a read takes the root.
    members = [BridgeTensor(jax.ShapeDtypeStruct(tuple(p.shape), flat.dtype), p._index) for p in params]
    _make_members(root, members, [tuple(p.shape) for p in params])
    return members


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
    params, grads, flat_avgs, flat_sqs, flat_maxes, scalars,
    *, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize
):
    """One Adam/AdamW step; returns the new (params, flat exp_avgs, flat exp_avg_sqs, flat
    max_exp_avg_sqs or None). The moments are flat arrays (`flat_state`); `scalars` (one
    transfer from the host) holds 1 - lr * weight_decay, then -lr / (1 - beta1**step) per
    parameter, then sqrt(1 - beta2**step) per parameter."""
    count = len(params)
    decay, step_sizes, bias2_sqrts = scalars[0], scalars[1 : 1 + count], scalars[1 + count :]
    exp_avgs, exp_avg_sqs = _split(flat_avgs, params), _split(flat_sqs, params)
    max_exp_avg_sqs = _split(flat_maxes, params) if amsgrad else None
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
    return new_params, _join(new_avgs), _join(new_sqs), (_join(new_maxes) if amsgrad else None)


@functools.partial(
    jax.jit,
    static_argnames=("momentum", "dampening", "weight_decay", "nesterov", "maximize", "first"),
    donate_argnums=(2,),
)
def sgd_update(params, grads, flat_buffers, lr, *, momentum, dampening, weight_decay, nesterov, maximize, first):
    """One SGD step; returns (new params, new flat momentum buffers or None). `first`: no
    buffers yet (torch starts them as a copy of the gradient)."""
    buffers = None if first or momentum == 0 else _split(flat_buffers, params)
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
    return new_params, (_join(new_buffers) if momentum != 0 else None)
