"""README.md's benchmark tables, rebuilt from the results files they cite.

    python benchmarks/tables.py           # rewrite the tables in README.md
    python benchmarks/tables.py --check   # exit 1 with a diff if README.md is out of date

Each table sits in README.md between `<!-- table:NAME -->` and `<!-- /table:NAME -->`. Its rows
are declared below, each with the file its figures come from (benchmarks/results/INDEX.md says
what each file shows). Standard library only: it runs without a GPU or a network.
"""

import argparse
import difflib
import json
import re
import statistics
import sys
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE.parent / "README.md"
sys.path.insert(0, str(HERE))

from real_programs import FIGURES  # noqa: E402


def _load(name):
    return json.loads((RESULTS / f"{name}.json").read_text())


def _significant(value, digits=3):
    """`value` to `digits` significant figures, halves rounded up as a reader rounds them."""
    exact = Decimal(repr(value))
    step = Decimal(1).scaleb(exact.adjusted() - digits + 1)
    return str(exact.quantize(step, rounding=ROUND_HALF_UP))


# Real programs (benchmarks/real_programs.py): one row per program and run.


@dataclass(frozen=True)
class ProgramRow:
    label: str  # the program as the README names it
    results: str  # a real_programs results file, without its extension
    program: str  # its key in that file


PROGRAM_ROWS = (
    ProgramRow(
        "nanoGPT `bench.py` (GPT-2 small, bf16, `AdamW(fused=True)`, two parameter groups)",
        "real_programs_h200_2026-11-29_5",
        "nanogpt-bench",
    ),
    ProgramRow("nanoGPT `bench.py`, the run before", "real_programs_h200_2026-11-29_4", "nanogpt-bench"),
    ProgramRow("nanoGPT `bench.py`, another run", "real_programs_h200_2026-11-29_3", "nanogpt-bench"),
    ProgramRow("nanoGPT `bench.py`, another run", "real_programs_h200_2026-11-29", "nanogpt-bench"),
    ProgramRow("nanoGPT `bench.py`, another run", "real_programs_h200_2026-11-28_late", "nanogpt-bench"),
    ProgramRow("nanoGPT `bench.py`, another run", "real_programs_h200_2026-11-28_night", "nanogpt-bench"),
    ProgramRow("nanoGPT `bench.py`, another run", "real_programs_h200_2026-11-28_flat_parameters", "nanogpt-bench"),
    ProgramRow(
        "nanoGPT `bench.py`, before the parameters were packed", "real_programs_h200_2026-11-28_nanogpt_trainer", "nanogpt-bench"
    ),
    ProgramRow("nanoGPT `bench.py`, another run", "real_programs_h200_2026-11-27_facts_2", "nanogpt-bench"),
    ProgramRow(
        "HF `Trainer` defaults, GPT-2 6x768 from a config, batch 8x512",
        "real_programs_h200_2026-11-29_5",
        "hf-trainer",
    ),
    ProgramRow("HF `Trainer`, the run before", "real_programs_h200_2026-11-29_4", "hf-trainer"),
    ProgramRow("HF `Trainer`, another run", "real_programs_h200_2026-11-29_3", "hf-trainer"),
    ProgramRow("HF `Trainer`, another run", "real_programs_h200_2026-11-29", "hf-trainer"),
    ProgramRow("HF `Trainer`, another run", "real_programs_h200_2026-11-28_flat_parameters", "hf-trainer"),
    ProgramRow("HF `Trainer`, before the parameters were packed", "real_programs_h200_2026-11-28_nanogpt_trainer", "hf-trainer"),
    ProgramRow("HF `Trainer`, another run", "real_programs_h200_2026-11-28_generate_default_cache", "hf-trainer"),
    ProgramRow("timm `vit_small_patch16_224` training, bf16, AdamW", "real_programs_h200_2026-11-28_generate_vit", "vit"),
    ProgramRow("timm `vit_small_patch16_224`, another run", "real_programs_h200_2026-11-27_generate_vit", "vit"),
    ProgramRow("timm `vit_small_patch16_224`, another run", "real_programs_h200_2026-11-28_timm_convnext_vit", "vit"),
    ProgramRow(
        "timm `convnext_tiny` training, bf16, AdamW", "real_programs_h200_2026-11-28_narrow_conv_gradients", "convnext"
    ),
    ProgramRow(
        "timm `convnext_tiny`, before bfloat16 convolutions' gradients were bfloat16 convolutions",
        "real_programs_h200_2026-11-28_timm_convnext_vit",
        "convnext",
    ),
    ProgramRow(
        "HF `generate`, GPT-2 12x768, greedy, 128 new tokens, generate's default cache (the bridge decodes "
        "with HF's static cache; torch.compile: HF's static cache, compiled)",
        "real_programs_h200_2026-11-28_generate_vit",
        "generate",
    ),
    ProgramRow("HF `generate`, default cache, another run", "real_programs_h200_2026-11-28_generate_in_program_mask", "generate"),
    ProgramRow(
        "HF `generate`, default cache, before HF's mask was built inside the decoding program",
        "real_programs_h200_2026-11-28_generate_default_cache",
        "generate",
    ),
    ProgramRow(
        "HF `generate`, the cache asked static for the bridge",
        "real_programs_h200_2026-11-27_facts",
        "generate",
    ),
    ProgramRow("HF `generate`, static, another run", "real_programs_h200_2026-11-27_deferred_updates", "generate"),
    ProgramRow(
        "HF `generate`, static, the run before in-place updates ran together",
        "real_programs_h200_2026-11-27_host_int_ops",
        "generate",
    ),
    ProgramRow(
        "timm `resnet50`, bf16, timm's AdamW and clip (`benchmarks/programs/timm_train.py`)",
        "real_programs_h100_2026-11-26_pm",
        "timm",
    ),
    ProgramRow("timm `resnet50`, another run", "real_programs_h200_2026-11-28_narrow_conv_gradients", "timm"),
    ProgramRow(
        "timm `resnet50`, before bfloat16 convolutions' gradients were bfloat16 convolutions",
        "real_programs_h200_2026-11-28_timm_convnext_vit",
        "timm",
    ),
    ProgramRow("pytorch/examples imagenet `-a resnet50 --dummy` (DataParallel)", "real_programs_h200_2026-11-28_night", "imagenet"),
    ProgramRow("pytorch/examples imagenet, the run before", "real_programs_h200_2026-11-27_host_int_ops_2", "imagenet"),
    ProgramRow("pytorch/examples imagenet, another run", "real_programs_h100_2026-11-26_pm_2", "imagenet"),
    ProgramRow(
        "pytorch/examples word_language_model `--model Transformer` (before slices at moving offsets were views)",
        "real_programs_h200_2026-11-28_late",
        "word-lm",
    ),
    ProgramRow("word_language_model, the run before", "real_programs_h200_2026-11-28_night", "word-lm"),
    ProgramRow("word_language_model, another run", "real_programs_h200_2026-11-27_facts", "word-lm"),
    ProgramRow("word_language_model, another run", "real_programs_h200_2026-11-27_deferred_updates", "word-lm"),
    ProgramRow(
        "word_language_model, the run before in-place updates ran together",
        "real_programs_h200_2026-11-27_host_int_ops",
        "word-lm",
    ),
)

_CAPTURED = re.compile(r"captured mode: (\d+) region program\(s\) compiled .*?(\d+) graph break\(s\)")


def _gpu(versions):
    """The GPU's short name ("H100") from a results file's versions."""
    found = re.search(r"\b([A-Z]\d{2,4})\b", versions.get("gpu", ""))
    return found.group(1) if found else "CPU"


def _programs_cell(bridge):
    """The bridge's compiled programs and graph breaks, from its summary lines."""
    cell = "-"
    for line in bridge.get("bridge_summary", []):
        found = _CAPTURED.search(line)
        if found:
            regions, breaks = int(found.group(1)), int(found.group(2))
            cell = f"{regions} region{'s' if regions > 1 else ''}"
            if "update(s), each one program" in line:
                cell += " + the optimizer's update as one program"
            cell += ", no graph break" if breaks == 0 else f", {breaks} graph breaks"
    if bridge.get("same_tokens_as_torch"):
        cell += "; the same tokens as torch eager"
    return cell


def _ratio(numerator, denominator):
    return f"{numerator / denominator:.2f}x" if numerator and denominator else None


def _figure(value, unit):
    return "-" if value is None else f"{_significant(value)} {unit}"


def real_programs_table():
    lines = [
        "| program | torch eager | torch.compile | bridge | bridge / compile (/ eager) | bridge's programs | machine, results |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in PROGRAM_ROWS:
        data = _load(row.results)
        cases = data["results"][row.program]
        key, unit = FIGURES[row.program]
        eager, compiled, bridge = (cases.get(case, {}).get(key) for case in ("torch", "torch-compile", "bridge"))
        to_compile, to_eager = _ratio(bridge, compiled), _ratio(bridge, eager)
        ratios = f"{to_compile} ({to_eager})" if to_compile else f"({to_eager})"
        lines.append(
            f"| {row.label} | {_figure(eager, unit)} | {_figure(compiled, unit)} | {_figure(bridge, unit)} | {ratios} "
            f"| {_programs_cell(cases['bridge'])} | {_gpu(data['versions'])}, `{row.results}.md` |"
        )
    return "\n".join(lines)


# The goals (benchmarks/run.py on an H100, and cpu_overhead.py on this repository's CPU).

# 2026-11-24's runs, every compilation cache empty (results/h100_session_2026-11-24_pm.md).
SESSION_GPT2 = ("gpt2_bf16_final_1124", "gpt2_final_1124", "gpt2_bf16_repeat_1124")
SESSION_RESNET = ("resnet50_final_1124", "resnet50_repeat_1124")


@dataclass(frozen=True)
class Later:
    """A run after the goal's main runs, shown apart from their median."""

    label: str
    results: str
    before: str = ""  # the same run on the code before the change, for the bridge's figure alone


@dataclass(frozen=True)
class Goal:
    goal: str
    bridge: tuple  # (workload, precision, case) of the bridge's figure
    other: tuple  # the figure it is held to
    runs: tuple  # run.py results files measured side by side; their median is the goal's
    later: tuple = ()
    also: tuple = ()  # (name, (workload, precision, case)): more comparisons in the same runs


GOALS = (
    Goal(
        "GPT-2 small bf16 ≤ `torch.compile`",
        ("gpt2", "bf16", "bridge-captured"),
        ("gpt2", "bf16", "torch-compile"),
        SESSION_GPT2,
        later=(
            Later(
                "2026-11-25, captured gradients by torch's rules",
                "gpt2_bf16_after_torch_rules",
                before="gpt2_bf16_before_torch_rules",
            ),
            Later("JAX 0.12.0.1", "gpt2_bf16_jax012"),
        ),
    ),
    Goal(
        "GPT-2 small bf16 ≤ hand-written JAX",
        ("gpt2", "bf16", "bridge-captured"),
        ("gpt2", "bf16", "jax"),
        SESSION_GPT2,
        later=(Later("JAX 0.12.0.1", "gpt2_bf16_jax012"),),
    ),
    Goal(
        "GPT-2 small float32 ≤ torch eager",
        ("gpt2", "fp32", "bridge-captured"),
        ("gpt2", "fp32", "torch"),
        ("gpt2_final_1124",),
        also=(("`torch.compile`", ("gpt2", "fp32", "torch-compile")),),
    ),
    Goal(
        'float32 with `set_float32_matmul_precision("high")` ≤ hand-written JAX (TF32)',
        ("gpt2", "fp32-high", "bridge-captured"),
        ("gpt2", "fp32", "jax"),
        ("gpt2_final_1124",),
    ),
    Goal(
        "ResNet-50 ≤ `torch.compile`",
        ("resnet50", "fp32", "bridge-captured"),
        ("resnet50", "fp32", "torch-compile"),
        SESSION_RESNET,
        later=(
            Later(
                "2026-11-25, captured gradients by torch's rules",
                "resnet50_after_torch_rules",
                before="resnet50_before_torch_rules",
            ),
        ),
    ),
)

MEMORY = (  # peak memory ≤ torch eager's: (name, run, workload, precision)
    ("GPT-2 float32", "gpt2_final_1124", "gpt2", "fp32"),
    ("bf16", "gpt2_final_1124", "gpt2", "bf16"),
    ("ResNet-50", "resnet50_final_1124", "resnet50", "fp32"),
)

CPU_RATIOS = (  # cpu_overhead.md's notes table: its row, the name the README gives it, the goal
    ("bridge eager `torch.add` / raw `jnp.add`", "`torch.add`", 2),
    ("bridge eager `a + b` / raw `jnp.add`", "`a + b`", 2),
    ("bridge eager matmul / raw `jnp` matmul", "matmul", 2),
    ("plain CPU tensors while active, add", "plain tensors", 1.1),
    ("small GPT, bridge captured / hand-written JAX", "small GPT", 1.1),
)


def _cases(name):
    return {(r["workload"], r["precision"], r["case"]): r for r in _load(name)["results"] if "error" not in r}


def _versus(name, bridge, other):
    """(ratio, "a against b ms") of the bridge's step time to the other's in one run."""
    cases = _cases(name)
    a, b = cases[bridge]["step_ms"], cases[other]["step_ms"]
    return a / b, f"{a:.1f} against {b:.1f} ms"


def _files(names):
    return ", ".join(f"`{name}.md`" for name in names)


def _goal_row(goal):
    measured = [_versus(name, goal.bridge, goal.other) for name in goal.runs]
    cell = ", ".join(f"{ratio:.2f}x ({figures})" for ratio, figures in measured)
    if len(measured) > 1:
        median = statistics.median(ratio for ratio, _ in measured)
        cell += f": median **{median:.2f}x**, above the goal" if median > 1 else f": median {median:.2f}x"
    for name, other in goal.also:
        for run in goal.runs:
            ratio, figures = _versus(run, goal.bridge, other)
            cell += f"; {ratio:.2f}x {name}'s ({figures})"
    files = list(goal.runs)
    for later in goal.later:
        ratio, figures = _versus(later.results, goal.bridge, goal.other)
        cell += f"; {later.label}: {ratio:.2f}x ({figures}"
        files.append(later.results)
        if later.before:
            cell += f"; {_cases(later.before)[goal.bridge]['step_ms']:.1f} ms on the code before"
            files.append(later.before)
        cell += ")"
    return f"| {goal.goal} | {cell} | {_files(files)} |"


def _first_step_row():
    ratios = []
    for name in SESSION_GPT2 + SESSION_RESNET:
        cases = _cases(name)
        for (workload, precision, case), result in cases.items():
            compiled = cases.get((workload, precision, "torch-compile"))
            if case == "bridge-captured" and compiled:
                ratios.append(result["first_step_s"] / compiled["first_step_s"])
    return f"| first step ≤ 2x `torch.compile`'s | {min(ratios):.2f}-{max(ratios):.2f}x | the 2026-11-24 files above |"


def _memory_row():
    parts = []
    for label, name, workload, precision in MEMORY:
        cases = _cases(name)
        a = cases[(workload, precision, "bridge-captured")]["peak_memory_gib"]
        b = cases[(workload, precision, "torch")]["peak_memory_gib"]
        parts.append(f"{label} {a / b:.2f}x ({a:.2f} against {b:.2f} GiB)")
    files = dict.fromkeys(name for _, name, _, _ in MEMORY)
    return f"| peak memory ≤ torch eager's | {', '.join(parts)} | {_files(files)} |"


def _cpu_row():
    """The medians of several runs, which only cpu_overhead.md's notes table holds."""
    text = (RESULTS / "cpu_overhead.md").read_text()
    rows = dict(
        (name.strip(), [float(run) for run in runs.split(",")])
        for name, runs, _ in re.findall(r"^\| (.+?) \| ([0-9., ]+) \| ([0-9.]+)x \|$", text, re.MULTILINE)
    )
    parts = []
    for row, name, goal in CPU_RATIOS:
        runs = rows[row]
        above = [run for run in runs if run > goal]
        parts.append(f"{name} {statistics.median(runs):.2f}x" + (f" ({len(above)} of {len(runs)} runs above {goal}x)" if above else ""))
    return (
        "| CPU (2 cores): eager op ≤ 2x raw `jnp`; plain tensors ≤ 1.1x; small GPT captured ≤ 1.1x hand-written JAX "
        f"| medians of {len(rows[CPU_RATIOS[0][0]])} runs: {', '.join(parts)} | `cpu_overhead.md` |"
    )


def goals_table():
    lines = ["| goal | measured (ratio: bridge against the other) | files |", "|---|---|---|"]
    lines += [_goal_row(goal) for goal in GOALS]
    lines += [_first_step_row(), _memory_row(), _cpu_row()]
    return "\n".join(lines)


TABLES = {"real-programs": real_programs_table, "goals": goals_table}


def render(readme):
    """`readme` with every table region rebuilt from the results files."""
    for name, build in TABLES.items():
        region = re.compile(rf"(<!-- table:{name} -->\n).*?(<!-- /table:{name} -->)", re.DOTALL)
        if not region.search(readme):
            raise SystemExit(f"README.md has no <!-- table:{name} --> ... <!-- /table:{name} --> region")
        table = build()
        readme = region.sub(lambda found: f"{found.group(1)}\n{table}\n\n{found.group(2)}", readme)
    return readme


def check(path=README):
    """The diff between `path` and its rebuilt tables; empty when it is up to date."""
    text = path.read_text()
    return "".join(
        difflib.unified_diff(
            text.splitlines(keepends=True), render(text).splitlines(keepends=True), str(path), "rebuilt from benchmarks/results"
        )
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether README.md is up to date")
    options = parser.parse_args(argv)
    if options.check:
        diff = check()
        if diff:
            print(diff + "\nREADME.md's benchmark tables are out of date: run python benchmarks/tables.py")
            return 1
        return 0
    README.write_text(render(README.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
