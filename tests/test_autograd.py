"""Autograd corner cases under the bridge, each run on bridge tensors and on eager torch's CPU
tensors (the oracle) with the same numbers: torch.autograd.grad, retain_graph, the functional
jacobian/hessian, module and tensor hooks, activation checkpointing, inference_mode."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bridge.runtime import BridgeTensor

DEVICES = ("cpu", "cuda")


def _both(function):
    """function(device) on the host and on the bridge; the bridge's results brought to the host."""
    expected = function("cpu")
    actual = function("cuda")
    return expected, actual


def _close(actual, expected, **tolerance):
    if expected is None:
        assert actual is None
        return
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _close(a, e, **tolerance)
        return
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual.cpu() if isinstance(actual, torch.Tensor) else actual, expected, **tolerance)
        return
    assert actual == pytest.approx(expected, rel=1e-5)


def _leaf(values, device):
    return torch.tensor(values, device=device, requires_grad=True)


def test_autograd_grad_allow_unused_and_materialize_grads(bridged):
    def run(device):
        x, y, unused = _leaf([1.0, 2.0, 3.0], device), _leaf([0.5, -1.0], device), _leaf([4.0], device)
        out = (x**2).sum() * y.sum()
        grads = torch.autograd.grad(out, [x, unused, y], allow_unused=True, retain_graph=True)
        materialized = torch.autograd.grad(out, [unused], allow_unused=True, materialize_grads=True)
        with pytest.raises(RuntimeError, match="appears to not have been used in the graph") as refused:
            torch.autograd.grad((x * 3).sum(), [x, unused])
        return grads, materialized, str(refused.value)

    (grads, materialized, message), (bridge_grads, bridge_materialized, bridge_message) = _both(run)
    assert grads[1] is None and bridge_grads[1] is None
    _close(bridge_grads, grads)
    _close(bridge_materialized, materialized)
    assert bridge_message == message


def test_retain_graph_second_backward_accumulates_and_without_it_torch_refuses(bridged):
    def run(device):
        w = _leaf([[1.0, -2.0], [0.5, 3.0]], device)
        x = torch.tensor([[2.0, 1.0]], device=device)
        loss = (x @ w).tanh().sum()
        loss.backward(retain_graph=True)
        first = w.grad.clone()
        loss.backward()
        second = w.grad.clone()
        with pytest.raises(RuntimeError, match="backward through the graph a second time") as refused:
            loss.backward()
        return first, second, str(refused.value)

    (first, second, message), (bridge_first, bridge_second, bridge_message) = _both(run)
    _close(bridge_first, first)
    _close(bridge_second, second)
    torch.testing.assert_close(second, 2 * first)
    assert bridge_message == message


def test_create_graph_double_backward(bridged):
    def run(device):
        x = _leaf([0.3, -1.2, 2.0], device)
        (gradient,) = torch.autograd.grad((x.sin() * x).sum(), x, create_graph=True)
        (second,) = torch.autograd.grad(gradient.pow(2).sum(), x)
        return gradient.detach(), second

    expected, actual = _both(run)
    _close(actual, expected)


def _function(x):
    return torch.stack([x[0] * x[1].sin(), x[2].exp() * x[0] ** 2, (x * x).sum()])


def _scalar(x):
    return (x.sin() * x.roll(1)).sum() + x.prod()


@pytest.mark.parametrize("vectorize", [False, True])
def test_functional_jacobian_and_hessian(bridged, vectorize):
    def run(device):
        x = torch.tensor([0.5, -1.0, 0.25], device=device)
        jacobian = torch.autograd.functional.jacobian(_function, x, vectorize=vectorize)
        hessian = torch.autograd.functional.hessian(_scalar, x, vectorize=vectorize)
        return jacobian, hessian

    (jacobian, hessian), (bridge_jacobian, bridge_hessian) = _both(run)
    assert isinstance(bridge_jacobian, BridgeTensor) and bridge_jacobian.shape == (3, 3)
    _close(bridge_jacobian, jacobian)
    _close(bridge_hessian, hessian)
    torch.testing.assert_close(hessian, hessian.T)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def test_module_full_backward_hook_and_pre_hook(bridged):
    model = _model()
    x = torch.randn(6, 4)

    def run(device):
        net = copy.deepcopy(model).to(device)
        seen = []

        def pre_hook(module, grad_output):
            seen.append(("pre", [g.detach().clone() for g in grad_output]))
            return (grad_output[0] * 2,)  # doubles every gradient below this layer

        def hook(module, grad_input, grad_output):
            seen.append(("full", [g.detach().clone() for g in grad_input], [g.detach().clone() for g in grad_output]))

        handles = [net[2].register_full_backward_pre_hook(pre_hook), net[2].register_full_backward_hook(hook),
                   net[0].register_full_backward_hook(hook)]
        inputs = x.clone().to(device).requires_grad_()
        net(inputs).pow(2).sum().backward()
        for handle in handles:
            handle.remove()
        return seen, inputs.grad, [p.grad for p in net.parameters()]

    (seen, input_grad, grads), (bridge_seen, bridge_input_grad, bridge_grads) = _both(run)
    assert [entry[0] for entry in bridge_seen] == [entry[0] for entry in seen] == ["pre", "full", "full"]
    for actual, expected in zip(bridge_seen, seen):
        _close(list(actual[1:]), list(expected[1:]), rtol=1e-5, atol=1e-6)
    _close(bridge_input_grad, input_grad, rtol=1e-5, atol=1e-6)
    _close(bridge_grads, grads, rtol=1e-5, atol=1e-6)


def test_post_accumulate_grad_hook_steps_in_backward(bridged):
    """The optimizer-in-backward pattern: each parameter updated by its own hook once its
    gradient is accumulated, `.grad` then freed."""
    model = _model()
    x, y = torch.randn(8, 4), torch.randn(8, 3)

    def run(device):
        net = copy.deepcopy(model).to(device)
        calls = []

        def step(parameter):
            calls.append(tuple(parameter.shape))
            with torch.no_grad():
                parameter.add_(parameter.grad, alpha=-0.1)
            parameter.grad = None

        for parameter in net.parameters():
            parameter.register_post_accumulate_grad_hook(step)
        for _ in range(2):
            F.mse_loss(net(x.to(device)), y.to(device)).backward()
        return calls, [p.detach() for p in net.parameters()], [p.grad for p in net.parameters()]

    (calls, parameters, grads), (bridge_calls, bridge_parameters, bridge_grads) = _both(run)
    assert sorted(bridge_calls) == sorted(calls) and len(calls) == 8
    assert all(g is None for g in bridge_grads + grads)
    _close(bridge_parameters, parameters, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_gradients_match_torch(bridged, use_reentrant):
    model = _model()
    x = torch.randn(5, 4)

    def run(device):
        net = copy.deepcopy(model).to(device)
        inputs = x.clone().to(device).requires_grad_()
        hidden = checkpoint(lambda t: net[1](net[0](t)), inputs, use_reentrant=use_reentrant)
        net[2](hidden).pow(2).mean().backward()
        return inputs.grad, [p.grad for p in net.parameters()]

    expected, actual = _both(run)
    _close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recomputes_the_same_dropout_mask(bridged, use_reentrant):
    """The recomputation in backward restores the bridge generator's state (torch.cuda.get_rng_state):
    the gradient must use the mask that the forward drew."""
    torch.manual_seed(0)
    x = torch.randn(4000, device="cuda", requires_grad=True)
    weight = torch.full((4000,), 3.0, device="cuda", requires_grad=True)
    out = checkpoint(lambda t, w: F.dropout(t * w, 0.5, training=True), x, weight, use_reentrant=use_reentrant)
    out.sum().backward()
    kept = (out.detach().cpu() != 0).float()
    assert 0.45 < kept.mean().item() < 0.55
    torch.testing.assert_close(x.grad.cpu(), kept * 3.0 / 0.5)


def test_inference_mode_tensors_are_refused_by_autograd_with_torch_s_errors(bridged):
    def run(device):
        with torch.inference_mode():
            frozen = torch.ones(3, device=device) * 2
        assert frozen.is_inference() and not frozen.requires_grad
        weight = _leaf([1.0, 2.0, 3.0], device)
        messages = []
        with pytest.raises(RuntimeError) as refused:
            (frozen * weight).sum().backward()
        messages.append(str(refused.value))
        with pytest.raises(RuntimeError) as refused:
            frozen.add_(1)
        messages.append(str(refused.value))
        with pytest.raises(RuntimeError) as refused:
            frozen.requires_grad_()
        messages.append(str(refused.value))
        # A clone is a normal tensor and takes part in autograd.
        (frozen.clone() * weight).sum().backward()
        return messages, weight.grad

    (messages, grad), (bridge_messages, bridge_grad) = _both(run)
    assert "Inference tensors cannot be saved for backward" in messages[0]
    assert bridge_messages == messages
    _close(bridge_grad, grad)


def test_no_grad_enable_grad_and_set_grad_enabled(bridged):
    def run(device):
        x = _leaf([1.0, 2.0], device)
        with torch.no_grad():
            a = x * 2
            with torch.enable_grad():
                b = x * 3
        with torch.set_grad_enabled(False):
            c = x * 4
        torch.set_grad_enabled(True)
        d = x * 5
        return [t.requires_grad for t in (a, b, c, d)]

    expected, actual = _both(run)
    assert actual == expected == [False, True, False, True]
