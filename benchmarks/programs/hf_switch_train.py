"""HF Switch Transformers training steps, as a user's loop runs them: a Switch model from a config
(switch-base-8's shape by default: 12+12 layers of width 768, 8 experts, every other layer
sparse, expert capacity 64), AdamW, batch 8 of 128 source and 32 target tokens of random data.
Prints `RESULT {json}`: the median step time over the steps after the first 5 (each step
synchronized), the first step's time and the first and last losses.

Run as it is for torch eager, under `python -m bridge run` for the bridge."""

import argparse
import json
import sys
import statistics
import time

import torch
import transformers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--progress", action="store_true", help="print each step's time and loss as it ends")
    options = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.SwitchTransformersConfig(
        num_layers=options.layers, num_decoder_layers=options.layers, num_experts=options.experts,
        expert_capacity=options.capacity, router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    device = "cuda" if torch.cuda.is_available() or "bridge" in sys.modules else "cpu"
    model = transformers.SwitchTransformersForConditionalGeneration(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (options.batch, 128), generator=generator).to(device)
    labels = torch.randint(3, config.vocab_size, (options.batch, 32), generator=generator).to(device)
    mask = torch.ones_like(ids)
    times, losses = [], []
    for _ in range(options.steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if options.progress:
            print(f"step {len(times)}: {times[-1]:.3f} s, loss {losses[-1]:.4f}", flush=True)
    result = {
        "ms_per_step": round(statistics.median(times[5:]) * 1000, 2),
        "first_step_seconds": round(times[0], 2),
        "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
        "steps": options.steps,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
