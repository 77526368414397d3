"""Special-function and order-statistic mappings against eager torch: values (special cases
included), result dtypes, and gradients through the bridge with no CPU fallback."""

import pytest
import torch

from op_testing import check, through_bridge

aten = torch.ops.aten

# Points around each function's branch boundaries (5 for J/Y, 2 and 8 for I/K, +-2.09 and 8.32 for
# Ai), poles, zeros and non-finite values.
POINTS = [-30.0, -8.5, -5.0, -2.09, -2.0, -1.5, -1.0, -0.5, -1e-6, 0.0, 1e-6, 0.5, 1.0, 2.0, 2.09, 4.99, 5.0,
          5.01, 8.0, 8.3203353, 9.5, 30.0, 110.0, float("inf"), float("-inf"), float("nan")]

UNARY = [
    aten.special_bessel_j0.default, aten.special_bessel_j1.default, aten.special_bessel_y0.default,
    aten.special_bessel_y1.default, aten.special_modified_bessel_i0.default, aten.special_modified_bessel_i1.default,
    aten.special_modified_bessel_k0.default, aten.special_modified_bessel_k1.default,
    aten.special_scaled_modified_bessel_k0.default, aten.special_scaled_modified_bessel_k1.default,
    aten.special_airy_ai.default, aten.digamma.default, aten.angle.default,
]

POLYNOMIALS = [
    "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
    "legendre_polynomial_p",
]


@pytest.mark.parametrize("op", UNARY, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_unary_special_functions(op, dtype):
    check(op, torch.tensor(POINTS, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=str)
def test_integer_inputs_compute_in_the_default_float(dtype):
    values = torch.tensor([0, 1, 2, 3, -1, -4]).to(dtype)
    for op in (aten.digamma.default, aten.special_bessel_j0.default, aten.angle.default, aten.special_airy_ai.default):
        check(op, values)


@pytest.mark.parametrize("order", [0, 1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_polygamma(order, dtype):
    check(aten.polygamma.default, order, torch.tensor([-10.5, -2.5, -1.0, -0.5, 0.0, 1e-3, 0.5, 1.0, 3.0, 9.99, 10.0, 50.0], dtype=dtype))


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_polynomials_and_their_special_cases(name):
    packet = getattr(aten, "special_" + name)
    x = torch.tensor([-1.5, -1.0, -0.7, -0.2, 0.0, 0.3, 0.5, 0.9, 1.0, 1.2, 2.0], dtype=torch.float64)
    n = torch.arange(-2, 14)
    grid_x, grid_n = x[:, None].expand(-1, len(n)).contiguous(), n[None].expand(len(x), -1).contiguous()
    check(packet.default, grid_x, grid_n)  # n < 0, |x| == 1, x in {0, 1}, trigonometric forms above n = 4..8
    check(packet.default, grid_x.float(), grid_n.float())
    check(packet.n_scalar, grid_x, 9)
    check(packet.x_scalar, 0.3, grid_n)


def test_hermite_degree_limit_gives_nan():
    check(aten.special_hermite_polynomial_h.default, torch.tensor([0.5, 0.5]), torch.tensor([128.0, 129.0]))


def test_digamma_gradient_through_the_bridge():
    through_bridge(torch.digamma, torch.tensor([0.3, 1.5, 4.0, -0.5], dtype=torch.float64))


# ---------------------------------------------------------------- order statistics and histograms


def with_nans(dtype):
    values = torch.randint(-4, 5, (5, 7), generator=torch.Generator().manual_seed(1)).to(dtype)
    values[1, 2] = float("nan")
    values[3, 0] = float("nan")
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_medians_modes_and_running_extrema(dtype):
    values = with_nans(dtype) if dtype.is_floating_point else torch.randint(-4, 5, (5, 7)).to(dtype)
    check(aten.median.default, values)
    check(aten.nanmedian.default, values)
    check(aten.median.dim, values, 1)
    check(aten.nanmedian.dim, values, 1, True)
    # (torch's mode of a row with NaN depends on how its sort met the NaN: not compared)
    check(aten.mode.default, torch.nan_to_num(values, nan=2.0) if dtype.is_floating_point else values, 1)
    check(aten.cummax.default, values, 1)
    check(aten.cummin.default, values, 0)


def test_median_of_an_even_count_is_the_lower_middle():
    check(aten.median.default, torch.tensor([4.0, 1.0, 3.0, 2.0]))


def test_histograms():
    values = torch.randn(60, generator=torch.Generator().manual_seed(2))
    check(aten.histc.default, values, 7)
    check(aten.histc.default, values, 5, -1, 1)
    check(aten.histc.default, torch.ones(3), 4)  # an empty range widens by 1 each side
    check(aten.histogram.bin_ct, values, 6, range=[-1.0, 2.0], weight=torch.rand(60), density=True)
    points = values.reshape(20, 3)
    check(aten._histogramdd_bin_edges.default, points, [3, 4, 2])
    check(aten._histogramdd_from_bin_cts.default, points, [3, 4, 2])
    edges = [torch.tensor([-2.0, -0.5, 0.0, 1.5]), torch.tensor([-1.0, 1.0]), torch.tensor([-3.0, 0.0, 0.5, 3.0])]
    check(aten._histogramdd_from_bin_tensors.default, points, edges, weight=torch.rand(20), density=True)
    check(aten.histogram.bins_tensor, values, torch.tensor([-1.0, 0.0, 0.25, 2.0]))
    check(aten.histc.default, values.to(torch.bfloat16), 30, -2, 2)  # each step rounded in bfloat16, as torch


def test_histograms_of_no_data():
    empty = torch.zeros(5, 0, 5)
    check(aten.histc.default, empty, 3)
    check(aten.histogram.bin_ct, empty, 3)
    check(aten._histogramdd_bin_edges.default, empty, [2, 3, 1, 1, 2])


def test_bincount_reads_its_size_once():
    values = torch.tensor([1, 3, 3, 7])
    check(aten.bincount.default, values, eager=True)
    check(aten.bincount.default, values, torch.tensor([0.5, 1.0, 2.0, 4.0]), 10, eager=True)


@pytest.mark.parametrize("reduce", ["prod", "amax", "amin", "mean"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_index_reduce(reduce, include_self, dtype):
    target = torch.randint(-3, 4, (5, 7)).to(dtype)
    source = torch.randint(-3, 4, (5, 4)).to(dtype)
    check(aten.index_reduce.default, target, 1, torch.tensor([0, 2, 2, 6]), source, reduce, include_self=include_self)


@pytest.mark.parametrize("reduce", ["sum", "mean", "prod", "max", "min"])
def test_segment_reduce_and_its_gradient(bridged, reduce):
    data = torch.randn(5, 3, dtype=torch.float64)
    lengths = torch.tensor([2, 0, 3])
    check(aten.segment_reduce.default, data, reduce, lengths=lengths, initial=2.0)
    check(aten.segment_reduce.default, data, reduce, offsets=torch.tensor([0, 2, 2, 5]))
    through_bridge(lambda values: torch.segment_reduce(values, reduce, lengths=lengths.to(values.device)), data)


def test_equal_allclose_and_hash_return_host_values():
    values = torch.tensor([[1.0, 2.0], [3.0, float("nan")]])
    check(aten.equal.default, values, values, eager=True)
    check(aten.equal.default, values[:1], values[:1] + 0, eager=True)
    check(aten.allclose.default, values, values + 1e-9, eager=True)
    check(aten.allclose.default, values, values, 1e-5, 1e-8, True, eager=True)
    check(aten.hash_tensor.default, values)
    check(aten.hash_tensor.default, torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), [1], keepdim=True)
