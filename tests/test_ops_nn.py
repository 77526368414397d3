"""Neural-network mappings (matrix products, convolution and pooling, normalization, losses, attention)
against eager torch: each entry called directly, then whole modules' gradients through the bridge."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import op_testing
from bridge.runtime.registry import MAPPINGS
from op_testing import run_mapping, to_jax, to_torch

aten = torch.ops.aten

# bfloat16 keeps 8 bits of mantissa; entries accumulate in float32, so they are compared with
# float64 torch rounded to bfloat16 rather than with torch's bfloat16 kernels, whose own
# accumulation error in backward ops (sums over overlapping windows, batch axes) is larger.
BF16 = dict(atol=3e-2, rtol=3e-2)

# This file runs its entries op by op (eager), where the other families trace them under jax.jit.
check = functools.partial(op_testing.check, eager=True, bfloat16_against_float64=BF16)


def sample(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        return torch.randint(-4, 5, shape, generator=generator, dtype=dtype)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


FLOATS = [torch.float32, torch.float64, torch.bfloat16]


# ---------------------------------------------------------------- matrix products


def test_matrix_products():
    a, b, c = sample(3, 4), sample(4, 5, seed=1), sample(3, 5, seed=2)
    check(aten.mm.default, a, b)
    check(aten.addmm.default, c, a, b, beta=2, alpha=3)
    check(aten.addmm.default, sample(5), a, b)
    batch1, batch2 = sample(2, 3, 4), sample(2, 4, 5, seed=1)
    check(aten.bmm.default, batch1, batch2)
    check(aten.baddbmm.default, sample(2, 3, 5), batch1, batch2, beta=0.5, alpha=2)
    check(aten.addbmm.default, c, batch1, batch2)
    vector = sample(4, seed=3)
    check(aten.mv.default, a, vector)
    check(aten.addmv.default, sample(3), a, vector, beta=2, alpha=-1)
    check(aten.dot.default, vector, sample(4, seed=4))
    check(aten.vdot.default, vector, sample(4, seed=4))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64])
def test_matrix_products_other_dtypes(dtype):
    a, b, c = sample(3, 4, dtype=dtype), sample(4, 5, dtype=dtype, seed=1), sample(3, 5, dtype=dtype, seed=2)
    check(aten.mm.default, a, b)
    check(aten.addmm.default, c, a, b, beta=2, alpha=3)
    batch1, batch2 = sample(2, 3, 4, dtype=dtype), sample(2, 4, 5, dtype=dtype, seed=1)
    check(aten.baddbmm.default, sample(2, 3, 5, dtype=dtype), batch1, batch2, beta=2, alpha=3)


def test_addmm_beta_zero_ignores_nan():
    bias = torch.full((3, 5), float("nan"))
    check(aten.addmm.default, bias, sample(3, 4), sample(4, 5), beta=0)


def test_bfloat16_products_accumulate_in_float32():
    # 512 terms of 1 + 2**-8: a bfloat16 running sum would stall; float32 accumulation does not.
    ones = torch.full((1, 512), 1 + 2**-8, dtype=torch.bfloat16)
    result = run_mapping(aten.mm.default, ones, torch.ones(512, 1, dtype=torch.bfloat16), eager=True)
    torch.testing.assert_close(result.double(), torch.tensor([[514.0]], dtype=torch.float64), atol=2, rtol=0)


# ---------------------------------------------------------------- convolution

CONVOLUTIONS = [
    # input shape, weight shape, stride, padding, dilation, transposed, output_padding, groups
    ((2, 4, 9, 8), (6, 2, 3, 2), [2, 1], [1, 0], [1, 2], False, [0, 0], 2),
    ((2, 4, 7, 6), (4, 3, 3, 3), [2, 2], [1, 1], [1, 1], True, [1, 0], 1),
    ((2, 4, 7, 6), (4, 1, 2, 3), [2, 1], [0, 1], [2, 1], True, [1, 0], 4),
    ((2, 3, 10), (5, 3, 3), [2], [1], [1], False, [0], 1),
    ((1, 2, 5, 6, 4), (3, 2, 2, 3, 2), [1, 2, 1], [1, 0, 1], [1, 1, 2], False, [0, 0, 0], 1),
]


@pytest.mark.parametrize("case", CONVOLUTIONS, ids=["grouped", "transposed", "transposed-grouped", "1d", "3d"])
def test_convolution_and_backward(case):
    dtype = torch.float64
    input_shape, weight_shape, stride, padding, dilation, transposed, output_padding, groups = case
    input, weight = sample(*input_shape, dtype=dtype), sample(*weight_shape, dtype=dtype, seed=1)
    channels = weight_shape[1] * groups if transposed else weight_shape[0]
    bias = sample(channels, dtype=dtype, seed=2)
    arguments = (stride, padding, dilation, transposed, output_padding, groups)
    out = check(aten.convolution.default, input, weight, bias, *arguments)
    grad = sample(*out.shape, dtype=dtype, seed=3)
    check(aten.convolution_backward.default, grad, input, weight, [channels], *arguments, [True, True, True])
    check(aten.convolution_backward.default, grad, input, weight, None, *arguments, [True, False, False])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_convolution_low_precision(dtype):
    input, weight = sample(2, 4, 9, 8, dtype=dtype), sample(6, 2, 3, 3, dtype=dtype, seed=1)
    check(aten.convolution.default, input, weight, sample(6, dtype=dtype), [1, 1], [1, 1], [1, 1], False, [0, 0], 2)


def test_convolution_backward_honours_output_mask():
    input, weight = sample(1, 2, 5, 5), sample(3, 2, 3, 3, seed=1)
    grad = sample(1, 3, 3, 3, seed=2)
    grads = run_mapping(aten.convolution_backward.default, grad, input, weight, [3], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, False], eager=True)
    assert grads[0] is None and grads[2] is None and grads[1].shape == weight.shape


# ---------------------------------------------------------------- pooling

POOLS = [
    # kernel, stride, padding, dilation, ceil_mode
    ([2, 2], [], [0, 0], [1, 1], False),
    ([3, 3], [2, 2], [1, 1], [1, 1], True),
    ([3, 2], [2, 1], [1, 0], [2, 1], True),
]


@pytest.mark.parametrize("pool", POOLS, ids=["plain", "padded-ceil", "dilated"])
def test_max_pool2d_with_indices(pool):
    dtype = torch.float32
    input = sample(2, 3, 9, 8, dtype=dtype)
    values, indices = check(aten.max_pool2d_with_indices.default, input, *pool)
    expected_indices = aten.max_pool2d_with_indices.default(input, *pool)[1]
    # Indices are flat positions in the input's H*W plane, as torch defines them.
    assert torch.equal(indices, expected_indices)
    grad = sample(*values.shape, dtype=dtype, seed=1)
    check(aten.max_pool2d_with_indices_backward.default, grad, input, *pool, expected_indices)


def test_max_pools_pick_torchs_element_among_ties_and_nan():
    # torch keeps the first of equal maxima but the last NaN of a window.
    input = torch.tensor([[[[1.0, 1.0, 0.0], [1.0, float("nan"), 2.0], [float("nan"), 0.0, 0.0]]]])
    check(aten.max_pool2d_with_indices.default, input, [2, 2], [1, 1])
    check(aten.max_pool2d_with_indices.default, input.to(torch.bfloat16), [2, 2], [1, 1])
    check(aten.adaptive_max_pool2d.default, input, [2, 2])


def test_max_pool3d_with_indices():
    input = sample(1, 2, 5, 6, 7)
    pool = ([2, 2, 3], [2, 1, 2], [1, 0, 1], [1, 1, 1], True)
    values, indices = check(aten.max_pool3d_with_indices.default, input, *pool)
    check(aten.max_pool3d_with_indices_backward.default, sample(*values.shape, seed=1), input, *pool, indices)


@pytest.mark.parametrize("count_include_pad, divisor_override", [(True, None), (False, None), (False, 3)])
def test_avg_pool2d(count_include_pad, divisor_override):
    input = sample(2, 3, 9, 8, dtype=torch.float64)
    arguments = ([3, 3], [2, 2], [1, 1], True, count_include_pad, divisor_override)
    out = check(aten.avg_pool2d.default, input, *arguments)
    check(aten.avg_pool2d_backward.default, sample(*out.shape, dtype=torch.float64, seed=1), input, *arguments)


def test_avg_pool2d_bfloat16_and_3d():
    check(aten.avg_pool2d.default, sample(2, 3, 8, 8, dtype=torch.bfloat16), [2, 2], [2, 2])
    input = sample(1, 2, 5, 6, 7)
    out = check(aten.avg_pool3d.default, input, [2, 2, 3], [2, 1, 2], [1, 0, 1], True, False)
    check(aten.avg_pool3d_backward.default, sample(*out.shape, seed=1), input, [2, 2, 3], [2, 1, 2], [1, 0, 1], True, False, None)


@pytest.mark.parametrize("output_size", [[3, 4], [4, 5]])
def test_adaptive_pools(output_size):
    input = sample(2, 3, 9, 8)
    out = check(aten._adaptive_avg_pool2d.default, input, output_size)
    check(aten._adaptive_avg_pool2d_backward.default, sample(*out.shape, seed=1), input)
    values, indices = check(aten.adaptive_max_pool2d.default, input, output_size)
    check(aten.adaptive_max_pool2d_backward.default, sample(*values.shape, seed=1), input, indices)


# ---------------------------------------------------------------- upsampling, im2col


@pytest.mark.parametrize(
    "output_size, scales, dtype",
    [([20, 13], (None, None), torch.float32), ([27, 12], (3.0, 1.5), torch.float64)],
)
def test_upsampling(output_size, scales, dtype):
    input = sample(2, 3, 9, 8, dtype=dtype)
    out = check(aten.upsample_nearest2d.default, input, output_size, *scales)
    check(aten.upsample_nearest2d_backward.default, sample(*out.shape, dtype=dtype, seed=1), output_size, list(input.shape), *scales)
    for align_corners in (True, False):
        out = check(aten.upsample_bilinear2d.default, input, output_size, align_corners, *scales)
        grad = sample(*out.shape, dtype=dtype, seed=1)
        check(aten.upsample_bilinear2d_backward.default, grad, output_size, list(input.shape), align_corners, *scales)


def test_upsampling_vec_overloads():
    input = sample(2, 3, 9, 8)
    check(aten.upsample_nearest2d.vec, input, None, [2.0, 1.5])
    check(aten.upsample_bilinear2d.vec, input, [5, 7], False, None)


def test_im2col_and_col2im():
    input = sample(2, 3, 9, 8)
    columns = check(aten.im2col.default, input, [3, 2], [1, 2], [1, 0], [2, 1])
    check(aten.col2im.default, columns, [9, 8], [3, 2], [1, 2], [1, 0], [2, 1])


# ---------------------------------------------------------------- normalization


@pytest.mark.parametrize(
    "training, dtype",
    [(True, torch.float32), (False, torch.float32), (True, torch.float64), (True, torch.bfloat16)],
)
def test_native_batch_norm(training, dtype):
    input = sample(4, 3, 5, 6, dtype=dtype) * 2 + 1
    weight, bias = sample(3, dtype=dtype, seed=1), sample(3, dtype=dtype, seed=2)
    running_mean, running_var = sample(3, dtype=dtype, seed=3), torch.rand(3, dtype=dtype) + 0.5
    expected_mean, expected_var = running_mean.clone(), running_var.clone()
    expected = aten.native_batch_norm.default(input, weight, bias, expected_mean, expected_var, training, 0.1, 1e-5)
    (out, mean, inverse_std), updates = MAPPINGS[aten.native_batch_norm.default].call(
        *[to_jax(a) for a in (input, weight, bias, running_mean, running_var)], training, 0.1, 1e-5
    )
    tolerance = BF16 if dtype is torch.bfloat16 else {}
    torch.testing.assert_close(to_torch(out), expected[0], **tolerance)
    if training:
        torch.testing.assert_close(to_torch(mean).to(dtype), expected[1], **tolerance)
        torch.testing.assert_close(to_torch(inverse_std).to(dtype), expected[2], **tolerance)
        torch.testing.assert_close(to_torch(updates["running_mean"]), expected_mean, **tolerance)
        torch.testing.assert_close(to_torch(updates["running_var"]), expected_var, **tolerance)
    else:
        assert updates == {}
    saved = (expected[1], expected[2]) if training else (None, None)
    grad = sample(*input.shape, dtype=dtype, seed=4)
    check(aten.native_batch_norm_backward.default, grad, input, weight, running_mean, running_var, *saved, training, 1e-5, [True, True, True])


def test_batch_norm_variants():
    input, weight, bias = sample(4, 3, 5), sample(3, seed=1), sample(3, seed=2)
    running_mean, running_var = sample(3, seed=3), torch.rand(3) + 0.5
    check(aten._native_batch_norm_legit.no_stats, input, weight, bias, True, 0.1, 1e-5)
    check(aten._native_batch_norm_legit_no_training.default, input, weight, bias, running_mean, running_var, 0.1, 1e-5, outputs=[0])
    check(aten._native_batch_norm_legit_functional.default, input, weight, bias, running_mean, running_var, True, 0.1, 1e-5)
    check(aten._batch_norm_with_update_functional.default, input, weight, bias, running_mean, running_var, 0.1, 1e-5)
    check(aten._batch_norm_no_update.default, input, weight, bias, running_mean, running_var, 0.1, 1e-5, outputs=[0])


@pytest.mark.parametrize("dtype", FLOATS)
def test_layer_norm(dtype):
    input = sample(4, 3, 5, 6, dtype=dtype) * 2 + 1
    for normalized_shape in ([6], [5, 6]):
        weight, bias = sample(*normalized_shape, dtype=dtype, seed=1), sample(*normalized_shape, dtype=dtype, seed=2)
        _, mean, inverse_std = check(aten.native_layer_norm.default, input, normalized_shape, weight, bias, 1e-5, outputs=[0])
        expected = aten.native_layer_norm.default(input, normalized_shape, weight, bias, 1e-5)
        grad = sample(*input.shape, dtype=dtype, seed=3)
        check(aten.native_layer_norm_backward.default, grad, input, normalized_shape, expected[1], expected[2], weight, bias, [True, True, True])
    _, mean, inverse_std = aten.native_layer_norm.default(input, [6], None, None, 1e-5)
    check(aten.native_layer_norm_backward.default, grad, input, [6], mean, inverse_std, None, None, [True, False, False])


@pytest.mark.parametrize("offset", [1e4, -3e5])
def test_layer_norm_far_from_zero(offset):
    # The statistics come from shifted sums (op_mappings.normalization._shifted): rows
    # far from zero keep their variance in float32 as torch's kernel does (the centred form put 1/std
    # off by 7e-4 at -3e5), and constant rows get a variance of 0.
    # At such offsets the input itself is rounded to float32's steps there, so the output is held to
    # torch's own float32 error against float64, not to torch's float32 result.
    input = sample(8, 768) + offset
    input[3] = offset  # a constant row
    input[5, 0] += 40  # a row whose first value, the shift, lies far from its mean
    weight, bias = sample(768, seed=1), sample(768, seed=2)
    exact = aten.native_layer_norm.default(input.double(), [768], weight.double(), bias.double(), 1e-5)
    ours = [to_torch(value).double() for value in run_mapping(aten.native_layer_norm.default, input, [768], weight, bias, 1e-5)]
    torch_own = [value.double() for value in aten.native_layer_norm.default(input, [768], weight, bias, 1e-5)]
    torch.testing.assert_close(ours[2], exact[2], rtol=1e-5, atol=0)  # 1 / std: the variance, to float32's digits
    torch.testing.assert_close(ours[1], exact[1], rtol=1e-6, atol=0)  # the mean
    our_error, torch_error = (ours[0] - exact[0]).abs().max(), (torch_own[0] - exact[0]).abs().max()
    assert our_error <= 1.5 * torch_error, (our_error, torch_error)


@pytest.mark.parametrize("groups, dtype", [(3, torch.float32), (6, torch.float64), (2, torch.bfloat16)])
def test_group_norm(groups, dtype):
    input = sample(2, 6, 4, 5, dtype=dtype)
    weight, bias = sample(6, dtype=dtype, seed=1), sample(6, dtype=dtype, seed=2)
    check(aten.native_group_norm.default, input, weight, bias, 2, 6, 20, groups, 1e-5)
    _, mean, inverse_std = aten.native_group_norm.default(input, weight, bias, 2, 6, 20, groups, 1e-5)
    grad = sample(*input.shape, dtype=dtype, seed=3)
    check(aten.native_group_norm_backward.default, grad, input, mean, inverse_std, weight, 2, 6, 20, groups, [True, True, True])


@pytest.mark.parametrize("eps, dtype", [(None, torch.float32), (1e-6, torch.float64)])
def test_fused_rms_norm(eps, dtype):
    input, weight = sample(4, 3, 6, dtype=dtype), sample(6, dtype=dtype, seed=1)
    out, inverse_rms = check(aten._fused_rms_norm.default, input, [6], weight, eps)
    # torch has no CPU kernel for the backward op: compare with autograd through F.rms_norm.
    grad = sample(*input.shape, dtype=dtype, seed=2)
    leaf_input, leaf_weight = input.clone().requires_grad_(), weight.clone().requires_grad_()
    F.rms_norm(leaf_input, [6], leaf_weight, eps).backward(grad)
    grads = run_mapping(aten._fused_rms_norm_backward.default, grad, input, [6], inverse_rms, weight, [True, True], eager=True)
    torch.testing.assert_close(grads[0], leaf_input.grad)
    torch.testing.assert_close(grads[1], leaf_weight.grad)


# ---------------------------------------------------------------- softmax and losses


@pytest.mark.parametrize("dtype, dim", [(torch.float32, 1), (torch.float64, -1), (torch.bfloat16, 1)])
def test_softmax_family(dtype, dim):
    input = sample(4, 5, 3, dtype=dtype)
    pairs = (
        (aten._softmax.default, aten._softmax_backward_data.default),
        (aten._log_softmax.default, aten._log_softmax_backward_data.default),
    )
    for forward, backward in pairs:
        check(forward, input, dim, False)
        check(backward, sample(*input.shape, dtype=dtype, seed=1), forward(input, dim, False), dim, dtype)
    masked = input.clone()
    masked[0, :, 0] = -float("inf")
    check(aten._safe_softmax.default, masked, 1)


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_nll_loss(reduction):
    dtype = torch.float64
    log_probabilities = torch.log_softmax(sample(6, 5, dtype=dtype), 1)
    weight = torch.rand(5, dtype=dtype)
    for ignore_index, class_weight in ((-100, None), (2, weight)):
        target = torch.tensor([0, 4, 2, ignore_index, 1, 2])
        out, total_weight = check(aten.nll_loss_forward.default, log_probabilities, target, class_weight, reduction, ignore_index)
        grad = sample(*out.shape, dtype=dtype, seed=1)
        check(aten.nll_loss_backward.default, grad, log_probabilities, target, class_weight, reduction, ignore_index, total_weight)
    images = torch.log_softmax(sample(2, 5, 3, 4, dtype=dtype), 1)
    target = torch.randint(0, 5, (2, 3, 4), generator=torch.Generator().manual_seed(0))
    target[0, 0, 0] = -100
    out, total_weight = check(aten.nll_loss2d_forward.default, images, target, weight, reduction, -100)
    check(aten.nll_loss2d_backward.default, sample(*out.shape, dtype=dtype, seed=1), images, target, weight, reduction, -100, total_weight)


@pytest.mark.parametrize("reduction", [0, 1])
def test_pointwise_losses(reduction):
    input, target = sample(4, 5) * 2, torch.rand(4, 5, generator=torch.Generator().manual_seed(1))
    probabilities = torch.rand(4, 5, generator=torch.Generator().manual_seed(2)) * 0.98 + 0.01
    signs = sample(4, 5, seed=3).sign()
    cases = [
        (aten.mse_loss.default, aten.mse_loss_backward.default, (input, target), ()),
        (aten.smooth_l1_loss.default, aten.smooth_l1_loss_backward.default, (input, target), (0.5,)),
        (aten.smooth_l1_loss.default, aten.smooth_l1_loss_backward.default, (input, target), (0.0,)),
        (aten.huber_loss.default, aten.huber_loss_backward.default, (input, target), (0.7,)),
        (aten.soft_margin_loss.default, aten.soft_margin_loss_backward.default, (input, signs), ()),
    ]
    for forward, backward, operands, extra in cases:
        out = check(forward, *operands, reduction, *extra)
        check(backward, sample(*out.shape, seed=4), *operands, reduction, *extra)
    weight = torch.rand(5)
    out = check(aten.binary_cross_entropy.default, probabilities, target, weight, reduction)
    check(aten.binary_cross_entropy_backward.default, sample(*out.shape, seed=4), probabilities, target, weight, reduction)
    check(aten.binary_cross_entropy_with_logits.default, input, target, weight, torch.rand(5) * 3, reduction)
    check(aten.binary_cross_entropy_with_logits.default, input, target, None, None, reduction)
    check(aten.mse_loss.default, input, target, 2)
    check(aten.mse_loss_backward.default, torch.tensor(0.5), input, target, 2)


def test_binary_cross_entropy_clamps_logarithms():
    check(aten.binary_cross_entropy.default, torch.tensor([0.0, 1.0, 0.5]), torch.tensor([1.0, 0.0, 1.0]), None, 0)


def test_losses_bfloat16():
    input, target = sample(4, 5, dtype=torch.bfloat16), sample(4, 5, dtype=torch.bfloat16, seed=1)
    check(aten.mse_loss.default, input, target, 1)
    check(aten._log_softmax.default, input, 1, False)
    check(aten.nll_loss_forward.default, input, torch.tensor([0, 1, 2, 3]), None, 1, -100)


# ---------------------------------------------------------------- attention

ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default
ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@pytest.mark.parametrize(
    "variant, dtype",
    [
        ("plain", torch.float32),
        ("causal-scaled", torch.float64),
        ("float-mask", torch.float32),
        ("grouped-query", torch.float64),
        ("causal-scaled", torch.bfloat16),
        ("float-mask", torch.bfloat16),
    ],
)
def test_flash_attention_for_cpu(variant, dtype):
    query = sample(2, 4, 5, 8, dtype=dtype)
    key_heads = 2 if variant == "grouped-query" else 4
    key, value = sample(2, key_heads, 7, 8, dtype=dtype, seed=1), sample(2, key_heads, 7, 8, dtype=dtype, seed=2)
    is_causal = variant == "causal-scaled"
    keywords = {"scale": 0.3} if is_causal else {}
    if variant == "float-mask":
        mask = sample(5, 7, dtype=dtype, seed=3)
        mask[2] = -float("inf")  # a fully masked row gives zeros, as torch's kernel does
        keywords["attn_mask"] = mask
    out, logsumexp = check(ATTENTION, query, key, value, 0.0, is_causal, **keywords)
    assert logsumexp.dtype == (torch.float64 if dtype is torch.float64 else torch.float32)
    expected_out, expected_logsumexp = ATTENTION(query, key, value, 0.0, is_causal, **keywords)
    grad = sample(*out.shape, dtype=dtype, seed=4)
    check(ATTENTION_BACKWARD, grad, query, key, value, expected_out, expected_logsumexp, 0.0, is_causal, **keywords)


# ---------------------------------------------------------------- whole modules through the bridge


def _compare_training_step(model, inputs, loss_function, tolerance):
    bridged_model = copy.deepcopy(model).to("cuda")
    losses = []
    for module, device in ((model, "cpu"), (bridged_model, "cuda")):
        loss = loss_function(module, *[value.to(device) for value in inputs])
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1].cpu(), losses[0], **tolerance)
    for (name, parameter), (_, bridged_parameter) in zip(model.named_parameters(), bridged_model.named_parameters()):
        torch.testing.assert_close(bridged_parameter.grad.cpu(), parameter.grad, **tolerance, msg=name)
    return bridged_model


def test_cnn_gradients_through_bridge(bridged):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.MaxPool2d(2),
        nn.ConvTranspose2d(4, 4, 3, stride=2, output_padding=1),
        nn.AdaptiveAvgPool2d(3),
        nn.Flatten(),
        nn.Linear(36, 5),
    )
    inputs = (torch.randn(4, 3, 10, 10), torch.randint(0, 5, (4,)))
    _compare_training_step(
        model, inputs, lambda m, x, t: F.cross_entropy(m(x), t, label_smoothing=0.1), dict(atol=1e-5, rtol=1e-4)
    )


def test_attention_block_gradients_through_bridge(bridged):
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.projection = nn.Linear(16, 48)
            self.output = nn.Linear(16, 16)

        def forward(self, x):
            query, key, value = self.projection(self.norm(x)).reshape(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
            return self.output(attended.transpose(1, 2).reshape(2, 6, 16))

    inputs = (torch.randn(2, 6, 16), torch.randn(2, 6, 16))
    _compare_training_step(Block(), inputs, lambda m, x, t: F.mse_loss(m(x), t), dict(atol=1e-5, rtol=1e-4))


def test_batch_norm_running_stats_through_bridge(bridged):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 2))
    inputs = (torch.randn(4, 3, 6, 6), torch.randn(4, 2))
    bridged_model = _compare_training_step(model, inputs, lambda m, x, t: F.mse_loss(m(x), t), dict(atol=1e-5, rtol=1e-4))
    torch.testing.assert_close(bridged_model[1].running_mean.cpu(), model[1].running_mean)
    torch.testing.assert_close(bridged_model[1].running_var.cpu(), model[1].running_var)
    model.eval()
    bridged_model.eval()
    torch.testing.assert_close(bridged_model(inputs[0].to("cuda")).cpu(), model(inputs[0]), atol=1e-5, rtol=1e-4)


def test_group_norm_of_an_empty_batch():
    check(aten.native_group_norm.default, torch.zeros(0, 2), torch.ones(2), torch.zeros(2), 0, 2, 1, 2, 1e-5)


def test_dropout_backward_of_a_bool_gradient_is_float():
    gradient = torch.tensor([True, True, False, True])
    mask = torch.tensor([True, False, True, True])
    check(aten.native_dropout_backward.default, gradient, mask, 2.0)


def _convolutions(jaxpr):
    """Every conv_general_dilated equation of a jaxpr, nested ones (custom_vjp, pjit) included."""
    import jax

    found = []
    for equation in jaxpr.eqns:
        if equation.primitive.name == "conv_general_dilated":
            found.append(equation)
        for value in equation.params.values():
            inner = getattr(value, "jaxpr", value)
            if isinstance(inner, jax.extend.core.Jaxpr):
                found += _convolutions(inner)
    return found


@pytest.mark.parametrize("groups", [1, 8], ids=["dense", "depthwise"])
def test_half_precision_convolution_gradients_are_half_precision_convolutions(groups, bridged):
    """A bfloat16 convolution accumulates in float32, and its input and weight gradients are
    convolutions of bfloat16 operands, as torch's backward is: JAX's own rule convolved the
    float32 cotangent with an upcast operand (TF32 and FFT kernels on GPUs, ConvNeXt's step at
    1.8x torch's). The values are torch's within bfloat16's tolerances."""
    import jax
    import jax.numpy as jnp

    from bridge.compat.harness import judge_against_float64
    from bridge.op_mappings import convolution

    def loss(x, w):
        out = convolution._convolve(x, w, None, [1, 1], [3, 3], [1, 1], False, [0, 0], groups)
        return out.astype(jnp.float32).sum()

    x, w = jnp.ones((2, 8, 16, 16), jnp.bfloat16), jnp.ones((8, 8 // groups, 7, 7), jnp.bfloat16)
    convs = _convolutions(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr)
    assert len(convs) == 3, convs  # the forward, the input's and the weight's gradients
    assert all(operand.aval.dtype == jnp.bfloat16 for equation in convs for operand in equation.invars), convs
    assert convs[0].params["preferred_element_type"] == jnp.float32

    torch.manual_seed(0)
    reference = nn.Conv2d(8, 8, 7, padding=3, groups=groups).bfloat16()
    model = copy.deepcopy(reference).cuda()
    wide = copy.deepcopy(reference).double()
    expected = torch.randn(2, 8, 16, 16).bfloat16().requires_grad_()
    data, exact = expected.detach().cuda().requires_grad_(), expected.detach().double().requires_grad_()
    # One cotangent for all three, in bfloat16 as torch and the bridge hand it to the
    # convolution: made from each one's own output, it carried the forward's rounding into the
    # gradients (an output element on a rounding boundary, which the CPU's kernels sum in
    # different orders: on a CPU with AMX, torch's sat on the other side of it than XLA's).
    cotangent = 2 * reference(expected).detach()
    for module, given in ((reference, expected), (model, data), (wide, exact)):
        module(given).backward(cotangent.to(given.device).to(given.dtype))
    results = [
        (given.grad, module.weight.grad, module.bias.grad) for module, given in ((model, data), (reference, expected), (wide, exact))
    ]
    actual = [tensor.cpu() for tensor in results[0]]
    # bfloat16 sums of 392 products round differently in torch's CPU kernel and XLA's: the
    # bridge's gradients are as close to float64's as torch's, summed over the elements.
    verdict = judge_against_float64(actual, list(results[1]), list(results[2]))
    assert verdict is not None and verdict[0] == "precise", verdict
