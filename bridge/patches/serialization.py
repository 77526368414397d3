"""Serialization: `torch.load` onto the bridge device.

`torch.save` needs no patch: bridge tensors pickle as ordinary CPU tensors
(`BridgeTensor.__reduce_ex__`), so checkpoints load without the bridge.
`torch.load` keeps torch's own unpickler and `weights_only` checks; only where
the tensors land changes: storages meant for 'cuda' (by `map_location`, or by
the location recorded in a checkpoint written on a GPU machine) are restored
on the CPU and the tensors built on them are moved to the bridge device.
"""

import torch

from bridge.runtime import devices
from bridge.runtime.tensor import to_bridge

from . import collect, wrap


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
    moved = {}  # storage data pointer -> bridge ordinal

    def restore(storage, location):
        target = location
        if isinstance(map_location, dict):
            target = map_location.get(location, location)
        elif map_location is not None:
            target = map_location
        index = everything_to if everything_to is not None else devices.bridge_index(target)
        if index is None:
            return None if isinstance(target, str) and target.startswith("cpu") else _torch_default(storage, target)
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
