"""Matrix products: mm, bmm, the add*-fused forms (addmm, baddbmm, addbmm, addmv), mv, dot, vdot.

Half-precision inputs accumulate in float32 and round once, as torch's kernels do;
float32 products use the precision that torch's matmul setting asks for.
"""

import functools

import jax
import jax.numpy as jnp

from bridge.runtime import config
from bridge.runtime.registry import aten, jnp_dtype, register_mapping

_LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_FLOAT32 = jnp.dtype(jnp.float32)


def _accumulator(dtype):
    return jnp.dtype(jnp.float32) if dtype in _LOW_PRECISION else dtype


def _product(subscripts, left, right, out_dtype=None):
    """einsum in the accumulation dtype of the operands, rounded to `out_dtype` (default: the operands')."""
    out_dtype = left.dtype if out_dtype is None else out_dtype
    if config.settings.tracing and left.dtype in _LOW_PRECISION and left.dtype == right.dtype:
        return _half_einsum(subscripts, left, right, config.matmul_precision(), jnp.dtype(out_dtype))
    product = jnp.einsum(
        subscripts,
        left,
        right,
        precision=config.matmul_precision(),
        preferred_element_type=_accumulator(left.dtype),
    )
    return product.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def _half_einsum(subscripts, left, right, precision, out_dtype):
    """A half-precision product accumulated in float32 (as torch's kernels do) and returned in
    `out_dtype`, whose gradient products run in half precision as torch's backward does:
    differentiated as written, they would take the float32 cotangent and run in float32 (used
    in captured regions, where JAX differentiates the tables). Returned in the operands' own
    dtype, the product is one GEMM writing half precision, rounded once as torch's is: a
    float32 result and a separate rounding cost GPT-2's vocabulary projection a pass over
    its 0.4 G logits."""
    if out_dtype == left.dtype:
        return jnp.einsum(subscripts, left, right, precision=precision)
    return jnp.einsum(subscripts, left, right, precision=precision, preferred_element_type=jnp.float32).astype(out_dtype)


def _half_einsum_forward(subscripts, left, right, precision, out_dtype):
    return _half_einsum(subscripts, left, right, precision, out_dtype), (left, right)


def _half_einsum_backward(subscripts, precision, out_dtype, saved, cotangent):
    left, right = saved
    _, pullback = jax.vjp(lambda a, b: jnp.einsum(subscripts, a, b, precision=precision), left, right)
    return pullback(cotangent.astype(left.dtype))


_half_einsum.defvjp(_half_einsum_forward, _half_einsum_backward)


def _fused_add(self, product, beta, alpha, out_dtype):
    """beta * self + alpha * product, where beta == 0 ignores self (NaN included), as torch does."""
    accumulator = _accumulator(out_dtype)
    product = product.astype(accumulator)
    if alpha != 1:
        product = product * jnp.asarray(alpha, dtype=accumulator)
    if beta == 0:
        return product.astype(out_dtype)
    base = self.astype(accumulator)
    if beta != 1:
        base = base * jnp.asarray(beta, dtype=accumulator)
    return (base + product).astype(out_dtype)


# --- plain products ---


@register_mapping(aten.mm.default)
def mm(self, mat2):
    return _product("ij,jk->ik", self, mat2)


@register_mapping(aten.mm.dtype)
def mm_dtype(self, mat2, out_dtype):
    return _product("ij,jk->ik", self, mat2, jnp_dtype(out_dtype))


@register_mapping(aten.bmm.default)
def bmm(self, mat2):
    return _product("bij,bjk->bik", self, mat2)


@register_mapping(aten.bmm.dtype)
def bmm_dtype(self, mat2, out_dtype):
    return _product("bij,bjk->bik", self, mat2, jnp_dtype(out_dtype))


@register_mapping(aten.mv.default)
def mv(self, vec):
    return _product("ij,j->i", self, vec)


@register_mapping(aten.dot.default)
def dot(self, tensor):
    return _product("i,i->", self, tensor)


@register_mapping(aten.vdot.default)
def vdot(self, other):
    return _product("i,i->", jnp.conj(self), other)


@register_mapping(aten.outer.default)
def outer(self, vec2):
    return self[:, None] * vec2[None, :]


# --- products fused with a scaled addition: beta * self + alpha * (product) ---


def _addmm(self, mat1, mat2, beta, alpha, out_dtype):
    if config.settings.tracing and mat1.dtype in _LOW_PRECISION and mat1.dtype == mat2.dtype:
        return _fused_add(self, _half_einsum("ij,jk->ik", mat1, mat2, config.matmul_precision(), _FLOAT32), beta, alpha, out_dtype)
    product = jnp.einsum(
        "ij,jk->ik", mat1, mat2, precision=config.matmul_precision(), preferred_element_type=_accumulator(mat1.dtype)
    )
    return _fused_add(self, product, beta, alpha, out_dtype)


@register_mapping(aten.addmm.default)
def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    return _addmm(self, mat1, mat2, beta, alpha, mat1.dtype)


@register_mapping(aten.addmm.dtype)
def addmm_dtype(self, mat1, mat2, out_dtype, *, beta=1, alpha=1):
    return _addmm(self, mat1, mat2, beta, alpha, jnp_dtype(out_dtype))


def _baddbmm(self, batch1, batch2, beta, alpha, out_dtype):
    product = jnp.einsum(
        "bij,bjk->bik",
        batch1,
        batch2,
        precision=config.matmul_precision(),
        preferred_element_type=_accumulator(batch1.dtype),
    )
    return _fused_add(self, product, beta, alpha, out_dtype)


@register_mapping(aten.baddbmm.default)
def baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    return _baddbmm(self, batch1, batch2, beta, alpha, batch1.dtype)


@register_mapping(aten.baddbmm.dtype)
def baddbmm_dtype(self, batch1, batch2, out_dtype, *, beta=1, alpha=1):
    return _baddbmm(self, batch1, batch2, beta, alpha, jnp_dtype(out_dtype))


@register_mapping(aten.addbmm.default)
def addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    # The batch sum is part of the contraction, so it accumulates at full width too.
    product = jnp.einsum(
        "bij,bjk->ik",
        batch1,
        batch2,
        precision=config.matmul_precision(),
        preferred_element_type=_accumulator(batch1.dtype),
    )
    return _fused_add(self, product, beta, alpha, batch1.dtype)


@register_mapping(aten.addmv.default)
def addmv(self, mat, vec, *, beta=1, alpha=1):
    product = jnp.einsum(
        "ij,j->i", mat, vec, precision=config.matmul_precision(), preferred_element_type=_accumulator(mat.dtype)
    )
    return _fused_add(self, product, beta, alpha, mat.dtype)
