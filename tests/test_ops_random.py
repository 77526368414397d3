"""Random mappings: shapes, dtypes, reproducibility under a fixed key, and the moments of torch's distributions;
then seeding, dropout and in-place initializers through the bridge."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bridge.op_mappings  # noqa: F401  (registers the tables)
from bridge.runtime.registry import MAPPINGS

jax.config.update("jax_enable_x64", True)
aten = torch.ops.aten
SAMPLES = 200_000


def draw(op, *args, seed=0, **kwargs):
    return MAPPINGS[op].call(*args, key=jax.random.key(seed), **kwargs)


def moments(values):
    values = np.asarray(values, dtype=np.float64)
    return values.mean(), values.std()


def assert_moments(values, mean, std, tolerance=0.02):
    actual_mean, actual_std = moments(values)
    scale = max(std, 1e-3)
    assert abs(actual_mean - mean) < tolerance * scale * 5, (actual_mean, mean)
    assert abs(actual_std - std) < tolerance * scale * 5, (actual_std, std)


def like(shape=(SAMPLES,), dtype=jnp.float32):
    return jnp.zeros(shape, dtype=dtype)


# ---------------------------------------------------------------- shape, dtype, reproducibility


FACTORIES = [
    (aten.rand.default, ([3, 4],), {}, (3, 4), jnp.float32),
    (aten.rand.default, ([3, 4],), {"dtype": torch.bfloat16}, (3, 4), jnp.bfloat16),
    (aten.randn.default, ([2, 5],), {"dtype": torch.float64}, (2, 5), jnp.float64),
    (aten.randn.default, ([6],), {"dtype": torch.complex64}, (6,), jnp.complex64),
    (aten.randint.default, (7, [4, 2]), {}, (4, 2), jnp.int64),
    (aten.randint.low, (-3, 9, [5]), {"dtype": torch.int32}, (5,), jnp.int32),
    (aten.randperm.default, (10,), {}, (10,), jnp.int64),
    (aten.normal.float_float, (1.0, 2.0, [3, 3]), {}, (3, 3), jnp.float32),
]


@pytest.mark.parametrize("op, args, kwargs, shape, dtype", FACTORIES, ids=lambda value: str(value)[:24])
def test_factories_shape_dtype_and_reproducibility(op, args, kwargs, shape, dtype):
    first = draw(op, *args, **kwargs)
    assert first.shape == shape and first.dtype == dtype
    np.testing.assert_array_equal(np.asarray(draw(op, *args, **kwargs)), np.asarray(first))
    assert not np.array_equal(np.asarray(draw(op, *args, seed=1, **kwargs)), np.asarray(first))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_like_ops_keep_shape_and_dtype(dtype):
    template = like((3, 5), dtype)
    for op, args in (
        (aten.rand_like.default, ()),
        (aten.randn_like.default, ()),
        (aten.randint_like.default, (4,)),
        (aten.randint_like.low_dtype, (2, 4)),
        (aten.uniform.default, (-1.0, 1.0)),
        (aten.normal_functional.default, (0.0, 1.0)),
        (aten.bernoulli.p, (0.5,)),
        (aten.exponential.default, ()),
        (aten.cauchy.default, ()),
        (aten.log_normal.default, ()),
        (aten.geometric.default, (0.5,)),
        (aten.random.default, ()),
    ):
        result = draw(op, template, *args)
        assert result.shape == (3, 5) and result.dtype == dtype, op
    assert draw(aten.rand_like.default, template, dtype=torch.float64).dtype == jnp.float64


def test_uniform_draws_stay_below_the_upper_bound():
    for dtype in (jnp.bfloat16, jnp.float32):
        values = np.asarray(draw(aten.uniform.default, like(dtype=dtype), 0.0, 1.0).astype(jnp.float32))
        assert values.min() >= 0 and values.max() < 1


# ---------------------------------------------------------------- distributions


def test_continuous_moments():
    assert_moments(draw(aten.rand.default, [SAMPLES]), 0.5, math.sqrt(1 / 12))
    assert_moments(draw(aten.randn.default, [SAMPLES], dtype=torch.float64), 0.0, 1.0)
    assert_moments(draw(aten.uniform.default, like(), -2.0, 3.0), 0.5, 5 / math.sqrt(12))
    assert_moments(draw(aten.normal_functional.default, like(), 2.0, 3.0), 2.0, 3.0)
    assert_moments(draw(aten.normal.Tensor_float, like() + 1.0, 2.0), 1.0, 2.0)
    assert_moments(draw(aten.normal.float_Tensor, -1.0, like() + 0.5), -1.0, 0.5)
    assert_moments(draw(aten.normal.Tensor_Tensor, like() + 3.0, like() + 0.25), 3.0, 0.25)
    assert_moments(draw(aten.exponential.default, like(), 2.0), 0.5, 0.5)
    sigma, mean = 0.5, 0.1
    log_normal_mean = math.exp(mean + sigma**2 / 2)
    log_normal_std = math.sqrt((math.exp(sigma**2) - 1) * math.exp(2 * mean + sigma**2))
    assert_moments(draw(aten.log_normal.default, like(), mean, sigma), log_normal_mean, log_normal_std)
    # Cauchy has no moments: check its median and quartiles (median +- sigma).
    cauchy = np.asarray(draw(aten.cauchy.default, like(), 1.0, 2.0))
    np.testing.assert_allclose(np.percentile(cauchy, [25, 50, 75]), [-1.0, 1.0, 3.0], atol=0.05)


def test_complex_randn_splits_the_variance():
    values = np.asarray(draw(aten.randn.default, [SAMPLES], dtype=torch.complex128))
    assert_moments(values.real, 0.0, math.sqrt(0.5))
    assert_moments(values.imag, 0.0, math.sqrt(0.5))


def test_discrete_distributions():
    randint = np.asarray(draw(aten.randint.low, -5, 5, [SAMPLES]))
    assert randint.min() == -5 and randint.max() == 4
    assert_moments(randint, -0.5, math.sqrt((10**2 - 1) / 12))
    geometric = np.asarray(draw(aten.geometric.default, like(), 0.25))
    assert geometric.min() == 1
    assert_moments(geometric, 4.0, math.sqrt(0.75) / 0.25)
    bernoulli = np.asarray(draw(aten.bernoulli.p, like(), 0.3))
    assert set(np.unique(bernoulli)) <= {0.0, 1.0}
    assert abs(bernoulli.mean() - 0.3) < 0.01
    probabilities = jnp.asarray(np.linspace(0, 1, SAMPLES), dtype=jnp.float64)
    drawn = np.asarray(draw(aten.bernoulli.default, probabilities))
    assert abs(drawn[: SAMPLES // 2].mean() - 0.25) < 0.01 and abs(drawn[SAMPLES // 2 :].mean() - 0.75) < 0.01
    assert abs(np.asarray(draw(aten.bernoulli.Tensor, like(), like() + 0.8)).mean() - 0.8) < 0.01


def test_random_ranges():
    floats = np.asarray(draw(aten.random.default, like()))
    assert floats.min() >= 0 and floats.max() <= 2**24 and floats.max() > 2**23
    assert np.all(floats == np.floor(floats))
    wide = np.asarray(draw(aten.random.default, like(dtype=jnp.int64)))
    assert wide.min() >= 0 and wide.max() > 2**62
    assert set(np.unique(np.asarray(draw(aten.random.to, like(), 3)))) == {0.0, 1.0, 2.0}
    from_to = np.asarray(draw(getattr(aten.random, "from"), like(dtype=jnp.int64), 3, 6))
    assert set(np.unique(from_to)) == {3, 4, 5}
    unbounded = np.asarray(draw(getattr(aten.random, "from"), like(dtype=jnp.int8), -5, None))
    assert unbounded.min() == -5 and unbounded.max() == 127


def test_multinomial():
    weights = jnp.asarray([1.0, 2.0, 7.0, 0.0], dtype=jnp.float32)
    with_replacement = np.asarray(draw(aten.multinomial.default, jnp.stack([weights, weights]), SAMPLES // 2, True))
    assert with_replacement.shape == (2, SAMPLES // 2) and with_replacement.dtype == np.int64
    frequencies = np.bincount(with_replacement.ravel(), minlength=4) / with_replacement.size
    np.testing.assert_allclose(frequencies, [0.1, 0.2, 0.7, 0.0], atol=0.01)
    without = np.asarray(draw(aten.multinomial.default, jnp.tile(weights, (500, 1)), 3))
    assert all(sorted(row) == [0, 1, 2] for row in without)
    # The first draw without replacement follows the weights too.
    np.testing.assert_allclose(np.bincount(without[:, 0], minlength=3) / 500, [0.1, 0.2, 0.7], atol=0.06)


def test_randperm_is_a_permutation():
    assert sorted(np.asarray(draw(aten.randperm.default, 1000)).tolist()) == list(range(1000))


def test_native_dropout():
    input = jnp.ones((1000, 100), dtype=jnp.float32)
    output, mask = draw(aten.native_dropout.default, input, 0.3, True)
    assert mask.dtype == jnp.bool_ and abs(float(mask.mean()) - 0.7) < 0.01
    np.testing.assert_allclose(np.asarray(output), np.asarray(mask) / 0.7, rtol=1e-6)
    output, mask = draw(aten.native_dropout.default, input, 0.3, False)
    assert bool(mask.all()) and bool((output == input).all())
    output, mask = draw(aten.native_dropout.default, input, 1.0, True)
    assert not bool(output.any())
    grad = MAPPINGS[aten.native_dropout_backward.default].call(input * 2, mask, 2.0)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(mask) * 4.0)


# ---------------------------------------------------------------- through the bridge


def test_manual_seed_reproduces_bridge_draws(bridged):
    torch.manual_seed(7)
    first = (torch.randn(5, device="cuda"), torch.rand(3, device="cuda"), torch.randint(10, (4,), device="cuda"))
    torch.manual_seed(7)
    second = (torch.randn(5, device="cuda"), torch.rand(3, device="cuda"), torch.randint(10, (4,), device="cuda"))
    for a, b in zip(first, second):
        assert torch.equal(a.cpu(), b.cpu())
    assert not torch.equal(torch.randn(5, device="cuda").cpu(), first[0].cpu())


def test_functional_dropout_through_bridge(bridged):
    torch.manual_seed(0)
    input = torch.ones(200, 50, device="cuda", requires_grad=True)
    output = torch.ops.aten.native_dropout(input, 0.25, True)[0]
    output.sum().backward()
    kept = (output.detach().cpu() != 0).float()
    assert abs(kept.mean().item() - 0.75) < 0.02
    torch.testing.assert_close(input.grad.cpu(), kept / 0.75)


def test_dropout_and_uniform_initializer_through_bridge(bridged):
    torch.manual_seed(0)
    layer = nn.Linear(100, 100).to("cuda")
    nn.init.uniform_(layer.bias, -1.0, 1.0)
    bias = layer.bias.detach().cpu()
    assert bias.min() >= -1 and bias.max() < 1 and bias.std() > 0.5
    input = torch.ones(100, 100, device="cuda", requires_grad=True)
    output = F.dropout(input, 0.4)
    output.sum().backward()
    kept = (output.detach().cpu() != 0).float()
    assert abs(kept.mean().item() - 0.6) < 0.03
    torch.testing.assert_close(input.grad.cpu(), kept / 0.6)
    assert torch.equal(nn.Dropout(0.4).eval()(input).detach().cpu(), input.detach().cpu())


def test_normal_initializer_through_bridge(bridged):
    torch.manual_seed(0)
    weight = torch.empty(100, 100, device="cuda")
    nn.init.normal_(weight, 0.0, 0.5)
    assert abs(weight.cpu().std().item() - 0.5) < 0.02 and abs(weight.cpu().mean().item()) < 0.02
