"""The optimizer's update program alone, in the layouts it could take: GPT-2 small's 148
parameters, AdamW with the clip folded in and SGD with momentum, their moments in flat arrays.

    python benchmarks/optimizer_update.py [--tiny]

Layouts (each a jitted program donating the parameters and the flat state, as the bridge calls
it; results compared with the first's):
- per-parameter: each parameter's new moments computed from its slices, then concatenated
  into new flat arrays (runtime.optimizers before 2026-11-24);
- flat joined: the gradients concatenated once, the moments updated as whole flat arrays,
  each parameter's update reading its slice of the new moments (runtime.optimizers' Adam now;
  its SGD from 2026-11-24 to 11-26, and on backends other than GPUs now);
- flat spans: each parameter's moments read from and written back into their span of the
  flat arrays, in place (runtime.optimizers' SGD on GPUs now);
- separate (Adam): each parameter's moments in arrays of their own, as torch keeps them;
- flat all (Adam): the parameters joined too, one elementwise pass, the new parameters split.
Each line also gives the number of kernels (fusions and library calls) XLA compiled the program
into.
Prints the median time of a call with the device idle before it, and the time a call of calls
back to back (ms).
"""

import argparse
import functools
import statistics
import sys
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bridge.op_mappings  # noqa: E402,F401 - fills the mapping tables the clip arithmetic goes through
from bridge.runtime import optimizers  # noqa: E402

ADAM_STATIC = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, amsgrad=False, maximize=False, max_norm=1.0, norm_type=2.0)
SGD_STATIC = dict(momentum=0.9, dampening=0.0, weight_decay=1e-4, nesterov=False, maximize=False, first=False, max_norm=None, norm_type=None)


def _adam_per_parameter(params, grads, flat_avgs, flat_sqs, flat_maxes, scalars, clip_grads=None, coefficient=None, **static):
    """runtime.optimizers.adam_update as it was before 2026-11-24 (moments per parameter, then
    concatenated)."""
    grads, clip = optimizers._clipped(grads, clip_grads, coefficient, static["max_norm"], static["norm_type"])
    count = len(params)
    decay, step_sizes, bias2_sqrts = scalars[0], scalars[1 : 1 + count], scalars[1 + count :]
    exp_avgs, exp_avg_sqs = optimizers._split(flat_avgs, params), optimizers._split(flat_sqs, params)
    beta1, beta2, eps = static["beta1"], static["beta2"], static["eps"]
    new_params, new_avgs, new_sqs = [], [], []
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        dtype = param.dtype
        param = param * decay.astype(dtype)
        exp_avg = optimizers._lerp(exp_avg, grad, jnp.asarray(1 - beta1, dtype))
        exp_avg_sq = exp_avg_sq * jnp.asarray(beta2, dtype)
        exp_avg_sq = exp_avg_sq + jnp.asarray(1 - beta2, dtype) * grad * grad
        denom = jnp.sqrt(exp_avg_sq) / bias2_sqrts[i].astype(dtype) + jnp.asarray(eps, dtype)
        new_params.append(param + step_sizes[i].astype(dtype) * (exp_avg / denom))
        new_avgs.append(exp_avg)
        new_sqs.append(exp_avg_sq)
    return new_params, optimizers._join(new_avgs), optimizers._join(new_sqs), None, clip


def _sgd_per_parameter(params, grads, flat_buffers, lr, clip_grads=None, coefficient=None, **static):
    """Each parameter's buffer from its slice of the flat array, then joined again."""
    new_params, new_buffers, clip = _sgd_separate(params, grads, optimizers._split(flat_buffers, params), lr, clip_grads, coefficient, **static)
    return new_params, optimizers._join(new_buffers), clip


def _adam_spans(params, grads, flat_avgs, flat_sqs, flat_maxes, scalars, clip_grads=None, coefficient=None, **static):
    """Adam with its moments updated span by span in place, as runtime.optimizers.sgd_update
    updates its buffers (for Adam slower on an H100: 6.1 ms against 4.1)."""
    grads, clip = optimizers._clipped(grads, clip_grads, coefficient, static["max_norm"], static["norm_type"])
    count = len(params)
    decay, step_sizes, bias2_sqrts = scalars[0], scalars[1 : 1 + count], scalars[1 + count :]
    dtype = params[0].dtype
    beta1, beta2, eps = static["beta1"], static["beta2"], static["eps"]
    avgs, sqs = optimizers._Spans(flat_avgs), optimizers._Spans(flat_sqs)
    new_params = []
    for i, (param, grad) in enumerate(zip(params, grads)):
        exp_avg = avgs.write(i, optimizers._lerp(avgs.read(i, param), grad, jnp.asarray(1 - beta1, dtype)))
        exp_avg_sq = sqs.read(i, param) * jnp.asarray(beta2, dtype)
        second = sqs.write(i, exp_avg_sq + jnp.asarray(1 - beta2, dtype) * grad * grad)
        param = param * decay.astype(dtype)
        denom = jnp.sqrt(second) / bias2_sqrts[i].astype(dtype) + jnp.asarray(eps, dtype)
        new_params.append(param + step_sizes[i].astype(dtype) * (exp_avg / denom))
    return new_params, avgs.flat, sqs.flat, None, clip


def _adam_separate(params, grads, avgs, sqs, flat_maxes, scalars, clip_grads=None, coefficient=None, **static):
    """Adam with each parameter's moments in arrays of their own (as torch keeps them), all
    donated: no joins, each parameter one elementwise fusion, but three times the arrays to
    hand over on every call."""
    grads, clip = optimizers._clipped(grads, clip_grads, coefficient, static["max_norm"], static["norm_type"])
    count = len(params)
    decay, step_sizes, bias2_sqrts = scalars[0], scalars[1 : 1 + count], scalars[1 + count :]
    beta1, beta2, eps = static["beta1"], static["beta2"], static["eps"]
    new_params, new_avgs, new_sqs = [], [], []
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(zip(params, grads, avgs, sqs)):
        dtype = param.dtype
        exp_avg = optimizers._lerp(exp_avg, grad, jnp.asarray(1 - beta1, dtype))
        exp_avg_sq = exp_avg_sq * jnp.asarray(beta2, dtype) + jnp.asarray(1 - beta2, dtype) * grad * grad
        denom = jnp.sqrt(exp_avg_sq) / bias2_sqrts[i].astype(dtype) + jnp.asarray(eps, dtype)
        new_params.append(param * decay.astype(dtype) + step_sizes[i].astype(dtype) * (exp_avg / denom))
        new_avgs.append(exp_avg)
        new_sqs.append(exp_avg_sq)
    return new_params, new_avgs, new_sqs, None, clip


def _adam_flat_all(params, grads, flat_avgs, flat_sqs, flat_maxes, scalars, clip_grads=None, coefficient=None, **static):
    """Adam with the parameters joined too: one elementwise pass over flat arrays (one step size
    for all, as when every parameter has taken the same number of steps), then the new flat
    parameters split into the parameters' arrays."""
    grads, clip = optimizers._clipped(grads, clip_grads, coefficient, static["max_norm"], static["norm_type"])
    count = len(params)
    decay, step_size, bias2_sqrt = scalars[0], scalars[1], scalars[1 + count]
    dtype = params[0].dtype
    beta1, beta2, eps = static["beta1"], static["beta2"], static["eps"]
    flat_grads, flat_params = optimizers._join(grads), optimizers._join(params)
    flat_avgs = optimizers._lerp(flat_avgs, flat_grads, jnp.asarray(1 - beta1, dtype))
    flat_sqs = flat_sqs * jnp.asarray(beta2, dtype) + jnp.asarray(1 - beta2, dtype) * flat_grads * flat_grads
    denom = jnp.sqrt(flat_sqs) / bias2_sqrt.astype(dtype) + jnp.asarray(eps, dtype)
    flat_params = flat_params * decay.astype(dtype) + step_size.astype(dtype) * (flat_avgs / denom)
    return optimizers._split(flat_params, params), flat_avgs, flat_sqs, None, clip


def _sgd_separate(params, grads, buffers, lr, clip_grads=None, coefficient=None, **static):
    """SGD with each parameter's momentum buffer an array of its own (as torch keeps them)."""
    grads, clip = optimizers._clipped(grads, clip_grads, coefficient, static["max_norm"], static["norm_type"])
    new_params, new_buffers = [], []
    for param, grad, buffer in zip(params, grads, buffers):
        dtype = param.dtype
        grad = grad + jnp.asarray(static["weight_decay"], dtype) * param
        buffer = buffer * jnp.asarray(static["momentum"], dtype) + jnp.asarray(1 - static["dampening"], dtype) * grad
        new_buffers.append(buffer)
        new_params.append(param + (-lr).astype(dtype) * buffer)
    return new_params, new_buffers, clip


def _sgd_joined(params, grads, flat_buffers, lr, clip_grads=None, coefficient=None, **static):
    """runtime.optimizers.sgd_update as it was from 2026-11-24 to 2026-11-26: the gradients
    joined into one flat array, the buffers updated whole, each parameter reading its slice."""
    grads, clip = optimizers._clipped(grads, clip_grads, coefficient, static["max_norm"], static["norm_type"])
    dtype = params[0].dtype
    grads = [grad + jnp.asarray(static["weight_decay"], dtype) * param for grad, param in zip(grads, params)]
    flat_grads = optimizers._join(grads)
    flat_buffers = flat_buffers * jnp.asarray(static["momentum"], dtype) + jnp.asarray(1 - static["dampening"], dtype) * flat_grads
    steps = optimizers._split(flat_buffers, params)
    return [param + (-lr).astype(dtype) * step for param, step in zip(params, steps)], flat_buffers, clip


def _sgd_spans(params, grads, flat_buffers, lr, clip_grads=None, coefficient=None, **static):
    """runtime.optimizers.sgd_update on GPUs: each buffer updated in its span, in place."""
    grads, clip = optimizers._clipped(grads, clip_grads, coefficient, static["max_norm"], static["norm_type"])
    dtype = params[0].dtype
    grads = [grad + jnp.asarray(static["weight_decay"], dtype) * param for grad, param in zip(grads, params)]
    spans = optimizers._Spans(flat_buffers)
    momentum, dampening = jnp.asarray(static["momentum"], dtype), jnp.asarray(1 - static["dampening"], dtype)
    steps = [spans.write(i, spans.read(i, p) * momentum + dampening * g) for i, (p, g) in enumerate(zip(params, grads))]
    return [param + (-lr).astype(dtype) * step for param, step in zip(params, steps)], spans.flat, clip


def gpt2_shapes(tiny):
    import torch

    import models

    config = models.GPT2_TINY if tiny else models.GPT2_SMALL
    with torch.device("meta"):
        model = models.GPT(**config)
    return [tuple(p.shape) for p in model.parameters()]


def _time(function, arguments, donated, repeats):
    """Median ms of a call, feeding each call's results back as the next call's inputs."""
    samples = []
    params, flats = arguments[0], list(arguments[donated[0] : donated[-1] + 1])
    for index in range(repeats + 3):
        call = list(arguments)
        call[0] = params
        call[donated[0] : donated[-1] + 1] = flats
        jax.block_until_ready(call)
        start = time.perf_counter()
        result = function(*call)
        jax.block_until_ready(result)
        if index >= 3:
            samples.append((time.perf_counter() - start) * 1e3)
        params, flats = result[0], list(result[1 : 1 + len(flats)])
    # Calls back to back, one synchronization at the end: the device's time a call where the
    # host runs ahead (its dispatch hidden), or the host's where that is longer.
    start = time.perf_counter()
    for _ in range(repeats):
        call = list(arguments)
        call[0] = params
        call[donated[0] : donated[-1] + 1] = flats
        result = function(*call)
        params, flats = result[0], list(result[1 : 1 + len(flats)])
    jax.block_until_ready(result)
    return statistics.median(samples), (time.perf_counter() - start) * 1e3 / repeats


def _device_time(function, arguments, donated, calls=10):
    """The GPU's busy time a call, the host out of it: the kernels' durations in a profile of
    `calls` calls (JAX's profiler, read back with its ProfileData), summed and divided; and the
    kernels a call. None without a GPU in the profile."""
    import glob
    import tempfile

    from jax._src.lib import _profile_data

    first, last = donated[0], donated[-1] + 1
    params, flats = arguments[0], list(arguments[first:last])
    folder = tempfile.mkdtemp()
    jax.profiler.start_trace(folder)
    for _ in range(calls):
        call = list(arguments)
        call[0] = params
        call[first:last] = flats
        result = function(*call)
        jax.block_until_ready(result)
        params, flats = result[0], list(result[1 : 1 + len(flats)])
    jax.profiler.stop_trace()
    paths = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    total, kernels = 0, 0
    for plane in _profile_data.ProfileData.from_file(paths[0]).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                for event in line.events:
                    total += event.duration_ns
                    kernels += 1
    if not kernels:
        return None
    return total / 1e6 / calls, kernels / calls


def _torch_device_times(repeats):
    """torch's AdamW and SGD steps on the same shapes, each implementation: ms a step with steps
    back to back (CUDA events), run in a process of its own so that JAX's memory is not shared."""
    import subprocess

    code = f"""
import sys, statistics, torch
sys.path.insert(0, {HERE!r})
import optimizer_update as u
shapes = u.gpt2_shapes(False)
params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
for name, make in [
    ("adamw fused", lambda: torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=True)),
    ("adamw foreach", lambda: torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, foreach=True)),
    ("sgd fused", lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4, fused=True)),
    ("sgd foreach", lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True)),
]:
    optimizer = make()
    for _ in range(3):
        optimizer.step()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range({repeats}):
            optimizer.step()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / {repeats})
    print(f"torch {{name:14s}} {{statistics.median(samples):8.3f}} ms a step, steps back to back (CUDA events)", flush=True)
"""
    subprocess.run([sys.executable, "-c", code], check=False)


def _call_costs(repeats):
    """The host's microseconds for a jitted call taking and returning n arrays (the device idle)."""
    for count in (1, 150, 300, 450, 600, 1050):
        arrays = [jnp.ones((256,), jnp.float32) for _ in range(count)]
        function = jax.jit(lambda values: [value + 1 for value in values], donate_argnums=(0,))
        arrays = function(arrays)
        samples = []
        for _ in range(repeats):
            jax.block_until_ready(arrays)
            start = time.perf_counter()
            arrays = function(arrays)
            samples.append(time.perf_counter() - start)
        print(f"host: a jitted call of {count:5d} arrays in and out: {statistics.median(samples) * 1e6:8.1f} us", flush=True)


def _kernels(function, arguments):
    """How many kernels XLA compiled the program into: the fusions and custom calls of its entry
    computation."""
    text = function.lower(*arguments).compile().as_text()
    entry = text[text.index("ENTRY") :]
    return sum(1 for line in entry.splitlines() if " fusion(" in line or " custom-call(" in line or " copy(" in line)


def _distance(values, reference):
    """How far results are from the reference's: identical, or how many differ and by how much
    (the same arithmetic fused differently may round a product and a sum once, as a fused
    multiply-add, or twice)."""
    if np.array_equal(values, reference):
        return "identical"
    differ = np.count_nonzero(values != reference)
    largest = np.max(np.abs(values - reference))
    return f"{differ} of {values.size} values differ, by at most {largest:.1e} (largest value {np.max(np.abs(reference)):.1e})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", action="store_true", help="also the device's time alone (a profile), torch's steps and the host's call costs")
    parser.add_argument("--only", default="", help="layouts to run, comma-separated (default: all)")
    options = parser.parse_args(argv)
    if options.device:
        _torch_device_times(options.repeats)
        _call_costs(options.repeats)
    shapes = gpt2_shapes(options.tiny)
    total = sum(int(np.prod(shape)) for shape in shapes)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}: {len(shapes)} parameters, {total:,} values")
    rng = np.random.default_rng(0)

    def arrays(scale):
        return [jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale) for shape in shapes]

    def fresh_adam():
        params, grads = arrays(0.02), arrays(1e-3)
        avgs = jnp.asarray(rng.standard_normal(total, dtype=np.float32) * 1e-3)
        sqs = jnp.asarray(rng.random(total, dtype=np.float32) * 1e-6)
        scalars = np.array([1 - 3e-4 * 0.1] + [-3e-4 / (1 - 0.9**5)] * len(shapes) + [(1 - 0.999**5) ** 0.5] * len(shapes), np.float32)
        return [params, grads, avgs, sqs, None, scalars, grads]

    def fresh_adam_separate():
        made = fresh_adam()
        made[2], made[3] = optimizers._split(made[2], made[0]), optimizers._split(made[3], made[0])
        return made

    def fresh_sgd_separate():
        made = fresh_sgd()
        made[2] = optimizers._split(made[2], made[0])
        return made

    def fresh_sgd():
        params, grads = arrays(0.02), arrays(1e-3)
        buffers = jnp.asarray(rng.standard_normal(total, dtype=np.float32) * 1e-3)
        return [params, grads, buffers, np.array(0.1, np.float32)]

    cases = (
        ("adam", "per-parameter", _adam_per_parameter, ADAM_STATIC, fresh_adam, (2, 3)),
        ("adam", "flat joined", optimizers.adam_update.__wrapped__, ADAM_STATIC, fresh_adam, (2, 3)),
        ("adam", "flat spans", _adam_spans, ADAM_STATIC, fresh_adam, (2, 3)),
        ("adam", "separate", _adam_separate, ADAM_STATIC, fresh_adam_separate, (2, 3)),
        ("adam", "flat all", _adam_flat_all, ADAM_STATIC, fresh_adam, (2, 3)),
        ("sgd", "per-parameter", _sgd_per_parameter, SGD_STATIC, fresh_sgd, (2,)),
        ("sgd", "flat joined", _sgd_joined, SGD_STATIC, fresh_sgd, (2,)),
        ("sgd", "flat spans", _sgd_spans, SGD_STATIC, fresh_sgd, (2,)),
        ("sgd", "separate", _sgd_separate, SGD_STATIC, fresh_sgd_separate, (2,)),
    )
    unclipped = {"adam": dict(ADAM_STATIC, max_norm=None, norm_type=None), "sgd": dict(SGD_STATIC)}
    reference = {}
    if options.only:
        cases = [case for case in cases if case[1] in options.only.split(",")]
    for optimizer, layout, update, static, fresh, donated in cases:
        function = jax.jit(functools.partial(update, **static), donate_argnums=(0,) + donated)
        rng = np.random.default_rng(0)
        first = function(*fresh())  # one call from the same inputs for every layout, compared below
        values = np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(first[:-1])])
        same = "reference" if optimizer not in reference else _distance(values, reference[optimizer])
        reference.setdefault(optimizer, values)
        rng = np.random.default_rng(1)
        arguments = fresh()
        kernels = _kernels(function, arguments)
        ms, pipelined = _time(function, arguments, donated, options.repeats)
        device = ""
        if options.device:
            bare_function = jax.jit(functools.partial(update, **unclipped[optimizer]), donate_argnums=(0,) + donated)
            for label, timed_function, timed_arguments in (
                ("device alone", function, fresh()),
                ("unclipped", bare_function, fresh()[:6] if optimizer == "adam" else fresh()),
            ):
                measured = _device_time(timed_function, timed_arguments, donated)
                device += f"  {label} " + ("-" if measured is None else f"{measured[0]:7.3f} ms ({measured[1]:.0f} kernels)")
        print(f"{optimizer:5s} {layout:14s} {ms:8.3f} ms  back to back {pipelined:8.3f} ms  {kernels:4d} kernels{device}   results {same}", flush=True)


if __name__ == "__main__":
    main()
