"""Matrix products: mm, bmm, the add*-fused forms (addmm, baddbmm, addbmm, addmv), mv, dot, vdot,
and _trilinear (F.bilinear's three-operand contraction).

Half-precision inputs accumulate in float32 and round once, as torch's kernels do;
float32 products use the precision that torch's matmul setting asks for.
"""

import functools

import jax
import jax.numpy as jnp

from bridge.runtime import config, precision
from bridge.runtime.registry import aten, jnp_dtype, register_mapping
from .common import LOW_PRECISION, accumulator_dtype

_FLOAT32 = jnp.dtype(jnp.float32)


def _product(subscripts, left, right, out_dtype=None):
    """einsum in the accumulation dtype of the operands, rounded to `out_dtype` (default: the operands')."""
    out_dtype = left.dtype if out_dtype is None else out_dtype
    if config.settings.tracing and left.dtype in LOW_PRECISION and left.dtype == right.dtype:
        return _half_einsum(subscripts, left, right, precision.matmul_precision(), jnp.dtype(out_dtype))
    product = jnp.einsum(
        subscripts,
        left,
        right,
        precision=precision.matmul_precision(),
        preferred_element_type=accumulator_dtype(left.dtype),
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
    accumulator = accumulator_dtype(out_dtype)
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


@register_mapping(aten.mm.default, reads=("precision",))
def mm(self, mat2):
    return _product("ij,jk->ik", self, mat2)


@register_mapping(aten.mm.dtype, reads=("precision",))
def mm_dtype(self, mat2, out_dtype):
    return _product("ij,jk->ik", self, mat2, jnp_dtype(out_dtype))


@register_mapping(aten.bmm.default, reads=("precision",))
def bmm(self, mat2):
    return _product("bij,bjk->bik", self, mat2)


@register_mapping(aten.bmm.dtype, reads=("precision",))
def bmm_dtype(self, mat2, out_dtype):
    return _product("bij,bjk->bik", self, mat2, jnp_dtype(out_dtype))


@register_mapping(aten.mv.default, reads=("precision",))
def mv(self, vec):
    return _product("ij,j->i", self, vec)


@register_mapping(aten.dot.default, reads=("precision",))
def dot(self, tensor):
    return _product("i,i->", self, tensor)


@register_mapping(aten.vdot.default, reads=("precision",))
def vdot(self, other):
    return _product("i,i->", jnp.conj(self), other)


@register_mapping(aten.outer.default)
def outer(self, vec2):
    return self[:, None] * vec2[None, :]


# --- products fused with a scaled addition: beta * self + alpha * (product) ---


def _addmm(self, mat1, mat2, beta, alpha, out_dtype):
    if config.settings.tracing and mat1.dtype in LOW_PRECISION and mat1.dtype == mat2.dtype:
        return _fused_add(self, _half_einsum("ij,jk->ik", mat1, mat2, precision.matmul_precision(), _FLOAT32), beta, alpha, out_dtype)
    product = jnp.einsum(
        "ij,jk->ik", mat1, mat2, precision=precision.matmul_precision(), preferred_element_type=accumulator_dtype(mat1.dtype)
    )
    return _fused_add(self, product, beta, alpha, out_dtype)


@register_mapping(aten.addmm.default, reads=("precision",))
def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    return _addmm(self, mat1, mat2, beta, alpha, mat1.dtype)


@register_mapping(aten.addmm.dtype, reads=("precision",))
def addmm_dtype(self, mat1, mat2, out_dtype, *, beta=1, alpha=1):
    return _addmm(self, mat1, mat2, beta, alpha, jnp_dtype(out_dtype))


def _baddbmm(self, batch1, batch2, beta, alpha, out_dtype):
    product = jnp.einsum(
        "bij,bjk->bik",
        batch1,
        batch2,
        precision=precision.matmul_precision(),
        preferred_element_type=accumulator_dtype(batch1.dtype),
    )
    return _fused_add(self, product, beta, alpha, out_dtype)


@register_mapping(aten.baddbmm.default, reads=("precision",))
def baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    return _baddbmm(self, batch1, batch2, beta, alpha, batch1.dtype)


@register_mapping(aten.baddbmm.dtype, reads=("precision",))
def baddbmm_dtype(self, batch1, batch2, out_dtype, *, beta=1, alpha=1):
    return _baddbmm(self, batch1, batch2, beta, alpha, jnp_dtype(out_dtype))


@register_mapping(aten.addbmm.default, reads=("precision",))
def addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    # The batch sum is part of the contraction, so it accumulates at full width too.
    product = jnp.einsum(
        "bij,bjk->ik",
        batch1,
        batch2,
        precision=precision.matmul_precision(),
        preferred_element_type=accumulator_dtype(batch1.dtype),
    )
    return _fused_add(self, product, beta, alpha, batch1.dtype)


@register_mapping(aten.addmv.default, reads=("precision",))
def addmv(self, mat, vec, *, beta=1, alpha=1):
    product = jnp.einsum(
        "ij,j->i", mat, vec, precision=precision.matmul_precision(), preferred_element_type=accumulator_dtype(mat.dtype)
    )
    return _fused_add(self, product, beta, alpha, mat.dtype)


# ---------------------------------------------------------------- _trilinear (F.bilinear, nn.Bilinear)


@register_mapping(aten._trilinear.default, reads=("precision",))
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """sum over `sumdim` of i1 * i2 * i3, each first unsqueezed at its `expand` dims.

    As torch's kernel does, in two contractions rounded to the dtype in between: i1 with i2 over
    the summed dims i3 lacks, then that with i3 over the rest.
    """
    operands = []
    for tensor, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        for dim in sorted(expand):
            tensor = jnp.expand_dims(tensor, dim)
        operands.append(tensor)
    ndim = operands[0].ndim
    # Broadcast sizes (a 0 wins over a 1).
    sizes = [next((o.shape[dim] for o in operands if o.shape[dim] != 1), 1) for dim in range(ndim)]
    letters = "abcdefghijklmnopqrstuvwxyz"[:ndim]
    present, squeezed = [], []
    for operand in operands:
        # Size-1 dims (the expanded ones, or broadcasting ones) are dropped from that operand.
        dropped = tuple(dim for dim in range(ndim) if operand.shape[dim] == 1 and sizes[dim] != 1)
        squeezed.append(jnp.squeeze(operand, dropped) if dropped else operand)
        present.append([dim for dim in range(ndim) if dim not in dropped])
    summed = set(sumdim)
    dtype = jnp.result_type(i1, i2, i3)
    accumulator = accumulator_dtype(dtype)

    def contract(left, left_dims, right, right_dims, keep):
        text = "".join(letters[d] for d in left_dims) + "," + "".join(letters[d] for d in right_dims)
        return jnp.einsum(
            text + "->" + "".join(letters[d] for d in keep),
            left,
            right,
            precision=precision.matmul_precision(),
            preferred_element_type=accumulator,
        ).astype(dtype)

    pair_dims = sorted(set(present[0]) | set(present[1]))
    pair_keep = [d for d in pair_dims if not (d in summed and d not in present[2])]
    pair = contract(squeezed[0], present[0], squeezed[1], present[1], pair_keep)
    keep = [d for d in range(ndim) if d not in summed and (d in pair_keep or d in present[2])]
    out = contract(pair, pair_keep, squeezed[2], present[2], keep)
    # Dims no operand has (size 1 everywhere) and that are not summed stay in the output.
    return out.reshape(tuple(1 if d not in keep else sizes[d] for d in range(ndim) if d not in summed))
