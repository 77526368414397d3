"""Training-step benchmarks: torch eager, torch.compile, hand-written JAX, the bridge in eager and
in captured mode, on the same workloads, one process per case, in one run on one machine.

    python benchmarks/run.py                        # GPT-2 small fp32/bf16 and ResNet-50 on the GPU
    python benchmarks/run.py --workloads gpt2 --cases torch,jax,bridge-captured
    python benchmarks/run.py --tiny --steps 6       # a small smoke run (CPU is fine)

Writes benchmarks/results/<name>.md, .json and .svg (--out, --name). Step time: the median of
the second half of the steps (spread: min and max of that half), each step ending with
`loss.item()`; first step: the first step's wall time (compiles included); peak memory: torch's
max_memory_allocated, or JAX's peak_bytes_in_use of the device.
"""

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# (workload, precision, case): what one process runs.
CASES = {
    "gpt2": [
        ("fp32", "torch"),
        ("fp32", "jax"),
        ("fp32", "bridge-captured"),
        ("fp32-high", "bridge-captured"),
        ("bf16", "torch"),
        ("bf16", "jax"),
        ("bf16", "bridge-captured"),
        ("bf16", "torch-compile"),
        ("fp32", "torch-compile"),
        ("fp32", "bridge-eager"),
        ("bf16", "bridge-eager"),
    ],
    "resnet50": [
        ("fp32", "torch"),
        ("fp32", "torch-compile"),
        ("fp32", "jax"),
        ("fp32", "bridge-captured"),
        ("fp32", "bridge-eager"),
    ],
}
# Bridge eager compiles every op's program on the first step and runs op by op: fewer steps.
EAGER_STEPS = 4


def device_memory(kind):
    """(bytes in use, peak bytes) of the device's allocator: torch's, or JAX's for the first
    device; (None, None) where the backend keeps no statistics."""
    try:
        if kind == "torch":
            import torch

            if not torch.cuda.is_available():
                return None, None
            return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None, None


def setup(workload, precision, case, tiny):
    """Build one case in this process; returns (step, kind): `step()` runs one training step
    and returns the loss as a Python float; kind says whose allocator holds the memory."""
    sys.path.insert(0, HERE)
    bf16 = precision == "bf16"
    if case == "jax":
        import jax_models

        if workload == "resnet50":
            return jax_models.resnet_setup(batch=4 if tiny else 64, size=32 if tiny else 224, tiny=tiny), "jax"
        config = jax_models_config(tiny)
        if precision == "fp32-high":
            import jax

            jax.config.update("jax_default_matmul_precision", "tensorfloat32")
        return jax_models.gpt_setup(config, batch=2 if tiny else 8, bf16=bf16), "jax"
    import torch

    kind = "torch"
    if case.startswith("bridge"):
        import bridge

        bridge.activate(mode="captured" if case == "bridge-captured" else "eager")
        kind = "jax"
    if precision == "fp32-high":
        torch.set_float32_matmul_precision("high")
    import models

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if workload == "gpt2":
        config = models.GPT2_TINY if tiny else models.GPT2_SMALL
        model, optimizer, data = models.gpt_setup(device, config, batch=2 if tiny else 8)
        train = models.gpt_step
    else:
        model, optimizer, data = models.resnet_setup(device, batch=4 if tiny else 64, size=32 if tiny else 224, tiny=tiny)
        train = models.resnet_step
    if case == "torch-compile":
        model = torch.compile(model)

    def step(mark=models._no_mark):
        return train(model, optimizer, data, bf16, mark)

    return step, kind


def worker(workload, precision, case, steps, tiny):
    """Run one case in this process; returns its measurements."""
    step, kind = setup(workload, precision, case, tiny)
    times, losses = [], []
    pauses, started = [], [0.0]  # full garbage collections: [step index, ms]; the current one's start

    def garbage_collection(phase, info):
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                pauses.append([len(times), round((time.perf_counter() - started[0]) * 1e3, 1)])

    gc.callbacks.append(garbage_collection)
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    gc.callbacks.remove(garbage_collection)
    steady = times[len(times) // 2 :] if len(times) > 1 else times
    result = {
        "workload": workload,
        "precision": precision,
        "case": case,
        "steps": steps,
        "step_ms": statistics.median(steady) * 1e3,
        "step_ms_min": min(steady) * 1e3,
        "step_ms_max": max(steady) * 1e3,
        "first_step_s": times[0],
        "step_times_ms": [round(t * 1e3, 2) for t in times[1:]],
        "peak_memory_gib": (device_memory(kind)[1] or 0) / 2**30 or None,
        "losses": [losses[0], losses[-1]],
        "full_garbage_collections": pauses,  # [step index (0: the first step), ms]
    }
    if case.startswith("bridge"):
        from bridge.runtime import capture

        result["compiles"] = len(capture.compiles)
        result["optimizer_steps_as_one_program"] = dict(capture.fused_steps)
        result["graph_breaks"] = [f"{b.region}: {b.reason} at {b.site}" for b in capture.breaks]
    return result


def jax_models_config(tiny):
    sys.path.insert(0, HERE)
    import models

    return models.GPT2_TINY if tiny else models.GPT2_SMALL


def _items_per_second(result, tiny):
    if result["workload"] == "gpt2":
        per_step = (2 * 64) if tiny else (8 * 1024)
        unit = "tokens/s"
    else:
        per_step = 4 if tiny else 64
        unit = "images/s"
    return per_step / (result["step_ms"] / 1e3), unit


@functools.lru_cache(maxsize=None)
def machine():
    info = {"python": platform.python_version(), "host": platform.node(), "cpu_count": os.cpu_count()}
    try:
        info["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    versions = subprocess.run(
        [sys.executable, "-c", "import torch, jax; print(torch.__version__, jax.__version__, jax.default_backend())"],
        capture_output=True,
        text=True,
    ).stdout.split()
    if len(versions) == 3:
        info["torch"], info["jax"], info["jax_backend"] = versions
    return info


def _table(results, tiny):
    lines = [
        "| workload | precision | case | step ms (median) | spread (min-max) | throughput | first step s | peak GiB | compiles | graph breaks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['precision']} | {r['case']} | failed: {r['error'][:120]} | | | | | | |")
            continue
        rate, unit = _items_per_second(r, tiny)
        memory = f"{r['peak_memory_gib']:.2f}" if r.get("peak_memory_gib") else "-"
        lines.append(
            f"| {r['workload']} | {r['precision']} | {r['case']} | {r['step_ms']:.1f} | {r['step_ms_min']:.1f}-{r['step_ms_max']:.1f} "
            f"| {rate:,.0f} {unit} | {r['first_step_s']:.1f} | {memory} | {r.get('compiles', '-')} | {len(r.get('graph_breaks', [])) if 'graph_breaks' in r else '-'} |"
        )
    return "\n".join(lines)


def _ratios(results):
    """The issue's comparisons, each measured in this run."""
    found = {(r["workload"], r["precision"], r["case"]): r for r in results if "error" not in r}
    lines = []

    def ratio(label, numerator, denominator, field="step_ms"):
        a, b = found.get(numerator), found.get(denominator)
        if a and b and b.get(field):
            lines.append(f"- {label}: {a[field]:.2f} / {b[field]:.2f} = **{a[field] / b[field]:.2f}x**")

    for workload in ("gpt2", "resnet50"):
        ratio(f"{workload} bf16: bridge captured / torch.compile", (workload, "bf16", "bridge-captured"), (workload, "bf16", "torch-compile"))
        ratio(f"{workload} bf16: bridge captured / hand-written JAX", (workload, "bf16", "bridge-captured"), (workload, "bf16", "jax"))
        ratio(f"{workload} fp32: bridge captured / torch eager", (workload, "fp32", "bridge-captured"), (workload, "fp32", "torch"))
        ratio(f"{workload} fp32 (high): bridge captured / hand-written JAX (TF32)", (workload, "fp32-high", "bridge-captured"), (workload, "fp32", "jax"))
        ratio(f"{workload} fp32: bridge captured / torch.compile", (workload, "fp32", "bridge-captured"), (workload, "fp32", "torch-compile"))
        if workload == "resnet50":
            # Both at their defaults: TF32 convolutions (torch.backends.cudnn.allow_tf32, JAX's
            # default precision). GPT-2's float32 cases differ in precision: no such ratio.
            ratio(f"{workload} fp32: bridge captured / hand-written JAX", (workload, "fp32", "bridge-captured"), (workload, "fp32", "jax"))
        for precision in ("fp32", "bf16"):
            ratio(f"{workload} {precision}: bridge eager / torch eager", (workload, precision, "bridge-eager"), (workload, precision, "torch"))
        for precision in ("fp32", "bf16"):
            ratio(
                f"{workload} {precision}: first step, bridge captured / torch.compile",
                (workload, precision, "bridge-captured"),
                (workload, precision, "torch-compile"),
                "first_step_s",
            )
            ratio(
                f"{workload} {precision}: peak memory, bridge captured / torch eager",
                (workload, precision, "bridge-captured"),
                (workload, precision, "torch"),
                "peak_memory_gib",
            )
    return "\n".join(lines)


def _svg(results):
    sys.path.insert(0, REPO)
    from bridge.report import _bar_chart

    values = {
        f"{r['workload']} {r['precision']} {r['case']}": round(r["step_ms"], 1) for r in results if "error" not in r
    }
    return _bar_chart("Step time (ms, median; lower is better)", values, "ms").split("</h2>", 1)[1]


def _write(options, argv, results):
    """Write the results files (JSON, Markdown, SVG) for the cases run so far."""
    info = machine()
    os.makedirs(options.out, exist_ok=True)
    base = os.path.join(options.out, options.name)
    with open(base + ".json", "w") as handle:
        json.dump({"machine": dict(info), "command": " ".join(["python", "benchmarks/run.py", *(argv or sys.argv[1:])]), "results": results}, handle, indent=2)
    with open(base + ".svg", "w") as handle:
        handle.write(_svg(results))
    text = (
        f"# {options.name}\n\nCommand: `python benchmarks/run.py {' '.join(argv or sys.argv[1:])}`; "
        f"generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n"
        f"Machine: {json.dumps(info)}\n\n{_table(results, options.tiny)}\n\n## Ratios (same run)\n\n{_ratios(results)}\n"
    )
    with open(base + ".md", "w") as handle:
        handle.write(text)
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="gpt2,resnet50")
    parser.add_argument("--cases", default=None, help="comma list of cases to keep (torch, torch-compile, jax, bridge-eager, bridge-captured)")
    parser.add_argument("--precisions", default=None, help="comma list of precisions to keep (fp32, fp32-high, bf16)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="small models and batches (a smoke run)")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per case")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="training_steps")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker:
        workload, precision, case = options.worker.split(":")
        print("RESULT " + json.dumps(worker(workload, precision, case, options.steps, options.tiny)), flush=True)
        return 0
    results = []
    for workload in options.workloads.split(","):
        for precision, case in CASES[workload]:
            if options.cases and case not in options.cases.split(","):
                continue
            if options.precisions and precision not in options.precisions.split(","):
                continue
            steps = min(options.steps, EAGER_STEPS) if case == "bridge-eager" else options.steps
            command = [sys.executable, __file__, "--worker", f"{workload}:{precision}:{case}", "--steps", str(steps)]
            if options.tiny:
                command.append("--tiny")
            env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
            print(f"== {workload} {precision} {case} ({steps} steps)", flush=True)
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=options.timeout, env=env)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if lines:
                    result = json.loads(lines[-1][len("RESULT ") :])
                else:
                    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                    result = {"workload": workload, "precision": precision, "case": case, "error": " | ".join(tail)}
            except subprocess.TimeoutExpired:
                result = {"workload": workload, "precision": precision, "case": case, "error": f"over {options.timeout} s"}
            print(json.dumps(result), flush=True)
            results.append(result)
            _write(options, argv, results)  # after every case: a run cut short keeps what it measured
    text = _write(options, argv, results)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
