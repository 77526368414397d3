"""The machine and library versions a benchmark's results file records, and the file itself."""

import json
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


def write_results(out, name, data, text):
    """<out>/<name>.json (the data) and <out>/<name>.md (the text); the text is printed too."""
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, name)
    with open(base + ".json", "w") as handle:
        json.dump(data, handle, indent=2)
    with open(base + ".md", "w") as handle:
        handle.write(text)
    print(text)
