"""Errors: an uncaught exception shows the script's frames and torch's message, not the
bridge's frames (bridge/tracebacks.py)."""

import sys

from bridge import tracebacks

from . import Patch

PATCHES = [Patch(sys, "excepthook", wrapper=tracebacks.excepthook)]
