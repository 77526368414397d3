"""ONNX models to JAX: an ONNX graph as one pure JAX function over its initializers, and the
registry that op_mappings/onnx_ops*.py fill with one entry per ONNX op type.

    function, state = to_jax(model, ONNX_OPS)       # onnx.ModelProto; the table as an argument
    outputs = function(state, *inputs, key=None)    # a tuple, one array per graph output

`state` maps the names of the model's floating-point initializers (its weights) to arrays; integer
and boolean initializers (shapes, axes, indices) are constants of the function, known while it is
traced, so that a Reshape to a stored shape needs no value from the device. Nodes whose inputs are
all known while tracing (Shape, Constant, those constants and what is computed from them) are
computed then, as NumPy arrays: the shape arithmetic torch.onnx.export writes never reaches XLA.
The onnx package (the `onnx` extra) is imported only where a model is read.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .errors import BridgeWarning, DataDependentShapeError, SavedModelError, UnsupportedOnnxOpError, UnsupportedOpsetError

# The ai.onnx opsets the table is written for: before 7, binary ops broadcast only with a
# `broadcast` attribute and several ops had other attributes.
MIN_OPSET = 7
DEFAULT_DOMAINS = ("", "ai.onnx")

# TensorProto.DataType codes (fixed by the ONNX standard) to NumPy dtypes.
ONNX_DTYPES: dict[int, Any] = {
    1: np.dtype(np.float32),
    2: np.dtype(np.uint8),
    3: np.dtype(np.int8),
    4: np.dtype(np.uint16),
    5: np.dtype(np.int16),
    6: np.dtype(np.int32),
    7: np.dtype(np.int64),
    8: np.dtype(object),  # strings
    9: np.dtype(np.bool_),
    10: np.dtype(np.float16),
    11: np.dtype(np.float64),
    12: np.dtype(np.uint32),
    13: np.dtype(np.uint64),
    14: np.dtype(np.complex64),
    15: np.dtype(np.complex128),
    16: np.dtype(ml_dtypes.bfloat16),
    17: np.dtype(ml_dtypes.float8_e4m3fn),
    18: np.dtype(ml_dtypes.float8_e4m3fnuz),
    19: np.dtype(ml_dtypes.float8_e5m2),
    20: np.dtype(ml_dtypes.float8_e5m2fnuz),
    21: np.dtype(ml_dtypes.uint4),
    22: np.dtype(ml_dtypes.int4),
    23: np.dtype(ml_dtypes.float4_e2m1fn),
    24: np.dtype(ml_dtypes.float8_e8m0fnu),
}


def onnx_dtype(code: int) -> Any:
    """The NumPy dtype of an ONNX element type code (Cast's `to`, a tensor's data_type)."""
    if code not in ONNX_DTYPES:
        raise NotImplementedError(f"ONNX element type {code} has no JAX dtype")
    return ONNX_DTYPES[code]


# ------------------------------------------------------------------------------------ registry


@dataclasses.dataclass(frozen=True)
class OnnxOp:
    """One ONNX op's entry: a pure jnp/lax function of the node's inputs (positional, None for an
    omitted optional input) and attributes (keywords), returning an array or a tuple of them."""

    op_type: str
    domain: str
    body: Callable
    family: str
    takes_opset: bool  # the body reads `opset=` (semantics that changed between opsets)
    rng: bool  # the body draws random numbers from `key=`; never computed while tracing
    takes_outputs: bool  # the body reads `outputs=`, how many outputs the node names (Split)
    # The node's attributes the body does not read, with the reason (ignored rather than refused).
    ignores: tuple[str, ...] = ()


class OnnxTable(dict):
    """{(domain, op type): OnnxOp}, filled by the `register_onnx_op` decorators of op_mappings."""

    def lookup(self, domain: str, op_type: str) -> Optional[OnnxOp]:
        return self.get(("" if domain in DEFAULT_DOMAINS else domain, op_type))


ONNX_OPS = OnnxTable()


def register_onnx_op(*op_types: str, domain: str = "", rng: bool = False, ignores: tuple[str, ...] = ()) -> Callable:
    """Declare the decorated function as the entry of the ONNX op types named (in `domain`)."""

    def decorate(body: Callable) -> Callable:
        parameters = inspect.signature(body).parameters
        family = body.__module__.rsplit(".", 1)[-1]
        for op_type in op_types:
            key = (domain, op_type)
            if key in ONNX_OPS:
                raise ValueError(f"ONNX op {domain or 'ai.onnx'}::{op_type} is registered twice")
            ONNX_OPS[key] = OnnxOp(op_type, domain, body, family, "opset" in parameters, rng, "outputs" in parameters, ignores)
        return body

    return decorate


# ------------------------------------------------------------------------- values for entries


def is_known(value: Any) -> bool:
    """Whether a value is known while tracing (NumPy, a Python value), not a traced array."""
    if isinstance(value, (list, tuple)):
        return all(is_known(item) for item in value)
    return value is None or isinstance(value, (np.ndarray, np.generic, int, float, bool, str, Subgraph))


def known(value: Any, what: str) -> np.ndarray:
    """A value an entry needs while tracing (a shape, axes, pads) as a NumPy array."""
    if isinstance(value, jax.core.Tracer):
        raise DataDependentShapeError(
            f"the {what} is computed from the graph's inputs, and XLA needs it before the graph runs"
        )
    return np.asarray(value)


def known_ints(value: Any, what: str) -> tuple[int, ...]:
    return tuple(int(item) for item in known(value, what).reshape(-1))


class Subgraph:
    """A graph attribute (If's branches, Loop's and Scan's bodies) as a function of its inputs,
    seeing the values of the scopes around it."""

    def __init__(self, graph: Any, scope: collections.ChainMap, context: "_Context"):
        self.graph, self.scope, self.context = graph, scope, context
        self.input_names = [value.name for value in graph.input]
        self.output_names = [value.name for value in graph.output]

    def __call__(self, *inputs: Any) -> list:
        scope = self.scope.new_child(dict(zip(self.input_names, inputs)))
        for tensor in self.graph.initializer:
            scope[tensor.name] = _tensor_value(tensor)
        _run_nodes(self.graph.node, scope, self.context)
        return [scope[name] for name in self.output_names]


# ------------------------------------------------------------------------------ the translator


@dataclasses.dataclass
class _Context:
    table: OnnxTable
    opsets: dict  # domain -> version
    functions: dict  # (domain, name) -> FunctionProto of the model's local functions
    source: str  # the file or "the model", for messages
    keys: list  # [key]: random entries split it


def _tensor_value(tensor: Any) -> np.ndarray:
    from onnx import numpy_helper

    array = numpy_helper.to_array(tensor)
    if array.dtype.kind in "SU":
        array = array.astype(object)
    return array


def _attribute_value(attribute: Any, scope: collections.ChainMap, context: _Context) -> Any:
    from onnx import AttributeProto, helper

    if attribute.type == AttributeProto.TENSOR:
        return _tensor_value(attribute.t)
    if attribute.type == AttributeProto.TENSORS:
        return [_tensor_value(tensor) for tensor in attribute.tensors]
    if attribute.type == AttributeProto.GRAPH:
        return Subgraph(attribute.g, scope, context)
    if attribute.type == AttributeProto.GRAPHS:
        return [Subgraph(graph, scope, context) for graph in attribute.graphs]
    if attribute.type == AttributeProto.SPARSE_TENSOR:
        raise NotImplementedError("sparse tensor attributes are not read yet")
    value = helper.get_attribute_value(attribute)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [item.decode("utf-8") for item in value]
    return value


def _describe(node: Any) -> str:
    domain = f"{node.domain}::" if node.domain not in DEFAULT_DOMAINS else ""
    return f"node {node.name or '(unnamed)'!r} ({domain}{node.op_type})"


def _as_numpy(value: Any) -> Any:
    if isinstance(value, jax.Array):
        return np.asarray(value)
    if isinstance(value, tuple):
        return tuple(_as_numpy(item) for item in value)
    if isinstance(value, list):
        return [_as_numpy(item) for item in value]
    return value


def _call_entry(entry: OnnxOp, node: Any, inputs: list, attributes: dict, context: _Context) -> Any:
    domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
    keywords = dict(attributes)
    for name in entry.ignores:
        keywords.pop(name, None)
    if entry.takes_opset:
        keywords["opset"] = context.opsets.get(domain, context.opsets.get("", 0))
    if entry.takes_outputs:
        keywords["outputs"] = len(node.output)
    if entry.rng:
        context.keys[0], keywords["key"] = jax.random.split(context.keys[0])
        return entry.body(*inputs, **keywords)
    if all(is_known(value) for value in inputs):
        # Shape arithmetic and constants: computed now, kept known for the entries that need them.
        with jax.ensure_compile_time_eval():
            return _as_numpy(entry.body(*inputs, **keywords))
    return entry.body(*inputs, **keywords)


def _function_body(node: Any, inputs: list, context: _Context) -> Any:
    """The FunctionProto that defines the node's op, where the model or the ONNX standard gives
    one (the standard defines Gelu, LayerNormalization, ... as functions of simpler ops)."""
    domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
    local = context.functions.get((node.domain, node.op_type))
    if local is not None:
        return local
    import onnx
    from onnx import defs

    opset = context.opsets.get(domain)
    if opset is None:
        return None
    try:
        schema = defs.get_schema(node.op_type, opset, domain)
    except Exception:  # noqa: BLE001 - an op the standard does not know: no body
        return None
    if schema.has_function:
        function = schema.get_function_with_opset_version(_function_version(schema.function_opset_versions, opset)) or schema.function_body
        if isinstance(function, bytes):
            function = onnx.FunctionProto.FromString(function)
        return function
    if schema.has_context_dependent_function:
        types = []
        for value in inputs:
            elem = 0
            if value is not None and hasattr(value, "dtype"):
                for code, dtype in ONNX_DTYPES.items():
                    if dtype == np.dtype(value.dtype):
                        elem = code
                        break
            types.append(onnx.helper.make_tensor_type_proto(elem, None).SerializeToString())
        try:
            version = _function_version(schema.context_dependent_function_opset_versions, opset)
            encoded = schema.get_context_dependent_function_with_opset_version(version, node.SerializeToString(), types)
        except Exception:  # noqa: BLE001 - no body for these input types
            return None
        function = onnx.FunctionProto()
        function.ParseFromString(encoded)
        return function if function.node else None
    return None


def _function_version(versions: Any, opset: int) -> int:
    """The opset of the standard's function body that holds at `opset`: the latest defined at or
    before it (SoftmaxCrossEntropyLoss's is defined at 13 and holds at 17; asked for 17 itself,
    the schema gives an empty body)."""
    return max((version for version in versions if version <= opset), default=opset)


def _run_function(function: Any, node: Any, inputs: list, attributes: dict, context: _Context) -> list:
    """A node whose op is defined as a function: its body run in a scope of its own."""
    from onnx import helper

    scope = collections.ChainMap({name: value for name, value in zip(function.input, inputs) if name})
    defaults = {attribute.name: _attribute_value(attribute, scope, context) for attribute in function.attribute_proto}
    given = {**defaults, **attributes}
    opsets = dict(context.opsets)
    opsets.update({("" if item.domain in DEFAULT_DOMAINS else item.domain): item.version for item in function.opset_import})
    inner = dataclasses.replace(context, opsets=opsets)
    body_nodes = []
    for body_node in function.node:
        copied = type(body_node)()
        copied.CopyFrom(body_node)
        del copied.attribute[:]
        for attribute in body_node.attribute:
            if attribute.ref_attr_name:
                if attribute.ref_attr_name not in given:
                    continue
                value = given[attribute.ref_attr_name]
                if isinstance(value, np.ndarray):
                    from onnx import numpy_helper

                    made = helper.make_attribute(attribute.name, numpy_helper.from_array(value))
                else:
                    made = helper.make_attribute(attribute.name, value)
                copied.attribute.append(made)
            else:
                copied.attribute.append(attribute)
        body_nodes.append(copied)
    _run_nodes(body_nodes, scope, inner)
    # (optional outputs the body does not make for these inputs stay absent)
    return tuple(scope.get(name) for name in function.output)


def _run_node(node: Any, scope: collections.ChainMap, context: _Context) -> None:
    inputs = [scope[name] if name else None for name in node.input]
    while inputs and inputs[-1] is None:  # trailing omitted optional inputs: the entry's defaults
        inputs.pop()
    attributes = {attribute.name: _attribute_value(attribute, scope, context) for attribute in node.attribute}
    entry = context.table.lookup(node.domain, node.op_type)
    try:
        if entry is not None:
            outputs = _call_entry(entry, node, inputs, attributes, context)
        else:
            function = _function_body(node, inputs, context)
            if function is None:
                raise UnsupportedOnnxOpError(
                    f"{context.source}: {_describe(node)} has no mapping in the bridge's ONNX table and no "
                    "function definition in the ONNX standard. Run `python -m bridge check FILE.onnx` to "
                    "list every such node, then export the model without that op (torch.onnx.export with "
                    "another opset_version), save it with torch.export for `bridge.load` of a .pt2, or "
                    "file an issue naming the op."
                )
            outputs = _run_function(function, node, inputs, attributes, context)
    except DataDependentShapeError as error:
        raise DataDependentShapeError(
            f"{context.source}: {_describe(node)}: {error}. Export the model with static shapes "
            "(no dynamic_shapes / dynamic_axes), or call the program's jax_function without jax.jit."
        ) from None
    if not isinstance(outputs, tuple):  # one output (a list is one ONNX sequence)
        outputs = (outputs,)
    for name, value in zip(node.output, outputs):
        if name:
            scope[name] = value


def _run_nodes(nodes: Any, scope: collections.ChainMap, context: _Context) -> None:
    for node in nodes:
        _run_node(node, scope, context)


def opsets_of(model: Any, source: str = "the model") -> dict:
    """{domain: version} of the model, after checking the ai.onnx opset is one the table serves."""
    import onnx

    opsets = {("" if item.domain in DEFAULT_DOMAINS else item.domain): item.version for item in model.opset_import}
    newest = onnx.defs.onnx_opset_version()
    version = opsets.get("", newest)
    if not MIN_OPSET <= version <= newest:
        raise UnsupportedOpsetError(
            f"{source}: the model uses ai.onnx opset {version}; the bridge reads opsets {MIN_OPSET} to {newest}. "
            f"Export it again with torch.onnx.export(..., opset_version={max(MIN_OPSET, min(version, 18))}) "
            "(or convert it with onnx.version_converter.convert_version)."
        )
    return opsets


def split_initializers(model: Any) -> tuple[dict, dict]:
    """(state, constants): floating-point initializers as jax arrays (the weights, a pytree for
    jax.grad and optimizers) and the others as NumPy arrays known while tracing."""
    state, constants = {}, {}
    for tensor in model.graph.initializer:
        array = _tensor_value(tensor)
        if array.dtype.kind in "fc" or array.dtype in (np.dtype(ml_dtypes.bfloat16),):
            state[tensor.name] = jnp.asarray(array)
        else:
            constants[tensor.name] = array
    return state, constants


def to_jax(model: Any, table: OnnxTable, source: str = "the model") -> tuple[Callable, dict]:
    """The model as a pure JAX function and its initial state (see the module's docstring)."""
    opsets = opsets_of(model, source)
    state, constants = split_initializers(model)
    initialized = {tensor.name for tensor in model.graph.initializer}
    # Old exporters list initializers among the inputs too: those are not the caller's.
    input_names = [value.name for value in model.graph.input if value.name not in initialized]
    output_names = [value.name for value in model.graph.output]
    functions = {(function.domain, function.name): function for function in model.functions}

    def function(state: dict, *inputs: Any, key: Any = None) -> tuple:
        if len(inputs) != len(input_names):
            raise TypeError(f"{source} takes {len(input_names)} input(s) ({', '.join(input_names)}), not {len(inputs)}")
        scope = collections.ChainMap({**constants, **state, **dict(zip(input_names, inputs))})
        context = _Context(table, opsets, functions, source, [jax.random.key(0) if key is None else key])
        _run_nodes(model.graph.node, scope, context)
        return tuple(_as_jax(scope[name]) for name in output_names)

    function.input_names = input_names  # type: ignore[attr-defined]
    function.output_names = output_names  # type: ignore[attr-defined]
    return function, state


def _as_jax(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_as_jax(item) for item in value]
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype != object:
        return jnp.asarray(value)
    return value


def read_model(path: str) -> Any:
    """An ONNX file as a ModelProto, or one SavedModelError naming the file and what to do."""
    try:
        import onnx
    except ImportError:
        raise SavedModelError(f"{path}: reading ONNX models needs the onnx package: pip install 'bridge[onnx]'") from None
    if not os.path.exists(path):
        raise SavedModelError(f"{path}: no such file (bridge.load reads .onnx files written by torch.onnx.export)")
    try:
        model = onnx.load(path)
    except Exception as error:  # noqa: BLE001 - protobuf's errors name no file
        raise SavedModelError(
            f"{path}: not a readable ONNX model ({type(error).__name__}: {error}); the file may be truncated "
            "or corrupt: export it again (torch.onnx.export) and check it with onnx.checker.check_model"
        ) from None
    if not model.graph.node and not model.graph.output:
        raise SavedModelError(f"{path}: the file parses as an ONNX model with an empty graph; it may be truncated or not an ONNX file: export it again")
    return model


def unmapped_nodes(model: Any, table: OnnxTable) -> dict:
    """{status: {op: node count}} for the model's nodes and those of its subgraphs: "mapped" (a
    table entry), "expanded" (defined by an ONNX function of mapped ops), "no mapping"."""
    import onnx

    opsets = {("" if item.domain in DEFAULT_DOMAINS else item.domain): item.version for item in model.opset_import}
    local = {(function.domain, function.name) for function in model.functions}
    counts: collections.Counter = collections.Counter()

    def walk(graph):
        for node in graph.node:
            counts[(node.domain, node.op_type)] += 1
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    walk(attribute.g)
                for graph_item in attribute.graphs:
                    walk(graph_item)

    walk(model.graph)
    statuses: dict = collections.defaultdict(dict)
    for (domain, op_type), count in counts.items():
        name = op_type if domain in DEFAULT_DOMAINS else f"{domain}::{op_type}"
        if table.lookup(domain, op_type) is not None:
            status = "mapped"
        elif (domain, op_type) in local:
            status = "model function (expanded)"
        else:
            try:
                schema = onnx.defs.get_schema(op_type, opsets.get("" if domain in DEFAULT_DOMAINS else domain, 1), "" if domain in DEFAULT_DOMAINS else domain)
                expandable = schema.has_function or schema.has_context_dependent_function
            except Exception:  # noqa: BLE001 - unknown to the standard
                expandable = False
            status = "ONNX function (expanded)" if expandable else "no mapping"
        statuses[status][name] = count
    return dict(statuses)


class OnnxProgram:
    """An ONNX model as one jitted JAX function over its weights; called with torch tensors, it
    returns bridge tensors (one per graph output; a tuple when there are several).

    `jax_function(state, *arrays, key=None)` and `state` (the floating-point initializers by
    name) are the same program for code that stays in JAX; `constants` holds the integer ones."""

    def __init__(self, source: Any, table: OnnxTable):
        if isinstance(source, (str, os.PathLike)):
            self.path = os.fspath(source)
            self.model = read_model(self.path)
        else:  # an onnx.ModelProto
            self.path, self.model = "the ONNX model", source
        self.jax_function, self.state = to_jax(self.model, table, self.path)
        self.input_names = self.jax_function.input_names
        self.output_names = self.jax_function.output_names
        self.constants = split_initializers(self.model)[1]
        self._compiled = jax.jit(self.jax_function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from . import random
        from .tensor import BridgeTensor, read_value, to_bridge

        missing = [name for name in self.input_names[len(args):] if name not in kwargs]
        unknown = set(kwargs) - set(self.input_names)
        if missing or unknown:
            raise TypeError(f"{self.path} takes inputs {self.input_names}; missing {missing}, unknown {sorted(unknown)}")
        values = list(args) + [kwargs[name] for name in self.input_names[len(args):]]
        arrays = []
        for value in values:
            if isinstance(value, BridgeTensor):
                arrays.append(read_value(value))
            elif hasattr(value, "detach"):  # a host torch tensor
                arrays.append(read_value(to_bridge(value)))
            else:
                arrays.append(jnp.asarray(value))
        key = random.next_key()
        if self._compiled is not None:
            try:
                outputs = self._compiled(self.state, *arrays, key=key)
            except DataDependentShapeError as error:
                # A shape that comes from the data (NonZero, a computed Reshape): no static
                # program holds it, so the graph runs node by node from now on, said once.
                warnings.warn(f"{error} It runs node by node (eager JAX) instead of as one XLA program.", BridgeWarning, stacklevel=2)
                self._compiled = None
        if self._compiled is None:
            outputs = self.jax_function(self.state, *arrays, key=key)
        wrapped = tuple(BridgeTensor(value, 0) if isinstance(value, jax.Array) else value for value in outputs)
        return wrapped[0] if len(wrapped) == 1 else wrapped

    def state_dict(self) -> dict:
        """The weights as torch CPU tensors, by initializer name."""
        from .tensor import numpy_to_torch

        return {name: numpy_to_torch(np.array(value)) for name, value in self.state.items()}
