"""Finding the line of the user's script that made a torch call."""

import os
import sys
import linecache

import torch

_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (
        torch.__file__,
        __file__,
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bridge", "x"),
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "op_mappings", "x"),
    )
)
_SKIP_NAMES = ("<frozen ", "<string>")


def _is_library(filename):
    if filename.startswith(_LIBRARY_DIRS) or filename.startswith(_SKIP_NAMES):
        return True
    return f"{os.sep}site-packages{os.sep}" in filename or f"{os.sep}lib{os.sep}python3" in filename


def user_call_site():
    """'file:line in function: source' of the innermost frame outside torch, JAX and the bridge."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not _is_library(filename):
            source = linecache.getline(filename, frame.f_lineno).strip()
            where = f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
            return f"{where}: {source}" if source else where
        frame = frame.f_back
    return "<no user frame: the call came from library code>"
