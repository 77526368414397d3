"""Small integer and bool work on the host (runtime/dispatch.py `_on_host`, runtime/tensor.py
`host_array`): a small integer tensor moved to the device (`.to("cuda")`) or made there by a
factory keeps its value on the host, and an op on such tensors runs by torch's CPU kernel, its
result kept on the host until the device reads it. HF generate's loop (token ids, positions,
masks: ~40 ops a token) then costs a few microseconds an op instead of a program call each. The
answers are torch's own; a value read on the device is copied there once."""

import jax
import pytest
import torch

from bridge.runtime import stats
from bridge.runtime.config import settings
from bridge.runtime.tensor import OnHost, host_array, read_value

aten = torch.ops.aten


@pytest.fixture
def counted(bridged):
    stats.host_runs.clear()
    yield bridged


def _on_device_only(tensor):
    """A bridge tensor whose value is on the device only (a floating-point op made it there)."""
    return tensor.float().cuda().to(tensor.dtype)


def test_token_ids_moved_to_the_device_stay_on_the_host_until_the_device_reads_them(counted):
    ids = torch.tensor([[5, 7, 11]])
    moved = ids.cuda()
    assert moved.device.type == "cuda" and type(moved._pending) is OnHost
    ids[0, 0] = 99  # the script's own tensor: the bridge kept a copy
    grown = torch.cat([moved, moved[:, -1:] * 2 + 1], dim=1)
    assert grown.tolist() == [[5, 7, 11, 23]]
    assert type(grown._pending) is OnHost and stats.host_runs[aten.cat.default] == 1
    assert grown.sum().item() == 46 and type(grown._pending) is OnHost  # .item() needs no device
    # Read on the device: copied there once, and the host value is kept.
    value = read_value(grown)
    assert isinstance(value, jax.Array) and grown._pending is None and host_array(grown) is not None
    assert read_value(grown) is value
    embedded = torch.nn.functional.embedding(grown, torch.arange(100.0).reshape(50, 2).cuda())
    assert embedded[0, :, 0].tolist() == [10.0, 14.0, 22.0, 46.0]


def test_floating_point_results_are_made_on_the_device(counted):
    ids = torch.arange(6).cuda()
    half = ids / 2  # a quotient: floating point, so the mapping's program computes it
    assert half._pending is None and host_array(half) is None
    torch.testing.assert_close(half.cpu(), torch.arange(6) / 2)
    assert ids.float()._pending is None
    assert stats.host_runs[aten.div.Tensor] == 0


def test_views_made_on_the_host_follow_writes_as_in_torch(counted):
    reference = torch.arange(12).reshape(3, 4)
    ids = reference.cuda()
    row, corner = ids[1], ids[:2, 2:]
    assert row.tolist() == reference[1].tolist() and host_array(row) is not None
    ids.mul_(3)  # written in place: the views see it
    reference.mul_(3)
    assert row.tolist() == reference[1].tolist() and corner.tolist() == reference[:2, 2:].tolist()
    corner.add_(100)  # and a write through a view reaches the base
    reference[:2, 2:].add_(100)
    assert ids.tolist() == reference.tolist() and row.tolist() == reference[1].tolist()
    # A view read on the device gets the host's value, and its chain still serves after a write.
    torch.testing.assert_close((row.float() * 0.5).cpu(), reference[1].float() * 0.5)
    ids.zero_()
    assert row.float().sum().item() == 0.0


def test_a_device_value_joins_the_host_once_computed(counted):
    positions = torch.arange(4).cuda()  # a factory's: on the host
    scores = torch.tensor([[0.1, 0.9, 0.3], [0.8, 0.1, 0.1]]).cuda()
    best = scores.argmax(dim=-1)  # on the device (a floating-point input)
    assert host_array(best) is None
    combined = torch.cat([positions, best])  # small: read to the host (after the device computed it)
    assert combined.tolist() == [0, 1, 2, 3, 1, 0] and type(combined._pending) is OnHost
    assert host_array(best).tolist() == [1, 0]  # kept for its next use


def test_a_factory_result_is_shared_with_its_device_copy(counted):
    first = torch.arange(10, device="cuda")
    second = torch.arange(10, device="cuda")
    assert type(first._pending) is OnHost and first is not second
    assert read_value(first) is read_value(second)  # the second found the first's device copy


def test_host_tensors_still_refuse_plain_host_tensors(counted):
    ids = torch.arange(4).cuda()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        ids + torch.arange(4)
    assert (ids + torch.tensor(1)).tolist() == [1, 2, 3, 4]  # a 0-dim host tensor is a scalar, as in torch


def test_numpy_gives_a_copy_of_a_host_value(counted):
    ids = torch.arange(3, device="cuda")
    array = ids.numpy(force=True)
    array[0] = 42
    assert ids.tolist() == [0, 1, 2] and torch.arange(3, device="cuda").tolist() == [0, 1, 2]


def test_off_the_values_live_on_the_device(counted):
    settings.host_int_ops = False
    try:
        ids = torch.tensor([1, 2, 3]).cuda()
        assert ids._pending is None and host_array(ids) is None
        assert (ids * 2).tolist() == [2, 4, 6] and stats.host_runs[aten.mul.Tensor] == 0
    finally:
        settings.host_int_ops = True


class _Decoder(torch.nn.Module):
    """A toy decoder: the next token from the ids and positions, as generate's model gives it."""

    def __init__(self):
        super().__init__()
        self.tokens = torch.nn.Embedding(32, 8)
        self.positions = torch.nn.Embedding(64, 8)
        self.out = torch.nn.Linear(8, 32)

    def forward(self, ids, positions):
        return self.out(self.tokens(ids) + self.positions(positions))


def _decode(model, ids, steps, device):
    """generate's loop around the model: positions, the next token, stopping flags."""
    unfinished = torch.ones(ids.shape[0], dtype=torch.long, device=device)
    for _ in range(steps):
        positions = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
        logits = model(ids[:, -1:], positions[:, -1:])[:, -1, :]  # (the last token: one shape)
        next_tokens = torch.argmax(logits.float(), dim=-1)
        next_tokens = next_tokens * unfinished + 0 * (1 - unfinished)
        ids = torch.cat([ids, next_tokens[:, None]], dim=-1)
        unfinished = unfinished & ~torch.isin(ids[:, -1:], torch.tensor([3], device=device)).any(dim=-1)
        if unfinished.max() == 0:
            break
    return ids


@pytest.mark.parametrize("mode", ["captured", "eager"])
def test_a_decoding_loop_gives_torchs_tokens_with_its_small_ops_on_the_host(counted, mode):
    from bridge.runtime import capture

    previous = counted.set_mode(mode)
    capture.reset()
    try:
        torch.manual_seed(0)
        reference = _Decoder().eval()
        model = _Decoder().eval()
        model.load_state_dict(reference.state_dict())
        model.cuda()
        ids = torch.randint(0, 32, (2, 3), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = _decode(reference, ids, 12, "cpu")
            got = _decode(model, ids.cuda(), 12, "cuda")
        assert got.tolist() == expected.tolist()
        # The loop's integer ops ran on the host; the growing ids compiled no program per length.
        assert stats.host_runs[aten.cat.default] == 12 and stats.host_runs[aten.bitwise_and.Tensor] == 12
        assert not capture.breaks, capture.breaks
    finally:
        counted.set_mode(previous)
