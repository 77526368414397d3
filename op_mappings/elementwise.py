"""Elementwise arithmetic, math functions, comparisons, logic, and dtype conversion/copy ops.

Type promotion is declared with `promote=`; bodies receive operands already in torch's compute dtype.
"""

import jax
import jax.numpy as jnp
from jax import lax

from bridge.runtime import registry, versions
from bridge.runtime.dtypes import ALWAYS_BOOL, BOOL_TO_LONG, COMPLEX_TO_FLOAT, DEFAULT, INT_TO_FLOAT, NO_OPMATH
from bridge.runtime.registry import aten, jnp_dtype, register_mapping
from .common import is_integral


# Ops whose result is exact in any dtype skip torch's "opmath" upcast of bfloat16/float16 (NO_OPMATH):
# computing in float32 and rounding back would give the same values at the cost of two casts.


# ---------------------------------------------------------------- arithmetic


def _scaled(value, alpha):
    """value * alpha, as torch's add/sub compute it; not multiplied where alpha is the number 1.
    `alpha` may be a traced float (a step size that changes between eager calls becomes an
    argument of the op's program: runtime/compiled_ops.py); x * 1.0 is x exactly there too."""
    if isinstance(alpha, (bool, int, float)) and alpha == 1:
        return value
    return value * alpha


@register_mapping(aten.add.Tensor, aten.add.Scalar, promote=DEFAULT, operands=("self", "other"))
def add(self, other, alpha=1):
    return jnp.add(self, _scaled(other, alpha))


def _refuse_bool_subtraction(computed_in):
    if computed_in == jnp.bool_:
        raise versions.BOOL_SUBTRACTION_ERROR(
            "Subtraction, the `-` operator, with two bool tensors is not supported. "
            "Use the `^` or `logical_xor()` operator instead."
        )


@register_mapping(aten.sub.Tensor, aten.sub.Scalar, promote=DEFAULT, operands=("self", "other"))
def sub(self, other, alpha=1):
    _refuse_bool_subtraction(self.dtype)
    return jnp.subtract(self, _scaled(other, alpha))


@register_mapping(aten.rsub.Tensor, aten.rsub.Scalar, promote=DEFAULT, operands=("self", "other"))
def rsub(self, other, alpha=1):
    _refuse_bool_subtraction(self.dtype)
    return jnp.subtract(other, _scaled(self, alpha))


@register_mapping(aten.mul.Tensor, aten.mul.Scalar, promote=DEFAULT)
def mul(self, other):
    return jnp.multiply(self, other)


@register_mapping(aten.div.Tensor, aten.div.Scalar, aten.true_divide.Tensor, aten.true_divide.Scalar, promote=INT_TO_FLOAT)
def div(self, other):
    return jnp.true_divide(self, other)


@register_mapping(aten.floor_divide.default, aten.floor_divide.Scalar, promote=DEFAULT)
def floor_divide(self, other):
    if is_integral(self):
        return jnp.floor_divide(self, other)
    # torch divides by zero as a true division (inf, nan); jnp's divmod would give nan throughout.
    return jnp.where(other == 0, jnp.true_divide(self, other), jnp.floor_divide(self, other))


def _trunc_divide(self, other):
    if is_integral(self):
        return lax.div(*jnp.broadcast_arrays(self, jnp.asarray(other, dtype=self.dtype)))
    return jnp.trunc(jnp.true_divide(self, other))


# rounding_mode decides the promotion kind (None divides integers into floats), so each mode
# gets its own promoted function and the entry routes by mode.
_DIVIDE_BY_MODE = {
    None: registry.MAPPINGS[aten.div.Tensor].call,
    "trunc": registry._promoting(_trunc_divide, aten.div.Tensor, DEFAULT, None),
    "floor": registry.MAPPINGS[aten.floor_divide.default].call,
}


@register_mapping(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_rounding(self, other, *, rounding_mode=None):
    return _DIVIDE_BY_MODE[rounding_mode](self, other)


# remainder and fmod keep low-precision floats in their own dtype, as torch's kernels do (a scalar
# divisor is rounded to the tensor's dtype first); fmod is exact in any precision.
@register_mapping(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor, promote=NO_OPMATH)
def remainder(self, other):
    return jnp.remainder(self, other)


@register_mapping(aten.fmod.Tensor, aten.fmod.Scalar, promote=NO_OPMATH)
def fmod(self, other):
    return jnp.fmod(self, other)


def _integer_power(base, exponent):
    # Integers to negative powers: torch gives 1 for base 1, +-1 for base -1 and 0 otherwise.
    result = jnp.power(base, jnp.maximum(exponent, 0))
    odd = (exponent % 2) != 0
    negative_power = jnp.where(base == 1, 1, jnp.where(base == -1, jnp.where(odd, -1, 1), 0))
    return jnp.where(exponent < 0, negative_power.astype(result.dtype), result)


@register_mapping(aten.pow.Tensor_Tensor, aten.pow.Scalar, promote=BOOL_TO_LONG)
def pow_tensor(self, exponent):
    if jnp.issubdtype(jnp.result_type(self, exponent), jnp.integer) and hasattr(exponent, "dtype"):
        return _integer_power(jnp.asarray(self, dtype=exponent.dtype), exponent)
    return jnp.power(self, exponent)


@register_mapping(aten.pow.Tensor_Scalar, promote=BOOL_TO_LONG)
def pow_scalar(self, exponent):
    # A Python int exponent becomes lax.integer_pow (repeated multiplication, as torch does for small powers).
    return jnp.power(self, exponent)


@register_mapping(aten.float_power.Tensor_Tensor, aten.float_power.Tensor_Scalar, aten.float_power.Scalar)
def float_power(self, exponent):
    # float_power always computes in double (complex double for complex inputs).
    is_complex = any(jnp.iscomplexobj(value) for value in (self, exponent))
    dtype = jnp.complex128 if is_complex else jnp.float64
    return jnp.power(jnp.asarray(self, dtype=dtype), jnp.asarray(exponent, dtype=dtype))


@register_mapping(aten.square.default, promote=BOOL_TO_LONG)
def square(self):
    return jnp.multiply(self, self)


@register_mapping(aten.lerp.Scalar, aten.lerp.Tensor, promote=DEFAULT)
def lerp(self, end, weight):
    # torch's formula: interpolate from the nearer endpoint for accuracy near weight 1.
    difference = end - self
    return jnp.where(jnp.abs(weight) < 0.5, self + weight * difference, end - difference * (1 - weight))


@register_mapping(aten.addcmul.default, promote=DEFAULT)
def addcmul(self, tensor1, tensor2, *, value=1):
    return self + value * tensor1 * tensor2


@register_mapping(aten.addcdiv.default, promote=DEFAULT)
def addcdiv(self, tensor1, tensor2, *, value=1):
    return self + value * tensor1 / tensor2


@register_mapping(aten.neg.default, promote=NO_OPMATH)
def neg(self):
    return jnp.negative(self)


@register_mapping(aten.positive.default)
def positive(self):
    return self


# abs at 0 gives 0, clamp passes the gradient at its bounds, as in torch (JAX's clip halves it
# there, and its masks multiply, so an infinite gradient beyond a bound becomes NaN).
@register_mapping(aten.abs.default, promote=COMPLEX_TO_FLOAT, gradient="torch")
def abs(self):
    if self.dtype == jnp.bool_:
        return self
    return jnp.abs(self)


@register_mapping(aten.sign.default, promote=NO_OPMATH)
def sign(self):
    if self.dtype == jnp.bool_:
        return self
    # torch's formula, which makes the sign of NaN 0 (jnp.sign keeps NaN).
    return (self > 0).astype(self.dtype) - (self < 0).astype(self.dtype)


@register_mapping(aten.sgn.default, promote=NO_OPMATH)
def sgn(self):
    if jnp.iscomplexobj(self):
        magnitude = jnp.abs(self)
        return jnp.where(magnitude == 0, 0, self / jnp.where(magnitude == 0, 1, magnitude))
    return sign(self)


@register_mapping(aten.signbit.default, promote=ALWAYS_BOOL)
def signbit(self):
    if self.dtype == jnp.bool_:
        return jnp.zeros(self.shape, dtype=jnp.bool_)
    return jnp.signbit(self)


@register_mapping(aten.reciprocal.default, promote=INT_TO_FLOAT)
def reciprocal(self):
    return jnp.reciprocal(self)


# ---------------------------------------------------------------- unary math (integers compute in float)


def _logit(self, eps=None):
    if eps is not None:
        self = jnp.clip(self, eps, 1 - eps)
    return jnp.log(self / (1 - self))


_FLOAT_UNARY = {
    aten.exp.default: jnp.exp,
    aten.exp2.default: jnp.exp2,
    aten.expm1.default: jnp.expm1,
    aten.log.default: jnp.log,
    aten.log2.default: jnp.log2,
    aten.log10.default: jnp.log10,
    aten.log1p.default: jnp.log1p,
    aten.sqrt.default: jnp.sqrt,
    aten.rsqrt.default: lax.rsqrt,
    aten.sin.default: jnp.sin,
    aten.cos.default: jnp.cos,
    aten.tan.default: jnp.tan,
    aten.asin.default: jnp.arcsin,
    aten.acos.default: jnp.arccos,
    aten.atan.default: jnp.arctan,
    aten.sinh.default: jnp.sinh,
    aten.cosh.default: jnp.cosh,
    aten.tanh.default: jnp.tanh,
    aten.asinh.default: jnp.arcsinh,
    aten.acosh.default: jnp.arccosh,
    aten.atanh.default: jnp.arctanh,
    aten.erf.default: lax.erf,
    aten.erfc.default: lax.erfc,
    aten.erfinv.default: lax.erf_inv,
    aten.sigmoid.default: jax.nn.sigmoid,
    aten.logit.default: _logit,
    aten.lgamma.default: lax.lgamma,
}

for _op, _function in _FLOAT_UNARY.items():
    register_mapping(_op, promote=INT_TO_FLOAT, family="elementwise")(_function)


def _identity_for_integers(function):
    def rounding(self):
        return self if is_integral(self) else function(self)

    rounding.__name__ = function.__name__
    return rounding


_ROUNDING = {
    aten.floor.default: jnp.floor,
    aten.ceil.default: jnp.ceil,
    aten.trunc.default: jnp.trunc,
    aten.fix.default: jnp.trunc,
    aten.round.default: jnp.round,  # both round half to even
}

for _op, _function in _ROUNDING.items():
    register_mapping(_op, promote=DEFAULT, family="elementwise")(_identity_for_integers(_function))


@register_mapping(aten.round.decimals, promote=DEFAULT)
def round_decimals(self, *, decimals=0):
    # Scale as torch does: multiply for positive decimals, divide for negative ones.
    if decimals >= 0:
        scale = 10.0**decimals
        return jnp.round(self * scale) / scale
    scale = 10.0 ** (-decimals)
    return jnp.round(self / scale) * scale


@register_mapping(aten.frac.default, promote=DEFAULT)
def frac(self):
    return self - jnp.trunc(self)


# ---------------------------------------------------------------- binary math


@register_mapping(aten.atan2.default, promote=INT_TO_FLOAT)
def atan2(self, other):
    return jnp.arctan2(self, other)


@register_mapping(aten.hypot.default, promote=DEFAULT)
def hypot(self, other):
    return jnp.hypot(self, other)


@register_mapping(aten.copysign.Tensor, aten.copysign.Scalar, promote=INT_TO_FLOAT)
def copysign(self, other):
    return jnp.copysign(self, other)


@register_mapping(aten.xlogy.Tensor, aten.xlogy.Scalar_Other, aten.xlogy.Scalar_Self, promote=INT_TO_FLOAT)
def xlogy(self, other):
    product = self * jnp.log(other)
    return jnp.where(jnp.isnan(other), jnp.nan, jnp.where(self == 0, 0, product))


@register_mapping(
    aten.special_xlog1py.default, aten.special_xlog1py.other_scalar, aten.special_xlog1py.self_scalar, promote=INT_TO_FLOAT
)
def xlog1py(self, other):
    product = self * jnp.log1p(other)
    return jnp.where(jnp.isnan(other), jnp.nan, jnp.where(self == 0, 0, product))


@register_mapping(aten.heaviside.default, promote=DEFAULT)
def heaviside(self, values):
    return jnp.where(self == 0, values, jnp.where(self > 0, 1, 0).astype(self.dtype))


@register_mapping(aten.maximum.default, aten.max.other, promote=NO_OPMATH)
def maximum(self, other):
    return jnp.maximum(self, other)


@register_mapping(aten.minimum.default, aten.min.other, promote=NO_OPMATH)
def minimum(self, other):
    return jnp.minimum(self, other)


@register_mapping(aten.fmax.default, promote=NO_OPMATH)
def fmax(self, other):
    return jnp.fmax(self, other)


@register_mapping(aten.fmin.default, promote=NO_OPMATH)
def fmin(self, other):
    return jnp.fmin(self, other)


# Optional bounds are named explicitly: they take part in promotion (an int tensor clamped to 0.5 is float).
@register_mapping(
    aten.clamp.default, aten.clamp.Tensor, promote=NO_OPMATH, operands=("self", "min", "max"),
    gradient="torch",
)
def clamp(self, min=None, max=None):
    # torch applies min first, then max, so max wins where min > max.
    if min is not None:
        self = jnp.maximum(self, min)
    if max is not None:
        self = jnp.minimum(self, max)
    return self


@register_mapping(aten.clamp_min.default, aten.clamp_min.Tensor, promote=NO_OPMATH, gradient="torch")
def clamp_min(self, min):
    return jnp.maximum(self, min)


@register_mapping(aten.clamp_max.default, aten.clamp_max.Tensor, promote=NO_OPMATH, gradient="torch")
def clamp_max(self, max):
    return jnp.minimum(self, max)


# ---------------------------------------------------------------- comparisons and logic

_COMPARISONS = {
    aten.eq: jnp.equal,
    aten.ne: jnp.not_equal,
    aten.lt: jnp.less,
    aten.le: jnp.less_equal,
    aten.gt: jnp.greater,
    aten.ge: jnp.greater_equal,
}

for _packet, _function in _COMPARISONS.items():
    register_mapping(_packet.Tensor, _packet.Scalar, promote=ALWAYS_BOOL, family="elementwise")(_function)

_LOGICAL = {
    aten.logical_and.default: jnp.logical_and,
    aten.logical_or.default: jnp.logical_or,
    aten.logical_xor.default: jnp.logical_xor,
}

for _op, _function in _LOGICAL.items():
    register_mapping(_op, promote=ALWAYS_BOOL, family="elementwise")(_function)


@register_mapping(aten.logical_not.default, promote=ALWAYS_BOOL)
def logical_not(self):
    return jnp.logical_not(self)


_BITWISE = {
    aten.bitwise_and: jnp.bitwise_and,
    aten.bitwise_or: jnp.bitwise_or,
    aten.bitwise_xor: jnp.bitwise_xor,
}

for _packet, _function in _BITWISE.items():
    register_mapping(_packet.Tensor, _packet.Scalar, _packet.Scalar_Tensor, promote=DEFAULT, family="elementwise")(_function)


@register_mapping(aten.bitwise_not.default, promote=DEFAULT)
def bitwise_not(self):
    return jnp.bitwise_not(self)


@register_mapping(
    aten.bitwise_left_shift.Tensor,
    aten.bitwise_left_shift.Tensor_Scalar,
    aten.bitwise_left_shift.Scalar_Tensor,
    aten.__lshift__.Tensor,
    aten.__lshift__.Scalar,
    promote=DEFAULT,
)
def left_shift(self, other):
    return jnp.left_shift(self, other)


@register_mapping(
    aten.bitwise_right_shift.Tensor,
    aten.bitwise_right_shift.Tensor_Scalar,
    aten.bitwise_right_shift.Scalar_Tensor,
    aten.__rshift__.Tensor,
    aten.__rshift__.Scalar,
    promote=DEFAULT,
)
def right_shift(self, other):
    return jnp.right_shift(self, other)


@register_mapping(aten.isnan.default, promote=ALWAYS_BOOL)
def isnan(self):
    return jnp.isnan(self)


@register_mapping(aten.isinf.default, promote=ALWAYS_BOOL)
def isinf(self):
    return jnp.isinf(self)


@register_mapping(aten.isfinite.default, promote=ALWAYS_BOOL)
def isfinite(self):
    return jnp.isfinite(self)


@register_mapping(aten.isposinf.default, promote=ALWAYS_BOOL)
def isposinf(self):
    return jnp.isposinf(self)


@register_mapping(aten.isneginf.default, promote=ALWAYS_BOOL)
def isneginf(self):
    return jnp.isneginf(self)


@register_mapping(aten.nan_to_num.default)
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    if is_integral(self):
        return self
    return jnp.nan_to_num(self, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


# ---------------------------------------------------------------- selection


@register_mapping(
    aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
    promote=NO_OPMATH, operands=("self", "other"),
)
def where(condition, self, other):
    return jnp.where(condition.astype(jnp.bool_), self, other)


@register_mapping(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(self, mask, value):
    # The result keeps self's dtype whatever the fill value's type.
    return jnp.where(mask, jnp.asarray(value).astype(self.dtype), self)


# ---------------------------------------------------------------- copies, fills and dtype conversion


def _convert(value, dtype):
    if jnp.iscomplexobj(value) and not jnp.issubdtype(dtype, jnp.complexfloating):
        value = jnp.real(value)  # torch drops the imaginary part (with a warning of its own)
    if jnp.issubdtype(dtype, jnp.unsignedinteger) and jnp.issubdtype(value.dtype, jnp.floating):
        # torch converts negative floats to unsigned types through a signed integer (-1.0 -> 255);
        # XLA's direct conversion would saturate at 0.
        value = value.astype(jnp.int64)
    return value.astype(dtype)


@register_mapping(aten._to_copy.default, host_tensors=True)
def to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    # jax arrays are immutable, so a copy to the same dtype is the array itself.
    if dtype is None:
        return self
    return _convert(self, jnp_dtype(dtype))


@register_mapping(aten.clone.default)
def clone(self, *, memory_format=None):
    return self


@register_mapping(aten.copy.default, host_tensors=True)
def copy(self, src, non_blocking=False):
    return jnp.broadcast_to(_convert(src, self.dtype), self.shape)


@register_mapping(aten.fill.Scalar)
def fill_scalar(self, value):
    return jnp.full(self.shape, value, dtype=self.dtype)


@register_mapping(aten.fill.Tensor)
def fill_tensor(self, value):
    return jnp.broadcast_to(_convert(value, self.dtype), self.shape)


@register_mapping(aten.zero.default)
def zero(self):
    return jnp.zeros(self.shape, dtype=self.dtype)


# ---------------------------------------------------------------- complex parts


@register_mapping(aten.real.default)
def real(self):
    return jnp.real(self) if jnp.iscomplexobj(self) else self


@register_mapping(aten.imag.default)
def imag(self):
    return jnp.imag(self)


@register_mapping(aten._conj.default, aten.conj_physical.default)
def conj(self):
    return jnp.conj(self) if jnp.iscomplexobj(self) else self


# Bridge arrays hold their values physically (no lazy conjugate/negative bits), so resolving is a no-op.
@register_mapping(aten.resolve_conj.default, aten.resolve_neg.default)
def resolve(self):
    return self

