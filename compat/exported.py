"""PyTorch's ModuleInfo modules and the script corpus's models through `torch.export` and the
bridge's translator (runtime/export.py).

    python -m bridge.compat.exported [--only nn.Linear,gan] [--out compat/reports]

For each ModuleInfo module (float32, training and eval mode, its first sample with a forward
input), the module is exported with `torch.export.export` in plain torch, translated to one JAX
function, and run on the same inputs: its outputs and the buffers it writes (running statistics)
must match eager torch's. Each compat/scripts program runs with plain torch, and each model it
calls is checked the same way at its first call, with its gradients where the script trains it.
Modules `torch.export` refuses are counted apart (the translator never sees them). Writes
<out>/exported.md.
"""

import copy
import sys
import time

import numpy as np
import torch
from torch.utils import _pytree as pytree

from . import harness
from .moduleinfo import load_database, select, tolerance

PASSED, FAILED, NOT_EXPORTED, NO_SAMPLE = "passed", "failed", "torch.export refuses it", "no sample"


def _sample(info, training):
    torch.manual_seed(0)
    for module_input in info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=False, training=training):
        if module_input.forward_input is not None:
            return module_input
    return None


def _detached(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def check_module(info, training):
    """(status, detail) of one module in one mode."""
    module_input = _sample(info, training)
    if module_input is None:
        return NO_SAMPLE, "no forward input"
    constructor = module_input.constructor_input
    args, kwargs = pytree.tree_map(_detached, (module_input.forward_input.args, module_input.forward_input.kwargs))
    torch.manual_seed(0)
    module = info.module_cls(*constructor.args, **constructor.kwargs).train(training)
    if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin):
        with torch.no_grad():  # a lazy module takes its shapes from a first call, as a script's would
            module(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    return check_translation(module, args, kwargs, tolerance(info, torch.float32) or (1e-5, 1e-6))


def check_translation(module, args, kwargs, tolerances, gradients=False):
    """(status, detail) of a module exported with `torch.export` in plain torch, translated and
    run on (args, kwargs): its outputs and the buffers it writes against eager torch's; with
    `gradients`, also jax.grad of its outputs (weighted by fixed random numbers) over its
    trainable parameters against torch's backward."""
    import jax.numpy as jnp

    import bridge
    from bridge.runtime import export

    reference = copy.deepcopy(module)
    try:
        exported = torch.export.export(copy.deepcopy(module), tuple(args), dict(kwargs), strict=False)
    except Exception as error:  # noqa: BLE001 - counted apart: the translator never sees the module
        return NOT_EXPORTED, f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    try:
        torch.manual_seed(0)
        expected = copy.deepcopy(reference)(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        torch.manual_seed(1)
        again = reference(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    except Exception as error:  # noqa: BLE001 - the sample is not one eager torch runs
        return NO_SAMPLE, f"eager torch raises on the sample ({type(error).__name__})"
    # A module that draws random numbers (dropout in training mode): torch's streams are not the
    # bridge's, so only the structure of its results is compared.
    random = any(
        isinstance(a, torch.Tensor) and not torch.equal(a, b) for a, b in zip(pytree.tree_leaves(expected), pytree.tree_leaves(again))
    )
    to_array = lambda value: jnp.asarray(value.detach().numpy()) if isinstance(value, torch.Tensor) else value  # noqa: E731
    rtol, atol = tolerances
    try:
        with bridge.active():
            function, state = export.to_jax(exported)
            out, new_state, _ = function(state, *pytree.tree_map(to_array, list(args)), **pytree.tree_map(to_array, dict(kwargs)))
        got, wanted = pytree.tree_leaves(out), pytree.tree_leaves(expected)
        if len(got) != len(wanted):
            return FAILED, f"{len(got)} outputs where torch gives {len(wanted)}"
        for actual, want in zip(got, wanted):
            if isinstance(want, torch.Tensor):
                if random:
                    assert tuple(actual.shape) == tuple(want.shape) and str(actual.dtype) == str(want.dtype).removeprefix("torch.")
                else:
                    np.testing.assert_allclose(np.asarray(actual), want.detach().numpy(), rtol=rtol, atol=atol)
        for name, buffer in reference.state_dict().items():
            if name in new_state and not random:
                np.testing.assert_allclose(np.asarray(new_state[name]), buffer.numpy(), rtol=rtol, atol=atol, err_msg=name)
        if gradients and not random:
            worst = _compare_gradients(module, exported, function, state, args, kwargs, to_array, rtol, atol)
            return PASSED, f"gradients of {worst[0]} parameters compared: largest difference {worst[1]:.1e} relative to the largest gradient"
    except Exception as error:  # noqa: BLE001 - a failure of the translator: recorded
        return FAILED, f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
    return PASSED, "draws random numbers: shapes and dtypes compared" if random else ""


def _compare_gradients(module, exported, function, state, args, kwargs, to_array, rtol, atol):
    """(how many parameters, the largest difference over the largest gradient): jax.grad of the
    translation against torch's backward of the same weighted sum of the floating-point outputs."""
    import jax

    import bridge

    torch.manual_seed(2)
    eager = copy.deepcopy(module)
    outputs = [value for value in pytree.tree_leaves(eager(*copy.deepcopy(args), **copy.deepcopy(kwargs))) if _is_float(value)]
    weights = [torch.randn(value.shape, dtype=value.dtype) for value in outputs]
    # The program names a tied parameter (GPT's embedding and head) once for each of its uses:
    # its gradient is the sum of theirs.
    names_of = {}
    for name in exported.graph_signature.parameters:
        parameter = eager.get_parameter(name)
        if parameter.requires_grad:
            names_of.setdefault(parameter, []).append(name)
    torch_gradients = torch.autograd.grad(sum((value * weight).sum() for value, weight in zip(outputs, weights)), list(names_of), allow_unused=True)
    weight_arrays = [to_array(weight) for weight in weights]

    def weighted(parameters):
        out, _, _ = function({**state, **parameters}, *pytree.tree_map(to_array, list(args)), **pytree.tree_map(to_array, dict(kwargs)))
        floats = [value for value in jax.tree_util.tree_leaves(out) if jax.numpy.issubdtype(value.dtype, jax.numpy.floating)]
        return sum((value * weight).sum() for value, weight in zip(floats, weight_arrays))

    with bridge.active():
        gradients = jax.grad(weighted)({name: state[name] for names in names_of.values() for name in names})
    largest = max((gradient.abs().max().item() for gradient in torch_gradients if gradient is not None), default=0.0)
    worst = 0.0
    for names, expected in zip(names_of.values(), torch_gradients):
        actual = sum(np.asarray(gradients[name]) for name in names)
        expected = np.zeros(actual.shape) if expected is None else expected.numpy()
        # (atol relative to the largest gradient, as tests/test_export.py's: a gradient that is 0
        # in truth is rounding noise of that size on both sides)
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol * largest, err_msg=f"gradient of {' and '.join(names)}")
        worst = max(worst, float(np.abs(actual - expected).max()) / max(largest, 1e-30))
    return len(names_of), worst


def _is_float(value):
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def sweep(only=None):
    """{"moduleinfo": [(name, mode, status, detail, seconds)], "corpus": [(script, model, mode,
    status, detail, seconds)]}; `only` names ModuleInfo modules and corpus scripts."""
    results = {"moduleinfo": [], "corpus": []}
    for info in select(load_database(), only):
        for training in (True, False):
            started = time.perf_counter()
            status, detail = check_module(info, training)
            results["moduleinfo"].append((info.name, "train" if training else "eval", status, detail, time.perf_counter() - started))
    for script in harness.corpus_scripts():
        if only is None or script in only:
            results["corpus"].extend(_check_script_in_child(script))
    return results


# Tolerances of the corpus's models by their parameters' dtype: float32 as the ModuleInfo sweep's
# default; float16 one unit of its rounding, as tests/test_corpus.py states; bfloat16 and float64
# torch.testing's defaults.
_CORPUS_TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-5), torch.float64: (1e-7, 1e-7)}


# Corpus models whose gradients cannot be torch's, with the reason.
GRADIENT_FAILURES = {
    ("custom_function", "QuantisedMLP"): (
        "torch.export keeps the forward of the script's autograd.Function (a rounding), not its "
        "straight-through backward: the program's derivative is round's, 0"
    ),
}
EXPECTED_FAILURE, UNEXPECTED_PASS = "expected failure", "unexpectedly passes"


def check_script(script):
    """[(script, model, mode, status, detail, seconds)] for each model compat/scripts/<script>.py
    calls (harness.corpus_models): exported at its first call, translated and compared; gradients
    too where the script trained it."""
    try:
        models = harness.corpus_models(script)
    except Exception as error:  # noqa: BLE001 - the script itself failed under plain torch: recorded
        return [(script, "-", "-", NO_SAMPLE, f"the script fails with plain torch: {harness.first_line(error)}", 0.0)]
    rows = []
    for model in models:
        started = time.perf_counter()
        dtype = next(model.module.parameters()).dtype
        status, detail = check_translation(model.module, model.args, model.kwargs, _CORPUS_TOLERANCES.get(dtype, (1e-5, 1e-6)), gradients=model.trained)
        reason = GRADIENT_FAILURES.get((script, model.name))
        if reason is not None and status == PASSED:
            status, detail = UNEXPECTED_PASS, f"listed as failing: {reason}"
        elif reason is not None and status == FAILED and "gradient of" in detail:
            status, detail = EXPECTED_FAILURE, f"outputs match; gradients: {reason}"
        elif status == PASSED and not model.trained:
            detail = "not trained by the script: outputs compared" + (f"; {detail}" if detail else "")
        rows.append((script, model.name, "train" if model.training else "eval", status, detail, time.perf_counter() - started))
    return rows


def _check_script_in_child(script):
    try:
        return harness.corpus_rows_in_child("exported", script)
    except harness.CorpusChildError as error:
        return [(script, "-", "-", FAILED, str(error), error.seconds)]


def report(results, command):
    modules, corpus = results["moduleinfo"], results["corpus"]
    lines = [
        "# torch.export programs through the bridge's translator",
        "",
        f"Command: `{command}`; torch {torch.__version__}. Regenerated by the command, never edited by hand.",
        "",
    ]
    if modules:
        counts = _counts(modules, 2)
        exported = counts.get(PASSED, 0) + counts.get(FAILED, 0)
        lines += [
            "## ModuleInfo modules",
            "",
            f"Of {len(modules)} module and mode pairs, torch.export accepted {exported}; the translator gave torch's "
            f"outputs and written buffers for {counts.get(PASSED, 0)} of them. "
            f"{counts.get(NOT_EXPORTED, 0)} torch.export refused, {counts.get(NO_SAMPLE, 0)} had no sample to export with. "
            f"{sum(1 for result in modules if result[2] == PASSED and result[3])} of the passes draw random numbers "
            "(dropout and its kin in training mode): their shapes and dtypes are compared, not their values.",
            "",
            "| module | mode | status | detail |",
            "|---|---|---|---|",
        ]
        for name, mode, status, detail, _ in modules:
            if status != PASSED or detail:
                lines.append(f"| {name} | {mode} | {status} | {detail.replace('|', '/')} |")
        lines.append("")
    if corpus:
        counts = _counts(corpus, 3)
        exported = len(corpus) - counts.get(NOT_EXPORTED, 0) - counts.get(NO_SAMPLE, 0)
        trained = sum(1 for row in corpus if row[3] == PASSED and row[4].startswith("gradients"))
        lines += [
            "## The script corpus (compat/scripts)",
            "",
            "Each module a script calls itself (not one inside another), as it was at its first call, with that "
            "call's inputs and in the script's mode: exported with torch.export in plain torch, translated, and "
            "compared with eager torch (outputs and written buffers), and where the script trained it, jax.grad "
            "of its outputs (weighted by fixed random numbers) over its trainable parameters against torch's backward.",
            "",
            f"Of {len(corpus)} models in {len({row[0] for row in corpus})} scripts, torch.export accepted {exported}; "
            f"{counts.get(PASSED, 0)} pass ({trained} with their gradients), {counts.get(FAILED, 0)} fail, "
            f"{counts.get(EXPECTED_FAILURE, 0)} fail as listed with the reason, {counts.get(UNEXPECTED_PASS, 0)} listed "
            f"ones pass; {counts.get(NOT_EXPORTED, 0)} torch.export refused, {counts.get(NO_SAMPLE, 0)} scripts failed "
            "with plain torch. Models run in the dtype of their parameters (gpt_amp's GPT in float32: the script's "
            "autocast is not part of the module).",
            "",
            "| script | model | mode | status | detail |",
            "|---|---|---|---|---|",
        ]
        for script, name, mode, status, detail, _ in corpus:
            lines.append(f"| {script} | {name} | {mode} | {status} | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _counts(rows, position):
    counts = {}
    for row in rows:
        counts[row[position]] = counts.get(row[position], 0) + 1
    return counts


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--corpus-script"]:  # (the child process of _check_script_in_child)
        import json

        print(json.dumps(check_script(argv[1])))
        return 0
    return harness.report_command(argv, __doc__.splitlines()[0], "exported", "exported.md", sweep, report)


if __name__ == "__main__":
    sys.exit(main())
