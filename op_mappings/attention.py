"""Scaled dot-product attention: the fused CPU kernel torch dispatches `F.scaled_dot_product_attention` to, and its backward.

With dropout, 3-d inputs or a value head size unlike the query's, torch takes its math path
instead, which decomposes into bmm, `_safe_softmax` and dropout ops mapped elsewhere.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge.op_mappings import flash_attention
from bridge.runtime import config, precision
from bridge.runtime.registry import aten, register_mapping
from .common import LOW_PRECISION, accumulator_dtype


@functools.partial(jax.jit, static_argnames=("is_causal", "scale", "plain"))
def _attention(query, key, value, is_causal, attn_mask, scale, plain=False):
    """(output, logsumexp of the scaled, masked scores); softmax in float32 for half-precision inputs.

    In captured regions on a GPU, `_cudnn_output` replaces the output for half-precision inputs;
    beside it (`plain`), the results come from plain JAX operations with no derivative of our own,
    which XLA drops when nothing uses them (a custom_vjp's backward would run on zero cotangents).
    """
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    query_heads, key_heads = query.shape[-3], key.shape[-3]
    if query_heads != key_heads:
        # Grouped-query attention: each key/value head serves a contiguous group of query heads.
        key = jnp.repeat(key, query_heads // key_heads, axis=-3)
        value = jnp.repeat(value, query_heads // key_heads, axis=-3)
    if _fused_float32(query, key, value, attn_mask):
        return flash_attention.flash_attention(query, key, value, is_causal, scale, precision.matmul_precision())
    if plain:
        out, logsumexp = _full_attention_forward(query, key, value, attn_mask, is_causal, scale, precision.matmul_precision())[0]
        return out.astype(query.dtype), logsumexp
    block = _causal_block(query, key, is_causal, attn_mask)
    if block:
        out, logsumexp = _blocked_causal(query, key, value, scale, block, precision.matmul_precision())
        return out.astype(query.dtype), logsumexp
    out, logsumexp = _full_attention(query, key, value, attn_mask, is_causal, scale, precision.matmul_precision())
    return out.astype(query.dtype), logsumexp


def _fused_float32(query, key, value, attn_mask):
    """Whether float32 attention runs as the Pallas kernel: on an NVIDIA GPU, for the inputs it
    takes (`flash_attention.applies`), unless BRIDGE_FUSED_ATTENTION=0."""
    return (
        config.settings.fused_attention
        and query.dtype == jnp.float32
        and key.dtype == value.dtype == jnp.float32
        and flash_attention.applies(query, key, value, attn_mask)
        and _on_gpu()
    )


def _scores(query, key, attn_mask, is_causal, scale, precision):
    """The scaled, masked score matrix, in the accumulator dtype."""
    accumulator = accumulator_dtype(query.dtype)
    scores = jnp.einsum("...qd,...kd->...qk", query, key, precision=precision, preferred_element_type=accumulator)
    scores = scores * jnp.asarray(scale, dtype=accumulator)
    if is_causal:
        # torch aligns the causal mask to the top-left corner when query and key lengths differ.
        allowed = np.tril(np.ones(scores.shape[-2:], dtype=bool))
        scores = jnp.where(allowed, scores, -jnp.inf)
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            scores = jnp.where(attn_mask, scores, -jnp.inf)
        else:
            scores = scores + attn_mask.astype(accumulator)
    return scores


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _full_attention(query, key, value, attn_mask, is_causal, scale, precision):
    """(output in the accumulator dtype, logsumexp). Its backward is the one torch's fused
    kernels run (probabilities recomputed from the logsumexp, the softmax's row term from the
    output), which rounds as torch's does, where JAX's derivative of the softmax rounds worse."""
    return _full_attention_forward(query, key, value, attn_mask, is_causal, scale, precision)[0]


def _full_attention_forward(query, key, value, attn_mask, is_causal, scale, precision):
    accumulator = accumulator_dtype(query.dtype)
    scores = _scores(query, key, attn_mask, is_causal, scale, precision)
    # Softmax is shift-invariant, so the row maximum needs no gradient; a fully masked row
    # (maximum -inf) yields zeros and a logsumexp of 0, as torch's kernel gives.
    row_max = lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    fully_masked = row_max == -jnp.inf
    row_max = jnp.where(fully_masked, jnp.zeros((), dtype=accumulator), row_max)
    weights = jnp.exp(scores - row_max)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probabilities = weights / jnp.where(total == 0, jnp.ones((), dtype=accumulator), total)
    out = jnp.einsum(
        "...qk,...kd->...qd", probabilities, value.astype(accumulator), precision=precision, preferred_element_type=accumulator
    )
    logsumexp = jnp.where(fully_masked, jnp.zeros((), dtype=accumulator), jnp.log(total) + row_max)[..., 0]
    return (out, logsumexp), (query, key, value, attn_mask, out, logsumexp)


def _row_term(grad_out, out, grad_logsumexp):
    """delta_r = sum_d dO_rd O_rd, the softmax backward's row term; the logsumexp's cotangent
    enters with it (d logsumexp_r / d score_rk = p_rk). grad_out in the accumulator dtype."""
    return jnp.sum(grad_out * out, axis=-1) - grad_logsumexp.astype(grad_out.dtype)


def _probability_grads(probabilities, grad_out, delta, query, key, value, scale, precision):
    """The backward torch's fused kernels run, given the recomputed probabilities of some query
    rows against some keys: (score gradient before the scale, query, key and value gradients),
    in the accumulator dtype."""
    accumulator = grad_out.dtype
    grad_value = jnp.einsum("...qk,...qd->...kd", probabilities, grad_out, precision=precision, preferred_element_type=accumulator)
    grad_probabilities = jnp.einsum(
        "...qd,...kd->...qk", grad_out, value.astype(accumulator), precision=precision, preferred_element_type=accumulator
    )
    grad_masked = probabilities * (grad_probabilities - delta[..., None])
    grad_scores = grad_masked * jnp.asarray(scale, dtype=accumulator)
    grad_query = jnp.einsum(
        "...qk,...kd->...qd", grad_scores, key.astype(accumulator), precision=precision, preferred_element_type=accumulator
    )
    grad_key = jnp.einsum(
        "...qk,...qd->...kd", grad_scores, query.astype(accumulator), precision=precision, preferred_element_type=accumulator
    )
    return grad_masked, grad_query, grad_key, grad_value


def _full_attention_backward(is_causal, scale, precision, residuals, cotangents):
    # As in _blocked_causal_backward: recompute the scores rather than let XLA keep the forward's.
    query, key, value, attn_mask, out, logsumexp = lax.optimization_barrier(residuals)
    grad_out, grad_logsumexp = cotangents
    grad_out = grad_out.astype(accumulator_dtype(query.dtype))
    scores = _scores(query, key, attn_mask, is_causal, scale, precision)
    probabilities = jnp.exp(scores - logsumexp[..., None])  # 0 on masked entries and fully masked rows
    delta = _row_term(grad_out, out, grad_logsumexp)
    grad_masked, grad_query, grad_key, grad_value = _probability_grads(
        probabilities, grad_out, delta, query, key, value, scale, precision
    )
    if attn_mask is None:
        grad_mask = None
    elif attn_mask.dtype == jnp.bool_:
        grad_mask = np.zeros(attn_mask.shape, dtype=jax.dtypes.float0)
    else:
        grad_mask = _sum_to_shape(grad_masked, attn_mask.shape).astype(attn_mask.dtype)
    return grad_query.astype(query.dtype), grad_key.astype(key.dtype), grad_value.astype(value.dtype), grad_mask


def _sum_to_shape(value, shape):
    """Sum a broadcast result back to the shape of the operand that was broadcast."""
    lead = value.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, size in enumerate(shape) if size == 1 and value.shape[lead + i] != 1)
    return jnp.sum(value, axis=axes, keepdims=True).reshape(shape) if axes else value


_full_attention.defvjp(_full_attention_forward, _full_attention_backward)


def _causal_block(query, key, is_causal, attn_mask):
    """The query block size of `_blocked_causal` where it applies (causal, no explicit mask,
    square, at least 512 long and a multiple of the block), else 0.

    Four blocks, the fastest of two, four and eight (benchmarks/results/gpt2_fp32_blocks_*.md):
    more blocks skip more products but run more, smaller matrix products and slices."""
    length = query.shape[-2]
    if not is_causal or attn_mask is not None or key.shape[-2] != length or length < 512:
        return 0
    block = max(128, length // 4)
    return block if length % block == 0 else 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _blocked_causal(query, key, value, scale, block, precision):
    """Causal attention by query blocks: block i attends to keys [0, (i + 1) * block) only, so
    the score blocks above the diagonal, all masked, are never computed (at 4 blocks, 10 of a
    full score matrix's 16 blocks are computed). Each block's rows are whole softmax rows, so the
    result is the full computation's, term by term. The backward recomputes each block's
    probabilities from the saved logsumexp (no score matrix is kept between the passes), as
    torch's fused kernels do. Returns (output in the accumulator dtype, logsumexp)."""
    return _blocked_causal_forward(query, key, value, scale, block, precision)[0]


def _block_probabilities(q, key, start, stop, scale, precision, logsumexp=None):
    accumulator = accumulator_dtype(q.dtype)
    scores = jnp.einsum(
        "...qd,...kd->...qk", q, key[..., :stop, :], precision=precision, preferred_element_type=accumulator
    )
    scores = scores * jnp.asarray(scale, dtype=accumulator)
    # Query row r (absolute start + r) sees keys up to and including itself.
    allowed = np.arange(stop)[None, :] <= (start + np.arange(stop - start))[:, None]
    scores = jnp.where(allowed, scores, -jnp.inf)
    if logsumexp is None:
        row_max = lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
        weights = jnp.exp(scores - row_max)
        total = jnp.sum(weights, axis=-1, keepdims=True)
        return weights / total, (jnp.log(total) + row_max)[..., 0]
    return jnp.exp(scores - logsumexp[..., None]), logsumexp


def _blocked_causal_forward(query, key, value, scale, block, precision):
    accumulator = accumulator_dtype(query.dtype)
    outs, logsumexps = [], []
    for start in range(0, query.shape[-2], block):
        stop = start + block
        probabilities, logsumexp = _block_probabilities(query[..., start:stop, :], key, start, stop, scale, precision)
        outs.append(
            jnp.einsum(
                "...qk,...kd->...qd",
                probabilities,
                value[..., :stop, :].astype(accumulator),
                precision=precision,
                preferred_element_type=accumulator,
            )
        )
        logsumexps.append(logsumexp)
    out = jnp.concatenate(outs, axis=-2)
    logsumexp = jnp.concatenate(logsumexps, axis=-1)
    return (out, logsumexp), (query, key, value, out, logsumexp)


def _blocked_causal_backward(scale, block, precision, residuals, cotangents):
    # The barrier keeps XLA from merging this pass's recomputed score blocks (and its slices
    # of the query, key and value) with the forward's identical ones: merged, every layer's
    # score blocks stayed alive from the forward to its backward, as saved probabilities would.
    # Recomputing the scores, as torch's kernel does, costs a little time for peak memory under
    # torch eager's (benchmarks/results/h100_session_2026-11-23_night.md).
    query, key, value, out, logsumexp = lax.optimization_barrier(residuals)
    grad_out, grad_logsumexp = cotangents
    accumulator = accumulator_dtype(query.dtype)
    grad_out = grad_out.astype(accumulator)
    delta = _row_term(grad_out, out, grad_logsumexp)
    grad_query = []
    grad_key = jnp.zeros(key.shape, accumulator)
    grad_value = jnp.zeros(value.shape, accumulator)
    for start in range(0, query.shape[-2], block):
        stop = start + block
        q = query[..., start:stop, :]
        probabilities, _ = _block_probabilities(q, key, start, stop, scale, precision, logsumexp[..., start:stop])
        _, block_query, block_key, block_value = _probability_grads(
            probabilities, grad_out[..., start:stop, :], delta[..., start:stop], q, key[..., :stop, :], value[..., :stop, :], scale, precision
        )
        grad_query.append(block_query)
        grad_key = grad_key.at[..., :stop, :].add(block_key)
        grad_value = grad_value.at[..., :stop, :].add(block_value)
    grad_query = jnp.concatenate(grad_query, axis=-2)
    return grad_query.astype(query.dtype), grad_key.astype(key.dtype), grad_value.astype(value.dtype)


_blocked_causal.defvjp(
    lambda query, key, value, scale, block, precision: _blocked_causal_forward(query, key, value, scale, block, precision),
    _blocked_causal_backward,
)


def _check_dropout(dropout_p):
    if dropout_p > 0:
        # torch's own CPU kernel refuses dropout too; F.scaled_dot_product_attention routes
        # dropout to the math path before reaching this op.
        raise NotImplementedError("scaled_dot_product_attention_flash_attention: Currently do not support dropout > 0")


def _on_gpu():
    from bridge.runtime import devices

    return devices.first_device().platform == "gpu"


def _cudnn_output(query, key, value, is_causal, attn_mask, scale):
    """cuDNN's fused attention for the output, where it applies: inside a captured region (whose
    gradient is JAX's vjp, so the logsumexp output goes unused and XLA drops its computation),
    on a GPU, bfloat16/float16, no explicit mask, equal query and key lengths when causal, and
    head sizes cuDNN takes. None where it does not apply."""
    if not (
        config.settings.tracing
        and query.dtype in LOW_PRECISION
        and attn_mask is None
        and query.ndim == 4
        and query.shape[-1] == value.shape[-1]
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 128
        and (not is_causal or query.shape[-2] == key.shape[-2])
        and _on_gpu()
    ):
        return None
    # torch's (batch, heads, length, dim) -> JAX's (batch, length, heads, dim)
    swapped = [jnp.swapaxes(array, 1, 2) for array in (query, key, value)]
    fused = functools.partial(_cudnn_attention, scale=scale, is_causal=is_causal)
    try:
        if config.settings.tracing_for_grad:
            # cuDNN's training kernels take fewer shapes (odd lengths: ViT's 197 tokens), and
            # JAX checks them only when the vjp is traced, after this mapping has returned:
            # trace it here on shapes alone, so that a refusal falls to XLA's attention.
            abstract = [jax.ShapeDtypeStruct(array.shape, array.dtype) for array in swapped]
            jax.eval_shape(lambda *arrays: _pulled_back(fused, arrays), *abstract)
        out = fused(*swapped)
    except Exception:  # noqa: BLE001 - cuDNN refuses this shape or build: XLA's attention below serves
        return None
    return jnp.swapaxes(out, 1, 2)


def _cudnn_attention(query, key, value, scale, is_causal):
    return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=is_causal, implementation="cudnn")


def _pulled_back(function, arrays):
    out, pullback = jax.vjp(function, *arrays)
    return pullback(out)


@register_mapping(aten._scaled_dot_product_flash_attention_for_cpu.default, reads=("precision",))
def scaled_dot_product_flash_attention_for_cpu(
    query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None
):
    _check_dropout(dropout_p)
    fused = _cudnn_output(query, key, value, is_causal, attn_mask, scale)
    # Beside cuDNN's output, the logsumexp output goes unused and XLA drops its computation.
    out, logsumexp = _attention(
        query, key, value, is_causal=is_causal, attn_mask=attn_mask, scale=scale, plain=fused is not None
    )
    return (out if fused is None else fused), logsumexp


@register_mapping(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, reads=("precision",))
def scaled_dot_product_flash_attention_for_cpu_backward(
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    _check_dropout(dropout_p)
    return _attention_backward(grad_out, query, key, value, attn_mask, is_causal=is_causal, scale=scale)


# Compiled as one program: op by op, the vjp would dispatch (and compile) every primitive separately.
@functools.partial(jax.jit, static_argnames=("is_causal", "scale"))
def _attention_backward(grad_out, query, key, value, attn_mask, is_causal, scale):
    # Recomputing the forward under vjp costs one more score matrix but needs no saved softmax.
    def forward(query, key, value):
        return _attention(query, key, value, is_causal, attn_mask, scale)[0]

    _, pullback = jax.vjp(forward, query, key, value)
    return pullback(grad_out.astype(query.dtype))
