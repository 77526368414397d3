"""PyTorch's ModuleInfo modules through `torch.export` and the bridge's translator (runtime/export.py).

    python -m bridge.compat.exported [--only Linear,Conv2d] [--out compat/reports]

For each module (float32, training and eval mode, its first sample with a forward input), the
module is exported with `torch.export.export` in plain torch, translated to one JAX function, and
run on the same inputs: its outputs and the buffers it writes (running statistics) must match
eager torch's. Modules `torch.export` refuses are counted apart (the translator never sees them).
Writes <out>/exported.md.
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
    import jax.numpy as jnp

    import bridge
    from bridge.runtime import export

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
    to_array = lambda value: jnp.asarray(value.numpy()) if isinstance(value, torch.Tensor) else value  # noqa: E731
    try:
        with bridge.active():
            function, state = export.to_jax(exported)
            out, new_state, _ = function(state, *pytree.tree_map(to_array, list(args)), **pytree.tree_map(to_array, dict(kwargs)))
        rtol, atol = tolerance(info, torch.float32) or (1e-5, 1e-6)
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
    except Exception as error:  # noqa: BLE001 - a failure of the translator: recorded
        return FAILED, f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
    return PASSED, "draws random numbers: shapes and dtypes compared" if random else ""


def sweep(only=None):
    results = []
    for info in select(load_database(), only):
        for training in (True, False):
            started = time.perf_counter()
            status, detail = check_module(info, training)
            results.append((info.name, "train" if training else "eval", status, detail, time.perf_counter() - started))
    return results


def report(results, command):
    counts = {}
    for _, _, status, _, _ in results:
        counts[status] = counts.get(status, 0) + 1
    exported = counts.get(PASSED, 0) + counts.get(FAILED, 0)
    lines = [
        "# ModuleInfo modules through torch.export and the bridge's translator",
        "",
        f"Command: `{command}`; torch {torch.__version__}. Regenerated by the command, never edited by hand.",
        "",
        f"Of {len(results)} module and mode pairs, torch.export accepted {exported}; the translator gave torch's "
        f"outputs and written buffers for {counts.get(PASSED, 0)} of them. "
        f"{counts.get(NOT_EXPORTED, 0)} torch.export refused, {counts.get(NO_SAMPLE, 0)} had no sample to export with. "
        f"{sum(1 for result in results if result[2] == PASSED and result[3])} of the passes draw random numbers "
        "(dropout and its kin in training mode): their shapes and dtypes are compared, not their values.",
        "",
        "| module | mode | status | detail |",
        "|---|---|---|---|",
    ]
    for name, mode, status, detail, _ in results:
        if status != PASSED or detail:
            lines.append(f"| {name} | {mode} | {status} | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    return harness.report_command(argv, __doc__.splitlines()[0], "exported", "exported.md", sweep, report)


if __name__ == "__main__":
    sys.exit(main())
