"""Elementwise and activation mappings against eager torch: values, dtypes and shapes, incl. promotion."""

import numpy as np
import pytest
import torch

from op_testing import assert_same, check, run_mapping, sample, seeded, through_bridge  # noqa: F401  (seeded: autouse)

aten = torch.ops.aten

FLOATS = [torch.float32, torch.float64, torch.bfloat16]


def shapes_for(dtype):
    # Each new shape costs a JAX compilation; the 0-dim case is covered once per op.
    return [(5,), ()] if dtype is torch.float32 else [(5,)]


# ---------------------------------------------------------------- unary

# op -> (low, high) of the inputs it is defined on
UNARY_FLOAT = {
    aten.exp.default: (-5, 5),
    aten.exp2.default: (-5, 5),
    aten.expm1.default: (-5, 5),
    aten.log.default: (0.1, 10),
    aten.log2.default: (0.1, 10),
    aten.log10.default: (0.1, 10),
    aten.log1p.default: (-0.5, 10),
    aten.sqrt.default: (0, 10),
    aten.rsqrt.default: (0.1, 10),
    aten.sin.default: (-5, 5),
    aten.cos.default: (-5, 5),
    aten.tan.default: (-1.2, 1.2),
    aten.asin.default: (-0.99, 0.99),
    aten.acos.default: (-0.99, 0.99),
    aten.atan.default: (-5, 5),
    aten.sinh.default: (-3, 3),
    aten.cosh.default: (-3, 3),
    aten.tanh.default: (-3, 3),
    aten.asinh.default: (-5, 5),
    aten.acosh.default: (1, 5),
    aten.atanh.default: (-0.9, 0.9),
    aten.erf.default: (-3, 3),
    aten.erfc.default: (-3, 3),
    aten.erfinv.default: (-0.99, 0.99),
    aten.sigmoid.default: (-8, 8),
    aten.logit.default: (0.05, 0.95),
    aten.reciprocal.default: (0.5, 5),
    aten.lgamma.default: (0.5, 5),
    aten.digamma.default: (0.5, 5),
}
UNARY_EXACT = [
    aten.neg.default,
    aten.abs.default,
    aten.sign.default,
    aten.sgn.default,
    aten.floor.default,
    aten.ceil.default,
    aten.trunc.default,
    aten.round.default,
    aten.frac.default,
    aten.square.default,
    aten.positive.default,
    aten.signbit.default,
    aten.isnan.default,
    aten.isinf.default,
    aten.isfinite.default,
    aten.logical_not.default,
    aten.clone.default,
    aten.zero.default,
    aten.nan_to_num.default,
]


# torch's CPU kernels for these round every intermediate step to bfloat16, while its CUDA kernels
# (and the bridge) compute in float32 and round once: compare bfloat16 against that float32 result.
ROUNDS_INTERMEDIATES_ON_CPU = {aten.logit.default}


# float64 runs the same bodies as float32 (it is covered by the binary and promotion tests), and
# bfloat16 goes through the same float32 upcast for every op: a few ops cover it.
BFLOAT16_SAMPLE = {aten.exp.default, aten.log.default, aten.tanh.default, aten.sigmoid.default, aten.erfinv.default, aten.logit.default}


@pytest.mark.parametrize(
    "op, dtype",
    [(op, torch.float32) for op in UNARY_FLOAT] + [(op, torch.bfloat16) for op in UNARY_FLOAT if op in BFLOAT16_SAMPLE],
    ids=str,
)
def test_unary_float_math(op, dtype):
    low, high = UNARY_FLOAT[op]
    for shape in shapes_for(dtype):
        values = sample(shape, dtype, low, high)
        if dtype is torch.bfloat16 and op in ROUNDS_INTERMEDIATES_ON_CPU:
            assert_same(run_mapping(op, values), op(values.float()).bfloat16())
        else:
            check(op, values)


@pytest.mark.parametrize("op", list(UNARY_FLOAT), ids=str)
def test_unary_float_math_promotes_integers(op):
    low, high = UNARY_FLOAT[op]
    low, high = int(np.ceil(low)), int(np.floor(high)) + 1
    values = sample((6,), torch.int64, low, high) if high - low > 1 else torch.full((3,), low)
    check(op, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("op", UNARY_EXACT, ids=str)
def test_unary_exact(op, dtype):
    if not _torch_accepts(op, sample((2,), dtype)):
        pytest.skip(f"torch rejects {dtype} input for this op")
    for shape in shapes_for(dtype):
        values = sample(shape, dtype, -10, 10)
        if dtype.is_floating_point and len(shape) == 1:
            values[0], values[1] = -0.0, 2.5  # signed zero, a round-half-to-even case
            values[2] = float("nan") if op is not aten.nan_to_num.default else float("inf")
        check(op, values)


def test_nan_to_num_arguments():
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.5])
    check(aten.nan_to_num.default, values, 0.5, 100.0, -100.0)
    check(aten.nan_to_num.default, values.bfloat16())


@pytest.mark.parametrize("decimals", [0, 2, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_round_decimals(dtype, decimals):
    check(aten.round.decimals, sample((20,), dtype, -500, 500), decimals=decimals)


# ---------------------------------------------------------------- binary arithmetic and promotion

# (self, other) pairs that exercise torch's promotion: dimensioned tensors, 0-dim tensors, Python scalars.
def promotion_pairs():
    return [
        (sample((2, 3), torch.float32), sample((2, 3), torch.float32)),
        (sample((2, 3), torch.float32), sample((3,), torch.float64)),
        (sample((2, 3), torch.int64), sample((2, 3), torch.float32)),
        (sample((4,), torch.int64, -9, 9), sample((4,), torch.int64, 1, 9)),
        (sample((4,), torch.bfloat16), sample((), torch.float64, 0, 0.5)),
        (sample((4,), torch.bfloat16), sample((4,), torch.bfloat16)),
        (sample((4,), torch.bool), sample((4,), torch.int64, 1, 5)),
        (sample((4,), torch.int64), sample((), torch.float64)),
        (sample((), torch.int64, 1, 5), sample((3,), torch.int32, 1, 5)),
        (sample((3,), torch.float32), 2.5),
        (sample((3,), torch.int64), 2.5),
        (sample((3,), torch.int64, -9, 9), 3),
        (sample((3,), torch.bfloat16), 0.3),
        (sample((3,), torch.bool), 2),
    ]


ARITHMETIC = [
    (aten.add.Tensor, aten.add.Scalar),
    (aten.sub.Tensor, aten.sub.Scalar),
    (aten.rsub.Tensor, aten.rsub.Scalar),
    (aten.mul.Tensor, aten.mul.Scalar),
    (aten.div.Tensor, aten.div.Scalar),
    (aten.remainder.Tensor, aten.remainder.Scalar),
    (aten.fmod.Tensor, aten.fmod.Scalar),
    (aten.floor_divide.default, aten.floor_divide.Scalar),
    (aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar),
    (aten.maximum.default, None),
    (aten.minimum.default, None),
    (aten.fmax.default, None),
    (aten.fmin.default, None),
    (aten.atan2.default, None),
    (aten.copysign.Tensor, aten.copysign.Scalar),
    (aten.xlogy.Tensor, aten.xlogy.Scalar_Other),
    (aten.eq.Tensor, aten.eq.Scalar),
    (aten.ne.Tensor, aten.ne.Scalar),
    (aten.lt.Tensor, aten.lt.Scalar),
    (aten.le.Tensor, aten.le.Scalar),
    (aten.gt.Tensor, aten.gt.Scalar),
    (aten.ge.Tensor, aten.ge.Scalar),
    (aten.logical_and.default, None),
    (aten.logical_or.default, None),
    (aten.logical_xor.default, None),
]


def _torch_accepts(op, *args):
    try:
        op(*args)
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("ops", ARITHMETIC, ids=lambda ops: str(ops[0]))
def test_binary_promotion(ops):
    tensor_op, scalar_op = ops
    checked = 0
    pairs = promotion_pairs()
    if tensor_op not in FULLY_CHECKED:
        pairs = [pairs[index] for index in (2, 3, 6, 10, 12)]
    for self, other in pairs:
        if tensor_op in (aten.pow.Tensor_Tensor,) and not isinstance(other, float):
            other = other.abs() if isinstance(other, torch.Tensor) and other.dtype != torch.bool else other
        op = tensor_op
        if isinstance(other, (int, float)):
            if scalar_op is None:
                continue
            # torch's Python layer sends Tensor overloads with Python scalars too; test both.
            if _torch_accepts(tensor_op, self, other):
                check(tensor_op, self, other)
            op = scalar_op
        if not _torch_accepts(op, self, other):
            continue
        check(op, self, other)
        checked += 1
    assert checked >= 2


# Every promotion pair for a few ops; the others see a sample (promotion is the decorator's, shared by all).
FULLY_CHECKED = {aten.add.Tensor, aten.div.Tensor, aten.remainder.Tensor}


@pytest.mark.parametrize("op", [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor], ids=str)
def test_zero_dim_operand_rounds_to_common_dtype(op):
    check(op, torch.tensor([5.28125, -4.625, 5.6875], dtype=torch.bfloat16), torch.tensor(-4.931640625, dtype=torch.float64))


@pytest.mark.parametrize("alpha", [1, 2, 0.5])
def test_add_sub_alpha(alpha):
    self, other = sample((2, 3), torch.float32), sample((2, 3), torch.float32)
    for op in (aten.add.Tensor, aten.sub.Tensor, aten.rsub.Tensor):
        check(op, self, other, alpha=alpha)
    check(aten.add.Scalar, self, 1.5, alpha)
    integers = sample((4,), torch.int64)
    check(aten.add.Tensor, integers, integers, alpha=3)


@pytest.mark.parametrize("mode", [None, "trunc", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16], ids=str)
def test_div_rounding_modes(dtype, mode):
    numerator = torch.tensor([7, -7, 7, -7, 0, 5, 9], dtype=dtype)
    denominator = torch.tensor([2, 2, -2, -2, 3, 5, 4], dtype=dtype)
    check(aten.div.Tensor_mode, numerator, denominator, rounding_mode=mode)
    check(aten.div.Tensor_mode, numerator, 3, rounding_mode=mode)
    check(aten.div.Scalar_mode, numerator, -3, rounding_mode=mode)
    if dtype.is_floating_point:
        check(aten.div.Tensor_mode, numerator, 2.5, rounding_mode=mode)
        check(aten.div.Tensor_mode, numerator, torch.zeros(7, dtype=dtype), rounding_mode=mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_remainder_fmod_signs(dtype):
    numerator = torch.tensor([7, -7, 7, -7, 0, 6], dtype=dtype)
    denominator = torch.tensor([3, 3, -3, -3, 3, -3], dtype=dtype)
    for op in (aten.remainder.Tensor, aten.fmod.Tensor, aten.floor_divide.default):
        check(op, numerator, denominator)
    check(aten.remainder.Scalar_Tensor, 5, denominator)


def test_pow_overloads():
    base = sample((6,), torch.float32, 0.1, 3)
    for exponent in (2, 3, 0.5, -1, 0, -2.5):
        check(aten.pow.Tensor_Scalar, base, exponent)
    check(aten.pow.Tensor_Scalar, torch.tensor([-2.0, -3.0, 2.0]), 3)
    check(aten.pow.Tensor_Tensor, torch.tensor([-2.0, -3.0, 2.0]), torch.tensor([2.0, 3.0, 0.5]))
    check(aten.pow.Scalar, 2, sample((5,), torch.float32))
    check(aten.pow.Scalar, 2.5, sample((5,), torch.int64, 0, 5))
    check(aten.pow.Scalar, 3, sample((5,), torch.int64, 0, 5))
    check(aten.pow.Tensor_Scalar, sample((5,), torch.int64, -4, 4), 3)
    check(aten.pow.Tensor_Scalar, sample((5,), torch.bool), 2)
    check(aten.pow.Tensor_Scalar, sample((5,), torch.bfloat16, 0.1, 3), 0.5)
    integers = torch.tensor([1, -1, -1, 2, 3, 0, 5])
    check(aten.pow.Tensor_Tensor, integers, torch.tensor([-3, -3, -2, -1, 2, 3, 0]))
    check(aten.float_power.Tensor_Scalar, base, 2)
    check(aten.float_power.Tensor_Tensor, integers.abs(), torch.tensor([1, 2, 3, 1, 2, 3, 0]))
    check(aten.float_power.Scalar, 2, base)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8], ids=str)
def test_bitwise(dtype):
    low, high = (0, 2) if dtype is torch.bool else (0, 100)
    self, other = sample((8,), dtype, low, high), sample((8,), dtype, low, high)
    for packet in (aten.bitwise_and, aten.bitwise_or, aten.bitwise_xor):
        check(packet.Tensor, self, other)
        check(packet.Scalar, self, True if dtype is torch.bool else 5)
    check(aten.bitwise_not.default, self)
    if dtype is not torch.bool:
        shifts = sample((8,), dtype, 0, 7)
        for op in (aten.bitwise_left_shift.Tensor, aten.bitwise_right_shift.Tensor, aten.__lshift__.Tensor, aten.__rshift__.Tensor):
            check(op, self, shifts)
        check(aten.bitwise_left_shift.Tensor_Scalar, self, 2)
        check(aten.bitwise_right_shift.Tensor_Scalar, self, 1)
    check(aten.bitwise_right_shift.Tensor, torch.tensor([-8, -8, 8]), torch.tensor([1, 70, 3]))


def test_hypot_heaviside_xlog1py():
    self, other = sample((2, 4), torch.float32), sample((2, 4), torch.float32)
    check(aten.hypot.default, self, other)
    check(aten.heaviside.default, torch.tensor([-1.0, 0.0, 2.0, 0.0]), torch.tensor([0.5, 0.25, 0.1, 7.0]))
    check(aten.special_xlog1py.default, torch.tensor([0.0, 1.0, 2.0]), torch.tensor([float("nan"), 0.5, 3.0]))
    check(aten.xlogy.Tensor, torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.0, float("nan"), 3.0]))
    check(aten.xlogy.Scalar_Self, 2, torch.tensor([1.0, 4.0]))


# ---------------------------------------------------------------- clamp, where, lerp, addcmul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_clamp(dtype):
    values = sample((3, 4), dtype, -10, 10)
    check(aten.clamp.default, values, -2, 3)
    check(aten.clamp.default, values, None, 3)
    check(aten.clamp.default, values, 4, -1)  # min > max: max wins
    check(aten.clamp.default, values, 0.5)  # a float bound promotes integers
    check(aten.clamp_min.default, values, 1)
    check(aten.clamp_max.default, values, 1)
    low, high = sample((4,), dtype, -10, 0), sample((3, 1), dtype, 0, 10)
    check(aten.clamp.Tensor, values, low, high)
    check(aten.clamp.Tensor, values, None, high)
    check(aten.clamp_min.Tensor, values, low)
    check(aten.clamp_max.Tensor, values, high)
    if dtype.is_floating_point:
        check(aten.clamp.default, torch.tensor([float("nan"), 1.0], dtype=dtype), 0, 0.5)


def test_where_and_masked_fill():
    condition = sample((3, 4), torch.bool)
    self, other = sample((3, 4), torch.float32), sample((4,), torch.float64)
    check(aten.where.self, condition, self, other)
    check(aten.where.self, condition, self, sample((), torch.float64))
    check(aten.where.self, condition, sample((3, 4), torch.int64), sample((3, 4), torch.bfloat16))
    check(aten.where.ScalarOther, condition, self, 2)
    check(aten.where.ScalarSelf, condition, 2.5, sample((3, 4), torch.int64))
    check(aten.where.Scalar, condition, 1.0, 2)
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
        values = sample((3, 4), dtype)
        check(aten.masked_fill.Scalar, values, condition, 1)
        check(aten.masked_fill.Tensor, values, condition[0], torch.tensor(0.75))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_lerp_addcmul_addcdiv(dtype):
    start, end = sample((3, 4), dtype), sample((3, 4), dtype)
    for weight in (0.25, 0.75, -0.5):
        check(aten.lerp.Scalar, start, end, weight)
    check(aten.lerp.Tensor, start, end, sample((4,), dtype, 0, 1))
    first, second = sample((3, 4), dtype), sample((4,), dtype, 0.5, 2)
    check(aten.addcmul.default, start, first, second, value=0.3)
    check(aten.addcdiv.default, start, first, second, value=-2)
    check(aten.addcmul.default, start, first, second)


# ---------------------------------------------------------------- copies and conversion

ALL_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool], ids=str)
def test_to_copy(source):
    values = sample((2, 5), source, -50, 50) if source is not torch.uint8 else sample((2, 5), source)
    for target in ALL_DTYPES:
        check(aten._to_copy.default, values, dtype=target)
    check(aten._to_copy.default, values, dtype=None, device=torch.device("cpu"), layout=torch.strided)


def test_copy_fill_zero():
    self = sample((3, 4), torch.float32)
    check(aten.copy.default, self, sample((4,), torch.float64))
    check(aten.copy.default, self, sample((3, 4), torch.int64))
    check(aten.copy.default, sample((2,), torch.int64), torch.tensor([1.7, -2.9]))
    check(aten.fill.Scalar, self, 2.5)
    check(aten.fill.Scalar, sample((3,), torch.int64), 7)
    check(aten.fill.Tensor, self, torch.tensor(3, dtype=torch.int64))
    check(aten.zero.default, sample((2, 2), torch.bfloat16))


def test_complex_parts():
    values = torch.randn(4, dtype=torch.complex64)
    check(aten.real.default, values)
    check(aten.imag.default, values)
    check(aten.conj_physical.default, values)
    check(aten.sgn.default, torch.tensor([0j, 3 + 4j], dtype=torch.complex64))
    check(aten.real.default, sample((3,), torch.float32))


# ---------------------------------------------------------------- activations

# (forward op, its arguments after the input), (backward op, a function of (grad, input, output) giving its arguments)
ACTIVATIONS = [
    ((aten.relu.default,), (aten.threshold_backward.default, lambda grad, x, y: (grad, y, 0))),
    ((aten.gelu.default,), (aten.gelu_backward.default, lambda grad, x, y: (grad, x))),
    ((aten.gelu.default, "tanh"), (aten.gelu_backward.default, lambda grad, x, y: (grad, x), "tanh")),
    ((aten.silu.default,), (aten.silu_backward.default, lambda grad, x, y: (grad, x))),
    ((aten.sigmoid.default,), (aten.sigmoid_backward.default, lambda grad, x, y: (grad, y))),
    ((aten.tanh.default,), (aten.tanh_backward.default, lambda grad, x, y: (grad, y))),
    ((aten.threshold.default, 0.1, 2.0), (aten.threshold_backward.default, lambda grad, x, y: (grad, x, 0.1))),
    ((aten.hardtanh.default, -0.5, 1.5), (aten.hardtanh_backward.default, lambda grad, x, y: (grad, x, -0.5, 1.5))),
    ((aten.leaky_relu.default, 0.2), (aten.leaky_relu_backward.default, lambda grad, x, y: (grad, x, 0.2, False))),
    ((aten.elu.default, 1.5, 1.0, 1.0), (aten.elu_backward.default, lambda grad, x, y: (grad, 1.5, 1.0, 1.0, False, x))),
    ((aten.elu.default, 1.0, 1.2, 0.5), (aten.elu_backward.default, lambda grad, x, y: (grad, 1.0, 1.2, 0.5, True, y))),
    ((aten.softplus.default, 2.0, 5.0), (aten.softplus_backward.default, lambda grad, x, y: (grad, x, 2.0, 5.0))),
    ((aten.mish.default,), (aten.mish_backward.default, lambda grad, x, y: (grad, x))),
    ((aten.hardswish.default,), (aten.hardswish_backward.default, lambda grad, x, y: (grad, x))),
    ((aten.hardsigmoid.default,), (aten.hardsigmoid_backward.default, lambda grad, x, y: (grad, x))),
    ((aten.hardshrink.default, 0.7), (aten.hardshrink_backward.default, lambda grad, x, y: (grad, x, 0.7))),
    ((aten.softshrink.default, 0.7), (aten.softshrink_backward.default, lambda grad, x, y: (grad, x, 0.7))),
    ((aten.logit.default, 0.1), (aten.logit_backward.default, lambda grad, x, y: (grad, x, 0.1))),
    ((aten.celu.default, 0.8), None),
    ((aten.selu.default,), None),
    ((aten.glu.default, 1), (aten.glu_backward.default, lambda grad, x, y: (grad, x, 1))),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("entry", ACTIVATIONS, ids=lambda entry: "-".join(map(str, entry[0])))
def test_activation_and_backward(entry, dtype):
    forward, backward = entry
    op, *options = forward
    # Inputs cover both sides of every kink (-3, 0, 3) and the logit domain when needed.
    low, high = (0.01, 0.99) if op is aten.logit.default else (-5, 5)
    values = sample((4, 6), dtype, low, high)
    keywords = {"approximate": options.pop()} if op is aten.gelu.default and options else {}
    if op in ROUNDS_INTERMEDIATES_ON_CPU and dtype is torch.bfloat16:
        pytest.skip("compared in float32 by test_unary_float_math")
    check(op, values, *options, **keywords)
    if backward is None:
        return
    backward_op, arguments, *approximate = backward
    grad = sample(op(values, *options, **keywords).shape, dtype)
    output = op(values, *options, **keywords)
    backward_keywords = {"approximate": approximate[0]} if approximate else {}
    check(backward_op, *arguments(grad, values, output), **backward_keywords)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_log_sigmoid_and_prelu(dtype):
    values = sample((3, 5), dtype, -30, 30)
    check(aten.log_sigmoid_forward.default, values)
    output, buffer = aten.log_sigmoid_forward.default(values)
    check(aten.log_sigmoid_backward.default, sample((3, 5), dtype), values, buffer)
    weight = sample((1, 5), dtype, 0, 1)
    check(aten._prelu_kernel.default, values, weight)
    check(aten._prelu_kernel_backward.default, sample((3, 5), dtype), values, weight)


def test_activation_scalars_keep_dtype():
    integers = sample((6,), torch.int64, -5, 5)
    check(aten.relu.default, integers)
    check(aten.threshold.default, integers, 1, 7)
    check(aten.hardtanh.default, integers, -2, 2)
    check(aten.leaky_relu.default, sample((6,), torch.float32), 0.3)


# ---------------------------------------------------------------- through the bridge: values and gradients


F = torch.nn.functional

UNARY_FUNCTIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.1),
    "elu": F.elu,
    "selu": F.selu,
    "celu": lambda x: F.celu(x, 0.5),
    "softplus": lambda x: F.softplus(x, beta=2),
    "mish": F.mish,
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "hardtanh": lambda x: F.hardtanh(x, -0.5, 0.5),
    "relu6": F.relu6,
    "logsigmoid": F.logsigmoid,
    "glu": F.glu,
    "threshold": lambda x: F.threshold(x, 0.2, -1.0),
    "hardshrink": F.hardshrink,
    "softshrink": F.softshrink,
    "prelu": lambda x: F.prelu(x, torch.full((1,), 0.25, device=x.device)),
    "math": lambda x: torch.exp(x).log1p() * torch.sin(x) + torch.sqrt(x.abs() + 1) / (x.square() + 1),
    "rounding": lambda x: torch.round(x * 3) + x.frac() * x + torch.floor(x) - torch.trunc(x),
    "comparisons": lambda x: torch.where(x > 0.2, x * 2, -x) + (x <= 0).float() * x,
    "clamp": lambda x: x.clamp(-0.5, 0.7) + x.clamp(min=0) * x.clamp_max(0.3),
    "pow": lambda x: x.abs().pow(1.5) + x**2 + 2**x - x.pow(3),
    "division": lambda x: x / (x.abs() + 1) - 1 / (x * x + 2) + torch.rsqrt(x * x + 1),
    "lerp_addcmul": lambda x: torch.lerp(x, x.flip(0), 0.3) + torch.addcmul(x, x, x, value=0.5) + torch.addcdiv(x, x, x * x + 1),
    "maximum": lambda x: torch.maximum(x, x.flip(0)) - torch.minimum(x, 0.1 * x.flip(1)),
    "nan_to_num_masked": lambda x: x.masked_fill(x > 0.5, 0.0).nan_to_num() * 2,
    "to_dtype": lambda x: x.double().exp().float() + x.to(torch.bfloat16).float(),
    "atan2_hypot": lambda x: torch.atan2(x, x.flip(0) + 3) + torch.hypot(x, x.flip(1)),
    "erf_family": lambda x: torch.erf(x) + torch.erfc(x) + torch.special.erfinv(x.tanh() * 0.9),
    "logit": lambda x: torch.logit(torch.sigmoid(x), eps=1e-4),
}


@pytest.mark.parametrize("name", list(UNARY_FUNCTIONS))
def test_gradients_through_bridge(bridged, name):
    through_bridge(UNARY_FUNCTIONS[name], sample((4, 6), torch.float32, -2, 2))


def test_in_place_ops_through_bridge(bridged):
    def function(x):
        y = x * 1
        y.add_(1).mul_(0.5).clamp_(0, 1)
        y[0].zero_()
        y[1].fill_(2.0)
        y.copy_(y * 2 + 1)
        return y.sigmoid_()

    through_bridge(function, sample((3, 5), torch.float32))
