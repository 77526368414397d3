"""Every torch.optim optimizer, in each implementation torch offers, against eager torch: in
captured mode each step after the first runs as one compiled program (the first makes the
state, as torch's does), and after several steps under a learning-rate schedule the
parameters and the saved state equal torch's. The fused kernels' own mappings
(op_mappings/optimizers.py) are checked in eager mode, where they are what runs."""

import copy

import pytest
import torch

from conftest import loaded_in_plain_torch
from bridge.runtime import capture

O = torch.optim

def _make(cls, **defaults):
    return lambda params, **flags: cls(params, **{**defaults, **flags})


# (name, constructor, implementations): each implementation is a dict of constructor flags.
OPTIMIZERS = [
    ("adam", _make(O.Adam, lr=1e-2, weight_decay=0.01), ["foreach", "single", "capturable", "fused", "tensor-lr"]),
    ("adamw", _make(O.AdamW, lr=1e-2, amsgrad=True), ["foreach", "single", "capturable", "fused"]),
    ("sgd", _make(O.SGD, lr=0.1, momentum=0.9, nesterov=True), ["foreach", "single", "fused"]),
    ("adagrad", _make(O.Adagrad, lr=0.1, lr_decay=0.01, weight_decay=1e-3), ["foreach", "single", "fused"]),
    ("adadelta", _make(O.Adadelta, lr=1.0, weight_decay=1e-3), ["foreach", "single", "capturable"]),
    ("adamax", _make(O.Adamax, lr=1e-2), ["foreach", "single", "capturable"]),
    ("asgd", _make(O.ASGD, lr=1e-2, t0=2), ["foreach", "single", "capturable"]),
    ("nadam", _make(O.NAdam, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01), ["foreach", "single", "capturable"]),
    ("radam", _make(O.RAdam, lr=1e-2, weight_decay=0.01), ["foreach", "single", "capturable"]),
    ("rmsprop", _make(O.RMSprop, lr=1e-2, momentum=0.9, centered=True), ["foreach", "single", "capturable"]),
    ("rprop", _make(O.Rprop, lr=1e-2), ["foreach", "single", "capturable"]),
]

FLAGS = {
    "foreach": {"foreach": True},
    "single": {"foreach": False},
    "capturable": {"capturable": True, "foreach": True},
    "fused": {"fused": True},
    "tensor-lr": {"lr": torch.tensor(1e-2), "fused": True},
}

CASES = [pytest.param(make, FLAGS[flags], id=f"{name}-{flags}") for name, make, implementations in OPTIMIZERS for flags in implementations]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _groups(net, device):
    # Two parameter groups, the second with its own learning rate scale.
    first = {"params": list(net.fc1.parameters())}
    second = {"params": list(net.fc2.parameters())}
    return [first, second]


def _flags_on(flags, device):
    flags = dict(flags)
    if isinstance(flags.get("lr"), torch.Tensor):
        flags["lr"] = flags["lr"].clone().to(device) if device == "cpu" else flags["lr"].clone()
    if flags.get("capturable") and device == "cpu":
        flags["capturable"] = False  # torch's capturable needs an accelerator; on the CPU the same math runs uncaptured
    return flags


def _train(make, flags, device, steps=5, clip=None):
    torch.manual_seed(0)
    net = Net()
    if device != "cpu":
        net = net.to(device)
    optimizer = make(_groups(net, device), **_flags_on(flags, device))
    schedule = O.lr_scheduler.ExponentialLR(optimizer, 0.8)
    data = torch.Generator().manual_seed(1)
    programs = []  # the update programs each step ran (captured mode)
    norms = []
    for _ in range(steps):
        x = torch.randn(8, 6, generator=data).to(device)
        optimizer.zero_grad()
        net(x).square().mean().backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), clip))  # read after the step
        before = sum(capture.fused_steps.values())
        optimizer.step()
        programs.append(sum(capture.fused_steps.values()) - before)
        schedule.step()
    net.programs, net.norms = programs, [float(norm) for norm in norms]
    return net, optimizer


def _compare_state(state, state_ref):
    assert sorted(state) == sorted(state_ref)
    for key, expected in state_ref.items():
        value = state[key]
        if isinstance(expected, torch.Tensor):
            assert value.device.type == expected.device.type or key != "step", (key, value.device, expected.device)
            # Relative to the tensor's scale: centered RMSprop divides by the square root of a
            # difference, which carries float32 rounding into its momentum (as large in the
            # bridge's eager mode as in captured mode: 1e-5 of values up to 24).
            scale = float(expected.abs().max()) if expected.numel() else 0.0
            torch.testing.assert_close(value.cpu().to(expected.dtype), expected, rtol=2e-5, atol=1e-6 + 2e-6 * scale)
        else:
            assert value == expected, key


@pytest.mark.parametrize("make, flags", CASES)
def test_step_is_one_program_and_matches_torch(captured, make, flags):
    steps = 5
    reference, opt_ref = _train(make, flags, "cpu", steps)
    net, optimizer = _train(make, flags, "cuda", steps)
    for p_ref, p in zip(reference.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=2e-5, atol=1e-6)
    saved, saved_ref = optimizer.state_dict(), opt_ref.state_dict()
    for index, state_ref in saved_ref["state"].items():
        state = saved["state"][index]
        # torch keeps capturable and fused step counts (and all of ASGD's) on the parameters'
        # device, the others on the host; the reference's device is the host either way
        if flags.get("capturable") or flags.get("fused") or isinstance(optimizer, O.ASGD):
            assert all(value.device.type == "cuda" for value in state.values() if isinstance(value, torch.Tensor))
            state = {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
        _compare_state(state, state_ref)
    assert [float(group["lr"]) for group in saved["param_groups"]] == pytest.approx(
        [float(group["lr"]) for group in saved_ref["param_groups"]]
    )
    assert not capture.breaks, capture.breaks
    # Every step after the first (which makes the state) ran as one program, both parameter
    # groups in it; one structure compiled.
    assert net.programs[1:] == [1] * (steps - 1), (net.programs, capture.fused_steps)
    step_compiles = [record for record in capture.compiles if record.region.endswith(".step")]
    assert len(step_compiles) <= 2, step_compiles  # the trace, and its redo once it found the state


def test_saved_state_loads_in_plain_torch(captured, tmp_path):
    """Host step counts of a captured step are written back: the checkpoint is torch's."""
    net, optimizer = _train(_make(O.RMSprop, lr=1e-2), {}, "cuda", steps=4)
    assert sum(capture.fused_steps.values()) == 3
    path = tmp_path / "opt.pt"
    torch.save(optimizer.state_dict(), path)
    loaded = loaded_in_plain_torch(captured, path)
    for state in loaded["state"].values():
        assert state["step"].device.type == "cpu" and float(state["step"]) == 4.0


def test_python_numbers_in_state_run_eagerly(captured):
    """An optimizer counting steps in a Python int (as HF's Adafactor does) is not replayed:
    a replay would not count."""

    class Counting(O.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    state["step"] = state.get("step", 0) + 1
                    p.add_(p.grad, alpha=-group["lr"] / state["step"])

    torch.manual_seed(0)
    reference = Net()
    net = copy.deepcopy(reference).cuda()
    for model in (reference, net):
        optimizer = Counting(model.parameters())
        for _ in range(4):
            optimizer.zero_grad()
            model(torch.ones(2, 6, device=next(model.parameters()).device)).sum().backward()
            optimizer.step()
    for p_ref, p in zip(reference.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=1e-5, atol=1e-6)
    assert any("Python numbers" in record.reason for record in capture.breaks)


def test_user_optimizer_in_torch_ops_is_captured(captured):
    """An optimizer outside torch.optim written in torch ops (Lion) runs as one program."""

    class Lion(O.Optimizer):
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.99)):
            super().__init__(params, {"lr": lr, "betas": betas})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["exp_avg"] = torch.zeros_like(p)
                    exp_avg = state["exp_avg"]
                    update = exp_avg * beta1 + p.grad * (1 - beta1)
                    p.add_(torch.sign(update), alpha=-group["lr"])
                    exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)

    torch.manual_seed(0)
    reference = Net()
    net = copy.deepcopy(reference).cuda()
    for model in (reference, net):
        optimizer = Lion(model.parameters(), lr=1e-2)
        for step in range(4):
            optimizer.zero_grad()
            x = torch.linspace(-1, 1, 12).reshape(2, 6) * (step + 1)
            model(x.to(next(model.parameters()).device)).square().sum().backward()
            optimizer.step()
    for p_ref, p in zip(reference.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=1e-5, atol=1e-6)
    assert capture.fused_steps.get("Lion.step") == 3, capture.fused_steps
    assert not capture.breaks


FUSED = [
    pytest.param(_make(O.Adam, lr=1e-2, weight_decay=0.05, maximize=True), id="adam"),
    pytest.param(_make(O.AdamW, lr=1e-2, amsgrad=True), id="adamw"),
    pytest.param(_make(O.SGD, lr=0.1, momentum=0.9, weight_decay=1e-3), id="sgd"),
    pytest.param(_make(O.Adagrad, lr=0.1, lr_decay=0.01), id="adagrad"),
]


@pytest.mark.parametrize("make", FUSED)
def test_fused_kernels_in_eager_mode(bridged, make):
    """fused=True in eager mode runs the fused kernels' mappings (no host fallback), each call
    one compiled program over all of its tensors (run op by op, a tiny GPT-2's AdamW step took
    ~350 ms of JAX dispatches on the CPU)."""
    from bridge.runtime import dispatch, stats

    previous = bridged.set_mode("eager")
    try:
        reference, opt_ref = _train(make, {"fused": True}, "cpu", steps=4)
        net, optimizer = _train(make, {"fused": True}, "cuda", steps=4)
    finally:
        bridged.set_mode(previous)
    for p_ref, p in zip(reference.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=2e-5, atol=1e-6)
    fused = {str(op): rung for op, rung in stats.op_rung.items() if "_fused_" in str(op)}
    assert fused and all(rung != stats.CPU_FALLBACK for rung in fused.values()), fused
    # The functional kernel the in-place one derives from: its last call ran a compiled program.
    kernel = getattr(torch.ops.aten, f"_fused_{type(optimizer).__name__.lower()}").default
    assert dispatch._plans[kernel].entry.last is not None, (kernel, stats.uncompiled_reasons.get(kernel))


@pytest.mark.parametrize("schedule", [False, True], ids=["constant", "schedule"])
@pytest.mark.parametrize("flags", [{"fused": True}, {"foreach": True}], ids=["fused", "foreach"])
def test_list_kernels_repeated_in_eager_mode_write_their_results_directly(bridged, flags, schedule):
    """A fused kernel or `_foreach_*_` op repeating an earlier call's shapes and scalars (a
    constant learning rate) runs its program and writes the results into its lists directly,
    without wrapping each result first (a tiny GPT-2's fused AdamW step on the CPU: 17.8 ms ->
    10.6); with a learning rate that changes every step, or foreach Adam's step sizes (a list of
    floats, new every step), the same by the call's key without its floats (24.6 -> 12.3 ms;
    foreach 36 -> 19). Results that are inputs returned as they came (the fused kernels'
    gradients) are left out of the program and not written. The parameters, gradients and the
    state stay torch's."""
    from bridge.runtime import dispatch

    def train(device):
        torch.manual_seed(0)
        net = Net().to(device)
        optimizer = O.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, **_flags_on(flags, device))
        decay = O.lr_scheduler.ExponentialLR(optimizer, 0.8) if schedule else None
        data = torch.Generator().manual_seed(1)
        for _ in range(4):
            optimizer.zero_grad()
            net(torch.randn(8, 6, generator=data).to(device)).square().mean().backward()
            optimizer.step()
            if decay is not None:
                decay.step()
        return net, optimizer

    previous = bridged.set_mode("eager")
    try:
        reference, opt_ref = train("cpu")
        net, optimizer = train("cuda")
    finally:
        bridged.set_mode(previous)
    for p_ref, p in zip(reference.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=2e-5, atol=1e-6)
    saved, saved_ref = optimizer.state_dict()["state"], opt_ref.state_dict()["state"]
    assert sorted(saved) == sorted(saved_ref)
    for index, state_ref in saved_ref.items():
        _compare_state({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in saved[index].items()}, state_ref)
    if schedule:  # the kernel's learning rate; foreach's decoupled decay, 1 - lr * weight_decay
        kernel = torch.ops.aten._fused_adamw_.default if "fused" in flags else torch.ops.aten._foreach_mul_.Scalar
        assert dispatch._plans[kernel].floating, kernel
    if "foreach" in flags:  # the step sizes, a list of Python floats that changes every step
        kernel = torch.ops.aten._foreach_addcdiv_.ScalarList
        assert dispatch._plans[kernel].floating, kernel
    if not schedule:
        kernel = torch.ops.aten._fused_adamw_.default if "fused" in flags else torch.ops.aten._foreach_add_.Scalar
        assert dispatch._plans[kernel].fast, kernel
    if "fused" in flags:
        # The kernel returns the gradients as they came: its program was compiled again without
        # them (no copies), and they were not written; they are still the backward's values.
        pruned = [kept for kept in dispatch._plans[torch.ops.aten._fused_adamw_.default].unchanged.values() if kept]
        assert pruned and all(not any(kept[1][1]) and all(kept[1][0]) for kept in pruned), pruned
        for p_ref, p in zip(reference.parameters(), net.parameters()):
            torch.testing.assert_close(p.grad.cpu(), p_ref.grad, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "captured"])
def test_fused_adam_with_grad_scaler(bridged, mode):
    """GradScaler hands a fused Adam its scale and found_inf: the kernel's mapping unscales the
    gradients, and skips the step when they were not finite, as torch's kernel does. In
    captured mode each step after the first is one program, the skipped one too (a fresh scale
    and found_inf every step are its inputs)."""
    results = []
    previous = bridged.set_mode(mode)
    try:
        results.append(_scaled_adam("cpu"))
        results.append(_scaled_adam("cuda"))
    finally:
        bridged.set_mode(previous)
    (params_ref, scale_ref, _), (params, scale, programs) = results
    assert scale == scale_ref
    for p_ref, p in zip(params_ref, params):
        torch.testing.assert_close(p, p_ref, rtol=2e-5, atol=1e-6)
    assert programs == ([0, 1, 1, 1] if mode == "captured" else [0] * 4)


def _scaled_adam(device):
    torch.manual_seed(0)
    net = Net().to(device) if device != "cpu" else Net()
    optimizer = O.Adam([{"params": net.fc1.parameters()}, {"params": net.fc2.parameters(), "lr": 1e-3}], lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler(device, init_scale=1024.0)
    programs = []
    for step in range(4):
        optimizer.zero_grad()
        x = torch.ones(2, 6) * (float("inf") if step == 2 else 1.0)
        loss = net(x.to(device)).square().mean()
        scaler.scale(loss).backward()
        before = sum(capture.fused_steps.values())
        scaler.step(optimizer)
        programs.append(sum(capture.fused_steps.values()) - before)
        scaler.update()
    return [p.detach().cpu() for p in net.parameters()], float(scaler.get_scale()), programs


@pytest.mark.parametrize("make", [_make(O.AdamW, lr=1e-2), _make(O.SGD, lr=0.1, momentum=0.9)], ids=["adamw", "sgd"])
def test_clip_then_step_of_several_groups(captured, make):
    """A clip waiting for the step runs in the program of a step captured whole (several
    parameter groups), as it does in Adam's and SGD's own update programs: the same norms and
    parameters as torch's."""
    steps = 5
    reference, _ = _train(make, {}, "cpu", steps, clip=0.05)
    net, _ = _train(make, {}, "cuda", steps, clip=0.05)
    for p_ref, p in zip(reference.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=2e-5, atol=1e-6)
    assert max(reference.norms) > 0.05  # the clip scaled the gradients
    torch.testing.assert_close(torch.tensor(net.norms), torch.tensor(reference.norms), rtol=1e-5, atol=1e-7)
    assert net.programs[1:] == [1] * (steps - 1), capture.fused_steps
    # the clip ran in the step's program (the first step's clip, before any state, on its own)
    assert len([record for record in capture.compiles if record.region == "clip_grad_norm_"]) <= 1
    assert not capture.breaks


@pytest.mark.parametrize("name", ["LBFGS", "Adafactor"])
def test_steps_that_cannot_be_one_program_match_torch(captured, name):
    """LBFGS re-runs the model in its closure (the closure's modules are captured, the step's
    arithmetic runs op by op); torch's Adafactor counts its step in a Python number (its step
    runs as torch runs it). Both give torch's parameters."""
    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        net = Net().to(device) if device != "cpu" else Net()
        optimizer = O.LBFGS(net.parameters(), lr=0.5, max_iter=4) if name == "LBFGS" else O.Adafactor(net.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(8, 6, generator=data).to(device)

            def closure():
                optimizer.zero_grad()
                loss = net(x).square().mean()
                loss.backward()
                return loss

            optimizer.step(closure)
        results.append([p.detach().cpu() for p in net.parameters()])
    for p_ref, p in zip(*results):
        torch.testing.assert_close(p, p_ref, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_update_in_spans_equals_the_joined_form(monkeypatch, nesterov):
    """On GPUs SGD's momentum buffers are updated span by span in place (XLA's CPU backend runs
    the joined form faster): both forms give the same values."""
    import jax.numpy as jnp
    import numpy as np

    from bridge.runtime import optimizers
    from bridge.runtime.config import settings

    rng = np.random.default_rng(0)
    shapes = [(3, 4), (5,), (2, 2, 2)]
    params = [jnp.asarray(rng.standard_normal(shape, dtype=np.float32)) for shape in shapes]
    grads = [jnp.asarray(rng.standard_normal(shape, dtype=np.float32)) for shape in shapes]
    buffers = jnp.asarray(rng.standard_normal(sum(int(np.prod(s)) for s in shapes), dtype=np.float32))
    static = dict(momentum=0.9, dampening=0.1, weight_decay=1e-2, nesterov=nesterov, maximize=False, first=False)
    update = optimizers.sgd_update.__wrapped__
    results = []
    for platform in ("cpu", "gpu"):
        monkeypatch.setattr(settings, "platform", platform)
        results.append(update(params, grads, buffers, np.float32(0.1), **static))
    (params_joined, flat_joined, _), (params_spans, flat_spans, _) = results
    np.testing.assert_array_equal(np.asarray(flat_spans), np.asarray(flat_joined))
    for a, b in zip(params_spans, params_joined):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _eventful_training(make, device, events):
    """Steps of Net under an lr schedule, with `events` (step index -> what happens before
    that step's backward) changing the step's structure; returns the net and each step's count
    of torch `_init_group` calls."""
    torch.manual_seed(0)
    net = Net()
    if device != "cpu":
        net = net.to(device)
    optimizer = make(_groups(net, device))
    schedule = O.lr_scheduler.ExponentialLR(optimizer, 0.9)
    data = torch.Generator().manual_seed(1)
    calls = []
    init_group = type(optimizer)._init_group

    def counted(*args, **kwargs):
        calls[-1] += 1
        return init_group(optimizer, *args, **kwargs)

    optimizer._init_group = counted
    saved = None
    for step in range(9):
        calls.append(0)
        x = torch.randn(8, 6, generator=data).to(device)
        optimizer.zero_grad(set_to_none=True)
        event = events.get(step)
        if event == "freeze fc1":  # fc1's parameters get no gradient this step
            net.fc2(torch.tanh(net.fc1(x).detach())).square().mean().backward()
        else:
            net(x).square().mean().backward()
        if event == "weight decay":
            optimizer.param_groups[1]["weight_decay"] = 0.05
        if event == "save":
            saved = copy.deepcopy(optimizer.state_dict())
        if event == "load":
            optimizer.load_state_dict(saved)
        # as scripts call it, and as accelerate (HF Trainer) hands its closure on: step(None)
        [optimizer.step, lambda: optimizer.step(None), lambda: optimizer.step(closure=None)][step % 3]()
        schedule.step()
    return net, calls


@pytest.mark.parametrize(
    "make",
    [_make(O.AdamW, lr=1e-2, fused=True), _make(O.Adam, lr=1e-2, amsgrad=True), _make(O.SGD, lr=0.1, momentum=0.9)],
    ids=["adamw-fused", "adam-amsgrad", "sgd"],
)
def test_steps_of_one_structure_repeat_without_torchs_step(captured, make, request):
    """Adam's, AdamW's and SGD's steps whose structure is the last step's repeat its update
    programs without running torch's step Python (_init_group is not called); a step whose
    structure changed (a parameter without a gradient, a changed hyperparameter, state loaded
    from a checkpoint) runs torch's step again. Parameters equal torch's throughout."""
    events = {3: "freeze fc1", 5: "weight decay", 2: "save", 7: "load"}
    reference, _ = _eventful_training(make, "cpu", events)
    net, calls = _eventful_training(make, "cuda", events)
    for p_ref, p in zip(reference.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=2e-5, atol=1e-6)
    # Step 0 runs torch's step (it makes the state), and SGD's step 1 too (step 0 made its
    # momentum buffers); 3, 4 (after the frozen step), 5 and 7 changed structure; the others
    # repeat. Two parameter groups: two _init_group calls a step torch runs.
    first = [2, 2] if "sgd" in request.node.name else [2, 0]
    assert calls == first + [0, 2, 2, 2, 0, 2, 0], calls
    assert not capture.breaks, capture.breaks


def test_state_loaded_into_a_step_captured_whole(captured):
    """A step captured whole (RMSprop's) after load_state_dict: it reads the loaded state, its
    parameters equal torch's, and it mirrors only the host tensors the state now holds (those
    load_state_dict replaced are dropped, not written back)."""
    from bridge.patches import optim as optim_patches

    make = _make(O.RMSprop, lr=1e-2, momentum=0.9)
    events = {2: "save", 7: "load"}
    reference, _ = _eventful_training(make, "cpu", events)
    net, _ = _eventful_training(make, "cuda", events)
    for p_ref, p in zip(reference.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=2e-5, atol=1e-6)
    (region,) = [region for optimizer, region in optim_patches._step_regions.items() if isinstance(optimizer, O.RMSprop)]
    optimizer = region.optimizer()
    held = {id(value) for state in optimizer.state.values() for value in state.values() if optim_patches._host_scalar(value)}
    assert held and set(region.mirrors) == held
    # Every step after the first (which makes the state) ran as the captured program, those
    # called as step(None) and step(closure=None) too.
    assert capture.fused_steps.get("RMSprop.step") == 8, capture.fused_steps
    assert not capture.breaks, capture.breaks


def test_a_dropped_optimizer_is_freed(captured):
    """What an optimizer's repeated steps keep does not keep the optimizer alive."""
    import gc
    import weakref

    net, optimizer = _train(_make(O.AdamW, lr=1e-2), {"fused": True}, "cuda", steps=3)
    gone = weakref.ref(optimizer)
    del optimizer
    gc.collect()
    assert gone() is None


SEPARATE_STATE_CASES = [
    pytest.param(_make(O.AdamW, lr=1e-2, amsgrad=True), {"fused": True}, id="adamw-amsgrad-fused"),
    pytest.param(_make(O.Adam, lr=1e-2, weight_decay=0.01), {"foreach": True}, id="adam-foreach"),
    pytest.param(_make(O.SGD, lr=0.1, momentum=0.9, nesterov=True), {"foreach": False}, id="sgd-nesterov"),
]


@pytest.mark.parametrize("make, flags", SEPARATE_STATE_CASES)
def test_state_in_arrays_of_its_own_matches_torch(captured, monkeypatch, make, flags):
    """BRIDGE_OPTIMIZER_STATE=separate: Adam's moments and SGD's buffers each hold an array of
    their own (as torch keeps them) instead of views into flat arrays; with a clip folded in and
    a learning-rate schedule, the parameters, the norms and the state equal torch's, and each
    step after the first is one program."""
    from bridge.runtime.config import settings

    monkeypatch.setattr(settings, "optimizer_state", "separate")
    steps = 5
    reference, opt_ref = _train(make, flags, "cpu", steps, clip=0.05)
    net, optimizer = _train(make, flags, "cuda", steps, clip=0.05)
    for p_ref, p in zip(reference.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(net.norms), torch.tensor(reference.norms), rtol=1e-5, atol=1e-7)
    for state, state_ref in zip(optimizer.state.values(), opt_ref.state.values()):
        for key, value in state.items():
            if key != "step":
                assert value._root is None, key  # its own array, not a view into a flat one
        _compare_state({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}, state_ref)
    assert net.programs[1:] == [1] * (steps - 1), capture.fused_steps


def test_a_layout_not_known_is_refused(monkeypatch):
    from bridge.runtime.config import optimizer_state, settings

    monkeypatch.setattr(settings, "optimizer_state", "flta")
    with pytest.raises(ValueError, match="BRIDGE_OPTIMIZER_STATE='flta'.*'flat' or 'separate'"):
        optimizer_state()


def test_a_parameter_replaced_in_its_group_is_not_repeated_as_the_old_one(captured):
    """A repeated step checks its groups' parameters by identity: a parameter put in another's
    place (same count, same group list) takes torch's step, as in torch."""

    def run(device):
        torch.manual_seed(0)
        net = Net() if device == "cpu" else Net().to(device)
        optimizer = O.AdamW(_groups(net, device), lr=1e-2, fused=device != "cpu")
        data = torch.Generator().manual_seed(1)
        for step in range(5):
            if step == 3:
                replacement = torch.nn.Parameter(net.fc1.bias.detach().clone() + 1)
                optimizer.param_groups[0]["params"][1] = replacement
                net.fc1.bias = replacement
            x = torch.randn(8, 6, generator=data).to(device)
            optimizer.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
            optimizer.step()
        return net

    reference, net = run("cpu"), run("cuda")
    for p_ref, p in zip(reference.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=2e-5, atol=1e-6)


def test_a_large_group_keeps_separate_state_by_default(monkeypatch):
    """The flat layout's update joins the gradients into one more copy of them: above
    SEPARATE_STATE_BYTES of parameters the state is kept separate unless the user chose."""
    from bridge.runtime.config import SEPARATE_STATE_BYTES, optimizer_state, settings

    monkeypatch.setattr(settings, "optimizer_state", None)
    assert optimizer_state(SEPARATE_STATE_BYTES) == "flat"
    assert optimizer_state(SEPARATE_STATE_BYTES + 1) == "separate"
    monkeypatch.setattr(settings, "optimizer_state", "flat")
    assert optimizer_state(SEPARATE_STATE_BYTES + 1) == "flat"


REBINDS = {
    # A state tensor handed another array (`.data =`): it leaves its flat root.
    "state data": lambda optimizer, net: setattr(optimizer.state[net.fc1.weight]["exp_avg"], "data", torch.full_like(optimizer.state[net.fc1.weight]["exp_avg"], 0.5)),
    # A state tensor swapped with a new one in place (Module.to's way for tensor subclasses).
    "state swapped": lambda optimizer, net: torch.utils.swap_tensors(optimizer.state[net.fc1.weight]["exp_avg"], optimizer.state[net.fc1.weight]["exp_avg"] * 0.5),
    # A parameter handed another array.
    "parameter data": lambda optimizer, net: setattr(net.fc2.bias, "data", net.fc2.bias.detach() * 2 + 1),
}


@pytest.mark.parametrize("change", list(REBINDS))
@pytest.mark.parametrize("flags", [{"fused": True}, {"foreach": True}], ids=["fused", "foreach"])
def test_tensors_given_other_arrays_between_repeated_steps(captured, change, flags):
    """A repeated step remembers which flat roots hold its parameters and state while no
    tensor's root changed (runtime.tensor.root_changes). A state tensor or parameter given
    another array between steps (`.data =`, swap_tensors) is seen: the next steps use and
    update it, as torch's do."""

    def run(device):
        torch.manual_seed(0)
        net = Net() if device == "cpu" else Net().to(device)
        optimizer = O.AdamW(_groups(net, device), lr=1e-2, **(flags if device != "cpu" else {}))
        data = torch.Generator().manual_seed(1)
        for step in range(6):
            if step == 3:
                with torch.no_grad():
                    REBINDS[change](optimizer, net)
            x = torch.randn(8, 6, generator=data).to(device)
            optimizer.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
            optimizer.step()
        return net, optimizer

    (reference, opt_ref), (net, optimizer) = run("cpu"), run("cuda")
    for p_ref, p in zip(reference.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach().cpu(), p_ref.detach(), rtol=2e-5, atol=1e-6)
    for state, state_ref in zip(optimizer.state.values(), opt_ref.state.values()):
        _compare_state({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}, state_ref)
