"""Patches of torch's Python API that the dispatcher cannot see.

Each module here patches one torch surface and exposes `PATCHES`, a list of
`Patch` objects; activation applies the modules in `SURFACES` in order and
deactivation undoes them in reverse, restoring every attribute exactly.
"""

import wrapt

_MISSING = object()


class Patch:
    """One wrapped attribute of a torch module or class, with its undo."""

    def __init__(self, owner, name, wrapper=None, replacement=None):
        self.owner = owner
        self.name = name
        self.wrapper = wrapper  # wrapt-style: wrapper(wrapped, instance, args, kwargs)
        self.replacement = replacement  # or a plain value to put in place
        self.saved = _MISSING

    def apply(self):
        self.saved = vars(self.owner).get(self.name, _MISSING)
        if self.replacement is not None:
            setattr(self.owner, self.name, self.replacement)
        else:
            wrapt.wrap_function_wrapper(self.owner, self.name, self.wrapper)

    def undo(self):
        if self.saved is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.saved)
        self.saved = _MISSING

    def __repr__(self):
        owner = getattr(self.owner, "__name__", repr(self.owner))
        return f"Patch({owner}.{self.name})"


def replace(owner, name):
    """Decorator: the function replaces `owner.name` while the bridge is active."""

    def decorate(function):
        function.__bridge_patch__ = Patch(owner, name, replacement=function)
        return function

    return decorate


def wrap(owner, name):
    """Decorator: the wrapt wrapper wraps `owner.name` while the bridge is active."""

    def decorate(wrapper):
        wrapper.__bridge_patch__ = Patch(owner, name, wrapper=wrapper)
        return wrapper

    return decorate


def collect(namespace):
    """The Patch objects declared with @replace/@wrap in a module's namespace, in order."""
    return [value.__bridge_patch__ for value in list(namespace.values()) if hasattr(value, "__bridge_patch__")]
