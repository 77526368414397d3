"""Shared machinery of the parity sweeps: moving samples onto the bridge, comparing with eager torch,
per-sample time limits, and the record each (entry, dtype, phase) result is kept as."""

import dataclasses
import signal
import time

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import bridge
from runtime import stats

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

    def to_json(self):
        return dataclasses.asdict(self)


class SampleTimeout(BaseException):
    """Raised inside a sample that ran past its time budget (a BaseException so ops' own
    `except Exception` blocks do not swallow it)."""


def _on_alarm(signum, frame):
    raise SampleTimeout()


class time_limit:
    """Interrupt the body with SampleTimeout after `seconds` (main thread only; no-op elsewhere)."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.previous = None

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


def activate():
    """Activate the bridge for a sweep (idempotent).

    The databases are imported first: building them deep-copies torch functions, which the
    bridge's patches (wrapt proxies) refuse while active.
    """
    import torch.testing._internal.common_methods_invocations  # noqa: F401
    import torch.testing._internal.common_modules  # noqa: F401

    bridge.activate()
    _patched.clear()


def _patched_namespaces():
    """Where the bridge patches functions (factories taking device=, seeding, ...)."""
    return (torch, torch.Tensor, torch.nn.functional, torch.random, torch.cuda)


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
                    _patched[id(value.__wrapped__)] = value
        _patched[None] = None
    return _patched.get(id(function), function)


# ---------------------------------------------------------------- moving values


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
        if line.startswith(("Mismatched elements", "Greatest absolute", "Greatest relative", "The failure occurred")):
            keep.append(line)
        elif "do not match" in line or "mismatch" in line.lower():
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
        self.fallbacks = sorted(str(op) for op, count in stats.op_counts.items() if count and stats.op_rung.get(op) == stats.CPU_FALLBACK)
        sample_clean = not self.fallbacks
        for op, count in stats.op_counts.items():
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
        return sum(stats.op_counts.get(op, 0) for op in self._fallback_ops())

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
