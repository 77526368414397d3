"""Several GPUs of one host: nanoGPT's train.py (its own DDP path) under torchrun, plain torch
against the bridge, for each process count; the DDP parity script of the tests and pytorch/examples'
ddp-tutorial-series on 2 GPUs. Writes distributed_<machine>_<date>.md with every command.

    python benchmarks/distributed_runs.py --nanogpt NANOGPT --tutorial DDP_TUTORIAL --fsdp2 FSDP2 --gpus 1,2 --out DIR

FSDP2 (`--fsdp2`, pytorch/examples' distributed/FSDP2 folder): its example.py unmodified, and
benchmarks/programs/fsdp_large.py (its Transformer at 4.3 B parameters, too large for one GPU:
plain torch on one GPU is run to show it) on the largest process count, plain torch and the bridge.

nanoGPT's data is synthetic (random tokens in data/synthetic); torch runs with its default
torch.compile, the bridge captures. Times are the median of each run's iterations after the
first five (nanoGPT's own "time ... ms" lines); tokens/s per GPU is nanoGPT's tokens per
iteration over that time and the number of processes.
"""

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ITERATION = re.compile(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms", re.M)


def _run(command, cwd, timeout, env=None):
    started = time.time()
    full = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", **(env or {}))
    try:
        done = subprocess.run(command, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        text, code = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(errors="replace"), "timeout"
    return text, code, time.time() - started


def _synthetic(nanogpt):
    import numpy as np

    folder = os.path.join(nanogpt, "data", "synthetic")
    os.makedirs(folder, exist_ok=True)
    generator = np.random.default_rng(0)
    for split in ("train", "val"):
        generator.integers(0, 50257, size=2_000_000, dtype=np.uint16).tofile(os.path.join(folder, f"{split}.bin"))


def nanogpt(nanogpt_dir, processes, bridge, iterations, timeout, log):
    accumulation = 2 * max(processes, 1)  # two micro-batches per process and iteration
    arguments = ["train.py", "--dataset=synthetic", "--batch_size=8", "--block_size=1024",
                 f"--gradient_accumulation_steps={accumulation}", f"--max_iters={iterations}", "--eval_interval=100000",
                 "--eval_iters=1", "--log_interval=1", "--always_save_checkpoint=False", "--dtype=bfloat16",
                 "--compile=True", "--wandb_log=False"]
    report = os.path.join(os.path.abspath(nanogpt_dir), "bridge-report.json")
    run = ["-m", "bridge", "run", "--report", report]
    if processes == 0:  # one process, no torchrun: the script without DDP
        command = [sys.executable, *(run if bridge else []), *arguments]
        processes = 1
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        command = launcher + ([*run, *arguments] if bridge else arguments)
    text, code, seconds = _run(command, nanogpt_dir, timeout)
    averages = _report_entry(report if processes == 1 else report.replace(".json", ".rank0.json"), "ddp_gradient_averages")
    log.write(f"\n$ {' '.join(command)}\n{text[-6000:]}\n")
    found = [(int(i), float(loss), float(ms)) for i, loss, ms in ITERATION.findall(text)]
    tokens = re.search(r"tokens per iteration will be: ([\d,]+)", text)
    times = [ms for i, _, ms in found if i >= 5]
    if code != 0 or not times or not tokens:
        return {"ok": False, "code": code, "seconds": seconds}
    median = statistics.median(times)
    per_iteration = int(tokens.group(1).replace(",", ""))
    return {"ok": True, "ms": median, "tokens_per_gpu": per_iteration / (median / 1000) / processes,
            "losses": [loss for _, loss, _ in found], "seconds": seconds, "command": " ".join(command),
            "averages": averages if bridge else None}


def _report_entry(path, key):
    import json

    try:
        with open(path) as handle:
            data = json.load(handle)
        os.remove(path)
    except (OSError, ValueError):
        return None
    return data.get(key) if key != "capture" else {"graph_breaks": len(data["capture"]["graph_breaks"])}


STEP = re.compile(r"^step (\d+) loss ([\d.]+) time ([\d.]+)ms", re.M)


def fsdp_example(folder, processes, timeout, log):
    """pytorch/examples' FSDP2 example.py, unmodified (it writes its checkpoints beside it)."""
    import shutil

    results = {}
    for name, prefix in (("torch", ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]),
                         ("bridge", ["-m", "bridge", "run", "--nproc-per-node", str(processes)])):
        shutil.rmtree(os.path.join(folder, "checkpoints"), ignore_errors=True)
        command = [sys.executable, *prefix, "example.py"]
        text, code, seconds = _run(command, folder, timeout)
        log.write(f"\n$ {' '.join(command)}\n{text[-5000:]}\n")
        saved = os.path.isdir(os.path.join(folder, "checkpoints"))
        results[name] = (code, seconds, saved)
    return results


def fsdp_large(folder, processes, timeout, log, layers=20, steps=8):
    """benchmarks/programs/fsdp_large.py: one GPU under plain torch (expected out of memory), then
    fully_shard over `processes` GPUs under plain torch and under the bridge."""
    script = os.path.join(HERE, "programs", "fsdp_large.py")
    report = os.path.join(REPO, "fsdp-report.json")
    runs = {}
    size = ["--fsdp2", folder, "--layers", str(layers), "--steps", str(steps)]
    for name, command in (
        ("torch, 1 GPU, the global batch", [sys.executable, script, *size, "--single", "--steps", "3"]),
        (f"torch FSDP2, {processes} GPUs", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                           f"--nproc_per_node={processes}", script, *size]),
        (f"bridge FSDP2, {processes} GPUs", [sys.executable, "-m", "bridge", "run", "--report", report,
                                            "--nproc-per-node", str(processes), script, *size]),
    ):
        text, code, seconds = _run(command, REPO, timeout)
        log.write(f"\n$ {' '.join(command)}\n{text[-6000:]}\n")
        steps = [(int(i), float(loss), float(ms)) for i, loss, ms in STEP.findall(text)]
        summary = re.search(r"^median .*$", text, re.M)
        memory = "out of memory" if "OutOfMemoryError" in text or "out of memory" in text.lower() else ""
        breaks = _report_entry(report.replace(".json", ".rank0.json"), "capture") if name.startswith("bridge") else None
        runs[name] = {"code": code, "seconds": seconds, "steps": steps, "summary": summary.group(0) if summary else "",
                      "memory": memory, "breaks": breaks, "command": " ".join(command)}
    return runs


def parity(processes, timeout, log):
    script = os.path.join(REPO, "tests", "distributed", "train_ddp.py")
    options = ["--optimizer", "adamw", "--accumulate", "2", "--steps", "5"]
    results = {}
    for name, command in (
        ("bridge DDP", [sys.executable, "-m", "bridge", "run", "--nproc-per-node", str(processes), script, *options]),
        ("bridge one process", [sys.executable, "-m", "bridge", "run", script, *options]),
        ("torch DDP (NCCL)", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc_per_node={processes}", script, *options]),
    ):
        text, code, _ = _run(command, REPO, timeout)
        log.write(f"\n$ {' '.join(command)}\n{text[-4000:]}\n")
        losses = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("step ")]
        weights = [line for line in text.splitlines() if line.startswith("weights")]
        results[name] = (code, losses, weights[0] if weights else "")
    return results


def tutorial(folder, processes, timeout, log):
    results = {}
    for name, prefix in (("bridge", ["-m", "bridge", "run", "--nproc-per-node", str(processes)]),
                         ("torch", ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"])):
        command = [sys.executable, *prefix, "multigpu_torchrun.py", "3", "1"]
        text, code, seconds = _run(command, folder, timeout)
        log.write(f"\n$ {' '.join(command)}\n{text[-3000:]}\n")
        results[name] = (code, seconds, text.count("Epoch 2 | Batchsize: 32"))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", required=True)
    parser.add_argument("--tutorial")
    parser.add_argument("--fsdp2", help="pytorch/examples' distributed/FSDP2 folder")
    parser.add_argument("--fsdp-layers", type=int, default=20, help="fsdp_large.py's layers (20: 4.3 B parameters)")
    parser.add_argument("--fsdp-steps", type=int, default=8)
    parser.add_argument("--gpus", default="1,2")
    parser.add_argument("--iterations", type=int, default=25)
    parser.add_argument("--timeout", type=int, default=200)
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: nanogpt,parity,tutorial,fsdp_example,fsdp")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    options = parser.parse_args()
    import jax
    import torch

    machine = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip().splitlines()
    label = f"{len(machine)}x{machine[0].split()[1].lower() if machine else 'cpu'}"
    stamp = datetime.date.today().isoformat()
    skip = set(options.skip.split(","))
    parts = "-".join(part for part in ("nanogpt", "parity", "tutorial", "fsdp_example", "fsdp") if part not in skip)
    name = f"distributed_{label}_{stamp}_gpus{options.gpus.replace(',', '-')}_{parts}"
    path = os.path.join(options.out, f"{name}.md")
    log = open(os.path.join(options.out, f"{name}.log"), "w")
    lines = [f"# Several GPUs: torch DDP against the bridge ({stamp})", "",
             f"Machine: {len(machine)} x {machine[0] if machine else '?'}; python {sys.version.split()[0]}, "
             f"torch {torch.__version__}, jax {jax.__version__}. Command: `python benchmarks/distributed_runs.py "
             f"--gpus {options.gpus} --iterations {options.iterations}` (nanoGPT: GPT-2 small, bf16, batch 8 x 1024 "
             "tokens per micro-batch, two micro-batches per process and iteration, synthetic tokens).", ""]
    if "nanogpt" not in skip:
        _synthetic(options.nanogpt)
        lines += ["## nanoGPT train.py", "", "| processes | torch ms/iter | bridge ms/iter | torch tokens/s/GPU | "
                  "bridge tokens/s/GPU | bridge / torch | bridge / bridge's 1-GPU |", "|---|---|---|---|---|---|---|"]
        single = nanogpt(options.nanogpt, 0, True, options.iterations, options.timeout, log)
        lines_single = (f"One process without torchrun under the bridge: {single.get('ms', float('nan')):.1f} ms/iter, "
                        f"{single.get('tokens_per_gpu', float('nan')):,.0f} tokens/s"
                        if single["ok"] else f"One process without torchrun under the bridge: failed ({single['code']})")
        losses, reports = {}, {}
        for count in [int(n) for n in options.gpus.split(",")]:
            torch_run = nanogpt(options.nanogpt, count, False, options.iterations, options.timeout, log)
            bridge_run = nanogpt(options.nanogpt, count, True, options.iterations, options.timeout, log)
            losses[count] = (torch_run.get("losses"), bridge_run.get("losses"))
            reports[count] = bridge_run.get("averages")

            def cell(run, key, form):
                return format(run[key], form) if run["ok"] else f"failed ({run['code']})"

            ratio = bridge_run["tokens_per_gpu"] / torch_run["tokens_per_gpu"] if bridge_run["ok"] and torch_run["ok"] else float("nan")
            scaling = bridge_run["tokens_per_gpu"] / single["tokens_per_gpu"] if bridge_run["ok"] and single["ok"] else float("nan")
            lines.append(f"| {count} | {cell(torch_run, 'ms', '.1f')} | {cell(bridge_run, 'ms', '.1f')} | "
                         f"{cell(torch_run, 'tokens_per_gpu', ',.0f')} | {cell(bridge_run, 'tokens_per_gpu', ',.0f')} | "
                         f"{ratio:.3f} | {scaling:.3f} |")
            log.flush()
        lines += ["", lines_single, "", "Rank 0's loss per iteration (its own micro-batches; nanoGPT draws each "
                  "rank's batches from its own seed, so runs of different process counts see other data):", ""]
        for count, (torch_losses, bridge_losses) in losses.items():
            lines.append(f"- {count} process(es): torch {torch_losses}; bridge {bridge_losses}")
        lines += ["", "DistributedDataParallel's gradient averages in the bridge's runs (rank 0's run report):", ""]
        for count, averages in reports.items():
            lines.append(f"- {count} process(es): {averages}")
        lines.append("")
    if "parity" not in skip:
        results = parity(2, options.timeout, log)
        lines += ["## DDP parity (tests/distributed/train_ddp.py, float32, 2 GPUs)", ""]
        for name, (code, losses, weights) in results.items():
            lines.append(f"- {name} (exit {code}): losses {losses}; {weights}")
        lines.append("")
    if "tutorial" not in skip and options.tutorial:
        results = tutorial(options.tutorial, 2, options.timeout, log)
        lines += ["## pytorch/examples ddp-tutorial-series/multigpu_torchrun.py, 2 GPUs, 3 epochs", ""]
        for name, (code, seconds, epochs) in results.items():
            lines.append(f"- {name}: exit {code}, {seconds:.1f} s, last epoch reported by {epochs} rank(s)")
        lines.append("")
    if "fsdp" not in skip and options.fsdp2:
        count = max(int(n) for n in options.gpus.split(","))
        if "fsdp_example" not in skip:
            example = fsdp_example(options.fsdp2, count, options.timeout, log)
            lines += [f"## pytorch/examples distributed/FSDP2/example.py, unmodified, {count} GPUs", ""]
            for name, (code, seconds, saved) in example.items():
                lines.append(f"- {name}: exit {code}, {seconds:.1f} s, checkpoint written: {saved}")
        runs = fsdp_large(options.fsdp2, count, options.timeout, log, options.fsdp_layers, options.fsdp_steps)
        lines += ["", f"## A model too large for one GPU: benchmarks/programs/fsdp_large.py, {count} GPUs", "",
                  f"pytorch/examples' FSDP2 Transformer with {options.fsdp_layers} layers of width 4096, Adam in "
                  "float32, 4 sequences of 512 tokens per GPU and step, made on the meta device and sharded per "
                  "block and at the root.", ""]
        for name, run in runs.items():
            losses = [loss for _, loss, _ in run["steps"]]
            lines.append(f"- {name}: exit {run['code']}, {run['seconds']:.0f} s{'; ' + run['memory'] if run['memory'] else ''}; "
                         f"{run['summary'] or 'no summary'}; losses {losses}"
                         + (f"; graph breaks (rank 0's report): {run['breaks']}" if run["breaks"] is not None else ""))
            lines.append(f"  `{run['command']}`")
        lines.append("")
    with open(path, "w") as handle:
        handle.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
