"""CPU micro-benchmarks: per-op overhead of the bridge against raw `jnp` and torch, the cost to
plain CPU tensors while the bridge is active, and a small GPT's training step captured against
hand-written JAX. One process, one machine, side by side.

    python benchmarks/cpu_overhead.py [--out benchmarks/results] [--name cpu_overhead]

Times are medians of repeated timing loops (microseconds per call, or milliseconds per step).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import machine  # noqa: E402


def per_call_us(function, number=2000, repeat=7):
    function()  # warm: compiles, caches
    function()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            function()
        samples.append((time.perf_counter() - start) / number * 1e6)
    return statistics.median(samples)


def block(value):
    import jax

    return jax.block_until_ready(value)


def step_ms(step, steps=30):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[steps // 2 :]) * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="cpu_overhead")
    options = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    torch.set_num_threads(1)
    rows = []

    def row(label, value, unit):
        rows.append({"measure": label, "value": round(value, 2), "unit": unit})
        print(f"{label}: {value:.2f} {unit}", flush=True)

    a, b = torch.randn(16, 16), torch.randn(16, 16)
    m1, m2 = torch.randn(64, 64), torch.randn(64, 64)

    ja, jb = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
    jnp_add = per_call_us(lambda: block(jnp.add(ja, jb)))
    row("jnp add 16x16, eager", jnp_add, "us")
    jitted_add = jax.jit(jnp.add)
    row("jax.jit add 16x16", per_call_us(lambda: block(jitted_add(ja, jb))), "us")
    jm1, jm2 = jnp.asarray(m1.numpy()), jnp.asarray(m2.numpy())
    jnp_mm = per_call_us(lambda: block(jnp.matmul(jm1, jm2)))
    row("jnp matmul 64x64, eager", jnp_mm, "us")

    # Plain torch CPU tensors just before the bridge is activated (JAX already running).
    torch_add = per_call_us(lambda: torch.add(a, b))
    row("torch add 16x16 (CPU tensor, bridge inactive)", torch_add, "us")
    torch_mm = per_call_us(lambda: m1 @ m2)
    row("torch matmul 64x64 (CPU tensor, bridge inactive)", torch_mm, "us")

    import bridge
    from bridge.runtime.tensor import read_value

    bridge.activate(mode="eager")
    torch_add_active = per_call_us(lambda: torch.add(a, b))
    row("torch add 16x16 (CPU tensor, bridge active)", torch_add_active, "us")
    torch_mm_active = per_call_us(lambda: m1 @ m2)
    row("torch matmul 64x64 (CPU tensor, bridge active)", torch_mm_active, "us")
    ba, bb = a.cuda(), b.cuda()
    bridge_add = per_call_us(lambda: block(read_value(torch.add(ba, bb))))
    row("bridge eager add 16x16", bridge_add, "us")
    bridge_operator = per_call_us(lambda: block(read_value(ba + bb)))
    row("bridge eager a + b 16x16", bridge_operator, "us")
    bm1, bm2 = m1.cuda(), m2.cuda()
    bridge_mm = per_call_us(lambda: block(read_value(bm1 @ bm2)))
    row("bridge eager matmul 64x64", bridge_mm, "us")

    # A small MLP training step: torch CPU, bridge eager, bridge captured.
    def mlp_step(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(32, 64).to(device), torch.randint(0, 10, (32,)).to(device)

        def step():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss.item()

        return step

    bridge.set_mode("eager")
    row("small MLP step, bridge eager", step_ms(mlp_step("cuda")), "ms")
    bridge.set_mode("captured")
    row("small MLP step, bridge captured", step_ms(mlp_step("cuda")), "ms")
    bridge.deactivate()
    row("small MLP step, torch CPU", step_ms(mlp_step("cpu")), "ms")

    # A small GPT: bridge captured (the unmodified torch step) against hand-written JAX.
    import jax_models
    import models

    config = dict(layers=2, heads=4, width=128, vocab=512, block=64)
    jax_step = jax_models.gpt_setup(config, batch=8, bf16=False)
    jax_ms = step_ms(jax_step)
    row("small GPT step, hand-written JAX", jax_ms, "ms")
    torch_model = models.gpt_setup("cpu", config, batch=8)
    torch_ms = step_ms(lambda: models.gpt_step(*torch_model, bf16=False))
    row("small GPT step, torch CPU", torch_ms, "ms")
    bridge.activate(mode="captured")
    # The JAX version runs at XLA's default precision; so does the bridge once torch asks for
    # "high" (torch's CPU kernels are full float32 either way).
    torch.set_float32_matmul_precision("high")
    bridge_model = models.gpt_setup("cuda", config, batch=8)
    bridge_ms = step_ms(lambda: models.gpt_step(*bridge_model, bf16=False))
    row("small GPT step, bridge captured", bridge_ms, "ms")
    bridge.deactivate()

    ratios = [
        f"- bridge eager torch.add / raw jnp add: {bridge_add / jnp_add:.2f}x (goal: at most 2x)",
        f"- bridge eager a + b / raw jnp add: {bridge_operator / jnp_add:.2f}x (goal: at most 2x)",
        f"- bridge eager matmul / raw jnp matmul: {bridge_mm / jnp_mm:.2f}x (goal: at most 2x)",
        f"- plain CPU tensors while active, add: {torch_add_active / torch_add:.2f}x; matmul: {torch_mm_active / torch_mm:.2f}x (goal: at most 1.1x)",
        f"- small GPT, bridge captured / hand-written JAX: {bridge_ms / jax_ms:.2f}x (goal: at most 1.1x)",
    ]
    info = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "jax": jax.__version__,
        "numpy": np.__version__,
    }
    table = "\n".join(f"| {r['measure']} | {r['value']} {r['unit']} |" for r in rows)
    text = (
        f"# {options.name}\n\nCommand: `python benchmarks/cpu_overhead.py`; generated "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch threads 1.\n\nMachine: {json.dumps(info)}\n\n"
        f"| measure | median |\n|---|---|\n{table}\n\n## Ratios (same run)\n\n" + "\n".join(ratios) + "\n"
    )
    machine.write_results(options.out, options.name, {"machine": info, "rows": rows, "ratios": ratios}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
