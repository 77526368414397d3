"""The arithmetic settings of torch that mappings read besides their arguments: float32 matmul
and cuDNN TF32 precision, and the layout 2-d convolutions give their results in.

A mapping that reads the precision settings declares it (`register_mapping(..., reads=
("precision",))`); its compiled programs are then keyed on `precision_settings()`, so a script
that changes them mid-run (`torch.set_float32_matmul_precision`) gets what it asked for.
`reads` counts every read, so that the runtime can tell a mapping that reads them without
declaring it (runtime/compiled_ops.py).
"""

import torch
from jax import lax

from . import devices
from .config import settings

reads = 0  # reads of the precision settings so far (matmul_precision, conv_precision)


def precision_settings() -> tuple:
    return (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )


def matmul_precision() -> lax.Precision:
    """The `jax.lax.Precision` matching torch's float32 matmul setting.

    torch's default ("highest") is full float32; "high" and "medium" allow TF32
    or bf16 passes, which XLA's DEFAULT precision gives on GPUs.
    """
    global reads
    reads += 1
    if torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32:
        return lax.Precision.HIGHEST
    return lax.Precision.DEFAULT


def conv_precision() -> lax.Precision:
    """The `jax.lax.Precision` of float32 convolutions: torch lets cuDNN use TF32 for them
    unless `torch.backends.cudnn.allow_tf32` is False (its default is True). XLA's CPU
    backend computes DEFAULT in full float32, as torch's CPU kernels do."""
    global reads
    reads += 1
    if not torch.backends.cudnn.allow_tf32:
        return lax.Precision.HIGHEST
    return lax.Precision.DEFAULT


def conv_channels_last() -> bool:
    """Whether 2-d convolutions give their result channels-last before the transpose to NCHW.

    On GPUs XLA runs convolutions in NHWC. A captured region's split runs keep convolution
    results for the backward program (runtime/capture.py), and a kept NCHW result would be
    transposed on its way out of the forward program and back in the backward (a fifth of
    ResNet-50's step on an H100: docs/design.md). On XLA's CPU the layout changes the order of
    later reductions, so it stays NCHW there. `settings.conv_channels_last` overrides.
    """
    if settings.conv_channels_last is not None:
        return settings.conv_channels_last
    return devices.first_device().platform == "gpu"
