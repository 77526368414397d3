"""WGAN-GP critic training: a gradient penalty through double backward (torch.autograd.grad with create_graph=True)."""

import torch
import torch.nn as nn


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    critic = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Softplus(), nn.Linear(32, 1)).to(device)
    optimizer = torch.optim.Adam(critic.parameters(), lr=1e-3, betas=(0.0, 0.9))
    for step in range(8):
        real = (torch.randn(32, 2, generator=generator) * 0.5 + 1.0).to(device)
        fake = torch.randn(32, 2, generator=generator).to(device)
        alpha = torch.rand(32, 1, generator=generator).to(device)
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        scores = critic(mixed)
        (gradients,) = torch.autograd.grad(scores, mixed, grad_outputs=torch.ones_like(scores), create_graph=True)
        penalty = ((gradients.norm(2, dim=1) - 1) ** 2).mean()
        wasserstein = critic(fake).mean() - critic(real).mean()
        loss = wasserstein + 10.0 * penalty
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f} wasserstein {wasserstein.item():.6f} penalty {penalty.item():.6f}")
    # A Hessian-vector product: the second derivative itself.
    x = torch.tensor([[0.3, -0.2]], device=device, requires_grad=True)
    (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
    (hv,) = torch.autograd.grad(g, x, grad_outputs=torch.ones_like(g))
    print(f"grad {[round(v, 6) for v in g.flatten().tolist()]} hvp {[round(v, 6) for v in hv.flatten().tolist()]}")


if __name__ == "__main__":
    main()
