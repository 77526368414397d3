"""In-place updates run together (runtime/deferred.py): a hand-written update loop
(`p.data.add_(p.grad, alpha=-lr)`, pytorch/examples' word_language_model) or a model EMA records
its in-place ops and runs them as one program at the first read of what they wrote. Each case
compares with eager torch, and with the same ops run one by one (`defer_updates` off)."""

import io

import pytest
import torch

from bridge.runtime import deferred, dispatch, stats
from bridge.runtime.config import settings


@pytest.fixture
def counted(bridged):
    """Counts from zero, with `add` and `add_` planned afresh (which programs an update records,
    a float's static one or its lifted one, depends on the calls the op met before)."""
    deferred.flush()
    stats.reset()
    ops = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)
    earlier = {op: dispatch._plans.pop(op, None) for op in ops}
    try:
        yield bridged
    finally:
        deferred.flush()
        for op, plan in earlier.items():
            dispatch._plans.pop(op, None)
            if plan is not None:
                dispatch._plans[op] = plan


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _train(model, device, steps, lrs):
    data = torch.randn(16, 6, generator=torch.Generator().manual_seed(1)).to(device)
    target = torch.randn(16, 3, generator=torch.Generator().manual_seed(2)).to(device)
    for step in range(steps):
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lrs[step])
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["captured", "eager"])
def test_a_hand_written_update_loop_runs_as_one_program_and_matches_torch(counted, mode):
    previous = counted.set_mode(mode)
    try:
        lrs = [0.1] * 6 + [0.025] * 6  # annealed, as word_language_model does
        expected = _train(_net(), "cpu", 12, lrs)
        got = _train(_net().cuda(), "cuda", 12, lrs)
        for want, have in zip(expected, got):
            torch.testing.assert_close(have, want)
        settings.defer_updates = False
        one_by_one = _train(_net().cuda(), "cuda", 12, lrs)
        for alone, have in zip(one_by_one, got):
            assert torch.equal(alone, have)  # the same programs, composed
    finally:
        settings.defer_updates = True
        counted.set_mode(previous)
    # From the second step on (the first runs each op to learn its program) each step's four
    # updates ran as one batch, with one program for both learning rates.
    assert stats.deferred_batches >= 10 and stats.deferred_ops >= 40
    assert stats.deferred_programs <= 2
    from bridge.report import summary_text

    (line,) = [line for line in summary_text().splitlines() if "in-place updates ran together" in line]
    assert f"{stats.deferred_ops} op(s) in {stats.deferred_batches} batch(es)" in line


def test_a_chain_of_updates_to_one_tensor_stays_in_one_batch(counted):
    """A model EMA: `ema.mul_(d).add_(p, alpha=1 - d)`, the second op on the first's result."""
    torch.manual_seed(0)
    params = [torch.randn(5, 4), torch.randn(3)]
    emas = [p.clone() * 0.5 for p in params]
    bridge_params, bridge_emas = [p.cuda() for p in params], [e.cuda() for e in emas]
    for decay in (0.9, 0.9, 0.99, 0.99):
        for ema, p in zip(emas, params):
            ema.mul_(decay).add_(p, alpha=1 - decay)
        for ema, p in zip(bridge_emas, bridge_params):
            ema.mul_(decay).add_(p, alpha=1 - decay)
        for p in params + bridge_params:
            p.add_(0.125)
    for want, have in zip(emas, bridge_emas):
        torch.testing.assert_close(have.cpu(), want)
    assert stats.deferred_ops > stats.deferred_batches  # several ops a batch


def test_what_reads_or_replaces_a_target_sees_the_update_first(counted):
    base = torch.arange(12.0).reshape(3, 4)
    for recorded in (False, True):  # (the first call of each op runs it, the second records it)
        target = base.clone().cuda()
        row = target[1]  # a view made before the update
        target.add_(torch.ones(3, 4).cuda(), alpha=2.0)
        assert (target._pending is deferred._current is not None) == recorded
        assert row.tolist() == (base[1] + 2).tolist()  # a view's read runs the batch
        target.mul_(3.0)
        assert target.sum().item() == ((base + 2) * 3).sum().item()
        target.mul_(0.5)
        target.data = torch.zeros(3, 4).cuda()  # replaced: the update must not land after it
        assert target.abs().sum().item() == 0.0
        target.add_(1.0)
        target.copy_(torch.full((3, 4), 7.0).cuda())
        assert target.tolist() == [[7.0] * 4] * 3


def test_an_update_reading_a_view_of_an_earlier_target_runs_the_earlier_first(counted):
    for _ in range(2):
        a, b = torch.ones(4).cuda(), torch.zeros(2).cuda()
        a.mul_(3.0)
        b.add_(a[:2])  # a view of a's update: the batch with a's runs first
        assert b.tolist() == [3.0, 3.0] and a.tolist() == [3.0] * 4


def test_synchronize_and_save_see_the_updates(counted):
    model = torch.nn.Linear(3, 2).cuda()
    expected = {name: value.detach().cpu() + 0.5 for name, value in model.state_dict().items()}
    for _ in range(2):
        for p in model.parameters():
            p.data.add_(torch.full_like(p, 0.25))
    torch.cuda.synchronize()
    assert deferred._current is None
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    for name, value in expected.items():
        torch.testing.assert_close(loaded[name].cpu(), value)
