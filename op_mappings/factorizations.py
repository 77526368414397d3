"""Matrix factorizations and solvers: cholesky, LU, QR, SVD, eigendecompositions, triangular and general solves, inverses, determinants.

torch's conventions are kept where they are visible: LU pivots are 1-based int32 (LAPACK's),
`info` outputs are int32 per matrix (0: success), outputs that an option turns off are empty
tensors of shape (0,). Where torch's autograd formulas read an auxiliary output (the LU of
det/slogdet), it is the one torch's CPU kernel makes: for a real contiguous A torch factors
A^T (A in LAPACK's column-major order) and its backward solves with that factor accordingly;
bridge tensors are always contiguous, so real input means A^T here. (solve_ex factors A itself.)

A failure that torch reports by raising (`_linalg_check_errors` on a nonzero `info`) cannot be
reported without reading `info` on the host; the check is a no-op, and the results of a failed
factorization hold NaN (cholesky) or infinities (a singular solve) instead.
"""

import jax
import jax.numpy as jnp
from jax import lax
import jax.scipy.linalg

from bridge.runtime.registry import aten, register_mapping


# ---------------------------------------------------------------- helpers


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x))


def _empty(dtype):
    """The (0,)-shaped tensor torch returns for an output an option turned off."""
    return jnp.zeros((0,), dtype=dtype)


def _real_dtype(dtype):
    return jnp.finfo(dtype).dtype


def _batched(*matrices):
    """The matrices with their batch dimensions broadcast against each other."""
    batch = jnp.broadcast_shapes(*(matrix.shape[:-2] for matrix in matrices))
    return [jnp.broadcast_to(matrix, batch + matrix.shape[-2:]) for matrix in matrices]


def _eye_like(matrix):
    return jnp.broadcast_to(jnp.eye(matrix.shape[-1], dtype=matrix.dtype), matrix.shape)


def _triangular_solve(a, b, *, lower, left=True, adjoint=False, transpose=False, unit=False):
    """Solves op(a) x = b (left) or x op(a) = b, reading only a's `lower`/upper triangle."""
    a, b = _batched(a, b)
    return lax.linalg.triangular_solve(
        a,
        b,
        left_side=left,
        lower=lower,
        transpose_a=adjoint or transpose,
        conjugate_a=adjoint,
        unit_diagonal=unit,
    )


def _is_vector_rhs(a, b):
    """torch's rule (linalg_solve_is_vector_rhs): b is a (batch of) vector(s)."""
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])


# ---------------------------------------------------------------- triangular solves


@register_mapping(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(self, B, *, upper, left=True, unitriangular=False):
    return _triangular_solve(self, B, lower=not upper, left=left, unit=unitriangular)


@register_mapping(aten.triangular_solve.default)
def triangular_solve(self, A, upper=True, transpose=False, unitriangular=False):
    A, B = _batched(A, self)
    solution = _triangular_solve(A, B, lower=not upper, transpose=transpose, unit=unitriangular)
    return solution, A


# ---------------------------------------------------------------- cholesky


def _cholesky_failure_order(lower_part):
    """LAPACK potrf's `info`: the order of the first leading minor that is not positive definite
    (0 if none), from the pivots of an elimination without pivoting on the Hermitian matrix
    whose lower triangle is given."""
    n = lower_part.shape[-1]
    strict = jnp.tril(lower_part, -1)
    matrix = strict + _mH(strict) + jnp.real(jnp.diagonal(lower_part, axis1=-2, axis2=-1))[..., None] * jnp.eye(
        n, dtype=lower_part.dtype
    )
    info = jnp.zeros(lower_part.shape[:-2], dtype=jnp.int32)

    def step(k, state):
        matrix, info = state
        pivot = jnp.real(matrix[..., k, k])
        failed = ~(pivot > 0)
        info = jnp.where(failed & (info == 0), k + 1, info)
        safe = jnp.where(failed, 1, pivot).astype(matrix.dtype)
        column = matrix[..., :, k] / safe[..., None]
        matrix = matrix - column[..., :, None] * jnp.conj(matrix[..., :, k])[..., None, :]
        return matrix, info

    return lax.fori_loop(0, n, step, (matrix, info))[1]


def _cholesky_lower(self, upper):
    """The lower factor of the matrix torch reads (the upper triangle when `upper`)."""
    source = _mH(self) if upper else self
    return source, lax.linalg.cholesky(source, symmetrize_input=False)


@register_mapping(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(self, *, upper=False, check_errors=False):
    source, lower = _cholesky_lower(self, upper)
    if self.shape[-1] == 0:  # 0x0 matrices: nothing can fail
        return lower, jnp.zeros(self.shape[:-2], dtype=jnp.int32)
    failed = jnp.any(jnp.isnan(lower))
    info = lax.cond(
        failed,
        _cholesky_failure_order,
        lambda matrix: jnp.zeros(matrix.shape[:-2], dtype=jnp.int32),
        source,
    )
    return (_mH(lower) if upper else lower), info


@register_mapping(aten.cholesky.default)
def cholesky(self, upper=False):
    lower = _cholesky_lower(self, upper)[1]
    return _mH(lower) if upper else lower


def _cholesky_solve(B, factor, upper):
    # A = L L^H (lower) or U^H U (upper): two triangular solves.
    if upper:
        half = _triangular_solve(factor, B, lower=False, adjoint=True)
        return _triangular_solve(factor, half, lower=False)
    half = _triangular_solve(factor, B, lower=True)
    return _triangular_solve(factor, half, lower=True, adjoint=True)


@register_mapping(aten.cholesky_solve.default)
def cholesky_solve(self, input2, upper=False):
    return _cholesky_solve(self, input2, upper)


@register_mapping(aten._cholesky_solve_helper.default)
def cholesky_solve_helper(self, A, upper):
    return _cholesky_solve(self, A, upper)


@register_mapping(aten.cholesky_inverse.default)
def cholesky_inverse(self, upper=False):
    inverse_factor = _triangular_solve(self, _eye_like(self), lower=not upper)
    if upper:
        return inverse_factor @ _mH(inverse_factor)
    return _mH(inverse_factor) @ inverse_factor


# ---------------------------------------------------------------- LU


def _lu(A):
    """(LU, 0-based permutation, 1-based int32 pivots, int32 info) of A, as LAPACK getrf."""
    lu, pivots, permutation = lax.linalg.lu(A)
    zero = jnp.diagonal(lu, axis1=-2, axis2=-1) == 0
    # getrf's info: the first exactly-zero pivot U[i, i] (1-based), 0 if none.
    first = jnp.argmax(zero, axis=-1) if zero.shape[-1] else jnp.zeros(zero.shape[:-1], jnp.int32)
    info = jnp.where(jnp.any(zero, axis=-1), first + 1, 0).astype(jnp.int32)
    return lu, permutation, (pivots + 1).astype(jnp.int32), info


def _permutation(pivots, size):
    """The 0-based row permutation (A[perm] = L U) of torch's 1-based pivots."""
    return lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, size)


def _rows(matrix, permutation):
    """matrix[..., permutation, :] for batched permutations."""
    return jnp.take_along_axis(matrix, permutation[..., :, None], axis=-2)


def _lu_solve(lu, permutation, B, left=True, adjoint=False):
    """Solves A X = B (or A^H X = B, X A = B, X A^H = B) with A = P L U given as (lu, permutation)."""
    if not left:
        # X A = B  <=>  A^H X^H = B^H;  X A^H = B  <=>  A X^H = B^H.
        return _mH(_lu_solve(lu, permutation, _mH(B), left=True, adjoint=not adjoint))
    lu, B = _batched(lu, B)
    permutation = jnp.broadcast_to(permutation, lu.shape[:-1])
    if not adjoint:
        lower_solved = _triangular_solve(lu, _rows(B, permutation), lower=True, unit=True)
        return _triangular_solve(lu, lower_solved, lower=False)
    # A^H = U^H L^H P^T.
    upper_solved = _triangular_solve(lu, B, lower=False, adjoint=True)
    solved = _triangular_solve(lu, upper_solved, lower=True, adjoint=True, unit=True)
    return _rows(solved, jnp.argsort(permutation, axis=-1))


def _no_unpivoted_lu(pivot):
    if not pivot:
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the CPU")


@register_mapping(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(A, *, pivot=True, check_errors=False):
    _no_unpivoted_lu(pivot)
    lu, _, pivots, info = _lu(A)
    return lu, pivots, info


def _unpacked(lu, permutation, m, n):
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    upper = jnp.triu(lu[..., :k, :])
    # A = P L U with A[perm] = L U: P[i, j] = (i == perm[j]).
    permutation_matrix = (jnp.arange(m)[:, None] == permutation[..., None, :]).astype(lu.dtype)
    return permutation_matrix, lower, upper


@register_mapping(aten.linalg_lu.default)
def linalg_lu(A, *, pivot=True):
    _no_unpivoted_lu(pivot)
    lu, permutation, _, _ = _lu(A)
    return _unpacked(lu, permutation, A.shape[-2], A.shape[-1])


@register_mapping(aten.lu_unpack.default)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    m, n = LU_data.shape[-2:]
    permutation = _permutation(LU_pivots, m)
    P, L, U = _unpacked(LU_data, permutation, m, n)
    if not unpack_data:
        L = U = _empty(LU_data.dtype)
    if not unpack_pivots:
        P = _empty(LU_data.dtype)
    return P, L, U


@register_mapping(aten.linalg_lu_solve.default)
def linalg_lu_solve(LU, pivots, B, *, left=True, adjoint=False):
    return _lu_solve(LU, _permutation(pivots, LU.shape[-1]), B, left=left, adjoint=adjoint)


def _factored_as_torch(A):
    """LU of A as torch's det/slogdet factor it: of A^T for real A (see the module note)."""
    return _lu(A if jnp.issubdtype(A.dtype, jnp.complexfloating) else _mT(A))


@register_mapping(aten._linalg_solve_ex.default)
def linalg_solve_ex(A, B, *, left=True, check_errors=False):
    # torch's backward solves the adjoint system with this LU: it is A's, never A^T's.
    lu, permutation, pivots, info = _lu(A)
    vector = _is_vector_rhs(A, B)
    rhs = B[..., None] if vector else B
    result = _lu_solve(lu, permutation, rhs, left=left)
    return (result[..., 0] if vector else result), lu, pivots, info


@register_mapping(aten.linalg_inv_ex.default)
def linalg_inv_ex(A, *, check_errors=False):
    lu, permutation, _, info = _lu(A)
    return _lu_solve(lu, permutation, _eye_like(A)), info


def _permutation_sign(pivots, dtype):
    """(-1) ** (number of row swaps) of 1-based LAPACK pivots."""
    swaps = jnp.sum(pivots != jnp.arange(1, pivots.shape[-1] + 1, dtype=pivots.dtype), axis=-1)
    return jnp.where(swaps % 2 == 0, 1, -1).astype(dtype)


@register_mapping(aten._linalg_det.default)
def linalg_det(A):
    lu, _, pivots, _ = _factored_as_torch(A)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    return _permutation_sign(pivots, A.dtype) * jnp.prod(diagonal, axis=-1), lu, pivots


@register_mapping(aten._linalg_slogdet.default)
def linalg_slogdet(A):
    lu, _, pivots, _ = _factored_as_torch(A)
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    magnitude = jnp.abs(diagonal)
    # sign(0) is 0, so a singular matrix has sign 0 and log|det| = -inf, as in torch.
    phases = jnp.where(magnitude == 0, 0, diagonal / jnp.where(magnitude == 0, 1, magnitude).astype(A.dtype))
    sign = _permutation_sign(pivots, A.dtype) * jnp.prod(phases, axis=-1)
    return sign, jnp.sum(jnp.log(magnitude), axis=-1), lu, pivots


@register_mapping(aten._linalg_check_errors.default)
def linalg_check_errors(info, api_name, *, is_matrix):
    # torch raises here when a factorization failed; that needs `info` on the host (module note).
    return None


# ---------------------------------------------------------------- QR and Householder reflectors


@register_mapping(aten.linalg_qr.default)
def linalg_qr(A, mode="reduced"):
    if mode == "r":
        return _empty(A.dtype), jnp.linalg.qr(A, mode="r")
    return tuple(jnp.linalg.qr(A, mode=mode))


@register_mapping(aten.geqrf.default)
def geqrf(self):
    # jnp's "raw" mode is LAPACK geqrf's output in row-major order (transposed).
    reflectors, tau = jnp.linalg.qr(self, mode="raw")
    return _mT(reflectors), tau


@register_mapping(aten.linalg_householder_product.default)
def linalg_householder_product(input, tau):
    return lax.linalg.householder_product(input, tau)


@register_mapping(aten.ormqr.default)
def ormqr(self, input2, input3, left=True, transpose=False):
    return lax.linalg.ormqr(self, input2, input3, left=left, transpose=transpose)


# ---------------------------------------------------------------- spectral decompositions


@register_mapping(aten._linalg_svd.default)
def linalg_svd(A, full_matrices=False, compute_uv=True, *, driver=None):
    if not compute_uv:
        return _empty(A.dtype), jnp.linalg.svd(A, compute_uv=False), _empty(A.dtype)
    U, S, Vh = jnp.linalg.svd(A, full_matrices=full_matrices)
    return U, S, Vh


@register_mapping(aten._linalg_eigh.default)
def linalg_eigh(A, UPLO="L", compute_v=True):
    vectors, values = lax.linalg.eigh(A, lower=UPLO.upper() == "L", symmetrize_input=False)
    return values, (vectors if compute_v else _empty(A.dtype))


@register_mapping(aten.linalg_eig.default)
def linalg_eig(self):
    values, vectors = lax.linalg.eig(self, compute_left_eigenvectors=False)
    return values, vectors


# ---------------------------------------------------------------- pseudoinverse and least squares


def _default_rtol(A):
    return jnp.finfo(_real_dtype(A.dtype)).eps * max(A.shape[-2], A.shape[-1])


@register_mapping(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(self, *, atol=None, rtol=None, hermitian=False):
    # torch's tolerances are float64 tensors (get_atol_rtol); rtol defaults to eps * max(m, n),
    # or to 0 where a positive atol is given.
    absolute = jnp.zeros((), jnp.float64) if atol is None else atol.astype(jnp.float64)
    if rtol is not None:
        relative = rtol.astype(jnp.float64)
    else:
        default = jnp.asarray(_default_rtol(self), jnp.float64)
        relative = default if atol is None else jnp.where(absolute > 0, 0.0, default)
    if hermitian:
        values, vectors = lax.linalg.eigh(self, symmetrize_input=False)[::-1]
        magnitudes = jnp.abs(values)
        largest = jnp.max(magnitudes, axis=-1, keepdims=True, initial=0)
        tolerance = jnp.maximum(absolute[..., None], relative[..., None] * largest)
        inverted = jnp.where(magnitudes > tolerance, 1 / values, 0).astype(self.dtype)
        return (vectors * inverted[..., None, :]) @ _mH(vectors)
    U, S, Vh = jnp.linalg.svd(self, full_matrices=False)
    largest = S[..., :1] if S.shape[-1] else jnp.zeros(S.shape[:-1] + (1,), S.dtype)
    tolerance = jnp.maximum(absolute[..., None], relative[..., None] * largest)
    inverted = jnp.where(S > tolerance, 1 / S, 0).astype(self.dtype)
    return _mH(Vh) @ (inverted[..., :, None] * _mH(U))


# lstsq's gradient as torch's formula computes it (JAX's derivative of the mapping's
# factorization differed by 1.3e-4 in float32).
@register_mapping(aten.linalg_lstsq.default, gradient="torch")
def linalg_lstsq(self, b, rcond=None, *, driver=None):
    # The minimum-norm least-squares solution through the SVD; torch's CPU drivers (gelsy by
    # default) give the same solution, rank and singular values.
    driver = driver or "gelsy"
    m, n = self.shape[-2:]
    vector = _is_vector_rhs(self, b)
    rhs = b[..., None] if vector else b
    A, rhs = _batched(self, rhs)
    real = _real_dtype(self.dtype)
    U, S, Vh = jnp.linalg.svd(A, full_matrices=False)
    relative = _default_rtol(self) if rcond is None or rcond < 0 else rcond
    largest = S[..., :1] if S.shape[-1] else jnp.zeros(S.shape[:-1] + (1,), real)
    kept = S > relative * largest
    inverted = jnp.where(kept, 1 / jnp.where(kept, S, 1), 0).astype(self.dtype)
    solution = _mH(Vh) @ (inverted[..., :, None] * (_mH(U) @ rhs))
    if m > n and driver != "gelsy":
        residuals = jnp.sum(jnp.abs(A @ solution - rhs) ** 2, axis=-2).astype(real)
    else:
        residuals = _empty(real)
    rank = jnp.sum(kept, axis=-1).astype(jnp.int64) if driver != "gels" else _empty(jnp.int64)
    singular_values = S if driver in ("gelsd", "gelss") else _empty(real)
    return (solution[..., 0] if vector else solution), residuals, rank, singular_values


# ---------------------------------------------------------------- matrix functions


# Single precision computed in double and rounded: scaling and squaring multiplies the Pade
# approximant's rounding error by the matrix's norm, and in float32 jax.scipy's result was up to
# 16x further from the exact one than torch's Taylor polynomial (OpInfo's 5x5 sample: 0.086
# against 0.0054, depending on how XLA's CPU kernels accumulate). TPUs have no float64.
_MATRIX_EXP_COMPUTE = {
    jnp.dtype(jnp.bfloat16): jnp.float32,
    jnp.dtype(jnp.float16): jnp.float32,
    jnp.dtype(jnp.float32): jnp.float64,
    jnp.dtype(jnp.complex64): jnp.complex128,
}


@register_mapping(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(self):
    compute = _MATRIX_EXP_COMPUTE.get(self.dtype, self.dtype)
    if jax.default_backend() == "tpu" and compute in (jnp.float64, jnp.complex128):
        compute = self.dtype
    values = self.astype(compute)
    # max_squarings bounds the scaling-and-squaring loop; jax returns NaN past it, torch has no bound.
    result = jax.scipy.linalg.expm(values, max_squarings=64)
    return result.astype(self.dtype)


# ---------------------------------------------------------------- LDL (Bunch-Kaufman, as LAPACK sytf2/hetf2 with uplo='L')

# LAPACK's pivot threshold (1 + sqrt(17)) / 8.
_BUNCH_KAUFMAN_ALPHA = (1 + 17**0.5) / 8


class _Symmetry:
    """The arithmetic that differs between LAPACK's symmetric (sytf2) and Hermitian (hetf2) kernels."""

    def __init__(self, dtype, hermitian):
        self.complex = jnp.issubdtype(dtype, jnp.complexfloating)
        self.hermitian = hermitian and self.complex

    def size(self, value):
        # LAPACK's CABS1 (|re| + |im|) for complex, |x| for real.
        if self.complex:
            return jnp.abs(jnp.real(value)) + jnp.abs(jnp.imag(value))
        return jnp.abs(value)

    def diagonal_size(self, value):
        return jnp.abs(jnp.real(value)) if self.hermitian else self.size(value)

    def conj(self, value):
        return jnp.conj(value) if self.hermitian else value

    def mirrored(self, matrix):
        """The full matrix whose lower triangle is `matrix`'s (a Hermitian one has a real diagonal)."""
        lower = jnp.tril(matrix, -1)
        diagonal = jnp.diagonal(matrix)
        if self.hermitian:
            diagonal = jnp.real(diagonal).astype(matrix.dtype)
        return lower + self.conj(lower.T) + jnp.diag(diagonal)


def _ldl_factor(A, hermitian):
    """LAPACK ?sytf2/?hetf2 (lower) on one matrix: (LD, 1-based pivots, info), step by step alike."""
    n = A.shape[-1]
    kind = _Symmetry(A.dtype, hermitian)
    real = _real_dtype(A.dtype)
    alpha = jnp.asarray(_BUNCH_KAUFMAN_ALPHA, real)
    index = jnp.arange(n)

    def pivot_choice(M, k):
        column = M[:, k]
        below = jnp.where(index > k, kind.size(column), -1)
        imax = jnp.argmax(below)
        colmax = jnp.where(k < n - 1, kind.size(column[imax]), 0).astype(real)
        absakk = kind.diagonal_size(M[k, k])
        row = jnp.where((index >= k) & (index < imax), kind.size(M[imax, :]), -1)
        rowmax = kind.size(M[imax, jnp.argmax(row)])
        under = jnp.where(index > imax, kind.size(M[:, imax]), -1)
        rowmax = jnp.where(imax < n - 1, jnp.maximum(rowmax, jnp.max(under)), rowmax).astype(real)
        zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        keep = zero | (absakk >= alpha * colmax) | (absakk >= alpha * colmax * (colmax / rowmax))
        swap_one = kind.diagonal_size(M[imax, imax]) >= alpha * rowmax
        kp = jnp.where(keep, k, imax)
        kstep = jnp.where(keep | swap_one, 1, 2)
        return zero, kp, kstep

    def interchange(M, k, kk, kp):
        # Rows and columns kk and kp of the trailing block (L's finished columns stay as they are).
        order = jnp.where(index == kk, kp, jnp.where(index == kp, kk, index))
        trailing = index >= k
        permuted = M[order][:, order]
        return jnp.where(trailing[:, None] & trailing[None, :], permuted, M)

    def one_by_one(M, k):
        pivot = jnp.real(M[k, k]) if kind.hermitian else M[k, k]
        inverse = (1 / pivot).astype(M.dtype)
        x = jnp.where(index > k, M[:, k], 0)
        # ?syr/?her: A(i, j) + x(i) * (-d * conj(x(j))).
        updated = M + x[:, None] * (-inverse * kind.conj(x))[None, :]
        block = (index > k)[:, None] & (index > k)[None, :]
        M = kind.mirrored(jnp.where(block, updated, M))
        return M.at[:, k].set(jnp.where(index > k, M[:, k] * inverse, M[:, k]))

    def two_by_two(M, k):
        k = jnp.minimum(k, n - 2)  # traced for every k; taken only where a 2x2 pivot fits
        column, next_column = M[:, k], M[:, k + 1]
        if kind.hermitian:
            magnitude = jnp.abs(M[k + 1, k])
            d11 = jnp.real(M[k + 1, k + 1]) / magnitude
            d22 = jnp.real(M[k, k]) / magnitude
            scale = (1 / (d11 * d22 - 1)) / magnitude
            d21 = M[k + 1, k] / magnitude
            wk = scale * (d11 * column - d21 * next_column)
            wkp1 = scale * (d22 * next_column - jnp.conj(d21) * column)
            updated = M - column[:, None] * jnp.conj(wk)[None, :] - next_column[:, None] * jnp.conj(wkp1)[None, :]
        else:
            d21 = M[k + 1, k]
            d11 = M[k + 1, k + 1] / d21
            d22 = M[k, k] / d21
            d21 = (1 / (d11 * d22 - 1)) / d21
            wk = d21 * (d11 * column - next_column)
            wkp1 = d21 * (d22 * next_column - column)
            updated = M - column[:, None] * wk[None, :] - next_column[:, None] * wkp1[None, :]
        rest = index > k + 1
        M = kind.mirrored(jnp.where(rest[:, None] & rest[None, :], updated, M))
        M = M.at[:, k].set(jnp.where(rest, wk, M[:, k]))
        return M.at[:, k + 1].set(jnp.where(rest, wkp1, M[:, k + 1]))

    def step(state):
        M, pivots, k, info = state
        zero, kp, kstep = pivot_choice(M, k)
        info = jnp.where(zero & (info == 0), k + 1, info)
        M = interchange(M, k, k + kstep - 1, kp)
        if n > 1:
            M = lax.cond(
                zero,
                lambda M: M,
                lambda M: lax.cond(kstep == 1, one_by_one, two_by_two, M, k),
                M,
            )
        else:
            M = lax.cond(zero, lambda M: M, lambda M: one_by_one(M, k), M)
        code = jnp.where(kstep == 1, kp + 1, -(kp + 1)).astype(jnp.int32)
        pivots = pivots.at[k].set(code)
        pivots = jnp.where((kstep == 2) & (index == k + 1), code, pivots)
        return M, pivots, k + kstep, info

    initial = (kind.mirrored(A), jnp.zeros(n, jnp.int32), jnp.asarray(0), jnp.asarray(0, jnp.int32))
    M, pivots, _, info = lax.while_loop(lambda state: state[2] < n, step, initial)
    return jnp.tril(M), pivots, info


def _over_batch(function, *arrays):
    """`function` of single matrices, mapped over the (equal) batch dimensions of `arrays`."""
    batch = arrays[0].shape[:-2]
    if any(size == 0 for size in batch) or arrays[0].shape[-1] == 0:
        return None
    flat = [array.reshape((-1,) + array.shape[len(batch) :]) for array in arrays]
    results = jax.vmap(function)(*flat)
    return tuple(result.reshape(batch + result.shape[1:]) for result in results)


@register_mapping(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(self, *, hermitian=False, check_errors=False):
    result = _over_batch(lambda matrix: _ldl_factor(matrix, hermitian), self)
    if result is None:  # no matrices, or 0x0 ones
        return self, jnp.zeros(self.shape[:-1], jnp.int32), jnp.zeros(self.shape[:-2], jnp.int32)
    return result


def _ldl_solve(LD, pivots, B, hermitian):
    """LAPACK ?sytrs/?hetrs (lower) on one matrix: solves L D L^T X = B (L D L^H X = B)."""
    n = LD.shape[-1]
    kind = _Symmetry(LD.dtype, hermitian)
    index = jnp.arange(n)

    def swap_rows(B, i, j):
        order = jnp.where(index == i, j, jnp.where(index == j, i, index))
        return B[order]

    def forward(state):
        B, k = state
        code = pivots[k]

        def one(B):
            B = swap_rows(B, k, code - 1)
            B = B - jnp.where(index > k, LD[:, k], 0)[:, None] * B[k][None, :]
            pivot = jnp.real(LD[k, k]) if kind.hermitian else LD[k, k]
            return B.at[k].set(B[k] * (1 / pivot).astype(B.dtype))

        def two(B):
            k1 = jnp.minimum(k + 1, n - 1)
            B = swap_rows(B, k1, -code - 1)
            rest = (index > k1)[:, None]
            B = B - jnp.where(rest, LD[:, k][:, None] * B[k][None, :], 0)
            B = B - jnp.where(rest, LD[:, k1][:, None] * B[k1][None, :], 0)
            off = LD[k1, k]
            akm1 = LD[k, k] / kind.conj(off)
            ak = LD[k1, k1] / off
            denominator = akm1 * ak - 1
            bkm1 = B[k] / kind.conj(off)
            bk = B[k1] / off
            B = B.at[k].set((ak * bkm1 - bk) / denominator)
            return B.at[k1].set((akm1 * bk - bkm1) / denominator)

        B = lax.cond(code > 0, one, two, B)
        return B, k + jnp.where(code > 0, 1, 2)

    def backward(state):
        B, k = state
        code = pivots[k]

        def reduce(B, row, column):
            weights = jnp.where(index > k, kind.conj(LD[:, column]), 0)
            return B.at[row].set(B[row] - weights @ B)

        def one(B):
            B = reduce(B, k, k)
            return swap_rows(B, k, code - 1)

        def two(B):
            km1 = jnp.maximum(k - 1, 0)
            B = reduce(B, k, k)
            B = reduce(B, km1, km1)
            return swap_rows(B, k, -code - 1)

        B = lax.cond(code > 0, one, two, B)
        return B, k - jnp.where(code > 0, 1, 2)

    B = lax.while_loop(lambda state: state[1] < n, forward, (B, jnp.asarray(0)))[0]
    return (lax.while_loop(lambda state: state[1] >= 0, backward, (B, jnp.asarray(n - 1)))[0],)


@register_mapping(aten.linalg_ldl_solve.default)
def linalg_ldl_solve(LD, pivots, B, *, hermitian=False):
    LD, B = _batched(LD, B)
    pivots = jnp.broadcast_to(pivots, LD.shape[:-1])
    result = _over_batch(lambda ld, p, b: _ldl_solve(ld, p[:, 0], b, hermitian), LD, pivots[..., None], B)
    return B if result is None else result[0]

