"""Collectives across processes on JAX: processes joined by `jax.distributed`, each collective one
XLA program over a mesh of its group's devices (NCCL between GPUs, gloo between CPUs).

Every process owns one device (its local rank's GPU, or its CPU). A collective takes each
process's local array as one block of a global array laid out over the group's devices and runs
a `shard_map` of `jax.lax` collectives over it; the result is the block this process holds.
Programs are cached by what they do and the shapes they take.

A collective whose peers do not all arrive would wait forever inside XLA, so every collective
first meets its group at a barrier of JAX's coordination service with the group's timeout: a
rank that never comes makes the others raise `DistributedTimeoutError` naming it, instead of
hanging (the most common complaint of distributed training).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.array import ArrayImpl
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .errors import DistributedError, DistributedTimeoutError

AXIS = "ranks"

# The reductions of torch.distributed.ReduceOp, by name, and DistributedDataParallel's average
# (each rank's value divided by the group's size, then summed: torch's reducer divides first).
REDUCTIONS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM", "DIVIDED_SUM")


@dataclasses.dataclass
class World:
    """This process's place among the others, once `start` has joined them."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    coordinator: str
    # Device of each rank (the one device each process owns), by rank.
    devices: tuple = ()


_world: list[Optional[World]] = [None]
# Collectives met so far, per group: every rank counts the same, whichever thread calls (the
# autograd engine's, for DDP's reduction), so the n-th barrier of a group has one name everywhere.
_sequence: dict = {}


def world() -> Optional[World]:
    return _world[0]


def backends_started() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


def launched_environment() -> Optional[dict]:
    """What torchrun (or `bridge run --nproc-per-node`) told this process, if it started it."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(name in os.environ for name in names):
        return None
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return {
        "rank": rank,
        "size": size,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "local_size": int(os.environ.get("LOCAL_WORLD_SIZE", size)),
        "master": (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
    }


def coordinator_address(master: tuple[str, int]) -> str:
    """Where JAX's coordination service listens: BRIDGE_COORDINATOR if set, else the port after
    torch's store (MASTER_PORT + 1) on MASTER_ADDR, so the script's own settings place both."""
    chosen = os.environ.get("BRIDGE_COORDINATOR")
    if chosen:
        return chosen
    host, port = master
    return f"{host}:{port + 1}"


def refuse_late_start(site: str = "") -> None:
    if backends_started():
        where = f"init_process_group at {site}: " if site else ""
        raise DistributedError(
            f"{where}torch.distributed needs to join the other processes before JAX starts its devices, but a "
            "tensor was already put on the device. Call torch.distributed.init_process_group before "
            "the first tensor goes to 'cuda', or start the script with torchrun (or "
            "`python -m bridge run --nproc-per-node N script.py`), which joins them at startup."
        )


def start(rank: int, size: int, local_rank: int, local_size: int, coordinator: str, platform: Optional[str],
          timeout_seconds: float = 300) -> World:
    """Join the other processes through jax.distributed (before any JAX backend starts)."""
    if _world[0] is not None:
        return _world[0]
    refuse_late_start()
    if platform in (None, "cpu"):
        # JAX's CPU backend moves collectives between processes with gloo (GPUs use NCCL).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=size,
            process_id=rank,
            # One GPU per process: its local rank's (the others stay free for the other processes).
            local_device_ids=[local_rank],
            initialization_timeout=max(1, int(timeout_seconds)),
        )
    except Exception as error:
        raise DistributedError(
            f"rank {rank} of {size} could not join the others through JAX's coordination service at "
            f"{coordinator} ({error}). Check that every rank was started and that the address is "
            f"reachable from this host; BRIDGE_COORDINATOR=host:port picks another address "
            f"(the default is MASTER_ADDR with MASTER_PORT + 1)."
        ) from None
    by_process: dict[int, jax.Device] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, device)
    _world[0] = World(rank, size, local_rank, local_size, coordinator, tuple(by_process[r] for r in range(size)))
    return _world[0]


def local_device() -> jax.Device:
    return jax.local_devices()[0]


# ---------------------------------------------------------------- meeting before a collective


def _client():
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def _prefix(group: tuple) -> str:
    """The coordination service's names for a group's barriers and votes."""
    return f"bridge/{'-'.join(map(str, group))}"


def meet(group: tuple, name: str, timeout_seconds: float, site: str = "") -> int:
    """Wait for every rank of `group` at a barrier of JAX's coordination service; a rank that does
    not come within the timeout raises DistributedTimeoutError instead of a hang in XLA. Returns
    the collective's number in the group."""
    count = _sequence[group] = _sequence.get(group, 0) + 1
    barrier = f"{_prefix(group)}/{count}"
    try:
        _client().wait_at_barrier(barrier, max(1, int(timeout_seconds * 1000)), process_ids=list(group))
    except Exception as error:
        text = str(error)
        missing = _missing_ranks(text, group)
        where = f" at {site}" if site else ""
        raise DistributedTimeoutError(
            f"{name}{where}: rank {_world[0].rank} waited {timeout_seconds:g} s for the ranks "
            f"{list(group)} and {missing or 'some of them'} never reached collective number {count} of "
            f"this group. A rank has stopped, crashed, or called a different collective (every rank of "
            f"a group must call the same collectives in the same order). init_process_group(timeout=...) "
            f"sets how long to wait. ({text.splitlines()[0] if text else type(error).__name__})"
        ) from None
    return count


def agree(group: tuple, name: str, timeout_seconds: float, site: str, choice: bool) -> bool:
    """Meet as `meet` does, each rank saying yes or no (in the coordination service's key-value
    store, before the barrier); True when every rank said yes. Where a collective may run in one
    of two programs, the ranks must all take the same one."""
    rank, client = _world[0].rank, _client()
    count = _sequence.get(group, 0) + 1
    votes = f"{_prefix(group)}/votes/{count}/"
    client.key_value_set(votes + str(rank), "1" if choice else "0")
    meet(group, name, timeout_seconds, site)
    answer = all(value == "1" for _, value in client.key_value_dir_get(votes))
    # Every rank has read the votes of two collectives ago (it has since passed a barrier).
    try:
        client.key_value_delete(f"{_prefix(group)}/votes/{count - 2}/{rank}")
    except Exception:  # not there: that collective was no vote
        pass
    return answer


def _missing_ranks(text: str, group: tuple) -> str:
    """The ranks the coordination service names as late ('Some timed out task names: ...')."""
    marker = "timed out task names:"
    if marker not in text:
        return ""
    names = text.split(marker, 1)[1].split("\n\n", 1)[0]
    ranks = sorted({int(token) for token in names.replace(",", " ").split() if token.isdigit()} & set(group))
    return f"rank(s) {ranks}" if ranks else ""


# ---------------------------------------------------------------- programs


def _mesh(group: tuple) -> Mesh:
    return _meshes(group)


@functools.lru_cache(maxsize=None)
def _meshes(group: tuple) -> Mesh:
    return Mesh(np.array([_world[0].devices[rank] for rank in group]), (AXIS,))


def _global(array: jax.Array, mesh: Mesh) -> jax.Array:
    """This process's array as its block of a global array (blocks side by side on axis 0): no
    copy and no op, the array is the block (a 0-dim array must be given as shape (1,))."""
    sharding = NamedSharding(mesh, PartitionSpec(AXIS))
    shape = (array.shape[0] * mesh.devices.size,) + array.shape[1:]
    return jax.make_array_from_single_device_arrays(shape, sharding, [array])


def _local(array: jax.Array) -> jax.Array:
    return array.addressable_shards[0].data


def _own(array: jax.Array) -> jax.Array:
    return array.addressable_data(0)


def _replicated(array: jax.Array, sharding: NamedSharding) -> jax.Array:
    """This process's array as its copy of a replicated global array (a step's few hundred
    arguments: JAX's checked constructor costs 15 us an array on a 2-core CPU, its array type's
    own 3.5)."""
    try:
        return ArrayImpl(array.aval, sharding, [array], committed=True, _skip_checks=True)
    except Exception:  # the private constructor changed: the public one
        return jax.make_array_from_single_device_arrays(array.shape, sharding, [array])


def _reduce_stacked(stacked: jax.Array, reduction: str, size: int, factor=None) -> jax.Array:
    """Reduce the ranks' values stacked on axis 0 as torch's ReduceOp does."""
    if reduction == "SUM":
        return jnp.sum(stacked, axis=0, dtype=stacked.dtype)
    if reduction == "PREMUL_SUM":
        return jnp.sum(stacked * jnp.asarray(factor, stacked.dtype), axis=0, dtype=stacked.dtype)
    if reduction == "AVG":
        total = jnp.sum(stacked, axis=0, dtype=stacked.dtype)
        if jnp.issubdtype(stacked.dtype, jnp.integer):
            return jax.lax.div(total, jnp.asarray(size, stacked.dtype))  # integer division, as NCCL's
        return total / jnp.asarray(size, stacked.dtype)
    if reduction == "PRODUCT":
        return jnp.prod(stacked, axis=0, dtype=stacked.dtype)
    if reduction == "MIN":
        return jnp.min(stacked, axis=0)
    if reduction == "MAX":
        return jnp.max(stacked, axis=0)
    bitwise = {"BAND": jnp.bitwise_and, "BOR": jnp.bitwise_or, "BXOR": jnp.bitwise_xor}[reduction]
    return functools.reduce(bitwise, [stacked[i] for i in range(size)])


def _reduce_across(value: jax.Array, reduction: str, size: int, factor=None) -> jax.Array:
    """Inside shard_map: the reduction of `value` over the ranks, the same on every rank."""
    if reduction == "SUM" and value.dtype != jnp.bool_:
        return jax.lax.psum(value, AXIS)
    if reduction == "DIVIDED_SUM":
        return jax.lax.psum(value / jnp.asarray(size, value.dtype), AXIS)
    if reduction in ("MIN", "MAX") and value.dtype != jnp.bool_:
        return (jax.lax.pmin if reduction == "MIN" else jax.lax.pmax)(value, AXIS)
    # Products, averages and bitwise reductions: gather, then reduce in rank order (exact and
    # deterministic, as torch's gloo backend is).
    stacked = jax.lax.all_gather(value, AXIS)
    if value.dtype == jnp.bool_:
        summed = _reduce_stacked(stacked.astype(jnp.int32), reduction, size, factor)
        return summed.astype(jnp.bool_) if reduction != "BXOR" else (summed % 2).astype(jnp.bool_)
    return _reduce_stacked(stacked, reduction, size, factor)


# Collectives whose result is the same on every rank: their programs return it replicated, so each
# process's shard is the whole result (no op to take it out).
_REPLICATED = ("all_reduce", "all_gather", "broadcast")


@functools.lru_cache(maxsize=None)
def _program(kind: str, group: tuple, static: tuple) -> Callable:
    """One jitted shard_map program for a collective; `static` holds its static arguments. Each
    rank's value arrives as it is (its block of the global input)."""
    mesh = _mesh(group)
    size = len(group)
    options = dict(static)
    out_specs = PartitionSpec() if kind in _REPLICATED else PartitionSpec(AXIS)

    def program(function):
        def body(*values):
            return tuple(function(*values))

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec(AXIS), out_specs=out_specs,
                                     check_vma=False))

    if kind == "all_reduce":  # one reduction per value
        return program(lambda *values: [_reduce_across(v, reduction, size, options.get("factor"))
                                        for v, reduction in zip(values, options["reductions"])])
    if kind == "all_gather":
        return program(lambda value: [jax.lax.all_gather(value, AXIS)])
    if kind == "broadcast":
        source = options["source"]
        return program(lambda *values: [jax.lax.all_gather(v, AXIS)[source] for v in values])
    if kind == "reduce_scatter":  # value: (size, *chunk) -> this rank's chunk (kept 1-dim at least), reduced
        reduction = options["reduction"]

        def reduce_scatter(value):
            if reduction == "SUM" and value.dtype != jnp.bool_:
                chunk = jax.lax.psum_scatter(value, AXIS, scatter_dimension=0, tiled=False)
            else:
                reduced = _reduce_across(value, reduction, size, options.get("factor"))
                chunk = jax.lax.dynamic_index_in_dim(reduced, jax.lax.axis_index(AXIS), 0, keepdims=False)
            return [chunk if chunk.ndim else chunk[None]]

        return program(reduce_scatter)
    if kind == "all_to_all":  # value: (size, *chunk): chunk i goes to rank i
        return program(lambda value: [jax.lax.all_to_all(value, AXIS, 0, 0, tiled=False)])
    if kind == "send":  # group is (source, destination)
        return program(lambda value: [jax.lax.ppermute(value, AXIS, perm=[(0, 1)])])
    raise ValueError(kind)


def _run(kind: str, group: tuple, arrays: Sequence[jax.Array], **static) -> list[jax.Array]:
    program = _program(kind, group, tuple(sorted(static.items())))
    mesh = _mesh(group)
    scalars = [array.ndim == 0 for array in arrays]
    blocks = [array.reshape(1) if scalar else array for array, scalar in zip(arrays, scalars)]
    results = [_local(result) for result in program(*[_global(block, mesh) for block in blocks])]
    if kind in ("all_reduce", "broadcast", "send"):  # shaped as the inputs: 0-dim ones back to 0-dim
        return [result.reshape(()) if scalar else result for result, scalar in zip(results, scalars)]
    if kind == "all_gather" and scalars[0]:
        return [results[0].reshape(len(group))]
    return results


def average(values: Sequence[jax.Array], group: tuple) -> list[jax.Array]:
    """Inside a `group_program`: DistributedDataParallel's average of each value over the group
    (divided by the group's size, then summed), as the all_reduce of DIVIDED_SUM gives it."""
    return [_reduce_across(value, "DIVIDED_SUM", len(group)) for value in values]


def group_program(function: Callable, group: tuple, **jit_options) -> Callable:
    """`function` as one program that every rank of `group` runs, its body free to hold the
    group's collectives (`average`). Each rank's arguments and results are its own: they pass as
    blocks of replicated global arrays, which nothing checks, so no array is copied or reshaped
    (a pytree of arrays, None and NumPy values in, a pytree of arrays out)."""
    mesh = _mesh(group)
    sharding = NamedSharding(mesh, PartitionSpec())
    program = jax.jit(jax.shard_map(function, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
                                    check_vma=False), **jit_options)

    def placed(value):
        return _replicated(value, sharding) if isinstance(value, jax.Array) else value

    def run(*args):
        return jax.tree_util.tree_map(_own, program(*jax.tree_util.tree_map(placed, args)))

    return run


# ---------------------------------------------------------------- the collectives


def all_reduce(arrays: Sequence[jax.Array], group: tuple, reduction, factor=None) -> list[jax.Array]:
    """The reduction over the group of each array (one program for all of them); `reduction` is
    one name for all, or a tuple of one name per array."""
    reductions = tuple(reduction) if isinstance(reduction, (tuple, list)) else (reduction,) * len(arrays)
    if len(group) == 1:
        return [_reduce_stacked(a[None], r, 1, factor) if r == "PREMUL_SUM" else a for a, r in zip(arrays, reductions)]
    if len(arrays) <= _PACK_ABOVE:
        return _run("all_reduce", group, arrays, reductions=reductions, factor=factor)
    # Many arrays (a model's gradients): packed into one flat buffer per dtype and reduction, as
    # DDP's buckets are, so that one collective moves them (and the host makes a few arrays, not
    # hundreds); unpacked after.
    kinds: dict = {}
    for index, (array, name) in enumerate(zip(arrays, reductions)):
        kinds.setdefault((array.dtype, name), []).append(index)
    members = list(kinds.values())
    flats = [_pack(*[arrays[i] for i in indices]) for indices in members]
    reduced = _run("all_reduce", group, flats, reductions=tuple(name for _, name in kinds), factor=factor)
    results: list = [None] * len(arrays)
    for indices, flat in zip(members, reduced):
        shapes = tuple(arrays[i].shape for i in indices)
        for index, value in zip(indices, _unpack(flat, shapes)):
            results[index] = value
    return results


_PACK_ABOVE = 4


@jax.jit
def _pack(*arrays):
    return jnp.concatenate([array.reshape(-1) for array in arrays])


@functools.partial(jax.jit, static_argnums=1)
def _unpack(flat, shapes):
    values, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape, dtype=np.int64))
        values.append(flat[start:start + size].reshape(shape))
        start += size
    return values


def broadcast(arrays: Sequence[jax.Array], group: tuple, source_index: int) -> list[jax.Array]:
    """The values of the rank at `source_index` in the group."""
    if len(group) == 1:
        return list(arrays)
    return _run("broadcast", group, arrays, source=source_index)


def all_gather(array: jax.Array, group: tuple) -> jax.Array:
    """Every rank's array, stacked on a new axis 0 in group order."""
    if len(group) == 1:
        return array[None]
    return _run("all_gather", group, [array])[0]


def reduce_scatter(stacked: jax.Array, group: tuple, reduction: str, factor=None) -> jax.Array:
    """`stacked` holds one chunk per rank on axis 0; returns this rank's chunk reduced over the group."""
    if len(group) == 1:
        return _reduce_stacked(stacked, reduction, 1, factor) if reduction in ("AVG", "PREMUL_SUM") else stacked[0]
    chunk = _run("reduce_scatter", group, [stacked], reduction=reduction, factor=factor)[0]
    return chunk.reshape(()) if stacked.ndim == 1 else chunk


def all_to_all(stacked: jax.Array, group: tuple) -> jax.Array:
    """`stacked[i]` goes to the i-th rank of the group; returns what each rank sent here, stacked."""
    if len(group) == 1:
        return stacked
    return _run("all_to_all", group, [stacked])[0]


def send_receive(array: jax.Array, source: int, destination: int) -> jax.Array:
    """Point to point: both ranks call it, the source with its value, the destination with a
    buffer of the same shape; the destination gets the source's value."""
    return _run("send", (source, destination), [array])[0]


# ---------------------------------------------------------------- functional collectives

# Each group's timeout (its ranks -> seconds), as the process group that serves it was made with.
_timeouts: dict = {}


def set_timeout(group: tuple, seconds: float) -> None:
    _timeouts[group] = seconds


def _group_of(name) -> tuple:
    import torch.distributed as dist

    group = torch_resolve_group(name)
    return tuple(dist.distributed_c10d.get_process_group_ranks(group)), group.rank()


def torch_resolve_group(name):
    from torch._C._distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def functional_collective(func, args, kwargs, site: str = ""):
    """torch's functional collectives (`torch.ops._c10d_functional`: what DTensor, FSDP2's state
    dicts and compiled programs call) on bridge tensors: new tensors for the results, the inputs
    written by the in-place forms."""
    from .tensor import BridgeTensor, read_value, write_value

    name = func._schema.name.split("::", 1)[1]
    values = {argument.name: (args[i] if i < len(args) else kwargs.get(argument.name, argument.default_value))
              for i, argument in enumerate(func._schema.arguments)}
    if name in ("wait_tensor", "_wrap_tensor_autograd"):
        return values["tensor" if "tensor" in values else "input"]
    group, group_rank = _group_of(values["group_name"])
    if len(group) > 1:
        meet(group, name, _timeouts.get(group, 600.0), site)
    index = values.get("input", (values.get("inputs") or [None])[0])._index

    def made(array):
        return BridgeTensor(array, index)

    reduction = str(values.get("reduce_op", "sum")).upper()
    if name.startswith("all_reduce"):
        inputs = values["inputs"] if "coalesced" in name else [values["input"]]
        results = all_reduce([read_value(t) for t in inputs], group, reduction)
        if name.endswith("_"):
            for tensor, result in zip(inputs, results):
                write_value(tensor, result)
            return inputs if "coalesced" in name else inputs[0]
        return [made(r) for r in results] if "coalesced" in name else made(results[0])
    if name.startswith("all_gather_into_tensor"):
        inputs = values["inputs"] if "coalesced" in name else [values["input"]]
        results = []
        for tensor in inputs:
            gathered = all_gather(read_value(tensor), group)
            shape = (gathered.shape[0] * gathered.shape[1],) + gathered.shape[2:] if gathered.ndim > 1 else gathered.shape
            results.append(gathered.reshape(shape))
        if name.endswith("_out"):
            write_value(values["out"], results[0])
            return values["out"]
        return [made(r) for r in results] if "coalesced" in name else made(results[0])
    if name.startswith("reduce_scatter_tensor"):
        inputs = values["inputs"] if "coalesced" in name else [values["input"]]
        results = []
        for tensor in inputs:
            value = read_value(tensor)
            stacked = value.reshape((len(group), value.shape[0] // len(group)) + value.shape[1:])
            results.append(reduce_scatter(stacked, group, reduction))
        if name.endswith("_out"):
            write_value(values["out"], results[0])
            return values["out"]
        return [made(r) for r in results] if "coalesced" in name else made(results[0])
    if name in ("broadcast", "broadcast_"):
        result = broadcast([read_value(values["input"])], group, values["src"])[0]
        if name.endswith("_"):
            write_value(values["input"], result)
            return values["input"]
        return made(result)
    if name == "all_to_all_single":
        value = read_value(values["input"])
        splits = set(values["output_split_sizes"] or ()) | set(values["input_split_sizes"] or ())
        if len(splits) > 1:
            raise DistributedError(
                f"all_to_all_single with uneven split sizes at {site}: the bridge's all_to_all sends equal "
                "chunks; pad the chunks to one size"
            )
        stacked = value.reshape((len(group), value.shape[0] // len(group)) + value.shape[1:])
        return made(all_to_all(stacked, group).reshape(value.shape))
    raise DistributedError(
        f"torch.ops._c10d_functional.{name} at {site}: the bridge has no rule for it yet; use the "
        "torch.distributed collective it stands for (all_reduce, all_gather_into_tensor, ...)"
    )
