"""Fine-tuning: a "pretrained" backbone loaded from a state dict, early layers frozen, parameter groups with their own learning rates."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def backbone():
    return nn.Sequential(
        nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(),
        nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU(),
        nn.Linear(32, 32), nn.ReLU(),
    )


class Classifier(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.backbone = backbone()
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        return self.head(self.backbone(x))


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    pretrained = backbone().state_dict()  # stands in for downloaded weights

    model = Classifier(classes=3)
    model.backbone.load_state_dict(pretrained)
    model.to(device)
    for parameter in model.backbone[:3].parameters():
        parameter.requires_grad = False
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"trainable parameters {trainable} of {sum(p.numel() for p in model.parameters())}")
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in model.backbone.parameters() if p.requires_grad], "lr": 1e-3},
            {"params": model.head.parameters(), "lr": 1e-2, "weight_decay": 0.0},
        ],
        weight_decay=0.05,
    )
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=4)
    weights = torch.randn(16, 3, generator=generator)
    for step in range(8):
        x = torch.randn(32, 16, generator=generator)
        y = (x @ weights).argmax(1)
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        print(f"step {step} loss {loss.item():.6f} lrs {[round(g['lr'], 8) for g in optimizer.param_groups]}")
    frozen_unchanged = all(
        torch.equal(model.backbone.state_dict()[name].cpu(), pretrained[name]) for name in ("0.weight", "0.bias")
    )
    moved = (model.backbone[3].weight.detach().cpu() - pretrained["3.weight"]).abs().sum().item()
    print(f"frozen layer unchanged {int(frozen_unchanged)} unfrozen moved {moved:.6f}")
    print(f"frozen grad is None {int(model.backbone[0].weight.grad is None)}")


if __name__ == "__main__":
    main()
