"""torch.optim under the bridge: every optimizer step in captured mode, and the grouping
helpers torch's optimizers and clip_grad_norm_ use.

- Adam, AdamW and SGD: torch's functional updates are patched to run each parameter group's
  update as one program (runtime/optimizers.py), all groups of a step together; a step whose
  structure is the last one's repeats those updates without torch's step Python (_Replay).
- Every other step (torch.optim's others, any optimizer written in torch ops) is traced once
  per structure and replayed as one program (_StepRegion).
- torch groups tensors by their C++ device, which is 'cpu' for bridge tensors; the groups'
  device keys are rewritten to the device the script sees, so that `x.to(device)` inside those
  helpers stays on the bridge instead of copying to the host.
"""

import contextlib
import functools
import importlib
import itertools
import operator
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bridge.runtime import capture, flat, optimizers
from bridge.runtime import tensor as tensor_module
from bridge.runtime.config import optimizer_state, settings
from bridge.runtime.tensor import (
    BridgeTensor,
    held_only_by_their_tensors,
    read_value,
    read_values,
    root_of,
    to_bridge,
    write_value,
    write_values,
)

from . import Patch, bound_arguments
from .capture import _clip_arguments, _clip_done, clip_in_place


def group_tensors_by_device_and_dtype(wrapped, instance, args, kwargs):
    grouped = wrapped(*args, **kwargs)
    renamed = {}
    for (device, dtype), (tensor_lists, indices) in grouped.items():
        first = next((tensor for tensors in tensor_lists for tensor in tensors if tensor is not None), None)
        if isinstance(first, BridgeTensor):
            device = first.device
        renamed[(device, dtype)] = (tensor_lists, indices)
    return renamed


# Each module imported the helper by name, so each binding is patched.
PATCHES = [
    Patch(module, "_group_tensors_by_device_and_dtype", wrapper=group_tensors_by_device_and_dtype)
    for module in map(
        importlib.import_module,
        ("torch.utils._foreach_utils", "torch.optim.optimizer", "torch.nn.utils.clip_grad", "torch.optim.swa_utils"),
    )
]


# ---------------------------------------------------------------- Adam's, AdamW's and SGD's update programs
#
# torch's Adam, AdamW and SGD call their functional update once per parameter group; the patches
# below check what torch hands in and, where the update can be one program, make it a
# _GroupUpdate and submit it. The step's updates are recorded (recording_updates), so that a
# later step with the same structure repeats them without torch's step Python
# (_Replay, below): for GPT-2's 148 parameters torch's _init_group and the
# checks here cost the host more than the update itself.

_recorded = None  # the group updates of the optimizer step running now, or None


@contextlib.contextmanager
def recording_updates():
    """Within: each group update the patches below make is appended to the list yielded (None
    for a group torch's own update took)."""
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = outer


def _record(update):
    if _recorded is not None:
        _recorded.append(update)


def _plain_cpu(value):
    """A tensor of torch's own on the host (not a bridge tensor)."""
    if type(value) is torch.Tensor:  # the common case, checked first (a step scans all state)
        return value.is_cpu
    return isinstance(value, torch.Tensor) and not isinstance(value, BridgeTensor) and value.is_cpu


def _local_shards(a, names):
    """The functional update's arguments with FSDP2's sharded parameters (DTensors) and their
    gradients and state replaced by their local shards, where that is the same update: each
    parameter's tensors sharded or replicated alike over one mesh (an elementwise update of the
    shards is the update of the whole), and True; else `a` unchanged and False: torch runs the
    update on the DTensors, an op of DTensor's dispatch per tensor and op."""
    params = a["params"]
    if not params or type(params[0]).__name__ != "DTensor":
        return a, False
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial

    local = dict(a)
    for name in ("params", *names):
        tensors = a[name]
        if len(tensors) != len(params):
            return a, False
        shards = []
        for tensor, param in zip(tensors, params):
            if not isinstance(tensor, DTensor) or tensor.device_mesh != param.device_mesh:
                return a, False
            if tensor.placements != param.placements or any(isinstance(p, Partial) for p in tensor.placements):
                return a, False
            shards.append(tensor._local_tensor)
        local[name] = shards
    return local, True


def _uniform(params):
    """The params' dtype and device if all are bridge tensors of one real float dtype and device."""
    if not params or not all(isinstance(p, BridgeTensor) for p in params):
        return None
    dtype, index = params[0].dtype, params[0]._index
    if dtype not in (torch.float32, torch.float64):
        return None
    if any(p.dtype != dtype or p._index != index for p in params):
        return None
    return dtype


class _GroupUpdate:
    """One parameter group's update program call, made from what torch handed the functional
    update; `submit(grads, lr)` runs it (again) for these gradients and learning rate.

    `state` names the per-parameter state tensors it uses (the state dict's keys) with the
    tensors, so that a repeat can check that the optimizer's state still holds them. `shards`:
    made from DTensors' local shards (`_local_shards`), which the state is not keyed by."""

    kind = None
    shards = False

    def __init__(self, params, dtype, state, statics):
        self.params, self.dtype, self.state, self.statics = params, dtype, state, statics
        self.numpy_dtype = np.float32 if dtype == torch.float32 else np.float64
        self.calls = 0  # submits: a second is a step of the same structure (_Replay)
        self.flat_root = None  # the flat root this call's parameters are members of, or None
        self.holdings = flat.Holdings()  # the flat roots of the parameters and state lists
        self.found_holders = (None, None)  # (gradients, flat.gradient_holders of them) last asked

    def grads_usable(self, grads):
        """Whether these gradients (one per parameter, from p.grad) fit the program (in C loops:
        a step checks hundreds). Where some are the members of one flat root (a fused run's
        joined gradients: flat.gradient_holders), that root stands for them (its members have its
        dtype and device) and is remembered for the update's call (_gradient_arguments)."""
        if not all(map(isinstance, grads, itertools.repeat(BridgeTensor))):
            return False
        found = flat.gradient_holders(grads) if self.flat_root is not None and not self.separate else None
        self.found_holders = (None, None) if found is None else (grads, found)
        checked = grads if found is None else found[0]
        with torch._C.DisableTorchFunctionSubclass():  # attribute reads skip the subclass check
            same_dtype = all(map(operator.eq, map(_DTYPE, checked), itertools.repeat(self.dtype)))
        return same_dtype and all(map(operator.eq, map(_INDEX, checked), itertools.repeat(self.params[0]._index)))

    def _param_values(self):
        """The parameters' values as the update takes them, and the statics that say how: where
        they are members of one flat root (runtime/flat.py; packed when the optimizer took its
        groups, or here once the step's structure repeats), the root's one array, which the update
        returns new; else an array each."""
        self.calls += 1
        packable = settings.flat_parameters and not self.separate and not self.shards
        found = self.holdings.get("params", self.params, flat.layout) if packable else None
        if found is None and packable and self.calls >= 2 and flat.flat_parameters(self.params) is not None:
            found = self.holdings.get("params", self.params, flat.layout)
        if found is None:
            self.flat_root = None
            flat.release(self.params)  # written one by one, each would be written into its flat root
            return read_values(self.params), {}
        root, shapes, updated = found
        self.flat_root = root
        return [read_value(root)], {"flat_shapes": shapes, "flat_updated": updated}

    def _gradient_arguments(self, grads, layout):
        """The update's gradient values and clip arguments (_clip_arguments). Where the update
        takes the parameters' flat root whole (`layout` without `flat_updated`) and some of the
        gradients are the members of a flat root laid out as those parameters (a fused run's
        small gradients, runtime/capture.py `_joined`): that root's one array, then the others'
        arrays, and the members' places (`joined_grads`; None where all are members)."""
        (known, found), self.found_holders = self.found_holders, (None, None)  # (not kept: a step's gradients)
        if layout and layout["flat_updated"] is None and not self.separate:
            if known is not grads:  # (not asked by grads_usable for these: a first step's)
                found = flat.gradient_holders(grads)
            shapes = layout["flat_shapes"]
            if found is not None and flat.members_of(found[0][0]).shapes == flat.picked(shapes, found[1]):
                holders, places = found
                clip, values, clip_values, clip_statics = _clip_arguments(holders)
                joined = None if len(places) == len(shapes) else places
                return clip, values, clip_values, dict(clip_statics, joined_grads=joined)
        return _clip_arguments(grads)

    def _submit(self, arguments, statics, finish, now=False):
        values = arguments[0]
        holders = self.params if self.flat_root is None else [self.flat_root]
        optimizers.submit(self.kind, held_only_by_their_tensors(holders, values), arguments, statics, finish, now=now)
        capture.fused_steps[self.kind] = capture.fused_steps.get(self.kind, 0) + (now or optimizers.batched() is None)

    def _flat_state(self, kind):
        """The flat root of the group's state tensors of this kind (their tensors its members)."""
        return self.holdings.get(kind, self.state[kind], optimizers.flat_state)

    def _write_params(self, new_params):
        root = self.flat_root
        if root is None:
            write_values(self.params, new_params)
        else:
            write_value(root, new_params[0])

    @functools.cached_property
    def separate(self):
        """Whether the state tensors hold arrays of their own (else views into flat roots)."""
        return _state_layout(self.params) == "separate"


def _state_layout(params):
    """The layout of a group's state (runtime.config.optimizer_state, by the group's size)."""
    return optimizer_state(sum(map(torch.Tensor.numel, params)) * params[0].element_size())


def _write_state(held, value):
    """A state kind's new value: a list of arrays into its tensors, or a flat array into its root."""
    if isinstance(held, list):
        write_values(held, value)
    else:
        write_value(held, value)


class _AdamUpdate(_GroupUpdate):
    kind = "adam"

    def __init__(self, params, dtype, state, statics, on_host):
        super().__init__(params, dtype, state, statics)
        self.on_host = on_host
        self.host_counts = None  # on_host: (the step tensors' _versions, their counts, numpy views)

    def _advance_host_counts(self, steps):
        """torch's `step_t += 1` on each host step tensor; returns the new counts (numpy). The counts are
        kept here and written through numpy views of the tensors' memory (a torch op per tensor
        cost a millisecond for GPT-2's 148); a tensor changed since (its _version moved) is read."""
        versions = list(map(_VERSION, steps))
        known = self.host_counts
        if known is not None and known[0] == versions:
            counts, views = known[1], known[2]
        else:
            views = [step.numpy() for step in steps]
            counts = np.array([view[()] for view in views])
        counts = counts + counts.dtype.type(1)  # in the tensors' dtype, as torch adds
        for view, count in zip(views, counts):
            view[()] = count
        self.host_counts = (versions, counts, views)
        return counts

    def submit(self, grads, lr):
        beta1, beta2 = self.statics["beta1"], self.statics["beta2"]
        tensors = self.state
        if self.on_host:
            counts, held_counts, advanced = self._advance_host_counts(tensors["step"]), None, None
        else:
            # Step counts on the device (fused=True, capturable=True), their values kept on
            # the host too; the update program advances them.
            held_counts, counts, advanced = optimizers.device_step_counts(self._flat_state("step"))
        # As torch computes them, in Python floats (from the counts' numpy array): bias
        # corrections, the step size, its sign; sent to the device as one array. (Every
        # parameter has taken as many steps, usually.)
        count = len(counts)
        uniform = bool((counts == counts[0]).all())
        scalars = np.empty(1 + 2 * count, dtype=self.numpy_dtype)
        scalars[0] = 1 - lr * self.statics["weight_decay"]
        if uniform:
            first = float(counts[0])
            scalars[1 : 1 + count], scalars[1 + count :] = (lr / (1 - beta1**first)) * -1, (1 - beta2**first) ** 0.5
        else:
            counts = counts.tolist()
            scalars[1 : 1 + count] = [(lr / (1 - beta1**c)) * -1 for c in counts]
            scalars[1 + count :] = [(1 - beta2**c) ** 0.5 for c in counts]
        kinds = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if self.statics["amsgrad"] else ("exp_avg", "exp_avg_sq")
        if self.separate:
            # Each moment tensor holds its own array, as in torch.
            holders = [tensors[kind] for kind in kinds]
            states = [read_values(held) for held in holders]
        else:
            # The moments as flat arrays: their tensors become views into them (optimizers.flat_state).
            holders = [self._flat_state(kind) for kind in kinds]
            states = [read_value(root) for root in holders]
        values, layout = self._param_values()
        clip, grad_values, clip_values, clip_statics = self._gradient_arguments(grads, layout if uniform else None)

        def finish(result):
            new_params, *new_states, clip_result, new_counts = result
            _clip_done(clip, clip_result)
            self._write_params(new_params)
            for held, value in zip(holders, new_states):
                _write_state(held, value)
            if advanced is not None:
                advanced(new_counts)

        count_values = None if held_counts is None else read_value(held_counts)
        arguments = [values, grad_values, *states, *([None] * (3 - len(kinds))), scalars, *clip_values, count_values]
        if layout:
            layout["uniform"] = uniform
        self._submit(arguments, dict(clip_statics, separate=self.separate, **layout, **self.statics), finish)


def adam(wrapped, instance, args, kwargs):
    if not settings.capture or settings.tracing:  # a traced step is torch's own, through the tables
        return wrapped(*args, **kwargs)
    a = bound_arguments(wrapped, args, kwargs)
    a, shards = _local_shards(a, ["grads", "exp_avgs", "exp_avg_sqs"] + (["max_exp_avg_sqs"] if a["amsgrad"] else []))
    params = a["params"]
    dtype = _uniform(params)
    steps = a["state_steps"]
    # Step counts on the host (torch's default), or on the device (fused=True, capturable=True),
    # where their values are kept on the host too (optimizers.device_step_counts).
    on_host = all(_plain_cpu(step) for step in steps)
    on_device = all(isinstance(step, BridgeTensor) and step.dim() == 0 for step in steps)
    usable = (
        dtype is not None
        and not a.get("differentiable")
        and a.get("grad_scale") is None
        and a.get("found_inf") is None
        and not a.get("has_complex")
        and not any(isinstance(a[name], BridgeTensor) for name in ("lr", "beta1", "beta2"))
        and (on_host or (on_device and (a.get("fused") or a.get("capturable"))))
        and all(isinstance(t, BridgeTensor) and t.dtype == dtype for t in a["grads"] + a["exp_avgs"] + a["exp_avg_sqs"])
        and (not a["amsgrad"] or all(isinstance(t, BridgeTensor) for t in a["max_exp_avg_sqs"]))
    )
    if not usable:
        _record(None)
        return wrapped(*args, **kwargs)
    state = {"exp_avg": a["exp_avgs"], "exp_avg_sq": a["exp_avg_sqs"], "step": steps}
    if a["amsgrad"]:
        state["max_exp_avg_sq"] = a["max_exp_avg_sqs"]
    statics = dict(
        beta1=float(a["beta1"]),
        beta2=float(a["beta2"]),
        eps=float(a["eps"]),
        weight_decay=float(a["weight_decay"]),
        decoupled=bool(a.get("decoupled_weight_decay")),
        amsgrad=bool(a["amsgrad"]),
        maximize=bool(a["maximize"]),
    )
    update = _AdamUpdate(params, dtype, state, statics, on_host)
    update.shards = shards  # (not replayed: _Replay.make)
    update.submit(a["grads"], float(a["lr"]))
    _record(update)
    return None


class _SGDUpdate(_GroupUpdate):
    kind = "sgd"

    def __init__(self, params, dtype, state, statics, buffers):
        super().__init__(params, dtype, state, statics)
        self.buffers = buffers  # torch's list: the first step's new buffers are put in it

    def submit(self, grads, lr):
        momentum, first, separate = self.statics["momentum"], self.statics["first"], self.separate
        if first or momentum == 0:
            held, state = None, None
        elif separate:
            held = list(self.buffers)
            state = read_values(held)
        else:
            held = self.holdings.get("momentum_buffer", self.buffers, optimizers.flat_state)
            state = read_value(held)
        values, layout = self._param_values()
        clip, grad_values, clip_values, clip_statics = self._gradient_arguments(grads, layout)

        def finish(result):
            new_params, new_state, clip_result = result
            _clip_done(clip, clip_result)
            self._write_params(new_params)
            if momentum == 0:
                return
            if not first:
                _write_state(held, new_state)
            elif separate:  # torch: a copy of each gradient
                index = self.params[0]._index
                self.buffers[:] = [BridgeTensor(value, index) for value in new_state]
            else:  # views into one flat root
                self.buffers[:] = optimizers.flat_members(new_state, self.params)

        arguments = [values, grad_values, state, np.array(lr, dtype=self.numpy_dtype), *clip_values]
        # The first step's buffers are new tensors torch puts in the state right after this
        # call: that update runs now, not with the step's other groups.
        self._submit(arguments, dict(clip_statics, separate=separate, **layout, **self.statics), finish, now=first)


def sgd(wrapped, instance, args, kwargs):
    if not settings.capture or settings.tracing:  # a traced step is torch's own, through the tables
        return wrapped(*args, **kwargs)
    a = bound_arguments(wrapped, args, kwargs)
    shards = False
    if all(buffer is not None for buffer in a["momentum_buffer_list"]):
        # (a first step's buffers are made by the update and put in the state: torch's DTensors)
        a, shards = _local_shards(a, ["d_p_list", "momentum_buffer_list"])
    params, grads, buffers = a["params"], a["d_p_list"], a["momentum_buffer_list"]
    dtype = _uniform(params)
    first = all(buffer is None for buffer in buffers)
    usable = (
        dtype is not None
        and not a.get("has_sparse_grad")
        and a.get("grad_scale") is None
        and a.get("found_inf") is None
        and not isinstance(a["lr"], BridgeTensor)
        and all(isinstance(t, BridgeTensor) and t.dtype == dtype for t in grads)
        and (first or all(isinstance(t, BridgeTensor) for t in buffers))
    )
    if not usable:
        _record(None)
        return wrapped(*args, **kwargs)
    momentum = float(a["momentum"])
    statics = dict(
        momentum=momentum,
        dampening=float(a["dampening"]),
        weight_decay=float(a["weight_decay"]),
        nesterov=bool(a["nesterov"]),
        maximize=bool(a["maximize"]),
        first=first and momentum != 0,
    )
    state = {} if momentum == 0 else {"momentum_buffer": buffers}
    update = _SGDUpdate(params, dtype, state, statics, buffers)
    update.shards = shards  # (not replayed: _Replay.make)
    update.submit(grads, float(a["lr"]))
    # A first step's update makes the buffers: the next step's differs (it reads them).
    _record(None if statics["first"] else update)
    return None


# ---------------------------------------------------------------- whole steps as programs
#
# Captured mode runs an optimizer's `step()` as one program: torch's own Python step is traced
# through the tables once per structure (which parameters have gradients, the hyperparameters)
# and replayed after, as module calls are (runtime/capture.py). This serves every optimizer
# written in torch ops, torch.optim's and others (HF's Adafactor, a user's Lion), in whichever
# implementation the script picked; Adam, AdamW and SGD keep their own update programs
# (above) for the steps they serve in one program (_own_program_serves),
# which also fold a waiting clip_grad_norm_ in.
#
# What the trace must see as torch.compile's does:
# - `torch.compiler.is_compiling()` is true, so torch's steps keep their scalars as tensors
#   (`_get_value`, `_stack_if_compiling`) instead of reading them with `.item()`;
# - `capturable` and `foreach` are on where a group has them (torch.optim's), so step counts and
#   a tensor learning rate are used on the device; a float learning rate of such a group is
#   carried as a tensor too, so that a schedule changing it every step replays one program
#   (other optimizers' float lr is a constant of the program, which compiles anew when it
#   changes);
# - the 0-dim host tensors of the state (step counts; ASGD's eta and mu) are stood in for by
#   bridge tensors while the step runs ("mirrors"). Their host tensors, which state_dict() and
#   checkpoints read, are brought up to date after each step (an asynchronous copy, finished
#   at the next step or when the state is read), so the saved state is torch's.

def _host_scalar(value):
    return _plain_cpu(value) and value.dim() == 0


def _params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _hand_over(optimizer, params, grads, scaler_tensors):
    """Give the parameters these gradients and the optimizer these GradScaler tensors (None: the
    attribute is left as it is)."""
    for p, grad in zip(params, grads):
        p.grad = grad
    for name, tensor in zip(_SCALER_ATTRIBUTES, scaler_tensors):
        if tensor is not None:
            setattr(optimizer, name, tensor)


def _python_numbers(optimizer):
    """The plain numbers of an optimizer's state and param_groups, by place."""
    numbers = []
    for owner in [*optimizer.state.values(), *optimizer.param_groups]:
        numbers.append(tuple((key, value) for key, value in owner.items() if isinstance(value, (int, float))))
    return numbers


def _waiting_clip(grads):
    """The clip_grad_norm_ waiting for exactly these gradients (whole arrays), if any: the step's
    program can compute it."""
    present = [grad for grad in grads if grad is not None]
    clip = optimizers.PendingClip.of(present) if present else None
    if clip is None or clip.coefficient is not None:
        return None
    roots = [root_of(grad) for grad in present]
    if {id(root) for root in roots} != {id(grad) for grad in clip.grads} or len(roots) != len(clip.grads):
        return None
    if any(root.shape != grad.shape for root, grad in zip(roots, present)):
        return None
    return clip


# What torch.amp.GradScaler sets on an optimizer whose step unscales (fused ones) for one step.
_SCALER_ATTRIBUTES = ("grad_scale", "found_inf")


class _StepRegion:
    """One optimizer's captured step: its region, its mirrors and the host values in flight."""

    def __init__(self, optimizer, step):
        self.optimizer = weakref.ref(optimizer)
        self.step = step  # the class's step below this patch, unbound
        self.mirrors = {}  # id(host tensor) -> (host tensor, its _version when mirrored, mirror, its numpy view)
        self.rates = {}  # group position -> (lr mirror, its float) (groups whose float lr is carried as a tensor)
        self.in_flight = None  # (host tensors, device array being copied to the host)
        self.tensors = []  # the step's state: parameters, state and group tensors (mirrors in place)
        name = f"{type(optimizer).__name__}.step"
        self.region = capture.Region(self._body, name, state_roots=lambda: self.tensors)

    # The traced body: gradients are inputs (a new tensor every step), and so are the scale and
    # found_inf GradScaler hands a fused step (new tensors every step, set on the optimizer);
    # hyperparameters are static.
    # A clip_grad_norm_ waiting for this step (`clip`: its max_norm and norm_type) runs first in
    # the same program, on the unclipped gradients; its norm and coefficient are returned.
    def _body(self, grads, scaler_tensors, hyperparameters, clip):
        optimizer = self.optimizer()
        params = _params(optimizer)
        saved = [p.grad for p in params]
        saved_scaler = [getattr(optimizer, name, None) for name in _SCALER_ATTRIBUTES]
        numbers = _python_numbers(optimizer)
        tracing = bool(settings.tracing)  # else the region runs it eagerly, after a break
        clipped = None
        if clip is not None:
            clipped = clip_in_place([grad for grad in grads if grad is not None], *clip.value)
        try:
            _hand_over(optimizer, params, grads, scaler_tensors)
            self.step(optimizer)
        finally:
            _hand_over(optimizer, params, saved, saved_scaler)
        if tracing and _python_numbers(optimizer) != numbers:
            for owner, entries in zip([*optimizer.state.values(), *optimizer.param_groups], numbers):
                owner.update(entries)  # as before the trace: the eager run counts once
            # (HF's Adafactor counts `state["step"] += 1` in a Python int.) A replay runs no
            # Python, so it would not count: the step runs as torch runs it.
            raise capture.GraphBreak(
                "the optimizer's step changes Python numbers in its state or param_groups, which a compiled "
                "replay would not change"
            )
        return clipped

    def run(self):
        optimizer = self.optimizer()
        self.finish_copy()
        params = _params(optimizer)
        index = params[0]._index
        swapped = self._swap_in(optimizer, index)
        try:
            # What the trace reads as constants: the groups' settings (a float lr is carried as
            # a tensor instead), and any plain numbers of the state.
            hyperparameters = tuple(
                tuple(
                    (key, value)
                    for key, value in sorted(group.items())
                    if key != "params" and not isinstance(value, torch.Tensor)
                )
                for group in optimizer.param_groups
            ) + tuple(_python_numbers(optimizer))
            scaler_tensors = [getattr(optimizer, name, None) for name in _SCALER_ATTRIBUTES]
            grads = [p.grad for p in params]
            clip = _waiting_clip(grads)
            if clip is not None:
                # The unclipped values go in; the gradients stay waiting for the coefficient.
                grads = [None if grad is None else BridgeTensor(root_of(grad)._value, grad._index) for grad in grads]
            with torch.no_grad():
                clipped = self.region(
                    grads,
                    scaler_tensors,
                    capture.Static(hyperparameters),
                    None if clip is None else capture.Static((clip.max_norm, clip.norm_type)),
                )
            if clip is not None and clipped is not None:
                clip.taken(*map(read_value, clipped))
        finally:
            self._swap_out(swapped)
        self._start_copy()
        if self.region.broken is None:
            capture.fused_steps[self.region.name] = capture.fused_steps.get(self.region.name, 0) + 1

    def _mirror(self, host, index):
        known = self.mirrors.get(id(host))
        if known is not None and known[0] is host:
            mirror = known[2]
            if known[1] != host._version:
                # Changed on the host since (a scheduler's `fill_` of a tensor lr): the same
                # mirror takes the value, as the programs read this tensor.
                write_value(mirror, to_bridge(host, index)._value)
                self.mirrors[id(host)] = (host, host._version, mirror, known[3])
            return mirror
        mirror = to_bridge(host, index)
        # The host tensor's memory as numpy sees it, kept: finish_copy writes each step's value there.
        self.mirrors[id(host)] = (host, host._version, mirror, host.numpy())
        return mirror

    def _swap_in(self, optimizer, index):
        """Put mirrors in place of the host scalars, capturable on and float lr as a tensor;
        returns what to put back. Names the region's state as it goes (self.tensors): the
        tensors the optimizer holds now, so that a program traced before load_state_dict
        replaced them does not serve."""
        swapped, tensors = [], []
        for owner in [*optimizer.state.values(), *optimizer.param_groups]:
            for key, value in owner.items():
                if isinstance(value, BridgeTensor):
                    tensors.append(value)
                elif _host_scalar(value):
                    swapped.append((owner, key, value))
        for owner, key, value in swapped:
            owner[key] = mirror = self._mirror(value, index)
            tensors.append(mirror)
        if len(self.mirrors) > len(swapped):
            # Host tensors no longer in the state (load_state_dict replaced them): their mirrors
            # go, and their values are no longer written back.
            held = {id(value) for _, _, value in swapped}
            self.mirrors = {key: entry for key, entry in self.mirrors.items() if key in held}
        for position, group in enumerate(optimizer.param_groups):
            for flag in ("capturable", "foreach") if not group.get("fused") else ():
                if flag in group:
                    swapped.append((group, flag, group[flag]))
                    group[flag] = True
            # torch.optim's steps take a tensor lr in these modes; others' may need a number
            # (`p.add_(update, alpha=-lr)`), and recompile when it changes.
            torch_flags = any(flag in group for flag in ("capturable", "foreach", "fused"))
            if torch_flags and isinstance(group.get("lr"), float):
                swapped.append((group, "lr", group["lr"]))
                group["lr"] = mirror = self._rate(position, group["lr"], group["params"][0])
                tensors.append(mirror)
        self.tensors = tensors + _params(optimizer)
        return swapped

    def _rate(self, position, lr, param):
        dtype = param.dtype if param.dtype == torch.float64 else torch.float32
        mirror, known = self.rates.get(position, (None, None))
        if mirror is None or mirror.dtype != dtype:
            mirror = to_bridge(torch.tensor(lr, dtype=dtype), param._index)
        elif known != lr:  # a schedule changed it (else no transfer)
            write_value(mirror, to_bridge(torch.tensor(lr, dtype=dtype), param._index)._value)
        self.rates[position] = (mirror, lr)
        return mirror

    @staticmethod
    def _swap_out(swapped):
        for owner, key, value in reversed(swapped):
            owner[key] = value

    def _start_copy(self):
        pairs = [(host, mirror) for host, _, mirror, _ in self.mirrors.values()]
        if not pairs:
            return
        values = _stack([read_value(mirror) for _, mirror in pairs])
        values.copy_to_host_async()
        self.in_flight = ([host for host, _ in pairs], values)

    def finish_copy(self):
        """Write the mirrors' values of the last step into their host tensors."""
        if self.in_flight is None:
            return
        hosts, values = self.in_flight
        self.in_flight = None
        values = np.asarray(values)
        for host, value in zip(hosts, values):
            known = self.mirrors.get(id(host))
            if known is None or known[0] is not host or known[1] != host._version:
                continue  # written on the host since the step (a scheduler's fill_): that value is newer
            # Into the tensor's memory, as fill_ would write it (without a torch call per
            # tensor: GPT-2 has 148 step counts); its version stays the one mirrored.
            known[3][()] = value


_stack = jax.jit(lambda values: jnp.stack([value.astype(jnp.float64 if value.dtype == jnp.float64 else jnp.float32) for value in values]))
_step_regions = weakref.WeakKeyDictionary()  # optimizer -> _StepRegion

# Optimizers with update programs of their own (the patches above of their update
# functions), which also take a waiting clip_grad_norm_ in.
_OWN_PROGRAMS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _own_program_serves(optimizer):
    """Whether Adam's, AdamW's or SGD's own update programs serve this step: torch calls the
    update once per parameter group, each with float hyperparameters, float32 or float64
    parameters, and no scale handed in by GradScaler. Other steps of theirs are captured whole.

    Several groups (nanoGPT's and timm's decay / no-decay split) run their update programs as one
    (captured_step). Captured whole instead, GPT-2's AdamW step traced through torch's own code
    compiled in 66 s and ran slower (nanoGPT bench.py 30.3 ms against 28.4 under torch.compile
    on an H100; results/real_programs_h100_2026-11-26_whole_step.md)."""
    if type(optimizer) not in _OWN_PROGRAMS or getattr(optimizer, "grad_scale", None) is not None:
        return False
    for group in optimizer.param_groups:
        scalars = [group.get("lr"), *group.get("betas", ())]
        if any(isinstance(value, BridgeTensor) for value in scalars):
            return False
        if not all(p.dtype in (torch.float32, torch.float64) for p in group["params"]):
            return False
    return True


# ---------------------------------------------------------------- Adam's, AdamW's and SGD's steps repeated
#
# Where their own update programs serve a step, torch's step Python (its _init_group over every
# parameter, the functional update's checks) costs the host more than the update program: for
# GPT-2's 148 parameters, milliseconds a step. A step whose structure is the last one's (the
# same parameters with gradients, the same state tensors, the same hyperparameters but the
# learning rate) repeats the last step's group updates directly: each reads the new gradients
# and learning rate, as torch's step would have handed them in.

_PLAIN = (bool, int, float, str, type(None))


def _plain_value(value):
    return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(item, _PLAIN) for item in value))


def _state_reader(kinds):
    """A function of a parameter's state dict: its tensors of these kinds, as a tuple."""
    if len(kinds) == 1:
        kind = kinds[0]
        return lambda entry: (entry[kind],)
    return operator.itemgetter(*kinds) if kinds else (lambda entry: ())


class _Replay:
    """The last step's group updates of an optimizer, one per parameter group, with what they
    were made from."""

    def __init__(self, optimizer, updates):
        # Not the optimizer itself: _replays is keyed on it weakly.
        self.state, self.param_groups = optimizer.state, optimizer.param_groups
        # The state's parameters and their entries as they are now: checked by identity, in
        # order (hashing 148 parameters in Python, Tensor.__hash__, cost more than the update).
        self.keys, self.entries = tuple(self.state.keys()), tuple(self.state.values())
        self.layout = tensor_module.layout_changes  # a parameter's dtype or shape changed in place
        self.groups = []
        for group, update in zip(optimizer.param_groups, updates):
            params = group["params"]
            members = {id(p) for p in update.params}
            with_grad = tuple(i for i, p in enumerate(params) if id(p) in members)
            hyper = {key: value for key, value in group.items() if key not in ("params", "lr")}
            held = [self.state[p] for p in update.params]
            # Each parameter's state tensors, kind by kind, as one sequence: checked in one pass
            # over the state dicts (each read once, rather than once a kind).
            reader = _state_reader(tuple(update.state))
            expected = tuple(itertools.chain.from_iterable(zip(*update.state.values())))
            self.groups.append((group, params, tuple(params), with_grad, hyper, update, (held, reader, expected)))

    @classmethod
    def make(cls, optimizer, updates):
        """A replay of these updates, or None where a step may not be repeated this way (a group
        torch's own update took, a learning rate or hyperparameter that is not a plain value)."""
        groups = optimizer.param_groups
        if len(updates) != len(groups) or any(update is None or update.shards for update in updates):
            return None
        for group in groups:
            if not isinstance(group.get("lr"), (int, float)) or not all(_plain_value(v) for k, v in group.items() if k != "params"):
                return None
        return cls(optimizer, updates)

    def gradients(self, optimizer):
        """Each group's gradients, where this step's structure is the recorded one; else None.

        The checks compare objects by identity in C loops (map over operator.is_): a GPT-2
        step has 148 parameters, each with a gradient and two or three state tensors."""
        state = self.state
        if (
            optimizer.state is not state
            or optimizer.param_groups is not self.param_groups
            or len(self.param_groups) != len(self.groups)
            or getattr(optimizer, "grad_scale", None) is not None
            or tensor_module.layout_changes != self.layout
            or len(state) != len(self.keys)
            or not all(map(operator.is_, state.keys(), self.keys))
            or not all(map(operator.is_, state.values(), self.entries))
        ):
            return None
        found = []
        for group, params, members, with_grad, hyper, update, held in self.groups:
            if group["params"] is not params or len(params) != len(members) or not all(map(operator.is_, params, members)):
                return None
            if not isinstance(group["lr"], (int, float)):
                return None
            if len(group) != len(hyper) + 2 or any(group.get(key, hyper) != value for key, value in hyper.items()):
                return None
            with torch._C.DisableTorchFunctionSubclass():  # attribute reads skip the subclass check
                grads = list(map(_GRAD, params))
            if len(with_grad) != len(params):
                if tuple(i for i, grad in enumerate(grads) if grad is not None) != with_grad:
                    return None
                grads = [grads[i] for i in with_grad]
            elif any(map(operator.is_, grads, itertools.repeat(None))):
                return None
            if not update.grads_usable(grads):
                return None
            entries, reader, expected = held
            try:
                if not all(map(operator.is_, itertools.chain.from_iterable(map(reader, entries)), expected)):
                    return None
            except KeyError:  # (a state entry deleted)
                return None
            found.append(grads)
        return found

    def run(self, gradients):
        for (group, *_, update, _), grads in zip(self.groups, gradients):
            update.submit(grads, float(group["lr"]))


_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_VERSION = operator.attrgetter("_version")
_INDEX = operator.attrgetter("_index")
_replays = weakref.WeakKeyDictionary()  # optimizer -> _Replay


def _no_closure(args, kwargs):
    """Whether step() was called without a closure (which re-evaluates the model: torch's step
    calls it). `step(None)` is none: accelerate's AcceleratedOptimizer, which HF Trainer uses,
    hands its closure on."""
    return len(args) <= 1 and set(kwargs) <= {"closure"} and all(value is None for value in (*args, *kwargs.values()))


def _own_step(optimizer, step, args, kwargs):
    """A step Adam's, AdamW's or SGD's own update programs serve: torch's step, recording its
    updates so that the next step of the same structure repeats them (_repeated)."""

    def run():
        with recording_updates() as updates:
            result = step(optimizer, *args, **kwargs)
        made = _Replay.make(optimizer, updates)
        if made is None:
            _replays.pop(optimizer, None)
        else:
            _replays[optimizer] = made
        return result

    return _in_one_program(optimizer, run)


def _repeated(optimizer, args, kwargs):
    """Whether this step repeated the last one's updates (its structure unchanged; see _Replay):
    checked first, so that such a step runs no more of the bridge's Python or torch's."""
    replay = _replays.get(optimizer)
    if replay is None or not _no_closure(args, kwargs):
        return False
    gradients = replay.gradients(optimizer)
    if gradients is None:
        return False
    region = _step_regions.get(optimizer)  # a step captured whole before (GradScaler's scale set then)
    if region is not None:
        region.finish_copy()
    _in_one_program(optimizer, lambda: replay.run(gradients))
    return True


def _in_one_program(optimizer, run):
    """run(), with the update programs of a step of several groups run as one program
    (runtime.optimizers.one_program)."""
    if len(optimizer.param_groups) == 1 and not optimizers.reductions_waiting():
        return run()
    # (A DDP average waiting for this step is taken into the batch's program.)
    with optimizers.one_program() as batch:
        result = run()
        kinds = {call[0] for call in batch.calls}
    for kind in kinds:
        capture.fused_steps[kind] = capture.fused_steps.get(kind, 0) + 1
    return result


def _capturable_step(optimizer, args, kwargs):
    """Whether this call of optimizer.step can run as a captured program (one that Adam's, AdamW's
    or SGD's own update programs do not serve: checked first)."""
    if not _no_closure(args, kwargs):
        return False  # a closure (LBFGS) re-evaluates the model inside the step
    if getattr(optimizer, "defaults", {}).get("differentiable"):
        return False
    params = _params(optimizer)
    if not params or not all(isinstance(p, BridgeTensor) for p in params):
        return False
    with_grad = [p for p in params if p.grad is not None]
    # The first step makes the state; it runs as torch runs it, the later ones are programs.
    return bool(with_grad) and all(optimizer.state.get(p) for p in with_grad)


def _wrap_step(step):
    """A class's step (unhooked) that runs as a captured program where it can."""

    @functools.wraps(step)
    def captured_step(self, *args, **kwargs):
        active = settings.capture and not settings.tracing
        if active and _repeated(self, args, kwargs):
            return None
        own = active and _own_program_serves(self)
        if not active or own or not _capturable_step(self, args, kwargs):
            region = _step_regions.get(self)
            if region is not None:
                region.finish_copy()
            if own:
                return _own_step(self, step, args, kwargs)
            return step(self, *args, **kwargs)
        region = _step_regions.get(self)
        if region is None:
            region = _step_regions[self] = _StepRegion(self, step)
        region.run()
        return None

    return captured_step


def add_param_group(wrapped, instance, args, kwargs):
    """torch's add_param_group (its __init__ calls it for each group). In captured mode the
    group's parameters then move into one flat array (runtime/flat.py): before the model's
    region is first traced, so that it compiles for them packed once, rather than once per
    parameter and again when the first steps pack them."""
    result = wrapped(*args, **kwargs)
    if settings.capture and settings.flat_parameters and not settings.tracing:
        params = instance.param_groups[-1]["params"]
        if _uniform(params) is not None and all(p.requires_grad for p in params) and _state_layout(params) == "flat":
            flat.flat_parameters(list(params))
    return result


def state_dict(wrapped, instance, args, kwargs):
    """The state as torch has it: host step counts brought up to date first."""
    region = _step_regions.get(instance)
    if region is not None:
        region.finish_copy()
    return wrapped(*args, **kwargs)


class _StepPatch(Patch):
    """Optimizer classes' steps, wrapped when torch hooks them (Optimizer._patch_step_function,
    on a class's first instance) and, for classes hooked before activation, when applied."""

    def __init__(self):
        super().__init__(torch.optim.Optimizer, "_patch_step_function", wrapper=self._patch_step_function)
        self.wrapped = []  # (class, its step before)

    def _wrap_class(self, cls):
        step = vars(cls).get("step")
        if step is None or not getattr(step, "hooked", False) or getattr(step, "__bridge_step__", False):
            return
        # Below torch's hook wrapper (profile_hook_step), which runs the step hooks: they run
        # on every call, in Python, as in torch.
        self.wrapped.append((cls, step))
        hooked = torch.optim.Optimizer.profile_hook_step(_wrap_step(step.__wrapped__))
        hooked.hooked = True
        hooked.__bridge_step__ = True
        cls.step = hooked

    def _patch_step_function(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        self._wrap_class(type(instance))
        return result

    def apply(self):
        super().apply()
        pending = [torch.optim.Optimizer]
        while pending:
            cls = pending.pop()
            self._wrap_class(cls)
            pending.extend(cls.__subclasses__())

    def undo(self):
        for cls, step in reversed(self.wrapped):
            cls.step = step
        self.wrapped = []
        super().undo()


PATCHES += [
    # Each optimizer module calls the functional form through its own global name.
    Patch(importlib.import_module("torch.optim.adam"), "adam", wrapper=adam),
    Patch(importlib.import_module("torch.optim.adamw"), "adam", wrapper=adam),
    Patch(importlib.import_module("torch.optim.sgd"), "sgd", wrapper=sgd),
    Patch(torch.optim.Optimizer, "state_dict", wrapper=state_dict),
    Patch(torch.optim.Optimizer, "add_param_group", wrapper=add_param_group),
    _StepPatch(),
]
