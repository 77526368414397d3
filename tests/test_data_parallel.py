"""nn.DataParallel over several bridge devices (JAX's CPU backend split into two devices, in a
fresh process): the same outputs, gradients, parameters and BatchNorm statistics as torch's
replicas give, in eager and captured mode, without graph breaks.

torch's DataParallel needs CUDA devices, so the reference is its semantics written out in plain
torch: the batch split with chunk(), each chunk through the module with the parameters shared
(gradients add up over the replicas), the first replica on the module's own buffers and the
others on copies made before the call, the outputs concatenated."""

import pytest

from conftest import run_python

SCRIPT = r'''
import copy, json, sys, warnings
import torch

mode = sys.argv[1]
seen = []

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x, scale=1.0):
        if not torch.compiler.is_compiling():  # (eager mode: each chunk's device)
            seen.append(str(x.device))
        hidden = torch.relu(self.norm(self.fc1(x)))
        return {"logits": self.fc2(hidden) * scale, "hidden": hidden}


def replicas_in_plain_torch(module, x, count, scale):
    chunks = x.chunk(count)
    buffers = {name: value.clone() for name, value in module.named_buffers()}
    params = dict(module.named_parameters())
    outputs = [module(chunks[0], scale=scale)]
    for chunk in chunks[1:]:
        copies = {name: value.clone() for name, value in buffers.items()}
        outputs.append(torch.func.functional_call(module, {**params, **copies}, (chunk,), {"scale": scale}))
    return {key: torch.cat([out[key] for out in outputs]) for key in outputs[0]}


torch.manual_seed(0)
reference = Net()
bridged_net = copy.deepcopy(reference)
data = [(torch.randn(7, 5), torch.randint(0, 3, (7,))) for _ in range(4)]

opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
ref_logits = []
for step, (x, y) in enumerate(data):
    if step != 2:  # (step 2 adds its gradients to step 1's)
        opt_ref.zero_grad()
    out = replicas_in_plain_torch(reference, x, 2, 0.5)
    torch.nn.functional.cross_entropy(out["logits"], y).backward()
    ref_logits.append(out["logits"].detach())
    opt_ref.step()

import bridge
bridge.activate(mode=mode)
from bridge.runtime import capture
assert torch.cuda.device_count() == 2
model = torch.nn.DataParallel(bridged_net.cuda())
assert model.device_ids == [0, 1]
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    logits = []
    for step, (x, y) in enumerate(data):
        if step != 2:
            opt.zero_grad()
        out = model(x, scale=0.5)  # host tensors: scattered to the module's device
        assert out["logits"].device == torch.device("cuda", 0)
        torch.nn.functional.cross_entropy(out["logits"], y.cuda()).backward()
        logits.append(out["logits"].detach().cpu())
        opt.step()
    model.eval()
    reference.eval()
    with torch.no_grad():
        row = torch.randn(1, 5)
        small = model(row)  # one row: one chunk, one replica
        torch.testing.assert_close(small["logits"].cpu(), reference(row)["logits"], rtol=1e-5, atol=1e-6)

for got, expected in zip(logits, ref_logits):
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
for (name, p_ref), p in zip(reference.named_parameters(), model.module.parameters()):
    torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=1e-5, atol=1e-6, msg=name)
# BatchNorm's statistics: the first chunk's, as torch's first replica (on the module's buffers) wrote them
for (name, b_ref), b in zip(reference.named_buffers(), model.module.buffers()):
    torch.testing.assert_close(b.cpu(), b_ref, rtol=1e-5, atol=1e-6, msg=name)
assert int(model.module.norm.num_batches_tracked) == len(data)
assert not [str(w.message) for w in caught if "DataParallel" in str(w.message)]
if mode == "eager":  # each step's two chunks on the two devices, then the one row on the first
    assert [device for device in seen if device != "cpu"] == ["cuda:0", "cuda:1"] * 4 + ["cuda:0"], seen
print(json.dumps({"breaks": len(capture.breaks), "compiles": [c.region for c in capture.compiles]}))
'''


@pytest.mark.parametrize("mode", ["eager", "captured"])
def test_data_parallel_over_two_devices_matches_torchs_replicas(mode, tmp_path):
    script = tmp_path / "data_parallel.py"
    script.write_text(SCRIPT)
    done = run_python(str(script), mode, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import json

    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["breaks"] == 0
    if mode == "captured":
        # The module's region, one program per chunk shape, device and mode, each compiled once
        # (the copies on the second device are kept from step to step): the 4-row chunk on the
        # first device, the 3-row chunk on the second, the one-row batch in eval mode.
        assert record["compiles"] == ["Net (train)", "Net (train)", "Net (eval)"], record


SECOND_DEVICE = r'''
import json, sys
import torch

mode = sys.argv[1]
torch.manual_seed(0)
plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
dropped = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
data = [torch.randn(16, 4) for _ in range(3)]

import copy
import bridge
bridge.activate(mode=mode)
from bridge.runtime import capture

def train(net, device):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for x in data:
        opt.zero_grad()
        loss = net(x.to(device)).square().mean()
        loss.backward()
        opt.step()
    return loss

bridged = copy.deepcopy(plain).to("cuda:1")
loss = train(bridged, "cuda:1")
assert loss.device == torch.device("cuda", 1), loss.device
train(plain, "cpu")
for p_ref, p in zip(plain.parameters(), bridged.parameters()):
    assert p.device == torch.device("cuda", 1)
    torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=1e-5, atol=1e-6)
# Random ops on the second device: their values there, usable beside its other tensors.
noisy = train(dropped.to("cuda:1"), "cuda:1")
drawn = torch.rand(5, device="cuda:1")
assert drawn.device == torch.device("cuda", 1) and bool(((drawn >= 0) & (drawn < 1)).all())
assert bool(torch.isfinite(noisy + drawn.sum()))
print(json.dumps({"breaks": [str(b)[:300] for b in capture.breaks]}))
'''


@pytest.mark.parametrize("mode", ["eager", "captured"])
def test_a_model_on_the_second_device_trains_there(mode, tmp_path):
    """A model moved to `cuda:1` trains there, its random ops (dropout, `torch.rand`) drawing
    on that device: the random stream's key lives on the first device and is moved to an op's
    or a region's device (runtime/random.py). Before, their values landed on the first device
    and the next op refused the mix."""
    script = tmp_path / "second_device.py"
    script.write_text(SECOND_DEVICE)
    done = run_python(str(script), mode, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import json

    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"breaks": []}
