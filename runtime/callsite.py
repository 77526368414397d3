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


def user_frame():
    """(filename, line, function) of the innermost frame outside torch, JAX and the bridge, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not _is_library(filename):
            return filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None


def user_call_site():
    """'file:line in function: source' of the user's frame that made the current torch call."""
    found = user_frame()
    if found is None:
        return "<no user frame: the call came from library code>"
    filename, line, function = found
    source = linecache.getline(filename, line).strip()
    where = f"{filename}:{line} in {function}"
    return f"{where}: {source}" if source else where


def warn_at_user_site(message, category):
    """Issue a warning attributed to the user's line (not to the bridge's internals)."""
    import warnings

    found = user_frame()
    if found is None:
        warnings.warn(message, category, stacklevel=3)
    else:
        warnings.warn_explicit(message, category, found[0], found[1])
