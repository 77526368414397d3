"""`python -m bridge compare`: does my script print the same numbers under the bridge?"""

import os
import re
import subprocess
import sys

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)\b")


def numbers(line):
    return [float(token) for token in _NUMBER.findall(line)]


def _run(command, env=None):
    return subprocess.run(command, capture_output=True, text=True, env=env)


def compare_outputs(expected, actual, rtol, atol, match=None):
    """Compare two programs' stdout line by line; returns (worst relative difference, problems)."""
    pattern = re.compile(match) if match else None
    expected_lines = [line for line in expected.splitlines() if pattern is None or pattern.search(line)]
    actual_lines = [line for line in actual.splitlines() if pattern is None or pattern.search(line)]
    problems = []
    if len(expected_lines) != len(actual_lines):
        problems.append(f"plain torch printed {len(expected_lines)} lines, the bridge {len(actual_lines)}")
    worst = 0.0
    for number, (plain, bridged) in enumerate(zip(expected_lines, actual_lines), 1):
        plain_numbers, bridged_numbers = numbers(plain), numbers(bridged)
        if len(plain_numbers) != len(bridged_numbers):
            problems.append(f"line {number}: {plain!r} vs {bridged!r}")
            continue
        for a, b in zip(plain_numbers, bridged_numbers):
            if a != a and b != b:  # both NaN
                continue
            difference = abs(a - b)
            relative = difference / abs(a) if a else difference
            worst = max(worst, relative)
            if difference > atol + rtol * abs(a):
                problems.append(f"line {number}: {a!r} vs {b!r} (relative difference {relative:.2e}): {bridged.strip()}")
    return worst, problems


def compare_script(script, args, rtol=1e-5, atol=0.0, match=None, device="auto", mode=None):
    plain_env = dict(os.environ)
    plain_env.setdefault("CUDA_VISIBLE_DEVICES", "")  # plain torch runs on its CPU, as the reference
    plain = _run([sys.executable, script, *args], env=plain_env)
    mode_option = ["--mode", mode] if mode else []
    bridged = _run([sys.executable, "-m", "bridge", "run", "--quiet", "--device", device, *mode_option, script, *args])
    for name, result in (("plain torch", plain), ("the bridge", bridged)):
        if result.returncode != 0:
            print(f"bridge compare: {script} failed under {name} (exit code {result.returncode}):", file=sys.stderr)
            print(result.stderr[-4000:], file=sys.stderr)
            return 1
    worst, problems = compare_outputs(plain.stdout, bridged.stdout, rtol, atol, match)
    compared = len([line for line in plain.stdout.splitlines() if not match or re.search(match, line)])
    print(f"bridge compare: {compared} lines compared, worst relative difference {worst:.2e} (rtol {rtol:g}, atol {atol:g})")
    for problem in problems[:20]:
        print(f"  differs: {problem}")
    if len(problems) > 20:
        print(f"  ... and {len(problems) - 20} more")
    return 1 if problems else 0
