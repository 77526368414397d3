"""torch functions whose C++ composite kernels the bridge cannot see into.

A bridge tensor reports the `cpu` device to torch's C++ (see docs/design.md,
"Measurements behind the choices"). Most composite kernels only call other ATen ops on their inputs,
which reach the bridge's tables; a few build a result of their own from `input.options()`
(`at::zeros(..., input.options())` for an empty matrix), and that result is a plain host
tensor. The functions here put such results on the device of their bridge inputs,
`tensor_split` reads the split points of a bridge tensor as torch reads a host one, and
`one_hot` (whose kernel compares its input with a host `arange`) runs the bridge's entry.
"""

import torch
import torch.nn.utils.rnn
from torch.utils import _pytree as pytree

from bridge.runtime.config import settings
from bridge.runtime.dispatch import dispatch
from bridge.runtime.tensor import BridgeTensor, to_bridge_autograd

from . import Patch

# Functions observed to return host tensors for bridge inputs (empty matrices): the test
# `test_linalg_results_stay_on_the_bridge` runs every torch.linalg function on empty inputs,
# so a composite missing here shows up there.
_RESULTS_FROM_OPTIONS = ("norm", "matrix_norm", "matrix_rank", "cond")


def _bridge_index(args, kwargs):
    for value in pytree.tree_leaves((args, kwargs)):
        if isinstance(value, BridgeTensor):
            return value._index
    return None


def _results_with_inputs(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if kwargs.get("out") is not None:
        return result
    index = _bridge_index(args, kwargs)
    if index is None:
        return result
    return pytree.tree_map_only(
        torch.Tensor, lambda value: value if isinstance(value, BridgeTensor) else to_bridge_autograd(value, index), result
    )


# Functions whose composite kernels mix host tensors they make from `input.options()` with their
# bridge inputs (`at::tensor(target_lengths, options)` in ctc_loss, a host `arange` or mask in
# quantile, matrix_rank and istft, the padded result of pad_packed_sequence): inside them, host tensors may meet bridge tensors (the
# two-device check of runtime/dispatch.py lets them). Found by the OpInfo and ModuleInfo
# sweeps, which run every entry with all its inputs on the bridge.
_MAKES_HOST_TENSORS = (
    (torch, "quantile"), (torch.Tensor, "quantile"), (torch, "nanquantile"), (torch.Tensor, "nanquantile"),
    (torch.linalg, "matrix_rank"), (torch, "istft"), (torch.Tensor, "istft"),
    (torch.nn.functional, "ctc_loss"), (torch, "ctc_loss"),
    # _pad_packed_sequence's padded result is made from the packed data's options
    (torch.nn.utils.rnn, "pad_packed_sequence"),
    # the math form (taken with dropout, as in training) builds its causal mask from the query's
    # options (HF GPT-2 under Trainer's defaults)
    (torch.nn.functional, "scaled_dot_product_attention"),
)


def _host_tensors_join(wrapped, instance, args, kwargs):
    settings.in_host_making_composite += 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        settings.in_host_making_composite -= 1


def _split_points(value):
    # torch reads a host tensor's split points in C++; a bridge tensor's are read here.
    if isinstance(value, BridgeTensor):
        if value.dim() > 1 or value.dtype != torch.long:
            raise RuntimeError(
                "tensor_split expected tensor_indices_or_sections to have a long dtype and be a 0-d or "
                f"1-d tensor, got a {value.dim()}-d tensor of {value.dtype}"
            )
        return value.item() if value.dim() == 0 else value.tolist()
    return value


def _read_split_points(position):
    """A wrapper of tensor_split whose split points are argument `position` (or a keyword)."""

    def wrapper(wrapped, instance, args, kwargs):
        if len(args) > position:
            args = args[:position] + (_split_points(args[position]),) + args[position + 1 :]
        kwargs = {name: _split_points(value) if name != "dim" else value for name, value in kwargs.items()}
        return wrapped(*args, **kwargs)

    return wrapper


def _one_hot(wrapped, instance, args, kwargs):
    def parse(tensor, num_classes=-1):
        return tensor, num_classes

    tensor, num_classes = parse(*args, **kwargs)
    if type(tensor) is not BridgeTensor:
        return wrapped(*args, **kwargs)
    if tensor.dtype != torch.long:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if num_classes == -1:
        # torch reads the largest class on the host too (a sync point)
        if not tensor.numel():
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        num_classes = int(tensor.max()) + 1
    return dispatch(torch.ops.aten.one_hot.default, (tensor, num_classes), {})


PATCHES = [
    Patch(torch, "tensor_split", wrapper=_read_split_points(1)),
    Patch(torch.Tensor, "tensor_split", wrapper=_read_split_points(0)),
    Patch(torch.nn.functional, "one_hot", wrapper=_one_hot),
    Patch(torch._C._nn, "one_hot", wrapper=_one_hot),
] + [
    Patch(owner, name, wrapper=_host_tensors_join) for owner, name in _MAKES_HOST_TENSORS
] + [
    Patch(torch.linalg, name, wrapper=_results_with_inputs) for name in _RESULTS_FROM_OPTIONS
]
