"""The host's time of one captured optimizer step after a captured backward, as training takes
it: GPT-2 small's 148 parameters (optimizer_steps.py's, with its `--backward` module), the
gradients made by a backward before each step, the device synchronized before the step starts.

    python benchmarks/optimizer_host.py NAME IMPLEMENTATION [--tiny] [--steps 200] [--profile]

NAME is a torch.optim class (AdamW, SGD, ...), IMPLEMENTATION one of optimizer_steps.py's
(fused, foreach, single, capturable). Prints the median host time until step() returned and
the median time until the synchronization after it, over the steps after the first 50. To set
two versions of the bridge side by side, run it from each checkout in turn, alternating:

    for r in 1 2 3; do for tree in NEW OLD; do (cd $tree && PYTHONPATH=$PWD python \\
        benchmarks/optimizer_host.py AdamW fused); done; done

`--profile` prints cProfile's view of the timed steps (the step alone, not the backward).
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name")
    parser.add_argument("implementation", choices=["fused", "foreach", "single", "capturable"])
    parser.add_argument("--tiny", action="store_true", help="the 148 parameters at width 64 (a CPU)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    options = parser.parse_args(argv)

    import torch

    import bridge
    import optimizer_steps

    bridge.activate(mode="captured")
    keywords = {name: kwargs for name, kwargs, _ in optimizer_steps.OPTIMIZERS}[options.name]
    params = optimizer_steps._parameters(options.tiny, "cuda")
    squares = optimizer_steps._Squares(params)
    scale = torch.tensor(5e-4, device="cuda")
    optimizer = getattr(torch.optim, options.name)(params, **keywords, **optimizer_steps.FLAGS[options.implementation])
    optimizer.step()
    profile = cProfile.Profile() if options.profile else None
    host, total = [], []
    for step in range(options.steps):
        optimizer.zero_grad(set_to_none=True)
        squares(scale).backward()
        torch.cuda.synchronize()
        timed = step >= 50
        if timed and profile is not None:
            profile.enable()
        start = time.perf_counter()
        optimizer.step()
        returned = time.perf_counter()
        if timed and profile is not None:
            profile.disable()
        torch.cuda.synchronize()
        if timed:
            host.append((returned - start) * 1e3)
            total.append((time.perf_counter() - start) * 1e3)
    print(
        f"{options.name} {options.implementation}: host ms median {statistics.median(host):.3f}, "
        f"with the synchronization {statistics.median(total):.3f}",
        flush=True,
    )
    if profile is not None:
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
