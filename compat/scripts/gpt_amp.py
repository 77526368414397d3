"""A GPT-style language model: bf16 autocast, gradient accumulation, gradient clipping, a cosine schedule, checkpoint save and resume."""

import math
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BLOCK, WIDTH, HEADS, LAYERS = 32, 16, 32, 4, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(approximate="tanh"), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        batch, steps, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, steps, HEADS, width // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, steps, width))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.zeros(1, BLOCK, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight  # weight tying
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        x = self.tokens(idx) + self.positions[:, : idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))
        return logits, loss


def get_batch(data, batch, generator):
    starts = torch.randint(0, len(data) - BLOCK - 1, (batch,), generator=generator)
    x = torch.stack([data[s : s + BLOCK] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + BLOCK] for s in starts.tolist()])
    return x, y


def cosine_lr(step, total, warmup=1, peak=3e-3, floor=3e-4):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def train(model, optimizer, data, device, autocast_device, first, last, total, accumulation, generator):
    model.train()
    for step in range(first, last):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, total)
        optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        for _ in range(accumulation):
            x, y = get_batch(data, 8, generator)
            x, y = x.to(device), y.to(device)
            with torch.autocast(autocast_device, dtype=torch.bfloat16):
                _, loss = model(x, y)
            (loss / accumulation).backward()
            total_loss += loss.item() / accumulation
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        print(f"step {step} loss {total_loss:.6f} grad_norm {norm.item():.6f} lr {optimizer.param_groups[0]['lr']:.6f}")


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    autocast_device = "cuda" if device == "cuda" else "cpu"
    generator = torch.Generator().manual_seed(0)
    # A sequence with structure: each token is a function of the previous two.
    data = torch.zeros(2000, dtype=torch.long)
    data[:2] = torch.tensor([1, 2])
    noise = torch.randint(0, 4, (2000,), generator=generator)
    for i in range(2, 2000):
        data[i] = (data[i - 1] * 3 + data[i - 2] + noise[i] // 3) % VOCAB

    model = GPT().to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95)
    )
    total = 4
    train(model, optimizer, data, device, autocast_device, 0, 2, total, 2, generator)

    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "checkpoint.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 2,
                    "generator": generator.get_state()}, path)
        checkpoint = torch.load(path, map_location=device)
    resumed = GPT().to(device)
    resumed.load_state_dict(checkpoint["model"])
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in resumed.parameters() if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in resumed.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95)
    )
    optimizer.load_state_dict(checkpoint["optimizer"])
    generator.set_state(checkpoint["generator"].cpu())
    print(f"resumed at step {checkpoint['step']} exp_avg_sq sum "
          f"{sum(s['exp_avg_sq'].sum().item() for s in optimizer.state.values()):.6e}")
    train(resumed, optimizer, data, device, autocast_device, checkpoint["step"], total, total, 2, generator)

    resumed.eval()
    with torch.no_grad(), torch.autocast(autocast_device, dtype=torch.bfloat16):
        x, y = get_batch(data, 16, torch.Generator().manual_seed(123))
        logits, loss = resumed(x.to(device), y.to(device))
    print(f"eval loss {loss.item():.6f} logits dtype {str(logits.dtype).split('.')[-1]}")


if __name__ == "__main__":
    main()
