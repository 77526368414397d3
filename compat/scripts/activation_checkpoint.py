"""Activation checkpointing with torch.utils.checkpoint: gradients match the uncheckpointed model."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, width=32, depth=3, use_checkpoint=True):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.use_checkpoint else block(x)
        return self.head(x)


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    model = Model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    target_weights = torch.randn(32, generator=generator)
    for step in range(4):
        x = torch.randn(16, 32, generator=generator)
        y = torch.sin(x @ target_weights / 4).unsqueeze(1)
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")

    # The same gradients without checkpointing, and with the reentrant variant over a Sequential.
    x = torch.randn(16, 32, generator=generator).to(device)
    model.zero_grad()
    model(x).pow(2).sum().backward()
    with_checkpoint = [p.grad.clone() for p in model.parameters()]
    model.use_checkpoint = False
    model.zero_grad()
    model(x).pow(2).sum().backward()
    difference = max((a - p.grad).abs().max().item() for a, p in zip(with_checkpoint, model.parameters()))
    print(f"grad norm {sum(g.norm() ** 2 for g in with_checkpoint).sqrt().item():.6f} checkpoint differs by 0: {int(difference == 0)}")
    sequential = nn.Sequential(*model.blocks, model.head)
    input_leaf = x.clone().requires_grad_(True)
    out = checkpoint_sequential(sequential, 2, input_leaf, use_reentrant=True)
    out.pow(2).sum().backward()
    print(f"reentrant input grad {input_leaf.grad.abs().sum().item():.6f}")


if __name__ == "__main__":
    main()
