"""REINFORCE on a small corridor environment with torch.distributions.Categorical.

Training actions are drawn from a seeded CPU generator so that runs are reproducible everywhere;
the final evaluation samples with Categorical.sample() on the model's device (its own RNG).
"""

import torch
import torch.nn as nn
from torch.distributions import Categorical

LENGTH = 6  # states 0..5, reward at the right end


def run_episode(policy, device, generator=None, max_steps=10):
    state, log_probs, entropies, rewards = 0, [], [], []
    for _ in range(max_steps):
        observation = torch.zeros(LENGTH)
        observation[state] = 1.0
        distribution = Categorical(logits=policy(observation.to(device)))
        if generator is not None:
            action = torch.multinomial(distribution.probs.detach().cpu(), 1, generator=generator).squeeze(0)
            action = action.to(device)
        else:
            action = distribution.sample()
        log_probs.append(distribution.log_prob(action))
        entropies.append(distribution.entropy())
        state = max(0, state - 1) if action.item() == 0 else state + 1
        done = state == LENGTH - 1
        rewards.append(1.0 if done else -0.05)
        if done:
            break
    return log_probs, entropies, rewards


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    policy = nn.Sequential(nn.Linear(LENGTH, 16), nn.Tanh(), nn.Linear(16, 2)).to(device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=2e-2)
    gamma = 0.95
    for episode in range(6):
        log_probs, entropies, rewards = run_episode(policy, device, generator)
        returns, running = [], 0.0
        for reward in reversed(rewards):
            running = reward + gamma * running
            returns.insert(0, running)
        returns = torch.tensor(returns, device=device)
        returns = (returns - returns.mean()) / (returns.std(unbiased=False) + 1e-8)
        loss = -(torch.stack(log_probs) * returns).sum() - 0.01 * torch.stack(entropies).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"episode {episode} length {len(rewards)} return {sum(rewards):.6f} loss {loss.item():.6f}")
    with torch.no_grad():
        probs = torch.softmax(policy(torch.eye(LENGTH, device=device)), dim=1)[:, 1]
        print(f"p(right) per state {[round(p, 6) for p in probs.tolist()]}")
        # Sampled on the device: compared by statistics only.
        actions = Categorical(probs=torch.stack([1 - probs, probs], dim=1)).sample((4000,))
        print(f"stat sampled right fraction {actions.float().mean().item():.6f} expected {probs.mean().item():.6f}")


if __name__ == "__main__":
    main()
