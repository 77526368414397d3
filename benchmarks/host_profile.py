"""Python's view of one benchmark case's host time: cProfile over steady-state steps.

    python benchmarks/host_profile.py resnet50:fp32:bridge-captured [--warmup 6] [--steps 10]

Prints the functions by own time and by cumulative time (cProfile adds its own cost per Python
call, so the shares, not the absolute times, are what to read).
"""

import argparse
import cProfile
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", help="workload:precision:case, as in run.py")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--lines", type=int, default=40)
    options = parser.parse_args(argv)
    import run

    workload, precision, case = options.case.split(":")
    step, _ = run.setup(workload, precision, case, options.tiny)
    for _ in range(options.warmup):
        step()
    start = time.perf_counter()
    for _ in range(options.steps):
        step()
    plain = (time.perf_counter() - start) * 1e3 / options.steps
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(options.steps):
        step()
    profiler.disable()
    print(f"# {options.case}: {plain:.2f} ms per step without the profiler")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(options.lines)
    stats.sort_stats("cumtime").print_stats(options.lines)


if __name__ == "__main__":
    main()
