"""Where one benchmark case's device memory goes: in use and peak after each phase of each step,
the largest arrays alive at the end, and, with --dump, each XLA program's buffers.

    python benchmarks/memory_phases.py gpt2:fp32:bridge-captured gpt2:fp32:torch [--steps 3]
    python benchmarks/memory_phases.py gpt2:fp32:bridge-captured --dump /tmp/xla

One process per case. Torch cases: memory_allocated and max_memory_allocated with the peak reset
after each phase (the peak within that phase). JAX cases: bytes_in_use and peak_bytes_in_use,
which JAX cannot reset (the peak so far; the phase where it rises is where the peak is). --dump
sets XLA_FLAGS to dump each compiled program, then sums each program's buffer assignment by kind
(parameters, outputs, temporaries) and lists its largest temporaries.
"""

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

GIB = 2**30


def _reader(kind):
    """() -> (in use, peak) in bytes, and a function resetting the peak where it can be."""
    import run

    def read():
        in_use, peak = run.device_memory(kind)
        return in_use or 0, peak or 0

    if kind == "torch":
        import torch

        return read, torch.cuda.reset_peak_memory_stats
    return read, lambda: None


def _live_arrays(kind, top):
    """The largest arrays alive, grouped by shape and dtype: [(bytes, count, description)]."""
    groups = collections.Counter()
    counts = collections.Counter()
    if kind == "torch":
        import gc

        import torch

        seen = set()
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                storage = obj.untyped_storage()
                if storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                key = f"{obj.dtype} storage of {storage.nbytes()} bytes"
                groups[key] += storage.nbytes()
                counts[key] += 1
    else:
        import jax

        for array in jax.live_arrays():
            key = f"{array.dtype}{list(array.shape)}"
            groups[key] += array.nbytes
            counts[key] += 1
    total = sum(groups.values())
    return total, [(size, counts[key], key) for key, size in groups.most_common(top)]


def worker(case_name, steps, tiny):
    import run

    workload, precision, case = case_name.split(":")
    step, kind = run.setup(workload, precision, case, tiny)
    read, reset = _reader(kind)
    rows = []
    current = [0]

    def mark(phase):
        in_use, peak = read()
        rows.append({"step": current[0], "phase": phase, "in_use": in_use, "peak": peak})
        reset()

    for number in range(steps):
        current[0] = number
        mark("start")
        step(mark)
    total, largest = _live_arrays(kind, 15)
    return {"case": case_name, "kind": kind, "rows": rows, "live_total": total, "live_largest": largest}


_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*)$")


def buffer_summary(folder, top=12):
    """Per dumped program: bytes of its parameters, outputs and temporaries, and the largest
    temporaries' shapes (from XLA's buffer assignment and memory usage report)."""
    summaries = []
    for path in sorted(glob.glob(os.path.join(folder, "*after_optimizations-buffer-assignment.txt"))):
        sizes = collections.Counter()
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                match = _ALLOCATION.match(line)
                if not match:
                    if line.startswith("Total bytes used"):
                        break
                    continue
                size, description = int(match.group(2)), match.group(3)
                if description.startswith("parameter"):
                    kind = "parameters"
                elif "maybe-live-out" in description or description.startswith("output"):
                    kind = "outputs"
                elif "constant" in description:
                    kind = "constants"
                else:
                    kind = "temporaries"
                sizes[kind] += size
        if sum(sizes.values()) < 2**16:
            continue  # eager programs and small helpers
        report = path.replace("-buffer-assignment.txt", "-memory-usage-report.txt")
        largest = []
        if os.path.exists(report):
            with open(report, encoding="utf-8") as handle:
                lines = [line.rstrip() for line in handle if "(" in line and ";" in line and "cumulative" not in line]
            largest = lines[:top]
        name = os.path.basename(path).split(".")[1]
        summaries.append({"program": name, "bytes": dict(sizes), "largest": largest, "peak": _peak_breakdown(path, top)})
    return summaries


def _peak_breakdown(path, top):
    """XLA's own account of the program's peak: the bytes live at the peak point of its schedule,
    by the JAX operation (op_name) that made them, from the dumped live ranges."""
    live_ranges = path.replace("-buffer-assignment.txt", "-live-range.txt")
    if not os.path.exists(live_ranges):
        return []
    with open(live_ranges, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    for number, line in enumerate(lines):
        if line.strip().startswith("Stack trace breakdown for peak usage"):
            return [line.strip()] + [entry.strip(" │├└─") for entry in lines[number + 2 : number + 2 + top]]
    return []


def _print(result):
    print(f"# {result['case']} ({'torch allocator, peak per phase' if result['kind'] == 'torch' else 'JAX device, peak so far'})")
    print("| step | phase | in use GiB | peak GiB |")
    print("|---|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['step']} | {row['phase']} | {row['in_use'] / GIB:.2f} | {row['peak'] / GIB:.2f} |")
    print(f"\nalive at the end: {result['live_total'] / GIB:.2f} GiB; largest groups:")
    for size, count, key in result["live_largest"]:
        print(f"  {size / GIB:8.3f} GiB  {count:4d} x {key}")
    for summary in result.get("programs", []):
        sizes = ", ".join(f"{kind} {size / GIB:.2f} GiB" for kind, size in sorted(summary["bytes"].items()))
        print(f"\nprogram {summary['program']}: {sizes}")
        for line in summary["largest"]:
            print(f"  {line.strip()}")
        for line in summary["peak"]:
            print(f"  peak: {line}")
    print()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", help="workload:precision:case, as in run.py")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--dump", metavar="FOLDER", help="dump XLA's programs here and summarize their buffers")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        print(json.dumps(worker(options.cases[0], options.steps, options.tiny)))
        return
    for case in options.cases:
        environment = dict(os.environ)
        folder = None
        if options.dump and not case.split(":")[2].startswith("torch"):
            folder = os.path.join(options.dump, case.replace(":", "_"))
            os.makedirs(folder, exist_ok=True)
            environment["XLA_FLAGS"] = (environment.get("XLA_FLAGS", "") + f" --xla_dump_to={folder} --xla_dump_hlo_as_text").strip()
            environment["BRIDGE_CACHE_DIR"] = "0"  # a program from the compilation cache is not compiled, so not dumped
        command = [sys.executable, os.path.abspath(__file__), case, "--steps", str(options.steps), "--worker"]
        if options.tiny:
            command.append("--tiny")
        done = subprocess.run(command, capture_output=True, text=True, env=environment)
        if done.returncode != 0:
            print(f"# {case}: failed\n{done.stderr[-3000:]}")
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if folder:
            result["programs"] = buffer_summary(folder)
        _print(result)


if __name__ == "__main__":
    main()
