"""Run reports: the exit summary on stderr and the JSON file."""

import json
import sys

from runtime import stats


def summary_text(data=None):
    data = data or stats.summary()
    by_rung = data["by_rung"]
    lines = [
        f"bridge: {data['ops_run']} torch ops ran ({data['distinct_ops']} distinct) in {data['wall_seconds']:.1f} s: "
        + ", ".join(f"{count} {rung}" for rung, count in by_rung.items()),
    ]
    for fallback in data["cpu_fallbacks"]:
        lines.append(
            f"bridge: CPU fallback {fallback['op']} ran {fallback['calls']} time(s), first at {fallback['first_call_site']}"
        )
    for correction in data["dtype_corrections"]:
        lines.append(f"bridge: mapping of {correction['op']} {correction['detail']}")
    return "\n".join(lines)


def write_report(path):
    data = stats.summary()
    with open(path, "w") as handle:
        json.dump(data, handle, indent=2)
    return data


def finish(report_path=None, quiet=False):
    """What a run does at its end: the JSON report if asked for, and the summary unless quiet."""
    data = write_report(report_path) if report_path else stats.summary()
    if not quiet:
        print(summary_text(data), file=sys.stderr)
