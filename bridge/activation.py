"""Activation and deactivation: settings, the mapping tables, and the patch surfaces."""

import importlib
import os

import jax

from bridge import whole_module
from bridge.runtime import capture, deferred, devices, random, stats, versions
from bridge.runtime.config import settings
from bridge.runtime.errors import ActivationError

# The patch surfaces, applied in this order and undone in reverse.
SURFACES = (
    "bridge.patches.devices",
    "bridge.patches.random",
    "bridge.patches.optim",
    "bridge.patches.serialization",
    "bridge.patches.amp",
    "bridge.patches.capture",
    "bridge.patches.composites",
    "bridge.patches.errors",
    "bridge.patches.distributed",
    "bridge.patches.hf_generate",
    "bridge.patches.hf_experts",
)

_PLATFORMS = {"auto": None, "cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}

_state: dict = {"active": False, "patches": []}


def is_active() -> bool:
    return bool(_state["active"])


MODES = ("captured", "eager")
RESIDUALS = ("matmuls", "all", "recompute")  # settings.residuals (runtime/config.py)


def activate(device: str = "auto", strict: bool = False, check_signatures: bool = True, mode: str | None = None) -> None:
    """Route torch's 'cuda' device to JAX. Idempotent: a second call changes nothing.

    device: the JAX platform 'cuda' stands for: 'auto' (JAX's default backend),
        'cpu', 'gpu' or 'tpu'.
    strict: make every CPU fallback an error naming the op and the calling line.
    check_signatures: compare each mapping with torch's meta kernels the first
        time a signature is seen.
    mode: 'captured' (module calls, backward, gradient clipping and optimizer
        steps run as compiled programs) or 'eager' (op by op); default
        $BRIDGE_MODE, else 'captured'. `set_mode` changes it later.
    """
    if _state["active"]:
        return
    versions.check_supported()
    if device not in _PLATFORMS:
        raise ActivationError(f"device={device!r} is not one of {sorted(_PLATFORMS)}")
    mode = mode or os.environ.get("BRIDGE_MODE") or "captured"
    if mode not in MODES:
        raise ActivationError(f"mode={mode!r} (or BRIDGE_MODE) is not one of {list(MODES)}")
    if settings.residuals not in RESIDUALS:
        raise ActivationError(f"BRIDGE_RESIDUALS={settings.residuals!r} is not one of {list(RESIDUALS)}")
    # torch's int64 and float64 are real; JAX truncates them to 32 bits without this.
    jax.config.update("jax_enable_x64", True)
    _configure_xla()
    _use_compilation_cache()
    import bridge.op_mappings  # noqa: F401  (registers the tables)
    import torch

    from bridge.patches import distributed

    distributed.join_launched_processes(_PLATFORMS[device])  # before JAX starts its devices
    if _PLATFORMS[device] is not None:
        # Found now, not at the script's first use of the device (after torch.cuda.is_available()
        # had said True): a platform JAX does not have here raises DeviceError naming it.
        devices.backend_devices_of(_PLATFORMS[device])
    settings.platform = _PLATFORMS[device]
    settings.mode = mode
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
    _state["options"] = {"device": device, "strict": strict, "check_signatures": check_signatures, "mode": mode}
    stats.reset()
    capture.reset()
    whole_module.reset()


def _configure_xla():
    """XLA options for torch-shaped programs, set before JAX starts its backends.

    XLA's GPU backend records runs of a program's kernels as CUDA graphs (command buffers). The
    bridge keeps them for fusions and cuDNN calls only (`FUSION,CUDNN`): without graphs the host
    left ResNet-50's GPU waiting, and with cuBLAS calls in graphs GPT-2 float32's step was slower
    (docs/design.md, "Measurements behind the choices"). BRIDGE_COMMAND_BUFFERS=0 turns them
    off, =1 keeps XLA's own set; an XLA_FLAGS that names the option is left as it is.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    choice = os.environ.get("BRIDGE_COMMAND_BUFFERS")
    if choice == "1" or "xla_gpu_enable_command_buffer" in flags:
        return
    kinds = "" if choice == "0" else "FUSION,CUDNN"
    os.environ["XLA_FLAGS"] = (flags + f" --xla_gpu_enable_command_buffer={kinds}").strip()


def _use_compilation_cache():
    """Keep compiled XLA programs on disk, so a script's second run skips compiling.

    BRIDGE_CACHE_DIR chooses the folder (default ~/.cache/bridge/xla); BRIDGE_CACHE_DIR=0
    turns it off. A cache the script or JAX already configured is left as it is.
    """
    folder = os.environ.get("BRIDGE_CACHE_DIR")
    if folder == "0" or jax.config.jax_compilation_cache_dir:
        return
    if folder is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "bridge", "xla")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return  # a read-only home: run without the cache
    jax.config.update("jax_compilation_cache_dir", folder)
    # Eager entries compile in milliseconds each; cache them all.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def activation_options() -> dict:
    """The arguments the bridge was activated with (a process the script starts activates the same way)."""
    options = dict(_state.get("options") or {})
    if options:
        options["mode"] = settings.mode
    return options


def set_mode(mode: str) -> str:
    """Switch between 'captured' and 'eager' execution (active or not); returns the previous mode."""
    if mode not in MODES:
        raise ActivationError(f"mode={mode!r} is not one of {list(MODES)}")
    previous, settings.mode = settings.mode, mode
    return previous


def deactivate() -> None:
    """Undo every patch, restoring torch's attributes exactly. Idempotent."""
    if not _state["active"]:
        return
    deferred.flush()  # in-place updates waiting to run together (runtime/deferred.py)
    for patch in reversed(_state["patches"]):
        patch.undo()
    _state["patches"] = []
    _state["active"] = False
