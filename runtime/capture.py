"""Captured execution: a region of torch code traced once into `jax.jit` programs, then replayed.

A region is a Python callable over bridge tensors (a module's forward, a function given to
`torch.compile`). The first call with a given structure runs the callable once with tensors
whose values are JAX tracers: every torch op dispatches into the mapping tables as usual, and
the result is one XLA program. Later calls with the same structure replay that program
without running the region's Python.

What a program reads and writes:
- its inputs: the tensor arguments (fresh tensors during the trace; an input written in
  place is written back to the caller's tensor after each run);
- its state: the roots of parameters, buffers and any other bridge tensor the region reads
  (found during the trace: a concrete value read while tracing means a tensor from outside
  the region; the trace is then redone with that tensor as state); state written in place
  (BatchNorm's running statistics) comes back as outputs and is written after each run;
- the RNG key, so random ops draw fresh numbers on every replay.

With autograd recording, the program is split into a forward that also returns the
residuals of `jax.vjp` (settings.residuals: the results of matmuls and convolutions, the
backward recomputing the rest; all of JAX's residuals; or none), and a backward program; a
`torch.autograd.Function` links them to torch's graph, with the state tensors that require
grad (parameters) as its inputs, so `.grad` accumulates as in eager torch. Double backward
(create_graph) goes through a second Function that differentiates the backward program with
JAX.

A region whose trace fails (data-dependent Python control flow, `.item()`, an op with no
traceable mapping) is a graph break: it is recorded with the user's line and the reason,
and that region runs eagerly from then on.
"""

import collections
import copy
import dataclasses
import functools
import gc
import itertools
import operator
import os
import time
import traceback
import weakref
from typing import NamedTuple

import jax
import jax.extend.core as jax_core
import torch
import torch.autograd.forward_ad as _forward_ad
from torch.utils import _pytree as pytree

from . import bounds, deferred, flat, precision, random, views
from . import tensor as tensor_module
from .callsite import _is_library
from .config import KEEP_FOR_BACKWARD, settings
from .errors import GraphBreak
from .tensor import BridgeTensor, host_array, read_value, root_of, when_freed, write_value

# Programs kept per region before it is left to run eagerly (torch.compile's cache_size_limit).
MAX_PROGRAMS = 8
# Programs kept per call structure for different values needed on the host (guards), as
# torch.compile keeps a code object's compiled entries up to its cache size limit (8).
MAX_VARIANTS = 8
# Traces redone to take in tensors found from outside the region.
MAX_RETRACES = 3
# Eager runs of a region to learn the values its code needs on the host (Region._learn).
MAX_LEARNS = 4


class _FreeTensors(Exception):
    """Raised at the end of a trace that read tensors from outside the region."""


# ---------------------------------------------------------------- the trace in progress

_trace = None  # the _Trace being recorded, or None
_recording = None  # the _Recorder of a region's eager run that learns its host values, or None


_FLOAT_NEEDED = (
    "a {kind} value computed in the region is needed on the host (.item()): a compiled program is kept for "
    "the bool and integer values it was traced with, not for other values"
)


class _NeedsHostValues(Exception):
    """A trace met a value needed on the host (`bool(t)`, `t.item()`) that it has no value for."""


class EagerRunFirst(GraphBreak):
    """Raised in a region's trace by something that one eager run of the region settles: an op
    with no mapping inside a module that the bridge exports whole at its next call
    (bridge/whole_module.py). That call runs eagerly and the next one traces again; after
    MAX_LEARNS such calls the region breaks."""


class _GuardFailed(Exception):
    """A program's values needed on the host came out other than those it was traced with."""


def tracing_or_learning():
    """Whether a region's code runs to be captured: traced, or run eagerly to learn the values it
    needs on the host (library code must take the same paths in both)."""
    return settings.tracing > 0 or _recording is not None


class _Recorder:
    """The values a region's eager run asked for on the host, in order (its `.item()`s)."""

    def __init__(self):
        self.values = []

    def __call__(self, plan, args, kwargs):
        value = plan(args, kwargs)
        self.values.append(value)
        return value


def tracing():
    return _trace is not None


def gradient_only_where(flag, tensors):
    """In a trace: the region's gradients for `tensors` (its parameters) are given only where the
    traced 0-dim bool `flag` comes out true in a run; where it is false the region's backward
    gives them None, as torch's autograd does for parameters that took no part in a call (an
    expert that got no token, whose loop iteration torch never ran). The program returns the
    flag beside its guards. Outside traces: nothing."""
    if _trace is not None:
        _trace.presence.append((read_value(flag).reshape(()), list(tensors)))


class _Trace:
    """Bookkeeping of one trace: which roots are state, which outside roots were touched."""

    def __init__(self, roots, learned=None):
        self.known = {id(root) for root in roots}
        self.free = {}  # id -> (root, value, generation) of outside roots, as they were
        self.learned = learned  # the values the region's code needed on the host, as learned
        self.position = 0  # how many of them this trace has asked for
        self.guards = []  # the traced values it took learned values for (the program returns them)
        self.presence = []  # (traced bool, tensors): gradient_only_where's, in order
        self.expected = []  # the learned value of each
        self.input_positions = {}  # id of each input tensor of the body -> its position
        self.bounds = []  # (input position, bounds.Check, where): index checks of the inputs

    def bound(self, index, check, op):
        """An index op's bounds (runtime/bounds.py), kept where its index is an input of the
        region (or a view of one with all its elements): each call checks the input's host value."""
        position = bounds.input_of(index, self.input_positions)
        if position is not None:
            record = (position, check, bounds.where(op))
            if record not in self.bounds:
                self.bounds.append(record)

    def host_value(self, plan, args, kwargs):
        """A value the region's code needs on the host: a traced bool or integer is taken as
        learned (the program returns it, and a run that computes another is redone, see
        _check_guards); a constant of the trace is computed."""
        position = self.position
        self.position += 1
        array = read_value(args[0])
        if not isinstance(array, jax.core.Tracer):
            return plan(args, kwargs)
        if self.learned is None or position >= len(self.learned):
            raise _NeedsHostValues(position)
        value = self.learned[position]
        if type(value) not in (bool, int):
            raise GraphBreak(_FLOAT_NEEDED.format(kind=type(value).__name__))
        self.guards.append(array.reshape(()))
        self.expected.append(value)
        return value

    def touch(self, tensor):
        root = root_of(tensor)
        key = id(root)
        if key in self.known or key in self.free:
            return
        if isinstance(root._value, jax.core.Tracer):
            return  # made inside the trace
        self.free[key] = (root, root._value, root._generation)

    def restore_free(self):
        for root, value, generation in self.free.values():
            root._value = value
            # Past every generation the trace gave it: an alias read or written during the
            # trace remembers the generation it saw, with a traced value.
            root._generation = max(root._generation, generation) + 1


# ---------------------------------------------------------------- structure of a call


def _is_float(dtype):
    return dtype.is_floating_point or dtype.is_complex


def _leaf_key(leaf):
    if isinstance(leaf, _Carried):
        return ("C", leaf.description)
    if isinstance(leaf, BridgeTensor):
        return ("T", tuple(leaf.shape), leaf.dtype, leaf.requires_grad, leaf._index)
    if isinstance(leaf, torch.Tensor):
        raise GraphBreak("an argument is a tensor on the host CPU, not on the bridge device")
    if isinstance(leaf, float):
        return (type(leaf), leaf.hex())  # -0.0 is not 0.0 to a program; NaN never equals itself
    if not isinstance(leaf, _STATIC_TYPES):
        # An object passed by identity (a key-value cache, a config) may be changed by the
        # region's Python, which a replay would not run, and hashes by identity, which would
        # compile anew on every call: the region runs eagerly instead.
        raise GraphBreak(f"an argument of type {type(leaf).__name__} is an object the region may change")
    return (type(leaf), leaf)


class Static:
    """A hashable value a region's caller passes whole as one static argument (a pytree leaf):
    part of the program's key, not flattened on every call."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value = value
        self._hash = hash(value)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, Static) and self._hash == other._hash and self.value == other.value


# Python values a program can be specialized on (they are part of its key).
_STATIC_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.memory_format, torch.layout, type(Ellipsis), slice, Static)


# ---------------------------------------------------------------- argument objects carried through a region
#
# An argument object that holds tensors (HF's StaticCache, whose layers keep key and value
# tensors that each decoding step writes in place) is carried: its tensors become inputs of the
# program (written back after each run, as any input written in place), its other attributes
# part of the program's key, and the trace runs on a copy of it holding the trace's tensors. A
# call that changes the object's attributes (a lazy initialization) is traced too: the program
# gives the caller's object the state the call left (_Reshaped); calls that each change it
# (DynamicCache's `keys = torch.cat(...)` on every token) run op by op, on the object itself.

_CARRIED_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
_SLOT = object()  # where a carried object's copy takes a tensor
_HOST_VALUES = 16  # a carried host tensor of at most this many elements is keyed by its values


class _NotCarried(Exception):
    pass


class _CarriedChanged(Exception):
    """A trace changed the attributes of an argument object it carries (or the object holds a
    host tensor); args: the object's type name, why."""


_CHANGED = {
    "changes its attributes": (
        "changes the attributes of its argument {name} (HF's DynamicCache grows its tensors with torch.cat on "
        "every token); HF's cache_implementation='static' keeps them in place"
    ),
    "holds a tensor on the host CPU": "passes an argument {name} that holds a tensor on the host CPU; move it to the device",
}


def _describe_carried(value, tensors, depth=0):
    """The structure of a carried object (hashable: types, plain values, tensor slots), its
    tensors appended to `tensors` in order; _NotCarried for anything else it holds."""
    if isinstance(value, BridgeTensor):
        tensors.append(value)
        return "T"
    if isinstance(value, torch.Tensor):
        # A host tensor: a trace keeps its value as a constant. A small one of integers (a
        # counter of a cache not yet initialized, as HF's StaticCache holds) is part of the key
        # by its values, as value guards specialize on integers (MAX_PROGRAMS bounds how many);
        # for others no program is kept (see _check_carried).
        if (
            value.numel() <= _HOST_VALUES
            and value.layout == torch.strided
            and not (value.is_floating_point() or value.is_complex())
        ):
            return ("h", tuple(value.shape), value.dtype, tuple(value.reshape(-1).tolist()))
        return ("H", tuple(value.shape), value.dtype)
    if isinstance(value, _CARRIED_PLAIN):
        return (type(value), value.hex() if isinstance(value, float) else value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_describe_carried(item, tensors, depth) for item in value))
    if isinstance(value, dict) and all(isinstance(key, (str, int)) for key in value):  # EncoderDecoderCache's is_updated: {layer: bool}
        return (dict, tuple((key, _describe_carried(item, tensors, depth)) for key, item in value.items()))
    if (
        depth < 3
        and not isinstance(value, (torch.Tensor, torch.nn.Module, type))
        and not callable(value)
        and isinstance(getattr(value, "__dict__", None), dict)
    ):
        return (type(value), tuple((key, _describe_carried(item, tensors, depth + 1)) for key, item in vars(value).items()))
    raise _NotCarried


def _slotted_copy(value, tensors=()):
    """A deep copy of a carried object (or of a template holding slots) with _SLOT where it
    holds one of `tensors`; a slot stays the one _SLOT."""
    return copy.deepcopy(value, memo={id(_SLOT): _SLOT, **{id(tensor): _SLOT for tensor in tensors}})


def _fill(value, tensors):
    """A carried object's copy with its tensor slots filled from `tensors`, in order."""
    if value is _SLOT:
        return next(tensors)
    if isinstance(value, list):
        value[:] = [_fill(item, tensors) for item in value]
    elif isinstance(value, tuple):
        return type(value)(_fill(item, tensors) for item in value) if not hasattr(value, "_fields") else type(value)(*(_fill(item, tensors) for item in value))
    elif isinstance(value, dict):
        for key in value:
            value[key] = _fill(value[key], tensors)
    elif isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, _CARRIED_PLAIN):
        for key, item in list(vars(value).items()):
            setattr(value, key, _fill(item, tensors))
    return value


class _Carried:
    """In a call's leaves, where a carried object stands: its structure (part of the key) and
    the object (weakly: a program keeps this leaf), whose copy the trace runs on."""

    def __init__(self, description, source, count):
        self.description, self.source, self.count = description, source, count

    def __eq__(self, other):
        return isinstance(other, _Carried) and other.description == self.description

    def __hash__(self):
        return hash(self.description)

    def rebuild(self, tensors):
        """A copy of the object holding these tensors (the trace's) where it holds its own."""
        source = self.source()
        if source is None:
            raise GraphBreak("an argument object the region carries was freed before its trace")
        held = []
        _describe_carried(source, held)
        return _fill(_slotted_copy(source, held), iter(tensors))


class _CarriedOut:
    """In a program's outputs, where the region returns a carried object (a model returning its
    cache): the caller's object is returned there."""

    def __init__(self, number):
        self.number = number


def _carry(leaves):
    """The call's leaves with each argument object made of plain values, tensors and such
    objects (to a depth of 3) replaced by a _Carried, those objects' bridge tensors in order,
    and the objects; other leaves stay (and break the region: see _leaf_key)."""
    carried, tensors, objects = None, [], []
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, _STATIC_TYPES) or isinstance(leaf, torch.Tensor) or not isinstance(getattr(leaf, "__dict__", None), dict):
            continue
        held = []
        try:
            description = _describe_carried(leaf, held)
            source = weakref.ref(leaf)
        except (_NotCarried, TypeError):
            continue
        carried = list(leaves) if carried is None else carried
        carried[position] = _Carried(description, source, len(held))
        tensors.extend(held)
        objects.append(leaf)
    return (leaves if carried is None else carried), tensors, objects


def _context_key():
    """What else changes a trace: grad mode, autocast, matmul precision, default dtype."""
    return (
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.get_default_dtype(),
    )


class _StateKey(tuple):
    """_state_key's tuple, hashed once: a region's call looks its program up by a key holding it,
    and hashing GPT-2's 148 view chains again on every step cost the host 0.1 ms."""

    def __hash__(self):
        known = self.__dict__.get("hash")
        if known is None:
            known = self.__dict__["hash"] = tuple.__hash__(self)
        return known


def _state_key(roots, owners):
    # (a member of a flat root is its own root here: its flat root's identity says which pack it is in)
    return _StateKey(
        (id(root), id(owner), owner.requires_grad, root.dtype, tuple(root.shape), root._index, tuple(owner._chain),
         id(owner._root) if root is owner and owner._chain else 0)
        for root, owner in zip(roots, owners)
    )


def describe_change(old, new):
    """Which part of a region's key changed between two compiles, in words."""
    names = ("argument structure, shapes or dtypes", "grad mode, autocast or precision settings", "module state")
    parts = [name for name, before, after in zip(names, old, new) if before != after]
    return ", ".join(parts) or "a new structure"


_requires_grad = operator.attrgetter("requires_grad")
_ROOT = operator.attrgetter("_root")
_instance_dict = operator.attrgetter("__dict__")


class _StateCache:
    """A region's state roots, owners and key for one list of state tensors. They hold while
    the same tensors have the same roots and grad flags, no tensor's sizes, dtype or device
    changed in place (runtime.tensor.layout_changes), and no root was swapped for another
    tensor (torch.utils.swap_tensors, as Module.to uses it, swaps their __dict__s)."""

    def __init__(self, tensors, roots, owners, key):
        self.tensors = tensors
        self.tensor_roots = [tensor._root for tensor in tensors]  # (None for a tensor that is a root)
        self.requires_grad = [tensor.requires_grad for tensor in tensors]
        self.root_dicts = [root.__dict__ for root in roots]
        self.layout_changes = tensor_module.layout_changes
        self.roots, self.owners, self.key = roots, owners, key

    def holds(self, tensors):
        return (
            self.layout_changes == tensor_module.layout_changes
            and len(tensors) == len(self.tensors)
            and all(map(operator.is_, tensors, self.tensors))
            and all(map(operator.is_, map(_ROOT, tensors), self.tensor_roots))
            and all(map(operator.is_, map(_instance_dict, self.roots), self.root_dicts))
            and list(map(_requires_grad, tensors)) == self.requires_grad
        )


# ---------------------------------------------------------------- a compiled program


@dataclasses.dataclass
class Program:
    """One compiled structure of a region."""

    roots: list  # state roots, in the order of the program's state arguments
    owners: list  # per root, the tensor autograd knows (a parameter aliasing the root)
    spec: object  # pytree spec of (args, kwargs)
    statics: list  # the non-tensor leaves of (args, kwargs), tensors as None
    tensor_positions: list  # positions of tensor leaves
    input_indices: list  # bridge device ordinals of the tensor leaves
    grad: bool  # built for autograd (split forward/backward)
    diff_roots: list = None  # positions in roots differentiated
    diff_inputs: list = None  # positions in tensor leaves differentiated
    forward: object = None  # jitted: outputs and vjp residuals (split runs)
    backward: object = None  # jitted: the pullback (split runs)
    primal: object = None  # jitted: the differentiable body's outputs only
    infer: object = None  # jitted, no autograd
    index: int = 0
    body: object = None  # the traced Python body (_trace_body; its `traced` is its last trace's record)
    traced: "Traced" = None  # what the first trace of the body learned, set by Region._compile
    differentiable: object = None  # the body as a function of the differentiated values
    fused: object = None  # jitted: forward and the gradients of one scalar output
    recompute: object = None  # jitted: the vjp from the primals (after a fused forward)
    speculate: int = None  # the scalar output whose gradients fused runs compute, or None
    reach: list = None  # per float output, the positions among the differentiated values it depends on
    backward_ahead: bool = False  # compile the backward before the first split forward runs
    learned: list = None  # the values the region's code needed on the host, as its eager run gave them
    owner_views: bool = False  # an owner is a view into its root (its gradient is cut from the root's)
    packs: tuple = ()  # _Pack per flat root whose members are roots here (runtime/flat.py)
    packed: frozenset = frozenset()  # the positions in roots of those members
    joinable: dict = dataclasses.field(default_factory=dict)  # fused output -> _joinable's answer

    # What the trace learned, read through the record (Traced).
    out_spec = property(lambda self: self.traced.out_spec)
    out_statics = property(lambda self: self.traced.out_statics)
    out_tensor_positions = property(lambda self: self.traced.out_tensor_positions)
    out_float = property(lambda self: self.traced.out_float)
    out_shapes = property(lambda self: self.traced.out_shapes)
    mutated_roots = property(lambda self: self.traced.mutated_roots)
    pack_writes = property(lambda self: self.traced.pack_writes)
    mutated_inputs = property(lambda self: self.traced.mutated_inputs)
    expected = property(lambda self: self.traced.expected)
    presence = property(lambda self: self.traced.presence)
    reshaped = property(lambda self: self.traced.reshaped)
    stored = property(lambda self: self.traced.stored)


@dataclasses.dataclass(frozen=True)
class Traced:
    """What a trace of a region's body learned about its call: the output structure, which
    state it writes, what it needed on the host. Each trace leaves it as the body's `traced`
    (_trace_body); the program keeps the first."""

    out_spec: object  # pytree spec of the region's result
    out_statics: tuple  # the result's non-tensor leaves, tensors as None, carried objects as _CarriedOut
    out_tensor_positions: tuple  # positions of tensor leaves in the result
    out_float: tuple  # per tensor output: differentiable (floating) or not
    out_shapes: tuple
    mutated_roots: tuple  # positions of the state roots the body writes (but those of pack_writes)
    pack_writes: tuple  # the packs (indices in Program.packs) written whole: their flat arrays, after mutated_roots'
    mutated_inputs: tuple  # positions of the input tensors it writes
    expected: tuple  # the host values the trace took as learned (its guards'), in order
    presence: tuple  # per gradient_only_where call: the positions of its tensors' roots
    reshaped: dict  # per carried object the call changes: its state after the call (_Reshaped)
    stored: tuple  # the tensors the forward stores on its modules (_Stored), outputs after the result's
    bounds: tuple = ()  # (input position, bounds.Check, where) of each index op on an input


def _traced(value):
    """Whether a value (or a list, tuple or dict of values) holds a tensor made in a trace."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, BridgeTensor) and isinstance(leaf._value, jax.core.Tracer):
            return True
    return False


class _AttributeWatch:
    """The attributes (and buffers) of the region's modules before a trace. A forward that
    stores a tensor it computed (`self.src_mask = mask`, a mask made on the first call and kept)
    would leave a tracer there: the attribute is put back as it was, and the tensor becomes an
    output of the program, which stores it after each run (_Stored)."""

    def __init__(self, objects):
        self.saved = [(obj, dict(vars(obj)), dict(getattr(obj, "_buffers", None) or {})) for obj in objects]

    def restore(self):
        """Put back every attribute that now holds a traced tensor; a _Stored for each."""
        changed = []
        for obj, attributes, buffers in self.saved:
            for kind, current, saved in (("attribute", vars(obj), attributes), ("buffer", getattr(obj, "_buffers", None), buffers)):
                for name, value in _put_back(current, saved) if current is not None else ():
                    changed.append(_Stored(obj, kind, name, value))
        return changed


class _Stored:
    """A tensor a forward stored on one of its modules: where (a weak reference to the module, an
    attribute or a buffer, the name), and in the trace the traced tensor."""

    def __init__(self, obj, kind, name, value):
        self.module, self.kind, self.name, self.value = weakref.ref(obj), kind, name, value
        self.label = f"{type(obj).__name__}.{name}"

    def apply(self, tensor):
        module = self.module()
        if module is not None:
            (module._buffers if self.kind == "buffer" else vars(module))[self.name] = tensor


def _put_back(current, saved):
    """Restore the entries of a dict that a trace set to traced tensors; (name, traced value)s."""
    found = []
    for name, value in list(current.items()):
        if (name not in saved or saved[name] is not value) and _traced(value):
            found.append((name, value))
            if name in saved:
                current[name] = saved[name]
            else:
                del current[name]
    return found


def _trace_body(function, program, watched=None):
    """The pure function of a region: (state values, input values, key) -> results. Each trace
    leaves what it learned as the function's `traced` (a Traced), for the caller to take."""

    def body(root_values, input_values, key):
        global _trace
        roots = program.roots
        saved = [(root._value, root._generation) for root in roots]
        # Members of flat roots (packs) are roots of their own while the body is traced.
        detached = [(root, root._root, root._chain) for root in roots if root._root is not None]
        trace = _Trace(roots, program.learned)
        previous_trace = _trace
        saved_key = random.swap_key(key)
        try:
            tensor_module.root_changed()
            for root, _, _ in detached:
                root._root, root._chain = None, ()
            for root, value in zip(roots, root_values):
                root._value = value
                root._generation += 1
            inputs = [BridgeTensor(value, index) for value, index in zip(input_values, program.input_indices)]
            # The inputs are the body's own, traced or not: a double backward runs the body under
            # jax.vjp outside jit, where its integer inputs (cross_entropy's targets) are arrays.
            trace.known.update(map(id, inputs))
            trace.input_positions = {id(tensor): position for position, tensor in enumerate(inputs)}
            leaves = list(program.statics)
            for position, tensor in zip(program.tensor_positions, inputs):
                leaves[position] = tensor
            extra, copies = iter(inputs[len(program.tensor_positions) :]), []
            for position, leaf in enumerate(leaves):
                if isinstance(leaf, _Carried):
                    given = [next(extra) for _ in range(leaf.count)]
                    leaves[position] = leaf.rebuild(given)
                    copies.append((leaf, leaves[position], given))
            args, kwargs = pytree.tree_unflatten(leaves, program.spec)
            # autocast caches the casts of parameters for the length of its block: a cast made
            # before the trace would enter it as a constant, and one made in it would leak.
            torch.clear_autocast_cache()
            _trace = trace
            previous_hooks = tensor_module.set_hooks(trace.touch, trace.host_value)
            previous_bounds, bounds.record_hook = bounds.record_hook, trace.bound
            settings.tracing += 1
            outer_for_grad = settings.tracing_for_grad
            settings.tracing_for_grad = program.grad
            watch = _AttributeWatch(watched()) if watched is not None else None
            try:
                # The script's grad mode, as in eager torch, so that its `torch.no_grad()`
                # blocks are seen (runtime.dispatch._cut_from_gradient), with torch's autograd
                # recording nothing: JAX differentiates the traced body. (A recorded graph would
                # hold the parameters from any trace tensor a script or an error keeps.) Below
                # autograd composite ops reach the bridge whole and decompose by torch's own
                # composite kernels (runtime.dispatch._make_plan), as above it.
                with torch.set_grad_enabled(program.grad), torch._C._AutoDispatchBelowAutograd():
                    result = function(*args, **kwargs)
            finally:
                settings.tracing -= 1
                settings.tracing_for_grad = outer_for_grad
                _trace = previous_trace
                tensor_module.set_hooks(*previous_hooks)
                bounds.record_hook = previous_bounds
                leaked = watch.restore() if watch is not None else []
            kept = [stored for stored in leaked if isinstance(stored.value, BridgeTensor)]
            if len(kept) < len(leaked):
                names = ", ".join(stored.label for stored in leaked if stored not in kept)
                raise GraphBreak(
                    f"the forward stores tensors it computes in {names} (not a tensor: a list or another "
                    "object holding them): a compiled replay would not store them, so the module runs eagerly"
                )
            if trace.free:
                raise _FreeTensors([entry[0] for entry in trace.free.values()])
            reshaped_objects = {}
            for number, (leaf, copied, given) in enumerate(copies):
                reshaped = _check_carried(leaf, copied, given)
                if reshaped is not None:
                    reshaped_objects[number] = reshaped
            if reshaped_objects or kept:
                # The new tensors of the objects the call changed and those it stored on its
                # modules: outputs after the result's.
                result = (result, [reshaped.new for reshaped in reshaped_objects.values()], [stored.value for stored in kept])
                for stored in kept:
                    stored.value = None  # the trace's tensor: not kept past the trace
            out_leaves, out_spec = pytree.tree_flatten(result)
            out_statics, positions, arrays = [], [], []
            returned = {id(copied): number for number, (_, copied, _) in enumerate(copies)}
            for position, leaf in enumerate(out_leaves):
                if id(leaf) in returned:
                    out_statics.append(_CarriedOut(returned[id(leaf)]))
                elif isinstance(leaf, BridgeTensor):
                    positions.append(position)
                    arrays.append(read_value(leaf))
                    out_statics.append(None)
                elif isinstance(leaf, torch.Tensor):
                    raise GraphBreak("the region returns a tensor on the host CPU")
                else:
                    out_statics.append(leaf)
            mutated_roots = {position for position, (root, value) in enumerate(zip(roots, root_values)) if root._value is not value}
            # A pack that covers its flat root, with members written (an optimizer step traced
            # whole): its new flat array, one output, in their stead.
            pack_writes = tuple(k for k, pack in enumerate(program.packs) if pack.order and mutated_roots & set(pack.positions))
            mutated_roots -= {position for k in pack_writes for position in program.packs[k].positions}
            traced = Traced(
                out_spec=out_spec,
                out_statics=tuple(out_statics),
                out_tensor_positions=tuple(positions),
                out_float=tuple(_is_float(tensor_module.JAX_TO_TORCH[array.dtype]) for array in arrays),
                out_shapes=tuple(tuple(array.shape) for array in arrays),
                mutated_roots=tuple(sorted(mutated_roots)),
                pack_writes=pack_writes,
                mutated_inputs=tuple(position for position, tensor in enumerate(inputs) if tensor._generation != 0),
                expected=tuple(trace.expected),
                presence=tuple(
                    tuple(places[id(root_of(tensor))] for tensor in tensors if id(root_of(tensor)) in places)
                    for places in [{id(root): position for position, root in enumerate(roots)}]
                    for _, tensors in trace.presence
                ),
                reshaped=reshaped_objects,
                stored=tuple(kept),
                bounds=tuple(trace.bounds),
            )
            mutated = [roots[position]._value for position in traced.mutated_roots]
            mutated += [flat.join([roots[p]._value for p in program.packs[k].order]) for k in pack_writes]
            written = [read_value(inputs[position]) for position in traced.mutated_inputs]
            body.traced = traced
            return arrays, mutated, written, random.current_key(), trace.guards + [flag for flag, _ in trace.presence]
        finally:
            torch.clear_autocast_cache()
            trace.restore_free()
            for root, (value, generation) in zip(roots, saved):
                root._value = value
                root._generation = max(root._generation, generation) + 1
            tensor_module.root_changed()
            for root, flat_root, chain in detached:
                root._root, root._chain, root._seen = flat_root, chain, -1  # read from the flat root again
            random.swap_key(saved_key)

    body.traced = None
    return body


def _holds_host_tensor(description):
    if isinstance(description, tuple):
        return (len(description) == 3 and description[0] == "H") or any(map(_holds_host_tensor, description))
    return False


def _check_carried(leaf, copied, given):
    """A carried object's copy after the trace: None where it has the same attributes, holding
    the same tensors (written in place or not); else its state after the call (_Reshaped). An
    object holding a host tensor, before or after, is not kept in a program (the trace would
    read it as a constant: _CarriedChanged), nor is one that came to hold what is not carried."""
    name = type(copied).__name__
    if _holds_host_tensor(leaf.description):
        raise _CarriedChanged(name, "holds a tensor on the host CPU")
    now = []
    try:
        description = _describe_carried(copied, now)
    except _NotCarried:
        raise _CarriedChanged(name, "changes its attributes") from None
    if description == leaf.description and len(now) == len(given) and all(a is b for a, b in zip(now, given)):
        return None
    if _holds_host_tensor(description):
        raise _CarriedChanged(name, "holds a tensor on the host CPU")
    return _Reshaped(copied, now, given)


class _Reshaped:
    """A carried object's state after a call that changed its attributes (a cache's lazy
    initialization on its first call, as torch.compile carries it): a copy with a slot where it
    holds a tensor, and per slot the caller's tensor it kept (("in", i): the i-th it was given)
    or a new one the program returns (("out", j)). Plain values set by the call are those of the
    trace, which the program's key and guards fix."""

    def __init__(self, copied, now, given):
        positions = {id(tensor): number for number, tensor in enumerate(given)}
        self.slots, self.new = [], []
        for tensor in now:
            if id(tensor) in positions:
                self.slots.append(("in", positions[id(tensor)]))
            else:
                self.slots.append(("out", len(self.new)))
                self.new.append(tensor)
        self.template = _slotted_copy(copied, now)

    def apply(self, target, given, new):
        """Give the caller's object `target` this state: `given` its tensors as the call found
        them, `new` the program's new tensors."""
        tensors = iter([given[i] if kind == "in" else new[i] for kind, i in self.slots])
        _transplant(target, _fill(_slotted_copy(self.template), tensors))


def _transplant(target, state):
    """Make `target` hold what `state` holds, keeping the identity of the objects, lists and
    dicts both have in the same place (a cache's layers stay the objects a caller may hold)."""
    if isinstance(target, list) and isinstance(state, list):
        target[:] = [_transplanted(old, new) for old, new in zip(target, state)] + state[len(target) :]
    elif isinstance(target, dict) and isinstance(state, dict):
        for key in [key for key in target if key not in state]:
            del target[key]
        for key, new in state.items():
            target[key] = _transplanted(target.get(key), new)
    else:
        attributes = vars(target)
        for key in [key for key in attributes if key not in vars(state)]:
            delattr(target, key)
        for key, new in vars(state).items():
            setattr(target, key, _transplanted(attributes.get(key), new))


def _transplanted(old, new):
    if type(old) is type(new) and (isinstance(new, (list, dict)) or (
        isinstance(getattr(new, "__dict__", None), dict) and not isinstance(new, (torch.Tensor,) + _CARRIED_PLAIN)
    )):
        _transplant(old, new)
        return old
    return new


def _split(values, positions):
    chosen = set(positions)
    return [values[i] for i in positions], [value for i, value in enumerate(values) if i not in chosen]


_last_collection = [0.0]  # seconds the last full collection took


def _collect_after(compile_seconds):
    """A full garbage collection after a long compile. Tracing and compiling leave many objects
    behind; left to Python's collector, they set off a full collection some steps later, in the
    middle of a training step, where here it falls in the compiling step. A full collection
    costs about 0.3 s with torch, JAX and transformers loaded, so it follows only compiles that
    took five times the last one (not each of a first call's many short cached ones)."""
    if compile_seconds < 5 * _last_collection[0]:
        return
    start = time.perf_counter()
    gc.collect()
    _last_collection[0] = time.perf_counter() - start


def _compiler_options(jaxpr):
    """XLA options for a program. float32 matmuls at torch's default precision (full float32,
    no autocast) run faster through cuBLAS than through XLA's Triton GEMM fusions, whose
    autotuning also multiplied GPT-2's first-step compile time; programs with convolutions keep
    Triton, which serves XLA's 1x1-convolution GEMMs best (measured on an H100: docs/design.md,
    "Measurements behind the choices")."""
    from jax import lax

    if (
        precision.matmul_precision() == lax.Precision.HIGHEST
        and not torch.is_autocast_enabled("cpu")
        and not _uses(jaxpr.jaxpr, "conv_general_dilated")
    ):
        return {"xla_gpu_enable_triton_gemm": False}
    return None


def _reach(jaxpr, program):
    """For each float output of a region, the differentiated values (positions in diff_roots
    then diff_inputs) it depends on through floating-point values and not through a detach:
    torch's autograd reaches a parameter only along such paths, and leaves the `.grad` of one it
    does not reach None. Along no such path can JAX's gradient be other than zero, so a None
    here never drops a gradient. Nested programs (jitted mappings, custom rules) count as
    depending on all their inputs."""
    n_roots = len(program.roots)
    invar_of = list(program.diff_roots) + [n_roots + i for i in program.diff_inputs]
    position_of = {id(jaxpr.invars[index]): k for k, index in enumerate(invar_of)}
    n_arrays = len(program.out_float)
    reach = []
    for output, is_float in zip(jaxpr.outvars[:n_arrays], program.out_float):
        if not is_float:
            continue
        needed = {id(output)} if isinstance(output, jax_core.Var) else set()
        for equation in reversed(jaxpr.eqns):
            if equation.primitive.name != "stop_gradient" and any(id(var) in needed for var in equation.outvars):
                for var in equation.invars:
                    if isinstance(var, jax_core.Var) and jax.numpy.issubdtype(var.aval.dtype, jax.numpy.inexact):
                        needed.add(id(var))
        reach.append(frozenset(k for key, k in position_of.items() if key in needed))
    return reach


def _gradients_out(program, given, values, index, absent=frozenset()):
    """Region gradients for torch: None for a differentiated value no output with a gradient
    reaches (torch leaves such a parameter's `.grad` None), or that the run marked absent
    (`gradient_only_where`), a tensor for the others."""
    reached = frozenset().union(*(program.reach[position] for position in given)) if program.reach else None
    return [
        (value if type(value) is BridgeTensor else BridgeTensor(value, index))
        if (reached is None or k in reached) and k not in absent
        else None
        for k, value in enumerate(values)
    ]


def _absent(program, present):
    """The positions among a region's gradients that this run's gradient_only_where flags marked
    absent (a differentiated root's: its place in program.diff_roots)."""
    if not present or not program.presence:
        return frozenset()
    places = {position: k for k, position in enumerate(program.diff_roots)}
    return frozenset(
        places[position]
        for flag, positions in zip(present, program.presence)
        if not flag
        for position in positions
        if position in places
    )


def _owner_gradients(program, values):
    """A differentiated root's gradient as its owner's: a parameter that is a view into its root
    (FSDP2's unsharded parameters, views into the all-gather's buffer) gets the root's gradient
    cut by its view chain (a selection of distinct elements: `_roots` checks). Applied inside
    the programs that make the gradients (run op by op, the cuts cost FSDP blocks 30 ms a step)."""
    if not program.owner_views:
        return values
    values = list(values)
    for k, position in enumerate(program.diff_roots):
        if position in program.packed:
            continue  # a member of a flat root: a root of its own here
        for step in program.owners[position]._chain:
            values[k] = step(values[k])
    return values


# A member's gradient joins its pack's flat array below this many elements. Joining costs the
# GPU a copy of the gradient inside the fused program (XLA writes a matrix product's result to a
# buffer of its own); each array that is not joined costs the host a few microseconds in the
# update's call (about 5 us on one H200's host). GPT-2 small: its 111 members below 2**20
# (biases, norms' weights, the position table, the attention's output projections: 8M values)
# join; its 37 large matrices (116M) stay arrays of their own. Joining them too made nanoGPT's
# step 0.26 ms slower on that GPU, where the update's call waits on the GPU anyway.
JOIN_BELOW = 1 << 20


def _joinable(program, position):
    """The packs whose small members' gradients a fused run of output `position` returns joined,
    in one flat array (runtime/flat.py): packs of every member of their root, each
    differentiated and reached by that output. Per such pack: its members' places among the
    differentiated values, in the root's order, and which of them join (JOIN_BELOW)."""
    found = program.joinable.get(position)
    if found is None:
        places = {root: k for k, root in enumerate(program.diff_roots)}
        reached = program.reach[position] if program.reach else None
        found = []
        for pack in program.packs:
            members = [places.get(root) for root in pack.order]
            if not members or None in members or (reached is not None and not reached.issuperset(members)):
                continue
            sizes = [stop - start for start, stop, _ in sorted(pack.spans)]
            joined = tuple(k for k, size in zip(members, sizes) if size < JOIN_BELOW)
            if len(joined) > 1:
                found.append((tuple(members), joined))
        found = program.joinable[position] = tuple(found)
    return found


def _joined(program, position, d_roots):
    """Inside a fused program: each joinable pack's small gradients joined into one flat array
    (the optimizer's update then takes one array for them, not one per parameter); their
    places in `d_roots` become None."""
    joined = []
    for _, members in _joinable(program, position):
        joined.append(flat.join([d_roots[k] for k in members]))
        for k in members:
            d_roots[k] = None
    return joined


def _separate_gradients(program, joined, values, absent):
    """After a fused run: the joined gradients (see _joined) into `values`, each pack's as the
    members of a new flat root where every owner's `.grad` is None (a step's first backward;
    autograd then sets each `.grad` to an alias of its member), else cut into arrays of their
    own (an accumulation into existing gradients, a hook run after accumulation: DDP's, FSDP's)."""
    for (pack, members), value in zip(_joinable(program, program.speculate), joined):
        owners = [program.owners[program.diff_roots[k]] for k in members]
        with torch._C.DisableTorchFunctionSubclass():
            everyone = [program.owners[program.diff_roots[k]] for k in pack]
            fresh = all(owner.grad is None and owner._post_accumulate_grad_hooks is None for owner in everyone)
        if fresh and absent.isdisjoint(members):
            pieces = flat.gradient_members(value, owners)
        else:
            flat.release_gradients(everyone)  # (accumulated into one by one: see flat.gradient_members)
            pieces = flat.split_jit(value, tuple(tuple(owner.shape) for owner in owners))
        for k, piece in zip(members, pieces):
            values[k] = piece


def _uses(jaxpr, primitive):
    """Whether a jaxpr (or one nested in it: jitted mappings, custom rules) applies `primitive`."""
    for equation in jaxpr.eqns:
        if equation.primitive.name == primitive:
            return True
        for value in equation.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if isinstance(inner, jax_core.Jaxpr) and _uses(inner, primitive):
                    return True
    return False


# Split runs keep the products and the small values mappings name for it (batch statistics).
_KEEP = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable,
    jax.checkpoint_policies.save_only_these_names(KEEP_FOR_BACKWARD),
)


def _build(program, options):
    body = program.body
    if not program.grad:
        if program.packs:
            program.infer = jax.jit(lambda roots, inputs, key: body(_unpack(program, roots), inputs, key), compiler_options=options)
        else:
            program.infer = jax.jit(body, compiler_options=options)
        return
    n_roots = len(program.roots)
    n_inputs = len(program.input_indices)  # the leaves' tensors, then carried objects'

    def differentiable(diff_roots, diff_inputs, other_roots, other_inputs, key):
        root_values = flat.merge(diff_roots, other_roots, program.diff_roots, n_roots)
        input_values = flat.merge(diff_inputs, other_inputs, program.diff_inputs, n_inputs)
        arrays, mutated, written, new_key, guards = body(root_values, input_values, key)
        floats = [array for array, is_float in zip(arrays, program.out_float) if is_float]
        others = [array for array, is_float in zip(arrays, program.out_float) if not is_float]
        return floats, (others, mutated, written, new_key, guards)

    def forward(diff_roots, diff_inputs, other_roots, other_inputs, key):
        packed = (diff_roots, diff_inputs, other_roots, other_inputs, key)  # the program's own inputs
        diff_roots, other_roots = _unpacked(program, diff_roots, other_roots)

        def function(d_roots, d_inputs):
            return differentiable(d_roots, d_inputs, other_roots, other_inputs, key)

        if settings.residuals == "matmuls":
            # Keep the products (matmuls, convolutions) for the backward and recompute the
            # cheap ops between them inside it, as torch.compile's partitioner does: JAX's own
            # residuals of normalizations and activations held ResNet-50 at 3.3x torch's memory.
            function = jax.checkpoint(function, policy=_KEEP)
        floats, pullback, aux = jax.vjp(
            function,
            diff_roots,
            diff_inputs,
            has_aux=True,
        )
        return floats, aux, _Residuals.of(pullback, packed)

    def fused(diff_roots, diff_inputs, other_roots, other_inputs, key, position):
        # Forward and gradients of one scalar output in one program (see _RegionFunction).
        diff_roots, other_roots = _unpacked(program, diff_roots, other_roots)
        def scalar(d_roots, d_inputs):
            floats, aux = differentiable(d_roots, d_inputs, other_roots, other_inputs, key)
            return floats[position], (floats, aux)

        if settings.fused_residuals == "matmuls":
            scalar = jax.checkpoint(scalar, policy=_KEEP)
        (_, (floats, aux)), (d_roots, d_inputs) = jax.value_and_grad(scalar, argnums=(0, 1), has_aux=True)(
            diff_roots, diff_inputs
        )
        d_roots = _owner_gradients(program, d_roots)
        gradients = (d_roots, d_inputs, _joined(program, position, d_roots))
        # The scalar is a training step's loss, which scripts read with `.item()` after the
        # step: a copy of it in the host's memory, written by this program, reads in about 40 us
        # once the program is done; a copy from the device took 0.4-0.6 ms after it (one H200),
        # while the GPU waited for the host to begin the next step.
        host = _host_space()
        return floats, aux, gradients, (jax.device_put(floats[position], host) if host is not None else None)

    def recompute(primals, cotangents):
        diff_roots, diff_inputs, other_roots, other_inputs, key = primals
        diff_roots, other_roots = _unpacked(program, diff_roots, other_roots)
        _, pullback, _ = jax.vjp(
            lambda a, b: differentiable(a, b, other_roots, other_inputs, key), diff_roots, diff_inputs, has_aux=True
        )
        return _pull(pullback, cotangents)

    def _pull(pullback, cotangents):
        d_roots, d_inputs = pullback(cotangents)
        return _owner_gradients(program, d_roots), d_inputs

    def primal(diff_roots, diff_inputs, other_roots, other_inputs, key):
        diff_roots, other_roots = _unpacked(program, diff_roots, other_roots)
        return differentiable(diff_roots, diff_inputs, other_roots, other_inputs, key)

    # The residuals pass to the backward row-major. Returning them in the layouts XLA chose
    # (`Layout.AUTO` outputs) would spare ResNet-50 its NCHW/NHWC transposes, but with JAX 0.10
    # a convolution's output of such a program read wrong in the next program on XLA's CPU.
    program.forward = jax.jit(forward, compiler_options=options)
    program.backward = jax.jit(_pull, compiler_options=options)
    program.primal = jax.jit(primal, compiler_options=options)
    program.fused = jax.jit(fused, static_argnums=5, compiler_options=options)
    program.recompute = jax.jit(recompute, compiler_options=options)
    program.differentiable = differentiable
    ahead = settings.compile_backward_ahead
    program.backward_ahead = (settings.platform or jax.default_backend()) == "gpu" if ahead is None else ahead


def _compile_backward(program, primals):
    """Compile a split run's backward program before its forward first runs. On GPUs, XLA
    autotunes convolutions and matmuls while compiling, on buffers of its own: compiled at the
    first backward, that came on top of the forward's residuals (ResNet-50's cold first step
    peaked at 7.88 GiB, its later steps at 4.41). The backward's later call finds the program
    compiled (jit reuses what `lower(...).compile()` made for the same shapes)."""
    lowered = program.forward.lower(*primals)  # the forward's call reuses this trace and lowering
    floats, _, residuals = lowered.out_info
    # Placed as the forward's outputs will be: jit compiles again for arguments placed otherwise.
    sharding = jax.tree_util.tree_leaves(primals)[0].sharding

    def placed(value):
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

    residuals = jax.tree_util.tree_map(placed, residuals)
    cotangents = [placed(value) for value in floats]
    program.backward.lower(residuals.pullback(primals), cotangents).compile()


@jax.tree_util.register_pytree_node_class
class _Residuals:
    """A split run's pullback as its forward program returns it: the residuals that are the
    program's own inputs (parameters a convolution's backward reads) are left out and put back
    from the inputs on the host. Returned by the program, each would be copied into a new buffer
    (ResNet-50: 161 device-to-device copies a step, a launch each, and its weights twice over)."""

    def __init__(self, kept, treedef, sources):
        self.kept = kept
        self.treedef = treedef
        self.sources = sources  # per pullback leaf: its position among the inputs, or None

    @classmethod
    def of(cls, pullback, inputs):
        position = {id(leaf): k for k, leaf in enumerate(jax.tree_util.tree_leaves(inputs))}
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        sources = tuple(position.get(id(leaf)) for leaf in leaves)
        return cls([leaf for leaf, source in zip(leaves, sources) if source is None], treedef, sources)

    def pullback(self, inputs):
        inputs = jax.tree_util.tree_leaves(inputs)
        kept = iter(self.kept)
        leaves = [next(kept) if source is None else inputs[source] for source in self.sources]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def tree_flatten(self):
        return self.kept, (self.treedef, self.sources)

    @classmethod
    def tree_unflatten(cls, aux, kept):
        return cls(list(kept), *aux)


@jax.jit
def _scale(gradients, factor):
    return jax.tree_util.tree_map(lambda g: g * factor.astype(g.dtype), gradients)


# ---------------------------------------------------------------- running a program


def _gather(program, input_tensors):
    roots = program.roots
    if program.packs:
        # A pack's flat array once, at its carrier's position; its other members' are None.
        packed = program.packed
        root_values = [None if position in packed else read_value(root) for position, root in enumerate(roots)]
        for pack in program.packs:
            root_values[pack.carrier] = read_value(roots[pack.carrier]._root)
    else:
        root_values = [read_value(root) for root in roots]
    input_values = [read_value(tensor) for tensor in input_tensors]
    return root_values, input_values


class _Pack(NamedTuple):
    """Members of one flat root (runtime/flat.py) that are roots of a program: the program takes
    the flat array once, at the carrier's position among its roots, and cuts the members out of
    it, so that a region over GPT-2's 148 parameters packed by the optimizer takes one array for
    them. Each member is still a root of its own inside the program: its gradient, its reach
    (torch's None for a parameter no output depends on) and its writes are its own."""

    carrier: int  # a position of the pack in roots: a differentiated one where there is one
    positions: tuple  # the members' positions in roots
    spans: tuple  # each member's (start, stop, shape) in the flat array
    order: tuple  # where the pack holds every member of its root: the positions in the root's order, else ()


def _packs(roots, diff_roots):
    groups = {}
    for position, root in enumerate(roots):
        if root._root is not None:  # a member as a root of its own (Region._roots)
            groups.setdefault(id(root._root), []).append(position)
    differentiated = set(diff_roots or ())
    packs = []
    for positions in groups.values():
        members = flat.members_of(roots[positions[0]]._root)
        spans = tuple(members.by_chain[roots[position]._chain] for position in positions)
        carrier = next((position for position in positions if position in differentiated), positions[0])
        order = ()
        if len(positions) == len(members.spans):
            order = tuple(position for _, position in sorted(zip((span[0] for span in spans), positions)))
        packs.append(_Pack(carrier, tuple(positions), spans, order))
    return tuple(packs)


def _unpack(program, root_values):
    """Root values with each pack's members cut from the flat array at its carrier (inside a
    program; on ShapeDtypeStructs, their shapes)."""
    if not program.packs:
        return root_values
    values = list(root_values)
    for pack in program.packs:
        whole = values[pack.carrier]
        for position, (start, stop, shape) in zip(pack.positions, pack.spans):
            if isinstance(whole, jax.ShapeDtypeStruct):
                values[position] = jax.ShapeDtypeStruct(shape, whole.dtype)
            else:
                values[position] = whole[start:stop].reshape(shape)
    return values


def _unpacked(program, diff_roots, other_roots):
    """_unpack on root values split into the differentiated ones and the others."""
    if not program.packs:
        return diff_roots, other_roots
    merged = flat.merge(diff_roots, other_roots, program.diff_roots, len(program.roots))
    return _split(_unpack(program, merged), program.diff_roots)


def _write_back(program, input_tensors, mutated, written, new_key):
    for position, value in zip(program.mutated_roots, mutated):
        write_value(program.roots[position], value)
    for k, value in zip(program.pack_writes, mutated[len(program.mutated_roots) :]):
        root = program.roots[program.packs[k].carrier]._root
        write_value(root, value)
    for position, value in zip(program.mutated_inputs, written):
        write_value(input_tensors[position], value)
    random.swap_key(new_key)


def _outputs(program, arrays):
    leaves = list(program.out_statics)
    tensors = [BridgeTensor(array, program.index) for array in arrays]
    for position, tensor in zip(program.out_tensor_positions, tensors):
        leaves[position] = tensor
    return tensors, leaves


def _check_guards(program, guards):
    """Before a run's results are used: the values its code needed on the host must be those it
    was traced with (one small copy to the host, which waits for the program)."""
    if not guards:
        return ()
    found = tuple(value.item() for value in jax.device_get(guards))
    count = len(program.expected)
    if found[:count] != program.expected:
        raise _GuardFailed(found[:count])
    return found[count:]  # gradient_only_where's flags


def _returned(program, leaves, objects, inputs):
    """The region's result: the output leaves with the caller's carried objects where the region
    returned them, those objects given the state the call left them in if it changed them."""
    result = pytree.tree_unflatten(
        [objects[leaf.number] if isinstance(leaf, _CarriedOut) else leaf for leaf in leaves], program.out_spec
    )
    if not (program.reshaped or program.stored):
        return result
    result, new, stored = result
    for place, tensor in zip(program.stored, stored):
        place.apply(tensor)
    given, start = [], len(program.tensor_positions)
    for leaf in program.statics:
        if isinstance(leaf, _Carried):
            given.append(inputs[start : start + leaf.count])
            start += leaf.count
    for (number, reshaped), tensors in zip(program.reshaped.items(), new):
        reshaped.apply(objects[number], given[number], tensors)
    return result


def run(program, input_tensors, objects=()):
    """Run a compiled program on the current values; returns the region's result. `objects`:
    the argument objects it carries (their tensors are at the end of `input_tensors`)."""
    for position, check, where in program.traced.bounds:
        array = host_array(input_tensors[position])
        if array is not None:
            bounds.raise_outside(check, array, where)
    root_values, input_values = _gather(program, input_tensors)
    key = random.key_on(program.index)
    if not program.grad:
        arrays, mutated, written, new_key, guards = program.infer(root_values, input_values, key)
        _check_guards(program, guards)
        _write_back(program, input_tensors, mutated, written, new_key)
        _, leaves = _outputs(program, arrays)
        return _returned(program, leaves, objects, input_tensors)
    diff_tensors = [program.owners[i] for i in program.diff_roots] + [input_tensors[i] for i in program.diff_inputs]
    state = {"root_values": root_values, "input_values": input_values, "key": key, "inputs": input_tensors}
    if torch._C._are_functorch_transforms_active():
        outs = _RegionFunction.apply(program, state, *diff_tensors)
    else:
        outs = _apply_region(program, state, *diff_tensors)
    leaves = list(program.out_statics)
    for position, tensor in zip(program.out_tensor_positions, outs):
        leaves[position] = tensor
    return _returned(program, leaves, objects, input_tensors)


class _RegionFunction(torch.autograd.Function):
    """A captured region in torch's autograd graph.

    Two ways to run it. Split: the forward program returns the outputs and the residuals of
    `jax.vjp`, and backward runs the pullback program with torch's incoming gradients. Fused,
    once a region's backward has been seen to receive a gradient for one scalar output only
    (a loss computed inside the model, as most training scripts do): the forward program also
    computes the gradients of that output (`jax.value_and_grad`, one XLA program for forward
    and backward, as hand-written JAX does), and backward scales them by the incoming gradient
    (the gradient of a scalar is linear in it). A later backward that needs other outputs'
    gradients recomputes them with a vjp program, and the region goes back to split runs.
    """

    @staticmethod
    def forward(ctx, program, state, *diff_tensors):
        diff_roots, other_roots = _split(state["root_values"], program.diff_roots)
        diff_inputs, other_inputs = _split(state["input_values"], program.diff_inputs)
        primals = (diff_roots, diff_inputs, other_roots, other_inputs, state["key"])
        ctx.gradients = ctx.residuals = None
        if program.speculate is not None:
            floats, (others, mutated, written, new_key, guards), ctx.gradients, host_copy = program.fused(*primals, program.speculate)
        elif settings.residuals == "recompute":
            floats, (others, mutated, written, new_key, guards) = program.primal(*primals)
        else:
            if program.backward_ahead:
                program.backward_ahead = False
                _compile_backward(program, primals)
            floats, (others, mutated, written, new_key, guards), ctx.residuals = program.forward(*primals)
        ctx.present = _check_guards(program, guards)
        _write_back(program, state["inputs"], mutated, written, new_key)
        floats, others = iter(floats), iter(others)
        arrays = [next(floats) if is_float else next(others) for is_float in program.out_float]
        tensors, _ = _outputs(program, arrays)
        if program.speculate is not None and host_copy is not None:
            loss = [tensor for tensor, is_float in zip(tensors, program.out_float) if is_float][program.speculate]
            loss._host_copy = (host_copy, loss._generation)
        ctx.program = program
        ctx.primals = _FreeableRoots(program, primals) if program.owner_views else primals
        ctx.diff_tensors = diff_tensors
        # Unused outputs get no gradient from torch (None); zeros are made here, on the device.
        ctx.set_materialize_grads(False)
        ctx.float_avals = [(a.shape, a.dtype) for a, is_float in zip(arrays, program.out_float) if is_float]
        ctx.mark_non_differentiable(*[t for t, is_float in zip(tensors, program.out_float) if not is_float])
        return tuple(tensors)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.primals is None:
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved tensors after they "
                "have already been freed). Saved intermediate values of the graph are freed when you call "
                ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
                "graph a second time or if you need to access saved tensors after calling backward."
            )
        primals = ctx.primals.current() if isinstance(ctx.primals, _FreeableRoots) else ctx.primals
        results = _region_backward(ctx, primals, grads)
        if not _graph_kept():
            # torch frees this graph after this backward: the region's inputs and residuals go
            # with it, so that an optimizer step can update the parameters' buffers in place
            # (runtime.tensor.held_only_by_their_tensors).
            ctx.primals = ctx.residuals = ctx.gradients = None
        return results


@functools.cache
def _host_space():
    """JAX's host memory as a place inside a program, where the default device has pinned host
    memory (GPUs, TPUs and XLA's CPU list it), else None. (Asked at a trace: the backend is up.)"""
    space = getattr(getattr(jax, "memory", None), "Space", None)
    try:
        kinds = {memory.kind for memory in jax.devices()[0].addressable_memories()}
    except Exception:  # noqa: BLE001 - a backend without memory kinds
        return None
    return space.Host if space is not None and "pinned_host" in kinds else None


# torch's own apply for _RegionFunction, without Function.apply's Python (up to torch 2.13), which
# maps functorch's unwrapping of dead wrappers over every argument: a region's arguments are
# BridgeTensors (Region.__call__ takes no others), never functorch's wrappers, and over GPT-2's
# 148 parameters the map cost about 0.1 ms of host time a step while the GPU waited for the call.
_apply_region = torch._C._FunctionBase.__dict__["apply"].__get__(None, _RegionFunction)


class _FreeableRoots:
    """The inputs a region's backward reads, where its parameters are views into roots whose
    storage the script frees between the forward and the backward: FSDP2 frees each block's
    gathered parameters after the block's forward (`untyped_storage().resize_(0)`) and gathers
    them into the same storage again before its backward. torch's saved tensors share that
    storage, so the memory is gone in between and the backward reads the refilled contents.
    Here a freed root's array is let go of at the free (the forward's residuals never hold it:
    `_Residuals` puts inputs back at the backward) and read again from the root at the backward."""

    def __init__(self, program, primals):
        self.primals = [list(part) if isinstance(part, list) else part for part in primals]
        self.places = {}  # id(root) -> (root, part of primals, position in it), as _split places them
        diff, others = {position: k for k, position in enumerate(program.diff_roots)}, itertools.count()
        for position, (root, owner) in enumerate(zip(program.roots, program.owners)):
            part, k = (0, diff[position]) if position in diff else (2, next(others))
            if owner._chain and position not in program.packed:
                self.places[id(root)] = (root, part, k)
                when_freed(root, self)
                when_freed(root, owner)  # its own copy of its part goes too

    def _storage_freed(self, root):
        _, part, k = self.places[id(root)]
        self.primals[part][k] = None

    def current(self):
        for root, part, k in self.places.values():
            if self.primals[part][k] is None:
                if root.__dict__.get("_freed"):
                    raise RuntimeError(
                        f"the backward of a captured region needs a tensor of shape {tuple(root.shape)} that its "
                        "parameters are views into, and that tensor's storage was freed "
                        "(untyped_storage().resize_(0)) after the forward and not given back (resize_ to its "
                        "size and filled) before the backward; torch's backward would read freed memory"
                    )
                self.primals[part][k] = read_value(root)
        return tuple(self.primals)


_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _graph_kept():
    """Whether the backward running now keeps its graph (retain_graph); True where torch does
    not say."""
    return True if _keep_graph is None else _keep_graph()


def _torch_convention(values):
    """Complex gradients between torch's convention and JAX's, which are each other's complex
    conjugates (torch's autograd takes the conjugate Wirtinger derivative; JAX's vjp the plain
    one): conjugated on the way into a JAX pullback and on the way out. Real values pass as
    they are."""
    # (dtype.kind: jnp.iscomplexobj cost 4 us a value, on each gradient of every backward)
    return [jax.numpy.conj(value) if value is not None and value.dtype.kind == "c" else value for value in values]


def _region_backward(ctx, primals, grads):
    """_RegionFunction's backward: the region's gradients for torch's incoming ones."""
    program = ctx.program
    grads = [grad for grad, is_float in zip(grads, program.out_float) if is_float]
    given = [position for position, grad in enumerate(grads) if grad is not None]
    index = program.index
    if ctx.gradients is not None and given == [program.speculate] and not torch.is_grad_enabled():
        # A fused run: only the scalar's gradient is used; the other outputs' zeros (GPT-2's
        # logits: 0.8 GB) are never made. `loss.backward()`'s implicit gradient of ones
        # needs no scaling program (one kernel per parameter, launched from the host).
        grad = grads[program.speculate]
        if _is_ones(grad):
            d_roots, d_inputs, joined = ctx.gradients
        else:
            shape, dtype = ctx.float_avals[program.speculate]
            d_roots, d_inputs, joined = _scale(ctx.gradients, read_value(_gradient(grad, shape, dtype, index)))
        values = _torch_convention(list(d_roots) + list(d_inputs))
        absent = _absent(program, ctx.present)
        if joined:
            _separate_gradients(program, _torch_convention(joined), values, absent)
        return (None, None, *_gradients_out(program, given, values, index, absent))
    grads = [_gradient(grad, shape, dtype, index) for grad, (shape, dtype) in zip(grads, ctx.float_avals)]
    if torch.is_grad_enabled():
        # create_graph=True: the gradients need a graph of their own (double backward).
        results = _RegionGradFunction.apply(program, primals, len(grads), *grads, *ctx.diff_tensors)
        return (None, None, *results)
    cotangents = _torch_convention([read_value(grad) for grad in grads])
    if ctx.gradients is not None:
        program.speculate = None  # this region's outputs are used otherwise: split runs again
        d_roots, d_inputs = program.recompute(primals, cotangents)
    else:
        if ctx.residuals is None:  # residuals="recompute": the backward runs the forward again
            d_roots, d_inputs = program.recompute(primals, cotangents)
        else:
            d_roots, d_inputs = program.backward(ctx.residuals.pullback(primals), cotangents)
        if len(given) == 1 and ctx.float_avals[given[0]][0] == () and program.speculate is None:
            program.speculate = given[0]
    values = _torch_convention(list(d_roots) + list(d_inputs))
    return (None, None, *_gradients_out(program, given, values, index, _absent(program, ctx.present)))


def mark_ones(tensor):
    """Note that a bridge tensor holds ones, as made (torch's implicit gradient of a scalar)."""
    tensor._ones_at = tensor._generation


def _is_ones(tensor):
    # Still as made: an in-place write (a hook editing the gradient) bumps the generation (a
    # deferred one too, when recorded: runtime/deferred.py).
    if not isinstance(tensor, BridgeTensor) or tensor._chain:
        return False
    return getattr(tensor, "_ones_at", None) == tensor._generation


def _gradient(grad, shape, dtype, index):
    """An incoming gradient as a bridge tensor (zeros for None, device copies of host tensors)."""
    if isinstance(grad, BridgeTensor):
        return grad
    if grad is None:
        return BridgeTensor(_zeros(tuple(shape), jax.numpy.dtype(dtype)), index)
    return BridgeTensor(jax.numpy.asarray(grad.detach().numpy(), dtype=dtype), index)


# Zeros for an output torch gives no gradient: one program a shape (jnp.zeros called eagerly
# took JAX's per-primitive path, about 1 ms of host time a call on a CPU).
_zeros = jax.jit(jax.numpy.zeros, static_argnums=(0, 1))


class _RegionGradFunction(torch.autograd.Function):
    """A region's gradients as a differentiable function of the incoming gradients and of the
    region's differentiated inputs (only when backward is itself recorded: gradient penalties)."""

    @staticmethod
    def forward(ctx, program, primals, n_grads, *tensors):
        diff_roots, diff_inputs, other_roots, other_inputs, key = primals
        diff_roots, other_roots = _unpacked(program, diff_roots, other_roots)

        def gradients(d_roots, d_inputs, cotangents):
            _, pullback, _ = jax.vjp(
                lambda a, b: program.differentiable(a, b, other_roots, other_inputs, key),
                d_roots,
                d_inputs,
                has_aux=True,
            )
            d_roots, d_inputs = pullback(cotangents)
            return _owner_gradients(program, d_roots), d_inputs

        cotangents = [read_value(grad) for grad in tensors[:n_grads]]
        (d_roots, d_inputs), pullback = jax.vjp(gradients, diff_roots, diff_inputs, cotangents)
        ctx.pullback = pullback
        ctx.index = program.index
        ctx.n_roots = len(d_roots)
        ctx.set_materialize_grads(False)
        ctx.avals = [(value.shape, value.dtype) for value in list(d_roots) + list(d_inputs)]
        return tuple(BridgeTensor(value, program.index) for value in list(d_roots) + list(d_inputs))

    @staticmethod
    def backward(ctx, *grads):
        values = [
            read_value(_gradient(grad, shape, dtype, ctx.index)) for grad, (shape, dtype) in zip(grads, ctx.avals)
        ]
        d_roots, d_inputs, d_cotangents = ctx.pullback((values[: ctx.n_roots], values[ctx.n_roots :]))
        wrap = [BridgeTensor(value, ctx.index) for value in list(d_cotangents) + list(d_roots) + list(d_inputs)]
        return (None, None, None, *wrap)


# ---------------------------------------------------------------- regions


@dataclasses.dataclass
class Break:
    region: str
    reason: str
    site: str
    calls: int = 0  # the region's calls run eagerly since (the breaking one included)
    seconds: float = 0.0  # their host time (the device's where a call waits for it)


@dataclasses.dataclass
class Compile:
    region: str
    reason: str
    seconds: float = 0.0


breaks = []  # Break records (the run report lists them)
compiles = []  # Compile records
fused_steps = {}  # optimizer name -> steps run as one program (bridge/patches/optim.py)
# module class name -> calls that ran the module's Python because hooks on it or below it need
# Python on each call (bridge/patches/capture.py): its submodules' regions compile on their own
hooked = collections.Counter()


def _describe(frame):
    source = (frame.line or "").strip()
    where = f"{frame.filename}:{frame.lineno} in {frame.name}"
    return f"{where}: {source}" if source else where


# Where the bridge's packages, JAX's and torch's dispatch machinery live: not where a region's
# code asked for a value (a library's line is).
_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_MACHINERY = tuple(
    os.path.normpath(path) + os.sep
    for path in (
        # a checkout's runtime/, op_mappings/ and bridge/ (installed, all three sit under bridge/)
        _HERE,
        os.path.join(_HERE, "..", "op_mappings"),
        os.path.join(_HERE, "..", "bridge"),
        *([os.path.dirname(_HERE)] if os.path.basename(os.path.dirname(_HERE)) == "bridge" else []),
        os.path.dirname(jax.__file__),
        os.path.join(_TORCH, "utils"),
    )
) + (os.path.join(_TORCH, "_ops.py"),)


def _machinery(filename):
    return os.path.abspath(filename).startswith(_MACHINERY)


def _user_site(error):
    """Where a region broke: 'file:line in function: source' of the innermost user frame of an
    exception's traceback, and of the library line below it that failed (`(in ...)`: a
    torch.distributions check, a transformers model's). Where the traceback holds no user frame
    at all (the region is library code: torch's TransformerEncoder), the user's line that
    called the region stands first."""
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    failed = next((frame for frame in reversed(frames) if not _machinery(frame.filename)), None)
    user = next((frame for frame in reversed(frames) if not _is_library(os.path.abspath(frame.filename))), None)
    if user is None:
        user = next((frame for frame in reversed(traceback.extract_stack()) if not _is_library(os.path.abspath(frame.filename))), None)
    if user is None and failed is None:
        return "<no user frame>"
    if user is None:
        return f"in {_describe(failed)}"
    return _describe(user) + ("" if failed is None or failed is user else f" (in {_describe(failed)})")


def _reason(error):
    if isinstance(error, GraphBreak):
        return error.reason
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    kind = type(error).__name__
    if isinstance(error, jax.errors.JAXTypeError) or "Tracer" in kind or "Concretization" in kind:
        return f"data-dependent value needed on the host ({kind}): {text[:200]}"
    return f"{kind}: {text[:200]}"


class Region:
    """A capturable callable with its cache of programs (per structure of its inputs)."""

    def __init__(self, function, name, state_roots=None, fullgraph=False, watched=None):
        self.function = function
        self.name = name
        self.state_roots = state_roots  # callable -> list of root tensors known up front
        self.watched = watched  # callable -> objects (modules) whose attributes a trace must not leave traced
        self.fullgraph = fullgraph
        self.programs = {}
        self.extra_roots = []  # outside tensors found by earlier traces
        self.broken = None  # Break, once the region is left to run eagerly
        self.last_key = None
        self._state_cache = None
        self.learned = {}  # call structure -> the values its code needed on the host (_learn)
        # key -> {the host values a program was traced with: that program}, the last few of each
        # key: values that come back (a branch that alternates; which experts got tokens, as it
        # changes and changes back) run the program kept for them instead of an eager run and a
        # new trace.
        self.variants = {}
        self.learns = 0  # value sets learned that no kept program was traced with
        self.changes = 0  # calls in a row that changed an argument object's attributes
        self.eager_first = [0, 0.0]  # calls run eagerly because their trace raised EagerRunFirst, their seconds

    def __call__(self, *args, **kwargs):
        if deferred._current is not None and not settings.tracing:
            deferred.flush()  # (a trace reads roots' values as they are: in-place updates run first)
        if self.broken is not None and settings.capture and not tracing_or_learning():
            return self._eagerly(args, kwargs)
        if self.broken is not None or not settings.capture or tracing_or_learning() or _forward_ad._current_level >= 0:
            # Forward-mode AD (a dual level is open) runs op by op: a traced program would
            # carry the primal values only.
            return self.function(*args, **kwargs)
        try:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            leaves, carried, objects = _carry(leaves)
            roots, state_key = self._state()
            shapes = tuple(_leaf_key(leaf) for leaf in leaves) + tuple(_leaf_key(tensor) for tensor in carried)
            key = ((spec, shapes), _context_key(), state_key)
        except GraphBreak as error:
            return self._break(error, args, kwargs)
        program = self.programs.get(key)
        inputs = [leaf for leaf in leaves if isinstance(leaf, BridgeTensor)] + carried
        if program is None:
            if len(self.programs) >= MAX_PROGRAMS:
                return self._break(GraphBreak(f"more than {MAX_PROGRAMS} structures compiled"), args, kwargs)
            try:
                program, result = self._compile(key, leaves, spec, roots, inputs, objects)
            except (_NeedsHostValues, _GuardFailed, _CarriedChanged, EagerRunFirst) as error:
                failure, learn = error, True
            except Exception as error:  # noqa: BLE001 - any failure to capture runs the region eagerly
                failure, learn = error, False
            else:
                self.changes = 1 if program.reshaped else 0
                return result
            # Outside the handler: an error of the eager run is not chained to the trace's.
            if isinstance(failure, _CarriedChanged):
                return self._eagerly_once(failure, args, kwargs)
            if isinstance(failure, EagerRunFirst):
                return self._eagerly_first(failure, args, kwargs)
            if learn:
                return self._learn(key, failure, args, kwargs)
            return self._break(failure, args, kwargs)
        try:
            result = run(program, inputs, objects)
            self.changes = 1 if program.reshaped else 0
            return result
        except _GuardFailed as failed:
            kept = self.variants.get(key, {}).get(failed.args[0])
            if kept is not None and kept is not program:
                # Traced with the values this run found: its own guards check them again.
                self.programs[key] = kept
                try:
                    result = run(kept, inputs, objects)
                    self.changes = 1 if kept.reshaped else 0
                    return result
                except _GuardFailed as again:
                    failed = again
            del self.programs[key]
            return self._learn(key, failed, args, kwargs)

    def _eagerly_once(self, changed, args, kwargs):
        """A call that changes an argument object's attributes right after another that did (a
        cache that grows on every call; a cache's lazy initialization on its first call is kept
        in a program, see _Reshaped), or one that holds a host tensor, runs op by op on the
        object itself; the next call is traced again. Calls that each do so, with no program run
        between them, break the region after a few."""
        self.changes += 1
        if self.changes > MAX_LEARNS:
            name, why = changed.args
            return self._break(GraphBreak(f"each call {_CHANGED[why].format(name=name)}"), args, kwargs)
        return self.function(*args, **kwargs)

    def _eagerly_first(self, error, args, kwargs):
        """A call whose trace raised EagerRunFirst runs op by op; the next one traces again. Such
        calls count toward a break that follows (they ran op by op too)."""
        if self.eager_first[0] >= MAX_LEARNS:
            return self._break(error, args, kwargs)
        start = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.eager_first[0] += 1
            self.eager_first[1] += time.perf_counter() - start

    def _learn(self, key, why, args, kwargs):
        """Run the region eagerly once (its own code and its submodules', op by op), recording the
        values its code asks for on the host; the next call with this structure traces with
        them. Called when a trace met such a value with none learned (`_NeedsHostValues`), or a
        program's run computed others than it was traced with (`_GuardFailed`): a few times per
        region, then it breaks."""
        global _recording
        self.learns += 1
        if self.learns > MAX_LEARNS:
            found = f" (the last run found {why.args[0]})" if isinstance(why, _GuardFailed) else ""
            return self._break(
                GraphBreak(f"the values its code needs on the host (bool(t), t.item()) changed {MAX_LEARNS} times{found}"),
                args,
                kwargs,
            )
        recorder, outer = _Recorder(), _recording
        _recording = recorder
        outer_hooks = tensor_module.set_hooks(tensor_module.trace_hook, recorder)
        start = time.perf_counter()
        try:
            result = self.function(*args, **kwargs)
        finally:
            _recording = outer
            tensor_module.set_hooks(*outer_hooks)
        self.learned[key[:2]] = values = recorder.values
        needed = why.args[0] if isinstance(why, _NeedsHostValues) else None
        if needed is not None and needed < len(values) and type(values[needed]) not in (bool, int):
            # A float (a loss logged with .item() inside the forward): no program keeps it.
            error = GraphBreak(_FLOAT_NEEDED.format(kind=type(values[needed]).__name__))
            error.__traceback__ = why.__traceback__  # the trace's, at the user's line
            if self.fullgraph:
                return self._break(error, args, kwargs)  # raises
            record = self._record_break(error)
            record.calls, record.seconds = 1, time.perf_counter() - start
        return result

    def _state(self):
        """The state's roots and their part of the program key, as _roots and _state_key give
        them; remembered from the last call while nothing they depend on has changed (a module
        call pays for this on every step: ResNet-50 has 320 state tensors)."""
        tensors = list(self.state_roots() if self.state_roots else []) + self.extra_roots
        cached = self._state_cache
        if cached is not None and cached.holds(tensors):
            self.owners = cached.owners
            return cached.roots, cached.key
        roots = self._roots(tensors)
        key = _state_key(roots, self.owners)
        self._state_cache = _StateCache(tensors, roots, self.owners, key)
        return roots, key

    def _roots(self, tensors):
        """The state: roots of the region's tensors, and for each the tensor that autograd
        knows (a parameter is often an alias of its root; its gradient is the root's)."""
        roots, owners, seen, flat_roots = [], [], {}, set()
        for tensor in tensors:
            if not isinstance(tensor, BridgeTensor):
                raise GraphBreak("the module has a parameter or buffer that is not on the bridge device")
            root = root_of(tensor)
            if flat.is_member(tensor):
                # A member of a flat root (runtime/flat.py): a root of its own to the program,
                # which takes the flat root once and cuts its members out of it (packs).
                flat_roots.add(id(root))
                root = tensor
            position = seen.get(id(root))
            if tensor._chain and tensor.requires_grad and root is not tensor:
                # Differentiated through its root: its gradient is the root's, cut by the view
                # (distinct elements, the root owned by no other parameter).
                if (position is not None and owners[position].requires_grad) or not views.selects_distinct(tensor):
                    raise GraphBreak("a parameter is a view into another tensor (of overlapping elements, or "
                                     "into one that another parameter views too)")
            if position is None:
                seen[id(root)] = len(roots)
                roots.append(root)
                owners.append(tensor)
            elif tensor.requires_grad and not owners[position].requires_grad:
                owners[position] = tensor
            elif tensor.requires_grad and owners[position]._chain and owners[position] is not tensor:
                raise GraphBreak("a parameter is a view into another tensor that another parameter views too")
        if flat_roots & set(seen):
            # The flat root itself (through a tensor that views it otherwise) beside its members:
            # the program would not see that they share memory.
            raise GraphBreak("a tensor of the module views the one array the optimizer packed its parameters into, "
                             "beside those parameters")
        self.owners = owners
        return roots

    def _compile(self, key, leaves, spec, roots, inputs, objects=()):
        start = time.perf_counter()
        if self.last_key is None:
            reason = "first call"
        elif key == self.last_key:
            reason = "recompile: a value needed on the host changed"
        else:
            reason = f"recompile: {describe_change(self.last_key, key)} changed"
        if self.learned.get(key[:2]):
            reason += f" (with {len(self.learned[key[:2]])} value(s) needed on the host, from an eager run)"
        for _ in range(MAX_RETRACES):
            program = self._program(leaves, spec, roots, inputs)
            program.learned = self.learned.get(key[:2])
            try:
                # Trace once without compiling to see the outputs (is there a loss?) and the
                # operations (which XLA options suit them).
                root_values, input_values = _gather(program, inputs)
                if program.packs:
                    root_values = _unpack(program, [
                        jax.ShapeDtypeStruct(value.shape, value.dtype) if value is not None else None for value in root_values
                    ])
                jaxpr = jax.make_jaxpr(program.body)(root_values, input_values, random.current_key())
                program.traced = program.body.traced
                if program.reshaped and self.changes:
                    # Two calls in a row that change an argument object (a cache that grows each
                    # token): one program each would compile one per call.
                    changed = next(iter(program.reshaped.values())).template
                    raise _CarriedChanged(type(changed).__name__, "changes its attributes")
                if program.grad:
                    program.reach = _reach(jaxpr.jaxpr, program)
                _build(program, _compiler_options(jaxpr))
                self._guess_scalar(program)
                result = run(program, inputs, objects)
            except _FreeTensors as found:
                self.extra_roots.extend(found.args[0])
                roots, state_key = self._state()
                key = key[:2] + (state_key,)
                continue
            break
        else:
            raise GraphBreak("the region keeps reading new tensors from outside it")
        self.programs[key] = program
        if program.expected:
            variants = self.variants.setdefault(key, {})
            variants.pop(program.expected, None)
            variants[program.expected] = program
            while len(variants) > MAX_VARIANTS:
                del variants[next(iter(variants))]  # the oldest
        self.last_key = key
        _collect_after(time.perf_counter() - start)
        compiles.append(Compile(self.name, reason, time.perf_counter() - start))
        return program, result

    def _program(self, leaves, spec, roots, inputs):
        grad = torch.is_grad_enabled()
        tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, BridgeTensor)]
        statics = [None if isinstance(leaf, BridgeTensor) else leaf for leaf in leaves]
        indices = [tensor._index for tensor in inputs]
        index = indices[0] if indices else (roots[0]._index if roots else 0)
        program = Program(roots, list(self.owners), spec, statics, tensor_positions, indices, grad, index=index)
        program.owner_views = any(
            owner._chain and owner.requires_grad and owner is not root for root, owner in zip(roots, program.owners)
        )
        if grad:
            program.diff_roots = [
                i for i, owner in enumerate(program.owners) if owner.requires_grad and _is_float(owner.dtype)
            ]
            program.diff_inputs = [i for i, tensor in enumerate(inputs) if tensor.requires_grad and _is_float(tensor.dtype)]
            program.grad = bool(program.diff_roots or program.diff_inputs)
        program.packs = _packs(roots, program.diff_roots)
        program.packed = frozenset(position for pack in program.packs for position in pack.positions)
        program.body = _trace_body(self.function, program, self.watched)
        return program

    @staticmethod
    def _guess_scalar(program):
        """After the first trace: a region with one 0-dim floating output (a loss) starts with
        fused runs, so that even its first step keeps no vjp residuals (see _RegionFunction)."""
        if program.grad and program.out_float and program.speculate is None:
            shapes = [shape for shape, is_float in zip(program.out_shapes, program.out_float) if is_float]
            scalars = [position for position, shape in enumerate(shapes) if shape == ()]
            if len(scalars) == 1:
                program.speculate = scalars[0]

    def _record_break(self, error):
        record = Break(self.name, _reason(error), _user_site(error), *self.eager_first)
        self.broken = record
        breaks.append(record)
        return record

    def _break(self, error, args, kwargs):
        record = self._record_break(error)
        site = record.site
        if self.fullgraph:
            raise GraphBreak(
                f"torch.compile(fullgraph=True) of {self.name} cannot be captured as one XLA program: "
                f"{record.reason}; run without fullgraph=True to let it run eagerly",
                site,
            ) from error
        try:
            return self._eagerly(args, kwargs)
        except BaseException:
            if not isinstance(error, GraphBreak):
                # The region fails eagerly too: the script's own error (a shape mismatch), which
                # is what the user sees; the region is not at fault and is tried again next call.
                breaks.remove(record)
                self.broken = None
            raise

    def _eagerly(self, args, kwargs):
        """The region's function run op by op, counted against its break (what it costs)."""
        start = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.broken.calls += 1
            self.broken.seconds += time.perf_counter() - start


def reset():
    breaks.clear()
    compiles.clear()
    fused_steps.clear()
    hooked.clear()


def summary():
    """Plain data for the run report: the mode, every compile and why, every graph break."""
    return {
        "mode": settings.mode,
        "compiles": [dataclasses.asdict(record) for record in compiles],
        "graph_breaks": [dataclasses.asdict(record) for record in breaks],
        "optimizer_steps_as_one_program": dict(fused_steps),
        "hooked_modules": dict(hooked),
    }

