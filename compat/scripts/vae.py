"""A variational autoencoder on synthetic binary patterns (reparameterisation noise from a CPU generator)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class VAE(nn.Module):
    def __init__(self, features=64, hidden=32, latent=4):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, hidden), nn.ReLU())
        self.mu = nn.Linear(hidden, latent)
        self.logvar = nn.Linear(hidden, latent)
        self.decoder = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, features))

    def forward(self, x, noise):
        h = self.encoder(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + noise * torch.exp(0.5 * logvar)
        return self.decoder(z), mu, logvar


def loss_function(logits, x, mu, logvar):
    reconstruction = F.binary_cross_entropy_with_logits(logits, x, reduction="sum")
    kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return (reconstruction + kl) / x.shape[0], reconstruction / x.shape[0], kl / x.shape[0]


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    prototypes = (torch.rand(4, 64, generator=generator) > 0.5).float()
    model = VAE().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(10):
        which = torch.randint(0, 4, (32,), generator=generator)
        flips = (torch.rand(32, 64, generator=generator) < 0.05).float()
        x = (prototypes[which] - flips).abs().to(device)
        noise = torch.randn(32, 4, generator=generator).to(device)
        logits, mu, logvar = model(x, noise)
        loss, reconstruction, kl = loss_function(logits, x, mu, logvar)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f} recon {reconstruction.item():.6f} kl {kl.item():.6f}")
    model.eval()
    with torch.no_grad():
        z = torch.randn(8, 4, generator=generator).to(device)
        samples = torch.sigmoid(model.decoder(z))
        print(f"sample mean {samples.mean().item():.6f} std {samples.std().item():.6f}")


if __name__ == "__main__":
    main()
