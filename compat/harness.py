"""Shared machinery of the parity sweeps: moving samples onto the bridge, comparing with eager torch,
per-sample time limits, and the record each (entry, dtype, phase) result is kept as."""

import dataclasses
import os
import signal
import time
import warnings

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import bridge
from bridge.runtime import stats
from bridge.runtime.config import settings

BRIDGE_DEVICE = "cuda"

# What one (entry, dtype, phase) can come out as.
PASS = "pass"
FAIL = "fail"
EXPECTED_FAILURE = "expected_failure"  # listed in compat/expected_failures.py, and it fails
UNEXPECTED_PASS = "unexpected_pass"  # listed in compat/expected_failures.py, but it passes
OPINFO_SKIP = "opinfo_skip"  # the database itself skips the matching torch test
OPINFO_EXPECTED_FAILURE = "opinfo_expected_failure"  # the database marks the matching torch test xfail
TIMEOUT = "timeout"
NO_SAMPLES = "no_samples"  # the database gave no sample torch itself can run for this dtype
STATUSES = (PASS, FAIL, EXPECTED_FAILURE, UNEXPECTED_PASS, OPINFO_SKIP, OPINFO_EXPECTED_FAILURE, TIMEOUT, NO_SAMPLES)
# Results a test run accepts.
ACCEPTED = (PASS, EXPECTED_FAILURE, OPINFO_SKIP, OPINFO_EXPECTED_FAILURE, NO_SAMPLES)

FORWARD = "forward"
BACKWARD = "backward"
# Gradients of the op run inside a captured region (torch.compile under the bridge), the
# default mode: the region's backward is the program's, not torch's autograd op by op.
BACKWARD_CAPTURED = "backward_captured"


@dataclasses.dataclass
class Record:
    """The result of one entry of a database, for one dtype and one phase (forward or backward)."""

    database: str  # "opinfo" or "moduleinfo"
    entry: str  # "name" or "name.variant"
    dtype: str  # "float32", ...
    phase: str  # FORWARD or BACKWARD (modules: "train" / "eval" are part of `entry`)
    status: str
    detail: str = ""  # first line of the error, the skip reason, or the listed reason
    kind: str = ""  # for failures: "error", "mismatch", "dtype", "shape", "device", "reproducibility"
    samples: int = 0  # samples compared
    passed: int = 0
    cpu_fallback: list = dataclasses.field(default_factory=list)  # ATen ops that ran on the host CPU
    seconds: float = 0.0
    random: bool = False  # checked for shape, dtype and reproducibility, not values
    # Samples that differ from torch beyond the tolerance but passed by test_ops' rule: at least as
    # close to the float64 result as torch's own (see judge_against_float64).
    precise: int = 0
    precise_note: str = ""
    # Captured gradient samples whose region broke and ran eagerly (their gradients are then
    # eager mode's, which is what a user's program gets there too).
    graph_breaks: int = 0

    def to_json(self):
        return dataclasses.asdict(self)


class SampleTimeout(BaseException):
    """Raised inside a sample that ran past its time budget (a BaseException so ops' own
    `except Exception` blocks do not swallow it)."""


def _on_alarm(signum, frame):
    raise SampleTimeout()


class Deadline:
    """An entry's time budget: `seconds` from now, extended by `per_sample` for each sample that
    completes, so that an entry with many samples (max_pool2d has over a thousand per dtype) may
    run them all while a hang still trips within the allowance it has left."""

    def __init__(self, seconds, per_sample=0.0):
        self.at = time.perf_counter() + seconds
        self.per_sample = per_sample

    def left(self):
        return self.at - time.perf_counter()

    def passed(self):
        return self.left() <= 0

    def sample_done(self, limit=None):
        """Credit one completed sample; re-arm `limit` (a time_limit) to the new deadline."""
        if self.per_sample:
            self.at += self.per_sample
            if limit is not None:
                limit.rearm(self.left())


def _map_count_limit():
    try:
        with open("/proc/sys/vm/max_map_count", encoding="ascii") as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return None


_MAP_COUNT_LIMIT = _map_count_limit()


_RESIDENT_LIMIT = 3 << 30
# After a release the programs are dropped again only once the process has grown this much past
# what it held just after it: what a release cannot free (torch's and the bridge's own memory)
# must not set it off at every phase (see release_compiled_programs).
_RESIDENT_GROWTH = 1 << 30
_resident_after_release = 0


def release_compiled_programs():
    """Drop JAX's compiled programs once this process holds half of the memory mappings Linux
    allows it (vm.max_map_count, 65530 by default).

    Every compiled XLA CPU program keeps its own mappings, and JAX's caches keep the programs
    after the functions that made them are gone. A sweep compiles new captured programs for
    every module input (a fresh module each time) that it never runs again: nn.LSTM's 128 inputs
    left some 65,000 mappings, and the next compilation failed with "LLVM compilation error:
    Cannot allocate memory" on a machine with gigabytes free. Programs still in use compile again.

    The programs are dropped as well once the process's resident memory passes
    `_RESIDENT_LIMIT`: an OpInfo sweep worker grew to 6 GB of them, and two such workers beside
    a test run exhausted a 24 GiB machine. Past the limit, the next release waits until the
    process has grown `_RESIDENT_GROWTH` beyond what it held after the last one: a worker that
    stayed at 3 GiB after a release dropped its programs after every phase, compiled them all
    again, and the test suite's OpInfo sweep took 761 s instead of about 300.
    """
    global _resident_after_release
    if _MAP_COUNT_LIMIT is None:
        return False
    try:
        count = _map_count()
        resident = _resident_bytes()
    except (OSError, ValueError, IndexError):
        return False
    resident_limit = max(_RESIDENT_LIMIT, _resident_after_release + _RESIDENT_GROWTH)
    if count < _MAP_COUNT_LIMIT // 2 and resident < resident_limit:
        return False
    import ctypes
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the freed heap back, so that resident memory shows it
    except (OSError, AttributeError):
        pass
    try:
        _resident_after_release = _resident_bytes()
    except (OSError, ValueError, IndexError):
        _resident_after_release = resident
    return True


def _map_count():
    with open("/proc/self/maps", "rb") as handle:
        return sum(1 for _ in handle)


def _resident_bytes():
    with open("/proc/self/statm", "rb") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_heartbeat = []


def alive():
    """Tell a parent sweep process that this one still makes progress (its idle timeout guards
    against hangs; a long entry reports after each phase)."""
    for beat in _heartbeat:
        beat()


class time_limit:
    """Interrupt the body with SampleTimeout after `seconds` (main thread only; no-op elsewhere)."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.previous = None

    def rearm(self, seconds):
        if self.seconds is not None:
            signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))

    def __enter__(self):
        if self.seconds is None:
            return self
        try:
            self.previous = signal.signal(signal.SIGALRM, _on_alarm)
        except ValueError:  # not the main thread
            self.seconds = None
            return self
        signal.setitimer(signal.ITIMER_REAL, max(self.seconds, 0.001))
        return self

    def __exit__(self, *exc):
        if self.seconds is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False


def load_databases():
    """(op_db, module_db). Building them deep-copies torch functions, which the bridge's patches
    (wrapt proxies) refuse while active, so the bridge is off while they are first imported."""
    was_active = bridge.is_active()
    if was_active:
        bridge.deactivate()
    try:
        from torch.testing._internal.common_methods_invocations import op_db
        from torch.testing._internal.common_modules import module_db
    finally:
        if was_active:
            bridge.activate()
    return op_db, module_db


def activate():
    """Activate the bridge for a sweep (idempotent), the databases imported first. A sweep
    measures the mappings: no sample runs on the host for being a new shape."""
    load_databases()
    bridge.activate()
    settings.host_int_ops = False
    _patched.clear()


def _patched_namespaces():
    """Where the bridge patches functions (factories taking device=, seeding, ...)."""
    return (torch, torch.Tensor, torch.nn.functional, torch.random, torch.cuda, torch.linalg)


_patched = {}  # id(original function) -> the active patched attribute


def patched(function):
    """The bridge's patched version of a torch function captured before activation (as the
    databases capture `torch.ones`), else the function itself. A user's `from torch import ones`
    above the activation line would bypass the patch the same way."""
    if not _patched:
        import wrapt

        for namespace in _patched_namespaces():
            for value in list(vars(namespace).values()):
                if isinstance(value, wrapt.FunctionWrapper):
                    original = value.__wrapped__
                    while isinstance(original, wrapt.FunctionWrapper):  # patched twice
                        original = original.__wrapped__
                    _patched[id(original)] = value
        _patched[None] = None
    return _patched.get(id(function), function)


# ---------------------------------------------------------------- moving values


def captured(function):
    """`function` as captured mode runs it: `torch.compile` under the bridge, one region."""
    return torch.compile(function)


def graph_breaks():
    """How many regions have broken so far in this process."""
    from bridge.runtime import capture

    return len(capture.breaks)


def _is_cpu_device(value):
    return (isinstance(value, torch.device) and value.type == "cpu") or value == "cpu"


def to_bridge(tree, memo=None, keep_grad=False):
    """A copy of a nest of values with every tensor moved to the bridge device.

    Tensors seen twice stay one tensor (aliasing inside a sample is kept); `device="cpu"`
    arguments become the bridge device. With keep_grad, tensors that require grad become
    fresh bridge leaves that require grad. `memo` maps id(cpu tensor) to its bridge copy.
    """
    memo = {} if memo is None else memo

    def move(value):
        if isinstance(value, torch.Tensor):
            key = id(value)
            if key not in memo:
                copy = value.detach().to(BRIDGE_DEVICE)
                if keep_grad and value.requires_grad:
                    copy.requires_grad_(True)
                memo[key] = copy
            return memo[key]
        if isinstance(value, torch.device) and value.type == "cpu":
            return torch.device(BRIDGE_DEVICE)
        return value

    return pytree.tree_map(move, tree)


def bridge_kwargs(kwargs):
    """`device="cpu"` keyword arguments (factories in the databases) name the bridge device instead."""
    if "device" in kwargs and _is_cpu_device(kwargs["device"]):
        kwargs = dict(kwargs, device=BRIDGE_DEVICE)
    return kwargs


def placement(tree):
    """The default device a sample's call runs under: the bridge device for a sample with neither a
    tensor nor a `device=` argument (`torch.arange(2)`), which only the default device can move, as
    `torch.set_default_device("cuda")` moves a script's; else no change."""
    import contextlib

    has_device = False

    def visit(value):
        nonlocal has_device
        has_device = has_device or isinstance(value, (torch.Tensor, torch.device))

    pytree.tree_map(visit, tree)
    if has_device or (isinstance(tree, tuple) and len(tree) == 3 and isinstance(tree[2], dict) and "device" in tree[2]):
        return contextlib.nullcontext()
    return torch.device(BRIDGE_DEVICE)


class NotOnBridge(AssertionError):
    """An op given bridge tensors returned a tensor that is not a bridge tensor."""


def to_cpu(tree):
    """A copy of a nest of bridge results with each tensor brought back to an eager CPU tensor."""

    def back(value):
        if isinstance(value, torch.Tensor):
            if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
                raise NotOnBridge(f"result is a plain {value.device} tensor, not a bridge tensor")
            return value.detach().cpu()
        return value

    return pytree.tree_map(back, tree)


# ---------------------------------------------------------------- comparing


def first_line(error):
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    name = type(error).__name__
    return f"{name}: {line}"[:300]


def mismatch_summary(error):
    """assert_close's message, shortened to what tells the cause apart."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    keep = [lines[0]] if lines else []
    for line in lines[1:]:
        if line.startswith(("Mismatched elements", "Greatest absolute", "Greatest relative", "The failure occurred")) or "do not match" in line or "mismatch" in line.lower():
            keep.append(line)
    return " | ".join(keep)[:400]


def classify_mismatch(error):
    text = str(error)
    if "dtype" in text and "do not match" in text.lower():
        return "dtype"
    if "shape" in text.lower() and "do not match" in text.lower():
        return "shape"
    return "mismatch"


def compare(actual, expected, tolerance=None):
    """assert_close with exact dtypes and NaNs equal; `tolerance` is (rtol, atol) or None for
    torch's defaults per dtype. Non-tensor leaves (ints, dtypes, strings) must be equal."""
    actual_leaves, actual_spec = pytree.tree_flatten(actual)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    if len(actual_leaves) != len(expected_leaves):
        raise AssertionError(f"structure differs: {actual_spec} vs {expected_spec}")
    for position, (got, want) in enumerate(zip(actual_leaves, expected_leaves)):
        where = f"output {position}"
        if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
            if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
                raise AssertionError(f"{where}: type {type(got).__name__} vs {type(want).__name__}")
            if got.dtype != want.dtype:
                raise AssertionError(f"{where}: dtypes do not match: {got.dtype} vs {want.dtype}")
            if got.shape != want.shape:
                raise AssertionError(f"{where}: shapes do not match: {tuple(got.shape)} vs {tuple(want.shape)}")
            options = {}
            if tolerance is not None and (want.is_floating_point() or want.is_complex()):
                options = {"rtol": tolerance[0], "atol": tolerance[1]}
            try:
                torch.testing.assert_close(got, want, equal_nan=True, check_device=False, check_stride=False, **options)
            except AssertionError as error:
                raise AssertionError(f"{where}: {mismatch_summary(error)}") from None
        elif isinstance(want, (int, float, complex)) and not isinstance(want, bool):
            options = {} if tolerance is None else {"rtol": tolerance[0], "atol": tolerance[1]}
            torch.testing.assert_close(got, want, equal_nan=True, **options)
        elif got != want:
            raise AssertionError(f"{where}: {got!r} vs {want!r}")


def compare_structure(actual, expected):
    """Shapes and dtypes only: for random ops and uninitialized memory."""
    actual_leaves, _ = pytree.tree_flatten(actual)
    expected_leaves, _ = pytree.tree_flatten(expected)
    if len(actual_leaves) != len(expected_leaves):
        raise AssertionError(f"{len(actual_leaves)} outputs where torch gives {len(expected_leaves)}")
    for position, (got, want) in enumerate(zip(actual_leaves, expected_leaves)):
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                raise AssertionError(f"output {position}: {type(got).__name__} where torch gives a tensor")
            if got.dtype != want.dtype:
                raise AssertionError(f"output {position}: dtypes do not match: {got.dtype} vs {want.dtype}")
            if got.shape != want.shape:
                raise AssertionError(
                    f"output {position}: shapes do not match: {tuple(got.shape)} vs {tuple(want.shape)}"
                )


def compare_exact(first, second):
    """Bit equality (NaNs equal): reproducibility under one seed."""
    first_leaves, _ = pytree.tree_flatten(first)
    second_leaves, _ = pytree.tree_flatten(second)
    for position, (one, two) in enumerate(zip(first_leaves, second_leaves)):
        if isinstance(one, torch.Tensor):
            torch.testing.assert_close(one, two, rtol=0, atol=0, equal_nan=True)


def judge_against_float64(actual, expected, truth):
    """(kind, note) for a mismatch between the bridge's and torch's results, given the same
    computation in float64 on the CPU (None when the float64 result cannot judge: NaN or infinity
    where torch has a number, or results of other shapes):

    - ("precise", ...) when the bridge's result is at least as close to the float64 one as torch's,
      summing the absolute differences over every element: the rule PyTorch's own test_ops applies
      to its Python references when they do not match the torch kernel (TestCommon._ref_test_helper,
      "the reference was more accurate than the torch operator"). The sample passes.
    - ("rounding", ...) when it is not, but its largest error is within twice torch's: a difference
      in rounding order that still fails.
    - ("mismatch", ...) otherwise."""
    bridge_error = torch_error = 0.0
    bridge_distance = torch_distance = 0.0
    got_leaves, want_leaves, exact_leaves = (pytree.tree_leaves(tree) for tree in (actual, expected, truth))
    if not (len(got_leaves) == len(want_leaves) == len(exact_leaves)):
        return None
    for got, want, exact in zip(got_leaves, want_leaves, exact_leaves):
        if not isinstance(want, torch.Tensor) or not (want.is_floating_point() or want.is_complex()):
            continue
        if not isinstance(got, torch.Tensor) or not isinstance(exact, torch.Tensor):
            return None
        if got.shape != want.shape or exact.shape != want.shape:
            return None
        wide = torch.complex128 if want.is_complex() else torch.float64
        got, want, exact = got.detach().to(wide), want.detach().to(wide), exact.detach().to(wide)
        if not (torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())):
            return None
        finite = exact.isfinite() & want.isfinite()
        if not torch.equal(got[~finite].nan_to_num(0.0, 1.0, -1.0), want[~finite].nan_to_num(0.0, 1.0, -1.0)):
            return None  # NaNs matched above; infinities must be the same, sign included
        if finite.any():
            bridge_off = (got[finite] - exact[finite]).abs()
            torch_off = (want[finite] - exact[finite]).abs()
            bridge_error = max(bridge_error, bridge_off.max().item())
            torch_error = max(torch_error, torch_off.max().item())
            bridge_distance += bridge_off.sum().item()
            torch_distance += torch_off.sum().item()
    note = (
        f"error against float64: bridge {bridge_error:.2g}, torch CPU {torch_error:.2g} at most; "
        f"{bridge_distance:.3g} and {torch_distance:.3g} summed"
    )
    if bridge_distance <= torch_distance:
        return "precise", f"{PRECISE_NOTE} ({note})"
    if bridge_error <= 2.0 * torch_error + 1e-12:
        return "rounding", f"rounding: as close to the float64 result as torch's CPU kernel ({note})"
    return "mismatch", note


PRECISE_NOTE = "passed by test_ops' rule: as close to the float64 result as torch's CPU kernel"


def count_precise(record, note):
    """Count a sample that passed by test_ops' rule (`note` empty: it passed the tolerance)."""
    if note:
        record.precise += 1
        record.precise_note = record.precise_note or note


def _is_bridge(value):
    return isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter)


class FirstDivergence(TorchDispatchMode):
    """Runs each ATen op that gets bridge tensors a second time with eager torch on CPU copies of
    its inputs, and names the first op whose result differs (or that raises): where a failing
    sample goes wrong, for the failure groups of the report. For diagnosis only (slow)."""

    def __init__(self):
        super().__init__()
        self.found = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is not None or not any(_is_bridge(value) for value in pytree.tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        try:
            cpu_args, cpu_kwargs = pytree.tree_map(
                lambda value: value.detach().cpu().clone() if _is_bridge(value) else value, (args, kwargs)
            )
            if "device" in cpu_kwargs and cpu_kwargs["device"] is not None:
                cpu_kwargs["device"] = "cpu"
        except Exception:  # noqa: BLE001
            return func(*args, **kwargs)
        try:
            result = func(*args, **kwargs)
        except Exception as error:
            self.found = f"{func} raised {first_line(error)[:120]}"
            raise
        if _draws_random_numbers(func) or _uninitialized(func):
            return result
        try:
            expected = func(*cpu_args, **cpu_kwargs)
            compare(to_cpu_loose(result), expected)
        except AssertionError as error:
            self.found = f"{func} ({mismatch_summary(error).split(' | ')[0][:120]})"
        except Exception:  # noqa: BLE001 - eager torch cannot replay it: no verdict
            pass
        return result


def _draws_random_numbers(func):
    from bridge.runtime.registry import MAPPINGS

    mapping = MAPPINGS.get(func)
    return (mapping is not None and mapping.rng) or torch.Tag.nondeterministic_seeded in func.tags


def _uninitialized(func):
    """Ops whose results are uninitialized memory (empty, empty_like, new_empty, ...)."""
    return torch.Tag.nondeterministic_bitwise in func.tags or "empty" in func._schema.name


def to_cpu_loose(tree):
    """Like to_cpu, but plain tensors pass through (for diagnosis, where the device is not the question)."""
    return pytree.tree_map(lambda value: value.detach().cpu() if isinstance(value, torch.Tensor) else value, tree)


# ---------------------------------------------------------------- the runtime's counters


class Counting(TorchDispatchMode):
    """Counts what the bridge dispatches inside the block, through the runtime's own counters.

    As a dispatch mode it also sees each op the program calls before the bridge does, so CPU
    fallbacks that happen inside an op's decomposition are charged to that op: a decomposition
    "lands on table entries" only if some call of it ran no op on the host CPU.
    """

    def __init__(self):
        super().__init__()
        self.fallbacks = []
        self.ops = {}
        self._unclean = set()  # ops every call of which ran a CPU fallback (within the block)
        self._clean = set()
        self._known = (0, ())

    def __enter__(self):
        stats.reset()
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        counts = stats.op_counts()
        self.fallbacks = sorted(str(op) for op, count in counts.items() if count and stats.op_rung.get(op) == stats.CPU_FALLBACK)
        sample_clean = not self.fallbacks
        for op, count in counts.items():
            if not count:
                continue
            rung = stats.op_rung.get(op, stats.MAPPED)
            if rung == stats.CPU_FALLBACK:
                clean = False
            elif op in self._clean:
                clean = True
            elif op in self._unclean:
                clean = False
            else:  # reached only inside another op's decomposition: judged by the whole block
                clean = sample_clean
            self.ops[str(op)] = (rung, clean)
        return result

    def _fallback_ops(self):
        size, ops = self._known
        if size != len(stats.op_rung):
            ops = tuple(op for op, rung in stats.op_rung.items() if rung == stats.CPU_FALLBACK)
            self._known = (len(stats.op_rung), ops)
        return ops

    def _fallback_calls(self):
        return sum(stats.calls(op) for op in self._fallback_ops())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self._fallback_calls()
        result = func(*args, **(kwargs or {}))
        own = 1 if stats.op_rung.get(func) == stats.CPU_FALLBACK else 0
        if self._fallback_calls() - before - own > 0:
            self._unclean.add(func)
        else:
            self._clean.add(func)
        return result


def merge_ops(target, ops):
    """Fold one block's ops ({op: (rung, clean)}, see Counting) into `target` ({op: [rung, clean
    in some call]})."""
    for op, (rung, clean) in ops.items():
        seen = target.setdefault(op, [rung, False])
        seen[1] = seen[1] or clean


# ---------------------------------------------------------------- a sweep as a process of its own


def run_sweep(database, name_of, run_entry, quick, progress, budget, starting, planned):
    """Run `run_entry` over every entry of a selected database (OpInfo's or ModuleInfo's), with the
    sweep's callbacks. Returns (records, ops by entry name, seconds, entries over budget)."""
    if planned is not None:
        planned([name_of(entry) for entry in database])
    activate()
    started = time.perf_counter()
    records, ops_by_entry, over_budget = [], {}, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for position, entry in enumerate(database):
            if starting is not None:
                starting(position, len(database), entry)
            entry_started = time.perf_counter()
            entry_records, entry_ops = run_entry(entry, quick=quick, budget=budget)
            records.extend(entry_records)
            ops_by_entry[name_of(entry)] = entry_ops
            if any(record.status == TIMEOUT for record in entry_records):
                over_budget.append(name_of(entry))
            if progress is not None:
                progress(position, len(database), entry, entry_records, time.perf_counter() - entry_started, entry_ops)
    return records, ops_by_entry, time.perf_counter() - started, over_budget


def sweep_main(module, argv=None):
    """`python -m bridge.compat.opinfo [--quick] [--only A,B] [--entries A,B]`: one database's sweep as
    JSON lines on stdout: the plan (entry names), then per entry a "start" line, its records and a
    "done" line with the ATen ops it dispatched, so that a parent process learns which entry was
    running if this one dies."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(prog=f"python -m {module.__name__}", description=module.__doc__)
    parser.add_argument("--quick", action="store_true", help="the first sample per entry and dtype only")
    parser.add_argument("--only", action="append", metavar="NAME[,NAME]", help="only these entries (a name selects its variants)")
    parser.add_argument("--entries", metavar="FILE", help="only the entries named in FILE, one per line, exactly")
    options = parser.parse_args(argv)
    only = [name.strip() for value in options.only or () for name in value.split(",") if name.strip()] or None
    exact = None
    if options.entries:
        with open(options.entries, encoding="utf-8") as handle:
            exact = [line.strip() for line in handle if line.strip()]
    out = sys.stdout

    def write(line):
        out.write(json.dumps(line) + "\n")
        out.flush()

    def planned(names):
        write({"event": "plan", "entries": names})

    def starting(position, count, entry):
        write({"event": "start", "entry": module.display_name(entry), "planned": module.planned_records(entry, quick=options.quick)})

    def finished(position, count, entry, records, seconds, ops=None):
        for record in records:
            write({"event": "record", **record.to_json()})
        write({"event": "done", "entry": module.display_name(entry), "seconds": round(seconds, 3), "ops": ops or {}})

    _heartbeat.append(lambda: write({"event": "alive"}))
    records, _, seconds, over_budget = module.sweep(
        only=only, exact=exact, quick=options.quick, progress=finished, starting=starting, planned=planned
    )
    write({"event": "end", "seconds": round(seconds, 3), "records": len(records), "over_budget": over_budget})
    return 0


def run_sweep_process(module_name, quick=False, only=None, progress=None, idle_timeout=None, exact=None):
    """Run one database's sweep in child processes (a crash or a hang in one entry costs that
    entry, not the sweep). Returns {"records": [dict], "ops": {entry: ops}, "seconds": float,
    "over_budget": [names], "crashed": [names]}."""
    import json
    import os
    import queue
    import subprocess
    import sys
    import tempfile
    import threading

    idle_timeout = idle_timeout or 600.0
    result = {"records": [], "ops": {}, "seconds": 0.0, "over_budget": [], "crashed": []}
    plan = None
    done = set()
    repository, environment = child_environment()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        while True:
            command = [sys.executable, "-m", module_name]
            if quick:
                command.append("--quick")
            if plan is None:
                if only:
                    command += ["--only", ",".join(only)]
                elif exact:
                    entries_file = os.path.join(folder, "entries.txt")
                    with open(entries_file, "w", encoding="utf-8") as handle:
                        handle.write("\n".join(exact))
                    command += ["--entries", entries_file]
            else:
                remaining = [name for name in plan if name not in done]
                if not remaining:
                    break
                entries_file = os.path.join(folder, "entries.txt")
                with open(entries_file, "w", encoding="utf-8") as handle:
                    handle.write("\n".join(remaining))
                command += ["--entries", entries_file]
            error_path = os.path.join(folder, "stderr.txt")
            with open(error_path, "w+", encoding="utf-8") as error_file:
                child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=error_file, text=True, cwd=repository, env=environment)
                lines = queue.Queue()
                threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True).start()
                running, ended = None, False
                while True:
                    try:
                        line = lines.get(timeout=idle_timeout)
                    except queue.Empty:
                        child.kill()
                        break
                    if line is None:
                        break
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue  # something the child printed on stdout itself
                    kind = event.pop("event", None)
                    if kind == "plan" and plan is None:
                        plan = event["entries"]
                    elif kind == "start":
                        running, planned = event["entry"], event["planned"]
                        received = set()
                    elif kind == "record":
                        result["records"].append(event)
                        received.add((event["entry"], event["dtype"], event["phase"]))
                    elif kind == "done":
                        done.add(event["entry"])
                        result["ops"][event["entry"]] = event["ops"]
                        running = None
                        if progress is not None:
                            progress(event["entry"], [r for r in result["records"] if _belongs(r, event["entry"])], event["seconds"])
                    elif kind == "end":
                        result["over_budget"].extend(event["over_budget"])
                        ended = True
                child.wait()
                error_file.seek(0)
                error_tail = [line.strip() for line in error_file.read().splitlines() if line.strip()][-1:]
            if ended:
                if plan is None or all(name in done for name in plan):
                    break
                continue
            if plan is None or running is None:
                raise RuntimeError(f"{module_name} sweep process failed before any entry ran: {' '.join(error_tail)}")
            # The child died (or hung) inside `running`: record that and go on after it.
            done.add(running)
            result["crashed"].append(running)
            how = _death(child.returncode)
            for entry, dtype, phase in planned:
                if (entry, dtype, phase) not in received:
                    result["records"].append(
                        Record(
                            module_name.rsplit(".", 1)[-1], entry, dtype, phase, FAIL, kind="crash",
                            detail=f"the sweep process {how} in this entry: {' '.join(error_tail)}"[:300],
                        ).to_json()
                    )
    result["seconds"] = time.perf_counter() - started
    return result


def child_environment():
    """(the repository's folder, the environment) a child process of a sweep runs with: the
    repository importable as the `bridge` package."""
    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = dict(os.environ)
    environment["PYTHONPATH"] = repository + os.pathsep + environment.get("PYTHONPATH", "")
    return repository, environment


def run_sweep_parallel(module_name, names, workers=2, quick=False, progress=None):
    """run_sweep_process over `names` split between `workers` child processes at once (the
    entries interleaved, so slow families spread out); the results merged as one sweep."""
    import threading

    chunks = [names[start::workers] for start in range(workers)]
    results = [None] * len(chunks)
    errors = []

    def sweep(position):
        try:
            results[position] = run_sweep_process(module_name, quick=quick, exact=chunks[position], progress=progress)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(error)

    started = time.perf_counter()
    threads = [threading.Thread(target=sweep, args=(position,)) for position in range(len(chunks)) if chunks[position]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    merged = {"records": [], "ops": {}, "seconds": time.perf_counter() - started, "over_budget": [], "crashed": []}
    for result in results:
        if result is None:
            continue
        merged["records"] += result["records"]
        merged["ops"].update(result["ops"])
        merged["over_budget"] += result["over_budget"]
        merged["crashed"] += result["crashed"]
    return merged


def _pump(stream, lines):
    """Move a child's output lines into a queue (None at the end), so the parent can time out."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def _death(returncode):
    import signal

    if returncode == -signal.SIGKILL:
        return "stopped answering and was killed"
    if returncode is not None and returncode < 0:
        return f"died of {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


def _belongs(record, entry):
    name = record["entry"]
    return name == entry or name.rsplit(".", 1)[0] == entry and record["database"] == "moduleinfo"


def problems(records):
    """What a test run does not accept in these records: new failures, time-outs, crashes, and
    listed expected failures that now pass (the list must be kept true)."""
    found = []
    for record in records:
        where = f"{record['entry']} {record['dtype']}/{record['phase']}"
        if record["status"] == UNEXPECTED_PASS:
            found.append(f"{where}: unexpectedly passing ({record['detail']}); remove it from compat/expected_failures.py")
        elif record["status"] not in ACCEPTED:
            found.append(f"{where}: {record['status']}: {record['detail']}")
    return found


def report_command(argv, description, module, report_name, sweep, report):
    """The command line of a sweep's report (compat/exported.py, compat/torchscript.py):
    `--only` names its entries (modules, corpus scripts), `--out` the folder; writes and prints
    the report."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--only", default="", help="module names, comma-separated")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "reports"))
    options = parser.parse_args(argv)
    load_databases()
    results = sweep([name for name in options.only.split(",") if name] or None)
    command = f"python -m bridge.compat.{module}" + (f" --only {options.only}" if options.only else "")
    text = report(results, command)
    os.makedirs(options.out, exist_ok=True)
    with open(os.path.join(options.out, report_name), "w") as handle:
        handle.write(text)
    print(text)
    return 0


# ---------------------------------------------------------------- the script corpus's models

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


@dataclasses.dataclass
class CorpusModel:
    """A module a corpus script calls, as it was at its first call: a copy of it and of the call's
    inputs, its mode then, and whether the script went on to train it (gradients reached it)."""

    script: str
    name: str  # its class's name, numbered where the script calls several of one class
    module: torch.nn.Module
    args: tuple
    kwargs: dict
    training: bool
    original: torch.nn.Module  # the script's own module, to read its gradients after the run

    @property
    def trained(self):
        return any(parameter.grad is not None for parameter in self.original.parameters())


def corpus_scripts():
    return sorted(name[:-3] for name in os.listdir(CORPUS) if name.endswith(".py"))


def corpus_models(script):
    """Run compat/scripts/<script>.py with plain torch (in this process, its output discarded,
    in a scratch folder) and return a CorpusModel for each module with parameters that the script
    calls itself (a module called inside another is part of that one); DistributedDataParallel
    stands for its module."""
    import contextlib
    import copy
    import io
    import runpy
    import sys
    import tempfile
    from unittest import mock

    calling = torch.nn.Module.__call__
    models, seen, depth = [], set(), [0]

    def recording(module, *args, **kwargs):
        if depth[0] == 0 and id(module) not in seen:
            seen.add(id(module))
            inner = getattr(module, "module", module) if type(module).__name__ in ("DistributedDataParallel", "DataParallel") else module
            if any(True for _ in inner.parameters()):
                # (copied outside inference mode: a copy made inside it is an inference tensor,
                # which torch.export cannot trace with)
                with torch.inference_mode(False):
                    detached = pytree.tree_map(lambda value: value.detach().clone() if isinstance(value, torch.Tensor) else value, (args, kwargs))
                    count = sum(1 for model in models if type(model.module).__name__ == type(inner).__name__)
                    name = type(inner).__name__ + (f" #{count + 1}" if count else "")
                    models.append(CorpusModel(script, name, copy.deepcopy(inner), *copy.deepcopy(detached), inner.training, inner))
        depth[0] += 1
        try:
            return calling(module, *args, **kwargs)
        finally:
            depth[0] -= 1

    path = os.path.join(CORPUS, script + ".py")
    saved_argv, saved_cwd, saved_dtype = sys.argv, os.getcwd(), torch.get_default_dtype()
    with tempfile.TemporaryDirectory() as folder, mock.patch.object(torch.nn.Module, "__call__", recording):
        sys.argv = [path]
        os.chdir(folder)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                runpy.run_path(path, run_name="__main__")
        finally:
            sys.argv = saved_argv
            os.chdir(saved_cwd)
            torch.set_default_dtype(saved_dtype)
    for model in models:  # numbered names: the first of a class is "#1" once a second is seen
        if any(other.name == model.name + " #2" for other in models):
            model.name += " #1"
    return models


class CorpusChildError(Exception):
    """A corpus script's check that gave no result in its process: why, and the seconds it took."""

    def __init__(self, reason, seconds):
        super().__init__(reason)
        self.seconds = seconds


def corpus_rows_in_child(module, script, timeout=600):
    """The rows `python -m bridge.compat.<module> --corpus-script <script>` prints (its last line,
    JSON), run in a process of its own: the script's DataLoader workers fork before JAX starts
    there, and what the script sets for the process (seeds, a process group) ends with it.
    Raises CorpusChildError where the process gives no rows."""
    import json
    import subprocess
    import sys

    repository, environment = child_environment()
    command = [sys.executable, "-m", f"bridge.compat.{module}", "--corpus-script", script]
    try:
        child = subprocess.run(command, capture_output=True, text=True, cwd=repository, env=environment, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CorpusChildError(f"no result within {timeout} s", float(timeout)) from None
    lines = [line for line in child.stdout.splitlines() if line.startswith("[")]
    if child.returncode != 0 or not lines:
        tail = " ".join(child.stderr.strip().splitlines()[-1:])
        raise CorpusChildError(f"the check's process exited with code {child.returncode}: {tail}"[:300], 0.0)
    return [tuple(row) for row in json.loads(lines[-1])]
