"""The ONNX backend conformance suite's node tests, and the script corpus's models exported with
torch.onnx.export, through the bridge's ONNX table.

    python -m bridge.compat.onnx_conformance [--only REGEX] [--out compat/reports]
    python -m bridge.compat.onnx_conformance --corpus [--out compat/reports]

The cases come from the onnx package's own generators (onnx.backend.test.case.node: each a
one-node model, or that node expanded into its function's ops, with inputs and the reference
outputs), built in memory: nothing is downloaded or written but the report. Each case runs as
bridge.load runs a model: the graph translated once (runtime/onnx_graph.py) under jax.jit, its
numeric inputs traced. A case whose graph needs an input's value while it is traced (a Reshape
to a shape given as an input, NonZero) runs again with its inputs known while tracing, and is
counted apart. Outputs are compared as the suite's runner compares them: same shape and dtype,
rtol=1e-3 and atol=1e-7 (its defaults; two bfloat16 ULPs for bfloat16), strings equal. Cases of
ops that draw random numbers are compared by shape and dtype. Writes <out>/onnx.md, keeping its
corpus section.

With --corpus, each model a compat/scripts program calls (compat/harness.py's corpus_models) is
exported in eval mode with torch.onnx.export as tests/test_onnx.py exports (the TorchScript
exporter at opset 17; the dynamo exporter where that one refuses), its ops listed as `bridge check`
lists them, run by `bridge.load` and compared with eager torch by tests/test_onnx.py's rule; only
the corpus section of <out>/onnx.md is rewritten.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import sys
import time
import traceback
import warnings

import numpy as np
import torch
from torch.utils import _pytree as pytree

PASSED, PASSED_KNOWN, FAILED, UNSUPPORTED = "passed", "passed, inputs known", "failed", "no mapping"

# Whole ops the bridge does not run, with the reason (their cases fail; the report lists them).
EXPECTED_FAILURES = {
    "StringConcat": "strings: JAX arrays hold numbers only",
    "StringSplit": "strings: JAX arrays hold numbers only",
    "StringNormalizer": "strings: JAX arrays hold numbers only",
    "RegexFullMatch": "strings: JAX arrays hold numbers only",
    "TfIdfVectorizer": "text features: not in the table",
    "ImageDecoder": "decodes image files: not an array op",
    "ai.onnx.ml::LabelEncoder": "ai.onnx.ml (classical ML) is not in the table",
    "ai.onnx.ml::TreeEnsemble": "ai.onnx.ml (classical ML) is not in the table",
    "ai.onnx.ml::ArrayFeatureExtractor": "ai.onnx.ml (classical ML) is not in the table",
    "ai.onnx.ml::Binarizer": "ai.onnx.ml (classical ML) is not in the table",
    "ai.onnx.preview.training::Adagrad": "training ops (ai.onnx.preview.training) are not in the table",
    "ai.onnx.preview.training::Adam": "training ops (ai.onnx.preview.training) are not in the table",
    "ai.onnx.preview.training::Momentum": "training ops (ai.onnx.preview.training) are not in the table",
}
# Single cases the bridge does not pass, with the reason.
EXPECTED_CASE_FAILURES = {
    **{f"test_cast_{source}_to_{target}": "JAX has no 2-bit integer types" for source in ("FLOAT", "FLOAT16") for target in ("UINT2", "INT2")},
    **{f"test_cast_{source}_to_{target}": "ONNX wraps out-of-range values into 4 bits; the cast saturates (not matched yet)"
       for source in ("FLOAT", "FLOAT16") for target in ("UINT4", "INT4")},
    **{f"test_cast_{source}_to_FLOAT8E5M2": "saturating float8 e5m2 cast: ONNX's rounding of values past the largest (not matched yet)"
       for source in ("FLOAT", "FLOAT16")},
    **{f"test_cast_e8m0_{source}_to_FLOAT8E8M0": "float8 e8m0: ONNX rounds up (round_mode), ml_dtypes to nearest" for source in ("FLOAT", "FLOAT16")},
    **{f"test_not_{rank}d": "opset 1: the table reads opsets 7 and later" for rank in (2, 3, 4)},
    "test_maxpool_with_argmax_2d_precomputed_strides": "MaxPool's Indices output with strides (not matched yet)",
    **{f"test_resize_downsample_{kind}_antialias": "Resize's antialias filter when downsampling (not matched yet)"
       for kind in ("scales_linear", "sizes_linear", "scales_cubic", "sizes_cubic")},
    **{f"test_resize_downsample_scales_{mode}_align_corners": "Resize align_corners with downsampling scales (not matched yet)"
       for mode in ("linear", "cubic")},
}
RANDOM_OPS = {"Bernoulli", "RandomUniformLike", "RandomNormalLike", "RandomUniform", "RandomNormal", "Multinomial"}


def collect_cases():
    """The suite's node cases: [(name, model, data sets)], as its generators make them."""
    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = node.collect_testcases(None)
    return [case for case in cases if case.kind == "node"]


def _op_name(node):
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def case_op(case):
    """The op a case is named for: its model's one node, or the op its expanded graph stands for."""
    names = [_op_name(node) for node in case.model.graph.node]
    if "_expanded" in case.name or len(names) != 1:
        base = case.name.split("_expanded")[0]
        for name in sorted(set(names), key=len, reverse=True):
            if name.lower() in base.replace("_", "").lower():
                return name
    return names[0] if len(names) == 1 else names[-1]


def case_opset(case):
    return next((item.version for item in case.model.opset_import if item.domain in ("", "ai.onnx")), 0)


def _similar(actual, expected, random):
    """None where actual matches expected as the suite's runner judges it, else why not."""
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return f"expected a sequence of {len(expected)}, got {type(actual).__name__}"
        for actual_item, expected_item in zip(actual, expected):
            reason = _similar(actual_item, expected_item, random)
            if reason:
                return reason
        return None
    if expected is None:
        return None if actual is None else "expected an empty optional"
    if actual is None:
        return "got an empty optional"
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return f"shape {actual.shape}, expected {expected.shape}"
    if expected.dtype == object:
        return None if np.array_equal(actual.astype(object), expected) else "strings differ"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    if random:
        return None
    rtol, atol = 1e-3, 1e-7
    if actual.dtype.name == "bfloat16":
        rtol = max(rtol, 2**-6)
    if actual.dtype.kind not in "fciub" or actual.dtype.name.startswith(("float8", "float4", "int4", "uint4", "bfloat16")):
        actual, expected = actual.astype(np.float32), expected.astype(np.float32)
    try:
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as error:
        lines = [line.strip() for line in str(error).splitlines() if "Max absolute" in line or "Max relative" in line]
        return "values differ: " + "; ".join(lines)
    return None


def _array(value):
    """A case's input or output as NumPy (cases of exotic element types hold TensorProtos)."""
    from onnx import TensorProto, numpy_helper

    if isinstance(value, TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, (list, tuple)):
        return [_array(item) for item in value]
    return value


def _traceable(value):
    if isinstance(value, np.ndarray):
        return value.dtype != object
    if isinstance(value, list):
        return all(_traceable(item) for item in value)
    return False


def run_case(case, table):
    """(status, detail) of one case."""
    import jax

    from bridge.runtime import onnx_graph
    from bridge.runtime.errors import DataDependentShapeError, UnsupportedOnnxOpError

    random = any(node.op_type in RANDOM_OPS for node in case.model.graph.node)
    try:
        function, state = onnx_graph.to_jax(case.model, table, source=case.name)
    except Exception as error:  # noqa: BLE001 - reported per case
        return FAILED, _reason(error)
    for inputs, expected in case.data_sets:
        inputs, expected = [_array(value) for value in inputs], [_array(value) for value in expected]
        traced = [position for position, value in enumerate(inputs) if _traceable(value)]
        status = PASSED

        def call(traced_values, inputs=inputs, traced=traced):
            given = list(inputs)
            for position, value in zip(traced, traced_values):
                given[position] = value
            return function(state, *given)

        try:
            try:
                outputs = jax.jit(call)([inputs[position] for position in traced])
            except (DataDependentShapeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                    jax.errors.TracerIntegerConversionError, jax.errors.TracerBoolConversionError):
                status = PASSED_KNOWN
                outputs = function(state, *inputs)
            outputs = jax.tree_util.tree_map(np.asarray, list(outputs), is_leaf=lambda leaf: leaf is None)
        except UnsupportedOnnxOpError as error:
            return UNSUPPORTED, _reason(error)
        except Exception as error:  # noqa: BLE001 - reported per case
            return FAILED, _reason(error)
        reason = _similar(list(outputs), list(expected), random)
        if reason:
            return FAILED, reason
    return status, "random: shape and dtype compared" if random else ""


def _reason(error):
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return re.sub(r"\s+", " ", text)[:220]


def run(only=None, out=None, echo=print):
    import jax

    import bridge  # noqa: F401  (jax's x64, as the bridge runs)
    from bridge.op_mappings import onnx_ops  # noqa: F401  (the table's registrations)
    from bridge.runtime.onnx_graph import ONNX_OPS

    jax.config.update("jax_enable_x64", True)
    cases = collect_cases()
    if only:
        cases = [case for case in cases if re.search(only, case.name)]
    results = []
    start = time.time()
    for number, case in enumerate(cases):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            status, detail = run_case(case, ONNX_OPS)
        op = case_op(case)
        if status in (FAILED, UNSUPPORTED) and op in EXPECTED_FAILURES:
            detail = f"expected: {EXPECTED_FAILURES[op]}"
        elif status in (FAILED, UNSUPPORTED) and case.name in EXPECTED_CASE_FAILURES:
            detail = f"expected: {EXPECTED_CASE_FAILURES[case.name]} ({detail})"
        results.append((case.name, op, case_opset(case), status, detail))
        if echo and (number % 100 == 0 or status == FAILED and only):
            echo(f"[{number + 1}/{len(cases)}] {case.name}: {status} {detail}")
    elapsed = time.time() - start
    if out:
        write_report(out, node_part=render(results, elapsed))
    return results


def _counts(rows):
    counts = collections.Counter(status for *_, status, _ in rows)
    return counts[PASSED], counts[PASSED_KNOWN], counts[FAILED], counts[UNSUPPORTED]


def render(results, elapsed):
    import jax
    import onnx

    total_passed = sum(1 for row in results if row[3] in (PASSED, PASSED_KNOWN))
    lines = [
        "# ONNX backend conformance: node tests through the bridge's ONNX table",
        "",
        f"Command: `python -m bridge.compat.onnx_conformance`; onnx {onnx.__version__}, jax {jax.__version__}, "
        f"{len(results)} node cases ({elapsed:.0f} s). Regenerated by the command, never edited by hand.",
        "",
        f"**{total_passed} of {len(results)} cases pass** (outputs within the suite's rtol=1e-3, atol=1e-7, same shape "
        "and dtype). *passed*: under jax.jit with the case's numeric inputs traced, as `bridge.load` runs a model; "
        "*passed, inputs known*: the graph needs an input's value while it is traced (a shape, axes or a count given "
        "as an input, or an output whose shape depends on values: NonZero, Unique) and passes with its inputs known "
        "then; *no mapping*: an op with no table entry and no function in the ONNX standard. Random ops are "
        "compared by shape and dtype.",
        "",
        "## By opset (the ai.onnx opset of the case's model)",
        "",
        "| opset | cases | passed | passed, inputs known | failed | no mapping |",
        "|---|---|---|---|---|---|",
    ]
    by_opset = collections.defaultdict(list)
    for row in results:
        by_opset[row[2]].append(row)
    for opset in sorted(by_opset):
        rows = by_opset[opset]
        lines.append(f"| {opset} | {len(rows)} | " + " | ".join(str(count) for count in _counts(rows)) + " |")
    lines.append(f"| all | {len(results)} | " + " | ".join(str(count) for count in _counts(results)) + " |")
    lines += ["", "## By op", "", "| op | cases | passed | passed, inputs known | failed | no mapping |", "|---|---|---|---|---|---|"]
    by_op = collections.defaultdict(list)
    for row in results:
        by_op[row[1]].append(row)
    for op in sorted(by_op, key=str.lower):
        rows = by_op[op]
        lines.append(f"| {op} | {len(rows)} | " + " | ".join(str(count) for count in _counts(rows)) + " |")
    lines += ["", "## Cases that do not pass", "", "| case | op | opset | status | reason |", "|---|---|---|---|---|"]
    for name, op, opset, status, detail in results:
        if status in (FAILED, UNSUPPORTED):
            lines.append(f"| {name} | {op} | {opset} | {status} | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------- the script corpus through torch.onnx.export

# An exported model's outputs against eager torch's: rtol 1e-5, and atol 1e-6 of the largest
# output's magnitude (at least 1), as tests/test_hf_models.py's logits (float32 sums in another
# order); same dtype and shape, integers equal.
RTOL, ATOL = 1e-5, 1e-6
CORPUS_HEADING = "## The script corpus's models through torch.onnx.export"
NOT_EXPORTED = "torch.onnx.export refuses it"


def export_onnx(model, args, path, dynamo=False, **options):
    """The model in eval mode to an .onnx file at path: the TorchScript exporter at opset 17 (the
    same graphs under torch 2.13 and 2.14, in a fraction of a second), or torch's default, the
    dynamo exporter."""
    model.eval()
    if dynamo:
        torch.onnx.export(model, args, str(path), dynamo=True, verbose=False, **options)
    else:
        torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, **options)
    return str(path)


def compare_outputs(actual, expected):
    """The largest absolute difference of the bridge's outputs from eager torch's (the tensors of
    `expected`, in order); AssertionError where one is outside RTOL and ATOL."""
    actual = actual if isinstance(actual, (tuple, list)) else (actual,)
    expected = [value for value in pytree.tree_leaves(expected) if isinstance(value, torch.Tensor)]
    assert len(actual) == len(expected), f"{len(actual)} outputs where torch gives {len(expected)}"
    worst = 0.0
    for got, want in zip(actual, expected):
        got = got.cpu()
        assert got.dtype == want.dtype and got.shape == want.shape, f"{got.dtype} {tuple(got.shape)} where torch gives {want.dtype} {tuple(want.shape)}"
        if not want.is_floating_point():
            torch.testing.assert_close(got, want)
            continue
        scale = max(want.abs().max().item(), 1.0)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL * scale)
        worst = max(worst, (got - want).abs().max().item())
    return worst


def check_exported_model(module, args, kwargs, path):
    """(exporter, status, ops with no mapping, largest difference, detail) of a module exported
    to path in eval mode, run by bridge.load on the same inputs and compared with eager torch."""
    import copy

    import bridge
    from bridge.runtime import onnx_graph

    with torch.no_grad():
        expected = copy.deepcopy(module).eval()(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    refusals = []
    for exporter in ("TorchScript", "dynamo"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                export_onnx(copy.deepcopy(module), tuple(args), path, dynamo=exporter == "dynamo", kwargs=dict(kwargs) or None)
            break
        except Exception as error:  # noqa: BLE001 - recorded: the bridge never sees the model
            refusals.append(f"{exporter}: {_reason(error)}")
    else:
        return "-", NOT_EXPORTED, "", None, "; ".join(refusals)
    detail = f"the TorchScript exporter refuses it ({refusals[0]})" if refusals else ""
    missing = onnx_graph.unmapped_nodes(onnx_graph.read_model(path), onnx_graph.ONNX_OPS).get("no mapping", {})
    if missing:
        return exporter, UNSUPPORTED, ", ".join(sorted(missing)), None, detail
    inputs = [value for value in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(value, torch.Tensor)]
    try:
        with bridge.active():
            worst = compare_outputs(bridge.load(path)(*inputs), expected)
    except Exception as error:  # noqa: BLE001 - recorded per model
        summary = [line.strip() for line in str(error).splitlines() if "difference" in line or "Mismatched" in line]
        reason = "; ".join(summary) if isinstance(error, AssertionError) and summary else _reason(error)
        return exporter, FAILED, "", None, "; ".join(part for part in (reason, detail) if part)
    return exporter, PASSED, "", worst, detail


def check_corpus_script(script):
    """[(script, model, mode, exporter, status, ops with no mapping, largest difference, detail)]
    for each model compat/scripts/<script>.py calls (its mode in the script; exported in eval mode)."""
    import tempfile

    from bridge.op_mappings import onnx_ops  # noqa: F401  (the table's registrations)

    from . import harness

    try:
        models = harness.corpus_models(script)
    except Exception as error:  # noqa: BLE001 - the script itself failed under plain torch: recorded
        return [(script, "-", "-", "-", FAILED, "", None, f"the script fails with plain torch: {harness.first_line(error)}")]
    rows = []
    logging.disable(logging.WARNING)  # the exporters log at length
    with tempfile.TemporaryDirectory() as folder:
        for number, model in enumerate(models):
            path = os.path.join(folder, f"{number}.onnx")
            mode = "train" if model.training else "eval"
            rows.append((script, model.name, mode, *check_exported_model(model.module, model.args, model.kwargs, path)))
    return rows


def run_corpus(out=None, echo=print):
    """check_corpus_script over the corpus, each script in a process of its own; writes the
    corpus section of <out>/onnx.md."""
    from . import harness

    rows = []
    for script in harness.corpus_scripts():
        try:
            rows.extend(harness.corpus_rows_in_child("onnx_conformance", script))
        except harness.CorpusChildError as error:
            rows.append((script, "-", "-", "-", FAILED, "", None, str(error)))
        if echo:
            echo(f"{script}: " + ", ".join(f"{row[1]} {row[4]}" for row in rows if row[0] == script))
    if out:
        write_report(out, corpus_part=render_corpus(rows))
    return rows


def render_corpus(rows):
    counts = collections.Counter(row[4] for row in rows)
    exported = sum(1 for row in rows if row[3] != "-")
    unmapped = sorted({op for row in rows for op in row[5].split(", ") if op})
    lines = [
        CORPUS_HEADING,
        "",
        f"Command: `python -m bridge.compat.onnx_conformance --corpus`; torch {torch.__version__}. Rewrites this "
        "section only.",
        "",
        "Each module a compat/scripts program calls itself (compat/harness.py's corpus_models: as it was at its "
        "first call, with that call's inputs), exported in eval mode with torch.onnx.export as tests/test_onnx.py "
        "exports (the TorchScript exporter at opset 17; the dynamo exporter where that one refuses), its ops looked "
        "up as `python -m bridge check` looks them up, run by `bridge.load` and compared with eager torch in eval "
        "mode: same dtype and shape, rtol 1e-5 and atol 1e-6 of the largest output's magnitude.",
        "",
        f"**Of {len(rows)} models in {len({row[0] for row in rows})} scripts, torch.onnx.export exported {exported}; "
        f"{counts[PASSED]} pass, {counts[FAILED]} fail, {counts[UNSUPPORTED]} have ops with no mapping"
        f"{' (' + ', '.join(unmapped) + ')' if unmapped else ''}; {counts[NOT_EXPORTED]} the exporters refuse.**",
        "",
        "| script | model | mode in the script | exporter | status | ops with no mapping | largest difference | detail |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for script, name, mode, exporter, status, missing, worst, detail in rows:
        difference = "-" if worst is None else f"{worst:.1e}"
        lines.append(f"| {script} | {name} | {mode} | {exporter} | {status} | {missing or '-'} | {difference} | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write_report(out, node_part=None, corpus_part=None):
    """<out>/onnx.md from its two parts, each kept from the file where not given."""
    path = os.path.join(out, "onnx.md")
    existing = open(path).read() if os.path.exists(path) else ""
    kept_node, _, kept_corpus = existing.partition(CORPUS_HEADING)
    node_part = node_part if node_part is not None else kept_node.rstrip("\n") + "\n"
    corpus_part = corpus_part if corpus_part is not None else (CORPUS_HEADING + kept_corpus if kept_corpus else "")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as report:
        report.write(node_part + ("\n" + corpus_part if corpus_part else ""))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bridge.compat.onnx_conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="a regular expression: run the cases whose names match")
    parser.add_argument("--corpus", action="store_true", help="the script corpus's models instead: rewrites onnx.md's corpus section")
    parser.add_argument("--corpus-script", help=argparse.SUPPRESS)  # (the child process of one corpus script)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "reports"), help="where onnx.md goes")
    arguments = parser.parse_args(argv)
    try:
        import onnx  # noqa: F401
    except ImportError:
        print("the conformance sweep needs the onnx package: pip install 'bridge[onnx]'", file=sys.stderr)
        return 2
    if arguments.corpus_script:
        import json

        print(json.dumps(check_corpus_script(arguments.corpus_script)))
        return 0
    if arguments.corpus:
        rows = run_corpus(arguments.out)
        passed = sum(1 for row in rows if row[4] == PASSED)
        print(f"{passed} of {len(rows)} corpus models pass through torch.onnx.export and bridge.load")
        return 0
    results = run(arguments.only, None if arguments.only else arguments.out)
    passed = sum(1 for row in results if row[3] in (PASSED, PASSED_KNOWN))
    print(f"{passed} of {len(results)} ONNX node cases pass")
    if arguments.only:
        for name, op, opset, status, detail in results:
            if status in (FAILED, UNSUPPORTED):
                print(f"  {name} ({op}, opset {opset}): {status}: {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
