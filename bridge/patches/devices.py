"""Devices: 'cuda' in torch's API names the bridge's JAX devices.

Covers moving tensors (`Tensor.to/cuda`), factory functions called with
`device=` or under a default device (`torch.set_default_device`, `with
torch.device(...)`), and the `torch.cuda` / `torch.accelerator` queries scripts make.
"""

import collections
import gc
import os
import time
import weakref

import jax
import torch
import torch.backends.cudnn
import torch.utils._device
from torch.nn.parameter import UninitializedTensorMixin, is_lazy
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode

from bridge.runtime import deferred, devices, random
from bridge.runtime import flat as runtime_flat
from bridge.runtime import tensor as tensor_module
from bridge.runtime.callsite import user_call_site, warn_at_user_site
from bridge.runtime.config import settings
from bridge.runtime.dtypes import TORCH_TO_JAX
from bridge.runtime.errors import DeviceError
from bridge.runtime.dispatch import dispatch
from bridge.runtime.tensor import BridgeTensor, on_host, read_value, read_values, to_bridge_autograd, to_numpy, write_values

from . import Patch, collect, replace, wrap
from .capture import _children, _members, _same  # (a module tree's slots, as a captured call's walk reads them)


def _parse_to(args, kwargs):
    if args and isinstance(args[0], torch.Tensor):
        return args[0].device, args[0].dtype
    device, dtype, _non_blocking, _memory_format = torch._C._nn._parse_to(
        *args, **{name: value for name, value in kwargs.items() if name != "copy"}
    )
    return device, dtype


def _ordinal_named(device):
    """A bare integer device means cuda:N in torch; the other spellings pass unchanged."""
    if type(device) is int:
        return f"{settings.device_type}:{device}"
    return device


@wrap(torch._C._nn, "_parse_to")
def parse_to(wrapped, instance, args, kwargs):
    """`Module.to(0)` and `Tensor.to(0)`: torch resolves an integer through its accelerator,
    which a CPU-only torch build does not have ('Cannot access accelerator device')."""
    if args and type(args[0]) is int:
        args = (_ordinal_named(args[0]),) + tuple(args[1:])
    if "device" in kwargs:
        kwargs = dict(kwargs, device=_ordinal_named(kwargs["device"]))
    return wrapped(*args, **kwargs)


def _other_subclass(tensor):
    """A tensor subclass with its own dispatch (DTensor, FakeTensor): it moves its inner tensors
    through torch's ops, which reach the bridge for a bridge tensor inside."""
    kind = type(tensor)
    return kind is not BridgeTensor and kind.__torch_dispatch__ is not _PLAIN_DISPATCH


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def _holds_bridge_tensors(tensor):
    """Whether a traceable wrapper subclass (DTensor) holds bridge tensors: it is on the bridge
    device then, whatever its wrapper's C++ device says."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return False
    inner = [value for value in (getattr(tensor, name) for name in flatten()[0]) if isinstance(value, torch.Tensor)]
    return bool(inner) and all(isinstance(value, BridgeTensor) for value in inner)


@wrap(torch.Tensor, "to")
def tensor_to(wrapped, instance, args, kwargs):
    device, dtype = _parse_to(args, kwargs)
    index = devices.bridge_index(device)
    if index is None:
        return wrapped(*args, **kwargs)
    if _other_subclass(instance):
        if not _holds_bridge_tensors(instance):
            return wrapped(*args, **kwargs)
        # Already on the bridge device (a DTensor of bridge tensors): torch's C++ `.to('cuda')`
        # would start CUDA itself before dispatching, so only the dtype is passed on.
        return instance if dtype is None else wrapped(dtype)
    tensor = instance if dtype is None or dtype == instance.dtype else instance.to(dtype)
    if is_lazy(instance):
        return _lazy_to(instance, tensor, index)
    return to_bridge_autograd(tensor, index)


@wrap(torch.Tensor, "cuda")
def tensor_cuda(wrapped, instance, args, kwargs):
    if _other_subclass(instance) and _holds_bridge_tensors(instance):
        return instance
    device = args[0] if args else kwargs.get("device")
    index = devices.current_index() if device is None else devices.bridge_index(device)
    if index is None:
        index = torch.device(device).index or 0
    if is_lazy(instance):
        return _lazy_to(instance, instance, index)
    return to_bridge_autograd(instance, index)


@wrap(torch.nn.Module, "_apply")
def module_apply(wrapped, instance, args, kwargs):
    """`model.cpu()`, `model.to("cpu")` of a module holding bridge tensors. torch hands each
    parameter its host copy through `param.data = host`, which cannot turn a bridge tensor (a
    Python object of another type) into a host tensor; swapping the two objects, as torch does
    for tensor subclasses, moves the parameter and keeps its identity (optimizers hold it).

    A conversion that changes none of the module's own tensors (`self.classifier =
    self.classifier.to(self.dtype)` in a forward, as HF's Switch router does on each call)
    leaves them as they are: torch would swap each for a new Parameter aliasing it, which a
    captured region's trace cannot do (autograd holds the parameter) and which leaves the
    parameter a view of another tensor."""
    fn = args[0] if args else kwargs["fn"]
    if _changes_nothing(instance, fn):
        if args[1] if len(args) > 1 else kwargs.get("recurse", True):
            for child in instance.children():
                child._apply(fn)
        return instance
    if any(value._use_count() > 2 for value in instance._parameters.values() if value is not None):
        # torch swaps only tensors that nothing else in C++ holds (an autograd graph's saved
        # tensors); a freed graph caught in a reference cycle still holds them until collected.
        gc.collect()
    swap = not torch.__future__.get_swap_module_params_on_conversion() and any(
        type(value) is BridgeTensor for value in instance._parameters.values()
    )
    if swap:
        torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return wrapped(*args, **kwargs)
    except DeviceError:
        raise  # a submodule's, said already
    except RuntimeError as error:
        if "use_count" not in str(error.__cause__):
            raise
        raise DeviceError(
            f"{error} at {user_call_site()}: moving a module between the host and the bridge swaps each "
            "parameter for a new tensor object, which torch allows only while no autograd graph holds the "
            "parameter (an output of the module computed with gradients is still alive). Move the module "
            "before that forward, run the forward under torch.no_grad(), or drop its outputs (del) first."
        ) from error.__cause__
    finally:
        if swap:
            torch.__future__.set_swap_module_params_on_conversion(False)


def _changes_nothing(module, fn):
    """Whether `fn` returns each of the module's own parameters, their gradients and buffers as
    they are (all on the bridge). It stops at the first one it changes, whose converted copy is
    dropped (torch's _apply converts it again)."""
    tensors = [value for value in module._parameters.values() if value is not None]
    tensors += [value.grad for value in tensors if value.grad is not None]
    tensors += [value for value in module._buffers.values() if value is not None]
    if not all(type(value) is BridgeTensor for value in tensors):
        return False
    with torch.no_grad():
        return all(fn(value) is value for value in tensors)


@wrap(torch.nn.DataParallel, "forward")
def data_parallel_forward(wrapped, instance, args, kwargs):
    """nn.DataParallel over bridge devices (its module's tensors on the first, as torch requires).

    Over one device it calls its module directly, as torch does after scattering to that one
    device: the inputs go to the module's device, and no Scatter or Gather (autograd Functions
    over torch's C++ communication) stands between the script's region and the module's.

    Over several it does what torch's replicas do, on the bridge's devices (_Replicas): chunk
    i of the batch on device i, through the module with its parameters and buffers copied
    there; the copies' gradients are brought back and added into the parameters' at the end
    of the backward, as torch's Broadcast adds its replicas' up. torch's own scatter, replicate
    and gather go through CUDA streams and its C++ communication, which bridge tensors do not
    reach. JAX runs each device's programs as they are dispatched: the replicas run at once."""
    from torch.utils import _pytree as pytree

    if not instance.device_ids:
        return wrapped(*args, **kwargs)
    device = instance.src_device_obj
    targets = [torch.device(device.type, index) for index in instance.device_ids[1:]]
    replicas = _replicas.get(instance)
    if replicas is None or not replicas.serve(instance.module, targets):
        # (checked again only where the module's tensors or their devices changed since)
        if not isinstance(next(instance.module.parameters(), None), BridgeTensor):
            return wrapped(*args, **kwargs)
        for tensor in (*instance.module.parameters(), *instance.module.buffers()):
            if tensor.device != device:
                return wrapped(*args, **kwargs)  # torch's own error names the tensor's device
        replicas = _replicas[instance] = _Replicas(instance.module, targets)
    if not targets:

        def to_device(value):
            return value.to(device) if isinstance(value, torch.Tensor) else value

        args, kwargs = pytree.tree_map(to_device, (args, kwargs))
        return instance.module(*args, **kwargs)
    inputs, module_kwargs = _scatter_on(device, args, kwargs, len(instance.device_ids), instance.dim)
    if not inputs and not module_kwargs:
        inputs, module_kwargs = ((),), ({},)
    outputs = replicas.apply(inputs, module_kwargs)
    return _gather_to(outputs, instance.output_device, instance.dim)


_replicas = weakref.WeakKeyDictionary()  # DataParallel -> its _Replicas


def _is_namedtuple(value):
    return isinstance(value, tuple) and hasattr(value, "_asdict") and hasattr(value, "_fields")


def _scatter_on(device, args, kwargs, count, dim):
    """torch's scatter_kwargs (torch/nn/parallel/scatter_gather.py) with every chunk on `device`:
    tensors split with chunk(count, dim), as its C++ scatter splits them (a batch smaller than
    the devices gives fewer chunks, and fewer replicas run), other values repeated; containers
    chunked item by item, zipped to the shortest."""

    def scatter_map(value):
        if isinstance(value, torch.Tensor):
            return list(value.to(device).chunk(count, dim))
        if _is_namedtuple(value):
            return [type(value)(*items) for items in zip(*map(scatter_map, value))]
        if isinstance(value, tuple) and value:
            return list(zip(*map(scatter_map, value)))
        if isinstance(value, list) and value:
            return [list(items) for items in zip(*map(scatter_map, value))]
        if isinstance(value, dict) and value:
            return [type(value)(items) for items in zip(*map(scatter_map, value.items()))]
        return [value for _ in range(count)]

    inputs = scatter_map(args) if args else []
    module_kwargs = scatter_map(kwargs) if kwargs else []
    if len(inputs) < len(module_kwargs):
        inputs.extend(() for _ in range(len(module_kwargs) - len(inputs)))
    elif len(module_kwargs) < len(inputs):
        module_kwargs.extend({} for _ in range(len(inputs) - len(module_kwargs)))
    return tuple(inputs), tuple(module_kwargs)


class _Replicas:
    """A DataParallel module's replicas on its other devices (torch's replicate), kept from call
    to call: each is a shallow copy of the module tree (Module._replicate_for_data_parallel, as
    torch's replicate makes them) whose parameters are leaf tensors on its device and whose
    buffers are copies there. Kept, a replica's calls are a captured region of their own that
    compiles once (replicas made anew each call would compile anew), and its walk of the module
    tree holds. At each call the copies take the module's current values (one transfer per
    device and dtype, `_moved`); the buffers' writes on a replica are dropped (the first
    replica is the module itself, on its own buffers: BatchNorm's running statistics are the
    first chunk's, as in torch). At the end of each backward the copies' gradients go to the
    module's device and add into the parameters' (`_reduce`), as torch's Broadcast adds its
    replicas' up."""

    def __init__(self, module, targets):
        self.module, self.targets = module, targets
        self.layout_changes = tensor_module.layout_changes
        self.modules = list(module.modules())
        self.children, self.members = _children(self.modules), _members(self.modules)
        self.params = _unique(tensor for each in self.modules for tensor in each._parameters.values())
        self.buffers = _unique(
            tensor for each in self.modules for tensor in each._buffers.values() if isinstance(tensor, BridgeTensor)
        )
        self.requires_grad = [param.requires_grad for param in self.params]
        self.pairs = []  # (module, its replica on one device): train() and eval() reach the replicas
        self.replicas = [self._replica(target) for target in targets]  # (module, parameter copies, buffer copies)
        self.queued = False

    def _replica(self, target):
        index = devices.bridge_index(target)
        params = {id(param): _leaf_copy(param, index) for param in self.params}
        buffers = {id(buffer): BridgeTensor(read_value(buffer), index) for buffer in self.buffers}
        made = {id(each): each._replicate_for_data_parallel() for each in self.modules}
        for each in self.modules:
            replica = made[id(each)]
            replica._parameters = {name: None if value is None else params[id(value)] for name, value in each._parameters.items()}
            replica._buffers = {name: buffers.get(id(value), value) for name, value in each._buffers.items()}
            replica._modules = {name: None if child is None else made[id(child)] for name, child in each._modules.items()}
        for copy in params.values():
            if copy.requires_grad:
                copy.register_post_accumulate_grad_hook(self._queue)
        self.pairs.extend((each, made[id(each)]) for each in self.modules)
        return made[id(self.module)], list(params.values()), list(buffers.values())

    def serve(self, module, targets):
        """Whether these replicas are of this module as it is now (the same submodules,
        parameters, buffers and grad flags), on these devices."""
        return (
            module is self.module
            and targets == self.targets
            and tensor_module.layout_changes == self.layout_changes  # (a tensor moved to another device)
            and _same(_children(self.modules), self.children)
            and _same(_members(self.modules), self.members)
            and [param.requires_grad for param in self.params] == self.requires_grad
        )

    def apply(self, inputs, module_kwargs):
        from torch.utils import _pytree as pytree

        for each, replica in self.pairs:
            replica.training = each.training
        param_values, buffer_values = read_values(self.params), read_values(self.buffers)
        for target, (_, params, buffers), _ in zip(self.targets, self.replicas, inputs[1:]):  # (the devices used)
            device = devices.jax_device(devices.bridge_index(target))
            write_values(params, _moved(param_values, device))
            write_values(buffers, _moved(buffer_values, device))
        outputs = [self.module(*inputs[0], **module_kwargs[0])]  # (a batch of one row: only this)
        for target, chunk, chunk_kwargs, (replica, _, _) in zip(self.targets, inputs[1:], module_kwargs[1:], self.replicas):

            def to_target(value):
                return value.to(target) if isinstance(value, torch.Tensor) else value

            chunk, chunk_kwargs = pytree.tree_map(to_target, (tuple(chunk), dict(chunk_kwargs)))
            outputs.append(replica(*chunk, **chunk_kwargs))
        return outputs

    def _queue(self, _copy):
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    def _reduce(self):
        """The copies' gradients added into the parameters' (the first replica's, accumulated by
        autograd) on the module's device: torch's Broadcast backward, a sum over the replicas."""
        self.queued = False
        for _, params, _ in self.replicas:
            moved = [(param, copy.grad) for param, copy in zip(self.params, params) if copy.grad is not None]
            if not moved:
                continue
            owners = [param for param, _ in moved]
            index = owners[0]._index
            arrays = _moved(read_values([grad for _, grad in moved]), devices.jax_device(index))
            for copy in params:
                copy.grad = None
            with torch.no_grad():
                have = [owner for owner in owners if owner.grad is not None]
                if have:
                    grads = [owner.grad for owner in have]
                    sums = _add_all(read_values(grads), [array for owner, array in zip(owners, arrays) if owner.grad is not None])
                    write_values(grads, sums)
                for owner, array in zip(owners, arrays):
                    if owner.grad is None:
                        owner.grad = BridgeTensor(array, index)


def _unique(tensors):
    """The tensors (None left out), each once, in order."""
    return list({id(tensor): tensor for tensor in tensors if tensor is not None}.values())


def _moved(arrays, device):
    """The arrays on `device`, in one transfer per dtype: joined into one flat array on their
    device, moved, and cut on the other (jax.device_put of a list moves them one by one, at about
    100 us of host time each: ResNet-50's 161 parameters, 159 buffers and 161 gradients made 60 ms
    a step on a 2-core CPU)."""
    moved = [None] * len(arrays)
    groups = {}
    for position, array in enumerate(arrays):
        groups.setdefault(array.dtype, []).append(position)
    for positions in groups.values():
        group = [arrays[position] for position in positions]
        flat = jax.device_put(runtime_flat.join_jit(group), device)
        for position, piece in zip(positions, runtime_flat.split_jit(flat, tuple(tuple(array.shape) for array in group))):
            moved[position] = piece
    return moved


def _leaf_copy(value, index):
    copy = BridgeTensor(jax.device_put(read_value(value), devices.jax_device(index)), index)
    return copy.requires_grad_(value.requires_grad)


_add_all = jax.jit(lambda values, others: [value + other for value, other in zip(values, others)])


def _gather_to(outputs, target, dim):
    """torch's gather (torch/nn/parallel/scatter_gather.py): tensors concatenated along `dim` on
    the output device (0-dim ones along a new dimension, with torch's warning), containers
    item by item."""
    target = torch.device("cuda", target) if isinstance(target, int) else torch.device(target)

    def gather_map(values):
        first = values[0]
        if isinstance(first, torch.Tensor):
            if dim == 0 and all(value.dim() == 0 for value in values):
                warn_at_user_site(
                    "Was asked to gather along dimension 0, but all input tensors were scalars; will instead "
                    "unsqueeze and return a vector.",
                    UserWarning,
                )
                values = [value.view(1) for value in values]
            return torch.cat([value.to(target) for value in values], dim)
        if first is None:
            return None
        if isinstance(first, dict):
            if not all(len(first) == len(value) for value in values):
                raise ValueError("All dicts must have the same number of keys")
            return type(first)((key, gather_map([value[key] for value in values])) for key in first)
        if _is_namedtuple(first):
            return type(first)._make(map(gather_map, zip(*values)))
        return type(first)(map(gather_map, zip(*values)))

    return gather_map(outputs)


@wrap(torch.backends.cudnn, "is_acceptable")
def cudnn_is_acceptable(wrapped, instance, args, kwargs):
    """No cuDNN kernel takes a bridge tensor (RNN modules ask before packing their weights
    with cuDNN's `_cudnn_rnn_flatten_weight`)."""
    tensor = args[0] if args else kwargs.get("tensor")
    if isinstance(tensor, BridgeTensor):
        return False
    return wrapped(*args, **kwargs)


# Lazy modules (nn.LazyLinear, ...): torch moves an UninitializedParameter/Buffer uninitialized
# and materializes it on the first forward, on the device of its (empty) data. Torch forbids
# reading that data, so it cannot become a bridge tensor: the bridge device is remembered on
# the uninitialized tensor instead, and `materialize` creates the tensor there.
_LAZY_INDEX = "_bridge_lazy_index"


def _lazy_to(instance, moved, index):
    setattr(instance, _LAZY_INDEX, index)
    setattr(moved, _LAZY_INDEX, index)
    return moved


@wrap(UninitializedTensorMixin, "materialize")
def lazy_materialize(wrapped, instance, args, kwargs):
    def parse(shape, device=None, dtype=None):
        return shape, device, dtype

    shape, device, dtype = parse(*args, **kwargs)
    if device is None and getattr(instance, _LAZY_INDEX, None) is not None:
        device = devices.torch_device(getattr(instance, _LAZY_INDEX))
    if device is None or devices.bridge_index(device) is None:
        return wrapped(*args, **kwargs)
    value = torch.empty(shape, device=device, dtype=dtype or instance.data.dtype)
    if instance.cls_to_become is torch.nn.Parameter:
        value = torch.nn.Parameter(value, requires_grad=instance.requires_grad)
    # torch turns the object itself into the materialized tensor (modules hold it); a bridge
    # tensor is another Python type, so the two objects are swapped, as Module.to does.
    torch.utils.swap_tensors(instance, value)


@wrap(torch.utils, "swap_tensors")
def swap_tensors(wrapped, instance, args, kwargs):
    """torch.utils.swap_tensors (Module.to's and load_state_dict(assign=True)'s for tensor
    subclasses) swaps two tensors' __dict__s, and with them their roots: flat roots found holding
    tensors must look again (runtime.tensor.root_changes)."""
    tensor_module.root_changed()
    return wrapped(*args, **kwargs)


@wrap(torch.Tensor, "pin_memory")
def tensor_pin_memory(wrapped, instance, args, kwargs):
    # Host memory the JAX runtime copies from needs no pinning through torch.
    return instance


@wrap(torch.Tensor, "is_pinned")
def tensor_is_pinned(wrapped, instance, args, kwargs):
    return False


# Factory functions that take device=.
_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm",
    "arange", "range", "linspace", "logspace", "eye", "zeros_like", "ones_like", "empty_like",
    "full_like", "rand_like", "randn_like", "randint_like", "empty_strided", "normal", "tril_indices",
    "triu_indices", "scalar_tensor", "bartlett_window", "hann_window", "hamming_window",
    "blackman_window", "kaiser_window", "empty_permuted", "asarray", "from_file",
)

# Sparse constructors: a bridge tensor holds one dense jax.Array, so they cannot make one.
_SPARSE_FACTORIES = (
    "sparse_coo_tensor", "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor",
    "sparse_compressed_tensor",
)


# Factories that draw random numbers: on a bridge device they draw from the bridge's generator.
_RANDOM_FACTORIES = {"rand", "randn", "randint", "randperm", "normal", "rand_like", "randn_like", "randint_like"}
_META = torch.device("meta")


_FAKE_MODE_ACTIVE = torch._C._get_dispatch_mode
_FAKE = torch._C._TorchDispatchModeKey.FAKE


def _factory(wrapped, instance, args, kwargs):
    if kwargs.get("pin_memory"):
        # Host memory the JAX runtime copies from needs no pinning through torch (which asks
        # the CUDA driver for it: safetensors' load_file(device="cuda") does).
        kwargs = dict(kwargs, pin_memory=False)
    device = kwargs.get("device")
    if device is None or _FAKE_MODE_ACTIVE(_FAKE):
        # (Under a FakeTensorMode, DTensor's sharding propagation and torch.export's tracing,
        # a 'cuda' tensor is metadata only: torch's fake 'cuda' tensor is the one they need.)
        return wrapped(*args, **kwargs)
    index = devices.bridge_index(device)
    if index is None:
        if args and isinstance(args[0], BridgeTensor):
            return _make_on_host(wrapped, args, kwargs)
        return wrapped(*args, **kwargs)
    if (args and wrapped.__name__ in _FILLED_LIKE and isinstance(args[0], torch.Tensor) and _other_subclass(args[0])
            and hasattr(args[0], "__tensor_flatten__")):
        return _like_each_inner(wrapped, args, kwargs)
    return _make_on_bridge(wrapped, args, kwargs, index)


# Factories shaped like a tensor and filled without random numbers (a DTensor's random numbers
# are drawn by its own offset tracker, across ranks: torch's path).
_FILLED_LIKE = {"empty_like", "zeros_like", "ones_like", "full_like"}


def _like_each_inner(wrapped, args, kwargs):
    """A factory like a wrapper subclass (a DTensor on the meta device that `Module.to_empty`
    moves to the GPU, as FSDP2's models are made): the same factory on each inner tensor, then
    the subclass rebuilt around them, as the subclass's own dispatch would."""
    outer = args[0]
    names, context = outer.__tensor_flatten__()
    inner = {}
    for name in names:
        value = getattr(outer, name)  # (DTensor's device mesh is an inner value too)
        inner[name] = _factory(wrapped, None, (value, *args[1:]), kwargs) if isinstance(value, torch.Tensor) else value
    made = type(outer).__tensor_unflatten__(inner, context, outer.size(), outer.stride())
    return made.requires_grad_(bool(kwargs.get("requires_grad", False)))


def _sparse_factory(wrapped, instance, args, kwargs):
    device = kwargs.get("device")
    if device is not None and devices.bridge_index(device) is not None:
        raise DeviceError(
            f"torch.{wrapped.__name__}(..., device={str(device)!r}) at {user_call_site()}: a bridge tensor holds "
            f"one dense JAX array, so sparse tensors cannot live on the bridge's device. Build the sparse "
            f"tensor on the CPU (device='cpu') and move its dense form: .to_dense().to({str(device)!r})."
        )
    return wrapped(*args, **kwargs)


def _make_on_host(function, args, kwargs):
    """A factory given a bridge tensor and a host `device=` (`torch.zeros_like(x, device="cpu")`,
    `torch.tensor(x, device="cpu")`): torch makes a host tensor, so the bridge tensor enters as
    its host copy (a `_like` factory reads only its shape and dtype, and draws from the host's
    generator, as torch does)."""
    first = args[0]
    if function.__name__.endswith("_like"):
        first = torch.empty(first.shape, dtype=kwargs.get("dtype") or first.dtype, device="cpu")
    else:
        first = first.detach().cpu() if not first.requires_grad else first.cpu()
    return function(first, *args[1:], **kwargs)


# Factories whose result the arguments alone decide: their small results are kept on the device
# (_made), as a loop's `torch.arange(n, device="cuda")` asks for the same tensor every step.
_DETERMINISTIC_FACTORIES = {"arange", "zeros", "ones", "full", "empty", "tensor", "as_tensor", "scalar_tensor", "eye", "range"}
_MADE_MAX_ELEMENTS = 1 << 16
_MADE_MAX_ENTRIES = 256
# key (_made_key) -> [numpy array, its device copy or None], the most recently used last
_made = collections.OrderedDict()


def _hashable(value):
    """A key for a factory's argument that tells apart what gives another tensor (1, 1.0 and
    True; 0.0 and -0.0), or None where the argument is not plain (a tensor, an array)."""
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, (list, tuple)):  # torch.Size too
        items = [_hashable(item) for item in value]
        return None if any(item is None for item in items) else ("seq", tuple(items))
    return None


def _made_key(function, args, kwargs, index):
    if function.__name__ not in _DETERMINISTIC_FACTORIES or kwargs.get("requires_grad") or "out" in kwargs:
        return None
    parts = [_hashable(value) for value in args] + [_hashable(value) for value in kwargs.values()]
    if any(part is None for part in parts):
        return None
    return (function.__name__, tuple(parts), tuple(kwargs), torch.get_default_dtype(), index)


def _make_on_bridge(function, args, kwargs, index):
    """`function(*args, **kwargs)` (a torch factory whose `device=` names bridge device `index`) as
    a bridge tensor. The small integer and bool results of deterministic factories are kept
    (_shareable): a later call with the same arguments wraps the same device array (bridge tensors
    never write into their arrays, so sharing one is safe; one freed anyway is made anew), where
    making it again cost a host tensor and a copy to the device (~8 a token in HF's generate loop:
    positions, masks, token ids)."""
    key = None if settings.tracing else _made_key(function, args, kwargs, index)
    if key is not None:
        cell = _made.get(key)
        if cell is not None:
            _made.move_to_end(key)
            return _from_cell(cell, index)
    result = _made_on_device(function, args, kwargs, index)
    if result is not None:
        return result
    result = _make_fresh(function, args, kwargs, index)
    if key is not None and _shareable(result):
        cell = _made[key] = [to_numpy(result), None if result._pending is not None else read_value(result)]
        if len(_made) > _MADE_MAX_ENTRIES:
            _made.popitem(last=False)
        if settings.host_int_ops:
            return _from_cell(cell, index)
    return result


_FILLS = {"empty": 0, "zeros": 0, "ones": 1, "full": None}


def _made_on_device(function, args, kwargs, index):
    """A large tensor of one value (`torch.empty`, `zeros`, `ones`, `full`) made on the device
    itself, or None where the host makes it (small ones stay there for the integer ops on the
    host; see _make_on_bridge). Made on the host, 800 MB took 260 ms to copy over on an H200:
    FSDP2 makes each block's all-gather buffer so, twice a step. (`empty`'s memory is zeros.)"""
    name = function.__name__
    if name not in _FILLS or "out" in kwargs or kwargs.get("layout") not in (None, torch.strided):
        return None
    value = _FILLS[name]
    if value is None:
        value = kwargs.get("fill_value", args[1] if len(args) > 1 else None)
        if not isinstance(value, (bool, int, float)):
            return None
    try:
        shaped = function(*args, **dict(kwargs, device="meta", requires_grad=False, pin_memory=False))
    except Exception:  # noqa: BLE001 - torch's own call below raises the caller's error
        return None
    if shaped.numel() <= _MADE_MAX_ELEMENTS or shaped.is_complex():
        return None
    result = BridgeTensor(tensor_module.filled(tuple(shaped.shape), TORCH_TO_JAX[shaped.dtype], value, index), index)
    if kwargs.get("requires_grad"):
        result.requires_grad_(True)
    return result


def _from_cell(cell, index):
    """A factory's kept result: its value on the host (ops on small integers run there, see
    runtime/dispatch.py), and on the device once made there (`cell[1]`)."""
    if settings.host_int_ops:
        return on_host(cell[0], index, cell)
    if cell[1] is None or cell[1].is_deleted():
        cell[1] = devices.put(cell[0], index)
    return BridgeTensor(cell[1], index)


def _shareable(result):
    """Whether a factory's result may be kept and shared: small, and of integers or bools (or
    empty). A floating-point one may become a parameter or optimizer state, whose array an
    optimizer step donates to XLA (runtime.optimizers): donated, a shared array would be freed
    under every other tensor holding it."""
    return (
        result.numel() <= _MADE_MAX_ELEMENTS
        and not result.requires_grad
        and (result.numel() == 0 or not (result.is_floating_point() or result.is_complex()))
    )


def _make_fresh(function, args, kwargs, index):
    kwargs = dict(kwargs)
    # An explicit host device, so that a default-device mode (`with torch.device(...)`) leaves it.
    kwargs["device"] = "cpu"
    requires_grad = kwargs.pop("requires_grad", False)
    kwargs.pop("pin_memory", None)
    if function.__name__ in _RANDOM_FACTORIES and kwargs.get("generator") is None:
        with _DrawOnBridge():
            result = function(*args, **kwargs)
    else:
        if kwargs.get("generator") is not None:
            random.refuse_host_draw_in_trace(f"torch.{function.__name__}")
        # Drawn on the host with the script's generator: the numbers torch gives for its seed.
        result = function(*args, **kwargs)
    if not isinstance(result, BridgeTensor):
        result = to_bridge_autograd(result, index)  # (a small integer result keeps its value on the host)
    elif result._index != index:
        result = result.to(devices.torch_device(index))
    if requires_grad:
        result.requires_grad_(True)
    return result


class _DrawOnBridge(TorchDispatchMode):
    """Runs a random factory's ATen op (aten.randn, ...) through the bridge's table, which draws
    from the bridge's generator: `torch.manual_seed` and `torch.cuda.manual_seed` reseed it, and a
    captured region takes its key as an input, so that each replay draws new numbers (a draw on
    the host would enter the program as a constant)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        kwargs["device"] = _META  # the entry places its result; torch's meta check then draws nothing
        return dispatch(func, args, kwargs)


def _factory_patches():
    from . import Patch

    return [Patch(torch, name, wrapper=_factory) for name in _FACTORIES if hasattr(torch, name)] + [
        Patch(torch, name, wrapper=_sparse_factory) for name in _SPARSE_FACTORIES if hasattr(torch, name)
    ]


# torch.device(0): a CPU-only torch build has no accelerator to resolve the integer with. Where
# it refuses, `torch.device` is a constructor that names the bridge's device for an integer and
# builds torch's own device object for every other argument; isinstance checks still hold.
_TorchDevice = torch.device


def _integer_devices_work():
    try:
        _TorchDevice(0)
    except RuntimeError:
        return False
    return True


class _DeviceType(type):
    def __instancecheck__(cls, instance):
        return isinstance(instance, _TorchDevice)

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, _TorchDevice)


class BridgeDevice(metaclass=_DeviceType):
    """torch.device, with `torch.device(0)` meaning the bridge's cuda:0 as on a CUDA machine."""

    def __new__(cls, *args, **kwargs):
        if args and type(args[0]) is int and len(args) == 1 and not kwargs:
            return _TorchDevice(settings.device_type, args[0])
        return _TorchDevice(*args, **kwargs)


def _device_patch():
    from . import Patch

    return [] if _integer_devices_work() else [Patch(torch, "device", replacement=BridgeDevice)]


# torch.set_default_device and `with torch.device(...)`: torch builds both on
# torch.utils._device.DeviceContext, a function mode that adds `device=` to factory calls.
_TorchDeviceContext = torch.utils._device.DeviceContext


class _AnyDeviceContext(type(_TorchDeviceContext)):
    """Metaclass of the patched DeviceContext: torch's bookkeeping of the mode stack checks
    `isinstance(mode, DeviceContext)`, which must hold for contexts made before activation too."""

    def __instancecheck__(cls, instance):
        return isinstance(instance, _TorchDeviceContext)

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, _TorchDeviceContext)


# torch's factories, as torch defines them: `_device_constructors()` caches the functions that
# `torch.linspace` and the others name when it is first called, which are whatever replaced them
# then (a test's or a library's stand-in) if that came first.
_CONSTRUCTORS = frozenset(_device_constructors.__wrapped__())


@replace(torch.utils._device, "DeviceContext")
class BridgeDeviceContext(_TorchDeviceContext, metaclass=_AnyDeviceContext):
    """A default device that names a bridge device makes factories called without `device=`
    (and modules built in `with torch.device("cuda"):`) create bridge tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") is None and func in _CONSTRUCTORS:
            index = devices.bridge_index(self.device)
            if index is not None and _bridge_active():
                return _make_on_bridge(func, args, kwargs, index)
        return super().__torch_function__(func, types, args, kwargs)


def _bridge_active():
    # A default device set while the bridge was active outlives deactivation; it then
    # behaves as torch's own (which cannot make CUDA tensors on a CPU build).
    from bridge.activation import is_active

    return is_active()


# torch.cuda queries.
@replace(torch.cuda, "is_available")
def is_available():
    return True


@replace(torch.cuda, "device_count")
def device_count():
    return devices.device_count()


@replace(torch.cuda, "current_device")
def current_device():
    return devices.current_index()


@replace(torch.cuda, "set_device")
def set_device(device):
    index = devices.bridge_index(device)
    devices.set_current_index(index if index is not None else int(device))


@replace(torch.cuda, "is_initialized")
def is_initialized():
    return True


@replace(torch.cuda, "init")
def init():
    return None


# `with torch.cuda.device(i):` / `torch.cuda.device_of(t)` switch the current device through these.
@replace(torch.cuda, "_exchange_device")
def exchange_device(index):
    if index < 0:
        return -1
    previous = devices.current_index()
    set_device(index)
    return previous


@replace(torch.cuda, "_maybe_exchange_device")
def maybe_exchange_device(index):
    return exchange_device(index)


def _initialized_patch():
    from . import Patch

    # Read directly (not through is_initialized) by torch.utils.checkpoint, which saves and
    # restores the device's RNG state around recomputation only when it is true.
    return Patch(torch.cuda, "_initialized", replacement=True)


@replace(torch.cuda, "synchronize")
def synchronize(device=None):
    # Every dispatched JAX computation finishes before this returns, in-place updates waiting to
    # run together (runtime/deferred.py) included.
    deferred.flush()
    jax.effects_barrier()
    jax.block_until_ready(jax.live_arrays())  # one call for all (one a buffer took 3x longer)


def _index_of(device):
    if device is None:
        return devices.current_index()
    index = devices.bridge_index(device)
    return index if index is not None else int(device)


@replace(torch.cuda, "get_device_name")
def get_device_name(device=None):
    jax_device = devices.jax_device(_index_of(device))
    return f"{jax_device.device_kind} (JAX {jax_device.platform}, via bridge)"


@replace(torch.cuda, "get_device_capability")
def get_device_capability(device=None):
    # Scripts use this to pick bf16/flash paths; report an Ampere-class device.
    return (8, 0)


class DeviceProperties:
    """What `torch.cuda.get_device_properties` reports for a bridge device."""

    def __init__(self, jax_device):
        stats = _memory_stats(jax_device)
        self.name = f"{jax_device.device_kind} (JAX {jax_device.platform}, via bridge)"
        # XLA's CPU backend keeps no memory statistics: its memory is the host's.
        self.total_memory = stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.major, self.minor = 8, 0
        self.multi_processor_count = getattr(jax_device, "core_count", 1) or 1
        self.is_integrated = False
        self.is_multi_gpu_board = False

    def __repr__(self):
        return f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, total_memory={self.total_memory // 2**20}MB)"


@replace(torch.cuda, "get_device_properties")
def get_device_properties(device=None):
    return DeviceProperties(devices.jax_device(_index_of(device)))


@replace(torch.cuda, "is_bf16_supported")
def is_bf16_supported(including_emulation=True):
    return True


def _memory_stats(jax_device):
    try:
        return jax_device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - the CPU backend has no memory statistics
        return {}


@replace(torch.cuda, "memory_allocated")
def memory_allocated(device=None):
    return _memory_stats(devices.jax_device(_index_of(device))).get("bytes_in_use", 0)


@replace(torch.cuda, "max_memory_allocated")
def max_memory_allocated(device=None):
    return _memory_stats(devices.jax_device(_index_of(device))).get("peak_bytes_in_use", 0)


@replace(torch.cuda, "memory_reserved")
def memory_reserved(device=None):
    stats = _memory_stats(devices.jax_device(_index_of(device)))
    return stats.get("bytes_reserved", stats.get("bytes_in_use", 0))


@replace(torch.cuda, "max_memory_reserved")
def max_memory_reserved(device=None):
    stats = _memory_stats(devices.jax_device(_index_of(device)))
    return stats.get("peak_bytes_reserved", stats.get("peak_bytes_in_use", 0))


@replace(torch.cuda, "reset_peak_memory_stats")
def reset_peak_memory_stats(device=None):
    return None


@replace(torch.cuda, "empty_cache")
def empty_cache():
    return None


# Streams and events. JAX orders work on a device itself; a stream is a no-op context, and
# an event is a point in time after all queued work has finished.
class BridgeStream:
    """What `torch.cuda.current_stream()` / `torch.cuda.Stream()` return for a bridge device."""

    def __init__(self, device=None, priority=0, **kwargs):
        index = _index_of(device)
        self.device = devices.torch_device(index)
        self.device_index = index
        self.priority = priority

    def is_capturing(self):
        return False

    def synchronize(self):
        synchronize()

    def query(self):
        return True

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        event = event or BridgeEvent()
        event.record(self)
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


class BridgeEvent:
    """What `torch.cuda.Event()` returns. A timing event records the time once the work queued
    before it has finished (a wait). Another orders work between streams, which JAX's one
    queue per device already does: recording it costs nothing, and waiting on it waits for all
    queued work (FSDP2 records one per block and collective: a wait each had stalled the GPU)."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **kwargs):
        self.enable_timing = enable_timing
        self.time = None

    def record(self, stream=None):
        if self.enable_timing:
            synchronize()
            self.time = time.perf_counter()

    def synchronize(self):
        synchronize()

    def wait(self, stream=None):
        return None

    def query(self):
        synchronize()
        return True

    def elapsed_time(self, end_event):
        return (end_event.time - self.time) * 1000.0


@replace(torch.cuda, "current_stream")
def current_stream(device=None):
    return BridgeStream(device)


@replace(torch.cuda, "default_stream")
def default_stream(device=None):
    return BridgeStream(device)


@replace(torch.cuda, "Stream")
class Stream(BridgeStream):
    pass


@replace(torch.cuda, "Event")
class Event(BridgeEvent):
    pass


@replace(torch.cuda, "stream")
def stream(stream=None):
    return stream if stream is not None else BridgeStream()


@replace(torch.cuda, "is_current_stream_capturing")
def is_current_stream_capturing():
    return False


# torch.accelerator, the device-generic API newer scripts (and DataLoader's pinning) use.
@replace(torch.accelerator, "current_stream")
def accelerator_current_stream(device=None):
    return BridgeStream(device)

@replace(torch.accelerator, "is_available")
def accelerator_is_available(check_fork=False):
    return True


@replace(torch.accelerator, "current_accelerator")
def current_accelerator(check_available=False):
    return torch.device(settings.device_type)


# What torch.distributed and FSDP2 ask for the machine's accelerator (its device mesh by default).
@replace(torch._C, "_get_accelerator")
def get_accelerator():
    return torch.device(settings.device_type)


@replace(torch.accelerator, "device_count")
def accelerator_device_count():
    return devices.device_count()


@replace(torch.accelerator, "current_device_index")
def current_device_index():
    return devices.current_index()


@replace(torch.accelerator, "set_device_index")
def set_device_index(device):
    set_device(device)


@replace(torch.accelerator, "synchronize")
def accelerator_synchronize(device=None):
    synchronize(device)


@replace(torch.accelerator, "memory_allocated")
def accelerator_memory_allocated(device_index=None):
    return memory_allocated(device_index)


@replace(torch.accelerator, "max_memory_allocated")
def accelerator_max_memory_allocated(device_index=None):
    return max_memory_allocated(device_index)


@replace(torch.accelerator, "empty_cache")
def accelerator_empty_cache():
    return None


# Captured mode makes DataParallel's module's calls the regions, not DataParallel's own: over
# several devices each replica's call is a program on its device (one region of DataParallel
# would trace all the chunks into one program on one device).
_DATA_PARALLEL_WRAPS_REGION = Patch(torch.nn.DataParallel, "bridge_wraps_region", replacement=True)

PATCHES = collect(dict(globals())) + _factory_patches() + [_initialized_patch(), _DATA_PARALLEL_WRAPS_REGION] + _device_patch()
