"""Reduction, scan and foreach mappings against eager torch: values, result dtypes and shapes."""

import pytest
import torch

from op_testing import check, sample, seeded, through_bridge  # noqa: F401  (seeded: autouse)

aten = torch.ops.aten

# torch sums float32 pairwise, XLA in its own order: allow for the rounding of a few hundred terms.
SUM_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


# ---------------------------------------------------------------- sums, means, products


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool], ids=str)
def test_sum_prod_dtype_rules(dtype):
    values = sample((3, 4, 5), dtype, -3, 3)
    tolerance = SUM_TOLERANCE.get(dtype)
    check(aten.sum.default, values, tolerance=tolerance)
    check(aten.sum.dim_IntList, values, [1], tolerance=tolerance)
    check(aten.sum.dim_IntList, values, [0, -1], True, tolerance=tolerance)
    check(aten.sum.dim_IntList, values, [], tolerance=tolerance)
    check(aten.sum.dim_IntList, values, [2], dtype=torch.float64)
    check(aten.prod.default, values, tolerance=tolerance)
    check(aten.prod.dim_int, values, 1, True, tolerance=tolerance)
    check(aten.cumsum.default, values, 1, tolerance=tolerance)
    check(aten.cumprod.default, values, -1, tolerance=tolerance)
    check(aten.cumsum.default, values, 0, dtype=torch.float32)
    check(aten.count_nonzero.default, values)
    check(aten.count_nonzero.dim_IntList, values, [0, 2])


# float64 runs the float32 bodies; its accumulation is exercised by the dtype=float64 cases.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mean_var_std(dtype):
    values = sample((4, 6, 5), dtype, -3, 3)
    tolerance = SUM_TOLERANCE.get(dtype)
    check(aten.mean.default, values, tolerance=tolerance)
    check(aten.mean.dim, values, [1, 2], tolerance=tolerance)
    check(aten.mean.dim, values, [-1], True, tolerance=tolerance)
    check(aten.mean.dim, values, [0], dtype=torch.float64)
    check(aten.var.correction, values, [1], tolerance=tolerance)
    check(aten.var.correction, values, [1], correction=2.5, tolerance=tolerance)
    check(aten.std.correction, values, None, correction=0, tolerance=tolerance)
    check(aten.var.correction, values, [0, 2], correction=1, keepdim=True, tolerance=tolerance)
    check(aten.var_mean.correction, values, [1], correction=0, tolerance=tolerance)
    check(aten.std_mean.correction, values, [0, 1], keepdim=True, tolerance=tolerance)
    check(aten.var.dim, values, [1], False, tolerance=tolerance)
    check(aten.std.default, values, tolerance=tolerance)
    check(aten.var_mean.dim, values, [2], True, True, tolerance=tolerance)
    check(aten.logsumexp.default, values, [1], tolerance=tolerance)
    check(aten.logsumexp.default, values, [0, 2], True, tolerance=tolerance)


def test_degenerate_reductions():
    one = torch.randn(1)
    check(aten.var.correction, one)  # no degrees of freedom: nan
    check(aten.var.correction, torch.ones(3), correction=2.5)
    scalar = torch.tensor(2.5)
    check(aten.sum.dim_IntList, scalar, [0])
    check(aten.cumsum.default, scalar, 0)
    check(aten.max.dim, scalar, 0)
    check(aten.argmax.default, scalar, 0)
    check(aten.amax.default, scalar, [-1])
    check(aten.linalg_vector_norm.default, scalar, 2, [0])
    check(aten.logsumexp.default, torch.tensor([-float("inf"), -float("inf")]), [0])
    check(aten.logsumexp.default, torch.tensor([float("inf"), 1.0]), [0])
    check(aten.logsumexp.default, sample((3, 2), torch.int64, 0, 5), [1])
    check(aten.mean.dim, torch.ones(2, 3, dtype=torch.float16), [0], dtype=torch.float32)


# ---------------------------------------------------------------- extrema


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_extrema(dtype):
    values = sample((4, 5), dtype, -5, 5)
    if dtype.is_floating_point:
        values[1, 2] = float("nan")
    values[3] = values[3, 0]  # ties: the first index wins
    for op in (aten.max.default, aten.min.default):
        check(op, values)
    for op in (aten.max.dim, aten.min.dim):
        check(op, values, 1)
        check(op, values, 0, True)
    for op in (aten.amax.default, aten.amin.default):
        check(op, values, [0])
        check(op, values, [1], True)
    for op in (aten.argmax.default, aten.argmin.default):
        check(op, values)
        check(op, values, -2, True)
    check(aten.aminmax.default, values, dim=1, keepdim=True)


# ---------------------------------------------------------------- logical


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.float32, torch.int64], ids=str)
def test_all_any(dtype):
    values = sample((3, 4), dtype, 0, 2)
    values[0] = 1
    for packet in (aten.all, aten.any):
        check(packet.default, values)
        check(packet.dim, values, 1)
        check(packet.dim, values, 0, True)
        check(packet.dims, values, [0, 1])
        check(packet.dims, values, None)
        check(packet.dims, values, [], True)


# ---------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norms(dtype):
    values = sample((3, 4, 5), dtype, -3, 3)
    values[0, 0, :2] = 0
    tolerance = SUM_TOLERANCE.get(dtype)
    for ord in (2, 1, float("inf"), -float("inf"), 0, 3, 0.5):
        check(aten.linalg_vector_norm.default, values, ord, tolerance=tolerance)
        check(aten.linalg_vector_norm.default, values, ord, [1, 2], True, tolerance=tolerance)
    check(aten.linalg_vector_norm.default, values, 2, [0], dtype=torch.float64)
    check(aten.norm.Scalar, values, tolerance=tolerance)
    check(aten.norm.Scalar, values, 1, tolerance=tolerance)
    check(aten.norm.ScalarOpt_dim, values, None, [1], tolerance=tolerance)
    check(aten.norm.ScalarOpt_dim, values, 3, [0, 2], True, tolerance=tolerance)
    check(aten.norm.ScalarOpt_dim_dtype, values, 2, [1], False, dtype=torch.float64)
    check(aten.norm.ScalarOpt_dtype, values, 2, dtype=torch.float64)


def test_complex_norm_and_variance():
    values = torch.randn(3, 4, dtype=torch.complex64)
    check(aten.linalg_vector_norm.default, values, 2, [1])
    check(aten.var.correction, values, [1])


# ---------------------------------------------------------------- foreach (optimizers, clip_grad_norm_)


def tensor_list(dtypes=(torch.float32, torch.bfloat16, torch.float64), low=-3, high=3):
    shapes = [(3, 4), (5,), ()]
    return [sample(shape, dtype, low, high) for shape, dtype in zip(shapes, dtypes)]


FOREACH_UNARY = [
    aten._foreach_abs, aten._foreach_neg, aten._foreach_sign, aten._foreach_exp, aten._foreach_sigmoid,
    aten._foreach_tanh, aten._foreach_round, aten._foreach_zero, aten._foreach_clone, aten._foreach_max,
]


@pytest.mark.parametrize("packet", FOREACH_UNARY, ids=str)
def test_foreach_unary(packet):
    check(packet.default, tensor_list())


def test_foreach_unary_positive_domain():
    positive = tensor_list(low=0.1, high=4)
    for packet in (aten._foreach_sqrt, aten._foreach_rsqrt, aten._foreach_log, aten._foreach_reciprocal):
        check(packet.default, positive)


@pytest.mark.parametrize("packet", [aten._foreach_add, aten._foreach_sub, aten._foreach_mul, aten._foreach_div,
                                    aten._foreach_maximum, aten._foreach_minimum, aten._foreach_clamp_min,
                                    aten._foreach_clamp_max], ids=str)
def test_foreach_binary(packet):
    self, other = tensor_list(), tensor_list()
    overloads = packet.overloads()
    check(packet.List, self, other)
    check(packet.Scalar, self, 0.5)
    check(packet.ScalarList, self, [0.5, -2, 3.0])
    if "Tensor" in overloads:
        check(packet.Tensor, self, torch.tensor(0.25))
    if packet in (aten._foreach_add, aten._foreach_sub):
        check(packet.List, self, other, alpha=-0.1)
    if packet in (aten._foreach_add, aten._foreach_div):
        integers = [sample((4,), torch.int64, 1, 9), sample((2, 2), torch.int32, 1, 9)]
        check(packet.List, integers, [sample((4,), torch.int64, 1, 9), sample((2, 2), torch.int32, 1, 9)])
        check(packet.Scalar, integers, 2)


def test_foreach_pow():
    base, exponent = tensor_list(low=0.5, high=2), tensor_list(low=-2, high=2)
    check(aten._foreach_pow.List, base, exponent)
    check(aten._foreach_pow.Scalar, base, 2)
    check(aten._foreach_pow.Scalar, base, 0.5)
    check(aten._foreach_pow.ScalarList, base, [2, 0.5, -1])
    check(aten._foreach_pow.ScalarAndTensor, 2.0, exponent)


@pytest.mark.parametrize("packet", [aten._foreach_addcmul, aten._foreach_addcdiv], ids=str)
def test_foreach_addcmul_addcdiv(packet):
    self, first, second = tensor_list(), tensor_list(), tensor_list(low=0.5, high=2)
    check(packet.Scalar, self, first, second)
    check(packet.Scalar, self, first, second, -0.3)
    check(packet.ScalarList, self, first, second, [0.1, -2.0, 3])
    check(packet.Tensor, self, first, second, torch.tensor([0.1, -2.0, 3.0], dtype=torch.float64))


def test_foreach_lerp_copy_norm():
    start, end = tensor_list(), tensor_list()
    check(aten._foreach_lerp.Scalar, start, end, 0.3)
    check(aten._foreach_lerp.ScalarList, start, end, [0.3, 0.9, -0.1])
    check(aten._foreach_lerp.List, start, end, tensor_list(low=0, high=1))
    check(aten._foreach_copy.default, start, end)
    for ord in (2, 1, float("inf")):
        check(aten._foreach_norm.Scalar, start, ord, tolerance=SUM_TOLERANCE[torch.bfloat16])
    check(aten._foreach_norm.Scalar, start, 2, torch.float64)
    check(aten._foreach_powsum.Scalar, start, 2, tolerance=SUM_TOLERANCE[torch.bfloat16])
    check(aten._foreach_powsum.Scalar, start, 3, torch.float64)


# ---------------------------------------------------------------- through the bridge: values, gradients, optimizer steps


REDUCTIONS = {
    "sum": lambda x: x.sum() + x.sum(dim=1).sum() * 0.5,
    "mean": lambda x: x.mean(dim=(0, 2), keepdim=True).sum() + x.mean(),
    "prod": lambda x: (x * 0.5 + 1).prod(dim=1).sum(),
    "var_std": lambda x: x.var(dim=1).sum() + x.std() + torch.var_mean(x, dim=2)[0].sum(),
    "norm": lambda x: x.norm() + torch.linalg.vector_norm(x, 1, dim=2).sum() + x.norm(p=3, dim=0).sum(),
    "logsumexp": lambda x: torch.logsumexp(x, dim=1).sum(),
    "max_min": lambda x: x.max(dim=1).values.sum() + x.amax(dim=(0, 2)).sum() - x.min() + x.amin(),
    "cumsum_cumprod": lambda x: x.cumsum(dim=1).sum() + (x * 0.1 + 1).cumprod(dim=2).sum(),
    "softmax_like": lambda x: (x - x.amax(dim=-1, keepdim=True)).exp().div(x.exp().sum(-1, keepdim=True)).sum(),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reduction_gradients_through_bridge(bridged, name):
    through_bridge(REDUCTIONS[name], sample((3, 4, 5), torch.float32, -2, 2))


def test_index_and_logical_reductions_through_bridge(bridged):
    def function(x):
        return (x.argmax(dim=1) + x.argmin() + x.count_nonzero() + (x > 0).all(dim=0).long().sum() + (x > 1).any().long())

    through_bridge(function, sample((3, 4), torch.float32, -2, 2), differentiable=False)


def _optimizer_run(parameters, step):
    """Two steps of `step(parameters, grads)` with fixed gradients: returns the parameters after."""
    for round_ in range(2):
        for index, parameter in enumerate(parameters):
            generator = torch.Generator().manual_seed(10 * round_ + index)
            gradient = torch.randn(parameter.shape, generator=generator)
            parameter.grad = gradient.to(parameter.device) if parameter.device.type == "cpu" else _to_bridge(gradient)
        step(parameters)
    return parameters


def _to_bridge(value):
    from bridge.runtime.tensor import to_bridge

    return to_bridge(value)


def _compare_optimizer(step):
    from bridge.runtime import stats
    from bridge.runtime.tensor import to_torch as bridge_to_torch

    initial = [sample((4, 3), torch.float32), sample((3,), torch.float32), sample((2, 2), torch.float32)]
    eager = _optimizer_run([torch.nn.Parameter(value.clone()) for value in initial], step)
    stats.reset()
    bridged = _optimizer_run([torch.nn.Parameter(_to_bridge(value)) for value in initial], step)
    for expected, actual in zip(eager, bridged):
        torch.testing.assert_close(bridge_to_torch(actual.detach()), expected.detach())
    summary = stats.summary()
    assert not summary["cpu_fallbacks"], summary["cpu_fallbacks"]
    foreach_ops = [entry["op"] for entry in summary["ops"] if "_foreach_" in entry["op"]]
    assert foreach_ops, "the foreach path did not run"


def _sgd_with_clipping(parameters):
    torch.nn.utils.clip_grad_norm_(parameters, 0.5, foreach=True)
    optimizer = _sgd_with_clipping.optimizers.setdefault(id(parameters[0]), torch.optim.SGD(parameters, lr=0.1, momentum=0.9, foreach=True))
    optimizer.step()


def test_sgd_foreach_and_clip_grad_norm_through_bridge(bridged):
    # Eager mode: captured mode folds the clip into SGD's one-program update (tests/test_captured.py).
    previous = bridged.set_mode("eager")
    try:
        _sgd_with_clipping.optimizers = {}
        _compare_optimizer(_sgd_with_clipping)
    finally:
        bridged.set_mode(previous)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_adam_foreach_through_bridge(bridged, decoupled, amsgrad):
    # The functional form runs the same foreach code as Adam(..., foreach=True).step(); step() itself
    # first asks torch.accelerator for the current stream, which the bridge does not answer yet.
    from torch.optim.adam import adam

    states = {}

    def step(parameters):
        state = states.setdefault(id(parameters[0]), {
            "exp_avgs": [torch.zeros_like(p) for p in parameters],
            "exp_avg_sqs": [torch.zeros_like(p) for p in parameters],
            "max_exp_avg_sqs": [torch.zeros_like(p) for p in parameters],
            "steps": [torch.tensor(0.0) for _ in parameters],
        })
        with torch.no_grad():
            adam(
                list(parameters), [p.grad for p in parameters], state["exp_avgs"], state["exp_avg_sqs"],
                state["max_exp_avg_sqs"], state["steps"], foreach=True, capturable=False, differentiable=False,
                fused=None, grad_scale=None, found_inf=None, has_complex=False, decoupled_weight_decay=decoupled,
                amsgrad=amsgrad, beta1=0.9, beta2=0.999, lr=0.01, weight_decay=0.1, eps=1e-8, maximize=False,
            )

    # Eager mode: in captured mode the Adam step runs as one program instead of these foreach
    # ops (that path is tested in tests/test_captured.py).
    previous = bridged.set_mode("eager")
    try:
        _compare_optimizer(step)
    finally:
        bridged.set_mode(previous)


def test_logcumsumexp_of_complex_follows_torchs_scan():
    # torch's sequential scan does not wrap the imaginary part to (-pi, pi].
    values = sample((5, 5, 5), torch.complex64, low=-3, high=3)
    check(aten.logcumsumexp.default, values, 1)
    check(aten.logcumsumexp.default, values, 0)
