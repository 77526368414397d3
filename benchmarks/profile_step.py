"""Where a benchmark case's step time goes: kernels, XLA programs, and the host's share.

    python benchmarks/profile_step.py gpt2:bf16:bridge-captured gpt2:bf16:jax --out /tmp/prof

Each case (workload:precision:case, as in run.py) runs in its own process: warm-up steps, then
a few steps under a profiler (jax.profiler's Perfetto trace for JAX-backed cases, torch.profiler
for torch cases). Writes <out>/<case>.txt: wall time per step, GPU busy time per step (the union
of kernel intervals), the XLA programs run per step, and the kernels by total time, each also
summed into a family (matmul, attention, convolution, fusion, copy/transpose, reduction, other).

`--gaps`: the profiler as above, and where the GPU sits idle within each step: every idle
stretch, what the host's calling thread was doing then (inside which XLA program's call, or
in Python between calls) and in which phase of the step; with the host's time per phase.

`--phases`: no profiler; the host's time in each phase of the step (forward, zero_grad,
backward, clip, optimizer, and `loss.item()`, where the host waits for the device), median
over the measured steps. A step whose `item` phase is near zero is bound by the host.
"""

import argparse
import collections
import glob
import gzip
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

FAMILIES = (
    ("attention", ("flash", "fmha", "cudnn_generated_fort_native_sdpa", "sdpa", "attention")),
    ("convolution", ("convolution", "conv_", "implicit_gemm", "wgrad", "dgrad", "fprop", "winograd")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "matmul", "dot", "cublas")),
    ("copy/transpose", ("transpose", "copy", "memcpy", "concatenate", "dynamic_update_slice")),
    ("reduction", ("reduce", "reduction")),
    ("fusion", ("fusion", "loop_", "input_", "triton", "elementwise", "vectorized")),
)


def family(name):
    lowered = name.lower()
    for label, needles in FAMILIES:
        if any(needle in lowered for needle in needles):
            return label
    return "other"


def _union(intervals):
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def _report(title, wall_ms, steps, kernels, programs=None, host=None):
    """kernels: [(name, start_us, dur_us)]; programs: {name: [dur_us]}; host: {name: [dur_us]}."""
    busy = _union([(start, start + dur) for _, start, dur in kernels]) / 1e3 / steps
    lines = [f"# {title}", f"wall per step: {wall_ms:.2f} ms", f"GPU busy per step (union of kernels): {busy:.2f} ms"]
    by_family = collections.Counter()
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for name, _, dur in kernels:
        by_family[family(name)] += dur
        by_name[name][0] += dur
        by_name[name][1] += 1
    total = sum(by_family.values()) or 1.0
    lines.append(f"kernel time per step (sum): {total / 1e3 / steps:.2f} ms")
    lines.append("\n## families (ms per step, share)")
    for label, dur in by_family.most_common():
        lines.append(f"{label:16s} {dur / 1e3 / steps:8.2f}  {100 * dur / total:5.1f}%")
    for label, table in (("XLA programs", programs), ("host events", host)):
        if table:
            lines.append(f"\n## {label} (ms per step, calls per step)")
            for name, durs in sorted(table.items(), key=lambda item: -sum(item[1]))[:25]:
                lines.append(f"{sum(durs) / 1e3 / steps:8.2f} {len(durs) / steps:6.1f}  {name[:150]}")
    lines.append("\n## kernels (ms per step, calls per step, family)")
    for name, (dur, count) in sorted(by_name.items(), key=lambda item: -item[1][0])[:60]:
        lines.append(f"{dur / 1e3 / steps:8.3f} {count / steps:6.1f}  {family(name):14s} {name[:160]}")
    return "\n".join(lines) + "\n"


def _annotated(step):
    """The step with each phase inside a profiler annotation `phase:<k>` (k counts the phases of
    the step in order), and the phase names as the step's `mark` calls give them."""
    import jax

    if not inspect.signature(step).parameters:
        return step, []
    names = []

    def run():
        current = [jax.profiler.TraceAnnotation(f"phase:{len(names)}")]
        current[0].__enter__()

        def mark(phase):
            current[0].__exit__(None, None, None)
            names.append(phase)
            current[0] = jax.profiler.TraceAnnotation(f"phase:{len(names)}")
            current[0].__enter__()

        try:
            return step(mark)
        finally:
            current[0].__exit__(None, None, None)

    return run, names


def _jax_profile(step, warmup, steps, directory, gaps=False, origins=False):
    """Profiles `steps` steps; returns (wall ms a step, kernels, programs, host events), then the
    gap report with `gaps`, then with `origins` the origins report (_origins_report)."""
    import jax

    for _ in range(warmup):
        step()
    names = []
    if gaps:
        step, names = _annotated(step)
    options = jax.profiler.ProfileOptions()
    # Python function events would slow the host several times over and hide its real share.
    options.python_tracer_level = 0
    jax.profiler.start_trace(directory, create_perfetto_trace=True, profiler_options=options)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    jax.profiler.stop_trace()
    path = sorted(glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as handle:
        events = json.load(handle)["traceEvents"]
    processes, threads = {}, {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            threads[(event["pid"], event["tid"])] = event["args"]["name"]
    kernels, programs, host = [], collections.defaultdict(list), collections.defaultdict(list)
    spans = []  # (name, start, duration, thread) of host events, for --gaps
    sources = collections.defaultdict(collections.Counter)  # kernel -> {(program, HLO op): time}
    for event in events:
        if event.get("ph") != "X":
            continue
        process = processes.get(event["pid"], "")
        thread = threads.get((event["pid"], event.get("tid")), "")
        if "GPU" in process or "device" in process.lower():
            if "XLA Modules" in thread:
                programs[event["name"]].append(event["dur"])
            elif "Stream" in thread or "stream" in thread:
                kernels.append((event["name"], event["ts"], event["dur"]))
                args = event.get("args", {})
                sources[event["name"]][(args.get("hlo_module", "?"), args.get("hlo_op", "?"))] += event["dur"]
        else:
            if event["name"].startswith("PjitFunction") or "Execute" in event["name"]:
                host[event["name"]].append(event["dur"])
            if gaps:
                spans.append((event["name"], event["ts"], event["dur"], (event["pid"], event.get("tid"))))
    result = (wall_ms, kernels, programs, host)
    if gaps:
        result += (_gap_report(kernels, spans, names, steps),)
    if origins:
        result += (_origins_report(sources, steps),)
    return result


def _origins_report(sources, steps, rows=60):
    """The longest kernels with the XLA program and HLO instruction each ran for (the trace's
    `hlo_module` and `hlo_op`), to be read beside the program's dumped HLO
    (XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text)."""
    lines = ["\n## kernels by origin (ms per step; XLA program; HLO instruction; kernel)"]
    flat = [(dur, module, op, kernel) for kernel, table in sources.items() for (module, op), dur in table.items()]
    by_module = collections.Counter()
    for dur, module, _, _ in flat:
        by_module[module] += dur
    for module, dur in by_module.most_common():
        lines.append(f"{dur / 1e3 / steps:8.3f}  {module}")
    lines.append("")
    for dur, module, op, kernel in sorted(flat, reverse=True)[:rows]:
        lines.append(f"{dur / 1e3 / steps:8.3f}  {module[:40]:40s} {op[:40]:40s} {kernel[:70]}")
    return "\n".join(lines) + "\n"


def _gap_report(kernels, spans, names, steps):
    """Where the GPU is idle during the profiled steps, and what the host was doing meanwhile."""
    busy = []
    for _, start, dur in sorted(kernels, key=lambda kernel: kernel[1]):
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], start + dur)
        else:
            busy.append([start, start + dur])
    phases = sorted((start, start + dur, int(name.split(":")[1])) for name, start, dur, _ in spans if name.startswith("phase:"))
    calls = sorted((start, start + dur, name) for name, start, dur, _ in spans if name.startswith("PjitFunction"))
    if not busy or not phases:
        return "\n## GPU idle\nno device kernels or no phase annotations in the trace\n"
    window = (phases[0][0], phases[-1][1])

    def label(moment):
        phase = next((k for start, stop, k in phases if start <= moment < stop), None)
        phase = names[phase] if phase is not None and phase < len(names) else "between steps"
        call = next((name for start, stop, name in reversed(calls) if start <= moment < stop), None)
        return phase, call[len("PjitFunction(") : -1] if call else "Python (no XLA call)"

    idle = []
    previous = window[0]
    for start, stop in busy + [[window[1], window[1]]]:
        if start > previous and previous < window[1]:
            idle.append((previous, min(start, window[1])))
        previous = max(previous, stop)
    by_host = collections.Counter()
    by_phase = collections.Counter()
    for start, stop in idle:
        # Attribute each idle stretch in 5 us slices, so that a stretch spanning several host
        # activities is split between them.
        moment = start
        while moment < stop:
            width = min(5.0, stop - moment)
            phase, doing = label(moment)
            by_host[doing] += width
            by_phase[phase] += width
            moment += width
    total = sum(stop - start for start, stop in idle)
    lines = [
        "\n## GPU idle within the steps (ms per step)",
        f"idle {total / 1e3 / steps:.2f} of {(window[1] - window[0]) / 1e3 / steps:.2f} ms per step, in {len(idle) / steps:.0f} stretches",
        "\n### by what the host's calling thread was doing",
    ]
    lines += [f"{value / 1e3 / steps:8.2f}  {name}" for name, value in by_host.most_common(12)]
    lines.append("\n### by phase of the step")
    lines += [f"{value / 1e3 / steps:8.2f}  {name}" for name, value in by_phase.most_common()]
    lines.append("\n### host time per phase (ms per step)")
    phase_time = collections.Counter()
    for start, stop, k in phases:
        phase_time[names[k] if k < len(names) else "?"] += stop - start
    lines += [f"{value / 1e3 / steps:8.2f}  {name}" for name, value in phase_time.items()]
    lines.append("\n### host events during idle stretches of 0.3 ms or more (ms per step they overlap, any depth)")
    main_thread = next(thread for name, _, _, thread in spans if name.startswith("phase:"))
    overlap = collections.Counter()
    for start, stop in idle:
        if stop - start < 300:
            continue
        for name, begin, dur, thread in spans:
            if not name.startswith("phase:") and begin < stop and begin + dur > start:
                where = "" if thread == main_thread else " [another thread]"
                overlap[name[:90] + where] += min(stop, begin + dur) - max(start, begin)
    lines += [f"{value / 1e3 / steps:8.3f}  {name}" for name, value in overlap.most_common(25)]
    lines.append("\n### the longest idle stretches (ms, phase, host)")
    for start, stop in sorted(idle, key=lambda gap: gap[0] - gap[1])[:12]:
        phase, doing = label(start)
        lines.append(f"{(stop - start) / 1e3:8.3f}  {phase:10s} {doing}")
    return "\n".join(lines) + "\n"


def _torch_profile(step, warmup, steps):
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    kernels = [
        (event.name, event.time_range.start, event.time_range.end - event.time_range.start)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    ]
    return wall_ms, kernels


def _phases(step, warmup, steps):
    """Median host milliseconds per phase of the step, and of the whole step (a hand-written
    JAX step is one call: the whole step only)."""
    if not inspect.signature(step).parameters:
        step = (lambda plain: lambda mark: plain())(step)
    for _ in range(warmup):
        step()
    samples = collections.defaultdict(list)
    for _ in range(steps):
        last = start = time.perf_counter()

        def mark(phase):
            nonlocal last
            now = time.perf_counter()
            samples[phase].append((now - last) * 1e3)
            last = now

        step(mark)
        samples["step"].append((time.perf_counter() - start) * 1e3)
    return {phase: sorted(values)[len(values) // 2] for phase, values in samples.items()}


def worker(spec, warmup, steps, out, tiny, phases=False, gaps=False):
    sys.path.insert(0, HERE)
    import run

    workload, precision, case = spec.split(":")
    step, kind = run.setup(workload, precision, case, tiny)
    if phases:
        medians = _phases(step, warmup, steps)
        text = f"# {spec}: host ms per phase (median of {steps} steps)\n" + "".join(
            f"{phase:>10} {value:8.2f}\n" for phase, value in medians.items()
        )
        with open(os.path.join(out, spec.replace(":", "_") + ".phases.txt"), "w") as handle:
            handle.write(text)
        print(text, flush=True)
        return
    if kind == "torch":
        wall_ms, kernels = _torch_profile(step, warmup, steps)
        text = _report(spec, wall_ms, steps, kernels)
    else:
        directory = tempfile.mkdtemp(prefix="trace_")
        profiled = _jax_profile(step, warmup, steps, directory, gaps=gaps)
        wall_ms, kernels, programs, host = profiled[:4]
        for path in glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True):
            shutil.copy(path, os.path.join(out, spec.replace(":", "_") + ".perfetto.json.gz"))
        text = _report(spec, wall_ms, steps, kernels, programs, host)
        if gaps:
            text += profiled[4]
        if case.startswith("bridge"):
            from bridge.runtime import capture

            text += "\n## bridge\n" + json.dumps(capture.summary(), indent=1, default=str) + "\n"
    with open(os.path.join(out, spec.replace(":", "_") + ".txt"), "w") as handle:
        handle.write(text)
    print(text, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", help="workload:precision:case, e.g. gpt2:bf16:bridge-captured")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "profiles"))
    parser.add_argument("--timeout", type=int, default=400)
    parser.add_argument("--phases", action="store_true", help="host time per phase of the step, no profiler")
    parser.add_argument("--gaps", action="store_true", help="with the profiler: where the GPU idles, and why")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    os.makedirs(options.out, exist_ok=True)
    if options.worker:
        worker(options.worker, options.warmup, options.steps, options.out, options.tiny, options.phases, options.gaps)
        return 0
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for spec in options.cases:
        command = [sys.executable, __file__, "--worker", spec, "--warmup", str(options.warmup), "--steps", str(options.steps), "--out", options.out]
        if options.tiny:
            command.append("--tiny")
        if options.phases:
            command.append("--phases")
        if options.gaps:
            command.append("--gaps")
        print(f"== {spec}", flush=True)
        try:
            done = subprocess.run(command, timeout=options.timeout, env=env, capture_output=True, text=True)
            print(done.stdout[-6000:] if done.returncode == 0 else (done.stdout + done.stderr)[-3000:], flush=True)
        except subprocess.TimeoutExpired:
            print(f"{spec}: over {options.timeout} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
