"""Eager ops called with a Python float that changes between calls (runtime/compiled_ops.py): a
step size `p.data.add_(p.grad, alpha=-lr)` under a schedule, `loss * scale`, `x.clamp(min=eps)`.
Once two calls of a signature differ only in their floats, the floats become arguments of one
program for it; an op whose mapping needs the float as a Python number runs that signature
uncompiled, and the run report says so. Before, the second float stopped the op compiling for
every signature (word_language_model's update ran each `add_` as separate JAX dispatches)."""

import pytest
import torch
import torch.nn.functional as F

from bridge.runtime import dispatch, stats

aten = torch.ops.aten

FLOATS = [0.5, -0.25, 1.0, 0.0, -0.0, 3.75, 0.1, float("inf"), float("nan")]

X = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
Y = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
INDEX = torch.tensor([[0, 1, 2, 3, 0]])
DEGREES = torch.arange(5)

# name -> (op whose program takes the float, call(x, y, f)). Each answer is compared with the
# program compiled for that float alone, to the bit, and with eager torch on the CPU.
CASES = {
    "add alpha": (aten.add.Tensor, lambda x, y, f: torch.add(x, y, alpha=f)),
    "sub alpha": (aten.sub.Tensor, lambda x, y, f: torch.sub(x, y, alpha=f)),
    "p.data.add_ alpha": (aten.add.Tensor, lambda x, y, f: x.clone().data.add_(y, alpha=f)),
    "mul by a scalar": (aten.mul.Tensor, lambda x, y, f: x * f),
    "a 0-dim tensor times a scalar": (aten.mul.Tensor, lambda x, y, f: x.sum() * f),
    "mul_": (aten.mul.Tensor, lambda x, y, f: x.clone().mul_(f)),
    "scalar minus a tensor": (aten.rsub.Scalar, lambda x, y, f: f - x),
    "clamp min": (aten.clamp.default, lambda x, y, f: x.clamp(min=f)),
    "lerp weight": (aten.lerp.Scalar, lambda x, y, f: torch.lerp(x, y, f)),
    "addcmul value": (aten.addcmul.default, lambda x, y, f: torch.addcmul(x, y, y, value=f)),
    "leaky_relu slope": (aten.leaky_relu.default, lambda x, y, f: F.leaky_relu(x, f)),
    "fill_": (aten.fill.Scalar, lambda x, y, f: x.clone().fill_(f)),
    "masked_fill": (aten.masked_fill.Scalar, lambda x, y, f: x.masked_fill(x > 0, f)),
    "gt a scalar": (aten.gt.Scalar, lambda x, y, f: x > f),
    # mappings that tell a Python number from an array: a lifted float is a Python number there
    "scatter a value": (aten.scatter.value, lambda x, y, f: x.scatter(0, INDEX.to(x.device), f)),
    "chebyshev of a number": (
        aten.special_chebyshev_polynomial_t.x_scalar,
        lambda x, y, f: torch.special.chebyshev_polynomial_t(f, DEGREES.to(x.device)),
    ),
}


@pytest.fixture
def fresh_plans(bridged):
    """Plans made anew for the test (no signatures compiled yet), the earlier ones restored after."""
    earlier = dict(dispatch._plans)
    dispatch._plans.clear()
    stats.uncompiled_calls.clear()
    stats.uncompiled_reasons.clear()
    try:
        yield
    finally:
        dispatch._plans.clear()
        dispatch._plans.update(earlier)


def _alone(call, f):
    """call's answer from plans made for this float alone: its float compiled in as a constant."""
    kept = dict(dispatch._plans)
    dispatch._plans.clear()
    try:
        return call(X.cuda(), Y.cuda(), f).cpu()
    finally:
        dispatch._plans.clear()
        dispatch._plans.update(kept)


@pytest.mark.parametrize("name", list(CASES))
def test_a_changing_float_compiles_one_program_and_matches_torch(fresh_plans, name):
    op, call = CASES[name]
    for f in FLOATS:
        expected = call(X, Y, f)
        got = call(X.cuda(), Y.cuda(), f).cpu()
        assert got.dtype == expected.dtype, (f, got.dtype, expected.dtype)
        torch.testing.assert_close(got, _alone(call, f), rtol=0, atol=0, equal_nan=True, msg=f"{name} with {f}")
        torch.testing.assert_close(got, expected, equal_nan=True, msg=f"{name} with {f}")
        if f == 0:
            assert torch.equal(got.signbit(), expected.signbit()), f  # -0.0 is not 0.0
    entry = dispatch._plans[op].entry
    assert entry.enabled
    assert len(entry.lifted) == 1 and None not in entry.lifted.values()
    assert stats.uncompiled_calls[op] == 0


def test_the_update_loop_of_word_language_model_stays_compiled_when_the_rate_changes(fresh_plans):
    # pytorch/examples word_language_model: `p.data.add_(p.grad, alpha=-lr)`, and `lr /= 4.0`
    # when the validation loss stops improving. Each rate runs as the same program.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    reference = [p.detach().clone() for p in model.parameters()]
    grads = [torch.randn_like(p) for p in model.parameters()]
    model = model.cuda()
    for p, g in zip(model.parameters(), grads):
        p.grad = g.cuda()
    lr = 20.0
    for _ in range(4):
        for _ in range(3):
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            for p, g in zip(reference, grads):
                p.add_(g, alpha=-lr)
        lr /= 4.0
    for p, want in zip(model.parameters(), reference):
        torch.testing.assert_close(p.detach().cpu(), want)
    entry = dispatch._plans[aten.add.Tensor].entry
    assert entry.enabled and len(entry.lifted) == 1
    assert stats.uncompiled_calls[aten.add.Tensor] == 0


def test_a_probability_that_changes_samples_in_the_tensors_dtype(fresh_plans):
    # bernoulli's mapping draws in the probability's dtype where it is a tensor, in the result's
    # where it is a Python number; a lifted float is the number.
    for p in (0.25, 0.5, 0.75):
        drawn = torch.bernoulli(torch.zeros(4000).cuda(), p)
        assert drawn.dtype == torch.float32 and set(drawn.unique().tolist()) <= {0.0, 1.0}
        assert abs(drawn.mean().item() - p) < 0.05
    entry = dispatch._plans[aten.bernoulli.p].entry
    assert len(entry.lifted) == 1 and None not in entry.lifted.values()


def test_an_op_that_needs_the_float_as_a_number_runs_that_signature_uncompiled_and_says_so(fresh_plans):
    # smooth_l1_loss's mapping branches on beta in Python: a traced beta cannot be its argument.
    for beta in (0.5, 1.5, 2.5):
        expected = F.smooth_l1_loss(X, Y, beta=beta)
        got = F.smooth_l1_loss(X.cuda(), Y.cuda(), beta=beta).cpu()
        torch.testing.assert_close(got, expected)
    op = aten.smooth_l1_loss.default
    assert stats.uncompiled_calls[op] == 2  # the second and third betas
    assert "Python number" in stats.uncompiled_reasons[op]
    assert dispatch._plans[op].entry.enabled  # other signatures still compile
    assert any(entry["op"] == str(op) for entry in stats.summary()["uncompiled"])


def test_later_floats_run_the_lifted_program_without_the_entry(fresh_plans, monkeypatch):
    # After a signature's second float, a call with yet another float is found by its key
    # without the floats' values and runs the lifted program with its floats straight from the
    # dispatcher (runtime/dispatch.py `_with_call_floats`): no entry key, no unwrapping. That
    # holds for a functional op, an in-place one (deferred, as `p.data.add_` is) and a list one.
    from bridge.runtime.compiled_ops import CompiledEntry

    entered = []
    original = CompiledEntry.__call__

    def counted(self, values, keywords):
        entered.append(self.op)
        return original(self, values, keywords)

    monkeypatch.setattr(CompiledEntry, "__call__", counted)
    params = [torch.randn(3, 4, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    grads = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + k)) for k in range(3)]
    moved, moved_grads = [p.cuda() for p in params], [g.cuda() for g in grads]
    x = X.cuda()
    for step, lr in enumerate([0.5, 0.25, 0.125, 0.1, 0.05, -0.0, 3.0]):
        if step == 3:
            entered.clear()
        torch.testing.assert_close((x * lr).cpu(), X * lr, rtol=0, atol=0)
        for p, g, moved_p, moved_g in zip(params, grads, moved, moved_grads):
            p.add_(g, alpha=-lr)
            moved_p.data.add_(moved_g, alpha=-lr)
        torch._foreach_add_(params, lr)
        torch._foreach_add_(moved, lr)
        for p, moved_p in zip(params, moved):
            # (torch's CPU kernel may fuse alpha's multiply and the add: a float32 rounding apart)
            torch.testing.assert_close(moved_p.cpu(), p)
    assert entered == [], entered
