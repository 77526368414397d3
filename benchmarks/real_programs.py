"""Real, unmodified training programs under torch eager, torch.compile and the bridge, side by side.

The programs are not in this repository: point the benchmark at checkouts of them (see
benchmarks/README.md for the commits and how to carry them to a machine without a network).

    python benchmarks/real_programs.py --nanogpt PATH --examples PATH [--programs ...] [--out DIR]

Programs (each run as its authors ship it; only command-line flags they offer are set):
- nanogpt-bench: nanoGPT's bench.py (GPT-2 small 12x768, batch 12x1024, bf16 autocast,
  AdamW(fused=True) because the device is cuda, loss.item() every step) with --real_data=False
  (the OpenWebText shards are not carried). Cases: torch eager (--compile=False), torch.compile
  (its default), the bridge (its default, under `python -m bridge run`). Figure: the script's own
  "time per iteration" over its 20 timed steps.
- hf-trainer: HuggingFace Trainer with its default arguments (adamw_torch_fused) plus bf16, on a
  GPT-2 of 6 layers x 768 built from a config, batch 8x512 of random tokens
  (benchmarks/programs/hf_trainer_gpt2.py). Cases: torch eager, the bridge. Figures: median ms a
  step over steps 20-60, and the time to the first step's end.
- timm: a timm training step as timm's train.py takes it (benchmarks/programs/timm_train.py:
  resnet50 from timm.create_model, timm's AdamW factory, bf16 autocast, label smoothing,
  timm's clip at 1.0, channels-last batches of 64). Cases: torch eager, torch.compile, the
  bridge. Figure: median ms a step over steps 10-40.
- vit: the same timm loop on vit_small_patch16_224 (its attention runs through
  F.scaled_dot_product_attention over 197 tokens, a length cuDNN's fused kernel refuses).
- convnext: the same timm loop on convnext_tiny (depthwise 7x7 convolutions, LayerNorm over
  channels-last, layer scale, stochastic depth off at timm's default).
- generate: HF `generate`, greedy, 128 new tokens from a 64-token prompt, with a GPT-2 (12 x 768,
  a byte vocabulary) trained 300 steps on the standard library's source first (plain torch),
  so that its logits have clear margins (benchmarks/programs/hf_generate.py). Cases: torch eager
  with generate's default (dynamic) cache; torch with a static cache, which HF itself compiles
  (torch.compile, in the torch.compile column); torch eager with a static cache
  (disable_compile); the bridge with generate's default cache (the call as torch eager's),
  cold and again warm (the compilation cache the first left); the bridge with a static cache
  asked for (`--generate-cases` picks some). Figures:
  median ms a token over 3 calls after the first, the first call's seconds, and whether each
  case's tokens equal torch eager's.
- imagenet: pytorch/examples imagenet/main.py -a resnet50 --dummy (DataParallel, SGD, top-1/5
  accuracy each batch; FakeData decoded by its DataLoader workers). Cases: torch eager, the
  bridge. Figure: the script's own averaged batch time at its last progress line within the
  time given.
- word-lm: pytorch/examples word_language_model/main.py --accel --model Transformer on a
  synthetic corpus of WikiText-2's size (the data files are not carried). Cases: torch eager,
  the bridge. Figure: the script's ms/batch at its last progress line.

Writes <out>/real_programs.md and .json: per program and case the figure, and the ratios.
"""

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import machine  # noqa: E402

# The figure each program's table reports: the key of its results and the figure's unit.
FIGURES = {
    "nanogpt-bench": ("ms_per_step", "ms"),
    "hf-trainer": ("ms_per_step", "ms"),
    "timm": ("ms_per_step", "ms"),
    "vit": ("ms_per_step", "ms"),
    "convnext": ("ms_per_step", "ms"),
    "generate": ("ms_per_token", "ms a token"),
    "imagenet": ("steady_batch_seconds", "s/batch"),
    "word-lm": ("ms_per_batch", "ms/batch"),
}


def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.update(extra or {})
    return env


def _run(command, cwd, timeout, extra_env=None):
    """Run a command; returns (output, seconds, timed_out)."""
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=cwd, env=_env(extra_env), capture_output=True, text=True, timeout=timeout
        )
        output, timed_out = done.stdout + done.stderr, False
        if done.returncode != 0:
            output += f"\n[exit code {done.returncode}]"
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        output += (expired.stderr or b"").decode() if isinstance(expired.stderr, bytes) else (expired.stderr or "")
        timed_out = True
    return output, time.perf_counter() - start, timed_out


def _bridge(args, cache):
    return [sys.executable, "-m", "bridge", "run", *args], {"BRIDGE_CACHE_DIR": cache}


def _last(pattern, text, group=1):
    found = re.findall(pattern, text)
    if not found:
        return None
    last = found[-1]
    return float(last if isinstance(last, str) else last[group - 1])


def _summary_lines(text):
    return [line for line in text.splitlines() if line.startswith("bridge:")][-8:]


def nanogpt_bench(checkout, scratch, timeout):
    cases = {}
    base = [sys.executable, "bench.py", "--real_data=False"]
    for case, command, env in (
        ("torch", base + ["--compile=False"], None),
        ("torch-compile", base, None),
        ("bridge", *_bridge(["bench.py", "--real_data=False"], os.path.join(scratch, "cache-nanogpt"))),
    ):
        output, seconds, timed_out = _run(command, checkout, timeout, env)
        cases[case] = {
            "ms_per_step": _last(r"time per iteration: ([0-9.]+)ms", output),
            "wall_seconds": round(seconds, 1),
            "timed_out": timed_out,
            "bridge_summary": _summary_lines(output),
            "tail": output[-1500:],
        }
    return cases


def _script_cases(script, cases_run, scratch, timeout, cache, args=(), commands=None):
    """Run one of benchmarks/programs' scripts per case (torch eager, torch.compile through its
    `--compile` flag, the bridge, or `commands`: case -> extra arguments, under the bridge when
    the case's name starts with "bridge"); each prints `RESULT {json}`."""
    script = os.path.join(HERE, "programs", script)
    commands = commands or {"torch": [], "torch-compile": ["--compile"], "bridge": []}
    cases = {}
    for case in cases_run:
        extra = [script, *args, *commands[case]]
        if case.startswith("bridge"):
            command, env = _bridge(extra, os.path.join(scratch, cache))
        else:
            command, env = [sys.executable, *extra], None
        output, seconds, timed_out = _run(command, scratch, timeout, env)
        result = re.findall(r"RESULT (\{.*\})", output)
        cases[case] = {
            **(json.loads(result[-1]) if result else {}),
            "wall_seconds": round(seconds, 1),
            "timed_out": timed_out,
            "bridge_summary": _summary_lines(output),
            "tail": output[-1500:],
        }
    return cases


def hf_trainer(scratch, timeout):
    return _script_cases("hf_trainer_gpt2.py", ("torch", "bridge"), scratch, timeout, "cache-hf")


def timm_train(scratch, timeout):
    return _script_cases("timm_train.py", ("torch", "torch-compile", "bridge"), scratch, timeout, "cache-timm")


def vit_train(scratch, timeout, model="vit_small_patch16_224"):
    return _script_cases("timm_train.py", ("torch", "torch-compile", "bridge"), scratch, timeout, f"cache-{model}", ["--model", model])


GENERATE_CASES = ("torch", "torch-compile", "torch-static-eager", "bridge", "bridge-warm", "bridge-static")


def hf_generate(scratch, timeout, only=None):
    checkpoint = os.path.join(scratch, "gpt2-bytes.pt")
    script = os.path.join(HERE, "programs", "hf_generate.py")
    output, seconds, _ = _run([sys.executable, script, "--checkpoint", checkpoint, "--train", "300"], scratch, timeout)
    trained = {"train_seconds": round(seconds, 1), "train_tail": output[-300:]}
    run = [case for case in GENERATE_CASES if only is None or case in only]
    cases = _script_cases(
        "hf_generate.py",
        run,
        scratch,
        timeout,
        "cache-generate",
        ["--checkpoint", checkpoint],
        {
            "torch": [],
            "torch-compile": ["--cache", "static"],
            "torch-static-eager": ["--cache", "static", "--no-compile"],
            "bridge": [],
            "bridge-warm": [],  # again, with the compilation cache the first run left
            "bridge-static": ["--cache", "static"],
        },
    )
    reference = cases.get("torch", {}).get("tokens")
    for data in cases.values():
        tokens = data.pop("tokens", None)
        data["same_tokens_as_torch"] = tokens is not None and tokens == reference
    cases.setdefault("torch", {})["training"] = trained
    return cases


def imagenet(checkout, scratch, seconds):
    folder = os.path.join(checkout, "imagenet")
    args = ["main.py", "-a", "resnet50", "--dummy", "-p", "10", "-j", "12", "--epochs", "1"]
    cases = {}
    for case, command, env in (
        ("torch", [sys.executable, *args], None),
        ("bridge", *_bridge(args, os.path.join(scratch, "cache-imagenet"))),
    ):
        output, wall, timed_out = _run(command, folder, seconds, env)
        # "Epoch: [0][  50/5005]\tTime  0.046 ( 0.081)": the running average is in parentheses
        progress = re.findall(r"Epoch: \[0\]\[\s*(\d+)/\d+\]\s+Time\s+([0-9.]+) \(\s*([0-9.]+)\)", output)
        cases[case] = {
            "batches": int(progress[-1][0]) if progress else 0,
            "last_batch_seconds": float(progress[-1][1]) if progress else None,
            "average_batch_seconds": float(progress[-1][2]) if progress else None,
            # batch time averaged over the progress lines of the run's second half (past compiling)
            "steady_batch_seconds": (
                round(sorted(float(p[1]) for p in progress[len(progress) // 2 :])[len(progress[len(progress) // 2 :]) // 2], 4)
                if len(progress) >= 4 else None
            ),
            "wall_seconds": round(wall, 1),
            "bridge_summary": _summary_lines(output),
            "tail": output[-1500:],
        }
    return cases


def _synthetic_corpus(folder):
    """WikiText-2's shape: about 2M training tokens over a 33k vocabulary, in lines."""
    rng = random.Random(0)
    vocabulary = [f"w{i}" for i in range(33000)]
    os.makedirs(folder, exist_ok=True)
    for name, lines in (("train.txt", 36000), ("valid.txt", 3700), ("test.txt", 4300)):
        with open(os.path.join(folder, name), "w") as out:
            for _ in range(lines):
                out.write(" " + " ".join(rng.choices(vocabulary, k=rng.randint(20, 90))) + " \n")


WORD_LM_ARGS = ["main.py", "--accel", "--model", "Transformer", "--epochs", "1", "--log-interval", "100", "--lr", "5"]


def word_lm(checkout, scratch, seconds):
    folder = os.path.join(scratch, "word_language_model")
    shutil.copytree(os.path.join(checkout, "word_language_model"), folder, dirs_exist_ok=True)
    _synthetic_corpus(os.path.join(folder, "data", "wikitext-2"))
    args = WORD_LM_ARGS
    cases = {}
    for case, command, env in (
        ("torch", [sys.executable, *args], None),
        ("bridge", *_bridge(args, os.path.join(scratch, "cache-wordlm"))),
    ):
        output, wall, timed_out = _run(command, folder, seconds, env)
        progress = re.findall(r"\|\s+(\d+)/\s*\d+ batches \|.*?ms/batch\s+([0-9.]+)", output)
        cases[case] = {
            "batches": int(progress[-1][0]) if progress else 0,
            "ms_per_batch": float(progress[-1][1]) if progress else None,
            "wall_seconds": round(wall, 1),
            "bridge_summary": _summary_lines(output),
            "tail": output[-1500:],
        }
    return cases


def _ratio(numerator, denominator):
    return round(numerator / denominator, 3) if numerator and denominator else None


def report(results, versions, out):
    lines = [
        "# Real programs: torch eager, torch.compile and the bridge, one run",
        "",
        "Machine and versions: " + ", ".join(f"{key} {value}" for key, value in versions.items()),
        "Command: `python benchmarks/real_programs.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| program | torch eager | torch.compile | bridge | bridge / eager | bridge / compile |",
        "|---|---|---|---|---|---|",
    ]
    for program, cases in results.items():
        key, unit = FIGURES[program]
        values = {case: cases.get(case, {}).get(key) for case in ("torch", "torch-compile", "bridge")}
        cell = lambda value: "-" if value is None else f"{value} {unit}"  # noqa: E731
        lines.append(
            f"| {program} | {cell(values['torch'])} | {cell(values['torch-compile'])} | {cell(values['bridge'])} | "
            f"{_ratio(values['bridge'], values['torch'])} | {_ratio(values['bridge'], values['torch-compile'])} |"
        )
    lines.append("")
    for program, cases in results.items():
        lines.append(f"## {program}")
        for case, data in cases.items():
            shown = {key: value for key, value in data.items() if key not in ("tail", "bridge_summary")}
            lines.append(f"- {case}: `{json.dumps(shown)}`")
            for summary in data.get("bridge_summary", []):
                lines.append(f"  - {summary}")
        lines.append("")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "real_programs.md"), "w") as handle:
        handle.write("\n".join(lines))
    with open(os.path.join(out, "real_programs.json"), "w") as handle:
        json.dump({"versions": versions, "results": results}, handle, indent=1)
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", help="a nanoGPT checkout")
    parser.add_argument("--examples", help="a pytorch/examples checkout")
    parser.add_argument("--programs", default="nanogpt-bench,hf-trainer,timm,vit,convnext,generate,imagenet,word-lm")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--timeout", type=int, default=240, help="seconds per case at most")
    parser.add_argument("--window", type=int, default=75, help="seconds given to each imagenet and word-lm case")
    parser.add_argument("--generate-cases", help=f"a subset of {','.join(GENERATE_CASES)}")
    options = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="real-programs-")
    results = {}
    for program in options.programs.split(","):
        if program == "nanogpt-bench":
            results[program] = nanogpt_bench(options.nanogpt, scratch, options.timeout)
        elif program == "hf-trainer":
            results[program] = hf_trainer(scratch, options.timeout)
        elif program == "timm":
            results[program] = timm_train(scratch, options.timeout)
        elif program == "vit":
            results[program] = vit_train(scratch, options.timeout)
        elif program == "convnext":
            results[program] = vit_train(scratch, options.timeout, "convnext_tiny")
        elif program == "generate":
            results[program] = hf_generate(scratch, options.timeout, options.generate_cases and options.generate_cases.split(","))
        elif program == "imagenet":
            results[program] = imagenet(options.examples, scratch, options.window)
        elif program == "word-lm":
            results[program] = word_lm(options.examples, scratch, options.window)
        else:
            parser.error(f"unknown program {program}")
        report(results, machine.versions("transformers", "torchvision", "timm"), options.out)  # after each program: a cut-off run keeps what it measured


if __name__ == "__main__":
    main()
