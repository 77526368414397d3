"""The fallback ladder read statically: which rung an ATen overload would take (a table entry,
derived from one, decomposed into entries, or eager torch on the host CPU), from the tables and
torch's dispatcher, without running it. The coverage report and `bridge check` use it; dispatch
itself decides by trying (runtime/dispatch.py `_make_plan`)."""

import torch

MAPPED = "mapped"
DERIVED = "mapped (derived)"
DECOMPOSED = "decomposed"
CPU_FALLBACK = "CPU fallback"
UNSUPPORTED = "unsupported"


def _writes(argument):
    return argument.alias_info is not None and argument.alias_info.is_write


def functional_counterpart(op):
    """`aten.add.Tensor` for `aten.add_.Tensor` and `aten.add.out`, else None."""
    schema = op._schema
    base = schema.name.split("::")[-1]
    arguments = schema.arguments
    if base.endswith("_") and arguments and _writes(arguments[0]):
        packet = getattr(torch.ops.aten, base[:-1], None)
        return getattr(packet, op._overloadname, None) if packet is not None else None
    outs = [argument.name for argument in arguments if argument.kwarg_only and _writes(argument)]
    if not outs:
        return None
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    wanted = [argument.name for argument in arguments if argument.name not in outs]
    for name in packet.overloads():
        candidate = getattr(packet, name)
        if any(_writes(argument) for argument in candidate._schema.arguments):
            continue
        if [argument.name for argument in candidate._schema.arguments] == wanted:
            return candidate
    return None


_decomposition_tables = []


def _has_kernel(op, key):
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)
    except RuntimeError:  # an overload TorchScript knows and the dispatcher does not (aten::acos.int)
        return False


def in_dispatcher(op):
    try:
        return torch._C._dispatch_has_kernel(op.name())
    except RuntimeError:
        return False


def has_decomposition(op):
    if not _decomposition_tables:
        from torch import _decomp

        _decomposition_tables.extend([_decomp.core_aten_decompositions(), _decomp.decomposition_table])
    if any(op in table for table in _decomposition_tables):
        return True
    return _has_kernel(op, "CompositeImplicitAutograd")


def has_cpu_kernel(op):
    return any(
        _has_kernel(op, key)
        for key in ("CPU", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional", "CompositeImplicitAutograd")
    )


def aten_status(op, mappings, observed):
    """Status of one ATen overload: the runtime's fallback ladder, read from the tables (and, for
    decompositions, from what the sweeps saw them dispatch to)."""
    if op in mappings:
        return MAPPED
    functional = functional_counterpart(op)
    if functional is not None and functional in mappings:
        return DERIVED
    if has_decomposition(op):
        seen = observed.get(str(op))
        if seen is not None and not seen["clean"]:
            return CPU_FALLBACK  # its decomposition reached ops that ran on the host CPU
        return DECOMPOSED
    if has_cpu_kernel(op):
        return CPU_FALLBACK
    return UNSUPPORTED
