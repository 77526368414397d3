"""Mixed precision: `torch.autocast("cuda")` applies to bridge tensors.

Bridge tensors are CPU tensors to torch's dispatcher, so the autocast that
reaches them is torch's CPU autocast: an autocast region for 'cuda' becomes
one for 'cpu' with the dtype the script asked for (float16 when it named
none, as CUDA's default is). The queries scripts make about 'cuda' autocast
answer for it.
"""

import torch
import torch.amp.autocast_mode as autocast_mode

from bridge.runtime.config import settings

from . import collect, wrap


def _cuda_to_cpu(device_type):
    return "cpu" if device_type == settings.device_type else device_type


@wrap(autocast_mode.autocast, "__init__")
def autocast_init(wrapped, instance, args, kwargs):
    args = list(args)
    if args:
        device_type = args[0]
        args[0] = _cuda_to_cpu(device_type)
    else:
        device_type = kwargs.get("device_type")
        kwargs["device_type"] = _cuda_to_cpu(device_type)
    if device_type == settings.device_type and len(args) < 2 and kwargs.get("dtype") is None:
        kwargs["dtype"] = torch.float16
    return wrapped(*args, **kwargs)


def _device_query(wrapped, instance, args, kwargs):
    if args and args[0] == settings.device_type:
        args = ("cpu",) + tuple(args[1:])
    return wrapped(*args, **kwargs)


@wrap(torch, "is_autocast_enabled")
def is_autocast_enabled(wrapped, instance, args, kwargs):
    return _device_query(wrapped, instance, args, kwargs)


@wrap(torch, "get_autocast_dtype")
def get_autocast_dtype(wrapped, instance, args, kwargs):
    return _device_query(wrapped, instance, args, kwargs)


@wrap(torch.amp, "is_autocast_available")
def is_autocast_available(wrapped, instance, args, kwargs):
    return _device_query(wrapped, instance, args, kwargs)


PATCHES = collect(dict(globals()))
