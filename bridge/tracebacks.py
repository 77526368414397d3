"""What a script's user sees of an exception: their frames and torch's message.

An error in a model under the bridge passes through the bridge's own frames (the region that
captures a module, the dispatch of each op, torch's meta kernels that check arguments). Torch
eager shows the script's frames and torch's Python frames down to the call that failed; the
same is shown here: every frame of the bridge is dropped, and so is everything below the point
where a torch call entered the bridge's dispatch. `BRIDGE_DEBUG=1` keeps every frame.

An error the bridge itself raises by mistake (one whose innermost frame is in the bridge, JAX or
NumPy, and that is not one of the bridge's own error classes) keeps every frame: it is a bug to
report, with the frames that show it.
"""

import os
import sys
import types

import bridge
from bridge import compat, op_mappings, runtime
from bridge.runtime import capture
from bridge.runtime.errors import BridgeError

_BRIDGE_DIRS = tuple(os.path.dirname(package.__file__) + os.sep for package in (bridge, runtime, op_mappings, compat))
# Where a torch call enters the bridge: the tensor type's dispatch and everything it runs. The
# capture of regions is not: the script's own forward runs inside it.
_DISPATCH_DIRS = tuple(os.path.dirname(package.__file__) + os.sep for package in (runtime, op_mappings))
_REGION_FILE = capture.__file__
_ENGINE_DIRS = tuple(
    os.path.dirname(module.__file__) + os.sep for module in (sys.modules["jax"], sys.modules["numpy"])
) + (os.path.dirname(sys.modules["jax"].__file__) + "lib" + os.sep,)

NOTE = "bridge: the bridge's frames are hidden from this traceback; BRIDGE_DEBUG=1 shows them"


def debugging():
    return os.environ.get("BRIDGE_DEBUG", "").lower() in ("1", "true", "yes", "on")


def _is_bridge(filename):
    return filename.startswith(_BRIDGE_DIRS)


def _enters_dispatch(filename):
    return filename.startswith(_DISPATCH_DIRS) and filename != _REGION_FILE


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _user_frames(error, tb):
    """The frames of `tb` a torch user would see, or None where all of them should stay."""
    frames = list(_frames(tb))
    if not frames:
        return None
    innermost = frames[-1].tb_frame.f_code.co_filename
    if not isinstance(error, BridgeError) and (_is_bridge(innermost) or innermost.startswith(_ENGINE_DIRS)):
        return None
    kept = []
    for frame in frames:
        filename = frame.tb_frame.f_code.co_filename
        if _enters_dispatch(filename):
            break
        if not _is_bridge(filename):
            kept.append(frame)
    if not kept or len(kept) == len(frames):
        return None
    return kept


def without_bridge_frames(error):
    """Give `error` and the exceptions chained to it tracebacks without the bridge's frames;
    returns whether any frame was dropped. (New traceback objects: the old ones stay intact.)"""
    dropped = False
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        kept = _user_frames(error, error.__traceback__)
        if kept is not None:
            rebuilt = None
            for frame in reversed(kept):
                rebuilt = types.TracebackType(rebuilt, frame.tb_frame, frame.tb_lasti, frame.tb_lineno)
            error.__traceback__ = rebuilt
            dropped = True
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return dropped


def excepthook(wrapped, instance, args, kwargs):
    """sys.excepthook while the bridge is active (an uncaught exception of a script that ran
    `import bridge.auto`)."""
    kind, error, tb = args
    if debugging() or error is None:
        return wrapped(*args, **kwargs)
    error.__traceback__ = tb
    dropped = without_bridge_frames(error)
    wrapped(kind, error, error.__traceback__)
    if dropped:
        print(NOTE, file=sys.stderr)
