"""An LSTM language model over variable-length sentences, with packed sequences."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence

VOCAB, PAD = 20, 0


class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16, padding_idx=PAD)
        self.rnn = nn.LSTM(16, 24, num_layers=1, batch_first=True)
        self.out = nn.Linear(24, VOCAB)

    def forward(self, tokens, lengths):
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        output, (hidden, cell) = self.rnn(packed)
        output, _ = pad_packed_sequence(output, batch_first=True, total_length=tokens.shape[1])
        return self.out(output), hidden


def make_sentences(count, generator):
    sentences = []
    # Lengths from a fixed set, in a random order: every batch packs to the same shapes.
    for index in torch.randperm(count, generator=generator).tolist():
        length = 3 + index % 4
        start = int(torch.randint(1, VOCAB, (1,), generator=generator))
        # Counting upward with wraparound: learnable next-token structure.
        sentences.append(torch.tensor([1 + (start + i - 1) % (VOCAB - 1) for i in range(length)]))
    return sentences


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    model = LanguageModel().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(4):
        sentences = make_sentences(8, generator)
        lengths = torch.tensor([len(s) for s in sentences])
        tokens = pad_sequence(sentences, batch_first=True, padding_value=PAD)
        inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        logits, hidden = model(inputs, lengths - 1)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f} hidden {hidden.abs().sum().item():.6f}")
    with torch.no_grad():
        prompt = torch.tensor([[3, 4, 5]], device=device)
        logits, _ = model(prompt, torch.tensor([3]))
        print(f"next after 3 4 5: {logits[0, -1].argmax().item()} logit {logits[0, -1].max().item():.6f}")


if __name__ == "__main__":
    main()
