"""TorchScript through the bridge (runtime/torchscript.py, `bridge.load` of `.pt`, `bridge check`):
traced and scripted models give eager torch's results, buffers the graph writes and gradients come
back, an `if` on a tensor runs as jax.lax.cond, and bad files and untranslatable nodes fail with
one error naming the file and the node."""

import copy
import math
import warnings
from typing import List

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bridge
from bridge.runtime import torchscript
from bridge.runtime.errors import SavedModelError, TranslationError

RTOL, ATOL = 1e-5, 1e-5

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::torch.jit.TracerWarning")


def _array(tensor):
    return jnp.asarray(tensor.detach().numpy())


def _close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), expected.detach().numpy(), rtol=RTOL, atol=ATOL)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class Block(nn.Module):
    """Causal self-attention and an MLP, written out (views, a mask made in forward, softmax)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q = q.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
        k = k.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
        v = v.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(width // self.heads)
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=x.device), 1)
        attended = (scores.masked_fill(mask, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(batch, length, width)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 32, heads: int = 4, layers: int = 2, length: int = 16):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(1, length, width) * 0.02)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions[:, : ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Encoder(nn.Module):
    """torch's TransformerEncoderLayer: its scripted forward asks autograd whether to take a fused path."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.layer(x)


class Recurrent(nn.Module):
    """An LSTM: its scripted forward reads its weights as a list attribute (_flat_weights)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


MODELS = {
    "cnn": (SmallCNN, lambda: (torch.randn(2, 3, 16, 16),)),
    "gpt": (TinyGPT, lambda: (torch.randint(0, 50, (2, 12)),)),
    "encoder": (Encoder, lambda: (torch.randn(2, 5, 32),)),
    "lstm": (Recurrent, lambda: (torch.randn(2, 7, 8),)),
}


def _scripted(name, how, training):
    cls, make_args = MODELS[name]
    torch.manual_seed(0)
    module, args = cls().train(training), make_args()
    if how == "trace":
        return torch.jit.trace(module, args, check_trace=False), args
    return torch.jit.script(module), args


@pytest.mark.parametrize(
    "name, how, training",
    [("cnn", "trace", False), ("cnn", "script", True), ("gpt", "trace", False), ("gpt", "script", False),
     ("encoder", "script", False), ("lstm", "script", False), ("lstm", "trace", True)],
)
def test_models_give_torch_s_results(name, how, training):
    """Outputs and the buffers the graph writes (BatchNorm's running statistics in training mode)
    against the same ScriptModule run by torch."""
    scripted, args = _scripted(name, how, training)
    with bridge.active():
        function, state = torchscript.to_jax(scripted)
        out, new_state, _ = jax.jit(function)(state, *map(_array, args))
    expected = scripted(*args)  # (torch's run writes the module's buffers: after the bridge's)
    _close(out, expected)
    buffers = dict(scripted.named_buffers())
    for name_, buffer in buffers.items():
        _close(new_state[name_], buffer)
    if training and buffers:
        assert any(not np.array_equal(np.asarray(new_state[name_]), np.asarray(state[name_])) for name_ in buffers)


def test_gradients_through_jax_grad_are_torch_s():
    scripted, args = _scripted("cnn", "script", False)
    with bridge.active():
        function, state = torchscript.to_jax(scripted)
        names = [name for name, _ in scripted.named_parameters()]

        def loss(parameters):
            out, _, _ = function({**state, **parameters}, *map(_array, args))
            return (out**2).sum()

        gradients = jax.grad(loss)({name: state[name] for name in names})
    (scripted(*args) ** 2).sum().backward()
    for name, parameter in scripted.named_parameters():
        np.testing.assert_allclose(np.asarray(gradients[name]), parameter.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


@torch.jit.script
def control_flow(x: torch.Tensor, steps: int) -> torch.Tensor:
    outputs: List[torch.Tensor] = []
    for step in range(steps):
        x = torch.tanh(x * 1.5 + step)
        outputs.append(x)
    total = torch.stack(outputs).sum(0)
    if total.sum() > 0:
        total = total * 2
    else:
        total = -total
    if x.dim() == 2:
        total = total.t()
    return total


def test_scripted_function_with_control_flow_runs_as_one_program():
    """The loop (a Python trip count) unrolls, the list grows, `if x.dim() == 2` is decided while
    tracing and `if total.sum() > 0` becomes jax.lax.cond: one jitted program takes either branch."""
    x = torch.randn(3, 4)
    with bridge.active():
        function, state = torchscript.to_jax(control_flow)
        compiled = jax.jit(function, static_argnums=2)
        for sample in (x.abs(), -x.abs() - 1):
            out, _, _ = compiled(state, _array(sample), 3)
            _close(out, control_flow(sample, 3))
        assert compiled._cache_size() == 1


def test_a_loop_on_a_tensor_s_value_names_the_node():
    @torch.jit.script
    def halve_until_small(x: torch.Tensor) -> torch.Tensor:
        while x.abs().max() > 1:
            x = x / 2
        return x

    with bridge.active():
        function, state = torchscript.to_jax(halve_until_small)
        with pytest.raises(TranslationError, match=r"prim::Loop|aten::Bool.*test_torchscript\.py.*while x\.abs\(\)\.max\(\) > 1"):
            jax.jit(function)(state, _array(torch.randn(4) * 10))


def test_load_runs_a_pt_file_and_keeps_its_state(tmp_path):
    """`bridge.load` of a torch.jit.save archive: torch tensors in, bridge tensors out, running
    statistics carried from call to call, the JAX function and its state exposed."""
    scripted, (x,) = _scripted("cnn", "trace", True)
    path = tmp_path / "cnn.pt"
    torch.jit.save(scripted, str(path))
    reference = torch.jit.load(str(path))
    with bridge.active():
        program = bridge.load(path)
        assert callable(program.jax_function) and set(program.state) >= {"head.weight", "features.1.running_mean"}
        for _ in range(2):
            out = program(x.to("cuda"))
            assert isinstance(out, torch.Tensor) and out.device.type == "cuda"
            torch.testing.assert_close(out.cpu(), reference(x), rtol=RTOL, atol=ATOL)
        state = program.state_dict()
    buffers = dict(reference.named_buffers())
    torch.testing.assert_close(state["features.1.running_mean"], buffers["features.1.running_mean"], rtol=RTOL, atol=ATOL)
    assert int(state["features.1.num_batches_tracked"]) == int(buffers["features.1.num_batches_tracked"]) == 3  # (trace, 2 calls)


# ---------------------------------------------------------------- bad input


@torch.jit.script
class Counter:
    def __init__(self, start: int):
        self.count = start

    def bump(self) -> int:
        self.count += 1
        return self.count


class UsesAClass(nn.Module):
    """A TorchScript class instance: TorchScript objects have no translation."""

    def forward(self, x):
        counter = Counter(1)
        return x * counter.bump()


def test_bad_files_say_which_and_what_to_do(tmp_path):
    scripted, _ = _scripted("cnn", "script", False)
    good = tmp_path / "good.pt"
    torch.jit.save(scripted, str(good))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    checkpoint = tmp_path / "weights.pt"
    torch.save(scripted.state_dict(), checkpoint)
    with bridge.active():
        with pytest.raises(SavedModelError, match=r"missing\.pt: no such file.*torch\.jit\.save"):
            bridge.load(tmp_path / "missing.pt")
        with pytest.raises(SavedModelError, match=r"truncated\.pt: .*truncated or corrupt.*torch\.jit\.save"):
            bridge.load(truncated)
        with pytest.raises(SavedModelError, match=r"weights\.pt: .*not a TorchScript one.*load_state_dict"):
            bridge.load(checkpoint)


def test_a_node_without_translation_fails_at_load_naming_file_node_and_line(tmp_path):
    path = tmp_path / "object.pt"
    torch.jit.save(torch.jit.script(UsesAClass()), str(path))
    with bridge.active(), pytest.raises(TranslationError) as caught:
        bridge.load(path)  # before anything runs
    message = str(caught.value)
    assert str(path) in message and "prim::CreateObject" in message and "TorchScript class" in message, message
    assert "test_torchscript.py\", line" in message, message  # the source range TorchScript kept
    assert "Rewrite" in message


def test_a_traced_python_function_names_its_node():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, gradient):
            return gradient * 2

    class UsesFunction(nn.Module):
        def forward(self, x):
            return Double.apply(x) + 1

    traced = torch.jit.trace(UsesFunction(), (torch.randn(3),), check_trace=False)
    with bridge.active(), pytest.raises(TranslationError, match=r"prim::PythonOp.*Double.*torch\.autograd\.Function"):
        bridge.load(traced)


def test_check_lists_a_script_s_nodes_before_running(tmp_path, capsys):
    from bridge.cli import main

    scripted, _ = _scripted("gpt", "script", False)
    good, bad = tmp_path / "gpt.pt", tmp_path / "object.pt"
    torch.jit.save(scripted, str(good))
    torch.jit.save(torch.jit.script(UsesAClass()), str(bad))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:100])
    with bridge.active():
        assert main(["check", str(good)]) == 0
        printed = capsys.readouterr().out
        assert "aten.linear.default" in printed and "aten.softmax.int" in printed and torchscript.INTERPRETED in printed
        assert main(["check", str(bad)]) == 1
        printed = capsys.readouterr()
        assert "no translation: 3 op(s), 5 node(s)" in printed.out and "prim::CreateObject" in printed.out, printed.out
        assert main(["check", str(truncated)]) == 2
        assert "truncated.pt" in capsys.readouterr().err
        assert main(["check", str(tmp_path / "missing.pt")]) == 2


def test_moduleinfo_modules_through_torchscript():
    """compat/torchscript.py's sweep on a few ModuleInfo modules (the whole sweep writes
    compat/reports/torchscript.md): traced and scripted, in both modes."""
    from bridge.compat import torchscript as sweep

    names = ["nn.Linear", "nn.BatchNorm2d", "nn.GRU"]
    results = sweep.sweep(names, sources=("script", "load"))
    assert {result[0] for result in results} == set(names)
    failed = [result for result in results if result[3] not in (sweep.PASSED, sweep.NOT_SCRIPTED)]
    assert not failed, failed
    # torch cannot call a scripted nn.GRU (its overloaded forward): the 2 script pairs; the rest pass
    assert sum(result[3] == sweep.PASSED for result in results) == 10, results
