"""More neural-network mappings against eager torch (distances, embedding bags, losses and pooling
ops whose backward torch's autograd reaches), and lazy modules under the bridge."""

import copy

import pytest
import torch
import torch.nn as nn

from op_testing import through_bridge

# ---------------------------------------------------------------- lazy modules


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.LazyLinear(5), (3, 7)),
        (lambda: nn.LazyConv2d(4, 3), (2, 3, 6, 6)),
        (lambda: nn.LazyBatchNorm1d(), (4, 6)),
    ],
)
def test_lazy_module_materializes_on_the_bridge_device(bridged, make, shape):
    from bridge.runtime.tensor import BridgeTensor, to_torch

    eager = make().to(torch.float64)
    moved = make().to("cuda", torch.float64)
    assert all(nn.parameter.is_lazy(parameter) for parameter in moved.parameters())
    x = torch.randn(shape, dtype=torch.float64)
    eager(x)
    moved(x.to("cuda"))
    for parameter in list(moved.parameters()) + list(moved.buffers()):
        assert isinstance(parameter, BridgeTensor) and str(parameter.device) == "cuda:0"
        assert not nn.parameter.is_lazy(parameter)
    assert all(isinstance(p, nn.Parameter) or getattr(p, "_is_param", False) for p in moved.parameters())
    with torch.no_grad():
        for mine, theirs in zip(moved.parameters(), eager.parameters()):
            mine.copy_(theirs.to("cuda"))
    expected, actual = eager(x), moved(x.to("cuda"))
    torch.testing.assert_close(to_torch(actual), expected)
    expected.sum().backward()
    actual.sum().backward()
    for mine, theirs in zip(moved.parameters(), eager.parameters()):
        torch.testing.assert_close(to_torch(mine.grad), theirs.grad)


# ---------------------------------------------------------------- ops against eager torch, values and gradients


def sample(*shape, dtype=torch.float64, seed=0, low=-2.0, high=2.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low).to(dtype)


def integers(high, *shape, seed=1):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


F = nn.functional
WEIGHT = sample(10, 4, seed=5)
BAG_INDICES = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0, 0])
SAMPLES = torch.rand(2, 3, 2, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

try:  # torch 2.13's chunked linear_cross_entropy
    from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

    _CHUNKED = LinearCrossEntropyOptions(batch_chunk_size=2, allow_retain_graph=True)
except ImportError:  # pragma: no cover - older torch
    _CHUNKED = None

# name -> (function of the inputs, inputs); the inputs that are floating point get gradients.
CASES = {
    "cdist p=2 direct": (lambda a, b: torch.cdist(a, b), (sample(2, 5, 3), sample(2, 4, 3, seed=1))),
    "cdist p=2 by matrix products": (lambda a, b: torch.cdist(a, b), (sample(30, 3), sample(4, 3, seed=1))),
    "cdist p=1 broadcast batch": (lambda a, b: torch.cdist(a, b, p=1.0), (sample(2, 1, 5, 3), sample(3, 4, 3, seed=1))),
    "cdist p=0.5": (lambda a, b: torch.cdist(a, b, p=0.5), (sample(5, 3), sample(4, 3, seed=1))),
    "cdist p=3": (lambda a, b: torch.cdist(a, b, p=3.0), (sample(5, 3), sample(4, 3, seed=1))),
    "cdist p=inf": (lambda a, b: torch.cdist(a, b, p=float("inf")), (sample(5, 3), sample(4, 3, seed=1))),
    "cdist p=0": (lambda a, b: torch.cdist(a, b, p=0.0), (sample(5, 3), sample(4, 3, seed=1))),
    "pdist p=2": (lambda a: F.pdist(a), (sample(6, 3),)),
    "pdist p=1.5": (lambda a: F.pdist(a, p=1.5), (sample(6, 3),)),
    "pdist p=inf": (lambda a: F.pdist(a, p=float("inf")), (sample(6, 3),)),
    "embedding_bag sum": (lambda w, i, o: F.embedding_bag(i, w, o, mode="sum"), (WEIGHT, BAG_INDICES, torch.tensor([0, 4, 4]))),
    "embedding_bag mean padding_idx": (
        lambda w, i, o: F.embedding_bag(i, w, o, mode="mean", padding_idx=4),
        (WEIGHT, BAG_INDICES, torch.tensor([0, 4, 4, 9])),
    ),
    "embedding_bag max include_last_offset": (
        lambda w, i, o: F.embedding_bag(i, w, o, mode="max", include_last_offset=True),
        (WEIGHT, BAG_INDICES, torch.tensor([0, 3, 3, 10])),
    ),
    "embedding_bag 2-d input": (lambda w, i: F.embedding_bag(i, w, mode="mean"), (WEIGHT, BAG_INDICES.reshape(2, 5))),
    "embedding_bag per_sample_weights": (
        lambda w, i, o, s: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=s),
        (WEIGHT, BAG_INDICES, torch.tensor([0, 6]), sample(10, seed=3)),
    ),
    "interpolate nearest 1d": (lambda x: F.interpolate(x, size=7, mode="nearest"), (sample(2, 3, 5),)),
    "interpolate nearest 3d": (lambda x: F.interpolate(x, scale_factor=1.7, mode="nearest"), (sample(1, 2, 3, 4, 3),)),
    "interpolate nearest-exact 1d": (lambda x: F.interpolate(x, size=3, mode="nearest-exact"), (sample(2, 3, 5),)),
    "interpolate nearest-exact 2d": (lambda x: F.interpolate(x, size=(5, 3), mode="nearest-exact"), (sample(1, 2, 4, 4),)),
    "interpolate linear": (lambda x: F.interpolate(x, size=9, mode="linear"), (sample(2, 3, 5),)),
    "interpolate linear align_corners": (lambda x: F.interpolate(x, size=4, mode="linear", align_corners=True), (sample(2, 3, 5),)),
    "interpolate bicubic": (lambda x: F.interpolate(x, size=(7, 3), mode="bicubic"), (sample(1, 2, 4, 5),)),
    "interpolate bicubic align_corners": (
        lambda x: F.interpolate(x, scale_factor=1.5, mode="bicubic", align_corners=True),
        (sample(1, 2, 4, 5),),
    ),
    "interpolate trilinear": (lambda x: F.interpolate(x, size=(3, 5, 2), mode="trilinear"), (sample(1, 2, 2, 3, 4),)),
    "interpolate bilinear antialias down": (
        lambda x: F.interpolate(x, size=(3, 4), mode="bilinear", antialias=True),
        (sample(1, 2, 8, 9),),
    ),
    "interpolate bilinear antialias up": (
        lambda x: F.interpolate(x, size=(6, 7), mode="bilinear", antialias=True),
        (sample(1, 2, 3, 4),),
    ),
    "adaptive_max_pool3d": (lambda x: F.adaptive_max_pool3d(x, (2, 3, 2)), (sample(1, 2, 4, 5, 3),)),
    "fractional_max_pool2d": (
        lambda x: F.fractional_max_pool2d(x, 2, output_size=(4, 3), _random_samples=SAMPLES.to(x.device)),
        (sample(2, 3, 7, 6),),
    ),
    "fractional_max_pool2d unbatched": (
        lambda x: F.fractional_max_pool2d(x, 2, output_size=(4, 3), _random_samples=SAMPLES.to(x.device)),
        (sample(3, 7, 6),),
    ),
    "fractional_max_pool3d": (
        lambda x: F.fractional_max_pool3d(x, 2, output_size=(3, 2, 3), _random_samples=SAMPLES[:, :, :1].expand(2, 3, 3).to(x.device)),
        (sample(2, 3, 5, 4, 6),),
    ),
    "max_unpool2d": (
        lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2),
        (sample(1, 2, 4, 6),),
    ),
    "bilinear": (lambda a, b, w: F.bilinear(a, b, w), (sample(3, 4), sample(3, 5, seed=1), sample(2, 4, 5, seed=2))),
    "multi_margin_loss p=1 weight": (
        lambda x, t: F.multi_margin_loss(x, t, weight=sample(5, seed=3, low=0.5).to(x.device)),
        (sample(4, 5), integers(5, 4)),
    ),
    "multi_margin_loss p=2 none": (lambda x, t: F.multi_margin_loss(x, t, p=2, reduction="none"), (sample(4, 5), integers(5, 4))),
    "multilabel_margin_loss": (
        lambda x, t: F.multilabel_margin_loss(x, t),
        (sample(3, 4), torch.tensor([[3, 0, -1, 1], [0, 1, 2, 3], [-1, 2, 0, 1]])),
    ),
    "multilabel_margin_loss none": (
        lambda x, t: F.multilabel_margin_loss(x, t, reduction="none"),
        (sample(3, 4), torch.tensor([[3, 0, -1, -1], [0, 1, 2, 3], [2, -1, -1, -1]])),
    ),
    "multilabel_margin_loss sum 1-d": (
        lambda x, t: F.multilabel_margin_loss(x, t, reduction="sum"),
        (sample(4), torch.tensor([2, 1, -1, -1])),
    ),
    "multilabel_margin_loss none 1-d": (  # a 0-dim loss, as torch's kernels give
        lambda x, t: F.multilabel_margin_loss(x, t, reduction="none"),
        (sample(4), torch.tensor([2, 1, -1, -1])),
    ),
    "ctc_loss": (
        lambda x, t: F.ctc_loss(x.log_softmax(2), t, [8, 6, 5], [4, 2, 0]),
        (sample(8, 3, 5), integers(4, 3, 4) + 1),
    ),
    "ctc_loss concatenated zero_infinity": (
        lambda x, t: F.ctc_loss(x.log_softmax(2), t, [6, 2], [3, 3], reduction="sum", zero_infinity=True),
        (sample(6, 2, 4), integers(3, 6) + 1),
    ),
    "ctc_loss tensor lengths": (
        lambda x, t: F.ctc_loss(x.log_softmax(2), t, torch.tensor([7, 5]).to(x.device), torch.tensor([3, 1]).to(x.device)),
        (sample(7, 2, 4), integers(3, 2, 3) + 1),
    ),
    "linear_cross_entropy chunked mean, weights, ignore_index": (
        lambda x, w, b, t: F.linear_cross_entropy(
            x, w, t, linear_bias=b, weight=sample(6, seed=9, low=0.5).to(x.device),
            ignore_index=2, options=_CHUNKED,
        ),
        (sample(5, 4), sample(6, 4, seed=1), sample(6, seed=2), integers(6, 5)),
    ),
    "linear_cross_entropy chunked none": (
        lambda x, w, t: F.linear_cross_entropy(x, w, t, reduction="none", ignore_index=1, options=_CHUNKED),
        (sample(5, 4), sample(6, 4, seed=1), integers(6, 5)),
    ),
    "replication pad negative": (lambda x: F.pad(x, (-1, 2, 1, -2), mode="replicate"), (sample(1, 2, 4, 5),)),
}

if _CHUNKED is None:
    CASES = {name: case for name, case in CASES.items() if not name.startswith("linear_cross_entropy")}

GRID = sample(2, 4, 3, 2, seed=4, low=-1.2, high=1.2)
for _mode in ("bilinear", "nearest", "bicubic"):
    for _padding in ("zeros", "border", "reflection"):
        for _align in (False, True):
            CASES[f"grid_sample {_mode} {_padding} align_corners={_align}"] = (
                lambda x, g, m=_mode, p=_padding, a=_align: F.grid_sample(x, g, mode=m, padding_mode=p, align_corners=a),
                (sample(2, 3, 5, 6), GRID),
            )

GRID_3D = sample(1, 2, 3, 4, 3, seed=6, low=-1.2, high=1.2)
for _mode in ("bilinear", "nearest"):
    for _padding in ("zeros", "border", "reflection"):
        CASES[f"grid_sample 3d {_mode} {_padding}"] = (
            lambda x, g, m=_mode, p=_padding: F.grid_sample(x, g, mode=m, padding_mode=p, align_corners=p == "border"),
            (sample(1, 2, 3, 4, 5), GRID_3D),
        )


@pytest.mark.parametrize("name", sorted(CASES))
def test_against_torch_through_bridge(bridged, name):
    function, inputs = CASES[name]
    through_bridge(function, *inputs)


@pytest.mark.parametrize(
    "function",
    [
        lambda x: F.unfold(x, 2),
        lambda x: F.pad(x, (0, 0, -1, 1), mode="replicate"),
    ],
    ids=["unfold", "replicate"],
)
def test_empty_batch(bridged, function):
    through_bridge(function, sample(0, 2, 4, 5))


def test_resize_as(bridged):
    through_bridge(lambda x, y: x.clone().resize_as_(y), sample(3, 4), sample(3, 4, seed=1), differentiable=False)


def test_rrelu_with_noise_draws_and_writes_noise(bridged):
    from bridge.runtime.tensor import to_bridge, to_torch

    x = sample(200, dtype=torch.float32)
    results = []
    for _ in range(2):
        noise = to_bridge(torch.zeros(200))
        torch.manual_seed(3)
        out = torch.ops.aten.rrelu_with_noise(to_bridge(x), noise, 0.1, 0.3, True)
        results.append((to_torch(out), to_torch(noise)))
    (out, noise), (again, noise_again) = results
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, again)
    torch.testing.assert_close(noise, noise_again)
    negative = x <= 0
    assert torch.all(noise[~negative] == 1)
    assert torch.all((noise[negative] >= 0.1) & (noise[negative] <= 0.3))
    assert len(set(noise[negative].tolist())) > 1
    torch.testing.assert_close(out, x * noise)
    eval_noise = to_bridge(torch.zeros(200))
    evaluated = torch.ops.aten.rrelu_with_noise(to_bridge(x), eval_noise, 0.1, 0.3, False)
    torch.testing.assert_close(to_torch(evaluated), F.leaky_relu(x, 0.2))
    # Through autograd: the gradient is the slope drawn for each element.
    leaf = to_bridge(x).requires_grad_(True)
    F.rrelu(leaf, 0.1, 0.3, training=True).sum().backward()
    grad = to_torch(leaf.grad)
    assert torch.all(grad[~negative] == 1) and torch.all((grad[negative] >= 0.1) & (grad[negative] <= 0.3))


# ---------------------------------------------------------------- recurrent layers


@pytest.mark.parametrize("mode", ["eager", "captured"])
@pytest.mark.parametrize(
    "options",
    [
        dict(num_layers=2),
        dict(num_layers=2, bidirectional=True, batch_first=True),
        dict(bias=False),
    ],
)
def test_float32_lstm_runs_its_onednn_layer_on_the_bridge(bridged, mode, options):
    """To torch's C++ a bridge tensor is a CPU tensor, so a float32 nn.LSTM calls oneDNN's
    mkldnn_rnn_layer (and its backward): it was unmapped, ran on the host CPU and broke the
    capture of every module holding an LSTM."""
    from bridge.runtime import capture, stats

    previous = bridged.set_mode(mode)
    capture.reset()
    try:
        torch.manual_seed(0)
        eager = nn.LSTM(3, 4, **options)
        moved = copy.deepcopy(eager).to("cuda")
        x = torch.randn(5, 2, 3, requires_grad=True)
        # An initial state of its own, but for the batch-first layer (which starts from zeros).
        state = None
        if not options.get("batch_first"):
            state = tuple(torch.randn(eager.num_layers, 2, 4, requires_grad=True) for _ in range(2))

        def run(module, x, state):
            output, (h, c) = module(x) if state is None else module(x, state)
            (output.square().sum() + 2 * h.sum() + 3 * c.square().sum()).backward()
            return output, h, c

        expected = run(eager, x, state)
        moved_x = x.detach().to("cuda").requires_grad_()
        moved_state = None if state is None else tuple(value.detach().to("cuda").requires_grad_() for value in state)
        actual = run(moved, moved_x, moved_state)
        for got, want in zip(actual, expected):
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(moved_x.grad.cpu(), x.grad, rtol=1e-5, atol=1e-5)
        if state is not None:
            for got, want in zip(moved_state, state):
                torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-5)
        for got, want in zip(moved.parameters(), eager.parameters()):
            torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-5)
        assert stats.op_rung.get(torch.ops.aten.mkldnn_rnn_layer.default) == stats.MAPPED
        assert not capture.breaks
        if mode == "eager":
            assert stats.op_rung.get(torch.ops.aten.mkldnn_rnn_layer_backward.default) == stats.MAPPED
    finally:
        bridged.set_mode(previous)
