"""A timm training loop as timm's own train.py runs one step: a timm model (`--model`,
resnet50 by default) from `timm.create_model`, the optimizer from `timm.optim.create_optimizer_v2`
(AdamW, weight decay 0.05), bf16 autocast, cross-entropy with label smoothing
(`timm.loss.LabelSmoothingCrossEntropy`), clipping at 1.0 with `timm.utils.dispatch_clip_grad`,
channels-last images of 224x224, batch 64 of random data. Prints `RESULT {json}`: the median
step time over steps 10 to `--steps` (each step synchronized), and the first step's time.

Run as it is for torch eager, with `--compile` for torch.compile, under `python -m bridge run`
for the bridge."""

import argparse
import json
import statistics
import time

import timm
import timm.loss
import timm.optim
import timm.utils
import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--profile", help="then profile 5 steps: the kernels by time into this folder (benchmarks/profile_step.py's report)")
    options = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = timm.create_model(options.model, num_classes=1000).to(device).to(memory_format=torch.channels_last)
    optimizer = timm.optim.create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    criterion = timm.loss.LabelSmoothingCrossEntropy(smoothing=0.1)
    step_model = torch.compile(model) if options.compile else model
    images = torch.randn(options.batch, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (options.batch,), device=device)
    times, losses = [], []

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = criterion(step_model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        timm.utils.dispatch_clip_grad(model.parameters(), value=1.0, mode="norm")
        optimizer.step()
        losses.append(loss.item())  # timm's loop reads the loss for its meters

    for _ in range(options.steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if options.profile:
        _profile(options, step)
    print("RESULT " + json.dumps({
        "ms_per_step": round(statistics.median(times[10:]) * 1e3, 2),
        "first_step_seconds": round(times[0], 2),
        "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
        "steps": options.steps,
    }), flush=True)


def _profile(options, step):
    """Kernels by family and name over 5 more steps: JAX's profiler under the bridge, torch's
    otherwise (benchmarks/profile_step.py's report)."""
    import os
    import sys
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import profile_step

    bridged = getattr(sys.modules.get("bridge"), "is_active", lambda: False)()
    runtime = "bridge" if bridged else "torch-compile" if options.compile else "torch"
    if bridged:
        wall_ms, kernels, programs, host = profile_step._jax_profile(step, 2, 5, tempfile.mkdtemp())
    else:
        (wall_ms, kernels), programs, host = profile_step._torch_profile(step, 2, 5), None, None
    os.makedirs(options.profile, exist_ok=True)
    title = f"timm {options.model}, {runtime}, batch {options.batch}"
    with open(os.path.join(options.profile, f"{options.model}_{runtime}.txt"), "w") as handle:
        handle.write(profile_step._report(title, wall_ms, 5, kernels, programs, host))


if __name__ == "__main__":
    main()
