"""Where nanoGPT bench.py's step time goes, under the bridge or under torch.compile (GPU).

    python benchmarks/nanogpt_profile.py bridge|compile --nanogpt PATH [--gaps] [--origins] [--no-profile] [--cprofile] [--launch-times]

The step is bench.py's (nanoGPT's own model.py from the checkout at PATH, unmodified: GPT-2
small 12x768, batch 12x1024, bf16 autocast, `configure_optimizers` with its fused AdamW, then
forward, `zero_grad(set_to_none=True)`, backward, step and `loss.item()`), on random tokens.
Prints the median step time and the host's time per phase; then profiles 5 steps (a JAX
profile for the bridge, torch.profiler for torch.compile) and writes
$OUT (or /tmp)/nanogpt_<case>.txt with profile_step.py's report: kernels by family and by
name, with --gaps where the GPU waits and what the host is doing meanwhile, and with --origins
(bridge) the XLA program and HLO instruction of each long kernel. --cprofile first
prints cProfile's view of 10 steps (the host's Python, by time spent in each function).
--launch-times (bridge) prints, for 30 steps, the host's time from `loss.item()`'s return to the
points on the way to the region's program call and past it: the GPU waits that long.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["bridge", "compile"])
    parser.add_argument("--nanogpt", required=True, help="a nanoGPT checkout")
    parser.add_argument("--gaps", action="store_true")
    parser.add_argument("--origins", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--launch-times", action="store_true")
    options = parser.parse_args(argv)
    sys.path.insert(0, options.nanogpt)
    if options.case == "bridge":
        import bridge

        bridge.activate(mode="captured")
    import torch
    from model import GPT, GPTConfig

    import profile_step

    torch.manual_seed(1337)
    config = GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=False)
    model = GPT(config).to("cuda")
    optimizer = model.configure_optimizers(weight_decay=1e-2, learning_rate=1e-4, betas=(0.9, 0.95), device_type="cuda")
    if options.case == "compile":
        model = torch.compile(model)
    x = torch.randint(50304, (12, 1024)).to("cuda")
    y = torch.randint(50304, (12, 1024)).to("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)

    def step(mark=lambda phase: None):
        mark("started")
        with autocast:
            mark("autocast entered")
            _, loss = model(x, y)
        mark("forward")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        mark("backward")
        optimizer.step()
        mark("optimizer")
        loss.item()
        mark("item")

    if options.launch_times and options.case == "bridge":
        _launch_times(step)
    for _ in range(8):
        step()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    print(f"{options.case}: median {statistics.median(times):.2f} ms a step (min {min(times):.2f})", flush=True)
    print("host ms per phase:", profile_step._phases(step, 2, 10), flush=True)
    if options.cprofile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(10):
            step()
        profile.disable()
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(40)
    if options.no_profile:
        return
    if options.case == "bridge":
        profiled = profile_step._jax_profile(step, 2, 5, tempfile.mkdtemp(), gaps=options.gaps, origins=options.origins)
        text = profile_step._report(options.case, profiled[0], 5, *profiled[1:4]) + "".join(profiled[4:])
    else:
        wall_ms, kernels = profile_step._torch_profile(step, 2, 5)
        text = profile_step._report(options.case, wall_ms, 5, kernels)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"nanogpt_{options.case}.txt"), "w") as handle:
        handle.write(text)
    print(text, flush=True)


def _launch_times(step):
    """Median ms from loss.item()'s return to each point of the next step's way to its program
    (the GPU has nothing of the step to run until the program's call), and past it."""
    from bridge.patches import capture as capture_patches
    from bridge.runtime import capture

    marks = {}

    def mark(name):
        marks.setdefault(name, []).append(time.perf_counter())

    def marked(owner, name, label):
        function = owner.__dict__[name]
        inner = function.__func__ if isinstance(function, staticmethod) else function

        def call(*args, **kwargs):
            mark(label + " called")
            result = inner(*args, **kwargs)
            mark(label + " returned")
            return result

        setattr(owner, name, staticmethod(call) if isinstance(function, staticmethod) else call)
        return lambda: setattr(owner, name, function)

    undo = [
        marked(capture_patches._ModuleRegion, "walk", "walk of the module tree"),
        marked(capture.Region, "__call__", "Region.__call__"),
        marked(capture.Region, "_state", "Region._state"),
        marked(capture, "run", "capture.run"),
        marked(capture, "_gather", "_gather"),
        marked(capture._RegionFunction, "forward", "_RegionFunction.forward"),
    ]
    try:
        for _ in range(8):
            step()
        marks.clear()
        for _ in range(30):
            step(mark)
    finally:
        for restore in undo:
            restore()
    returns = marks["item"]
    print("ms from loss.item()'s return (median of 29 steps):", flush=True)
    rows = []
    for name, values in marks.items():
        if len(values) != len(returns):
            continue  # (a point some steps pass more than once)
        deltas = [values[k] - returns[k - 1] for k in range(1, len(returns))]
        rows.append((statistics.median(deltas) * 1e3, name))
    for ms, name in sorted(rows):
        print(f"  {name:45s} {ms:8.3f}", flush=True)


if __name__ == "__main__":
    main()
