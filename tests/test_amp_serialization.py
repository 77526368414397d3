"""Mixed precision (`torch.autocast("cuda")`, `GradScaler`) and checkpoints (`torch.save`/`torch.load`)
under the bridge, against eager torch."""

import copy
import io

import pytest
import torch
import torch.nn as nn

from conftest import run_python
from bridge.runtime import BridgeTensor


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


@pytest.mark.cpu_exact
def test_autocast_bfloat16_matches_torch_cpu_autocast(bridged):
    model = _model()
    bridged_model = copy.deepcopy(model).cuda()
    x = torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        actual = bridged_model(x.cuda())
        assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual.cpu(), expected)


def test_cuda_amp_autocast_defaults_to_float16(bridged):
    layer = nn.Linear(4, 4).cuda()
    with torch.cuda.amp.autocast():
        assert layer(torch.randn(2, 4, device="cuda")).dtype == torch.float16


def test_grad_scaler_training_matches_torch(bridged):
    model = _model()
    bridged_model = copy.deepcopy(model).cuda()
    data = [(torch.randn(6, 8), torch.randn(6, 4)) for _ in range(4)]

    def train(net, device):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
        for x, y in data:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(net(x.to(device)).float(), y.to(device))
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return [p.detach().cpu() for p in net.parameters()], scaler.get_scale()

    expected, expected_scale = train(model, "cpu")
    actual, actual_scale = train(bridged_model, "cuda")
    assert actual_scale == expected_scale
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-3)  # bf16 autocast arithmetic


def test_checkpoint_written_under_bridge_loads_in_plain_torch(bridged, tmp_path):
    model = _model().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8, device="cuda")).sum().backward()
    optimizer.step()
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "whole": model}, path)
    expected = {name: value.cpu() for name, value in model.state_dict().items()}
    torch.save(expected, tmp_path / "expected.pt")
    check = (
        "import torch\n"
        f"c = torch.load({str(path)!r}, weights_only=False)\n"
        f"e = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        "assert all(type(v) is torch.Tensor and torch.equal(v, e[k]) for k, v in c['model'].items())\n"
        "assert all(type(p) is torch.nn.Parameter for p in c['whole'].parameters())\n"
        "assert c['optimizer']['state'][0]['exp_avg'].device.type == 'cpu'\n"
        "print('ok')\n"
    )
    result = run_python("-c", check)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_model_saved_on_the_bridge_loads_back_onto_it(bridged, tmp_path):
    """pytorch/examples' word_language_model saves its whole model (on 'cuda') and loads it
    back with a plain torch.load: as in torch, the model comes back on the device it was saved
    from. The checkpoint still loads in plain torch, onto the CPU; a checkpoint mixing host
    tensors in stays as torch.load gives it."""
    model = _model().cuda()
    path = tmp_path / "model.pt"
    with open(path, "wb") as handle:
        torch.save(model, handle)
    torch.save(model.state_dict(), tmp_path / "state.pt")
    torch.save({"model": model.state_dict(), "count": torch.tensor(3)}, tmp_path / "mixed.pt")
    with open(path, "rb") as handle:
        loaded = torch.load(handle, weights_only=False)
    assert all(isinstance(p, BridgeTensor) and p.is_cuda for p in loaded.parameters())
    x = torch.randn(2, 8, device="cuda")
    torch.testing.assert_close(loaded(x).cpu(), model(x).cpu())
    state = torch.load(tmp_path / "state.pt")
    assert all(isinstance(value, BridgeTensor) for value in state.values())
    assert type(torch.load(tmp_path / "state.pt", map_location="cpu")["0.weight"]) is torch.Tensor
    mixed = torch.load(tmp_path / "mixed.pt")
    assert type(mixed["count"]) is torch.Tensor and type(mixed["model"]["0.weight"]) is torch.Tensor
    check = (
        "import torch\n"
        f"m = torch.load({str(path)!r}, weights_only=False)\n"
        "assert all(type(p) is torch.nn.Parameter and p.device.type == 'cpu' for p in m.parameters())\n"
        f"s = torch.load({str(tmp_path / 'state.pt')!r})\n"
        "assert all(type(v) is torch.Tensor for v in s.values())\n"
        "print('ok')\n"
    )
    result = run_python("-c", check)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_load_with_map_location_cuda_lands_on_bridge(bridged):
    buffer = io.BytesIO()
    state = {"weight": torch.randn(3, 3), "nested": [torch.arange(4)], "step": 7}
    torch.save(state, buffer)
    for map_location in ("cuda", "cuda:0", torch.device("cuda"), 0):
        buffer.seek(0)
        loaded = torch.load(buffer, map_location=map_location)
        assert isinstance(loaded["weight"], BridgeTensor) and loaded["weight"].is_cuda
        assert isinstance(loaded["nested"][0], BridgeTensor)
        assert torch.equal(loaded["weight"].cpu(), state["weight"]) and loaded["step"] == 7
    buffer.seek(0)
    assert type(torch.load(buffer)["weight"]) is torch.Tensor  # no map_location: stays on the CPU
    buffer.seek(0)
    assert type(torch.load(buffer, map_location="cpu")["weight"]) is torch.Tensor


def test_checkpoint_written_on_a_gpu_machine_loads_onto_the_cpu(bridged, monkeypatch):
    """A checkpoint whose storages name 'cuda:0' (written by torch on a GPU) loads where
    map_location says; map_location='cpu' keeps it on the CPU, as torch does."""
    state = {"weight": torch.randn(3, 3), "step": 7}
    buffer = io.BytesIO()
    with monkeypatch.context() as patched:
        patched.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(state, buffer)
    for map_location in ("cpu", torch.device("cpu"), {"cuda:0": "cpu"}):
        buffer.seek(0)
        loaded = torch.load(buffer, map_location=map_location)
        assert type(loaded["weight"]) is torch.Tensor and torch.equal(loaded["weight"], state["weight"])
    buffer.seek(0)
    assert isinstance(torch.load(buffer)["weight"], BridgeTensor)  # where it was saved: the bridge's 'cuda'


def test_load_state_dict_into_bridged_model(bridged):
    source = _model()
    target = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).cuda()
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    target.load_state_dict(torch.load(buffer, map_location="cuda"))
    x = torch.randn(2, 8)
    torch.testing.assert_close(target(x.cuda()).cpu(), source(x))


def test_grad_scaler_ops_are_mapped_and_back_off_on_overflow(bridged):
    from bridge.runtime import stats

    grads = [torch.tensor([1.0, float("inf")], device="cuda"), torch.tensor([2.0, 4.0], device="cuda")]
    found = torch.zeros((), device="cuda")
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((), 0.5, device="cuda"))
    assert found.item() == 1.0 and grads[1].cpu().tolist() == [1.0, 2.0]
    scale, tracker = torch.full((), 8.0, device="cuda"), torch.zeros((), dtype=torch.int32, device="cuda")
    torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2)
    assert scale.item() == 4.0 and tracker.item() == 0
    no_inf = torch.zeros((), device="cuda")
    for expected_scale, expected_tracker in ((4.0, 1), (8.0, 0)):
        torch._amp_update_scale_(scale, tracker, no_inf, 2.0, 0.5, 2)
        assert (scale.item(), tracker.item()) == (expected_scale, expected_tracker)
    for op in (torch.ops.aten._amp_foreach_non_finite_check_and_unscale.default, torch.ops.aten._amp_update_scale.default):
        assert stats.op_rung[op] == stats.MAPPED
