"""HuggingFace `generate` as its users call it: greedy decoding with a GPT-2.

The model is a GPT-2 from a config (12 x 768 by default) over a byte vocabulary, trained briefly
on the standard library's Python source, so that its logits have clear margins and greedy
decoding does not meet near-ties that rounding decides (with random weights it does).

    python hf_generate.py --checkpoint FILE --train 300        # plain torch: train, save
    python hf_generate.py --checkpoint FILE [--cache static]   # load, generate, time

The second form runs as it is for torch, or under `python -m bridge run` for the bridge. With
`--cache static` on a GPU, torch's run is compiled: HF's generate calls torch.compile on the
decoding step by itself when the cache is static (`--no-compile` turns that off). It
prints one line `RESULT {json}`: the seconds of the first `generate` call (tracing and compiling
included) and of every call, the median ms a token over the calls after the first, the number
of new tokens, and the tokens themselves (so that runs can be compared)."""

import argparse
import json
import os
import statistics
import sysconfig
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def _corpus(limit=4_000_000):
    """Bytes of the standard library's Python source, in a fixed order."""
    folder = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py") and total < limit:
            with open(os.path.join(folder, name), "rb") as file:
                chunks.append(file.read())
            total += len(chunks[-1])
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def _model(options):
    config = GPT2Config(
        vocab_size=256,
        n_layer=options.layers,
        n_embd=options.width,
        n_head=options.heads,
        n_positions=1024,
        bos_token_id=10,
        eos_token_id=10,
    )
    return GPT2LMHeadModel(config)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train(options):
    torch.manual_seed(0)
    data = _corpus()
    model = _model(options).to(_device())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    for step in range(options.train):
        starts = torch.randint(len(data) - 257, (16,), generator=generator)
        batch = torch.stack([data[start : start + 257] for start in starts]).to(_device())
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == options.train - 1:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    torch.save(model.state_dict(), options.checkpoint)


def generate(options):
    model = _model(options)
    model.load_state_dict(torch.load(options.checkpoint, map_location="cpu"))
    model = model.to(_device()).eval()
    prompt = _corpus()[-options.prompt :].unsqueeze(0).to(_device())
    settings = dict(max_new_tokens=options.new_tokens, do_sample=False, pad_token_id=10)
    if options.cache == "static":
        settings["cache_implementation"] = "static"
    if options.no_compile:
        settings["disable_compile"] = True  # HF compiles the decoding step on a GPU with a static cache
    seconds, tokens = [], None
    for _ in range(options.repeats + 1):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, **settings)
        _sync()
        seconds.append(time.perf_counter() - start)
        tokens = out[0, prompt.shape[1] :].tolist()
    new = len(tokens)
    result = {
        "first_call_seconds": round(seconds[0], 3),
        "call_seconds": [round(value, 3) for value in seconds],
        "ms_per_token": round(statistics.median(seconds[1:]) * 1000 / new, 3),
        "new_tokens": new,
        "cache": options.cache,
        "prompt_tokens": prompt.shape[1],
        "tokens": tokens,
    }
    print("RESULT " + json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--train", type=int, default=0, help="train this many steps and save (plain torch)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=64, help="prompt length in bytes")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--cache", choices=("default", "static"), default="default", help="generate's default cache, or cache_implementation='static'"
    )
    parser.add_argument("--no-compile", action="store_true", help="generate(disable_compile=True)")
    options = parser.parse_args()
    if options.train:
        train(options)
    else:
        generate(options)


if __name__ == "__main__":
    main()
