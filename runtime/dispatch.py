"""Dispatch from torch into the mapping tables, and the fallback ladder.

Each ATen overload gets a plan the first time it is seen (mapped, view,
in-place or out= derived from a functional entry, decomposed, CPU fallback);
later calls run the cached plan. The first call of each signature is also
checked against torch's meta kernel, which gives torch's own error for bad
input and catches table entries whose shape or dtype disagree with torch.
"""

import functools
from time import perf_counter

import jax
import numpy as np
import torch
import torch._decomp

from . import bounds, devices, distributed, precision, random, stats
from .compiled_ops import CompiledEntry, WithFloats, scalar_array
from .callsite import user_call_site, warn_at_user_site
from .config import settings
from .dtypes import TORCH_TO_JAX
from .errors import CPUFallbackWarning, DeviceError, MappingDtypeWarning, MappingMismatchError, UnsupportedOpError
from .registry import OP_TRAITS, Mapping, mapping_of, meta_of, takes_host_tensors, takes_torch_gradient
from . import deferred, torch_gradients
from .tensor import (
    BridgeTensor,
    OnHost,
    host_array,
    keep_host,
    numpy_to_torch,
    on_host,
    read_value,
    root_of,
    set_wrapper_layout,
    settle,
    to_torch,
    torch_to_numpy,
    write_value,
)
from . import tensor as tensor_module
from .views import ViewStep

aten = torch.ops.aten

_plans = {}  # OpOverload -> callable(args, kwargs)
_checked = {}  # signature -> None (agrees with torch) or tuple of torch dtypes to cast to
_UNCHECKED = object()

# id(op) -> (op, its stats.Tally, its index bounds' spec or None: runtime/bounds.py): found by the
# op's id, an int, where the op's own hash is Python code (two dict updates keyed by the op cost
# about 3 us an op on a 2-core CPU).
_tallies = {}


def dispatch(func, args, kwargs):
    plan = _plans.get(func)
    if plan is None:
        plan = _make_plan(func)
    if func is _LOCAL_SCALAR_DENSE and tensor_module.host_value_hook is not None:
        return tensor_module.host_value_hook(plan, args, kwargs)  # a value a region's trace needs on the host
    found = _tallies.get(id(func))
    if found is None or found[0] is not func:
        found = _tallies[id(func)] = (func, stats.tally(func), bounds.SPECS.get(func))
    if found[2] is not None:
        bounds.check(func, found[2], args, kwargs)  # torch's error for an index out of range
    tally = found[1]
    start = perf_counter()
    try:
        if settings.tracing_for_grad and settings.tracing:
            if not torch._C.is_grad_enabled():
                out = plan(args, kwargs)
                _cut_from_gradient(out, args, kwargs)
            elif takes_torch_gradient(func) and not settings.in_torch_gradient:
                out = torch_gradients.call(func, plan, args, kwargs)
            else:
                out = plan(args, kwargs)
        else:
            out = plan(args, kwargs)
        # Counted once it ran: a call that raised (a trace that must run eagerly first, a break)
        # ran on no rung, and the report must not say it took one.
        tally.calls += 1
        return out
    finally:
        # Host time, including nested ops of a decomposition (JAX runs asynchronously); in a
        # trace it is the compile's (capture's records), not the op's.
        if not settings.tracing:
            tally.seconds += perf_counter() - start


tensor_module.install(dispatch)
_LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default


# ---------------------------------------------------------------- unwrapping


def _unwrap(value, index, func=None):
    """Replace bridge tensors (and host tensors that may join them) by jax arrays; lists stay
    lists. `func`: the op, when a host tensor of more than 0 dimensions must not join (see below)."""
    if isinstance(value, BridgeTensor):
        return read_value(value)
    if isinstance(value, torch.Tensor):
        if value._is_zerotensor():
            # autograd's zero that takes no memory (forward-mode AD's tangent of a tensor that
            # has none): it holds no data to copy
            return devices.put(np.zeros(value.shape, TORCH_TO_JAX[value.dtype]), index)
        if func is not None and value.dim() and not takes_host_tensors(func) and not _inside_autograd():
            _refuse_two_devices(func, value, index)
        return devices.put(torch_to_numpy(value), index)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (torch.Tensor, type(None))):
        return [_unwrap(item, index, func) for item in value]
    return value


# torch refuses an op between a tensor on the GPU and one on the host ("Expected all tensors to
# be on the same device"), except a 0-dim host tensor (a scalar), the indices of indexing, and
# the copies that move data between devices (their registrations say host_tensors=True). A
# bridge tensor is a CPU tensor to torch's C++ core, so tensors that C++ code makes "like" it
# are host tensors: backward formulas do (`at::zeros(sizes, grad.options())`), and so do a few
# forward composites (one_hot's arange).
# Those are not the script's mixing: autograd's are let through (a backward node is running,
# or forward-mode AD's formulas are), and so are those of the forward composites listed in
# bridge/patches/composites.py.
_current_node = torch._C._current_autograd_node
_forward_ad = torch.autograd.forward_ad


def _inside_autograd():
    return _current_node() is not None or _forward_ad._current_level >= 0 or settings.in_host_making_composite


def _refuse_two_devices(func, host, index):
    raise DeviceError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"{devices.torch_device(index)} and {host.device}! ({func} at {user_call_site()}: move the "
        f"host tensor with .to({str(devices.torch_device(index))!r}), or the other with .cpu())"
    )


def _device_index(args, kwargs=None):
    """The bridge ordinal of a call: that of its first bridge tensor (positional first)."""
    index = _bridge_index_in(args, kwargs)
    return devices.current_index() if index is None else index


def _bridge_index_in(args, kwargs):
    """The ordinal of the call's first bridge tensor, or None when it has none."""
    for value in list(args) + list((kwargs or {}).values()):
        if isinstance(value, BridgeTensor):
            return value._index
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, BridgeTensor):
                    return item._index
    return None


def _unwrap_all(args, kwargs, func=None):
    index = _bridge_index_in(args, kwargs)
    if index is None:
        # No bridge tensor (a factory's inputs): host tensors meet only each other.
        index, func = devices.current_index(), None
    return (
        [_unwrap(value, index, func) for value in args],
        {name: _unwrap(value, index, func) for name, value in kwargs.items()},
        index,
    )


def _wrap(value, index):
    if isinstance(value, jax.Array):
        return BridgeTensor(value, index)
    if isinstance(value, (tuple, list)):
        return type(value)(_wrap(item, index) for item in value)
    return value


# ---------------------------------------------------------------- signature check


def _signature_item(value):
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype)
    if isinstance(value, float):
        return float
    if isinstance(value, (list, tuple)):
        return tuple(_signature_item(item) for item in value)
    return value


def _signature(func, args, kwargs):
    key = [func]
    for value in args:
        key.append(_signature_item(value))
    for name, value in kwargs.items():
        key.append(name)
        key.append(_signature_item(value))
    return tuple(key)


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(item) for item in value)
    return value


def _meta_result(func, args, kwargs):
    """torch's meta-kernel result for the call; raises torch's own error for bad input.

    Returns None when torch has no meta kernel for it (then nothing is checked).
    """
    if meta_of(func) in ("data-dependent", "stricter"):
        return None
    try:
        return func(*_to_meta(args), **{name: _to_meta(value) for name, value in kwargs.items()})
    except NotImplementedError:
        return None
    except Exception as error:  # noqa: BLE001 - re-raised unless meta itself is the problem
        text = str(error)
        if "meta" in text.lower() or "data-dependent" in text or "Unbacked" in text or "sym" in text.lower():
            return None
        kernel_error = _host_kernel_error(func, args, kwargs)
        if kernel_error is not None and type(kernel_error) is type(error):
            # torch's own kernels word some checks differently from its meta kernels ("mat1 and
            # mat2 shapes cannot be multiplied" for mm); the script would have seen theirs.
            raise kernel_error from None
        raise


def _host_kernel_error(func, args, kwargs):
    """The error torch's CPU kernel raises for arguments of these shapes and dtypes (tensors
    that take no memory: a 0-dim zero expanded), or None. Only for ops that write nothing."""
    if func._schema.is_mutable:
        return None

    def host(value):
        if isinstance(value, torch.Tensor):
            return torch.zeros((), dtype=value.dtype).expand(value.shape)
        if isinstance(value, (list, tuple)):
            return type(value)(host(item) for item in value)
        return value

    try:
        func(*host(args), **{name: host(value) for name, value in kwargs.items()})
    except Exception as error:  # noqa: BLE001 - returned for the caller to raise
        return error
    return None


def _leaves(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _compare(func, expected, actual):
    """Corrections to apply to the mapping's outputs (None if it agrees with torch)."""
    expected_leaves = list(_leaves(expected))
    actual_leaves = list(_leaves(actual))
    if len(expected_leaves) != len(actual_leaves):
        raise MappingMismatchError(
            f"bridge mapping for {func} returned {len(actual_leaves)} outputs where torch returns "
            f"{len(expected_leaves)}; this is a bug in the bridge's tables, please report it"
        )
    corrections = []
    needed = False
    for want, got in zip(expected_leaves, actual_leaves):
        if not isinstance(want, torch.Tensor) or not isinstance(got, jax.Array):
            corrections.append(None)
            continue
        if tuple(want.shape) != tuple(got.shape) and meta_of(func) != "shape-differs":
            raise MappingMismatchError(
                f"bridge mapping for {func} returned shape {tuple(got.shape)} where torch gives "
                f"{tuple(want.shape)} (called at {user_call_site()}); this is a bug in the bridge's "
                f"tables, please report it"
            )
        want_dtype = tensor_module.TORCH_TO_JAX.get(want.dtype)
        if want_dtype is not None and got.dtype != want_dtype:
            needed = True
            corrections.append(want_dtype)
            if func not in stats.dtype_corrections:
                detail = f"returned {got.dtype} where torch gives {want.dtype}; cast to torch's dtype"
                stats.dtype_corrections[func] = detail
                warn_at_user_site(f"bridge: mapping for {func} {detail}", MappingDtypeWarning)
        else:
            corrections.append(None)
    return tuple(corrections) if needed else None


def _apply_corrections(out, corrections):
    leaves = iter(corrections)

    def fix(value):
        if isinstance(value, (list, tuple)):
            return type(value)(fix(item) for item in value)
        dtype = next(leaves)
        return value.astype(dtype) if dtype is not None else value

    return fix(out)


# ---------------------------------------------------------------- plans


def _alias_plan(args, kwargs):
    """detach/alias: a new tensor sharing the value and view chain, with no JAX call (autograd
    detaches every gradient it accumulates, so this is on the path of each training step)."""
    base = args[0]
    root = root_of(base)
    if base._chain and base._seen != root._generation and "_members" in root.__dict__ and root._pending is None:
        # A member of a flat root not read since the root changed (runtime/flat.py: the
        # gradients of a fused run, which autograd detaches into `.grad`): the alias reads its
        # value when it is first read, as the member would, instead of now.
        value = base._value
        if type(value) is not jax.ShapeDtypeStruct:
            value = jax.ShapeDtypeStruct(value.shape, value.dtype)
        out = BridgeTensor(value, base._index)
        _make_view(out, root, base._chain)
        out._seen = -1
        return out
    out = BridgeTensor(read_value(base), base._index)
    _make_view(out, root, base._chain)
    return out


# In a captured region JAX differentiates the traced body, which torch's autograd does not see:
# a detached tensor must stop JAX's gradient there (a straight-through estimator's
# `z + (q - z).detach()`). The step is part of the view's chain, so a value read again from the
# root after an in-place write is stopped too; positions pass through it unchanged.
_STOP_GRADIENT = ViewStep(
    Mapping(aten.detach.default, jax.lax.stop_gradient, jax.lax.stop_gradient, None, False, "shapes"), (), {}, None
)


def _detach_plan(args, kwargs):
    if not settings.tracing:
        return _alias_plan(args, kwargs)
    base = args[0]
    out = BridgeTensor(jax.lax.stop_gradient(read_value(base)), base._index)
    _make_view(out, root_of(base), base._chain + (_STOP_GRADIENT,))
    return out


_SHARING_VIEWS = {aten.detach.default, aten.alias.default}


def _stop_gradient_of(tensor):
    """Cut a tensor made in a trace from JAX's gradient; a view keeps the cut in its chain."""
    if not jax.numpy.issubdtype(tensor._value.dtype, jax.numpy.inexact):
        return
    if tensor._root is not None:
        _make_view(tensor, tensor._root, tensor._chain + (_STOP_GRADIENT,))
    tensor._value = jax.lax.stop_gradient(tensor._value)


def _cut_from_gradient(out, args, kwargs):
    """An op run with grad mode off inside a differentiated trace: torch's autograd records
    nothing of it, so its results get no gradient. The arguments it wrote in place (returned
    as results) keep their own gradient path (runtime.tensor.write_value)."""
    written = {id(value) for value in _leaves((args, list(kwargs.values()))) if isinstance(value, BridgeTensor)}
    for value in _leaves(out):
        if isinstance(value, BridgeTensor) and id(value) not in written:
            _stop_gradient_of(value)


def _same_storage_numel_plan(args, kwargs):
    # forward-mode AD's make_dual asks whether a tangent's storage is laid out as its primal's
    # is; a bridge tensor's storage is its root's (BridgeTensor.untyped_storage)
    first, second = (root_of(tensor) for tensor in args)
    return first.numel() * first.element_size() == second.numel() * second.element_size()


def _make_plan(func):
    if func is aten._has_same_storage_numel.default:
        _plans[func] = _same_storage_numel_plan
        stats.op_rung[func] = stats.MAPPED
        stats.op_family[func] = "shapes"
        return _same_storage_numel_plan
    if func in _SHARING_VIEWS:
        plan = _plans[func] = _detach_plan if func == aten.detach.default else _alias_plan
        stats.op_rung[func] = stats.MAPPED
        stats.op_family[func] = "shapes"
        return plan
    if func.namespace in ("c10d", "_c10d_functional"):
        plan = _plans[func] = _collective_plan(func)
        stats.op_rung[func] = stats.MAPPED
        stats.op_family[func] = "distributed"
        return plan
    mapping = mapping_of(func)
    schema = func._schema
    if mapping is not None:
        if mapping.mutates:
            plan = _mutating_plan(func, mapping)
        elif func.is_view:
            plan = _view_plan(func, mapping)
        elif func is _LOCAL_SCALAR_DENSE:
            plan = _item_plan(func, mapping)
        else:
            plan = _mapped_plan(func, mapping)
        rung = stats.MAPPED
    else:
        functional = _functional_counterpart(func)
        # A derived op is what its functional counterpart is: mapped, or decomposed, or run on
        # the host CPU (the report must not call a host fallback a mapping).
        derived = stats.DERIVED
        if functional is not None:
            if functional not in _plans:
                _make_plan(functional)
            if stats.op_rung.get(functional) != stats.MAPPED:
                derived = stats.op_rung.get(functional, stats.DERIVED)
        if functional is not None and _changes_shape_in_place(func):
            plan, rung = _inplace_view_plan(func, functional), derived
        elif functional is not None and _writes_self(schema):
            plan, rung = _inplace_plan(func, functional), derived
        elif functional is not None and _out_arguments(schema):
            plan, rung = _out_plan(func, functional), derived
        elif torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # torch's own C++ composite kernel: what runs above autograd in eager torch, so an op
            # that reaches the bridge whole (inference mode, a captured trace) decomposes into
            # the same ops as it would have there. (Not OpOverload.has_kernel_for_dispatch_key,
            # which also counts Python kernels: upsample_nearest3d has one and no C++ kernel.)
            composite = functools.partial(func._op_dk, torch._C.DispatchKey.CompositeImplicitAutograd)
            plan, rung = _decomposed_plan(func, composite), stats.DECOMPOSED
        elif _decomposition(func) is not None:
            plan, rung = _decomposed_plan(func, _decomposition(func)), stats.DECOMPOSED
        else:
            plan, rung = _fallback_plan(func), stats.CPU_FALLBACK
    if func in _STORAGE_OFFSET_POSITION:
        plan = _offsets_into_own_elements(func, plan, _STORAGE_OFFSET_POSITION[func])
    if func is aten._to_copy.default:
        plan = _copies_to_meta(plan)
    _plans[func] = plan
    stats.op_rung[func] = rung
    stats.op_family[func] = mapping.family if mapping is not None else None
    return plan


def _collective_plan(func):
    """torch.distributed's ops (c10d::allreduce_ and kin) carry their process group: their CPU
    kernel hands the tensors as they are to the group's backend, which under the bridge is the
    bridge's (bridge/patches/distributed.py) and runs the collective on the device."""
    if func.namespace == "_c10d_functional":
        # The functional forms allocate their results (on the host, to torch's C++): the bridge
        # runs them itself, its results on the device (runtime/distributed.py).
        def functional(args, kwargs):
            return distributed.functional_collective(func, args, kwargs, user_call_site())

        return functional
    kernel = functools.partial(func._op_dk, torch._C.DispatchKey.CPU)

    def plan(args, kwargs):
        return kernel(*args, **kwargs)

    return plan


# as_strided and its kin take `storage_offset` counted from the start of the input's storage;
# their entries index the input's own elements. A view's `storage_offset()` says where it starts
# in its root's storage, so that much is taken off first (torch's decompositions pass
# `a.storage_offset() + k`, and `v.as_strided(size, stride, v.storage_offset())` is `v`).
_STORAGE_OFFSET_POSITION = {
    aten.as_strided.default: 3,
    aten.as_strided_copy.default: 3,
    aten.as_strided_.default: 3,
    aten.as_strided_scatter.default: 4,
    torch.ops.prims.as_strided.default: 3,
}


def _offsets_into_own_elements(func, plan, position):
    name = func._schema.arguments[position].name

    def run(args, kwargs):
        tensor = args[0] if args else kwargs.get("self")
        start = tensor.storage_offset() if isinstance(tensor, BridgeTensor) and tensor._chain else 0
        if start:
            args, kwargs = list(args), dict(kwargs)
            offset = args[position] if len(args) > position else kwargs.get(name)
            if offset is not None:
                if offset < start:
                    raise UnsupportedOpError(
                        f"{func} at {user_call_site()}: storage_offset={offset} reaches before the start of "
                        f"the view it is applied to (its storage_offset() is {start}); the bridge reads a "
                        "view's own elements. Apply it to the view's base tensor instead."
                    )
                if len(args) > position:
                    args[position] = offset - start
                else:
                    kwargs[name] = offset - start
        return plan(args, kwargs)

    return run


def _copies_to_meta(plan):
    """`_to_copy(..., device='meta')`: a meta tensor, as torch gives. C++ asks for one to learn a
    result's shape (the kernels of autograd's zero tensors, forward-mode AD's undefined tangents,
    compute `add(self.to(kMeta), other.to(kMeta))`)."""

    def run(args, kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "meta":
            tensor = args[0]
            return torch.empty(tensor.shape, dtype=kwargs.get("dtype") or tensor.dtype, device="meta")
        return plan(args, kwargs)

    return run


_core_decompositions = []


def _decomposition(func):
    """torch's decomposition of an op: the Core ATen one if there is one (it lands on ops the
    tables map), else any registered one (which may go through prims)."""
    if not _core_decompositions:
        _core_decompositions.append(torch._decomp.core_aten_decompositions())
    decomposition = _core_decompositions[0].get(func)
    if decomposition is None:
        decomposition = torch._decomp.decomposition_table.get(func)
    if decomposition is not None and not _takes_schema_positions(func, decomposition):
        return None
    return decomposition


def _takes_schema_positions(func, decomposition):
    """Whether a registered decomposition takes the op's positional arguments where its schema
    puts them. Some are references of the Python function instead: `nll_loss`'s takes
    (input, target, weight, size_average, ...) where aten.nll_loss has (self, target, weight,
    reduction, ...), so a reduction of 'sum' became a `size_average` and gave a mean; the
    references for var/std put `dim` where the schema has `unbiased`. The bridge sees such an
    op below autograd (torch.inference_mode, a captured trace); its CompositeImplicitAutograd
    kernel, torch's own, runs instead."""
    import inspect

    try:
        parameters = inspect.signature(decomposition).parameters.values()
    except (TypeError, ValueError):
        return True
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    schema = [argument.name for argument in func._schema.arguments if not argument.kwarg_only]
    return all(names.index(name) == position for position, name in enumerate(schema) if name in names)


def _writes_self(schema):
    arguments = schema.arguments
    return (
        schema.name.endswith("_")
        and arguments
        and arguments[0].alias_info is not None
        and arguments[0].alias_info.is_write
    )


def _out_arguments(schema):
    return [
        argument.name
        for argument in schema.arguments
        if argument.kwarg_only and argument.alias_info is not None and argument.alias_info.is_write
    ]


def _functional_counterpart(func):
    """`add.Tensor` for `add_.Tensor` and for `add.out`; None if there is none.

    The counterpart is the overload of the functional packet with the same name, else the one
    taking the same arguments (`bernoulli_.float` -> `bernoulli.p`, `normal_` -> `normal.functional`).
    """
    schema = func._schema
    base_name = schema.name.split("::")[-1]
    outs = _out_arguments(schema)
    if _writes_self(schema):
        packet = getattr(aten, base_name[:-1], None)
        same_name = getattr(packet, func._overloadname, None) if packet is not None else None
        if same_name is not None and not _out_arguments(same_name._schema):
            return same_name
        functional_packet = getattr(aten, base_name[:-1] + "_functional", None)  # normal_ -> normal_functional
        if functional_packet is not None:
            packet = functional_packet
    elif outs:
        packet = getattr(aten, base_name, None)
    else:
        return None
    if packet is None:
        return None
    wanted = [argument.name for argument in schema.arguments if argument.name not in outs]
    for name in packet.overloads():
        candidate = getattr(packet, name)
        candidate_schema = candidate._schema
        if _out_arguments(candidate_schema) or _writes_self(candidate_schema):
            continue
        if [argument.name for argument in candidate_schema.arguments] == wanted:
            return candidate
    return None


_prechecked = set()  # (op, direct key) of calls whose signature was checked


def _precheck(func, args, kwargs):
    """Run the meta kernel once per signature so invalid calls raise torch's own error."""
    if not settings.check_signatures:
        return
    direct = _direct_key(args, kwargs)  # finer than the signature, and cheaper to make
    if direct is not None and (func, direct) in _prechecked:
        return
    key = _signature(func, args, kwargs)
    if key not in _checked:
        _meta_result(func, args, kwargs)
        _checked[key] = None
    if direct is not None:
        if len(_prechecked) >= _DIRECT_LIMIT:
            _prechecked.clear()
        _prechecked.add((func, direct))


# A call repeating an earlier one's shapes, dtypes, devices and scalars, with no keyword
# arguments, runs the program compiled for that earlier call without building its signature,
# unwrapping lists or applying corrections again (`_direct_key`, `_mapped_plan`): on a small
# tensor these cost about as much as the XLA call. Entries past this many are dropped.
_DIRECT_LIMIT = 4096


_STATIC_ARGUMENT_TYPES = (torch.dtype, torch.device, torch.memory_format, torch.layout)


def _direct_item(value):
    """One argument's part of a direct key; None where the argument does not qualify."""
    kind = type(value)
    if kind is BridgeTensor:
        return (value.shape, value.dtype, value._index)
    if kind is float:
        return None if value != value else (float, value.hex())
    if kind is int or kind is bool or value is None or kind in _STATIC_ARGUMENT_TYPES:
        return (kind, value)
    if kind is list or kind is tuple:
        if value and type(value[0]) is BridgeTensor:
            if all(type(item) is BridgeTensor for item in value):
                return (kind, tuple([(item.shape, item.dtype, item._index) for item in value]))  # cat's tensors
            return None
        if all(type(item) is int for item in value):
            return (kind, tuple(value))  # sizes, dims
        if all(type(item) is float for item in value):
            return (kind, tuple([(float, item.hex()) for item in value]))  # foreach Adam's step sizes
    return None


def _direct_tensors(args):
    """The bridge tensors of a direct call's arguments, in the order its program takes their
    arrays (a list's tensors where the list stands)."""
    tensors = []
    for value in args:
        kind = type(value)
        if kind is BridgeTensor:
            tensors.append(value)
        elif (kind is list or kind is tuple) and value and type(value[0]) is BridgeTensor:
            tensors.extend(value)
    return tensors


def _direct_arrays(args):
    """The arrays of a direct call's arguments, in the order its program takes them."""
    return [read_value(tensor) for tensor in _direct_tensors(args)]


def _direct_key(args, kwargs):
    """What decides the program and the result's device for these arguments: bridge tensors'
    shapes, dtypes and devices (a list's too), scalars exactly (-0.0 is not 0.0), sizes and
    dtypes; None where an argument is something else (a plain tensor, a mixed list), a NaN, or
    a tensor passed by keyword (the program takes the positional ones' arrays only)."""
    key = []
    for value in args:
        item = _direct_item(value)
        if item is None:
            return None
        key.append(item)
    for name, value in kwargs.items():
        item = _direct_item(value)
        if item is None or type(value) is BridgeTensor or (type(value) in (list, tuple) and value and type(value[0]) is BridgeTensor):
            return None
        key.append((name, item))
    return tuple(key)


def _device_float_among(args):
    """Whether a positional argument is a bridge tensor that _on_host refuses (`where`'s values
    after its bool condition): the check costs a fifth of _on_host's."""
    return any(type(value) is BridgeTensor and value.dtype not in _HOST_DTYPES for value in args)


def _mapped_plan(func, mapping):
    call = CompiledEntry(func, mapping.call, reads_precision="precision" in mapping.reads)
    rng = mapping.rng
    mutating = bool(mapping.mutates)
    # Random ops draw a new key each call; mutating ones write their arguments afterwards.
    direct = None if rng or mutating else {}
    # A call whose Python floats changed since (a schedule's learning rate): by its key without
    # the floats' values, the entry's program that takes them as arguments (_with_call_floats).
    lifted = None if direct is None else {}

    def run(args, kwargs):
        if direct is not None and settings.host_int_ops and not settings.tracing:
            first = args[0] if args else None
            if (type(first) is list or type(first) is tuple) and first:
                first = first[0]  # cat's, stack's tensors
            if (type(first) is not BridgeTensor or first.dtype in _HOST_DTYPES) and not _device_float_among(args):
                out = _on_host(func, call, args, kwargs, new_shapes=False)
                if out is not None:
                    return out
        direct_key = None
        if direct is not None and settings.compile_ops and not settings.tracing:
            direct_key = _direct_key(args, kwargs)
            if direct_key is not None and call.reads_precision:
                direct_key += (precision.precision_settings(),)  # torch.set_float32_matmul_precision
            known = direct.get(direct_key) if direct_key is not None else None
            if known is None and lifted and direct_key is not None:
                exacts = []
                known = _with_call_floats(lifted, _floats_erased(direct_key, exacts), exacts)
            if known is not None:
                program, index = known
                out = program(_direct_arrays(args))
                return _wrap(out, index) if type(out) in (tuple, list) else BridgeTensor(out, index)
        if direct is not None and settings.host_int_ops and not settings.tracing:
            out = _on_host(func, call, args, kwargs, new_shapes=True)  # (a shape with no program yet)
            if out is not None:
                return out
        if settings.check_signatures:
            key = _signature(func, args, kwargs)
            if key not in _checked:
                # Validate first, so torch's error (not a JAX one) reports bad input.
                expected = _meta_result(func, args, kwargs)
            else:
                expected = None
        values, keywords, index = _unwrap_all(args, kwargs, func)
        if rng:
            generator = keywords.get("generator")
            if generator is None:
                keywords["key"] = random.next_key(index)
            else:
                keywords["key"] = random.generator_key(generator, index)
                keywords["generator"] = None  # drawn from; the entry only takes the key
        try:
            out = call(values, keywords)
        except Exception as error:
            error.add_note(f"(in the bridge's mapping of {func}, called at {user_call_site()})")
            raise
        if mutating:
            out, updates = out
        if settings.check_signatures:
            corrections = _checked.get(key, _UNCHECKED)
            if corrections is _UNCHECKED:
                corrections = None if expected is None else _compare(func, expected, out)
                _checked[key] = corrections
            if corrections is not None:
                out = _apply_corrections(out, corrections)
        if mutating:
            return _wrap(out, index), updates
        if direct_key is not None and (not settings.check_signatures or _checked.get(key) is None):
            _remember_direct(direct, direct_key, args, call.last, index, lifted)
        return _wrap(out, index)

    run.direct, run.entry, run.lifted = direct, call, lifted  # for the in-place forms derived from this op
    return run


# Integer and bool work on the host. torch's CPU kernel runs a small op in a few microseconds,
# where a program call on a GPU costs tens (HF generate's loop: ~40 ops a token on token ids,
# positions and masks, 75-135 us each on an H200). An op on small integer or bool tensors runs
# there (_on_host) when one of its tensors has its value on the host already (a factory's or a
# `.to("cuda")`'s result, runtime.tensor.host_array) and the others' can be had without waiting
# for the device, or a small one can; or when it would compile yet another program for an op
# whose shapes keep changing. The result stays on the host until the device reads it. Integer
# results are exact either way; floating-point ops stay on the device (torch's CPU kernels round
# their own way).
_HOST_DTYPES = tensor_module.HOST_DTYPES

# Elements of an op's tensors, in all, up to which it runs on the host (those moved there, as
# runtime.tensor.HOST_ELEMENTS: copying 2**16 elements to the device takes well under a
# millisecond). A new shape of an op that keeps changing shapes runs there up to 2**18
# (compiling costs tens of milliseconds).
_HOST_ELEMENTS = tensor_module.HOST_ELEMENTS
_NEW_SHAPE_ELEMENTS = 1 << 18

# A tensor of at most this many elements still being computed on the device is waited for, to
# join others on the host: the next token from argmax meeting the token ids. A larger one keeps
# the op on the device (where a wait would idle the device while the host catches up).
_WAIT_ELEMENTS = 64


class _NotForHost(Exception):
    pass


def _host_form(value, waiting, hosted):
    """One argument as torch's CPU kernel takes it: a bridge tensor as a CPU tensor over its host
    value (appended to `hosted`), or as itself where it has none yet (appended to `waiting`).
    Raises _NotForHost for a tensor that is not a small integer or bool bridge tensor (a plain
    torch tensor must not silently join the device's)."""
    kind = type(value)
    if kind is BridgeTensor:
        if value.dtype not in _HOST_DTYPES:
            raise _NotForHost
        array = host_array(value)
        if array is None:
            waiting.append(value)
            return value
        hosted.append(value)
        return torch.from_numpy(array)
    if (kind is list or kind is tuple) and value and isinstance(value[0], (torch.Tensor, type(None))):
        return kind(None if item is None else _host_form(item, waiting, hosted) for item in value)
    if isinstance(value, torch.Tensor):
        raise _NotForHost
    return value


def _on_host(func, call, args, kwargs, new_shapes):
    """Run the call by torch's CPU kernel on the host values of its tensors (see _HOST_DTYPES);
    the result stays on the host until the device reads it (OnHost). None where the call is not
    for the host, torch's CPU kernel refuses it (a dtype it lacks, bad arguments: the mapping's
    path then raises torch's error) or its result is floating point. `new_shapes`: whether a call
    of device values only may go too, for compiling yet another shape (asked where the call has
    no program yet: the test costs more than a program call)."""
    waiting, hosted = [], []
    try:
        cpu_args = [_host_form(value, waiting, hosted) for value in args]
        cpu_kwargs = {name: _host_form(value, waiting, hosted) for name, value in kwargs.items()} if kwargs else kwargs
    except _NotForHost:
        return None
    if not hosted and (not waiting or not new_shapes):
        return None
    values = [read_value(tensor) for tensor in waiting]
    if any(isinstance(value, jax.core.Tracer) for value in values):
        return None  # (in a trace that is not a region's: a custom Function's backward)
    elements = sum(tensor.numel() for tensor in hosted) + sum(tensor.numel() for tensor in waiting)
    if hosted:  # some tensor's value is on the host
        if elements > _HOST_ELEMENTS:
            return None
        for tensor, value in zip(waiting, values):
            if not (value.is_ready() or tensor.numel() <= _WAIT_ELEMENTS):
                return None
    elif not (new_shapes and elements <= _NEW_SHAPE_ELEMENTS and _compiles_yet_another_shape(call, args, kwargs)):
        return None
    if waiting:
        for tensor, value in zip(waiting, values):
            keep_host(tensor, np.array(value))  # a copy of its own, kept with the tensor
        cpu_args = [_host_form(value, [], []) for value in args]
        cpu_kwargs = {name: _host_form(value, [], []) for name, value in kwargs.items()}
    try:
        result = func(*cpu_args, **cpu_kwargs)
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if any(item.is_floating_point() or item.is_complex() for item in _leaves(result) if isinstance(item, torch.Tensor)):
        return None  # (an integer division's quotient)
    stats.host_runs[func] += 1
    return _from_host(result, (hosted or waiting)[0]._index)


def _abstract(value):
    """What _unwrap makes of an argument, with shapes and dtypes in place of arrays."""
    if type(value) is BridgeTensor:
        return jax.ShapeDtypeStruct(tuple(value.shape), TORCH_TO_JAX[value.dtype])
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (torch.Tensor, type(None))):
        return [None if item is None else _abstract(item) for item in value]
    return value


def _compiles_yet_another_shape(call, args, kwargs):
    """Whether the call would compile a new program for an op that has compiled several already
    (compiled_ops.EAGER_VARIANTS) and keeps meeting new shapes."""
    if not call.has_compiled_many():
        return False
    values = [_abstract(value) for value in args]
    keywords = {name: _abstract(value) for name, value in kwargs.items()}
    return call.has_compiled_many_but_not(values, keywords)


def _from_host(result, index):
    """A host result as bridge tensors kept on the host (OnHost)."""
    if isinstance(result, torch.Tensor):
        return on_host(result.numpy(), index)
    if isinstance(result, (list, tuple)):
        return type(result)(_from_host(item, index) for item in result)
    return result


def _remember_direct(direct, direct_key, args, program, index, lifted=None):
    if program is None or not _direct_arrays(args):
        return
    if len(direct) >= _DIRECT_LIMIT:
        direct.clear()
    direct[direct_key] = (program, index)
    _remember_lifted(lifted, direct_key, program, index)


def _remember_lifted(lifted, direct_key, program, index):
    """Where `program` (an entry's last) is a lifted program with one call's floats: it, by the
    call's key without the floats' values (see _with_call_floats)."""
    if lifted is not None and type(program) is WithFloats and program.baked is not None:
        if len(lifted) >= _DIRECT_LIMIT:
            lifted.clear()
        lifted[_floats_erased(direct_key)] = (program.program, program.baked, index)


def _with_call_floats(lifted, erased, exacts):
    """(the lifted program with this call's floats, the result's device) for a direct key whose
    floats differ from earlier calls' (see _mapped_plan), given as _floats_erased gives it: the
    key without the floats' values, and their values; or None: no lifted program for that key,
    or a float the program has compiled in differs."""
    known = lifted.get(erased)
    if known is None:
        return None
    program, baked, index = known
    if len(exacts) != len(baked):
        return None
    floats = []
    for exact, compiled_in in zip(exacts, baked):
        if compiled_in is None:
            floats.append(scalar_array(exact))
        elif compiled_in != exact:
            return None
    return WithFloats(program, floats), index


def _view_plan(func, mapping):
    compute = _mapped_plan(func, mapping)
    identity = mapping.identity_view  # the whole base at equal shapes: no step in a view chain
    # A call repeating an earlier one's direct key (_direct_key) makes its views without running
    # anything: their shapes and dtypes are the earlier results', and each runs the earlier
    # call's program on its base when first read (BridgeTensor._made), or applies its chain to
    # its root's value if the root has changed since (as a view whose root changed does).
    # torch's views run no kernel; an eager `x[:, 0]` or `view` ran a program call at once, as
    # much host time as the rest of the op's work together, whether or not it was read.
    lazy = {}  # direct key -> what _lazy_view takes after the base
    # (one result only: the key of a split, whose views are made at once, would be built twice a call)
    single = [str(item.type) for item in func._schema.returns] == ["Tensor"]
    # slice's keys without the offset, seen to make a plain view on the device (_moving_slice)
    moving = set() if func == aten.slice.Tensor else None

    def run(args, kwargs):
        base = args[0]
        if moving and not kwargs and not settings.tracing:
            view = _moving_slice(moving, mapping, args)
            if view is not None:
                return view
        key = None
        if single and type(base) is BridgeTensor and base.dtype not in _HOST_DTYPES and settings.compile_ops and not settings.tracing:
            key = _direct_key(args, kwargs)
            known = lazy.get(key) if key is not None else None
            if known is not None:
                return _lazy_view(base, *known)
            if key is not None and len(args) > 1 and _direct_tensors(args[1:]):
                key = None  # (views of the base only)
        out = compute(args, kwargs)
        if not isinstance(base, BridgeTensor):
            return out
        root = root_of(base)
        rest = args[1:]
        if identity and out.shape == base.shape:
            _make_view(out, root, base._chain)
            step = None
        elif isinstance(out, BridgeTensor):
            step = ViewStep(mapping, rest, kwargs, None)
            _make_view(out, root, base._chain + (step,))
        else:
            for position, item in enumerate(out):
                _make_view(item, root, base._chain + (ViewStep(mapping, rest, kwargs, position),))
            return out
        if key is not None:
            _learn_lazy(lazy, key, out, step, compute.direct.get(key))
        if moving is not None and not kwargs and type(out) is BridgeTensor and out._host is None and out._pending is None:
            found = _slice_key(args)
            if found is not None and found[1] == tuple(out.shape):
                if len(moving) >= _DIRECT_LIMIT:
                    moving.clear()
                moving.add(found[0])
        return out

    return run


def _slice_key(args):
    """(key, result shape) of `aten.slice.Tensor(base, dim, start, end, step)` with the start left
    out (the base's shape, dtype and device, the dim, step and count of elements), or None for
    arguments other than a bridge tensor and ints (None for the start or end) with a step of 1 or
    more, over a base of known sizes. The count is torch's: negative bounds count from the end,
    and both are clamped."""
    base = args[0]
    if type(base) is not BridgeTensor:
        return None
    dim, start, end, step = (tuple(args[1:]) + (0, None, None, 1)[len(args) - 1 :])[:4]
    if type(dim) is not int or type(step) is not int or step < 1 or (start is not None and type(start) is not int) or (end is not None and type(end) is not int):
        return None
    shape = tuple(base.shape)
    if not -len(shape) <= dim < len(shape) or not all(type(size) is int for size in shape):
        return None  # (a symbolic size: an exported program's dynamic dimension)
    dim %= len(shape)
    size = shape[dim]
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    start, end = min(max(start, 0), size), min(max(end, 0), size)
    count = max(0, -(-(end - start) // step))
    key = (shape, base.dtype, base._index, dim, step, count)
    return key, shape[:dim] + (count,) + shape[dim + 1 :]


def _moving_slice(moving, mapping, args):
    """A slice at an offset that changes from call to call (a loop's `source[i:i + 35]`, as
    pytorch/examples' word_language_model takes its batches): its view made at once, without
    running anything, where a slice of the same base shape, dim, step and length made a plain
    view on the device before. It is read as any view whose root changed is: its chain applied
    to the root's value (`_part`: one program a shape, the offset its argument). Through the
    op's full path (signature, metadata check, an entry per offset) each such call cost a few
    hundred microseconds of host time. A base with its value on the host is left to that path
    (small integer work stays there: _on_host)."""
    found = _slice_key(args)
    if found is None or found[0] not in moving:
        return None
    base = args[0]
    if base._host is not None or base._pending is not None:
        return None
    root = root_of(base)
    if root._pending is not None or root._host is not None:
        return None
    step = ViewStep(mapping, tuple(args[1:]), {}, None)
    struct = jax.ShapeDtypeStruct(found[1], TORCH_TO_JAX[base.dtype])
    # (read first with its base unchanged: the base's value, if kept, is cut)
    return _lazy_view(base, functools.partial(_step_on_first, step), struct, step, base._index)


def _step_on_first(step, arrays):
    return step(arrays[0])


def _item_plan(func, mapping):
    """`.item()`: a float tensor's one value read from its array at once. It compiles nothing
    (a copy to the host), so _mapped_plan's path (signature, unwrapping, entry) never reached
    its fast one, and cost as much as the copy."""
    plan = _mapped_plan(func, mapping)
    item = mapping.call

    def run(args, kwargs):
        tensor = args[0]
        if type(tensor) is BridgeTensor and not kwargs and tensor.dtype not in _HOST_DTYPES and not settings.tracing and tensor.numel() == 1:
            copy = tensor._host_copy
            if copy is not None and copy[1] == tensor._generation:
                return item(copy[0])  # its program's copy in host memory (runtime.capture's fused runs)
            return item(read_value(tensor))
        return plan(args, kwargs)

    return run


def _learn_lazy(lazy, key, out, step, direct):
    """Remember a view call's program (`direct`: the one _mapped_plan keeps for the key), its
    result's shape and dtype and its step (one view on the device only: one made on the host
    keeps its host value; the several views of a split would each run the program that makes
    them all)."""
    if direct is None or type(out) is not BridgeTensor or out._pending is not None or out._host is not None:
        return
    if len(lazy) >= _DIRECT_LIMIT:
        lazy.clear()
    lazy[key] = (direct[0], jax.ShapeDtypeStruct(out._value.shape, out._value.dtype), step, direct[1])


def _lazy_view(base, program, struct, step, index):
    root = root_of(base)
    view = BridgeTensor(struct, index)
    view._root, view._seen = root, -1
    view._chain = base._chain if step is None else base._chain + (step,)
    view._made = (program, base, root._generation)
    return view


def _make_view(view, root, chain):
    view._root = root
    view._chain = chain
    if type(view._pending) is OnHost:
        # Made on the host (_on_host): its value there, none on the device until read there
        # (runtime.tensor.read_value copies the host value over).
        view._host = (view._pending.array, root, root._generation)
        view._pending = view._value = None
        view._seen = -1
    else:
        view._seen = root._generation


def _mutating_plan(func, mapping):
    compute = _mapped_plan(func, mapping)
    positions = {argument.name: position for position, argument in enumerate(func._schema.arguments)}

    def run(args, kwargs):
        out, updates = compute(args, kwargs)
        for name, value in updates.items():
            position = positions[name]
            target = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(target, BridgeTensor):
                write_value(target, value.astype(read_value(target).dtype))
            elif isinstance(target, (list, tuple)):  # a Tensor(a!)[] argument: one value each
                for item, item_value in zip(target, value):
                    write_value(item, item_value.astype(read_value(item).dtype))
        return out

    return run


def _result_value(result, like):
    if isinstance(result, BridgeTensor):
        value = read_value(result)
    elif isinstance(result, torch.Tensor):
        value = jax.numpy.asarray(torch_to_numpy(result))
    else:
        value = result
    target_dtype = tensor_module.TORCH_TO_JAX[like.dtype]
    return value.astype(target_dtype) if value.dtype != target_dtype else value


def _written_arguments(schema):
    """(position, name) of every argument the op writes in place."""
    return [
        (position, argument.name)
        for position, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    ]


def _argument(args, kwargs, position, name):
    return args[position] if position < len(args) else kwargs.get(name)


def _write_into(target, value):
    """Write an op's result (bridge tensor, plain tensor or jax array) into a written argument."""
    if isinstance(target, (list, tuple)):
        for item, item_value in zip(target, value):
            _write_into(item, item_value)
    elif isinstance(target, BridgeTensor):
        write_value(target, _broadcast_to(_result_value(value, target), target.shape))
    elif isinstance(target, torch.Tensor):
        with torch.no_grad():
            target.copy_(value.cpu() if isinstance(value, BridgeTensor) else value)


def _with_defaults(schema, args, kwargs):
    """Positional arguments completed with the schema's defaults (for a counterpart whose
    schema has no default where this one has)."""
    positional = [argument for argument in schema.arguments if not argument.kwarg_only]
    if len(args) >= len(positional):
        return args, kwargs
    completed = list(args)
    for argument in positional[len(args):]:
        if argument.name in kwargs:
            completed.append(kwargs[argument.name])
        elif argument.has_default_value():
            completed.append(argument.default_value)
        else:
            break
    kwargs = {name: value for name, value in kwargs.items() if name not in {a.name for a in positional}}
    return tuple(completed), kwargs


def _inplace_plan(func, functional):
    """`foo_(self, ...)`: run the functional `foo`, write its outputs into the written arguments.

    `self.add_(other)` repeating an earlier call's shapes, dtypes and scalars, whose result
    needed no cast or broadcast to be written, runs the functional op's compiled program and
    writes `self` without the checks and wrappers of the general path (`fast`)."""
    written = _written_arguments(func._schema)
    returns = len(func._schema.returns)
    same_overload = func._overloadname == functional._overloadname
    single = [position for position, _ in written] == [0] and returns == 1
    # Several written arguments, or lists: the fused optimizer kernels (`_fused_adamw_`: the
    # parameters, gradients and moments) and `_foreach_*_` ops (`_foreach_add_(steps, 1)`).
    lists = bool(written) and returns == 0
    fast = {} if same_overload and (single or lists) else None
    # A call whose Python floats differ from every earlier call's (a learning-rate schedule's
    # `lr`, new each step) has a key of its own each time: by its key with the floats left out,
    # the functional op's program that takes them as arguments runs (_with_call_floats; else, for
    # lists, its entry) and its arrays are written directly, as above.
    floating = {} if fast is not None else None
    positions = [position for position, _ in written]
    unchanged = {}  # a list op's program -> which of its results are its inputs as they were

    def run(args, kwargs):
        key = None
        if fast is not None and settings.compile_ops and not settings.tracing and len(args) > positions[-1]:
            key = _direct_key(args, kwargs)
            known = fast.get(key) if key is not None else None
            program = None
            if known is not None and (not known[1].reads_precision or known[2] == precision.precision_settings()):
                program = known[0]
            exacts = []
            erased = _floats_erased(key, exacts) if program is None and key is not None else None
            entry = floating.get(erased) if erased is not None else None
            lifted = getattr(_plans.get(functional), "lifted", None) if entry is not None else None
            if lifted and not entry.reads_precision:
                found = _with_call_floats(lifted, erased, exacts)
                program = None if found is None else found[0]
            if program is not None:
                if not single:
                    _run_list_program(program, args, positions, unchanged)
                    return None
                target = args[0]
                if settings.defer_updates and not target._chain and target.dtype.is_floating_point:
                    deferred.record(program, target, _direct_tensors(args))
                else:
                    write_value(target, program(_direct_arrays(args)))
                return target
            if entry is not None and not single:
                values, keywords, index = _unwrap_all(args, kwargs, func)
                _write_results(args, positions, entry(values, keywords))
                _remember_lifted(lifted, key, entry.last, index)
                return None
        _precheck(func, args, kwargs)
        if not same_overload:
            args, kwargs = _with_defaults(func._schema, args, kwargs)
        result = _run_uncounted(functional, args, kwargs)
        results = [result] if len(written) == 1 else list(result)
        for (position, name), value in zip(written, results):
            _write_into(_argument(args, kwargs, position, name), value)
        if key is not None:
            entry = _remember_inplace(fast, key, functional, args, kwargs, result, positions)
            if entry is not None and floating is not None:
                if len(floating) >= _DIRECT_LIMIT:
                    floating.clear()
                floating[_floats_erased(key)] = entry
        if returns == 0:
            return None
        return args[0]

    run.fast, run.floating, run.unchanged = fast, floating, unchanged  # (tests)
    return run


def _run_list_program(program, args, positions, unchanged):
    """A list in-place op's functional program run on its arguments' arrays, its results written
    into the written arguments. Results that are an input returned as it was, into the argument
    it came from (`_fused_adamw_`'s gradients: 148 for GPT-2), are neither returned by the program
    (each would be a copy, a launch and an output buffer) nor written: the program is compiled
    again without them, once a trace has shown them."""
    base, floats = (program.program, (program.floats,)) if type(program) is WithFloats else (program, ())
    arrays = _direct_arrays(args)
    known = unchanged.get(base)
    if known is None:
        if len(unchanged) >= _DIRECT_LIMIT:
            unchanged.clear()
        known = unchanged[base] = _without_unchanged(base, arrays, floats, args, positions)
    if known is False:
        _write_results(args, positions, base(arrays, *floats))
        return
    pruned, kept = known
    results = iter(pruned(arrays, *floats))
    for position, keep in zip(positions, kept):
        target = args[position]
        if type(target) is BridgeTensor:
            if keep[0]:
                write_value(target, next(results))
            continue
        chosen = [tensor for tensor, written in zip(target, keep) if written]
        tensor_module.write_values(chosen, [next(results) for _ in chosen])


def _without_unchanged(base, arrays, floats, args, positions):
    """(a program returning only the results of `base` that are not its inputs returned as they
    were into the argument they came from, per written argument which of its results it returns),
    or False where every result is new."""
    raw = base.__wrapped__  # (the entry's function that jax.jit compiled)
    offsets, counts, start = {}, {}, 0
    for position, value in enumerate(args):
        offsets[position] = start
        counts[position] = len(_direct_tensors([value]))  # (as _direct_arrays orders them)
        start += counts[position]

    def split(arrays_in, out):
        outs = [out] if len(positions) == 1 else out
        kept, results = [], []
        for position, values in zip(positions, outs):
            items = values if type(values) in (list, tuple) else [values]
            keep = [k >= counts[position] or value is not arrays_in[offsets[position] + k] for k, value in enumerate(items)]
            kept.append(keep)
            results.extend(value for value, written in zip(items, keep) if written)
        return kept, results

    shown = []

    def traced(arrays_in, *floats_in):
        kept, results = split(arrays_in, raw(arrays_in, *floats_in))
        shown.append(kept)
        return results

    jax.make_jaxpr(traced)(arrays, *floats)
    kept = shown[0]
    if all(all(keep) for keep in kept):
        return False
    return jax.jit(lambda arrays_in, *floats_in: split(arrays_in, raw(arrays_in, *floats_in))[1]), kept


def _write_results(args, positions, out):
    """A list in-place op's program results written into its written arguments, as they are."""
    outs = [out] if len(positions) == 1 else out
    for position, values in zip(positions, outs):
        target = args[position]
        if type(target) is BridgeTensor:
            write_value(target, values)
        else:
            tensor_module.write_values(target, values)


def _written_as_is(targets, results):
    """Whether each result could be written into its target as it is (same dtype and shape)."""
    for target, result in zip(targets, results):
        if type(target) is BridgeTensor:
            if type(result) is not BridgeTensor or result.dtype != target.dtype or result.shape != target.shape:
                return False
        elif type(target) not in (list, tuple) or type(result) not in (list, tuple) or len(target) != len(result):
            return False
        elif not _written_as_is(target, result):
            return False
    return True


def _remember_inplace(fast, key, functional, args, kwargs, result, positions):
    """After a general in-place call: the functional op's program, if its results could be written
    into the written arguments as they were (same dtypes and shapes). Returns the functional op's
    entry where they could (its results then need no correction either), else None."""
    plan = _plans.get(functional)
    direct = getattr(plan, "direct", None)
    targets = [args[position] for position in positions]
    results = [result] if len(positions) == 1 else result
    if direct is None or type(results) not in (list, tuple) or len(results) != len(targets):
        return None
    if not _written_as_is(targets, results):
        return None
    target = next((item for item in _leaves(targets) if type(item) is BridgeTensor), None)
    if target is None:
        return None
    entry = plan.entry
    settings_read = precision.precision_settings() if entry.reads_precision else None
    known = direct.get(key + ((settings_read,) if settings_read is not None else ()))
    if known is None or known[1] != target._index:
        return None  # (run uncompiled, or with a dtype correction: no direct program)
    if len(fast) >= _DIRECT_LIMIT:
        fast.clear()
    fast[key] = (known[0], entry, settings_read)
    return entry


def _floats_erased(key, exacts=None):
    """A direct key with its Python floats' values left out (positional and keyword, lists of
    floats too); their values (float.hex()) appended to `exacts` in order, unless it is None."""
    return tuple(_float_erased(item, exacts) for item in key)


def _float_erased(item, exacts):
    first = item[0]
    if first is float:
        if exacts is not None:
            exacts.append(item[1])
        return (float,)
    if first is list or first is tuple:  # (kind, items): a list of floats
        items = item[1]
        if items and type(items[0]) is tuple and items[0] and items[0][0] is float:
            if exacts is not None:
                exacts.extend(exact for _, exact in items)
            return (first, len(items), float)
        return item
    if type(first) is str and type(item[1]) is tuple:  # a keyword's (name, item)
        return (first, _float_erased(item[1], exacts))
    return item


def _changes_shape_in_place(func):
    """squeeze_, unsqueeze_, transpose_, t_, as_strided_, resize_...: ops that give the tensor
    itself new sizes rather than new contents."""
    return torch.Tag.inplace_view in func.tags or func in (aten.resize_.default, aten.resize_as_.default)


def _inplace_view_plan(func, functional):
    """`x.squeeze_()`: `x` becomes what `x.squeeze()` would be, as in torch.

    A view keeps its root and takes the functional view's chain, so writes still reach the
    root. A root takes the new value (views made of it before the change keep reading the
    old layout's chain, which no longer applies: torch scripts rarely do this).
    `resize_` is not a view in torch (it reallocates), so a resized view leaves its root."""
    is_view = torch.Tag.inplace_view in func.tags

    def run(args, kwargs):
        _precheck(func, args, kwargs)
        target = args[0]
        settle(target)  # (deferred work would write the old layout after the change)
        result = _run_uncounted(functional, args, kwargs)
        value = _result_value(result, target)
        if tuple(target.shape) != tuple(value.shape):
            # Torch reads the sizes from the wrapper itself: give it the new ones.
            set_wrapper_layout(target, BridgeTensor(value, target._index))
        tensor_module.root_changed()
        if is_view and target._root is not None and isinstance(result, BridgeTensor):
            target._root, target._chain = result._root, result._chain
            target._value, target._seen = value, result._seen
        else:
            target._root, target._chain, target._value = None, (), value
            target._generation += 1
        return target

    return run


def _broadcast_to(value, shape):
    shape = tuple(shape)
    return value if tuple(value.shape) == shape else jax.numpy.broadcast_to(value, shape)


def _out_plan(func, functional):
    outs = _out_arguments(func._schema)

    def run(args, kwargs):
        _precheck(func, args, kwargs)
        functional_kwargs = {name: value for name, value in kwargs.items() if name not in outs}
        result = _run_uncounted(functional, args, functional_kwargs)
        targets = [kwargs[name] for name in outs]
        results = [result] if len(targets) == 1 else list(result)
        for target, value in zip(targets, results):
            replace_contents(target, _result_value(value, target))
        return targets[0] if len(targets) == 1 else tuple(targets)

    return run


def replace_contents(target, value):
    """Write `value` into `target`, resizing it first if torch's out= semantics call for it."""
    if not isinstance(target, BridgeTensor):
        # A plain CPU tensor given as out= (DDP's gradient buckets): write through torch.
        with torch.no_grad():
            if tuple(target.shape) != tuple(value.shape):
                target.resize_(value.shape)
            target.copy_(numpy_to_torch(np.array(value)))
        return
    if tuple(target.shape) != tuple(value.shape):
        settle(target)
        resized = BridgeTensor(value, target._index)
        set_wrapper_layout(target, resized)
        tensor_module.root_changed()
        target._root, target._chain, target._value = None, (), value
        target._generation += 1
        return
    write_value(target, value)


def rung_of(func):
    """The rung of the ladder that `func` takes (stats' names), its plan made if it has none yet."""
    if func not in _plans:
        _make_plan(func)
    return stats.op_rung.get(func, stats.MAPPED)


def _run_uncounted(func, args, kwargs):
    plan = _plans.get(func)
    if plan is None:
        plan = _make_plan(func)
    return plan(args, kwargs)


def _decomposed_plan(func, decomposition):
    def run(args, kwargs):
        result = decomposition(*args, **kwargs)
        if result is NotImplemented:
            return _fallback_plan(func)(args, kwargs)
        return result

    return run


# ---------------------------------------------------------------- CPU fallback


def _to_cpu(value):
    if isinstance(value, BridgeTensor):
        return to_torch(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return value


# Called as `fallback_hook(func, site)` when an op is about to take the CPU fallback: the bridge's
# whole-module rung (bridge/whole_module.py) installs it while active. It returns a phrase naming the
# module whose call runs the op ("the module Block"), or None, and may raise instead (inside a
# captured region's trace, so that the region runs eagerly once and that module is exported).
fallback_hook = None


def _fallback_plan(func):
    written = _written_arguments(func._schema)
    warned = []

    def run(args, kwargs):
        site = user_call_site()
        module = fallback_hook(func, site) if fallback_hook is not None else None
        if settings.strict:
            inside = f"\n  inside {module}" if module else ""
            raise UnsupportedOpError(
                f"torch operator {func} has no bridge mapping and no decomposition, and --strict forbids "
                f"running it on the CPU or exporting its module whole.{inside}\n  called at {site}\n  what to do: "
                f"run without --strict to let the bridge run {module or 'it'} through torch.export or, where that "
                f"fails, the op on the host CPU (slow, but correct), or file an issue asking for a mapping of {func}."
            )
        stats.fallback_calls[func] += 1
        if not warned:
            warned.append(True)
            stats.fallback_sites.setdefault(func, site)
            later = (
                f" It ran inside {module}, which the bridge tries to run whole through torch.export from its next call."
                if module
                else ""
            )
            warn_at_user_site(
                f"bridge: {func} has no mapping; running it with eager torch on the host CPU "
                f"(slow: a copy to the host and back).{later} This warning is shown once per op.",
                CPUFallbackWarning,
            )
        index = _device_index(args, kwargs)
        cpu_args = _to_cpu(list(args))
        cpu_kwargs = {name: _to_cpu(value) for name, value in kwargs.items()}
        result = func(*cpu_args, **cpu_kwargs)
        for position, name in written:
            _copy_back(_argument(args, kwargs, position, name), _argument(cpu_args, cpu_kwargs, position, name), index)
        traits = OP_TRAITS.get(func)
        host_outputs = traits.host_outputs if traits is not None else ()  # torch keeps them on the host
        if host_outputs and isinstance(result, tuple):
            return tuple(
                item if position in host_outputs else _from_cpu(item, args, kwargs, cpu_args, cpu_kwargs, index)
                for position, item in enumerate(result)
            )
        return _from_cpu(result, args, kwargs, cpu_args, cpu_kwargs, index)

    return run


def _copy_back(target, source, index):
    """After a CPU fallback: the CPU copy of a written argument goes back into the bridge tensor."""
    if isinstance(target, (list, tuple)):
        for item, item_source in zip(target, source):
            _copy_back(item, item_source, index)
    elif isinstance(target, BridgeTensor):
        replace_contents(target, devices.put(torch_to_numpy(source), index))


def _from_cpu(result, args, kwargs, cpu_args, cpu_kwargs, index):
    if isinstance(result, torch.Tensor):
        for original, converted in zip(list(args) + list(kwargs.values()), cpu_args + list(cpu_kwargs.values())):
            if converted is result:
                return original  # an in-place op returns its (now updated) argument
        return BridgeTensor(devices.put(torch_to_numpy(result), index), index)
    if isinstance(result, (list, tuple)):
        return type(result)(_from_cpu(item, args, kwargs, cpu_args, cpu_kwargs, index) for item in result)
    return result
