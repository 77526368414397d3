"""Training batch norm + ReLU on ResNet-50's activation shapes: forward and backward programs
timed for several ways of writing the statistics, beside torch (eager and torch.compile).

    python benchmarks/batch_norm_variants.py [--repeat 50]

Each JAX variant runs as a captured region of the bridge does when the loss is outside it: a
forward program (`jax.vjp` under the bridge's checkpoint policy, keeping matmul/convolution
results and named values) and a backward program (the pullback). The input is the transpose of
a channels-last array, as the bridge's convolutions produce it on GPUs. Prints milliseconds per
forward and backward, the median of `--repeat` timed calls, and the error of each variant's
results against float64.
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

from bridge.op_mappings import normalization  # noqa: E402
from bridge.runtime.config import KEEP_FOR_BACKWARD  # noqa: E402

SHAPES = [(64, 64, 112, 112), (64, 64, 56, 56), (64, 256, 56, 56), (64, 128, 28, 28), (64, 512, 28, 28), (64, 1024, 14, 14), (64, 2048, 7, 7)]

_KEEP = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names(KEEP_FOR_BACKWARD)
)


def bridge_variant(x, w, b):
    """The bridge's mapping as captured regions run it (torch's closed-form backward)."""
    out, _, _, updates = normalization._batch_norm(x, w, b, jnp.zeros_like(w), jnp.ones_like(w), True, 0.1, 1e-5, traced=True)
    return out, updates


def plain_two_pass(x, w, b):
    axes = (0, 2, 3)
    mean = jnp.mean(x, axes)
    var = jnp.mean(jnp.square(x - mean[None, :, None, None]), axes)
    out = (x - mean[None, :, None, None]) * jax.lax.rsqrt(var + 1e-5)[None, :, None, None] * w[None, :, None, None] + b[None, :, None, None]
    return out, {"running_mean": mean, "running_var": var}


def plain_one_pass(x, w, b):
    """E[x^2] - E[x]^2, as flax's BatchNorm computes it (cancels badly for large means)."""
    axes = (0, 2, 3)
    mean = jnp.mean(x, axes)
    var = jnp.maximum(jnp.mean(jnp.square(x), axes) - jnp.square(mean), 0)
    out = (x - mean[None, :, None, None]) * jax.lax.rsqrt(var + 1e-5)[None, :, None, None] * w[None, :, None, None] + b[None, :, None, None]
    return out, {"running_mean": mean, "running_var": var}


VARIANTS = {
    "bridge": bridge_variant,
    "two-pass autodiff": plain_two_pass,
    "one-pass autodiff": plain_one_pass,
}


def block(x_nhwc, w, b, variant):
    x = jnp.transpose(x_nhwc, (0, 3, 1, 2))
    out, updates = variant(x, w, b)
    return jax.nn.relu(out), updates


def programs(variant):
    def forward(x, w, b):
        function = jax.checkpoint(lambda x, w, b: block(x, w, b, variant), policy=_KEEP)
        out, pullback, updates = jax.vjp(function, x, w, b, has_aux=True)
        return out, updates, pullback

    return jax.jit(forward), jax.jit(lambda pullback, grad: pullback(grad))


def _median_ms(call, repeat):
    jax.block_until_ready(call())
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(call())
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _relative(value, reference):
    value, reference = np.asarray(value, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(value - reference) / max(np.linalg.norm(reference), 1e-300))


def torch_times(shape, repeat):
    import torch

    if not torch.cuda.is_available():
        return {}
    results = {}
    x = torch.randn(shape, device="cuda").to(memory_format=torch.channels_last).requires_grad_()
    bn = torch.nn.BatchNorm2d(shape[1]).cuda()
    grad = torch.randn(shape, device="cuda").to(memory_format=torch.channels_last)

    def eager():
        return torch.relu(bn(x))

    for name, function in (("torch eager", eager), ("torch.compile", torch.compile(eager))):
        for _ in range(3):
            function().backward(grad)
        forward, backward = [], []
        for _ in range(repeat):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = function()
            torch.cuda.synchronize()
            middle = time.perf_counter()
            out.backward(grad)
            torch.cuda.synchronize()
            forward.append((middle - start) * 1e3)
            backward.append((time.perf_counter() - middle) * 1e3)
        results[name] = (statistics.median(forward), statistics.median(backward))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--shapes", default="all", help="'all' or indices into SHAPES, comma-separated")
    options = parser.parse_args(argv)
    shapes = SHAPES if options.shapes == "all" else [SHAPES[int(i)] for i in options.shapes.split(",")]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    totals = {}
    for shape in shapes:
        n, c, h, wd = shape
        rng = np.random.default_rng(0)
        x = rng.standard_normal((n, h, wd, c)).astype(np.float32) * 2 + 0.5
        w = rng.standard_normal(c).astype(np.float32)
        b = rng.standard_normal(c).astype(np.float32)
        g = rng.standard_normal((n, c, h, wd)).astype(np.float32)
        args = [jnp.asarray(a) for a in (x, w, b)]
        grad = jnp.asarray(g)
        reference_forward, reference_backward = programs(plain_two_pass)
        out64, _, pull64 = reference_forward(*[a.astype(jnp.float64) for a in args])
        ref_grads = reference_backward(pull64, grad.astype(jnp.float64))
        print(f"\n{shape}")
        for name, variant in VARIANTS.items():
            forward, backward = programs(variant)
            out, _, pullback = forward(*args)
            grads = backward(pullback, grad)
            error = max([_relative(out, out64)] + [_relative(a, r) for a, r in zip(grads, ref_grads)])
            f_ms = _median_ms(lambda: forward(*args), options.repeat)
            b_ms = _median_ms(lambda: backward(pullback, grad), options.repeat)
            totals.setdefault(name, [0.0, 0.0])
            totals[name][0] += f_ms
            totals[name][1] += b_ms
            print(f"  {name:20s} forward {f_ms:7.3f} ms  backward {b_ms:7.3f} ms  max rel. error {error:.1e}")
        for name, (f_ms, b_ms) in torch_times(shape, options.repeat).items():
            totals.setdefault(name, [0.0, 0.0])
            totals[name][0] += f_ms
            totals[name][1] += b_ms
            print(f"  {name:20s} forward {f_ms:7.3f} ms  backward {b_ms:7.3f} ms")
    print("\n## totals over the shapes (ms)")
    for name, (f_ms, b_ms) in totals.items():
        print(f"  {name:20s} forward {f_ms:7.3f}  backward {b_ms:7.3f}  both {f_ms + b_ms:7.3f}")


if __name__ == "__main__":
    main()
