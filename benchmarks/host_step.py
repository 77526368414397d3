"""The host's time per step of a captured training loop with ResNet-50's structure, on the CPU.

    python benchmarks/host_step.py [--width 1] [--size 16] [--steps 60] [--profile]

The model has ResNet-50's modules and parameters (161 parameters, 53 batch norms, torchvision's
layout, written here by hand: no torchvision on CPU machines) at a tiny width and image size, so
that XLA's arithmetic is small and the step time is mostly the host's own work: the bridge's
Python around the compiled programs (module walk, state, autograd, optimizer) and their
dispatch. The GPU step of the real model is bound by this time on slow hosts
(benchmarks/results). `--profile` adds cProfile's view of the same steps.
"""

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

class Bottleneck(nn.Module):
    expansion = 4
    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False); self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False); self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False); self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True); self.downsample = downsample
    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)

class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), num_classes=1000, width=64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False); self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True); self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make(width, layers[0]); self.layer2 = self._make(width*2, layers[1], 2)
        self.layer3 = self._make(width*4, layers[2], 2); self.layer4 = self._make(width*8, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1); self.fc = nn.Linear(width * 32, num_classes)
    def _make(self, planes, blocks, stride=1):
        down = None
        if stride != 1 or self.inplanes != planes * 4:
            down = nn.Sequential(nn.Conv2d(self.inplanes, planes * 4, 1, stride, bias=False), nn.BatchNorm2d(planes * 4))
        layers = [Bottleneck(self.inplanes, planes, stride, down)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)
    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eager-torch", action="store_true", help="plain torch on the CPU instead of the bridge")
    parser.add_argument("--profile", action="store_true")
    options = parser.parse_args(argv)
    if not options.eager_torch:
        import bridge

        bridge.activate()
    torch.manual_seed(0)
    device = "cpu" if options.eager_torch else "cuda"
    model = ResNet(width=options.width, num_classes=10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(2, 3, options.size, options.size, device=device)
    y = torch.randint(0, 10, (2,), device=device)

    def step():
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()

    for _ in range(5):
        step()
    times = []
    for _ in range(options.steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    quartiles = statistics.quantiles(times, n=4)
    print(f"step ms: median {statistics.median(times):.3f} (quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}), "
          f"{sum(1 for _ in model.parameters())} parameters, {'torch' if options.eager_torch else 'bridge captured'}")
    if options.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(options.steps):
            step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    sys.exit(main())
