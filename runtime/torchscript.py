"""TorchScript to JAX: a ScriptModule's or ScriptFunction's graph (from `torch.jit.trace`,
`torch.jit.script` or `torch.jit.load`) as one pure JAX function, through the same tables as eager mode.

The graph (its method calls inlined) is compiled once into steps, then run under a JAX trace on
bridge tensors holding tracers: each ATen node calls the `torch.ops.aten` overload its schema
names, so it reaches the bridge's dispatch as a script's call does (the same tables, decompositions,
view and in-place rules). TorchScript's own nodes (`prim::` constants, lists, tuples, attributes,
`If`, `Loop`) and its builtins on Python numbers, lists and dicts run as Python. The module's
parameters and buffers, which the graph reaches through `prim::GetAttr` chains, are the function's
state, passed in as graph values rather than swapped into the module (a RecursiveScriptModule
refuses a parameter swap). What the graph writes in place comes back, as for torch.export programs
(runtime/export.py, whose trace and write detection this shares).

    function, state = to_jax(scripted)
    outputs, new_state, new_inputs = function(state, *args)

`state` maps the module's parameter and buffer names (`named_parameters`, `named_buffers`, and any
other tensor attribute the graph reads) to arrays; `new_state` is `state` with what the graph wrote
replaced; `new_inputs` has, for each tensor leaf of the arguments, its new value where the graph
wrote it, else None. Jit-able and differentiable over `state`; `key=` seeds the graph's random ops.

Control flow: an `If` on a Python value (`self.training`, a shape) takes its branch while tracing;
an `If` on a tensor's value becomes `jax.lax.cond` with both branches traced (their tensor results
must agree in shape and dtype); a `Loop` whose trip count and condition are Python values runs
unrolled; a loop on a tensor's value, and any other use of a tensor's value as a Python number,
cannot be traced and raises TranslationError naming the node.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils import _pytree as pytree

from .errors import BridgeError, SavedModelError, TranslationError
from .export import arrays_of, graph_trace, written
from .tensor import BridgeTensor, read_value, root_of, to_bridge

# Statuses of `bridge check` for what is not an ATen op of the dispatcher.
INTERPRETED = "TorchScript (interpreted as Python)"
NO_TRANSLATION = "no translation"

# TorchScript builtins that turn a tensor into a Python number: under a trace the value is unknown.
_TO_NUMBER = {"aten::Int", "aten::Float", "aten::item", "aten::ScalarImplicit", "aten::IntImplicit", "aten::FloatImplicit"}


# ---------------------------------------------------------------- reading archives


def load(path: str) -> torch.jit.ScriptModule:
    """The TorchScript archive at `path` (from `torch.jit.save`), read on the host; SavedModelError
    naming the file when it is missing, truncated or not a TorchScript archive."""
    if not os.path.exists(path):
        raise SavedModelError(f"{path}: no such file. Pass the path of a TorchScript archive written by torch.jit.save.")
    try:
        return torch.jit.load(path, map_location="cpu")
    except Exception as error:  # noqa: BLE001 - torch's reader raises RuntimeError and ValueError alike
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if "constants.pkl" in first or "code/" in first:
            why = "it is a zip archive but not a TorchScript one (a torch.save checkpoint holds weights, not a program)"
            what = ("build the model in Python, load the checkpoint into it with load_state_dict, and run the script "
                    "under the bridge, or save a program with torch.jit.save or torch.export.save")
        else:
            why = "torch cannot read it: the file is truncated or corrupt"
            what = "write it again with torch.jit.save (and check that the copy is complete)"
        raise SavedModelError(f"{path}: not a readable TorchScript archive; {why} (torch says: {first[:200]}). "
                              f"To run it: {what}.") from None


# ---------------------------------------------------------------- describing nodes


def where(node: torch._C.Node) -> str:
    """The node's source line as TorchScript recorded it (a scripted module's line, or a traced
    module's innermost Python frame), or '' when it kept none."""
    lines = [line for line in node.sourceRange().splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].lstrip().startswith("File") and len(lines) > 1:
        return f"{lines[0].strip()}: {lines[1].strip()}"
    return lines[0].strip()


def describe(node: torch._C.Node, source: Optional[str] = None) -> str:
    schema = node.schema()
    text = node.kind() if schema == "(no schema)" else schema.split("(")[0]
    site = where(node)
    return (f"{source}: " if source else "") + f"node {text}" + (f" ({site})" if site else "")


class _Untranslatable(Exception):
    """Compile-time: a node has no translation (the reason, without the node)."""


class _DataDependent(Exception):
    """Run-time: a tensor's value is needed as a Python value, which a trace does not have."""


# ---------------------------------------------------------------- values the interpreter passes


@dataclasses.dataclass(frozen=True)
class _Module:
    """A module of the scripted model, by its dotted path ('' for the root)."""

    path: str


@dataclasses.dataclass(frozen=True)
class _Condition:
    """`bool(tensor)` of a tensor the trace has no value for: prim::If turns it into jax.lax.cond."""

    tensor: torch.Tensor
    negated: bool = False

    def __bool__(self):
        raise _DataDependent("a tensor's value decides a Python condition here, other than an `if` on it")


# ---------------------------------------------------------------- the compiled graph


@dataclasses.dataclass
class _Step:
    node: torch._C.Node
    run: Callable  # run(frame, step, inputs) -> list of the node's outputs
    inputs: tuple
    outputs: tuple
    blocks: tuple = ()
    detail: Any = None  # per kind: the overload, the constant, the attribute's name, ...


@dataclasses.dataclass
class _Block:
    steps: list
    inputs: tuple
    outputs: tuple


def _ids(values) -> tuple:
    return tuple(value.unique() for value in values)


def _is_tensor_type(type_text: str) -> bool:
    return type_text in ("Tensor", "Optional[Tensor]", "List[Tensor]", "List[Optional[Tensor]]")


@dataclasses.dataclass
class _Operator:
    overload: Any
    keywords: tuple  # names of the keyword-only arguments, in schema order, after the positional ones
    positional: int
    returns: int
    factory: bool  # no tensor among the arguments, a tensor returned: made on the host, then moved
    devices: tuple  # positions of Device arguments
    optional_devices: tuple  # of those, the ones that may be None


def _operator(node: torch._C.Node) -> _Operator:
    schema_text = node.schema()
    if schema_text == "(no schema)":
        raise _Untranslatable("TorchScript gives it no operator schema")
    schema = torch._C.parse_schema(schema_text)
    namespace, name = schema.name.split("::")
    try:
        overload = getattr(getattr(getattr(torch.ops, namespace), name), schema.overload_name or "default")
    except (AttributeError, RuntimeError):
        raise _Untranslatable(f"torch.ops has no {schema.name}.{schema.overload_name or 'default'}") from None
    types = [str(argument.type) for argument in schema.arguments]
    tensors_in = any(_is_tensor_type(text) for text in types)
    tensor_out = any("Tensor" in str(returned.type) for returned in schema.returns)
    keywords = tuple(argument.name for argument in schema.arguments if argument.kwarg_only)
    return _Operator(
        overload=overload,
        keywords=keywords,
        positional=len(schema.arguments) - len(keywords),
        returns=len(schema.returns),
        factory=tensor_out and not tensors_in,
        devices=tuple(position for position, text in enumerate(types) if text in ("Device", "Optional[Device]")),
        optional_devices=tuple(position for position, text in enumerate(types) if text == "Optional[Device]"),
    )


class _Compiler:
    """Turns a graph's nodes into steps, resolving every module attribute statically (the module's
    structure is fixed). With `collect`, a node without translation is recorded in `problems`
    instead of raised, and compilation goes on (for `bridge check`)."""

    def __init__(self, module: Optional[torch.nn.Module], source: Optional[str], collect: bool = False):
        self.module = module
        self.source = source
        self.collect = collect
        self.problems: list = []  # (node, reason)
        self.modules: dict = {}  # value id -> _Module, known while compiling
        self.tensor_attributes: dict = {}  # dotted name -> host tensor, for every tensor attribute read
        self.tensor_names: dict = {}  # id of a parameter or buffer -> its name
        if isinstance(module, torch.jit.ScriptModule):
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                self.tensor_names.setdefault(id(tensor), name)

    def block(self, block, inputs=None) -> _Block:
        steps = [self.step(node) for node in block.nodes()]
        return _Block([step for step in steps if step is not None], _ids(inputs if inputs is not None else block.inputs()), _ids(block.outputs()))

    def step(self, node) -> Optional[_Step]:
        try:
            run, detail = self._translation(node)
        except _Untranslatable as reason:
            if not self.collect:
                raise TranslationError(
                    f"{describe(node, self.source)} has no translation to the bridge: {reason}. "
                    "Rewrite that part of the model without it (or export it with torch.export, whose "
                    "graph the bridge reads too), or file an issue with this message."
                ) from None
            self.problems.append((node, str(reason)))
            return None
        blocks = tuple(self.block(block) for block in node.blocks())
        return _Step(node, run, _ids(node.inputs()), _ids(node.outputs()), blocks, detail)

    def _translation(self, node) -> tuple[Callable, Any]:
        kind = node.kind()
        if kind == "prim::Constant":
            return _constant, _constant_value(node)
        if kind == "prim::GetAttr":
            return self._get_attribute(node)
        if kind == "prim::SetAttr":
            return self._set_attribute(node)
        if kind in _PRIM:
            return _PRIM[kind], None
        if kind == "prim::ConstantChunk":
            return _constant_chunk, (node.i("chunks"), node.i("dim"))
        if kind == "prim::TupleSlice":
            return _tuple_slice, (node.i("beg"), node.i("end"))
        if kind == "prim::PythonOp":
            owner = getattr(node.pyobj(), "__self__", None)
            name = f"{owner.__name__}.{node.pyname()}" if isinstance(owner, type) else node.pyname()
            raise _Untranslatable(
                f"a Python function called from the traced code ({name}: a torch.autograd.Function "
                "or a @torch.jit.ignore'd function) has no graph to translate")
        if kind == "prim::CreateObject":
            raise _Untranslatable("it makes an instance of a TorchScript class; the bridge translates tensors, "
                                  "numbers, strings, lists, tuples and dicts, not objects")
        if kind in ("prim::CallMethod", "prim::CallFunction"):
            raise _Untranslatable("a call TorchScript could not inline (an interface, a recursive or a Python call)")
        if kind in _TO_NUMBER:
            return _to_number, _operator(node)
        if kind == "aten::Bool":
            return _to_bool, _operator(node)
        if kind == "aten::__not__":
            return _not, None
        if kind in _IDENTITY:
            return _container, _IDENTITY[kind]
        first = next(iter(node.inputs()), None)
        if kind in _CONTAINERS and (first is None or str(first.type()) not in ("Tensor", "Optional[Tensor]")):
            return _container, _CONTAINERS[kind]
        if kind in _REPLACED:
            overload, count = _REPLACED[kind]
            return _replaced, (overload, count)
        if kind in ("aten::to", "aten::cuda", "aten::cpu"):
            return _to, _operator(node)
        if kind.startswith("prim::") and node.schema() == "(no schema)":
            raise _Untranslatable("TorchScript's interpreter runs it, and the bridge has no Python rule for it")
        return _call, _operator(node)

    def _get_attribute(self, node):
        owner = self.modules.get(node.input().unique())
        if owner is None:
            raise _Untranslatable("an attribute of an object that is not one of the model's modules")
        name = node.s("name")
        path = f"{owner.path}.{name}" if owner.path else name
        value = getattr(self._submodule(owner.path), name)
        if isinstance(value, torch.nn.Module):
            self.modules[node.output().unique()] = _Module(path)
            return _constant, _Module(path)
        if isinstance(value, torch.Tensor):
            self.tensor_attributes[path] = value
            return _read_attribute, path
        if isinstance(value, (list, tuple)) and any(isinstance(leaf, torch.Tensor) for leaf in value):
            # (an LSTM's _flat_weights: its parameters, by their own names)
            names = []
            for index, item in enumerate(value):
                if not isinstance(item, torch.Tensor):
                    raise _Untranslatable(f"the attribute {path} mixes tensors and other values")
                name = self.tensor_names.get(id(item), f"{path}.{index}")
                self.tensor_attributes.setdefault(name, item)
                names.append(name)
            return _read_attributes, (type(value), tuple(names))
        if isinstance(value, dict) and any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value)):
            raise _Untranslatable(f"the attribute {path} holds tensors inside a dict")
        return _constant, value  # a flag (`training`), a number, a string: fixed when the model was scripted

    def _submodule(self, path):
        module = self.module  # (a ScriptModule has no get_submodule)
        for name in path.split(".") if path else ():
            module = getattr(module, name)
        return module

    def _set_attribute(self, node):
        owner = self.modules.get(list(node.inputs())[0].unique())
        name = node.s("name")
        if owner is None:
            raise _Untranslatable("an attribute written on an object that is not one of the model's modules")
        path = f"{owner.path}.{name}" if owner.path else name
        value = getattr(self._submodule(owner.path), name)
        if not isinstance(value, torch.Tensor):
            raise _Untranslatable(f"it writes the module attribute {path}, which is not a tensor (a Python value the model keeps)")
        self.tensor_attributes[path] = value
        return _write_attribute, path


def _constant_value(node):
    output = node.output()
    if str(output.type()).startswith("Function"):
        raise _Untranslatable("a function used as a value")
    return output.toIValue()


# ---------------------------------------------------------------- running the steps


class _Frame:
    """One run of the graph: the values of its nodes and the state tensors."""

    def __init__(self, attributes: dict, source: Optional[str]):
        self.values: dict = {}
        self.attributes = attributes  # dotted name -> bridge tensor (replaced by prim::SetAttr)
        self.source = source
        self.grad_enabled = torch.is_grad_enabled()
        self.requiring_grad: set = set()  # ids of the state's bridge tensors whose parameter requires a gradient

    def run(self, block: _Block, inputs: list) -> list:
        values = self.values
        for value_id, value in zip(block.inputs, inputs):
            values[value_id] = value
        for step in block.steps:
            arguments = [values[value_id] for value_id in step.inputs]
            try:
                results = step.run(self, step, arguments)
            except BridgeError:
                raise
            except (_DataDependent, jax.errors.ConcretizationTypeError) as error:
                raise TranslationError(
                    f"{describe(step.node, self.source)} needs a tensor's value as a Python value, which a "
                    f"trace does not have ({_first_line(error)}). An `if` on a tensor becomes jax.lax.cond; a "
                    "loop on one, a size computed from one, or .item() cannot be traced: compute it from shapes, "
                    "or run that part outside the model."
                ) from None
            except jax.errors.TracerArrayConversionError:
                raise TranslationError(
                    f"{describe(step.node, self.source)}: the bridge's tables have no entry for this op (or one it "
                    "decomposes into), so it would run with eager torch on the host CPU, which cannot happen inside "
                    "one XLA program. `python -m bridge check` lists such ops; file an issue naming the op."
                ) from None
            except Exception as error:
                if not getattr(error, "_bridge_node_noted", False):
                    error.add_note(f"(in the TorchScript graph at {describe(step.node, self.source)})")
                    error._bridge_node_noted = True
                raise
            for value_id, result in zip(step.outputs, results):
                values[value_id] = result
        return [values[value_id] for value_id in block.outputs]


def _first_line(error) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:160] if text else type(error).__name__


def _single(step, result) -> list:
    count = len(step.outputs)
    if count == 0:
        return []
    if count == 1:
        return [result]
    return list(result)


def _constant(frame, step, inputs):
    value = step.detail
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        # A 0-dim constant stays on the host, as torch lets it meet tensors of any device: a
        # traced model computes sizes with such constants and reads them back with aten::Int.
        return [value.clone()]
    if isinstance(value, torch.Tensor):
        # A tensor the trace recorded as a constant: on the bridge device, made anew each run
        # (ops may write to it).
        return [to_bridge(value)]
    if isinstance(value, list):
        return [list(value)]  # (a list constant that the graph may append to)
    return [value]


def _read_attribute(frame, step, inputs):
    return [frame.attributes[step.detail]]


def _read_attributes(frame, step, inputs):
    kind, names = step.detail
    return [kind(frame.attributes[name] for name in names)]


def _write_attribute(frame, step, inputs):
    frame.attributes[step.detail] = _on_device(inputs[1])
    return []


def _on_device(value):
    return to_bridge(value) if isinstance(value, torch.Tensor) and not isinstance(value, BridgeTensor) else value


def _call(frame, step, inputs):
    operator: _Operator = step.detail
    inputs = list(inputs)
    if operator.factory:
        # ATen factories take no bridge tensor to dispatch on: made on the host, then moved, as
        # runtime/export.py does for an exported graph's factories.
        for position in operator.devices:
            inputs[position] = "cpu"
        result = operator.overload(*inputs[: operator.positional], **dict(zip(operator.keywords, inputs[operator.positional:])))
        return _single(step, pytree.tree_map(_on_device, result))
    for position in operator.optional_devices:
        inputs[position] = None  # stays on its input's device (the device the model was traced on is not the bridge's)
    result = operator.overload(*inputs[: operator.positional], **dict(zip(operator.keywords, inputs[operator.positional:])))
    return _single(step, result)


def _to(frame, step, inputs):
    """`x.to(...)`, `.cuda()`, `.cpu()`: the dtype and copy are kept, the device is not (the
    model's tensors live on the bridge device; a host scalar stays where it is)."""
    operator: _Operator = step.detail
    tensor = inputs[0]
    arguments = dict(zip([argument.name for argument in operator.overload._schema.arguments], inputs))
    dtype = arguments.get("dtype")
    if isinstance(arguments.get("other"), torch.Tensor):
        dtype = arguments["other"].dtype
    if dtype is not None and dtype != tensor.dtype:
        return [torch.ops.aten._to_copy.default(tensor, dtype=dtype if isinstance(dtype, torch.dtype) else _DTYPES[dtype])]
    if arguments.get("copy"):
        return [torch.ops.aten.clone.default(tensor)]
    return [tensor]


def _to_number(frame, step, inputs):
    value = inputs[0]
    if isinstance(value, BridgeTensor):
        array = read_value(value)
        if isinstance(array, jax.core.Tracer):
            raise _DataDependent("the tensor's value is known only when the program runs")
        value = torch.from_numpy(np.asarray(array).copy())
    return _single(step, step.detail.overload(value, *inputs[1:]))


def _to_bool(frame, step, inputs):
    value = inputs[0]
    if isinstance(value, BridgeTensor) and isinstance(read_value(value), jax.core.Tracer):
        return [_Condition(value)]
    return _to_number(frame, step, inputs)


def _not(frame, step, inputs):
    value = inputs[0]
    if isinstance(value, _Condition):
        return [dataclasses.replace(value, negated=not value.negated)]
    return [not value]


def _container(frame, step, inputs):
    return _single(step, step.detail(*inputs))


def _constant_chunk(frame, step, inputs):
    chunks, dim = step.detail
    return list(torch.ops.aten.chunk.default(inputs[0], chunks, dim))


def _tuple_slice(frame, step, inputs):
    begin, end = step.detail
    return [tuple(inputs[0][begin:end])]


def _list_unpack(frame, step, inputs):
    values = list(inputs[0])
    if len(values) != len(step.outputs):
        raise ValueError(f"expected {len(step.outputs)} values to unpack, got {len(values)}")
    return values


def _raise(frame, step, inputs):
    raise _ScriptRaised(inputs[0] if inputs else "Exception", step)


class _ScriptRaised(Exception):
    """The model's own `raise` (prim::RaiseException), reached while tracing."""

    def __init__(self, message, step):
        super().__init__(f"the model raised: {message}")
        self.step = step


def _if(frame, step, inputs):
    condition = inputs[0]
    then_block, else_block = step.blocks
    if not isinstance(condition, _Condition):
        return frame.run(then_block if condition else else_block, [])
    return _conditional(frame, step, condition)


def _conditional(frame, step, condition: _Condition):
    """An `if` on a tensor's value: jax.lax.cond, both branches traced. A branch that raises (the
    model's own check) is dropped: the program takes the other, as torch does whenever it does not
    raise."""
    predicate = read_value(condition.tensor if isinstance(condition.tensor, BridgeTensor) else to_bridge(condition.tensor))
    predicate = (predicate if predicate.dtype == jnp.bool_ else predicate != 0).reshape(())
    if condition.negated:
        predicate = jnp.logical_not(predicate)
    roots = {id(root_of(tensor)): root_of(tensor) for tensor in _bridge_tensors(frame)}
    generations = {key: root._generation for key, root in roots.items()}
    fixed: list = [None, None]  # per branch: its results that are not tensors
    raised: list = [None, None]

    def branch(which, block):
        def run(_):
            try:
                results = frame.run(block, [])
            except _ScriptRaised as error:
                raised[which] = error
                return None
            fixed[which] = [None if isinstance(result, torch.Tensor) else result for result in results]
            return [read_value(_on_device(result)) if isinstance(result, torch.Tensor) else None for result in results]

        return run

    then_run, else_run = branch(0, step.blocks[0]), branch(1, step.blocks[1])
    # A trial trace of each branch finds a raise before jax.lax.cond compares their results.
    jax.eval_shape(then_run, None), jax.eval_shape(else_run, None)
    if any(root._generation != generations[key] for key, root in roots.items()):
        raise TranslationError(
            f"{describe(step.node, frame.source)}: a branch of an `if` on a tensor's value writes a tensor of the "
            "enclosing graph in place, which jax.lax.cond cannot express. Write the result as the branch's value "
            "(`x = torch.where(...)`) instead."
        )
    if raised[0] is not None and raised[1] is not None:
        raise TranslationError(f"{describe(step.node, frame.source)}: both branches of an `if` on a tensor's value raise ({raised[0]})")
    if raised[0] is not None or raised[1] is not None:
        return frame.run(step.blocks[1 if raised[0] is not None else 0], [])
    if fixed[0] != fixed[1]:
        raise TranslationError(
            f"{describe(step.node, frame.source)}: the branches of an `if` on a tensor's value give different "
            f"Python values ({fixed[0]} and {fixed[1]}); only tensors can differ between them."
        )
    try:
        arrays = jax.lax.cond(predicate, then_run, else_run, None)
    except TypeError as error:
        raise TranslationError(
            f"{describe(step.node, frame.source)}: the branches of an `if` on a tensor's value give tensors of "
            f"different shapes or dtypes ({_first_line(error)}); jax.lax.cond needs them alike."
        ) from None
    return [BridgeTensor(array, 0) if array is not None else value for array, value in zip(arrays, fixed[0])]


def _bridge_tensors(frame):
    for value in list(frame.values.values()) + list(frame.attributes.values()):
        if isinstance(value, BridgeTensor):
            yield value


def _loop(frame, step, inputs):
    trip_count, condition, *carried = inputs
    (body,) = step.blocks
    iteration = 0
    while True:
        if isinstance(condition, _Condition):
            raise _DataDependent("a loop runs while a tensor's value holds")
        if not condition or iteration >= trip_count:
            return carried
        results = frame.run(body, [iteration, *carried])
        condition, carried = results[0], results[1:]
        iteration += 1


def _num_to_tensor(frame, step, inputs):
    # A Python number as a 0-dim tensor (a traced model's sizes): kept on the host, so that the
    # aten::Int that usually follows reads it back without a trace's unknown values.
    return [torch.tensor(inputs[0])]


_PRIM = {
    "prim::ListConstruct": lambda frame, step, inputs: [list(inputs)],
    "prim::TupleConstruct": lambda frame, step, inputs: [tuple(inputs)],
    "prim::DictConstruct": lambda frame, step, inputs: [dict(zip(inputs[0::2], inputs[1::2]))],
    "prim::ListUnpack": _list_unpack,
    "prim::TupleUnpack": _list_unpack,
    "prim::TupleIndex": lambda frame, step, inputs: [inputs[0][inputs[1]]],
    "prim::NumToTensor": _num_to_tensor,
    "prim::If": _if,
    "prim::Loop": _loop,
    "prim::RaiseException": _raise,
    "prim::Uninitialized": lambda frame, step, inputs: [None],
    "prim::unchecked_cast": lambda frame, step, inputs: [inputs[0]],
    "prim::Print": lambda frame, step, inputs: [print(*inputs)][:0],
    "prim::device": lambda frame, step, inputs: [inputs[0].device],
    "prim::dtype": lambda frame, step, inputs: [_DTYPE_CODES[inputs[0].dtype]],
    "prim::data": lambda frame, step, inputs: [inputs[0].detach()],
    # What the model asks of autograd (nn.TransformerEncoderLayer takes a fused path only when
    # nothing needs a gradient) is answered as torch would answer the caller: autograd is off
    # inside the trace only because JAX differentiates the function.
    "prim::requires_grad": lambda frame, step, inputs: [frame.grad_enabled and id(inputs[0]) in frame.requiring_grad],
    "aten::is_grad_enabled": lambda frame, step, inputs: [frame.grad_enabled],
    "prim::shape": lambda frame, step, inputs: [list(inputs[0].shape)],
}


def _append(container, value):
    container.append(value)
    return container


def _set_item(container, index, value):
    container[index] = value
    return container


def _warn(message, *ignored):
    warnings.warn(message, stacklevel=2)


# TorchScript's builtins on lists, dicts and strings, as Python (torch.ops would copy a list the
# graph then appends to).
_CONTAINERS = {
    "aten::__getitem__": lambda container, index: container[index],
    "aten::len": len,
    "aten::append": _append,
    "aten::_set_item": _set_item,
    "aten::insert": lambda container, index, value: container.insert(index, value),
    "aten::pop": lambda container, *key: container.pop(*key),
    "aten::extend": lambda container, other: container.extend(other),
    "aten::clear": lambda container: container.clear(),
    "aten::copy": lambda container: type(container)(container),
    "aten::list": list,
    "aten::slice": lambda container, start=None, end=None, step=1: container[start:end:step],
    # (on lists, torch.ops cannot tell the element type of a generic `t[]`; on numbers, the same)
    "aten::add": lambda first, second: first + second,
    "aten::mul": lambda first, second: first * second,
    "aten::eq": lambda first, second: first == second,
    "aten::ne": lambda first, second: first != second,
    "aten::__contains__": lambda container, key: key in container,
    "aten::keys": lambda container: list(container.keys()),
    "aten::values": lambda container: list(container.values()),
    "aten::items": lambda container: list(container.items()),
    "aten::format": lambda text, *values: text.format(*values),
    "aten::str": str,
    "aten::warn": _warn,
}


# `x is None` and its kin, on any value (torch.ops would refuse a None first argument).
_IDENTITY = {
    "aten::__is__": lambda first, second: first is second,
    "aten::__isnot__": lambda first, second: first is not second,
}

# Ops that torch.jit.trace records and today's ATen spells otherwise: the first `count`
# arguments go to `overload` (the others are cuDNN and benchmarking flags).
_REPLACED = {
    "aten::_convolution": (torch.ops.aten.convolution.default, 9),
}


def _replaced(frame, step, inputs):
    overload, count = step.detail
    return [overload(*inputs[:count])]


def _dtype_codes() -> dict:
    """torch.dtype -> TorchScript's ScalarType number (prim::dtype gives numbers; constants are numbers)."""
    codes = {}
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
                  torch.float64, torch.complex64, torch.complex128, torch.bool, torch.bfloat16):
        codes[dtype] = torch.ops.prim.dtype(torch.empty(0, dtype=dtype))
    return codes


_DTYPE_CODES = _dtype_codes()
_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


# ---------------------------------------------------------------- the whole function


@dataclasses.dataclass
class Script:
    """A scripted module or function compiled for the interpreter."""

    graph: Any  # the inlined copy of the graph (the steps hold its nodes)
    body: _Block
    module_value: Optional[int]  # the graph's `self` input, for a module
    arguments: tuple  # the forward's arguments after `self`: (name, has default, default)
    tensor_attributes: dict  # dotted name -> host tensor
    requiring_grad: frozenset  # names of the state's tensors that require a gradient in the module
    problems: list  # (node, reason), collected when compiled for `bridge check`


def _graph_and_schema(scripted):
    if isinstance(scripted, torch.jit.ScriptModule):
        names = scripted._c._method_names()
        if "forward" not in names:
            # An overloaded forward (nn.GRU's, nn.LSTM's) is compiled as forward__0, forward__1, ...:
            # the first that takes tensors and numbers only.
            overloads = [scripted._c._get_method(name) for name in names if name.startswith("forward__")]
            usable = [method for method in overloads if "__torch__" not in str(method.schema).split("->")[0].split(",", 1)[-1]]
            if not usable:
                raise TranslationError(f"{type(scripted).__name__} has no forward method the bridge can call")
            return usable[0].graph, usable[0].schema, scripted
        method = scripted.forward
        return method.graph, method.schema, scripted
    if isinstance(scripted, torch.jit.ScriptFunction):
        return scripted.graph, scripted.schema, None
    raise TypeError(f"expected a torch.jit.ScriptModule or ScriptFunction, got {type(scripted).__name__}")


def compile_script(scripted, source: Optional[str] = None, collect: bool = False) -> Script:
    """Inlines a copy of the scripted forward's graph and compiles it; TranslationError naming
    the first node without translation (with `collect`, they are listed in `problems` instead)."""
    graph, schema, module = _graph_and_schema(scripted)
    graph = graph.copy()
    torch._C._jit_pass_inline(graph)
    compiler = _Compiler(module, source, collect)
    inputs = list(graph.inputs())
    arguments = list(schema.arguments)
    module_value = None
    if module is not None:
        module_value = inputs[0].unique()
        compiler.modules[module_value] = _Module("")
        inputs, arguments = inputs[1:], arguments[1:]
    body = compiler.block(graph, inputs)
    described = tuple((argument.name, argument.has_default_value(), argument.default_value) for argument in arguments)
    requiring = set()
    if isinstance(module, torch.jit.ScriptModule):
        requiring = {name for name, parameter in module.named_parameters() if parameter.requires_grad}
    requiring |= {name for name, tensor in compiler.tensor_attributes.items() if tensor.requires_grad}
    return Script(graph, body, module_value, described, compiler.tensor_attributes, frozenset(requiring), compiler.problems)


def initial_state(scripted, script: Script) -> dict:
    """The module's parameters, buffers and other tensor attributes the graph reads, as arrays."""
    tensors = {}
    if isinstance(scripted, torch.jit.ScriptModule):
        tensors.update(scripted.named_parameters())
        tensors.update(scripted.named_buffers())
    tensors.update(script.tensor_attributes)
    return arrays_of(tensors)


def _as_tensor(value):
    if isinstance(value, jax.Array):
        return BridgeTensor(value, 0)
    if isinstance(value, np.ndarray):
        return BridgeTensor(jnp.asarray(value), 0)
    return value


def _as_output(value):
    if isinstance(value, torch.Tensor):
        return read_value(_on_device(value))
    if isinstance(value, (bool, int, float)):
        return jnp.asarray(value)  # (a jitted function returns arrays only)
    return value


def to_jax(scripted, source: Optional[str] = None) -> tuple[Callable, dict]:
    """The scripted module or function as a pure JAX function and its initial state (see the
    module's docstring). `source` (a file name) prefixes the errors."""
    script = compile_script(scripted, source)
    names = [name for name, _, _ in script.arguments]

    def function(state, *args, key=None, **kwargs):
        if len(args) > len(names):
            raise TypeError(f"the scripted forward takes {len(names)} arguments, not {len(args)}")
        given = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names or name in given:
                raise TypeError(f"the scripted forward has no argument {name!r} left to give (it takes {names})")
            given[name] = value
        values = []
        for name, has_default, default in script.arguments:
            if name not in given and not has_default:
                raise TypeError(f"the scripted forward needs its argument {name!r}")
            values.append(given[name] if name in given else default)
        flat, spec = pytree.tree_flatten(values)
        tensors = [_as_tensor(value) for value in flat]
        names_in_state = [name for name in state]
        attributes = {name: BridgeTensor(state[name], 0) for name in names_in_state}
        before_inputs = [tensor._value if isinstance(tensor, BridgeTensor) else None for tensor in tensors]
        before_state = [attributes[name]._value for name in names_in_state]
        frame = _Frame(attributes, source)
        frame.requiring_grad = {id(attributes[name]) for name in script.requiring_grad if name in attributes}
        if script.module_value is not None:
            frame.values[script.module_value] = _Module("")
        with graph_trace(key):
            outputs = frame.run(script.body, pytree.tree_unflatten(tensors, spec))
        outputs = outputs[0] if len(outputs) == 1 else tuple(outputs)
        new_state = dict(state)
        for name, value in zip(names_in_state, written([frame.attributes[name] for name in names_in_state], before_state)):
            if value is not None:
                new_state[name] = value
        new_inputs = written(tensors, before_inputs)
        return pytree.tree_map(_as_output, outputs), new_state, new_inputs

    return function, initial_state(scripted, script)


# ---------------------------------------------------------------- bridge check


def census(scripted) -> dict:
    """{status: {node name: count}} for the scripted forward's graph, nothing run: ATen overloads
    by the rung of the fallback ladder each would take, TorchScript's own nodes as interpreted,
    nodes without translation by kind. The tables must be loaded (the bridge active)."""
    from . import ladder
    from .registry import MAPPINGS

    script = compile_script(scripted, collect=True)
    statuses: dict = collections.defaultdict(collections.Counter)

    def visit(block):
        for step in block.steps:
            overload = step.detail.overload if isinstance(step.detail, _Operator) else None
            if step.run is _replaced:
                overload = step.detail[0]
            if overload is not None and ladder.in_dispatcher(overload):
                statuses[ladder.aten_status(overload, MAPPINGS, {})][str(overload)] += 1
            else:
                statuses[INTERPRETED][step.node.kind()] += 1
            for inner in step.blocks:
                visit(inner)

    visit(script.body)
    first_sites: dict = {}
    for node, reason in script.problems:
        first_sites.setdefault((node.kind(), reason), where(node))
        statuses[NO_TRANSLATION][(node.kind(), reason)] += 1
    if first_sites:  # by kind and reason, with the first node's source line
        statuses[NO_TRANSLATION] = collections.Counter({
            f"{kind}: {reason}" + (f" (first at {first_sites[kind, reason]})" if first_sites[kind, reason] else ""): count
            for (kind, reason), count in statuses[NO_TRANSLATION].items()
        })
    return {status: dict(counts) for status, counts in statuses.items()}
