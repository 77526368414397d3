"""Custom `torch.autograd.Function`s inside captured regions.

A region's gradient is JAX's derivative of its traced body, which would differentiate a custom
Function's forward and never run its backward (a straight-through estimator's, a clipped
gradient's, a library's hand-written backward). Inside a trace, `Function.apply` becomes a
`jax.custom_vjp`: its forward is the Function's forward and its backward the Function's
backward, both traced through the tables like the rest of the region. So the region stays one
program and its gradient is the one torch computes.

What the forward keeps for the backward crosses as residuals: the tensors given to
`ctx.save_for_backward` and tensors set as attributes of `ctx`; other attributes (numbers,
shapes, flags) are kept by the Python objects. `ctx.needs_input_grad` is true for every
floating-point tensor argument (inside a region a tensor's `requires_grad` does not say whether
the region's gradient reaches it, so each gradient is asked for: what torch would not compute
is then computed and not used). A Function that marks inputs dirty (writes them in place) is
not traced: the region runs eagerly (a graph break that names the Function).
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils import _pytree as pytree

from bridge.runtime import capture
from bridge.runtime import tensor as tensor_module
from bridge.runtime.config import settings
from bridge.runtime.tensor import BridgeTensor, read_value

_SETUP_CONTEXT = torch.autograd.function._SingleLevelFunction.setup_context


class _Context(torch.autograd.function.FunctionCtx):
    """The `ctx` a traced Function's forward and backward see."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True
        self.to_save = ()

    def set_materialize_grads(self, value):
        self.materialize_grads = value

    @property
    def saved_tensors(self):
        return self._bridge_saved


def _floating(tensor):
    return tensor.dtype.is_floating_point or tensor.dtype.is_complex


def _break(cls, why):
    return capture.GraphBreak(f"the custom autograd.Function {cls.__qualname__} {why}")


def _no_host_values(cls):
    def refuse(plan, args, kwargs):
        raise _break(cls, "needs a value on the host (bool(t), t.item()) in its forward or backward")

    return refuse


def traced_apply(cls, args, kwargs):
    """`cls.apply(*args, **kwargs)` in a region being traced, as a jax.custom_vjp over every
    bridge tensor among the arguments; the backward's gradients go to the positional tensor
    arguments (as in torch, where a tensor inside a list or given by keyword gets none)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, BridgeTensor)]
    inputs = [leaves[i] for i in positions]
    # Which positional argument each input is, where it is one: leaf position -> argument number.
    argument_at, offset = {}, 0
    for number, arg in enumerate(args):
        if isinstance(arg, BridgeTensor):
            argument_at[offset] = number
        offset += len(pytree.tree_flatten(arg)[0])
    needs = tuple(isinstance(arg, BridgeTensor) and _floating(arg) for arg in args)
    made = {}  # found while tracing the forward: the output's structure, the context

    def forward(arrays):
        ctx = _Context(needs)
        call = list(leaves)
        for position, array, tensor in zip(positions, arrays, inputs):
            call[position] = BridgeTensor(array, tensor._index)
        call_args, call_kwargs = pytree.tree_unflatten(call, spec)
        # (JAX traces the forward more than once: learned host values would not line up.)
        outer = tensor_module.set_hooks(tensor_module.trace_hook, _no_host_values(cls))
        try:
            with torch.no_grad():  # as torch runs a Function's forward
                if cls.setup_context is _SETUP_CONTEXT:
                    out = cls.forward(ctx, *call_args, **call_kwargs)
                else:
                    out = cls.forward(*call_args, **call_kwargs)
                    cls.setup_context(ctx, call_args, out)
        finally:
            tensor_module.set_hooks(*outer)
        if getattr(ctx, "dirty_tensors", None):
            raise _break(cls, "writes its inputs in place (mark_dirty)")
        out_leaves, out_spec = pytree.tree_flatten(out)
        at = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, BridgeTensor)]
        values = [read_value(out_leaves[i]) for i in at]
        # The output's structure, its plain leaves, and each tensor's place, device, shape, dtype.
        made["out"] = (
            [None if i in at else leaf for i, leaf in enumerate(out_leaves)],
            out_spec,
            [(i, out_leaves[i]._index, value.shape, value.dtype) for i, value in zip(at, values)],
        )
        return ctx, values

    @jax.custom_vjp
    def function(*arrays):
        return forward(arrays)[1]

    def function_forward(*arrays):
        ctx, outputs = forward(arrays)
        to_save = tuple(ctx.to_save or ())
        saved = [read_value(tensor) if isinstance(tensor, BridgeTensor) else None for tensor in to_save]
        held = {name: value for name, value in vars(ctx).items() if isinstance(value, BridgeTensor)}
        for name in held:
            delattr(ctx, name)  # traced values cross as residuals, not in the Python object
        ctx.to_save = None
        # Per saved object: the device of a tensor (its value crosses), or the object itself.
        places = [(tensor._index, None) if isinstance(tensor, BridgeTensor) else (None, tensor) for tensor in to_save]
        made["ctx"] = (ctx, places, {name: value._index for name, value in held.items()})
        return outputs, (saved, {name: read_value(value) for name, value in held.items()})

    def function_backward(residuals, cotangents):
        saved, held = residuals
        ctx, saved_places, held_indices = made["ctx"]
        ctx._bridge_saved = tuple(
            plain if index is None else BridgeTensor(array, index) for array, (index, plain) in zip(saved, saved_places)
        )
        for name, array in held.items():
            setattr(ctx, name, BridgeTensor(array, held_indices[name]))
        grads_in = []
        for cotangent, (_, index, shape, dtype) in zip(cotangents, made["out"][2]):
            if cotangent.dtype == jax.dtypes.float0:  # an integer output: torch hands zeros (or None)
                grads_in.append(BridgeTensor(jnp.zeros(shape, dtype), index) if ctx.materialize_grads else None)
            else:
                grads_in.append(BridgeTensor(cotangent, index))
        outer = tensor_module.set_hooks(tensor_module.trace_hook, _no_host_values(cls))
        try:
            with torch.no_grad():  # as torch runs a backward (no create_graph)
                grads = cls.backward(ctx, *grads_in)
        finally:
            tensor_module.set_hooks(*outer)
        grads = grads if isinstance(grads, tuple) else (grads,)
        if len(grads) < len(args):
            raise _break(cls, f"returned {len(grads)} gradient(s) from backward for {len(args)} input(s)")
        results = []
        for position, tensor in zip(positions, inputs):
            value = tensor._value  # (its shape and dtype)
            number = argument_at.get(position)
            grad = None if number is None else grads[number]
            if not jnp.issubdtype(value.dtype, jnp.inexact):
                results.append(np.zeros(value.shape, jax.dtypes.float0))
            elif grad is None:
                results.append(jnp.zeros(value.shape, value.dtype))
            else:
                results.append(jnp.broadcast_to(read_value(grad).astype(value.dtype), value.shape))
        return tuple(results)

    function.defvjp(function_forward, function_backward)
    arrays = [read_value(tensor) for tensor in inputs]
    outputs = function(*arrays)
    if settings.tracing_for_grad:
        # The backward traced now, its result unused (XLA drops it): one that cannot be traced
        # (it needs a value on the host, or runs torch's autograd itself) breaks the region
        # here, at its first call, rather than when the region's backward is first compiled.
        _, pullback = jax.vjp(function, *map(jax.lax.stop_gradient, arrays))
        pullback([np.zeros(shape, jax.dtypes.float0) if not jnp.issubdtype(dtype, jnp.inexact) else jnp.zeros(shape, dtype) for _, _, shape, dtype in made["out"][2]])
    out_leaves, out_spec, places = made["out"]
    result = list(out_leaves)
    for (position, index, _, _), array in zip(places, outputs):
        result[position] = BridgeTensor(array, index)
    return pytree.tree_unflatten(result, out_spec)
