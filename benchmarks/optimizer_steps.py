"""Every torch.optim optimizer's step on GPT-2 small's parameters, in each implementation torch
offers, as torch runs it and as the bridge runs it (captured mode), one process each, in one run.

    python benchmarks/optimizer_steps.py [--tiny] [--steps 20] [--only adam,sgd] [--eager] [--backward] [--out DIR]

The parameters are GPT-2 small's 148 (12 layers x 768, vocab 50304; float32, 124M values) with
fixed gradients (with --backward, made by a backward before each step, untimed, as training
makes them); each case builds its optimizer, takes 3 steps (the first makes the state; the
bridge compiles the step's program at the second), then times `--steps` steps, each followed by
a device synchronization (`torch.cuda.synchronize()`, which the bridge maps onto JAX), and
reports the median; then `--steps` steps back to back with one synchronization ("pipelined").
The bridge's rows also say how many programs each timed step ran (one is the goal), the host's
time until step() returned, and a captured step's compiled program timed alone.

Figures: per optimizer, torch's fastest implementation (fused where torch has it, else foreach)
against each of the bridge's, and their ratio. With --eager, a third process runs the bridge in
eager mode (each torch op one call; the fused kernels and `_foreach_*` ops one program each) and a
table sets it against torch's same implementation. Writes <out>/<name>.{md,json}.
"""

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import machine  # noqa: E402

# (name, constructor keyword arguments, implementations torch offers on a GPU)
OPTIMIZERS = [
    ("Adam", dict(lr=3e-4, weight_decay=0.0), ["fused", "foreach", "single", "capturable"]),
    ("AdamW", dict(lr=3e-4, weight_decay=0.1), ["fused", "foreach", "single", "capturable"]),
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=1e-4), ["fused", "foreach", "single"]),
    ("Adagrad", dict(lr=0.01), ["fused", "foreach", "single"]),
    ("Adadelta", dict(lr=1.0), ["foreach", "single", "capturable"]),
    ("Adamax", dict(lr=2e-3), ["foreach", "single", "capturable"]),
    ("ASGD", dict(lr=0.01), ["foreach", "single", "capturable"]),
    ("NAdam", dict(lr=2e-3), ["foreach", "single", "capturable"]),
    ("RAdam", dict(lr=1e-3), ["foreach", "single", "capturable"]),
    ("RMSprop", dict(lr=1e-2, momentum=0.9), ["foreach", "single", "capturable"]),
    ("Rprop", dict(lr=1e-2), ["foreach", "single", "capturable"]),
]
FLAGS = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "single": {"foreach": False},
    "capturable": {"capturable": True, "foreach": True},
}


def _parameters(tiny, device):
    import torch

    import models

    # --tiny: GPT-2 small's 12 layers (its 148 parameters: the host's cost of a step is per
    # tensor) at width 64, so that a CPU measures the host's time rather than the arithmetic.
    config = dict(models.GPT2_TINY, layers=models.GPT2_SMALL["layers"]) if tiny else models.GPT2_SMALL
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in models.GPT(**config).parameters()]
    generator = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        param = torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02).to(device))
        param.grad = (torch.randn(shape, generator=generator) * 1e-3).to(device)
        params.append(param)
    return params


class _Squares:
    """--backward: a module over the parameters whose loss, 1e-3 * sum(p**2) / 2, gives each
    the gradient 1e-3 * p, made by a backward each step as training makes them (under the
    bridge a captured region, whose fused run returns each group's gradients joined)."""

    def __new__(cls, params):
        import torch

        class Squares(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.params = torch.nn.ParameterList(params)

            def forward(self, scale):  # (a module call is captured when it takes a tensor)
                return sum(p.square().sum() for p in self.params) * scale

        return Squares()


def _measure(options):
    """One process: every case under one runtime; prints one JSON line per case."""
    import torch

    bridged = options.runtime.startswith("bridge")
    if bridged:
        import bridge
        from bridge.runtime import capture

        bridge.activate(mode="eager" if options.runtime == "bridge-eager" else "captured")
    device = "cuda" if bridged or torch.cuda.is_available() else "cpu"
    params = _parameters(options.tiny, device)
    squares = _Squares(params) if options.backward else None
    scale = torch.tensor(5e-4, device=device)
    only = set(options.only.split(",")) if options.only else None
    for name, kwargs, implementations in OPTIMIZERS:
        if only and name.lower() not in only:
            continue
        for implementation in implementations:
            if device == "cpu" and implementation in ("capturable",):
                continue  # torch's capturable needs an accelerator
            record = {"runtime": options.runtime, "optimizer": name, "implementation": implementation}
            try:
                optimizer = getattr(torch.optim, name)(params, **kwargs, **FLAGS[implementation])
                optimizer.step()
                # --schedule: a cosine learning-rate schedule stepped after each step, as training
                # scripts do (a new Python float `lr` each step).
                schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 1000) if options.schedule else None
            except RuntimeError as error:  # an implementation torch lacks on this device
                print("RESULT " + json.dumps({**record, "error": str(error).splitlines()[0][:200]}), flush=True)
                continue
            times, host, programs = [], [], []
            profile = cProfile.Profile() if options.profile else None
            for step in range(2 + options.steps):
                if profile is not None and step == 2:
                    profile.enable()
                if squares is not None:
                    optimizer.zero_grad(set_to_none=True)
                    squares(scale).backward()
                before = sum(capture.fused_steps.values()) if bridged else 0
                torch.cuda.synchronize() if device == "cuda" else None
                start = time.perf_counter()
                optimizer.step()
                returned = time.perf_counter()
                if device == "cuda":
                    torch.cuda.synchronize()
                if schedule is not None:
                    schedule.step()
                if step >= 2:
                    times.append((time.perf_counter() - start) * 1e3)
                    host.append((returned - start) * 1e3)
                    programs.append(sum(capture.fused_steps.values()) - before if bridged else None)
            if profile is not None:
                profile.disable()
                print(f"PROFILE {options.runtime} {name} {implementation}", flush=True)
                pstats.Stats(profile, stream=sys.stdout).sort_stats(os.environ.get("PROFILE_SORT", "tottime")).print_stats(int(os.environ.get("PROFILE_ROWS", "25")))
            # Steps back to back, one synchronization at the end: the rate a training loop sees
            # when the host runs ahead.
            start = time.perf_counter()
            for _ in range(options.steps):
                optimizer.step()
                if schedule is not None:
                    schedule.step()
            if device == "cuda":
                torch.cuda.synchronize()
            pipelined = (time.perf_counter() - start) * 1e3 / options.steps
            record.update({
                "ms": round(statistics.median(times), 3),
                "spread": [round(min(times), 3), round(max(times), 3)],
                "programs_per_step": programs[-1] if bridged else None,
                "host_ms": round(statistics.median(host), 3),  # until step() returned
                "pipelined_ms": round(pipelined, 3),
                "program_ms": _program_ms(optimizer) if bridged else None,
            })
            print("RESULT " + json.dumps(record), flush=True)
            del optimizer
            gc.collect()


def _program_ms(optimizer):
    """The median time of a captured step's compiled program alone (called directly on its
    current inputs, synchronized), or None where the step is not one (Adam's, AdamW's and
    SGD's own update programs are timed by optimizer_update.py)."""
    import jax

    from bridge.patches import optim
    from bridge.runtime import capture, random

    region = optim._step_regions.get(optimizer)
    if region is None or not region.region.programs:
        return None
    program = next(iter(region.region.programs.values()))
    if program.infer is None:
        return None
    roots, _ = capture._gather(program, [])  # (a pack of parameters as its one flat array)
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    inputs = [capture.read_value(grad) for grad in grads if grad is not None][: len(program.tensor_positions)]
    if len(inputs) != len(program.tensor_positions):
        return None
    times = []
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(program.infer(roots, inputs, random.current_key()))
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="GPT-2 small's 148 parameters at width 64 (the host's time, on a CPU)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", default="", help="optimizers by lower-case name, comma-separated")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="optimizer_steps")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed steps of each case (printed with the logs; PROFILE_SORT and PROFILE_ROWS set its order and rows)")
    parser.add_argument("--eager", action="store_true", help="also the bridge's eager mode (each torch op a call; a table of its own)")
    parser.add_argument("--schedule", action="store_true", help="a cosine learning-rate schedule stepped after each step")
    parser.add_argument("--backward", action="store_true",
                        help="gradients made by a backward before each timed step (untimed), as training makes them")
    parser.add_argument("--runtime", choices=["torch", "bridge", "bridge-eager"], help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.runtime:
        _measure(options)
        return 0

    records, logs = [], {}
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    for runtime in ("torch", "bridge") + (("bridge-eager",) if options.eager else ()):
        command = [sys.executable, __file__, "--runtime", runtime, "--steps", str(options.steps)]
        command += ["--tiny"] if options.tiny else []
        command += ["--only", options.only] if options.only else []
        command += ["--profile"] if options.profile else []
        command += ["--schedule"] if options.schedule else []
        command += ["--backward"] if options.backward else []
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        output = done.stdout + done.stderr
        logs[runtime] = output[-3000:]
        for line in done.stdout.splitlines():
            if line.startswith("RESULT "):
                records.append(json.loads(line[len("RESULT "):]))
        if done.returncode:
            print(output[-3000:], file=sys.stderr)

    def ms(runtime, name, implementation):
        for record in records:
            if (record["runtime"], record["optimizer"], record["implementation"]) == (runtime, name, implementation):
                return record if "ms" in record else None
        return None

    lines = [
        "| optimizer | torch fastest | torch ms | bridge implementation | bridge ms | programs a step | bridge / torch fastest | bridge host ms | bridge pipelined ms | its program alone ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for name, _, implementations in OPTIMIZERS:
        torch_rows = [r for r in (ms("torch", name, i) for i in implementations) if r]
        if not torch_rows:
            continue
        fastest = min(torch_rows, key=lambda r: r["ms"])
        ratios = []
        for implementation in implementations:
            row = ms("bridge", name, implementation)
            if row is None:
                continue
            ratio = row["ms"] / fastest["ms"]
            ratios.append(ratio)
            lines.append(
                f"| {name} | {fastest['implementation']} | {fastest['ms']} | {implementation} | {row['ms']} | "
                f"{row['programs_per_step']} | {ratio:.2f} | {row['host_ms']} | {row['pipelined_ms']} | {row['program_ms'] or '-'} |"
            )
        if ratios:
            summary.append({"optimizer": name, "torch_fastest": fastest["implementation"], "worst_ratio": round(max(ratios), 3), "best_ratio": round(min(ratios), 3)})
    torch_table = ["| optimizer | implementation | torch ms (median) | min-max | host ms | pipelined ms |", "|---|---|---|---|---|---|"]
    torch_table += [
        f"| {r['optimizer']} | {r['implementation']} | {r['ms']} | {r['spread'][0]}-{r['spread'][1]} | {r['host_ms']} | {r['pipelined_ms']} |"
        if "ms" in r else f"| {r['optimizer']} | {r['implementation']} | not run: {r['error']} | |"
        for r in records if r["runtime"] == "torch"
    ]
    eager_table = ["| optimizer | implementation | torch ms | bridge eager ms | bridge eager / torch | host ms |", "|---|---|---|---|---|---|"]
    for r in records:
        reference = ms("torch", r["optimizer"], r["implementation"]) if r["runtime"] == "bridge-eager" else None
        if reference is not None and "ms" in r:
            eager_table.append(
                f"| {r['optimizer']} | {r['implementation']} | {reference['ms']} | {r['ms']} | {r['ms'] / reference['ms']:.2f} | {r['host_ms']} |"
            )
    eager_text = (
        "\n## The bridge's eager mode, against torch's same implementation\n\n" + "\n".join(eager_table) + "\n"
        if options.eager else ""
    )
    versions = machine.versions()
    command = "python benchmarks/optimizer_steps.py" + (" --tiny" if options.tiny else "") + (f" --only {options.only}" if options.only else "") + (" --eager" if options.eager else "") + (" --schedule" if options.schedule else "") + (" --backward" if options.backward else "")
    text = (
        f"# Optimizer steps: torch and the bridge on GPT-2 {'small (width 64)' if options.tiny else 'small'}'s parameters\n\n"
        f"Command: `{command}`; generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n"
        f"Machine and versions: {json.dumps(versions)}\n\n"
        "Median ms a step (step + device synchronization), over "
        f"{options.steps} steps after 3. Each bridge implementation against torch's fastest for that optimizer:\n\n"
        + "\n".join(lines) + "\n\n## torch, every implementation\n\n" + "\n".join(torch_table) + "\n" + eager_text
    )
    machine.write_results(options.out, options.name, {"versions": versions, "command": command, "records": records, "summary": summary, "logs": logs}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
