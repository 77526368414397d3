"""`import bridge.auto`: activate the bridge with defaults at import time.

Environment variables override the defaults: BRIDGE_DEVICE (auto|cpu|gpu|tpu),
BRIDGE_MODE (captured|eager), BRIDGE_STRICT=1, BRIDGE_REPORT=path.json, BRIDGE_QUIET=1 (no exit summary).
"""

import atexit
import os

from bridge import _layers

_layers.check_not_shadowed("import bridge.auto")

import bridge  # noqa: E402
from bridge import report  # noqa: E402


def _flag(name):
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


if not bridge.is_active():
    _problem = os.environ.get("BRIDGE_REPORT") and report.unwritable(os.environ["BRIDGE_REPORT"])
    if _problem:
        raise bridge.ActivationError(f"BRIDGE_REPORT={os.environ['BRIDGE_REPORT']}: {_problem}")
    bridge.activate(device=os.environ.get("BRIDGE_DEVICE", "auto"), strict=_flag("BRIDGE_STRICT"))
    atexit.register(report.finish, os.environ.get("BRIDGE_REPORT") or None, _flag("BRIDGE_QUIET"))
