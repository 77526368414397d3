"""Whole graphs to JAX: a `torch.export.ExportedProgram` as one pure JAX function.

The program's graph runs once, under a JAX trace, on bridge tensors holding the tracers: each of
its ATen calls reaches the bridge's dispatch as in eager mode, so the graph takes the same
tables, the same decompositions and the same view and in-place rules as a script does. What
the graph writes in place (BatchNorm's running statistics in training mode, a user input it
adds to) is found the way captured regions find it (the tensor's value is no longer the one it
was given) and returned, so nothing is dropped.

    function, state = to_jax(exported)
    outputs, new_state, new_inputs = function(state, *args)

`state` maps the program's parameter, buffer and constant names (its state_dict's and its
constants' keys) to arrays; `new_state` is `state` with every buffer the graph wrote replaced;
`new_inputs` has, for each user input (flattened as the program flattens them), its new value
where the graph wrote it and None where it did not. The function is jit-able and differentiable
(`jax.grad` over `state`); a `key=` argument seeds the graph's random ops.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import torch
from torch.utils import _pytree as pytree

from . import random
from .config import settings
from .tensor import BridgeTensor, read_value, to_bridge

# The kinds of graph inputs that come from the program's state rather than the caller.
_STATE_KINDS = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")


@dataclasses.dataclass(frozen=True)
class Signature:
    """What the function needs to know of the program's graph signature, by placeholder order."""

    placeholders: tuple  # per graph input: ("state", name) or ("input", position among user inputs)
    in_spec: Any  # pytree spec of (args, kwargs) as the program was exported with
    out_spec: Any  # pytree spec of its user outputs
    user_outputs: tuple  # positions of user outputs among the graph's outputs


def _signature(exported: torch.export.ExportedProgram) -> Signature:
    placeholders, user = [], 0
    for spec in exported.graph_signature.input_specs:
        kind = spec.kind.name
        if kind in _STATE_KINDS:
            placeholders.append(("state", spec.target))
        elif kind == "USER_INPUT":
            placeholders.append(("input", user))
            user += 1
        else:
            raise NotImplementedError(f"torch.export input of kind {kind} ({spec.arg}) is not supported yet")
    outputs = tuple(
        position for position, spec in enumerate(exported.graph_signature.output_specs) if spec.kind.name == "USER_OUTPUT"
    )
    return Signature(tuple(placeholders), exported.call_spec.in_spec, exported.call_spec.out_spec, outputs)


def initial_state(exported: torch.export.ExportedProgram) -> dict:
    """The program's parameters, buffers and constants as JAX arrays on the first bridge device."""
    return arrays_of({**exported.state_dict, **exported.constants})


def arrays_of(tensors: dict) -> dict:
    """{name: jax.Array} on the first bridge device for the torch tensors among `tensors`' values."""
    return {name: read_value(to_bridge(tensor.detach().cpu())) for name, tensor in tensors.items() if isinstance(tensor, torch.Tensor)}


@contextlib.contextmanager
def graph_trace(key: Optional[jax.Array]) -> Iterator[None]:
    """Runs a whole graph's ATen calls (on bridge tensors holding tracers) as one trace: the
    graph's random ops draw from `key`, autograd records nothing (`jax.grad` differentiates the
    function), and the tables know that they are tracing. TorchScript's translator shares it."""
    saved_key = random.swap_key(jax.random.key(0) if key is None else key)
    settings.tracing += 1
    outer_for_grad, settings.tracing_for_grad = settings.tracing_for_grad, False
    try:
        with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():
            yield
    finally:
        settings.tracing -= 1
        settings.tracing_for_grad = outer_for_grad
        random.swap_key(saved_key)


def written(tensors: Sequence[Any], given: Sequence[Any]) -> list:
    """For each of the graph's inputs (bridge tensors made from the arrays in `given`), its value
    after the graph ran where the graph wrote it in place, else None."""
    values = []
    for tensor, before in zip(tensors, given):
        value = read_value(tensor) if isinstance(tensor, BridgeTensor) else before
        values.append(None if value is before else value)
    return values


def _on_bridge_device(graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the graph that runs wholly on the bridge device, where it names the device it
    was exported on: a copy to a device (`_to_copy(x, device="cpu")`) keeps its tensor where it
    is, and a factory's result (`ones(..., device="cpu")`, made on the host: ATen factories take
    no bridge tensor to dispatch on) is moved to the bridge device, as a constant of the trace."""
    copied = copy.deepcopy(graph_module)
    graph = copied.graph
    for node in list(graph.nodes):
        device = node.kwargs.get("device")
        if node.op != "call_function" or not isinstance(device, (torch.device, str)):
            continue
        if any(isinstance(arg, torch.fx.Node) for arg in pytree.tree_leaves((node.args, node.kwargs))):
            node.kwargs = {**node.kwargs, "device": None}
            continue
        # (a string: torch 2.13's code generation names a torch.device it cannot find)
        node.kwargs = {**node.kwargs, "device": "cpu"}
        with graph.inserting_after(node):
            moved = graph.call_method("to", (node, settings.device_type))
        node.replace_all_uses_with(moved, delete_user_cb=lambda user: user is not moved)
    copied.recompile()
    return copied


# While set (`scoped_by_node`), each graph node runs inside `jax.named_scope(node.name)`, so that
# the equations of a trace carry the names of the nodes they came from (bridge convert names its
# variables after them). Off by default: an interpreter walks the graph more slowly than the
# graph's own generated code.
_scope_nodes = False


@contextlib.contextmanager
def scoped_by_node() -> Iterator[None]:
    """Within the block, functions from `to_jax` that are traced name their equations' scopes
    after the graph's nodes."""
    global _scope_nodes
    outer, _scope_nodes = _scope_nodes, True
    try:
        yield
    finally:
        _scope_nodes = outer


class _ScopedInterpreter(torch.fx.Interpreter):
    def run_node(self, node):
        with jax.named_scope(node.name):
            return super().run_node(node)


def _run_graph(graph: torch.fx.GraphModule, tensors: list) -> Any:
    if _scope_nodes:
        return _ScopedInterpreter(graph).run(*tensors)
    return graph(*tensors)


def to_jax(exported: torch.export.ExportedProgram) -> tuple[Callable, dict]:
    """The program as a pure JAX function and its initial state (see the module's docstring)."""
    signature = _signature(exported)
    graph = _on_bridge_device(exported.graph_module)

    def function(state, *args, key=None, **kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        if signature.in_spec is not None and spec != signature.in_spec:
            raise TypeError(f"the program was exported for arguments shaped as {signature.in_spec}, not {spec}")
        tensors = []
        for source, which in signature.placeholders:
            value = state[which] if source == "state" else flat[which]
            tensors.append(BridgeTensor(value, 0) if isinstance(value, jax.Array) else value)
        given = [tensor._value if isinstance(tensor, BridgeTensor) else None for tensor in tensors]
        with graph_trace(key):
            outputs = _run_graph(graph, tensors)
        outputs = [outputs[position] for position in signature.user_outputs]
        arrays = [read_value(out) if isinstance(out, BridgeTensor) else out for out in outputs]
        new_state, new_inputs = dict(state), [None] * len(flat)
        for (source, which), value in zip(signature.placeholders, written(tensors, given)):
            if value is None:
                continue
            if source == "state":
                new_state[which] = value
            else:
                new_inputs[which] = value
        return pytree.tree_unflatten(arrays, signature.out_spec), new_state, new_inputs

    return function, initial_state(exported)
