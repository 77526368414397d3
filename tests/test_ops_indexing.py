"""Indexing and factory mappings against eager torch: values of each entry called directly, and gradients through the bridge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge.runtime.registry import MAPPINGS
from op_testing import check, to_jax, to_torch, through_bridge
from op_testing import run_mapping as run
from op_testing import seeded_sample as sample

aten = torch.ops.aten


def positions(high, shape, seed=1):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def distinct(shape, dtype=torch.float32):
    """Values without ties, so that sort orders are unique."""
    count = int(np.prod(shape))
    return torch.randperm(count, generator=torch.Generator().manual_seed(2)).reshape(shape).to(dtype)


# ---------------------------------------------------------------- advanced indexing


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_index(dtype):
    value = sample((4, 5, 6), dtype)
    first, second = torch.tensor([0, 3, -1]), torch.tensor([[1, 2, 4]])
    check(aten.index.Tensor, value, [first])
    check(aten.index.Tensor, value, [None, first])
    check(aten.index.Tensor, value, [first, None, first])  # not adjacent: result dims go first
    check(aten.index.Tensor, value, [None, second, first])
    check(aten.index.Tensor, value, [first.to(torch.int32), second])
    # Bool masks give data-dependent shapes: eager only.
    check(aten.index.Tensor, value, [sample((4,), torch.bool)], eager=True)
    check(aten.index.Tensor, value, [None, sample((5, 6), torch.bool)], eager=True)
    check(aten.index.Tensor, value, [sample((4, 5), torch.bool), torch.tensor([1])], eager=True)
    check(aten._unsafe_index.Tensor, value, [None, None, first])


@pytest.mark.parametrize("accumulate", [False, True])
def test_index_put(accumulate):
    value = sample((4, 5, 6))
    first = torch.tensor([0, 3, 1])
    check(aten.index_put.default, value, [first], sample((3, 5, 6), seed=3), accumulate)
    check(aten.index_put.default, value, [None, first, first], sample((3,), seed=3), accumulate)
    check(aten.index_put.default, value, [first, None, torch.tensor([2])], torch.tensor(7.0), accumulate)
    # Bool masks: the traceable `where` path (values constant along the mask) and the general one.
    mask = sample((4, 5), torch.bool)
    check(aten.index_put.default, value, [mask], torch.tensor(2.5), accumulate)
    check(aten.index_put.default, value, [mask], sample((6,), seed=4), accumulate)
    check(aten.index_put.default, value, [None, sample((5,), torch.bool)], sample((4, 1, 6), seed=4), accumulate)
    count = int(mask.sum())
    check(aten.index_put.default, value, [mask], sample((count, 6), seed=5), accumulate, eager=True)
    check(aten._unsafe_index_put.default, value, [first], torch.tensor(1.0), accumulate)


def test_index_put_accumulates_repeats():
    check(aten.index_put.default, torch.zeros(5, dtype=torch.float64), [torch.tensor([1, 1, 3, 1])], torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64), True)
    check(aten.index_put.default, torch.zeros(3, 2, dtype=torch.int64), [torch.tensor([2, 2])], torch.tensor([[1, 2], [3, 4]]), True)


def test_index_put_mask_is_traceable():
    value, mask = sample((4, 5)), sample((4, 5), torch.bool)
    traced = jax.jit(lambda value, mask: MAPPINGS[aten.index_put.default].call(value, [mask], jnp.asarray(3.0, jnp.float32)))
    torch.testing.assert_close(to_torch(traced(*to_jax((value, mask)))), value.masked_fill(mask, 3.0))


def test_unsafe_masked_index():
    value = sample((4, 5))
    rows = torch.tensor([0, 3, 4, -1])
    mask = torch.tensor([True, True, False, False])
    expected = torch.where(mask, value[rows.clamp(-4, 3)][:, 0], 0.0)
    torch.testing.assert_close(run(aten._unsafe_masked_index.default, value, mask[:, None], [rows, None], 0.0)[:, 0], expected)


# ---------------------------------------------------------------- index_* ops along one dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_index_ops(dtype):
    value = sample((5, 4, 3), dtype)
    index = torch.tensor([4, 0, 2, 0])
    check(aten.index_select.default, value, 1, torch.tensor([3, 3, 0]))
    check(aten.index_select.default, value, -1, torch.tensor(1))
    check(aten.index_add.default, value, 0, index, sample((4, 4, 3), dtype, seed=5))
    check(aten.index_add.default, value, 1, torch.tensor([1, 1]), sample((5, 2, 3), dtype, seed=5), alpha=2)
    check(aten.index_copy.default, value, 0, torch.tensor([4, 1]), sample((2, 4, 3), dtype, seed=5))
    check(aten.index_copy.default, value, -1, torch.tensor([2]), sample((5, 4, 1), dtype, seed=5))
    check(aten.index_fill.int_Scalar, value, 1, torch.tensor([0, 2]), 3)
    check(aten.index_fill.int_Tensor, value, 2, torch.tensor([1]), torch.tensor(-1).to(dtype))


# ---------------------------------------------------------------- gather and scatter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64])
def test_gather(dtype):
    value = sample((4, 5, 3), dtype)
    check(aten.gather.default, value, 1, positions(5, (4, 7, 3)))
    check(aten.gather.default, value, 0, positions(4, (2, 3, 1)))  # smaller than self in the other dims
    check(aten.gather.default, value, -1, positions(3, (4, 5, 2)))
    check(aten.gather.default, torch.tensor(2.0).to(dtype), 0, torch.tensor(0))


def unique_positions(high, shape, dim):
    """Scatter indices without repeats along `dim`, so that plain scatter has one answer."""
    generator = torch.Generator().manual_seed(7)
    columns = [torch.randperm(high, generator=generator)[: shape[dim]] for _ in range(int(np.prod(shape)) // shape[dim])]
    moved = torch.stack(columns, -1).reshape((shape[dim],) + tuple(size for axis, size in enumerate(shape) if axis != dim))
    return moved.movedim(0, dim).contiguous()


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_scatter(dtype):
    value = sample((5, 4), dtype)
    index = unique_positions(5, (3, 2), 0)
    source = sample((4, 3), dtype, seed=9)
    check(aten.scatter.src, value, 0, index, source)
    check(aten.scatter.value, value, 0, index, 7)
    check(aten.scatter.src, value, -1, unique_positions(4, (5, 3), 1), source.repeat(2, 1))
    repeated = positions(5, (3, 4))
    check(aten.scatter.reduce, value, 0, repeated, source.repeat(1, 2), reduce="add")
    check(aten.scatter.value_reduce, value, 0, repeated, 2, reduce="multiply")
    check(aten.scatter_add.default, value, 0, repeated, source.repeat(1, 2))
    check(aten.scatter_add.default, value, 1, positions(4, (5, 6)), sample((5, 6), dtype, seed=9))
    check(aten.scatter.src, torch.tensor(1.0).to(dtype), 0, torch.tensor(0), torch.tensor(5.0).to(dtype))


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
def test_scatter_reduce(reduce):
    for dtype in (torch.float32, torch.int64):
        value = sample((5, 4), dtype)
        source = sample((6, 4), dtype, seed=11)
        for include_self in (True, False):
            check(aten.scatter_reduce.two, value, 0, positions(5, (6, 4)), source, reduce, include_self=include_self)
    check(aten.scatter_reduce.two, value, 1, positions(4, (5, 3)), source, reduce, include_self=False)


def test_bool_accumulation_is_logical():
    # torch accumulates bools as logical or (sums) and logical and (products).
    value, source = sample((5, 4), torch.bool), sample((6, 4), torch.bool, seed=11)
    index = positions(5, (6, 4))
    check(aten.scatter_add.default, value, 0, index, source)
    for reduce in ("sum", "prod"):
        for include_self in (True, False):
            check(aten.scatter_reduce.two, value, 0, index, source, reduce, include_self=include_self)
    flat_positions = positions(20, (9,))
    check(aten.put.default, value, flat_positions, sample((9,), torch.bool, seed=3), True)


# ---------------------------------------------------------------- masked and flat selection


def test_masked_scatter():
    value = sample((3, 4))
    mask = sample((3, 4), torch.bool)
    check(aten.masked_scatter.default, value, mask, sample((20,), seed=3))
    check(aten.masked_scatter.default, value, sample((4,), torch.bool), sample((3, 4), seed=3))
    check(aten.masked_scatter_backward.default, sample((3, 4), seed=4), mask, [4, 5])


def test_take_put_nonzero_masked_select():
    value = sample((3, 4))
    check(aten.take.default, value, torch.tensor([[0, 11], [-1, 5]]))
    check(aten.put.default, value, torch.tensor([0, -1, 5]), torch.tensor([1.0, 2.0, 3.0]))
    check(aten.put.default, value, torch.tensor([1, 1, 5]), torch.tensor([1.0, 2.0, 3.0]), True)
    check(aten.nonzero.default, sample((3, 4, 2), torch.bool), eager=True)
    check(aten.nonzero.default, torch.tensor(3.0), eager=True)
    check(aten.nonzero.default, torch.tensor([0, 2, 0, 1]), eager=True)
    check(aten.nonzero_static.default, torch.tensor([0, 2, 0, 1]), size=4)
    check(aten.nonzero_static.default, torch.tensor([[0, 2], [3, 1]]), size=2, fill_value=-5)
    check(aten.where.default, sample((3, 4), torch.bool), eager=True)
    check(aten.masked_select.default, value, sample((3, 4), torch.bool), eager=True)
    check(aten.masked_select.default, value, sample((4,), torch.bool), eager=True)


# ---------------------------------------------------------------- embedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding(dtype):
    weight = sample((10, 3), dtype)
    indices = torch.tensor([[1, 2, 1], [9, 0, 1]])
    check(aten.embedding.default, weight, indices)
    grad = sample((2, 3, 3), dtype, seed=4)
    check(aten.embedding_dense_backward.default, grad, indices, 10, -1, False)
    check(aten.embedding_dense_backward.default, grad, indices, 10, 1, False)
    check(aten.embedding_dense_backward.default, grad, indices, 10, -1, True)
    check(aten.embedding_dense_backward.default, grad, indices.to(torch.int32), 10, 2, True)


def test_embedding_renorm():
    weight = sample((6, 3)) * 3
    check(aten.embedding_renorm.default, weight, torch.tensor([[0, 2], [2, 5]]), 1.5, 2.0)
    check(aten.embedding_renorm.default, weight, torch.tensor([1, 3]), 2.0, 1.0)


def test_repeat_interleave():
    repeats = torch.tensor([1, 0, 3, 2])
    check(aten.repeat_interleave.Tensor, repeats, output_size=6)
    check(aten.repeat_interleave.Tensor, repeats, eager=True)


# ---------------------------------------------------------------- sorting


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_sort(dtype):
    value = distinct((4, 6), dtype)
    check(aten.sort.default, value)
    check(aten.sort.default, value, 0, True)
    check(aten.argsort.default, value, -1, True)
    check(aten.argsort.stable, value, stable=True, dim=0)
    ties = torch.tensor([[3, 1, 3, 1, 2], [0, 0, 0, 1, 1]]).to(dtype)
    check(aten.sort.stable, ties, stable=True)
    check(aten.sort.stable, ties, stable=True, descending=True)
    check(aten.sort.default, torch.tensor(2).to(dtype))


def test_sort_nan():
    value = torch.tensor([3.0, float("nan"), -1.0, float("inf"), float("-inf")])
    check(aten.sort.stable, value, stable=True)
    check(aten.sort.stable, value, stable=True, descending=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("largest", [True, False])
def test_topk_kthvalue(dtype, largest):
    value = distinct((4, 7), dtype)
    check(aten.topk.default, value, 3, -1, largest)
    check(aten.topk.default, value, 2, 0, largest)
    check(aten.topk.default, value, 7, 1, largest)
    check(aten.kthvalue.default, value, 3)
    check(aten.kthvalue.default, value, 2, 0, True)


# ---------------------------------------------------------------- searching


@pytest.mark.parametrize("right", [False, True])
def test_searchsorted_bucketize(right):
    boundaries = torch.tensor([1.0, 3.0, 3.0, 5.0, 9.0])
    values = torch.tensor([[0.0, 3.0, 4.0], [9.0, 10.0, 1.0]])
    check(aten.searchsorted.Tensor, boundaries, values, right=right)
    check(aten.searchsorted.Tensor, boundaries, values, side="right" if right else "left", out_int32=True)
    check(aten.searchsorted.Scalar, boundaries, 3.0, right=right)
    batched = torch.sort(sample((2, 3, 6)), -1)[0]
    check(aten.searchsorted.Tensor, batched, sample((2, 3, 4), seed=5), right=right)
    shuffled = torch.tensor([5.0, 1.0, 9.0, 3.0])
    check(aten.searchsorted.Tensor, shuffled, values, right=right, sorter=torch.argsort(shuffled))
    check(aten.bucketize.Tensor, values, boundaries, right=right)
    check(aten.bucketize.Scalar, 3.0, boundaries, right=right, out_int32=True)


# ---------------------------------------------------------------- unique


def test_unique():
    value = torch.tensor([[3, 1, 3], [2, 2, 1]])
    check(aten._unique2.default, value, True, False, False, eager=True)
    check(aten._unique2.default, value, True, True, True, eager=True)
    check(aten.unique_dim.default, torch.tensor([[3, 1], [2, 2], [3, 1]]), 0, True, True, True, eager=True)
    check(aten.unique_consecutive.default, torch.tensor([1, 1, 2, 2, 3, 1, 1]), True, True, eager=True)
    check(aten.unique_consecutive.default, torch.tensor([1, 1, 2, 2, 3, 1, 1]), False, False, eager=True)
    check(aten.unique_consecutive.default, torch.tensor([[1, 1, 2], [1, 1, 2]]), False, False, 1, eager=True)


# ---------------------------------------------------------------- factories (op_mappings.factories)


@pytest.mark.parametrize("dtype", [None, torch.int64])
def test_constant_factories(dtype):
    check(aten.zeros.default, [2, 3], dtype=dtype)
    check(aten.ones.default, [4], dtype=dtype)
    check(aten.full.default, [2, 2], 1, dtype=dtype)
    torch.testing.assert_close(run(aten.empty.memory_format, [3, 1], dtype=dtype), torch.zeros(3, 1, dtype=dtype))
    torch.testing.assert_close(run(aten.empty_strided.default, [3, 2], [1, 3], dtype=dtype), torch.zeros(3, 2, dtype=dtype))
    check(aten.scalar_tensor.default, 3, dtype=dtype)
    check(aten.eye.default, 3, dtype=dtype)
    check(aten.eye.m, 2, 4, dtype=dtype)
    value = sample((2, 3), torch.float64)
    check(aten.zeros_like.default, value, dtype=dtype)
    check(aten.ones_like.default, value, dtype=dtype)
    check(aten.full_like.default, value, 2, dtype=dtype)
    check(aten.new_zeros.default, value, [1, 4], dtype=dtype)
    check(aten.new_ones.default, value, [5], dtype=dtype)
    check(aten.new_full.default, value, [2], 0, dtype=dtype)
    torch.testing.assert_close(run(aten.new_empty.default, value, [2], dtype=dtype), torch.zeros(2, dtype=dtype or torch.float64))
    torch.testing.assert_close(run(aten.empty_like.default, value, dtype=dtype), torch.zeros(2, 3, dtype=dtype or torch.float64))


@pytest.mark.parametrize("fill", [True, 3, 2.5, 1 + 2j])
def test_full_infers_dtype(fill):
    check(aten.full.default, [2], fill)


def test_default_dtype_is_followed():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        check(aten.zeros.default, [2])
        check(aten.full.default, [2], 0.5)
        check(aten.arange.start_step, 0, 1, 0.25)
        check(aten.linspace.default, 0, 1, 5)
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize(
    "args, dtype",
    [((5,), None), ((2.5,), None), ((-3, 5, 2.5), None), ((0, 1, 0.1), None), ((10, 0, -3), None), ((0.5, 5, 1.5), torch.int64), ((0, 10, 3), torch.float32), ((1, 2, 0.1), torch.float64), ((0, 4), torch.bfloat16), ((3, 3), None)],
)
def test_arange(args, dtype):
    op = {1: aten.arange.default, 2: aten.arange.start, 3: aten.arange.start_step}[len(args)]
    check(op, *args, dtype=dtype)


@pytest.mark.parametrize("dtype", [None, torch.int64])
def test_linspace_logspace(dtype):
    check(aten.linspace.default, -7, 7, 6, dtype=dtype)
    check(aten.linspace.default, 0, 1, 1, dtype=dtype)
    check(aten.linspace.default, 0, 1, 0, dtype=dtype)
    check(aten.linspace.default, 0.1, 3.3, 17, dtype=dtype)
    check(aten.linspace.Tensor_Tensor, torch.tensor(0.0), torch.tensor(3.0), 4, dtype=dtype)
    check(aten.linspace.Scalar_Tensor, 1, torch.tensor(3.0), 5, dtype=dtype)
    check(aten.logspace.default, 0, 2, 5, dtype=dtype)
    check(aten.logspace.default, -1, 1, 4, 2.0, dtype=dtype)
    check(aten.logspace.Tensor_Scalar, torch.tensor(1.0), 2, 3, dtype=dtype)


@pytest.mark.parametrize("row, col, offset", [(3, 3, 0), (3, 4, 1), (4, 3, -1), (1, 5, -2)])
def test_tril_triu_indices(row, col, offset):
    check(aten.tril_indices.default, row, col, offset)
    check(aten.triu_indices.default, row, col, offset)


def test_local_scalar_dense_and_lift():
    for value in (torch.tensor(2.5), torch.tensor(3), torch.tensor(True), torch.tensor(1 + 2j)):
        result = run(aten._local_scalar_dense.default, value, eager=True)
        assert type(result) is type(value.item()) and result == value.item()
    check(aten.lift_fresh.default, sample((2,)))


# ---------------------------------------------------------------- through the bridge: values, in-place writes and gradients


F = torch.nn.functional
ROWS = torch.tensor([0, 3, 3, 1])
MASK = sample((4, 5), torch.bool)

INDEXING_FUNCTIONS = {
    "index": lambda x, rows, mask: x[rows],
    "index_middle": lambda x, rows, mask: x[1:, rows],
    "index_pair": lambda x, rows, mask: x[rows, rows + 1],
    "index_mask": lambda x, rows, mask: x[mask],
    "index_select": lambda x, rows, mask: x.index_select(1, rows),
    "gather": lambda x, rows, mask: x.gather(1, rows.expand(4, 4)),
    "take_along_dim": lambda x, rows, mask: torch.take_along_dim(x, rows[:, None], 1),
    "take": lambda x, rows, mask: x.take(rows * 3),
    "masked_select": lambda x, rows, mask: x.masked_select(mask),
    "scatter": lambda x, rows, mask: x.scatter(0, torch.tensor([[0, 1, 2, 3, 0]], device=x.device), x[:1] * 3),
    "scatter_add": lambda x, rows, mask: x.scatter_add(1, rows.expand(4, 4), x[:, :4]),
    "index_put_accumulate": lambda x, rows, mask: x.index_put((rows,), x[:4] * 2, accumulate=True),
    "index_add": lambda x, rows, mask: x.index_add(0, rows, x * 3),
    "masked_fill_by_index": lambda x, rows, mask: x.index_put((mask,), torch.tensor(0.0, device=x.device)),
    "masked_scatter": lambda x, rows, mask: x.masked_scatter(mask, x * 2),
    "sort": lambda x, rows, mask: x.sort(1)[0],
    "sort_descending": lambda x, rows, mask: x.sort(0, descending=True)[0],
    "topk": lambda x, rows, mask: x.topk(2, 1)[0],
    "topk_smallest": lambda x, rows, mask: x.topk(3, 0, largest=False)[0],
    "kthvalue": lambda x, rows, mask: x.kthvalue(2, 1)[0],
    "embedding": lambda x, rows, mask: F.embedding(rows[None], x),
    "embedding_padding": lambda x, rows, mask: F.embedding(rows[None], x, padding_idx=3),
    "embedding_scaled": lambda x, rows, mask: F.embedding(rows[None], x, scale_grad_by_freq=True),
    "repeat_interleave": lambda x, rows, mask: x.repeat_interleave(rows, dim=0, output_size=7),
}


@pytest.mark.parametrize(
    "name",
    sorted(INDEXING_FUNCTIONS),
)
def test_gradients_through_bridge(bridged, name):
    through_bridge(INDEXING_FUNCTIONS[name], sample((4, 5)), ROWS, MASK)


def test_in_place_indexing_through_bridge(bridged):
    def write(x, rows, mask):
        x = x.clone()
        x[mask] = 0.5
        x[rows, 1] += 2.0
        x.index_fill_(1, torch.tensor([4], device=x.device), -1.0)
        x.scatter_(0, torch.tensor([[3, 2]], device=x.device), 9.0)
        x.index_put_((rows,), torch.ones(5, device=x.device), accumulate=True)
        return x

    through_bridge(write, sample((4, 5)), ROWS, MASK)


def test_factories_and_item_through_bridge(bridged):
    from bridge.runtime.tensor import to_torch as bridge_to_torch

    device = torch.device("cuda")
    torch.testing.assert_close(bridge_to_torch(torch.arange(2, 9, 3, device=device)), torch.arange(2, 9, 3))
    torch.testing.assert_close(bridge_to_torch(torch.linspace(0, 1, 7, device=device)), torch.linspace(0, 1, 7))
    torch.testing.assert_close(bridge_to_torch(torch.full((2, 3), 1.5, device=device)), torch.full((2, 3), 1.5))
    torch.testing.assert_close(bridge_to_torch(torch.eye(3, 4, device=device)), torch.eye(3, 4))
    torch.testing.assert_close(bridge_to_torch(torch.tensor([1.0, 2.0], device=device)), torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(bridge_to_torch(torch.tril_indices(3, 3, device=device)), torch.tril_indices(3, 3))
    assert torch.tensor(2.5, device=device).item() == 2.5
    assert torch.tensor(7, device=device).item() == 7
    ones = torch.ones(2, 3, device=device, dtype=torch.float64)
    torch.testing.assert_close(bridge_to_torch(ones.new_zeros(4)), torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(bridge_to_torch(torch.zeros_like(ones, dtype=torch.int64)), torch.zeros(2, 3, dtype=torch.int64))


def test_data_dependent_ops_through_bridge(bridged):
    from bridge.runtime.tensor import to_bridge
    from bridge.runtime.tensor import to_torch as bridge_to_torch

    value = torch.tensor([[3, 0, 3], [1, 0, 2]])
    bridged_value = to_bridge(value)
    torch.testing.assert_close(bridge_to_torch(bridged_value.nonzero()), value.nonzero())
    for expected, actual in zip(torch.where(value > 1), torch.where(bridged_value > 1)):
        torch.testing.assert_close(bridge_to_torch(actual), expected)
    for expected, actual in zip(torch.unique(value, return_inverse=True, return_counts=True), torch.unique(bridged_value, return_inverse=True, return_counts=True)):
        torch.testing.assert_close(bridge_to_torch(actual), expected)
    torch.testing.assert_close(bridge_to_torch(F.one_hot(bridged_value.flatten(), 4)), F.one_hot(value.flatten(), 4))


def test_empty_and_zero_dim_samples():
    values = sample((5,))
    check(aten.gather.default, values, 0, torch.zeros(2, 0, dtype=torch.int64))  # an empty index of another rank
    check(aten.scatter_add.default, values, 0, torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0))
    check(aten.masked_select.default, torch.tensor(3.0), torch.tensor(True), eager=True)
    check(aten.nonzero_static.default, torch.zeros(5, 0, 5), size=3)
    empty = torch.zeros(0, 0, 0)
    check(aten.searchsorted.Tensor, empty, empty, right=True)
    check(aten.unique_consecutive.default, torch.zeros(5, 0, 5), dim=1, eager=True)


def test_bool_accumulation_is_a_logical_or():
    target = torch.tensor([True, False, False, True, False])
    source = torch.tensor([False, True, False, False])
    index = torch.tensor([0, 1, 1, 4])
    check(aten.index_add.default, target, 0, index, source)
    check(aten.index_add.default, target, 0, index, source, alpha=False)
    check(aten.index_put.default, target, [index], source, True)
    check(aten.scatter.reduce, target, 0, index, source, reduce="add")
