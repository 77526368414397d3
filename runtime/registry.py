"""The mapping registry: one entry per torch operator overload, declared by `op_mappings`.

An entry is a pure JAX function taking the ATen op's arguments with tensors
replaced by `jax.Array`s. What is needed to run and check it (the overloads it
serves, its type-promotion kind, whether it draws random numbers) is declared
on it once, with `register_mapping`; promotion and result casting live here so
that entry bodies are only the computation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, NamedTuple, Optional

import jax
import numpy as np
import torch
from torch._ops import OpOverload, OpOverloadPacket

from . import dtypes
from .config import settings


# What torch's meta kernel of an op cannot be trusted for (the runtime checks each mapping's
# result against the meta kernel the first time a signature is seen):
#   "data-dependent": the result's shape or value depends on the data; no meta result is made.
#   "stricter": the meta kernel refuses calls the kernels take (_grouped_mm's takes bfloat16
#       only); the entry checks its arguments itself, with torch's messages.
#   "shape-differs": the meta kernel gives another shape than the CPU and CUDA kernels, which
#       are the oracle; the meta kernel still checks the arguments.
Meta = Optional[Literal["data-dependent", "stricter", "shape-differs"]]


class Vjp(NamedTuple):
    """A derivative given as torch's formula (see `_differentiate_as_torch`): `save(args, kwargs,
    out)` returns the arrays torch's formula saves, `backward(saved, cotangent, args, kwargs)`
    the gradient of each array argument in order (None: zeros)."""

    save: Callable[..., tuple]
    backward: Callable[..., tuple]


@dataclasses.dataclass(frozen=True)
class Mapping:
    """An op's whole record: its JAX entry and every fact the runtime needs about it."""

    op: OpOverload
    body: Callable  # the entry as written in op_mappings
    call: Callable  # body wrapped with type promotion (and a custom vjp); what dispatch runs
    promote: Optional[str]
    rng: bool
    family: str
    # Names of arguments the op writes besides its outputs (running stats of batch norm):
    # the body returns (outputs, {name: new value}) and the runtime writes them back.
    mutates: tuple[str, ...] = ()
    meta: Meta = None
    # A view that, at equal shapes, is the whole base in order: it adds no step to a view chain.
    identity_view: bool = False
    # Settings the body reads besides its arguments ("precision": torch's float32 matmul and
    # cuDNN TF32 settings): compiled programs of the op are keyed on them.
    reads: tuple[str, ...] = ()
    # The op takes host tensors beside bridge tensors as torch's does beside CUDA tensors (indices,
    # the source of a copy) rather than refusing them with torch's two-device error.
    host_tensors: bool = False
    # "torch": inside differentiated captured regions the op takes torch's derivative formula
    # (runtime/torch_gradients.py), where JAX's differs (at 0, at bounds, special arguments);
    # a Vjp: the body's derivative is that formula, traced into the region.
    gradient: Any = None


@dataclasses.dataclass(frozen=True)
class Traits:
    """Facts about an op that has no mapping (it decomposes, or falls back to the CPU)."""

    meta: Meta = None
    # Output positions that torch keeps on the host whatever the inputs' device.
    host_outputs: tuple[int, ...] = ()
    # "torch": its decomposition is differentiated by torch's formula for the op itself.
    gradient: Optional[str] = None
    # As Mapping.host_tensors (in-place and copy ops that the runtime derives).
    host_tensors: bool = False


# Ops with no entry in the tables and something the runtime must know about them.
OP_TRAITS: dict[OpOverload, Traits] = {}

MAPPINGS: dict[OpOverload, Mapping] = {}


def _operand_positions(op, names):
    """(position, name) of the arguments that take part in type promotion."""
    chosen = []
    for position, argument in enumerate(op._schema.arguments):
        if names is not None:
            if argument.name in names:
                chosen.append((position, argument.name))
            continue
        kind = str(argument.type)
        if kind.startswith("Optional[") and kind.endswith("]"):
            kind = kind[len("Optional[") : -1]
        if argument.kwarg_only:
            continue
        if kind == "Tensor" or kind in ("Scalar", "number", "float", "int"):
            chosen.append((position, argument.name))
    return tuple(chosen)


def _promoting(body, op, kind, names):
    positions = _operand_positions(op, names)

    def call(*args, **kwargs):
        operands = []
        for position, name in positions:
            if position < len(args):
                operands.append(args[position])
            elif name in kwargs:
                operands.append(kwargs[name])
        compute, result = dtypes.elementwise_dtypes(kind, operands)
        compute_jax = dtypes.TORCH_TO_JAX[compute]
        if any(getattr(value, "dtype", compute_jax) != compute_jax for value in operands):
            # torch first brings every operand to the common dtype (a float64 0-dim tensor
            # beside bfloat16 is rounded to bfloat16), then computes in the wider compute dtype.
            common_jax = dtypes.TORCH_TO_JAX[dtypes.result_type(operands)] if compute != result else None
            args = list(args)
            for position, name in positions:
                if position < len(args):
                    args[position] = _cast(_cast(args[position], common_jax), compute_jax)
                elif name in kwargs:
                    kwargs[name] = _cast(_cast(kwargs[name], common_jax), compute_jax)
        out = body(*args, **kwargs)
        result_jax = dtypes.TORCH_TO_JAX[result]
        if out.dtype != result_jax:
            out = out.astype(result_jax)
        return out

    return call


def _cast(value, dtype):
    # (A Python float, or a tracer standing for one, is left for jnp to convert as a weak scalar.)
    if dtype is not None and hasattr(value, "dtype") and value.dtype != dtype and not dtypes.is_lifted_float(value):
        return value.astype(dtype)
    return value


MISSING_OPS: set[str] = set()  # every operator name the tables asked for and the installed torch lacks


class MissingOp:
    """An operator (or overload) the installed torch does not have; registering it does nothing.

    The tables name ops of every supported torch; an op added in a later release, or removed
    in one, must not stop the tables from loading. Each name is recorded in `MISSING_OPS`, which
    a test holds against runtime/versions.py's list of such ops, so that a typo does not pass
    for a version difference.
    """

    def __init__(self, name):
        self.name = name
        MISSING_OPS.add(name)

    def __getattr__(self, attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return MissingOp(f"{self.name}.{attribute}")

    def overloads(self):
        return []

    def __repr__(self):
        return f"MissingOp({self.name})"


class TolerantPacket:
    """An `OpOverloadPacket` whose missing overloads are MissingOps."""

    def __init__(self, packet):
        self.packet = packet

    def __getattr__(self, name):
        try:
            return getattr(self.packet, name)
        except AttributeError:
            if name.startswith("__"):
                raise
            return MissingOp(f"{self.packet._qualified_op_name}.{name}")

    def __repr__(self):
        return repr(self.packet)


class TolerantNamespace:
    """`torch.ops.aten` for the tables: ops missing from the installed torch are MissingOps."""

    def __init__(self, namespace, name):
        self._namespace = namespace
        self._name = name

    def __getattr__(self, name):
        try:
            packet = getattr(self._namespace, name)
        except AttributeError:
            if name.startswith("__"):
                raise
            return MissingOp(f"{self._name}.{name}")
        return TolerantPacket(packet) if isinstance(packet, OpOverloadPacket) else packet


aten = TolerantNamespace(torch.ops.aten, "aten")
prims = TolerantNamespace(torch.ops.prims, "prims")


def _overloads(op):
    if isinstance(op, TolerantPacket):
        op = op.packet
    if isinstance(op, MissingOp):
        return []
    if isinstance(op, OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    if isinstance(op, OpOverload):
        return [op]
    raise TypeError(f"register_mapping takes ATen operators (aten.add, aten.add.Tensor), not {op!r}")


def register_mapping(
    *ops: Any,
    promote: Optional[str] = None,
    operands: Optional[tuple[str, ...]] = None,
    rng: bool = False,
    mutates: tuple[str, ...] = (),
    family: Optional[str] = None,
    meta: Meta = None,
    identity_view: bool = False,
    reads: tuple[str, ...] = (),
    host_tensors: bool = False,
    gradient: Any = None,
) -> Callable[[Callable], Callable]:
    """Declare a JAX function as the mapping of one or more ATen ops, with every fact the runtime
    needs about them: the one place an op's story is told.

    ops: `OpOverload`s, or `OpOverloadPacket`s meaning every overload they have
        except `out=` and in-place ones, which the runtime derives from the
        functional entry.
    promote: a promotion kind of `runtime.dtypes` (DEFAULT, INT_TO_FLOAT,
        ALWAYS_BOOL, ...): operands are cast to the dtype torch computes in and
        the result to the dtype torch returns, so the body need not.
    operands: names of the arguments that take part in promotion (default:
        the positional Tensor and Scalar arguments).
    rng: the body takes a `key=` keyword with a fresh JAX PRNG key.
    mutates: for ops that write some arguments in place besides `self`/`out=`
        (batch norm's running stats): the body returns `(result, {name: value})`
        and the runtime writes each value into that argument.
    meta: what torch's meta kernel cannot be trusted for (see `Meta`).
    identity_view: a view that is its whole base at equal shapes (view, expand, squeeze).
    reads: settings the body reads besides its arguments: ("precision",) for bodies that
        call `precision.matmul_precision()` or `precision.conv_precision()`.
    host_tensors: the op takes host tensors beside bridge tensors, as torch's takes host
        tensors beside CUDA ones (indices, a copy's source).
    gradient: "torch" (torch's derivative formula inside captured regions) or a `Vjp`.
    """
    if gradient is not None and gradient != "torch" and not isinstance(gradient, Vjp):
        raise TypeError(f"gradient= takes 'torch' or a Vjp, not {gradient!r}")

    def decorate(body: Callable) -> Callable:
        for packet_or_op in ops:
            is_packet = isinstance(packet_or_op, (OpOverloadPacket, TolerantPacket))
            for op in _overloads(packet_or_op):
                if is_packet and _is_derived_variant(op) and not mutates:
                    continue
                call = body if promote is None else _promoting(body, op, promote, operands)
                if isinstance(gradient, Vjp):
                    call = _differentiate_as_torch(call, gradient)
                MAPPINGS[op] = Mapping(
                    op=op,
                    body=body,
                    call=call,
                    promote=promote,
                    rng=rng,
                    family=family or body.__module__.rsplit(".", 1)[-1],
                    mutates=tuple(mutates),
                    meta=meta,
                    identity_view=identity_view,
                    reads=tuple(reads),
                    host_tensors=host_tensors,
                    gradient=gradient,
                )
        return body

    return decorate


def register_traits(
    *ops: Any,
    meta: Meta = None,
    host_outputs: tuple[int, ...] = (),
    gradient: Optional[str] = None,
    host_tensors: bool = False,
) -> None:
    """Declare facts about ops that have no mapping (OP_TRAITS); packets mean their functional
    overloads."""
    for packet_or_op in ops:
        is_packet = isinstance(packet_or_op, (OpOverloadPacket, TolerantPacket))
        for op in _overloads(packet_or_op):
            if not (is_packet and _is_derived_variant(op)):
                OP_TRAITS[op] = Traits(
                    meta=meta, host_outputs=tuple(host_outputs), gradient=gradient, host_tensors=host_tensors
                )


_NO_FACTS = Traits()


def _facts(op: OpOverload) -> Any:
    """The record that holds `op`'s facts: its Mapping, else its Traits, else one with none."""
    return MAPPINGS.get(op) or OP_TRAITS.get(op, _NO_FACTS)


def meta_of(op: OpOverload) -> Meta:
    """What torch's meta kernel cannot be trusted for in `op` (see `Meta`), mapped or not."""
    return _facts(op).meta


# Entries for operators of other libraries (`transformers::grouped_mm_fallback`), by qualified
# name: such an operator exists only once its library registered it, which may be after the
# tables load, so its entry is made when it first reaches the bridge (mapping_of).
NAMED_MAPPINGS: dict = {}


def register_named_mapping(name: str, family: Optional[str] = None) -> Callable[[Callable], Callable]:
    """Declare a JAX function as the mapping of another library's operator, by its qualified name
    ('namespace::name'); every overload it has takes it."""

    def decorate(body):
        NAMED_MAPPINGS[name] = (body, family or body.__module__.rsplit(".", 1)[-1])
        return body

    return decorate


def mapping_of(op: OpOverload) -> Optional[Mapping]:
    """The table entry of an OpOverload: its own, or the one declared for its qualified name."""
    mapping = MAPPINGS.get(op)
    if mapping is None and op.name() in NAMED_MAPPINGS:
        body, family = NAMED_MAPPINGS[op.name()]
        mapping = MAPPINGS[op] = Mapping(op=op, body=body, call=body, promote=None, rng=False, family=family)
    return mapping


def takes_host_tensors(op: OpOverload) -> bool:
    """Whether `op` takes host tensors beside bridge tensors (see Mapping.host_tensors)."""
    return _facts(op).host_tensors


def takes_torch_gradient(op: OpOverload) -> bool:
    """Whether `op` takes torch's derivative formula inside differentiated captured regions."""
    return _facts(op).gradient == "torch"


def _differentiate_as_torch(inner: Callable, vjp: Vjp) -> Callable:
    """Inside captured regions, have JAX differentiate a mapping as torch's autograd does.

    JAX differentiating a mapping's body keeps whatever intermediate values the body's
    primitives need (a tanh GELU keeps four tensors the size of its input) and rounds the
    gradient its own way. With this, the mapping gets a custom vjp: the forward keeps what
    torch's derivative formula saves, `save(args, kwargs, out)` (a tuple of arrays), and the
    backward is that formula, `backward(saved, cotangent, args, kwargs)`, which returns the
    gradient of each array argument in order (None: zeros). In `args` and `kwargs` the
    backward sees the op's arguments, its arrays replaced by their `jax.ShapeDtypeStruct`s.
    Outside captured regions nothing changes: torch's autograd calls the backward op itself.
    """
    save, backward = vjp

    def call(*args, **kwargs):
        if not settings.tracing:
            return inner(*args, **kwargs)
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

        def rebuild(arrays):
            filled = list(leaves)
            for position, array in zip(positions, arrays):
                filled[position] = array
            return jax.tree_util.tree_unflatten(tree, filled)

        avals = [jax.ShapeDtypeStruct(leaves[position].shape, leaves[position].dtype) for position in positions]
        statics = rebuild(avals)

        @jax.custom_vjp
        def function(*arrays):
            inner_args, inner_kwargs = rebuild(arrays)
            return inner(*inner_args, **inner_kwargs)

        def forward(*arrays):
            inner_args, inner_kwargs = rebuild(arrays)
            out = inner(*inner_args, **inner_kwargs)
            return out, save(inner_args, inner_kwargs, out)

        def pull(saved, cotangent):
            # The barrier keeps XLA from merging the backward's recomputation with the forward's
            # computation: in a one-program forward and backward it otherwise keeps the forward's
            # intermediates alive for the backward (a tanh GELU's float32 tanh, 100 MB a layer
            # in GPT-2 small's bf16 step, where torch's formula saves the bf16 input alone).
            saved = jax.lax.optimization_barrier(saved)
            grads = backward(saved, cotangent, *statics)
            return tuple(_cotangent(grad, aval.shape, aval.dtype) for grad, aval in zip(grads, avals))

        function.defvjp(forward, pull)
        return function(*(leaves[position] for position in positions))

    return call


def _cotangent(grad, shape, dtype):
    if not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
        return np.zeros(shape, jax.dtypes.float0)  # what JAX takes for integer arguments
    return jax.numpy.zeros(shape, dtype) if grad is None else grad.astype(dtype)


def _is_derived_variant(op):
    schema = op._schema
    return any(argument.alias_info is not None and argument.alias_info.is_write for argument in schema.arguments)


def lookup(op: OpOverload) -> Optional[Mapping]:
    return MAPPINGS.get(op)


def jnp_dtype(torch_dtype: Optional[torch.dtype], default: Any = None) -> Any:
    """Helper for entries with a `dtype=` argument."""
    if torch_dtype is None:
        return default
    return dtypes.TORCH_TO_JAX[torch_dtype]


__all__ = ["Mapping", "MAPPINGS", "Traits", "OP_TRAITS", "Vjp", "register_mapping", "register_traits", "lookup", "jnp_dtype"]
