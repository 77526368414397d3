"""Shape and view ops (view, reshape, transpose, slice, split, cat, pad, ...) and their backward ops.

View entries return the view's value; the runtime keeps the aliasing with the base.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge.runtime import dtypes
from bridge.runtime.registry import aten, jnp_dtype, register_mapping


def wrap_dim(dim, ndim):
    """A torch dim (negative counts from the end) as an axis; 0-dim tensors accept dims 0 and -1."""
    size = max(ndim, 1)
    if not -size <= dim < size:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-size}, {size - 1}], but got {dim})")
    return dim % size


def wrap_dims(dims, ndim):
    return tuple(wrap_dim(dim, ndim) for dim in dims)


def slice_bounds(size, start, end, step):
    """torch's slice clamping: None means the whole range, negatives count from the end, out of range clamps."""
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, step


def _slice_index(ndim, dim, start, end, step):
    return (slice(None),) * dim + (slice(start, end, step),)


# ---------------------------------------------------------------- reshapes


@register_mapping(
    aten.view.default, aten._unsafe_view.default, aten.view_copy.default, aten.reshape.default, aten._reshape_copy.default,
    identity_view=True,
)
def view(self, size):
    return jnp.reshape(self, tuple(size))


@register_mapping(aten._reshape_alias.default)
def reshape_alias(self, size, stride):
    # Torch only emits it where the strides describe the same elements as a reshape.
    return jnp.reshape(self, tuple(size))


@register_mapping(aten.view.dtype, aten.view_copy.dtype)
def view_dtype(self, dtype):
    target = jnp_dtype(dtype)
    source = self.dtype
    # XLA's bitcast has no bool: reinterpret it as the byte it is stored in.
    if source == jnp.bool_:
        self, source = self.astype(jnp.uint8), jnp.dtype(jnp.uint8)
    bitcast_target = jnp.dtype(jnp.uint8) if target == jnp.bool_ else target
    if source.itemsize == bitcast_target.itemsize:
        result = lax.bitcast_convert_type(self, bitcast_target)
    elif source.itemsize > bitcast_target.itemsize:
        # The last dim grows by the size ratio.
        result = lax.bitcast_convert_type(self, bitcast_target)
        result = result.reshape(self.shape[:-1] + (self.shape[-1] * result.shape[-1],) if self.ndim else (result.shape[-1],))
    else:
        ratio = bitcast_target.itemsize // source.itemsize
        grouped = self.reshape(self.shape[:-1] + (self.shape[-1] // ratio, ratio))
        result = lax.bitcast_convert_type(grouped, bitcast_target)
    return result.astype(jnp.bool_) if target == jnp.bool_ else result


@register_mapping(aten.view_as_real.default, aten.view_as_real_copy.default)
def view_as_real(self):
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@register_mapping(aten.view_as_complex.default, aten.view_as_complex_copy.default)
def view_as_complex(self):
    return lax.complex(self[..., 0], self[..., 1])


@register_mapping(aten.alias.default, aten.alias_copy.default, aten.detach.default, aten.detach_copy.default, identity_view=True)
def alias(self):
    return self


@register_mapping(aten._neg_view.default, aten._neg_view_copy.default)
def neg_view(self):
    # A lazily negated view in torch; its value is the negation.
    return -self


@register_mapping(aten.flatten.using_ints)
def flatten(self, start_dim=0, end_dim=-1):
    if self.ndim == 0:
        return self.reshape(1)
    start_dim, end_dim = wrap_dim(start_dim, self.ndim), wrap_dim(end_dim, self.ndim)
    shape = self.shape[:start_dim] + (math.prod(self.shape[start_dim : end_dim + 1]),) + self.shape[end_dim + 1 :]
    return self.reshape(shape)


# ---------------------------------------------------------------- dim permutations


@register_mapping(aten.t.default, aten.t_copy.default)
def t(self):
    return self.T if self.ndim == 2 else self


@register_mapping(aten.transpose.int, aten.transpose_copy.int)
def transpose(self, dim0, dim1):
    if self.ndim == 0:
        return self
    return jnp.swapaxes(self, wrap_dim(dim0, self.ndim), wrap_dim(dim1, self.ndim))


@register_mapping(aten.permute.default, aten.permute_copy.default)
def permute(self, dims):
    return jnp.transpose(self, wrap_dims(dims, self.ndim)) if self.ndim else self


@register_mapping(aten.movedim.int, aten.movedim.intlist, aten.moveaxis.int, aten.moveaxis.intlist)
def movedim(self, source, destination):
    if self.ndim == 0:
        return self
    source = wrap_dims(source, self.ndim) if isinstance(source, (list, tuple)) else wrap_dim(source, self.ndim)
    destination = wrap_dims(destination, self.ndim) if isinstance(destination, (list, tuple)) else wrap_dim(destination, self.ndim)
    return jnp.moveaxis(self, source, destination)


# ---------------------------------------------------------------- adding and removing dims


@register_mapping(aten.expand.default, aten.expand_copy.default, identity_view=True)
def expand(self, size, *, implicit=False):
    size = tuple(size)
    leading = len(size) - self.ndim
    # -1 keeps the existing size of that dim; new leading dims cannot use it.
    shape = tuple(self.shape[index - leading] if wanted == -1 and index >= leading else wanted for index, wanted in enumerate(size))
    return jnp.broadcast_to(self, shape)


@register_mapping(aten.expand_as.default)
def expand_as(self, other):
    return jnp.broadcast_to(self, other.shape)


@register_mapping(aten.squeeze.default, aten.squeeze_copy.default, identity_view=True)
def squeeze(self):
    return jnp.squeeze(self)


@register_mapping(aten.squeeze.dim, aten.squeeze_copy.dim, identity_view=True)
def squeeze_dim(self, dim):
    return squeeze_dims(self, [dim])


@register_mapping(aten.squeeze.dims, aten.squeeze_copy.dims, identity_view=True)
def squeeze_dims(self, dim):
    if self.ndim == 0:
        return self
    # Dims of size other than one are left in place, unlike numpy which refuses them.
    axes = tuple(axis for axis in set(wrap_dims(dim, self.ndim)) if self.shape[axis] == 1)
    return jnp.squeeze(self, axes)


@register_mapping(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def unsqueeze(self, dim):
    return jnp.expand_dims(self, wrap_dim(dim, self.ndim + 1))


# ---------------------------------------------------------------- slicing


def _part(value, dim, start, end, step=1):
    """value[start:end:step] along dim. On concrete arrays (eager ops, view chains read outside a
    trace) the start is an argument of a program compiled once per shape: as part of the
    program, every new offset compiled one more (a loop's `source[i:i + 35]`, as pytorch/examples'
    word_language_model slices its batches: a compile a batch). In a trace it stays static."""
    if isinstance(value, jax.core.Tracer) or not isinstance(value, jax.Array) or start == 0:
        return lax.slice_in_dim(value, start, end, step, axis=dim)
    count = max(0, -(-(end - start) // step))
    index = np.int32(start) if value.shape[dim] < 2**31 else np.int64(start)
    return _offset_part(value, index, dim, count, step)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _offset_part(value, start, dim, count, step):
    span = (count - 1) * step + 1 if count else 0
    part = lax.dynamic_slice_in_dim(value, start, span, axis=dim)
    return lax.slice_in_dim(part, 0, span, step, axis=dim) if step > 1 else part


@register_mapping(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_(self, dim=0, start=None, end=None, step=1):
    dim = wrap_dim(dim, self.ndim)
    start, end, step = slice_bounds(self.shape[dim], start, end, step)
    return _part(self, dim, start, end, step)


@register_mapping(aten.select.int, aten.select_copy.int)
def select(self, dim, index):
    dim = wrap_dim(dim, self.ndim)
    size = self.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"select(): index {index} out of range for tensor of size {tuple(self.shape)} at dimension {dim}")
    index %= size
    return jnp.squeeze(_part(self, dim, index, index + 1), dim)


@register_mapping(aten.narrow.default, aten.narrow_copy.default)
def narrow(self, dim, start, length):
    dim = wrap_dim(dim, self.ndim)
    if start < 0:
        start += self.shape[dim]
    return _part(self, dim, start, start + length)


@register_mapping(aten.narrow.Tensor)
def narrow_tensor(self, dim, start, length):
    dim = wrap_dim(dim, self.ndim)
    start = jnp.where(start < 0, start + self.shape[dim], start)
    return lax.dynamic_slice_in_dim(self, start, length, axis=dim)


@register_mapping(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal(self, offset=0, dim1=0, dim2=1):
    dim1, dim2 = wrap_dim(dim1, self.ndim), wrap_dim(dim2, self.ndim)
    rows, columns = self.shape[dim1], self.shape[dim2]
    length = max(0, min(rows + min(offset, 0), columns - max(offset, 0)))
    if length == 0:
        # numpy refuses offsets past the end; torch returns an empty diagonal.
        rest = tuple(size for axis, size in enumerate(self.shape) if axis not in (dim1, dim2))
        return jnp.zeros(rest + (0,), dtype=self.dtype)
    return jnp.diagonal(self, offset, dim1, dim2)


@register_mapping(aten.unfold.default, aten.unfold_copy.default)
def unfold(self, dimension, size, step):
    if self.ndim == 0:
        return self.reshape(1)
    dimension = wrap_dim(dimension, self.ndim)
    count = (self.shape[dimension] - size) // step + 1
    windows = jnp.arange(count)[:, None] * step + jnp.arange(size)[None, :]
    taken = jnp.take(self, windows, axis=dimension)
    return jnp.moveaxis(taken, dimension + 1, -1)


@register_mapping(aten.as_strided.default, aten.as_strided_copy.default)
def as_strided(self, size, stride, storage_offset=None):
    flat, offset, count = jnp.ravel(self), storage_offset or 0, math.prod(size)
    if count and all(step == expected for extent, step, expected in zip(size, stride, _contiguous(size)) if extent > 1):
        # A dense block (FSDP's parameters in their all-gather buffer, a flat parameter's
        # views): a slice, not a gather of every position.
        return jax.lax.slice(flat, (offset,), (offset + count,)).reshape(tuple(size))
    return flat[_strided_positions(size, stride, offset)]


def _contiguous(size):
    strides, step = [], 1
    for extent in reversed(size):
        strides.append(step)
        step *= max(extent, 1)
    return strides[::-1]


def _strided_positions(size, stride, storage_offset):
    """Flat positions, in a contiguous buffer, of the elements of a strided view (made on the
    host: the sizes are static)."""
    positions = np.full(tuple(size), storage_offset or 0, dtype=np.int64)
    for axis, (extent, step) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[axis] = extent
        positions = positions + (np.arange(extent, dtype=np.int64) * step).reshape(shape)
    return positions


@register_mapping(aten.resize.default)
def resize(self, size, *, memory_format=None):
    """The first elements of `self` (in order) as a tensor of `size`; torch leaves any new
    elements uninitialized, here they are zeros."""
    count = math.prod(size)
    flat = jnp.ravel(self)[:count]
    if flat.shape[0] < count:
        flat = jnp.concatenate([flat, jnp.zeros((count - flat.shape[0],), dtype=self.dtype)])
    return flat.reshape(tuple(size))


@register_mapping(aten.resize_as.default)
def resize_as(self, the_template, *, memory_format=None):
    return resize(self, the_template.shape)


# ---------------------------------------------------------------- splitting


@register_mapping(aten.split.Tensor, aten.split_copy.Tensor)
def split(self, split_size, dim=0):
    dim = wrap_dim(dim, self.ndim)
    total = self.shape[dim]
    if split_size == 0:
        return [self]
    sizes = [min(split_size, total - start) for start in range(0, total, split_size)] or [0]
    return split_with_sizes(self, sizes, dim)


@register_mapping(aten.split_with_sizes.default, aten.split_with_sizes_copy.default, aten.split.sizes, aten.split.default)
def split_with_sizes(self, split_sizes, dim=0):
    dim = wrap_dim(dim, self.ndim)
    pieces, start = [], 0
    for length in split_sizes:
        pieces.append(lax.slice_in_dim(self, start, start + length, axis=dim))
        start += length
    return pieces


@register_mapping(aten.unbind.int, aten.unbind_copy.int)
def unbind(self, dim=0):
    dim = wrap_dim(dim, self.ndim)
    return [lax.index_in_dim(self, index, axis=dim, keepdims=False) for index in range(self.shape[dim])]


@register_mapping(aten.chunk.default)
def chunk(self, chunks, dim=0):
    size = self.shape[wrap_dim(dim, self.ndim)]
    return split(self, max(-(-size // chunks), 1) if size else 1, dim)


# ---------------------------------------------------------------- joining


def _common_dtype(tensors):
    # torch.cat and torch.stack promote their inputs as result_type does.
    return dtypes.TORCH_TO_JAX[dtypes.result_type(tensors)]


@register_mapping(aten.cat.default)
def cat(tensors, dim=0):
    dtype = _common_dtype(tensors)
    # Legacy rule kept by torch: 1-d empty tensors are skipped whatever the other shapes.
    kept = [tensor for tensor in tensors if not (tensor.ndim == 1 and tensor.shape[0] == 0)]
    if not kept:
        return jnp.zeros((0,), dtype=dtype)
    dim = wrap_dim(dim, kept[0].ndim)
    return jnp.concatenate([tensor.astype(dtype) for tensor in kept], axis=dim)


@register_mapping(aten.stack.default)
def stack(tensors, dim=0):
    dtype = _common_dtype(tensors)
    dim = wrap_dim(dim, tensors[0].ndim + 1)
    return jnp.stack([tensor.astype(dtype) for tensor in tensors], axis=dim)


@register_mapping(aten.hstack.default)
def hstack(tensors):
    tensors = [jnp.atleast_1d(tensor) for tensor in tensors]
    return cat(tensors, 0 if tensors[0].ndim == 1 else 1)


@register_mapping(aten.vstack.default)
def vstack(tensors):
    return cat([jnp.atleast_2d(tensor) for tensor in tensors], 0)


# ---------------------------------------------------------------- reordering and repeating


@register_mapping(aten.flip.default)
def flip(self, dims):
    if self.ndim == 0 or not dims:
        return self
    return jnp.flip(self, wrap_dims(dims, self.ndim))


@register_mapping(aten.roll.default)
def roll(self, shifts, dims=()):
    if not dims:
        # No dims: roll the flattened tensor.
        return jnp.roll(self.reshape(-1), tuple(shifts)).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), wrap_dims(dims, self.ndim))


@register_mapping(aten.repeat.default)
def repeat(self, repeats):
    return jnp.tile(self, tuple(repeats))


@register_mapping(aten.tril.default)
def tril(self, diagonal=0):
    return jnp.tril(self, diagonal)


@register_mapping(aten.triu.default)
def triu(self, diagonal=0):
    return jnp.triu(self, diagonal)


# ---------------------------------------------------------------- padding


def _pad_widths(ndim, pad):
    """torch's pad list (last dim first, (before, after) pairs) as per-axis widths."""
    widths = [(0, 0)] * ndim
    for pair in range(len(pad) // 2):
        widths[ndim - 1 - pair] = (pad[2 * pair], pad[2 * pair + 1])
    return widths


@register_mapping(aten.constant_pad_nd.default)
def constant_pad_nd(self, pad, value=0):
    widths = _pad_widths(self.ndim, pad)
    # lax.pad crops on negative widths, as torch does.
    return lax.pad(self, jnp.asarray(value).astype(self.dtype), [(before, after, 0) for before, after in widths])


@register_mapping(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default)
def reflection_pad(self, padding):
    widths = _pad_widths(self.ndim, padding)
    if all(before >= 0 and after >= 0 for before, after in widths):
        return jnp.pad(self, widths, mode="reflect")
    # Negative widths crop, as in torch, which jnp.pad refuses: torch's own index formula.
    out = self
    for axis, (before, after) in enumerate(widths):
        if before or after:
            size = self.shape[axis]
            position = np.arange(size + before + after)
            source = np.where(position < before, 2 * before - position, position)
            source = np.where(position >= size + before, 2 * (size + before - 1) - position, source)
            source = source - max(0, before) + max(0, -before)
            out = jnp.take(out, source, axis=axis)
    return out


@register_mapping(aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default)
def replication_pad(self, padding):
    # Output element i along an axis reads input element clip(i - before): negative widths crop,
    # as in torch, which jnp.pad refuses.
    out = self
    for axis, (before, after) in enumerate(_pad_widths(self.ndim, padding)):
        if before or after:
            size = self.shape[axis]
            source = np.clip(np.arange(size + before + after) - before, 0, size - 1)
            out = jnp.take(out, source, axis=axis)
    return out


def _pullback(forward, primal, cotangent):
    """The vjp of a linear forward at `primal`: the backward of a view or a gather."""
    _, backward = jax.vjp(forward, primal)
    return backward(cotangent.astype(primal.dtype))[0]


@register_mapping(aten.reflection_pad1d_backward.default, aten.reflection_pad2d_backward.default, aten.reflection_pad3d_backward.default)
def reflection_pad_backward(grad_output, self, padding):
    return _pullback(lambda value: reflection_pad(value, padding), jnp.zeros_like(self, dtype=grad_output.dtype), grad_output)


@register_mapping(aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default, aten.replication_pad3d_backward.default)
def replication_pad_backward(grad_output, self, padding):
    return _pullback(lambda value: replication_pad(value, padding), jnp.zeros_like(self, dtype=grad_output.dtype), grad_output)


# ---------------------------------------------------------------- backward of views and their scatters


@register_mapping(aten.slice_backward.default)
def slice_backward(grad_output, input_sizes, dim, start, end, step):
    return slice_scatter(jnp.zeros(tuple(input_sizes), dtype=grad_output.dtype), grad_output, dim, start, end, step)


@register_mapping(aten.select_backward.default)
def select_backward(grad_output, input_sizes, dim, index):
    return select_scatter(jnp.zeros(tuple(input_sizes), dtype=grad_output.dtype), grad_output, dim, index)


@register_mapping(aten.diagonal_backward.default)
def diagonal_backward(grad_output, input_sizes, offset, dim1, dim2):
    return diagonal_scatter(jnp.zeros(tuple(input_sizes), dtype=grad_output.dtype), grad_output, offset, dim1, dim2)


@register_mapping(aten.unfold_backward.default)
def unfold_backward(grad_in, input_sizes, dim, size, step):
    # Overlapping windows sum their gradients: the vjp of the gather does that.
    return _pullback(lambda value: unfold(value, dim, size, step), jnp.zeros(tuple(input_sizes), dtype=grad_in.dtype), grad_in)


@register_mapping(aten.slice_scatter.default)
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    dim = wrap_dim(dim, self.ndim)
    start, end, step = slice_bounds(self.shape[dim], start, end, step)
    return self.at[_slice_index(self.ndim, dim, start, end, step)].set(src.astype(self.dtype))


@register_mapping(aten.select_scatter.default)
def select_scatter(self, src, dim, index):
    dim = wrap_dim(dim, self.ndim)
    return self.at[(slice(None),) * dim + (index % self.shape[dim],)].set(src.astype(self.dtype))


@register_mapping(aten.diagonal_scatter.default)
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    dim1, dim2 = wrap_dim(dim1, self.ndim), wrap_dim(dim2, self.ndim)
    length = src.shape[-1]
    rows = jnp.arange(length) + max(-offset, 0)
    columns = jnp.arange(length) + max(offset, 0)
    # Put the two diagonal dims last so that the advanced indices land at the end, as in src.
    moved = jnp.moveaxis(self, (dim1, dim2), (-2, -1))
    moved = moved.at[..., rows, columns].set(src.astype(self.dtype))
    return jnp.moveaxis(moved, (-2, -1), (dim1, dim2))


# Overlapping strides: torch's formula gives the source's gradient where the scatter wrote it.
@register_mapping(aten.as_strided_scatter.default, gradient="torch")
def as_strided_scatter(self, src, size, stride, storage_offset=None):
    positions = _strided_positions(size, stride, storage_offset)
    return jnp.ravel(self).at[positions].set(src.astype(self.dtype)).reshape(self.shape)



# torch.export writes this check after a dtype conversion (`x.float()`): the graph's value must
# have the sizes and dtype it was traced with. Shapes and dtypes are static in a JAX trace too,
# so the check runs while tracing and leaves nothing in the program.
@register_mapping(aten._assert_tensor_metadata.default, family="shapes")
def assert_tensor_metadata(a, size=None, stride=None, dtype=None, *, device=None, layout=None):
    if size is not None and tuple(size) != tuple(a.shape):
        raise AssertionError(f"Tensor sizes mismatch: expected {tuple(size)}, found {tuple(a.shape)}")
    if dtype is not None and jnp_dtype(dtype) != a.dtype:
        raise AssertionError(f"Tensor dtype mismatch: expected {dtype}, found {a.dtype}")
    return None
