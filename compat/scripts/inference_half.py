"""Batched inference in torch.inference_mode with a float16 model (conv net + attention), top-k predictions."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.AvgPool2d(2))
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        tokens = self.conv(x).flatten(2).transpose(1, 2)
        attended, _ = self.attention(tokens, tokens, tokens, need_weights=False)
        return self.head((tokens + attended).mean(1))


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    model = Model().eval()
    images = torch.randn(16, 3, 8, 8, generator=generator)
    with torch.inference_mode():
        reference = model(images)  # float32 on the CPU: the accuracy baseline
    model = model.to(device).half()
    with torch.inference_mode():
        logits = model(images.to(device).half())
        probabilities = F.softmax(logits.float(), dim=1)
        values, indices = probabilities.topk(3, dim=1)
        print(f"dtype {str(logits.dtype).split('.')[-1]} inference {int(logits.is_inference())} grad {int(logits.requires_grad)}")
        print(f"top1 {indices[:, 0].tolist()}")
        print(f"top3 prob sum {values.sum().item():.4f}")
        print(f"logits sum {logits.float().sum().item():.4f} abs {logits.float().abs().sum().item():.4f}")
        error = (logits.float().cpu() - reference).abs().max().item()
        print(f"half vs float32 max error below 0.02: {int(error < 0.02)}")


if __name__ == "__main__":
    main()
