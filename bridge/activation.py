"""Activation and deactivation: settings, the mapping tables, and the patch surfaces."""

import importlib

import jax

from runtime import random, stats
from runtime.config import settings
from runtime.errors import ActivationError

# The patch surfaces, applied in this order and undone in reverse.
SURFACES = (
    "bridge.patches.devices",
    "bridge.patches.random",
    "bridge.patches.optim",
    "bridge.patches.serialization",
    "bridge.patches.amp",
)

_PLATFORMS = {"auto": None, "cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}

_state = {"active": False, "patches": []}


def is_active():
    return _state["active"]


def activate(device="auto", strict=False, check_signatures=True):
    """Route torch's 'cuda' device to JAX. Idempotent: a second call changes nothing.

    device: the JAX platform 'cuda' stands for: 'auto' (JAX's default backend),
        'cpu', 'gpu' or 'tpu'.
    strict: make every CPU fallback an error naming the op and the calling line.
    check_signatures: compare each mapping with torch's meta kernels the first
        time a signature is seen.
    """
    if _state["active"]:
        return
    if device not in _PLATFORMS:
        raise ActivationError(f"device={device!r} is not one of {sorted(_PLATFORMS)}")
    # torch's int64 and float64 are real; JAX truncates them to 32 bits without this.
    jax.config.update("jax_enable_x64", True)
    import op_mappings  # noqa: F401  (registers the tables)
    import torch

    settings.platform = _PLATFORMS[device]
    settings.strict = strict
    settings.check_signatures = check_signatures
    random.seed(torch.initial_seed())
    patches = []
    try:
        for surface in SURFACES:
            for patch in importlib.import_module(surface).PATCHES:
                patch.apply()
                patches.append(patch)
    except Exception:
        for patch in reversed(patches):
            patch.undo()
        raise
    _state["patches"] = patches
    _state["active"] = True
    stats.reset()


def deactivate():
    """Undo every patch, restoring torch's attributes exactly. Idempotent."""
    if not _state["active"]:
        return
    for patch in reversed(_state["patches"]):
        patch.undo()
    _state["patches"] = []
    _state["active"] = False
