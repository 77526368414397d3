"""Matrix factorizations and solvers: cholesky, LU, QR, SVD, eigendecompositions, triangular and general solves, inverses, determinants."""

from runtime.registry import aten, register_mapping  # noqa: F401
