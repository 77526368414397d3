"""Custom torch.autograd.Functions inside captured regions: the region stays one program, and
its gradient is the Function's own backward (not JAX's derivative of its forward), as in eager
torch. Each case trains a small model a few steps eagerly and under the bridge (captured mode)
and compares outputs, gradients and parameters."""

import copy

import pytest
import torch

from bridge.runtime import capture


class RoundStraightThrough(torch.autograd.Function):
    """round() forward, identity backward: JAX's derivative of round is 0 everywhere."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class ClampedGradScale(torch.autograd.Function):
    """y = x * scale, with what the backward needs saved three ways: save_for_backward, a tensor
    attribute of ctx, and plain attributes; the gradient of x clamped; scale's gradient only
    where asked for."""

    @staticmethod
    def forward(ctx, x, scale, limit):
        ctx.save_for_backward(x, scale)
        ctx.limit = limit
        ctx.doubled = scale * 2  # a tensor kept as an attribute
        ctx.shape = x.shape
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        assert ctx.shape == x.shape
        grad_x = (grad * ctx.doubled / 2).clamp(-ctx.limit, ctx.limit)
        grad_scale = (grad * x).sum().reshape(scale.shape) if ctx.needs_input_grad[1] else None
        return grad_x, grad_scale, None


class SquareWithSetupContext(torch.autograd.Function):
    """The newer form: forward without ctx, setup_context, a backward that is not the exact
    derivative (3x instead of 2x), so that a wrong rule shows."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * grad * x


class ValuesAndIndices(torch.autograd.Function):
    """Two outputs, one of them integer and non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        values, indices = x.max(dim=-1)
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        ctx.width = x.shape[-1]
        return values, indices

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_values, grad_indices):
        (indices,) = ctx.saved_tensors
        return torch.nn.functional.one_hot(indices, ctx.width).to(grad_values.dtype) * grad_values.unsqueeze(-1)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        h = RoundStraightThrough.apply(self.fc1(x))
        h = ClampedGradScale.apply(h, self.scale, 0.05)
        h = SquareWithSetupContext.apply(torch.tanh(self.fc2(h)))
        values, indices = ValuesAndIndices.apply(h)
        return values.sum() + indices.float().mean() * 0


def test_custom_functions_run_inside_one_program_with_their_backward(captured):
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference).to("cuda")
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 6, generator=data)
        for net, optimizer, device in ((reference, opt_ref, "cpu"), (model, opt, "cuda")):
            optimizer.zero_grad()
            loss = net(x.to(device))
            loss.backward()
            net.last = (float(loss.detach()), [p.grad.detach().cpu().clone() for p in net.parameters()])
            optimizer.step()
        assert model.last[0] == pytest.approx(reference.last[0], rel=1e-5, abs=1e-6)
        for grad, grad_ref in zip(model.last[1], reference.last[1]):
            torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-6)
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=1e-5, atol=1e-6)
    assert not capture.breaks, capture.breaks
    assert [record.region for record in capture.compiles] == ["Net (train)"], capture.compiles


def test_a_function_writing_its_input_breaks_with_its_name(captured):
    class AddOneInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x.add_(1)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x):
            return AddOneInPlace.apply(self.fc(x) * 1).sum()

    torch.manual_seed(0)
    reference = Model()
    model = copy.deepcopy(reference).to("cuda")
    x = torch.randn(2, 3)
    loss_ref, loss = reference(x), model(x.to("cuda"))
    loss_ref.backward()
    loss.backward()
    assert float(loss) == pytest.approx(float(loss_ref), rel=1e-6)
    torch.testing.assert_close(model.fc.weight.grad.cpu(), reference.fc.weight.grad)
    (record,) = [record for record in capture.breaks if record.region.startswith("Model")]
    assert "AddOneInPlace" in record.reason and "mark_dirty" in record.reason, record


def test_a_backward_that_cannot_be_traced_breaks_at_the_first_call(captured):
    """A backward needing a value on the host (`.item()`) breaks the region when it is first
    called (its forward), so the step runs eagerly with torch's gradients, instead of failing
    when the region's backward program is compiled."""

    class LoggedGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            if grad.abs().sum().item() > 1e9:
                return grad * 0
            return grad * 2

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x):
            return LoggedGrad.apply(self.fc(x))  # not a loss: a forward program, a backward program

    torch.manual_seed(0)
    reference = Model()
    model = copy.deepcopy(reference).to("cuda")
    x = torch.randn(2, 3)
    reference(x).square().sum().backward()
    model(x.to("cuda")).square().sum().backward()
    torch.testing.assert_close(model.fc.weight.grad.cpu(), reference.fc.weight.grad, rtol=1e-5, atol=1e-6)
    (record,) = [record for record in capture.breaks if record.region.startswith("Model")]
    assert "test_custom_functions.py" in record.site and ".item()" in record.site, record
