"""Captured mode's entry points into unmodified scripts (ARCHITECTURE.md, "Execution modes").

- Module calls: the outermost `nn.Module` call on bridge tensors runs as a captured region
  (runtime/capture.py): its forward is one XLA program, its backward another. A module that
  cannot be captured (a graph break, hooks that must run in Python) runs its own Python,
  and its submodules are captured in its place.
- `torch.compile(model_or_fn)` returns a captured region of the module or function;
  `fullgraph=True` turns a graph break into an error.
- Optimizer steps: Adam, AdamW and SGD update all parameters of a step in one program
  (runtime/optimizers.py) in place of torch's per-tensor ops.

Everything here is inert in eager mode (`--mode eager`, BRIDGE_MODE=eager).
"""

import contextlib
import functools
import importlib
import inspect
import operator
import weakref

import numpy as np
import torch

from bridge.runtime import capture, optimizers
from bridge.runtime.config import settings
from bridge.runtime.tensor import BridgeTensor, held_only_by_their_tensors, read_value, root_of, write_value

from . import Patch

# ---------------------------------------------------------------- module calls

_regions = weakref.WeakKeyDictionary()  # module -> _ModuleRegion


def _has_bridge_tensor(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, BridgeTensor):
            return True
        if isinstance(value, (list, tuple)) and any(isinstance(item, BridgeTensor) for item in value):
            return True
    return False


def _global_hooks():
    from torch.nn.modules import module

    return any(
        getattr(module, name, None)
        for name in (
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_forward_hooks_always_called",
        )
    )


def _children(modules):
    return [child for module in modules for child in module._modules.values()]


def _members(modules):
    """Every parameter and buffer slot of the modules, in order, None and repeats included."""
    return [tensor for module in modules for tensor in module._parameters.values()] + [
        tensor for module in modules for tensor in module._buffers.values()
    ]


def _same(items, others):
    return len(items) == len(others) and all(map(operator.is_, items, others))


class _Tree:
    """One walk over a module's subtree, in torch's own orders (named_modules' pre-order;
    parameters() then buffers(), each tensor once): whether hooks need Python on this call,
    the training flags that key its regions, and its state tensors. Module calls need this on
    every step, so it reads the module dicts directly (torch's generators, four walks with
    prefix strings, took about 1 ms of host time per GPT-2 forward), and a walk is reused while
    the subtree's modules, parameters and buffers are the same objects (`still_holds`)."""

    # The module itself is not kept (the regions of a module are held weakly by it), only the
    # modules below it.
    __slots__ = ("hooked", "key", "state", "descendants", "children", "members")

    def __init__(self, module):
        modules, seen = [], set()
        stack = [module]
        while stack:
            current = stack.pop()
            if id(current) in seen:
                continue
            seen.add(id(current))
            modules.append(current)
            stack.extend(reversed([child for child in current._modules.values() if child is not None]))
        self.descendants = modules[1:]
        self.children = _children(modules)
        self.members = _members(modules)
        state, taken = [], set()
        for tensor in self.members:
            if tensor is not None and id(tensor) not in taken:
                taken.add(id(tensor))
                state.append(tensor)
        self.state = state
        self._read_flags(modules)

    def _read_flags(self, modules):
        # Hooks and training flags change without the modules changing: read on every call.
        self.hooked = any(
            m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in modules
        )
        self.key = tuple([m.training for m in modules])

    def still_holds(self, module):
        """Whether `module`'s subtree still has these modules, parameters and buffers (its hooks
        and training flags are read anew)."""
        modules = [module] + self.descendants
        if not (_same(_children(modules), self.children) and _same(_members(modules), self.members)):
            return False
        self._read_flags(modules)
        return True


def _weak_call(bound):
    """A module's bound call that does not keep the module alive: `_regions` is keyed weakly
    by module, and a value holding its key would keep every captured module (with its
    parameters and programs) for the life of the process."""
    function, owner = getattr(bound, "__func__", None), getattr(bound, "__self__", None)
    if function is None or owner is None:
        return bound
    owner = weakref.ref(owner)

    def call(*args, **kwargs):
        return function(owner(), *args, **kwargs)

    return call


class _ModuleRegion:
    """The regions of one module, one per combination of its submodules' training flags."""

    def __init__(self, module, call, fullgraph=False):
        self.module = weakref.ref(module)
        self.call = call
        self.fullgraph = fullgraph
        self.by_mode = {}
        self.tree = None  # the walk of the current call: its state is the regions' state

    def walk(self, module):
        """The walk of `module` for this call: the last one while it holds."""
        tree = self.tree
        return tree if tree is not None and tree.still_holds(module) else _Tree(module)

    def region(self, module, tree=None):
        self.tree = tree = self.walk(module) if tree is None else tree
        region = self.by_mode.get(tree.key)
        if region is None:
            name = f"{type(module).__name__} ({'train' if module.training else 'eval'})"
            region = capture.Region(
                self.call, name, state_roots=self._state, fullgraph=self.fullgraph, watched=self._modules
            )
            self.by_mode[tree.key] = region
        return region

    def _state(self):
        return self.tree.state

    def _modules(self):
        module = self.module()
        return ([module] if module is not None else []) + list(self.tree.descendants)


def module_call(wrapped, instance, args, kwargs):
    if (
        not settings.capture
        or settings.tracing
        or instance is None
        or type(instance) is CompiledModule
        or not _has_bridge_tensor(args, kwargs)
        or _global_hooks()
    ):
        return wrapped(*args, **kwargs)
    entry = _regions.get(instance)
    tree = _Tree(instance) if entry is None else entry.walk(instance)
    if tree.hooked:
        return wrapped(*args, **kwargs)
    if entry is None:
        entry = _regions[instance] = _ModuleRegion(instance, _weak_call(wrapped))
    return entry.region(instance, tree)(*args, **kwargs)


# ---------------------------------------------------------------- custom autograd Functions

# A classmethod on Function up to torch 2.13, a C classmethod of _FunctionBase from 2.14:
# either binds to the subclass through the descriptor protocol.
_function_apply = inspect.getattr_static(torch.autograd.Function, "apply")


def _apply(cls, *args, **kwargs):
    """A custom autograd.Function inside a region: its backward is the user's Python, which a
    region's JAX gradient would not run, so the region runs eagerly (a graph break)."""
    if settings.tracing and not cls.__module__.startswith("bridge.runtime."):
        raise capture.GraphBreak(f"the custom autograd.Function {cls.__qualname__} runs inside; its backward is Python")
    return _function_apply.__get__(None, cls)(*args, **kwargs)


# ---------------------------------------------------------------- torch.compile


class CompiledModule(torch.nn.Module):
    """What `torch.compile(module)` returns under the bridge: like torch's OptimizedModule, it
    holds the module as `_orig_mod` (so state_dict keys match torch's) and runs it captured."""

    def __init__(self, module, fullgraph):
        super().__init__()
        self._orig_mod = module
        self._bridge_region = _ModuleRegion(module, module.__call__, fullgraph=fullgraph)

    def forward(self, *args, **kwargs):
        module = self._orig_mod
        if not settings.capture or not _has_bridge_tensor(args, kwargs):
            return module(*args, **kwargs)
        return self._bridge_region.region(module)(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)


def _compile_function(function, fullgraph):
    name = getattr(function, "__qualname__", repr(function))
    region = capture.Region(function, name, fullgraph=fullgraph)

    def compiled(*args, **kwargs):
        return region(*args, **kwargs)

    compiled.__wrapped__ = function
    compiled._torchdynamo_orig_callable = function
    return compiled


def compile(model=None, *, fullgraph=False, dynamic=None, backend=None, mode=None, options=None, disable=False, **rest):
    """torch.compile under the bridge: the region becomes one jax.jit program (see module doc).

    `dynamic` and `mode` have no XLA meaning here: shapes are specialized (a new shape compiles
    once more) and XLA chooses its own kernels. A custom `backend` cannot run on bridge tensors;
    the region is captured by the bridge instead.
    """
    if model is None:
        return lambda target: compile(
            target, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode, options=options, disable=disable
        )
    if disable:
        return model
    if isinstance(model, torch.nn.Module):
        return CompiledModule(model, fullgraph)
    return _compile_function(model, fullgraph)


# ---------------------------------------------------------------- gradient clipping


def clip_in_place(grads, max_norm, norm_type, foreach=None):
    """torch's clip_grad_norm_ on a list of gradients (its own norm, then its own scaling);
    returns the total norm and the coefficient."""
    from torch.nn.utils import clip_grad

    total = clip_grad._get_total_norm(grads, norm_type, False, foreach)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient)
    return total, coefficient


def _clip_body(grads, max_norm, norm_type, foreach):
    return clip_in_place(grads, max_norm, norm_type, foreach)[0]


_clip_region = capture.Region(_clip_body, "clip_grad_norm_")


def clip_grad_norm(wrapped, instance, args, kwargs):
    """clip_grad_norm_ as one program: the norms, the total and the scaling of every gradient.
    Folded into the optimizer's step when it can wait for it (optimizers.PendingClip)."""
    if not settings.capture:
        return wrapped(*args, **kwargs)
    a = _bind(wrapped, args, kwargs)
    parameters = a["parameters"]
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if a["error_if_nonfinite"] or not grads or not all(isinstance(g, BridgeTensor) for g in grads):
        return wrapped(parameters, *list(a.values())[1:])
    max_norm, norm_type, foreach = float(a["max_norm"]), float(a["norm_type"]), a["foreach"]
    with torch.no_grad():
        if not _can_wait(grads):
            return _clip_region(grads, max_norm, norm_type, foreach)
        for grad in grads:
            read_value(grad)  # an earlier clip still waiting runs first
        clip_now = functools.partial(_clip_region, max_norm=max_norm, norm_type=norm_type, foreach=foreach)
        return optimizers.PendingClip([root_of(grad) for grad in grads], max_norm, norm_type, clip_now).norm


def _can_wait(grads):
    """A clip can wait for the step when its gradients are whole arrays (roots, or aliases of
    distinct roots; not views of part of one) of one floating dtype on one device, and no
    region is being traced."""
    first = grads[0]
    return (
        not settings.tracing
        and first.dtype in (torch.float32, torch.float64)
        and len({id(root_of(grad)) for grad in grads}) == len(grads)
        and all(not grad._chain and grad.dtype == first.dtype and grad._index == first._index for grad in grads)
    )


def _clip_arguments(grads):
    """The gradient values and clip arguments of an update program for these gradients: a clip
    they all wait for is computed by the update (or its known coefficient applied)."""
    clip = optimizers.PendingClip.of(grads)
    if clip is None:
        return clip, [read_value(t) for t in grads], (None, None), {}
    values, clip_values, coefficient = clip.update_inputs(grads)
    return clip, values, (clip_values, coefficient), {"max_norm": clip.max_norm, "norm_type": clip.norm_type}


def _clip_done(clip, result):
    if clip is not None and result[0] is not None:
        clip.taken(*result)


# ---------------------------------------------------------------- optimizers
#
# torch's Adam, AdamW and SGD call their functional update once per parameter group; the patches
# below check what torch hands in and, where the update can be one program, make it a
# _GroupUpdate and submit it. The step's updates are recorded (recording_updates), so that a
# later step with the same structure repeats them without torch's step Python
# (bridge/patches/optim.py, _Replay): for GPT-2's 148 parameters torch's _init_group and the
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


def _plain_cpu(tensor):
    return isinstance(tensor, torch.Tensor) and not isinstance(tensor, BridgeTensor) and tensor.device.type == "cpu"


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


@functools.lru_cache(maxsize=None)
def _signature(function):
    return inspect.signature(function)


def _bind(wrapped, args, kwargs):
    bound = _signature(wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


class _GroupUpdate:
    """One parameter group's update program call, made from what torch handed the functional
    update; `submit(grads, lr)` runs it (again) for these gradients and learning rate.

    `state` names the per-parameter state tensors it uses (the state dict's keys) with the
    tensors, so that a repeat can check that the optimizer's state still holds them."""

    kind = None

    def __init__(self, params, dtype, state, statics):
        self.params, self.dtype, self.state, self.statics = params, dtype, state, statics
        self.numpy_dtype = np.float32 if dtype == torch.float32 else np.float64

    def grads_usable(self, grads):
        """Whether these gradients (one per parameter, from p.grad) fit the program."""
        dtype, index = self.dtype, self.params[0]._index
        return all(isinstance(g, BridgeTensor) and g.dtype == dtype and g._index == index for g in grads)

    def _submit(self, arguments, statics, finish, now=False):
        values = arguments[0]
        optimizers.submit(self.kind, held_only_by_their_tensors(self.params, values), arguments, statics, finish, now=now)
        capture.fused_steps[self.kind] = capture.fused_steps.get(self.kind, 0) + (now or optimizers.batched() is None)

    def _write_params(self, new_params):
        for tensor, value in zip(self.params, new_params):
            write_value(tensor, value)


class _AdamUpdate(_GroupUpdate):
    kind = "adam"

    def __init__(self, params, dtype, state, statics, steps, on_host, weight_decay):
        super().__init__(params, dtype, state, statics)
        self.steps, self.on_host, self.weight_decay = steps, on_host, weight_decay
        self.amsgrad = statics["amsgrad"]

    def submit(self, grads, lr):
        beta1, beta2 = self.statics["beta1"], self.statics["beta2"]
        if self.on_host:
            torch._foreach_add_(self.steps, 1.0)
            counts = torch.stack(self.steps).tolist()  # one host op for all parameters' step counts
        else:
            # Step counts on the device (fused=True, capturable=True), their values kept on
            # the host too.
            counts = optimizers.device_step_counts(self.steps)
        # As torch computes them, in Python floats: bias corrections, the step size, its sign;
        # sent to the device as one array.
        scalars = np.array(
            [1 - lr * self.weight_decay]
            + [(lr / (1 - beta1**count)) * -1 for count in counts]
            + [(1 - beta2**count) ** 0.5 for count in counts],
            dtype=self.numpy_dtype,
        )
        # The moments as flat arrays: their tensors become views into them (optimizers.flat_state).
        tensors = self.state
        roots = [optimizers.flat_state(tensors["exp_avg"]), optimizers.flat_state(tensors["exp_avg_sq"])]
        roots.append(optimizers.flat_state(tensors["max_exp_avg_sq"]) if self.amsgrad else None)
        clip, grad_values, clip_values, clip_statics = _clip_arguments(grads)
        values = [read_value(t) for t in self.params]

        def finish(result):
            new_params, *new_flat, clip_result = result
            _clip_done(clip, clip_result)
            self._write_params(new_params)
            for root, value in zip(roots, new_flat):
                if root is not None:
                    write_value(root, value)

        arguments = [values, grad_values, *[None if root is None else read_value(root) for root in roots], scalars, *clip_values]
        self._submit(arguments, dict(clip_statics, **self.statics), finish)


def adam(wrapped, instance, args, kwargs):
    if not settings.capture or settings.tracing:  # a traced step is torch's own, through the tables
        return wrapped(*args, **kwargs)
    a = _bind(wrapped, args, kwargs)
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
    update = _AdamUpdate(params, dtype, state, statics, steps, on_host, float(a["weight_decay"]))
    update.submit(a["grads"], float(a["lr"]))
    _record(update)
    return None


class _SGDUpdate(_GroupUpdate):
    kind = "sgd"

    def __init__(self, params, dtype, state, statics, buffers):
        super().__init__(params, dtype, state, statics)
        self.buffers = buffers  # torch's list: the first step's new buffers are put in it

    def submit(self, grads, lr):
        momentum, first = self.statics["momentum"], self.statics["first"]
        root = None if first or momentum == 0 else optimizers.flat_state(self.buffers)
        clip, grad_values, clip_values, clip_statics = _clip_arguments(grads)
        values = [read_value(t) for t in self.params]

        def finish(result):
            new_params, new_flat, clip_result = result
            _clip_done(clip, clip_result)
            self._write_params(new_params)
            if momentum != 0:
                if first:  # torch: a copy of each gradient; here views into one flat root
                    self.buffers[:] = optimizers.flat_members(new_flat, self.params)
                else:
                    write_value(root, new_flat)

        arguments = [values, grad_values, None if root is None else read_value(root), np.array(lr, dtype=self.numpy_dtype), *clip_values]
        # The first step's buffers are new tensors torch puts in the state right after this
        # call: that update runs now, not with the step's other groups.
        self._submit(arguments, dict(clip_statics, **self.statics), finish, now=first)


def sgd(wrapped, instance, args, kwargs):
    if not settings.capture or settings.tracing:  # a traced step is torch's own, through the tables
        return wrapped(*args, **kwargs)
    a = _bind(wrapped, args, kwargs)
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
    update.submit(grads, float(a["lr"]))
    # A first step's update makes the buffers: the next step's differs (it reads them).
    _record(None if statics["first"] else update)
    return None


# ---------------------------------------------------------------- loss.backward()


def make_grads(wrapped, instance, args, kwargs):
    """torch.autograd's implicit gradient of a scalar output (`loss.backward()`) is a tensor of
    ones: marked, so that a fused region's backward hands its gradients on unscaled."""
    grads = args[1] if len(args) > 1 else kwargs["grads"]
    made = wrapped(*args, **kwargs)
    if settings.capture:
        for given, tensor in zip(grads, made):
            if given is None and isinstance(tensor, BridgeTensor):
                capture.mark_ones(tensor)
    return made


PATCHES = [
    Patch(torch.autograd, "_make_grads", wrapper=make_grads),
    Patch(torch.nn.Module, "__call__", wrapper=module_call),
    Patch(importlib.import_module("torch.nn.utils.clip_grad"), "clip_grad_norm_", wrapper=clip_grad_norm),
    Patch(torch.nn.utils, "clip_grad_norm_", wrapper=clip_grad_norm),
    Patch(torch, "compile", replacement=compile),
    Patch(torch.autograd.Function, "apply", replacement=classmethod(_apply)),
    # Each optimizer module calls the functional form through its own global name.
    Patch(importlib.import_module("torch.optim.adam"), "adam", wrapper=adam),
    Patch(importlib.import_module("torch.optim.adamw"), "adam", wrapper=adam),
    Patch(importlib.import_module("torch.optim.sgd"), "sgd", wrapper=sgd),
]
