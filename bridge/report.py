"""Run reports: the exit summary on stderr, and the report file (JSON, or a self-contained HTML page)."""

import html
import json
import os
import sys

from bridge import whole_module
from bridge.runtime import capture, stats


def _data():
    data = stats.summary()
    data["capture"] = capture.summary()
    data["whole_modules"] = whole_module.summary()
    return data


def _whole_module_line(record):
    """One module met by the whole-module rung (bridge/whole_module.py), for the summary."""
    cause = f"{record['op']} has no mapping, first at {record['site']}"
    if record["status"] == "exported":
        note = f"; {record['reason']}" if record["reason"] else ""
        regions = f", and inside captured regions' programs ({record['traced']} trace(s))" if record["traced"] else ""
        return (
            f"bridge: module {record['module']} ran whole through torch.export: {record['calls']} call(s) on their own"
            f"{regions}, {record['programs']} export(s); {cause}{note}"
        )
    if record["status"] == "not exported":
        return f"bridge: module {record['module']} could not be exported ({record['reason']}); its {cause}, runs on the host CPU"
    return f"bridge: module {record['module']} was to run whole through torch.export from its next call ({cause}); it was not called again"


def summary_text(data=None):
    data = data or _data()
    by_rung = data["by_rung"]
    lines = [
        f"bridge: {data['ops_run']} torch ops ran ({data['distinct_ops']} distinct) in {data['wall_seconds']:.1f} s: "
        + ", ".join(f"{count} {rung}" for rung, count in by_rung.items()),
    ]
    exported = [record for record in data.get("whole_modules", ()) if record["status"] == "exported"]
    if exported:
        lines[0] += f"; {len(exported)} module(s) run whole through torch.export"
    slow = [op for op in data["ops"] if op["rung"] != stats.MAPPED and op["host_seconds"] >= 0.01]
    if slow:
        # What the slow rungs cost, largest first, so that what dominates shows at once.
        lines.append(
            "bridge: host time off the mapped rung: "
            + ", ".join(
                f"{op['op']} ({op['rung']}) {op['calls']} call(s) {op['host_seconds']:.2f} s"
                for op in sorted(slow, key=lambda op: -op["host_seconds"])[:5]
            )
        )
    for fallback in data["cpu_fallbacks"]:
        lines.append(
            f"bridge: CPU fallback {fallback['op']} ran {fallback['calls']} time(s), first at {fallback['first_call_site']}"
        )
    for record in data.get("whole_modules", ()):
        lines.append(_whole_module_line(record))
    if data.get("host_runs"):
        lines.append(
            "bridge: small integer ops ran on the host by torch's CPU kernels (token ids, positions, masks): "
            + ", ".join(f"{op} {count} call(s)" for op, count in list(data["host_runs"].items())[:5])
        )
    deferred = data.get("deferred_updates")
    if deferred and deferred["ops"]:
        lines.append(
            f"bridge: in-place updates ran together: {deferred['ops']} op(s) in {deferred['batches']} "
            f"batch(es), {deferred['programs']} program(s) compiled for them"
        )
    averages = data.get("ddp_gradient_averages")
    if averages and (averages["in_step"] or averages["alone"]):
        lines.append(
            f"bridge: DistributedDataParallel's gradient averages: {averages['in_step']} inside the optimizer's "
            f"step program, {averages['alone']} in a program of their own (the gradients were read before the step)"
        )
    if data.get("hf_static_caches"):
        lines.append(
            "bridge: HF generate decoded with its StaticCache where it would grow a DynamicCache every token "
            "(BRIDGE_HF_STATIC_CACHE=0 keeps it): "
            + ", ".join(f"{model} {count} call(s)" for model, count in data["hf_static_caches"].items())
        )
    if data.get("uncompiled"):
        lines.append(
            "bridge: ops run uncompiled, a JAX dispatch per step of their mapping: "
            + ", ".join(f"{entry['op']} {entry['calls']} call(s) ({entry['why']})" for entry in data["uncompiled"][:5])
        )
    for correction in data["dtype_corrections"]:
        lines.append(f"bridge: mapping of {correction['op']} {correction['detail']}")
    captured = data["capture"]
    if captured["mode"] == "captured":
        seconds = sum(record["seconds"] for record in captured["compiles"])
        regions = sorted({record["region"] for record in captured["compiles"]})
        steps = captured["optimizer_steps_as_one_program"]
        lines.append(
            f"bridge: captured mode: {len(captured['compiles'])} region program(s) compiled in {seconds:.1f} s"
            + (f" ({', '.join(regions)})" if regions else "")
            + "".join(f", {count} {name} update(s), each one program" for name, count in sorted(steps.items()))
            + f", {len(captured['graph_breaks'])} graph break(s)"
        )
        for record in captured["compiles"]:
            if record["reason"] != "first call":
                lines.append(f"bridge: {record['region']}: {record['reason']}")
        if captured.get("hooked_modules"):
            lines.append(
                "bridge: modules whose hooks need Python on each call ran their own code, their submodules "
                "as regions of their own: "
                + ", ".join(f"{name} {count} call(s)" for name, count in list(captured["hooked_modules"].items())[:5])
            )
        for record in captured["graph_breaks"]:
            lines.append(
                f"bridge: graph break in {record['region']}: {record['reason']}, at {record['site']}; "
                f"ran op by op {record['calls']} time(s), {record['seconds']:.2f} s"
            )
    return "\n".join(lines)


def unwritable(path):
    """Why the run report cannot be written to `path` (checked before the script runs, so
    that a run is not lost to a typo in a folder's name), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a folder; name a file in it, such as {os.path.join(path, 'report.json')}"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist; create it first (mkdir -p {folder})"
    if not os.access(folder, os.W_OK):
        return f"the folder {folder} is not writable"
    return None


def write_report(path):
    """Write the run report to `path`: an HTML page if it ends in .html, else JSON."""
    data = _data()
    with open(path, "w") as handle:
        if str(path).lower().endswith((".html", ".htm")):
            handle.write(html_page(data))
        else:
            json.dump(data, handle, indent=2)
    return data


def _bar_chart(title, values, unit):
    """An inline SVG horizontal bar chart of {label: number}."""
    items = [(label, value) for label, value in values.items() if value]
    if not items:
        return f"<h2>{html.escape(title)}</h2><p>nothing recorded</p>"
    largest = max(value for _, value in items)
    row, width, label_width = 24, 420, 260
    bars = []
    for position, (label, value) in enumerate(items):
        y = position * row
        length = max(1, int(width * value / largest))
        shown = f"{value:.3f} {unit}" if isinstance(value, float) else f"{value} {unit}"
        bars.append(
            f'<text x="0" y="{y + 16}">{html.escape(str(label))}</text>'
            f'<rect x="{label_width}" y="{y + 4}" width="{length}" height="16" class="bar"/>'
            f'<text x="{label_width + length + 6}" y="{y + 16}">{html.escape(shown)}</text>'
        )
    height = row * len(items)
    return (
        f"<h2>{html.escape(title)}</h2>"
        f'<svg width="{label_width + width + 160}" height="{height}" role="img">{"".join(bars)}</svg>'
    )


def _capture_section(captured):
    if captured["mode"] != "captured":
        return "<h2>Captured execution</h2><p>off: the run was in eager mode (op by op).</p>"
    compiles = "".join(
        f"<tr><td>{html.escape(item['region'])}</td><td>{html.escape(item['reason'])}</td><td>{item['seconds']:.2f}</td></tr>"
        for item in captured["compiles"]
    ) or '<tr><td colspan="3">none</td></tr>'
    breaks = "".join(
        f"<tr><td>{html.escape(item['region'])}</td><td>{html.escape(item['reason'])}</td><td><code>{html.escape(item['site'])}</code></td>"
        f"<td>{item['calls']}</td><td>{item['seconds']:.2f}</td></tr>"
        for item in captured["graph_breaks"]
    ) or '<tr><td colspan="5">none</td></tr>'
    return (
        f"<h2>Compiled programs</h2><table><tr><th>region</th><th>why compiled</th><th>seconds</th></tr>{compiles}</table>"
        "<h2>Graph breaks</h2><table><tr><th>region</th><th>reason</th><th>where</th><th>calls run op by op</th>"
        f"<th>their seconds</th></tr>{breaks}</table>"
    )


def html_page(data):
    """The run report as one self-contained page (inline CSS and SVG, no external assets)."""
    fallbacks = "".join(
        f"<tr><td>{html.escape(item['op'])}</td><td>{item['calls']}</td><td><code>{html.escape(item['first_call_site'])}</code></td></tr>"
        for item in data["cpu_fallbacks"]
    ) or '<tr><td colspan="3">none</td></tr>'
    whole = "".join(
        f"<tr><td>{html.escape(item['module'])}</td><td>{html.escape(item['op'])}</td><td><code>{html.escape(item['site'])}</code></td>"
        f"<td>{html.escape(item['status'])}</td><td>{item['calls']}</td><td>{item['traced']}</td><td>{html.escape(item['reason'])}</td></tr>"
        for item in data.get("whole_modules", ())
    ) or '<tr><td colspan="7">none</td></tr>'
    corrections = "".join(
        f"<li>{html.escape(item['op'])}: {html.escape(item['detail'])}</li>" for item in data["dtype_corrections"]
    )
    ops = "".join(
        f"<tr><td>{html.escape(item['op'])}</td><td>{item['calls']}</td><td>{html.escape(item['rung'])}</td>"
        f"<td>{html.escape(str(item['family']))}</td><td>{item['host_seconds'] * 1e3:.2f}</td></tr>"
        for item in data["ops"]
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>bridge run report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }} td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: left; }}
svg text {{ font-size: 13px; }} .bar {{ fill: #4878a8; }} code {{ font-size: 12px; }}
</style></head><body>
<h1>bridge run report</h1>
<p>{data['ops_run']} torch ops ran ({data['distinct_ops']} distinct) in {data['wall_seconds']:.1f} s.</p>
{_bar_chart("Ops by rung of the fallback ladder", data["by_rung"], "calls")}
{_bar_chart("Host time by op family", data["host_seconds_by_family"], "s")}
<h2>CPU fallbacks</h2>
<table><tr><th>op</th><th>calls</th><th>first call site</th></tr>{fallbacks}</table>
<h2>Modules run whole through torch.export</h2>
<p>A module whose forward reached an op with no mapping and no decomposition runs, from its next call, as its
torch.export translated into one JAX function; where export fails, the op keeps the CPU fallback.</p>
<table><tr><th>module</th><th>op</th><th>first call site</th><th>status</th><th>calls on their own</th><th>traces into regions</th><th>why not, or note</th></tr>{whole}</table>
{_capture_section(data["capture"])}
{"<h2>dtype corrections</h2><ul>" + corrections + "</ul>" if corrections else ""}
<h2>Every op</h2>
<table><tr><th>op</th><th>calls</th><th>rung</th><th>family</th><th>host ms</th></tr>{ops}</table>
</body></html>
"""


def finish(report_path=None, quiet=False):
    """What a run does at its end: the JSON report if asked for, and the summary unless quiet."""
    data = write_report(report_path) if report_path else _data()
    if not quiet:
        print(summary_text(data), file=sys.stderr)
