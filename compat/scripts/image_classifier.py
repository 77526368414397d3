"""A small CNN image classifier: DataLoader with 2 workers, BatchNorm, SGD with momentum, a LR scheduler."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def make_data(count, generator):
    """Images whose class is the quadrant holding a bright square."""
    labels = torch.randint(0, 4, (count,), generator=generator)
    images = 0.3 * torch.randn(count, 3, 12, 12, generator=generator)
    for i, label in enumerate(labels.tolist()):
        row, col = divmod(label, 2)
        images[i, :, row * 6 + 1 : row * 6 + 5, col * 6 + 1 : col * 6 + 5] += 1.0
    return images, labels


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    images, labels = make_data(256, torch.Generator().manual_seed(0))
    loader = DataLoader(
        TensorDataset(images, labels), batch_size=32, shuffle=True, num_workers=2,
        generator=torch.Generator().manual_seed(1), pin_memory=torch.cuda.is_available(),
    )
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    for epoch in range(2):
        model.train()
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            print(f"epoch {epoch} step {step} loss {loss.item():.6f}")
        scheduler.step()
        print(f"epoch {epoch} lr {scheduler.get_last_lr()[0]:.6f}")
    model.eval()
    with torch.no_grad():
        logits = model(images.to(device))
        accuracy = (logits.argmax(1) == labels.to(device)).float().mean().item()
        bn = model.features[1]
    print(f"accuracy {accuracy:.6f}")
    print(f"bn running_mean {bn.running_mean.sum().item():.6f} running_var {bn.running_var.sum().item():.6f}")
    print(f"logits sum {logits.sum().item():.6f} abs {logits.abs().sum().item():.6f}")


if __name__ == "__main__":
    main()
