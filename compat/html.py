"""The coverage report as one self-contained HTML page: inline CSS and script, an inline SVG chart
of the totals, and a search box that filters every table's rows by op name."""

import html
import json

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
.meta { color: #666; }
table { border-collapse: collapse; width: 100%; margin: 0.5em 0 1em; }
th, td { border-bottom: 1px solid #eee; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f6f6f6; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, .mono { font-family: ui-monospace, monospace; font-size: 12.5px; }
.pass { color: #137333; } .fail { color: #c5221f; font-weight: bold; } .other { color: #8a6d00; }
.status-mapped, .status-mapped-derived { color: #137333; } .status-decomposed { color: #1a73e8; }
.status-CPU-fallback, .status-unsupported { color: #c5221f; } .status-untested { color: #888; }
#search { font-size: 16px; padding: 6px 10px; width: 24em; position: sticky; top: 0; }
.searchbar { position: sticky; top: 0; background: white; padding: 0.5em 0; z-index: 2; }
.note { color: #555; font-size: 12.5px; }
details summary { cursor: pointer; }
"""

_SCRIPT = """
function filterRows() {
  const query = document.getElementById('search').value.trim().toLowerCase();
  for (const table of document.querySelectorAll('table.searchable')) {
    let shown = 0;
    for (const row of table.tBodies[0].rows) {
      const key = row.getAttribute('data-name');
      const visible = !query || key.includes(query);
      row.style.display = visible ? '' : 'none';
      if (visible) shown++;
    }
    const counter = document.getElementById(table.id + '-count');
    if (counter) counter.textContent = shown + ' of ' + table.tBodies[0].rows.length + ' rows';
  }
}
"""


def _escape(value):
    return html.escape(str(value), quote=True)


def _chart(headline):
    """A horizontal bar chart (inline SVG) of the headline percentages."""
    bars = [(label, value, percent) for label, value, percent in headline if percent is not None]
    row_height, label_width, bar_width = 30, 520, 360
    height = row_height * len(bars) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_width + bar_width + 150}" height="{height}" role="img" aria-label="totals">']
    for position, (label, value, percent) in enumerate(bars):
        y = 10 + position * row_height
        width = bar_width * percent / 100.0
        color = "#34a853" if percent >= 95 else ("#fbbc04" if percent >= 80 else "#ea4335")
        parts.append(f'<text x="{label_width - 8}" y="{y + 15}" text-anchor="end" font-size="12">{_escape(label)}</text>')
        parts.append(f'<rect x="{label_width}" y="{y}" width="{bar_width}" height="20" fill="#eee"/>')
        parts.append(f'<rect x="{label_width}" y="{y}" width="{width:.1f}" height="20" fill="{color}"><title>{_escape(value)}</title></rect>')
        parts.append(f'<text x="{label_width + bar_width + 8}" y="{y + 15}" font-size="12">{_escape(value)}</text>')
    for tick in (95, 98):
        x = label_width + bar_width * tick / 100.0
        parts.append(f'<line x1="{x:.1f}" y1="5" x2="{x:.1f}" y2="{height - 18}" stroke="#555" stroke-dasharray="3,3"/>')
        parts.append(f'<text x="{x:.1f}" y="{height - 5}" text-anchor="middle" font-size="11" fill="#555">{tick}%</text>')
    parts.append("</svg>")
    return "".join(parts)


def _mark_cells(statuses, marks, short_dtypes, precise=()):
    """precise: the "dtype" keys of passes with samples passed by test_ops' float64 rule (≈)."""
    cells = []
    for dtype, short in short_dtypes.items():
        if dtype not in statuses:
            continue
        status = statuses[dtype]
        css = "pass" if status == "pass" else ("fail" if status in ("fail", "timeout") else "other")
        mark = marks[status] + ("≈" if status == "pass" and dtype in precise else "")
        cells.append(f'<span class="{css}" title="{_escape(dtype)}: {_escape(status)}">{_escape(short)}{_escape(mark)}</span>')
    return " ".join(cells)


def _precise(row, phase):
    return {where.split("/")[0] for where in row.get("precise_records", ()) if where.endswith("/" + phase)}


def _status_class(status):
    return "status-" + status.replace(" ", "-").replace("(", "").replace(")", "")


def _table(table_id, headers, rows):
    """rows: (search key, [cell html])."""
    out = [f'<p class="note" id="{table_id}-count">{len(rows)} rows</p>']
    out.append(f'<table class="searchable" id="{table_id}"><thead><tr>')
    out.extend(f"<th>{_escape(header)}</th>" for header in headers)
    out.append("</tr></thead><tbody>")
    for key, cells in rows:
        out.append(f'<tr data-name="{_escape(key.lower())}">' + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def render(report, headline, legend, marks, short_dtypes, status_order):
    totals = report["totals"]
    out = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{_escape(report['title'])}</title><style>{_STYLE}</style><script>{_SCRIPT}</script></head><body>",
        f"<h1>{_escape(report['title'])}</h1>",
        f"<p class='meta'>Generated by <code>{_escape(report['command'])}</code> ({_escape(report['mode'])}) on "
        f"{_escape(report['generated'])}; torch {_escape(report['versions']['torch'])}, jax "
        f"{_escape(report['versions']['jax'])}; {_escape(report['machine'])}.</p>",
        "<h2>Totals</h2>",
        _chart(headline),
        "<table><thead><tr><th>measure</th><th>result</th></tr></thead><tbody>",
    ]
    for label, value, _ in headline:
        out.append(f"<tr><td>{_escape(label)}</td><td>{_escape(value)}</td></tr>")
    out.append("</tbody></table>")
    core = totals["core_aten"]
    out.append(
        "<p>Core ATen by status: "
        + ", ".join(f"{_escape(status)} {count}" for status, count in core["by_status"].items() if count)
        + "</p>"
    )
    out.append("<table><thead><tr><th>namespace</th><th>functions</th><th>tested by OpInfo</th>")
    out.extend(f"<th>{_escape(status)}</th>" for status in status_order)
    out.append("</tr></thead><tbody>")
    for namespace, entry in totals["surface"].items():
        out.append(f"<tr><td>{_escape(namespace)}</td><td class='num'>{entry['functions']}</td><td class='num'>{entry['tested_by_opinfo']}</td>")
        out.extend(f"<td class='num'>{entry['by_status'][status]}</td>" for status in status_order)
        out.append("</tr>")
    out.append("</tbody></table>")
    out.append(f"<p class='note'>Legend: {_escape(legend)}.</p>")
    out.append("<div class='searchbar'><input id='search' type='search' placeholder='filter rows by op name…' oninput='filterRows()' autofocus></div>")

    for key, title in (("opinfo_failure_groups", "OpInfo failures by cause"), ("moduleinfo_failure_groups", "ModuleInfo failures by cause")):
        if report.get(key):
            out.append(f"<h2>{_escape(title)}</h2>")
            rows = [
                (
                    " ".join(group["examples"]) + " " + group["cause"],
                    [
                        str(group["count"]),
                        str(group["entries"]),
                        str(group["listed"]),
                        _escape(group["kind"]),
                        f"<span class='mono'>{_escape(group['cause'])}</span>",
                        _escape(", ".join(group["examples"][:8])),
                    ],
                )
                for group in report[key]
            ]
            out.append(_table(key, ["records", "entries", "listed", "kind", "cause", "examples"], rows))
    if report.get("opinfo_cpu_fallbacks"):
        out.append("<h2>ATen ops that ran through the CPU fallback</h2>")
        rows = [(group["op"] + " " + " ".join(group["examples"]), [f"<code>{_escape(group['op'])}</code>", str(group["entries"]), _escape(", ".join(group["examples"]))]) for group in report["opinfo_cpu_fallbacks"]]
        out.append(_table("fallbacks", ["op", "entries", "examples"], rows))

    out.append("<h2>Core ATen IR</h2>")
    rows = []
    for row in report["core_aten"]:
        status = row["status"]
        rows.append(
            (
                row["op"],
                [
                    f"<code>{_escape(row['op'])}</code>",
                    f"<span class='{_status_class(status)}'>{_escape(status)}</span>",
                    f"<span title='{_escape(', '.join(row['opinfo_entries']))}'>{len(row['opinfo_entries'])}</span>",
                    _escape(", ".join(row["opinfo_entries_failing"])),
                ],
            )
        )
    out.append(_table("core", ["overload", "status", "OpInfo entries dispatching it", "failing among them"], rows))

    for key, title in (("opinfo", "OpInfo entries"), ("moduleinfo", "ModuleInfo entries")):
        if not report.get(key):
            continue
        out.append(f"<h2>{_escape(title)}</h2>")
        rows = []
        for row in report[key]:
            notes = "<br>".join(f"<b>{_escape(where)}</b>: {_escape(detail)}" for where, detail in row["details"].items())
            if row["random"]:
                notes = "random: shape, dtype and reproducibility checked" + ("<br>" + notes if notes else "")
            rows.append(
                (
                    row["entry"],
                    [
                        _escape(row["entry"]),
                        _mark_cells(row["forward"], marks, short_dtypes, _precise(row, "forward")),
                        _mark_cells(row["backward"], marks, short_dtypes, _precise(row, "backward")),
                    ]
                    + (
                        [_mark_cells(row.get("backward_captured", {}), marks, short_dtypes, _precise(row, "backward_captured"))]
                        if key == "opinfo"
                        else []
                    )
                    + [
                        "<br>".join(f"<code>{_escape(op)}</code>" for op in row["cpu_fallback"]),
                        f"<details><summary>{len(row['details'])} notes</summary>{notes}</details>" if row["details"] else notes,
                    ],
                )
            )
        columns = ["entry", "forward", "backward (eager)", "backward (captured)"] if key == "opinfo" else ["entry", "forward", "backward"]
        out.append(_table(key, columns + ["CPU fallback", "notes"], rows))

    out.append("<h2>Public surface</h2>")
    rows = []
    for row in report["surface"]:
        rows.append(
            (
                row["name"],
                [
                    _escape(row["name"]),
                    f"<span class='{_status_class(row['status'])}'>{_escape(row['status'])}</span>",
                    _mark_cells(row["forward"], marks, short_dtypes),
                    _mark_cells(row["backward"], marks, short_dtypes),
                    _escape(row["evidence"]),
                ],
            )
        )
    out.append(_table("surface", ["function", "status", "forward", "backward", "evidence"], rows))

    out.append("<h2>Listed expected failures</h2>")
    rows = [
        (
            row["entry"],
            [_escape(row["database"]), _escape(row["entry"]), _escape(row["dtypes"] if row["dtypes"] == "all" else ", ".join(row["dtypes"])), _escape(", ".join(row["phases"])), _escape(row["reason"])],
        )
        for row in report["expected_failures"]
    ]
    out.append(_table("expected", ["database", "entry", "dtypes", "phases", "reason"], rows))
    out.append(f"<script type='application/json' id='totals'>{_escape(json.dumps(totals))}</script>")
    out.append("</body></html>")
    return "\n".join(out)
