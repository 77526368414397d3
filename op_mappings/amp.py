"""Gradient scaling for mixed precision: the two ops `torch.amp.GradScaler` runs."""

import jax.numpy as jnp

from bridge.runtime.registry import aten, register_mapping



@register_mapping(aten._amp_foreach_non_finite_check_and_unscale.default)
def non_finite_check_and_unscale(grads, found_inf, inv_scale):
    found = found_inf
    for grad in grads:
        found = jnp.maximum(found, jnp.logical_not(jnp.all(jnp.isfinite(grad))).astype(found.dtype))
    return [(grad * inv_scale).astype(grad.dtype) for grad in grads], found


@register_mapping(aten._amp_update_scale.default)
def update_scale(scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    found = found_inf > 0
    successful = growth_tracker + 1
    grow = jnp.logical_and(jnp.logical_not(found), successful == growth_interval)
    grown = (scale * scale_growth_factor).astype(scale.dtype)
    new_scale = jnp.where(found, scale * scale_backoff_factor, jnp.where(grow & jnp.isfinite(grown), grown, scale))
    new_tracker = jnp.where(found | grow, jnp.zeros_like(growth_tracker), successful)
    return new_scale.astype(scale.dtype), new_tracker.astype(growth_tracker.dtype)
