"""Shared fixtures: the bridge activated around a test, and helpers to compare with eager torch."""

import os
import subprocess
import sys

import pytest

# A mapping that reads what its registration does not declare is an error in the suite
# (runtime/compiled_ops.py _undeclared), so that every op's facts stay on its registration.
os.environ.setdefault("BRIDGE_CHECK_FACTS", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests run on XLA's CPU (CI) or, with JAX_PLATFORMS=cuda, on a GPU (benchmarks/gpu_check.sh).
ON_GPU = os.environ.get("JAX_PLATFORMS", "").split(",")[0] in ("cuda", "gpu", "rocm")

# Most of the suite's time is XLA compiling small CPU programs (the OpInfo and ModuleInfo sweeps
# compile about a thousand per 50 entries, 28 ms each). LLVM's optimization level 0 compiles them
# about 20% faster. It can change a last bit: at the default level LLVM contracts a multiply and
# an add into one FMA, as torch's CPU kernels do (`torch.add(x, y, alpha=3.75)`), where level 0
# rounds twice (30 other ops, transcendentals, reductions and a gradient among them, gave
# bit-identical results both ways); the tests compare such results within torch's tolerances.
# Set here, before JAX starts its backends; the sweeps' child processes inherit it. An XLA_FLAGS
# that names the option is kept.
if not ON_GPU and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cpu_exact: compares with torch's CPU kernels to the last bit or ulp, which holds on XLA's "
        "CPU only (GPU GEMMs round bfloat16 and float16 their own way)",
    )
    if ON_GPU:
        # The oracle is still eager torch on the CPU, in full float32: torch's CUDA default lets
        # cuDNN use TF32 for float32 convolutions, and the bridge follows it (runtime.config).
        import torch

        torch.backends.cudnn.allow_tf32 = False


# The longest files first: with `-n 2 --dist loadfile` (the README's command) one worker takes
# the OpInfo sweep at once, the other the rest, instead of the sweep starting last.
_FIRST = ("test_opinfo.py", "test_moduleinfo.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: 0 if item.path.name in _FIRST else 1)  # stable: the order within stays
    if not ON_GPU:
        return
    skip = pytest.mark.skip(reason="cpu_exact: exact agreement with torch's CPU kernels holds on XLA's CPU only")
    for item in items:
        if "cpu_exact" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def bridged():
    """The bridge active for one test (deactivated after, restoring torch)."""
    import bridge

    was_active = bridge.is_active()
    bridge.activate()
    try:
        yield bridge
    finally:
        if not was_active:
            bridge.deactivate()


@pytest.fixture
def captured(bridged):
    """The bridge active in captured mode, with capture's records (compiles, breaks) reset."""
    from bridge.runtime import capture

    previous = bridged.set_mode("captured")
    capture.reset()
    try:
        yield bridged
    finally:
        bridged.set_mode(previous)


@pytest.fixture
def distribution_validation_kept():
    """torch.export can start Dynamo, whose first start turns torch.distributions' argument
    validation off for the whole process (torch 2.13's TorchPatcher); later tests in the same
    process rely on it. The graph routes' test files use it for each test."""
    import torch

    validating = torch.distributions.Distribution._validate_args
    yield
    torch.distributions.Distribution.set_default_validate_args(validating)


def run_python(*args, cwd=None, env=None, timeout=300):
    """Run `python ARGS` in a fresh process; returns the CompletedProcess (text, both streams)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.setdefault("JAX_PLATFORMS", "cpu")
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def loaded_in_plain_torch(bridge, path):
    """torch.load(path) onto the host with the bridge off, as a script without it loads a
    checkpoint; the bridge is on again after."""
    import torch

    bridge.deactivate()
    try:
        return torch.load(path, map_location="cpu")
    finally:
        bridge.activate()
