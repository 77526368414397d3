"""PyTorch's ModuleInfo modules through TorchScript and the bridge's translator (runtime/torchscript.py).

    python -m bridge.compat.torchscript [--only Linear,Conv2d] [--out compat/reports]

For each module (float32, training and eval mode, its first sample with a forward input) and each
source of TorchScript (`torch.jit.trace`, `torch.jit.script`, and the traced module saved with
`torch.jit.save` and read back with `torch.jit.load`), the ScriptModule is translated to one JAX
function, jitted and run on the sample: its outputs and the buffers it writes must match the same
ScriptModule run by torch. Modules torch.jit refuses are counted apart (the translator never sees
them). Writes <out>/torchscript.md with the counts per source and the largest difference.
"""

import copy
import io
import sys
import time
import warnings

import numpy as np
import torch
from torch.utils import _pytree as pytree

from . import harness
from .moduleinfo import load_database, select, tolerance

PASSED, FAILED, NOT_SCRIPTED, NO_SAMPLE = "passed", "failed", "torch.jit refuses it", "no sample"
SOURCES = ("trace", "script", "load")


def _sample(info, training):
    torch.manual_seed(0)
    for module_input in info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=False, training=training):
        if module_input.forward_input is not None and not module_input.forward_input.kwargs:
            return module_input
    return None


def _detached(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _scripted(module, args, source):
    """The module as a ScriptModule from `source`, in plain torch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if source == "script":
            return torch.jit.script(module)
        traced = torch.jit.trace(module, tuple(copy.deepcopy(args)), check_trace=False)
        if source == "trace":
            return traced
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
        buffer.seek(0)
        return torch.jit.load(buffer)


def check_module(info, training, source):
    """(status, detail, largest difference) of one module in one mode from one source."""
    import jax
    import jax.numpy as jnp

    import bridge
    from bridge.runtime import torchscript

    module_input = _sample(info, training)
    if module_input is None:
        return NO_SAMPLE, "no forward input without keywords", None
    constructor = module_input.constructor_input
    args = pytree.tree_map(_detached, list(module_input.forward_input.args))
    torch.manual_seed(0)
    module = info.module_cls(*constructor.args, **constructor.kwargs).train(training)
    if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin):
        with torch.no_grad():  # a lazy module takes its shapes from a first call, as a script's would
            module(*copy.deepcopy(args))
    try:
        torch.manual_seed(0)
        first = copy.deepcopy(module)(*copy.deepcopy(args))
        torch.manual_seed(1)
        again = copy.deepcopy(module)(*copy.deepcopy(args))
    except Exception as error:  # noqa: BLE001 - the sample is not one eager torch runs
        return NO_SAMPLE, f"eager torch raises on the sample ({type(error).__name__})", None
    # A module that draws random numbers (dropout in training mode): torch's streams are not the
    # bridge's, so only the structure of its results is compared.
    random = any(
        isinstance(a, torch.Tensor) and not torch.equal(a, b) for a, b in zip(pytree.tree_leaves(first), pytree.tree_leaves(again))
    )
    try:
        scripted = _scripted(copy.deepcopy(module), args, source)
    except Exception as error:  # noqa: BLE001 - counted apart: the translator never sees the module
        return NOT_SCRIPTED, f"{type(error).__name__}: {harness.first_line(error)[:160]}", None
    to_array = lambda value: jnp.asarray(value.numpy()) if isinstance(value, torch.Tensor) else value  # noqa: E731
    worst = 0.0
    try:
        with bridge.active():
            function, state = torchscript.to_jax(scripted)
            out, new_state, _ = jax.jit(function)(state, *pytree.tree_map(to_array, args))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                expected = scripted(*copy.deepcopy(args))  # torch runs the same ScriptModule: the reference
            except Exception as error:  # noqa: BLE001 - torch cannot run what it scripted (an overloaded forward)
                return NOT_SCRIPTED, f"torch cannot call the ScriptModule ({type(error).__name__}: {harness.first_line(error)[:120]})", None
        rtol, atol = tolerance(info, torch.float32) or (1e-5, 1e-6)
        got, wanted = pytree.tree_leaves(out), pytree.tree_leaves(expected)
        if len(got) != len(wanted):
            return FAILED, f"{len(got)} outputs where torch gives {len(wanted)}", None
        compared = list(zip(got, wanted))
        if not random:
            compared += [(new_state[name], buffer) for name, buffer in scripted.named_buffers() if name in new_state]
        for actual, want in compared:
            if not isinstance(want, torch.Tensor):
                continue
            if random:
                assert tuple(actual.shape) == tuple(want.shape) and str(actual.dtype) == str(want.dtype).removeprefix("torch.")
                continue
            actual, want = np.asarray(actual), want.detach().numpy()
            np.testing.assert_allclose(actual, want, rtol=rtol, atol=atol)
            if actual.size and np.issubdtype(want.dtype, np.inexact):
                finite = np.isfinite(want)
                if finite.any():
                    worst = max(worst, float(np.max(np.abs(actual[finite].astype(np.float64) - want[finite]))))
    except Exception as error:  # noqa: BLE001 - a failure of the translator: recorded
        return FAILED, f"{type(error).__name__}: {' '.join(str(error).split())[:240]}", None
    return PASSED, "draws random numbers: shapes and dtypes compared" if random else "", None if random else worst


def sweep(only=None, sources=SOURCES):
    results = []
    for info in select(load_database(), only):
        for source in sources:
            for training in (True, False):
                started = time.perf_counter()
                status, detail, worst = check_module(info, training, source)
                results.append((info.name, source, "train" if training else "eval", status, detail, worst, time.perf_counter() - started))
    return results


def report(results, command):
    lines = [
        "# ModuleInfo modules through TorchScript and the bridge's translator",
        "",
        f"Command: `{command}`; torch {torch.__version__}. Regenerated by the command, never edited by hand.",
        "",
        "Each module and mode (float32, its first sample) from each source: `torch.jit.trace`, `torch.jit.script`, "
        "and the traced module through `torch.jit.save`/`torch.jit.load`; translated, jitted, and compared with the "
        "same ScriptModule run by torch (outputs and written buffers; modules that draw random numbers by shape and "
        "dtype).",
        "",
        "| source | pairs | torch.jit accepted | passed | failed | refused by torch.jit | no sample | largest difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for source in SOURCES:
        rows = [result for result in results if result[1] == source]
        if not rows:
            continue
        count = lambda status: sum(1 for result in rows if result[3] == status)  # noqa: E731
        worst = max((result[5] for result in rows if result[5] is not None), default=0.0)
        lines.append(
            f"| {source} | {len(rows)} | {count(PASSED) + count(FAILED)} | {count(PASSED)} | {count(FAILED)} | "
            f"{count(NOT_SCRIPTED)} | {count(NO_SAMPLE)} | {worst:.3g} |"
        )
    lines += ["", "Failures, refusals and passes with a note:", "", "| module | source | mode | status | detail |", "|---|---|---|---|---|"]
    for name, source, mode, status, detail, _, _ in results:
        if status != PASSED or detail:
            lines.append(f"| {name} | {source} | {mode} | {status} | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    return harness.report_command(argv, __doc__.splitlines()[0], "torchscript", "torchscript.md", sweep, report)


if __name__ == "__main__":
    sys.exit(main())
