"""HuggingFace mixture-of-experts layers whose expert loop takes its shapes from the data, traced
with shapes that do not.

Switch Transformers' sparse MLP sends each token to one expert: it asks which experts got tokens
(`nonzero`), then, per expert, which tokens (`torch.where` of the routing mask), and runs the
expert on those rows. Both lengths come from the data, which no XLA program holds (torch.compile
breaks there too, and HF marks the model not full-graph compilable), so the layer ran op by op
with each expert a region of its own, compiled anew for every token count.

In a captured trace the bridge runs the experts' loop (`SwitchTransformersExperts.forward`,
whose arguments every transformers version that has it shares) with fixed shapes. Each expert
takes the same number of rows: its routed tokens first, in their order (a stable sort of the
routing mask), then others, whose results are set to -0.0 (which adds nothing, not even a sign)
before `index_add_` puts the rows back, as HF's loop does. The sums each token gets are HF's.
The router bounds an expert's tokens by its capacity per sequence, so the rows are `batch x
min(capacity, length)`; whether an expert got more (transformers 5.17's router routes the
flattened tokens and counts along a dimension of one, so its capacity never binds) is asked as
a host value, a guard the program is kept for, and then every token is a row.

Every expert runs in the program, yet which ones got tokens still shows as in HF's loop: an
expert that got no token gets no gradient (its parameters' `.grad` stays None, and AdamW skips
them). The program returns each expert's "got tokens" flag beside its results, and the region's
backward gives None for the parameters of those whose flag is false
(`runtime.capture.gradient_only_where`). So the set never decides the program: at the start of
training from scratch, it changes from step to step (benchmarks/results/hf_switch_train_2026-11-28.md).

Eager runs (outside traces) take HF's own code, and so does every run with
`BRIDGE_HF_FIXED_EXPERTS=0`. Also here: the all-ones attention mask HF's
Switch encoder makes when called without one, which HF skips under compilers (`switch_stack`).
"""

import contextvars
import sys

import torch

from bridge.patches import WhenImported
from bridge.runtime import capture
from bridge.runtime.config import settings

_SWITCH = "transformers.models.switch_transformers.modeling_switch_transformers"


# The (batch, length, capacity) of the sparse MLP call whose experts run now, in a trace.
_routing = contextvars.ContextVar("switch_routing", default=None)


def switch_sparse_mlp(wrapped, instance, args, kwargs):
    """SwitchTransformersSparseMLP.forward: HF's own, with the call's batch, length and expert
    capacity known to its experts' loop (which sees the tokens flattened) in a trace."""
    hidden_states = args[0] if args else kwargs.get("hidden_states")
    capacity = getattr(getattr(instance, "router", None), "expert_capacity", None)
    shaped = isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3  # (batch, length, width)
    if not capture.tracing_or_learning() or not isinstance(capacity, int) or not shaped:
        return wrapped(*args, **kwargs)
    token = _routing.set((hidden_states.shape[0], hidden_states.shape[1], capacity))
    try:
        return wrapped(*args, **kwargs)
    finally:
        _routing.reset(token)


def _fits(instance, hidden, selected, weights):
    experts = getattr(instance, "num_experts", None)
    return (
        isinstance(experts, int)
        and all(isinstance(value, torch.Tensor) for value in (hidden, selected, weights))
        and hidden.dim() == 2
        and tuple(selected.shape) == (hidden.shape[0], 1, experts)
        and tuple(weights.shape) == (hidden.shape[0], 1)
        and all(f"expert_{index}" in instance for index in range(experts))
    )


def switch_experts(wrapped, instance, args, kwargs):
    """SwitchTransformersExperts.forward(hidden_states, selected_experts, routing_weights), with
    fixed shapes in a trace (see the module). Its arguments are the same in every transformers
    version that has it: the tokens' states (tokens, width), the one-hot routing (tokens, 1,
    experts) with tokens past capacity all zero, and each token's weight (tokens, 1)."""
    if not settings.hf_fixed_experts or not capture.tracing_or_learning() or kwargs or len(args) != 3:
        return wrapped(*args, **kwargs)
    if not _fits(instance, *args):
        return wrapped(*args, **kwargs)
    hidden, selected, weights = args
    tokens = hidden.shape[0]
    routed = selected[:, 0, :] > 0  # (tokens, experts)
    loads = routed.sum(dim=0)
    if torch.is_grad_enabled() and not capture.tracing():
        # The eager run that learns the region's host values: the experts that got tokens run,
        # as in HF's loop (the others get no gradient from torch's autograd); read without
        # being recorded, since the trace does not ask for them.
        taken = [count > 0 for count in loads.tolist()]
    else:
        # Every expert runs; in a trace that computes gradients, those of an expert that got no
        # token are dropped by the region's backward where its flag is false (as torch's loop
        # leaves them None), so which experts got tokens never decides the program.
        taken = [True] * instance.num_experts
    rows = tokens
    # A host value the program is kept for (a guard): whether an expert got more tokens than
    # capacity allows (transformers 5.17's router lets them: then every token is a row).
    routing = _routing.get()
    if routing is not None and routing[0] * routing[1] == tokens:
        batch, length, capacity = routing
        bound = batch * min(capacity, length)
        if bound < tokens and not bool(loads.max() > bound):
            rows = bound
    final = torch.zeros_like(hidden)
    nothing = torch.full((), -0.0, dtype=hidden.dtype, device=hidden.device)
    for index, expert_taken in enumerate(taken):
        if not expert_taken:
            continue
        mask = routed[:, index]
        expert = instance[f"expert_{index}"]
        if torch.is_grad_enabled():
            capture.gradient_only_where(loads[index] > 0, expert.parameters())
        order = torch.argsort((~mask).to(torch.uint8), stable=True)[:rows]  # its tokens first, in order
        outputs = expert(hidden[order]) * weights[order]
        outputs = torch.where(mask[order, None], outputs.to(hidden.dtype), nothing)
        final.index_add_(0, order, outputs)
    return final


def switch_stack(wrapped, instance, args, kwargs):
    """SwitchTransformersStack.forward: in a trace, an encoder called without an attention mask
    gets the all-ones mask HF's eager code makes. HF skips making it under a compiler
    (`is_torchdynamo_compiling()`, true in the bridge's traces as under torch.compile) and then
    indexes the None (`attention_mask[:, None, None, :]`), a TypeError that torch.compile meets
    too."""
    if not capture.tracing_or_learning() or getattr(instance, "is_decoder", True):
        return wrapped(*args, **kwargs)
    names = ("input_ids", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", "inputs_embeds")
    given = dict(zip(names, args), **kwargs)
    if given.get("attention_mask") is not None or len(args) > len(names):
        return wrapped(*args, **kwargs)
    tokens = given.get("inputs_embeds") if given.get("input_ids") is None else given["input_ids"]
    if tokens is None:
        return wrapped(*args, **kwargs)  # HF's own error
    given["attention_mask"] = torch.ones(tokens.shape[0], tokens.shape[1], device=tokens.device)
    return wrapped(**given)


def traced_whole(model):
    """Whether this module makes `model`'s forward one program where HF says it cannot be
    (`_can_compile_fullgraph`): a Switch Transformers model, with the setting on."""
    module = sys.modules.get(_SWITCH)
    return settings.hf_fixed_experts and module is not None and isinstance(model, module.SwitchTransformersPreTrainedModel)


PATCHES = [
    WhenImported(_SWITCH, "SwitchTransformersSparseMLP", "forward", switch_sparse_mlp),
    WhenImported(_SWITCH, "SwitchTransformersExperts", "forward", switch_experts),
    WhenImported(_SWITCH, "SwitchTransformersStack", "forward", switch_stack),
]
