"""Shared helpers of the per-family mapping tests: run a table entry on JAX copies of torch inputs."""

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import bridge.op_mappings  # noqa: E402,F401  (registers the tables)
from bridge.runtime import dtypes  # noqa: E402
from bridge.runtime.registry import MAPPINGS  # noqa: E402


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
    stay static, arrays are traced.
    """
    call = MAPPINGS[op].call
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


def assert_same(actual, expected, **tolerance):
    """Same dtype, shape and values (NaNs equal) as torch's result; lists item by item."""
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for actual_item, expected_item in zip(actual, expected):
            assert_same(actual_item, expected_item, **tolerance)
        return
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != torch's {expected.dtype}"
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != torch's {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, equal_nan=True, **tolerance)
