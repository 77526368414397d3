"""Eager ops whose shapes keep changing (runtime/dispatch.py, runtime/compiled_ops.py): past a few
compiled shapes, an op runs a new shape of small integer arrays by torch's CPU kernel and keeps the
result on the host until the device needs it (runtime/tensor.OnHost); a shape that comes back in a
later round of device-made tensors compiles. HF generate's token ids and attention mask grow by one
position a token: each shape would otherwise compile a program to run once. The answers are
torch's own. (Small integer tensors moved to the device with `.to("cuda")` keep their value on the
host from the start: tests/test_host_int_ops.py. Here `_device` makes tensors whose value is on
the device only, as an op of device values makes them.)"""

import contextlib

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

from bridge.runtime import compiled_ops, devices, dispatch, stats
from bridge.runtime.tensor import OnHost, read_value

aten = torch.ops.aten


@contextlib.contextmanager
def _fresh_plan(op):
    """`op` with a plan of its own (no shapes compiled yet) and its counts from zero, the earlier
    plan restored after."""
    earlier = dispatch._plans.pop(op, None)
    stats.host_runs.clear()
    stats.uncompiled_calls.clear()
    try:
        yield
    finally:
        dispatch._plans.pop(op, None)
        if earlier is not None:
            dispatch._plans[op] = earlier


@pytest.fixture
def fresh_cat(bridged):
    with _fresh_plan(aten.cat.default):
        yield


def _device(tensor):
    """`tensor` on the device, with no value on the host: made by a floating-point op there."""
    return tensor.float().cuda().to(tensor.dtype)


def _grow(ids, steps):
    """generate's loop: the sequence grows by one token a step (on the device, the token is made
    there from the host's: only `cat` meets bridge tensors, whatever other ops' plans hold)."""
    grown = []
    for _ in range(steps):
        token = (ids.cpu()[:, -1:] * 3 + 1) % 97
        ids = torch.cat([ids, _device(token) if ids.device.type == "cuda" else token], dim=1)
        grown.append(ids)
    return grown


def test_a_growing_sequence_runs_new_shapes_on_the_host_then_compiles_them_next_round(fresh_cat):
    start = torch.tensor([[5, 7]])
    expected = _grow(start, 10)
    first = _grow(_device(start), 10)
    for got, want in zip(first, expected):
        assert got.tolist() == want.tolist()
    entry = dispatch._plans[aten.cat.default].entry
    # The first shapes compiled as they came; the later ones ran on the host, once each (the
    # fifth for being a new shape, the rest for meeting the fifth's result there).
    assert len(entry.shapes) == compiled_ops.EAGER_VARIANTS
    assert stats.host_runs[aten.cat.default] == 10 - compiled_ops.EAGER_VARIANTS
    last = first[-1]
    assert type(last._pending) is OnHost  # still on the host: nothing on the device read it
    # Read on the device (as a program's input reads it): copied there once, its host value kept.
    assert isinstance(read_value(last), jax.Array) and last._pending is None
    assert (last * 2).tolist() == (expected[-1] * 2).tolist()

    # The next round meets the same shapes again. Its fifth comes back after fewer than
    # RECURRENCE_GAP other new ones and runs on the host again; from there on the round's
    # tensors are on the host, and nothing compiles.
    second = _grow(_device(start), 10)
    assert [got.tolist() for got in second] == [want.tolist() for want in expected]
    assert stats.host_runs[aten.cat.default] == 2 * (10 - compiled_ops.EAGER_VARIANTS)
    assert len(entry.shapes) == compiled_ops.EAGER_VARIANTS


def _compile_four_shapes(dtype=torch.long):
    for length in range(1, compiled_ops.EAGER_VARIANTS + 1):
        torch.cat([_device(torch.zeros(1, length, dtype=dtype)), _device(torch.zeros(1, 1, dtype=dtype))], dim=1)


def test_a_shape_that_every_round_meets_compiles_after_a_few(fresh_cat):
    """A shape that repeats while the op meets no other new one (a step that is the same each
    round) earns its program after RECURRENCE_COUNT calls."""
    _compile_four_shapes()
    for _ in range(compiled_ops.RECURRENCE_COUNT + 2):
        # (new tensors each round: one the host has read keeps its host value, and an op on it
        # runs there)
        a, b = _device(torch.arange(20).reshape(1, 20)), _device(torch.ones(1, 3, dtype=torch.long))
        out = torch.cat([a, b], dim=1)
    assert stats.host_runs[aten.cat.default] == compiled_ops.RECURRENCE_COUNT - 1
    assert out.tolist() == torch.cat([torch.arange(20).reshape(1, 20), torch.ones(1, 3, dtype=torch.long)], dim=1).tolist()


def test_a_result_kept_on_the_host_behaves_as_any_tensor(fresh_cat):
    _compile_four_shapes()
    kept = torch.cat([_device(torch.arange(6).reshape(1, 6)), _device(torch.ones(1, 2, dtype=torch.long))], dim=1)
    reference = torch.cat([torch.arange(6).reshape(1, 6), torch.ones(1, 2, dtype=torch.long)], dim=1)
    assert type(kept._pending) is OnHost
    view = kept[:, 2:5]
    kept.mul_(2)  # written in place: the view sees it, as in torch
    reference.mul_(2)
    assert view.cpu().tolist() == reference[:, 2:5].tolist()
    assert kept.sum().item() == reference.sum().item()
    assert kept.device.type == "cuda" and kept.dtype == torch.long
    assert int(kept[0, -1]) == 2 and kept.numel() == 8 and kept.shape == (1, 8)
    assert torch.equal(kept.cpu(), reference)
    torch.testing.assert_close((kept.float() / 3).cpu(), reference.float() / 3)  # read on the device

    masks = torch.cat([torch.tensor([[True, False]]).cuda(), torch.tensor([[True]]).cuda()], dim=1)
    assert masks.tolist() == [[True, False, True]] and masks.dtype == torch.bool


def test_floating_point_shapes_compile_as_they_come(fresh_cat):
    """torch's CPU kernels round their own way: floating-point ops keep the mappings' programs."""
    _compile_four_shapes(torch.float32)
    for length in range(5, 9):
        out = torch.cat([torch.linspace(0, 1, length).cuda(), torch.ones(1).cuda()])
    assert stats.host_runs[aten.cat.default] == 0 and out._pending is None
    torch.testing.assert_close(out.cpu(), torch.cat([torch.linspace(0, 1, 8), torch.ones(1)]))


def test_mapping_sweeps_run_no_op_on_the_host(fresh_cat):
    from bridge.compat import harness
    from bridge.runtime.config import settings

    try:
        harness.activate()
        assert not settings.host_int_ops
        _compile_four_shapes()
        torch.cat([torch.zeros(1, 9, dtype=torch.long).cuda(), torch.zeros(1, 1, dtype=torch.long).cuda()], dim=1)
        assert stats.host_runs[aten.cat.default] == 0
    finally:
        settings.host_int_ops = True


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.int64).reshape(3, 4),
        np.arange(12, dtype=np.float32).reshape(3, 4).T,  # not contiguous
        np.array(True),
        np.arange(5, dtype=np.float32).astype(ml_dtypes.bfloat16),
        np.zeros((0, 3), np.float64),
    ],
    ids=["int64", "transposed", "bool scalar", "bfloat16", "empty"],
)
def test_a_host_array_is_put_on_the_device_as_jax_puts_it(bridged, array):
    put = devices.put(array, 0)
    reference = jax.device_put(array, devices.jax_device(0))
    assert isinstance(put, jax.Array) and put.dtype == reference.dtype and put.shape == reference.shape
    assert put.devices() == reference.devices()
    np.testing.assert_array_equal(np.asarray(put), np.asarray(reference))


def test_a_signature_past_the_ops_programs_runs_on_the_host_not_op_by_op(bridged):
    """HF's sdpa_mask pads the attention mask to the cache's length, `F.pad(mask, (0, 192 - L))`:
    each token a new pad, a new signature. In the rounds after the first the shapes come back and
    would compile, but past MAX_VARIANTS signatures an op compiles none: such a call of small
    integers runs on the host (one torch call) rather than as its mapping's JAX calls one by one."""
    import torch.nn.functional as F

    op = aten.constant_pad_nd.default
    with _fresh_plan(op):
        total = compiled_ops.MAX_VARIANTS + 6
        for _ in range(3):  # three generate calls
            for length in range(1, total + 1):
                mask = torch.ones(1, length, dtype=torch.long)
                assert F.pad(_device(mask), (0, total + 1 - length)).tolist() == F.pad(mask, (0, total + 1 - length)).tolist()
        assert len(dispatch._plans[op].entry.variants) == compiled_ops.MAX_VARIANTS
        assert stats.uncompiled_calls[op] == 0
        assert stats.host_runs[op] > total
