"""The machine and library versions a benchmark's results file records."""

import os
import platform
import subprocess


def versions(*modules):
    """Python, the machine, torch and JAX, the given modules' versions where installed, and the
    GPU with its driver (from nvidia-smi; "none" without one)."""
    found = {"python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count()}
    for name in ("torch", "jax", "jaxlib", *modules):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            pass
    try:
        found["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        found["gpu"] = "none"
    return found
