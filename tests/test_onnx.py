"""ONNX models through the bridge (runtime/onnx_graph.py and the ONNX table, op_mappings/onnx_ops*.py):
torch models exported with torch.onnx.export and run by `bridge.load` give eager torch's outputs;
the JAX function and its weights work in plain JAX (jit, grad); `bridge check` lists what has no
mapping; bad files, ops and opsets each give one error naming the file and the node; and the
ONNX backend suite's node cases of every op these exports emit pass.

Exporter: the TorchScript exporter (`dynamo=False`) for most models: it exports the same graphs
under torch 2.13 and 2.14 in a fraction of a second, where the dynamo exporter (torch's default,
through onnxscript) takes seconds per model; the dynamo exporter is tested on the models it exports
and the TorchScript one does not (whisper) and on a small model. Tolerances as
tests/test_hf_models.py's logits: rtol 1e-5, atol 1e-6 of the largest output (float32 sums in
another order).
"""

import copy
import logging
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason='the ONNX route needs the onnx package: pip install -e ".[onnx]" (in the test extra)')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bridge  # noqa: E402
from bridge.compat.onnx_conformance import ATOL, RTOL  # noqa: E402
from bridge.compat.onnx_conformance import compare_outputs as _compare  # noqa: E402
from bridge.compat.onnx_conformance import export_onnx as _export  # noqa: E402
from bridge.runtime import errors  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_exporter():
    """torch.onnx's exporters warn and log at length; torch.distributions' validation is kept as
    found (the dynamo exporter starts Dynamo, whose first start turns it off for the process)."""
    validating = torch.distributions.Distribution._validate_args
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)
    torch.distributions.Distribution.set_default_validate_args(validating)


def _parity(model, args, tmp_path, dynamo=False, **options):
    """Export, load through the bridge, compare with eager torch; the worst difference."""
    torch.manual_seed(0)
    path = _export(copy.deepcopy(model), args, tmp_path / "model.onnx", dynamo, **options)
    with torch.no_grad():
        expected = model.eval()(*args)
    with bridge.active():
        program = bridge.load(path)
        actual = program(*args)
    return _compare(actual, expected)


# ------------------------------------------------------------- models like the script corpus'


class Classifier(torch.nn.Module):  # compat/scripts/image_classifier.py
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 10),
        )

    def forward(self, x):
        return self.features(x)


class Generator(torch.nn.Module):  # compat/scripts/gan.py
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, 2), torch.nn.Tanh())

    def forward(self, z):
        return self.net(z), torch.sigmoid(self.net(z).sum(-1))


class Vae(torch.nn.Module):  # compat/scripts/vae.py (the noise passed in: its draw is the script's)
    def __init__(self):
        super().__init__()
        self.encoder, self.mean, self.log_var = torch.nn.Linear(16, 12), torch.nn.Linear(12, 4), torch.nn.Linear(12, 4)
        self.decoder = torch.nn.Sequential(torch.nn.Linear(4, 12), torch.nn.ReLU(), torch.nn.Linear(12, 16))

    def forward(self, x, noise):
        hidden = torch.relu(self.encoder(x))
        mean, log_var = self.mean(hidden), self.log_var(hidden)
        z = mean + noise * torch.exp(0.5 * log_var)
        logits = self.decoder(z)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, x, reduction="sum")
        return logits, loss - 0.5 * torch.sum(1 + log_var - mean.pow(2) - log_var.exp())


class LstmModel(torch.nn.Module):  # compat/scripts/lstm_lm.py
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(50, 16)
        self.lstm = torch.nn.LSTM(16, 24, num_layers=2, batch_first=True)
        self.gru = torch.nn.GRU(24, 8, bidirectional=True)
        self.out = torch.nn.Linear(16, 50)

    def forward(self, tokens):
        hidden, _ = self.lstm(self.embedding(tokens))
        hidden, _ = self.gru(hidden)
        return torch.log_softmax(self.out(hidden), -1)


class Seq2Seq(torch.nn.Module):  # compat/scripts/transformer_seq2seq.py
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(20, 16)
        self.transformer = torch.nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.out = torch.nn.Linear(16, 20)

    def forward(self, source, target):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(target.shape[1])
        return self.out(self.transformer(self.embedding(source), self.embedding(target), tgt_mask=mask))


class ConvAttention(torch.nn.Module):  # compat/scripts/inference_half.py (float32 here)
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(8, 16, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, 16)
        self.attention = torch.nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        hidden = torch.nn.functional.gelu(self.norm(self.conv(x))).transpose(1, 2)
        attended, _ = self.attention(hidden, hidden, hidden)
        probabilities = torch.softmax(attended.mean(1), -1)
        return torch.topk(probabilities, 3)


class Recommender(torch.nn.Module):  # compat/scripts/embedding_recommender.py
    def __init__(self):
        super().__init__()
        self.users = torch.nn.Embedding(30, 8)
        self.items = torch.nn.EmbeddingBag(40, 8, mode="mean")

    def forward(self, users, items, offsets):
        return (self.users(users) * self.items(items, offsets)).sum(-1)


class Upsampler(torch.nn.Module):  # the resampling ops a decoder uses
    def __init__(self):
        super().__init__()
        self.up = torch.nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1)
        self.pool = torch.nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False)

    def forward(self, x):
        x = self.up(x)
        bilinear = torch.nn.functional.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
        nearest = torch.nn.functional.interpolate(x, size=(5, 7), mode="nearest")
        return self.pool(bilinear), nearest, torch.nn.functional.pad(x, (1, 2, 0, 1), mode="reflect")


def _generator():
    return torch.Generator().manual_seed(0)


MODELS = {
    "classifier": (Classifier, lambda g: (torch.randn(2, 3, 16, 16, generator=g),)),
    "generator": (Generator, lambda g: (torch.randn(5, 4, generator=g),)),
    "vae": (Vae, lambda g: (torch.rand(3, 16, generator=g), torch.randn(3, 4, generator=g))),
    "lstm": (LstmModel, lambda g: (torch.randint(0, 50, (2, 7), generator=g),)),
    "seq2seq": (Seq2Seq, lambda g: (torch.randint(0, 20, (2, 6), generator=g), torch.randint(0, 20, (2, 5), generator=g))),
    "conv_attention": (ConvAttention, lambda g: (torch.randn(2, 8, 10, generator=g),)),
    "recommender": (
        Recommender,
        lambda g: (torch.randint(0, 30, (3,), generator=g), torch.randint(0, 40, (7,), generator=g), torch.tensor([0, 2, 5])),
    ),
    "upsampler": (Upsampler, lambda g: (torch.randn(1, 4, 5, 6, generator=g),)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_exported_model_gives_torch_s_outputs(name, tmp_path):
    build, inputs = MODELS[name]
    torch.manual_seed(0)
    _parity(build(), inputs(_generator()), tmp_path)


def test_the_dynamo_exporter_s_graphs_run(tmp_path):
    """torch.onnx.export's default exporter (opset 18 and later, onnxscript's functions inlined)."""
    torch.manual_seed(0)
    _parity(ConvAttention(), (torch.randn(2, 8, 10, generator=_generator()),), tmp_path, dynamo=True)


# ---------------------------------------------------------------- HuggingFace transformers

HF_TORCHSCRIPT = ("gpt2", "bert", "llama", "t5", "vit")
# whisper: the TorchScript exporter has no aten::diff; the dynamo exporter exports it.
# mixtral: neither exporter exports it (aten::histc; the dynamo exporter's conversion fails).
# switch: exported, but its experts take the tokens routed to each (NonZero): it runs node by node.
HF_DYNAMO = ("whisper",)


def _hf_case(name):
    pytest.importorskip("transformers", reason='the hf test group needs HuggingFace transformers: pip install -e ".[hf]"')
    from tests.test_hf_models import CASES

    case = CASES[name]
    torch.manual_seed(0)
    model = case.build().eval()
    inputs = case.inputs(torch.Generator().manual_seed(0))
    inputs.pop("labels")
    if name in ("t5", "whisper", "switch"):
        inputs["decoder_input_ids"] = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    names = list(inputs)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            return self.model(**dict(zip(names, args)), use_cache=False, return_dict=False)[0]

    return Logits(), tuple(inputs.values())


@pytest.mark.hf
@pytest.mark.parametrize("name", HF_TORCHSCRIPT + HF_DYNAMO)
def test_transformers_model_gives_torch_s_logits(name, tmp_path):
    model, args = _hf_case(name)
    _parity(model, args, tmp_path, dynamo=name in HF_DYNAMO)


@pytest.mark.hf
def test_a_shape_from_the_data_runs_node_by_node(tmp_path):
    """Switch Transformers' experts take the tokens routed to each (NonZero): no static program
    holds that shape, so the program says so once and runs node by node, with torch's logits."""
    model, args = _hf_case("switch")
    path = _export(copy.deepcopy(model), args, tmp_path / "switch.onnx")
    with torch.no_grad():
        expected = model(*args)
    with bridge.active():
        program = bridge.load(path)
        with pytest.warns(errors.BridgeWarning, match=r"NonZero.*node by node"):
            actual = program(*args)
        _compare(actual, expected)
        _compare(program(*args), expected)  # the second call goes straight to node by node


# --------------------------------------------------------------------------- the JAX side


def test_jax_function_and_state_work_in_plain_jax(tmp_path):
    """program.jax_function over program.state: jit-able, and jax.grad of it gives torch's
    gradients with respect to the weights (initializers by name)."""
    torch.manual_seed(0)
    model = Generator()
    x = torch.randn(5, 4, generator=_generator())
    path = _export(copy.deepcopy(model), (x,), tmp_path / "generator.onnx")
    with bridge.active():
        program = bridge.load(path)
    function, state = program.jax_function, program.state
    assert all(isinstance(value, jax.Array) for value in state.values())
    array = jnp.asarray(x.numpy())

    def loss(weights):
        first, second = function(weights, array)
        return first.sum() + second.sum()

    gradients = jax.jit(jax.grad(loss))(state)
    first, second = model(x)
    (first.sum() + second.sum()).backward()
    by_shape = {tuple(parameter.shape): parameter.grad.numpy() for parameter in model.parameters()}
    for name, gradient in gradients.items():
        expected = by_shape[gradient.shape] if gradient.shape in by_shape else by_shape[gradient.shape[::-1]].T
        np.testing.assert_allclose(np.asarray(gradient), expected, rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------------- check and errors


def _model_with(op_type, opset=17, domain=""):
    from onnx import TensorProto, helper

    node = helper.make_node(op_type, ["x"], ["y"], name="the_node", domain=domain)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=imports)


def _check(path):
    return subprocess.run([sys.executable, "-m", "bridge", "check", str(path)], capture_output=True, text=True, timeout=120)


def test_check_lists_nodes_with_no_mapping(tmp_path):
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Mystery", ["a"], ["b"], domain="example.custom"),
        helper.make_node("Mystery", ["b"], ["y"], domain="example.custom"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)])
    path = tmp_path / "custom.onnx"
    onnx.save(model, path)
    result = _check(path)
    assert result.returncode == 1, result.stderr
    assert "no mapping: 1 op(s), 2 node(s)" in result.stdout
    assert "2  example.custom::Mystery" in result.stdout
    assert "mapped: 1 op(s), 1 node(s)" in result.stdout
    assert "custom.onnx" in result.stderr


def test_check_passes_an_exported_model(tmp_path):
    path = _export(Classifier(), (torch.randn(1, 3, 8, 8),), tmp_path / "classifier.onnx")
    result = _check(path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Conv" in result.stdout and "no mapping" not in result.stdout


def test_an_op_with_no_mapping_names_the_file_and_node(tmp_path):
    path = tmp_path / "custom.onnx"
    onnx.save(_model_with("Mystery", domain="example.custom"), path)
    with bridge.active(), pytest.raises(errors.UnsupportedOnnxOpError, match=r"custom\.onnx: node 'the_node' \(example\.custom::Mystery\).*bridge check"):
        bridge.load(path)(torch.ones(2))


def test_an_unsupported_opset_says_which_to_export(tmp_path):
    path = tmp_path / "old.onnx"
    onnx.save(_model_with("Relu", opset=5), path)
    with bridge.active(), pytest.raises(errors.UnsupportedOpsetError, match=r"old\.onnx: .*opset 5.*opset_version="):
        bridge.load(path)


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "missing"])
def test_a_file_it_cannot_read_says_so(tmp_path, damage):
    path = tmp_path / "model.onnx"
    if damage != "missing":
        _export(Generator(), (torch.randn(2, 4),), path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3] if damage == "truncated" else b"\x00\xff" * 64 + data[128:])
    with bridge.active(), pytest.raises(errors.SavedModelError, match=r"model\.onnx: .*(no such file|truncated)"):
        bridge.load(path)


# ------------------------------------------------------------------ the conformance suite


# The ops torch.onnx.export emits for the models above, the transformers models (both exporters)
# and the script corpus's models (python -m bridge.compat.onnx_conformance --corpus), whose node
# cases must all pass (the full sweep: python -m bridge.compat.onnx_conformance).
EMITTED_OPS = (
    "Abs", "Add", "And", "ArgMax", "AveragePool", "BatchNormalization", "Cast", "Concat", "Constant",
    "ConstantOfShape", "Conv", "ConvTranspose", "Cos", "CumSum", "Div", "Equal", "Erf", "Exp", "Expand", "Flatten",
    "Gather", "GatherND", "Gelu", "Gemm", "GlobalAveragePool", "Greater", "GreaterOrEqual", "GroupNormalization",
    "GRU", "Identity", "InstanceNormalization", "IsNaN", "LayerNormalization", "LeakyRelu", "Less", "LessOrEqual",
    "Log", "LogSoftmax", "Loop", "LSTM", "MatMul", "Max", "MaxPool", "Min", "Mul", "Neg", "NonZero", "Not",
    "OneHot", "Pad", "Pow", "Range", "Reciprocal", "ReduceMax", "ReduceMean", "ReduceSum", "Relu", "Reshape",
    "Resize", "ScatterElements", "ScatterND", "Shape", "Sigmoid", "Sin", "Slice", "Softmax", "SoftmaxCrossEntropyLoss", "Split", "Sqrt",
    "Squeeze", "Sub", "Tanh", "TopK", "Transpose", "Trilu", "Unsqueeze", "Where",
)


def _conformance_cases():
    from bridge.compat import onnx_conformance

    cases = [case for case in onnx_conformance.collect_cases() if onnx_conformance.case_op(case) in EMITTED_OPS]
    # The expanded forms of function ops run the same ops as the others: one form is enough here;
    # the cases listed as expected failures (with their reasons) are in the report.
    return [case for case in cases if "_expanded" not in case.name and case.name not in onnx_conformance.EXPECTED_CASE_FAILURES]


def test_conformance_cases_of_the_emitted_ops_pass():
    from bridge.compat import onnx_conformance
    from bridge.op_mappings import onnx_ops  # noqa: F401
    from bridge.runtime.onnx_graph import ONNX_OPS

    jax.config.update("jax_enable_x64", True)
    failures = {}
    cases = _conformance_cases()
    for case in cases:
        with np.errstate(all="ignore"):
            status, detail = onnx_conformance.run_case(case, ONNX_OPS)
        if status not in (onnx_conformance.PASSED, onnx_conformance.PASSED_KNOWN):
            failures[case.name] = detail
    assert len(cases) > 300
    assert not failures, failures
