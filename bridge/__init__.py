"""bridge: run unmodified PyTorch programs on JAX/XLA.

    import bridge
    bridge.activate()            # or: with bridge.active(): ...
    ...torch code using "cuda"...
    bridge.deactivate()

`import bridge.auto` activates with defaults (environment variables
BRIDGE_DEVICE, BRIDGE_MODE, BRIDGE_STRICT, BRIDGE_REPORT, BRIDGE_QUIET override them);
`python -m bridge run script.py args...` runs a script under the bridge.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from bridge import _layers

_layers.install()  # before the first import of bridge.runtime

from bridge.runtime.errors import (  # noqa: E402,F401  (re-exported for users)
    ActivationError,
    BridgeError,
    BridgeWarning,
    CPUFallbackWarning,
    DataDependentShapeError,
    DeviceError,
    DistributedError,
    DistributedTimeoutError,
    GraphBreak,
    MappingDtypeWarning,
    MappingMismatchError,
    SavedModelError,
    SymbolicShapeError,
    TranslationError,
    UnsupportedOnnxOpError,
    UnsupportedOpError,
    UnsupportedOpsetError,
    UnsupportedVersionError,
)

from . import report  # noqa: E402,F401
from .activation import activate, deactivate, is_active, set_mode  # noqa: E402
from .loading import LoadedProgram, load  # noqa: E402
from .interop import from_jax, to_jax  # noqa: E402

__version__ = "0.1.0"


@contextlib.contextmanager
def active(**options: Any) -> Iterator[None]:
    """Activate for the body of a `with` block; a no-op if the bridge is already active."""
    already = is_active()
    if not already:
        activate(**options)
    try:
        yield
    finally:
        if not already:
            deactivate()


__all__ = [
    "activate",
    "deactivate",
    "active",
    "is_active",
    "set_mode",
    "load",
    "LoadedProgram",
    "to_jax",
    "from_jax",
    "BridgeError",
    "UnsupportedOpError",
    "MappingMismatchError",
    "DeviceError",
    "DistributedError",
    "DistributedTimeoutError",
    "SavedModelError",
    "TranslationError",
    "UnsupportedOnnxOpError",
    "UnsupportedOpsetError",
    "DataDependentShapeError",
    "SymbolicShapeError",
    "GraphBreak",
    "ActivationError",
    "UnsupportedVersionError",
    "BridgeWarning",
    "CPUFallbackWarning",
    "MappingDtypeWarning",
]
