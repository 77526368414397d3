"""Patches of torch's Python API that the dispatcher cannot see.

Each module here patches one torch surface and exposes `PATCHES`, a list of
`Patch` objects; activation applies the modules in `SURFACES` in order and
deactivation undoes them in reverse, restoring every attribute exactly.

A patched function that TorchScript knows as a builtin (`torch.zeros` is
`aten::zeros` to it) is registered as that builtin for as long as it is in
place, so that `torch.jit.script` and what torch scripts itself (forward-mode
AD's decompositions) compile calls to it as before.
"""

import inspect
import sys

import torch.jit._builtins
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
        self.registered = None  # the object registered as a TorchScript builtin while applied

    def apply(self):
        self.saved = vars(self.owner).get(self.name, _MISSING)
        builtin = _torchscript_builtin(self.saved)
        if self.replacement is not None:
            setattr(self.owner, self.name, self.replacement)
        else:
            wrapt.wrap_function_wrapper(self.owner, self.name, self.wrapper)
        if builtin is not None:
            self.registered = getattr(self.owner, self.name)
            torch.jit._builtins._register_builtin(self.registered, builtin)

    def undo(self):
        if self.registered is not None:
            torch.jit._builtins._get_builtin_table().pop(id(self.registered), None)
            self.registered = None
        if self.saved is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.saved)
        self.saved = _MISSING

    def __repr__(self):
        owner = getattr(self.owner, "__name__", repr(self.owner))
        return f"Patch({owner}.{self.name})"


def _torchscript_builtin(function):
    """The name TorchScript compiles calls of `function` to ('aten::zeros'), or None."""
    if function is _MISSING:
        return None
    return torch.jit._builtins._find_builtin(function)


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


_signatures: dict = {}  # function -> inspect.Signature (about 0.1 ms to find: once per function)


def bound_arguments(wrapped, args, kwargs):
    """A wrapped call's arguments by name, defaults filled in (a bound method's without its
    instance); TypeError where they do not fit the signature. Signatures are kept per function,
    not per bound method, which would keep each instance alive."""
    function = getattr(wrapped, "__func__", wrapped)
    signature = _signatures.get(function)
    if signature is None:
        signature = _signatures[function] = inspect.signature(function)
    if function is not wrapped:
        args = (None, *args)  # the instance's place
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


class WhenImported:
    """A Patch of another library's attribute (`owner` a dotted path inside `module`, "" for the
    module itself), applied
    while the bridge is active: at activation if the module is imported already, else when the
    script imports it (wrapt's post-import hook). The hook is registered once per object and
    stays, doing nothing while the bridge is inactive."""

    def __init__(self, module, owner, name, wrapper):
        self.module, self.owner, self.name, self.wrapper = module, owner, name, wrapper
        self.wanted, self.applied, self.hooked = False, None, False

    def apply(self):
        self.wanted = True
        if not self.hooked:
            self.hooked = True
            wrapt.register_post_import_hook(self._imported, self.module)  # runs now if imported
        elif self.module in sys.modules:
            self._imported(sys.modules[self.module])

    def _imported(self, module):
        if not self.wanted or self.applied is not None:
            return
        owner = module
        for part in self.owner.split(".") if self.owner else ():
            owner = getattr(owner, part, None)
        if owner is None or self.name not in vars(owner):
            return  # another version of the library: nothing to patch
        self.applied = Patch(owner, self.name, wrapper=self.wrapper)
        self.applied.apply()

    def undo(self):
        self.wanted = False
        if self.applied is not None:
            self.applied.undo()
            self.applied = None

    def __repr__(self):
        return f"WhenImported({self.module}.{self.owner}.{self.name})"
