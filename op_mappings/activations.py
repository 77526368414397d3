"""Activation functions and their ATen backward ops (closed forms, cheaper than a traced vjp)."""

import math

import jax
import jax.numpy as jnp

from bridge.runtime.dtypes import DEFAULT, INT_TO_FLOAT, NO_OPMATH
from bridge.runtime.registry import MAPPINGS, Vjp, aten, register_mapping


# Scalar parameters (slopes, thresholds) never take part in promotion: torch keeps the input's dtype.
SELF = ("self",)
GRAD_AND_SELF = ("grad_output", "self")
GRAD_AND_OUTPUT = ("grad_output", "output")


# ---------------------------------------------------------------- rectifiers and thresholds


# Subgradients at 0 and at the bounds: torch's (relu and threshold give 0 at the threshold,
# hardtanh passes the gradient at both bounds), not JAX's.
@register_mapping(aten.relu.default, promote=NO_OPMATH, operands=SELF, gradient="torch")
def relu(self):
    return jnp.maximum(self, jnp.zeros((), dtype=self.dtype))


@register_mapping(aten.threshold.default, promote=DEFAULT, operands=SELF, gradient="torch")
def threshold(self, threshold, value):
    return jnp.where(self <= threshold, jnp.asarray(value).astype(self.dtype), self)


@register_mapping(aten.threshold_backward.default, promote=DEFAULT, operands=GRAD_AND_SELF)
def threshold_backward(grad_output, self, threshold):
    return jnp.where(self <= threshold, jnp.zeros((), dtype=grad_output.dtype), grad_output)


@register_mapping(aten.hardtanh.default, promote=NO_OPMATH, operands=SELF, gradient="torch")
def hardtanh(self, min_val=-1, max_val=1):
    return jnp.minimum(jnp.maximum(self, min_val), max_val)


@register_mapping(aten.hardtanh_backward.default, promote=DEFAULT, operands=GRAD_AND_SELF)
def hardtanh_backward(grad_output, self, min_val, max_val):
    outside = (self <= min_val) | (self >= max_val)
    return jnp.where(outside, jnp.zeros((), dtype=grad_output.dtype), grad_output)


@register_mapping(aten.leaky_relu.default, promote=DEFAULT, operands=SELF)
def leaky_relu(self, negative_slope=0.01):
    return jnp.where(self > 0, self, self * negative_slope)


@register_mapping(aten.leaky_relu_backward.default, promote=DEFAULT, operands=GRAD_AND_SELF)
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    return jnp.where(self > 0, grad_output, grad_output * negative_slope)


@register_mapping(aten._prelu_kernel.default, promote=DEFAULT, operands=("self", "weight"))
def prelu(self, weight):
    return jnp.where(self > 0, self, weight * self)


@register_mapping(aten._prelu_kernel_backward.default)
def prelu_backward(grad_output, self, weight):
    # weight arrives broadcastable to self; its gradient is reduced back to weight's shape by autograd's
    # caller (torch's own kernel returns it at self's shape too).
    positive = self > 0
    grad_self = jnp.where(positive, grad_output, weight * grad_output)
    grad_weight = jnp.where(positive, jnp.zeros((), dtype=self.dtype), self * grad_output)
    return grad_self.astype(self.dtype), grad_weight.astype(weight.dtype)


@register_mapping(aten.hardshrink.default, promote=DEFAULT, operands=SELF)
def hardshrink(self, lambd=0.5):
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), dtype=self.dtype), self)


@register_mapping(aten.hardshrink_backward.default, promote=DEFAULT, operands=("grad_out", "self"))
def hardshrink_backward(grad_out, self, lambd):
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), dtype=grad_out.dtype), grad_out)


@register_mapping(aten.softshrink.default, promote=DEFAULT, operands=SELF)
def softshrink(self, lambd=0.5):
    return jnp.where(self > lambd, self - lambd, jnp.where(self < -lambd, self + lambd, jnp.zeros((), dtype=self.dtype)))


@register_mapping(aten.softshrink_backward.default, promote=DEFAULT, operands=GRAD_AND_SELF)
def softshrink_backward(grad_output, self, lambd):
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), dtype=grad_output.dtype), grad_output)


# ---------------------------------------------------------------- smooth activations

_SQRT_HALF = 1 / math.sqrt(2)
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_INVERSE_SQRT_2PI = 1 / math.sqrt(2 * math.pi)


# In captured regions the gradients of GELU and SiLU keep only their input, as torch's do
# (JAX differentiating the tanh GELU keeps four tensors of its size).
def _save_input(args, kwargs, out):
    return (args[0],)


def _gelu_pullback(saved, grad, args, kwargs):
    approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    return (MAPPINGS[aten.gelu_backward.default].call(grad, saved[0], approximate=approximate),)


def _silu_pullback(saved, grad, args, kwargs):
    return (MAPPINGS[aten.silu_backward.default].call(grad, saved[0]),)


@register_mapping(aten.gelu.default, promote=INT_TO_FLOAT, operands=SELF, gradient=Vjp(_save_input, _gelu_pullback))
def gelu(self, *, approximate="none"):
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (self + 0.044715 * self * self * self)
        return 0.5 * self * (1 + jnp.tanh(inner))
    return self * 0.5 * (1 + jax.lax.erf(self * _SQRT_HALF))


@register_mapping(aten.gelu_backward.default, promote=INT_TO_FLOAT, operands=GRAD_AND_SELF)
def gelu_backward(grad_output, self, *, approximate="none"):
    if approximate == "tanh":
        cube = 0.044715 * self * self * self
        tanh_inner = jnp.tanh(_SQRT_2_OVER_PI * (self + cube))
        derivative_inner = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * self * self)
        left = 0.5 * (1 + tanh_inner)
        right = 0.5 * self * (1 - tanh_inner * tanh_inner) * derivative_inner
        return grad_output * (left + right)
    cdf = 0.5 * (1 + jax.lax.erf(self * _SQRT_HALF))
    pdf = _INVERSE_SQRT_2PI * jnp.exp(-0.5 * self * self)
    return grad_output * (cdf + self * pdf)


@register_mapping(aten.silu.default, promote=INT_TO_FLOAT, operands=SELF, gradient=Vjp(_save_input, _silu_pullback))
def silu(self):
    return self * jax.nn.sigmoid(self)


@register_mapping(aten.silu_backward.default, promote=INT_TO_FLOAT, operands=GRAD_AND_SELF)
def silu_backward(grad_output, self):
    sigmoid = jax.nn.sigmoid(self)
    return grad_output * sigmoid * (1 + self * (1 - sigmoid))


@register_mapping(aten.sigmoid_backward.default, promote=DEFAULT, operands=GRAD_AND_OUTPUT)
def sigmoid_backward(grad_output, output):
    return grad_output * (1 - output) * output


@register_mapping(aten.tanh_backward.default, promote=DEFAULT, operands=GRAD_AND_OUTPUT)
def tanh_backward(grad_output, output):
    return grad_output * (1 - output * output)


@register_mapping(aten.logit_backward.default, promote=DEFAULT, operands=GRAD_AND_SELF)
def logit_backward(grad_output, self, eps=None):
    derivative = grad_output / (self * (1 - self))
    if eps is None:
        return derivative
    outside = (self < eps) | (self > 1 - eps)
    return jnp.where(outside, jnp.zeros((), dtype=derivative.dtype), derivative)


@register_mapping(aten.elu.default, promote=DEFAULT, operands=SELF)
def elu(self, alpha=1, scale=1, input_scale=1):
    negative = alpha * scale * jnp.expm1(self * input_scale)
    return jnp.where(self > 0, self * scale, negative)


@register_mapping(aten.elu_backward.default, promote=DEFAULT, operands=("grad_output", "self_or_result"))
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    if is_result:
        negative = grad_output * input_scale * (self_or_result + alpha * scale)
    else:
        negative = grad_output * input_scale * alpha * scale * jnp.exp(self_or_result * input_scale)
    return jnp.where(self_or_result > 0, grad_output * scale, negative)


@register_mapping(aten.celu.default, promote=DEFAULT, operands=SELF)
def celu(self, alpha=1.0):
    return jnp.where(self > 0, self, alpha * jnp.expm1(self / alpha))


@register_mapping(aten.selu.default, promote=DEFAULT, operands=SELF)
def selu(self):
    alpha, scale = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946
    return elu(self, alpha, scale)


@register_mapping(aten.softplus.default, promote=DEFAULT, operands=SELF)
def softplus(self, beta=1, threshold=20):
    scaled = self * beta
    # Above the threshold softplus is the identity; clamp the exp's input there so it cannot overflow.
    smooth = jnp.log1p(jnp.exp(jnp.minimum(scaled, threshold))) / beta
    return jnp.where(scaled > threshold, self, smooth)


@register_mapping(aten.softplus_backward.default, promote=DEFAULT, operands=GRAD_AND_SELF)
def softplus_backward(grad_output, self, beta, threshold):
    scaled = self * beta
    exponential = jnp.exp(jnp.minimum(scaled, threshold))
    return jnp.where(scaled > threshold, grad_output, grad_output * exponential / (exponential + 1))


def _softplus(values):
    return jnp.logaddexp(values, jnp.zeros((), dtype=values.dtype))


@register_mapping(aten.mish.default, promote=DEFAULT, operands=SELF)
def mish(self):
    return self * jnp.tanh(_softplus(self))


@register_mapping(aten.mish_backward.default, promote=DEFAULT, operands=GRAD_AND_SELF)
def mish_backward(grad_output, self):
    tanh_softplus = jnp.tanh(_softplus(self))
    sigmoid = jax.nn.sigmoid(self)
    return grad_output * (tanh_softplus + self * sigmoid * (1 - tanh_softplus * tanh_softplus))


@register_mapping(aten.hardswish.default, promote=DEFAULT, operands=SELF)
def hardswish(self):
    return self * jnp.clip(self + 3, 0, 6) / 6


@register_mapping(aten.hardswish_backward.default, promote=DEFAULT, operands=GRAD_AND_SELF)
def hardswish_backward(grad_output, self):
    middle = grad_output * (self / 3 + 0.5)
    zero = jnp.zeros((), dtype=grad_output.dtype)
    # torch's boundaries: zero up to -3 included, the identity's slope from 3 included.
    return jnp.where(self <= -3, zero, jnp.where(self < 3, middle, grad_output))


@register_mapping(aten.hardsigmoid.default, promote=DEFAULT, operands=SELF)
def hardsigmoid(self):
    return jnp.clip(self + 3, 0, 6) / 6


@register_mapping(aten.hardsigmoid_backward.default, promote=DEFAULT, operands=GRAD_AND_SELF)
def hardsigmoid_backward(grad_output, self):
    inside = (self > -3) & (self < 3)
    return jnp.where(inside, grad_output / 6, jnp.zeros((), dtype=grad_output.dtype))


# log(sigmoid(x)) for large |x|: JAX's derivative of the stable form loses what torch's formula
# (from the saved buffer) keeps.
@register_mapping(aten.log_sigmoid_forward.default, gradient="torch")
def log_sigmoid_forward(self):
    compute = jnp.float32 if self.dtype in (jnp.bfloat16, jnp.float16) else self.dtype
    values = self.astype(compute)
    # The buffer is what torch's CPU kernel saves for the backward: exp(-|x|).
    buffer = jnp.exp(-jnp.abs(values))
    output = jnp.minimum(values, 0) - jnp.log1p(buffer)
    return output.astype(self.dtype), buffer.astype(self.dtype)


@register_mapping(aten.log_sigmoid_backward.default, promote=DEFAULT, operands=GRAD_AND_SELF)
def log_sigmoid_backward(grad_output, self, buffer):
    return grad_output * jax.nn.sigmoid(-self)


# ---------------------------------------------------------------- gated


@register_mapping(aten.glu.default, promote=DEFAULT, operands=SELF)
def glu(self, dim=-1):
    first, second = jnp.split(self, 2, axis=dim)
    return first * jax.nn.sigmoid(second)


@register_mapping(aten.glu_backward.default, promote=DEFAULT, operands=GRAD_AND_SELF)
def glu_backward(grad_output, self, dim):
    first, second = jnp.split(self, 2, axis=dim)
    sigmoid = jax.nn.sigmoid(second)
    grad_first = grad_output * sigmoid
    grad_second = grad_output * first * sigmoid * (1 - sigmoid)
    return jnp.concatenate([grad_first, grad_second], axis=dim)


@register_mapping(aten.rrelu_with_noise.default, rng=True, mutates=("noise",))
def rrelu_with_noise(self, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None, *, key):
    """Randomized leaky ReLU. Training: each negative element's slope is drawn from U(lower, upper)
    and written into `noise` (1 for the others), which the backward reads; eval: the mean slope."""
    if not training:
        return jnp.where(self > 0, self, self * ((lower + upper) / 2)).astype(self.dtype), {}
    sampling = jnp.promote_types(self.dtype, jnp.float32)
    slopes = jax.random.uniform(key, self.shape, dtype=sampling, minval=lower, maxval=upper)
    negative = self <= 0
    slopes = jnp.where(negative, slopes, jnp.ones((), sampling))
    out = jnp.where(negative, self.astype(sampling) * slopes, self.astype(sampling)).astype(self.dtype)
    return out, {"noise": slopes.astype(noise.dtype)}

