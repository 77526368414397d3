"""PyTorch's OpInfo database run through the bridge against eager torch on the CPU: every entry,
its sample inputs, forward results for each supported dtype and gradients in float32/float64."""

import time
import unittest

import torch
from torch.utils import _pytree as pytree

from . import expected_failures, harness
from .harness import BACKWARD, BACKWARD_CAPTURED, FORWARD, Record

DTYPES = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.complex64,
)
GRAD_DTYPES = (torch.float32, torch.float64)
GRADIENT_PHASES = (BACKWARD, BACKWARD_CAPTURED)
# The captured phase compiles a program per sample (about three times the eager phase's time):
# the quick sweep (CI's) runs it in float32, the full sweep in both.
QUICK_CAPTURED_DTYPES = (torch.float32,)


def _gradient_dtypes(phase, quick):
    return QUICK_CAPTURED_DTYPES if phase == BACKWARD_CAPTURED and quick else GRAD_DTYPES

# Per-entry time budgets (seconds) for all its dtypes and phases together.
QUICK_BUDGET = 45.0  # 30 s before the captured gradient phase joined; one entry ran past it
FULL_BUDGET = 180.0
# In full mode each completed sample adds this much to its entry's budget: the budget scales with
# the entry's sample count (max_pool2d has 1,440 samples per dtype at 0.07-0.2 s each, more on a
# loaded machine), while a sample that hangs still trips the budget left to it.
FULL_SECONDS_PER_SAMPLE = 0.5
# Samples whose torch reference raises are passed over; quick mode tries this many for one that runs.
QUICK_ATTEMPTS = 4

SEED = 1234
OTHER_SEED = 4321

# Entries whose values are draws from a distribution: checked for shape, dtype and
# reproducibility under torch.manual_seed, not for values.
RANDOM_ENTRIES = {
    "bernoulli",
    "cauchy",
    "exponential",
    "geometric",
    "log_normal",
    "multinomial",
    "normal",
    "normal.in_place",
    "normal.number_mean",
    "uniform",
    "rand_like",
    "randint",
    "randint_like",
    "randn",
    "randn_like",
    "nn.functional.dropout",
    "nn.functional.dropout2d",
    "nn.functional.dropout3d",
    "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.rrelu",
    "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d",
    "pca_lowrank",
    "svd_lowrank",
}
# Entries whose results are uninitialized memory: shape and dtype only.
UNINITIALIZED_ENTRIES = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}
# Entries random for the samples with a dropout probability above zero (in training), as the
# database's own skips say; their position among the positional arguments, if any.
DROPOUT_ENTRIES = {"nn.functional.scaled_dot_product_attention": None, "nn.functional.multi_head_attention_forward": 9}

# torch tests whose skip/xfail metadata applies to each phase of this sweep. test_compare_cpu is
# torch's own device-against-CPU comparison; test_variant_consistency_eager's skips mark samples
# that misbehave in eager mode; test_fn_grad is the first-order gradient test.
FORWARD_TESTS = (("TestCommon", "test_compare_cpu"),)
FORWARD_SKIP_ONLY_TESTS = (("TestCommon", "test_variant_consistency_eager"),)
BACKWARD_TESTS = (("TestBwdGradients", "test_fn_grad"),)
# Device types whose metadata applies: the reference runs on the CPU.
DEVICE_TYPES = (None, "cpu")


def entry_name(op):
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def load_database():
    """op_db, imported lazily (importing it takes seconds)."""
    return harness.load_databases()[0]


def entry_names():
    """Names of every entry ("name" or "name.variant"), in database order."""
    return [entry_name(op) for op in harness.load_databases()[0]]


def select(database, only=None, exact=None):
    """Entries whose name or "name.variant" is in `only`, or whose "name.variant" is in `exact`
    (all of them when neither is given)."""
    if exact is not None:
        wanted = set(exact)
        return [op for op in database if entry_name(op) in wanted]
    if not only:
        return list(database)
    wanted = set(only)
    return [op for op in database if op.name in wanted or entry_name(op) in wanted]


# ---------------------------------------------------------------- the database's own metadata


def _active(info, tests, dtype):
    if info.device_type not in DEVICE_TYPES:
        return False
    for cls_name, test_name in tests:
        try:
            if info.is_active(cls_name, test_name, info.device_type or "cpu", dtype, {}):
                return True
        except Exception:  # noqa: BLE001 - an active_if that needs test parameters we do not have
            continue
    return False


def _decorator_kind(decorator):
    """("skip", reason), ("xfail", None), ("tolerance", {dtype: (rtol, atol)}) or None."""
    if decorator is unittest.expectedFailure:
        return ("xfail", None)
    name = getattr(decorator, "__qualname__", "")
    if name.startswith("skip") and getattr(decorator, "__closure__", None):
        for cell in decorator.__closure__:
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if isinstance(value, str):
                return ("skip", value)
        return ("skip", "skipped")
    overrides = getattr(decorator, "d", None)
    if type(decorator).__name__ == "toleranceOverride" and isinstance(overrides, dict):
        return ("tolerance", {dtype: (value.rtol, value.atol) for dtype, value in overrides.items()})
    if type(decorator).__name__ == "precisionOverride" and isinstance(overrides, dict):
        return ("tolerance", {dtype: (0.0, value) for dtype, value in overrides.items()})
    return None


def database_verdict(op, dtype, phase):
    """What OpInfo itself says about this entry, dtype and phase: (skip reason or None, xfail?)."""
    tests = FORWARD_TESTS if phase == FORWARD else BACKWARD_TESTS
    skip_tests = tests + (FORWARD_SKIP_ONLY_TESTS if phase == FORWARD else ())
    if phase == FORWARD and (_mode(op) != "values" or entry_name(op) in DROPOUT_ENTRIES):
        # torch skips comparing values of random entries and of uninitialized memory; this sweep
        # checks their shapes, dtypes and reproducibility instead.
        tests = skip_tests = ()
    skip_reason, xfail = None, False
    for info in op.decorators:
        if not hasattr(info, "is_active"):
            continue
        for decorator in info.decorators:
            kind = _decorator_kind(decorator)
            if kind is None:
                continue
            if kind[0] == "skip" and skip_reason is None and _active(info, skip_tests, dtype):
                skip_reason = kind[1]
            elif kind[0] == "xfail" and _active(info, tests, dtype):
                xfail = True
    return skip_reason, xfail


def tolerance(op, dtype):
    """(rtol, atol) from the entry's tolerance overrides for this dtype, at least torch's defaults
    for the dtype; None when the entry declares none (then assert_close's defaults apply)."""
    return listed_tolerance(
        op.decorators,
        dtype,
        lambda info: info.cls_name in (None, "TestCommon", "TestBwdGradients") and info.active_if is not False,
    )


def listed_tolerance(infos, dtype, wanted):
    """The widest (rtol, atol) that the DecorateInfos `infos` of an OpInfo or ModuleInfo entry set
    for `dtype` on a CPU or CUDA device, among those `wanted(info)` accepts, and at least torch's
    defaults for the dtype; None where they set none."""
    found = None
    for info in infos:
        if not hasattr(info, "is_active") or info.device_type not in (None, "cpu", "cuda"):
            continue
        if info.dtypes is not None and dtype not in info.dtypes:
            continue
        if not wanted(info):
            continue
        for decorator in info.decorators:
            kind = _decorator_kind(decorator)
            if kind is None or kind[0] != "tolerance" or dtype not in kind[1]:
                continue
            rtol, atol = kind[1][dtype]
            found = (rtol, atol) if found is None else (max(found[0], rtol), max(found[1], atol))
    if found is None:
        return None
    default_rtol, default_atol = _default_tolerance(dtype)
    return (max(found[0], default_rtol), max(found[1], default_atol))


def _default_tolerance(dtype):
    from torch.testing._comparison import default_tolerances

    return default_tolerances(dtype)


# ---------------------------------------------------------------- one sample


class _Outcome:
    """The result of one sample: compared (ok or not), or not counted (torch's reference raised)."""

    __slots__ = ("actual", "broke", "counted", "culprit", "detail", "fallbacks", "kind", "ok", "ops", "precise", "random")

    def __init__(self, counted=True, ok=True, kind="", detail="", random=False):
        self.counted, self.ok, self.kind, self.detail, self.random = counted, ok, kind, detail, random
        self.fallbacks = []
        self.ops = {}
        self.actual = None  # the bridge's result, kept to judge a mismatch against float64
        self.culprit = ""  # the first ATen op that went wrong (see harness.FirstDivergence)
        self.precise = ""  # passed by test_ops' float64 rule after a mismatch: what it measured
        self.broke = False  # captured: the region broke and the sample ran eagerly


def _not_counted():
    return _Outcome(counted=False)


def _seeded(seed, function):
    torch.manual_seed(seed)
    return function()


def _bridge_arguments(sample, keep_grad=False, memo=None):
    memo = {} if memo is None else memo
    moved_input, moved_args, moved_kwargs = harness.to_bridge((sample.input, sample.args, sample.kwargs), memo, keep_grad)
    return moved_input, moved_args, harness.bridge_kwargs(moved_kwargs), memo


def _sample_mode(op, sample, mode):
    """"random" for a sample of a dropout entry that drops (see DROPOUT_ENTRIES), else `mode`."""
    name = entry_name(op)
    if name not in DROPOUT_ENTRIES:
        return mode
    probability = sample.kwargs.get("dropout_p")
    position = DROPOUT_ENTRIES[name]
    if probability is None and position is not None and len(sample.args) > position:
        probability = sample.args[position]
    drops = isinstance(probability, (int, float)) and probability > 0 and sample.kwargs.get("training", True)
    return "random" if drops else mode


def _forward_sample(op, sample, dtype, mode):
    """mode: "values", "random" or "uninitialized"."""
    mode = _sample_mode(op, sample, mode)
    first = _bridge_arguments(sample)
    second = _bridge_arguments(sample) if mode != "values" else None
    try:
        expected = sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs))
    except Exception:  # noqa: BLE001 - torch itself rejects the sample: not ours to compare
        return _not_counted()

    if mode == "values" and _ties_unspecified(op, sample):
        dim = _reduction_dim(op, sample)
        expected = _TieTolerant(expected, sample.input, dim)

    def run(arguments, seed=SEED):
        moved_input, moved_args, moved_kwargs, _ = arguments
        function = harness.patched(op.op)
        with harness.placement((moved_input, moved_args, moved_kwargs)):
            return _seeded(
                seed,
                lambda: harness.to_cpu(sample.output_process_fn_grad(function(moved_input, *moved_args, **moved_kwargs))),
            )

    outcome = _Outcome(random=mode in ("random", "uninitialized"))
    counting = harness.Counting()
    with counting:
        _compare_forward(outcome, run, first, second, expected, op, dtype, mode)
    outcome.fallbacks, outcome.ops = counting.fallbacks, counting.ops
    if outcome.kind == "mismatch" and mode == "values" and not isinstance(expected, _TieTolerant):
        _arbitrate(outcome, expected, lambda: _precise_forward(op, sample))
    if not outcome.ok and outcome.kind in DIAGNOSED:
        _diagnose(outcome, lambda: run(_bridge_arguments(sample)))
    return outcome


def _compare_forward(outcome, run, first, second, expected, op, dtype, mode):
    try:
        actual = outcome.actual = run(first)
        if isinstance(expected, _TieTolerant):
            expected.compare(actual, tolerance(op, dtype))
        elif mode == "values":
            harness.compare(actual, expected, tolerance(op, dtype))
        elif mode == "uninitialized":
            harness.compare_structure(actual, expected)
        elif mode == "random":
            harness.compare_structure(actual, expected)
            try:
                harness.compare_exact(run(second), actual)
            except AssertionError as error:
                outcome.ok, outcome.kind = False, "reproducibility"
                outcome.detail = "not reproducible under torch.manual_seed: " + harness.mismatch_summary(error)
    except harness.SampleTimeout:
        raise
    except harness.NotOnBridge as error:
        outcome.ok, outcome.kind, outcome.detail = False, "device", str(error)
    except AssertionError as error:
        outcome.ok, outcome.kind, outcome.detail = False, harness.classify_mismatch(error), harness.mismatch_summary(error)
    except Exception as error:  # noqa: BLE001 - any error of the bridge is this sample's failure
        outcome.ok, outcome.kind, outcome.detail = False, "error", harness.first_line(error)


# Entries whose index outputs torch documents as unspecified among equal values (sort and argsort
# unless stable=True, topk, kthvalue): the indices must point at the right values, not at the
# ones torch's CPU kernel happens to pick.
TIE_ENTRIES = {"sort": 0, "argsort": 0, "topk": 1, "kthvalue": 1}


def _ties_unspecified(op, sample):
    return (
        op.name in TIE_ENTRIES
        and not op.variant_test_name
        and isinstance(sample.input, torch.Tensor)
        and sample.input.dim() > 0
        and not sample.kwargs.get("stable", False)
    )


def _reduction_dim(op, sample):
    if "dim" in sample.kwargs:
        return sample.kwargs["dim"]
    position = TIE_ENTRIES[op.name]
    if len(sample.args) > position and isinstance(sample.args[position], int) and not isinstance(sample.args[position], bool):
        return sample.args[position]
    return -1


class _TieTolerant:
    """torch's result for an op whose indices may differ among equal values."""

    def __init__(self, expected, source, dim):
        self.expected = expected
        self.source = source.detach().clone()
        self.dim = dim

    def _picked(self, indices):
        if indices.dim() < self.source.dim():
            indices = indices.unsqueeze(self.dim)
        return torch.take_along_dim(self.source, indices, dim=self.dim)

    def compare(self, actual, tolerance):
        if isinstance(self.expected, torch.Tensor):  # argsort: indices only
            self._compare_indices(actual, self.expected, "output 0")
            return
        values, indices = self.expected
        got_values, got_indices = actual
        harness.compare(got_values, values, tolerance)
        self._compare_indices(got_indices, indices, "output 1")

    def _compare_indices(self, got, want, where):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            described = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise AssertionError(f"{where}: indices {described} where torch gives {want.dtype} {tuple(want.shape)}")
        try:
            torch.testing.assert_close(self._picked(got), self._picked(want), rtol=0, atol=0, equal_nan=True)
        except AssertionError as error:
            raise AssertionError(f"{where}: the indices point at other values: " + harness.mismatch_summary(error)) from None


# Gradient samples at special points: every floating input divided by 4 and rounded to an integer
# (OpInfo's inputs lie in [-9, 9], so the values are -2 to 2), which puts many zeros, ties and
# the bounds of clamp-like ops (0, ±1) among them, where torch's subgradient conventions decide
# the gradient. For the entries below: the
# elementwise and reduction families and the activations, norms and distances of torch.nn.
SPECIAL_POINT_ENTRIES = {
    "abs", "clamp", "clamp_min", "clamp_max", "clip", "maximum", "minimum", "fmax", "fmin", "max.binary",
    "min.binary", "norm", "linalg.vector_norm", "linalg.norm", "dist", "where", "amax", "amin",
    "nn.functional.relu", "nn.functional.relu6", "nn.functional.hardtanh", "nn.functional.hardswish",
    "nn.functional.hardsigmoid", "nn.functional.leaky_relu", "nn.functional.elu", "nn.functional.celu",
    "nn.functional.selu", "nn.functional.threshold", "nn.functional.softplus", "nn.functional.prelu",
    "nn.functional.hardshrink", "nn.functional.softshrink", "nn.functional.embedding",
    "nn.functional.normalize", "nn.functional.pdist", "nn.functional.pairwise_distance", "cdist",
    "nn.functional.silu", "nn.functional.mish", "nn.functional.gelu", "nn.functional.logsigmoid",
}


# Entries whose captured gradient phase is not run, with why: listed, shown in the report as
# expected failures, never silently dropped.
CAPTURED_NOT_RUN = {
    "sgn": (
        "comparing its captured gradient (zeros, as torch's) with torch's crashed the sweep process "
        "(SIGSEGV inside torch.isclose on the two CPU tensors, under the sweep's dispatch mode); eager "
        "mode's gradient of sgn is itself a listed failure (a plain CPU tensor comes back); not yet understood"
    ),
}


def _special_points(op, sample):
    """The sample with its floating inputs rounded to integers, or None where the entry has no
    special points to test."""
    if entry_name(op) not in SPECIAL_POINT_ENTRIES:
        return None

    def rounded(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return (value.detach() / 4).round().requires_grad_(value.requires_grad)
        return value

    moved = pytree.tree_map(rounded, (sample.input, sample.args, sample.kwargs))
    return sample.__class__(moved[0], args=moved[1], kwargs=moved[2], output_process_fn_grad=sample.output_process_fn_grad)


def _gradient_samples(op, samples):
    """The database's samples, each followed by its special-point variant where it has one."""
    for sample in samples:
        yield sample
        special = _special_points(op, sample)
        if special is not None:
            yield special


def _differentiable_positions(leaves):
    return [
        position
        for position, leaf in enumerate(leaves)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and (leaf.is_floating_point() or leaf.is_complex())
    ]


def _backward_sample(op, sample, dtype, mode, captured=False):
    """Backward a fixed random cotangent through the differentiable outputs; compare input grads.
    captured: the op runs inside a captured region (torch.compile under the bridge), so the
    gradient is the region program's."""
    mode = _sample_mode(op, sample, mode)
    leaves, seen = [], set()
    for value in pytree.tree_leaves((sample.input, sample.args, sample.kwargs)):
        if isinstance(value, torch.Tensor) and value.requires_grad and id(value) not in seen:
            seen.add(id(value))
            leaves.append(value)
    if not leaves:
        return _not_counted()

    def function(*args, **kwargs):
        return op.gradcheck_wrapper(op.op, *args, **kwargs)

    def bridge_function(*args, **kwargs):
        return op.gradcheck_wrapper(harness.patched(op.op), *args, **kwargs)

    if captured:
        bridge_function = harness.captured(bridge_function)
    first = _bridge_arguments(sample, keep_grad=True)
    second = _bridge_arguments(sample, keep_grad=True) if mode != "values" else None
    try:
        outputs = pytree.tree_leaves(sample.output_process_fn_grad(function(sample.input, *sample.args, **sample.kwargs)))
        positions = _differentiable_positions(outputs)
        if not positions:
            return _not_counted()
        generator = torch.Generator().manual_seed(SEED)
        cotangents = [torch.randn(outputs[p].shape, dtype=outputs[p].dtype, generator=generator) for p in positions]
        expected = torch.autograd.grad([outputs[p] for p in positions], leaves, cotangents, allow_unused=True)
        expected = [torch.zeros_like(leaf) if grad is None else grad for grad, leaf in zip(expected, leaves)]
    except Exception:  # noqa: BLE001 - torch itself cannot differentiate this sample
        return _not_counted()

    def run(arguments, seed=SEED):
        moved_input, moved_args, moved_kwargs, memo = arguments
        torch.manual_seed(seed)
        bridge_leaves = [memo[id(leaf)] for leaf in leaves]
        moved_outputs = pytree.tree_leaves(
            sample.output_process_fn_grad(bridge_function(moved_input, *moved_args, **moved_kwargs))
        )
        if len(moved_outputs) != len(outputs):
            raise AssertionError(f"{len(moved_outputs)} outputs where torch gives {len(outputs)}")
        chosen = []
        for position in positions:
            value = moved_outputs[position]
            if not isinstance(value, torch.Tensor) or not value.requires_grad:
                raise _GraphLost(f"output {position} does not require grad on the bridge (the autograd graph was lost)")
            chosen.append(value)
        bridge_cotangents = [cotangent.to(harness.BRIDGE_DEVICE) for cotangent in cotangents]
        grads = torch.autograd.grad(chosen, bridge_leaves, bridge_cotangents, allow_unused=True)
        return [
            torch.zeros_like(leaf) if grad is None else harness.to_cpu(grad) for grad, leaf in zip(grads, leaves)
        ]

    outcome = _Outcome(random=mode in ("random", "uninitialized"))
    counting = harness.Counting()
    breaks = harness.graph_breaks()
    with counting:
        _compare_backward(outcome, run, first, second, expected, op, dtype, mode)
    outcome.broke = captured and harness.graph_breaks() > breaks
    outcome.fallbacks, outcome.ops = counting.fallbacks, counting.ops
    if outcome.kind == "mismatch" and mode == "values":
        _arbitrate(outcome, expected, lambda: _precise_backward(function, sample, leaves, positions, cotangents))
    if not outcome.ok and outcome.kind in DIAGNOSED:
        _diagnose(outcome, lambda: run(_bridge_arguments(sample, keep_grad=True)))
    return outcome


def _compare_backward(outcome, run, first, second, expected, op, dtype, mode):
    try:
        actual = outcome.actual = run(first)
        if mode == "values":
            harness.compare(actual, expected, tolerance(op, dtype))
        elif mode in ("random", "uninitialized"):
            harness.compare_structure(actual, expected)
            if mode == "random":
                try:
                    harness.compare_exact(run(second), actual)
                except AssertionError as error:
                    outcome.ok, outcome.kind = False, "reproducibility"
                    outcome.detail = "gradients not reproducible under torch.manual_seed: " + harness.mismatch_summary(error)
    except harness.SampleTimeout:
        raise
    except _GraphLost as error:
        outcome.ok, outcome.kind, outcome.detail = False, "graph", str(error)
    except harness.NotOnBridge as error:
        outcome.ok, outcome.kind, outcome.detail = False, "device", str(error)
    except AssertionError as error:
        outcome.ok, outcome.kind, outcome.detail = False, harness.classify_mismatch(error), harness.mismatch_summary(error)
    except Exception as error:  # noqa: BLE001
        outcome.ok, outcome.kind, outcome.detail = False, "error", harness.first_line(error)


class _GraphLost(AssertionError):
    pass


# ---------------------------------------------------------------- judging a mismatch against float64


def _widened(tree):
    """The sample's floating tensors in float64 (complex in complex128), with their grad flags."""
    memo = {}

    def widen(value):
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in memo:
            wide = value.detach()
            if wide.is_floating_point():
                wide = wide.to(torch.float64)
            elif wide.is_complex():
                wide = wide.to(torch.complex128)
            memo[id(value)] = wide.requires_grad_(value.requires_grad and (wide.is_floating_point() or wide.is_complex()))
        return memo[id(value)]

    return pytree.tree_map(widen, tree), memo


def _precise_forward(op, sample):
    (wide_input, wide_args, wide_kwargs), _ = _widened((sample.input, sample.args, sample.kwargs))
    return sample.output_process_fn_grad(op(wide_input, *wide_args, **wide_kwargs))


def _precise_backward(function, sample, leaves, positions, cotangents):
    (wide_input, wide_args, wide_kwargs), memo = _widened((sample.input, sample.args, sample.kwargs))
    outputs = pytree.tree_leaves(sample.output_process_fn_grad(function(wide_input, *wide_args, **wide_kwargs)))
    chosen = [outputs[position] for position in positions]
    wide_cotangents = [cotangent.to(output.dtype) for cotangent, output in zip(cotangents, chosen)]
    grads = torch.autograd.grad(chosen, [memo[id(leaf)] for leaf in leaves], wide_cotangents, allow_unused=True)
    return [torch.zeros_like(memo[id(leaf)]) if grad is None else grad for grad, leaf in zip(grads, leaves)]


# Failures worth a second run that names the first ATen op to go wrong.
DIAGNOSED = ("mismatch", "shape", "dtype", "error", "device")


def _diagnose(outcome, rerun):
    divergence = harness.FirstDivergence()
    try:
        with divergence:
            rerun()
    except harness.SampleTimeout:
        raise
    except Exception:  # noqa: BLE001 - the failure itself, seen again
        pass
    if divergence.found:
        outcome.culprit = divergence.found
        outcome.detail = f"{outcome.detail} | first op to go wrong: {divergence.found}"


def _arbitrate(outcome, expected, precise):
    """Tell rounding from error (see harness.judge_against_float64)."""
    try:
        truth = precise()
    except Exception:  # noqa: BLE001 - no float64 version of this op or sample
        return
    verdict = harness.judge_against_float64(outcome.actual, expected, truth)
    if verdict is None:
        return
    kind, note = verdict
    if kind == "precise":
        outcome.ok, outcome.kind, outcome.precise = True, "", f"{note}; it differed from torch's: {outcome.detail}"
    else:
        outcome.kind = kind
        outcome.detail = f"{outcome.detail} | {note}"


# ---------------------------------------------------------------- one entry


def _mode(op):
    name = entry_name(op)
    if name in UNINITIALIZED_ENTRIES:
        return "uninitialized"
    if name in RANDOM_ENTRIES or op.name in RANDOM_ENTRIES:
        return "random"
    return "values"


def _run_phase(op, dtype, phase, quick, deadline, ops_seen):
    name = entry_name(op)
    mode = _mode(op)
    record = Record("opinfo", name, dtype_name(dtype), phase, harness.PASS, random=mode in ("random", "uninitialized"))
    started = time.perf_counter()
    skip_reason, database_xfail = database_verdict(op, dtype, phase)
    if skip_reason is not None:
        record.status, record.detail = harness.OPINFO_SKIP, skip_reason
        return record
    listed = expected_failures.lookup(expected_failures.OPINFO, name, dtype, phase, quick)
    if phase == BACKWARD_CAPTURED and name in CAPTURED_NOT_RUN:
        record.status, record.detail = harness.EXPECTED_FAILURE, "not run: " + CAPTURED_NOT_RUN[name]
        return record
    if deadline.passed():
        record.status, record.detail = harness.TIMEOUT, "the entry's time budget was spent before this dtype ran"
        return record
    failure = None
    kinds = set()
    fallbacks = set()
    attempts = 0
    torch.manual_seed(0)  # the same samples run to run, whatever ran before
    try:
        with harness.time_limit(deadline.left()) as limit:
            samples = op.sample_inputs("cpu", dtype, requires_grad=(phase != FORWARD))
            if phase != FORWARD:
                samples = _gradient_samples(op, samples)
            for sample in samples:
                attempts += 1
                if phase == FORWARD:
                    outcome = _forward_sample(op, sample, dtype, mode)
                else:
                    outcome = _backward_sample(op, sample, dtype, mode, captured=(phase == BACKWARD_CAPTURED))
                deadline.sample_done(limit)
                if outcome.counted:
                    record.samples += 1
                    record.graph_breaks += int(outcome.broke)
                    record.random = record.random or outcome.random
                    fallbacks.update(outcome.fallbacks)
                    harness.merge_ops(ops_seen, outcome.ops)
                    if outcome.ok:
                        record.passed += 1
                        harness.count_precise(record, outcome.precise)
                    else:
                        kinds.add(outcome.kind)
                        if failure is None:
                            failure = outcome
                # Quick: the first sample that runs (and its special-point variant).
                if quick and (record.samples >= (1 if phase == FORWARD or _special_points(op, sample) is None else 2) or attempts >= QUICK_ATTEMPTS):
                    break
    except harness.SampleTimeout:
        record.status = harness.TIMEOUT
        record.detail = f"ran past the entry's time budget after {record.samples} samples"
    except Exception as error:  # noqa: BLE001 - the database's sample generator itself failed
        if record.samples == 0:
            record.status, record.detail = harness.NO_SAMPLES, "sample generation failed: " + harness.first_line(error)
    record.cpu_fallback = sorted(fallbacks)
    record.seconds = round(time.perf_counter() - started, 3)
    if record.status == harness.TIMEOUT:
        return record
    if record.samples == 0:
        if record.status != harness.NO_SAMPLES:
            record.status, record.detail = harness.NO_SAMPLES, "no sample that torch itself runs"
        return record
    if failure is not None:
        record.kind = failure.kind
        record.detail = failure.detail
        if listed is not None and listed.covers(kinds):
            record.status = harness.EXPECTED_FAILURE
            record.detail = f"{listed.reason} (observed: {failure.detail})"
        elif database_xfail:
            record.status = harness.OPINFO_EXPECTED_FAILURE
        else:
            record.status = harness.FAIL
    elif listed is not None:
        record.status, record.detail = harness.UNEXPECTED_PASS, f"listed as failing: {listed.reason}"
    return record


def planned_records(op, dtypes=DTYPES, quick=False):
    """[entry, dtype, phase] of the records run_entry makes for this entry."""
    name = entry_name(op)
    supported = op.supported_dtypes("cpu")
    planned = [[name, dtype_name(dtype), FORWARD] for dtype in dtypes if dtype in supported]
    if op.supports_autograd:
        backward_supported = op.supported_backward_dtypes("cpu")
        planned += [
            [name, dtype_name(dtype), phase]
            for phase in GRADIENT_PHASES
            for dtype in _gradient_dtypes(phase, quick)
            if dtype in backward_supported and dtype in dtypes
        ]
    return planned


def run_entry(op, quick=False, budget=None, dtypes=DTYPES):
    """Records of one OpInfo entry (forward per supported dtype, backward in float32/float64),
    and the ATen ops it dispatched ({op: rung}) per phase."""
    budget = budget if budget is not None else (QUICK_BUDGET if quick else FULL_BUDGET)
    deadline = harness.Deadline(budget, per_sample=0.0 if quick else FULL_SECONDS_PER_SAMPLE)
    records = []
    ops = {FORWARD: {}, BACKWARD: {}}
    supported = op.supported_dtypes("cpu")
    for dtype in dtypes:
        if dtype in supported:
            records.append(_run_phase(op, dtype, FORWARD, quick, deadline, ops[FORWARD]))
            harness.alive()
            harness.release_compiled_programs()
    if op.supports_autograd:
        backward_supported = op.supported_backward_dtypes("cpu")
        for phase in GRADIENT_PHASES:
            for dtype in _gradient_dtypes(phase, quick):
                if dtype in backward_supported and dtype in dtypes:
                    records.append(_run_phase(op, dtype, phase, quick, deadline, ops[BACKWARD]))
                    harness.alive()
                    harness.release_compiled_programs()
    return records, ops


def sweep(only=None, quick=False, progress=None, budget=None, starting=None, planned=None, exact=None):
    """Run every selected entry. Returns (records, ops by entry, seconds, entries over budget)."""
    database = select(load_database(), only, exact)
    return harness.run_sweep(database, entry_name, run_entry, quick, progress, budget, starting, planned)


def display_name(op):
    return entry_name(op)


if __name__ == "__main__":
    import sys

    sys.exit(harness.sweep_main(sys.modules[__name__]))
