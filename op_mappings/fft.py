"""Discrete Fourier transforms: the _fft_c2c/_fft_r2c/_fft_c2r kernels torch.fft lowers to."""

from runtime.registry import aten, register_mapping  # noqa: F401
