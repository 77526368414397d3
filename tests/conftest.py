"""Shared fixtures: the bridge activated around a test, and helpers to compare with eager torch."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
