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

A program exported with dynamic dimensions (`torch.export.Dim`) is traced once for all their
sizes under `jax.export`'s shape polymorphism (runtime/symbolic.py):

    exported_jax = jax.export.export(jax.jit(function))(state_types, *symbolic_input_types(exported))
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import sympy
import torch
from torch.utils import _pytree as pytree

from . import random, symbolic
from .config import settings
from .errors import SymbolicShapeError
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
    # Writes a functional graph returns (a decomposed program's BatchNorm statistics): per output
    # position, ("state", name) or ("input", position among user inputs)
    mutations: tuple = ()


def _signature(exported: torch.export.ExportedProgram) -> Signature:
    placeholders, user, user_inputs = [], 0, {}
    for spec in exported.graph_signature.input_specs:
        kind = spec.kind.name
        if kind in _STATE_KINDS:
            placeholders.append(("state", spec.target))
        elif kind == "USER_INPUT":
            placeholders.append(("input", user))
            user_inputs[getattr(spec.arg, "name", None)] = user
            user += 1
        else:
            raise NotImplementedError(f"torch.export input of kind {kind} ({spec.arg}) is not supported yet")
    outputs, mutations = [], []
    for position, spec in enumerate(exported.graph_signature.output_specs):
        kind = spec.kind.name
        if kind == "USER_OUTPUT":
            outputs.append(position)
        elif kind == "BUFFER_MUTATION":
            mutations.append((position, ("state", spec.target)))
        elif kind == "USER_INPUT_MUTATION":
            mutations.append((position, ("input", user_inputs[spec.target])))
        else:
            raise NotImplementedError(f"torch.export output of kind {kind} ({spec.arg}) is not supported yet")
    return Signature(tuple(placeholders), exported.call_spec.in_spec, exported.call_spec.out_spec, tuple(outputs),
                     tuple(mutations))


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
    is; a factory of sizes the graph computes (`zeros([sym_size], device="cpu")`, a dynamic
    dimension's) runs through the bridge's table (ATen factories take no bridge tensor to dispatch
    on); any other factory's result (`ones(..., device="cpu")`, made on the host) is moved to the
    bridge device, as a constant of the trace."""
    copied = copy.deepcopy(graph_module)
    graph = copied.graph
    for node in list(graph.nodes):
        device = node.kwargs.get("device")
        if node.op != "call_function" or not isinstance(device, (torch.device, str)):
            continue
        arguments = [arg for arg in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(arg, torch.fx.Node)]
        if any(isinstance(arg.meta.get("val"), torch.Tensor) for arg in arguments):
            node.kwargs = {**node.kwargs, "device": None}
            continue
        if arguments and isinstance(node.target, torch._ops.OpOverload):
            node.target = _made_by_table(node.target)
            node.kwargs = {**node.kwargs, "device": "cpu"}  # (replaced; a string, as below)
            continue
        # (a string: torch 2.13's code generation names a torch.device it cannot find)
        node.kwargs = {**node.kwargs, "device": "cpu"}
        with graph.inserting_after(node):
            moved = graph.call_method("to", (node, settings.device_type))
        node.replace_all_uses_with(moved, delete_user_cb=lambda user: user is not moved)
    copied.recompile()
    return copied


# ---------------------------------------------------------------- dynamic dimensions


def _user_input_sizes(exported: torch.export.ExportedProgram) -> list:
    """Per user input (flattened), the sizes torch.export recorded for it (SymInts where a
    dimension is dynamic), or None for an input that is not a tensor."""
    kinds = {spec.arg.name: spec.kind.name for spec in exported.graph_signature.input_specs if hasattr(spec.arg, "name")}
    sizes = []
    for node in exported.graph_module.graph.nodes:
        if node.op == "placeholder" and kinds.get(node.name) == "USER_INPUT":
            value = node.meta.get("val")
            sizes.append(tuple(value.shape) if isinstance(value, torch.Tensor) else None)
    return sizes


def _bounds(exported: torch.export.ExportedProgram, symbol: Any) -> tuple[int, Optional[int]]:
    """(lower, upper or None) of a symbol of the program, from its range constraints."""
    found = exported.range_constraints.get(symbol)
    if found is None:
        return 2, None  # (torch.export's default range for a dynamic dimension)
    from torch.utils._sympy.numbers import int_oo

    return int(found.lower), (None if found.upper in (int_oo, sympy.oo) else int(found.upper))


def _hint(size: Any, lower: int, upper: Optional[int]) -> int:
    """The example size torch.export traced a dynamic dimension at (its lower bound, at least 2,
    where a loaded program does not record it)."""
    hint = getattr(size.node, "hint", None)
    if hint is not None:
        return int(hint)
    return min(max(lower, 2), upper) if upper is not None else max(lower, 2)


def symbolic_input_types(exported: torch.export.ExportedProgram) -> list:
    """The program's user inputs (flattened) as `jax.ShapeDtypeStruct`s for `jax.export`: each
    dynamic dimension a dimension variable named after torch's symbol for it (`s77`), within the
    bounds of its range constraint (`s77 >= 2`); derived dimensions (`2*s77`) stay expressions."""
    from .dtypes import TORCH_TO_JAX

    sizes = _user_input_sizes(exported)
    symbols = {symbol for shape in sizes if shape for size in shape if isinstance(size, torch.SymInt) for symbol in size.node.expr.free_symbols}
    constraints = []
    for symbol in sorted(symbols, key=str):
        lower, upper = _bounds(exported, symbol)
        if lower > 1:
            constraints.append(f"{symbol} >= {lower}")
        if upper is not None:
            constraints.append(f"{symbol} <= {upper}")
    scope = jax.export.SymbolicScope(constraints)
    names = {symbol: str(symbol) for symbol in symbols}
    values = [node.meta["val"] for node in exported.graph_module.graph.nodes if node.op == "placeholder"]
    values = values[len(values) - len(sizes):] if sizes else []
    types = []
    for shape, value in zip(sizes, values):
        if shape is None:
            raise SymbolicShapeError(f"the program takes a {type(value).__name__} input; only tensor inputs can have symbolic shapes")
        text = ", ".join(str(size) if isinstance(size, int) else symbolic.jax_text(size.node.expr, names) for size in shape)
        types.append(jax.ShapeDtypeStruct(jax.export.symbolic_shape(f"({text},)" if text else "()", scope=scope), TORCH_TO_JAX[value.dtype]))
    return types


def _symbolic_sizes(exported: torch.export.ExportedProgram, recorded: list, arrays: list) -> Optional[symbolic.SymbolicSizes]:
    """The torch symbols for the dimension variables of the given inputs' shapes (None where
    every shape is concrete): each variable is matched to the dynamic dimension torch.export
    recorded at its place, for that dimension's example size and bounds."""
    shapes = [getattr(array, "shape", ()) for array in arrays]
    if not any(symbolic.is_symbolic(shape) for shape in shapes):
        return None
    dimensions, scope = {}, None
    for position, (shape, sizes) in enumerate(zip(shapes, recorded)):
        for axis, size in enumerate(shape):
            if isinstance(size, int):
                continue
            scope = size.scope
            name = str(size)
            torch_size = sizes[axis] if sizes is not None and axis < len(sizes) else None
            if not name.isidentifier() or name in dimensions:
                continue
            if not isinstance(torch_size, torch.SymInt) or not torch_size.node.expr.is_Symbol:
                raise SymbolicShapeError(
                    f"dimension {axis} of input {position} is the dimension variable {name}, where the program has "
                    f"{'the static size ' + str(torch_size) if isinstance(torch_size, int) else torch_size}: export the "
                    "program with that dimension dynamic (torch.export.Dim), or give the size it was exported for"
                )
            lower, upper = _bounds(exported, torch_size.node.expr)
            dimensions[name] = symbolic.Dimension(name, _hint(torch_size, lower, upper), lower, upper)
    return symbolic.SymbolicSizes(list(dimensions.values()), scope)


def _made_by_table(op: torch._ops.OpOverload) -> Callable:
    """`op` (a factory) as the bridge's dispatch runs it, its result on the bridge device."""
    from .dispatch import dispatch

    def made(*args, **kwargs):
        return dispatch(op, args, {**kwargs, "device": _META})  # (the table places its result)

    made.__name__ = made.__qualname__ = f"{op._opname}_on_bridge"
    return made


_META = torch.device("meta")


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


class _NodeInterpreter(torch.fx.Interpreter):
    """Runs the graph node by node: each node in a named scope (`scoped_by_node`), and, in a
    symbolic trace, each dimension torch fixes to a number or JAX cannot compute with charged to
    the node that did it."""

    def __init__(self, graph: torch.fx.GraphModule, sizes: Optional[symbolic.SymbolicSizes]):
        super().__init__(graph)
        self.sizes = sizes

    def run_node(self, node):
        scope = jax.named_scope(node.name) if _scope_nodes else contextlib.nullcontext()
        with scope:
            if self.sizes is None:
                return super().run_node(node)
            try:
                result = super().run_node(node)
            except _SYMBOLIC_FAILURES as error:
                dimensions = self.sizes.names_in(self._inputs(node))
                if not dimensions:
                    raise
                cause = " ".join(str(error).split("\n")[0].split())
                raise SymbolicShapeError(
                    f"node {node.name} ({_op_name(node)}) of the program cannot compute with the symbolic dimension"
                    f"{'s' if len(dimensions) > 1 else ''} {', '.join(dimensions)} of its inputs ({type(error).__name__}: {cause}). "
                    "Export the program with those dimensions static, or call the function with concrete shapes "
                    "(each new shape then traces again)."
                ) from error
            decision = self.sizes.new_decision()
            if decision is not None:
                raise SymbolicShapeError(
                    f"node {node.name} ({_op_name(node)}) of the program branches on its symbolic sizes: torch decided "
                    f"{decision} at the example sizes ({self.sizes.example()}), which does not hold for every size. "
                    "Export the program with those dimensions static, or call the function with concrete shapes "
                    "(each new shape then traces again)."
                )
            return result

    def _inputs(self, node: torch.fx.Node) -> list:
        return [self.env[arg] for arg in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(arg, torch.fx.Node) and arg in self.env]


# What a table entry or torch raises where a size it needs as a number is symbolic.
_SYMBOLIC_FAILURES = (jax.errors.InconclusiveDimensionOperation, jax.errors.ConcretizationTypeError, TypeError, SymbolicShapeError)


def _op_name(node: torch.fx.Node) -> str:
    return str(node.target) if node.op == "call_function" else f"{node.op} {node.target}"


def _run_graph(graph: torch.fx.GraphModule, tensors: list, sizes: Optional[symbolic.SymbolicSizes] = None) -> Any:
    if _scope_nodes or sizes is not None:
        return _NodeInterpreter(graph, sizes).run(*tensors)
    return graph(*tensors)


@contextlib.contextmanager
def _symbolic_trace(sizes: Optional[symbolic.SymbolicSizes]) -> Iterator[None]:
    """Within the block, bridge tensors take SymInt sizes for the trace's dimension variables.
    torch's meta kernels are not compared with the tables' results there (a signature of SymInts
    has no hash to key the comparison on)."""
    if sizes is None:
        yield
        return
    checking, settings.check_signatures = settings.check_signatures, False
    try:
        with symbolic.tracing(sizes):
            yield
    finally:
        settings.check_signatures = checking


def _output_value(value: Any, sizes: Optional[symbolic.SymbolicSizes]) -> Any:
    """A user output as the function returns it: a tensor's array; a size that stays symbolic
    (a SymInt, as `x.shape[0]` returned) as a 0-dim integer array."""
    if isinstance(value, BridgeTensor):
        return read_value(value)
    if isinstance(value, (torch.SymInt, torch.SymBool)) and sizes is not None:
        size = sizes.jax_value(value)
        return size if isinstance(size, (int, bool)) else jax.numpy.asarray(size)
    return value


def to_jax(exported: torch.export.ExportedProgram) -> tuple[Callable, dict]:
    """The program as a pure JAX function and its initial state (see the module's docstring)."""
    signature = _signature(exported)
    graph = _on_bridge_device(exported.graph_module)
    recorded = _user_input_sizes(exported)

    def function(state, *args, key=None, **kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        if signature.in_spec is not None and spec != signature.in_spec:
            raise TypeError(f"the program was exported for arguments shaped as {signature.in_spec}, not {spec}")
        sizes = _symbolic_sizes(exported, recorded, flat)
        with graph_trace(key), _symbolic_trace(sizes):
            tensors = []
            for source, which in signature.placeholders:
                value = state[which] if source == "state" else flat[which]
                tensors.append(BridgeTensor(value, 0) if isinstance(value, jax.Array) else value)
            given = [tensor._value if isinstance(tensor, BridgeTensor) else None for tensor in tensors]
            outputs = _run_graph(graph, tensors, sizes)
        returned = [(place, _output_value(outputs[position], sizes)) for position, place in signature.mutations]
        outputs = [outputs[position] for position in signature.user_outputs]
        arrays = [_output_value(out, sizes) for out in outputs]
        new_state, new_inputs = dict(state), [None] * len(flat)
        for (source, which), value in list(zip(signature.placeholders, written(tensors, given))) + returned:
            if value is None:
                continue
            if source == "state":
                new_state[which] = value
            else:
                new_inputs[which] = value
        return pytree.tree_unflatten(arrays, signature.out_spec), new_state, new_inputs

    return function, initial_state(exported)
