"""A GAN on a 2-D mixture of Gaussians: generator and discriminator with two optimizers."""

import torch
import torch.nn as nn


def real_batch(count, generator):
    centres = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    which = torch.randint(0, 4, (count,), generator=generator)
    return centres[which] + 0.1 * torch.randn(count, 2, generator=generator)


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    netG = nn.Sequential(nn.Linear(4, 32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LeakyReLU(0.2), nn.Linear(32, 2)).to(device)
    netD = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1)).to(device)
    optG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    optD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    criterion = nn.BCEWithLogitsLoss()
    ones = torch.ones(64, 1, device=device)
    zeros = torch.zeros(64, 1, device=device)
    for step in range(10):
        real = real_batch(64, generator).to(device)
        z = torch.randn(64, 4, generator=generator).to(device)
        fake = netG(z)
        # Discriminator: real against detached fakes.
        optD.zero_grad()
        lossD = criterion(netD(real), ones) + criterion(netD(fake.detach()), zeros)
        lossD.backward()
        optD.step()
        # Generator: fool the updated discriminator.
        optG.zero_grad()
        lossG = criterion(netD(fake), ones)
        lossG.backward()
        optG.step()
        print(f"step {step} lossD {lossD.item():.6f} lossG {lossG.item():.6f}")
    with torch.no_grad():
        samples = netG(torch.randn(256, 4, generator=generator).to(device))
        print(f"samples mean {samples.mean(0).tolist()} std {samples.std(0).tolist()}")


if __name__ == "__main__":
    main()
