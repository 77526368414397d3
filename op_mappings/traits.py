"""Facts about ops that have no mapping of their own (they decompose, or fall back to the CPU)."""

from bridge.runtime.registry import aten, register_traits

# `bool(t)` of a one-element tensor: its value decides the result.
register_traits(aten.is_nonzero.default, meta="data-dependent")
# pack_padded_sequence's batch_sizes stay on the host in torch, whatever the input's device.
register_traits(aten._pack_padded_sequence.default, host_outputs=(1,))
# In-place and copy ops the runtime derives take host tensors as torch's do beside CUDA tensors:
# indices, and the source of a copy.
register_traits(
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten.copy_.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
    aten.set_.source_Tensor,
    host_tensors=True,
)
# log_ndtr's derivative in the far tail: its decomposition differentiated by JAX's rules gives
# NaN where torch's formula is finite.
register_traits(aten.special_log_ndtr, gradient="torch")
