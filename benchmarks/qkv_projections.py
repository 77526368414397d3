"""q, k and v cut out of one joined projection against three projections by the weight's slices,
in JAX alone: nanoGPT's attention half-blocks at its shapes (12 layers, batch 12 x 1024, width
768, 12 heads, bfloat16), forward and backward as one jitted program, attention by
`jax.nn.dot_product_attention` (cuDNN's on a GPU). The bridge traces nanoGPT's
`c_attn(x).split(n_embd, dim=2)` as the first; XLA then copies each of q, k and v out of the
joined product for cuDNN, where torch passes strided views.

    python benchmarks/qkv_projections.py [--implementation cudnn|xla] [--small]

Run it with `XLA_FLAGS=--xla_gpu_dot_merger_threshold_mb=0` too: XLA's dot merger joins the
three projections again. Prints the two losses (equal) and the median ms of 30 calls, twice.
"""

import argparse
import statistics
import sys
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--implementation", default="cudnn", choices=["cudnn", "xla"])
    parser.add_argument("--small", action="store_true", help="2 layers of 2 x 64 x 96, 4 heads (a CPU check)")
    options = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    batch, length, width, heads, layers = (2, 64, 96, 4, 2) if options.small else (12, 1024, 768, 12, 12)
    size = width // heads
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * layers + 1)
    x = jax.random.normal(keys[0], (batch, length, width), jnp.float32)
    params = [
        (jax.random.normal(keys[2 * i + 1], (3 * width, width)) * 0.02, jax.random.normal(keys[2 * i + 2], (width, width)) * 0.02)
        for i in range(layers)
    ]

    def attention(q, k, v):
        q, k, v = (t.reshape(batch, length, heads, size) for t in (q, k, v))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=options.implementation)
        return out.reshape(batch, length, width)

    def joined(h, w):
        qkv = jnp.einsum("btc,oc->bto", h, w.astype(jnp.bfloat16))
        return attention(qkv[..., :width], qkv[..., width : 2 * width], qkv[..., 2 * width :])

    def three(h, w):
        w = w.astype(jnp.bfloat16)
        return attention(*(jnp.einsum("btc,oc->bto", h, w[i * width : (i + 1) * width]) for i in range(3)))

    def step(kind):
        def loss(params, x):
            h = x.astype(jnp.bfloat16)
            for w, projection in params:
                h = h + jnp.einsum("btc,oc->bto", kind(h, w), projection.astype(jnp.bfloat16))
            return jnp.mean(h.astype(jnp.float32) ** 2)

        return jax.jit(jax.value_and_grad(loss))

    def median_ms(function):
        for _ in range(6):
            jax.block_until_ready(function(params, x))
        samples = []
        for _ in range(30):
            start = time.perf_counter()
            jax.block_until_ready(function(params, x))
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    first, second = step(joined), step(three)
    print("losses", float(first(params, x)[0]), float(second(params, x)[0]))
    for round_ in range(2):
        print(f"round {round_}: joined projection {median_ms(first):.3f} ms, three projections {median_ms(second):.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
