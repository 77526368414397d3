"""Grouping helpers torch's optimizers and clip_grad_norm_ use.

torch groups tensors by their C++ device, which is 'cpu' for bridge tensors;
the groups' device keys are rewritten to the device the script sees, so that
`x.to(device)` inside those helpers stays on the bridge instead of copying to
the host.
"""

import importlib

from bridge.runtime.tensor import BridgeTensor

from . import Patch


def group_tensors_by_device_and_dtype(wrapped, instance, args, kwargs):
    grouped = wrapped(*args, **kwargs)
    renamed = {}
    for (device, dtype), (tensor_lists, indices) in grouped.items():
        first = next((tensor for tensors in tensor_lists for tensor in tensors if tensor is not None), None)
        if isinstance(first, BridgeTensor):
            device = first.device
        renamed[(device, dtype)] = (tensor_lists, indices)
    return renamed


# Each module imported the helper by name, so each binding is patched.
PATCHES = [
    Patch(module, "_group_tensors_by_device_and_dtype", wrapper=group_tensors_by_device_and_dtype)
    for module in map(
        importlib.import_module,
        ("torch.utils._foreach_utils", "torch.optim.optimizer", "torch.nn.utils.clip_grad", "torch.optim.swa_utils"),
    )
]
