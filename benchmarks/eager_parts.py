"""Where an eager op's host time goes under the bridge, and what torch.cuda.synchronize costs it.

    python benchmarks/eager_parts.py [--number 300]

Eager ops (the bridge's eager mode): for a few of `op_overhead.py`'s rows, the op as the script
calls it; its cached program called directly on the same arrays (the XLA call the bridge makes);
and a raw jitted JAX function on those arrays and on fresh ones. Each figure is the median over 7
repeats of `number` calls, synchronized once a repeat, in microseconds a call. The op less its
program is the bridge's own cost (torch's dispatch into Python, the bridge's Python, the result's
wrapper). Then a cProfile of two ops.

Synchronize (captured mode): after captured AdamW steps on GPT-2 small's parameters
(`optimizer_steps.py`'s), `torch.cuda.synchronize()` with everything done, its parts
(`jax.live_arrays()`, one batched block on them) and a tiny program's round trip; then a step
followed by each way of waiting.
"""

import argparse
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from op_overhead import per_call_us  # noqa: E402  (the same warm-up and median of 7 repeats)


def _us(function, sync, number):
    return round(per_call_us(function, sync, number), 1)


def _direct_entries(plan):
    """The direct-call table (runtime/dispatch.py's `direct`) behind an op's plan, or None."""
    seen, todo = set(), [plan]
    while todo:
        function = todo.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        table = getattr(function, "direct", None)
        if isinstance(table, dict) and table:
            return table
        for cell in getattr(function, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if callable(value):
                todo.append(value)
    return None


def eager(number):
    import bridge

    bridge.activate(mode="eager")
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F
    from bridge.runtime import dispatch

    aten = torch.ops.aten
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(64, 64, generator=generator).to("cuda") for _ in range(2))
    wide = torch.randn(64, 1000, generator=generator).to("cuda")
    A, B, WIDE = (dispatch.read_value(t) for t in (a, b, wide))
    fresh = [jax.random.normal(jax.random.PRNGKey(i), shape, jnp.float32) for i, shape in enumerate([(64, 64), (64, 64), (64, 1000)])]
    def torch_sync(out=None):
        torch.cuda.synchronize()

    def jax_sync(out=None):
        if out is not None:
            jax.block_until_ready(out)

    cases = [
        ("to bfloat16", aten._to_copy.default, lambda: a.to(torch.bfloat16), jax.jit(lambda x: x.astype(jnp.bfloat16)), [A], [fresh[0]]),
        ("cat of two", aten.cat.default, lambda: torch.cat([a, b]), jax.jit(lambda x, y: jnp.concatenate([x, y])), [A, B], fresh[:2]),
        ("add", aten.add.Tensor, lambda: torch.add(a, b), jax.jit(jnp.add), [A, B], fresh[:2]),
        ("softmax", aten._softmax.default, lambda: F.softmax(wide, -1), jax.jit(lambda x: jax.nn.softmax(x, axis=-1)), [WIDE], [fresh[2]]),
        ("topk", aten.topk.default, lambda: wide.topk(5, 1)[1], jax.jit(lambda x: jax.lax.top_k(x, 5)[1]), [WIDE], [fresh[2]]),
    ]
    print("| op | bridge us | its program alone us | raw jit, same arrays us | raw jit, fresh arrays us |")
    print("|---|---|---|---|---|")
    for name, op, bridged, raw, same, new in cases:
        full = _us(bridged, torch_sync, number)
        table = _direct_entries(dispatch._plans.get(op))
        alone = "-"
        if table:
            program, _ = list(table.values())[-1]
            arrays = same  # the program takes the tensors' arrays, a list's in place of the list
            alone = _us(lambda: program(arrays), jax_sync, number)
        print(f"| {name} | {full} | {alone} | {_us(lambda: raw(*same), jax_sync, number)} | {_us(lambda: raw(*new), jax_sync, number)} |", flush=True)
    for name, function in (("to bfloat16", cases[0][2]), ("cat of two", cases[1][2])):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            function()
        torch.cuda.synchronize()
        profile.disable()
        print(f"\ncProfile, {name}, 2000 calls:")
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(14)


def synchronize(tiny):
    import bridge

    bridge.activate(mode="captured")
    import jax
    import jax.numpy as jnp
    import torch

    import optimizer_steps

    params = optimizer_steps._parameters(tiny, "cuda")
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    for _ in range(4):
        optimizer.step()
    torch.cuda.synchronize()
    live = jax.live_arrays()
    round_trip = jax.jit(lambda: jnp.zeros((), jnp.float32))
    round_trip().block_until_ready()

    def median_us(function, number=200):
        samples = []
        for _ in range(number):
            start = time.perf_counter()
            function()
            samples.append((time.perf_counter() - start) * 1e6)
        return round(statistics.median(samples), 1)

    print(f"live arrays after the steps: {len(live)}")
    print(f"torch.cuda.synchronize(), all done: {median_us(torch.cuda.synchronize)} us")
    print(f"jax.live_arrays(): {median_us(jax.live_arrays)} us")
    print(f"one batched block on them: {median_us(lambda: jax.block_until_ready(live))} us")
    print(f"a tiny program's round trip: {median_us(lambda: round_trip().block_until_ready())} us")
    for name, wait in (("torch.cuda.synchronize()", torch.cuda.synchronize), ("a tiny program's round trip", lambda: round_trip().block_until_ready())):
        totals = []
        for _ in range(30):
            torch.cuda.synchronize()
            start = time.perf_counter()
            optimizer.step()
            wait()
            totals.append((time.perf_counter() - start) * 1e3)
        print(f"a step, then {name}: {statistics.median(totals):.3f} ms (median of 30)", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=300)
    parser.add_argument("--tiny", action="store_true", help="GPT-2 small's parameters at width 64 for the synchronize part (a CPU)")
    parser.add_argument("--part", choices=["eager", "synchronize"], help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.part == "eager":
        eager(options.number)
        return 0
    if options.part == "synchronize":
        synchronize(options.tiny)
        return 0
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for part in ("eager", "synchronize"):  # one process each: each activates the bridge its own way
        command = [sys.executable, __file__, "--part", part, "--number", str(options.number)] + (["--tiny"] if options.tiny else [])
        subprocess.run(command, env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
