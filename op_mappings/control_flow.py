"""torch's higher-order control flow on bridge tensors: `torch.cond` as `jax.lax.cond` and
functorch's `map` as `jax.lax.map`, each branch or body traced through the tables.

These are not ATen ops: a higher-order op looks for a rule for the tensor subclass it meets
(`HigherOrderOperator.py_impl(BridgeTensor)`), registered here. A branch is a torch callable (a
graph module in an exported program); it runs on bridge tensors holding the branch's JAX
tracers, so its ATen calls take the same plans as anywhere else.
"""

import jax
import torch
from torch.utils import _pytree as pytree

from bridge.runtime import symbolic
from bridge.runtime.tensor import BridgeTensor, read_value, to_bridge

try:  # (present in every supported torch; guarded so that a move of them does not stop the tables)
    from torch._higher_order_ops.cond import cond_op
    from torch._higher_order_ops.map import map_impl
except ImportError:  # pragma: no cover
    cond_op = map_impl = None


def _arrays(values):
    """The arrays of the operands: a host tensor (a constant the graph closed over) is copied."""
    return [
        read_value(value if isinstance(value, BridgeTensor) else to_bridge(value)) if isinstance(value, torch.Tensor) else value
        for value in values
    ]


def _traced(function, index):
    """`function` (torch tensors in and out) as a function of arrays."""

    def run(*arrays):
        out = function(*[BridgeTensor(array, index) for array in arrays])
        return pytree.tree_map(lambda leaf: read_value(leaf) if isinstance(leaf, BridgeTensor) else leaf, out)

    return run


def _wrapped(out, index):
    return pytree.tree_map(lambda leaf: BridgeTensor(leaf, index) if isinstance(leaf, jax.Array) else leaf, out)


def _index(values):
    return next((value._index for value in values if isinstance(value, BridgeTensor)), 0)


def cond(pred, true_fn, false_fn, operands):
    index = _index([pred, *operands])
    # (a SymBool, a test of a jax.export trace's dimensions: its value computed from them)
    predicate = read_value(pred) if isinstance(pred, BridgeTensor) else symbolic.jax_value(pred)
    arrays = _arrays(operands)
    out = jax.lax.cond(predicate, _traced(true_fn, index), _traced(false_fn, index), *arrays)
    return _wrapped(out, index)


def map_(function, xs, pos_args, **kwargs):
    index = _index([*xs, *pos_args])
    rows, extra = _arrays(xs), _arrays(pos_args)
    body = _traced(function, index)
    out = jax.lax.map(lambda row: body(*row, *extra), tuple(rows))
    return _wrapped(out, index)


if cond_op is not None:
    cond_op.py_impl(BridgeTensor)(cond)
    map_impl.py_impl(BridgeTensor)(map_)
