"""The device model: which JAX devices the script's 'cuda:N' names stand for."""

import functools

import jax
import numpy as np
import torch

from .config import settings
from .errors import DeviceError


@functools.lru_cache(maxsize=None)
def backend_devices_of(platform):
    """JAX's devices of a platform ('cpu', 'gpu', 'tpu'); DeviceError where it has none."""
    try:
        return tuple(jax.devices(platform))
    except RuntimeError as error:
        raise DeviceError(
            f"the bridge was asked to run on the JAX platform {platform!r}, which is not available here "
            f"({error}); JAX's platform here is {jax.default_backend()!r}: pass --device auto (or "
            f"BRIDGE_DEVICE=auto), or install the JAX build for {platform!r} (see the README's install section)"
        ) from None


def backend_devices():
    """The JAX devices that bridge device ordinals 0..N-1 stand for."""
    return backend_devices_of(settings.platform or jax.default_backend())


# In a run of several processes (torch.distributed), each process owns one device: the one of
# its local rank, as `torch.cuda.set_device(local_rank)` makes it in torch. Ordinals still
# count the host's devices (`device_count()` is the number of processes on this host).
_process_device: list = [None]  # (local rank, local size) once joined


def own_one_device(local_rank, local_size):
    _process_device[0] = (local_rank, local_size)
    _deferred_checks[0] = 0
    _current[0] = local_rank


def device_count():
    if _process_device[0] is not None:
        return _process_device[0][1]
    if _deferred_checks[0]:
        return _deferred_checks[0]
    return len(backend_devices())


def jax_device(index):
    if _process_device[0] is not None:
        return _process_jax_device(index)
    devices = backend_devices()
    if not 0 <= index < len(devices):
        raise DeviceError(
            f"device ordinal {index} was requested, but the JAX backend "
            f"{devices[0].platform!r} has {len(devices)} device(s) (ordinals 0..{len(devices) - 1}); "
            f"use one of those, or check CUDA_VISIBLE_DEVICES"
        )
    return devices[index]


@functools.lru_cache(maxsize=None)
def torch_device(index):
    """The torch.device a script sees for bridge ordinal `index` (cached: it is returned on every `.device`)."""
    return torch.device(settings.device_type, index)


def bridge_index(device):
    """The bridge ordinal a torch device argument names, or None if it names no bridge device.

    Accepts what torch accepts: torch.device, 'cuda', 'cuda:1', and bare integers
    (which mean cuda:N in torch).
    """
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if isinstance(device, str):
        if not device.startswith(settings.device_type):
            return None
        device = torch.device(device)
    if isinstance(device, torch.device) and device.type == settings.device_type:
        return current_index() if device.index is None else device.index
    return None


_current = [0]


def current_index():
    return _current[0]


def set_current_index(index):
    if not _deferred_checks[0]:
        jax_device(index)  # validates the ordinal
    _current[0] = index


# A process started by torch.multiprocessing.spawn under the bridge calls set_device(rank) before
# init_process_group: JAX must not start its devices yet (the processes join first), so the
# ordinal is checked when they have joined. Holds the host's device count meanwhile.
_deferred_checks = [0]


def defer_checks(host_device_count):
    _deferred_checks[0] = host_device_count


def first_device():
    """The device of programs that are on no tensor's device (the RNG key): ordinal 0's, or in a
    run of several processes, this process's own."""
    if _process_device[0] is not None:
        return jax.local_devices(backend=settings.platform)[0]
    return jax_device(0)


def _process_jax_device(index):
    local_rank, local_size = _process_device[0]
    if index != local_rank:
        raise DeviceError(
            f"device ordinal {index} was requested in the process of local rank {local_rank}; in a "
            f"run of several processes each drives one device, that of its local rank "
            f"(cuda:{local_rank} here; {local_size} process(es) on this host). Use "
            f"torch.device('cuda', local_rank), as torch.cuda.set_device(local_rank) sets it"
        )
    return jax.local_devices(backend=settings.platform)[0]


def put(array, index):
    """A host (numpy) array copied to bridge device `index`.

    jax.device_put spends ~100 us of Python on a small array before its C++ transfer (~20 us on
    a 2-core CPU), which an eager op run on the host pays on every call; JAX's own C++ transfer is
    called directly where this JAX has it, as jax.device_put calls it, else jax.device_put. In a
    trace, jax.device_put: there it stages the transfer into the program."""
    device = jax_device(index)
    if _transfer[0] is not None and type(array) is np.ndarray and not settings.tracing:
        try:
            return _transfer[0](_ShapedArray(array.shape, array.dtype), _sharding(device), [array], [device], True)
        except Exception:  # another JAX's signature: from now on, the public call
            _transfer[0] = None
    return jax.device_put(array, device)


@functools.lru_cache(maxsize=None)
def _sharding(device):
    return jax.sharding.SingleDeviceSharding(device)


try:
    from jax._src.core import ShapedArray as _ShapedArray
    from jax._src.lib import xla_client as _xla_client

    _transfer = [_xla_client.batched_device_put]
except (ImportError, AttributeError):
    _transfer = [None]
