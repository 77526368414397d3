"""Captured mode's entry points into unmodified scripts (docs/design.md, "Captured mode").

- Module calls: the outermost `nn.Module` call on bridge tensors runs as a captured region
  (runtime/capture.py): its forward is one XLA program, its backward another. A module that
  cannot be captured (a graph break, hooks that must run in Python) runs its own Python,
  and its submodules are captured in its place.
- `torch.compile(model_or_fn)` returns a captured region of the module or function;
  `fullgraph=True` turns a graph break into an error.
- `clip_grad_norm_` runs as one program, or waits to join the optimizer step's program.
- `torch.compiler.is_compiling()` is true inside every trace, as under torch.compile.
- Custom `autograd.Function`s and `loss.backward()`'s implicit gradient of ones.

Optimizer steps are bridge/patches/optim.py's.

Everything here is inert in eager mode (`--mode eager`, BRIDGE_MODE=eager), except the
whole-module rung (bridge/whole_module.py): a module whose forward reached an op with no mapping
runs as its exported program in both modes.
"""

import collections
import functools
import importlib
import inspect
import operator
import sys
import weakref

import torch

from bridge import whole_module
from bridge.runtime import capture, dispatch, flat, optimizers
from bridge.runtime.config import settings
from bridge.runtime.tensor import BridgeTensor, read_value, read_values, root_of

from . import Patch, bound_arguments, custom_functions

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


def _watching(base):
    """`base` (dict, OrderedDict) whose changes count in `_edits`: a module's containers once a
    walk has read them (_watch), so that the next call knows the walk still holds from one
    counter instead of reading every module of the subtree again (for nanoGPT's 164 modules, 0.4
    of the 1.2 ms of host time an H200 spent between a step's `loss.item()` and the next program's
    call, while the GPU waited; 0.08 ms now). A
    container dropped (a module given a new dict, or freed) counts too. It pickles and copies
    as `base`, so that nothing the user saves depends on the bridge."""
    edits = _edits  # (a closure: __del__ may run after the module's globals are cleared)

    def changing(name):
        method = getattr(base, name)

        def change(self, *args, **kwargs):
            edits[0] += 1
            return method(self, *args, **kwargs)

        change.__name__ = name
        return change

    def dropped(self):
        edits[0] += 1

    names = ["__setitem__", "__delitem__", "__ior__", "pop", "popitem", "clear", "update", "setdefault"]
    namespace = {name: changing(name) for name in names + (["move_to_end"] if base is collections.OrderedDict else [])}
    namespace.update(__slots__=(), __del__=dropped, __reduce__=lambda self: (base, (list(self.items()),)))
    return type(f"Watched{base.__name__}", (base,), namespace)


# Changes to the module containers that walks have read, and containers dropped: a walk holds
# while this count has not moved since it was made.
_edits = [0]
_WATCHED = {dict: _watching(dict), collections.OrderedDict: _watching(collections.OrderedDict)}
_CONTAINERS = ("_modules", "_parameters", "_buffers")
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
_TRAINING = operator.attrgetter("training")


def _watch(module):
    """Give `module` watched containers in place of torch's (the same contents); whether all of
    its containers are now watched. Hook dicts are replaced only while empty: torch's handles
    hold their dict weakly, and the handle of a hook registered before would remove it from a
    dict the module no longer reads."""
    attributes = vars(module)
    watched = True
    for name in _CONTAINERS + _HOOKS:
        container = attributes.get(name)
        if type(container) in _WATCHED_TYPES:
            continue
        kind = _WATCHED.get(type(container))
        if kind is None or (name in _HOOKS and container):
            watched = False
            continue
        attributes[name] = kind(container)
    return watched


_WATCHED_TYPES = frozenset(_WATCHED.values())


class _Tree:
    """One walk over a module's subtree, in torch's own orders (named_modules' pre-order;
    parameters() then buffers(), each tensor once): whether hooks need Python on this call,
    the training flags that key its regions, and its state tensors. Module calls need this on
    every step, so it reads the module dicts directly (torch's generators, four walks with
    prefix strings, took about 1 ms of host time per GPT-2 forward), and a walk is reused while
    the subtree's modules, parameters and buffers are the same objects (`still_holds`): known
    from `_edits` where the walk could watch every module's containers, else by reading them."""

    # The module itself is not kept (the regions of a module are held weakly by it), only the
    # modules below it.
    __slots__ = ("hooked", "key", "state", "descendants", "children", "members", "watched", "edits")

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
        self.watched = all([_watch(m) for m in modules])
        self.edits = _edits[0]
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
            m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks or (m._forward_hooks and not _idle(m._forward_hooks))
            for m in modules
        )
        self.key = tuple(map(_TRAINING, modules))

    def still_holds(self, module):
        """Whether `module`'s subtree still has these modules, parameters and buffers (its hooks
        and training flags are read anew)."""
        modules = [module] + self.descendants
        if self.watched:
            # Every container watched, the hook dicts empty at the walk: a change since (a hook
            # registered too) has moved `_edits`. Training flags are plain attributes.
            if _edits[0] != self.edits:
                return False
            self.key = tuple(map(_TRAINING, modules))
            return True
        if not (_same(_children(modules), self.children) and _same(_members(modules), self.members)):
            return False
        self._read_flags(modules)
        return True


_HF_CAPTURING = "transformers.utils.output_capturing"


def _idle(hooks):
    """Whether a module's forward hooks are all HF transformers' output-capturing ones, with no
    collection under way. HF installs them for good the first time a call asks for router
    logits or hidden states (Mixtral's config asks on every call); each appends to a collector
    that the decorated forward sets and reads back itself, and does nothing while none is set.
    Called with none set, a region runs them only inside its own Python, which its trace runs;
    called inside a collecting forward (the region's module is below it), they would append to
    the caller's collector, which a program's replay would not."""
    if not all(getattr(hook, "__module__", None) == _HF_CAPTURING for hook in hooks.values()):
        return False
    collector = getattr(sys.modules.get(_HF_CAPTURING), "_active_collector", None)
    return collector is not None and collector.get() is None


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
    if whole_module.modules and instance is not None and instance in whole_module.modules:
        # a module whose forward reached an op with no mapping: its exported program, in both modes
        result = whole_module.call(instance, args, kwargs)
        if result is not whole_module.NOT_ROUTED:
            return result
    if (
        not settings.capture
        or capture.tracing_or_learning()
        or instance is None
        or getattr(type(instance), "bridge_wraps_region", False)
        or not _has_bridge_tensor(args, kwargs)
        or _global_hooks()
    ):
        return wrapped(*args, **kwargs)
    entry = _regions.get(instance)
    tree = _Tree(instance) if entry is None else entry.walk(instance)
    if tree.hooked:
        capture.hooked[type(instance).__name__] += 1
        return wrapped(*args, **kwargs)
    if entry is None:
        entry = _regions[instance] = _ModuleRegion(instance, _weak_call(wrapped))
    return entry.region(instance, tree)(*args, **kwargs)


# ---------------------------------------------------------------- custom autograd Functions

# A classmethod on Function up to torch 2.13, a C classmethod of _FunctionBase from 2.14:
# either binds to the subclass through the descriptor protocol.
_function_apply = inspect.getattr_static(torch.autograd.Function, "apply")


def _apply(cls, *args, **kwargs):
    """A custom autograd.Function inside a region being traced: its forward and backward traced
    as a jax.custom_vjp (bridge/patches/custom_functions.py), so that the region's gradient runs
    the Function's backward. The bridge's own Functions (its regions') run as they are."""
    if settings.tracing and not cls.__module__.startswith("bridge.runtime."):
        return custom_functions.traced_apply(cls, args, kwargs)
    return _function_apply.__get__(None, cls)(*args, **kwargs)


# ---------------------------------------------------------------- torch.compile


class CompiledModule(torch.nn.Module):
    """What `torch.compile(module)` returns under the bridge: like torch's OptimizedModule, it
    holds the module as `_orig_mod` (so state_dict keys match torch's) and runs it captured."""

    bridge_wraps_region = True  # module_call leaves it to its forward, which runs the region

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
        if not _has_bridge_tensor(args, kwargs):
            # Host tensors only (torch.cond's own compile of its branches on CPU tensors): torch's
            # eager code, as the compiled function would compute it.
            return function(*args, **kwargs)
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


# ---------------------------------------------------------------- the arguments of a torch function


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
    a = bound_arguments(wrapped, args, kwargs)
    parameters = a["parameters"]
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if a["error_if_nonfinite"] or not grads or not all(isinstance(g, BridgeTensor) for g in grads):
        return wrapped(parameters, *list(a.values())[1:])
    max_norm, norm_type, foreach = float(a["max_norm"]), float(a["norm_type"]), a["foreach"]
    joined = flat.joined_roots(grads)
    if joined is not None:
        # A fused run's gradients, joined in one flat array per parameter group (runtime/flat.py)
        # but for large ones: the clip takes each array as one gradient (its norm is the norm of
        # the gradients' norms), and the others as they are.
        grads = joined
    with torch.no_grad():
        if not _can_wait(grads):
            return _clip_region(grads, max_norm, norm_type, foreach)
        # Work the gradients wait for runs first (an earlier clip), but DDP's average, which
        # the clip then holds for the step (optimizers.PendingReduction).
        reduction = optimizers.PendingReduction.of(grads)
        for grad in grads:
            if reduction is None or root_of(grad)._pending is not reduction:
                read_value(grad)
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
    if grads and root_of(grads[0])._pending is None:
        # Neither a clip nor DDP's average waits (each is every gradient's pending work): the
        # common step, whose checks of every gradient are skipped.
        return None, read_values(grads), (None, None), {}
    clip = optimizers.PendingClip.of(grads)
    if clip is None:
        return clip, optimizers.gradient_values(grads), (None, None), {}
    values, clip_values, coefficient = clip.update_inputs(grads)
    return clip, values, (clip_values, coefficient), {"max_norm": clip.max_norm, "norm_type": clip.norm_type}


def _clip_done(clip, result):
    if clip is not None and result[0] is not None:
        clip.taken(*result)


# ---------------------------------------------------------------- traces see a compiler


def is_compiling(wrapped, instance, args, kwargs):
    """True in every captured trace, as under torch.compile: library code then takes the paths
    it keeps for compilers (HF transformers skips its attention-mask checks, `.all()` on a traced
    mask, and routes MoE experts through its own operator), and torch's optimizers keep their
    scalars as tensors. Eager runs, a region's after a graph break too, see torch's answer."""
    return capture.tracing_or_learning() or wrapped(*args, **kwargs)


def detect_is_causal_mask(wrapped, instance, args, kwargs):
    """torch's Transformer layers ask whether a given mask is the causal one
    (`bool((mask == causal).all())`, a value a trace cannot have) only to pick a fused causal
    kernel instead of applying the mask. In a trace the answer is "no" unless the caller said
    `is_causal=True`: the mask is applied as given, which computes the same attention."""
    if capture.tracing_or_learning():
        mask, is_causal = (list(args) + [None, None])[:2]
        mask, is_causal = kwargs.get("mask", mask), kwargs.get("is_causal", is_causal)
        if is_causal is None and isinstance(mask, BridgeTensor):
            return False
    return wrapped(*args, **kwargs)


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
    Patch(dispatch, "fallback_hook", replacement=whole_module.fallback_reached),
    Patch(importlib.import_module("torch.nn.utils.clip_grad"), "clip_grad_norm_", wrapper=clip_grad_norm),
    Patch(torch.nn.utils, "clip_grad_norm_", wrapper=clip_grad_norm),
    Patch(torch, "compile", replacement=compile),
    Patch(torch.autograd.Function, "apply", replacement=classmethod(_apply)),
    Patch(torch.compiler, "is_compiling", wrapper=is_compiling),
    Patch(importlib.import_module("torch.nn.modules.transformer"), "_detect_is_causal_mask", wrapper=detect_is_causal_mask),
]
