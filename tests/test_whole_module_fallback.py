"""The ladder's whole-module rung (bridge/whole_module.py): a module whose forward reaches an op with no mapping
and no decomposition runs, from its next call, as its torch.export translated into one JAX function;
where export fails it keeps the CPU fallback, and --strict makes the op an error naming the module.

The tables serve every Core ATen op, so the tests hide one entry: `hardswish_unmapped` removes
aten.hardswish's mapping and its decomposition from dispatch for a test's duration (torch.export's
own decomposition of it, into ops the tables serve, stays)."""

import copy
import json
import warnings

import pytest
import torch

from conftest import run_python

aten = torch.ops.aten
HARDSWISH = aten.hardswish.default


@pytest.fixture
def hardswish_unmapped(bridged, monkeypatch, distribution_validation_kept):
    from bridge import whole_module
    from bridge.runtime import dispatch, registry, stats

    decomposition = dispatch._decomposition
    monkeypatch.delitem(registry.MAPPINGS, HARDSWISH)
    monkeypatch.setattr(dispatch, "_decomposition", lambda op: None if op is HARDSWISH else decomposition(op))
    plans = (HARDSWISH, aten.hardswish_.default)

    def forget_plans():
        for op in plans:
            dispatch._plans.pop(op, None)
            stats.op_rung.pop(op, None)

    forget_plans()
    stats.reset()
    whole_module.reset()
    yield
    forget_plans()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return torch.nn.functional.hardswish(self.norm(self.linear(x))) * 2  # the unmapped op


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.block(x))


def _train(net, batches, device):
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    losses, grads = [], []
    for x in batches:
        optimizer.zero_grad()
        loss = net(x.to(device)).square().mean()
        loss.backward()
        grads.append([p.grad.cpu().clone() for p in net.parameters()])
        optimizer.step()
        losses.append(loss.item())
    return losses, grads


def _close(actual, expected):
    torch.testing.assert_close(actual.cpu(), expected, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("mode", ["eager", "captured"])
def test_module_runs_whole_trains_like_torch(hardswish_unmapped, bridged, mode):
    """Values, gradients, optimizer updates and BatchNorm's running statistics as in eager torch,
    with the module's later calls run as its exported program (in captured mode, inside the
    enclosing region's program: no graph break)."""
    from bridge import report, whole_module
    from bridge.runtime import capture, stats

    previous = bridged.set_mode(mode)
    capture.reset()
    try:
        torch.manual_seed(0)
        reference = Net()
        net = copy.deepcopy(reference).to("cuda")
        batches = [torch.randn(8, 4) for _ in range(4)]
        expected_losses, expected_grads = _train(reference, batches, "cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the first eager call's CPUFallbackWarning
            losses, grads = _train(net, batches, "cuda")
        for loss, expected in zip(losses, expected_losses):
            assert loss == pytest.approx(expected, rel=1e-5)
        for step, expected in zip(grads, expected_grads):
            for grad, expected_grad in zip(step, expected):
                _close(grad, expected_grad)
        for actual, expected in zip(net.state_dict().values(), reference.state_dict().values()):
            _close(actual, expected)
        assert int(net.block.norm.num_batches_tracked) == 4

        [record] = whole_module.records
        assert (record.module, record.op, record.status, record.programs) == ("Block", str(HARDSWISH), "exported", 1)
        assert "hardswish(self.norm(self.linear(x)))" in record.site
        if mode == "eager":
            # the first call ran the op on the host; the next three ran the exported program
            assert stats.fallback_calls[HARDSWISH] == 1 and record.calls == 3
        else:
            # the first trace met the op, the call ran eagerly (exporting Block), and the next
            # trace took Block's program into Net's: the op never ran on the host
            assert stats.fallback_calls[HARDSWISH] == 0 and record.traced >= 1
            assert stats.summary()["by_rung"][stats.CPU_FALLBACK] == 0  # nor does the report say it did
            assert capture.breaks == []
            assert "Net (train)" in {compiled.region for compiled in capture.compiles}
        text = report.summary_text()
        assert "1 module(s) run whole through torch.export" in text
        assert "module Block ran whole through torch.export" in text
        assert report._data()["whole_modules"][0]["status"] == "exported"
        assert "Modules run whole through torch.export" in report.html_page(report._data())

        # eval mode is another export (the training flags key the programs)
        reference.eval()
        net.eval()
        x = torch.randn(5, 4)
        _close(net(x.to("cuda")), reference(x))
        assert record.programs == 2
    finally:
        bridged.set_mode(previous)


def test_random_ops_draw_once_per_call(hardswish_unmapped, bridged):
    """Dropout in a module run whole: a new mask each call, and the backward (which runs the
    forward again) uses the mask the forward drew."""

    class Dropped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dropout = torch.nn.Dropout(0.5)

        def forward(self, x):
            return torch.nn.functional.hardswish(self.dropout(x))

    previous = bridged.set_mode("eager")
    try:
        module = Dropped().to("cuda")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module(torch.ones(4, device="cuda"))  # the CPU fallback; exported at the next call
        masks = []
        for _ in range(2):
            x = (torch.rand(64) * 0.5 + 0.5).to("cuda").requires_grad_()
            y = module(x)
            y.sum().backward()
            kept = (y != 0).cpu()
            assert 0 < kept.sum() < 64
            z = 2 * x.detach().cpu()  # dropout's scaling; hardswish's slope at z in (0, 3) is (2z + 3) / 6
            _close(y, torch.where(kept, z * (z + 3) / 6, 0.0))
            _close(x.grad, torch.where(kept, 2 * (2 * z + 3) / 6, 0.0))
            masks.append(kept)
        assert not torch.equal(masks[0], masks[1])
    finally:
        bridged.set_mode(previous)


class Branches(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.export refuses it
            return torch.nn.functional.hardswish(x)
        return -x


@pytest.mark.parametrize("mode", ["eager", "captured"])
def test_data_dependent_control_flow_keeps_the_cpu_fallback(hardswish_unmapped, bridged, mode):
    from bridge import report, whole_module
    from bridge.runtime import stats

    previous = bridged.set_mode(mode)
    try:
        module = Branches()
        x = torch.linspace(-3, 5, 9)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                _close(module(x.to("cuda")), torch.nn.functional.hardswish(x))
        [record] = whole_module.records
        assert record.status == "not exported"
        assert "data-dependent" in record.reason
        assert stats.fallback_calls[HARDSWISH] == 3
        assert "module Branches could not be exported (torch.export refused data-dependent" in report.summary_text()
    finally:
        bridged.set_mode(previous)


def test_strict_names_the_op_the_module_and_the_line(hardswish_unmapped, bridged):
    from bridge.runtime.config import settings

    settings.strict = True
    try:
        with pytest.raises(bridged.UnsupportedOpError) as raised:
            Block().to("cuda")(torch.randn(3, 4, device="cuda"))
    finally:
        settings.strict = False
    message = str(raised.value)
    assert str(HARDSWISH) in message
    assert "inside the module Block" in message
    assert f"{__file__}:" in message and "hardswish(self.norm(self.linear(x))) * 2  # the unmapped op" in message


# A custom operator nobody maps: torch.export keeps it in the graph, so the module it is in
# cannot run whole either (the report says why) and the op runs on the host.
SCRIPT = '''
import torch

@torch.library.custom_op("bridgetest::mystery2", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1

@mystery.register_fake
def _(x):
    return torch.empty_like(x)

class Layer(torch.nn.Module):
    def forward(self, x):
        return mystery(x) + 1

layer = Layer()
x = torch.ones(2, device="cuda")
for _ in range(2):
    print(layer(x).cpu().tolist())
'''


def test_runner_reports_the_module_and_strict_fails(tmp_path):
    script = tmp_path / "uses_custom_op.py"
    script.write_text(SCRIPT)
    report = tmp_path / "report.json"
    result = run_python("-m", "bridge", "run", "--report", str(report), str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[4.0, 4.0]", "[4.0, 4.0]"]
    [record] = json.loads(report.read_text())["whole_modules"]
    assert (record["module"], record["op"], record["status"]) == ("Layer", "bridgetest.mystery2.default", "not exported")
    assert "still calls bridgetest.mystery2.default" in record["reason"]
    assert "module Layer could not be exported" in result.stderr

    strict = run_python("-m", "bridge", "run", "--strict", str(script))
    assert strict.returncode == 1
    assert "UnsupportedOpError" in strict.stderr
    assert "bridgetest.mystery2.default" in strict.stderr
    assert "inside the module Layer" in strict.stderr
    assert "return mystery(x) + 1" in strict.stderr
