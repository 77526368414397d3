"""View bookkeeping: the steps of a view chain, and writes scattered back into a root."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import torch

from . import symbolic


def freeze(value):
    """A hashable form of a view op's argument (lists of sizes become tuples)."""
    if isinstance(value, list):
        return tuple(freeze(item) for item in value)
    if isinstance(value, torch.SymInt):  # a size of a symbolic trace (runtime/symbolic.py)
        return symbolic.jax_value(value)
    return value


class ViewStep:
    """One view op applied to the previous value in a chain: op(value, *args, **kwargs)[output]."""

    __slots__ = ("call", "op", "args", "kwargs", "output", "_hash")

    def __init__(self, mapping, args, kwargs, output):
        self.call = mapping.call
        self.op = mapping.op
        self.args = tuple(freeze(argument) for argument in args)
        self.kwargs = tuple(sorted((name, freeze(value)) for name, value in kwargs.items()))
        self.output = output
        self._hash = None  # made when first asked: most steps are never hashed

    def __call__(self, value):
        result = self.call(value, *self.args, **dict(self.kwargs))
        return result if self.output is None else result[self.output]

    def __hash__(self):
        if self._hash is None:
            self._hash = hash((self.op, self.args, self.kwargs, self.output))
        return self._hash

    def __eq__(self, other):
        return (
            isinstance(other, ViewStep)
            and (self.op, self.args, self.kwargs, self.output) == (other.op, other.args, other.kwargs, other.output)
        )

    def __repr__(self):
        return f"ViewStep({self.op}, {self.args}, {self.kwargs}, {self.output})"


def selects_distinct(tensor) -> bool:
    """Whether a view's elements are distinct elements of its root (no broadcast repeats one),
    so that the view's gradient is its root's gradient cut by the same view."""
    root = tensor._root
    if root is None or not tensor._chain:
        return True
    if root.dtype.is_complex or any(step.op in _DTYPE_VIEWS for step in tensor._chain):
        return False
    found = layout(tuple(root.shape), tuple(tensor._chain))
    if found is None:
        positions = _index_map(tuple(root.shape), False, tuple(tensor._chain))
        return positions is None or len(np.unique(positions)) == positions.size
    _, shape, strides = found
    # torch's test of a layout whose elements do not overlap: by stride, each dimension steps past
    # all the elements the smaller ones span.
    spanned = 0
    for size, stride in sorted((pair for pair in zip(shape, strides) if pair[0] > 1), key=lambda pair: pair[1]):
        if stride <= spanned:
            return False
        spanned += (size - 1) * stride
    return True


@functools.lru_cache(maxsize=4096)
def layout(root_shape, chain):
    """A view of a contiguous real root as torch lays it out: (storage offset, sizes, strides) in
    the root's elements, found by replaying the chain's ops on a meta tensor (nothing the size of
    the root is made: FSDP's buffers hold billions of elements); None where a step does not
    replay so (a dtype or complex view, an op without a meta kernel)."""
    if any(step.op in _DTYPE_VIEWS or step.op in _COMPLEX_VIEWS for step in chain):
        return None
    try:
        value = torch.empty(root_shape, device="meta")
        for step in chain:
            value = step.op(value, *step.args, **dict(step.kwargs))
            if step.output is not None:
                value = value[step.output]
        return value.storage_offset(), tuple(value.shape), tuple(value.stride())
    except Exception:
        return None


def _contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=4096)
def _index_map(shape, complex_root, chain):
    """Where each element of the view sits in the root: flat positions (None when the view is
    the whole root in order).

    A complex root is addressed by its components: position 2k is element k's real part and
    2k + 1 its imaginary part, and a complex element's position is the complex number
    (real position) + i (imaginary position). So the views that change between complex and
    real (`real`, `imag`, `view_as_real`, `view_as_complex`) move positions the way they move
    values, and a write through `z.real` or `view_as_real(z)[..., 1]` lands on its components.
    """
    complex_steps = _by_components(complex_root, chain)
    with jax.ensure_compile_time_eval():
        size = int(np.prod(shape, dtype=np.int64))
        if complex_root:
            even = jnp.arange(0, 2 * size, 2, dtype=jnp.float64)
            positions = lax.complex(even, even + 1)
        else:
            positions = jnp.arange(size, dtype=jnp.float64 if complex_steps else jnp.int64)
        positions = positions.reshape(shape)
        for step in chain:
            positions = step(positions)
        positions = np.asarray(positions).reshape(-1)
    if not complex_steps:
        if positions.size == size and np.array_equal(positions, np.arange(size)):
            return None
        return positions
    if np.iscomplexobj(positions):  # a complex view: its components, interleaved
        positions = np.stack([positions.real, positions.imag], axis=-1).reshape(-1)
    return positions.astype(np.int64)


def first_position(root_shape, complex_root, chain):
    """Where a view's first element sits in its root, in the root's elements (in halves of them
    for a complex root, whose positions count components); 0 for an empty view. A view that
    reinterprets the bytes as another dtype (`view(torch.int16)`) has no positions this
    numbering can follow: its steps from there on are taken as starting where they begin."""
    for cut, step in enumerate(chain):
        if step.op in _DTYPE_VIEWS:
            chain = chain[:cut]
            break
    found = None if complex_root else layout(tuple(root_shape), tuple(chain))
    if found is not None:
        return found[0] if int(np.prod(found[1], dtype=np.int64)) else 0
    positions = _index_map(tuple(root_shape), complex_root, tuple(chain))
    if positions is None or positions.size == 0:
        return 0
    return int(positions[0])


_DTYPE_VIEWS = frozenset({torch.ops.aten.view.dtype, torch.ops.aten.view_copy.dtype})


_COMPLEX_VIEWS = frozenset({torch.ops.aten.view_as_complex.default, torch.ops.aten.view_as_complex_copy.default})


def _write_strided(root_value, found, value):
    """`value` written into the view laid out as `found` (layout's) in a real root: a whole root
    reshaped, a contiguous block updated in place of a slice, else a scatter to the view's
    positions (computed for the view's elements only)."""
    offset, shape, strides = found
    value = jnp.ravel(value.astype(root_value.dtype) if value.dtype != root_value.dtype else value)
    count = int(np.prod(shape, dtype=np.int64))
    dense = all(stride == expected for size, stride, expected in zip(shape, strides, _contiguous_strides(shape)) if size > 1)
    if dense and offset == 0 and count == root_value.size:
        return jnp.reshape(value, root_value.shape)
    flat = jnp.ravel(root_value)
    if dense:
        return lax.dynamic_update_slice(flat, value, (offset,)).reshape(root_value.shape)
    positions = np.full(shape, offset, dtype=np.int64)
    for dimension, (size, stride) in enumerate(zip(shape, strides)):
        steps = np.arange(size, dtype=np.int64) * stride
        positions = positions + steps.reshape((1,) * dimension + (size,) + (1,) * (len(shape) - dimension - 1))
    return flat.at[positions.reshape(-1)].set(value).reshape(root_value.shape)


def _by_components(complex_root, chain):
    """Whether positions address real components (a complex root, or a chain that makes one)."""
    return complex_root or any(step.op in _COMPLEX_VIEWS for step in chain)


def scatter_into_root(root_value, chain, value):
    """The root's new value after `value` is written into the view that `chain` makes of it."""
    complex_root = jnp.iscomplexobj(root_value)
    found = None if complex_root else layout(tuple(root_value.shape), tuple(chain))
    if found is not None:
        return _write_strided(root_value, found, value)
    positions = _index_map(tuple(root_value.shape), complex_root, chain)
    if not _by_components(complex_root, chain):
        if value.dtype != root_value.dtype:
            value = value.astype(root_value.dtype)
        if positions is None:
            return jnp.reshape(value, root_value.shape)
        flat = jnp.ravel(root_value).at[positions].set(jnp.ravel(value))
        return flat.reshape(root_value.shape)
    # Component-wise: the root as real numbers, the value as real numbers.
    if complex_root:
        parts = jnp.stack([jnp.real(root_value), jnp.imag(root_value)], axis=-1)
    else:
        parts = root_value
    if jnp.iscomplexobj(value):
        value = jnp.stack([jnp.real(value), jnp.imag(value)], axis=-1)
    flat = jnp.ravel(parts).at[positions].set(jnp.ravel(value).astype(parts.dtype))
    if complex_root:
        flat = flat.reshape(-1, 2)
        return lax.complex(flat[:, 0], flat[:, 1]).reshape(root_value.shape)
    return flat.reshape(root_value.shape)
