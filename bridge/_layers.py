"""Where `bridge.runtime`, `bridge.op_mappings` and `bridge.compat` live when bridge runs from a source checkout.

Installed (wheel or editable), pyproject.toml's package-dir maps the repository's top-level
folders runtime/, op_mappings/ and compat/ to those package names. A checkout used through
PYTHONPATH (as the benchmarks do on machines where nothing is installed) has no such map: this
finder gives it one, for those three names only, so that the only top-level name the bridge
claims is still `bridge`.
"""

import importlib.abc
import importlib.machinery
import os
import sys

LAYERS = ("runtime", "op_mappings", "compat")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CheckoutLayerFinder(importlib.abc.MetaPathFinder):
    """Finds bridge.<layer> in the checkout's <layer>/ folder beside bridge/."""

    names = frozenset(f"bridge.{layer}" for layer in LAYERS)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [_ROOT])


def install():
    """Add the finder when bridge/ sits in a checkout and nothing else maps the layers."""
    inside_package = os.path.join(os.path.dirname(os.path.abspath(__file__)), LAYERS[0])
    beside_package = os.path.join(_ROOT, LAYERS[0], "__init__.py")
    if os.path.isdir(inside_package) or not os.path.exists(beside_package):
        return  # an installed wheel: the layers are real subpackages
    if not any(isinstance(finder, CheckoutLayerFinder) for finder in sys.meta_path):
        # First: an editable install of another checkout must not answer for this one's layers.
        sys.meta_path.insert(0, CheckoutLayerFinder())


def check_not_shadowed(how):
    """Stop with an explanation when `import bridge` found a folder instead of this package.

    A folder named `bridge` with no `__init__.py` in the current directory (a clone of this
    repository, seen from its parent) becomes a namespace package that hides the installed one
    from `python -m bridge` and `import bridge.auto`, whose own modules still load through the
    editable install's finder: `bridge.activate` is then missing.
    """
    package = sys.modules.get("bridge")
    if package is None or getattr(package, "__file__", None):
        return
    ours = os.path.dirname(os.path.abspath(__file__))
    folders = [folder for folder in getattr(package, "__path__", []) if os.path.abspath(folder) != ours]
    shown = ", ".join(folders) or "a folder on sys.path"
    raise SystemExit(
        f"bridge: {how} imported {shown} as the package 'bridge' instead of the bridge in {ours}: "
        "a folder named 'bridge' without an __init__.py (a checkout of the bridge's repository, say) in "
        "the current directory shadows the installed package. Run from another folder, or use the "
        "`bridge` command (`bridge run script.py ...`), which does not look in the current folder."
    )
