"""The ops that torch.distributed's FSDP2 runs on each process's own device (torch.ops.fsdp):
packing gradients into one flat buffer for the reduce-scatter.

torch defines them when torch.distributed.fsdp is imported (0.9 s, not paid at activation), so
this module is imported by bridge/patches/distributed.py once a script that imported FSDP makes
its process group; an FSDP op reached before that runs on the host CPU, with the warning.
"""

import jax
import jax.numpy as jnp
import torch
import torch.distributed.fsdp  # noqa: F401  (defines torch.ops.fsdp)

from bridge.runtime.registry import register_mapping

fsdp = torch.ops.fsdp


def _chunk_cat(tensors, dim, num_chunks, dtype):
    """torch's _chunk_cat: each tensor split into `num_chunks` equal chunks along `dim` (padded
    with zeros to a multiple), chunk i of every tensor side by side in row i."""
    pieces = []
    for tensor in tensors:
        axis = dim % tensor.ndim
        size = tensor.shape[axis]
        padded = -(-size // num_chunks) * num_chunks
        if padded != size:
            widths = [(0, 0)] * tensor.ndim
            widths[axis] = (0, padded - size)
            tensor = jnp.pad(tensor, widths)
        pieces.append(tensor.reshape(tensor.shape[:axis] + (num_chunks, -1)).astype(dtype))
    return jnp.concatenate(pieces, axis=dim % tensors[0].ndim + 1)


@register_mapping(fsdp.chunk_cat.default, mutates=("out",), family="sharding")
def chunk_cat(tensors, dim, num_chunks, *, out):
    return None, {"out": _chunk_cat(tensors, dim, num_chunks, out.dtype).reshape(out.shape)}


@register_mapping(fsdp.all_gather_copy_in.default, family="sharding")
def all_gather_copy_in(all_gather_inputs, all_gather_output, inp_split_sizes, all_gather_input_numel, rank):
    # torch returns this rank's slice of the output as a view of it; FSDP only reads the two,
    # and the all-gather that follows writes the whole output, so fresh arrays serve.
    flat = jnp.concatenate([value.reshape(-1).astype(all_gather_output.dtype) for value in all_gather_inputs])
    start = all_gather_input_numel * rank
    return flat, all_gather_output.at[start:start + all_gather_input_numel].set(flat)


@register_mapping(fsdp.split_with_sizes_copy.default, mutates=("out",), family="sharding")
def split_with_sizes_copy(all_gather_output, all_gather_input_split_sizes, dim=0, *, out):
    pieces, start = [], 0
    for size, target in zip(all_gather_input_split_sizes, out):
        piece = jax.lax.slice_in_dim(all_gather_output, start, start + size, axis=dim)
        pieces.append(piece.reshape(target.shape).astype(target.dtype))
        start += size
    return None, {"out": pieces}
