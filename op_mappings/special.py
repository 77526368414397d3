"""Special functions: Bessel functions, orthogonal polynomials, polygamma and the rest of torch.special."""

from runtime.registry import aten, register_mapping  # noqa: F401
