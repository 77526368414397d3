"""pytorch/examples' word_language_model (`--model Transformer`, the synthetic WikiText-2-shaped
corpus of real_programs.py) under two versions of the bridge, alternating, with torch eager first
and last: whether a change moved its time per batch, on a machine whose speed drifts.

    python benchmarks/word_lm_pair.py --examples PATH --before PATH [--seconds 60] [--pairs 2] [--out DIR] [--name NAME]

`--before` is another checkout of this repository (for instance `git worktree add /tmp/before
<commit>`); this one runs as "after". Each run is cut off after `--seconds`; a figure is the
median of main.py's own ms/batch over its intervals of 100 batches, leaving out the first
(which holds the compiles). Writes <out>/<name>.md.
"""

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import machine  # noqa: E402
import real_programs  # noqa: E402


def _run(folder, code, cache, seconds):
    """main.py's ms/batch per interval of 100 batches, the first left out: under torch (`code`
    None) or under the bridge checked out at `code`."""
    if code is None:
        command, env = [sys.executable, *real_programs.WORD_LM_ARGS], None
    else:
        command, env = real_programs._bridge(real_programs.WORD_LM_ARGS, cache)
        env["PYTHONPATH"] = code
    output, _, _ = real_programs._run(command, folder, seconds, env)  # (unbuffered: a run cut off keeps what it printed)
    return [float(value) for value in re.findall(r"ms/batch\s+([0-9.]+)", output)][1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", required=True, help="a pytorch/examples checkout")
    parser.add_argument("--before", required=True, help="a checkout of the bridge to compare with")
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="word_lm_pair")
    options = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="word-lm-pair-")
    folder = os.path.join(scratch, "word_language_model")
    shutil.copytree(os.path.join(options.examples, "word_language_model"), folder)
    real_programs._synthetic_corpus(os.path.join(folder, "data", "wikitext-2"))
    after = os.path.dirname(HERE)
    runs = [("torch", None)] + [(name, code) for _ in range(options.pairs) for name, code in (("after", after), ("before", options.before))]
    runs.append(("torch, again", None))
    lines = []
    for name, code in runs:
        values = _run(folder, code, os.path.join(scratch, "cache"), options.seconds)
        median = statistics.median(values) if values else None
        lines.append(f"| {name} | {median} | {len(values)} | {', '.join(map(str, values))} |")
        print(lines[-1], flush=True)
    text = "\n".join([
        "# word_language_model (Transformer): the bridge before and after a change, alternating",
        "",
        f"Command: `python benchmarks/word_lm_pair.py {' '.join(sys.argv[1:])}`; generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Machine and versions: {machine.versions()}",
        "",
        "| run | median ms/batch | intervals of 100 batches | each interval's ms/batch |",
        "|---|---|---|---|",
        *lines,
        "",
    ])
    os.makedirs(options.out, exist_ok=True)
    with open(os.path.join(options.out, options.name + ".md"), "w") as handle:
        handle.write(text)


if __name__ == "__main__":
    main()
