"""Exceptions the bridge raises for the person running a script.

Every message says which torch call failed, where in the user's script, why,
and what to do about it. One class per kind of failure, all under BridgeError.
"""


class BridgeError(RuntimeError):
    """Base class of every error the bridge raises on purpose."""


class UnsupportedOpError(BridgeError):
    """A torch operator has no mapping and no decomposition, and --strict forbids the CPU fallback."""


class MappingMismatchError(BridgeError):
    """A mapping's result disagrees with torch's own shape/dtype inference (a bug in a table entry)."""


class DeviceError(BridgeError):
    """A script asked for a device the JAX backend does not have."""


class ActivationError(BridgeError):
    """The bridge was activated in a way it cannot honour."""


class UnsupportedVersionError(ActivationError):
    """The installed torch or JAX is outside the releases the bridge supports."""


class GraphBreak(BridgeError):
    """A region could not be captured; `reason` says why, `site` where in the user's code. Raised
    to the script only under `fullgraph=True`; otherwise the region runs op by op and the report
    lists the break."""

    def __init__(self, reason, site=None):
        super().__init__(reason if site is None else f"{reason} (at {site})")
        self.reason = reason
        self.site = site


class DistributedError(BridgeError):
    """torch.distributed cannot run as the script asks (joining the processes, a collective's
    arguments, an unsupported feature)."""


class DistributedTimeoutError(DistributedError):
    """A collective's peers did not all arrive within the process group's timeout."""


class SavedModelError(BridgeError):
    """A saved model cannot be read: the file does not exist, is truncated or corrupt, or is not
    the kind of file its name says."""


class TranslationError(BridgeError):
    """A node of a whole graph (a TorchScript graph) has no translation to the bridge: the
    message names the file, the node and its source line."""


class UnsupportedOnnxOpError(UnsupportedOpError):
    """A node of an ONNX model has an op with no entry in the bridge's ONNX table and no function
    definition in the ONNX standard: the message names the file, the node and its op."""


class UnsupportedOpsetError(BridgeError):
    """An ONNX model uses an ai.onnx opset outside those the bridge's ONNX table serves."""


class DataDependentShapeError(BridgeError):
    """A whole graph needs a value while it is traced (a shape, axes) that is computed from its
    inputs on the device: XLA fixes shapes before the program runs."""


class SymbolicShapeError(BridgeError):
    """A dynamic dimension of a whole graph cannot stay symbolic under `jax.export`: an op needs
    it as a number. The message names the graph's node, its op and the dimension."""


class BridgeWarning(UserWarning):
    """Base class of the bridge's warnings."""


class CPUFallbackWarning(BridgeWarning):
    """An op ran with eager torch on the host CPU because it has no mapping."""


class MappingDtypeWarning(BridgeWarning):
    """A mapping returned a dtype other than torch's; the result was cast to torch's."""


# Users meet these as bridge.<Name> (tracebacks print the module).
for _error in (BridgeError, UnsupportedOpError, MappingMismatchError, DeviceError, ActivationError,
               UnsupportedVersionError, GraphBreak, SavedModelError, TranslationError,
               UnsupportedOnnxOpError, UnsupportedOpsetError, DataDependentShapeError, DistributedError, DistributedTimeoutError,
               BridgeWarning, CPUFallbackWarning, MappingDtypeWarning):
    _error.__module__ = "bridge"
