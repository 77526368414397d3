"""Known failures of the parity sweeps, each listed next to its op with the reason it fails.

A listed failure is still run and still shown in the coverage report (STYLE.md: listed, never
dropped); when it starts passing the sweep reports it as an unexpected pass, so the list is kept
true. Only failures whose cause was looked at belong here.
"""

import dataclasses

import torch

FORWARD = ("forward",)
BACKWARD = ("backward",)
BOTH = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class ExpectedFailure:
    reason: str
    dtypes: tuple = None  # None: every dtype
    phases: tuple = BOTH
    # False where only samples after the first fail, so that the quick sweep (one sample per
    # entry and dtype) passes and must not call it an unexpected pass.
    quick: bool = True
    # The kinds of failure this covers ("rounding", "mismatch", "error", ... as the sweep
    # classifies them); None: any. A failure of another kind is a new failure.
    kinds: tuple = None

    def covers(self, kinds):
        return self.kinds is None or set(kinds) <= set(self.kinds)

    def applies(self, dtype, phase, quick):
        if self.dtypes is not None and dtype not in self.dtypes:
            return False
        if phase not in self.phases:
            return False
        return self.quick or not quick


# OpInfo entries ("name" or "name.variant_test_name") -> their expected failures.
OPINFO = {}

# ModuleInfo entries ("nn.Linear") -> their expected failures; phases are "train" / "eval".
MODULEINFO = {}


def lookup(table, entry, dtype, phase, quick=False):
    """The listed expected failure of an entry for a dtype and phase, or None."""
    for expected in table.get(entry, ()):
        if expected.applies(dtype, phase, quick):
            return expected
    return None


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


__all__ = ["ExpectedFailure", "OPINFO", "MODULEINFO", "lookup", "torch"]
