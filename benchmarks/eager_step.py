"""Eager-mode step time of the char GPT example: torch on its own device vs the bridge.

Prints median milliseconds per training step (forward, backward, clip, AdamW, loss.item())
over steps 10..30, for plain torch (CUDA if torch has it, else CPU) and for the bridge.
"""

import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import gpt_char  # noqa: E402


def step_times(model, device, steps=30, batch=16, block=64):
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (batch, block)).to(device)
    y = torch.randint(0, 64, (batch, block)).to(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss.item()
        times.append(time.perf_counter() - start)
    return statistics.median(times[10:]) * 1000, times[0] * 1000


def main():
    torch.manual_seed(0)
    model = gpt_char.GPT(64, 64, width=128, heads=4, layers=4, dropout=0.0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    median, first = step_times(copy.deepcopy(model).to(device), device)
    print(f"torch eager ({device}): median {median:.1f} ms/step, first step {first:.0f} ms")
    import bridge

    bridge.activate()
    median, first = step_times(copy.deepcopy(model).to("cuda"), "cuda")
    print(f"bridge eager (JAX {torch.cuda.get_device_name()}): median {median:.1f} ms/step, first step {first:.0f} ms")


if __name__ == "__main__":
    main()
