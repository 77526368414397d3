"""JAX interop (bridge/interop.py): `bridge.to_jax` against torch eager under jax.jit, jax.grad,
jax.vmap and a training loop, BatchNorm's buffers through `with_state`; `bridge.from_jax`'s
outputs and gradients against the same math in torch, eagerly and inside captured regions."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge

RTOL, ATOL = 1e-5, 1e-6


# torch.export can start Dynamo, which turns torch.distributions' argument validation off for the
# whole process (conftest.distribution_validation_kept restores it after each test).
pytestmark = pytest.mark.usefixtures("distribution_validation_kept")


class ConvNet(torch.nn.Module):
    """Convolution, BatchNorm, pooling, a linear layer, LayerNorm, an embedding added by index,
    and two outputs: the ops of a small vision-and-text model."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.linear = torch.nn.Linear(4 * 4 * 4, 10)
        self.layer_norm = torch.nn.LayerNorm(10)
        self.embedding = torch.nn.Embedding(7, 10)

    def forward(self, x, ids):
        h = torch.nn.functional.max_pool2d(self.norm(self.conv(x)).relu(), 2)
        h = self.layer_norm(self.linear(h.flatten(1)) + self.embedding(ids))
        return {"probabilities": h.softmax(-1), "score": torch.tanh(h).mean()}


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.hidden(x)))


def _array(tensor):
    return jnp.asarray(tensor.detach().numpy())


def _close(actual, expected, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual), expected.detach().numpy(), rtol=RTOL, atol=atol)


def _conv_net(training=False):
    torch.manual_seed(0)
    net = ConvNet().train(training)
    return net, torch.randn(2, 3, 8, 8), torch.tensor([1, 5])


def test_to_jax_gives_torch_s_outputs_under_jit_and_leaves_torch_as_it_was():
    net, x, ids = _conv_net()
    fn, params = bridge.to_jax(net, x, ids)
    assert not bridge.is_active()  # active for the conversion and each trace only
    assert set(params) == {name for name, _ in net.named_parameters()}
    out = jax.jit(fn)(params, _array(x), _array(ids))
    expected = net(x, ids)
    assert set(out) == {"probabilities", "score"}
    for name in out:
        _close(out[name], expected[name])
    # numpy arrays and host tensors are inputs too
    _close(fn(params, x.numpy(), ids)["score"], expected["score"])


def test_jax_grad_gives_torch_s_gradients():
    """Over the parameters and the input, in evaluation mode and in training mode (BatchNorm by
    the batch's statistics)."""
    for training in (False, True):
        net, x, ids = _conv_net(training)
        fn, params = bridge.to_jax(copy.deepcopy(net), x, ids)

        def loss(params, x):
            out = fn(params, x, _array(ids))
            return (out["probabilities"] ** 2).sum() + out["score"]

        gradients, x_gradient = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, _array(x))
        x_torch = x.clone().requires_grad_()
        out = net(x_torch, ids)
        ((out["probabilities"] ** 2).sum() + out["score"]).backward()
        # atol relative to the largest gradient, as tests/test_export.py's: the conv bias has no
        # effect through training-mode BatchNorm, its true gradient is 0 and both give noise.
        largest = max(parameter.grad.abs().max().item() for parameter in net.parameters())
        for name, parameter in net.named_parameters():
            _close(gradients[name], parameter.grad, atol=ATOL * largest)
        _close(x_gradient, x_torch.grad, atol=ATOL * largest)


def test_vmap_over_a_function_exported_for_one_example():
    """Exported with one unbatched example, the function maps over a batch under jax.vmap (the
    bridge tensors hold the batch tracers, which have the example's shape), and per-example
    gradients are torch's gradients of each example alone."""
    torch.manual_seed(0)
    net, batch = MLP(), torch.randn(5, 4)
    fn, params = bridge.to_jax(net, batch[0])
    _close(jax.vmap(fn, in_axes=(None, 0))(params, _array(batch)), net(batch))
    per_example = jax.vmap(jax.grad(lambda params, x: fn(params, x).sum()), in_axes=(None, 0))(params, _array(batch))
    for row in range(len(batch)):
        net.zero_grad()
        net(batch[row]).sum().backward()
        for name, parameter in net.named_parameters():
            _close(per_example[name][row], parameter.grad)


def _adam(params, gradients, moments, step, rate=1e-2, betas=(0.9, 0.999), eps=1e-8):
    """torch.optim.Adam's update on a pytree (what optax.adam does), written out: optax is not a
    dependency of the suite."""
    first, second = moments
    first = jax.tree_util.tree_map(lambda m, g: betas[0] * m + (1 - betas[0]) * g, first, gradients)
    second = jax.tree_util.tree_map(lambda v, g: betas[1] * v + (1 - betas[1]) * g * g, second, gradients)
    correction1, correction2 = 1 - betas[0] ** step, 1 - betas[1] ** step
    params = jax.tree_util.tree_map(
        lambda p, m, v: p - rate / correction1 * m / (jnp.sqrt(v) / jnp.sqrt(correction2) + eps), params, first, second
    )
    return params, (first, second)


def test_a_jax_training_loop_follows_torch_s():
    """Five Adam steps on the pytree of parameters, in one jitted step function, against
    torch.optim.Adam on the module: the losses and the final parameters agree."""
    torch.manual_seed(0)
    net, x, target = MLP(), torch.randn(16, 4), torch.randn(16, 3)
    fn, params = bridge.to_jax(copy.deepcopy(net), x)

    @jax.jit
    def step(params, moments, count, x, target):
        loss, gradients = jax.value_and_grad(lambda p: ((fn(p, x) - target) ** 2).mean())(params)
        params, moments = _adam(params, gradients, moments, count)
        return params, moments, loss

    moments = (jax.tree_util.tree_map(jnp.zeros_like, params), jax.tree_util.tree_map(jnp.zeros_like, params))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    for count in range(1, 6):
        params, moments, loss = step(params, moments, jnp.float32(count), _array(x), _array(target))
        optimizer.zero_grad()
        torch_loss = ((net(x) - target) ** 2).mean()
        torch_loss.backward()
        optimizer.step()
        _close(loss, torch_loss)
    for name, parameter in net.named_parameters():
        _close(params[name], parameter, atol=1e-5)


def test_with_state_returns_the_buffers_training_mode_writes():
    """Training-mode BatchNorm: with_state=True returns the running statistics torch writes, call
    after call; the default function keeps its buffers as they were and gives the same outputs."""
    net, x, ids = _conv_net(training=True)
    fn, params, buffers = bridge.to_jax(copy.deepcopy(net), x, ids, with_state=True)
    assert set(buffers) == {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}
    compiled = jax.jit(fn)
    for _ in range(2):
        out, buffers = compiled(params, buffers, _array(x), _array(ids))
        expected = net(x, ids)
        _close(out["probabilities"], expected["probabilities"])
    for name in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
        _close(buffers[name], net.state_dict()[name])
    plain, plain_params = bridge.to_jax(copy.deepcopy(net), x, ids)
    _close(plain(plain_params, _array(x), _array(ids))["probabilities"], expected["probabilities"])


def test_random_ops_draw_from_the_key():
    """Dropout in training mode: the same key gives the same mask, another key another one."""

    class Dropout(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.dropout(x, 0.5, training=True)

    fn, params = bridge.to_jax(Dropout(), torch.ones(64))
    ones = jnp.ones(64)
    first, again = fn(params, ones, key=jax.random.key(1)), fn(params, ones, key=jax.random.key(1))
    other = fn(params, ones, key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    assert set(np.unique(np.asarray(first)).tolist()) == {0.0, 2.0}
    assert not np.array_equal(np.asarray(first), np.asarray(other))


# ---------------------------------------------------------------- from_jax


def _jax_block(x, weights):
    """A JAX function with nested arguments and outputs, and an integer output."""
    hidden = jax.nn.gelu(x @ weights["in"], approximate=False)
    out = jnp.tanh(hidden) @ weights["out"]
    return {"out": out, "best": jnp.argmax(out, axis=-1)}


def _torch_block(x, weights):
    out = torch.tanh(torch.nn.functional.gelu(x @ weights["in"])) @ weights["out"]
    return {"out": out, "best": out.argmax(-1)}


def _block_inputs():
    torch.manual_seed(0)
    return torch.randn(3, 4), {"in": torch.randn(4, 6), "out": torch.randn(6, 2)}


@pytest.mark.parametrize("where", ["bridge", "host"])
def test_from_jax_gives_torch_s_outputs_and_gradients(where):
    """On bridge tensors (bridge tensors back) and on CPU tensors (CPU tensors back); the integer
    output is not differentiable."""
    x, weights = _block_inputs()
    leaves = [x, weights["in"], weights["out"]]
    expected_leaves = [leaf.clone().requires_grad_() for leaf in leaves]
    expected = _torch_block(expected_leaves[0], {"in": expected_leaves[1], "out": expected_leaves[2]})
    (expected["out"] ** 2).sum().backward()
    block = bridge.from_jax(_jax_block)
    with bridge.active(mode="eager"):
        given = [(leaf.to("cuda") if where == "bridge" else leaf.clone()).requires_grad_() for leaf in leaves]
        out = block(given[0], {"in": given[1], "out": given[2]})
        assert isinstance(out["out"], bridge.runtime.tensor.BridgeTensor) == (where == "bridge")
        assert out["out"].requires_grad and not out["best"].requires_grad
        (out["out"] ** 2).sum().backward()
        torch.testing.assert_close(out["out"].cpu(), expected["out"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(out["best"].cpu(), expected["best"])
        # atol relative to the largest gradient (JAX's and torch's gelu derivatives round apart)
        largest = max(leaf.grad.abs().max().item() for leaf in expected_leaves)
        for mine, theirs in zip(given, expected_leaves):
            assert mine.grad.device == mine.device
            torch.testing.assert_close(mine.grad.cpu(), theirs.grad, rtol=RTOL, atol=ATOL * largest)


class _Network(torch.nn.Module):
    def __init__(self, activation):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 1)
        self.activation = activation

    def forward(self, x):
        return self.out(self.activation(self.hidden(x)))


def _train(network, x, target, steps=4):
    optimizer = torch.optim.SGD(network.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((network(x) - target) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["captured", "eager"])
def test_from_jax_layer_trains_in_a_torch_script(mode):
    """A JAX activation inside a module trained by torch.optim: the losses are those of the same
    activation written in torch, op by op and in captured regions (where the Function's forward
    and backward are traced into the step's program)."""
    torch.manual_seed(0)
    x, target = torch.randn(16, 4), torch.randn(16, 1)
    torch.manual_seed(1)
    reference = _Network(lambda h: torch.nn.functional.gelu(h, approximate="tanh"))
    torch.manual_seed(1)
    network = _Network(bridge.from_jax(lambda h: jax.nn.gelu(h, approximate=True)))
    expected = _train(reference, x, target)
    with bridge.active(mode=mode):
        losses = _train(network.to("cuda"), x.to("cuda"), target.to("cuda"))
    np.testing.assert_allclose(losses, expected, rtol=RTOL)
