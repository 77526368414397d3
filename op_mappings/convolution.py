"""Convolution and im2col/col2im (F.unfold / F.fold), with the backward ops torch's autograd calls.

Shapes here are static (they come from the schema's int lists): padding and output sizes are
worked out in Python at trace time.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from bridge.runtime import precision
from bridge.runtime.registry import aten, register_mapping
from .common import accumulator_dtype, compiled, expand_ints, linear_backward


# ---------------------------------------------------------------- convolution


def _dimension_numbers(spatial):
    letters = "DHW"[-spatial:] if spatial <= 3 else None
    return (f"NC{letters}", f"OI{letters}", f"NC{letters}")


def _transposed_weight(weight, groups):
    """A transposed convolution's weight (in, out/groups, *k) as the forward weight (out, in/groups, *k), flipped."""
    in_channels, out_per_group = weight.shape[:2]
    kernel = weight.shape[2:]
    grouped = weight.reshape((groups, in_channels // groups, out_per_group) + kernel)
    grouped = jnp.swapaxes(grouped, 1, 2)
    forward = grouped.reshape((groups * out_per_group, in_channels // groups) + kernel)
    return jnp.flip(forward, axis=tuple(range(2, 2 + len(kernel))))


def _accumulating_conv(input, weight, accumulator, **options):
    """lax.conv_general_dilated of `input` and `weight`, its result in `accumulator`'s dtype.

    For bfloat16 and float16 operands (accumulated in float32, as cuDNN and torch's CPU kernels
    do) the gradient is made of convolutions of operands of that dtype too, as torch's
    convolution backward is: JAX's own rule for the float32 result would convolve the float32
    cotangent with an upcast operand, which on GPUs ran the weight gradient of ConvNeXt's
    depthwise convolutions as TF32 FFTs (timm's ConvNeXt-T trained at 1.8x torch eager's step)."""

    def plain(input, weight, preferred):
        return lax.conv_general_dilated(
            input, weight, precision=precision.conv_precision(), preferred_element_type=preferred, **options
        )

    if accumulator == input.dtype:
        return plain(input, weight, accumulator)

    @jax.custom_jvp
    def conv(input, weight):
        return plain(input, weight, accumulator)

    @conv.defjvp
    def tangent(primals, tangents):
        # Linear in the tangents, in the operands' dtype: JAX's reverse mode transposes these
        # (forward mode, torch.func.jvp, uses them as they are).
        (input, weight), (input_dot, weight_dot) = primals, tangents
        out_dot = plain(input_dot, weight, None) + plain(input, weight_dot, None)
        return conv(input, weight), out_dot.astype(accumulator)

    return conv(input, weight)


@compiled("stride", "padding", "dilation", "transposed", "output_padding", "groups", "channels_last")
def _convolve(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, channels_last=False):
    spatial = input.ndim - 2
    stride = expand_ints(stride, spatial)
    padding = expand_ints(padding, spatial)
    dilation = expand_ints(dilation, spatial)
    accumulator = accumulator_dtype(input.dtype)
    if transposed:
        output_padding = expand_ints(output_padding, spatial)
        kernel = weight.shape[2:]
        # A transposed convolution is the input-gradient of a forward one: dilate the input by
        # the stride and pad by the dilated kernel extent less the forward padding.
        pads = [
            (dilation[i] * (kernel[i] - 1) - padding[i], dilation[i] * (kernel[i] - 1) - padding[i] + output_padding[i])
            for i in range(spatial)
        ]
        out = _accumulating_conv(
            input,
            _transposed_weight(weight, groups),
            accumulator,
            window_strides=(1,) * spatial,
            padding=tuple(pads),
            lhs_dilation=tuple(stride),
            rhs_dilation=tuple(dilation),
            dimension_numbers=_dimension_numbers(spatial),
            feature_group_count=groups,
        )
    else:
        numbers = _dimension_numbers(spatial)
        if channels_last:  # precision.conv_channels_last: NHWC out, NCHW after the transpose below
            numbers = numbers[:2] + ("NHWC",)
        out = _accumulating_conv(
            input,
            weight,
            accumulator,
            window_strides=tuple(stride),
            padding=tuple((p, p) for p in padding),
            lhs_dilation=None,
            rhs_dilation=tuple(dilation),
            dimension_numbers=numbers,
            feature_group_count=groups,
        )
        if channels_last:
            if bias is not None:
                out = out + bias.astype(accumulator)
            return jnp.transpose(out, (0, 3, 1, 2)).astype(input.dtype)
    if bias is not None:
        out = out + bias.astype(accumulator).reshape((1, -1) + (1,) * spatial)
    return out.astype(input.dtype)


@register_mapping(aten.convolution.default, reads=("precision",))
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    channels_last = input.ndim == 4 and not transposed and precision.conv_channels_last()
    return _convolve(
        input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, channels_last=channels_last
    )


@register_mapping(aten.convolution_backward.default, reads=("precision",))
def convolution_backward(
    grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    return _convolution_backward(
        grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups, output_mask
    )


@compiled("stride", "padding", "dilation", "transposed", "output_padding", "groups", "output_mask")
def _convolution_backward(grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups, output_mask):
    def forward(input, weight):
        return _convolve(input, weight, None, stride, padding, dilation, transposed, output_padding, groups)

    _, pullback = jax.vjp(forward, input, weight)
    grad_input, grad_weight = pullback(grad_output.astype(input.dtype))
    grad_bias = None
    if output_mask[2]:
        axes = (0,) + tuple(range(2, grad_output.ndim))
        grad_bias = jnp.sum(grad_output.astype(accumulator_dtype(grad_output.dtype)), axis=axes).astype(grad_output.dtype)
    return (
        grad_input if output_mask[0] else None,
        grad_weight if output_mask[1] else None,
        grad_bias,
    )


# ---------------------------------------------------------------- im2col / col2im (F.unfold / F.fold)


@compiled("kernel_size", "dilation", "padding", "stride")
def _im2col(input, kernel_size, dilation, padding, stride):
    batched = input.ndim == 4
    if not batched:
        input = input[None]
    if input.size == 0:
        # conv_general_dilated_patches divides by the batch size; an empty input has empty columns.
        blocks = math.prod(
            (input.shape[2 + i] + 2 * padding[i] - dilation[i] * (kernel_size[i] - 1) - 1) // stride[i] + 1 for i in range(2)
        )
        columns = jnp.zeros((input.shape[0], input.shape[1] * math.prod(kernel_size), blocks), dtype=input.dtype)
        return columns if batched else columns[0]
    patches = lax.conv_general_dilated_patches(
        input,
        filter_shape=tuple(kernel_size),
        window_strides=tuple(stride),
        padding=[(p, p) for p in padding],
        rhs_dilation=tuple(dilation),
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
        precision=lax.Precision.HIGHEST,
    )
    # patches: (N, C * kh * kw, out_h, out_w) with channel-major features, the order torch uses.
    columns = patches.reshape(patches.shape[:2] + (-1,))
    return columns if batched else columns[0]


@register_mapping(aten.im2col.default)
def im2col(self, kernel_size, dilation, padding, stride):
    return _im2col(self, expand_ints(kernel_size, 2), expand_ints(dilation, 2), expand_ints(padding, 2), expand_ints(stride, 2))


@register_mapping(aten.col2im.default)
def col2im(self, output_size, kernel_size, dilation, padding, stride):
    return _col2im(self, expand_ints(output_size, 2), expand_ints(kernel_size, 2), expand_ints(dilation, 2), expand_ints(padding, 2), expand_ints(stride, 2))


@compiled("output_size", "kernel_size", "dilation", "padding", "stride")
def _col2im(columns, output_size, kernel_size, dilation, padding, stride):
    batched = columns.ndim == 3
    channels = columns.shape[-2] // math.prod(kernel_size)
    image_shape = ((columns.shape[0],) if batched else ()) + (channels,) + tuple(output_size)
    like = jnp.zeros(image_shape, dtype=columns.dtype)

    def forward(image):
        return _im2col(image, kernel_size, dilation, padding, stride)

    # col2im is the adjoint of im2col: overlapping patches add up.
    return linear_backward(forward, columns, like)
