"""HuggingFace `generate` with its default key-value cache: decoded by a bounded number of programs.

HF's default cache (`DynamicCache`) grows its key and value tensors by `torch.cat` on every
token, so each decoding step has new shapes: a compiled program per token, or (as captured
regions do after a few) the model op by op. An XLA program cannot take a length that changes
(torch.compile traces one with a symbolic length; XLA has none). HF's own answer for compilers
is its `StaticCache`: buffers of the call's whole length, written in place at the token's
position, with the attention mask hiding the positions not written yet. Under the bridge, a
`generate` call that leaves the cache to HF (no `past_key_values`, no `cache_implementation`)
gets that cache, sized as HF sizes it (the call's `max_length`, growing to the longest call seen
on the model), so its decoding is one program per cache size; a returned cache
(`return_dict_in_generate=True`) is given back as the `DynamicCache` torch would return,
holding the same positions. The tokens are torch's: the masked positions add exact zeros to
the attention's sums, whose order alone differs.

Left to HF's default: beam search and assisted decoding (they reorder and crop the cache), models
whose cache layers are not all plain full-attention ones (sliding windows keep a rolling buffer),
models without a full-graph-compilable forward (`_can_compile_fullgraph`), and models on the
host CPU. `BRIDGE_HF_STATIC_CACHE=0` turns this off.
"""

import torch

from bridge.patches import WhenImported, bound_arguments, hf_experts
from bridge.runtime import stats
from bridge.runtime.config import settings
from bridge.runtime.tensor import BridgeTensor

_MODES = ("GREEDY_SEARCH", "SAMPLE")  # GenerationMode members whose caches are only appended to
_made = {}  # id(cache) -> the cache: static caches made here, while their generate runs


def _arguments(wrapped, args, kwargs):
    """The call's arguments by name, or None where they do not fit (another HF version)."""
    try:
        return bound_arguments(wrapped, args, kwargs)
    except TypeError:
        return None


def _applies(model, generation_config, model_kwargs, generation_mode):
    if not settings.hf_static_cache or generation_config is None or model_kwargs is None:
        return False
    if model_kwargs.get("past_key_values") is not None or model_kwargs.get("cache_params") is not None:
        return False
    if generation_config.cache_implementation is not None or generation_config.use_cache is False:
        return False
    if getattr(generation_mode, "name", None) not in _MODES or getattr(generation_config, "prefill_chunk_size", None):
        return False
    compilable = getattr(type(model), "_can_compile_fullgraph", False) or hf_experts.traced_whole(model)
    if not compilable or not model._supports_default_dynamic_cache():
        return False
    parameter = next(model.parameters(), None)
    return isinstance(parameter, BridgeTensor)


def _parts(cache):
    """A cache's caches: an encoder-decoder's self- and cross-attention ones, else itself."""
    if hasattr(cache, "self_attention_cache"):
        return [cache.self_attention_cache, cache.cross_attention_cache]
    return [cache]


def _plain_static(cache):
    """Whether every layer of the cache (both of an encoder-decoder's) is a plain StaticLayer."""
    from transformers.cache_utils import StaticLayer

    return all(type(layer) is StaticLayer for part in _parts(cache) for layer in getattr(part, "layers", [None]))


def prepare_cache(wrapped, instance, args, kwargs):
    """GenerationMixin._prepare_cache_for_generation: HF's StaticCache where it would make a
    DynamicCache (see the module's docstring)."""
    bound = _arguments(wrapped, args, kwargs)
    if bound is None or not _applies(
        instance, bound.get("generation_config"), bound.get("model_kwargs"), bound.get("generation_mode")
    ):
        return wrapped(*args, **kwargs)
    generation_config, model_kwargs = bound["generation_config"], bound["model_kwargs"]
    generation_config.cache_implementation = "static"  # generate's own copy of the config
    try:
        result = wrapped(*args, **kwargs)
        cache = model_kwargs.get("past_key_values")
        usable = cache is not None and _plain_static(cache)
    except Exception:  # noqa: BLE001 - HF refused a static cache for this model
        usable = False
    if not usable:  # HF's default, as the call asked
        generation_config.cache_implementation = None
        model_kwargs.pop("past_key_values", None)
        return wrapped(*args, **kwargs)
    _made[id(cache)] = cache
    stats.hf_static_caches[type(instance).__name__] += 1
    return result


def generate(wrapped, instance, args, kwargs):
    """GenerationMixin.generate: a static cache made above is returned as HF's DynamicCache."""
    before = set(_made)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        made = [_made.pop(key) for key in list(_made) if key not in before]
    cache = getattr(result, "past_key_values", None)
    if cache is not None and any(cache is mine for mine in made):
        result.past_key_values = _as_dynamic(cache)
    return result


def masks_for_generate(wrapped, instance, args, kwargs):
    """generation.utils.create_masks_for_generate, which HF calls before every decoding step
    with a static cache to build the 4-d attention mask outside the model (so that a compiled
    forward sees one shape): for a cache made here, the 2-d mask padded with zeros to the
    cache's length instead (or no mask, where the call has none), also one shape a call. The
    model's forward builds the same 4-d mask from it (the padded positions are past the current
    one, which the causal mask hides anyway), inside its program: on the host HF's version
    took about 15 small ops a token."""
    bound = _arguments(wrapped, args, kwargs)
    cache = None if bound is None else bound.get("past_key_values")
    mask = None if bound is None else bound.get("attention_mask")
    if cache is None or id(cache) not in _made or not (mask is None or isinstance(mask, BridgeTensor) and mask.ndim == 2):
        return wrapped(*args, **kwargs)
    if mask is None:
        return None  # (the model's forward makes the causal mask of a call without one)
    length = _parts(cache)[0].layers[0].max_cache_len  # (plain StaticLayers: _plain_static)
    if not isinstance(length, int) or length < mask.shape[-1]:
        return wrapped(*args, **kwargs)
    return torch.nn.functional.pad(mask, (0, length - mask.shape[-1]))


def _dynamic_of(static):
    from transformers.cache_utils import DynamicCache

    dynamic = DynamicCache()
    for number, layer in enumerate(static.layers):
        if not layer.is_initialized:
            break
        length = int(layer.get_seq_length())
        dynamic.update(layer.keys[:, :, :length], layer.values[:, :, :length], number)
    return dynamic


def _as_dynamic(cache):
    """The DynamicCache (or EncoderDecoderCache of them) holding a static cache's written positions."""
    parts = [_dynamic_of(part) for part in _parts(cache)]
    return type(cache)(*parts) if len(parts) > 1 else parts[0]


_UTILS = "transformers.generation.utils"
PATCHES = [
    WhenImported(_UTILS, "GenerationMixin", "_prepare_cache_for_generation", prepare_cache),
    WhenImported(_UTILS, "GenerationMixin", "generate", generate),
    WhenImported(_UTILS, "", "create_masks_for_generate", masks_for_generate),
]
