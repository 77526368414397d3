"""The ladder's whole-module rung (docs/design.md): a module whose forward reaches an op with no
mapping and no decomposition runs, from its next call on, as its `torch.export` translated into
one JAX function.

The call that meets the op finishes on the CPU fallback (its side effects done once, in order); the
module is then exported on the host (`torch.export`, decomposed to Core ATen, whose ops the tables
serve) and translated by runtime/export.py. Its later calls run that function through `from_jax`:
the parameters and buffers are read from the module on every call (optimizer steps and
`load_state_dict` are seen), gradients reach them through autograd (the backward is `jax.vjp`'s),
and the buffers the graph writes (BatchNorm's running statistics) are written back. Inside a
captured region's trace the op makes the region run eagerly once, which exports the module; the
next trace takes the module's function into the region's program.

Where export fails (data-dependent control flow, an op that is still unmapped after
decomposition), the module keeps the CPU fallback and the run report says why. Under `--strict`
nothing here runs: the op is an error naming the op, the module and the user's line.
"""

import dataclasses
import sys
import types
import weakref

import jax
import torch
from torch.utils import _pytree as pytree

from bridge.interop import export_on_host, from_jax
from bridge.runtime import capture, dispatch, export, random, stats
from bridge.runtime.config import settings
from bridge.runtime.errors import GraphBreak
from bridge.runtime.tensor import BridgeTensor, read_value

# Exports kept per module, one per structure of its inputs (shapes, dtypes, Python values) and
# training flags; a module called with more runs its later structures on the CPU fallback.
MAX_PROGRAMS = 8

_CALL_IMPL = torch.nn.Module._call_impl.__code__
_STATE_KINDS = ("PARAMETER", "BUFFER")
_OUTPUT_ORDER = ("USER_OUTPUT", "BUFFER_MUTATION", "USER_INPUT_MUTATION")


@dataclasses.dataclass
class Record:
    """One module met by the rung, for the run report."""

    module: str  # the module's class
    op: str  # the op with no mapping that its call reached
    site: str  # the user's line that first reached it
    status: str = "pending"  # "exported", "not exported", or "pending" (not called again)
    reason: str = ""  # why it was not exported (or why a call of it was not)
    calls: int = 0  # calls run as an exported program (outside captured regions)
    traced: int = 0  # traces of captured regions that took the exported program in
    programs: int = 0  # exports made (one per structure of its inputs)


records = []  # Record per module, in the order they were met
modules = weakref.WeakKeyDictionary()  # module -> _WholeModule
_routing = [0]  # depth of exported programs being run (their trace's ops are not the module's)


class _WholeModule:
    __slots__ = ("record", "routes", "refused", "failed")

    def __init__(self, record):
        self.record = record
        self.routes = {}  # call key -> _Route
        self.refused = set()  # call keys whose export failed after others succeeded
        self.failed = False  # its first export failed: the module keeps the CPU fallback


def _innermost_module():
    """The innermost nn.Module whose call is running (the `self` of torch's `_call_impl` frame)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def _describe(module):
    return f"the module {type(module).__qualname__}"


def fallback_reached(op, site):
    """runtime/dispatch.py's `fallback_hook`: `op` is about to run on the CPU fallback. Records the
    innermost module whose call runs it, to be exported at its next call; inside a captured
    region's trace, raises so that the region runs eagerly once (and exports it) or breaks."""
    if _routing[0] or (settings.tracing and not capture.tracing()):
        return None  # an exported program's graph, or a saved graph being translated: not a module's call
    module = _innermost_module()
    if module is None:
        if capture.tracing():
            raise GraphBreak(f"{op} has no mapping and no decomposition (it runs on the host CPU)")
        return None
    if settings.strict:
        return _describe(module)
    whole = modules.get(module)
    if whole is None:
        whole = modules[module] = _WholeModule(Record(type(module).__qualname__, str(op), site))
        records.append(whole.record)
    if capture.tracing():
        if whole.failed:
            raise GraphBreak(
                f"{op} has no mapping and no decomposition, and {_describe(module)} could not be exported "
                f"({whole.record.reason}): it runs on the host CPU"
            )
        raise capture.EagerRunFirst(f"{op} has no mapping: {_describe(module)} is exported whole at its next call")
    return _describe(module)


def _has_bridge_tensor(leaves):
    return any(isinstance(leaf, BridgeTensor) for leaf in leaves)


def _hooked(module):
    from torch.nn.modules import module as module_module

    if any(
        getattr(module_module, name, None)
        for name in ("_global_backward_hooks", "_global_backward_pre_hooks", "_global_forward_hooks", "_global_forward_pre_hooks")
    ):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in module.modules())


def _call_key(module, leaves, spec):
    shapes = tuple(
        (tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else (type(leaf), leaf)
        for leaf in leaves
    )
    return spec, shapes, tuple(m.training for m in module.modules())


NOT_ROUTED = object()


def call(module, args, kwargs):
    """A call of a module the rung has met (bridge/patches/capture.py module_call asks first): its
    exported program's outputs, or NOT_ROUTED where the call runs as usual (the module could not
    be exported, it has hooks to run, its arguments hold no bridge tensor, or --strict)."""
    whole = modules.get(module)
    if whole is None or whole.failed or settings.strict:
        return NOT_ROUTED
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if not _has_bridge_tensor(leaves):
        return NOT_ROUTED
    if _hooked(module):
        whole.record.reason = "hooks are registered on it: its calls run its Python, the op on the host CPU"
        return NOT_ROUTED
    try:
        key = _call_key(module, leaves, spec)
        hash(key)
    except TypeError:  # an argument that is no value (an object) fixes nothing to export for
        whole.record.reason = "an argument is an object, not tensors and values"
        return NOT_ROUTED
    route = whole.routes.get(key)
    if route is None:
        if key in whole.refused:
            return NOT_ROUTED
        if settings.tracing:
            if capture.tracing():
                # export reads the module on the host, which a trace cannot: the region's eager
                # run of this call exports it
                raise capture.EagerRunFirst(f"{_describe(module)} is exported whole for new inputs at its next call")
            return NOT_ROUTED
        if len(whole.routes) >= MAX_PROGRAMS:
            whole.record.reason = f"more than {MAX_PROGRAMS} structures of its inputs: the others run on the host CPU"
            return NOT_ROUTED
        try:
            route = _Route(module, args, kwargs, leaves, spec)
        except Exception as error:  # noqa: BLE001 - whatever export refuses keeps the CPU fallback
            whole.record.reason = _why(error)
            if whole.routes:  # exported for other inputs: these keep the CPU fallback
                whole.refused.add(key)
            else:
                whole.failed = True
                whole.record.status = "not exported"
            return NOT_ROUTED
        whole.routes[key] = route
        whole.record.status = "exported"
        whole.record.programs += 1
    if settings.tracing:
        whole.record.traced += 1
    else:
        whole.record.calls += 1
    return route(module, leaves)


def _why(error):
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    if "data-dependent" in text or "data dependent" in text or "GuardOnDataDependent" in type(error).__name__:
        return f"torch.export refused data-dependent control flow ({type(error).__name__}: {first[:200]})"
    return f"{type(error).__name__}: {first[:200]}"


class _Untranslated(Exception):
    """An exported graph still calls an op that would run on the host CPU."""


def _exported(module, args, kwargs):
    """torch.export of `module` on the host, decomposed to Core ATen. The inputs are host tensors
    of the call's shapes and dtypes (the export fakes their values), so a call whose tensors a
    trace holds is exported from the same description as a concrete one."""
    example = pytree.tree_map_only(
        torch.Tensor, lambda tensor: torch.zeros(tensor.shape, dtype=tensor.dtype, device="cpu"), (tuple(args), dict(kwargs))
    )
    # torch.export can start Dynamo, which turns torch.distributions' argument validation off for
    # the process: the script's setting is kept.
    validating = torch.distributions.Distribution._validate_args
    try:
        exported = export_on_host(module, *example).run_decompositions()
    finally:
        torch.distributions.Distribution.set_default_validate_args(validating)
    for node in exported.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if dispatch.rung_of(node.target) == stats.CPU_FALLBACK:
                raise _Untranslated(f"its torch.export graph still calls {node.target}, which has no mapping")
    return exported


class _EveryOutput:
    """An exported program as runtime/export.py's `to_jax` reads it, with every graph output a
    user output: after `run_decompositions()` a program returns what it writes (BatchNorm's
    running statistics, an input it adds to) as outputs of kinds BUFFER_MUTATION and
    USER_INPUT_MUTATION, which `to_jax` puts in its new state and inputs; this route wants them
    among the outputs `from_jax` hands back, and writes them back itself."""

    def __init__(self, exported):
        user = types.SimpleNamespace(kind=types.SimpleNamespace(name="USER_OUTPUT"))
        count = len(exported.graph_signature.output_specs)
        self.exported = exported
        self.graph_signature = types.SimpleNamespace(
            input_specs=exported.graph_signature.input_specs, output_specs=[user] * count
        )
        self.call_spec = types.SimpleNamespace(
            in_spec=exported.call_spec.in_spec, out_spec=pytree.tree_flatten(list(range(count)))[1]
        )

    def __getattr__(self, name):  # everything else as the program has it
        return getattr(self.exported, name)


class _Route:
    """One export of a module for one structure of its inputs: the translated function, jitted,
    run through `from_jax` on the module's parameters and buffers and the call's tensors."""

    def __init__(self, module, args, kwargs, leaves, spec):
        exported = _exported(module, args, kwargs)
        function, state = export.to_jax(_EveryOutput(exported))
        signature = exported.graph_signature
        self.state_names = [entry.target for entry in signature.input_specs if entry.kind.name in _STATE_KINDS]
        constants = {name: value for name, value in state.items() if name not in set(self.state_names)}
        user_inputs = [entry.arg.name for entry in signature.input_specs if entry.kind.name == "USER_INPUT"]
        kinds = [entry.kind.name for entry in signature.output_specs]
        self.buffers_written = [entry.target for entry in signature.output_specs if entry.kind.name == "BUFFER_MUTATION"]
        self.positions = [position for position, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        # (a user input's place among the graph's user inputs is its place among the call's leaves)
        self.inputs_written = [
            self.positions.index(user_inputs.index(entry.target))
            for entry in signature.output_specs
            if entry.kind.name == "USER_INPUT_MUTATION"
        ]
        unknown = set(kinds) - set(_OUTPUT_ORDER)
        if unknown:
            raise _Untranslated(f"its torch.export graph has outputs of kind {', '.join(sorted(unknown))}")
        self.out_spec = exported.call_spec.out_spec
        statics = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        positions = self.positions

        # Random ops draw from a key given as a tensor of its data: a tensor argument, it is held
        # for the backward (which runs the forward again with the same draws) as any input is,
        # where a key among the plain arguments would be a value of the trace that made it.
        self.random = any(
            isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags
            for node in exported.graph.nodes
        )

        def body(state, inputs, key_data):
            key = None if key_data is None else jax.random.wrap_key_data(key_data)
            call_leaves = list(statics)
            for position, array in zip(positions, inputs):
                call_leaves[position] = array
            call_args, call_kwargs = pytree.tree_unflatten(call_leaves, spec)
            outputs, _, _ = function({**constants, **state}, *call_args, key=key, **call_kwargs)
            # the module's outputs, then the buffers it writes, then the inputs it writes
            return [value for kind_wanted in _OUTPUT_ORDER for value, kind in zip(outputs, kinds) if kind == kind_wanted]

        self.program = from_jax(jax.jit(body))

    def __call__(self, module, leaves):
        tensors = dict(module.named_parameters(remove_duplicate=False))
        tensors.update(module.named_buffers(remove_duplicate=False))
        state = {name: tensors[name] for name in self.state_names}
        inputs = [leaves[position] for position in self.positions]
        # What the program writes goes in as its value now, in a tensor of its own: autograd
        # keeps the inputs for the backward (which runs the forward again), and the writes
        # below must neither change them nor trip autograd's check of their versions.
        given_state = {name: _value_now(tensor) if name in self.buffers_written else tensor for name, tensor in state.items()}
        given_inputs = [_value_now(tensor) if position in self.inputs_written else tensor for position, tensor in enumerate(inputs)]
        _routing[0] += 1
        try:
            key_data = None
            if self.random:
                index = next(tensor._index for tensor in [*inputs, *state.values()] if isinstance(tensor, BridgeTensor))
                key_data = BridgeTensor(jax.random.key_data(random.next_key()), index)
            results = self.program(given_state, given_inputs, key_data)
        finally:
            _routing[0] -= 1
        count = len(results) - len(self.buffers_written) - len(self.inputs_written)
        with torch.no_grad():
            for name, value in zip(self.buffers_written, results[count:]):
                state[name].copy_(value)
            for position, value in zip(self.inputs_written, results[count + len(self.buffers_written) :]):
                inputs[position].copy_(value)
        return pytree.tree_unflatten(results[:count], self.out_spec)


def _value_now(tensor):
    if isinstance(tensor, BridgeTensor) and not tensor.requires_grad:
        return BridgeTensor(read_value(tensor), tensor._index)
    return tensor


def reset():
    records.clear()


def summary():
    """Plain data for the run report."""
    return [dataclasses.asdict(record) for record in records]
