"""`bridge convert FILE`: a saved program (whatever `bridge.load` reads) as a standalone JAX module
that needs only jax and numpy, or as a serialized StableHLO artifact (`jax.export`).

The module is written from the jaxpr of the loaded program's JAX function: each equation becomes
a `jax.lax` (or `jnp`) call where one reads naturally and `primitive.bind(...)` where none does;
sub-jaxprs (jit, custom derivatives, control flow) become functions of their own. Variables take
the names of the graph nodes they come from (`runtime/export.scoped_by_node`). Parameters go to a
file beside the module (safetensors where that package is installed, else numpy's .npz).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import keyword
import logging
import math
import os
import re
import sys
import tempfile
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
import numpy as np

from bridge.runtime.errors import BridgeError, SavedModelError

# Constants of at most this many elements are written into the source; larger ones go to the
# parameter file (under CONSTANT_PREFIX), as the parameters do.
INLINE_ELEMENTS = 16
CONSTANT_PREFIX = "_constants."


class ConversionError(BridgeError):
    """The program cannot be written as a JAX module (a reason for the person running convert)."""


# ---------------------------------------------------------------- what is converted


@dataclasses.dataclass
class Traced:
    """A loaded program's forward, ready to write: its jaxpr (dead code removed) over the state
    and the flattened inputs, the names of both, and the structure of the outputs."""

    jaxpr: Any  # jax_core.ClosedJaxpr over (*state values in state_names order, *inputs)
    state_names: list  # the state's keys, in the order of the jaxpr's first invars
    input_names: list  # a Python name per input
    input_types: list  # jax.ShapeDtypeStruct per input
    out_tree: Any  # jax's treedef of the outputs
    node_text: dict  # graph node name -> one line describing it (comments), where known
    state_values: list  # the state's arrays, in state_names order


def input_types(program: Any, shapes: Optional[list] = None) -> tuple[list, list]:
    """(names, jax.ShapeDtypeStruct per input) of a loaded program: from `shapes` where given,
    else what the program knows of its example inputs (a torch.export program records them)."""
    if shapes:
        return [f"input_{i}" for i in range(len(shapes))], list(shapes)
    specs = getattr(program, "input_specs", None)
    if specs:
        return [f"input_{i}" for i in range(len(specs))], list(specs)
    exported = getattr(program, "exported", None)
    if exported is None:
        raise ConversionError(
            "the program does not record the shapes of its inputs: give each with --input SHAPE:DTYPE "
            "(for example --input 1x3x224x224:float32), in the order the program takes them"
        )
    names, types = [], []
    for node in exported.graph_module.graph.nodes:
        if node.op != "placeholder":
            continue
        spec = next(spec for spec in exported.graph_signature.input_specs if spec.arg.name == node.name)
        if spec.kind.name != "USER_INPUT":
            continue
        value = node.meta.get("val")
        if value is None or not hasattr(value, "shape"):
            raise ConversionError(f"input {node.name} of the program is not a tensor; only tensor inputs can be converted")
        shape = tuple(_size_hint(size) for size in value.shape)
        names.append(node.name)
        types.append(jax.ShapeDtypeStruct(shape, _jax_dtype(value.dtype)))
    return names, types


def _size_hint(size: Any) -> int:
    """A size as a number: a symbolic size (a dynamic dimension of the export) at its example's value."""
    if isinstance(size, int):
        return size
    hint = getattr(size.node, "hint", None)
    if hint is None:
        raise ConversionError("a dynamic dimension of the program has no example value: give the shapes with --input")
    return int(hint)


def _jax_dtype(torch_dtype: Any) -> Any:
    from bridge.runtime.dtypes import TORCH_TO_JAX

    return jnp.dtype(TORCH_TO_JAX[torch_dtype])


def trace(program: Any, shapes: Optional[list] = None) -> Traced:
    """The loaded program's forward (outputs only; what it writes to its state is left out) as a
    jaxpr, with equations named after the graph's nodes."""
    from bridge.runtime import export

    names, types = input_types(program, shapes)
    state = program.state
    state_names = sorted(state)
    exported = getattr(program, "exported", None)
    in_spec = exported.call_spec.in_spec if exported is not None else None

    def forward(state_values, *inputs):
        if in_spec is not None:
            from torch.utils import _pytree as pytree

            args, kwargs = pytree.tree_unflatten(list(inputs), in_spec)
        else:
            args, kwargs = inputs, {}
        outputs, _, _ = program.jax_function(dict(zip(state_names, state_values)), *args, **kwargs)
        return outputs

    state_types = [jax.ShapeDtypeStruct(state[name].shape, state[name].dtype) for name in state_names]
    with export.scoped_by_node():
        closed, out_shapes = jax.make_jaxpr(forward, return_shape=True)(state_types, *types)
    out_tree = jax.tree_util.tree_structure(out_shapes)
    state_values = [state[name] for name in state_names]
    return Traced(closed, state_names, _identifiers(names), types, out_tree, _node_text(exported), state_values)


def _node_text(exported: Any) -> dict:
    if exported is None:
        return {}
    text = {}
    for node in exported.graph_module.graph.nodes:
        if node.op == "call_function":
            arguments = ", ".join(_argument_text(argument) for argument in node.args)
            line = f"{_target_name(node.target)}({arguments})"
            text[node.name] = line if len(line) <= 90 else line[:87] + "..."
    return text


def _target_name(target: Any) -> str:
    name = str(target)
    return name if "." in name and not name.startswith("<") else getattr(target, "__name__", name)


def _argument_text(argument: Any) -> str:
    if isinstance(argument, (list, tuple)):
        return "[" + ", ".join(_argument_text(item) for item in argument) + "]"
    return str(getattr(argument, "name", argument))


# ---------------------------------------------------------------- source for values


def _dtype_source(dtype: Any) -> str:
    name = jnp.dtype(dtype).name
    return "jnp.bool_" if name == "bool" else f"jnp.{name}"


def _scalar_source(value: Any, dtype: Any) -> str:
    """A numpy scalar of exactly this dtype (lax's primitives take no other)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        number = repr(bool(value))
    elif jnp.issubdtype(dtype, jnp.integer):
        number = repr(int(value))
    elif jnp.issubdtype(dtype, jnp.complexfloating):
        number = repr(complex(value))
    else:
        number = _float_source(float(value))
    if dtype.name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                      "float16", "float32", "float64", "complex64", "complex128"):
        return f"np.{'bool_' if dtype.name == 'bool' else dtype.name}({number})"
    return f"np.asarray({number}, dtype={_dtype_source(dtype)})"


def _float_source(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return f'float("{value}")'
    return repr(value)


def _array_source(array: np.ndarray) -> str:
    if array.ndim == 0:
        return _scalar_source(array.item() if array.dtype.kind != "V" else float(array), array.dtype)
    items = [_float_source(float(item)) if array.dtype.kind == "f" or array.dtype.kind == "V" else repr(item.item())
             for item in array.reshape(-1)]
    flat = f"np.array([{', '.join(items)}], dtype={_dtype_source(array.dtype)})"
    return flat if array.ndim == 1 else f"{flat}.reshape({tuple(array.shape)})"


def _lax_name(value: Any) -> Optional[str]:
    """`lax.Name` where jax.lax exports this object (a class, a primitive), else None."""
    name = getattr(value, "__name__", None) or getattr(value, "name", None)
    for candidate in (name, f"{name}_p"):
        if isinstance(candidate, str) and getattr(jax.lax, candidate, None) is value:
            return f"lax.{candidate}"
    return None


def value_source(value: Any, where: str) -> str:
    """Python source that rebuilds a primitive's parameter; `where` names it in the error."""
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, int) and not isinstance(value, enum.Enum):
        return repr(value)
    if isinstance(value, float):
        return _float_source(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple of lax (dimension numbers)
        owner = _lax_name(type(value)) or _importable(type(value), where)
        fields = ", ".join(f"{field}={value_source(getattr(value, field), where)}" for field in value._fields)
        return f"{owner}({fields})"
    if isinstance(value, (tuple, list)):
        items = [value_source(item, where) for item in value]
        if isinstance(value, list):
            return "[" + ", ".join(items) + "]"
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, enum.Enum):
        return f"{_lax_name(type(value)) or _importable(type(value), where)}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        owner = _lax_name(type(value)) or _importable(type(value), where)
        fields = ", ".join(f"{field.name}={value_source(getattr(value, field.name), where)}" for field in dataclasses.fields(value))
        return f"{owner}({fields})"
    if isinstance(value, (np.dtype, type)) or hasattr(value, "dtype") and isinstance(value, type):
        try:
            return _dtype_source(value)
        except TypeError:
            pass
    if isinstance(value, np.generic):
        return _scalar_source(value, value.dtype)
    try:
        return _dtype_source(value)  # a dtype object of another kind (numpy's DType classes)
    except TypeError:
        pass
    raise ConversionError(f"{where} is a {type(value).__name__} ({value!r:.60}), which cannot be written as source")


def _importable(owner: Any, where: str) -> str:
    """`module.Name` for a class or object JAX defines outside jax.lax (written as an import)."""
    module = getattr(owner, "__module__", None)
    name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None)
    if module and name and getattr(importlib.import_module(module), name, None) is owner:
        return f"importlib.import_module({module!r}).{name}"
    raise ConversionError(f"{where}: {owner!r} cannot be imported by name")


def _primitive_source(primitive: Any) -> str:
    found = _lax_name(primitive)
    if found:
        return found
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("jax") or module is None:
            continue
        for attribute, value in list(vars(module).items()):
            if value is primitive:
                return f"importlib.import_module({module_name!r}).{attribute}"
    raise ConversionError(f"JAX's primitive {primitive.name} cannot be found by name to be written")


# ---------------------------------------------------------------- names


RESERVED = frozenset(
    ["jax", "jnp", "np", "lax", "os", "json", "importlib", "params", "forward", "load_params", "PARAMS_FILE"]
    + keyword.kwlist
    + dir(__builtins__ if isinstance(__builtins__, dict) else vars(__builtins__))
)


def _identifier(text: str) -> str:
    name = re.sub(r"\W+", "_", text).strip("_") or "value"
    return f"v_{name}" if name[0].isdigit() else name


def _identifiers(texts: list) -> list:
    namer = _Namer(RESERVED)
    return [namer.take(_identifier(text)) for text in texts]


class _Namer:
    """Unique Python names within one function: a base name, then base_1, base_2, ..."""

    def __init__(self, reserved: frozenset | set):
        self.taken = set(reserved)

    def take(self, base: str) -> str:
        name, count = base, 0
        while name in self.taken:
            count += 1
            name = f"{base}_{count}"
        self.taken.add(name)
        return name


# ---------------------------------------------------------------- primitives as source

# Each writer takes (the writer object, the equation, its argument expressions) and returns the
# expression of its result (a tuple of results for a primitive with several).
_WRITERS: dict[str, Callable] = {}

# Writers whose expression is a sequence of results even where the equation has one.
_SEQUENCES = frozenset({"split", "sort", "optimization_barrier", "while", "scan", "reduce_window"})

# Parameters that carry nothing the emitted call needs while they are None (sharding, accuracy).
_NONE_PARAMETERS = frozenset({"accuracy", "out_dtype", "sharding", "out_sharding"})


def _writes(*names: str) -> Callable:
    def register(writer: Callable) -> Callable:
        for name in names:
            _WRITERS[name] = writer
        return writer

    return register


def _plain(eqn: Any, *allowed: str) -> bool:
    """Whether the equation's parameters are only `allowed` ones and ones that are None."""
    return all(name in allowed or (name in _NONE_PARAMETERS and value is None) for name, value in eqn.params.items())


_OPERATORS = {"add": "+", "sub": "-", "mul": "*", "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
              "and": "&", "or": "|", "xor": "^"}
_LAX_BINARY = ("div", "rem", "pow", "max", "min", "atan2", "nextafter", "shift_left", "shift_right_logical",
               "shift_right_arithmetic", "complex", "igamma", "igammac", "polygamma", "zeta")
_LAX_UNARY = ("exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan",
              "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "abs", "sign", "floor", "ceil",
              "is_finite", "erf", "erfc", "erf_inv", "lgamma", "digamma", "square", "real", "imag", "conj",
              "stop_gradient", "population_count", "clz", "bessel_i0e", "bessel_i1e")


def _operator_writer(symbol: str) -> Callable:
    def write(writer, eqn, args):
        return f"{args[0]} {symbol} {args[1]}" if _plain(eqn) else None

    return write


for _name, _symbol in _OPERATORS.items():
    _WRITERS[_name] = _operator_writer(_symbol)


@_writes(*_LAX_BINARY, *_LAX_UNARY)
def _lax_call(writer, eqn, args):
    return f"lax.{eqn.primitive.name}({', '.join(args)})" if _plain(eqn) else None


@_writes("neg")
def _neg(writer, eqn, args):
    return f"-{args[0]}"


@_writes("not")
def _not(writer, eqn, args):
    return f"~{args[0]}"


@_writes("integer_pow")
def _integer_pow(writer, eqn, args):
    return f"lax.integer_pow({args[0]}, {eqn.params['y']})"


@_writes("round")
def _round(writer, eqn, args):
    return f"lax.round({args[0]}, {value_source(eqn.params['rounding_method'], 'round')})"


@_writes("copy", "copy_p")
def _copy(writer, eqn, args):
    return args[0]


@_writes("device_put")
def _device_put(writer, eqn, args):
    """A move between devices: the module's caller places its arrays, so the values pass as they are."""
    return f"({', '.join(args)},)" if len(args) > 1 else args[0]


@_writes("convert_element_type")
def _convert(writer, eqn, args):
    return f"lax.convert_element_type({args[0]}, {_dtype_source(eqn.params['new_dtype'])})" if _plain(eqn, "new_dtype", "weak_type") else None


@_writes("bitcast_convert_type")
def _bitcast(writer, eqn, args):
    return f"lax.bitcast_convert_type({args[0]}, {_dtype_source(eqn.params['new_dtype'])})"


@_writes("reshape")
def _reshape(writer, eqn, args):
    if eqn.params["dimensions"] is not None or not _plain(eqn, "new_sizes", "dimensions"):
        return None
    return f"lax.reshape({args[0]}, {tuple(eqn.params['new_sizes'])})"


@_writes("broadcast_in_dim")
def _broadcast(writer, eqn, args):
    if not _plain(eqn, "shape", "broadcast_dimensions"):
        return None
    return f"lax.broadcast_in_dim({args[0]}, {tuple(eqn.params['shape'])}, {tuple(eqn.params['broadcast_dimensions'])})"


@_writes("transpose")
def _transpose(writer, eqn, args):
    return f"lax.transpose({args[0]}, {tuple(eqn.params['permutation'])})"


@_writes("squeeze")
def _squeeze(writer, eqn, args):
    return f"lax.squeeze({args[0]}, {tuple(eqn.params['dimensions'])})"


@_writes("rev")
def _rev(writer, eqn, args):
    return f"lax.rev({args[0]}, {tuple(eqn.params['dimensions'])})"


@_writes("select_n")
def _select_n(writer, eqn, args):
    return f"lax.select_n({', '.join(args)})"


@_writes("clamp")
def _clamp(writer, eqn, args):
    return f"lax.clamp({', '.join(args)})"


@_writes("concatenate")
def _concatenate(writer, eqn, args):
    return f"lax.concatenate([{', '.join(args)}], {eqn.params['dimension']})"


@_writes("pad")
def _pad(writer, eqn, args):
    return f"lax.pad({args[0]}, {args[1]}, {value_source(tuple(map(tuple, eqn.params['padding_config'])), 'pad')})"


@_writes("slice")
def _slice(writer, eqn, args):
    params = eqn.params
    strides = "" if params["strides"] is None else f", {tuple(params['strides'])}"
    return f"lax.slice({args[0]}, {tuple(params['start_indices'])}, {tuple(params['limit_indices'])}{strides})"


@_writes("dynamic_slice")
def _dynamic_slice(writer, eqn, args):
    return f"lax.dynamic_slice({args[0]}, [{', '.join(args[1:])}], {tuple(eqn.params['slice_sizes'])})"


@_writes("dynamic_update_slice")
def _dynamic_update_slice(writer, eqn, args):
    return f"lax.dynamic_update_slice({args[0]}, {args[1]}, [{', '.join(args[2:])}])"


@_writes("iota")
def _iota(writer, eqn, args):
    params = eqn.params
    if not _plain(eqn, "dtype", "shape", "dimension"):
        return None
    return f"lax.broadcasted_iota({_dtype_source(params['dtype'])}, {tuple(params['shape'])}, {params['dimension']})"


@_writes("dot_general")
def _dot_general(writer, eqn, args):
    if not _plain(eqn, "dimension_numbers", "precision", "preferred_element_type"):
        return None
    params = eqn.params
    numbers = value_source(tuple(tuple(tuple(side) for side in pair) for pair in params["dimension_numbers"]), "dot_general")
    return (f"lax.dot_general({args[0]}, {args[1]}, {numbers}, precision={value_source(params['precision'], 'precision')}, "
            f"preferred_element_type={value_source(params['preferred_element_type'], 'preferred_element_type')})")


@_writes("conv_general_dilated")
def _convolution(writer, eqn, args):
    keys = ("window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers", "feature_group_count",
            "batch_group_count", "precision", "preferred_element_type")
    if not _plain(eqn, *keys):
        return None
    written = ", ".join(f"{key}={value_source(eqn.params[key], key)}" for key in keys)
    return f"lax.conv_general_dilated({args[0]}, {args[1]}, {written})"


@_writes("gather")
def _gather(writer, eqn, args):
    keys = ("dimension_numbers", "slice_sizes", "unique_indices", "indices_are_sorted", "mode", "fill_value")
    written = ", ".join(f"{key}={value_source(eqn.params[key], key)}" for key in keys)
    return f"lax.gather({args[0]}, {args[1]}, {written})"


@_writes("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
         "scatter-max", "scatter_max", "scatter-sub", "scatter_sub")
def _scatter(writer, eqn, args):
    kind = eqn.primitive.name.replace("-", "_")
    keys = ("dimension_numbers", "indices_are_sorted", "unique_indices", "mode")
    written = ", ".join(f"{key}={value_source(eqn.params[key], key)}" for key in keys)
    return f"lax.{kind}({args[0]}, {args[1]}, {args[2]}, {written})"


# The reductions as `lax.reduce` with the operation's identity: JAX turns that back into the same
# primitive (reduce_sum, reduce_max, ...), and unlike jnp.sum it never changes the dtype.
_REDUCTIONS = {"reduce_sum": ("lax.add", "zero"), "reduce_prod": ("lax.mul", "one"), "reduce_max": ("lax.max", "lowest"),
               "reduce_min": ("lax.min", "highest"), "reduce_and": ("lax.bitwise_and", "one"),
               "reduce_or": ("lax.bitwise_or", "zero")}


def _identity(kind: str, dtype: Any) -> str:
    dtype = np.dtype(dtype)
    if kind in ("zero", "one"):
        return _scalar_source(kind == "one", dtype) if dtype == np.bool_ else _scalar_source(0 if kind == "zero" else 1, dtype)
    if dtype == np.bool_:
        return _scalar_source(kind == "highest", dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return _scalar_source(info.min if kind == "lowest" else info.max, dtype)
    return _scalar_source(-math.inf if kind == "lowest" else math.inf, dtype)


@_writes(*_REDUCTIONS)
def _reduce(writer, eqn, args):
    if not _plain(eqn, "axes"):
        return None
    operation, identity = _REDUCTIONS[eqn.primitive.name]
    init = _identity(identity, eqn.invars[0].aval.dtype)
    return f"lax.reduce({args[0]}, {init}, {operation}, {tuple(eqn.params['axes'])})"


@_writes("argmax", "argmin")
def _argmax(writer, eqn, args):
    axes = eqn.params["axes"]
    return f"lax.{eqn.primitive.name}({args[0]}, {axes[0]}, {_dtype_source(eqn.params['index_dtype'])})" if len(axes) == 1 else None


_WINDOW_REDUCTIONS = {"reduce_window_max": ("lax.max", "lowest"), "reduce_window_min": ("lax.min", "highest"),
                      "reduce_window_sum": ("lax.add", "zero")}
_WINDOW_KEYS = ("window_dimensions", "window_strides", "padding", "base_dilation", "window_dilation")


@_writes(*_WINDOW_REDUCTIONS)
def _reduce_window(writer, eqn, args):
    operation, identity = _WINDOW_REDUCTIONS[eqn.primitive.name]
    init = _identity(identity, eqn.invars[0].aval.dtype)
    written = ", ".join(value_source(eqn.params[key], key) for key in _WINDOW_KEYS)
    return f"lax.reduce_window({args[0]}, {init}, {operation}, {written})"


@_writes("reduce_window")
def _reduce_window_generic(writer, eqn, args):
    """A window reduction of several operands at once (max pooling with its indices)."""
    params = eqn.params
    count = len(eqn.outvars)
    body = jax_core.ClosedJaxpr(params["jaxpr"], params["consts"])
    helper = writer.function(body, "window_reduction", as_tuple=True)
    operands, inits = args[:count], args[count:]
    written = ", ".join(value_source(params[key], key) for key in _WINDOW_KEYS)
    return (f"lax.reduce_window(({', '.join(operands)},), ({', '.join(inits)},), "
            f"lambda x, y: {writer.call(helper, ['*x', '*y'])}, {written})")


@_writes("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _cumulative(writer, eqn, args):
    return f"lax.{eqn.primitive.name}({args[0]}, axis={eqn.params['axis']}, reverse={eqn.params['reverse']})"


@_writes("sort")
def _sort(writer, eqn, args):
    params = eqn.params
    return (f"lax.sort(({', '.join(args)},), dimension={params['dimension']}, is_stable={params['is_stable']}, "
            f"num_keys={params['num_keys']})")


@_writes("split")
def _split(writer, eqn, args):
    return f"lax.split({args[0]}, {tuple(eqn.params['sizes'])}, axis={eqn.params['axis']})"


@_writes("reduce_precision")
def _reduce_precision(writer, eqn, args):
    return f"lax.reduce_precision({args[0]}, {eqn.params['exponent_bits']}, {eqn.params['mantissa_bits']})"


@_writes("optimization_barrier")
def _barrier(writer, eqn, args):
    return f"lax.optimization_barrier(({', '.join(args)},))"


@_writes("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
         "remat", "checkpoint")
def _call(writer, eqn, args):
    """A call of a sub-jaxpr, as a call of a function written for it. Custom derivatives
    (custom_jvp, custom_vjp) keep their forward only: the module reproduces the forward."""
    params = eqn.params
    body = params.get("jaxpr") if "jaxpr" in params else params.get("call_jaxpr", params.get("fun_jaxpr"))
    if body is None:
        return None
    if not isinstance(body, jax_core.ClosedJaxpr):
        body = jax_core.ClosedJaxpr(body, ())
    name = params.get("name") or {"custom_jvp_call": "custom_jvp", "custom_vjp_call": "custom_vjp"}.get(eqn.primitive.name, "call")
    helper = writer.function(body, name, as_tuple=len(eqn.outvars) != 1, argument_names=args)
    return writer.call(helper, args)


@_writes("cond")
def _cond(writer, eqn, args):
    branches = [writer.function(branch, f"branch_{number}", as_tuple=len(eqn.outvars) != 1)
                for number, branch in enumerate(eqn.params["branches"])]
    if not _plain(eqn, "branches"):
        return None
    functions = ", ".join(f"lambda *operands: {writer.call(branch, ['*operands'])}" for branch in branches)
    return f"lax.switch({args[0]}, [{functions}], {', '.join(args[1:])})"


@_writes("while")
def _while(writer, eqn, args):
    params = eqn.params
    cond_count, body_count = params["cond_nconsts"], params["body_nconsts"]
    condition = writer.function(params["cond_jaxpr"], "loop_condition", as_tuple=False)
    body = writer.function(params["body_jaxpr"], "loop_body", as_tuple=True)
    cond_consts, body_consts, init = args[:cond_count], args[cond_count:cond_count + body_count], args[cond_count + body_count:]
    return (f"lax.while_loop(lambda carry: {writer.call(condition, [*cond_consts, '*carry'])}, "
            f"lambda carry: {writer.call(body, [*body_consts, '*carry'])}, ({', '.join(init)},))")


@_writes("scan")
def _scan(writer, eqn, args):
    params = eqn.params
    consts, carries = params["num_consts"], params["num_carry"]
    body = writer.function(params["jaxpr"], "scan_body", as_tuple=True)
    init, xs = args[consts:consts + carries], args[consts + carries:]
    step = writer.call(body, [*args[:consts], "*carry", "*xs"])
    return (f"(lambda carry_and_ys: (*carry_and_ys[0], *carry_and_ys[1]))(lax.scan("
            f"lambda carry, xs: (lambda out: (out[:{carries}], out[{carries}:]))({step}), "
            f"({', '.join(init)}{',' if init else ''}), ({', '.join(xs)}{',' if xs else ''}), length={params['length']}, "
            f"reverse={params['reverse']}, unroll={value_source(params['unroll'], 'unroll')}))")


@_writes("random_seed")
def _random_seed(writer, eqn, args):
    return f"jax.random.key({args[0]}, impl={eqn.params['impl'].name!r})"


@_writes("random_bits")
def _random_bits(writer, eqn, args):
    dtype = f"jnp.uint{eqn.params['bit_width']}"
    return f"jax.random.bits({args[0]}, {tuple(eqn.params['shape'])}, {dtype})"


@_writes("random_wrap")
def _random_wrap(writer, eqn, args):
    return f"jax.random.wrap_key_data({args[0]}, impl={eqn.params['impl'].name!r})"


@_writes("random_unwrap")
def _random_unwrap(writer, eqn, args):
    return f"jax.random.key_data({args[0]})"


@_writes("random_fold_in")
def _random_fold_in(writer, eqn, args):
    return f"jax.random.fold_in({args[0]}, {args[1]})"


@_writes("random_split")
def _random_split(writer, eqn, args):
    return f"jax.random.split({args[0]}, {tuple(eqn.params['shape'])})"


# ---------------------------------------------------------------- the module


@dataclasses.dataclass
class _Helper:
    name: str
    constants: list  # ids of the stored constants it needs, passed first


class _ModuleWriter:
    """Writes the functions of one module: forward, and one per distinct sub-jaxpr."""

    def __init__(self, node_text: dict):
        self.node_text = node_text
        self.helpers: dict = {}  # (id of jaxpr, as_tuple) -> _Helper
        self.helper_sources: list = []
        self.helper_names = _Namer(RESERVED)
        self.stored: dict = {}  # id of array -> (key in the parameter file, array)
        self.constant_names: dict = {}  # id of array -> Python name of a stored constant
        self.uses_64_bits = False
        self._current: list = []  # per function being written: the ids of the stored constants it reads

    # -- constants

    def constant(self, value: Any) -> str:
        """The expression of a constant: written out where small, else a stored one's name (which
        the function being written then takes as an argument)."""
        array = np.asarray(value)
        self._note_dtype(array.dtype)
        if array.size <= INLINE_ELEMENTS:
            return _array_source(array)
        key = id(value)
        if key not in self.stored:
            number = len(self.stored)
            self.stored[key] = (f"{CONSTANT_PREFIX}{number}", array, value)
            self.constant_names[key] = f"constant_{number}"
        if key not in self._current[-1]:
            self._current[-1].append(key)
        return self.constant_names[key]

    def _note_dtype(self, dtype: Any) -> None:
        if jnp.dtype(dtype).itemsize == 8 and jnp.dtype(dtype).kind in "iufc":
            self.uses_64_bits = True

    def call(self, helper: _Helper, args: list) -> str:
        """A call of a helper: the stored constants it reads (this function then reads them too)."""
        for key in helper.constants:
            if key not in self._current[-1]:
                self._current[-1].append(key)
        return f"{helper.name}({', '.join([*(self.constant_names[key] for key in helper.constants), *args])})"

    # -- functions

    def function(self, closed: Any, name: str, as_tuple: bool, argument_names: Optional[list] = None) -> _Helper:
        """The helper written for a closed sub-jaxpr (once per jaxpr). Its parameters take the
        names of the first call's arguments where those are names."""
        key = (id(closed.jaxpr), as_tuple)
        if key in self.helpers:
            return self.helpers[key]
        helper_name = self.helper_names.take("_" + _identifier(name))
        self._current.append([])
        namer = _Namer(RESERVED | {helper.name for helper in self.helpers.values()} | {helper_name})
        names = self.constants_of(closed)
        given = argument_names or []
        parameters = []
        for position, _ in enumerate(closed.jaxpr.invars):
            suggested = given[position] if position < len(given) else ""
            parameters.append(namer.take(suggested if suggested.isidentifier() and not suggested.startswith("constant_") else "argument"))
        names.update(zip(closed.jaxpr.invars, parameters))
        body = self.body(closed.jaxpr, names, namer, indent="    ")
        outputs = [self.atom(var, names) for var in closed.jaxpr.outvars]
        result = f"({', '.join(outputs)},)" if as_tuple or len(outputs) != 1 else outputs[0]
        constants = self._current.pop()
        signature = ", ".join([*(self.constant_names[key] for key in constants), *parameters])
        source = [f"def {helper_name}({signature}):", *body, f"    return {result}"]
        self.helper_sources.append("\n".join(source))
        helper = _Helper(helper_name, constants)
        self.helpers[key] = helper
        return helper

    def constants_of(self, closed: Any) -> dict:
        """The expressions of a closed jaxpr's constants that its equations read (dead-code
        removal leaves constants no equation reads)."""
        read = {id(var) for eqn in closed.jaxpr.eqns for var in eqn.invars} | {id(var) for var in closed.jaxpr.outvars}
        return {var: self.constant(value) for var, value in zip(closed.jaxpr.constvars, closed.consts) if id(var) in read}

    def atom(self, var: Any, names: dict) -> str:
        if isinstance(var, jax_core.Literal):
            value = var.val
            dtype = var.aval.dtype
            self._note_dtype(dtype)
            if np.ndim(value) == 0:
                return _scalar_source(np.asarray(value).item() if np.asarray(value).dtype.kind != "V" else float(value), dtype)
            return self.constant(value)
        return names[var]

    def body(self, jaxpr: Any, names: dict, namer: _Namer, indent: str, top: bool = False) -> list:
        lines: list = []
        # At the top, an equation's outermost scope is its graph node; inside a helper, scopes
        # are those of the JAX code it came from (einsum's "ij,jk->ik"), the innermost the closest.
        scopes = [_scope_name(eqn, top) for eqn in jaxpr.eqns]
        # Each scope's results are named after it, its last result taking the bare name (the
        # graph node's own result), earlier ones numbered.
        remaining: dict = {}
        for scope, eqn in zip(scopes, jaxpr.eqns):
            remaining[scope] = remaining.get(scope, 0) + len(eqn.outvars)
        previous = None
        for scope, eqn in zip(scopes, jaxpr.eqns):
            if top and scope and scope != previous:
                text = self.node_text.get(scope)
                lines.append(f"{indent}# {scope}" + (f": {text}" if text else ""))
            previous = scope
            args = [self.atom(var, names) for var in eqn.invars]
            expression = self.equation(eqn, args)
            targets = []
            for var in eqn.outvars:
                remaining[scope] -= 1
                if isinstance(var, jax_core.DropVar):
                    targets.append("_")
                    continue
                if hasattr(var.aval, "dtype"):
                    self._note_dtype(var.aval.dtype)
                base = _identifier(scope or eqn.params.get("name") or eqn.primitive.name)
                name = namer.take(base if remaining[scope] == 0 else f"{base}_{remaining[scope]}")
                names[var] = name
                targets.append(name)
            if len(targets) == 1:
                lines.append(f"{indent}{targets[0]} = {expression}")
            else:
                lines.append(f"{indent}{', '.join(targets)} = {expression}")
        return lines

    def equation(self, eqn: Any, args: list) -> str:
        """The expression of an equation's result: one value, or a sequence of several."""
        writer = _WRITERS.get(eqn.primitive.name)
        expression = writer(self, eqn, args) if writer else None
        if expression is not None:
            return f"{expression}[0]" if len(eqn.outvars) == 1 and eqn.primitive.name in _SEQUENCES else expression
        # No readable call: the primitive itself, with its parameters written out.
        where = f"the parameter {{}} of {eqn.primitive.name}"
        params = ", ".join(f"{name}={value_source(value, where.format(name))}" for name, value in eqn.params.items())
        primitive = _primitive_source(eqn.primitive)
        call = f"{primitive}.bind({', '.join(args)}{', ' if params and args else ''}{params})"
        return f"{call}[0]" if eqn.primitive.multiple_results and len(eqn.outvars) == 1 else call

    def forward(self, traced: Traced, used_inputs: list) -> str:
        """forward(params, *inputs)'s source."""
        closed = traced.jaxpr
        jaxpr = closed.jaxpr
        self._current.append([])
        namer = _Namer(RESERVED)
        names = self.constants_of(closed)
        # Dead-code removal dropped the invars nothing reads: the state entries forward skips
        # (an inference program's num_batches_tracked) and inputs it ignores.
        invars = iter(jaxpr.invars)
        header, input_names = [], []
        for state_name, used in zip(traced.state_names, used_inputs[: len(traced.state_names)]):
            if used:
                var = next(invars)
                names[var] = namer.take(_identifier(state_name))
                header.append(f"    {names[var]} = params[{state_name!r}]")
        for input_name, used in zip(traced.input_names, used_inputs[len(traced.state_names):]):
            name = namer.take(input_name)
            input_names.append(name)
            if used:
                names[next(invars)] = name
        lines = self.body(jaxpr, names, namer, indent="    ", top=True)
        outputs = [self.atom(var, names) for var in jaxpr.outvars]
        constants = self._current.pop()
        for key in constants:
            stored_key = self.stored[key][0]
            header.append(f"    {self.constant_names[key]} = params[{stored_key!r}]")
        result = _structure_source(traced.out_tree, outputs)
        signature = ", ".join(["params", *input_names])
        types = ", ".join(f"{name}: {_type_text(spec)}" for name, spec in zip(input_names, traced.input_types))
        doc = f'    """The program\'s outputs for inputs of these shapes ({types})."""'
        return "\n".join([f"def forward({signature}):", doc, *header, *lines, f"    return {result}"])


def _scope_name(eqn: Any, top: bool) -> str:
    scope = str(eqn.source_info.name_stack)
    if not scope:
        return ""
    parts = scope.split("/")
    return parts[0] if top else parts[-1]


def _type_text(spec: Any) -> str:
    return f"{jnp.dtype(spec.dtype).name}[{', '.join(str(size) for size in spec.shape)}]"


def _structure_source(tree: Any, leaves: list) -> str:
    """The outputs' structure (tuples, lists, dicts, None) around the leaves' expressions."""

    class Leaf:
        def __init__(self, text):
            self.text = text

    rebuilt = jax.tree_util.tree_unflatten(tree, [Leaf(text) for text in leaves])

    def render(node):
        if isinstance(node, Leaf):
            return node.text
        if node is None:
            return "None"
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            items = [render(item) for item in node]
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if isinstance(node, list):
            return "[" + ", ".join(render(item) for item in node) + "]"
        if isinstance(node, dict):
            return "{" + ", ".join(f"{key!r}: {render(value)}" for key, value in node.items()) + "}"
        raise TypeError(type(node))

    try:
        return render(rebuilt)
    except TypeError:  # a container of another kind (a named tuple, a model output class): flat
        return "(" + ", ".join(leaves) + ("," if len(leaves) == 1 else "") + ")"


_LOADER = '''
_SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32", "U32": "uint32",
    "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def load_params(path=PARAMS_FILE):
    """The parameters forward takes, as JAX arrays keyed by the program's state names, from a
    .safetensors file (read here with numpy: no other package needed) or a .npz file."""
    if path.endswith(".npz"):
        with np.load(path) as archive:
            dtypes = json.loads(str(archive["__dtypes__"])) if "__dtypes__" in archive else {}
            arrays = {name: archive[name] for name in archive.files if name != "__dtypes__"}
        return {name: jnp.asarray(array.view(jnp.dtype(dtypes[name])) if name in dtypes else array)
                for name, array in arrays.items()}
    with open(path, "rb") as file:
        data = file.read()
    header_size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_size])
    header.pop("__metadata__", None)
    params = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        dtype = jnp.dtype(_SAFETENSORS_DTYPES[entry["dtype"]])
        array = np.frombuffer(data, dtype=dtype, count=(end - start) // dtype.itemsize, offset=8 + header_size + start)
        params[name] = jnp.asarray(array.reshape(entry["shape"]))
    return params
'''


def module_source(traced: Traced, params_file: str, origin: str) -> tuple[str, dict]:
    """(the module's source, the arrays its parameter file holds)."""
    from jax._src.interpreters import partial_eval

    closed = traced.jaxpr
    jaxpr, used_inputs = partial_eval.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=False)
    trimmed = dataclasses.replace(traced, jaxpr=jax_core.ClosedJaxpr(jaxpr, closed.consts))
    writer = _ModuleWriter(traced.node_text)
    forward = writer.forward(trimmed, used_inputs)
    arrays = {name: np.asarray(value) for name, value, used in zip(traced.state_names, traced.state_values, used_inputs) if used}
    for stored_key, array, _ in writer.stored.values():
        arrays[stored_key] = array
    for array in arrays.values():
        writer._note_dtype(array.dtype)
    module_name = os.path.splitext(os.path.basename(params_file))[0]
    call = f"{module_name}.forward(params, {', '.join(traced.input_names)})"
    doc = [
        f'"""The forward of {origin} in JAX, written by `python -m bridge convert` (JAX {jax.__version__}).',
        "",
        f"    import {module_name}",
        f"    params = {module_name}.load_params()   # {params_file}, beside this file",
        f"    outputs = {call}",
        "",
        "Needs jax and numpy only. Inputs: "
        + ", ".join(f"{name}: {_type_text(spec)}" for name, spec in zip(traced.input_names, traced.input_types))
        + " (the shapes it was converted for).",
        '"""',
    ]
    header = ["", "import importlib  # noqa: F401  (primitives JAX does not export from jax.lax)", "import json", "import os", "",
              "import jax", "import jax.numpy as jnp", "import numpy as np", "from jax import lax", ""]
    if writer.uses_64_bits:
        header += ["# The program has 64-bit values (torch's int64 and float64): JAX keeps them only with x64 on.",
                   'jax.config.update("jax_enable_x64", True)', ""]
    header += [f"PARAMS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), {params_file!r})"]
    parts = ["\n".join(doc + header), _LOADER.strip("\n"), forward, *writer.helper_sources]
    return "\n\n\n".join(parts) + "\n", arrays


# ---------------------------------------------------------------- files


def save_params(arrays: dict, path: str, suffix: str) -> None:
    """The arrays to `path` in the format of `suffix`: safetensors (.safetensors) or numpy's .npz
    (bfloat16 and float8 kept as their bits, with their dtypes under `__dtypes__`)."""
    if suffix == ".safetensors":
        from safetensors.numpy import save_file

        # (a copy in C order where needed: np.ascontiguousarray would make a 0-d array 1-d)
        save_file({name: array if array.flags.c_contiguous else array.copy(order="C") for name, array in arrays.items()}, path)
        return
    dtypes, plain = {}, {}
    for name, array in arrays.items():
        if array.dtype.name in ("bfloat16",) or array.dtype.name.startswith("float8"):
            dtypes[name] = array.dtype.name
            array = array.view(np.uint16 if array.dtype.itemsize == 2 else np.uint8)
        plain[name] = array
    if dtypes:
        import json

        plain["__dtypes__"] = np.array(json.dumps(dtypes))
    with open(path, "wb") as file:
        np.savez(file, **plain)


def params_suffix() -> str:
    try:
        import safetensors.numpy  # noqa: F401
    except ImportError:
        return ".npz"
    return ".safetensors"


class _Outputs:
    """Files written under temporary names beside their targets, renamed into place together at
    the end, and removed when anything fails (no partial output)."""

    def __init__(self):
        self.pending: list = []

    def path_for(self, target: str) -> str:
        directory = os.path.dirname(os.path.abspath(target))
        handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".partial", dir=directory)
        os.close(handle)
        self.pending.append((temporary, target))
        return temporary

    def commit(self) -> None:
        umask = os.umask(0)
        os.umask(umask)
        for temporary, target in self.pending:
            os.chmod(temporary, 0o666 & ~umask)  # as open() would have made it (mkstemp's is private)
            os.replace(temporary, target)
        self.pending = []

    def discard(self) -> None:
        for temporary, _ in self.pending:
            if os.path.exists(temporary):
                os.remove(temporary)
        self.pending = []


def convert(source: Any, output: str, to: str = "jax", shapes: Optional[list] = None, platforms: Optional[list] = None) -> list:
    """Write `source` (what `bridge.load` takes) as a JAX module (`to="jax"`) or a serialized
    StableHLO artifact (`to="stablehlo"`) at `output`, with its parameters beside it; returns the
    paths written."""
    import bridge
    from bridge.interop import _bridge_active

    with _bridge_active():
        program = _load(source)
        base = os.path.splitext(output)[0]
        params_path = base + params_suffix()
        origin = os.path.basename(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else type(source).__name__
        outputs = _Outputs()
        try:
            if to == "jax":
                traced = trace(program, shapes)
                source_text, arrays = module_source(traced, os.path.basename(params_path), origin)
                with open(outputs.path_for(output), "w") as file:
                    file.write(source_text)
            else:
                arrays, serialized = stablehlo(program, shapes, platforms)
                with open(outputs.path_for(output), "wb") as file:
                    file.write(serialized)
            save_params(arrays, outputs.path_for(params_path), os.path.splitext(params_path)[1])
            outputs.commit()
        finally:
            outputs.discard()
    return [output, params_path]


def _load(source: Any) -> Any:
    """bridge.load's program; a file it cannot read raises SavedModelError naming it."""
    import bridge

    # torch.export.load logs a traceback of its own before raising; the error below says it once.
    logger = logging.getLogger("torch.export")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        return bridge.load(source)
    except (NotImplementedError, SavedModelError):
        raise
    except Exception as error:  # noqa: BLE001 - torch's readers raise many kinds (zip, pickle, runtime)
        raise SavedModelError(
            f"{os.fspath(source)} could not be read as a saved program ({type(error).__name__}: {_first_line(error)}). "
            "Check that the file is complete and was written by torch.export.save (or is another kind bridge.load "
            "reads), and save it again if not."
        ) from error
    finally:
        logger.setLevel(level)


def stablehlo(program: Any, shapes: Optional[list] = None, platforms: Optional[list] = None) -> tuple[dict, bytes]:
    """(the state, `jax.export`'s serialization of forward(params, *inputs)); a torch.export
    program's dynamic dimensions are symbolic dimensions of the artifact, unless `shapes` fix them."""
    try:
        import flatbuffers  # noqa: F401  (jax.export's serialization format)
    except ImportError:
        raise ConversionError("--to stablehlo needs the flatbuffers package (jax.export writes with it): pip install flatbuffers") from None
    from bridge.runtime import export
    from bridge.runtime.errors import SymbolicShapeError

    names, types = input_types(program, shapes)
    exported_program = getattr(program, "exported", None)
    in_spec = exported_program.call_spec.in_spec if exported_program is not None else None
    if exported_program is not None and not shapes:
        types = export.symbolic_input_types(exported_program)  # its dynamic dimensions stay symbolic
    state = dict(program.state)

    def forward(params, *inputs):
        if in_spec is not None:
            from torch.utils import _pytree as pytree

            args, kwargs = pytree.tree_unflatten(list(inputs), in_spec)
        else:
            args, kwargs = inputs, {}
        return program.jax_function(params, *args, **kwargs)[0]

    state_types = {name: jax.ShapeDtypeStruct(value.shape, value.dtype) for name, value in state.items()}
    try:
        exported = jax.export.export(jax.jit(forward), platforms=platforms)(state_types, *types)
    except SymbolicShapeError as error:
        raise ConversionError(f"{error} To write it at fixed sizes, give each input's shape with --input.") from None
    return {name: np.asarray(value) for name, value in state.items()}, exported.serialize()


# ---------------------------------------------------------------- the command


def _shape(text: str) -> jax.ShapeDtypeStruct:
    shape_text, _, dtype_text = text.partition(":")
    try:
        shape = tuple(int(size) for size in shape_text.lower().split("x")) if shape_text else ()
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype_text or "float32"))
    except (ValueError, TypeError) as error:
        raise ConversionError(f"--input {text!r} is not SHAPE:DTYPE (for example 1x3x224x224:float32): {error}") from None


def main(options: argparse.Namespace) -> int:
    path = options.file
    if not os.path.exists(path):
        print(f"bridge convert: no such file: {path}", file=sys.stderr)
        return 2
    default_suffix = "_jax.py" if options.to == "jax" else ".stablehlo"
    output = options.output or os.path.splitext(path)[0] + default_suffix
    platforms = options.platforms.split(",") if options.platforms else None
    try:
        shapes = [_shape(text) for text in options.inputs or ()]
        written = convert(path, output, to=options.to, shapes=shapes, platforms=platforms)
    except ConversionError as error:
        print(f"bridge convert: {path}: {error}", file=sys.stderr)
        return 1
    except (NotImplementedError, SavedModelError) as error:  # a file bridge.load cannot read
        print(f"bridge convert: {error}", file=sys.stderr)
        return 2
    for name in written:
        print(f"bridge convert: wrote {name}")
    return 0


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
