"""Torch's derivative formula for ops whose JAX derivative is another one, inside captured regions.

A captured region's backward is JAX's differentiation of its traced forward. For most ops that
is torch's formula too; where the two differ (subgradients at 0 and at bounds, `padding_idx`,
`scale_grad_by_freq`, norms of zero vectors), the ops' registrations
declare it (`gradient="torch"`), and in a differentiated trace each call of one becomes a JAX
custom vjp whose backward runs the op once more through torch's autograd, on bridge tensors
holding the backward trace's values, and asks torch for the gradients: the formula of
derivatives.yaml, run through the mapping tables as eager mode runs it. Its residuals are the
op's inputs.

Only functional ops are declared: their in-place and out= variants reach the functional op
through the dispatcher, and views are differentiated by JAX exactly.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils import _pytree as pytree

from .config import settings
from .tensor import BridgeTensor, read_value


@contextlib.contextmanager
def _torch_autograd():
    """Where the backward runs torch's autograd on traced values: recording on, above autograd,
    no autocast (the forward's arguments were cast already), and no torch rule inside."""
    outer = settings.tracing_for_grad, settings.in_torch_gradient
    settings.tracing += 1
    settings.tracing_for_grad, settings.in_torch_gradient = False, True
    try:
        with torch.enable_grad(), torch.autocast("cpu", enabled=False):
            yield
    finally:
        settings.tracing -= 1
        settings.tracing_for_grad, settings.in_torch_gradient = outer


_TENSOR = object()  # where an output leaf is a tensor


def _zero_cotangent(value):
    if jnp.issubdtype(value.dtype, jnp.inexact):
        return jnp.zeros(value.shape, value.dtype)
    return np.zeros(value.shape, jax.dtypes.float0)


def call(func, plan, args, kwargs):
    """Run `func` (through its dispatch plan) as a JAX function whose vjp is torch's."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, BridgeTensor)]
    if not positions:
        return plan(args, kwargs)
    indices = [leaves[i]._index for i in positions]
    arrays = [read_value(leaves[i]) for i in positions]
    inexact = [jnp.issubdtype(array.dtype, jnp.inexact) for array in arrays]
    structure = {}

    def rebuild(values, requires_grad):
        filled = list(leaves)
        made = []
        for position, value, index, differentiable in zip(positions, values, indices, inexact):
            tensor = BridgeTensor(value, index)
            if requires_grad and differentiable:
                tensor.requires_grad_()
            filled[position] = tensor
            made.append(tensor)
        rebuilt_args, rebuilt_kwargs = pytree.tree_unflatten(filled, spec)
        return rebuilt_args, rebuilt_kwargs, made

    def primal(*values):
        call_args, call_kwargs, _ = rebuild(values, requires_grad=False)
        outer = settings.in_torch_gradient
        settings.in_torch_gradient = True  # the ops it decomposes into need no rule of their own
        try:
            out = plan(call_args, call_kwargs)
        finally:
            settings.in_torch_gradient = outer
        out_leaves, out_spec = pytree.tree_flatten(out)
        structure["spec"] = out_spec
        structure["leaves"] = [_TENSOR if isinstance(leaf, BridgeTensor) else leaf for leaf in out_leaves]
        structure["indices"] = [leaf._index for leaf in out_leaves if isinstance(leaf, BridgeTensor)]
        return tuple(read_value(leaf) for leaf in out_leaves if isinstance(leaf, BridgeTensor))

    def forward(*values):
        return primal(*values), values

    def backward(saved, cotangents):
        with _torch_autograd():
            call_args, call_kwargs, made = rebuild(saved, requires_grad=True)
            outputs = [leaf for leaf in pytree.tree_leaves(func(*call_args, **call_kwargs)) if isinstance(leaf, BridgeTensor)]
            chosen, given = [], []
            for output, cotangent in zip(outputs, cotangents):
                if output.requires_grad and jnp.issubdtype(cotangent.dtype, jnp.inexact):
                    chosen.append(output)
                    # Complex cotangents: torch's convention is the conjugate of JAX's.
                    given.append(BridgeTensor(jnp.conj(cotangent).astype(read_value(output).dtype), output._index))
            wanted = [tensor for tensor, differentiable in zip(made, inexact) if differentiable]
            grads = torch.autograd.grad(chosen, wanted, given, allow_unused=True) if chosen and wanted else [None] * len(wanted)
        found = iter(grads)
        result = []
        for value, differentiable in zip(saved, inexact):
            grad = next(found) if differentiable else None
            result.append(_zero_cotangent(value) if grad is None else jnp.conj(read_value(grad)).astype(value.dtype))
        return tuple(result)

    function = jax.custom_vjp(primal)
    function.defvjp(forward, backward)
    out_arrays = iter(function(*arrays))
    out_indices = iter(structure["indices"])
    out_leaves = [
        BridgeTensor(next(out_arrays), next(out_indices)) if leaf is _TENSOR else leaf for leaf in structure["leaves"]
    ]
    return pytree.tree_unflatten(out_leaves, structure["spec"])
