"""PyTorch's ModuleInfo database run through the bridge against eager torch on the CPU: every module's
forward (outputs and buffers) and backward (input and parameter gradients), in train and eval mode."""

import copy
import time

import torch
from torch.utils import _pytree as pytree

from . import expected_failures, harness
from .harness import BACKWARD, FORWARD, Record
from .opinfo import _decorator_kind, dtype_name, listed_tolerance

DTYPES = (torch.float32, torch.float64)
MODES = ("train", "eval")
QUICK_BUDGET = 30.0
FULL_BUDGET = 180.0
# In full mode each completed input adds this much to its module's budget (nn.Transformer has 64
# inputs per dtype and mode at about 2.5 s each, most of it compiling, more on a loaded machine),
# so that the budget scales with the module's input count while an input that hangs still trips it.
FULL_SECONDS_PER_INPUT = 10.0
SEED = 1234
OTHER_SEED = 4321

# torch's own tests whose metadata applies: test_cpu_gpu_parity is torch's device-against-CPU
# comparison of forward and backward; test_forward and test_grad check each alone.
FORWARD_TESTS = (("TestModule", "test_cpu_gpu_parity"), ("TestModule", "test_forward"))
BACKWARD_TESTS = (("TestModule", "test_cpu_gpu_parity"), ("TestModule", "test_grad"))
DEVICE_TYPES = (None, "cpu")


def load_database():
    return harness.load_databases()[1]


def entry_names():
    return [info.name for info in load_database()]


def select(database, only=None, exact=None):
    if exact is not None:
        return [info for info in database if info.name in set(exact)]
    if not only:
        return list(database)
    wanted = set(only)
    return [info for info in database if info.name in wanted or info.name.removeprefix("nn.") in wanted]


def database_verdict(info, dtype, phase, training):
    """(skip reason or None, xfail?) from the entry's own metadata for this dtype and phase."""
    tests = FORWARD_TESTS if phase == FORWARD else BACKWARD_TESTS
    skip_reason, xfail = None, False
    for decorate in info.decorators:
        if not hasattr(decorate, "is_active") or decorate.device_type not in DEVICE_TYPES:
            continue
        if not any(_is_active(decorate, cls_name, test_name, dtype, training) for cls_name, test_name in tests):
            continue
        for decorator in decorate.decorators:
            kind = _decorator_kind(decorator)
            if kind is None:
                continue
            if kind[0] == "skip" and skip_reason is None:
                skip_reason = kind[1]
            elif kind[0] == "xfail":
                xfail = True
    return skip_reason, xfail


def _is_active(decorate, cls_name, test_name, dtype, training):
    try:
        return decorate.is_active(cls_name, test_name, decorate.device_type or "cpu", dtype, {"training": training})
    except Exception:  # noqa: BLE001 - an active_if needing parameters we do not have
        return False


def tolerance(info, dtype):
    return listed_tolerance(
        info.decorators,
        dtype,
        lambda decorate: decorate.cls_name in (None, "TestModule")
        and decorate.test_name in (None, "test_forward", "test_cpu_gpu_parity", "test_grad"),
    )


# ---------------------------------------------------------------- one sample


class _Sample:
    """One module input: builds the CPU module and bridge copies of it, runs both."""

    def __init__(self, info, module_input, dtype, training):
        self.info = info
        self.training = training
        constructor = module_input.constructor_input
        self.forward_args = module_input.forward_input.args
        self.forward_kwargs = module_input.forward_input.kwargs
        self.lazy = issubclass(info.module_cls, torch.nn.modules.lazy.LazyModuleMixin)
        torch.manual_seed(SEED)
        self.cpu_module = info.module_cls(*constructor.args, **constructor.kwargs).to(dtype)
        self.cpu_module.train(training)
        self.template = copy.deepcopy(self.cpu_module)  # before lazy initialization
        if self.lazy:
            with torch.no_grad():
                self.cpu_module(*self.forward_args, **self.forward_kwargs)
        self.initialized = copy.deepcopy(self.cpu_module)

    def leaves(self):
        found, seen = [], set()
        for value in pytree.tree_leaves((self.forward_args, self.forward_kwargs)):
            if isinstance(value, torch.Tensor) and value.requires_grad and id(value) not in seen:
                seen.add(id(value))
                found.append(value)
        return found

    def precise(self, cotangents, positions):
        """((outputs, buffers), gradients) of the same computation in float64 on the CPU."""
        module = copy.deepcopy(self.initialized).to(torch.float64)
        memo = {}

        def widen(value):
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) not in memo:
                wide = value.detach().to(torch.float64) if value.is_floating_point() else value.detach()
                memo[id(value)] = wide.requires_grad_(value.requires_grad and wide.is_floating_point())
            return memo[id(value)]

        args, kwargs = pytree.tree_map(widen, (self.forward_args, self.forward_kwargs))
        torch.manual_seed(SEED)
        outputs = module(*args, **kwargs)
        forward = (outputs, _buffers(module))
        leaves = pytree.tree_leaves(outputs)
        wide_cotangents = [cotangent.to(leaves[p].dtype) for cotangent, p in zip(cotangents, positions)]
        grads = _grads(module, leaves, self.leaves(), memo, wide_cotangents, positions) if positions else None
        return forward, grads

    def run_cpu(self):
        torch.manual_seed(SEED)
        return self.cpu_module(*self.forward_args, **self.forward_kwargs)

    def bridge_module(self):
        module = copy.deepcopy(self.template).to(harness.BRIDGE_DEVICE)
        if self.lazy:
            arguments = harness.to_bridge((self.forward_args, self.forward_kwargs))
            with torch.no_grad():
                module(*arguments[0], **arguments[1])
            with torch.no_grad():
                for mine, theirs in zip(module.parameters(), self.initialized.parameters()):
                    mine.copy_(theirs)
                for mine, theirs in zip(module.buffers(), self.initialized.buffers()):
                    mine.copy_(theirs)
        return module

    def run_bridge(self, seed=SEED):
        """(module, outputs, memo of input copies)."""
        module = self.bridge_module()
        memo = {}
        args, kwargs = harness.to_bridge((self.forward_args, self.forward_kwargs), memo, keep_grad=True)
        torch.manual_seed(seed)
        return module, module(*args, **kwargs), memo


def _arbitrate(phase_result, actual, expected, precise):
    """Relabel a mismatch "rounding" when float64 says it is one (harness.judge_against_float64)."""
    try:
        truth = precise()
    except Exception:  # noqa: BLE001 - no float64 version of this module or input
        return
    verdict = harness.judge_against_float64(actual, expected, truth)
    if verdict is None:
        return
    kind, note = verdict
    if kind == "precise":
        phase_result[:] = [True, "", "", f"{note}; it differed from torch's: {phase_result[2]}"]
    else:
        phase_result[1] = kind
        phase_result[2] = f"{phase_result[2]} | {note}"


def _buffers(module):
    return {name: buffer.detach() for name, buffer in module.named_buffers()}


def _grads(module, outputs, leaves, memo, cotangents, positions):
    """Gradients of the chosen outputs against the inputs and the parameters."""
    parameters = [parameter for parameter in module.parameters() if parameter.requires_grad]
    inputs = [memo[id(leaf)] for leaf in leaves] if memo is not None else leaves
    targets = inputs + parameters
    chosen = []
    for position in positions:
        value = outputs[position]
        if not isinstance(value, torch.Tensor) or not value.requires_grad:
            raise _GraphLost(f"output {position} does not require grad (the autograd graph was lost)")
        chosen.append(value)
    if not targets:
        return []
    grads = torch.autograd.grad(chosen, targets, cotangents, allow_unused=True)
    return [torch.zeros_like(target) if grad is None else grad for grad, target in zip(grads, targets)]


class _GraphLost(AssertionError):
    pass


def _check(phase_result, function):
    """Run one comparison into phase_result [ok, kind, detail, precise note]; returns True when it passed."""
    try:
        function()
        return True
    except harness.SampleTimeout:
        raise
    except _GraphLost as error:
        phase_result[:3] = [False, "graph", str(error)]
    except harness.NotOnBridge as error:
        phase_result[:3] = [False, "device", str(error)]
    except AssertionError as error:
        phase_result[:3] = [False, harness.classify_mismatch(error), harness.mismatch_summary(error)]
    except Exception as error:  # noqa: BLE001
        phase_result[:3] = [False, "error", harness.first_line(error)]
    return False


def _run_sample(info, module_input, dtype, training):
    """{phase: [ok, kind, detail, random]} for one module input, or None if torch itself fails it."""
    try:
        sample = _Sample(info, module_input, dtype, training)
        expected_outputs = sample.run_cpu()
        expected_buffers = _buffers(sample.cpu_module)
        leaves = sample.leaves()
        outputs = pytree.tree_leaves(expected_outputs)
        positions = [
            position
            for position, value in enumerate(outputs)
            if isinstance(value, torch.Tensor) and value.requires_grad and (value.is_floating_point() or value.is_complex())
        ]
        generator = torch.Generator().manual_seed(SEED)
        cotangents = [torch.randn(outputs[p].shape, dtype=outputs[p].dtype, generator=generator) for p in positions]
        expected_grads = _grads(sample.cpu_module, outputs, leaves, None, cotangents, positions) if positions else None
    except Exception:  # noqa: BLE001 - torch itself cannot run this input
        return None
    tol = tolerance(info, dtype)
    forward = [True, "", "", ""]
    backward = [True, "", "", ""]
    random = [False]
    state = {}

    def run(seed=SEED):
        """Bridge outputs; the module, input copies and outputs of the run are kept for backward."""
        module, result, memo = sample.run_bridge(seed)
        state.update(module=module, memo=memo, outputs=result)
        return result

    def forward_check():
        got = state["forward_result"] = harness.to_cpu((run(), _buffers(state["module"])))
        try:
            harness.compare(got, (expected_outputs, expected_buffers), tol)
        except AssertionError:
            if not training:
                raise
            # Train mode may draw random numbers (dropout): a result that changes with the seed
            # is checked for shape, dtype and reproducibility instead.
            first = dict(state)
            other = harness.to_cpu(run(OTHER_SEED))
            try:
                harness.compare_exact(other, got[0])
            except AssertionError:
                random[0] = True
                harness.compare_structure(got, (expected_outputs, expected_buffers))
                harness.compare_exact(harness.to_cpu(run(SEED)), got[0])
                return
            state.update(first)
            raise

    def backward_check():
        bridge_outputs = pytree.tree_leaves(state["outputs"])
        bridge_cotangents = [cotangent.to(harness.BRIDGE_DEVICE) for cotangent in cotangents]
        got = harness.to_cpu(_grads(state["module"], bridge_outputs, leaves, state["memo"], bridge_cotangents, positions))
        state["backward_result"] = got
        if random[0]:
            harness.compare_structure(got, expected_grads)
        else:
            harness.compare(got, expected_grads, tol)

    ops = {}
    counting = harness.Counting()
    with counting:
        _check(forward, forward_check)
    harness.merge_ops(ops, counting.ops)
    if forward[1] == "mismatch" and not random[0]:
        _arbitrate(forward, state["forward_result"], (expected_outputs, expected_buffers), lambda: sample.precise(cotangents, positions)[0])
    result = {FORWARD: forward + [random[0], counting.fallbacks]}
    if expected_grads is not None:
        counting = harness.Counting()
        if "outputs" not in state:
            backward = [False, forward[1], "forward failed: " + forward[2], ""]
        else:
            with counting:
                _check(backward, backward_check)
        harness.merge_ops(ops, counting.ops)
        if backward[1] == "mismatch" and not random[0] and "backward_result" in state:
            _arbitrate(backward, state["backward_result"], expected_grads, lambda: sample.precise(cotangents, positions)[1])
        result[BACKWARD] = backward + [random[0], counting.fallbacks]
    result["ops"] = ops
    return result


# ---------------------------------------------------------------- one module


def entry_name(info, training):
    return f"{info.name}.{'train' if training else 'eval'}"


def planned_records(info, dtypes=DTYPES, quick=False):
    """[entry, dtype, phase] of the records run_entry makes for this module."""
    return [
        [entry_name(info, training), dtype_name(dtype), phase]
        for training in (True, False)
        for dtype in dtypes
        if dtype in info.dtypes
        for phase in (FORWARD, BACKWARD)
    ]


def run_entry(info, quick=False, budget=None, dtypes=DTYPES):
    """Records of one module: forward and backward per dtype, in train and eval mode."""
    budget = budget if budget is not None else (QUICK_BUDGET if quick else FULL_BUDGET)
    deadline = harness.Deadline(budget, per_sample=0.0 if quick else FULL_SECONDS_PER_INPUT)
    records = []
    ops = {}
    for training in (True, False):
        for dtype in dtypes:
            if dtype not in info.dtypes:
                continue
            records.extend(_run_dtype(info, dtype, training, quick, deadline, ops))
            harness.alive()
    return records, ops


def _run_dtype(info, dtype, training, quick, deadline, ops):
    name = entry_name(info, training)
    records = {phase: Record("moduleinfo", name, dtype_name(dtype), phase, harness.PASS) for phase in (FORWARD, BACKWARD)}
    failures = {}
    fallbacks = {FORWARD: set(), BACKWARD: set()}
    started = time.perf_counter()
    timed_out = False
    skipped = {}
    for phase in (FORWARD, BACKWARD):
        reason, _ = database_verdict(info, dtype, phase, training)
        if reason is not None:
            skipped[phase] = reason
    if deadline.passed():
        timed_out = True
    elif len(skipped) < 2:
        torch.manual_seed(0)
        try:
            with harness.time_limit(deadline.left()) as limit:
                inputs = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=training)
                for module_input in inputs:
                    if module_input.forward_input is None:
                        continue
                    result = _run_sample(info, module_input, dtype, training)
                    deadline.sample_done(limit)
                    harness.release_compiled_programs()
                    if result is None:
                        continue
                    for op, (rung, clean) in result.pop("ops").items():
                        harness.merge_ops(ops, {op: (rung, clean)})
                    for phase, (ok, kind, detail, precise, random, fallback) in result.items():
                        record = records[phase]
                        record.samples += 1
                        record.random = record.random or random
                        fallbacks[phase].update(fallback)
                        if ok:
                            record.passed += 1
                            harness.count_precise(record, precise)
                        elif phase not in failures:
                            failures[phase] = (kind, detail)
                    if quick:
                        break
        except harness.SampleTimeout:
            timed_out = True
        except Exception as error:  # noqa: BLE001 - the database's input generator failed
            for record in records.values():
                if record.samples == 0:
                    record.status, record.detail = harness.NO_SAMPLES, "input generation failed: " + harness.first_line(error)
    seconds = round(time.perf_counter() - started, 3)
    out = []
    for phase, record in records.items():
        record.seconds = seconds
        record.cpu_fallback = sorted(fallbacks[phase])
        if phase in skipped:
            record.status, record.detail = harness.OPINFO_SKIP, skipped[phase]
        elif timed_out:
            record.status, record.detail = harness.TIMEOUT, f"ran past the module's time budget after {record.samples} inputs"
        elif record.status == harness.NO_SAMPLES:
            pass
        elif record.samples == 0:
            record.status, record.detail = harness.NO_SAMPLES, "no input that torch itself runs"
        else:
            _resolve(info, record, failures.get(phase), dtype, phase, training, quick)
        out.append(record)
    return out


def _resolve(info, record, failure, dtype, phase, training, quick):
    listed = expected_failures.lookup(expected_failures.MODULEINFO, record.entry, dtype, phase, quick)
    if listed is None:
        listed = expected_failures.lookup(expected_failures.MODULEINFO, info.name, dtype, phase, quick)
    if failure is not None:
        record.kind, record.detail = failure
        if listed is not None and listed.covers([failure[0]]):
            record.status, record.detail = harness.EXPECTED_FAILURE, f"{listed.reason} (observed: {failure[1]})"
        elif database_verdict(info, dtype, phase, training)[1]:
            record.status = harness.OPINFO_EXPECTED_FAILURE
        else:
            record.status = harness.FAIL
    elif listed is not None:
        record.status, record.detail = harness.UNEXPECTED_PASS, f"listed as failing: {listed.reason}"


def sweep(only=None, quick=False, progress=None, budget=None, starting=None, planned=None, exact=None):
    """Run every selected module. Returns (records, ops by module, seconds, modules over budget)."""
    database = select(load_database(), only, exact)
    return harness.run_sweep(database, display_name, run_entry, quick, progress, budget, starting, planned)


def display_name(info):
    return info.name


if __name__ == "__main__":
    import sys

    sys.exit(harness.sweep_main(sys.modules[__name__]))
