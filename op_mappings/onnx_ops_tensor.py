"""The ONNX-op table, tensor family: shapes and views, indexing and scatter, constants and
ranges, reductions, matrix products (see onnx_ops.py for how an entry is written).

Shapes, axes, pads and repeats must be known while the graph is traced (XLA fixes shapes
before a program runs): `known_ints` gives them, and names what was not known.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge.runtime.onnx_graph import is_known, known, known_ints, onnx_dtype, register_onnx_op


def _axis(axis, rank):
    return axis + rank if axis < 0 else axis


def _axes(axes, rank):
    return tuple(sorted(_axis(int(axis), rank) for axis in axes))


# ------------------------------------------------------------------------------- constants


@register_onnx_op("Constant")
def constant(*, value=None, value_float=None, value_floats=None, value_int=None, value_ints=None,
             value_string=None, value_strings=None, sparse_value=None):
    if value is not None:
        return np.asarray(value)
    if value_float is not None:
        return np.asarray(value_float, np.float32)
    if value_floats is not None:
        return np.asarray(value_floats, np.float32)
    if value_int is not None:
        return np.asarray(value_int, np.int64)
    if value_ints is not None:
        return np.asarray(value_ints, np.int64)
    if value_string is not None:
        return np.asarray(value_string, object)
    if value_strings is not None:
        return np.asarray(value_strings, object)
    raise NotImplementedError("a sparse Constant is not read yet")


@register_onnx_op("Identity")
def identity(x):
    return x


@register_onnx_op("Shape")
def shape(x, *, start=0, end=None):
    dims = np.asarray(np.shape(x), np.int64)
    return dims[start:end]


@register_onnx_op("Size")
def size(x):
    return np.asarray(np.size(x), np.int64)


@register_onnx_op("ConstantOfShape")
def constant_of_shape(shape_input, *, value=None):
    fill = np.zeros((1,), np.float32) if value is None else np.asarray(value)
    return jnp.full(known_ints(shape_input, "shape of ConstantOfShape"), fill.reshape(-1)[0], fill.dtype)


@register_onnx_op("Range")
def range_(start, limit, delta):
    start, limit, delta = (known(value, "bounds of Range").reshape(()) for value in (start, limit, delta))
    count = max(int(np.ceil((limit - start) / delta)), 0)
    return start + np.arange(count).astype(np.asarray(start).dtype) * delta


@register_onnx_op("EyeLike")
def eye_like(x, *, dtype=None, k=0):
    result_dtype = x.dtype if dtype is None else onnx_dtype(dtype)
    return jnp.eye(x.shape[0], x.shape[1], k, dtype=result_dtype)


# --------------------------------------------------------------------------- shape and views


@register_onnx_op("Reshape")
def reshape(data, shape_input=None, *, allowzero=0, shape=None):
    target = list(known_ints(shape_input if shape_input is not None else shape, "target shape of Reshape"))
    if not allowzero:
        target = [data.shape[position] if dim == 0 else dim for position, dim in enumerate(target)]
    return jnp.reshape(data, target)


@register_onnx_op("Flatten")
def flatten(x, *, axis=1):
    axis = _axis(axis, x.ndim)
    return jnp.reshape(x, (int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:]))))


@register_onnx_op("Transpose")
def transpose(x, *, perm=None):
    return jnp.transpose(x, perm)


@register_onnx_op("Squeeze")
def squeeze(data, axes_input=None, *, axes=None):
    axes = axes_input if axes_input is not None else axes
    if axes is None:
        return jnp.squeeze(data)
    return jnp.squeeze(data, _axes(known_ints(axes, "axes of Squeeze"), data.ndim))


@register_onnx_op("Unsqueeze")
def unsqueeze(data, axes_input=None, *, axes=None):
    axes = known_ints(axes_input if axes_input is not None else axes, "axes of Unsqueeze")
    return jnp.expand_dims(data, _axes(axes, data.ndim + len(axes)))


@register_onnx_op("Concat")
def concat(*inputs, axis):
    if all(isinstance(value, np.ndarray) for value in inputs):
        return np.concatenate(inputs, axis)
    return jnp.concatenate(inputs, axis)


@register_onnx_op("Split")
def split(x, split_input=None, *, axis=0, split=None, num_outputs=None, outputs):
    sizes = split_input if split_input is not None else split
    axis = _axis(axis, x.ndim)
    if sizes is None or np.size(known(sizes, "split sizes")) == 0:
        pieces = num_outputs or outputs
        whole = x.shape[axis]
        each = -(-whole // pieces)
        sizes = [each] * (whole // each) + ([whole % each] if whole % each else [])
    sizes = known_ints(sizes, "split sizes")
    offsets = np.cumsum((0,) + sizes)
    return tuple(lax.slice_in_dim(x, int(begin), int(end), axis=axis) for begin, end in zip(offsets[:-1], offsets[1:]))


@register_onnx_op("Slice")
def slice_(data, starts_input=None, ends_input=None, axes_input=None, steps=None, *, starts=None, ends=None, axes=None):
    starts = known_ints(starts_input if starts_input is not None else starts, "starts of Slice")
    ends = known_ints(ends_input if ends_input is not None else ends, "ends of Slice")
    axes = axes_input if axes_input is not None else axes
    axes = range(len(starts)) if axes is None else known_ints(axes, "axes of Slice")
    steps = (1,) * len(starts) if steps is None else known_ints(steps, "steps of Slice")
    index = [slice(None)] * np.ndim(data)
    for axis, start, end, step in zip(axes, starts, ends, steps):
        dim = np.shape(data)[_axis(axis, np.ndim(data))]
        # ONNX clamps to the dimension; Python's slice does the same, but only within a machine word.
        start, end = (max(min(value, dim + 1), -dim - 2) for value in (start, end))
        index[_axis(axis, np.ndim(data))] = slice(start, end, step)
    return data[tuple(index)]


@register_onnx_op("Expand")
def expand(x, shape_input):
    target = known_ints(shape_input, "shape of Expand")
    return jnp.broadcast_to(x, np.broadcast_shapes(np.shape(x), target))


@register_onnx_op("Tile")
def tile(x, repeats):
    return jnp.tile(x, known_ints(repeats, "repeats of Tile"))


@register_onnx_op("Pad")
def pad(data, pads_input=None, constant_value=None, axes_input=None, *, mode="constant", pads=None, value=0.0):
    pads = known_ints(pads_input if pads_input is not None else pads, "pads of Pad")
    rank = data.ndim
    axes = range(rank) if axes_input is None else [_axis(axis, rank) for axis in known_ints(axes_input, "axes of Pad")]
    widths = [[0, 0] for _ in range(rank)]
    count = len(pads) // 2
    for position, axis in enumerate(axes):
        widths[axis] = [pads[position], pads[position + count]]
    # Negative pads crop.
    crop = tuple(slice(max(-begin, 0), data.shape[axis] - max(-end, 0)) for axis, (begin, end) in enumerate(widths))
    data = data[crop]
    widths = [(max(begin, 0), max(end, 0)) for begin, end in widths]
    if mode == "constant":
        fill = value if constant_value is None else constant_value
        fill = jnp.asarray(fill).reshape(()).astype(data.dtype) if np.size(fill) else jnp.zeros((), data.dtype)
        return jnp.pad(data, widths, constant_values=fill)
    return jnp.pad(data, widths, mode={"reflect": "reflect", "edge": "edge", "wrap": "wrap"}[mode])


@register_onnx_op("DepthToSpace")
def depth_to_space(x, *, blocksize, mode="DCR"):
    batch, channels, height, width = x.shape
    block = blocksize
    if mode == "DCR":
        y = x.reshape(batch, block, block, channels // block**2, height, width).transpose(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(batch, channels // block**2, block, block, height, width).transpose(0, 1, 4, 2, 5, 3)
    return y.reshape(batch, channels // block**2, height * block, width * block)


@register_onnx_op("SpaceToDepth")
def space_to_depth(x, *, blocksize):
    batch, channels, height, width = x.shape
    block = blocksize
    y = x.reshape(batch, channels, height // block, block, width // block, block).transpose(0, 3, 5, 1, 2, 4)
    return y.reshape(batch, channels * block**2, height // block, width // block)


@register_onnx_op("Trilu")
def trilu(x, k=None, *, upper=1):
    offset = 0 if k is None else int(known(k, "k of Trilu").reshape(()))
    return jnp.triu(x, offset) if upper else jnp.tril(x, offset)


# ------------------------------------------------------------------------ indexing, scatter


def _wrapped(indices, dim):
    return jnp.where(indices < 0, indices + dim, indices)


@register_onnx_op("Gather")
def gather(data, indices, *, axis=0):
    axis = _axis(axis, np.ndim(data))
    if is_known(data) and is_known(indices):
        return np.take(data, np.where(indices < 0, indices + data.shape[axis], indices), axis=axis)
    return jnp.take(data, _wrapped(indices, data.shape[axis]), axis=axis, mode="clip")


@register_onnx_op("GatherElements")
def gather_elements(data, indices, *, axis=0):
    axis = _axis(axis, data.ndim)
    return jnp.take_along_axis(data, _wrapped(indices, data.shape[axis]), axis=axis, mode="clip")


@register_onnx_op("GatherND")
def gather_nd(data, indices, *, batch_dims=0):
    depth = indices.shape[-1]
    batch_shape = data.shape[:batch_dims]

    def one(data_item, index_item):
        flat = index_item.reshape(-1, depth)
        flat = _wrapped(flat, jnp.asarray(data_item.shape[:depth]))
        gathered = data_item[tuple(flat[:, position] for position in range(depth))]
        return gathered.reshape(index_item.shape[:-1] + data_item.shape[depth:])

    function = one
    for _ in range(batch_dims):
        function = jax.vmap(function)
    result = function(data, indices)
    return result.reshape(batch_shape + result.shape[batch_dims:])


def _scatter_update(target, index, updates, reduction):
    at = jnp.asarray(target).at[index]  # (a NumPy constant has no .at)
    if reduction == "add":
        return at.add(updates)
    if reduction == "mul":
        return at.multiply(updates)
    if reduction == "max":
        return at.max(updates)
    if reduction == "min":
        return at.min(updates)
    return at.set(updates)


@register_onnx_op("ScatterElements", "Scatter")
def scatter_elements(data, indices, updates, *, axis=0, reduction="none"):
    axis = _axis(axis, data.ndim)
    grids = list(jnp.indices(indices.shape, sparse=True))
    grids[axis] = _wrapped(indices, data.shape[axis])
    return _scatter_update(data, tuple(grids), updates, reduction)


@register_onnx_op("ScatterND")
def scatter_nd(data, indices, updates, *, reduction="none"):
    depth = indices.shape[-1]
    index = tuple(_wrapped(indices[..., position], data.shape[position]) for position in range(depth))
    return _scatter_update(data, index, updates, reduction)


@register_onnx_op("OneHot")
def one_hot(indices, depth, values, *, axis=-1):
    depth = int(known(depth, "depth of OneHot").reshape(()))
    indices = jnp.asarray(indices)
    indices = jnp.where(indices < 0, indices + depth, indices).astype(jnp.int64)
    rank = indices.ndim + 1
    axis = _axis(axis, rank)
    classes = jnp.arange(depth).reshape((depth,) + (1,) * (rank - 1 - axis))
    hot = jnp.expand_dims(indices, axis) == classes
    return jnp.where(hot, values[1], values[0])


@register_onnx_op("Compress")
def compress(x, condition, *, axis=None):
    chosen = np.nonzero(known(condition, "condition of Compress"))[0]
    if axis is None:
        return jnp.reshape(x, -1)[chosen]
    return jnp.take(x, chosen, axis=axis)


@register_onnx_op("NonZero")
def non_zero(x):
    return np.asarray(np.nonzero(known(x, "input of NonZero (its result's shape is its count)")), np.int64)


@register_onnx_op("Unique")
def unique(x, *, axis=None, sorted=1):
    values = known(x, "input of Unique (its result's shape is its count)")
    unique_values, first, inverse, counts = np.unique(values, return_index=True, return_inverse=True, return_counts=True, axis=axis)
    if not sorted:
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        unique_values = np.take(unique_values, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], rank[inverse.reshape(-1)]
    return unique_values, first.astype(np.int64), inverse.reshape(-1).astype(np.int64), counts.astype(np.int64)


@register_onnx_op("ReverseSequence")
def reverse_sequence(x, sequence_lens, *, batch_axis=1, time_axis=0):
    steps = x.shape[time_axis]
    time = jnp.arange(steps).reshape([-1 if axis == time_axis else 1 for axis in range(x.ndim)])
    lengths = sequence_lens.reshape([-1 if axis == batch_axis else 1 for axis in range(x.ndim)])
    source = jnp.where(time < lengths, lengths - 1 - time, time)
    return jnp.take_along_axis(x, jnp.broadcast_to(source, x.shape), axis=time_axis)


@register_onnx_op("TopK")
def top_k(x, k_input=None, *, axis=-1, largest=1, sorted=1, k=None):
    count = int(known(k_input if k_input is not None else k, "k of TopK").reshape(-1)[0])
    axis = _axis(axis, x.ndim)
    order = jnp.argsort(x, axis=axis, stable=True, descending=bool(largest))
    indices = lax.slice_in_dim(order, 0, count, axis=axis)
    return jnp.take_along_axis(x, indices, axis=axis), indices.astype(jnp.int64)


@register_onnx_op("CumSum")
def cum_sum(x, axis, *, exclusive=0, reverse=0):
    return _cumulative(jnp.cumsum, jnp.zeros, x, axis, exclusive, reverse)


@register_onnx_op("CumProd")
def cum_prod(x, axis, *, exclusive=0, reverse=0):
    return _cumulative(jnp.cumprod, jnp.ones, x, axis, exclusive, reverse)


def _cumulative(function, identity, x, axis, exclusive, reverse):
    axis = _axis(int(known(axis, "axis").reshape(())), x.ndim)
    if reverse:
        x = jnp.flip(x, axis)
    result = function(x, axis=axis, dtype=x.dtype)
    if exclusive:
        first = identity(x.shape[:axis] + (1,) + x.shape[axis + 1 :], x.dtype)
        result = jnp.concatenate([first, lax.slice_in_dim(result, 0, x.shape[axis] - 1, axis=axis)], axis)
    return jnp.flip(result, axis) if reverse else result


# ------------------------------------------------------------------------------ reductions


def _reduce(function, *, positive=None):
    """An ONNX reduction: axes from the input (opset 13 for ReduceSum, 18 for the others) or the
    attribute; no axes reduces all unless noop_with_empty_axes."""

    def reduce(data, axes_input=None, *, axes=None, keepdims=1, noop_with_empty_axes=0):
        axes = axes_input if axes_input is not None else axes
        axes = () if axes is None else known_ints(axes, "axes of the reduction")
        if not axes:
            if noop_with_empty_axes:
                return positive(data) if positive is not None else data
            axes = tuple(range(data.ndim))
        return function(data, _axes(axes, data.ndim), bool(keepdims))

    return reduce


def _cast_back(function):
    return lambda data, axes, keepdims: function(data, axes, keepdims).astype(data.dtype)


def _extreme(jnp_function, empty):
    def reduce(data, axes, keepdims):
        if any(data.shape[axis] == 0 for axis in axes):
            shape = [1 if axis in axes else dim for axis, dim in enumerate(data.shape)]
            result = jnp.full(shape, empty(data.dtype), data.dtype)
            return result if keepdims else jnp.squeeze(result, axes)
        return jnp_function(data, axis=axes, keepdims=keepdims)

    return reduce


def _lowest(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else (False if dtype == jnp.bool_ else jnp.iinfo(dtype).min)


def _highest(dtype):
    return jnp.inf if jnp.issubdtype(dtype, jnp.floating) else (True if dtype == jnp.bool_ else jnp.iinfo(dtype).max)


register_onnx_op("ReduceSum")(_reduce(_cast_back(lambda x, a, k: jnp.sum(x, a, keepdims=k))))
register_onnx_op("ReduceMean")(_reduce(_cast_back(lambda x, a, k: jnp.mean(x, a, keepdims=k))))
register_onnx_op("ReduceProd")(_reduce(_cast_back(lambda x, a, k: jnp.prod(x, a, keepdims=k))))
register_onnx_op("ReduceMax")(_reduce(_extreme(jnp.max, _lowest)))
register_onnx_op("ReduceMin")(_reduce(_extreme(jnp.min, _highest)))
register_onnx_op("ReduceL1")(_reduce(_cast_back(lambda x, a, k: jnp.sum(jnp.abs(x), a, keepdims=k)), positive=jnp.abs))
register_onnx_op("ReduceL2")(_reduce(_cast_back(lambda x, a, k: jnp.sqrt(jnp.sum(x * x, a, keepdims=k))), positive=jnp.abs))
register_onnx_op("ReduceSumSquare")(_reduce(_cast_back(lambda x, a, k: jnp.sum(x * x, a, keepdims=k)), positive=jnp.square))
register_onnx_op("ReduceLogSum")(_reduce(_cast_back(lambda x, a, k: jnp.log(jnp.sum(x, a, keepdims=k))), positive=jnp.log))
register_onnx_op("ReduceLogSumExp")(
    _reduce(_cast_back(lambda x, a, k: jax.nn.logsumexp(x, a, keepdims=k)), positive=lambda x: x)
)


def _arg(function):
    def arg(data, *, axis=0, keepdims=1, select_last_index=0):
        axis = _axis(axis, data.ndim)
        if select_last_index:
            flipped = jnp.flip(data, axis)
            result = data.shape[axis] - 1 - function(flipped, axis=axis, keepdims=bool(keepdims))
        else:
            result = function(data, axis=axis, keepdims=bool(keepdims))
        return result.astype(jnp.int64)

    return arg


register_onnx_op("ArgMax")(_arg(jnp.argmax))
register_onnx_op("ArgMin")(_arg(jnp.argmin))


# ---------------------------------------------------------------------------- matrix products


def _matmul(a, b):
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


@register_onnx_op("MatMul")
def matmul(a, b):
    return _matmul(a, b).astype(a.dtype)


@register_onnx_op("Gemm")
def gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    a = a.T if transA else a
    b = b.T if transB else b
    result = _matmul(a, b)
    if alpha != 1.0:
        result = result * jnp.asarray(alpha, a.dtype)
    if c is not None:
        result = result + (c * jnp.asarray(beta, a.dtype) if beta != 1.0 else c)
    return result.astype(a.dtype)


@register_onnx_op("Einsum")
def einsum(*inputs, equation):
    return jnp.einsum(equation.replace(" ", ""), *inputs, precision=lax.Precision.HIGHEST).astype(inputs[0].dtype)


@register_onnx_op("Det")
def det(x):
    return jnp.linalg.det(x)


@register_onnx_op("MatMulInteger")
def matmul_integer(a, b, a_zero_point=None, b_zero_point=None):
    a = a.astype(jnp.int32) - (0 if a_zero_point is None else a_zero_point.astype(jnp.int32))
    b = b.astype(jnp.int32) - (0 if b_zero_point is None else b_zero_point.astype(jnp.int32))
    return jnp.matmul(a, b)
