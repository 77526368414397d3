"""Hand-written JAX (flax + optax) versions of the benchmark workloads: the reference a user
who rewrote the torch script in JAX would have. Same shapes, initialization scheme, optimizer
and step (GPT-2: forward, loss, gradients, clipping at 1.0, AdamW; ResNet-50: SGD with momentum;
the loss read on the host each step)."""

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


# torchvision initializes convolutions with kaiming_normal_(mode="fan_out", nonlinearity="relu").
_conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 block (v1.5: the stride sits on the 3x3 convolution)."""

    width: int
    stride: int

    @nn.compact
    def __call__(self, x):
        conv = functools.partial(nn.Conv, use_bias=False, kernel_init=_conv_init)
        norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9, epsilon=1e-5)
        out = nn.relu(norm()(conv(self.width, (1, 1))(x)))
        out = conv(self.width, (3, 3), strides=self.stride, padding=((1, 1), (1, 1)))(out)
        out = nn.relu(norm()(out))
        out = norm()(conv(4 * self.width, (1, 1))(out))
        if self.stride != 1 or x.shape[-1] != 4 * self.width:
            x = norm()(conv(4 * self.width, (1, 1), strides=self.stride)(x))
        return nn.relu(out + x)


class BasicBlock(nn.Module):
    """torchvision's ResNet-18 block (the --tiny smoke run)."""

    width: int
    stride: int

    @nn.compact
    def __call__(self, x):
        conv = functools.partial(nn.Conv, use_bias=False, kernel_init=_conv_init, padding=((1, 1), (1, 1)))
        norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9, epsilon=1e-5)
        out = nn.relu(norm()(conv(self.width, (3, 3), strides=self.stride)(x)))
        out = norm()(conv(self.width, (3, 3))(out))
        if self.stride != 1 or x.shape[-1] != self.width:
            x = norm()(nn.Conv(self.width, (1, 1), strides=self.stride, use_bias=False, kernel_init=_conv_init)(x))
        return nn.relu(out + x)


class ResNet(nn.Module):
    """torchvision's ResNet in flax, channels last (NHWC), the layout XLA's GPU convolutions
    prefer: what a user writing ResNet-50 in JAX would write."""

    stages: tuple
    block: type
    classes: int

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(64, (7, 7), strides=2, padding=((3, 3), (3, 3)), use_bias=False, kernel_init=_conv_init)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5)(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for stage, blocks in enumerate(self.stages):
            for index in range(blocks):
                stride = 2 if stage > 0 and index == 0 else 1
                x = self.block(64 * 2**stage, stride)(x)
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


def resnet_setup(batch, size=224, tiny=False):
    """ResNet-50 (ResNet-18 with 10 classes when tiny), SGD with momentum 0.9 and weight decay
    1e-4 as torch.optim.SGD applies them (decay added to the gradient before the momentum)."""
    if tiny:
        model, classes = ResNet((2, 2, 2, 2), BasicBlock, 10), 10
    else:
        model, classes = ResNet((3, 4, 6, 3), Bottleneck, 1000), 1000
    x = jax.random.normal(jax.random.key(0), (batch, size, size, 3), jnp.float32)
    y = jax.random.randint(jax.random.key(1), (batch,), 0, classes)
    variables = model.init(jax.random.key(2), x)
    params, batch_stats = variables["params"], variables["batch_stats"]
    optimizer = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9))
    state = optimizer.init(params)

    def loss_fn(params, batch_stats):
        logits, updated = model.apply({"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, updated["batch_stats"]

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def train_step(params, batch_stats, state):
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch_stats)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), batch_stats, state, loss

    carry = {"params": params, "batch_stats": batch_stats, "state": state}

    def step():
        carry["params"], carry["batch_stats"], carry["state"], loss = train_step(carry["params"], carry["batch_stats"], carry["state"])
        return float(loss)

    return step
