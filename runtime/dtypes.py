"""The dtype model: torch <-> JAX dtype tables and torch's type promotion.

JAX's own promotion (weak types, x64 rules) differs from torch's, so mappings
never rely on it: the registry casts operands to the dtype torch would compute
in, using the rules below, before an entry's body runs.
"""

import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

TORCH_TO_JAX = {
    torch.float32: jnp.dtype(jnp.float32),
    torch.float64: jnp.dtype(jnp.float64),
    torch.float16: jnp.dtype(jnp.float16),
    torch.bfloat16: jnp.dtype(jnp.bfloat16),
    torch.int8: jnp.dtype(jnp.int8),
    torch.int16: jnp.dtype(jnp.int16),
    torch.int32: jnp.dtype(jnp.int32),
    torch.int64: jnp.dtype(jnp.int64),
    torch.uint8: jnp.dtype(jnp.uint8),
    torch.uint16: jnp.dtype(jnp.uint16),
    torch.uint32: jnp.dtype(jnp.uint32),
    torch.uint64: jnp.dtype(jnp.uint64),
    torch.bool: jnp.dtype(jnp.bool_),
    torch.complex64: jnp.dtype(jnp.complex64),
    torch.complex128: jnp.dtype(jnp.complex128),
    torch.float8_e4m3fn: jnp.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: jnp.dtype(ml_dtypes.float8_e5m2),
}
JAX_TO_TORCH = {value: key for key, value in TORCH_TO_JAX.items()}


def to_jax_dtype(dtype):
    """The JAX dtype for a torch dtype (None stays None)."""
    if dtype is None:
        return None
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        from .errors import BridgeError

        raise BridgeError(f"torch dtype {dtype} has no JAX counterpart; cast the tensor to a supported dtype first") from None


def to_torch_dtype(dtype):
    """The torch dtype for a JAX/NumPy dtype."""
    return JAX_TO_TORCH[np.dtype(dtype)]


# Categories in torch's promotion order.
_BOOL, _INT, _FLOAT, _COMPLEX = 0, 1, 2, 3


def category(dtype):
    if dtype is torch.bool:
        return _BOOL
    if dtype.is_complex:
        return _COMPLEX
    if dtype.is_floating_point:
        return _FLOAT
    return _INT


def _scalar_dtype(value):
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    if isinstance(value, float):
        return torch.get_default_dtype()
    if isinstance(value, complex):
        return torch.complex64 if torch.get_default_dtype() is torch.float32 else torch.complex128
    return None


_COMPLEX_OF = {
    torch.float16: torch.complex32,
    torch.bfloat16: torch.complex64,
    torch.float32: torch.complex64,
    torch.float64: torch.complex128,
}


@functools.lru_cache(maxsize=4096)
def _result_type_cached(operands, default_dtype):
    # operands: tuple of (priority, torch dtype); priority 2 = dimensioned tensor,
    # 1 = zero-dim tensor, 0 = Python scalar.  Mirrors at::native::result_type.
    best = {}
    for priority, dtype in operands:
        current = best.get(priority)
        best[priority] = dtype if current is None else torch.promote_types(current, dtype)
    result = None
    for priority in (2, 1, 0):
        dtype = best.get(priority)
        if dtype is None:
            continue
        if result is None:
            result = dtype
        elif category(dtype) > category(result):
            if category(dtype) == _COMPLEX and result.is_floating_point:
                # A complex operand of lower priority keeps the float's width.
                dtype = _COMPLEX_OF.get(result, torch.complex64)
            elif priority == 0 and category(dtype) == _FLOAT:
                dtype = default_dtype
            elif priority == 0 and category(dtype) == _COMPLEX:
                dtype = _COMPLEX_OF[default_dtype]
            result = dtype
    return result


# The ids of the tracers that stand for Python floats in the trace of an eager op's program
# taking its changing floats as arguments (runtime/compiled_ops.py), while that trace runs: they
# promote as the Python numbers they stand for, not as 0-dim float64 tensors.
lifted_floats = set()


def is_lifted_float(value):
    return bool(lifted_floats) and id(value) in lifted_floats


def result_type(operands):
    """torch.result_type over jax arrays, 0-dim arrays and Python scalars.

    `operands` holds jax arrays (dimensioned or 0-dim), torch dtypes are
    recovered from them; Python numbers count as weakly typed scalars, and so
    do the tracers standing for them (is_lifted_float).
    """
    keyed = []
    for value in operands:
        if value is None:
            continue
        dtype = getattr(value, "dtype", None)
        if dtype is not None and is_lifted_float(value):
            keyed.append((0, torch.get_default_dtype()))
        elif dtype is not None:
            keyed.append((2 if value.ndim else 1, JAX_TO_TORCH[dtype]))
        else:
            dtype = _scalar_dtype(value)
            if dtype is not None:
                keyed.append((0, dtype))
    return _result_type_cached(tuple(keyed), torch.get_default_dtype())


# Promotion kinds, as in torch._prims_common.ELEMENTWISE_TYPE_PROMOTION_KIND.
DEFAULT = "default"
INT_TO_FLOAT = "int_to_float"
ALWAYS_BOOL = "always_bool"
COMPLEX_TO_FLOAT = "complex_to_float"
BOOL_TO_LONG = "bool_to_long"
NO_OPMATH = "no_opmath"

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=4096)
def _kind_dtypes(kind, dtype, default_dtype):
    """(compute dtype, result dtype) for a promoted dtype under a promotion kind."""
    if kind == INT_TO_FLOAT and not (dtype.is_floating_point or dtype.is_complex):
        dtype = default_dtype
    if kind == BOOL_TO_LONG and dtype is torch.bool:
        dtype = torch.int64
    compute = dtype
    if kind != NO_OPMATH and dtype in _LOW_PRECISION:
        compute = torch.float32
    elif kind != NO_OPMATH and dtype is torch.complex32:
        compute = torch.complex64
    if kind == ALWAYS_BOOL:
        return compute, torch.bool
    if kind == COMPLEX_TO_FLOAT and dtype.is_complex:
        return compute, dtype.to_real()
    return compute, dtype


def elementwise_dtypes(kind, operands):
    """(compute, result) torch dtypes for an elementwise op, as torch's _refs compute them."""
    return _kind_dtypes(kind, result_type(operands), torch.get_default_dtype())
