"""`python -m bridge doctor`: what is installed, what JAX runs on, and what to install when it does not fit."""

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile

OPTIONAL = ("transformers", "safetensors", "onnx", "jax-cuda12-plugin", "jax-cuda13-plugin", "libtpu")


def _installed(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_driver():
    """(GPU names, driver major version) from nvidia-smi, or None where there is no NVIDIA GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [row.split(",") for row in listed.stdout.strip().splitlines() if "," in row]
    if listed.returncode != 0 or not rows:
        return None
    names = sorted({name.strip() for name, _ in rows})
    return names, int(rows[0][1].strip().split(".")[0])


def _cache_folder():
    folder = os.environ.get("BRIDGE_CACHE_DIR")
    if folder == "0":
        return None, "off (BRIDGE_CACHE_DIR=0)"
    if folder is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "bridge", "xla")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as error:
        return folder, f"not writable ({error.strerror}): programs will compile anew in every run"
    return folder, "writable"


def report():
    """The lines `bridge doctor` prints, and the advice (a list of sentences; empty when all fits)."""
    import bridge
    from bridge.runtime import versions

    lines = [
        f"bridge       {bridge.__version__} ({os.path.dirname(os.path.abspath(bridge.__file__))})",
        f"python       {platform.python_version()} ({sys.executable})",
        f"torch        {_installed('torch') or 'not installed'}",
        f"jax          {_installed('jax') or 'not installed'}, jaxlib {_installed('jaxlib') or 'not installed'}",
    ]
    advice = [f"Installed {problem}." for problem in versions.unsupported()]
    for name in OPTIONAL:
        found = _installed(name)
        if found:
            lines.append(f"{name:<12} {found}")
    gpus = _nvidia_driver()
    lines.append("NVIDIA GPUs  " + (f"{', '.join(gpus[0])} (driver {gpus[1]})" if gpus else "none found"))

    import jax

    try:
        backend = jax.default_backend()
        devices = jax.devices()
        lines.append(f"JAX backend  {backend}: {len(devices)} device(s), {', '.join(str(d) for d in devices[:8])}")
    except RuntimeError as error:
        backend = None
        lines.append(f"JAX backend  failed to start: {str(error).splitlines()[0]}")
        advice.append("JAX could not start its backend: see the line above; JAX_PLATFORMS=cpu runs on the CPU.")
    if gpus and backend == "cpu":
        extra = "cuda13" if gpus[1] >= 580 else "cuda12"
        advice.append(
            f"This machine has an NVIDIA GPU but JAX runs on the CPU: install JAX's CUDA build with "
            f"pip install 'bridge[{extra}]' (driver {gpus[1]}: CUDA {extra[4:]}), keeping the JAX version "
            f"the bridge supports."
        )
    folder, state = _cache_folder()
    lines.append(f"XLA cache    {folder + ': ' if folder else ''}{state}")
    if state.startswith("not writable"):
        advice.append("Set BRIDGE_CACHE_DIR to a writable folder to keep compiled programs between runs.")
    return lines, advice


def main():
    lines, advice = report()
    print("\n".join(lines))
    if advice:
        print("\nWhat to do:")
        for sentence in advice:
            print(f"  - {sentence}")
        return 1
    print("\nEverything the bridge needs is in place.")
    return 0
