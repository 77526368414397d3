"""More neural-network mappings against eager torch (distances, embedding bags, losses and pooling
ops whose backward torch's autograd reaches), and lazy modules under the bridge."""

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
    from runtime.tensor import BridgeTensor, to_torch

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
