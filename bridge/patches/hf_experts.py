"""HuggingFace mixture-of-experts layers whose expert loop takes its shapes from the data, traced
with shapes that do not.

Switch Transformers' sparse MLP sends each token to one expert: it asks which experts got tokens
(`nonzero`), then, per expert, which tokens (`torch.where` of the routing mask), and runs the
expert on those rows. Both lengths come from the data, which no XLA program holds (torch.compile
breaks there too, and HF marks the model not full-graph compilable), so the layer ran op by op
with each expert a region of its own, compiled anew for every token count.

In a captured trace the bridge runs the same layer with fixed shapes. The router already bounds
each expert's tokens: at most `expert_capacity` per sequence (tokens past it are dropped). So each
expert takes `batch x min(capacity, length)` rows: its routed tokens first, in their order (a
stable sort of the routing mask), then others, whose results are set to -0.0 (which adds nothing,
not even a sign) before `index_add_` puts the rows back, as HF's loop does. The sums each token
gets are HF's.

Which experts run is HF's too, where it shows: an expert that got no token gets no gradient (its
parameters' `.grad` stays None, and AdamW skips them), so a trace that computes gradients asks
which experts got tokens as host values, and its program is kept for that set (a guard; training
batches route to every expert, so one program serves). Without gradients (generate, evaluation)
every expert runs over its rows, and the set is not asked (no wait for the device).

Eager runs (outside traces) take HF's own code. Also here: the all-ones attention mask HF's
Switch encoder makes when called without one, which HF skips under compilers (`switch_stack`).
"""

import sys

import torch

from bridge.patches import WhenImported
from bridge.runtime import capture

_SWITCH = "transformers.models.switch_transformers.modeling_switch_transformers"


def switch_sparse_mlp(wrapped, instance, args, kwargs):
    """SwitchTransformersSparseMLP.forward, with fixed shapes in a trace (see the module)."""
    if not capture.tracing_or_learning() or kwargs or len(args) != 1:
        return wrapped(*args, **kwargs)
    router, experts = getattr(instance, "router", None), getattr(instance, "experts", None)
    module = sys.modules[_SWITCH]  # (patched once imported)
    if type(router) is not module.SwitchTransformersTop1Router or type(experts) is not module.SwitchTransformersExperts:
        return wrapped(*args, **kwargs)  # a subclass may route otherwise
    (hidden_states,) = args
    batch, length, width = hidden_states.shape
    selected, weights, _ = router(hidden_states)
    hidden = hidden_states.view(-1, width)
    selected = selected.view(-1, router.num_experts) > 0
    weights = weights.view(-1, 1)
    rows = min(batch * min(router.expert_capacity, length), hidden.shape[0])
    if torch.is_grad_enabled():
        taken = [bool(flag) for flag in selected.any(dim=0)]  # host values: the program's guard
    else:
        taken = [True] * router.num_experts
    final = torch.zeros_like(hidden)
    nothing = torch.full((), -0.0, dtype=hidden.dtype, device=hidden.device)
    for index, expert_taken in enumerate(taken):
        if not expert_taken:
            continue
        routed = selected[:, index]
        order = torch.argsort((~routed).to(torch.uint8), stable=True)[:rows]  # its tokens first, in order
        outputs = experts[f"expert_{index}"](hidden[order]) * weights[order]
        outputs = torch.where(routed[order, None], outputs.to(hidden.dtype), nothing)
        final.index_add_(0, order, outputs)
    return final.reshape(batch, length, width)


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


def traced_without_host_values(model):
    """Whether this module makes `model`'s forward traceable as one program where HF says it is
    not (`_can_compile_fullgraph`): a Switch Transformers model."""
    module = sys.modules.get(_SWITCH)
    return module is not None and isinstance(model, module.SwitchTransformersPreTrainedModel)


PATCHES = [
    WhenImported(_SWITCH, "SwitchTransformersSparseMLP", "forward", switch_sparse_mlp),
    WhenImported(_SWITCH, "SwitchTransformersStack", "forward", switch_stack),
]
