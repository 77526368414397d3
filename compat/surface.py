"""The public torch surface the coverage report covers: `torch.*` (with torch.linalg, torch.fft,
torch.special), `torch.nn.functional.*` and `Tensor` methods, as torch's override machinery lists them."""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SurfaceItem:
    name: str  # "torch.add", "torch.nn.functional.relu", "Tensor.add_"
    namespace: str  # "torch", "torch.nn.functional", "Tensor"
    short: str  # "add", "relu", "add_"
    function: object


# torch.overrides namespaces -> (report namespace, prefix of the public name).
_NAMESPACES = (
    ("torch", "torch", "torch."),
    ("torch.functional", "torch", "torch."),
    ("torch.linalg", "torch", "torch.linalg."),
    ("torch.fft", "torch", "torch.fft."),
    ("torch.special", "torch", "torch.special."),
    ("torch.nn.functional", "torch.nn.functional", "torch.nn.functional."),
    ("Tensor", "Tensor", "Tensor."),
)


def _key_name(namespace):
    return getattr(namespace, "__name__", None)


def items():
    """Every public surface function, sorted by name; one item per public name."""
    overridable = torch.overrides.get_overridable_functions()
    by_name = {_key_name(namespace): functions for namespace, functions in overridable.items()}
    found = {}
    for key, report_namespace, prefix in _NAMESPACES:
        for function in by_name.get(key, ()):
            short = getattr(function, "__name__", None)
            if not short or short.startswith("_") or not callable(function):
                continue
            name = prefix + short
            if name not in found:
                found[name] = SurfaceItem(name, report_namespace, short, function)
    return [found[name] for name in sorted(found)]


def aten_packet(item):
    """The ATen operator packet of the same name, if there is one (`aten.add` for `torch.add`)."""
    short = item.short
    candidates = [short]
    if item.name.startswith("torch.linalg."):
        candidates.insert(0, "linalg_" + short)
    elif item.name.startswith("torch.fft."):
        candidates.insert(0, "fft_" + short)
    elif item.name.startswith("torch.special."):
        candidates.insert(0, "special_" + short)
    for candidate in candidates:
        packet = getattr(torch.ops.aten, candidate, None)
        if packet is not None and hasattr(packet, "overloads"):
            return packet
    return None
