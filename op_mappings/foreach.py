"""The `_foreach_*` ops of torch's optimizers and gradient clipping, as the elementwise entries applied per tensor.

Each tensor of a list promotes on its own, as torch's per-tensor fallback does, so the entries
reuse the promoted `call`s of the elementwise and reduction tables. The in-place forms
(`_foreach_add_`) are derived by the runtime from these functional ones.
"""

import jax.numpy as jnp

from bridge.runtime.registry import MAPPINGS, aten, jnp_dtype, register_mapping

from . import elementwise, reductions  # noqa: F401  (their entries are reused below)



def _call(op):
    return MAPPINGS[op].call


def _scalar_for(tensor, value):
    """A per-tensor scalar given as a 0-dim array (`.Tensor` overloads): computed as torch's double scalar would be."""
    if jnp.issubdtype(tensor.dtype, jnp.floating) and jnp.finfo(tensor.dtype).bits < 32:
        return value.astype(jnp.float32)
    return value.astype(tensor.dtype) if jnp.issubdtype(tensor.dtype, jnp.inexact) else value


# ---------------------------------------------------------------- unary

_UNARY = {
    aten._foreach_abs: aten.abs.default,
    aten._foreach_acos: aten.acos.default,
    aten._foreach_asin: aten.asin.default,
    aten._foreach_atan: aten.atan.default,
    aten._foreach_ceil: aten.ceil.default,
    aten._foreach_cos: aten.cos.default,
    aten._foreach_cosh: aten.cosh.default,
    aten._foreach_erf: aten.erf.default,
    aten._foreach_erfc: aten.erfc.default,
    aten._foreach_exp: aten.exp.default,
    aten._foreach_expm1: aten.expm1.default,
    aten._foreach_floor: aten.floor.default,
    aten._foreach_frac: aten.frac.default,
    aten._foreach_lgamma: aten.lgamma.default,
    aten._foreach_log: aten.log.default,
    aten._foreach_log10: aten.log10.default,
    aten._foreach_log1p: aten.log1p.default,
    aten._foreach_log2: aten.log2.default,
    aten._foreach_neg: aten.neg.default,
    aten._foreach_reciprocal: aten.reciprocal.default,
    aten._foreach_round: aten.round.default,
    aten._foreach_rsqrt: aten.rsqrt.default,
    aten._foreach_sigmoid: aten.sigmoid.default,
    aten._foreach_sign: aten.sign.default,
    aten._foreach_sin: aten.sin.default,
    aten._foreach_sinh: aten.sinh.default,
    aten._foreach_sqrt: aten.sqrt.default,
    aten._foreach_tan: aten.tan.default,
    aten._foreach_tanh: aten.tanh.default,
    aten._foreach_trunc: aten.trunc.default,
    aten._foreach_zero: aten.zero.default,
    aten._foreach_clone: aten.clone.default,
    aten._foreach_max: aten.max.default,
}


def _each_unary(op):
    call = _call(op)

    def foreach_unary(self, **ignored):  # _foreach_clone's memory_format
        return [call(tensor) for tensor in self]

    return foreach_unary


for _packet, _op in _UNARY.items():
    register_mapping(_packet.default, family="foreach")(_each_unary(_op))


@register_mapping(aten._foreach_copy.default)
def foreach_copy(self, src, non_blocking=False):
    copy = _call(aten.copy.default)
    return [copy(tensor, source) for tensor, source in zip(self, src)]


# ---------------------------------------------------------------- binary: List, Scalar, ScalarList, Tensor overloads

# foreach packet -> (op for tensor/scalar pairs, whether it takes alpha)
_BINARY = {
    aten._foreach_add: (aten.add.Tensor, True),
    aten._foreach_sub: (aten.sub.Tensor, True),
    aten._foreach_mul: (aten.mul.Tensor, False),
    aten._foreach_div: (aten.div.Tensor, False),
    aten._foreach_maximum: (aten.maximum.default, False),
    aten._foreach_minimum: (aten.minimum.default, False),
    aten._foreach_clamp_min: (aten.clamp_min.Tensor, False),
    aten._foreach_clamp_max: (aten.clamp_max.Tensor, False),
    aten._foreach_pow: (aten.pow.Tensor_Tensor, False),
}


def _each_pair(op):
    call = _call(op)

    def foreach_list(self, other, **alpha):
        return [call(tensor, operand, **alpha) for tensor, operand in zip(self, other)]

    def foreach_scalar(self, scalar, **alpha):
        return [call(tensor, scalar, **alpha) for tensor in self]

    return foreach_list, foreach_scalar


for _packet, (_op, _takes_alpha) in _BINARY.items():
    _foreach_list, _foreach_scalar = _each_pair(_op)
    _overloads = _packet.overloads()
    for _name, _body in (("List", _foreach_list), ("ScalarList", _foreach_list), ("Scalar", _foreach_scalar), ("Tensor", _foreach_scalar)):
        if _name in _overloads:
            register_mapping(getattr(_packet, _name), family="foreach")(_body)


@register_mapping(aten._foreach_pow.ScalarAndTensor)
def foreach_pow_scalar_base(self, exponent):
    power = _call(aten.pow.Scalar)
    return [power(self, tensor) for tensor in exponent]


# ---------------------------------------------------------------- ternary


def _each_pointwise(op):
    call = _call(op)

    def foreach_scalar(self, tensor1, tensor2, value=1):
        return [call(a, b, c, value=value) for a, b, c in zip(self, tensor1, tensor2)]

    def foreach_scalar_list(self, tensor1, tensor2, scalars):
        return [call(a, b, c, value=scalar) for a, b, c, scalar in zip(self, tensor1, tensor2, scalars)]

    def foreach_tensor(self, tensor1, tensor2, scalars):
        # scalars: a 1-D tensor holding one value per tensor of the list.
        return [call(a, b, c, value=_scalar_for(a, scalars[index])) for index, (a, b, c) in enumerate(zip(self, tensor1, tensor2))]

    return foreach_scalar, foreach_scalar_list, foreach_tensor


for _packet, _op in ((aten._foreach_addcmul, aten.addcmul.default), (aten._foreach_addcdiv, aten.addcdiv.default)):
    for _name, _body in zip(("Scalar", "ScalarList", "Tensor"), _each_pointwise(_op)):
        register_mapping(getattr(_packet, _name), family="foreach")(_body)


@register_mapping(aten._foreach_lerp.List, aten._foreach_lerp.ScalarList)
def foreach_lerp_list(self, tensors1, weights):
    lerp = _call(aten.lerp.Tensor)
    return [lerp(start, end, weight) for start, end, weight in zip(self, tensors1, weights)]


@register_mapping(aten._foreach_lerp.Scalar)
def foreach_lerp_scalar(self, tensors1, weight):
    lerp = _call(aten.lerp.Scalar)
    return [lerp(start, end, weight) for start, end in zip(self, tensors1)]


# ---------------------------------------------------------------- norms


@register_mapping(aten._foreach_norm.Scalar)
def foreach_norm(self, ord=2, dtype=None):
    norm = _call(aten.linalg_vector_norm.default)
    return [norm(tensor, ord, dtype=dtype) for tensor in self]


@register_mapping(aten._foreach_powsum.Scalar)
def foreach_powsum(self, ord=2, dtype=None):
    # sum(|x|^ord) per tensor: the norm before its final root.
    results = []
    for tensor in self:
        values = tensor if dtype is None else tensor.astype(jnp_dtype(dtype))
        compute = jnp.float32 if values.dtype in (jnp.bfloat16, jnp.float16) else values.dtype
        magnitude = jnp.abs(values.astype(compute))
        results.append(jnp.sum(jnp.power(magnitude, ord)).astype(jnp.real(values).dtype))
    return results
