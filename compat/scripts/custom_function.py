"""A custom autograd.Function (straight-through quantiser), tensor hooks, and in-place/view updates inside a training loop."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class StraightThroughRound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        # Pass gradients straight through inside the clipping range.
        return grad_output * (x.abs() <= 1.0).to(grad_output.dtype), None


class QuantisedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = StraightThroughRound.apply(h, 8.0)
        return self.fc2(h)


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    model = QuantisedMLP().to(device)
    grad_norms = []
    model.fc1.weight.register_hook(lambda grad: grad_norms.append(grad.norm().item()))
    model.fc2.weight.register_hook(lambda grad: grad.clamp(-0.5, 0.5))  # a hook that edits the gradient
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-2, alpha=0.9)
    true_weights = torch.randn(8, generator=generator)
    for step in range(8):
        x = torch.randn(32, 8, generator=generator)
        y = (x @ true_weights).unsqueeze(1)
        loss = F.smooth_l1_loss(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            # In-place edits through views: zero a column, renormalise the rows.
            model.fc1.weight[:, 0].mul_(0.9)
            model.fc1.weight.div_(model.fc1.weight.norm(dim=1, keepdim=True).clamp(min=1.0))
            model.fc2.bias.data.fill_(0.0)
        print(f"step {step} loss {loss.item():.6f} fc1 grad norm {grad_norms[-1]:.6f}")
    flat = model.fc1.weight.detach().view(-1)
    flat[:4] = 0.0  # writes through the view into the parameter
    print(f"fc1 weight sum {model.fc1.weight.sum().item():.6f} first row {model.fc1.weight[0, :4].tolist()}")
    x = torch.linspace(-1.5, 1.5, 7, device=device, requires_grad=True)
    StraightThroughRound.apply(x, 2.0).sum().backward()
    print(f"quantised {StraightThroughRound.apply(x.detach(), 2.0).tolist()} grad {x.grad.tolist()}")


if __name__ == "__main__":
    main()
