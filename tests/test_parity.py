"""Training parity with eager torch: the examples and a GPT-style model, model and data made on
the CPU with torch's RNG, one copy moved to 'cuda' (the bridge), losses compared step by step."""

import copy
import functools
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, run_python

sys.path.insert(0, os.path.join(REPO, "examples"))
import cnn  # noqa: E402
import gpt_char  # noqa: E402

LOSS_RTOL = 1e-5


@pytest.fixture(params=["captured", "eager"])
def mode(request, bridged):
    """Each parity test in both execution modes; captured runs must compile without graph breaks."""
    from bridge.runtime import capture

    previous = bridged.set_mode(request.param)
    capture.reset()
    try:
        yield request.param
        if request.param == "captured":
            assert capture.compiles, "captured mode compiled nothing"
            assert not capture.breaks, capture.breaks
    finally:
        bridged.set_mode(previous)


def _train(model, batches, optimizer, scheduler=None, clip=None, loss_fn=None):
    losses, first_grads = [], None
    for x, y in batches:
        loss = loss_fn(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if first_grads is None:
            first_grads = [p.grad.detach().cpu().clone() for p in model.parameters()]
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses, first_grads


def _compare(reference, bridged):
    reference_losses, reference_grads = reference
    bridged_losses, bridged_grads = bridged
    worst = max(abs(a - b) / abs(a) for a, b in zip(reference_losses, bridged_losses))
    assert worst <= LOSS_RTOL, f"worst relative loss difference {worst:.2e}"
    for expected, actual in zip(reference_grads, bridged_grads):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-6)
    return worst


def _gpt_loss(model, x, y):
    return model(x, y)[1]


def test_gpt_adamw_20_steps_matches_torch(mode):
    torch.manual_seed(0)
    vocab, block = 40, 16
    model = gpt_char.GPT(vocab, block, width=32, heads=4, layers=2, dropout=0.0)
    data = torch.randint(0, vocab, (22, 4, block + 1))
    bridged_model = copy.deepcopy(model).to("cuda")

    def run(net, device):
        optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=22)
        batches = [(d[:, :-1].contiguous().to(device), d[:, 1:].contiguous().to(device)) for d in data]
        return _train(net, batches, optimizer, scheduler, clip=1.0, loss_fn=_gpt_loss)

    reference = run(model, "cpu")
    result = run(bridged_model, "cuda")
    _compare(reference, result)
    assert result[0][-1] < result[0][0]


def test_cnn_sgd_momentum_batchnorm_matches_torch(mode):
    torch.manual_seed(0)
    model = cnn.Net()
    generator = torch.Generator().manual_seed(0)
    images, labels = cnn.make_data(16 * 20, generator)
    bridged_model = copy.deepcopy(model).to("cuda")

    def run(net, device):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
        batches = [
            (images[i * 16 : (i + 1) * 16].to(device), labels[i * 16 : (i + 1) * 16].to(device)) for i in range(20)
        ]
        return _train(net, batches, optimizer, scheduler, loss_fn=lambda m, x, y: F.cross_entropy(m(x), y))

    reference = run(model, "cpu")
    result = run(bridged_model, "cuda")
    _compare(reference, result)
    for expected, actual in zip(model.buffers(), bridged_model.buffers()):  # BatchNorm running stats
        torch.testing.assert_close(actual.cpu(), expected, rtol=1e-4, atol=1e-5)
    model.eval(), bridged_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(bridged_model(images[:8].cuda()).cpu(), model(images[:8]), rtol=1e-4, atol=1e-4)


def _losses(output):
    return [float(value) for value in re.findall(r"loss ([0-9.]+)", output)]


@functools.lru_cache(maxsize=None)
def _plain_run(path, args):
    """The script under plain torch: the same for both run modes, so it runs once."""
    return run_python(path, *args, env={"CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.parametrize("run_mode", ["captured", "eager"])
@pytest.mark.parametrize("script,args", [("gpt_char.py", ["--steps", "20"]), ("cnn.py", ["--steps", "20"])])
def test_unmodified_example_script_under_runner(script, args, run_mode):
    path = os.path.join(REPO, "examples", script)
    plain = _plain_run(path, tuple(args))
    assert plain.returncode == 0, plain.stderr
    bridged = run_python("-m", "bridge", "run", "--mode", run_mode, path, *args)
    assert bridged.returncode == 0, bridged.stderr
    expected, actual = _losses(plain.stdout), _losses(bridged.stdout)
    assert len(expected) == len(actual) == 20
    worst = max(abs(a - b) / a for a, b in zip(expected, actual))
    # Printed with 6 decimals: allow the rounding of the last digit on top of 1e-5.
    assert worst <= LOSS_RTOL + 1e-6 / min(expected), (expected, actual)
    assert "torch ops ran" in bridged.stderr and "cpu_fallback" in bridged.stderr
