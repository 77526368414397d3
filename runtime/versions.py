"""The torch and JAX versions the bridge supports, and every fact that differs between them.

Code that must behave differently on another torch or JAX release asks here (`TORCH >= (2, 14)`)
instead of probing with `hasattr`, so that the differences can be read, and retired, in one place.
"""

import os
import re
import warnings

import jax
import torch

from .errors import BridgeWarning, UnsupportedVersionError

# (lowest, highest) minor releases tested; patch releases of those are supported.
SUPPORTED_TORCH = ((2, 11), (2, 15))
SUPPORTED_JAX = ((0, 10), (0, 12))


def release(version):
    """(major, minor) of a version string such as '2.14.1+cu130' or '0.12.0.1'."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


TORCH = release(torch.__version__)
JAX = release(jax.__version__)

# Operators the tables name that some supported torch lacks: the release that added the op,
# or, where it was removed, the release that removed it. An op the installed torch lacks and that
# is not listed here is a typo in a table (tests/test_install.py checks it).
OPS_ADDED = {}
OPS_REMOVED = {
    "aten.cholesky": (2, 14),  # torch.cholesky was deprecated in favour of torch.linalg.cholesky
}


# Subtracting two bool tensors: torch 2.14 raises NotImplementedError from the kernel, where
# earlier releases raised RuntimeError from the argument check (the meta kernel no longer checks).
BOOL_SUBTRACTION_ERROR = NotImplementedError if TORCH >= (2, 14) else RuntimeError


# arange with an integer dtype and float bounds: from torch 2.14 its length comes from the bounds
# as given (arange(0.5, 5, 1.5, dtype=int64) has 3 elements), before it from the bounds truncated
# to integers (5 elements); the values step from the truncated start by the truncated step in both.
ARANGE_LENGTH_FROM_FLOAT_BOUNDS = TORCH >= (2, 14)


def expected_missing(name):
    """Whether the installed torch may lack the operator `name` ('aten.op' or 'aten.op.overload')."""
    packet = ".".join(name.split(".")[:2])
    for op in (name, packet):
        if op in OPS_ADDED and TORCH < OPS_ADDED[op]:
            return True
        if op in OPS_REMOVED and TORCH >= OPS_REMOVED[op]:
            return True
    return False


def _describe(name, found, supported):
    (low_major, low_minor), (high_major, high_minor) = supported
    return f"{name} {found} (the bridge supports {name} {low_major}.{low_minor} to {high_major}.{high_minor})"


def unsupported():
    """A sentence for each installed library outside its supported range."""
    problems = []
    for name, found, parsed, supported in (
        ("torch", torch.__version__, TORCH, SUPPORTED_TORCH),
        ("jax", jax.__version__, JAX, SUPPORTED_JAX),
    ):
        if not supported[0] <= parsed <= supported[1]:
            problems.append(_describe(name, found, supported))
    return problems


def check_supported():
    """At activation: an error naming each version outside the supported range, or, with
    BRIDGE_ALLOW_UNSUPPORTED=1, a warning and on we go (a newer release often still works)."""
    problems = unsupported()
    if not problems:
        return
    allowed = os.environ.get("BRIDGE_ALLOW_UNSUPPORTED", "").lower() in ("1", "true", "yes", "on")
    if allowed:
        warnings.warn(
            "bridge: running with " + "; ".join(problems) + ", as BRIDGE_ALLOW_UNSUPPORTED asks; "
            "results are untested there.",
            BridgeWarning,
            stacklevel=3,
        )
        return
    raise UnsupportedVersionError(
        "bridge: installed " + "; ".join(problems) + ". Install a supported release "
        "(pip install 'torch>=2.11,<2.16' 'jax>=0.10,<0.13'), or set BRIDGE_ALLOW_UNSUPPORTED=1 "
        "to try this one anyway (`python -m bridge doctor` shows what is installed)."
    )
