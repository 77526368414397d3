"""Shared helpers of the per-family mapping tests: run a table entry on JAX copies of torch inputs
and compare it with torch's op on the inputs. Importing it turns on JAX's 64-bit types (torch's
float64 and int64 need them) and registers the tables."""

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.testing import make_tensor  # noqa: E402

import bridge.op_mappings  # noqa: E402,F401  (registers the tables)
from bridge.runtime import dtypes  # noqa: E402
from bridge.runtime.registry import MAPPINGS  # noqa: E402


@pytest.fixture(autouse=True)
def seeded():
    """Seed torch's global generator before each test of a module that imports this fixture."""
    torch.manual_seed(0)


def sample(shape, dtype, low=None, high=None, **options):
    """make_tensor's values on the CPU, drawn from torch's global generator (see `seeded`)."""
    return make_tensor(shape, dtype=dtype, device="cpu", low=low, high=high, **options)


def seeded_sample(shape, dtype=torch.float32, seed=0):
    """Values from a generator of their own seed: bools half true, integers in [-50, 50), others normal."""
    generator = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-50, 50, shape, generator=generator, dtype=dtype)
    return torch.randn(shape, generator=generator, dtype=dtype)


def to_jax(value):
    """JAX copies of the tensors in a (nested) argument."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            return jnp.asarray(value.float().numpy()).astype(jnp.bfloat16)
        return jnp.asarray(value.numpy())
    if isinstance(value, (list, tuple)):
        return type(value)(to_jax(item) for item in value)
    if isinstance(value, dict):
        return {key: to_jax(item) for key, item in value.items()}
    return value


def to_torch(value):
    """Torch copies of the arrays in a (nested) result."""
    if isinstance(value, (jax.Array, np.ndarray)):
        dtype = dtypes.to_torch_dtype(value.dtype)
        if dtype is torch.bfloat16:
            return torch.from_numpy(np.array(value.astype(jnp.float32))).to(torch.bfloat16)
        return torch.from_numpy(np.array(value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_torch(item) for item in value)
    return value


def run_mapping(op, *args, eager=False, **kwargs):
    """The mapping of `op` on JAX copies of the arguments, traced under jax.jit unless `eager`.

    Entries must be traceable, so the tests trace them (one compile also costs less than
    compiling each primitive eagerly); only data-dependent ops run eagerly. Python scalars
    stay static, arrays are traced. Of an entry that writes arguments in place (`mutates`,
    batch norm's running statistics) it returns the outputs, not the written values.
    """
    mapping = MAPPINGS[op]

    def call(*arguments, **keywords):
        result = mapping.call(*arguments, **keywords)
        return result[0] if mapping.mutates else result

    leaves, tree = jax.tree_util.tree_flatten((to_jax(args), to_jax(kwargs)))
    if eager:
        arguments, keywords = jax.tree_util.tree_unflatten(tree, leaves)
        return to_torch(call(*arguments, **keywords))
    dynamic = [position for position, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

    def traced(*arrays):
        filled = list(leaves)
        for position, array in zip(dynamic, arrays):
            filled[position] = array
        arguments, keywords = jax.tree_util.tree_unflatten(tree, filled)
        return call(*arguments, **keywords)

    return to_torch(jax.jit(traced)(*[leaves[position] for position in dynamic]))


def check(op, *args, tolerance=None, eager=False, outputs=None, bfloat16_against_float64=None, **kwargs):
    """Run the mapping of `op` on JAX copies of the arguments and torch's `op` on the arguments,
    compare the two as `assert_same` does, and return the mapping's result (for a test's next op).

    tolerance: `rtol` and `atol` in place of torch.testing's defaults for the dtype, for ops whose
        rounding differs from torch's kernels by more (sums taken in another order).
    eager: run the entry op by op rather than traced under jax.jit, for ops whose result shape
        depends on the data (bool masks, nonzero) or whose result is a host value.
    outputs: positions in the op's tuple of outputs to compare, where torch leaves the others
        unspecified or the test compares them its own way (saved statistics).
    bfloat16_against_float64: a tolerance; given, a call with a bfloat16 tensor among its
        positional arguments is compared with torch run on float64 copies of the arguments,
        its result rounded to the mapping's dtypes, rather than with torch's bfloat16 kernels,
        whose own accumulation error (sums over windows, batch axes) is larger. The mapping's
        dtypes are then not compared, only shapes and values.
    """
    low_precision = bfloat16_against_float64 is not None and any(
        isinstance(argument, torch.Tensor) and argument.dtype is torch.bfloat16 for argument in args
    )
    if low_precision:
        expected = op(*as_float64(args), **as_float64(kwargs))
    else:
        expected = op(*args, **kwargs)
    actual = run_mapping(op, *args, eager=eager, **kwargs)
    compared = (actual, expected)
    if outputs is not None:
        compared = ([actual[index] for index in outputs], [expected[index] for index in outputs])
    try:
        if low_precision:
            assert_rounded_alike(*compared, **bfloat16_against_float64)
        else:
            assert_same(*compared, **(tolerance or {}))
    except AssertionError as error:
        raise AssertionError(f"{op} on {args} {kwargs}:\n{error}\nbridge: {actual}\ntorch:  {expected}") from None
    return actual


def as_float64(value):
    """float64 copies of the floating tensors in a (nested) argument."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    if isinstance(value, (list, tuple)):
        return type(value)(as_float64(item) for item in value)
    if isinstance(value, dict):
        return {key: as_float64(item) for key, item in value.items()}
    return value


def _output_pairs(actual, expected):
    """(bridge, torch) pairs of the outputs: a tuple's or list's items in order, of equal number."""
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{len(actual)} outputs != torch's {len(expected)}"
        for actual_item, expected_item in zip(actual, expected):
            yield from _output_pairs(actual_item, expected_item)
    else:
        yield actual, expected


def assert_same(actual, expected, **tolerance):
    """Same as torch's result: a tensor's dtype, shape and values (NaNs equal), None for None, any
    other value (a bool of `equal`) by ==; tuples and lists item by item."""
    for actual_item, expected_item in _output_pairs(actual, expected):
        if expected_item is None:
            assert actual_item is None, f"{actual_item} where torch gives None"
        elif not isinstance(expected_item, torch.Tensor):
            assert actual_item == expected_item, f"{actual_item} != torch's {expected_item}"
        else:
            assert actual_item.dtype == expected_item.dtype, f"dtype {actual_item.dtype} != torch's {expected_item.dtype}"
            assert actual_item.shape == expected_item.shape, (
                f"shape {tuple(actual_item.shape)} != torch's {tuple(expected_item.shape)}"
            )
            torch.testing.assert_close(actual_item, expected_item, equal_nan=True, **tolerance)


def assert_rounded_alike(actual, expected, **tolerance):
    """Values of a float64 torch result, rounded to the bridge result's dtypes, within `tolerance`:
    shapes and values (NaNs equal), None for None; not the dtypes, which float64 torch cannot give."""
    for actual_item, expected_item in _output_pairs(actual, expected):
        if expected_item is None:
            assert actual_item is None, f"{actual_item} where torch gives None"
        else:
            rounded = expected_item.to(actual_item.dtype).double()
            torch.testing.assert_close(actual_item.double(), rounded, equal_nan=True, **tolerance)


def through_bridge(function, *inputs, differentiable=True):
    """Run `function` on bridge copies of `inputs` and on the inputs; compare values and input gradients.

    Also checks that every op ran from the tables (no CPU fallback) and that no result
    needed a dtype correction against torch's meta kernels.
    """
    from bridge.runtime import stats
    from bridge.runtime.tensor import to_bridge
    from bridge.runtime.tensor import to_torch as bridge_to_torch

    stats.reset()
    eager = [value.clone().requires_grad_(differentiable and value.is_floating_point()) for value in inputs]
    bridged = [to_bridge(value).requires_grad_(differentiable and value.is_floating_point()) for value in inputs]
    expected, actual = function(*eager), function(*bridged)
    torch.testing.assert_close(bridge_to_torch(actual), expected, equal_nan=True)
    if differentiable:
        upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3), dtype=expected.dtype)
        expected.backward(upstream)
        actual.backward(to_bridge(upstream))
        for eager_input, bridged_input in zip(eager, bridged):
            if eager_input.requires_grad:
                torch.testing.assert_close(bridge_to_torch(bridged_input.grad), eager_input.grad)
    summary = stats.summary()
    assert not summary["cpu_fallbacks"], summary["cpu_fallbacks"]
    assert not summary["dtype_corrections"], summary["dtype_corrections"]
