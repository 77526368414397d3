"""FFT kernels and matrix factorization/solver mappings against eager torch: values, dtypes, the
conventions torch exposes (1-based int32 pivots, int32 info, empty outputs), and gradients
through the bridge (torch's autograd formulas running on the mapped ops)."""

import pytest
import torch

import op_testing
from bridge.runtime import versions
from op_testing import assert_same, check, run_mapping, seeded, through_bridge  # noqa: F401  (seeded: autouse)

aten = torch.ops.aten


def sample(shape, dtype=torch.float64):
    return op_testing.sample(shape, dtype, low=-2, high=2)


def symmetric_positive_definite(n, batch=(), dtype=torch.float64):
    matrix = sample(batch + (n, n), dtype)
    return matrix @ matrix.mH + n * torch.eye(n, dtype=dtype)


def well_conditioned(n, batch=(), dtype=torch.float64):
    return sample(batch + (n, n), dtype) + 4 * torch.eye(n, dtype=dtype)


# ---------------------------------------------------------------- FFT kernels

FFT_CASES = [
    # (op, input shape, input dtype, arguments after the input)
    (aten._fft_c2c.default, (4, 6), torch.complex128, ([1], 0, True)),
    (aten._fft_c2c.default, (4, 6), torch.complex64, ([0, 1], 1, False)),
    (aten._fft_c2c.default, (3, 4, 5), torch.complex128, ([0, 2], 2, False)),
    (aten._fft_c2c.default, (2, 3, 2, 4, 3), torch.complex128, ([0, 1, 3, 4], 2, True)),  # more than 3 axes
    (aten._fft_r2c.default, (4, 6), torch.float64, ([1], 0, True)),
    (aten._fft_r2c.default, (4, 7), torch.float32, ([0, 1], 1, True)),
    (aten._fft_r2c.default, (4, 6), torch.float64, ([0, 1], 2, False)),
    (aten._fft_r2c.default, (2, 3, 2, 4, 3), torch.float64, ([0, 1, 2, 4], 1, True)),
    (aten._fft_c2r.default, (4, 4), torch.complex128, ([1], 0, 6)),
    (aten._fft_c2r.default, (4, 4), torch.complex128, ([1], 2, 7)),
    (aten._fft_c2r.default, (3, 4, 5), torch.complex64, ([0, 2], 1, 8)),
    (aten._fft_c2r.default, (2, 3, 2, 4, 3), torch.complex128, ([0, 1, 2, 4], 2, 4)),
]


@pytest.mark.parametrize("op,shape,dtype,arguments", FFT_CASES, ids=lambda value: str(value).replace(" ", ""))
def test_fft_kernels(op, shape, dtype, arguments):
    check(op, sample(shape, dtype), *arguments)


FFT_FUNCTIONS = {
    "fft": lambda x: torch.view_as_real(torch.fft.fft(x, n=7, norm="ortho")),
    "rfft2": lambda x: torch.view_as_real(torch.fft.rfft2(x)),
    "irfft": lambda x: torch.fft.irfft(torch.fft.rfft(x, dim=0), n=5, dim=0, norm="forward"),
    "hfft": lambda x: torch.fft.hfft(x.to(torch.complex128) * 1j + x, dim=1),
    "ihfftn": lambda x: torch.view_as_real(torch.fft.ihfftn(x)),
}


@pytest.mark.parametrize("name", FFT_FUNCTIONS)
def test_fft_gradients_through_bridge(bridged, name):
    through_bridge(FFT_FUNCTIONS[name], sample((5, 6)))


# ---------------------------------------------------------------- factorizations: values and conventions


def test_cholesky_family():
    matrix = symmetric_positive_definite(4, (2,))
    check(aten.linalg_cholesky_ex.default, matrix)
    check(aten.linalg_cholesky_ex.default, matrix, upper=True)
    if not versions.expected_missing("aten.cholesky"):
        check(aten.cholesky.default, matrix, True)
    factor = torch.linalg.cholesky(matrix)
    check(aten.cholesky_solve.default, sample((3, 4, 2)).unsqueeze(1).expand(3, 2, 4, 2).clone(), factor)
    check(aten.cholesky_inverse.default, factor)
    check(aten.cholesky_inverse.default, factor.mH, True)
    complex_matrix = symmetric_positive_definite(3, dtype=torch.complex128)
    check(aten.linalg_cholesky_ex.default, complex_matrix)


def test_cholesky_info_names_the_failing_minor():
    # The leading 2x2 minor is positive definite, the 3x3 one is not: LAPACK's info is 3.
    matrix = torch.tensor([[4.0, 2.0, 0.0], [2.0, 5.0, 1.0], [0.0, 1.0, -1.0]], dtype=torch.float64)
    info = run_mapping(aten.linalg_cholesky_ex.default, torch.stack([matrix, torch.eye(3, dtype=torch.float64)]))[1]
    assert info.dtype == torch.int32
    assert info.tolist() == [3, 0]


def test_lu_conventions():
    for shape in [(2, 4, 4), (5, 3), (3, 5)]:
        matrix = sample(shape)
        check(aten.linalg_lu_factor_ex.default, matrix)  # pivots 1-based int32, info int32
        check(aten.linalg_lu.default, matrix)
        LU, pivots = torch.linalg.lu_factor(matrix)
        check(aten.lu_unpack.default, LU, pivots)
        check(aten.lu_unpack.default, LU, pivots, False, True)
        check(aten.lu_unpack.default, LU, pivots, True, False)
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)
    check(aten.linalg_lu_factor_ex.default, singular)  # info 2: U[1, 1] is exactly zero


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("adjoint", [False, True])
def test_lu_solve(left, adjoint):
    matrix = well_conditioned(4, (2,), torch.complex128)
    LU, pivots = torch.linalg.lu_factor(matrix)
    rhs = sample((4, 3) if left else (3, 4), torch.complex128)
    check(aten.linalg_lu_solve.default, LU, pivots, rhs, left=left, adjoint=adjoint)


def test_solves_inverses_determinants():
    matrix = well_conditioned(4, (3,))
    for rhs in [sample((4,)), sample((3, 4)), sample((3, 4, 2)), sample((2, 1, 4, 2))]:
        expected = aten._linalg_solve_ex.default(matrix, rhs)
        actual = run_mapping(aten._linalg_solve_ex.default, matrix, rhs)
        assert_same(actual, expected)  # the LU and pivots too: torch's backward reads them
    check(aten._linalg_solve_ex.default, matrix, sample((3, 2, 4)), left=False)
    check(aten.linalg_inv_ex.default, matrix)
    for dtype in [torch.float64, torch.complex128]:
        square = well_conditioned(4, (2,), dtype)
        check(aten._linalg_det.default, square)  # for real input the LU is that of A^T, as torch's
        check(aten._linalg_slogdet.default, square)
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)
    check(aten._linalg_slogdet.default, singular)
    check(aten._linalg_det.default, torch.zeros(0, 0, dtype=torch.float64))
    run_mapping(aten._linalg_check_errors.default, torch.zeros((), dtype=torch.int32), "linalg.inv", is_matrix=True)


def test_triangular_solves():
    triangular = torch.triu(well_conditioned(4, (2,)))
    rhs = sample((3, 1, 4, 2))
    check(aten.triangular_solve.default, rhs, triangular)
    check(aten.triangular_solve.default, rhs, triangular.mT, False, True, True)
    check(aten.linalg_solve_triangular.default, triangular, rhs, upper=True)
    check(aten.linalg_solve_triangular.default, triangular.mT, sample((2, 4)), upper=False, left=False, unitriangular=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_qr_and_householder(dtype):
    for shape in [(5, 3), (2, 3, 4)]:
        matrix = sample(shape, dtype)
        for mode in ["reduced", "complete", "r"]:
            check(aten.linalg_qr.default, matrix, mode)
        check(aten.geqrf.default, matrix)
    reflectors, tau = torch.geqrf(sample((5, 3), dtype))
    check(aten.linalg_householder_product.default, reflectors, tau)
    check(aten.ormqr.default, reflectors, tau, sample((5, 2), dtype))
    check(aten.ormqr.default, reflectors, tau, sample((2, 5), dtype), False, True)


def test_spectral_decompositions():
    matrix = sample((2, 4, 3))
    U, S, Vh = run_mapping(aten._linalg_svd.default, matrix)
    expected_U, expected_S, expected_Vh = aten._linalg_svd.default(matrix)
    assert_same(S, expected_S)
    # Singular vectors are unique up to sign: compare what does not depend on it.
    assert_same(U.abs(), expected_U.abs())
    assert_same(U @ Vh, expected_U @ expected_Vh)
    check(aten._linalg_svd.default, matrix, True, False)  # U and Vh empty
    full = run_mapping(aten._linalg_svd.default, matrix, True)
    assert [tuple(part.shape) for part in full] == [(2, 4, 4), (2, 3), (2, 3, 3)]

    hermitian = symmetric_positive_definite(4, (2,), torch.complex128) - 4 * torch.eye(4)
    values, vectors = run_mapping(aten._linalg_eigh.default, hermitian)
    expected_values, expected_vectors = aten._linalg_eigh.default(hermitian)
    assert_same(values, expected_values)
    assert_same(vectors.abs(), expected_vectors.abs())
    check(aten._linalg_eigh.default, hermitian, "U", False)

    general = sample((4, 4))
    values, vectors = run_mapping(aten.linalg_eig.default, general, eager=True)
    expected_values, expected_vectors = aten.linalg_eig.default(general)
    assert_same(values, expected_values)
    assert_same(vectors.abs(), expected_vectors.abs())


def test_pinv_and_lstsq():
    tall = sample((2, 5, 3))
    check(aten.linalg_pinv.atol_rtol_tensor, tall)
    check(aten.linalg_pinv.atol_rtol_tensor, tall, atol=torch.tensor(0.5, dtype=torch.float64))
    check(aten.linalg_pinv.atol_rtol_tensor, symmetric_positive_definite(3) - 3 * torch.eye(3), hermitian=True)
    for driver in ["gelsy", "gels", "gelsd", "gelss"]:
        check(aten.linalg_lstsq.default, tall, sample((2, 5, 2)), driver=driver)
        check(aten.linalg_lstsq.default, tall.mT, sample((2, 3, 2)), driver=driver)
    check(aten.linalg_lstsq.default, tall[0], sample((5,)), driver="gelsd")  # a vector right-hand side


def test_matrix_exp():
    check(aten.linalg_matrix_exp.default, sample((2, 4, 4)))
    check(aten.linalg_matrix_exp.default, 3 * sample((3, 3), torch.complex128))


@pytest.mark.parametrize("hermitian", [False, True])
def test_ldl_factor_and_solve(hermitian):
    # An indefinite matrix: Bunch-Kaufman picks 2x2 blocks and interchanges (negative pivots).
    matrix = torch.tensor(
        [[0.1, 3.0, 1.0, 2.0], [3.0, -0.2, 0.5, 1.0], [1.0, 0.5, 0.3, -4.0], [2.0, 1.0, -4.0, 0.1]],
        dtype=torch.complex128,
    )
    lower = torch.tril(matrix + 0.5j * torch.tril(torch.ones(4, 4), -1))
    matrix = lower + (torch.tril(lower, -1).mH if hermitian else torch.tril(lower, -1).mT)
    batch = torch.stack([matrix, symmetric_positive_definite(4, dtype=torch.complex128)])
    check(aten.linalg_ldl_factor_ex.default, batch, hermitian=hermitian)
    LD, pivots, _ = torch.linalg.ldl_factor_ex(batch, hermitian=hermitian)
    assert (pivots[0] < 0).any()
    check(aten.linalg_ldl_solve.default, LD, pivots, sample((4, 2), torch.complex128), hermitian=hermitian)


# ---------------------------------------------------------------- gradients through the bridge

# name -> (function, shapes of its inputs)
GRADIENT_FUNCTIONS = {
    "solve": (lambda a, b: torch.linalg.solve(a + 4 * torch.eye(4, device=a.device), b), [(4, 4), (4, 2)]),
    "solve_left_false": (lambda a, b: torch.linalg.solve(a + 4 * torch.eye(4, device=a.device), b, left=False), [(4, 4), (2, 4)]),
    "det_slogdet": (lambda a: torch.linalg.det(a) + torch.linalg.slogdet(a + 4 * torch.eye(4, device=a.device))[1], [(4, 4)]),
    "inv": (lambda a: torch.linalg.inv(a + 4 * torch.eye(4, device=a.device)), [(4, 4)]),
    "cholesky": (lambda a: torch.linalg.cholesky(a @ a.mT + torch.eye(4, device=a.device)), [(4, 4)]),
    "qr": (lambda a: torch.cat(torch.linalg.qr(a)), [(4, 3)]),
    "eigvalsh_svdvals": (lambda a: torch.cat([torch.linalg.eigvalsh(a + a.mT), torch.linalg.svdvals(a)]), [(4, 4)]),
    "lu_solve": (lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a + 4 * torch.eye(4, device=a.device)), b), [(4, 4), (4, 2)]),
    "solve_triangular": (
        lambda a, b: torch.linalg.solve_triangular(torch.triu(a) + 4 * torch.eye(4, device=a.device), b, upper=True),
        [(4, 4), (4, 2)],
    ),
    "pinv": (torch.linalg.pinv, [(4, 3)]),
    "matrix_exp": (lambda a: torch.linalg.matrix_exp(a / 4), [(4, 4)]),
    "cholesky_solve": (
        lambda a, b: torch.cholesky_solve(b, torch.linalg.cholesky(a @ a.mT + torch.eye(4, device=a.device))),
        [(4, 4), (4, 2)],
    ),
}


@pytest.mark.parametrize("name", GRADIENT_FUNCTIONS)
def test_gradients_through_bridge(bridged, name):
    function, shapes = GRADIENT_FUNCTIONS[name]
    through_bridge(function, *[sample(shape) for shape in shapes])


# Each public torch.linalg function on empty inputs, with the arguments it needs.
_EMPTY_CALLS = {
    "norm ord=2": ("norm", (2,)),
    "norm ord=1": ("norm", (1,)),
    "matrix_norm ord=inf": ("matrix_norm", (float("inf"),)),
    "matrix_norm ord=2": ("matrix_norm", (2,)),
}
_EMPTY_SHAPES = ((0, 0), (2, 0, 0), (0, 3, 3), (3, 0))


def _linalg_functions():
    for name in sorted(dir(torch.linalg)):
        function = getattr(torch.linalg, name)
        if not name.startswith("_") and callable(function) and not isinstance(function, type):
            yield name


@pytest.mark.parametrize("name", list(_linalg_functions()) + list(_EMPTY_CALLS))
def test_linalg_results_stay_on_the_bridge(bridged, name):
    """torch's C++ composites build some results from `input.options()` (host tensors for a
    bridge input, which reports `cpu` to C++): on empty matrices, every torch.linalg function
    gives bridge tensors, with torch's values."""
    from bridge.runtime import BridgeTensor

    function_name, extra = _EMPTY_CALLS.get(name, (name, ()))
    function = getattr(torch.linalg, function_name)  # the bridge's patched version, if any
    ran = 0
    for shape in _EMPTY_SHAPES:
        for arguments in ((torch.zeros(shape),) + extra, (torch.zeros(shape), torch.zeros(shape)) + extra):
            try:
                expected = function(*arguments)
            except Exception:  # noqa: BLE001 - not a valid call in torch either: nothing to compare
                continue
            actual = function(*(value.cuda() if isinstance(value, torch.Tensor) else value for value in arguments))
            for got, want in zip(torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected)):
                if isinstance(want, torch.Tensor):
                    assert isinstance(got, BridgeTensor), f"{name}{tuple(shape)}: a plain host tensor"
                    torch.testing.assert_close(got.cpu(), want, equal_nan=True)
            ran += 1
            break
    if ran == 0:
        pytest.skip(f"torch.linalg.{name} takes none of these empty inputs in eager torch")
