"""torch.distributed under the bridge: a process-group backend whose collectives run on JAX
(runtime/distributed.py), `init_process_group("nccl" | "gloo" | ...)` served by it, the
processes joined through `jax.distributed`, and DistributedDataParallel for bridge modules.

Scripts keep their backend names: "nccl", "gloo" and "cuda:nccl,cpu:gloo" are served by the
backend registered here as "bridge" (NCCL between GPUs and gloo between CPUs are what XLA's
collectives use underneath), and `dist.get_backend()` still answers the name the script gave.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
import torch.cuda.nccl
import torch.multiprocessing
import torch.nn.parallel
import torch.nn.parallel.distributed
from torch._C import _distributed_c10d as c10d
from torch.utils import _pytree as pytree

from bridge.runtime import devices
from bridge.runtime import distributed as collectives
from bridge.runtime import optimizers, stats
from bridge.runtime.callsite import user_call_site
from bridge.runtime.config import settings
from bridge.runtime.dtypes import TORCH_TO_JAX
from bridge.runtime.errors import DistributedError
from bridge.runtime.tensor import BridgeTensor, numpy_to_torch, read_value, read_values, root_of, torch_to_numpy, write_value

from . import Patch, collect, wrap

BACKEND = "bridge"
# The backend names a script may ask for, all served by the bridge's backend.
_SERVED = ("nccl", "gloo", "cuda:nccl,cpu:gloo", "cpu:gloo,cuda:nccl", BACKEND)
_requested: dict = {}  # process group -> the backend name the script asked for


# ---------------------------------------------------------------- joining the processes


def join_launched_processes(platform) -> None:
    """Join the other processes now if a launcher (torchrun, `bridge run --nproc-per-node`)
    started this one: JAX must join before it starts its devices, and scripts often put tensors
    on their device (`torch.cuda.set_device(local_rank)`, a model's `.to`) before
    `init_process_group`."""
    launched = collectives.launched_environment()
    if launched is None or launched["size"] < 2 or collectives.world() is not None:
        return
    _start(launched["rank"], launched["size"], launched["local_rank"], launched["local_size"], launched["master"],
           _timeout_seconds(None), platform)


def _start(rank, size, local_rank, local_size, master, timeout_seconds, platform):
    collectives.start(rank, size, local_rank, local_size, collectives.coordinator_address(master), platform,
                      timeout_seconds)
    devices.own_one_device(local_rank, local_size)


def _timeout_seconds(timeout) -> float:
    if timeout is None:
        return float(os.environ.get("BRIDGE_DISTRIBUTED_TIMEOUT", 600))
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def _master(store) -> tuple[str, int]:
    """Where torch's store listens (its TCPStore under the prefixes), else MASTER_ADDR/MASTER_PORT."""
    while store is not None and not isinstance(store, dist.TCPStore):
        store = getattr(store, "underlying_store", None)
    if store is not None:
        return store.host, store.port
    try:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as missing:
        if os.environ.get("BRIDGE_COORDINATOR"):
            return ("", 0)  # the coordinator is named outright
        raise DistributedError(
            f"init_process_group at {user_call_site()}: the bridge joins processes through JAX's coordination "
            f"service, which needs a host and a port, and {missing} is not set; use init_method='env://' "
            "(MASTER_ADDR, MASTER_PORT) or 'tcp://host:port', start the script with torchrun, or set "
            "BRIDGE_COORDINATOR=host:port"
        ) from None


@wrap(dist.distributed_c10d, "rendezvous")
def rendezvous(wrapped, instance, args, kwargs):
    # Before torch's store waits for the other processes: a process that cannot join them any
    # more says so now rather than after they have all connected.
    world_size = args[2] if len(args) > 2 else kwargs.get("world_size", -1)
    if world_size < 0:
        world_size = (collectives.launched_environment() or {}).get("size", 1)
    if world_size > 1 and collectives.world() is None:
        collectives.refuse_late_start(user_call_site())
    return wrapped(*args, **kwargs)


# Patched where init_process_group and new_group make their groups (not init_process_group
# itself): a script started by torch.multiprocessing.spawn imported `init_process_group` from
# torch.distributed before the bridge was active in its process.
@wrap(dist.distributed_c10d, "_new_process_group_helper")
def new_process_group_helper(wrapped, instance, args, kwargs):
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    arguments = bound.arguments
    requested = str(arguments["backend"]).lower()
    if requested not in _SERVED:
        raise DistributedError(
            f"a process group with backend {arguments['backend']!r} at {user_call_site()}: under the bridge the "
            f"collectives run on JAX, which serves {', '.join(repr(n) for n in _SERVED[:3])}; pass one of those "
            "(the script's tensors live on the bridge device)"
        )
    arguments["backend"] = BACKEND
    if "torch.distributed.fsdp" in sys.modules:
        import bridge.op_mappings.sharding  # noqa: F401  (FSDP2's own ops: see there)
    if not arguments["global_ranks_in_group"]:  # the default group: every process of the run
        _join(arguments["group_rank"], arguments["group_size"], arguments["store"], arguments.get("timeout"))
    del _made[:]
    group, store = wrapped(*bound.args, **bound.kwargs)
    if _made:
        _backends[group] = _made[-1]
    _requested[group] = requested if requested != BACKEND else _requested.get(dist.GroupMember.WORLD, "nccl")
    return group, store


def _join(rank, size, store, timeout):
    joined = collectives.world()
    if joined is not None:
        if (joined.rank, joined.size) != (rank, size):
            raise DistributedError(
                f"init_process_group(rank={rank}, world_size={size}) at {user_call_site()}: this process already "
                f"joined as rank {joined.rank} of {joined.size} (from the launcher's RANK and WORLD_SIZE); pass "
                "the same numbers, or none"
            )
        return
    if size < 2:
        return
    launched = collectives.launched_environment() or {}
    local_rank = launched.get("local_rank")
    if local_rank is None:
        # Started by torch.multiprocessing.spawn: one host; the device the script set, else its rank's.
        local_rank = devices.current_index() if devices.current_index() != 0 else rank
    _start(rank, size, local_rank, launched.get("local_size", size), _master(store), _timeout_seconds(timeout),
           settings.platform)


@wrap(dist, "get_backend")
def get_backend(wrapped, instance, args, kwargs):
    name = wrapped(*args, **kwargs)
    if name != BACKEND:
        return name
    group = (args[0] if args else kwargs.get("group")) or dist.GroupMember.WORLD
    return _requested.get(group, _requested.get(dist.GroupMember.WORLD, "nccl"))


@wrap(torch.cuda.nccl, "version")
def nccl_version(wrapped, instance, args, kwargs):
    # torch's own logging of a failed collective asks for NCCL's version when the script's backend
    # is "nccl"; a CPU build of torch has no NCCL (the bridge's collectives use XLA's), and the
    # AttributeError would replace the collective's own error.
    try:
        return wrapped(*args, **kwargs)
    except AttributeError:
        return (0, 0, 0)


@wrap(dist.distributed_c10d, "get_backend")
def c10d_get_backend(wrapped, instance, args, kwargs):
    return get_backend(wrapped, instance, args, kwargs)


@wrap(dist, "barrier")
def barrier(wrapped, instance, args, kwargs):
    """A bridge group's barrier is its backend's meeting, whatever device torch would pick for
    it: with `init_process_group(device_id=)` torch's barrier makes a tensor on that device first
    (a CUDA tensor, which a machine without CUDA cannot make)."""
    arguments = inspect.signature(wrapped).bind(*args, **kwargs).arguments
    backend = backend_of(arguments.get("group") or dist.GroupMember.WORLD)
    if backend is None:
        return wrapped(*args, **kwargs)
    work = backend.barrier()
    return work if arguments.get("async_op") else None


@wrap(dist.distributed_c10d, "barrier")
def c10d_barrier(wrapped, instance, args, kwargs):
    return barrier(wrapped, instance, args, kwargs)


# ---------------------------------------------------------------- torch.multiprocessing.spawn


class ActivatedEntry:
    """What a process started by torch.multiprocessing.spawn runs under the bridge: the script's
    function, in a process where the bridge is active as in its parent. The process joins the
    others at init_process_group, so JAX starts no device before it (the device the script sets
    first, `torch.cuda.set_device(rank)`, is checked once joined)."""

    def __init__(self, function, options, host_devices):
        self.function = function
        self.options = options
        self.host_devices = host_devices

    def __call__(self, index, *args):
        from bridge.activation import activate

        activate(**self.options)
        devices.defer_checks(self.host_devices)
        return self.function(index, *args)


def _start_processes(wrapped, instance, args, kwargs):
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    if bound.arguments.get("start_method", "spawn") != "fork":
        from bridge.activation import activation_options

        bound.arguments["fn"] = ActivatedEntry(bound.arguments["fn"], activation_options(), devices.device_count())
    return wrapped(*bound.args, **bound.kwargs)


_spawn_module = sys.modules["torch.multiprocessing.spawn"]


@wrap(_spawn_module, "start_processes")
def spawn_start_processes(wrapped, instance, args, kwargs):
    return _start_processes(wrapped, instance, args, kwargs)


@wrap(torch.multiprocessing, "start_processes")
def multiprocessing_start_processes(wrapped, instance, args, kwargs):
    return _start_processes(wrapped, instance, args, kwargs)


# ---------------------------------------------------------------- the backend


class _Done(dist._Work):
    """A collective's handle. JAX orders every later use of the results after the collective, so
    `wait()` has nothing to wait for; `get_future()` holds the results."""

    def __init__(self, results=None):
        super().__init__()
        self._results = results

    def wait(self, timeout=datetime.timedelta(0)):
        return True

    def is_completed(self):
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(self._results)
        return future


_REDUCTIONS = {
    dist.ReduceOp.SUM: "SUM", dist.ReduceOp.AVG: "AVG", dist.ReduceOp.PRODUCT: "PRODUCT",
    dist.ReduceOp.MIN: "MIN", dist.ReduceOp.MAX: "MAX", dist.ReduceOp.BAND: "BAND",
    dist.ReduceOp.BOR: "BOR", dist.ReduceOp.BXOR: "BXOR", dist.ReduceOp.PREMUL_SUM: "PREMUL_SUM",
}


def _reduction(operation) -> tuple[str, Any]:
    kind = getattr(operation, "op", operation)
    for known, name in _REDUCTIONS.items():
        if kind == known:
            if name == "PREMUL_SUM":
                raise DistributedError(
                    f"ReduceOp.PREMUL_SUM at {user_call_site()}: its factor is not readable from Python; "
                    "multiply the tensor by the factor and all_reduce with ReduceOp.SUM"
                )
            return name, None
    raise DistributedError(f"unknown ReduceOp {operation!r} at {user_call_site()}")


def _array(tensor: torch.Tensor) -> jax.Array:
    if isinstance(tensor, BridgeTensor):
        return read_value(tensor)
    return jax.device_put(torch_to_numpy(tensor.detach()), collectives.local_device())


def _write(tensor: torch.Tensor, value: jax.Array) -> None:
    if isinstance(tensor, BridgeTensor):
        write_value(tensor, value.astype(TORCH_TO_JAX[tensor.dtype]))
    else:
        with torch.no_grad():
            tensor.copy_(numpy_to_torch(np.array(value)))


def _backend_base():
    """c10d.Backend takes Python subclasses from torch 2.12 on; before, a Python process group
    subclasses ProcessGroup, which register_backend also accepts (with the same collectives)."""
    try:
        type("Probe", (c10d.Backend,), {})(0, 1)
        return c10d.Backend
    except TypeError:
        return dist.ProcessGroup


class BridgeBackend(_backend_base()):
    """torch.distributed's backend for a process group, collectives on JAX. Bridge tensors reach
    it as they are (their data stays on the device); host tensors (object collectives, a
    gloo-style CPU tensor) are moved to this process's device for the collective and back."""

    def __init__(self, options, backend_options=None):
        super().__init__(options.group_rank, options.group_size)
        ranks = tuple(options.global_ranks_in_group) or tuple(range(options.group_size))
        self.group = ranks
        self.timeout = options.timeout.total_seconds() if options.timeout else _timeout_seconds(None)
        collectives.set_timeout(ranks, self.timeout)

    def getBackendName(self):
        return BACKEND

    # What torch asks a backend before using features it may lack (`init_process_group(device_id=)`
    # asks for splitting): none of them here. Left to c10d.Backend, each property calls back into
    # Python for its own name and recurses.
    supports_splitting = supports_coalescing = supports_time_estimate = False
    supports_reconfigure = supports_shrinking = supports_window = False

    @property
    def options(self):
        return c10d.Backend.Options(BACKEND, datetime.timedelta(seconds=self.timeout))

    if _backend_base() is dist.ProcessGroup:
        # As a whole ProcessGroup (torch before 2.14) the group has no C++ backend to hold its name,
        # and torch's getter reads the name from there ("ProcessGroup name not set"): DeviceMesh and
        # the functional collectives name groups, so the name lives here.
        def _set_group_name(self, name):
            self._bridge_group_name = name

        @property
        def group_name(self):
            return self._bridge_group_name

        def _set_group_desc(self, description):
            self._bridge_group_desc = description

        @property
        def group_desc(self):
            return self._bridge_group_desc

        def _get_backend(self, device):
            return self  # the group is its own backend on every device

        @property
        def _device_types(self):
            return [torch.device("cuda"), torch.device("cpu")]  # as torch 2.14 lists the registered ones

    def _meet(self, name):
        if len(self.group) > 1:
            collectives.meet(self.group, name, self.timeout, user_call_site())

    def allreduce(self, tensors, opts):
        self._meet("all_reduce")
        reduction, factor = _reduction(opts.reduceOp)
        for tensor, value in zip(tensors, collectives.all_reduce([_array(t) for t in tensors], self.group,
                                                                 reduction, factor)):
            _write(tensor, value)
        return _Done(tensors)

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        self._meet("broadcast")
        for tensor, value in zip(tensors, collectives.broadcast([_array(t) for t in tensors], self.group,
                                                                opts.rootRank)):
            _write(tensor, value)
        return _Done(tensors)

    def allgather(self, output_lists, inputs, opts):
        self._meet("all_gather")
        for outputs, tensor in zip(output_lists, inputs):
            gathered = collectives.all_gather(_array(tensor), self.group)
            for index, output in enumerate(outputs):
                _write(output, gathered[index])
        return _Done(output_lists)

    def all_gather_single(self, output, tensor, opts):
        self._meet("all_gather_into_tensor")
        gathered = collectives.all_gather(_array(tensor), self.group)
        _write(output, gathered.reshape(output.shape))
        return _Done([output])

    def _allgather_base(self, output, tensor, opts):
        return self.all_gather_single(output, tensor, opts)

    def all_gather_single_coalesced(self, outputs, tensors, opts):
        for output, tensor in zip(outputs, tensors):
            self.all_gather_single(output, tensor, opts)
        return _Done(outputs)

    def allgather_into_tensor_coalesced(self, outputs, tensors, opts):
        return self.all_gather_single_coalesced(outputs, tensors, opts)

    def reduce_scatter(self, outputs, input_lists, opts):
        self._meet("reduce_scatter")
        reduction, factor = _reduction(opts.reduceOp)
        for output, inputs in zip(outputs, input_lists):
            stacked = jnp.stack([_array(tensor) for tensor in inputs])
            _write(output, collectives.reduce_scatter(stacked, self.group, reduction, factor))
        return _Done(outputs)

    def reduce_scatter_single(self, output, tensor, opts):
        self._meet("reduce_scatter_tensor")
        reduction, factor = _reduction(opts.reduceOp)
        value = _array(tensor)
        stacked = value.reshape((len(self.group),) + tuple(output.shape))
        _write(output, collectives.reduce_scatter(stacked, self.group, reduction, factor))
        return _Done([output])

    def _reduce_scatter_base(self, output, tensor, opts):
        return self.reduce_scatter_single(output, tensor, opts)

    def reduce_scatter_single_coalesced(self, outputs, tensors, opts):
        for output, tensor in zip(outputs, tensors):
            self.reduce_scatter_single(output, tensor, opts)
        return _Done(outputs)

    def reduce_scatter_tensor_coalesced(self, outputs, tensors, opts):
        return self.reduce_scatter_single_coalesced(outputs, tensors, opts)

    def all_to_all_single(self, output, tensor, output_splits, input_splits, opts):
        size = len(self.group)
        self._meet("all_to_all_single")
        value = _array(tensor)
        if (output_splits and len(set(output_splits)) > 1) or (input_splits and len(set(input_splits)) > 1):
            _write(output, self._uneven_all_to_all(value, list(input_splits), list(output_splits)))
            return _Done([output])
        stacked = value.reshape((size, value.shape[0] // size) + tuple(value.shape[1:]))
        _write(output, collectives.all_to_all(stacked, self.group).reshape(output.shape))
        return _Done([output])

    def _uneven_all_to_all(self, value, input_splits, output_splits):
        """Chunks of different lengths (a mixture of experts' tokens): each padded to the longest
        chunk any rank sends, exchanged in one all_to_all, and cut back to what each rank sent."""
        longest = max(input_splits + output_splits + [0])
        longest = int(collectives.all_reduce([jnp.asarray(longest, jnp.int64)], self.group, "MAX")[0])
        chunks, start = [], 0
        for length in input_splits:
            chunk = value[start:start + length]
            widths = [(0, longest - length)] + [(0, 0)] * (value.ndim - 1)
            chunks.append(jnp.pad(chunk, widths))
            start += length
        received = collectives.all_to_all(jnp.stack(chunks), self.group)
        return jnp.concatenate([received[source, :length] for source, length in enumerate(output_splits)])

    def alltoall_base(self, output, tensor, output_splits, input_splits, opts):
        return self.all_to_all_single(output, tensor, output_splits, input_splits, opts)

    def alltoall(self, outputs, inputs, opts):
        self._meet("all_to_all")
        if len({tuple(t.shape) for t in inputs} | {tuple(t.shape) for t in outputs}) > 1:
            # Tensors of different lengths: as all_to_all_single's uneven splits, then cut.
            received = self._uneven_all_to_all(jnp.concatenate([_array(t) for t in inputs]),
                                               [t.shape[0] for t in inputs], [t.shape[0] for t in outputs])
            start = 0
            for output in outputs:
                _write(output, received[start:start + output.shape[0]])
                start += output.shape[0]
            return _Done(outputs)
        received = collectives.all_to_all(jnp.stack([_array(tensor) for tensor in inputs]), self.group)
        for index, output in enumerate(outputs):
            _write(output, received[index])
        return _Done(outputs)

    def barrier(self, opts=None):
        self._meet("barrier")
        return _Done()

    def reduce(self, tensors, opts):
        self._meet("reduce")
        reduction, factor = _reduction(opts.reduceOp)
        results = collectives.all_reduce([_array(t) for t in tensors], self.group, reduction, factor)
        if self.rank() == opts.rootRank:
            for tensor, value in zip(tensors, results):
                _write(tensor, value)
        return _Done(tensors)

    def gather(self, output_lists, inputs, opts):
        self._meet("gather")
        gathered = collectives.all_gather(_array(inputs[0]), self.group)
        if self.rank() == opts.rootRank:
            for index, output in enumerate(output_lists[0]):
                _write(output, gathered[index])
        return _Done(output_lists)

    def scatter(self, outputs, input_lists, opts):
        self._meet("scatter")
        output = outputs[0]
        if self.rank() == opts.rootRank:
            stacked = jnp.stack([_array(tensor) for tensor in input_lists[0]])
        else:  # what the root sends: a placeholder of its shape here
            stacked = jnp.zeros((len(self.group),) + tuple(output.shape), TORCH_TO_JAX[output.dtype])
        sent = collectives.broadcast([stacked], self.group, opts.rootRank)[0]
        _write(output, sent[self.rank()])
        return _Done(outputs)

    def send(self, tensors, destination, tag):
        source = self.group[self.rank()]
        collectives.meet((min(source, self.group[destination]), max(source, self.group[destination])), "send",
                         self.timeout, user_call_site())
        collectives.send_receive(_array(tensors[0]), source, self.group[destination])
        return _Done(tensors)

    def recv(self, tensors, source, tag):
        destination = self.group[self.rank()]
        collectives.meet((min(destination, self.group[source]), max(destination, self.group[source])), "recv",
                         self.timeout, user_call_site())
        _write(tensors[0], collectives.send_receive(_array(tensors[0]), self.group[source], destination))
        return _Done(tensors)

    def recv_anysource(self, tensors, tag):
        raise DistributedError(
            f"recv without a source rank at {user_call_site()}: the bridge's point-to-point transfers are "
            "compiled for a known pair of ranks; pass src="
        )


# The bridge's backend of each process group (torch's way to reach it differs between releases:
# the group itself where BridgeBackend is a ProcessGroup, `_get_backend` where it is a Backend).
_backends: dict = {}
_made: list = []


def _make_backend(options, backend_options):
    _made.append(BridgeBackend(options, backend_options))
    return _made[-1]


def backend_of(group) -> "BridgeBackend | None":
    return _backends.get(group)


dist.Backend.register_backend(BACKEND, _make_backend, extended_api=True, devices=["cpu", "cuda"])


# ---------------------------------------------------------------- DistributedDataParallel

_TorchDistributedDataParallel = torch.nn.parallel.DistributedDataParallel


def _on_bridge(module: torch.nn.Module) -> bool:
    tensors = list(module.parameters()) + list(module.buffers())
    return bool(tensors) and all(isinstance(tensor, BridgeTensor) for tensor in tensors)


class DistributedDataParallel(_TorchDistributedDataParallel):
    """torch's DDP for a module on the bridge device: the same constructor, attributes and
    semantics (rank 0's parameters and buffers broadcast at construction, buffers again before
    each forward, gradients averaged over the group when backward ends, `no_sync()`), with the
    gradients reduced by one collective over all of them when the backward ends instead of
    torch's C++ reducer, whose buckets would be host tensors here. A module on the host gets
    torch's own DDP."""

    # Captured mode makes the wrapped module's call the region (bridge/patches/capture.py): the
    # buffer broadcast before it is a collective between processes, which runs between programs.
    bridge_wraps_region = True

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                 process_group=None, bucket_cap_mb=None, find_unused_parameters=False, *args, **kwargs):
        if not _on_bridge(module):
            super().__init__(module, device_ids, output_device, dim, broadcast_buffers, process_group, bucket_cap_mb,
                             find_unused_parameters, *args, **kwargs)
            self._bridge = False
            return
        torch.nn.Module.__init__(self)
        self._bridge = True
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = kwargs.get("gradient_as_bucket_view", False)
        self.static_graph = kwargs.get("static_graph", False)
        self.process_group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self._parameters_synced = [p for name, p in module.named_parameters() if name not in ignored and p.requires_grad]
        self._buffers_synced = [b for name, b in module.named_buffers() if name not in ignored]
        self._backend = backend_of(self.process_group)
        self._group = self._backend.group if self._backend is not None else None
        if self._group is None:
            raise DistributedError(
                f"DistributedDataParallel at {user_call_site()}: its process group is not the bridge's "
                "(init_process_group was called before the bridge was active?); activate the bridge first"
            )
        self._queued = False
        self._comm_hook = None  # (state, hook) from register_comm_hook
        self._reducer = _Reducer(self._backend)
        self._synchronize(self._parameters_synced + self._buffers_synced, "DistributedDataParallel's broadcast")
        for parameter in self._parameters_synced:
            parameter.register_post_accumulate_grad_hook(self._gradient_ready)

    # -- torch's DDP API
    def forward(self, *inputs, **kwargs):
        if not self._bridge:
            return super().forward(*inputs, **kwargs)
        if self.broadcast_buffers and self._buffers_synced and self.require_forward_param_sync and torch.is_grad_enabled():
            self._synchronize(self._buffers_synced, "DistributedDataParallel's buffer broadcast")
        if self.device_ids:
            device = torch.device("cuda", self.device_ids[0]) if isinstance(self.device_ids[0], int) else self.device_ids[0]
            inputs, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t if isinstance(t, BridgeTensor) else t.to(device), (inputs, kwargs))
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        if not self._bridge:
            with super().no_sync():
                yield
            return
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state, hook):
        """torch's communication hook: `hook(state, bucket)` reduces a bucket of gradients (a flat
        buffer of them; one bucket per dtype here) and returns a Future of the result, which DDP
        writes back into the gradients. The average runs when the backward ends, then, not in the
        step's program."""
        if not self._bridge:
            return super().register_comm_hook(state, hook)
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._comm_hook = (state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type):
        if not self._bridge:
            return super()._register_builtin_comm_hook(comm_hook_type)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        self.register_comm_hook(self.process_group, hooks[comm_hook_type])

    def _set_static_graph(self):
        if not self._bridge:
            return super()._set_static_graph()
        self.static_graph = True

    def __getstate__(self):
        if not self._bridge:
            return super().__getstate__()
        return torch.nn.Module.__getstate__(self)

    # -- the bridge's reduction
    def _synchronize(self, tensors, name):
        """Rank 0's values of `tensors` on every rank (one broadcast)."""
        if len(self._group) == 1 or not tensors:
            return
        self._backend._meet(name)
        with torch.no_grad():
            values = collectives.broadcast(read_values(tensors), self._group, 0)
            for tensor, value in zip(tensors, values):
                write_value(tensor, value)

    def _gradient_ready(self, parameter):
        if not self._queued and self.require_backward_grad_sync:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce_gradients)

    def _reduce_gradients(self):
        self._queued = False
        if len(self._group) == 1:
            return
        parameters = self._parameters_synced
        grads = [parameter.grad for parameter in parameters]
        if self._comm_hook is None and settings.capture and not settings.tracing and _whole_and_distinct(grads):
            # The optimizer's step takes the average into its program (the ranks agree there).
            optimizers.PendingReduction([root_of(grad) for grad in grads], self._reducer)
            return
        self._reducer.agree(False)
        stats.ddp_averages["alone"] += 1
        missing = [grad is None for grad in grads]
        gradients = [jnp.zeros(p.shape, TORCH_TO_JAX[p.dtype]) if absent else read_value(p.grad)
                     for p, absent in zip(parameters, missing)]
        if self._comm_hook is None:
            averaged, counts = self._reducer.average(gradients, missing)
        else:
            averaged, counts = self._hooked(parameters, gradients, missing)
        for index, (parameter, value) in enumerate(zip(parameters, averaged)):
            if not missing[index]:
                write_value(parameter.grad, value)
            elif counts[index]:
                parameter.grad = BridgeTensor(value, devices.current_index())

    def _hooked(self, parameters, gradients, missing):
        """The gradients reduced by the registered communication hook, a bucket per dtype (in
        torch's order: the parameters last registered first, as their gradients become ready), and
        where a rank lacks a gradient, how many ranks had it (a second, small all_reduce)."""
        state, hook = self._comm_hook
        index = parameters[0]._index
        by_dtype = {}
        for position in reversed(range(len(parameters))):
            by_dtype.setdefault(gradients[position].dtype, []).append(position)
        reduced = list(gradients)
        for number, positions in enumerate(by_dtype.values()):
            flat = jnp.concatenate([gradients[p].reshape(-1) for p in positions])
            bucket = _GradBucket(number, BridgeTensor(flat, index), [parameters[p] for p in positions],
                                 number == len(by_dtype) - 1)
            result = hook(state, bucket).wait()
            result = read_value(result[0] if isinstance(result, (list, tuple)) else result)
            start = 0
            for p in positions:
                size = gradients[p].size
                reduced[p] = result[start:start + size].reshape(gradients[p].shape).astype(gradients[p].dtype)
                start += size
        if not any(missing):
            return reduced, None
        had = jnp.asarray([0 if absent else 1 for absent in missing], jnp.int32)
        (counts,) = collectives.all_reduce([had], self._group, ("SUM",))
        return reduced, np.asarray(counts)


class _GradBucket:
    """What a DDP communication hook is handed (torch's GradBucket): a flat buffer of gradients."""

    def __init__(self, number, buffer, parameters, last):
        self._number, self._buffer, self._parameters, self._last = number, buffer, parameters, last

    def index(self):
        return self._number

    def buffer(self):
        return self._buffer

    def set_buffer(self, buffer):
        self._buffer = buffer

    def gradients(self):
        pieces, start = [], 0
        for parameter in self._parameters:
            pieces.append(self._buffer[start:start + parameter.numel()].view(parameter.shape))
            start += parameter.numel()
        return pieces

    def parameters(self):
        return list(self._parameters)

    def is_last(self):
        return self._last


def _whole_and_distinct(grads) -> bool:
    """Gradients a step may take unreduced: each a whole array of its own on the bridge."""
    if not all(isinstance(grad, BridgeTensor) and not grad._chain for grad in grads):
        return False
    return len({id(root_of(grad)) for grad in grads}) == len(grads)


class _Reducer:
    """How a DDP module's gradients are averaged over its group (the `reducer` of
    runtime.optimizers.PendingReduction): one all_reduce of all of them, with a count of the
    ranks that had each (a parameter no rank used keeps no gradient, as in torch). The ranks
    agree first whether the step's program runs it or a program of its own does."""

    def __init__(self, backend):
        self.backend = backend
        self.group = backend.group

    def agree(self, in_step: bool) -> bool:
        return collectives.agree(self.group, "DistributedDataParallel's gradient all_reduce", self.backend.timeout,
                                 user_call_site(), in_step)

    def average(self, gradients, missing):
        had = jnp.asarray([0 if absent else 1 for absent in missing], jnp.int32)
        reductions = ("DIVIDED_SUM",) * len(gradients) + ("SUM",)
        *averaged, counts = collectives.all_reduce(gradients + [had], self.group, reductions)
        return averaged, (np.asarray(counts) if any(missing) else None)

    def alone(self, values):
        return self.average(values, [False] * len(values))[0]


PATCHES = collect(dict(globals())) + [
    Patch(torch.nn.parallel, "DistributedDataParallel", replacement=DistributedDataParallel),
    Patch(torch.nn.parallel.distributed, "DistributedDataParallel", replacement=DistributedDataParallel),
]
