"""Fused attention for float32 on NVIDIA GPUs: a Pallas (Triton) kernel in FlashAttention-2's form.

Neither cuDNN nor XLA fuses float32 attention, and the blocked XLA form in `attention.py` pays for
its score blocks in device memory or in recomputation. This kernel keeps each block of scores
in registers: the forward passes over key blocks with a running softmax and saves the row
logsumexp; the backward recomputes the probabilities from it, once for the key and value
gradients (one program per key block) and once for the query gradient (one per query block),
as torch's memory-efficient kernel does. Causal attention skips the key blocks above the
diagonal and masks only the blocks that cross it.

Matrix products: for torch's default float32 precision, three TF32 tensor-core products each
(see `flash_attention`); for torch's "high", one TF32 product. It runs GPT-2 small's float32
step faster than XLA's blocked form and torch eager (benchmarks/results/gpt2_fp32_kernel_final.md).
Inputs are (batch, heads, length, head size), as torch gives them; `interpret=True` runs the
kernels through Pallas's interpreter on any backend (the tests do, on the CPU).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

# (query rows, key rows) per block, Triton's warps per program and pipeline depth, for the
# forward and for the backward's kernels: chosen by benchmarks/attention_kernel.py on an H100 for
# GPT-2 small's shape (benchmarks/results/attention_kernel_h100*.md).
FORWARD = (64, 64, 4, 2)
BACKWARD = (64, 32, 4, 2)

HEAD_SIZES = (16, 32, 64, 128)


def applies(query, key, value, attn_mask):
    """Whether the kernel takes these inputs: 4-d with the same batch and heads (no
    broadcasting), no explicit mask, equal head sizes of a supported size, and lengths that are
    multiples of the block sizes."""
    block = max(*FORWARD[:2], *BACKWARD[:2])
    return (
        attn_mask is None
        and query.ndim == key.ndim == value.ndim == 4
        and query.shape[:2] == key.shape[:2] == value.shape[:2]
        and query.shape[-1] == key.shape[-1] == value.shape[-1]
        and query.shape[-1] in HEAD_SIZES
        and key.shape[-2] == value.shape[-2]
        and query.shape[-2] % block == 0
        and key.shape[-2] % block == 0
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def flash_attention(query, key, value, causal, scale, precision, interpret=False, blocks=None):
    """(output, logsumexp of the scaled, masked scores), both float32 for float32 inputs.

    Causal attention aligns the mask to the top-left corner (query i sees keys 0..i), as torch
    does. `blocks`: (forward, backward) settings as FORWARD and BACKWARD, None for those.

    On a GPU, full float32 precision (`Precision.HIGHEST`) runs each product as three TF32
    tensor-core products (`DotAlgorithmPreset.TF32_TF32_F32_X3`): Triton's FMA path for float32
    products is many times slower, and the three-pass form is as close to a float64 reference as
    torch's own float32 kernel (benchmarks/results/attention_kernel_h100.md)."""
    return _forward(query, key, value, causal, scale, precision, interpret, blocks)[0]


def _products(precision, interpret):
    """The dot precision the kernels use for the torch precision asked for (see flash_attention)."""
    if precision == lax.Precision.HIGHEST and not interpret:
        return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return precision


def _compiler_params(num_warps, num_stages):
    # Imported when a kernel is built for a GPU (a slow import): the interpreter and CPUs never need it.
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _dot(a, b, trans_a=False, trans_b=False, precision=None):
    """a @ b of 2-d blocks (either transposed first), accumulated in float32."""
    dimensions = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dimensions, precision=precision, preferred_element_type=jnp.float32)


def _causal_mask(first_row, first_col, rows, cols):
    """True where query row first_row + r may see key first_col + c."""
    row = first_row + lax.iota(jnp.int32, rows)
    col = first_col + lax.iota(jnp.int32, cols)
    return col[None, :] <= row[:, None]


def _forward_kernel(query_ref, key_ref, value_ref, out_ref, logsumexp_ref, *, causal, scale, precision, block_key):
    block_query, size = query_ref.shape
    first = pl.program_id(0) * block_query
    query = query_ref[...]

    def step(index, carry, masked):
        row_max, total, acc = carry
        keys = pl.ds(index * block_key, block_key)
        scores = _dot(query, key_ref[keys, :], trans_b=True, precision=precision) * scale
        if masked:
            scores = jnp.where(_causal_mask(first, index * block_key, block_query, block_key), scores, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
        weights = jnp.exp(scores - new_max[:, None])
        correction = jnp.exp(row_max - new_max)
        total = total * correction + jnp.sum(weights, axis=1)
        acc = acc * correction[:, None] + _dot(weights, value_ref[keys, :], precision=precision)
        return new_max, total, acc

    carry = (
        jnp.full((block_query,), -jnp.inf, jnp.float32),
        jnp.zeros((block_query,), jnp.float32),
        jnp.zeros((block_query, size), jnp.float32),
    )
    carry = _over_key_blocks(step, carry, causal, first, block_query, block_key, key_ref.shape[0])
    row_max, total, acc = carry
    out_ref[...] = (acc / total[:, None]).astype(out_ref.dtype)
    logsumexp_ref[...] = row_max + jnp.log(total)


def _over_key_blocks(step, carry, causal, first, block_query, block_key, key_length):
    """Runs step(index, carry, masked) over the key blocks that query rows first..first +
    block_query see. Causal: key blocks wholly at or before the first row need no mask, the
    blocks that cross the diagonal do, and those after the last row are never computed."""
    key_blocks = np.int32(key_length // block_key)  # int32 loop indices, also under 64-bit JAX
    if not causal:
        return lax.fori_loop(np.int32(0), key_blocks, functools.partial(step, masked=False), carry)
    unmasked = jnp.minimum(lax.div(first, np.int32(block_key)), key_blocks)
    crossing = jnp.minimum(lax.div(first + (block_query + block_key - 1), np.int32(block_key)), key_blocks)
    carry = lax.fori_loop(np.int32(0), unmasked, functools.partial(step, masked=False), carry)
    return lax.fori_loop(unmasked, crossing, functools.partial(step, masked=True), carry)


def _forward(query, key, value, causal, scale, precision, interpret, blocks):
    block_query, block_key, num_warps, num_stages = blocks[0] if blocks else FORWARD
    precision = _products(precision, interpret)
    batch, heads, length, size = query.shape
    key_length = key.shape[-2]
    kernel = functools.partial(_forward_kernel, causal=causal, scale=float(scale), precision=precision, block_key=block_key)
    out, logsumexp = pl.pallas_call(
        kernel,
        grid=(length // block_query, batch, heads),
        in_specs=[
            pl.BlockSpec((None, None, block_query, size), lambda i, b, h: (b, h, i, 0)),
            pl.BlockSpec((None, None, key_length, size), lambda i, b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, None, key_length, size), lambda i, b, h: (b, h, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_query, size), lambda i, b, h: (b, h, i, 0)),
            pl.BlockSpec((None, None, block_query), lambda i, b, h: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(query.shape, query.dtype),
            jax.ShapeDtypeStruct((batch, heads, length), jnp.float32),
        ],
        compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="bridge_attention_forward",
    )(query, key, value)
    return (out, logsumexp), (query, key, value, out, logsumexp)


def _key_grads_kernel(
    query_ref, key_ref, value_ref, grad_out_ref, logsumexp_ref, delta_ref, grad_key_ref, grad_value_ref,
    *, causal, scale, precision, block_query,
):
    block_key, size = key_ref.shape
    first_key = pl.program_id(0) * block_key
    key = key_ref[...]
    value = value_ref[...]

    def step(index, carry, masked):
        grad_key, grad_value = carry
        rows = pl.ds(index * block_query, block_query)
        query = query_ref[rows, :]
        grad_out = grad_out_ref[rows, :]
        scores = _dot(query, key, trans_b=True, precision=precision) * scale
        probabilities = jnp.exp(scores - logsumexp_ref[rows][:, None])
        if masked:
            allowed = _causal_mask(index * block_query, first_key, block_query, block_key)
            probabilities = jnp.where(allowed, probabilities, 0.0)
        grad_value = grad_value + _dot(probabilities, grad_out, trans_a=True, precision=precision)
        grad_probabilities = _dot(grad_out, value, trans_b=True, precision=precision)
        grad_scores = probabilities * (grad_probabilities - delta_ref[rows][:, None])
        grad_key = grad_key + _dot(grad_scores, query, trans_a=True, precision=precision)
        return grad_key, grad_value

    carry = (jnp.zeros((block_key, size), jnp.float32), jnp.zeros((block_key, size), jnp.float32))
    query_blocks = np.int32(query_ref.shape[0] // block_query)
    if causal:
        # Query blocks wholly before the key block see none of it; those that overlap its rows
        # see part of it; those wholly after it see all of it.
        first = jnp.minimum(lax.div(first_key, np.int32(block_query)), query_blocks)
        overlapping = jnp.minimum(lax.div(first_key + (block_key + block_query - 1), np.int32(block_query)), query_blocks)
        carry = lax.fori_loop(first, overlapping, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(overlapping, query_blocks, functools.partial(step, masked=False), carry)
    else:
        carry = lax.fori_loop(np.int32(0), query_blocks, functools.partial(step, masked=False), carry)
    grad_key, grad_value = carry
    grad_key_ref[...] = (grad_key * scale).astype(grad_key_ref.dtype)
    grad_value_ref[...] = grad_value.astype(grad_value_ref.dtype)


def _query_grads_kernel(
    query_ref, key_ref, value_ref, grad_out_ref, logsumexp_ref, delta_ref, grad_query_ref,
    *, causal, scale, precision, block_key,
):
    block_query, size = query_ref.shape
    first = pl.program_id(0) * block_query
    query = query_ref[...]
    grad_out = grad_out_ref[...]
    logsumexp = logsumexp_ref[...]
    delta = delta_ref[...]

    def step(index, grad_query, masked):
        keys = pl.ds(index * block_key, block_key)
        key = key_ref[keys, :]
        scores = _dot(query, key, trans_b=True, precision=precision) * scale
        probabilities = jnp.exp(scores - logsumexp[:, None])
        if masked:
            probabilities = jnp.where(_causal_mask(first, index * block_key, block_query, block_key), probabilities, 0.0)
        grad_probabilities = _dot(grad_out, value_ref[keys, :], trans_b=True, precision=precision)
        grad_scores = probabilities * (grad_probabilities - delta[:, None])
        return grad_query + _dot(grad_scores, key, precision=precision)

    grad_query = jnp.zeros((block_query, size), jnp.float32)
    grad_query = _over_key_blocks(step, grad_query, causal, first, block_query, block_key, key_ref.shape[0])
    grad_query_ref[...] = (grad_query * scale).astype(grad_query_ref.dtype)


def _backward(causal, scale, precision, interpret, blocks, residuals, cotangents):
    block_query, block_key, num_warps, num_stages = blocks[1] if blocks else BACKWARD
    precision = _products(precision, interpret)
    query, key, value, out, logsumexp = residuals
    grad_out, grad_logsumexp = cotangents
    batch, heads, length, size = query.shape
    key_length = key.shape[-2]
    grad_out = grad_out.astype(jnp.float32)
    # The softmax backward's row term; the logsumexp's cotangent enters with it
    # (d logsumexp_r / d score_rk = p_rk).
    delta = jnp.sum(grad_out * out.astype(jnp.float32), axis=-1) - grad_logsumexp.astype(jnp.float32)
    params = None if interpret else _compiler_params(num_warps, num_stages)
    scale = float(scale)  # a weak type: the products stay float32
    whole_query = pl.BlockSpec((None, None, length, size), lambda i, b, h: (b, h, 0, 0))
    whole_rows = pl.BlockSpec((None, None, length), lambda i, b, h: (b, h, 0))
    whole_key = pl.BlockSpec((None, None, key_length, size), lambda i, b, h: (b, h, 0, 0))
    key_block = pl.BlockSpec((None, None, block_key, size), lambda i, b, h: (b, h, i, 0))
    query_block = pl.BlockSpec((None, None, block_query, size), lambda i, b, h: (b, h, i, 0))
    row_block = pl.BlockSpec((None, None, block_query), lambda i, b, h: (b, h, i))

    grad_key, grad_value = pl.pallas_call(
        functools.partial(_key_grads_kernel, causal=causal, scale=scale, precision=precision, block_query=block_query),
        grid=(key_length // block_key, batch, heads),
        in_specs=[whole_query, key_block, key_block, whole_query, whole_rows, whole_rows],
        out_specs=[key_block, key_block],
        out_shape=[jax.ShapeDtypeStruct(key.shape, key.dtype), jax.ShapeDtypeStruct(value.shape, value.dtype)],
        compiler_params=params,
        interpret=interpret,
        name="bridge_attention_key_grads",
    )(query, key, value, grad_out, logsumexp, delta)
    grad_query = pl.pallas_call(
        functools.partial(_query_grads_kernel, causal=causal, scale=scale, precision=precision, block_key=block_key),
        grid=(length // block_query, batch, heads),
        in_specs=[query_block, whole_key, whole_key, query_block, row_block, row_block],
        out_specs=query_block,
        out_shape=jax.ShapeDtypeStruct(query.shape, query.dtype),
        compiler_params=params,
        interpret=interpret,
        name="bridge_attention_query_grads",
    )(query, key, value, grad_out, logsumexp, delta)
    return grad_query, grad_key, grad_value


flash_attention.defvjp(_forward, _backward)
