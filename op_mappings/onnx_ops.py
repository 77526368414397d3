"""The ONNX-op table, elementwise family: arithmetic, comparisons, logic, casts and activations,
one entry per ONNX op type (runtime/onnx_graph.py runs them). Importing this module registers the
whole table: the other families (onnx_ops_*.py) are imported at its end.

An entry takes the node's inputs positionally (None where an optional input is omitted) and its
attributes as keywords, with ONNX's defaults; inputs and attributes that share a name (Clip's
min, Squeeze's axes, which moved from attribute to input in later opsets) are told apart by the
`_input` suffix of the positional parameter. ONNX ops keep their inputs' dtype: entries compute
in it and never promote, and broadcasting is NumPy's, as jnp's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge.runtime.onnx_graph import onnx_dtype, register_onnx_op

# ------------------------------------------------------------------------------------- unary

_UNARY = {
    "Abs": jnp.abs,
    "Neg": jnp.negative,
    "Floor": jnp.floor,
    "Ceil": jnp.ceil,
    "Round": jnp.round,  # halves to even, as ONNX
    "Sqrt": jnp.sqrt,
    "Exp": jnp.exp,
    "Log": jnp.log,
    "Sin": jnp.sin,
    "Cos": jnp.cos,
    "Tan": jnp.tan,
    "Asin": jnp.arcsin,
    "Acos": jnp.arccos,
    "Atan": jnp.arctan,
    "Sinh": jnp.sinh,
    "Cosh": jnp.cosh,
    "Asinh": jnp.arcsinh,
    "Acosh": jnp.arccosh,
    "Atanh": jnp.arctanh,
    "Tanh": jnp.tanh,
    "Sigmoid": jax.nn.sigmoid,
    "Erf": lax.erf,
    "Sign": jnp.sign,
    "IsNaN": jnp.isnan,
    "Not": jnp.logical_not,
    "BitwiseNot": jnp.bitwise_not,
    "Softsign": lambda x: x / (1 + jnp.abs(x)),
    "Softplus": lambda x: jnp.logaddexp(x, jnp.zeros_like(x)),
    "Mish": lambda x: x * jnp.tanh(jnp.logaddexp(x, jnp.zeros_like(x))),
    "HardSwish": lambda x: x * jnp.clip(x / 6 + 0.5, 0, 1).astype(x.dtype),
}


def _register_unary(op_type, function):
    @register_onnx_op(op_type)
    def unary(x):
        return function(x)

    unary.__name__ = op_type.lower()


for _op_type, _function in _UNARY.items():
    _register_unary(_op_type, _function)


@register_onnx_op("Reciprocal")
def reciprocal(x):
    return (jnp.ones((), x.dtype) / x).astype(x.dtype)


@register_onnx_op("Relu")
def relu(x):
    return jnp.maximum(x, jnp.zeros((), x.dtype))


@register_onnx_op("IsInf")
def is_inf(x, *, detect_negative=1, detect_positive=1):
    return (jnp.isposinf(x) & bool(detect_positive)) | (jnp.isneginf(x) & bool(detect_negative))


# ------------------------------------------------------------------------------- activations


@register_onnx_op("LeakyRelu")
def leaky_relu(x, *, alpha=0.01):
    return jnp.where(x >= 0, x, x * jnp.asarray(alpha, x.dtype))


@register_onnx_op("PRelu")
def prelu(x, slope):
    return jnp.where(x >= 0, x, x * slope).astype(x.dtype)


@register_onnx_op("Elu")
def elu(x, *, alpha=1.0):
    return jnp.where(x > 0, x, jnp.asarray(alpha, x.dtype) * jnp.expm1(x))


@register_onnx_op("Celu")
def celu(x, *, alpha=1.0):
    alpha = jnp.asarray(alpha, x.dtype)
    return jnp.maximum(0, x) + jnp.minimum(0, alpha * jnp.expm1(x / alpha))


@register_onnx_op("Selu")
def selu(x, *, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875):
    alpha, gamma = jnp.asarray(alpha, x.dtype), jnp.asarray(gamma, x.dtype)
    return jnp.where(x > 0, gamma * x, gamma * alpha * jnp.expm1(x))


@register_onnx_op("ThresholdedRelu")
def thresholded_relu(x, *, alpha=1.0):
    return jnp.where(x > alpha, x, jnp.zeros((), x.dtype))


@register_onnx_op("HardSigmoid")
def hard_sigmoid(x, *, alpha=0.2, beta=0.5):
    return jnp.clip(x * jnp.asarray(alpha, x.dtype) + jnp.asarray(beta, x.dtype), 0, 1).astype(x.dtype)


@register_onnx_op("Shrink")
def shrink(x, *, bias=0.0, lambd=0.5):
    bias = jnp.asarray(bias).astype(x.dtype)
    return jnp.where(x < -lambd, x + bias, jnp.where(x > lambd, x - bias, jnp.zeros((), x.dtype)))


@register_onnx_op("Swish")
def swish(x, *, alpha=1.0):
    return x * jax.nn.sigmoid(jnp.asarray(alpha, x.dtype) * x)


@register_onnx_op("Gelu")
def gelu(x, *, approximate="none"):
    return jax.nn.gelu(x, approximate=approximate == "tanh").astype(x.dtype)


# ---------------------------------------------------------------------------------- binary


def _integral(x):
    return jnp.issubdtype(x.dtype, jnp.integer)


@register_onnx_op("Add")
def add(a, b):
    return jnp.add(a, b).astype(a.dtype)


@register_onnx_op("Sub")
def sub(a, b):
    return jnp.subtract(a, b).astype(a.dtype)


@register_onnx_op("Mul")
def mul(a, b):
    return jnp.multiply(a, b).astype(a.dtype)


@register_onnx_op("Div")
def div(a, b):
    if _integral(a):  # C's integer division: toward zero
        return lax.div(*jnp.broadcast_arrays(a, b.astype(a.dtype)))
    return jnp.divide(a, b).astype(a.dtype)


@register_onnx_op("Mod")
def mod(a, b, *, fmod=0):
    if fmod or not _integral(a):
        return jnp.fmod(a, b).astype(a.dtype) if fmod else jnp.mod(a, b).astype(a.dtype)
    return jnp.mod(a, b).astype(a.dtype)


@register_onnx_op("Pow")
def power(x, y):
    if _integral(x) and _integral(y):
        return jnp.power(x, y.astype(x.dtype))
    compute = jnp.promote_types(x.dtype, y.dtype) if not _integral(y) else x.dtype
    if _integral(x):
        compute = jnp.float64
    return jnp.power(x.astype(compute), y.astype(compute)).astype(x.dtype)


@register_onnx_op("BitShift")
def bit_shift(x, y, *, direction):
    y = y.astype(x.dtype)
    return jnp.left_shift(x, y) if direction == "LEFT" else jnp.right_shift(x, y)


_BINARY = {
    "Equal": jnp.equal,
    "Greater": jnp.greater,
    "GreaterOrEqual": jnp.greater_equal,
    "Less": jnp.less,
    "LessOrEqual": jnp.less_equal,
    "And": jnp.logical_and,
    "Or": jnp.logical_or,
    "Xor": jnp.logical_xor,
    "BitwiseAnd": jnp.bitwise_and,
    "BitwiseOr": jnp.bitwise_or,
    "BitwiseXor": jnp.bitwise_xor,
}


def _register_binary(op_type, function):
    @register_onnx_op(op_type)
    def binary(a, b):
        if isinstance(a, np.ndarray) and a.dtype.kind in "OUS":  # strings (Equal), known while tracing
            return np.equal(a.astype(object), np.asarray(b).astype(object))
        return function(a, b)

    binary.__name__ = op_type.lower()


for _op_type, _function in _BINARY.items():
    _register_binary(_op_type, _function)


def _variadic(function):
    def reduce(*inputs):
        result = inputs[0]
        for value in inputs[1:]:
            result = function(result, value)
        return result.astype(inputs[0].dtype)

    return reduce


register_onnx_op("Max")(_variadic(jnp.maximum))
register_onnx_op("Min")(_variadic(jnp.minimum))
register_onnx_op("Sum")(_variadic(jnp.add))


@register_onnx_op("Mean")
def mean(*inputs):
    return (_variadic(jnp.add)(*inputs) / len(inputs)).astype(inputs[0].dtype)


@register_onnx_op("Where")
def where(condition, x, y):
    return jnp.where(condition, x, y)


@register_onnx_op("Clip")
def clip(x, min_input=None, max_input=None, *, min=None, max=None):
    low = min_input if min_input is not None else min
    high = max_input if max_input is not None else max
    if low is not None:
        x = jnp.maximum(x, jnp.asarray(low).astype(x.dtype))
    if high is not None:
        x = jnp.minimum(x, jnp.asarray(high).astype(x.dtype))
    return x


# ------------------------------------------------------------------------------------ casts


def _cast(x, dtype, saturate):
    dtype = np.dtype(dtype)
    if isinstance(x, np.ndarray) and (x.dtype == object or dtype == object):
        return _cast_strings(x, dtype)
    source = np.dtype(x.dtype)
    if saturate and dtype.name.startswith(("float8", "float4")):
        # ONNX's saturating cast to float8: out-of-range finite values clamp to the largest.
        largest = float(jnp.finfo(dtype).max)
        if source.kind == "f" or source.name == "bfloat16":
            keeps_infinity = bool(np.isinf(np.asarray(np.inf, np.float32).astype(dtype)))
            clipped = jnp.clip(x, -largest, largest)
            x = jnp.where(jnp.isinf(x), x, clipped) if keeps_infinity else jnp.where(jnp.isnan(x), x, clipped)
    if dtype == np.bool_:
        return x != 0
    return jnp.asarray(x).astype(dtype)


def _cast_strings(x, dtype):
    if dtype == object:
        if x.dtype.kind == "f":
            return np.vectorize(lambda item: np.format_float_positional(item, trim="-") if np.isfinite(item) else str(item).upper().replace("INF", "INF"))(x).astype(object) if x.size else x.astype(object)
        return x.astype(str).astype(object)
    return np.asarray(x.astype(str).astype(np.float64) if dtype.kind == "f" else x.astype(str)).astype(dtype)


@register_onnx_op("Cast", ignores=("round_mode",))
def cast(x, *, to, saturate=1):
    return _cast(x, onnx_dtype(to), saturate)


@register_onnx_op("CastLike", ignores=("round_mode",))
def cast_like(x, target, *, saturate=1):
    return _cast(x, target.dtype, saturate)


# The other families register when this module is imported.
from . import onnx_ops_control, onnx_ops_nn, onnx_ops_tensor  # noqa: E402,F401
