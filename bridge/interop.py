"""JAX interop: a torch module as a pure JAX function (`to_jax`), and a JAX function as a torch
operation with autograd (`from_jax`), both through the bridge's translator.

    fn, params = bridge.to_jax(model, example_x)     # fn(params, x) -> outputs; jit, grad, vmap
    layer = bridge.from_jax(jax_function)            # layer(t) on bridge tensors; backward: jax.vjp
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils import _pytree as pytree

from bridge.runtime import export
from bridge.runtime.tensor import BridgeTensor, numpy_to_torch, read_value, torch_to_numpy


def to_jax(module: torch.nn.Module, *example_inputs: Any, with_state: bool = False, **example_kwargs: Any) -> tuple:
    """`module` as a pure JAX function of its parameters, traced through the bridge's tables.

        fn, params = bridge.to_jax(module, *example_inputs)
        outputs = fn(params, *inputs, key=None)

        fn, params, buffers = bridge.to_jax(module, *example_inputs, with_state=True)
        outputs, new_buffers = fn(params, buffers, *inputs, key=None)

    `params` is a dict of JAX arrays keyed by the module's state_dict names (its parameters,
    frozen ones included); `outputs` has the structure of the module's outputs (tuples, lists and
    dicts of arrays). `fn` is pure: it works under `jax.jit`, `jax.grad` (over `params` and the
    inputs), `jax.vmap` and with optax. `key` (a `jax.random.key`) seeds the module's random ops
    (dropout in training mode); without it they draw from `jax.random.key(0)`.

    Buffers: by default the buffers (BatchNorm's running statistics) are constants of `fn`, with
    the values they had here, and what the module writes to them is dropped. A module in training
    mode normalizes by the batch's statistics either way; to carry its running statistics, use
    `with_state=True`: `fn` then takes the buffers and returns them as the module left them.

    The module goes through `torch.export.export(..., strict=False)` with the example inputs, so
    it must satisfy what that asks: its forward's Python control flow may depend on shapes and
    Python values but not on tensor data (`torch.cond` for that), it must not write Python state
    it reads later, and the example inputs fix the shapes `fn` accepts (each call's inputs have
    the example's shapes and dtypes; for `jax.vmap` export with one example, unbatched). The
    module is exported in the mode it is in (`module.eval()` first for inference). Inputs the
    module writes in place are not written (JAX arrays are immutable): only the outputs return.

    The graph runs through the bridge's tables: where the bridge is not active, `to_jax` and
    each trace of `fn` activate it for their duration (torch is left as it was). That turns
    JAX's 64-bit types on (`jax_enable_x64`) for the process: torch's int64 and float64 are real.
    """
    exported = export_on_host(module, example_inputs, example_kwargs)
    with _bridge_active():
        function, state = export.to_jax(exported)
    signature = exported.graph_signature
    params = {name: state[name] for name in signature.parameters}
    buffers = {name: state[name] for name in signature.buffers}
    constants = {name: value for name, value in state.items() if name not in params and name not in buffers}

    if with_state:

        def stateful(params: dict, buffers: dict, *inputs: Any, key: Any = None, **kwargs: Any) -> tuple:
            with _bridge_active():
                outputs, new_state, _ = function({**constants, **buffers, **params}, *_arrays(inputs), key=key, **_arrays(kwargs))
            return outputs, {name: new_state[name] for name in buffers}

        return _named(stateful, module), params, buffers

    fixed = {**constants, **buffers}

    def stateless(params: dict, *inputs: Any, key: Any = None, **kwargs: Any) -> Any:
        with _bridge_active():
            outputs, _, _ = function({**fixed, **params}, *_arrays(inputs), key=key, **_arrays(kwargs))
        return outputs

    return _named(stateless, module), params


@contextlib.contextmanager
def _bridge_active() -> Iterator[None]:
    """The bridge active for the block: left as it is where it already was."""
    from bridge.activation import activate, deactivate, is_active

    if is_active():
        yield
        return
    activate()
    try:
        yield
    finally:
        deactivate()


def export_on_host(module: torch.nn.Module, inputs: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """torch.export of the module on the host: its tensors and the example inputs as CPU tensors
    (bridge tensors, a module already moved to the bridge device, are copied back)."""
    if any(isinstance(tensor, BridgeTensor) for tensor in module.state_dict().values()):
        module = copy.deepcopy(module).cpu()
    to_host = lambda value: _host_tensor(value) if isinstance(value, (torch.Tensor, jax.Array, np.ndarray)) else value  # noqa: E731
    inputs, kwargs = pytree.tree_map(to_host, (tuple(inputs), dict(kwargs)))
    return torch.export.export(module, inputs, kwargs, strict=False)


def _host_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, BridgeTensor):
        return value.cpu()
    if isinstance(value, torch.Tensor):
        return value
    return numpy_to_torch(np.array(value))


def _arrays(tree: Any) -> Any:
    """Inputs as JAX arrays: numpy arrays and host torch tensors are converted, tracers kept."""

    def convert(value: Any) -> Any:
        if isinstance(value, jax.Array):
            return value
        if isinstance(value, BridgeTensor):
            return read_value(value)
        if isinstance(value, torch.Tensor):
            return jnp.asarray(torch_to_numpy(value))
        if isinstance(value, np.ndarray):
            return jnp.asarray(value)
        return value

    return pytree.tree_map(convert, tree)


def _named(function: Callable, module: torch.nn.Module) -> Callable:
    function.__name__ = function.__qualname__ = f"{type(module).__name__}_forward"
    return function


# ---------------------------------------------------------------- from_jax


def from_jax(function: Callable) -> Callable:
    """A JAX function as a torch operation: called with torch tensors, it runs `function` on
    their JAX arrays and returns torch tensors, with autograd (its backward is `jax.vjp` of
    `function`).

        gelu = bridge.from_jax(lambda x, w: jax.nn.gelu(x @ w))
        y = gelu(x, weight)          # bridge tensors in and out
        y.sum().backward()           # x.grad, weight.grad from JAX's derivative

    Arguments may be nested in tuples, lists and dicts; tensors among them become arrays, other
    values pass as they are. Outputs (arrays, or tuples, lists and dicts of them) come back as
    bridge tensors where any input was one, else as CPU tensors. Gradients reach floating-point
    tensor inputs given positionally or nested; integer outputs have none. `function` must be
    traceable by JAX (it runs under the bridge's captured regions' traces too).
    """

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        plan = _Call(function, leaves, spec, positions)
        outputs = _JaxFunction.apply(plan, *(leaves[i] for i in positions))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return jax.tree_util.tree_unflatten(plan.out_spec, list(outputs))

    return call


class _Call:
    """One call of a from_jax function: its arguments' structure and, once run, its outputs'."""

    def __init__(self, function: Callable, leaves: list, spec: Any, positions: tuple):
        self.function, self.leaves, self.spec, self.positions = function, leaves, spec, positions
        self.out_spec: Any = None
        self.out_types: list = []  # each output's (shape, dtype)
        self.index: Any = None  # the bridge device of the outputs, None for host tensors

    def __call__(self, *arrays: Any) -> list:
        """The function on these arrays in the tensors' places; its outputs, flattened."""
        leaves = list(self.leaves)
        for position, array in zip(self.positions, arrays):
            leaves[position] = array
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out_leaves, self.out_spec = jax.tree_util.tree_flatten(self.function(*args, **kwargs))
        return out_leaves


def _array_of(tensor: torch.Tensor) -> jax.Array:
    return read_value(tensor) if isinstance(tensor, BridgeTensor) else jnp.asarray(torch_to_numpy(tensor))


def _differentiable(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


class _JaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Call, *tensors: torch.Tensor) -> tuple:
        bridged = [tensor for tensor in tensors if isinstance(tensor, BridgeTensor)]
        plan.index = bridged[0]._index if bridged else None
        outputs = plan(*(_array_of(tensor) for tensor in tensors))
        plan.out_types = [(jnp.shape(value), jnp.result_type(value)) for value in outputs]
        # Each output on the inputs' side: a bridge tensor, or a host tensor (a copy: the caller may write it).
        results = tuple(
            BridgeTensor(jnp.asarray(value), plan.index) if plan.index is not None else numpy_to_torch(np.array(value))
            for value in outputs
        )
        ctx.plan = plan
        ctx.save_for_backward(*tensors)
        ctx.mark_non_differentiable(*(result for result, (_, dtype) in zip(results, plan.out_types) if not _differentiable(dtype)))
        return results

    @staticmethod
    def backward(ctx, *cotangents: torch.Tensor) -> tuple:
        plan, tensors = ctx.plan, ctx.saved_tensors
        arrays = [_array_of(tensor) for tensor in tensors]
        wanted = [i for i, array in enumerate(arrays) if _differentiable(array.dtype) and ctx.needs_input_grad[1 + i]]

        def differentiated(*chosen: jax.Array) -> list:
            call = list(arrays)
            for i, array in zip(wanted, chosen):
                call[i] = array
            return [output for output in plan(*call) if _differentiable(output.dtype)]

        # The forward runs again here (its residuals would be values of the forward's trace,
        # which in a captured region may have ended): XLA merges the two in one program.
        _, vjp = jax.vjp(differentiated, *(arrays[i] for i in wanted))
        float_cotangents = [
            jnp.zeros(shape, dtype) if cotangent is None else _array_of(cotangent).astype(dtype)
            for cotangent, (shape, dtype) in zip(cotangents, plan.out_types)
            if _differentiable(dtype)
        ]
        gradients = vjp(float_cotangents)
        result: list = [None] * len(tensors)
        for i, gradient in zip(wanted, gradients):
            tensor = tensors[i]
            if isinstance(tensor, BridgeTensor):
                result[i] = BridgeTensor(gradient, tensor._index)
            else:
                result[i] = numpy_to_torch(np.array(gradient))
        return (None, *result)


__all__ = ["to_jax", "from_jax"]
