"""The float32 attention kernel (op_mappings/flash_attention.py), run through Pallas's interpreter
on the CPU: outputs and gradients against torch, the logsumexp and its cotangent against JAX
differentiating the full score matrix, and which inputs the kernel takes.

On a GPU the same kernels are compiled by Triton; test_attention_blocks.py then checks the
captured and eager attention that uses them (`JAX_PLATFORMS=cuda`, benchmarks/gpu_check.sh)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax import lax

from bridge.op_mappings import flash_attention as fa

CASES = [
    # (batch, heads, query length, key length, head size, causal, (block_query, block_key, warps,
    # stages)): the same blocks forward and backward
    (1, 2, 128, 128, 16, True, (32, 32, 4, 2)),
    (2, 1, 128, 128, 32, False, (32, 32, 4, 2)),
    (1, 1, 128, 128, 32, True, (64, 32, 4, 2)),  # a query block spans two key blocks
    (1, 1, 128, 128, 32, True, (32, 64, 4, 2)),  # a key block spans two query blocks
    (1, 1, 64, 128, 16, True, (32, 32, 4, 2)),  # more keys than queries (top-left causal mask)
    (1, 1, 128, 64, 16, True, (32, 32, 4, 2)),  # more queries than keys
    (1, 1, 128, 64, 16, False, (32, 32, 4, 2)),
]


def _torch(q, k, v, grad, causal, dtype):
    q, k, v = (t.to(dtype).clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return (out, *torch.autograd.grad(out, (q, k, v), grad.to(dtype)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:5])) + ("-causal" if c[5] else "") + f"-b{c[6][0]}x{c[6][1]}")
def test_kernel_matches_torch(bridged, case):
    batch, heads, length, key_length, size, causal, blocks = case
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, length, size, generator=generator)
    k, v = (torch.randn(batch, heads, key_length, size, generator=generator) for _ in range(2))
    grad = torch.randn(batch, heads, length, size, generator=generator)
    exact = _torch(q, k, v, grad, causal, torch.float64)
    torch_float32 = _torch(q, k, v, grad, causal, torch.float32)

    def attend(q, k, v):
        return fa.flash_attention(q, k, v, causal, size**-0.5, lax.Precision.HIGHEST, True, (blocks, blocks))[0]

    out, pullback = jax.vjp(attend, *(jnp.asarray(t.numpy()) for t in (q, k, v)))
    ours = (out, *pullback(jnp.asarray(grad.numpy())))
    for name, mine, theirs, truth in zip(("output", "dq", "dk", "dv"), ours, torch_float32, exact):
        assert mine.dtype == jnp.float32
        truth = truth.detach().numpy()
        error = np.abs(np.asarray(mine, np.float64) - truth).max()
        torch_error = np.abs(theirs.detach().double().numpy() - truth).max()
        # float32 rounding: within a few times torch's own float32 kernel's distance to float64.
        assert error <= 4 * torch_error + 1e-6, f"{name}: kernel {error:.2e}, torch float32 {torch_error:.2e}"


def test_logsumexp_and_its_cotangent(bridged):
    """Both outputs and a cotangent for each, against JAX differentiating the full score matrix
    in float64 (the bridge enables JAX's 64-bit types; torch never differentiates the
    logsumexp, but the rule must be right)."""
    rng = np.random.default_rng(0)
    q, k, v, grad_out = (rng.standard_normal((1, 2, 128, 16)).astype(np.float32) for _ in range(4))
    grad_lse = rng.standard_normal((1, 2, 128)).astype(np.float32)
    scale = 0.3

    def full(q, k, v):
        scores = jnp.einsum("...qd,...kd->...qk", q, k) * scale
        scores = jnp.where(np.tril(np.ones((128, 128), bool)), scores, -jnp.inf)
        return jax.nn.softmax(scores, axis=-1) @ v, jax.nn.logsumexp(scores, axis=-1)

    def kernel(q, k, v):
        return fa.flash_attention(q, k, v, True, scale, lax.Precision.HIGHEST, True, ((32, 32, 4, 2),) * 2)

    expected, full_pullback = jax.vjp(full, *(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
    got, kernel_pullback = jax.vjp(kernel, *(jnp.asarray(x) for x in (q, k, v)))
    cotangents = (jnp.asarray(grad_out), jnp.asarray(grad_lse))
    exact_cotangents = tuple(c.astype(jnp.float64) for c in cotangents)
    for mine, truth in zip((*got, *kernel_pullback(cotangents)), (*expected, *full_pullback(exact_cotangents))):
        np.testing.assert_allclose(np.asarray(mine, np.float64), np.asarray(truth), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize(
    "shapes, mask, takes",
    [
        (((8, 12, 1024, 64),) * 3, None, True),  # GPT-2 small
        (((2, 4, 256, 128),) * 3, None, True),
        (((8, 12, 1024, 64),) * 3, "mask", False),  # an explicit mask: XLA's form
        (((2, 4, 100, 64),) * 3, None, False),  # length not a multiple of the blocks
        (((2, 4, 256, 80),) * 3, None, False),  # head size the kernel has no tiling for
        (((2, 4, 256, 64), (2, 4, 256, 64), (2, 4, 256, 32)), None, False),  # value head size differs
        (((12, 256, 64),) * 3, None, False),  # 3-d
        (((2, 4, 256, 64), (1, 4, 256, 64), (1, 4, 256, 64)), None, False),  # a broadcast batch
    ],
)
def test_which_inputs_the_kernel_takes(shapes, mask, takes):
    arrays = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    assert fa.applies(*arrays, mask) is takes
