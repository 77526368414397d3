"""Gradients at torch's special points, in captured mode (the default) and eagerly: torch's
subgradient conventions at 0 and at bounds, `padding_idx`, `scale_grad_by_freq`, norms of zero
vectors (runtime/torch_gradients.py); and programs whose semantics once broke in captured mode."""

import copy
import math

import jax
import pytest
import torch
import torch.nn.functional as F

from bridge.runtime import capture
from bridge.runtime.tensor import read_value

MODES = ("captured", "eager")

# Inputs with zeros of both signs, values at clamp's and hardtanh's bounds (0, ±1) and beyond.
POINTS = torch.tensor([-2.0, -1.0, -0.5, 0.0, -0.0, 0.5, 1.0, 2.0, 0.0, 1.0, -1.0, 3.0])

CASES = {
    "relu at 0": lambda x: F.relu(x),
    "abs at 0": lambda x: x.abs(),
    "clamp(0, 1) at both bounds": lambda x: x.clamp(0, 1),
    "clamp_min and clamp_max": lambda x: x.clamp_min(0) + x.clamp_max(1),
    "clamp with tensor bounds": lambda x: torch.clamp(x, torch.zeros_like(x), torch.ones_like(x)),
    "hardtanh at the bounds": lambda x: F.hardtanh(x),
    "relu6 at the bounds": lambda x: F.relu6(x * 6),
    "threshold": lambda x: F.threshold(x, 0.5, -1.0),
    "norm(dim=1) of a zero row": lambda x: torch.stack([x, x * 0]).norm(dim=1).sum() * x,
    "linalg.vector_norm of a zero vector": lambda x: torch.linalg.vector_norm(x * (x.abs() > 5)) * x,
    # (+ 0.0: clamp keeps the sign of a -0.0 input in torch, not in XLA; that forward difference
    # of signed zeros is not a gradient rule.)
    "sqrt(clamp(x, min=0))": lambda x: torch.sqrt(torch.clamp(x + 0.0, min=0)),
    "where(x > 0, log(x.clamp(min=0)), x)": lambda x: torch.where(x > 0, torch.log(x.clamp(min=0)), x),
    "maximum with ties": lambda x: torch.maximum(x, torch.zeros_like(x)),
    "amax with ties": lambda x: torch.stack([x, x.flip(0)]).amax(dim=0),
}


class Weighted(torch.nn.Module):
    """f(x * w), weighted and summed: a region whose backward reaches x and w."""

    def __init__(self, function):
        super().__init__()
        self.function = function
        self.weight = torch.nn.Parameter(torch.ones(POINTS.numel()))

    def forward(self, x):
        out = self.function(x * self.weight)
        return (out * torch.arange(1.0, out.numel() + 1, device=out.device).reshape(out.shape)).sum()


@pytest.fixture(params=MODES)
def mode(request, bridged):
    previous = bridged.set_mode(request.param)
    capture.reset()
    try:
        yield request.param
    finally:
        bridged.set_mode(previous)


def _gradients(module, x):
    x = x.clone().requires_grad_()
    module(x).backward()
    return x.grad, module.weight.grad


@pytest.mark.parametrize("name", list(CASES))
def test_special_point_gradients_match_torch(mode, name):
    reference = Weighted(CASES[name])
    expected = _gradients(reference, POINTS)
    module = copy.deepcopy(reference).cuda()
    actual = _gradients(module, POINTS.cuda())
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6, equal_nan=True)
    if mode == "captured":
        assert capture.compiles and not capture.breaks  # the gradients came from a compiled program


class Lookup(torch.nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.embedding = torch.nn.Embedding(6, 3, **options)

    def forward(self, indices):
        return (self.embedding(indices) * torch.arange(1.0, 4.0, device=indices.device)).sum()


@pytest.mark.parametrize("options", [{"padding_idx": 0}, {"scale_grad_by_freq": True}, {"padding_idx": 2, "scale_grad_by_freq": True}])
def test_embedding_gradient_rules_match_torch(mode, options):
    torch.manual_seed(0)
    reference = Lookup(**options)
    module = copy.deepcopy(reference).cuda()
    indices = torch.tensor([[0, 1, 0, 2], [2, 2, 5, 0]])
    reference(indices).backward()
    module(indices.cuda()).backward()
    torch.testing.assert_close(module.embedding.weight.grad.cpu(), reference.embedding.weight.grad)


class TransformerLM(torch.nn.Transformer):
    """pytorch/examples' word_language_model shape: the causal mask made in forward and kept on
    the module (`self.src_mask`), a TransformerEncoder that checks whether it is causal."""

    def __init__(self, tokens=50, width=16):
        super().__init__(d_model=width, nhead=2, dim_feedforward=32, num_encoder_layers=2, dropout=0.0)
        self.src_mask = None
        self.input_emb = torch.nn.Embedding(tokens, width)
        self.width = width
        self.head = torch.nn.Linear(width, tokens)

    def forward(self, source):
        if self.src_mask is None or self.src_mask.size(0) != len(source):
            self.src_mask = torch.log(torch.tril(torch.ones(len(source), len(source)))).to(source.device)
        hidden = self.encoder(self.input_emb(source) * math.sqrt(self.width), mask=self.src_mask)
        return F.log_softmax(self.head(hidden), dim=-1)


def _train(model, data, device, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        out = model(data.to(device))
        loss = F.nll_loss(out.view(-1, 50), data.to(device).view(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_transformer_with_a_causal_mask_kept_on_the_module(mode):
    torch.manual_seed(0)
    reference = TransformerLM()
    model = copy.deepcopy(reference).cuda()
    data = torch.randint(0, 50, (7, 3))
    expected = _train(reference, data, "cpu")
    actual = _train(model, data, "cuda")
    assert actual == pytest.approx(expected, rel=1e-5)
    # The mask the first call stored is the program's output: a real tensor, not a tracer.
    assert not isinstance(read_value(model.src_mask), jax.core.Tracer)
    torch.testing.assert_close(model.src_mask.cpu(), reference.src_mask)
    if mode == "captured":
        assert not capture.breaks, capture.breaks


class Caching(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.last = None

    def forward(self, x):
        self.last = self.linear(x)
        return self.last.sum()


def test_a_forward_storing_a_computed_tensor_keeps_it_on_the_module(mode):
    """`self.last = ...` in a forward: the program returns the tensor and stores it after each
    run, as torch would have; the region does not break."""
    module = Caching().cuda()
    for step in range(3):
        x = torch.randn(3, 4)
        module(x.cuda()).backward()
        weight, bias = module.linear.weight.detach().cpu(), module.linear.bias.detach().cpu()
        torch.testing.assert_close(module.last.detach().cpu(), F.linear(x, weight, bias))
        assert not isinstance(read_value(module.last), jax.core.Tracer)
    assert module.last.requires_grad  # computed from the parameters, as in torch
    if mode == "captured":
        assert not capture.breaks, capture.breaks


def _device_spellings():
    return [0, "cuda:0", torch.device("cuda", 0), torch.device(0), torch.accelerator.current_accelerator()]


def test_every_spelling_of_the_cuda_device(bridged, tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(torch.nn.Linear(3, 2).state_dict(), path)
    for device in _device_spellings():
        module = torch.nn.Linear(3, 2).to(device)
        assert module.weight.device == torch.device("cuda", 0), device
        assert torch.ones(2, 3).to(device).device == torch.device("cuda", 0), device
        assert torch.zeros(2, device=device).device == torch.device("cuda", 0), device
        assert torch.load(path, map_location=device)["weight"].device == torch.device("cuda", 0), device
    assert torch.nn.Linear(3, 2).cuda(0).weight.device == torch.device("cuda", 0)
    assert isinstance(torch.device(0), torch.device) and torch.device("cpu").type == "cpu"
