"""Argument objects carried through captured regions: an object holding tensors (a key-value
cache) is keyed by its structure, its tensors are the program's inputs and what the region
writes into them in place is written back to the caller's object. A call that changes the
object's attributes (a cache's lazy initialization) is kept in a program that gives the caller's
object its new state; calls that each change it (a cache that grows) run op by op and then break
the region with a reason. HuggingFace `generate` with
`cache_implementation="static"` (the bridge's choice where the call leaves the cache to HF, see
tests/test_hf_models.py) runs as two programs: the prefill and every decoding step."""

import copy

import pytest
import torch

from bridge.runtime import capture


class Cache:
    """A user's cache: tensors written in place, a plain attribute read by the forward."""

    def __init__(self, device, scale=1.0):
        self.totals = torch.zeros(4, device=device)
        self.steps = torch.zeros((), dtype=torch.long, device=device)
        self.scale = scale


class Accumulating(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, cache):
        y = self.fc(x)
        cache.totals.add_(y.detach().sum(0) * cache.scale)
        cache.steps.add_(1)
        return y + cache.totals, cache


def test_an_object_written_in_place_is_carried(captured):
    torch.manual_seed(0)
    reference = Accumulating()
    model = copy.deepcopy(reference).to("cuda")
    data = torch.Generator().manual_seed(1)
    for scale in (1.0, 1.0, 0.5):
        cache_ref, cache = Cache("cpu", scale), Cache("cuda", scale)  # a new object each round
        for _ in range(3):
            x = torch.randn(2, 4, generator=data)
            (out_ref, returned_ref), (out, returned) = reference(x, cache_ref), model(x.cuda(), cache)
            torch.testing.assert_close(out.detach().cpu(), out_ref.detach(), rtol=1e-5, atol=1e-6)
            assert returned is cache and returned_ref is cache_ref  # the caller's object comes back
        torch.testing.assert_close(cache.totals.cpu(), cache_ref.totals, rtol=1e-5, atol=1e-6)
        assert int(cache.steps) == 3
    assert not capture.breaks, capture.breaks
    # One program per structure: the third round's scale is part of the key.
    assert len([record for record in capture.compiles if record.region.startswith("Accumulating")]) == 2, capture.compiles


class Growing(torch.nn.Module):
    def forward(self, x, cache):
        cache.history = cache.history + [x * 2]  # rebinds an attribute: a replay would not
        return torch.stack(cache.history).sum(0)


class History:
    def __init__(self):
        self.history = []


def test_an_object_whose_attributes_change_runs_op_by_op_then_breaks(captured):
    model, history, history_ref = Growing(), History(), History()
    for step in range(7):
        x = torch.full((3,), float(step))
        torch.testing.assert_close(model(x.cuda(), history).cpu(), Growing()(x, history_ref))
    assert len(history.history) == 7
    (record,) = capture.breaks
    assert "changes the attributes of its argument History" in record.reason, record
    # The first call's change is kept in a program (as a lazy initialization's), the next three
    # ran op by op, and the fifth broke the region.
    assert record.calls == 7 - 4, record


class LazyLayer:
    def __init__(self):
        self.keys, self.ready = None, False


class LazyCache:
    """A cache as HF's StaticCache builds one: its buffers made by the first call, a step counter
    on the host until then."""

    def __init__(self):
        self.layers = [LazyLayer(), LazyLayer()]
        self.seen = torch.tensor(0)


class Filling(torch.nn.Module):
    def forward(self, x, cache):
        cache.seen = cache.seen.to(x.device)  # the same tensor once it is there
        for number, layer in enumerate(cache.layers):
            if not layer.ready:
                layer.keys, layer.ready = torch.zeros(4, 3, device=x.device), True
            layer.keys.index_copy_(0, cache.seen.reshape(1), (x * (number + 1)).unsqueeze(0))
        cache.seen.add_(1)
        return sum(layer.keys.sum(0) for layer in cache.layers)


def test_a_call_that_initializes_an_object_is_kept_in_a_program(captured):
    """The first call sets the object's attributes (new buffers, flags, a counter moved to the
    device): one program does so on every fresh object, keeping its inner objects' identity."""
    model = Filling()
    for round in range(2):  # the second round's fresh cache replays the first round's programs
        cache, cache_ref = LazyCache(), LazyCache()
        layers = list(cache.layers)
        for step in range(3):
            x = torch.full((3,), float(step + round))
            torch.testing.assert_close(model(x.cuda(), cache).cpu(), Filling()(x, cache_ref))
        assert cache.layers[0] is layers[0] and cache.layers[1] is layers[1]
        assert cache.layers[1].ready and int(cache.seen) == 3
        torch.testing.assert_close(cache.layers[1].keys.cpu(), cache_ref.layers[1].keys)
    assert not capture.breaks, capture.breaks
    # The initializing call's program, and the one of the calls after it.
    assert [record.region for record in capture.compiles] == ["Filling (train)"] * 2, capture.compiles


def _gpt2():
    transformers = pytest.importorskip("transformers", reason='the HF cases need transformers: pip install -e ".[hf]"')
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64, eos_token_id=None)
    reference = transformers.GPT2LMHeadModel(config).eval()
    model = transformers.GPT2LMHeadModel(config).eval()
    model.load_state_dict(reference.state_dict())
    return reference, model.to("cuda")


@pytest.mark.hf
def test_generate_with_a_static_cache_decodes_with_one_program(captured):
    reference, model = _gpt2()
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = reference.generate(ids, **settings)
    assert model.generate(ids.cuda(), **settings).cpu().tolist() == expected.tolist()
    assert not capture.breaks, capture.breaks
    # The prefill (which initializes the cache: a _Reshaped program) and every decoding step:
    # one program each, none for the model's parts.
    regions = sorted(record.region for record in capture.compiles)
    assert regions == ["GPT2LMHeadModel (eval)", "Module._wrapped_call_impl"], capture.compiles
    compiled = len(capture.compiles)
    assert model.generate(ids.cuda(), **settings).cpu().tolist() == expected.tolist()
    assert len(capture.compiles) == compiled, capture.compiles[compiled:]  # a new cache, the same programs


@pytest.mark.hf
def test_generate_with_a_dynamic_cache_says_what_to_use(captured, monkeypatch):
    """With the bridge's choice of HF's StaticCache off (BRIDGE_HF_STATIC_CACHE=0), generate
    grows HF's DynamicCache: the regions break, and say what to use."""
    from bridge.runtime.config import settings

    monkeypatch.setattr(settings, "hf_static_cache", False)
    reference, model = _gpt2()
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert model.generate(ids.cuda(), **settings).cpu().tolist() == reference.generate(ids, **settings).tolist()
    reasons = {record.reason for record in capture.breaks}
    assert reasons and all("cache_implementation='static'" in reason for reason in reasons), reasons


class Scaled(torch.nn.Module):
    def forward(self, x, holder):
        return x * holder.scale.item()


class Holder:
    def __init__(self):
        self.scale = torch.tensor(3.0)  # on the host


def test_an_object_holding_a_host_tensor_is_not_kept_in_a_program(captured):
    """A host tensor inside an argument object would be a constant of the trace: such calls run
    op by op (the right values whatever the tensor holds) and break after four."""
    model, holder = Scaled(), Holder()
    for step in range(6):
        holder.scale.fill_(float(step))
        x = torch.ones(2)
        torch.testing.assert_close(model(x.cuda(), holder).cpu(), x * step)
    (record,) = capture.breaks
    assert "holds a tensor on the host CPU" in record.reason, record
