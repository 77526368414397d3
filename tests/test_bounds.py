"""Indices out of range raise torch's error (runtime/bounds.py), where JAX's gathers would clamp
them or give NaN: in eager ops whose index values are on the host, and in captured regions whose
index is one of the region's inputs (or a view of one with all its elements)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from bridge.runtime import capture


def _cases():
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    return x, w, {
        "embedding": lambda x, w, put: F.embedding(put(torch.tensor([1, 9])), w),
        "embedding, negative": lambda x, w, put: F.embedding(put(torch.tensor([1, -1])), w),
        "index_select": lambda x, w, put: x.index_select(1, put(torch.tensor([9]))),
        "gather": lambda x, w, put: x.gather(1, put(torch.tensor([[9]]))),
        "gather, negative": lambda x, w, put: x.gather(1, put(torch.tensor([[-1]]))),
        "cross_entropy": lambda x, w, put: F.cross_entropy(x, put(torch.tensor([0, 1, 7, 2]))),
        "cross_entropy, negative": lambda x, w, put: F.cross_entropy(x, put(torch.tensor([0, 1, -3, 2]))),
        "cross_entropy 2d": lambda x, w, put: F.cross_entropy(x.reshape(1, 4, 5, 1), put(torch.full((1, 5, 1), 4))),
        "x[:, index]": lambda x, w, put: x[:, put(torch.tensor([9]))],
        "x[:, -6]": lambda x, w, put: x[:, put(torch.tensor([-6]))],
        "x[index] (rows)": lambda x, w, put: x[put(torch.tensor([4]))],
    }


_, _, CASES = _cases()
_IN_RANGE = {
    "embedding": lambda x, w, put: F.embedding(put(torch.tensor([0, 4])), w),
    "gather": lambda x, w, put: x.gather(1, put(torch.tensor([[4], [0], [1], [2]]))),
    "cross_entropy, ignore_index": lambda x, w, put: F.cross_entropy(x, put(torch.tensor([0, 1, -100, 4]))),
    "x[:, -5]": lambda x, w, put: x[:, put(torch.tensor([-5, 4]))],
    "mask": lambda x, w, put: x[x > 0],
}


@pytest.mark.parametrize("mode", ["eager", "captured"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_an_index_out_of_range_raises_torchs_error(bridged, mode, name):
    x, w, cases = _cases()
    call = cases[name]
    with pytest.raises((IndexError, RuntimeError)) as expected:  # torch's own, on the CPU
        call(x, w, lambda t: t)
    previous = bridged.set_mode(mode)
    try:
        with pytest.raises(expected.type) as raised:
            call(x.cuda(), w.cuda(), lambda t: t.cuda())
    finally:
        bridged.set_mode(previous)
    message = str(raised.value)
    assert str(expected.value).splitlines()[0].split(" for dimension")[0] in message, message
    assert "test_bounds.py" in message  # the user's line


@pytest.mark.parametrize("name", sorted(_IN_RANGE))
def test_indices_in_range_give_torchs_results(bridged, name):
    x, w, _ = _cases()
    call = _IN_RANGE[name]
    expected = call(x, w, lambda t: t)  # torch's own, on the CPU
    actual = call(x.cuda(), w.cuda(), lambda t: t.cuda())
    torch.testing.assert_close(actual.cpu(), expected)


class _TokenModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 6)

    def forward(self, idx, targets):
        logits = self.head(self.embedding(idx))
        return F.cross_entropy(logits.view(-1, 6), targets.view(-1))


def test_a_captured_region_checks_its_index_inputs(captured):
    """nanoGPT's shape of a model: token ids into an embedding, targets (viewed flat) into the
    loss. A bad token id or target raises torch's error at the call, naming the model's line,
    whether the call runs the program compiled before or traces anew; good calls stay one
    program."""
    torch.manual_seed(0)
    reference = _TokenModel()
    model = copy.deepcopy(reference).cuda()
    generator = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(0, 10, (2, 3), generator=generator), torch.randint(0, 6, (2, 3), generator=generator)
    for _ in range(3):
        torch.testing.assert_close(model(idx.cuda(), targets.cuda()).cpu(), reference(idx, targets))
    with pytest.raises(IndexError, match="Target 6 is out of bounds") as raised:
        model(idx.cuda(), torch.tensor([[1, 2, 3], [0, 6, 1]]).cuda())  # the compiled program's shapes
    assert "F.cross_entropy(logits.view(-1, 6), targets.view(-1))" in str(raised.value)
    with pytest.raises(IndexError, match="index out of range in self") as raised:
        model(torch.tensor([[1, 2, 12]]).cuda(), torch.tensor([[1, 2, 3]]).cuda())  # new shapes: a new trace
    assert "self.embedding(idx)" in str(raised.value)
    torch.testing.assert_close(model(idx.cuda(), targets.cuda()).cpu(), reference(idx, targets))
    assert not capture.breaks, capture.breaks
    # One program: the call with new shapes was traced, and refused before its program compiled.
    assert len([record for record in capture.compiles if record.region.startswith("_TokenModel")]) == 1


class _RelabellingModel(_TokenModel):
    def forward(self, idx, targets):
        targets[targets == 7] = -100  # in place, on the region's input, before the loss reads it
        logits = self.head(self.embedding(idx))
        return F.cross_entropy(logits.view(-1, 6), targets.view(-1))


def test_a_captured_input_written_before_its_index_op_is_not_checked_on_its_old_value(captured):
    """The input's host value is what the call passed; the loss reads it after the region wrote
    it. torch accepts this (the 7 became the ignored -100), and so must the bridge."""
    torch.manual_seed(0)
    reference = _RelabellingModel()
    model = copy.deepcopy(reference).cuda()
    idx, targets = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 7, 2]])
    for _ in range(2):
        expected = reference(idx, targets.clone())
        torch.testing.assert_close(model(idx.cuda(), targets.cuda()).cpu(), expected)
    assert not capture.breaks, capture.breaks
