"""float32 attention, forward and backward, on one GPU: torch's kernel against the bridge's.

    python benchmarks/attention_kernel.py --out benchmarks/results --name attention_kernel_h100

Times, for one shape (GPT-2 small's by default: batch 8, 12 heads, length 1024, head size 64,
causal), the forward and the forward-and-backward of
- torch's `F.scaled_dot_product_attention` on CUDA in float32 (its memory-efficient kernel);
- the bridge's XLA form (op_mappings/attention.py `_blocked_causal`, four query blocks);
- the bridge's Pallas kernel (op_mappings/flash_attention.py) at each setting in `--settings`
  (blocks, warps and stages forward and backward, and the products' precision).
Each result's largest distance to a float64 reference on the CPU is reported beside torch's own.
Medians of `--repeats` timed calls after a warm-up. Writes <out>/<name>.md and .json.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

# Forward/backward settings, each block_query x block_key x warps x stages (one setting: the
# same for both), then the products' precision: "highest" (torch's default, which the kernel
# runs as three TF32 tensor-core products), "f32" (float32 products on Triton's FMA path) or
# "tf32" (one TF32 product, as torch's "high").
SETTINGS = ",".join(
    [
        "64x64x4x2:f32",
        "64x64x4x2",
        "64x64x4x2/64x64x8x2",
        "64x64x4x2/32x64x4x2",
        "64x64x4x2/64x32x4x2",
        "64x64x4x2/32x32x4x2",
        "64x64x4x2/64x64x4x1",
        "64x64x4x2/32x64x2x2",
        "64x64x8x2/64x64x4x2",
        "64x64x4x2:tf32",
        "64x64x4x2/64x64x8x2:tf32",
    ]
)
PRECISIONS = {"highest": "HIGHEST", "f32": "F32_F32_F32", "tf32": "DEFAULT"}


def _median_ms(call, repeats, sync):
    call()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), max(times)


def _torch_case(q, k, v, grad, causal, repeats):
    import torch
    import torch.nn.functional as F

    device = [t.cuda().requires_grad_() for t in (q, k, v)]
    grad = grad.cuda()

    def forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(*device, is_causal=causal)

    def both():
        out = F.scaled_dot_product_attention(*device, is_causal=causal)
        return (out, *torch.autograd.grad(out, device, grad))

    results = [t.detach().cpu() for t in both()]
    return _median_ms(forward, repeats, torch.cuda.synchronize), _median_ms(both, repeats, torch.cuda.synchronize), results


def _jax_case(attend, q, k, v, grad, repeats):
    import jax
    import numpy as np

    arrays = [jax.device_put(np.asarray(t.numpy())) for t in (q, k, v)]
    grad = jax.device_put(np.asarray(grad.numpy()))
    forward = jax.jit(attend)

    @jax.jit
    def both(q, k, v, grad):
        out, pullback = jax.vjp(attend, q, k, v)
        return (out, *pullback(grad))

    results = [np.asarray(r) for r in both(*arrays, grad)]
    state = {}

    def sync():
        jax.block_until_ready(state.pop("out"))

    def run_forward():
        state["out"] = forward(*arrays)

    def run_both():
        state["out"] = both(*arrays, grad)

    return _median_ms(run_forward, repeats, sync), _median_ms(run_both, repeats, sync), results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8,12,1024,64", help="batch,heads,length,head size")
    parser.add_argument("--not-causal", action="store_true")
    parser.add_argument("--settings", default=SETTINGS)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="attention_kernel")
    args = parser.parse_args()

    import jax
    import torch
    from jax import lax

    from bridge.op_mappings import attention, flash_attention

    jax.config.update("jax_enable_x64", True)  # as under the bridge
    batch, heads, length, size = (int(n) for n in args.shape.split(","))
    causal = not args.not_causal
    scale = size**-0.5
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(batch, heads, length, size, generator=generator) for _ in range(4))
    exact = [t.detach() for t in _reference(q, k, v, grad, causal)]

    rows = []

    def record(case, timings, results):
        (forward, forward_min, forward_max), (both, both_min, both_max), outputs = timings[0], timings[1], results
        errors = [float((torch.as_tensor(r).double() - e).abs().max()) for r, e in zip(outputs, exact)]
        rows.append(
            {"case": case, "forward_ms": forward, "forward_spread": [forward_min, forward_max],
             "forward_backward_ms": both, "forward_backward_spread": [both_min, both_max],
             "max_error": dict(zip(("out", "dq", "dk", "dv"), errors))}
        )
        print(f"{case:40s} forward {forward:7.2f} ms  forward+backward {both:7.2f} ms  errors {' '.join(f'{e:.1e}' for e in errors)}", flush=True)

    forward, both, results = _torch_case(q, k, v, grad, causal, args.repeats)
    record("torch sdpa (CUDA, float32)", (forward, both), results)

    precision = lax.Precision.HIGHEST
    if causal and attention._causal_block(q, k, True, None):
        block = attention._causal_block(q, k, True, None)

        def blocked(q, k, v):
            return attention._blocked_causal(q, k, v, scale, block, precision)[0]

        forward, both, results = _jax_case(blocked, q, k, v, grad, args.repeats)
        record(f"bridge XLA blocked ({length // block} query blocks)", (forward, both), results)

    machine = {
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "jax": jax.__version__,
    }
    _write(args, machine, rows, (batch, heads, length, size), causal)
    for setting in args.settings.split(","):
        shape, _, name = setting.partition(":")
        forward_blocks, _, backward_blocks = shape.partition("/")
        blocks = tuple(tuple(int(n) for n in part.split("x")) for part in (forward_blocks, backward_blocks or forward_blocks))
        name = name or "highest"
        kind = PRECISIONS[name]
        chosen = getattr(lax.Precision, kind) if kind in ("HIGHEST", "DEFAULT") else getattr(lax.DotAlgorithmPreset, kind)

        def kernel(q, k, v, blocks=blocks, chosen=chosen):
            return flash_attention.flash_attention(q, k, v, causal, scale, chosen, False, blocks)[0]

        start = time.perf_counter()
        try:
            forward, both, results = _jax_case(kernel, q, k, v, grad, args.repeats)
        except Exception as error:  # noqa: BLE001 - a setting Triton cannot build is reported, not fatal
            print(f"pallas kernel {setting}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
            rows.append({"case": f"pallas kernel {setting}", "failed": f"{type(error).__name__}: {str(error)[:300]}"})
            continue
        record(f"pallas kernel {setting}", (forward, both), results)
        rows[-1]["seconds_with_compile"] = time.perf_counter() - start
        _write(args, machine, rows, (batch, heads, length, size), causal)  # kept if a later setting hangs


def _reference(q, k, v, grad, causal):
    import torch
    import torch.nn.functional as F

    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return (out, *torch.autograd.grad(out, (q, k, v), grad.double()))


def _write(args, machine, rows, shape, causal):
    os.makedirs(args.out, exist_ok=True)
    command = "python benchmarks/attention_kernel.py " + " ".join(sys.argv[1:])
    with open(os.path.join(args.out, args.name + ".json"), "w") as handle:
        json.dump({"command": command, "machine": machine, "shape": shape, "causal": causal, "rows": rows}, handle, indent=1)
    lines = [
        f"# {args.name}",
        "",
        f"Command: `{command}`; generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Machine: {json.dumps(machine)}. Shape (batch, heads, length, head size) {shape}, causal {causal}, float32 at full precision.",
        "",
        "| case | forward ms (median, spread) | forward + backward ms (median, spread) | max error out / dq / dk / dv (vs float64) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        if "failed" in row:
            lines.append(f"| {row['case']} | failed: {row['failed'][:120]} | | |")
            continue
        errors = " / ".join(f"{e:.1e}" for e in row["max_error"].values())
        lines.append(
            f"| {row['case']} | {row['forward_ms']:.2f} ({row['forward_spread'][0]:.2f}-{row['forward_spread'][1]:.2f})"
            f" | {row['forward_backward_ms']:.2f} ({row['forward_backward_spread'][0]:.2f}-{row['forward_backward_spread'][1]:.2f}) | {errors} |"
        )
    with open(os.path.join(args.out, args.name + ".md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
