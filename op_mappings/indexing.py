"""Indexing ops: advanced indexing and index_put, gather/scatter, index_* ops, embedding, sorting and searching.

Ops whose output shape depends on values (nonzero, masked_select, unique, bool-mask
indexing) can only run eagerly: their entries read the mask on the host.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from bridge.runtime.dtypes import is_lifted_float
from bridge.runtime.registry import aten, register_mapping

from .shapes import wrap_dim


_INDEX_DTYPE = jnp.int64


def _is_mask(index):
    # uint8 indices are masks too, a deprecated torch spelling of bool.
    return index.dtype == jnp.bool_ or index.dtype == jnp.uint8


@functools.partial(jax.jit, static_argnames="size")
def _sized_nonzero(mask, size):
    return tuple(positions.astype(_INDEX_DTYPE) for positions in jnp.nonzero(mask, size=size))


@jax.jit
def _count_nonzero(mask):
    return jnp.count_nonzero(mask)


def _nonzero(mask):
    """Positions of a mask's nonzero elements, per dim: eager only, as their number depends on the data.

    One host read for the count, then one compiled program, rather than jnp.nonzero's
    dozen primitives each dispatched (and compiled per shape) on its own.
    """
    return _sized_nonzero(mask, size=int(_count_nonzero(mask)))


def _index_key(indices):
    """The numpy-style key for ATen's list of optional index tensors.

    numpy's advanced-indexing rules (broadcast the index tensors together; their
    result dims go where they stand if they are adjacent, else first) are torch's.
    """
    key = []
    for index in indices:
        if index is None:
            key.append(slice(None))
        elif _is_mask(index):
            # Data-dependent shape: the mask is read on the host, so this only works
            # eagerly (under jax.jit it raises a concretization error).
            # (torch's Python layer turns 0-dim masks into unsqueeze and integer indices before ATen.)
            key.extend(_nonzero(index.astype(jnp.bool_)))
        else:
            key.append(index)
    return tuple(key)


@register_mapping(
    aten.index.Tensor, aten.index.Tensor_hacked_twin, aten._unsafe_index.Tensor, aten._unsafe_index.Tensor_hacked_twin,
    host_tensors=True,
)
def index(self, indices):
    return self[_index_key(indices)]


def _masked_put(self, position, mask, values, accumulate):
    """index_put with one mask and values constant along the masked elements: a traceable `where`."""
    after = self.shape[position + mask.ndim :]
    values = jnp.broadcast_to(values, self.shape[:position] + (1,) + after)
    values = values.reshape(self.shape[:position] + (1,) * mask.ndim + after)
    mask = mask.reshape((1,) * position + mask.shape + (1,) * len(after))
    if accumulate:
        return self + jnp.where(mask, values, jnp.zeros((), self.dtype))
    return jnp.where(mask, values, self)


def _single_mask_position(indices, values, ndim):
    """Where the only index is a bool mask whose values do not vary along the masked elements, its position."""
    given = [position for position, index in enumerate(indices) if index is not None]
    if len(given) != 1 or not _is_mask(indices[given[0]]) or indices[given[0]].ndim == 0:
        return None
    position = given[0]
    # The masked elements form one result dim; values broadcast along it if they have no such dim or it is 1.
    trailing = ndim - position - indices[position].ndim
    if values.ndim <= trailing or values.shape[values.ndim - 1 - trailing] == 1:
        return position
    return None


@register_mapping(
    aten.index_put.default, aten.index_put.hacked_twin, aten._unsafe_index_put.default, aten._unsafe_index_put.hacked_twin,
    host_tensors=True,
)
def index_put(self, indices, values, accumulate=False):
    if accumulate and self.dtype == jnp.bool_:
        return _as_logical_or(index_put)(self, indices, values, accumulate)
    values = values.astype(self.dtype)
    # `x[mask] = value` is common in training code: keep it traceable.
    position = _single_mask_position(indices, values, self.ndim)
    if position is not None:
        return _masked_put(self, position, indices[position].astype(jnp.bool_), values, accumulate)
    key = _index_key(indices)
    return self.at[key].add(values) if accumulate else self.at[key].set(values)


def _clamped(indices, shape):
    # Out-of-range positions are masked out by the caller; keep them in range so the gather is defined.
    return [None if index is None else jnp.clip(index, -size, size - 1) for index, size in zip(indices, shape)]


@register_mapping(aten._unsafe_masked_index.default)
def unsafe_masked_index(self, mask, indices, fill):
    return jnp.where(mask, index(self, _clamped(indices, self.shape)), jnp.asarray(fill, dtype=self.dtype))


@register_mapping(aten._unsafe_masked_index_put_accumulate.default)
def unsafe_masked_index_put_accumulate(self, mask, indices, values):
    values = jnp.where(mask, values, jnp.zeros((), values.dtype))
    return index_put(self, _clamped(indices, self.shape), values, accumulate=True)


# ---------------------------------------------------------------- index_* ops along one dim


def _as_logical_or(accumulate):
    """A bool accumulation as torch does it (a logical or): the sum in int32, then nonzero."""

    def run(self, *args, **kwargs):
        args = [argument.astype(jnp.int32) if getattr(argument, "dtype", None) == jnp.bool_ else argument for argument in args]
        return accumulate(self.astype(jnp.int32), *args, **kwargs) != 0

    return run


def _along(dim, index):
    return (slice(None),) * dim + (index.reshape(-1),)


@register_mapping(aten.index_select.default)
def index_select(self, dim, index):
    if self.ndim == 0:
        return self
    return jnp.take(self, index.reshape(-1), axis=wrap_dim(dim, self.ndim))


def _as_source(source, self, dim):
    # A 0-dim index selects one slice; its source may lack the indexed dim.
    if source.ndim < self.ndim:
        source = jnp.expand_dims(source, dim)
    return source.astype(self.dtype)


@register_mapping(aten.index_add.default)
def index_add(self, dim, index, source, *, alpha=1):
    if self.dtype == jnp.bool_:
        return _as_logical_or(index_add)(self, dim, index, source, alpha=int(alpha))
    if self.ndim == 0:
        return self + source.astype(self.dtype) * alpha
    dim = wrap_dim(dim, self.ndim)
    source = _as_source(source, self, dim)
    if alpha != 1:
        source = source * jnp.asarray(alpha, dtype=self.dtype)
    return self.at[_along(dim, index)].add(source)


@register_mapping(aten.index_copy.default)
def index_copy(self, dim, index, source):
    if self.ndim == 0:
        return source.astype(self.dtype)
    dim = wrap_dim(dim, self.ndim)
    return self.at[_along(dim, index)].set(_as_source(source, self, dim))


@register_mapping(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(self, dim, index, value):
    value = jnp.asarray(value).astype(self.dtype)
    if self.ndim == 0:
        return jnp.broadcast_to(value, ())
    return self.at[_along(wrap_dim(dim, self.ndim), index)].set(value)


# ---------------------------------------------------------------- gather and scatter


def _scatter_key(index, dim):
    """Full positions for gather/scatter: `index` along `dim`, the element's own position along the others."""
    key = []
    for axis, size in enumerate(index.shape):
        if axis == dim:
            key.append(index)
        else:
            shape = [1] * index.ndim
            shape[axis] = size
            key.append(jnp.arange(size).reshape(shape))
    return tuple(key)


def _scatter_source(src, index, dtype):
    # torch reads only the leading index.shape block of src.
    if not hasattr(src, "shape") or is_lifted_float(src):  # a Python number
        return jnp.asarray(src).astype(dtype)
    return src[tuple(slice(0, size) for size in index.shape)].astype(dtype)


def _scalar_dims(function):
    """Run a scatter body on a 0-dim self (whose index and src are 0-dim too) as on 1-element tensors;
    an empty index (of any rank, as torch accepts) writes nothing."""

    @functools.wraps(function)
    def body(self, dim, index, src, *args, **kwargs):
        if index.size == 0:
            return self
        if self.ndim != 0:
            return function(self, dim, index, src, *args, **kwargs)
        src = src.reshape(1) if hasattr(src, "reshape") else src
        return function(self.reshape(1), 0, index.reshape(1), src, *args, **kwargs).reshape(())

    return body


@register_mapping(aten.gather.default)
def gather(self, dim, index, *, sparse_grad=False):
    if index.size == 0:
        # torch accepts an empty index of any rank and reads nothing.
        return jnp.zeros(index.shape, dtype=self.dtype)
    if self.ndim == 0:
        return self.reshape(index.shape)
    dim = wrap_dim(dim, self.ndim)
    # index may be smaller than self along the other dims: only that block is read.
    cropped = self[tuple(slice(None) if axis == dim else slice(0, size) for axis, size in enumerate(index.shape))]
    return jnp.take_along_axis(cropped, index, axis=dim)


@register_mapping(aten.scatter.src, aten.scatter.value)
@_scalar_dims
def scatter(self, dim, index, src):
    dim = wrap_dim(dim, self.ndim)
    return self.at[_scatter_key(index, dim)].set(_scatter_source(src, index, self.dtype))


@register_mapping(aten.scatter.reduce, aten.scatter.value_reduce)
@_scalar_dims
def scatter_reduce_legacy(self, dim, index, src, *, reduce):
    dim = wrap_dim(dim, self.ndim)
    positions = self.at[_scatter_key(index, dim)]
    src = _scatter_source(src, index, self.dtype)
    if reduce == "add":
        if self.dtype == jnp.bool_:
            return _as_logical_or(lambda target: target.at[_scatter_key(index, dim)].add(src.astype(jnp.int32)))(self)
        return positions.add(src)
    if reduce == "multiply":
        return positions.multiply(src)
    raise ValueError(f"scatter: reduce must be 'add' or 'multiply', not {reduce!r}")


@register_mapping(aten.scatter_add.default)
@_scalar_dims
def scatter_add(self, dim, index, src):
    dim = wrap_dim(dim, self.ndim)
    positions = self.at[_scatter_key(index, dim)]
    src = _scatter_source(src, index, self.dtype)
    # A bool sum is a logical or: the largest of the values.
    return positions.max(src) if self.dtype == jnp.bool_ else positions.add(src)


def _lowest(dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf
    return jnp.iinfo(dtype).min if dtype != jnp.bool_ else False


def _highest(dtype):
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.inf
    return jnp.iinfo(dtype).max if dtype != jnp.bool_ else True


@register_mapping(aten.scatter_reduce.two)
@_scalar_dims
def scatter_reduce(self, dim, index, src, reduce, *, include_self=True):
    dim = wrap_dim(dim, self.ndim)
    key = _scatter_key(index, dim)
    src = _scatter_source(src, index, self.dtype)
    # Without include_self the scattered positions start from the reduction's identity.
    identity = {"sum": 0, "mean": 0, "prod": 1, "amax": _lowest(self.dtype), "amin": _highest(self.dtype)}[reduce]
    base = self if include_self else self.at[key].set(jnp.asarray(identity, dtype=self.dtype))
    # In bool a sum is a logical or (the largest value) and a product a logical and (the smallest).
    if reduce == "sum":
        return base.at[key].max(src) if self.dtype == jnp.bool_ else base.at[key].add(src)
    if reduce == "prod":
        return base.at[key].min(src) if self.dtype == jnp.bool_ else base.at[key].multiply(src)
    if reduce == "amax":
        return base.at[key].max(src)
    if reduce == "amin":
        return base.at[key].min(src)
    total = base.at[key].add(src)
    count = jnp.zeros(self.shape, dtype=self.dtype).at[key].add(jnp.ones((), dtype=self.dtype))
    if include_self:
        count = count + 1
    count = jnp.where(count == 0, jnp.ones((), dtype=self.dtype), count)
    if jnp.issubdtype(self.dtype, jnp.inexact):
        return total / count
    return jnp.floor_divide(total, count)


# ---------------------------------------------------------------- masked and flat selection


@register_mapping(aten.masked_scatter.default)
def masked_scatter(self, mask, source):
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    flat_mask = jnp.broadcast_to(mask, shape).reshape(-1)
    # The k-th masked element takes source's k-th element: a cumulative count gives k, traceably.
    positions = jnp.cumsum(flat_mask, dtype=_INDEX_DTYPE) - 1
    flat_source = source.reshape(-1).astype(self.dtype)
    if flat_source.size == 0:
        return jnp.broadcast_to(self, shape)
    taken = flat_source[jnp.clip(positions, 0, flat_source.size - 1)]
    return jnp.where(flat_mask, taken, jnp.broadcast_to(self, shape).reshape(-1)).reshape(shape)


@register_mapping(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad_output, mask, sizes):
    flat_mask = jnp.broadcast_to(mask, grad_output.shape).reshape(-1)
    count = 1
    for size in sizes:
        count *= size
    positions = jnp.where(flat_mask, jnp.cumsum(flat_mask, dtype=_INDEX_DTYPE) - 1, count)
    # Unmasked elements aim past the end and are dropped.
    result = jnp.zeros((count,), dtype=grad_output.dtype).at[positions].set(grad_output.reshape(-1), mode="drop")
    return result.reshape(tuple(sizes))


@register_mapping(aten.take.default)
def take(self, index):
    flat = self.reshape(-1)
    return flat[jnp.where(index < 0, index + flat.size, index)]


@register_mapping(aten.put.default)
def put(self, index, source, accumulate=False):
    flat = self.reshape(-1)
    positions = jnp.where(index < 0, index + flat.size, index).reshape(-1)
    source = source.reshape(-1).astype(self.dtype)
    if not accumulate:
        flat = flat.at[positions].set(source)
    elif self.dtype == jnp.bool_:  # a bool sum is a logical or
        flat = flat.at[positions].max(source)
    else:
        flat = flat.at[positions].add(source)
    return flat.reshape(self.shape)


@register_mapping(aten.nonzero.default, meta="data-dependent")
def nonzero(self):
    # Data-dependent shape: eager only.
    if self.ndim == 0:
        return jnp.zeros((int(self.astype(jnp.bool_)), 0), dtype=_INDEX_DTYPE)
    return jnp.stack(_nonzero(self), axis=1)


@register_mapping(aten.nonzero_static.default)
def nonzero_static(self, *, size, fill_value=-1):
    if self.ndim == 0:
        return jnp.zeros((size, 0), dtype=_INDEX_DTYPE)
    if self.size == 0:
        return jnp.full((size, self.ndim), fill_value, dtype=_INDEX_DTYPE)
    positions = jnp.nonzero(self, size=size, fill_value=fill_value)
    return jnp.stack(positions, axis=1).astype(_INDEX_DTYPE)


@register_mapping(aten.where.default, meta="data-dependent")
def where(condition):
    # Data-dependent shape: eager only.
    return list(_nonzero(condition))


@register_mapping(aten.masked_select.default, meta="data-dependent")
def masked_select(self, mask):
    # Data-dependent shape: eager only.
    shape = jnp.broadcast_shapes(self.shape, mask.shape) or (1,)  # a 0-dim pair selects as one element
    return jnp.broadcast_to(self, shape)[_nonzero(jnp.broadcast_to(mask, shape))]


# ---------------------------------------------------------------- embedding


# padding_idx rows get no gradient and scale_grad_by_freq divides by each index's count.
@register_mapping(aten.embedding.default, gradient="torch")
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@register_mapping(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat_indices = indices.reshape(-1)
    # Sum in float32 at least: many bfloat16 rows landing on one weight lose bits otherwise.
    accumulate = jnp.promote_types(grad_output.dtype, jnp.float32)
    rows = grad_output.reshape(flat_indices.shape[0], -1).astype(accumulate)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), dtype=accumulate).at[flat_indices].add(1)
        rows = rows / counts[flat_indices][:, None]
    if padding_idx >= 0:
        rows = jnp.where((flat_indices == padding_idx)[:, None], jnp.zeros((), accumulate), rows)
    grad_weight = jnp.zeros((num_weights, rows.shape[1]), dtype=accumulate).at[flat_indices].add(rows)
    return grad_weight.astype(grad_output.dtype)


@register_mapping(aten.embedding_renorm.default)
def embedding_renorm(self, indices, max_norm, norm_type):
    # Rows that indices name and whose norm exceeds max_norm are scaled down to it (torch's 1e-7 guard included).
    named = jnp.zeros((self.shape[0],), dtype=jnp.bool_).at[indices.reshape(-1)].set(True)
    norms = jnp.linalg.norm(self.astype(jnp.promote_types(self.dtype, jnp.float32)), ord=norm_type, axis=1)
    scale = jnp.where(named & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
    return (self * scale[:, None]).astype(self.dtype)


# ---------------------------------------------------------------- embedding_bag

_BAG_SUM, _BAG_MEAN, _BAG_MAX = 0, 1, 2


def _bag_parts(indices, offsets, num_bags, padding_idx):
    """(bag of each index position, whether it takes part): positions past the last bag (the
    include_last_offset case) and padding_idx entries take no part."""
    positions = jnp.arange(indices.shape[0], dtype=offsets.dtype)
    bag = jnp.searchsorted(offsets, positions, side="right").astype(jnp.int64) - 1
    valid = (bag >= 0) & (bag < num_bags)
    if padding_idx >= 0:
        valid = valid & (indices != padding_idx)
    return jnp.clip(bag, 0, max(num_bags - 1, 0)), valid


def _bag_accumulator(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _embedding_bag(weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx):
    num_bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    features = weight.shape[1]
    accumulate = _bag_accumulator(weight.dtype)
    bag, valid = _bag_parts(indices, offsets, num_bags, padding_idx)
    rows = jnp.take(weight, indices, axis=0).astype(accumulate)
    counts = jnp.zeros((num_bags,), dtype=jnp.int64).at[bag].add(valid.astype(jnp.int64))
    if mode == _BAG_MAX:
        lowest = jnp.asarray(-jnp.inf, dtype=accumulate)
        masked = jnp.where(valid[:, None], rows, lowest)
        maximum = jnp.full((num_bags, features), lowest).at[bag].max(masked)
        # torch keeps the first of equal maxima (it replaces the running maximum on `>` only).
        position = jnp.arange(indices.shape[0])[:, None]
        is_maximum = valid[:, None] & (masked == maximum[bag])
        first = jnp.full((num_bags, features), indices.shape[0]).at[bag].min(
            jnp.where(is_maximum, position, indices.shape[0])
        )
        empty = (counts == 0)[:, None]
        output = jnp.where(empty, jnp.zeros((), accumulate), maximum)
        # -1 marks an empty bag for the backward (torch's CPU kernel writes 0 and checks bag_size).
        chosen = jnp.take(indices, jnp.minimum(first, indices.shape[0] - 1)) if indices.shape[0] else first
        max_indices = jnp.where(empty, jnp.asarray(-1, indices.dtype), chosen.astype(indices.dtype))
    else:
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.astype(accumulate)[:, None]
        rows = jnp.where(valid[:, None], rows, jnp.zeros((), accumulate))
        output = jnp.zeros((num_bags, features), dtype=accumulate).at[bag].add(rows)
        if mode == _BAG_MEAN:
            output = output / jnp.maximum(counts, 1).astype(accumulate)[:, None]
        max_indices = jnp.zeros((0,), dtype=indices.dtype)
    # The auxiliary outputs are shaped as torch's meta kernel (and CUDA) shapes them: offset2bag
    # per index, bag_size per offset (the CPU kernel sometimes leaves them empty).
    bag_size = jnp.zeros(offsets.shape, dtype=indices.dtype).at[bag].add(valid.astype(indices.dtype))
    return output.astype(weight.dtype), bag.astype(indices.dtype), bag_size, max_indices


@register_mapping(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(
    weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False, per_sample_weights=None,
    include_last_offset=False, padding_idx=-1,
):
    return _embedding_bag(weight, indices, offsets, mode, per_sample_weights, include_last_offset, padding_idx)


@register_mapping(aten._embedding_bag_backward.default)
def embedding_bag_backward(
    grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq, mode, sparse,
    per_sample_weights, padding_idx=-1,
):
    # Bags are found again from the offsets: offset2bag is empty on torch's fast path.
    num_bags, features = grad.shape
    dtype = grad.dtype
    accumulate = _bag_accumulator(dtype)
    grad = grad.astype(accumulate)
    if mode == _BAG_MAX:
        chosen = maximum_indices >= 0
        rows = jnp.where(chosen, maximum_indices, 0)
        columns = jnp.broadcast_to(jnp.arange(features), rows.shape)
        grad_weight = jnp.zeros((num_weights, features), accumulate).at[rows, columns].add(
            jnp.where(chosen, grad, jnp.zeros((), accumulate))
        )
        return grad_weight.astype(dtype)
    bag, valid = _bag_parts(indices, offsets, num_bags, padding_idx)
    per_index = grad[bag]
    if mode == _BAG_MEAN:
        counts = jnp.zeros((num_bags,), dtype=accumulate).at[bag].add(valid.astype(accumulate))
        per_index = per_index / jnp.maximum(counts, 1)[bag][:, None]
    if per_sample_weights is not None:
        per_index = per_index * per_sample_weights.astype(accumulate)[:, None]
    if scale_grad_by_freq:
        frequency = jnp.zeros((num_weights,), dtype=accumulate).at[indices].add(1)
        per_index = per_index / frequency[indices][:, None]
    per_index = jnp.where(valid[:, None], per_index, jnp.zeros((), accumulate))
    return jnp.zeros((num_weights, features), accumulate).at[indices].add(per_index).astype(dtype)


@register_mapping(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    num_bags = grad.shape[0]
    accumulate = _bag_accumulator(grad.dtype)
    bag, valid = _bag_parts(indices, offsets, num_bags, padding_idx)
    products = jnp.sum(grad.astype(accumulate)[bag] * jnp.take(weight, indices, axis=0).astype(accumulate), axis=1)
    return jnp.where(valid, products, jnp.zeros((), accumulate)).astype(grad.dtype)


# ---------------------------------------------------------------- repeat_interleave


@register_mapping(aten.repeat_interleave.Tensor, meta="data-dependent")
def repeat_interleave(repeats, *, output_size=None):
    if output_size is None:
        # Data-dependent length: reads the total on the host, so eager only unless output_size is given.
        output_size = int(repeats.sum())
    positions = jnp.arange(repeats.shape[0], dtype=repeats.dtype)
    return jnp.repeat(positions, repeats, total_repeat_length=output_size)


# ---------------------------------------------------------------- sorting


def _sort_indices(self, dim, descending):
    # Stable either way; jnp puts NaN last ascending and first descending, as torch does.
    return jnp.argsort(self, axis=dim, stable=True, descending=descending).astype(_INDEX_DTYPE)


@register_mapping(aten.sort.default)
def sort(self, dim=-1, descending=False):
    if self.ndim == 0:
        return self, jnp.zeros((), dtype=_INDEX_DTYPE)
    dim = wrap_dim(dim, self.ndim)
    indices = _sort_indices(self, dim, descending)
    return jnp.take_along_axis(self, indices, axis=dim), indices


@register_mapping(aten.sort.stable)
def sort_stable(self, *, stable, dim=-1, descending=False):
    return sort(self, dim, descending)


@register_mapping(aten.argsort.default)
def argsort(self, dim=-1, descending=False):
    return sort(self, dim, descending)[1]


@register_mapping(aten.argsort.stable)
def argsort_stable(self, *, stable, dim=-1, descending=False):
    return sort(self, dim, descending)[1]


@register_mapping(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):
    if self.ndim == 0:
        return self, jnp.zeros((), dtype=_INDEX_DTYPE)
    dim = wrap_dim(dim, self.ndim)
    if largest and jnp.issubdtype(self.dtype, jnp.floating):
        # lax.top_k is the fast path on accelerators; it works on the last dim.
        values, indices = lax.top_k(jnp.moveaxis(self, dim, -1), k)
        return jnp.moveaxis(values, -1, dim), jnp.moveaxis(indices.astype(_INDEX_DTYPE), -1, dim)
    indices = lax.slice_in_dim(_sort_indices(self, dim, largest), 0, k, axis=dim)
    return jnp.take_along_axis(self, indices, axis=dim), indices


@register_mapping(aten.kthvalue.default)
def kthvalue(self, k, dim=-1, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), dtype=_INDEX_DTYPE)
    dim = wrap_dim(dim, self.ndim)
    indices = lax.slice_in_dim(_sort_indices(self, dim, False), k - 1, k, axis=dim)
    values = jnp.take_along_axis(self, indices, axis=dim)
    if not keepdim:
        values, indices = jnp.squeeze(values, dim), jnp.squeeze(indices, dim)
    return values, indices


# ---------------------------------------------------------------- searching


def _search(sorted_sequence, values, side, out_int32):
    if sorted_sequence.ndim <= 1:
        result = jnp.searchsorted(sorted_sequence, values, side=side)
    else:
        # One search per leading position: the sequences' leading dims match the values'.
        leading = sorted_sequence.shape[:-1]
        # Sizes spelled out: reshape cannot infer a -1 when a dim is empty.
        rows = math.prod(leading)
        flat_sequences = sorted_sequence.reshape(rows, sorted_sequence.shape[-1])
        flat_values = values.reshape(rows, math.prod(values.shape[len(leading) :]))
        result = jax.vmap(lambda sequence, row: jnp.searchsorted(sequence, row, side=side))(flat_sequences, flat_values)
        result = result.reshape(leading + values.shape[len(leading) :])
    return result.astype(jnp.int32 if out_int32 else _INDEX_DTYPE)


def _side(right, side):
    return "right" if right or side == "right" else "left"


@register_mapping(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None):
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    return _search(sorted_sequence, jnp.asarray(self), _side(right, side), out_int32)


@register_mapping(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(self, boundaries, *, out_int32=False, right=False):
    # bucketize's `right` picks the closed side of a bucket; it is searchsorted's `side` read the other way round.
    return _search(boundaries, jnp.asarray(self), "right" if right else "left", out_int32)


# ---------------------------------------------------------------- unique (eager only: data-dependent shapes)


def _empty_indices():
    return jnp.zeros((0,), dtype=_INDEX_DTYPE)


@jax.jit
def _count_unique(flat):
    ordered = jnp.sort(flat)
    return 1 + jnp.count_nonzero(ordered[1:] != ordered[:-1])


@functools.partial(jax.jit, static_argnames="size")
def _sized_unique(flat, size):
    # One compiled program once the number of distinct values is known (see _nonzero).
    return jnp.unique(flat, return_inverse=True, return_counts=True, size=size)


@register_mapping(aten._unique2.default, meta="data-dependent")
def unique(self, sorted=True, return_inverse=False, return_counts=False):
    flat = self.reshape(-1)
    values, inverse, counts = _sized_unique(flat, size=int(_count_unique(flat)) if flat.size else 0)
    return (
        values,
        inverse.reshape(self.shape).astype(_INDEX_DTYPE) if return_inverse else _empty_indices(),
        counts.astype(_INDEX_DTYPE) if return_counts else _empty_indices(),
    )


@register_mapping(aten.unique_dim.default, meta="data-dependent")
def unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    dim = wrap_dim(dim, self.ndim)
    values, inverse, counts = jnp.unique(self, axis=dim, return_inverse=True, return_counts=True)
    # Along a dim torch returns the inverse and the counts whether asked or not.
    return values, inverse.reshape(-1).astype(_INDEX_DTYPE), counts.astype(_INDEX_DTYPE)


@register_mapping(aten.unique_consecutive.default, meta="data-dependent")
def unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    if dim is None:
        rows = self.reshape(-1, 1)
    else:
        dim = wrap_dim(dim, self.ndim)
        others = math.prod(self.shape[:dim] + self.shape[dim + 1 :])  # not -1: dims may be empty
        rows = jnp.moveaxis(self, dim, 0).reshape(self.shape[dim], others)
    starts = jnp.concatenate([jnp.ones((min(rows.shape[0], 1),), dtype=jnp.bool_), jnp.any(rows[1:] != rows[:-1], axis=1)])
    kept = _nonzero(starts)[0]
    if dim is None:
        values = self.reshape(-1)[kept]
    else:
        values = jnp.take(self, kept, axis=dim)
    inverse = (jnp.cumsum(starts, dtype=_INDEX_DTYPE) - 1).reshape(self.shape if dim is None else (-1,))
    counts = jnp.diff(jnp.append(kept, rows.shape[0])).astype(_INDEX_DTYPE)
    if dim is not None:
        # Along a dim torch returns the inverse and the counts whether asked or not.
        return values, inverse, counts
    return (
        values,
        inverse if return_inverse else _empty_indices(),
        counts if return_counts else _empty_indices(),
    )


@register_mapping(aten.one_hot.default)
def one_hot(self, num_classes=-1):
    # num_classes=-1 (the largest class plus one) is read on the host before the call, as torch
    # reads it: bridge/patches/composites.py routes F.one_hot here with the number resolved.
    return jax.nn.one_hot(self, num_classes, dtype=jnp.int64)


@register_mapping(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor)
def isin(elements, test_elements, *, assume_unique=False, invert=False):
    # One op where torch's decomposition ran several (HF's generate asks it once a token).
    return jnp.isin(jnp.asarray(elements), jnp.asarray(test_elements), invert=invert)
