"""aten._grouped_mm (torch._grouped_mm, F.grouped_mm), the product of mixture-of-experts layers,
through the bridge's table against torch's CPU kernel, forward and backward, for the layouts
torch takes: 2d x 3d and 3d x 2d with offsets, 2d x 2d with offsets along the contraction,
3d x 3d without. torch's CPU kernel takes every layout; each case also checks torch against
plain matmuls per group, so that the oracle itself is pinned down."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from bridge.runtime import BridgeTensor, capture
from bridge.runtime.errors import CPUFallbackWarning

# The kernels want 16-byte aligned strides: sizes are multiples of 8.
GROUPS, M, K, N = 3, 8, 16, 24
OFFSETS = [16, 40, 64]  # ends of the groups (ragged: 16, 24 and 24 long)
OFFSETS_SHORT = [8, 8, 48]  # an empty group, and 16 rows past the last group


def _offsets(values):
    return torch.tensor(values, dtype=torch.int32)


def _spans(offs):
    start = 0
    for end in offs.tolist():
        yield start, end
        start = end


def _per_group(a, b, offs):
    """torch._grouped_mm's definition, with plain matmuls."""
    if a.dim() == 3 and b.dim() == 3:
        return torch.bmm(a, b)
    if a.dim() == 2 and b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=a.dtype)
        for group, (start, end) in enumerate(_spans(offs)):
            out[start:end] = a[start:end] @ b[group]
        return out
    if a.dim() == 3 and b.dim() == 2:
        out = torch.zeros(a.shape[1], b.shape[1], dtype=a.dtype)
        for group, (start, end) in enumerate(_spans(offs)):
            out[:, start:end] = a[group] @ b[:, start:end]
        return out
    return torch.stack([a[:, start:end] @ b[start:end] for start, end in _spans(offs)])


def _valid(out, a, b, offs):
    """The part of the output that belongs to a group (torch leaves the rest unwritten)."""
    if offs is None:
        return out
    last = offs[-1].item()
    if a.dim() == 2 and b.dim() == 3:
        return out[:last]
    if a.dim() == 3 and b.dim() == 2:
        return out[:, :last]
    return out


def _case(layout, offsets, dtype, generator):
    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    total = 64
    if layout == "2d x 3d":
        return randn(total, K), randn(GROUPS, K, N), _offsets(offsets)
    if layout == "2d x 3d, transposed weights":  # how transformers passes (experts, out, in) weights
        return randn(total, K), randn(GROUPS, N, K).transpose(-2, -1), _offsets(offsets)
    if layout == "3d x 2d":
        return randn(GROUPS, M, K), randn(K, total), _offsets(offsets)
    if layout == "2d x 2d":
        return randn(M, total), randn(total, N), _offsets(offsets)
    return randn(GROUPS, M, K), randn(GROUPS, K, N), None


LAYOUTS = ["2d x 3d", "2d x 3d, transposed weights", "3d x 2d", "2d x 2d", "3d x 3d"]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=5e-2),
             torch.float16: dict(rtol=2e-3, atol=1e-2)}


CASES = [(layout, offsets) for layout in LAYOUTS for offsets in (OFFSETS, OFFSETS_SHORT)
         if layout != "3d x 3d" or offsets is OFFSETS]  # 3d x 3d takes no offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout, offsets", CASES,
                         ids=[f"{layout}, {'full' if offsets is OFFSETS else 'empty group and tail'}" for layout, offsets in CASES])
def test_grouped_mm_forward_and_backward_match_torch(bridged, layout, offsets, dtype):
    a, b, offs = _case(layout, offsets, dtype, torch.Generator().manual_seed(0))
    expected = torch._grouped_mm(a, b, offs)
    reference = _per_group(a.float(), b.float(), offs)
    torch.testing.assert_close(_valid(expected, a, b, offs).float(), _valid(reference, a, b, offs), **TOLERANCE[dtype])

    a_leaf, b_leaf = a.clone().requires_grad_(), b.clone().requires_grad_()
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch._grouped_mm(a_leaf, b_leaf, offs).backward(_valid_mask(grad_out, a, b, offs))

    a_bridge = a.detach().to("cuda").requires_grad_()
    b_bridge = b.detach().to("cuda").requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CPUFallbackWarning)  # the table's entry, not torch on the host
        actual = F.grouped_mm(a_bridge, b_bridge, offs=None if offs is None else offs.cuda())
        assert isinstance(actual, BridgeTensor) and actual.dtype == expected.dtype and actual.shape == expected.shape
        actual.backward(_valid_mask(grad_out, a, b, offs).cuda())
    torch.testing.assert_close(_valid(actual.detach().cpu(), a, b, offs), _valid(expected, a, b, offs), **TOLERANCE[dtype])
    if offs is not None and offs[-1] < 64 and layout.startswith("2d x 3d"):
        assert not actual.detach().cpu()[offs[-1]:].any(), "rows past the last group are zeros"
    for bridge_grad, torch_grad, ragged in ((a_bridge.grad.cpu(), a_leaf.grad, _ragged_dim(a, b, "a")),
                                            (b_bridge.grad.cpu(), b_leaf.grad, _ragged_dim(a, b, "b"))):
        if ragged is None:
            torch.testing.assert_close(bridge_grad, torch_grad, **TOLERANCE[dtype])
            continue
        # Past the last group torch's backward leaves its output unwritten too; those entries
        # take no part in the product, so their gradient is zero.
        last = offs[-1].item()
        torch.testing.assert_close(bridge_grad.narrow(ragged, 0, last), torch_grad.narrow(ragged, 0, last), **TOLERANCE[dtype])
        assert not bridge_grad.narrow(ragged, last, bridge_grad.shape[ragged] - last).any()


def _ragged_dim(a, b, operand):
    """The dimension of a 2-d operand that `offs` cuts into groups (None for a 3-d one)."""
    if operand == "a":
        return None if a.dim() == 3 else (0 if b.dim() == 3 else 1)
    return None if b.dim() == 3 else (1 if a.dim() == 3 else 0)


def _valid_mask(grad, a, b, offs):
    """A gradient that is zero where torch's output is unwritten (its contents are arbitrary)."""
    masked = torch.zeros_like(grad)
    view = _valid(masked, a, b, offs)
    view.copy_(_valid(grad, a, b, offs))
    return masked


def test_grouped_mm_runs_inside_a_captured_region(bridged):
    """Mixtral-style experts: tokens sorted by expert, one grouped product per projection, in a
    module that the bridge captures and whose gradients JAX computes."""

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            self.up = torch.nn.Parameter(torch.randn(GROUPS, K, N, generator=generator) * 0.1)
            self.down = torch.nn.Parameter(torch.randn(GROUPS, N, K, generator=generator) * 0.1)

        def forward(self, tokens, offs):
            hidden = F.silu(torch._grouped_mm(tokens, self.up, offs))
            return torch._grouped_mm(hidden, self.down, offs)

    offs = _offsets(OFFSETS)
    tokens = torch.randn(64, K, generator=torch.Generator().manual_seed(2))
    results = []
    for device in ("cpu", "cuda"):
        experts = Experts().to(device)
        for _ in range(2):  # the second call replays the compiled program
            experts.zero_grad()
            out = experts(tokens.to(device), offs.to(device))
            out.pow(2).sum().backward()
        results.append((out.detach().cpu(), experts.up.grad.cpu(), experts.down.grad.cpu()))
    for actual, expected in zip(results[1], results[0]):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    assert [c.region for c in capture.compiles if c.region.startswith("Experts")], "the module was not captured"
    assert not [b for b in capture.breaks if b.region.startswith("Experts")], capture.breaks


@pytest.mark.parametrize("call, message", [
    (lambda: torch._grouped_mm(torch.randn(64), torch.randn(3, 16, 24), _offsets(OFFSETS)), "mat_a has to be 2 or 3d"),
    (lambda: torch._grouped_mm(torch.randn(64, 16), torch.randn(3, 24, 24), _offsets(OFFSETS)), "contraction dimension"),
    (lambda: torch._grouped_mm(torch.randn(64, 16), torch.randn(3, 16, 24)), "Have to provide offsets"),
    (lambda: torch._grouped_mm(torch.randn(3, 8, 16), torch.randn(3, 16, 24), _offsets(OFFSETS)), "Have to provide offsets"),
    (lambda: torch._grouped_mm(torch.randn(64, 16), torch.randn(3, 16, 24), _offsets(OFFSETS).long()), "int32"),
    (lambda: torch._grouped_mm(torch.randn(64, 16), torch.randn(4, 16, 24), _offsets(OFFSETS)), "batch sizes have to match"),
    (lambda: torch._grouped_mm(torch.randn(2, 8, 16), torch.randn(3, 16, 24)), "batched dimension has to match"),
    (lambda: torch._grouped_mm(torch.randn(64, 16), torch.randn(3, 16, 24), _offsets(OFFSETS), bias=torch.randn(3, 24)),
     "Bias not supported"),
    (lambda: torch._grouped_mm(torch.randn(64, 16).double(), torch.randn(3, 16, 24).double(), _offsets(OFFSETS)),
     "Float32, BFloat16 or Float16"),
], ids=["1d", "contraction", "no offsets", "offsets for 3d x 3d", "int64 offsets", "groups", "batch", "bias", "float64"])
def test_grouped_mm_refuses_what_torch_refuses(bridged, call, message):
    with pytest.raises(RuntimeError, match=message):
        call()  # torch on the host
    moved = _on_bridge(call)
    with pytest.raises(RuntimeError, match=message):
        moved()


def _on_bridge(call):
    def moved():
        original = torch._grouped_mm

        def on_bridge(a, b, offs=None, **kwargs):
            kwargs = {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
            return original(a.cuda(), b.cuda(), None if offs is None else offs.cuda(), **kwargs)

        torch._grouped_mm = on_bridge
        try:
            return call()
        finally:
            torch._grouped_mm = original

    return moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_jax_gradients_of_the_entry_match_torch_for_every_layout(bridged, dtype):
    """In captured regions JAX differentiates the entry itself (JAX has no derivative of a ragged
    contraction, the 2d x 2d layout: the entry supplies one)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bridge.runtime.registry import MAPPINGS
    from bridge.runtime.tensor import numpy_to_torch, torch_to_numpy

    entry = MAPPINGS[torch.ops.aten._grouped_mm.default].call
    for layout, offsets in CASES:
        a, b, offs = _case(layout, offsets, dtype, torch.Generator().manual_seed(3))
        a_leaf, b_leaf = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = torch._grouped_mm(a_leaf, b_leaf, offs)
        cotangent = _valid_mask(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype), a, b, offs)
        out.backward(cotangent)
        jax_offs = None if offs is None else jnp.asarray(offs.numpy())
        _, pullback = jax.vjp(lambda x, y: entry(x, y, jax_offs), jnp.asarray(torch_to_numpy(a)), jnp.asarray(torch_to_numpy(b)))
        grad_a, grad_b = (numpy_to_torch(np.array(g)) for g in pullback(jnp.asarray(torch_to_numpy(cotangent))))
        for jax_grad, torch_grad, ragged in ((grad_a, a_leaf.grad, _ragged_dim(a, b, "a")), (grad_b, b_leaf.grad, _ragged_dim(a, b, "b"))):
            if ragged is not None:
                jax_grad, torch_grad = (g.narrow(ragged, 0, offs[-1].item()) for g in (jax_grad, torch_grad))
            torch.testing.assert_close(jax_grad, torch_grad, **TOLERANCE[dtype], msg=lambda m: f"{layout}: {m}")
