"""Recurrent layers that reach the bridge as one op: oneDNN's LSTM layer and its backward.

To torch's C++ core a bridge tensor is a CPU tensor, so `at::lstm` takes its oneDNN path for
float32 (and half) inputs and calls `mkldnn_rnn_layer` once per layer and direction; float64,
GRU and RNN go through torch's per-step cell ops instead. Unmapped, the layer fell back to the
host CPU and broke every captured region holding an nn.LSTM. The layer here is a `lax.scan` over
time (one step traced, whatever the sequence length) and its backward the vjp of that scan.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from bridge.runtime.precision import matmul_precision
from bridge.runtime.registry import aten, register_mapping
from .common import accumulator_dtype

# ideep::rnn_kind, the `mode` argument; torch calls the oneDNN layer for LSTM only.
_LSTM = 2


def _check_mode(mode, batch_sizes):
    if mode != _LSTM:
        raise NotImplementedError(f"mkldnn_rnn_layer: only LSTM (mode {_LSTM}) is mapped, got mode {mode}")
    if batch_sizes:
        raise NotImplementedError("mkldnn_rnn_layer: packed sequences (batch_sizes) are not supported")


def _combined_bias(weight0, weight2, weight3, has_biases, dtype):
    # oneDNN adds the two biases once, before the gates (torch's _shuffle_bias for LSTM).
    if has_biases:
        return weight2.astype(dtype) + weight3.astype(dtype)
    return jnp.zeros((weight0.shape[0],), dtype)


def _lstm_layer(input, weight_ih, weight_hh, bias, hx, cx, reverse):
    """One direction of one layer: input (T, B, I) time-major; returns output (T, B, H), hy, cy."""
    precision = matmul_precision()
    projected = jnp.einsum("tbi,gi->tbg", input, weight_ih, precision=precision) + bias

    def step(carry, projected_t):
        h, c = carry
        gates = projected_t + jnp.einsum("bh,gh->bg", h, weight_hh, precision=precision)
        i, f, g, o = jnp.split(gates, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    (hy, cy), output = lax.scan(step, (hx, cx), projected, reverse=reverse)
    return output, hy, cy


@functools.partial(jax.jit, static_argnames=("reverse", "has_biases"))
def _forward(input, weight0, weight1, weight2, weight3, hx, cx, reverse, has_biases):
    accumulator = accumulator_dtype(input.dtype)
    output, hy, cy = _lstm_layer(
        input.astype(accumulator),
        weight0.astype(accumulator),
        weight1.astype(accumulator),
        _combined_bias(weight0, weight2, weight3, has_biases, accumulator),
        hx.astype(accumulator),
        cx.astype(accumulator),
        reverse,
    )
    return output.astype(input.dtype), hy.astype(hx.dtype), cy.astype(cx.dtype)


# torch's LSTM composite on a CPU build (what a bridge tensor is to C++) runs oneDNN's layer with
# host tensors it makes for the hidden state and packed weights.
@register_mapping(aten.mkldnn_rnn_layer.default, reads=("precision",), host_tensors=True)
def mkldnn_rnn_layer(
    input, weight0, weight1, weight2, weight3, hx_, cx_, reverse, batch_sizes, mode, hidden_size, num_layers,
    has_biases, bidirectional, batch_first, train,
):
    # `input` is time-major here whatever batch_first says: torch's caller transposed it.
    _check_mode(mode, batch_sizes)
    output, hy, cy = _forward(input, weight0, weight1, weight2, weight3, hx_, cx_, bool(reverse), bool(has_biases))
    # The workspace is oneDNN's; the backward below recomputes what it needs.
    return output, hy, cy, jnp.zeros((0,), jnp.uint8)


@functools.partial(jax.jit, static_argnames=("reverse", "has_biases"))
def _backward(input, weight0, weight1, weight2, weight3, hx, cx, grad_output, grad_hy, grad_cy, reverse, has_biases):
    # torch's oneDNN backward computes every gradient in float32 (its meta kernel says so too).
    float32 = jnp.float32

    def forward(input, weight_ih, weight_hh, bias, hx, cx):
        return _lstm_layer(input, weight_ih, weight_hh, bias, hx, cx, reverse)

    primals = (
        input.astype(float32),
        weight0.astype(float32),
        weight1.astype(float32),
        _combined_bias(weight0, weight2, weight3, has_biases, float32),
        hx.astype(float32),
        cx.astype(float32),
    )
    outputs, pullback = jax.vjp(forward, *primals)
    cotangents = tuple(
        jnp.zeros_like(value) if grad is None else grad.astype(float32) for value, grad in zip(outputs, (grad_output, grad_hy, grad_cy))
    )
    d_input, d_weight_ih, d_weight_hh, d_bias, d_hx, d_cx = pullback(cotangents)
    return d_input, d_weight_ih, d_weight_hh, d_bias, d_bias, d_hx, d_cx


@register_mapping(aten.mkldnn_rnn_layer_backward.default, reads=("precision",))
def mkldnn_rnn_layer_backward(
    input, weight1, weight2, weight3, weight4, hx_, cx_tmp, output, hy_, cy_, grad_output, grad_hy, grad_cy,
    reverse, mode, hidden_size, num_layers, has_biases, train, bidirectional, batch_sizes, batch_first, workspace,
):
    # The schema numbers the weights from 1: weight1/weight2 are W_ih/W_hh, weight3/weight4 the biases.
    _check_mode(mode, batch_sizes)
    return _backward(
        input, weight1, weight2, weight3, weight4, hx_, cx_tmp, grad_output, grad_hy, grad_cy, bool(reverse), bool(has_biases)
    )
