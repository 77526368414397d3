"""Grouped matrix products: aten._grouped_mm (torch.nn.functional.grouped_mm), the product of
mixture-of-experts layers (transformers' Mixtral-style experts), beside linalg.py's products.

A 2-d operand is cut into ragged groups by `offs`, the running ends of the groups (int32);
`jax.lax.ragged_dot` multiplies each group by its own matrix without padding. Rows (or columns)
past `offs[-1]` belong to no group: torch leaves them unwritten, the bridge writes zeros.
Half-precision inputs accumulate in float32 and round once, as torch's kernels do.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from bridge.runtime.precision import matmul_precision
from bridge.runtime.registry import aten, jnp_dtype, register_mapping, register_named_mapping
from .common import LOW_PRECISION, accumulator_dtype

_SUPPORTED = (jnp.dtype(jnp.float32), *LOW_PRECISION)
_TORCH_NAMES = {jnp.dtype(jnp.float64): "Double", jnp.dtype(jnp.int32): "Int", jnp.dtype(jnp.int64): "Long"}


def _check(mat_a, mat_b, offs, bias, out_dtype):
    """torch's checks of _grouped_mm's arguments, with its messages (the entry runs without
    torch's meta kernel, which accepts bfloat16 only: see runtime/dispatch.py)."""
    for name, matrix in (("mat_a", mat_a), ("mat_b", mat_b)):
        if matrix.dtype not in _SUPPORTED:
            kind = _TORCH_NAMES.get(matrix.dtype, str(matrix.dtype))
            raise RuntimeError(f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {kind}")
    for name, matrix in (("mat_a", mat_a), ("mat_b", mat_b)):
        if matrix.ndim not in (2, 3):
            raise RuntimeError(f"{name} has to be 2 or 3d")
    grouped = mat_a.ndim == 2 or mat_b.ndim == 2
    if grouped != (offs is not None):
        raise RuntimeError("Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        if offs.ndim != 1:
            raise RuntimeError("offs has to be 1D")
        if offs.dtype != jnp.int32:
            raise RuntimeError("Offsets have to be int32")
    if mat_a.shape[-1] != mat_b.shape[-2]:
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    if mat_a.ndim == 3 and mat_b.ndim == 3 and mat_a.shape[0] != mat_b.shape[0]:
        raise RuntimeError("batched dimension has to match")
    for matrix in (mat_a, mat_b):
        if matrix.ndim == 3 and offs is not None and matrix.shape[0] != offs.shape[0]:
            raise RuntimeError("matrix batch sizes have to match")
    if bias is not None:
        raise RuntimeError("Bias not supported yet")
    # torch's CPU kernel requires out_dtype == mat_a's dtype; float32 from half inputs is what
    # F.grouped_mm documents for CUDA (accumulate and return in float32), so it is taken too.
    if out_dtype is not None and out_dtype not in (mat_a.dtype, jnp.dtype(jnp.float32)):
        raise RuntimeError("Grouped gemm output dtype must match `mat_a` dtype")


def _group_sizes(offs):
    return jnp.diff(offs, prepend=jnp.zeros((1,), offs.dtype))


@register_mapping(aten._grouped_mm.default, meta="stricter", reads=("precision",))
def grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    out_dtype = jnp_dtype(out_dtype)
    _check(self, mat2, offs, bias, out_dtype)
    out_dtype = self.dtype if out_dtype is None else out_dtype
    precision = matmul_precision()
    accumulate = accumulator_dtype(self.dtype)
    if self.ndim == 3 and mat2.ndim == 3:
        out = jnp.einsum("gmk,gkn->gmn", self, mat2, precision=precision, preferred_element_type=accumulate)
    elif self.ndim == 2 and mat2.ndim == 3:
        # Rows of self in groups, each times its group's matrix: (M, K) x (G, K, N) -> (M, N).
        out = _ragged_rows(self, mat2, _group_sizes(offs), precision, accumulate)
    elif self.ndim == 3 and mat2.ndim == 2:
        # Columns of mat2 in groups: (G, M, K) x (K, N) -> (M, N), computed transposed as rows.
        out = _ragged_rows(mat2.T, jnp.swapaxes(self, 1, 2), _group_sizes(offs), precision, accumulate).T
    else:
        # The contraction in groups (a weight gradient): (M, K) x (K, N) -> (G, M, N).
        out = _on_platform(
            lambda left, right: _grouped_contraction(left, right, _group_sizes(offs), precision, accumulate),
            self, mat2, accumulate,
        )
    return out.astype(out_dtype)


def _on_platform(product, left, right, accumulate):
    """`product(left, right)`; on XLA's CPU backend, half-precision operands are widened first:
    it has no bf16 x bf16 -> f32 kernel for some ragged products. The numbers are the same
    (products of half-precision values are exact in float32); GPUs keep the half-precision kernel."""
    if left.dtype == accumulate:
        return product(left, right)

    def widened(left, right):
        return product(left.astype(accumulate), right.astype(accumulate))

    return lax.platform_dependent(left, right, cpu=widened, default=product)


def _ragged_rows(left, right, sizes, precision, accumulate):
    """Rows of `left` in groups of `sizes`, each group times its matrix of `right`."""
    return _on_platform(
        lambda left, right: lax.ragged_dot(left, right, sizes, precision=precision, preferred_element_type=accumulate),
        left, right, accumulate,
    )


_CONTRACTION_IN_GROUPS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [0]), ([], [])), lhs_ragged_dimensions=[1], rhs_group_dimensions=[]
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_contraction(left, right, sizes, precision, accumulate):
    """out[g] = left[:, k in g] @ right[k in g, :]. JAX has no derivative of ragged_dot_general
    with a ragged contraction; its gradients are ragged products over rows (used when a
    captured region is differentiated by JAX)."""
    return lax.ragged_dot_general(
        left, right, sizes, _CONTRACTION_IN_GROUPS, precision=precision, preferred_element_type=accumulate
    )


def _grouped_contraction_forward(left, right, sizes, precision, accumulate):
    return _grouped_contraction(left, right, sizes, precision, accumulate), (left, right, sizes)


def _grouped_contraction_backward(precision, accumulate, saved, cotangent):
    left, right, sizes = saved
    # d left[:, k] = cotangent[g] @ right[k].T, computed transposed: rows k of right in groups.
    d_left = _ragged_rows(right, jnp.swapaxes(cotangent, 1, 2).astype(right.dtype), sizes, precision, accumulate).T
    # d right[k] = left[:, k].T @ cotangent[g]: rows k of left.T in groups.
    d_right = _ragged_rows(left.T, cotangent.astype(left.dtype), sizes, precision, accumulate)
    return d_left.astype(left.dtype), d_right.astype(right.dtype), None


_grouped_contraction.defvjp(_grouped_contraction_forward, _grouped_contraction_backward)


# HuggingFace transformers' MoE layers run their experts through a custom operator of their own
# where torch.compile would be tracing (`transformers::grouped_mm_fallback`: rows of `input` in
# groups by `offs`, each times its expert's weight; a loop of `torch.mm` with `offs.tolist()`
# inside). The bridge traces as torch.compile does (torch.compiler.is_compiling() is true in a
# trace), so these reach it: the same grouped product as `_grouped_mm`, and its backward.


@register_named_mapping("transformers::grouped_mm_fallback")
def transformers_grouped_mm(input, weight, offs):
    return grouped_mm(input, weight, offs.astype(jnp.int32))


@register_named_mapping("transformers::grouped_mm_fallback_backward")
def transformers_grouped_mm_backward(input, weight, offs, grad_output):
    _, pullback = jax.vjp(lambda left, right: transformers_grouped_mm(left, right, offs), input, weight)
    return tuple(pullback(grad_output))
