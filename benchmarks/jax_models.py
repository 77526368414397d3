"""Hand-written JAX (flax + optax) versions of the benchmark workloads: the reference a user
who rewrote the torch script in JAX would have. Same shapes, initialization scheme, optimizer
and step (forward, loss, gradients, clipping at 1.0, AdamW, the loss read on the host)."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class Block(nn.Module):
    width: int
    heads: int
    layers: int
    dtype: object
    attention: str

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(0.02)
        proj_init = nn.initializers.normal(0.02 / math.sqrt(2 * self.layers))
        batch, length, width = x.shape
        h = nn.LayerNorm(epsilon=1e-5, dtype=jnp.float32)(x)
        qkv = nn.Dense(3 * width, kernel_init=init, dtype=self.dtype)(h)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.reshape(shape) for t in (q, k, v))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)
        x = x + nn.Dense(width, kernel_init=proj_init, dtype=self.dtype)(y.reshape(batch, length, width))
        h = nn.LayerNorm(epsilon=1e-5, dtype=jnp.float32)(x)
        h = nn.Dense(4 * width, kernel_init=init, dtype=self.dtype)(h)
        h = nn.gelu(h, approximate=True)
        return x + nn.Dense(width, kernel_init=proj_init, dtype=self.dtype)(h)


class GPT(nn.Module):
    layers: int
    heads: int
    width: int
    vocab: int
    block: int
    dtype: object = jnp.float32
    attention: str = None

    @nn.compact
    def __call__(self, idx):
        wte = nn.Embed(self.vocab, self.width, embedding_init=nn.initializers.normal(0.02))
        wpe = nn.Embed(self.block, self.width, embedding_init=nn.initializers.normal(0.02))
        x = wte(idx) + wpe(jnp.arange(idx.shape[1]))
        for _ in range(self.layers):
            x = Block(self.width, self.heads, self.layers, self.dtype, self.attention)(x)
        x = nn.LayerNorm(epsilon=1e-5, dtype=jnp.float32)(x)
        return wte.attend(x.astype(self.dtype)).astype(jnp.float32)


def gpt_setup(config, batch, bf16):
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    # cuDNN's fused attention takes only half precision; XLA's own attention serves float32.
    attention = "cudnn" if bf16 and jax.default_backend() == "gpu" else None
    model = GPT(**config, dtype=dtype, attention=attention)
    key = jax.random.key(0)
    idx = jax.random.randint(key, (batch, config["block"]), 0, config["vocab"])
    targets = jax.random.randint(jax.random.key(1), (batch, config["block"]), 0, config["vocab"])
    params = model.init(key, idx)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))
    state = optimizer.init(params)

    def loss_fn(params):
        logits = model.apply(params, idx)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    carry = {"params": params, "state": state}

    def step():
        carry["params"], carry["state"], loss = train_step(carry["params"], carry["state"])
        return float(loss)

    return step
