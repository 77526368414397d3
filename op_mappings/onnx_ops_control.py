"""The ONNX-op table, control family: If, Loop and Scan over subgraphs, sequences, optionals and
random numbers (see onnx_ops.py for how an entry is written).

A subgraph attribute arrives as a callable (runtime/onnx_graph.Subgraph). If takes jax.lax.cond
when its condition is traced; Loop and Scan unroll while tracing (their trip counts are known
then, as XLA needs), so each iteration may see shapes of its own, as ONNX allows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge.runtime.errors import DataDependentShapeError
from bridge.runtime.onnx_graph import is_known, known, known_ints, onnx_dtype, register_onnx_op


@register_onnx_op("If")
def if_(condition, *, then_branch, else_branch):
    if is_known(condition):
        branch = then_branch if bool(np.asarray(condition).reshape(())) else else_branch
        outputs = branch()
    else:
        outputs = lax.cond(jnp.reshape(condition, ()), lambda: [jnp.asarray(value) for value in then_branch()],
                           lambda: [jnp.asarray(value) for value in else_branch()])
    return tuple(outputs)


@register_onnx_op("Loop")
def loop(trip_count=None, condition=None, *carried, body):
    limit = None if trip_count is None else int(known(trip_count, "trip count of Loop").reshape(()))
    keep_going = True if condition is None else condition
    carried = list(carried)
    scans: list = []
    iteration = 0
    while limit is None or iteration < limit:
        if not is_known(keep_going):
            raise DataDependentShapeError("Loop's condition is computed from the graph's inputs; its trip count must be known")
        if not bool(np.asarray(keep_going).reshape(())):
            break
        outputs = body(np.asarray(iteration, np.int64), np.asarray(bool(np.asarray(keep_going).reshape(()))), *carried)
        keep_going = outputs[0]
        carried = list(outputs[1 : 1 + len(carried)])
        scans.append(outputs[1 + len(carried) :])
        iteration += 1
    count = len(body.output_names) - 1 - len(carried)
    stacked = [jnp.stack([jnp.asarray(step[position]) for step in scans]) if scans else jnp.zeros((0,)) for position in range(count)]
    return tuple(carried + stacked)


@register_onnx_op("Scan")
def scan(*inputs, body, num_scan_inputs, scan_input_axes=None, scan_input_directions=None, scan_output_axes=None,
         scan_output_directions=None):
    states = list(inputs[: len(inputs) - num_scan_inputs])
    sequences = inputs[len(states) :]
    input_axes = scan_input_axes or [0] * num_scan_inputs
    input_directions = scan_input_directions or [0] * num_scan_inputs
    sequences = [jnp.moveaxis(value, axis, 0) for value, axis in zip(sequences, input_axes)]
    sequences = [value[::-1] if reverse else value for value, reverse in zip(sequences, input_directions)]
    steps = sequences[0].shape[0]
    collected: list = []
    for step in range(steps):
        outputs = body(*states, *[value[step] for value in sequences])
        states = list(outputs[: len(states)])
        collected.append(outputs[len(states) :])
    count = len(body.output_names) - len(states)
    output_axes = scan_output_axes or [0] * count
    output_directions = scan_output_directions or [0] * count
    results = []
    for position in range(count):
        stacked = jnp.stack([jnp.asarray(step[position]) for step in collected])
        if output_directions[position]:
            stacked = stacked[::-1]
        results.append(jnp.moveaxis(stacked, 0, output_axes[position] % stacked.ndim))
    return tuple(states + results)


# ------------------------------------------------------------------------------- sequences
# A sequence is a Python list of arrays; an empty optional is None.


@register_onnx_op("SequenceConstruct")
def sequence_construct(*inputs):
    return list(inputs)


@register_onnx_op("SequenceEmpty")
def sequence_empty(*, dtype=1):
    return []


@register_onnx_op("SequenceLength")
def sequence_length(sequence):
    return np.asarray(len(sequence), np.int64)


@register_onnx_op("SequenceAt")
def sequence_at(sequence, position):
    return sequence[int(known(position, "position of SequenceAt"))]


@register_onnx_op("SequenceInsert")
def sequence_insert(sequence, tensor, position=None):
    result = list(sequence)
    result.insert(len(result) if position is None else int(known(position, "position")) % (len(result) + 1), tensor)
    return result


@register_onnx_op("SequenceErase")
def sequence_erase(sequence, position=None):
    result = list(sequence)
    del result[-1 if position is None else int(known(position, "position"))]
    return result


@register_onnx_op("ConcatFromSequence")
def concat_from_sequence(sequence, *, axis, new_axis=0):
    return jnp.stack(sequence, axis) if new_axis else jnp.concatenate(sequence, axis)


@register_onnx_op("SplitToSequence")
def split_to_sequence(x, split=None, *, axis=0, keepdims=1):
    axis = axis + x.ndim if axis < 0 else axis
    if split is None:
        pieces = [lax.index_in_dim(x, index, axis, keepdims=bool(keepdims)) for index in range(x.shape[axis])]
        return pieces
    sizes = known_ints(split, "split of SplitToSequence")
    if np.ndim(known(split, "split")) == 0:
        whole, each = x.shape[axis], sizes[0]
        sizes = [each] * (whole // each) + ([whole % each] if whole % each else [])
    offsets = np.cumsum((0,) + tuple(sizes))
    return [lax.slice_in_dim(x, int(begin), int(end), axis=axis) for begin, end in zip(offsets[:-1], offsets[1:])]


@register_onnx_op("SequenceMap")
def sequence_map(sequence, *extra, body):
    results = []
    for index in range(len(sequence)):
        arguments = [sequence[index]] + [value[index] if isinstance(value, list) else value for value in extra]
        results.append(body(*arguments))
    count = len(body.output_names)
    outputs = tuple([step[position] for step in results] for position in range(count))
    return outputs if count > 1 else outputs[0]


@register_onnx_op("Optional")
def optional(value=None, *, type=None):
    return value


@register_onnx_op("OptionalHasElement")
def optional_has_element(value=None):
    return np.asarray(value is not None)


@register_onnx_op("OptionalGetElement")
def optional_get_element(value):
    return value


# ------------------------------------------------------------------------------------ random


def _random_dtype(dtype, like=None):
    if dtype is not None:
        return onnx_dtype(dtype)
    return like.dtype if like is not None else np.dtype(np.float32)


def _key(key, seed):
    return jax.random.key(int(seed)) if seed is not None else key


@register_onnx_op("RandomNormal", rng=True)
def random_normal(*, dtype=1, mean=0.0, scale=1.0, seed=None, shape, key):
    return mean + scale * jax.random.normal(_key(key, seed), tuple(shape), _random_dtype(dtype))


@register_onnx_op("RandomUniform", rng=True)
def random_uniform(*, dtype=1, high=1.0, low=0.0, seed=None, shape, key):
    return jax.random.uniform(_key(key, seed), tuple(shape), _random_dtype(dtype), low, high)


@register_onnx_op("RandomNormalLike", rng=True)
def random_normal_like(x, *, dtype=None, mean=0.0, scale=1.0, seed=None, key):
    return mean + scale * jax.random.normal(_key(key, seed), x.shape, _random_dtype(dtype, x))


@register_onnx_op("RandomUniformLike", rng=True)
def random_uniform_like(x, *, dtype=None, high=1.0, low=0.0, seed=None, key):
    return jax.random.uniform(_key(key, seed), x.shape, _random_dtype(dtype, x), low, high)


@register_onnx_op("Bernoulli", rng=True)
def bernoulli(x, *, dtype=None, seed=None, key):
    return jax.random.bernoulli(_key(key, seed), x).astype(_random_dtype(dtype, x))


@register_onnx_op("Multinomial", rng=True)
def multinomial(x, *, dtype=6, sample_size=1, seed=None, key):
    samples = jax.random.categorical(_key(key, seed), x, axis=-1, shape=(sample_size, x.shape[0]))
    return samples.T.astype(onnx_dtype(dtype))
