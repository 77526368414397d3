"""Host cost of single ops in eager mode: the bridge against raw JAX (the same op as a jitted,
cached executable: JAX's own dispatch cost) and native torch, on whatever machine it runs on
(torch CUDA and JAX's GPU backend on a GPU machine; both on the CPU elsewhere). The ops are
those real training loops run between the model and the optimizer, and small arithmetic.

    python benchmarks/op_overhead.py [--number 500] [--out DIR] [--name NAME] [--only TEXT]

Each figure is the median over 7 repeats of `number` calls, the device synchronized at the end
of each repeat (so a figure is the host's cost per call where the op is small, and the device's
where it is not). The bridge's and raw JAX's repeats of one op alternate (JAX, bridge, JAX, ...),
so that a shared machine's drift reaches both alike; torch's run before the bridge is activated. Ratios: bridge / raw JAX (goal: at most 2x) and bridge / torch. Loop-level
rows (zero_grad, a scheduler step, an accuracy computation) have no single JAX op: they are
compared with torch only. Writes <out>/<name>.{md,json}.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import machine  # noqa: E402


def _warm(function, sync):
    for _ in range(3):
        function()  # warm: compiles, caches
    sync()


def _sample(function, sync, number):
    start = time.perf_counter()
    for _ in range(number):
        result = function()
    sync(result)
    return (time.perf_counter() - start) / number * 1e6


def per_call_us(function, sync, number, repeat=7):
    _warm(function, sync)
    return statistics.median(_sample(function, sync, number) for _ in range(repeat))


def alternated_us(first, second, number, repeat=7):
    """Medians of two (function, sync) pairs measured in turn, repeat by repeat."""
    _warm(*first)
    _warm(*second)
    samples = [(_sample(*first, number), _sample(*second, number)) for _ in range(repeat)]
    return statistics.median(a for a, _ in samples), statistics.median(b for _, b in samples)


def torch_cases(torch, device):
    """name -> (setup() -> state, call(state) -> result). The same code serves native torch and
    the bridge (whose device name is `cuda` too)."""
    F = torch.nn.functional

    def tensors(*shapes):
        generator = torch.Generator().manual_seed(0)
        return [torch.randn(*shape, generator=generator).to(device) for shape in shapes]

    def model_and_optimizer():
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(10)]).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        return model, optimizer

    def scheduler():
        _, optimizer = model_and_optimizer()
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 1000)

    def manual_sgd(state):
        # pytorch/examples word_language_model's update
        model, _ = state
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)

    def accuracy_inputs():
        logits, = tensors((64, 1000))
        target = torch.randint(0, 1000, (64,), generator=torch.Generator().manual_seed(1)).to(device)
        return logits, target

    def accuracy(state):
        # pytorch/examples imagenet's accuracy(): top-5, then each k's correct count
        logits, target = state
        _, pred = logits.topk(5, 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / 64) for k in (1, 5)]

    return {
        "add 64x64": (lambda: tensors((64, 64), (64, 64)), lambda s: torch.add(s[0], s[1])),
        "a + b 64x64": (lambda: tensors((64, 64), (64, 64)), lambda s: s[0] + s[1]),
        "mul by scalar 64x64": (lambda: tensors((64, 64)), lambda s: s[0] * 0.5),
        "add_ in place 64x64": (lambda: tensors((64, 64), (64, 64)), lambda s: s[0].add_(s[1], alpha=0.01)),
        "mm 64x64": (lambda: tensors((64, 64), (64, 64)), lambda s: s[0] @ s[1]),
        "mm 1024x1024": (lambda: tensors((1024, 1024), (1024, 1024)), lambda s: s[0] @ s[1]),
        "sum 64x1000": (lambda: tensors((64, 1000)), lambda s: s[0].sum()),
        "mean over dim 64x1000": (lambda: tensors((64, 1000)), lambda s: s[0].mean(1)),
        "softmax 64x1000": (lambda: tensors((64, 1000)), lambda s: F.softmax(s[0], dim=-1)),
        "relu 64x1000": (lambda: tensors((64, 1000)), lambda s: F.relu(s[0])),
        "cross_entropy 64x1000": (accuracy_inputs, lambda s: F.cross_entropy(s[0], s[1])),
        "topk 5 of 64x1000": (lambda: tensors((64, 1000)), lambda s: s[0].topk(5, 1)[1]),
        "argmax 64x1000": (lambda: tensors((64, 1000)), lambda s: s[0].argmax(1)),
        "eq + sum 64": (accuracy_inputs, lambda s: s[0].argmax(1).eq(s[1]).sum()),
        "slice x[:, 0]": (lambda: tensors((64, 64)), lambda s: s[0][:, 0]),
        "view": (lambda: tensors((64, 64)), lambda s: s[0].view(4096)),
        "to bfloat16": (lambda: tensors((64, 64)), lambda s: s[0].to(torch.bfloat16)),
        "cat of two": (lambda: tensors((64, 64), (64, 64)), lambda s: torch.cat([s[0], s[1]])),
        "where": (lambda: tensors((64, 64), (64, 64)), lambda s: torch.where(s[0] > 0, s[0], s[1])),
        "item of a sum": (lambda: tensors((64, 64)), lambda s: s[0].sum().item()),
        "host tensor to the device 64x64": (lambda: [torch.randn(64, 64)], lambda s: s[0].to(device)),
        # loop-level work, torch only
        "manual SGD p.data.add_(p.grad), 20 params": (model_and_optimizer, manual_sgd),
        "accuracy top-1/top-5 (imagenet)": (accuracy_inputs, accuracy),
        "zero_grad(set_to_none=True), 20 params": (model_and_optimizer, lambda s: s[1].zero_grad(set_to_none=True)),
        "lr scheduler step": (scheduler, lambda s: s.step()),
    }


def jax_cases(jax, jnp):
    """name -> (setup() -> arrays, jitted call). The same ops as jitted programs."""
    import numpy as np
    from jax import lax

    # Their dtypes spelled out: they are made after the bridge is activated, which turns on JAX's
    # 64-bit mode (its defaults would be float64 and int64 there).
    def arrays(*shapes):
        key = jax.random.PRNGKey(0)
        return [jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) for i, shape in enumerate(shapes)]

    def labels():
        return arrays((64, 1000))[0], jax.random.randint(jax.random.PRNGKey(1), (64,), 0, 1000, jnp.int32)

    jit = jax.jit
    greater, where, argmax, equal, total = jit(lambda a: a > 0), jit(jnp.where), jit(lambda a: a.argmax(1)), jit(jnp.equal), jit(jnp.sum)
    log_softmax = jit(lambda a: jax.nn.log_softmax(a, axis=-1))
    nll = jit(lambda logp, t: -jnp.mean(jnp.take_along_axis(logp, t[:, None], axis=1)))
    # torch runs these as several ops (where: gt, then where; cross_entropy: log_softmax, then
    # nll_loss): JAX runs as many programs, one per op.
    return {
        "add 64x64": (lambda: arrays((64, 64), (64, 64)), jit(jnp.add)),
        "a + b 64x64": (lambda: arrays((64, 64), (64, 64)), jit(lambda a, b: a + b)),
        "mul by scalar 64x64": (lambda: arrays((64, 64)), jit(lambda a: a * 0.5)),
        "add_ in place 64x64": (lambda: arrays((64, 64), (64, 64)), _chained(jit(lambda a, b: a + 0.01 * b))),
        "mm 64x64": (lambda: arrays((64, 64), (64, 64)), jit(lambda a, b: jnp.matmul(a, b, precision="highest"))),
        "mm 1024x1024": (lambda: arrays((1024, 1024), (1024, 1024)), jit(lambda a, b: jnp.matmul(a, b, precision="highest"))),
        "sum 64x1000": (lambda: arrays((64, 1000)), jit(jnp.sum)),
        "mean over dim 64x1000": (lambda: arrays((64, 1000)), jit(lambda a: a.mean(1))),
        "softmax 64x1000": (lambda: arrays((64, 1000)), jit(lambda a: jax.nn.softmax(a, axis=-1))),
        "relu 64x1000": (lambda: arrays((64, 1000)), jit(jax.nn.relu)),
        "cross_entropy 64x1000": (labels, lambda a, t: nll(log_softmax(a), t)),
        "topk 5 of 64x1000": (lambda: arrays((64, 1000)), jit(lambda a: lax.top_k(a, 5)[1])),
        "argmax 64x1000": (lambda: arrays((64, 1000)), jit(lambda a: a.argmax(1))),
        "eq + sum 64": (labels, lambda a, t: total(equal(argmax(a), t))),
        "slice x[:, 0]": (lambda: arrays((64, 64)), jit(lambda a: a[:, 0])),
        "view": (lambda: arrays((64, 64)), jit(lambda a: a.reshape(4096))),
        "to bfloat16": (lambda: arrays((64, 64)), jit(lambda a: a.astype(jnp.bfloat16))),
        "cat of two": (lambda: arrays((64, 64), (64, 64)), jit(lambda a, b: jnp.concatenate([a, b]))),
        "where": (lambda: arrays((64, 64), (64, 64)), lambda a, b: where(greater(a), a, b)),
        "item of a sum": (lambda: arrays((64, 64)), lambda a: float(_jit_sum(a))),
        "host tensor to the device 64x64": (lambda: [np.ones((64, 64), np.float32)], jax.device_put),
    }


_jit_sum = None


def _chained(update):
    """An in-place update as JAX writes one: each call takes the previous call's result (a chain
    of dependent calls, as `x.add_(...)` repeated makes on the bridge)."""
    last = {}

    def call(a, b):
        last["a"] = update(last.get("a", a), b)
        return last["a"]

    return call


def _floors(torch, jax, jnp, number):
    """The costs no Python tensor subclass avoids: torch's dispatch of `torch.add` to a
    `__torch_dispatch__` that returns at once, and making the wrapper tensor of a result; with
    raw JAX's jitted add beside them, the least a bridge op can cost."""

    class Noop(torch.Tensor):
        @staticmethod
        def __new__(cls):
            return torch.Tensor._make_wrapper_subclass(cls, (64, 64), dtype=torch.float32)

        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return made

    made, a, b = Noop(), Noop(), Noop()
    add = jax.jit(jnp.add)
    x = jnp.ones((64, 64))

    def no_sync(result=None):
        pass

    return {
        "torch.add dispatched to a subclass that returns at once": per_call_us(lambda: torch.add(a, b), no_sync, number),
        "a wrapper subclass tensor made (the result's)": per_call_us(
            lambda: torch.Tensor._make_wrapper_subclass(Noop, (64, 64), dtype=torch.float32), no_sync, number
        ),
        "raw JAX's jitted add of 64x64": per_call_us(lambda: add(x, x), lambda result=None: jax.block_until_ready(result), number),
    }


def main(argv=None):
    global _jit_sum
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=500)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="op_overhead")
    parser.add_argument("--only", default="", help="run only the rows whose name contains this")
    options = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import torch

    _jit_sum = jax.jit(jnp.sum)
    native = "cuda" if torch.cuda.is_available() else "cpu"
    if native == "cpu":
        torch.set_num_threads(1)
    results = {}

    def sync_torch(result=None):
        if native == "cuda":
            torch.cuda.synchronize()

    def chosen(cases):
        return {name: case for name, case in cases.items() if options.only in name}

    for name, (setup, call) in chosen(torch_cases(torch, native)).items():
        state = setup()
        results.setdefault(name, {})["torch"] = per_call_us(lambda: call(state), sync_torch, options.number)
        print(f"torch {name}: {results[name]['torch']:.1f} us", flush=True)

    def sync_jax(result=None):
        if result is not None:
            jax.block_until_ready(result)

    import bridge
    from bridge.runtime.tensor import BridgeTensor, read_value

    bridge.activate(mode="eager")

    def sync_bridge(result=None):
        leaves = result if isinstance(result, (list, tuple)) else [result]
        values = [read_value(leaf) for leaf in leaves if isinstance(leaf, BridgeTensor)]
        if values:
            jax.block_until_ready(values)
        torch.cuda.synchronize()

    raw = chosen(jax_cases(jax, jnp))
    for name, (setup, call) in chosen(torch_cases(torch, "cuda")).items():
        state = setup()
        bridged = (lambda: call(state), sync_bridge)
        if name in raw:
            arrays = raw[name][0]()
            results[name]["jax"], results[name]["bridge"] = alternated_us(
                (lambda: raw[name][1](*arrays), sync_jax), bridged, options.number
            )
            print(f"jax {name}: {results[name]['jax']:.1f} us", flush=True)
        else:
            results[name]["bridge"] = per_call_us(*bridged, options.number)
        print(f"bridge {name}: {results[name]['bridge']:.1f} us", flush=True)
    bridge.deactivate()
    floors = _floors(torch, jax, jnp, options.number)

    versions = dict(machine.versions(), backend=jax.default_backend())
    rows = ["| op | bridge us | raw JAX us | torch us | bridge / JAX | bridge / torch |", "|---|---|---|---|---|---|"]
    over = []
    for name, figures in results.items():
        jax_us = figures.get("jax")
        to_jax = figures["bridge"] / jax_us if jax_us else None
        if to_jax is not None and to_jax > 2.0:
            over.append(name)
        rows.append(
            f"| {name} | {figures['bridge']:.1f} | {'-' if jax_us is None else f'{jax_us:.1f}'} | {figures['torch']:.1f} | "
            f"{'-' if to_jax is None else f'{to_jax:.2f}'} | {figures['bridge'] / figures['torch']:.2f} |"
        )
    command = f"python benchmarks/op_overhead.py --number {options.number}" + (f" --only '{options.only}'" if options.only else "")
    ratios = sorted(figures["bridge"] / figures["jax"] for figures in results.values() if figures.get("jax"))
    text = (
        f"# Eager op overhead: the bridge, raw JAX and torch ({native} torch, JAX on {versions['backend']})\n\n"
        f"Command: `{command}`; generated "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\nMachine and versions: {json.dumps(versions)}\n\n"
        "Median microseconds a call (7 repeats; the device synchronized at the end of each repeat; the bridge's "
        "and raw JAX's repeats alternate).\n\n"
        + "\n".join(rows)
        + (f"\n\nbridge / raw JAX: median {statistics.median(ratios):.2f}x, largest {max(ratios):.2f}x; "
           f"above 2x: {', '.join(over) or 'none'}.\n\n" if ratios else "\n\n")
        + "What any op of a Python tensor subclass pays before the bridge's own Python (microseconds a call):\n\n"
        + "\n".join(f"- {name}: {value:.1f}" for name, value in floors.items())
        + "\n"
    )
    data = {"versions": versions, "number": options.number, "results": results, "above_2x": over, "floors": floors}
    machine.write_results(options.out, options.name, data, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
