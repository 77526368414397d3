"""A small character-level GPT, written as an ordinary CUDA-style PyTorch training script.

Runs as it is with plain PyTorch (`python examples/gpt_char.py`) and unchanged
under the bridge (`python -m bridge run examples/gpt_char.py`).
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

TEXT = """
It was the best of times, it was the worst of times, it was the age of wisdom,
it was the age of foolishness, it was the epoch of belief, it was the epoch of
incredulity, it was the season of Light, it was the season of Darkness, it was
the spring of hope, it was the winter of despair, we had everything before us,
we had nothing before us, we were all going direct to Heaven, we were all going
direct the other way. In short, the period was so far like the present period,
that some of its noisiest authorities insisted on its being received, for good
or for evil, in the superlative degree of comparison only.
""" * 4


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads, block):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        batch, time_steps, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q = q.view(batch, time_steps, self.heads, width // self.heads).transpose(1, 2)
        k = k.view(batch, time_steps, self.heads, width // self.heads).transpose(1, 2)
        v = v.view(batch, time_steps, self.heads, width // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, time_steps, width)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, width, heads, block, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, block)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block, width, heads, layers, dropout):
        super().__init__()
        self.block = block
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(block, width)
        self.blocks = nn.ModuleList([Block(width, heads, block, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets=None):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.token(idx) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT], dtype=torch.long)

    model = GPT(len(chars), args.block, args.width, args.heads, args.layers, args.dropout).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = lambda step: 0.5 * (1 + math.cos(math.pi * step / args.steps))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    start = time.time()
    for step in range(args.steps):
        starts = torch.randint(len(data) - args.block - 1, (args.batch,))
        x = torch.stack([data[s : s + args.block] for s in starts]).to(device)
        y = torch.stack([data[s + 1 : s + args.block + 1] for s in starts]).to(device)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        print(f"step {step:3d} loss {loss.item():.6f}")
    print(f"device {device}, {args.steps} steps in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
