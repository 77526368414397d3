"""The bridge tensor: a `torch.Tensor` wrapper subclass whose data is a `jax.Array`.

To torch's C++ core (autograd engine, dispatcher) a bridge tensor is a CPU
tensor with Python dispatch; to the script it reports the device it asked
for ('cuda:N'), because a wrapper that reported 'cuda' to C++ would break the
autograd engine on CPU-only torch builds and mix with real CUDA tensors on
CUDA builds (docs/design.md).

Aliasing: a view keeps its root tensor and the chain of view ops that made it;
writes through a view are scattered into the root, and views of a root that
changed are recomputed when next read (see `read_value` / `write_value`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import devices, symbolic
from .config import settings
from .dtypes import JAX_TO_TORCH, TORCH_TO_JAX


_make_wrapper = torch.Tensor._make_wrapper_subclass


class BridgeTensor(torch.Tensor):
    """A torch tensor living on a JAX device."""

    # _value: the jax.Array (possibly stale for a view; read through read_value)
    # _root: None for a tensor owning its data, else the owning BridgeTensor
    # _chain: the view ops from the root to this tensor
    # _seen: the root's version when _value was computed
    # _generation: (roots) bumped on every write
    # _index: the bridge device ordinal
    # _pending: (roots) None, or deferred work that gives the tensor its value when it is next
    #   read or written: a clip_grad_norm_ folded into the optimizer's step (runtime.optimizers.PendingClip),
    #   a value not yet copied to the device (OnHost)
    # _host: None, or (numpy array, root, root's generation): the tensor's value on the host as of
    #   that generation of its root (None for a root itself); see host_array
    # _host_copy: None, or (jax array in the host's memory, generation): a copy of this root's
    #   value that its program wrote into host memory as of that generation (a training step's
    #   loss: runtime.capture's fused runs), which `.item()` reads without a copy from the device
    # _made: None, or (program, base, root's generation): a view made
    #   without running its op (runtime.dispatch._view_plan), computed from its base when first
    #   read if its root is unchanged since

    # What a new tensor owning its data starts with (instances set their own when they change).
    _pending: Any = None
    _host: Any = None
    _host_copy: Any = None
    _made: Any = None
    _root = None
    _chain = ()
    _seen = 0
    _generation = 0

    @staticmethod
    def __new__(cls, value, index=0, requires_grad=False):
        # The wrapper's device is torch's default, the CPU; a new tensor is made for each op's
        # result, so only what differs from the defaults is passed.
        try:
            if requires_grad:
                tensor = _make_wrapper(cls, value.shape, dtype=JAX_TO_TORCH[value.dtype], requires_grad=True)
            else:
                tensor = _make_wrapper(cls, value.shape, dtype=JAX_TO_TORCH[value.dtype])
        except TypeError:
            if not symbolic.is_symbolic(value.shape):
                raise
            # a dimension variable of jax.export's trace (runtime/symbolic.py): a SymInt to torch
            tensor = _make_wrapper(cls, symbolic.torch_shape(value.shape), dtype=JAX_TO_TORCH[value.dtype], requires_grad=requires_grad)
        tensor._value = value
        tensor._index = index
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    # Traceable-wrapper-subclass protocol: makes nn.Module._apply swap parameters
    # in place (keeping their identity for optimizers built before .to()).
    def __tensor_flatten__(self):
        return [], (self._index,)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, context, outer_size, outer_stride):
        raise NotImplementedError("bridge tensors are not rebuilt from flattened parts")

    # What the script sees of the device.
    @property
    def device(self):
        return devices.torch_device(self._index)

    @property
    def is_cuda(self):
        return settings.device_type == "cuda"

    @property
    def is_cpu(self):
        return False

    def get_device(self):
        return self._index

    @property
    def data(self):
        if not self._chain and trace_hook is None and not settings.tracing:
            # An alias of the whole root made here, as `detach` makes it: through torch's
            # dispatch it took 5x as long (an update loop's `p.data.add_(...)`, per parameter).
            root = root_of(self)
            if root._pending is not None:
                # Deferred work writes the root (runtime/deferred.py): the alias reads it when
                # read, so that `ema.data.mul_(d)` after `ema.data.add_(x)` records too.
                alias = BridgeTensor(root._value, self._index)
                alias._root, alias._seen = root, -1
                return alias
            value = read_value(self)
            alias = BridgeTensor(value, self._index)
            alias._root, alias._seen = root, root._generation
            return alias
        with torch.no_grad():
            return self.detach()

    @data.setter
    def data(self, other):
        if not isinstance(other, BridgeTensor):
            other = to_bridge(other, self._index)
        if other.shape != self.shape or other.dtype != self.dtype:
            # Let torch update the wrapper's sizes and dtype; the value follows below.
            set_wrapper_layout(self, other)
        elif other._index != self._index:
            _layout_changed()
        value = read_value(other)
        settle(self)
        root_changed()
        self._root, self._chain, self._value = None, (), value
        self._generation += 1
        self._index = other._index

    # Sync points and transfers.
    def cpu(self, memory_format=torch.preserve_format):
        return self.to("cpu")

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        index = devices.current_index() if device is None else devices.bridge_index(device)
        if index is None:
            index = torch.device(device).index or 0
        return self.to(devices.torch_device(index))

    def to(self, *args, **kwargs):
        if not kwargs and len(args) == 1 and type(args[0]) is torch.dtype:
            # x.to(torch.float32), the common form: what the general path below does for it,
            # without parsing the arguments (about a fifth of the call's host time)
            return self if args[0] == self.dtype else torch._C.TensorBase.to(self, args[0])
        device, dtype, non_blocking, copy, memory_format = _parse_to(args, kwargs)
        if device is not None and device.type == "cpu":
            moved = to_cpu_autograd(self)
            return moved.to(dtype=dtype, copy=False) if dtype is not None else moved
        result = self
        if device is not None:
            index = devices.bridge_index(device)
            if index is None:
                raise devices.DeviceError(
                    f"cannot move a bridge tensor to {device}; bridge tensors move to "
                    f"'{settings.device_type}:N' or 'cpu'"
                )
            if index != self._index:
                result = _ToDevice.apply(self, index)
                copy = False
        if dtype is not None and dtype != result.dtype or copy:
            result = torch._C.TensorBase.to(result, dtype=dtype or result.dtype, copy=copy)
        return result

    def numpy(self, *, force=False):
        if not force:
            # The script believes this tensor is on a GPU, where torch refuses too.
            raise TypeError(
                f"can't convert {self.device} device type tensor to numpy. "
                "Use Tensor.cpu() to copy the tensor to host memory first."
            )
        return np.array(to_numpy(self))  # a copy: the host value may be shared (a factory's)

    def tolist(self):
        return to_numpy(self).tolist()

    def __repr__(self, *, tensor_contents=None):
        text = repr(_to_cpu_tensor(self))
        suffix = f"device='{self.device}'"
        if self.grad_fn is not None:
            tail = f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            tail = ", requires_grad=True"
        else:
            tail = ""
        head = text[:-1]
        # torch puts the device right after the data, before dtype and grad information.
        marker = ", dtype=" if ", dtype=" in head else None
        if marker:
            data, rest = head.split(marker, 1)
            return f"{data}, {suffix}{marker}{rest}{tail})"
        return f"{head}, {suffix}{tail})"

    def __format__(self, format_spec):
        if self.dim() == 0:
            return self.detach().item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __reduce_ex__(self, protocol):
        # Checkpoints must load in plain torch: save as an ordinary CPU tensor (or Parameter).
        if pickled_devices is not None:
            pickled_devices.append(self._index)  # torch.save under the bridge counts them
        plain = _to_cpu_tensor(self)
        if getattr(self, "_is_param", False):
            plain = torch.nn.Parameter(plain, requires_grad=self.requires_grad)
        elif self.requires_grad:
            plain.requires_grad_(True)
        return plain.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        copied = to_bridge(_to_cpu_tensor(self), self._index)
        if self.requires_grad:
            copied.requires_grad_(True)
        memo[id(self)] = copied
        return copied

    # Storage identity, as torch's serialization libraries read it (safetensors and
    # `save_pretrained` find tied weights by storage address): a view, a detached alias and a
    # tied parameter answer their root's storage; `data_ptr` and `storage_offset` place a view
    # where torch would, in its root's elements.
    def untyped_storage(self):
        root = root_of(self)
        if "_on_free" not in root.__dict__:
            root._on_free = {}  # its storage may be freed: see BridgeStorage.resize_ and when_freed
        return BridgeStorage(root)

    def _storage_freed(self, root):
        # A view's copy of its part of a root whose storage was just freed goes with it (FSDP's
        # unsharded parameters, views into each block's gathered buffer): its shape and dtype stay.
        self._value = jax.ShapeDtypeStruct(self._value.shape, self._value.dtype)

    def storage_offset(self):
        return _byte_offset(self) // self.element_size()

    def data_ptr(self):
        return storage_address(root_of(self)) + _byte_offset(self)


def _byte_offset(tensor):
    root = tensor._root
    if root is None or not tensor._chain:
        return 0
    from .views import first_position

    complex_root = root.is_complex()
    unit = root.element_size() // 2 if complex_root else root.element_size()
    return first_position(root.shape, complex_root, tensor._chain) * unit


# Addresses handed to roots when first asked for: never 0 (which serialization libraries read
# as "no storage"), never given to two roots, 64-byte aligned as torch's allocators are.
_ALIGNMENT = 64
_next_address = [1 << 40]


def storage_address(root: BridgeTensor) -> int:
    address = root.__dict__.get("_storage_address")
    if address is None:
        address = _next_address[0]
        size = root.numel() * root.element_size()
        _next_address[0] += max(_ALIGNMENT, -(-size // _ALIGNMENT) * _ALIGNMENT)
        root._storage_address = address
    return address


@functools.lru_cache(maxsize=256)
def _filled_program(shape, dtype, index):
    device = devices.jax_device(index)
    return jax.jit(lambda value: jnp.full(shape, value, dtype), out_shardings=jax.sharding.SingleDeviceSharding(device))


def filled(shape: tuple, dtype: Any, value: Any, index: int) -> jax.Array:
    """A fresh array of `value` made on a bridge device by a compiled program: nothing made on
    the host and copied (a large torch.empty(..., device="cuda") took 260 ms so on an H200), no
    eager jnp call (FSDP frees and refills each block's storage every step: 0.6 ms a call)."""
    return _filled_program(tuple(shape), jnp.dtype(dtype), index)(value)


class BridgeStorage(torch.UntypedStorage):
    """`untyped_storage()` of a bridge tensor: the identity, size and device of its root's data,
    whose bytes are a jax.Array's. Reading them (`cpu()`) copies the root's current contents to
    the host; writing through the storage object is not supported."""

    def __new__(cls, root):
        storage = super().__new__(cls, 0, device="meta")
        storage._bridge_root = root
        return storage

    def __init__(self, root):
        pass

    def data_ptr(self):
        return storage_address(self._bridge_root)

    def nbytes(self):
        root = self._bridge_root
        return 0 if root.__dict__.get("_freed") else root.numel() * root.element_size()

    def resize_(self, size):
        """Free the root's data (size 0) or give it back fresh memory of its own size, as FSDP
        frees each block's gathered parameters between uses (`storage.resize_(0)`, then back to
        its size before the next all-gather writes it): without it every block's would stay."""
        root = self._bridge_root
        whole = root.numel() * root.element_size()
        if size == 0:
            settle(root)
            root._value = filled((0,), TORCH_TO_JAX[root.dtype], 0, root._index)
            root._freed = True
            # What still holds the old array lets go: views' copies, and a captured region's saved
            # inputs, which its backward reads again once the storage is filled (runtime/capture.py).
            watchers = root.__dict__.get("_on_free", {})
            for ref in list(watchers.values()):
                holder = ref()
                if holder is not None:
                    holder._storage_freed(root)
            watchers.clear()
        elif size == whole:
            if root.__dict__.get("_freed"):
                root._value = filled(tuple(root.shape), TORCH_TO_JAX[root.dtype], 0, root._index)
                root._freed = False
        else:
            raise NotImplementedError(
                f"resizing a bridge tensor's storage to {size} bytes: only to 0 (freeing it) and back to its "
                f"tensor's {whole} bytes are supported"
            )
        root._generation += 1
        return self

    def size(self):
        return self.nbytes()

    def __len__(self):
        return self.nbytes()

    @property
    def device(self):
        return self._bridge_root.device

    @property
    def is_cuda(self):
        return self._bridge_root.is_cuda

    def cpu(self):
        return _to_cpu_tensor(self._bridge_root).untyped_storage()

    def tolist(self):
        return self.cpu().tolist()

    def __repr__(self):
        return f"BridgeStorage(nbytes={self.nbytes()}, device='{self.device}', data_ptr={self.data_ptr():#x})"


# Arithmetic operators on bridge tensors skip torch's dispatcher when it would add nothing: no
# autograd to record, no autocast, no torch function or dispatch mode, no functorch transform, no
# inference or forward-mode AD, no region being traced. The dispatcher's way into
# `__torch_dispatch__` and back costs more than the op's XLA call on a small tensor (4-10 us);
# these calls reach the same plan (runtime/dispatch.py) with the same arguments as it would.
# Everything else, and any other operand (a plain tensor, a numpy value), takes torch's way.
_SCALARS = (int, float, bool)


_grad_enabled = torch._C.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_function_mode = torch._C._is_torch_function_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_inference_mode = torch._C.is_inference_mode_enabled
_functorch_layer = torch._C._functorch.peek_interpreter_stack
_forward_ad = torch.autograd.forward_ad


def _dispatcher_adds_nothing(tensor, other):
    return not (
        settings.tracing
        or (_grad_enabled() and (tensor.requires_grad or (type(other) is BridgeTensor and other.requires_grad)))
        or _any_autocast()
        or _function_mode()
        or _dispatch_modes()
        or _inference_mode()
        or _functorch_layer() is not None
        or _forward_ad._current_level >= 0
    )


def _binary_operator(name, overload, reflected):
    through_torch = getattr(torch.Tensor, name)

    def operator(self, other, *more, **options):
        kind = type(other)
        if more or options:  # alpha=, rounding_mode=, out=
            return through_torch(self, other, *more, **options)
        if (kind is BridgeTensor or kind in _SCALARS) and _dispatcher_adds_nothing(self, other):
            if kind is BridgeTensor and other._index != self._index:
                return through_torch(self, other)  # torch's error for tensors on two devices
            return _dispatch(overload, (self, other), {})
        if reflected and isinstance(other, torch.Tensor):
            # `plain + bridge`: let the left operand's own operator run, as it did before
            # bridge tensors had operators of their own.
            return NotImplemented
        return through_torch(self, other)

    operator.__name__ = operator.__qualname__ = name
    return operator


_aten = torch.ops.aten
for _name, _overload, _reflected in (
    ("__add__", _aten.add.Tensor, False),
    ("__radd__", _aten.add.Tensor, True),
    ("add", _aten.add.Tensor, False),
    ("__sub__", _aten.sub.Tensor, False),
    ("sub", _aten.sub.Tensor, False),
    ("__mul__", _aten.mul.Tensor, False),
    ("__rmul__", _aten.mul.Tensor, True),
    ("mul", _aten.mul.Tensor, False),
    ("__truediv__", _aten.div.Tensor, False),
    ("div", _aten.div.Tensor, False),
):
    setattr(BridgeTensor, _name, _binary_operator(_name, _overload, _reflected))


_dispatch = None  # runtime.dispatch's entry point (install)


def install(dispatch: Callable[[Any, tuple, dict], Any]) -> None:
    """Route every ATen call on a bridge tensor to `dispatch(func, args, kwargs)`: runtime.dispatch
    installs itself when imported (it imports this module, so this module cannot import it)."""
    global _dispatch
    _dispatch = dispatch


def _parse_to(args, kwargs):
    copy = kwargs.pop("copy", False)
    if args and isinstance(args[0], torch.Tensor):
        other = args[0]
        return other.device, other.dtype, kwargs.get("non_blocking", False), copy, None
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype, non_blocking, copy, memory_format


# Set by runtime/capture.py through set_hooks. trace_hook: called with every tensor read or
# written while a region is traced. host_value_hook: while a region is traced or its host values
# recorded, runs each `_local_scalar_dense` (`.item()`, `bool(t)`, `int(t)`) as
# host_value_hook(plan, args, kwargs).
trace_hook = None
host_value_hook = None


def set_hooks(trace: Optional[Callable], host_value: Optional[Callable]) -> tuple[Optional[Callable], Optional[Callable]]:
    """Set both capture hooks (None: off); returns the pair they replace, to restore."""
    global trace_hook, host_value_hook
    previous = (trace_hook, host_value_hook)
    trace_hook, host_value_hook = trace, host_value
    return previous


# Counts the changes of a bridge tensor's sizes, dtype or device in place (the Python object
# stays): captured regions cache their state's layout and check this count instead of every
# tensor on every call. (torch.utils.swap_tensors, which Module.to uses, swaps the objects'
# __dict__s, which the regions check too.)
layout_changes = 0


def _layout_changed():
    global layout_changes
    layout_changes += 1


# Counts the changes of an existing bridge tensor's root (`_root`): a member leaving its flat root
# (runtime/flat.py `release`), `.data =`, a resize, a trace's detaching of packs, swap_tensors.
# A flat root found holding a list of tensors (flat.holding) holds them while this count stays:
# an optimizer's update then need not look at its 148 parameters and state tensors each step.
# (A new tensor made a view or a member, its `_root` set once, changes no one's.)
root_changes = 0


def root_changed() -> None:
    global root_changes
    root_changes += 1


def set_wrapper_layout(target: BridgeTensor, source: torch.Tensor) -> None:
    """Give the wrapper `target` the sizes and dtype of the tensor `source` (its value is the
    caller's to set)."""
    _layout_changed()
    torch._C.TensorBase.data.__set__(target, source)


def held_only_by_their_tensors(tensors: Sequence[BridgeTensor], values: list[jax.Array]) -> bool:
    """Whether each array in `values` (read_value of each of `tensors`) has no holder but its
    tensor and, for an alias of a whole root (a parameter after Module.to), that root: no other
    tensor shares it (`.data =` hands a tensor another's array), no other view caches it, no
    autograd graph keeps it for a backward still to come (runtime.capture releases a region's
    inputs once its graph is freed). Such an array's buffer can be given to the program that
    computes the tensor's next value. The count is taken against an object held the same way,
    so it does not depend on how the interpreter counts references."""
    canary = object()
    counts = [sys.getrefcount(value) for value in values + [canary]]
    base = counts.pop()  # the canary has its local name where the values have the list `values`
    for tensor, value, count in zip(tensors, values, counts):
        root = tensor._root
        holders = 2 if root is not None and not tensor._chain and root._value is value else 1
        if count != base + holders:
            return False
    return True


def settle(tensor: BridgeTensor) -> None:
    """Run the deferred work that gives a tensor's root its value, before its value is replaced
    outside write_value (the deferred work would overwrite the replacement)."""
    root = root_of(tensor)
    if root._pending is not None and not settings.tracing:
        root._pending.resolve(root)


def root_of(tensor: BridgeTensor) -> BridgeTensor:
    """The tensor owning a bridge tensor's data: itself, or the root it is a view of."""
    return tensor if tensor._root is None else tensor._root


def read_value(tensor: BridgeTensor) -> jax.Array:
    """The current jax.Array of a bridge tensor, recomputing a view whose root changed."""
    if trace_hook is not None:
        trace_hook(tensor)
    root = tensor._root
    if root is None:
        if tensor._pending is not None and not settings.tracing:
            tensor._pending.resolve(tensor)
        return tensor._value
    if root._pending is not None and not settings.tracing:
        root._pending.resolve(root)  # (deferred work writes the root: the view's value may change)
    if tensor._seen == root._generation:
        return tensor._value
    host = tensor._host
    if host is not None and host[1] is root and host[2] == root._generation and not settings.tracing:
        value = tensor._value = devices.put(_c_order(host[0]), tensor._index)  # a view made on the host
        tensor._seen = root._generation
        return value
    if not tensor._chain:  # an alias of the whole root (detach, .data, a parameter)
        value = root._value if root._pending is None else read_value(root)
        tensor._value = value
        tensor._seen = root._generation
        return value
    value = read_value(root)
    members = None if settings.tracing else root.__dict__.get("_members")
    position = None if members is None else members.place(tensor)
    if position is not None:
        # A member of a flat root (runtime/flat.py), or an alias of one (a gradient's `.grad`):
        # every member is cut from it in one program,
        # and kept there only (kept here too, it would outlive the root's next value).
        return members.piece(root, value, position)
    value = _view_value(tensor, root, value)
    tensor._value = value
    tensor._seen = root._generation
    if "_on_free" in root.__dict__ and not settings.tracing:
        when_freed(root, tensor)
    return value


def _view_value(tensor: BridgeTensor, root: BridgeTensor, value: jax.Array) -> jax.Array:
    """A view's value from its root's `value`: its chain's steps applied to it, or, for a view
    made without running its op (BridgeTensor._made) whose root is unchanged since, that op's
    program run on its base."""
    made = tensor._made
    if made is not None:
        tensor._made = None
        program, base, generation = made
        if generation == root._generation and root_of(base) is root and not settings.tracing:
            return program([read_value(base)])
    chain: tuple[Any, ...] = tensor._chain
    for apply_view in chain:
        value = apply_view(value)
    return value


def when_freed(root: BridgeTensor, holder: Any) -> None:
    """Have `holder._storage_freed(root)` called when the root's storage is freed
    (`untyped_storage().resize_(0)`); held weakly."""
    # (by id, not a WeakSet: that compares tensors with ==)
    watchers = root.__dict__.get("_on_free")
    if watchers is None:
        watchers = root._on_free = {}
    key = id(holder)
    if key not in watchers:

        def forget(_: Any) -> None:
            watchers.pop(key, None)

        watchers[key] = weakref.ref(holder, forget)


def read_values(tensors: Sequence[BridgeTensor]) -> list[jax.Array]:
    """read_value of each tensor, the common cases (a root with no work pending, a view or alias
    already up to date) inline: an optimizer step reads hundreds."""
    if trace_hook is not None:
        return [read_value(tensor) for tensor in tensors]
    values = []
    for tensor in tensors:
        root = tensor._root
        if tensor._pending is None if root is None else (tensor._seen == root._generation and root._pending is None):
            values.append(tensor._value)
        else:
            values.append(read_value(tensor))
    return values


@jax.custom_vjp
def _written_without_grad(old, new):
    return new


def _written_forward(old, new):
    return new, None


def _written_backward(_, gradient):
    return gradient, jnp.zeros_like(gradient)


_written_without_grad.defvjp(_written_forward, _written_backward)


def write_value(tensor: BridgeTensor, value: jax.Array) -> None:
    """Replace a tensor's contents (an in-place op's result), through views into the root."""
    if trace_hook is not None:
        trace_hook(tensor)
    if settings.tracing_for_grad and settings.tracing and not _grad_enabled() and jnp.issubdtype(value.dtype, jnp.inexact):
        # Written with grad mode off in a differentiated trace (`with torch.no_grad():
        # weight.mul_(0.5)`): torch's autograd records nothing, so gradients of later uses flow
        # to the tensor as they would have without the write, and none to what was written.
        value = _written_without_grad(read_value(tensor), value)
    settle(tensor)  # the deferred work read the value before this write
    root = tensor._root
    if root is None:
        tensor._value = value
        tensor._generation += 1
        members = tensor.__dict__.get("_members")
        if members is not None:
            members.forget()  # a flat root's members' values, cut from its last value (runtime/flat.py)
        return
    if tensor._chain:
        from .views import scatter_into_root

        release = None if settings.tracing else root.__dict__.get("_on_member_write")
        if release is not None:
            release()  # gradients joined in one flat root go back to arrays of their own (runtime/flat.py)
            if tensor._root is None:
                write_value(tensor, value)
                return
        members = None if settings.tracing else root.__dict__.get("_members")
        # A member's span of a flat root (runtime/flat.py) is written in place where it can be
        # (settled above: no deferred work waits on the root).
        written = None if members is None else members.write(root, tensor._chain, value)
        if written is not None:
            root._value = written
            root._generation += 1
            members.written(root, tensor._chain, value)  # the members' values, this one's too, still hold
            tensor._seen = -1  # (read through the members' values)
            return
        root._value = scatter_into_root(read_value(root), tensor._chain, value)
    else:
        root._value = value
    root._generation += 1
    tensor._value = value
    tensor._seen = root._generation


def write_values(tensors: Sequence[BridgeTensor], values: Sequence[jax.Array]) -> None:
    """write_value of each tensor, the common cases (a root, or an alias of a whole root, with no
    work pending and no trace recording) inline: an optimizer step writes hundreds."""
    if trace_hook is not None or settings.tracing:
        for tensor, value in zip(tensors, values):
            write_value(tensor, value)
        return
    for tensor, value in zip(tensors, values):
        root = tensor._root
        if tensor._chain or (tensor if root is None else root)._pending is not None:
            write_value(tensor, value)
        elif root is None:
            tensor._value = value
            tensor._generation += 1
        else:
            root._value = value
            root._generation += 1
            tensor._value = value
            tensor._seen = root._generation


class OnHost:
    """A root's value made on the host (an op run by torch's CPU kernel, runtime/dispatch.py; a
    small integer tensor moved or made on the device), copied to the device when something first
    reads it there. Until then the tensor's `_value` is the numpy array: a sequence grown by one
    token on the host and then sliced there never makes the trip. `cell`: where a factory's
    cache keeps the device copy once made, so the next tensor it makes starts with it."""

    __slots__ = ("array", "cell")

    def __init__(self, array, cell=None):
        self.array = array
        self.cell = cell

    def resolve(self, tensor):
        cell = self.cell
        value = None if cell is None else cell[1]
        if value is None or value.is_deleted():
            value = devices.put(_c_order(self.array), tensor._index)
            if cell is not None:
                cell[1] = value
        tensor._value = value
        tensor._pending = None


def _c_order(array):
    """A numpy array in C order, as the copy to the device takes it (0-dim arrays stay 0-dim)."""
    return array if array.flags.c_contiguous else array.copy(order="C")


def on_host(array: np.ndarray, index: int, cell: Optional[list] = None) -> BridgeTensor:
    """A bridge tensor whose value, `array` (numpy, which no one writes into), stays on the host
    until the device reads it (OnHost); its host copy stays valid until it is written."""
    tensor = BridgeTensor(array, index)
    tensor._pending = OnHost(array, cell)
    tensor._host = (array, None, 0)
    return tensor


def host_array(tensor: BridgeTensor) -> Optional[np.ndarray]:
    """The tensor's current value as a numpy array on the host, where one is known (made or read
    there since its root was last written), else None. Such arrays are never written into."""
    host = tensor._host
    if host is None:
        return None
    root = tensor._root
    if host[1] is not root or host[2] != (tensor if root is None else root)._generation:
        return None
    return host[0]


def keep_host(tensor: BridgeTensor, array: np.ndarray) -> None:
    """Record `array` as the tensor's current value on the host (see host_array)."""
    root = tensor._root
    tensor._host = (array, root, (tensor if root is None else root)._generation)


def to_numpy(tensor: BridgeTensor) -> np.ndarray:
    """A bridge tensor's current value as a numpy array, without a trip through the device for a
    value on the host (a read-only view where it is the device's)."""
    array = host_array(tensor)
    if array is not None:
        return array
    return np.asarray(read_value(tensor))


# While torch.save runs under the bridge (bridge/patches/serialization.py): the device ordinals
# of the bridge tensors pickled so far, one entry per tensor (each writes a storage of its own).
pickled_devices: Optional[list[int]] = None


@contextlib.contextmanager
def counting_pickled_devices() -> Iterator[list[int]]:
    """Within the block, collect the device ordinal of each bridge tensor pickled (the list it
    yields); nested blocks each see their own."""
    global pickled_devices
    outer, pickled_devices = pickled_devices, []
    try:
        yield pickled_devices
    finally:
        pickled_devices = outer


def _to_cpu_tensor(tensor):
    return numpy_to_torch(np.array(to_numpy(tensor)))  # a copy: the caller may write it


def numpy_to_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype == jnp.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    if array.dtype.name.startswith("float8"):
        return torch.from_numpy(array.view(np.uint8)).view(JAX_TO_TORCH[array.dtype])
    return torch.from_numpy(array)


def torch_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach()
    if tensor.dtype is torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(jnp.bfloat16)
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return tensor.view(torch.uint8).numpy().view(TORCH_TO_JAX[tensor.dtype])
    return tensor.resolve_conj().resolve_neg().numpy()


def to_bridge(tensor: torch.Tensor, index: Optional[int] = None) -> BridgeTensor:
    """A bridge tensor with the contents of a plain torch tensor (no autograd link)."""
    if index is None:
        index = devices.current_index()
    array = torch_to_numpy(tensor.cpu() if tensor.device.type != "cpu" else tensor)
    if devices.jax_device(index).platform == "cpu":
        # XLA's CPU client may keep using the numpy array's memory rather than copy it, and
        # that memory is the script's tensor: a later in-place write to it must not reach here.
        array = array.copy()
    return BridgeTensor(devices.put(array, index), index)


def to_torch(tensor: BridgeTensor) -> torch.Tensor:
    """A plain CPU torch tensor with the contents of a bridge tensor (no autograd link)."""
    return _to_cpu_tensor(tensor)


class _ToBridge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, index):
        return to_bridge(tensor, index)

    @staticmethod
    def backward(ctx, grad):
        return (_to_cpu_tensor(grad) if isinstance(grad, BridgeTensor) else grad), None


class _ToCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        ctx.index = tensor._index
        return _to_cpu_tensor(tensor)

    @staticmethod
    def backward(ctx, grad):
        return to_bridge(grad, ctx.index)


class _ToDevice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, index):
        ctx.index = tensor._index
        return BridgeTensor(jax.device_put(read_value(tensor), devices.jax_device(index)), index)

    @staticmethod
    def backward(ctx, grad):
        return BridgeTensor(jax.device_put(read_value(grad), devices.jax_device(ctx.index)), ctx.index), None


# Integer and bool tensors of at most this many elements that come to the device from the host
# (`.to("cuda")` of token ids, a factory's positions and masks) keep their value on the host
# too, and reach the device when something there first reads them: small integer ops on them
# run by torch's CPU kernels (runtime/dispatch.py _on_host).
HOST_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
HOST_ELEMENTS = 1 << 16


def stays_on_host(tensor: torch.Tensor) -> bool:
    """Whether a plain host tensor moved to the device keeps its value on the host (above)."""
    return tensor.dtype in HOST_DTYPES and tensor.numel() <= HOST_ELEMENTS and not tensor.requires_grad


def to_bridge_autograd(tensor: torch.Tensor, index: int) -> BridgeTensor:
    """`tensor.to('cuda:N')` for a plain tensor: differentiable when it needs to be."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _ToBridge.apply(tensor, index)
    if settings.host_int_ops and not settings.tracing and tensor.device.type == "cpu" and stays_on_host(tensor):
        return on_host(np.array(torch_to_numpy(tensor)), index)  # a copy: the script may write its tensor
    return to_bridge(tensor, index)


def to_cpu_autograd(tensor: BridgeTensor) -> torch.Tensor:
    """`tensor.cpu()` for a bridge tensor: differentiable when it needs to be."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _ToCPU.apply(tensor)
    return _to_cpu_tensor(tensor)
