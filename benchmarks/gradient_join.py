"""How an AdamW update over one flat parameter array takes per-parameter gradients, on the
device: the gradients joined by one concatenate (runtime.optimizers now) or otherwise.

    python benchmarks/gradient_join.py [--tiny] [--repeats 20]

The parameters are nanoGPT's weight-decay group for GPT-2 small (`bench.py`): the token
embedding (50304 x 768, 31% of the values), the position embedding and each block's four
matrices, 50 arrays. Their values, Adam's two moments and the update's result are flat arrays,
donated, as the bridge keeps them (runtime/flat.py); the gradients come in one array each, as a
captured region's backward returns them.

Ways to join (each a jitted program; its results compared with the first's):
- concatenate: one `jnp.concatenate` of the 50 gradients;
- largest apart: the gradients but the largest concatenated first (kept apart from the outer
  concatenate by an optimization barrier), then joined with the largest;
- chunks of 8: runs of 8 consecutive gradients concatenated, then the runs;
- in place: each gradient written into its span of one zero array (dynamic_update_slice);
- joined before: the gradients handed over joined already (what a backward that returns one
  flat gradient would give): no join in the update;
- one pass: the concatenate, and AdamW written as one elementwise pass over the flat arrays
  (`simple_adam`) instead of runtime.optimizers.adam_update.

The update is runtime.optimizers' batch program for nanoGPT's two groups (the other: 25 layer
norm weights without weight decay). Prints, per way, the GPU's kernel time a call (a JAX
profile), the ms a call with calls back to back, and the kernels XLA compiled (--kernels names
them).
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import optimizer_update  # noqa: E402
from bridge.runtime import optimizers  # noqa: E402

BETA1, BETA2, EPS = 0.9, 0.95, 1e-8


def nanogpt_decay_shapes(tiny):
    layers, width, vocab, block = (2, 64, 512, 64) if tiny else (12, 768, 50304, 1024)
    shapes = [(vocab, width), (block, width)]
    for _ in range(layers):
        shapes += [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)]
    return shapes


def _flat(arrays):
    return [array.reshape(-1) for array in arrays]


def join_concatenate(grads):
    return jnp.concatenate(_flat(grads))


def join_largest_apart(grads):
    sizes = [grad.size for grad in grads]
    big = sizes.index(max(sizes))
    rest = jax.lax.optimization_barrier(jnp.concatenate(_flat(grads[:big] + grads[big + 1 :])))
    before = sum(sizes[:big])
    return jnp.concatenate([rest[:before], grads[big].reshape(-1), rest[before:]])


def join_chunks(grads, size=8):
    runs = [jax.lax.optimization_barrier(jnp.concatenate(_flat(grads[i : i + size]))) for i in range(0, len(grads), size)]
    return jnp.concatenate(runs)


def join_in_place(grads):
    total = sum(grad.size for grad in grads)
    flat, start = jnp.zeros((total,), grads[0].dtype), 0
    for grad in grads:
        flat = jax.lax.dynamic_update_slice(flat, grad.reshape(-1), (start,))
        start += grad.size
    return flat


JOINS = {
    "concatenate": join_concatenate,
    "largest apart": join_largest_apart,
    "chunks of 8": join_chunks,
    "in place": join_in_place,
}


def join_none(grads):
    """The gradients already joined (what a backward returning one flat gradient would give)."""
    return grads[0]


def simple_adam(params, grads, avgs, sqs, maxes, scalars, clip_grads=None, coefficient=None, *, beta1, beta2, eps, weight_decay, flat_shapes, **_):
    """AdamW over the flat arrays written as one elementwise pass (for comparison with
    runtime.optimizers.adam_update's uniform path, the same arithmetic)."""
    count = len(flat_shapes)
    decay, step_size, bias2_sqrt = scalars[0], scalars[1], scalars[1 + count]
    grad = join_concatenate(grads)
    avg = optimizers._lerp(avgs, grad, jnp.asarray(1 - beta1, avgs.dtype))
    sq = sqs * jnp.asarray(beta2, sqs.dtype) + jnp.asarray(1 - beta2, sqs.dtype) * grad * grad
    denom = jnp.sqrt(sq) / bias2_sqrt + jnp.asarray(eps, sqs.dtype)
    return [params[0] * decay + step_size * (avg / denom)], avg, sq, None, None


def _group_arguments(shapes, rng, joined):
    """One parameter group's update arguments as runtime.optimizers' batch takes them: the flat
    parameters in a list, the gradients (one array each, or already joined), the flat moments,
    no AMSGrad maxima, the scalars."""
    total = sum(int(np.prod(shape)) for shape in shapes)
    grads = [jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 1e-3) for shape in shapes]
    if joined:
        grads = [jnp.concatenate([grad.reshape(-1) for grad in grads])]
    params = [jnp.asarray(rng.standard_normal(total, dtype=np.float32) * 0.02)]
    avgs = jnp.asarray(rng.standard_normal(total, dtype=np.float32) * 1e-3)
    sqs = jnp.asarray(rng.random(total, dtype=np.float32) * 1e-6)
    count = len(shapes)
    scalars = np.array([1 - 1e-4 * 1e-2] + [-1e-4 / (1 - BETA1**5)] * count + [(1 - BETA2**5) ** 0.5] * count, np.float32)
    return [params, grads, avgs, sqs, None, scalars]


def _plan(groups):
    plan = []
    for shapes, weight_decay in groups:
        statics = dict(beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=weight_decay, decoupled=True, amsgrad=False, maximize=False,
                       separate=False, max_norm=None, norm_type=None, flat_shapes=tuple(shapes), flat_updated=None, uniform=True)
        plan.append(("adam", (0, 2, 3, 4), 6, tuple(sorted(statics.items()))))
    return tuple(plan)


def _split_arguments(arguments, plan):
    donated = [[arg for i, arg in enumerate(args) if i in positions] for args, (_, positions, _, _) in zip(arguments, plan)]
    kept = [[arg for i, arg in enumerate(args) if i not in positions] for args, (_, positions, _, _) in zip(arguments, plan)]
    return donated, kept


def _fed_back(donated, results):
    """The next call's donated arguments: the last call's new parameters and moments."""
    return [[result[0], result[1], result[2], None] for result in results]


def _kernels(function, donated, kept):
    """The compiled program's kernels by name (fusions, library calls)."""
    text = function.lower(donated, kept).compile().as_text()
    entry = text[text.index("ENTRY") :]
    names = []
    for line in entry.splitlines():
        if " fusion(" in line or " custom-call(" in line:
            names.append(line.split("=")[0].strip().lstrip("%").split(" ")[0])
    return names


def _device_ms(function, donated, kept, calls=10):
    """The GPU's kernel time a call (JAX's profiler), or None off a GPU; and the donated
    arguments for the next call."""
    import glob
    import tempfile

    from jax._src.lib import _profile_data

    folder = tempfile.mkdtemp()
    jax.profiler.start_trace(folder)
    for _ in range(calls):
        results = function(donated, kept)
        jax.block_until_ready(results)
        donated = _fed_back(donated, results)
    jax.profiler.stop_trace()
    total = kernels = 0
    for path in glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True):
        for plane in _profile_data.ProfileData.from_file(path).planes:
            if plane.name.startswith("/device:GPU"):
                for line in plane.lines:
                    if line.name.startswith("Stream"):
                        for event in line.events:
                            total += event.duration_ns
                            kernels += 1
    return ((total / 1e6 / calls, kernels / calls) if kernels else None), donated


def _back_to_back_ms(function, donated, kept, repeats):
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            results = function(donated, kept)
            donated = _fed_back(donated, results)
        jax.block_until_ready(results)
        samples.append((time.perf_counter() - start) * 1e3 / repeats)
    return statistics.median(samples), donated


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--kernels", action="store_true", help="list each program's kernels")
    options = parser.parse_args(argv)
    decay = nanogpt_decay_shapes(options.tiny)
    groups = [(decay, 1e-2), ([(decay[0][1],)] * 25, 0.0)]
    total = sum(int(np.prod(shape)) for shapes, _ in groups for shape in shapes)
    print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}: {sum(len(s) for s, _ in groups)} gradients in 2 groups, {total:,} values", flush=True)
    plan = _plan(groups)
    reference = None
    ways = dict(JOINS, **{"joined before": join_none, "one pass": join_concatenate})
    raw = optimizers._RAW["adam"]
    for name, join in ways.items():
        optimizers.join_gradients = join
        optimizers._RAW["adam"] = (simple_adam, raw[1]) if name == "one pass" else raw
        function = jax.jit(lambda donated, kept: optimizers._updates(donated, kept, plan), donate_argnums=(0,))
        rng = np.random.default_rng(1)
        arguments = [_group_arguments(shapes, rng, name == "joined before") for shapes, _ in groups]
        donated, kept = _split_arguments(arguments, plan)
        kernels = _kernels(function, donated, kept)
        first = function(donated, kept)
        values = np.concatenate([np.asarray(array).reshape(-1) for result in first for array in (result[0][0], result[1], result[2])])
        same = "reference" if reference is None else optimizer_update._distance(values, reference)
        reference = values if reference is None else reference
        donated = _fed_back(donated, first)
        device, donated = _device_ms(function, donated, kept)
        piped, donated = _back_to_back_ms(function, donated, kept, options.repeats)
        device_text = "-" if device is None else f"{device[0]:7.3f} ms ({device[1]:.0f} kernels run)"
        print(f"{name:14s} device {device_text}  back to back {piped:7.3f} ms  {len(kernels)} kernels compiled  results {same}", flush=True)
        if options.kernels:
            print("    " + " ".join(kernels), flush=True)
    optimizers.join_gradients = optimizers._join
    optimizers._RAW["adam"] = raw


if __name__ == "__main__":
    main()
