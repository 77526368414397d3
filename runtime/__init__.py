"""The JAX side of the bridge: the bridge tensor, dispatch into the mapping tables, and the
dtype, device, RNG and view models."""

from . import dispatch, tensor  # noqa: F401  (dispatch wires itself into BridgeTensor)
from .tensor import BridgeTensor, to_bridge, to_torch  # noqa: F401
