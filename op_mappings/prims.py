"""torch's primitives (`torch.ops.prims`): what torch's reference decompositions lower to.

Mapping them lets every `_refs`-based decomposition run on the bridge. Prims do
no type promotion (their operands already share a dtype), so the entries are
direct `jnp`/`lax` calls.
"""

import jax
import jax.numpy as jnp
import jax.scipy.special as special
import numpy as np
from jax import lax

from bridge.runtime.registry import jnp_dtype, prims, register_mapping
from .common import default_float


_UNARY = {
    "abs": jnp.abs, "acos": jnp.arccos, "acosh": jnp.arccosh, "asin": jnp.arcsin, "asinh": jnp.arcsinh,
    "atan": jnp.arctan, "atanh": jnp.arctanh, "cbrt": jnp.cbrt, "ceil": jnp.ceil, "cos": jnp.cos,
    "cosh": jnp.cosh, "digamma": special.digamma, "erf": special.erf, "erf_inv": special.erfinv,
    "erfc": special.erfc, "exp": jnp.exp, "exp2": jnp.exp2, "expm1": jnp.expm1, "floor": jnp.floor,
    "isfinite": jnp.isfinite, "lgamma": special.gammaln, "log": jnp.log, "log10": jnp.log10,
    "log1p": jnp.log1p, "log2": jnp.log2, "neg": jnp.negative, "reciprocal": jnp.reciprocal,
    "round": jnp.round, "rsqrt": lax.rsqrt, "sign": jnp.sign, "signbit": jnp.signbit, "sin": jnp.sin,
    "sinh": jnp.sinh, "sqrt": jnp.sqrt, "tan": jnp.tan, "tanh": jnp.tanh, "trunc": jnp.trunc,
    "bitwise_not": jnp.invert, "imag": jnp.imag, "real": jnp.real, "conj": jnp.conj,
    "conj_physical": jnp.conj, "bessel_i0": jnp.i0, "bessel_i0e": special.i0e, "bessel_i1": special.i1,
    "bessel_i1e": special.i1e, "ndtri": special.ndtri,
}

_BINARY = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "atan2": jnp.arctan2,
    "bitwise_and": jnp.bitwise_and, "bitwise_or": jnp.bitwise_or, "bitwise_xor": jnp.bitwise_xor,
    "eq": jnp.equal, "ne": jnp.not_equal, "ge": jnp.greater_equal, "gt": jnp.greater,
    "le": jnp.less_equal, "lt": jnp.less, "fmax": jnp.fmax, "fmin": jnp.fmin, "maximum": jnp.maximum,
    "minimum": jnp.minimum, "hypot": jnp.hypot, "nextafter": jnp.nextafter, "pow": jnp.power,
    "gcd": jnp.gcd, "shift_left": jnp.left_shift, "shift_right_arithmetic": jnp.right_shift,
    "igamma": special.gammainc, "igammac": special.gammaincc, "zeta": special.zeta,
}


def _register_table(table):
    for name, function in table.items():
        register_mapping(getattr(prims, name).default, family="prims")(
            lambda *args, _function=function: _function(*args)
        )


_register_table(_UNARY)
_register_table(_BINARY)


@register_mapping(prims.div.default)
def div(a, b):
    # prims.div truncates for integers, as C does.
    if jnp.issubdtype(a.dtype, jnp.integer):
        return lax.div(a, b)
    return a / b


@register_mapping(prims.fmod.default)
def fmod(a, b):
    return jnp.fmod(a, b)


@register_mapping(prims.remainder.default)
def remainder(a, b):
    return jnp.remainder(a, b)


@register_mapping(prims.where.default)
def where(pred, a, b):
    return jnp.where(pred, a, b)


@register_mapping(prims.convert_element_type.default)
def convert_element_type(a, dtype):
    return a.astype(jnp_dtype(dtype))


@register_mapping(prims.broadcast_in_dim.default)
def broadcast_in_dim(a, shape, broadcast_dimensions):
    return lax.broadcast_in_dim(a, tuple(shape), tuple(broadcast_dimensions))


def _reduction(function):
    def body(inp, dims, *, output_dtype=None):
        out = function(inp, axis=None if dims is None else tuple(dims))
        return out if output_dtype is None else out.astype(jnp_dtype(output_dtype))

    return body


for _name, _function in {"sum": jnp.sum, "prod": jnp.prod, "amax": jnp.max, "amin": jnp.min}.items():
    register_mapping(getattr(prims, _name).default, family="prims")(_reduction(_function))


@register_mapping(prims.xor_sum.default)
def xor_sum(inp, dims, *, output_dtype=None):
    out = lax.reduce(inp, np.array(0, inp.dtype), lax.bitwise_xor, tuple(dims) if dims is not None else tuple(range(inp.ndim)))
    return out if output_dtype is None else out.astype(jnp_dtype(output_dtype))


@register_mapping(prims.var.default)
def var(inp, dims, correction=1, *, output_dtype=None):
    axis = None if dims is None else tuple(dims)
    out = jnp.var(inp, axis=axis, ddof=correction)
    return out if output_dtype is None else out.astype(jnp_dtype(output_dtype))


@register_mapping(prims.full.default)
def full(shape, fill_value, *, dtype, device, requires_grad):
    return jnp.full(tuple(shape), fill_value, dtype=jnp_dtype(dtype))


@register_mapping(prims.full_like.default)
def full_like(a, fill_value, *, dtype, device, requires_grad):
    return jnp.full(a.shape, fill_value, dtype=jnp_dtype(dtype))


@register_mapping(prims.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, device=None):
    return jnp.asarray(s, dtype=jnp_dtype(dtype, default_float()))


@register_mapping(prims.iota.default)
def iota(length, *, start, step, dtype, device, requires_grad):
    return start + step * jnp.arange(length, dtype=jnp_dtype(dtype))


@register_mapping(prims.empty_strided.default)
def empty_strided(shape, strides, *, dtype, device, requires_grad):
    return jnp.zeros(tuple(shape), dtype=jnp_dtype(dtype))


@register_mapping(prims.empty.default)
def empty(shape, *, dtype, device, requires_grad):
    return jnp.zeros(tuple(shape), dtype=jnp_dtype(dtype))


@register_mapping(prims.empty_permuted.default)
def empty_permuted(shape, physical_layout, *, dtype, device, requires_grad):
    return jnp.zeros(tuple(shape), dtype=jnp_dtype(dtype))


@register_mapping(prims.clone.default)
def clone(a, *, memory_format=None):
    return a


@register_mapping(prims.copy_strided.default)
def copy_strided(a, stride):
    return a


@register_mapping(prims.device_put.default)
def device_put(a, device, non_blocking=False):
    return a


@register_mapping(prims.view_of.default)
def view_of(a):
    return a


@register_mapping(prims.view_of_dtype.default)
def view_of_dtype(a, dtype):
    return lax.bitcast_convert_type(a, jnp_dtype(dtype))


@register_mapping(prims.collapse_view.default, prims.collapse.default)
def collapse(a, start, end):
    shape = a.shape[:start] + (int(np.prod(a.shape[start : end + 1], dtype=np.int64)),) + a.shape[end + 1 :]
    return a.reshape(shape)


@register_mapping(prims.split_dim.default)
def split_dim(a, dim, outer_length):
    inner = a.shape[dim] // outer_length
    return a.reshape(a.shape[:dim] + (outer_length, inner) + a.shape[dim + 1 :])


@register_mapping(prims.squeeze.default)
def squeeze(a, dimensions):
    return jnp.squeeze(a, axis=tuple(dimensions)) if dimensions else a


@register_mapping(prims.transpose.default)
def transpose(a, permutation):
    return jnp.transpose(a, tuple(permutation))


@register_mapping(prims.reshape.default)
def reshape(a, shape):
    return a.reshape(tuple(shape))


@register_mapping(prims.rev.default)
def rev(a, dims):
    return jnp.flip(a, axis=tuple(dims)) if dims else a


@register_mapping(prims.cat.default)
def cat(tensors, dim):
    return jnp.concatenate(tensors, axis=dim)


@register_mapping(prims.as_strided.default)
def as_strided(a, size, stride, storage_offset):
    positions = storage_offset + sum(
        np.arange(extent, dtype=np.int64).reshape((-1,) + (1,) * (len(size) - axis - 1)) * step
        for axis, (extent, step) in enumerate(zip(size, stride))
    )
    return jnp.ravel(a)[np.asarray(positions, dtype=np.int64).reshape(tuple(size))]


@register_mapping(prims.frexp.default)
def frexp(self):
    mantissa, exponent = jnp.frexp(self)
    return mantissa, exponent.astype(jnp.int32)


@register_mapping(prims.erfcx.default)
def erfcx(a):
    return jnp.exp(a * a) * special.erfc(a)


@register_mapping(prims.spherical_bessel_j0.default)
def spherical_bessel_j0(a):
    return jnp.where(a == 0, jnp.ones_like(a), jnp.sin(a) / jnp.where(a == 0, jnp.ones_like(a), a))


@register_mapping(prims.bessel_j0.default)
def bessel_j0(a):
    return special.bessel_jn(a, v=0)[0]


@register_mapping(prims.bessel_j1.default)
def bessel_j1(a):
    return special.bessel_jn(a, v=1)[1]


@register_mapping(prims.uniform.default, rng=True)
def uniform(shape, low, high, *, dtype, device, generator=None, key):
    return jax.random.uniform(key, tuple(shape), dtype=jnp_dtype(dtype), minval=low, maxval=high)


@register_mapping(prims.normal.default, rng=True)
def normal(shape, mean, std, *, dtype, device, requires_grad, generator=None, key):
    return mean + std * jax.random.normal(key, tuple(shape), dtype=jnp_dtype(dtype))
