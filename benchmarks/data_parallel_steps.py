"""nn.DataParallel's training step over the GPUs a machine has, torch and the bridge (captured),
and one GPU without DataParallel for each, one process per case.

    python benchmarks/data_parallel_steps.py [--batch 256] [--size 224] [--steps 20] [--profile] [--tiny]

The model is ResNet-50 (torchvision's where it imports, else benchmarks/host_step.py's, the same
modules written by hand), float32, SGD with momentum and weight decay, on a batch already on the
first device, as pytorch/examples' imagenet `main.py` trains it (its accuracy and `.item()`s
each step), without its data loader, which bounds that program's step on a fast GPU. Prints
the median step ms of each case after 5 warm steps; `--profile` adds cProfile's view of the
bridge's DataParallel steps (the host's Python). `--tiny` runs a small width and image on any
machine (the CPU's JAX devices split in two: a check, not a measurement).
"""

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

CASES = ("torch-dp", "bridge-dp", "torch-one", "bridge-one")


def _model(tiny):
    import torch

    if not tiny:
        try:
            import torchvision

            return torchvision.models.resnet50()
        except Exception:  # (torchvision's wheel may not import beside this torch)
            pass
    from host_step import ResNet

    return ResNet(width=8 if tiny else 64, num_classes=1000)


def _measure(case, options):
    import torch
    import torch.nn.functional as F

    if case.startswith("bridge"):
        import bridge

        bridge.activate(mode="captured")
    torch.manual_seed(0)
    model = _model(options.tiny).cuda()
    if case.endswith("dp"):
        model = torch.nn.DataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(options.batch, 3, options.size, options.size, device="cuda")
    y = torch.randint(0, 1000, (options.batch,), device="cuda")

    def step():
        output = model(x)
        loss = F.cross_entropy(output, y)
        _, top = output.topk(5, 1, True, True)
        correct = top.t().eq(y.view(1, -1).expand_as(top.t()))
        accuracy = correct[:1].reshape(-1).float().sum(0, keepdim=True)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item(), accuracy.item()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profile = cProfile.Profile() if options.profile and case == "bridge-dp" else None
    times = []
    for _ in range(options.steps):
        if profile is not None:
            profile.enable()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
        if profile is not None:
            profile.disable()
    record = {"case": case, "ms": round(statistics.median(times), 2), "spread": [round(min(times), 2), round(max(times), 2)],
              "devices": torch.cuda.device_count()}
    if case.startswith("bridge"):
        from bridge.runtime import capture

        record["compiles"] = [compile.region for compile in capture.compiles]
        record["breaks"] = len(capture.breaks)
    print("RESULT " + json.dumps(record), flush=True)
    if profile is not None:
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(30)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--case", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.tiny:
        options.batch, options.size = min(options.batch, 16), min(options.size, 32)
    if options.case:
        return _measure(options.case, options)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if options.tiny:
        env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    for case in options.only.split(","):
        if case.startswith("torch") and options.tiny:
            continue  # (torch's DataParallel needs CUDA)
        if case.endswith("one"):
            env_case = dict(env, CUDA_VISIBLE_DEVICES="0")
            if options.tiny:
                env_case["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        else:
            env_case = env
        command = [sys.executable, __file__, "--case", case, "--batch", str(options.batch), "--size", str(options.size),
                   "--steps", str(options.steps)] + ["--profile"] * options.profile + ["--tiny"] * options.tiny
        done = subprocess.run(command, env=env_case, capture_output=True, text=True)
        output = done.stdout + done.stderr
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        print(lines[-1] if lines else f"{case}: failed\n{output[-2000:]}", flush=True)
        if options.profile and case == "bridge-dp":
            print(done.stdout[-6000:])


if __name__ == "__main__":
    main()
