"""Gradients joined in one flat array (runtime/flat.py `gradient_members`): a fused run of a
region whose parameters an optimizer packed returns each group's gradients as one array, each
`.grad` a view of its span, and the optimizer's update takes that one array. Everything a script
sees must stay torch's: gradient values, accumulation, zeroing in place, views of a `.grad`
that see later writes, a clip, hooks, checkpoints."""

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import loaded_in_plain_torch
from bridge.runtime import capture, flat, optimizers
from bridge.runtime.tensor import root_of


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.fc3 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x))))).square().mean()


def _groups(model):
    """nanoGPT's two groups: matrices decayed, biases not."""
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


OPTIMIZERS = [
    pytest.param(lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True), id="adamw-fused"),
    pytest.param(lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=True), id="adamw-foreach"),
    pytest.param(lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9), id="sgd-momentum"),
]


def _pair(make):
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference).cuda()
    return reference, model, make(_groups(reference)), make(_groups(model))


def _close(model, reference, grads=True):
    for (name, p_ref), p in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=1e-5, atol=1e-6, msg=name)
        if grads:
            assert (p.grad is None) == (p_ref.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad.cpu(), p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)


def _updates_taking(monkeypatch):
    """The number of gradient arrays each update program call took."""
    taken = []
    real = optimizers.submit

    def submit(kind, in_place, args, statics, finish, now=False):
        taken.append(len(args[1]))
        return real(kind, in_place, args, statics, finish, now)

    monkeypatch.setattr(optimizers, "submit", submit)
    return taken


@pytest.mark.parametrize("below", [None, 200], ids=["all-joined", "large-apart"])
@pytest.mark.parametrize("make", OPTIMIZERS)
def test_a_fused_runs_gradients_are_one_array_per_group_and_the_update_takes_it(captured, make, below, monkeypatch):
    if below is not None:
        # fc2.weight (256 values) stays an array of its own; the other gradients join.
        monkeypatch.setattr(capture, "JOIN_BELOW", below)
    reference, model, opt_ref, opt = _pair(make)
    taken = _updates_taking(monkeypatch)
    data = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(8, 6, generator=data)
        for net, optimizer, given in ((reference, opt_ref, x), (model, opt, x.cuda())):
            optimizer.zero_grad()
            net(given).backward()
        for group in opt.param_groups:
            params = group["params"]
            joined = [k for k, p in enumerate(params) if p.numel() < (below or capture.JOIN_BELOW)]
            found = flat.gradient_holders([p.grad for p in params])
            assert found is not None and found[1] == tuple(joined)
            root = found[0][0]
            assert root is not root_of(params[0])
            assert flat.members_of(root).shapes == tuple(tuple(params[k].shape) for k in joined)
            assert all(not p.grad._chain for k, p in enumerate(params) if k not in joined)
        _close(model, reference)  # each gradient read from its span
        opt_ref.step()
        opt.step()
    _close(model, reference)
    # One array per group's joined gradients, and one per gradient left apart.
    assert taken and all(count == (1 if below is None else [2, 1][k % 2]) for k, count in enumerate(taken)), taken
    assert not capture.breaks


@pytest.mark.parametrize("set_to_none", [True, False])
def test_accumulated_and_zeroed_gradients_match_torch(captured, set_to_none):
    reference, model, opt_ref, opt = _pair(OPTIMIZERS[0].values[0])
    data = torch.Generator().manual_seed(2)
    for _ in range(3):
        batches = [torch.randn(4, 6, generator=data) for _ in range(3)]
        for net, optimizer, device in ((reference, opt_ref, "cpu"), (model, opt, "cuda")):
            for x in batches:
                net(x.to(device)).backward()
        _close(model, reference)
        # The first write into a joined gradient gave each `.grad` its own array back, so that
        # the accumulation took the way of any gradient (one batched program), not a write into
        # the flat array per parameter.
        assert all(p.grad._root is None or not p.grad._chain for p in model.parameters())
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad(set_to_none=set_to_none)
        opt.zero_grad(set_to_none=set_to_none)
        _close(model, reference)


def test_a_view_of_a_gradient_sees_later_writes(captured):
    reference, model, _, _ = _pair(OPTIMIZERS[0].values[0])
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    views = []
    for net, device in ((reference, "cpu"), (model, "cuda")):
        net(x.to(device)).backward()
        views.append(net.fc1.weight.grad.view(-1))
        net(y.to(device)).backward()  # accumulates into the viewed gradient
        net.fc3.bias.grad.mul_(2)
    torch.testing.assert_close(views[1].cpu(), views[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(views[1].cpu(), model.fc1.weight.grad.view(-1).cpu(), rtol=0, atol=0)
    _close(model, reference)


@pytest.mark.parametrize("below", [None, 200], ids=["all-joined", "large-apart"])
def test_a_clip_of_joined_gradients_is_folded_into_the_step(captured, below, monkeypatch):
    if below is not None:
        monkeypatch.setattr(capture, "JOIN_BELOW", below)
    reference, model, opt_ref, opt = _pair(OPTIMIZERS[0].values[0])
    data = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(8, 6, generator=data) * 10
        norms = []
        for net, optimizer, device in ((reference, opt_ref, "cpu"), (model, opt, "cuda")):
            optimizer.zero_grad()
            net(x.to(device)).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5))
            optimizer.step()
        torch.testing.assert_close(norms[1].cpu(), norms[0], rtol=1e-5, atol=1e-7)
        _close(model, reference)
    assert not [record for record in capture.compiles if record.region == "clip_grad_norm_"]


def test_hooks_see_torchs_gradients(captured):
    reference, model, opt_ref, opt = _pair(OPTIMIZERS[0].values[0])
    seen = {"cpu": [], "cuda": []}
    for net, device in ((reference, "cpu"), (model, "cuda")):
        net.fc1.weight.register_hook(lambda grad: grad * 3)
        net.fc3.weight.register_post_accumulate_grad_hook(lambda p, device=device: seen[device].append(p.grad.clone()))
    x = torch.randn(4, 6)
    for _ in range(2):
        for net, optimizer, device in ((reference, opt_ref, "cpu"), (model, opt, "cuda")):
            optimizer.zero_grad()
            net(x.to(device)).backward()
            optimizer.step()
        _close(model, reference, grads=False)
    for ours, theirs in zip(seen["cuda"], seen["cpu"]):
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-5, atol=1e-6)
    assert len(seen["cuda"]) == 2


def test_saved_gradients_load_in_plain_torch(captured, tmp_path):
    _, model, _, opt = _pair(OPTIMIZERS[0].values[0])
    model(torch.randn(4, 6).cuda()).backward()
    assert flat.gradient_holders([p.grad for p in opt.param_groups[0]["params"]]) == (
        [root_of(opt.param_groups[0]["params"][0].grad)], (0, 1, 2)
    )
    expected = {name: p.grad.cpu().clone() for name, p in model.named_parameters()}
    torch.save({name: p.grad for name, p in model.named_parameters()}, tmp_path / "grads.pt")
    loaded = loaded_in_plain_torch(captured, tmp_path / "grads.pt")
    assert type(loaded["fc1.weight"]) is torch.Tensor
    for name, grad in expected.items():
        assert torch.equal(loaded[name], grad), name
