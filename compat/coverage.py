"""The coverage report (`python -m bridge coverage`): status and parity of every Core ATen overload,
OpInfo and ModuleInfo entry and public torch function, with totals, as Markdown, JSON and HTML."""

import argparse
import collections
import datetime
import importlib
import json
import os
import platform
import re
import sys
import time

import torch

from . import expected_failures, harness, surface
from .harness import BACKWARD, BACKWARD_CAPTURED, FORWARD

from bridge.runtime.ladder import (  # noqa: E402  (the ladder's statuses, read statically)
    CPU_FALLBACK,
    DECOMPOSED,
    DERIVED,
    MAPPED,
    UNSUPPORTED,
    aten_status,
    functional_counterpart,
    in_dispatcher,
)

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reports")
FORMATS = ("md", "json", "html")
REPORT_NAME = "coverage"

# Status of an op or surface function (docs/design.md, "The fallback ladder").
GRAPH_ONLY = "graph-only"
UNTESTED = "untested"
STATUS_ORDER = (MAPPED, DERIVED, DECOMPOSED, GRAPH_ONLY, CPU_FALLBACK, UNSUPPORTED, UNTESTED)
SERVED = (MAPPED, DERIVED, DECOMPOSED)

# Results that leave an entry short of passing (listed or not).
NOT_PASSING = (harness.FAIL, harness.TIMEOUT, harness.EXPECTED_FAILURE, harness.OPINFO_EXPECTED_FAILURE)

SHORT_DTYPES = {
    "float32": "f32",
    "float64": "f64",
    "bfloat16": "bf16",
    "float16": "f16",
    "int64": "i64",
    "int32": "i32",
    "bool": "bool",
    "complex64": "c64",
}
MARKS = {
    harness.PASS: "✓",
    harness.FAIL: "✗",
    harness.EXPECTED_FAILURE: "xf",
    harness.UNEXPECTED_PASS: "xp",
    harness.OPINFO_SKIP: "s",
    harness.OPINFO_EXPECTED_FAILURE: "dxf",
    harness.TIMEOUT: "T",
    harness.NO_SAMPLES: "–",
}
METHOD = (
    "Each OpInfo entry runs its sample inputs (quick: the first per dtype) on eager torch on the CPU "
    "and on bridge copies; results are compared with torch.testing.assert_close at torch's default "
    "tolerances for the dtype (or the entry's own toleranceOverride), NaNs equal, dtypes exact. "
    "Gradients: a fixed random cotangent through the differentiable outputs, float32 and float64. "
    "Random ops are checked for shape, dtype and reproducibility under torch.manual_seed; indices "
    "torch leaves unspecified among equal values (sort, argsort, topk, kthvalue) must point at equal "
    "values. A sample outside the tolerance is judged against the same computation in float64 on the "
    "CPU by the rule PyTorch's test_ops applies to its Python references (TestCommon._ref_test_helper): "
    "it passes when the bridge's result is at least as close to the float64 one as torch's, summing "
    "absolute differences over all elements; such passes are marked ≈ and counted apart in the totals. "
    "A failing mismatch is called rounding when its largest error is within twice torch's. The database's own skips for test_compare_cpu, "
    "test_variant_consistency_eager and test_fn_grad (TestModule.test_cpu_gpu_parity/test_forward/"
    "test_grad for modules) are honoured and shown. A pass counts as 'no CPU fallback' only if no "
    "ATen op of the sample ran through the fallback."
)
LEGEND = (
    "✓ pass · ✗ fail · xf listed expected failure (compat/expected_failures.py) · xp listed but passes · "
    "s skipped by the database's own metadata · dxf failure the database itself marks expected · "
    "T over the time budget · – no sample torch runs · * passes only through the CPU fallback · "
    "≈ some samples passed by test_ops' float64 rule, not within the tolerance"
)


# ---------------------------------------------------------------- ATen overloads


def core_aten_overloads():
    """Every ATen overload the dispatcher knows that is tagged core, sorted by name. (The
    dispatcher's list, not dir(torch.ops.aten), which holds only the packets loaded so far.)"""
    found = {}
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        base, _, overload_name = name[len("aten::") :].partition(".")
        try:
            overload = getattr(getattr(torch.ops.aten, base), overload_name or "default")
        except (AttributeError, RuntimeError):
            continue
        if torch.Tag.core in overload.tags:
            found[str(overload)] = overload
    return [found[name] for name in sorted(found)]


# ---------------------------------------------------------------- running the sweeps


def run_sweeps(only=None, quick=False, progress=None, databases=("opinfo", "moduleinfo")):
    """Each database's sweep in child processes (see harness.run_sweep_process)."""
    results = {"opinfo": None, "moduleinfo": None}
    for database in databases:
        if only:
            result = harness.run_sweep_process(f"bridge.compat.{database}", quick=quick, only=only, progress=progress)
        else:  # every entry: two child processes at once (one per core of the machines CI runs on)
            names = importlib.import_module(f"bridge.compat.{database}").entry_names()
            result = harness.run_sweep_parallel(f"bridge.compat.{database}", names, workers=2, quick=quick, progress=progress)
        if not only or result["records"]:
            results[database] = result
    return results


# ---------------------------------------------------------------- building the report


def _rate(passed, total):
    return {"passed": passed, "total": total, "percent": round(100.0 * passed / total, 2) if total else None}


def _counted(record):
    """Records a pass rate counts: those the bridge was asked to run (not skipped by the
    database, not without samples)."""
    return record["status"] not in (harness.OPINFO_SKIP, harness.NO_SAMPLES)


def _passes(record, allow_fallback=True):
    return record["status"] == harness.PASS and (allow_fallback or not record["cpu_fallback"])


def opinfo_totals(records):
    forward32 = [r for r in records if r["phase"] == FORWARD and r["dtype"] == "float32" and _counted(r)]
    forward_all = [r for r in records if r["phase"] == FORWARD and _counted(r)]
    totals = {
        "entries": len({r["entry"] for r in records}),
        "float32_forward_no_fallback": _rate(sum(_passes(r, False) for r in forward32), len(forward32)),
        "float32_forward": _rate(sum(_passes(r) for r in forward32), len(forward32)),
        "all_dtypes_forward": _rate(sum(_passes(r) for r in forward_all), len(forward_all)),
        "all_dtypes_forward_no_fallback": _rate(sum(_passes(r, False) for r in forward_all), len(forward_all)),
    }
    for dtype in ("float32", "float64"):
        backward = [r for r in records if r["phase"] == BACKWARD and r["dtype"] == dtype and _counted(r)]
        totals[f"{dtype}_gradients"] = _rate(sum(_passes(r) for r in backward), len(backward))
        # Captured mode (the default): the op inside a compiled region, the region's gradients.
        captured = [r for r in records if r["phase"] == BACKWARD_CAPTURED and r["dtype"] == dtype and _counted(r)]
        totals[f"{dtype}_gradients_captured"] = _rate(sum(_passes(r) for r in captured), len(captured))
        totals[f"{dtype}_gradients_captured_graph_breaks"] = sum(1 for r in captured if r.get("graph_breaks"))
    by_dtype = {}
    for dtype in SHORT_DTYPES:
        chosen = [r for r in forward_all if r["dtype"] == dtype]
        by_dtype[dtype] = _rate(sum(_passes(r) for r in chosen), len(chosen))
    totals["forward_by_dtype"] = by_dtype
    totals["statuses"] = dict(collections.Counter(r["status"] for r in records))
    totals["passed_by_precision_rule"] = sum(1 for r in records if _counted(r) and _passes(r) and _precise(r))
    return totals


def _precise(record):
    """Whether a record has samples that passed by test_ops' float64 rule, not the tolerance."""
    return record.get("precise", 0) > 0


def moduleinfo_totals(records):
    by_module = collections.defaultdict(list)
    for record in records:
        by_module[record["entry"].rsplit(".", 1)[0]].append(record)
    counted_modules = [module for module, rs in by_module.items() if any(_counted(r) for r in rs)]
    passing = [module for module in counted_modules if all(_passes(r) for r in by_module[module] if _counted(r))]
    totals = {
        "modules": len(by_module),
        "modules_pass_forward_and_backward": _rate(len(passing), len(counted_modules)),
        "passing_by_precision_rule": sorted(
            module for module in passing if any(_precise(r) for r in by_module[module] if _counted(r))
        ),
        "statuses": dict(collections.Counter(r["status"] for r in records)),
    }
    for phase in (FORWARD, BACKWARD):
        chosen = [r for r in records if r["phase"] == phase and _counted(r)]
        totals[f"{phase}_records"] = _rate(sum(_passes(r) for r in chosen), len(chosen))
    return totals


def _observed_ops(results):
    """{op name: {"entries": [...], "clean": seen in a sample with no CPU fallback, "rung": ...}}."""
    observed = {}
    for database in ("opinfo", "moduleinfo"):
        result = results.get(database)
        if not result:
            continue
        for entry, phases in result["ops"].items():
            groups = phases.values() if database == "opinfo" else [phases]
            for ops in groups:
                for op, (rung, clean) in ops.items():
                    seen = observed.setdefault(op, {"entries": set(), "clean": False, "rung": rung})
                    seen["entries"].add(entry)
                    seen["clean"] = seen["clean"] or clean
    return observed


def _entry_rows(records):
    """One row per entry: its status per dtype and phase, details of what did not pass."""
    rows = collections.OrderedDict()
    for record in records:
        row = rows.setdefault(
            record["entry"],
            {
                "entry": record["entry"],
                FORWARD: {},
                BACKWARD: {},
                BACKWARD_CAPTURED: {},
                "details": {},
                "cpu_fallback": [],
                "fallback_records": [],
                "precise_records": [],
                "seconds": 0.0,
                "random": False,
            },
        )
        row[record["phase"]][record["dtype"]] = record["status"]
        if record["status"] != harness.PASS and record["detail"]:
            row["details"][f"{record['dtype']}/{record['phase']}"] = record["detail"]
        if record["cpu_fallback"]:
            row["fallback_records"].append(f"{record['dtype']}/{record['phase']}")
        if record["status"] == harness.PASS and _precise(record):
            row["precise_records"].append(f"{record['dtype']}/{record['phase']}")
            row["details"][f"{record['dtype']}/{record['phase']}"] = (
                f"{record['precise']} of {record['samples']} samples {record['precise_note']}"
            )
        for op in record["cpu_fallback"]:
            if op not in row["cpu_fallback"]:
                row["cpu_fallback"].append(op)
        row["seconds"] = round(row["seconds"] + record["seconds"], 3)
        row["random"] = row["random"] or record["random"]
    for row in rows.values():
        row["cpu_fallback"].sort()
    return list(rows.values())


def _normalize(detail):
    """An error's first line with the parts that vary between ops (numbers, shapes, names in
    quotes) blanked, so that failures of one cause group together."""
    text = re.sub(r"\(observed: (.*)\)$", r"\1", detail)
    text = re.sub(r"output \d+: ", "", text)
    text = text.split(" | ")[0]
    text = re.sub(r"aten\.[\w.]+", "aten.<op>", text)
    text = re.sub(r"'[^']*'", "'…'", text)
    text = re.sub(r"\[[^\]]*\]|\([^)]*\)", "(…)", text)
    text = re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "#", text)
    return text[:140]


def failure_groups(records):
    """What keeps entries from passing (listed expected failures included), grouped by cause:
    (kind, first ATen op to go wrong, normalized message), biggest first."""
    groups = collections.defaultdict(list)
    for record in records:
        if record["status"] not in NOT_PASSING:
            continue
        detail = record["detail"]
        observed = re.search(r"\(observed: (.*)\)$", detail)
        if observed:
            detail = observed.group(1)
        culprit = re.search(r"first op to go wrong: (aten\.[\w.]+)", detail)
        cause = _normalize(detail)
        if culprit:
            cause = f"{culprit.group(1)}: {cause}"
        groups[(record["kind"] or record["status"], cause)].append(record)
    ordered = sorted(groups.items(), key=lambda item: -len(item[1]))
    return [
        {
            "kind": kind,
            "cause": cause,
            "count": len(items),
            "listed": sum(1 for record in items if record["status"] == harness.EXPECTED_FAILURE),
            "entries": len({record["entry"] for record in items}),
            "examples": [f"{r['entry']} {r['dtype']}/{r['phase']}" for r in items[:12]],
        }
        for (kind, cause), items in ordered
    ]


def fallback_groups(records):
    """ATen ops that ran through the CPU fallback, with the entries that needed them."""
    groups = collections.defaultdict(set)
    for record in records:
        for op in record["cpu_fallback"]:
            groups[op].add(record["entry"])
    return [
        {"op": op, "entries": len(entries), "examples": sorted(entries)[:12]}
        for op, entries in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    ]


def _surface_rows(opinfo_rows_by_entry, opinfo_database, mappings, observed, opinfo_ops):
    """Status and parity of each public torch function, from the OpInfo entries that test it
    (matched by the function object or by name) or else from the ATen op of the same name."""
    by_function = collections.defaultdict(list)
    by_name = collections.defaultdict(list)
    for op in opinfo_database:
        name = f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
        if name not in opinfo_rows_by_entry:
            continue
        for function in (op.op, op.method_variant, op.inplace_variant, getattr(op, "operator_variant", None)):
            if function is not None:
                by_function[id(function)].append(name)
        by_name[op.name].append(name)
        for alias in getattr(op, "aliases", ()) or ():
            by_name[alias.name].append(name)
    rows = []
    for item in surface.items():
        entries = list(dict.fromkeys(by_function.get(id(item.function), [])))
        if not entries:
            key = item.name.removeprefix("torch.").removeprefix("Tensor.")
            entries = list(dict.fromkeys(by_name.get(key, []) or by_name.get(key.rstrip("_"), [])))
        row = {"name": item.name, "namespace": item.namespace, "evidence": "", "status": UNTESTED, FORWARD: {}, BACKWARD: {}, "entries": entries}
        if entries:
            row["evidence"] = "OpInfo " + ", ".join(entries[:3]) + (" …" if len(entries) > 3 else "")
            row["status"] = _status_from_runs(entries, opinfo_ops, opinfo_rows_by_entry)
            for phase in (FORWARD, BACKWARD):
                for dtype in SHORT_DTYPES:
                    statuses = [opinfo_rows_by_entry[e][phase][dtype] for e in entries if dtype in opinfo_rows_by_entry[e][phase]]
                    if statuses:
                        row[phase][dtype] = _combine(statuses)
        else:
            packet = surface.aten_packet(item)
            if packet is not None:
                overloads = [getattr(packet, name) for name in packet.overloads()]
                overloads = [overload for overload in overloads if in_dispatcher(overload)]
                # The functional overloads speak for the packet; an in-place packet (abs_) has only derived ones.
                functional = [overload for overload in overloads if functional_counterpart(overload) is None]
                statuses = [aten_status(overload, mappings, observed) for overload in functional or overloads]
                if statuses:
                    row["evidence"] = f"table (aten.{packet._qualified_op_name.split('::')[-1]}), no OpInfo entry"
                    row["status"] = max(statuses, key=STATUS_ORDER.index) if CPU_FALLBACK in statuses or UNSUPPORTED in statuses else min(statuses, key=STATUS_ORDER.index)
        rows.append(row)
    return rows


def _status_from_runs(entries, opinfo_ops, rows_by_entry):
    rungs = set()
    any_ran = False
    for entry in entries:
        for phase_ops in opinfo_ops.get(entry, {}).values():
            for rung, _clean in phase_ops.values():
                rungs.add(rung)
                any_ran = True
        row = rows_by_entry[entry]
        if row["cpu_fallback"]:
            rungs.add("cpu_fallback")
    if not any_ran:
        statuses = [s for e in entries for s in rows_by_entry[e][FORWARD].values()]
        if statuses and all(s in (harness.OPINFO_SKIP, harness.NO_SAMPLES) for s in statuses):
            return UNTESTED
        return UNSUPPORTED if statuses else UNTESTED
    if "cpu_fallback" in rungs:
        return CPU_FALLBACK
    if "decomposed" in rungs:
        return DECOMPOSED
    return MAPPED


def _combine(statuses):
    """One mark for several entries testing one function: the worst of them."""
    order = (
        harness.FAIL,
        harness.TIMEOUT,
        harness.UNEXPECTED_PASS,
        harness.EXPECTED_FAILURE,
        harness.OPINFO_EXPECTED_FAILURE,
        harness.PASS,
        harness.OPINFO_SKIP,
        harness.NO_SAMPLES,
    )
    return min(statuses, key=order.index)


def build(results, command, quick, only=None, started=None):
    """The report as plain data (what the JSON holds; the Markdown and HTML are views of it)."""
    import jax

    from bridge.runtime.registry import MAPPINGS

    _load_tables()

    report = {
        "title": "bridge coverage report",
        "command": command,
        "mode": "quick (first sample per entry and dtype)" if quick else "full (every sample)",
        "only": list(only) if only else None,
        "generated": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": {"torch": torch.__version__, "jax": jax.__version__, "python": platform.python_version()},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, JAX backend {jax.default_backend()}",
        "totals": {},
    }
    observed = _observed_ops(results)
    opinfo_records = results["opinfo"]["records"] if results.get("opinfo") else []
    module_records = results["moduleinfo"]["records"] if results.get("moduleinfo") else []

    # Core ATen IR
    core_rows = []
    for op in core_aten_overloads():
        status = aten_status(op, MAPPINGS, observed)
        seen = observed.get(str(op))
        entries = sorted(seen["entries"]) if seen else []
        core_rows.append({"op": str(op), "status": status, "opinfo_entries": entries})
    opinfo_rows = _entry_rows(opinfo_records)
    rows_by_entry = {row["entry"]: row for row in opinfo_rows}
    for row in core_rows:
        touching = [rows_by_entry[e] for e in row["opinfo_entries"] if e in rows_by_entry]
        failing = [
            r["entry"]
            for r in touching
            if any(s in NOT_PASSING for phase in (FORWARD, BACKWARD, BACKWARD_CAPTURED) for s in r.get(phase, {}).values())
        ]
        row["opinfo_entries_passing"] = len(touching) - len(failing)
        row["opinfo_entries_failing"] = failing
    core_counts = collections.Counter(row["status"] for row in core_rows)
    served = sum(core_counts[s] for s in SERVED)
    report["totals"]["core_aten"] = {
        "overloads": len(core_rows),
        "served_without_cpu_fallback": _rate(served, len(core_rows)),
        "by_status": {status: core_counts.get(status, 0) for status in STATUS_ORDER},
        "covered_by_opinfo": sum(1 for row in core_rows if row["opinfo_entries"]),
        "covered_and_all_passing": sum(1 for row in core_rows if row["opinfo_entries"] and not row["opinfo_entries_failing"]),
    }
    report["core_aten"] = core_rows

    if results.get("opinfo"):
        report["totals"]["opinfo"] = opinfo_totals(opinfo_records)
        report["totals"]["opinfo"]["seconds"] = round(results["opinfo"]["seconds"], 1)
        report["totals"]["opinfo"]["over_budget"] = results["opinfo"]["over_budget"]
        report["totals"]["opinfo"]["crashed"] = results["opinfo"]["crashed"]
        with_rows = {row["entry"] for row in opinfo_rows}
        # Entries that support none of the swept dtypes on the CPU: run, with nothing to record.
        report["totals"]["opinfo"]["no_records"] = sorted(set(results["opinfo"]["ops"]) - with_rows)
        report["opinfo"] = opinfo_rows
        report["opinfo_failure_groups"] = failure_groups(opinfo_records)
        report["opinfo_cpu_fallbacks"] = fallback_groups(opinfo_records)
    if results.get("moduleinfo"):
        report["totals"]["moduleinfo"] = moduleinfo_totals(module_records)
        report["totals"]["moduleinfo"]["seconds"] = round(results["moduleinfo"]["seconds"], 1)
        report["totals"]["moduleinfo"]["over_budget"] = results["moduleinfo"]["over_budget"]
        report["totals"]["moduleinfo"]["crashed"] = results["moduleinfo"]["crashed"]
        report["moduleinfo"] = _entry_rows(module_records)
        report["moduleinfo_failure_groups"] = failure_groups(module_records)

    # The public surface
    from .opinfo import load_database

    opinfo_ops = results["opinfo"]["ops"] if results.get("opinfo") else {}
    surface_rows = _surface_rows(rows_by_entry, load_database(), MAPPINGS, observed, opinfo_ops)
    report["surface"] = surface_rows
    surface_totals = {}
    for namespace in ("torch", "torch.nn.functional", "Tensor"):
        chosen = [row for row in surface_rows if row["namespace"] == namespace]
        counts = collections.Counter(row["status"] for row in chosen)
        surface_totals[namespace] = {
            "functions": len(chosen),
            "by_status": {status: counts.get(status, 0) for status in STATUS_ORDER},
            "tested_by_opinfo": sum(1 for row in chosen if row["entries"]),
        }
    report["totals"]["surface"] = surface_totals

    report["expected_failures"] = _listed_failures()
    report["totals"]["sweep_seconds"] = round(sum((results[d] or {}).get("seconds", 0.0) for d in results), 1)
    if started is not None:
        report["totals"]["report_seconds"] = round(time.perf_counter() - started, 1)
    return report


def _load_tables():
    """Register the mapping tables (what activation does first) without activating the bridge."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import bridge.op_mappings  # noqa: F401


def _listed_failures():
    rows = []
    for database, table in (("opinfo", expected_failures.OPINFO), ("moduleinfo", expected_failures.MODULEINFO)):
        for entry, listed in sorted(table.items()):
            for expected in listed:
                rows.append(
                    {
                        "database": database,
                        "entry": entry,
                        "dtypes": [str(d).replace("torch.", "") for d in expected.dtypes] if expected.dtypes else "all",
                        "phases": list(expected.phases),
                        "reason": expected.reason,
                    }
                )
    return rows


# ---------------------------------------------------------------- the headline numbers


def headline(report):
    """(label, value as text, percent or None) for the numbers the issue asks for."""
    totals = report["totals"]
    lines = []
    core = totals["core_aten"]
    lines.append(
        (
            "Core ATen IR overloads served by a table entry or a decomposition (no CPU fallback)",
            _fraction(core["served_without_cpu_fallback"]),
            core["served_without_cpu_fallback"]["percent"],
        )
    )
    if "opinfo" in totals:
        op = totals["opinfo"]
        lines.append(("OpInfo float32 forward: entries passing with no CPU fallback", _fraction(op["float32_forward_no_fallback"]), op["float32_forward_no_fallback"]["percent"]))
        lines.append(("OpInfo all dtypes forward: (entry, dtype) pairs passing", _fraction(op["all_dtypes_forward"]), op["all_dtypes_forward"]["percent"]))
        lines.append(("OpInfo gradients float32: entries passing", _fraction(op["float32_gradients"]), op["float32_gradients"]["percent"]))
        lines.append(("OpInfo gradients float64: entries passing", _fraction(op["float64_gradients"]), op["float64_gradients"]["percent"]))
        for dtype in ("float32", "float64"):
            rate = op.get(f"{dtype}_gradients_captured")
            if rate and rate["total"]:
                broke = op.get(f"{dtype}_gradients_captured_graph_breaks", 0)
                lines.append((
                    f"OpInfo gradients {dtype}, captured mode (inside a compiled region): entries passing"
                    + (f"; {broke} of them ran eagerly after a graph break" if broke else ""),
                    _fraction(rate),
                    rate["percent"],
                ))
        lines.append(("OpInfo: passing (entry, dtype, phase) records with samples that passed by test_ops' float64 rule (≈)", str(op.get("passed_by_precision_rule", 0)), None))
    if "moduleinfo" in totals:
        module = totals["moduleinfo"]
        lines.append(("ModuleInfo: modules passing forward and backward (train and eval)", _fraction(module["modules_pass_forward_and_backward"]), module["modules_pass_forward_and_backward"]["percent"]))
        by_rule = module.get("passing_by_precision_rule", [])
        lines.append(("ModuleInfo: of those, modules with inputs that passed by test_ops' float64 rule (≈)", f"{len(by_rule)}" + (f": {', '.join(by_rule)}" if by_rule else ""), None))
    lines.append(("Sweep wall time", f"{totals['sweep_seconds']:.0f} s ({report['mode'].split(' ')[0]})", None))
    return lines


def _fraction(rate):
    if not rate["total"]:
        return "n/a"
    return f"{rate['passed']} / {rate['total']} ({rate['percent']:.1f}%)"


# ---------------------------------------------------------------- writers


def _marks(statuses, fallback=(), phase=None, precise=()):
    """"f32✓ bf16✗ ..."; a pass that needed the CPU fallback gets a star, one with samples passed
    by test_ops' float64 rule a ≈."""
    marks = []
    for dtype, short in SHORT_DTYPES.items():
        if dtype in statuses:
            passed = statuses[dtype] == harness.PASS
            star = "*" if passed and f"{dtype}/{phase}" in fallback else ""
            star += "≈" if passed and f"{dtype}/{phase}" in precise else ""
            marks.append(f"{short}{MARKS[statuses[dtype]]}{star}")
    return " ".join(marks)


def _md_escape(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_markdown(report, path):
    out = []
    out.append(f"# {report['title']}\n")
    out.append(
        f"Generated by `{report['command']}` ({report['mode']}) on {report['generated']}; torch "
        f"{report['versions']['torch']}, jax {report['versions']['jax']}; {report['machine']}. "
        f"Never edited by hand: regenerate it with the command.\n"
    )
    out.append("## Totals\n")
    out.append("| measure | result |\n|---|---|")
    for label, value, _ in headline(report):
        out.append(f"| {label} | {value} |")
    totals = report["totals"]
    out.append("")
    core = totals["core_aten"]
    out.append(
        "Core ATen by status: "
        + ", ".join(f"{status} {count}" for status, count in core["by_status"].items() if count)
        + f"; {core['covered_by_opinfo']} dispatched by OpInfo samples, {core['covered_and_all_passing']} of them "
        "with every entry that dispatches them passing (listed expected failures count as not passing).\n"
    )
    if "opinfo" in totals:
        op = totals["opinfo"]
        out.append(
            "OpInfo forward by dtype: "
            + ", ".join(f"{d} {_fraction(r)}" for d, r in op["forward_by_dtype"].items() if r["total"])
            + ".\n"
        )
        out.append("OpInfo records by status: " + ", ".join(f"{k} {v}" for k, v in sorted(op["statuses"].items())) + ".\n")
        if op["over_budget"]:
            out.append("OpInfo entries over their time budget: " + ", ".join(op["over_budget"]) + ".\n")
    if "moduleinfo" in totals:
        module = totals["moduleinfo"]
        out.append(
            f"ModuleInfo records: forward {_fraction(module['forward_records'])}, backward "
            f"{_fraction(module['backward_records'])}; by status: "
            + ", ".join(f"{k} {v}" for k, v in sorted(module["statuses"].items()))
            + ".\n"
        )
    out.append("Public surface by status:\n")
    out.append("| namespace | functions | tested by OpInfo | " + " | ".join(STATUS_ORDER) + " |")
    out.append("|---|---|---|" + "---|" * len(STATUS_ORDER))
    for namespace, entry in totals["surface"].items():
        out.append(
            f"| {namespace} | {entry['functions']} | {entry['tested_by_opinfo']} | "
            + " | ".join(str(entry["by_status"][s]) for s in STATUS_ORDER)
            + " |"
        )
    out.append("")
    out.append(f"Legend: {LEGEND}.\n")
    out.append(f"How parity is checked: {METHOD}\n")

    for key, title in (("opinfo_failure_groups", "OpInfo failures by cause"), ("moduleinfo_failure_groups", "ModuleInfo failures by cause")):
        if report.get(key):
            out.append(f"## {title}\n")
            out.append("Listed expected failures included (column 'listed'); the cause names the first ATen op whose result differed from eager torch where the sweep could find it.\n")
            out.append("| records | entries | listed | kind | cause | examples |\n|---|---|---|---|---|---|")
            for group in report[key]:
                out.append(
                    f"| {group['count']} | {group['entries']} | {group['listed']} | {group['kind']} | "
                    f"{_md_escape(group['cause'])} | {_md_escape(', '.join(group['examples'][:6]))} |"
                )
            out.append("")
    if report.get("opinfo_cpu_fallbacks"):
        out.append("## ATen ops that ran through the CPU fallback in the OpInfo sweep\n")
        out.append("| op | entries | examples |\n|---|---|---|")
        for group in report["opinfo_cpu_fallbacks"]:
            out.append(f"| `{group['op']}` | {group['entries']} | {_md_escape(', '.join(group['examples'][:6]))} |")
        out.append("")

    out.append("## Core ATen IR\n")
    out.append("| overload | status | OpInfo entries dispatching it | failing among them |\n|---|---|---|---|")
    for row in report["core_aten"]:
        failing = ", ".join(row["opinfo_entries_failing"][:5]) + (" …" if len(row["opinfo_entries_failing"]) > 5 else "")
        out.append(f"| `{row['op']}` | {row['status']} | {len(row['opinfo_entries'])} | {_md_escape(failing)} |")
    out.append("")

    for key, title in (("opinfo", "OpInfo entries"), ("moduleinfo", "ModuleInfo entries (train / eval)")):
        if not report.get(key):
            continue
        out.append(f"## {title}\n")
        captured = key == "opinfo"
        if captured:
            out.append("| entry | forward | backward (eager) | backward (captured) | CPU fallback | notes |\n|---|---|---|---|---|---|")
        else:
            out.append("| entry | forward | backward | CPU fallback | notes |\n|---|---|---|---|---|")
        for row in report[key]:
            notes = "; ".join(f"{where}: {detail}" for where, detail in list(row["details"].items())[:2])
            if row["random"]:
                notes = ("random: shape, dtype, reproducibility checked; " + notes).rstrip("; ")
            out.append(
                f"| {row['entry']} | {_marks(row[FORWARD], row['fallback_records'], FORWARD, row['precise_records'])} | "
                f"{_marks(row[BACKWARD], row['fallback_records'], BACKWARD, row['precise_records'])} | "
                + (f"{_marks(row.get(BACKWARD_CAPTURED, {}), row['fallback_records'], BACKWARD_CAPTURED, row['precise_records'])} | " if captured else "")
                + f"{_md_escape(', '.join(row['cpu_fallback']))} | {_md_escape(notes[:300])} |"
            )
        out.append("")

    out.append("## Public surface\n")
    out.append("| function | status | forward | backward | evidence |\n|---|---|---|---|---|")
    for row in report["surface"]:
        out.append(f"| {row['name']} | {row['status']} | {_marks(row[FORWARD])} | {_marks(row[BACKWARD])} | {_md_escape(row['evidence'])} |")
    out.append("")

    out.append("## Listed expected failures (compat/expected_failures.py)\n")
    if report["expected_failures"]:
        out.append("| database | entry | dtypes | phases | reason |\n|---|---|---|---|---|")
        for row in report["expected_failures"]:
            dtypes = row["dtypes"] if row["dtypes"] == "all" else ", ".join(row["dtypes"])
            out.append(f"| {row['database']} | {row['entry']} | {dtypes} | {', '.join(row['phases'])} | {_md_escape(row['reason'])} |")
    else:
        out.append("None.")
    out.append("")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(out))


def write_json(report, path):
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1, sort_keys=False, ensure_ascii=False)
        handle.write("\n")


def write_html(report, path):
    from .html import render

    with open(path, "w", encoding="utf-8") as handle:
        handle.write(render(report, headline(report), LEGEND + ". " + METHOD, MARKS, SHORT_DTYPES, STATUS_ORDER))


WRITERS = {"md": write_markdown, "json": write_json, "html": write_html}


# ---------------------------------------------------------------- command line


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m bridge coverage",
        description=(
            "Run PyTorch's OpInfo and ModuleInfo databases through the bridge against eager torch on the "
            "CPU and write the coverage report (Core ATen IR, OpInfo, ModuleInfo, public torch surface)."
        ),
    )
    parser.add_argument(
        "--format",
        action="append",
        metavar="md|html|json",
        help="report format(s); repeat or give a comma list (default: all three)",
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="directory to write coverage.{md,json,html} to (default: compat/reports)")
    parser.add_argument("--quick", action="store_true", help="one sample per entry and dtype (every entry is still run)")
    parser.add_argument("--only", action="append", metavar="NAME[,NAME]", help="run only these OpInfo/ModuleInfo entries (debugging)")
    parser.add_argument("--progress", action="store_true", help="print each entry as it finishes")
    parser.add_argument("--save-results", metavar="PATH", help="also write the sweeps' raw results (records, ops) to PATH")
    parser.add_argument("--from-results", metavar="PATH", help="build the report from raw results saved earlier instead of sweeping")
    return parser


def _formats(values):
    if not values:
        return list(FORMATS)
    chosen = []
    for value in values:
        for item in value.split(","):
            item = item.strip().lower()
            if item == "markdown":
                item = "md"
            if item not in FORMATS:
                raise SystemExit(f"coverage: unknown format {item!r} (choose from {', '.join(FORMATS)})")
            if item not in chosen:
                chosen.append(item)
    return chosen


def main(argv=None):
    options = _parser().parse_args(argv)
    formats = _formats(options.format)
    only = [name.strip() for value in options.only or () for name in value.split(",") if name.strip()] or None
    command = "python -m bridge coverage" + (" --quick" if options.quick else "")
    if only:
        command += " --only " + ",".join(only)
    started = time.perf_counter()

    def progress(entry, records, seconds):
        bad = [f"{r['dtype']}/{r['phase']}: {r['status']}" for r in records if r["status"] not in harness.ACCEPTED]
        print(f"{entry} {seconds:.1f}s {'; '.join(bad)}", file=sys.stderr, flush=True)

    if options.from_results:
        with open(options.from_results, encoding="utf-8") as handle:
            saved = json.load(handle)
        results, command, only = saved["results"], saved["command"], saved["only"]
        options.quick = saved["quick"]
    else:
        results = run_sweeps(only=only, quick=options.quick, progress=progress if options.progress else None)
    if options.save_results:
        os.makedirs(os.path.dirname(os.path.abspath(options.save_results)), exist_ok=True)
        with open(options.save_results, "w", encoding="utf-8") as handle:
            json.dump({"command": command, "quick": options.quick, "only": only, "results": results}, handle)
    report = build(results, command, options.quick, only, started)
    os.makedirs(options.out, exist_ok=True)
    for fmt in formats:
        path = os.path.join(options.out, f"{REPORT_NAME}.{fmt}")
        WRITERS[fmt](report, path)
        print(f"coverage: wrote {path}", file=sys.stderr)
    for label, value, _ in headline(report):
        print(f"{label}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
