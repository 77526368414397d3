"""Index bounds. torch refuses an index out of range (`IndexError: index out of range in self`
from an embedding, `Target 7 is out of bounds.` from a loss); JAX's gathers clamp it or fill in
NaN, so a vocabulary smaller than the token ids, or a label past the classes, would train on
without a word. Checked here where the index's values are on the host without a wait:

- eager ops: an index tensor whose value the host holds (a factory's, a `.to(device)` of a CPU
  tensor: runtime.tensor.host_array) or a plain CPU tensor (indexing takes those);
- captured regions: an index that is one of the region's input tensors, or a view of one with
  all its elements (nanoGPT's `targets.view(-1)`); the trace records the check (`_Trace.bound`
  in runtime/capture.py) and each call makes it on the input's host value before the program
  runs (capture's `run`).

An index computed on the device (an argmax, a slice of a larger tensor) is not checked: reading
it would wait for the device.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch._prims_common import canonicalize_dim

from .callsite import user_call_site
from .config import settings
from .tensor import BridgeTensor, host_array, root_of

aten = torch.ops.aten


@dataclass(frozen=True)
class Check:
    """One index's bounds: its values must lie in [0, size), or [-size, size) where `negative`,
    except `ignore` (a loss's ignore_index)."""

    size: int
    negative: bool = False
    ignore: Optional[int] = None
    error: type = IndexError
    message: str = "index out of range in self"  # torch's, formatted with value, dim and size
    dim: int = 0

    def first_outside(self, array):
        """The first value of `array` (numpy) out of bounds, or None."""
        if array.size == 0 or array.dtype.kind not in "iu":
            return None
        low = -self.size if self.negative else 0
        if array.min() >= low and array.max() < self.size:
            return None  # (two reductions: cheaper than the mask below on the usual, good, index)
        bad = (array < low) | (array >= self.size)
        if self.ignore is not None:
            bad &= array != self.ignore
        if not bad.any():
            return None
        return int(array[bad].flat[0])


def _along(self, dim):
    """(dim made non-negative, the size the index addresses along it; a 0-dim tensor's is 1)."""
    dim = canonicalize_dim(self.dim(), dim)
    return dim, self.shape[dim] if self.dim() else 1


def _embedding(args, kwargs):
    weight, indices = args[0], args[1]
    return [(indices, Check(weight.shape[0]))]


def _index_select(args, kwargs):
    dim, size = _along(args[0], args[1])
    return [(args[2], Check(size, error=RuntimeError, message="INDICES element is out of DATA bounds, id={value} axis_dim={size}"))]


def _gather(args, kwargs):
    dim, size = _along(args[0], args[1])
    return [(args[2], Check(size, error=RuntimeError, message="index {value} is out of bounds for dimension {dim} with size {size}", dim=dim))]


def _nll_loss(args, kwargs):
    self, target = args[0], args[1]
    ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    classes = self.shape[0] if self.dim() == 1 else self.shape[1]
    return [(target, Check(classes, ignore=ignore, message="Target {value} is out of bounds."))]


def _index(args, kwargs):
    self, indices = args[0], args[1]
    found = []
    for dim, index in enumerate(indices):
        if index is None:
            continue
        if index.dtype in (torch.bool, torch.uint8) or dim >= self.dim():
            break  # a mask spans dimensions of its own: the positions after it are not these
        message = "index {value} is out of bounds for dimension {dim} with size {size}"
        found.append((index, Check(self.shape[dim], negative=True, message=message, dim=dim)))
    return found


# op -> its spec: (args, kwargs) -> [(index tensor, Check)]. runtime/dispatch.py keeps each op's
# spec beside its statistics, found by the op's id.
SPECS = {
    aten.embedding.default: _embedding,
    aten.index_select.default: _index_select,
    aten.gather.default: _gather,
    aten.nll_loss_forward.default: _nll_loss,
    aten.nll_loss2d_forward.default: _nll_loss,
    aten.index.Tensor: _index,
}

# Set by runtime/capture.py while a region's body is traced: record(index tensor, Check, op).
record_hook = None


def check(func, spec, args, kwargs):
    """Raise torch's error where an index of this call is out of range and its values are on
    the host (see the module's docstring); in a region's trace, hand the check to the trace."""
    for index, bound in spec(args, kwargs):
        if settings.tracing:
            if record_hook is not None and type(index) is BridgeTensor:
                record_hook(index, bound, func)
            continue
        if type(index) is BridgeTensor:
            array = host_array(index)
        elif isinstance(index, torch.Tensor) and index.device.type == "cpu" and not index.is_meta:
            array = index.numpy() if not index.requires_grad else None
        else:
            array = None
        if array is not None:
            raise_outside(bound, array, func)


def where(func):
    """The op and the user's line that called it, as an error names them."""
    return f"{func}, called at {user_call_site()}"


def raise_outside(bound, array, place):
    """Raise `bound`'s error if a value of `array` (numpy) is out of range. `place`: the op
    (its call site is the current one) or where() of an earlier call."""
    value = bound.first_outside(np.asarray(array))
    if value is not None:
        text = bound.message.format(value=value, size=bound.size, dim=bound.dim)
        place = place if isinstance(place, str) else where(place)
        raise bound.error(f"{text} (the bridge's check of {place}: the indices must lie within the indexed tensor's size)")


def input_of(index, positions):
    """The position of the region input that `index` is, or is a view of with all its elements,
    while the region has not written it (`labels[labels == -1] = -100` before the loss: the
    input's host value is then not what the op reads); None otherwise. `positions`: id of each
    input tensor -> its position."""
    root = root_of(index)
    position = positions.get(id(root))
    if position is None or root._generation != 0:
        return None
    return position if root is index or index.numel() == root.numel() else None

