"""Long causal attention runs by query blocks (op_mappings/attention.py, `_blocked_causal`):
outputs and gradients against torch, eager and captured, and the block rule's own vjp
against JAX's differentiation of the full score matrix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

SHAPES = [
    # (batch, query heads, length, head size, key/value heads)
    (2, 3, 512, 16, 3),
    (1, 4, 1024, 32, 2),  # grouped-query attention
]


def _reference(q, k, v, grad, gqa):
    """float64 torch on the CPU: outputs and gradients."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return (out, *torch.autograd.grad(out, (q, k, v), grad.double()))


def _run(q, k, v, grad, gqa, device):
    q, k, v = (t.detach().to(device).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return (out, *torch.autograd.grad(out, (q, k, v), grad.to(device)))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", ["eager", "captured"])
def test_long_causal_attention_matches_torch(bridged, shape, mode):
    batch, heads, length, size, kv_heads = shape
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, length, size, generator=generator)
    k = torch.randn(batch, kv_heads, length, size, generator=generator)
    v = torch.randn(batch, kv_heads, length, size, generator=generator)
    grad = torch.randn(batch, heads, length, size, generator=generator)
    gqa = heads != kv_heads
    reference = _reference(q, k, v, grad, gqa)
    torch_float32 = _run(q, k, v, grad, gqa, "cpu")
    previous = bridged.set_mode(mode)
    try:
        if mode == "captured":
            attend = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa))
            qc, kc, vc = (t.to("cuda").requires_grad_() for t in (q, k, v))
            out = attend(qc, kc, vc)
            ours = (out, *torch.autograd.grad(out, (qc, kc, vc), grad.to("cuda")))
        else:
            ours = _run(q, k, v, grad, gqa, "cuda")
    finally:
        bridged.set_mode(previous)
    for name, mine, theirs, exact in zip(("output", "dq", "dk", "dv"), ours, torch_float32, reference):
        mine = mine.detach().cpu().double()
        error = (mine - exact).abs().max().item()
        torch_error = (theirs.detach().double() - exact).abs().max().item()
        # float32 rounding: within a few times torch's own float32 kernel's distance to float64.
        assert error <= 4 * torch_error + 1e-6, f"{name}: bridge {error:.2e}, torch float32 {torch_error:.2e}"


def test_block_rule_vjp_includes_the_logsumexp_cotangent(bridged):
    """The custom vjp against JAX differentiating the full score matrix, with cotangents for
    both outputs (torch never differentiates the logsumexp, but the rule must be right), in
    float64 (the bridge enables JAX's 64-bit types)."""
    from jax import lax

    from bridge.op_mappings.attention import _blocked_causal

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2, 512, 8))) for _ in range(3))
    grad_out = jnp.asarray(rng.standard_normal((1, 2, 512, 8)))
    grad_lse = jnp.asarray(rng.standard_normal((1, 2, 512)))
    scale = 0.3

    def full(q, k, v):
        scores = jnp.einsum("...qd,...kd->...qk", q, k) * scale
        scores = jnp.where(np.tril(np.ones((512, 512), bool)), scores, -jnp.inf)
        lse = jax.nn.logsumexp(scores, axis=-1)
        return jnp.einsum("...qk,...kd->...qd", jnp.exp(scores - lse[..., None]), v), lse

    def blocked(q, k, v):
        return _blocked_causal(q, k, v, scale, 128, lax.Precision.HIGHEST)

    expected_out, expected_pullback = jax.vjp(full, q, k, v)
    out, pullback = jax.vjp(blocked, q, k, v)
    for mine, theirs in zip(out, expected_out):
        np.testing.assert_allclose(mine, theirs, rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(pullback((grad_out, grad_lse)), expected_pullback((grad_out, grad_lse))):
        np.testing.assert_allclose(mine, theirs, rtol=1e-10, atol=1e-10)


@jax.custom_vjp
def _refusing_to_train(query, key, value):
    """Stands in for cuDNN's fused attention, which refuses some shapes only when it trains
    (JAX checks them in the vjp's rules, as for ViT's 197 tokens on a GPU)."""
    weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", query, key).astype(jnp.float32) / np.sqrt(query.shape[-1]), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(value.dtype), value)


def _refusing_backward(lengths, grad):
    # Traced when the region's pullback is, outside the mapping's own code.
    raise NotImplementedError("Unsupported sequence length Q {}, KV {}.".format(*lengths))


_refusing_to_train.defvjp(lambda q, k, v: (_refusing_to_train(q, k, v), (q.shape[1], k.shape[1])), _refusing_backward)


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).sum()


def test_a_fused_kernel_refusing_to_train_falls_back_inside_the_region(captured, monkeypatch):
    """A kernel that refuses a training case leaves the region whole: XLA's attention serves."""
    from bridge.op_mappings import attention
    from bridge.runtime import capture

    monkeypatch.setattr(attention, "_on_gpu", lambda: True)
    monkeypatch.setattr(attention, "_cudnn_attention", lambda q, k, v, scale, is_causal: _refusing_to_train(q, k, v))
    torch.manual_seed(0)
    reference = _Attention().to(torch.bfloat16)
    model = _Attention().to(torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    model.cuda()
    x = torch.randn(2, 7, 16, dtype=torch.bfloat16)  # an odd length, as ViT's
    for _ in range(2):
        reference(x).backward()
        model(x.cuda()).backward()
    assert not capture.breaks, capture.breaks
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad.cpu(), theirs.grad, rtol=2e-2, atol=2e-2)
    with torch.no_grad():  # not training: the kernel serves
        torch.testing.assert_close(model(x.cuda()).cpu(), reference(x), rtol=2e-2, atol=5e-2)
