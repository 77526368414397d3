"""What a program's output buffers cost the host: deleting arrays, launching a program with many
outputs, and an update of many arrays with and without donating the old ones.

    python benchmarks/buffer_costs.py

Medians of seven calls, with the device idle and with it busy on a long matrix product (an
in-flight step, as in a training loop). Measured on an H100 (benchmarks/results/
h100_session_2026-11-23_evening.md): a new output buffer costs the host 2.5-5 us, so the
bridge's programs avoid outputs that are only copies of inputs and donate buffers whose old
values nothing else holds.
"""

import statistics
import time

import jax
import jax.numpy as jnp

COUNT = 200


def main():
    many_outputs = jax.jit(lambda x: [x * i for i in range(COUNT)])
    x = jnp.ones((256, 256))
    busy = jax.jit(lambda a: (a @ a) @ a)
    big = jnp.ones((8192, 8192)) if jax.default_backend() == "gpu" else jnp.ones((512, 512))
    jax.block_until_ready(busy(big))
    jax.block_until_ready(many_outputs(x))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    for loaded in (False, True):
        deletions, launches = [], []
        for _ in range(7):
            pending = busy(big) if loaded else None
            start = time.perf_counter()
            outputs = many_outputs(x)
            launches.append((time.perf_counter() - start) * 1e6)
            start = time.perf_counter()
            del outputs
            deletions.append((time.perf_counter() - start) / COUNT * 1e6)
            if pending is not None:
                jax.block_until_ready(pending)
        state = "busy" if loaded else "idle"
        print(f"device {state}: deleting an array {statistics.median(deletions):.2f} us; "
              f"a program with {COUNT} outputs {statistics.median(launches):.0f} us")
    donating = jax.jit(lambda values: [value + 1 for value in values], donate_argnums=0)
    plain = jax.jit(lambda values: [value + 1 for value in values])
    for name, update in (("donating its inputs", donating), ("new buffers", plain)):
        samples = []
        for _ in range(7):
            values = many_outputs(x)
            jax.block_until_ready(values)
            pending = busy(big)
            start = time.perf_counter()
            updated = update(values)
            del values
            samples.append((time.perf_counter() - start) * 1e6)
            jax.block_until_ready(pending)
            del updated
        print(f"update of {COUNT} arrays, {name}, old ones freed: {statistics.median(samples):.0f} us")


if __name__ == "__main__":
    main()
