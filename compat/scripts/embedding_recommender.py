"""A matrix-factorisation recommender with nn.EmbeddingBag features, Adagrad and ReduceLROnPlateau, evaluated with int64 ids."""

import torch
import torch.nn as nn
import torch.nn.functional as F

USERS, ITEMS, TAGS = 40, 30, 12


class Recommender(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.users = nn.Embedding(USERS, width)
        self.items = nn.Embedding(ITEMS, width)
        self.tags = nn.EmbeddingBag(TAGS, width, mode="mean")
        self.user_bias = nn.Embedding(USERS, 1)
        self.item_bias = nn.Embedding(ITEMS, 1)

    def forward(self, users, items, tags, offsets):
        item_vectors = self.items(items) + self.tags(tags, offsets)
        dot = (self.users(users) * item_vectors).sum(1)
        return dot + self.user_bias(users).squeeze(1) + self.item_bias(items).squeeze(1)


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    true_users = torch.randn(USERS, 3, generator=generator)
    true_items = torch.randn(ITEMS, 3, generator=generator)
    item_tags = [torch.randint(0, TAGS, (int(torch.randint(1, 4, (1,), generator=generator)),), generator=generator) for _ in range(ITEMS)]
    model = Recommender().to(device)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    for step in range(10):
        users = torch.randint(0, USERS, (64,), generator=generator)
        items = torch.randint(0, ITEMS, (64,), generator=generator)
        ratings = (true_users[users] * true_items[items]).sum(1)
        bags = [item_tags[i] for i in items.tolist()]
        offsets = torch.tensor([0] + [len(b) for b in bags[:-1]]).cumsum(0)
        tags = torch.cat(bags)
        prediction = model(users.to(device), items.to(device), tags.to(device), offsets.to(device))
        loss = F.mse_loss(prediction, ratings.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step(loss.item())
        print(f"step {step} loss {loss.item():.6f} lr {optimizer.param_groups[0]['lr']:.6f}")
    with torch.no_grad():
        scores = model.users.weight[:4] @ model.items.weight.T
        top = scores.topk(3, dim=1).indices
        large = torch.tensor([2**40 + 7], device=device) * 3 + USERS
        print(f"top items {top.tolist()} score sum {scores.sum().item():.6f}")
        print(f"int64 arithmetic {large.item()} dtype {str(large.dtype).split('.')[-1]}")


if __name__ == "__main__":
    main()
