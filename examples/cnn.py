"""A small CNN classifier on synthetic images, written as an ordinary CUDA-style PyTorch script.

Runs as it is with plain PyTorch and unchanged under `python -m bridge run`.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, stride=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


def make_data(count, generator):
    """Images whose class is which quadrant holds a bright square."""
    labels = torch.randint(0, 4, (count,), generator=generator)
    images = 0.3 * torch.randn(count, 3, 16, 16, generator=generator)
    for i, label in enumerate(labels.tolist()):
        row, col = divmod(label, 2)
        images[i, :, row * 8 + 2 : row * 8 + 6, col * 8 + 2 : col * 8 + 6] += 1.0
    return images, labels


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(args.seed)
    images, labels = make_data(args.batch * args.steps, generator)

    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    model.train()
    for step in range(args.steps):
        x = images[step * args.batch : (step + 1) * args.batch].to(device)
        y = labels[step * args.batch : (step + 1) * args.batch].to(device)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        print(f"step {step:3d} loss {loss.item():.6f}")

    model.eval()
    with torch.no_grad():
        x, y = images[: 4 * args.batch].to(device), labels[: 4 * args.batch].to(device)
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    print(f"train accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
