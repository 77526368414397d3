"""Facts about ops that have no mapping of their own (they decompose, or fall back to the CPU)."""

from bridge.runtime.registry import aten, register_traits

# `bool(t)` of a one-element tensor: its value decides the result.
register_traits(aten.is_nonzero.default, meta="data-dependent")
# pack_padded_sequence's batch_sizes stay on the host in torch, whatever the input's device.
register_traits(aten._pack_padded_sequence.default, host_outputs=(1,))
