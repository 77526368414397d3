"""nn.Transformer seq2seq: learn to reverse digit sequences, then greedy-decode."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BOS, EOS, LENGTH = 12, 10, 11, 5


class Seq2Seq(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.width = width
        self.embed = nn.Embedding(VOCAB, width)
        position = torch.arange(16).unsqueeze(1)
        frequency = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
        table = torch.zeros(16, width)
        table[:, 0::2] = torch.sin(position * frequency)
        table[:, 1::2] = torch.cos(position * frequency)
        self.register_buffer("positions", table)
        self.transformer = nn.Transformer(
            d_model=width, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
            dim_feedforward=64, dropout=0.0, batch_first=True,
        )
        self.out = nn.Linear(width, VOCAB)

    def encode(self, tokens):
        return self.embed(tokens) * math.sqrt(self.width) + self.positions[: tokens.shape[1]]

    def forward(self, source, target):
        mask = self.transformer.generate_square_subsequent_mask(target.shape[1], device=target.device)
        hidden = self.transformer(self.encode(source), self.encode(target), tgt_mask=mask, tgt_is_causal=True)
        return self.out(hidden)


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    model = Seq2Seq().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for step in range(5):
        source = torch.randint(0, 10, (12, LENGTH), generator=generator)
        target = torch.cat([torch.full((12, 1), BOS), source.flip(1), torch.full((12, 1), EOS)], dim=1)
        source, target = source.to(device), target.to(device)
        logits = model(source, target[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")
    model.eval()
    with torch.no_grad():
        source = torch.randint(0, 10, (2, LENGTH), generator=generator).to(device)
        decoded = torch.full((2, 1), BOS, device=device)
        for _ in range(LENGTH + 1):
            logits = model(source, decoded)
            decoded = torch.cat([decoded, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        print(f"last logits {logits[:, -1].sum().item():.6f} max {logits.max().item():.6f}")


if __name__ == "__main__":
    main()
