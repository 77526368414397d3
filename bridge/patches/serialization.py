"""Serialization: `torch.load` onto the bridge device.

Bridge tensors pickle as ordinary CPU tensors (`BridgeTensor.__reduce_ex__`), so
checkpoints load without the bridge. `torch.save` of an object whose tensors all
live on the bridge (a model moved to 'cuda', its state_dict)
also records the device in one extra entry of the archive, which torch ignores:
loaded under the bridge without a `map_location`, those tensors come back where
the script saved them, as torch's own checkpoint of a GPU model does.

`torch.load` keeps torch's own unpickler and `weights_only` checks; only where
the tensors land changes: storages meant for 'cuda' (by `map_location`, by the
location recorded in a checkpoint written on a GPU machine, or by the bridge's
entry) are restored on the CPU and the tensors built on them are moved to the
bridge device.
"""

import io
import os
import zipfile

import torch
import wrapt

from bridge.runtime import devices
from bridge.runtime import tensor as tensor_module
from bridge.runtime.tensor import to_bridge

from . import collect, wrap

# The archive entry naming the bridge device of a checkpoint whose tensors were all on it.
DEVICE_RECORD = "bridge_device"


class _CountingWriter(wrapt.ObjectProxy):
    """torch's zip writer, counting the storages it writes."""

    def __init__(self, writer):
        super().__init__(writer)
        self._self_storages = 0

    def write_record(self, name, *args, **kwargs):
        if name.startswith("data/"):
            self._self_storages += 1
        return self.__wrapped__.write_record(name, *args, **kwargs)

    def write_record_metadata(self, name, *args, **kwargs):
        if name.startswith("data/"):
            self._self_storages += 1
        return self.__wrapped__.write_record_metadata(name, *args, **kwargs)


@wrap(torch.serialization, "_save")
def save(wrapped, instance, args, kwargs):
    obj, zip_file, *rest = args
    counting = _CountingWriter(zip_file)
    with tensor_module.counting_pickled_devices() as pickled:
        result = wrapped(obj, counting, *rest, **kwargs)
    if pickled and len(pickled) == counting._self_storages and len(set(pickled)) == 1:
        record = str(pickled[0]).encode()
        zip_file.write_record(DEVICE_RECORD, record, len(record))
    return result


def _saved_device(source):
    """The bridge ordinal a checkpoint written under the bridge recorded, or None."""
    try:
        if isinstance(source, (str, os.PathLike)):
            with zipfile.ZipFile(source) as archive:
                return _device_entry(archive)
        if hasattr(source, "seek") and hasattr(source, "tell"):
            position = source.tell()
            try:
                with zipfile.ZipFile(source) as archive:
                    return _device_entry(archive)
            finally:
                source.seek(position)
    except (zipfile.BadZipFile, OSError, ValueError, io.UnsupportedOperation):
        return None
    return None


def _device_entry(archive):
    for name in archive.namelist():
        if name.rsplit("/", 1)[-1] == DEVICE_RECORD:
            return int(archive.read(name).decode())
    return None


def _bridge_target(map_location):
    """The bridge ordinal `map_location` sends everything to, or None."""
    if map_location is None or callable(map_location) or isinstance(map_location, dict):
        return None
    return devices.bridge_index(map_location)


@wrap(torch, "load")
def load(wrapped, instance, args, kwargs):
    args = list(args)
    if len(args) > 1:
        map_location = args.pop(1)
    else:
        map_location = kwargs.pop("map_location", None)
    if callable(map_location) and not isinstance(map_location, torch.device):
        return wrapped(*args, map_location=map_location, **kwargs)
    everything_to = _bridge_target(map_location)
    if map_location is None and args:
        everything_to = _saved_device(args[0])
    moved = {}  # storage data pointer -> bridge ordinal

    def restore(storage, location):
        target = location
        if isinstance(map_location, dict):
            target = map_location.get(location, location)
        elif map_location is not None:
            target = map_location
        index = everything_to if everything_to is not None else devices.bridge_index(target)
        if index is None:
            # The storage is read onto the CPU first; a None would send it to the location it
            # was saved from (a checkpoint written on a GPU machine: 'cuda:0').
            return storage if str(target).startswith("cpu") else _torch_default(storage, target)
        moved[storage.data_ptr()] = index
        return storage

    result = wrapped(*args, map_location=restore, **kwargs)
    return _to_bridge_tree(result, moved) if moved else result


def _torch_default(storage, location):
    # Non-bridge, non-CPU targets: let torch restore them its own way.
    return torch.serialization.default_restore_location(storage, str(location))


def _convert(tensor, moved):
    if tensor.device.type != "cpu" or not tensor.untyped_storage().size():
        return tensor
    index = moved.get(tensor.untyped_storage().data_ptr())
    if index is None:
        return tensor
    converted = to_bridge(tensor.detach(), index)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(converted, requires_grad=tensor.requires_grad)
    if tensor.requires_grad:
        converted.requires_grad_(True)
    return converted


def _to_bridge_tree(value, moved):
    if isinstance(value, torch.Tensor):
        return _convert(value, moved)
    if isinstance(value, torch.nn.Module):
        return value._apply(lambda tensor: _convert(tensor, moved))
    if isinstance(value, dict):
        converted = type(value)() if type(value) is not dict else {}
        for key, item in value.items():
            converted[key] = _to_bridge_tree(item, moved)
        if hasattr(value, "_metadata"):  # state_dict's version metadata
            converted._metadata = value._metadata
        return converted
    if isinstance(value, list):
        return [_to_bridge_tree(item, moved) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_to_bridge_tree(item, moved) for item in value)
    return value


PATCHES = collect(dict(globals()))
