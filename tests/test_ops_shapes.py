"""Shape and view mappings against eager torch: values of each entry called directly, and gradients through the bridge."""

import pytest
import torch

from op_testing import check, through_bridge
from op_testing import seeded_sample as sample

aten = torch.ops.aten


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool]


# ---------------------------------------------------------------- reshapes


@pytest.mark.parametrize("dtype", DTYPES)
def test_view_and_reshape(dtype):
    value = sample((2, 3, 4), dtype)
    check(aten.view.default, value, [6, 4])
    check(aten.view.default, value, [-1])
    check(aten.view.default, value, [2, -1, 2])
    check(aten._unsafe_view.default, value, [4, 6])
    check(aten.view_copy.default, value, [24])
    check(aten.view.default, torch.tensor(3.0).to(dtype), [1, 1])


@pytest.mark.parametrize("source, target", [(torch.float32, torch.int32), (torch.float32, torch.uint8), (torch.int16, torch.int64), (torch.bool, torch.uint8), (torch.float64, torch.int64), (torch.bfloat16, torch.int16)])
def test_view_dtype(source, target):
    check(aten.view.dtype, sample((3, 8), source), target)


def test_view_as_real_and_complex():
    value = torch.randn(3, 4, dtype=torch.complex64)
    check(aten.view_as_real.default, value)
    check(aten.view_as_complex.default, torch.randn(3, 4, 2, dtype=torch.float64))


@pytest.mark.parametrize("op", [aten.alias.default, aten.detach.default, aten.alias_copy.default])
def test_identity_views(op):
    check(op, sample((2, 3)))


def test_neg_view():
    check(aten._neg_view.default, torch.randn(3, dtype=torch.complex64))


@pytest.mark.parametrize("start, end", [(0, -1), (1, 2), (-2, -1), (0, 0)])
def test_flatten(start, end):
    check(aten.flatten.using_ints, sample((2, 3, 4)), start, end)


# ---------------------------------------------------------------- dim permutations


@pytest.mark.parametrize("dtype", DTYPES)
def test_transpose_and_permute(dtype):
    value = sample((2, 3, 4), dtype)
    check(aten.transpose.int, value, 0, 2)
    check(aten.transpose.int, value, -1, 1)
    check(aten.transpose_copy.int, value, 0, -2)
    check(aten.permute.default, value, [2, 0, 1])
    check(aten.permute.default, value, [-1, -3, -2])
    check(aten.permute_copy.default, value, [1, 0, 2])
    check(aten.t.default, sample((3, 5), dtype))
    check(aten.t.default, sample((5,), dtype))
    check(aten.transpose.int, torch.tensor(1.0), 0, -1)


def test_movedim():
    value = sample((2, 3, 4, 5))
    check(aten.movedim.int, value, 0, -1)
    check(aten.movedim.intlist, value, [0, 1], [-1, 0])


# ---------------------------------------------------------------- adding and removing dims


def test_expand():
    value = sample((3, 1))
    check(aten.expand.default, value, [3, 4])
    check(aten.expand.default, value, [2, -1, 5])
    check(aten.expand.default, torch.tensor(2.0), [2, 3])
    check(aten.expand_copy.default, value, [2, 3, 4])


def test_squeeze_and_unsqueeze():
    value = sample((1, 3, 1, 4))
    check(aten.squeeze.default, value)
    check(aten.squeeze.dim, value, 0)
    check(aten.squeeze.dim, value, 1)  # not of size one: unchanged
    check(aten.squeeze.dim, value, -2)
    check(aten.squeeze.dims, value, [0, 2])
    check(aten.squeeze.dims, value, [-4, 1])
    check(aten.squeeze.dims, value, [])
    check(aten.squeeze.dim, torch.tensor(1.0), 0)
    check(aten.squeeze_copy.dims, value, [0])
    for dim in (0, 2, 4, -1, -5):
        check(aten.unsqueeze.default, value, dim)
    check(aten.unsqueeze.default, torch.tensor(1.0), -1)


# ---------------------------------------------------------------- slicing


@pytest.mark.parametrize(
    "dim, start, end, step",
    [(0, None, None, 1), (1, 1, 4, 2), (1, -3, None, 1), (-1, None, -1, 3), (1, 2, 100, 1), (1, -100, 2, 1), (1, 4, 2, 1), (0, 0, 9223372036854775807, 1), (1, 6, None, 1)],
)
def test_slice(dim, start, end, step):
    value = sample((3, 5, 4))
    check(aten.slice.Tensor, value, dim, start, end, step)
    check(aten.slice_copy.Tensor, value, dim, start, end, step)


@pytest.mark.parametrize("dim, index", [(0, 0), (0, -1), (1, 2), (-1, -3)])
def test_select(dim, index):
    check(aten.select.int, sample((3, 4, 5)), dim, index)


def test_narrow():
    value = sample((4, 6))
    check(aten.narrow.default, value, 1, 2, 3)
    check(aten.narrow.default, value, -1, -3, 2)
    check(aten.narrow.Tensor, value, 0, torch.tensor(1), 2)


@pytest.mark.parametrize("offset, dim1, dim2", [(0, 0, 1), (1, 0, 1), (-2, 0, 1), (0, 2, 0), (1, -1, -2), (10, 0, 1)])
def test_diagonal(offset, dim1, dim2):
    check(aten.diagonal.default, sample((4, 5, 3)), offset, dim1, dim2)


@pytest.mark.parametrize("dimension, size, step", [(0, 2, 1), (1, 3, 2), (-1, 4, 4), (1, 5, 1)])
def test_unfold(dimension, size, step):
    check(aten.unfold.default, sample((4, 5, 8)), dimension, size, step)


@pytest.mark.parametrize(
    "shape, size, stride, offset",
    [((4, 5), (5, 4), (1, 5), None), ((20,), (3, 3), (4, 1), 2), ((2, 6), (2, 2, 3), (6, 1, 2), 0), ((10,), (4,), (0,), 3)],
)
def test_as_strided(shape, size, stride, offset):
    check(aten.as_strided.default, sample(shape), size, stride, offset)


# ---------------------------------------------------------------- splitting


def test_split_family():
    value = sample((7, 4))
    check(aten.split.Tensor, value, 3)
    check(aten.split.Tensor, value, 2, 1)
    check(aten.split.Tensor, value, 10)
    check(aten.split_with_sizes.default, value, [2, 0, 5])
    check(aten.split_with_sizes.default, value, [1, 3], -1)
    check(aten.split_with_sizes_copy.default, value, [4, 3])
    check(aten.unbind.int, value)
    check(aten.unbind.int, value, -1)
    check(aten.chunk.default, value, 3)
    check(aten.chunk.default, value, 2, 1)


# ---------------------------------------------------------------- joining


def test_cat():
    first, second = sample((2, 3)), sample((4, 3), torch.float64)
    check(aten.cat.default, [first, second])
    check(aten.cat.default, [first, first], -1)
    check(aten.cat.default, [first, torch.empty(0), first])
    check(aten.cat.default, [sample((2, 3), torch.int64), first], 0)
    check(aten.cat.default, [torch.empty(0), torch.empty(0)])


def test_stack():
    first, second = sample((2, 3)), sample((2, 3), torch.int64)
    check(aten.stack.default, [first, second])
    check(aten.stack.default, [first, first], -1)
    check(aten.stack.default, [first, first], 1)
    check(aten.hstack.default, [first, first])
    check(aten.vstack.default, [sample((3,)), sample((3,))])


# ---------------------------------------------------------------- reordering and repeating


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_flip_roll_repeat(dtype):
    value = sample((3, 4, 2), dtype)
    check(aten.flip.default, value, [0])
    check(aten.flip.default, value, [-1, 1])
    check(aten.roll.default, value, [1], [0])
    check(aten.roll.default, value, [-2, 5], [1, -1])
    check(aten.roll.default, value, [3])
    check(aten.repeat.default, value, [2, 1, 3])
    check(aten.repeat.default, value, [2, 1, 1, 2])


@pytest.mark.parametrize("diagonal", [0, 1, -1, 5])
def test_tril_triu(diagonal):
    value = sample((2, 4, 5))
    check(aten.tril.default, value, diagonal)
    check(aten.triu.default, value, diagonal)


# ---------------------------------------------------------------- padding


@pytest.mark.parametrize("pad", [[1, 2], [0, 1, 2, 0], [-1, 2], [1, 1, -1, 0, 2, 2]])
def test_constant_pad(pad):
    check(aten.constant_pad_nd.default, sample((2, 3, 4)), pad, 1.5)
    check(aten.constant_pad_nd.default, sample((2, 3, 4), torch.int64), pad)


def test_reflection_and_replication_pads():
    check(aten.reflection_pad1d.default, sample((2, 3, 6)), [2, 3])
    check(aten.reflection_pad2d.default, sample((2, 3, 5, 6)), [1, 2, 3, 0])
    check(aten.reflection_pad3d.default, sample((1, 2, 3, 4, 5)), [1, 1, 2, 0, 1, 2])
    check(aten.replication_pad1d.default, sample((3, 6)), [2, 3])
    check(aten.replication_pad2d.default, sample((2, 3, 5, 6)), [4, 2, 3, 0])
    check(aten.replication_pad3d.default, sample((1, 2, 3, 4, 5)), [1, 3, 2, 0, 1, 2])


def test_pad_backwards():
    value = sample((2, 3, 6))
    grad = sample((2, 3, 11))
    check(aten.reflection_pad1d_backward.default, grad, value, [2, 3])
    check(aten.replication_pad1d_backward.default, grad, value, [2, 3])
    value = sample((2, 3, 4, 5))
    grad = sample((2, 3, 7, 8))
    check(aten.reflection_pad2d_backward.default, grad, value, [1, 2, 3, 0])
    check(aten.replication_pad2d_backward.default, grad, value, [1, 2, 3, 0])


# ---------------------------------------------------------------- backward of views and their scatters


def test_view_backwards():
    check(aten.slice_backward.default, sample((3, 2)), [3, 5], 1, 1, 5, 2)
    check(aten.slice_backward.default, sample((2, 5)), [4, 5], 0, -2, 9223372036854775807, 1)
    check(aten.select_backward.default, sample((3,)), [3, 5], 1, -2)
    check(aten.diagonal_backward.default, sample((2, 4)), [2, 4, 5], 1, 1, 2)
    check(aten.diagonal_backward.default, sample((5, 2)), [4, 5, 3], -1, 2, 0)
    check(aten.unfold_backward.default, sample((2, 3, 4)), [2, 8], 1, 4, 2)
    check(aten.unfold_backward.default, sample((3, 2, 2)), [3, 5], -1, 2, 2)


def test_scatters():
    base = sample((4, 5))
    check(aten.slice_scatter.default, base, sample((4, 2)), 1, 1, None, 2)
    check(aten.select_scatter.default, base, sample((5,)), 0, -1)
    check(aten.diagonal_scatter.default, base, sample((3,)), 2)
    check(aten.diagonal_scatter.default, base, sample((4,)), -1, 1, 0)
    check(aten.as_strided_scatter.default, base, sample((2, 2)), [2, 2], [1, 5], 1)


# ---------------------------------------------------------------- through the bridge: values, in-place writes and gradients


F = torch.nn.functional

VIEW_FUNCTIONS = {
    "view": lambda x: x.view(6, 4),
    "reshape_copy": lambda x: x.transpose(0, 1).reshape(-1),
    "transpose": lambda x: x.transpose(0, 2),
    "t": lambda x: x[0].t(),
    "permute": lambda x: x.permute(2, 0, 1),
    "movedim": lambda x: x.movedim(0, -1),
    "flatten": lambda x: x.flatten(1),
    "expand": lambda x: x[:, :1].expand(2, 5, 4),
    "expand_new_dims": lambda x: x.expand(3, 2, 3, 4),
    "squeeze_unsqueeze": lambda x: x[:, :1].squeeze(1).unsqueeze(-1),
    "slice": lambda x: x[1:, ::2, -3:-1],
    "select": lambda x: x[1, :, -1],
    "narrow": lambda x: x.narrow(2, 1, 2),
    "split": lambda x: x.split(2, dim=2)[1],
    "split_sizes": lambda x: x.split([1, 3], dim=2)[1],
    "chunk": lambda x: x.chunk(2, dim=1)[0],
    "unbind": lambda x: x.unbind(1)[2],
    "diagonal": lambda x: x.diagonal(1, 1, 2),
    "unfold": lambda x: x.unfold(2, 2, 1),
    "as_strided": lambda x: x.as_strided((3, 3), (2, 1), 1),
    "cat": lambda x: torch.cat([x, x[:, :1] * 2], dim=1),
    "stack": lambda x: torch.stack([x, x.flip(0)], dim=-1),
    "flip": lambda x: x.flip(0, 2),
    "roll": lambda x: x.roll(1, 2),
    "repeat": lambda x: x.repeat(2, 1, 1, 2),
    "tile": lambda x: x.tile(2),
    "tril": lambda x: x.tril(1),
    "triu": lambda x: x.triu(-1),
    "pad_constant": lambda x: F.pad(x, (1, 2, 0, 1), value=0.5),
    "pad_reflect": lambda x: F.pad(x, (2, 1), mode="reflect"),
    "pad_reflect_2d": lambda x: F.pad(x[None], (1, 2, 2, 1), mode="reflect"),
    "pad_replicate": lambda x: F.pad(x, (2, 3), mode="replicate"),
    "pad_circular": lambda x: F.pad(x, (1, 2), mode="circular"),
}


@pytest.mark.parametrize("name", sorted(VIEW_FUNCTIONS))
def test_gradients_through_bridge(bridged, name):
    through_bridge(VIEW_FUNCTIONS[name], sample((2, 3, 4)))


def test_in_place_writes_through_views(bridged):
    def write(x):
        x = x.clone()
        x[:, 0] += 1
        x[1, 1:3, ::2] = 7.0
        x.transpose(0, 2)[0].mul_(2)
        x.diagonal(0, 1, 2).zero_()
        return x

    through_bridge(write, sample((2, 3, 4)))


def test_reflection_pad_with_negative_widths_crops():
    values = sample((1, 3, 4, 4))
    check(aten.reflection_pad2d.default, values, [-1, 1, -2, 1])
    check(aten.reflection_pad1d.default, sample((2, 5)), [2, -3])


def test_slices_at_new_offsets_share_one_program(bridged):
    """A loop's slices at ever new offsets (pytorch/examples' `source[i:i + 35]`) reuse one
    compiled program per shape: the offset is its argument, not part of it."""
    from bridge.op_mappings import shapes

    source = torch.arange(400.0).reshape(100, 4)
    on_bridge = source.cuda()
    before = shapes._offset_part._cache_size()
    for start in range(1, 60, 7):
        torch.testing.assert_close(on_bridge[start : start + 35].cpu(), source[start : start + 35])
        torch.testing.assert_close(on_bridge[start : start + 35 : 3].cpu(), source[start : start + 35 : 3])
        torch.testing.assert_close(on_bridge.narrow(0, start, 5).cpu(), source.narrow(0, start, 5))
        torch.testing.assert_close(on_bridge[start].cpu(), source[start])
        torch.testing.assert_close(on_bridge[:, start % 4].cpu(), source[:, start % 4])
    # One program for each distinct (shape, dim, length, step): five, whatever the offsets.
    assert shapes._offset_part._cache_size() - before <= 5
