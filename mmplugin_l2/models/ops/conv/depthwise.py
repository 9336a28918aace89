"""A depth-wise convolution's training pass with the gradients oneDNN computes slowly on CPU written otherwise
(`DepthwiseConvFunction`): the weight gradient of a large kernel as a convolution per sample, the input gradient of
a strided convolution in fp32. The layer is `layers.conv.Conv2dCL`, which runs it where `depthwise_applies` and
`DEPTHWISE_CONV` (in `ops.conv`) say, through `ops.dispatch.choose`.

A depth-wise convolution y = conv(x, W) (groups = C, W (C, 1, kh, kw), stride s, padding p, dilation d) has the
weight gradient

    dW[c, 0, i, j] = sum_b sum_(h, w) x_p[b, c, s h + d i, s w + d j] * dy[b, c, h, w]      (x_p: x zero-padded)

which for each sample b is itself a depth-wise convolution: x_p[b] (1, C, H_p, W_p) convolved with dy[b] as C
kernels (C, 1, H_out, W_out) (groups C, stride d, dilation s) gives sample b's term; the terms are summed over the
batch. On CPU, oneDNN's own depth-wise weight gradient is slow on large maps with large kernels, and slower in
bf16 than in fp32; the per-sample convolution is oneDNN's depth-wise forward kernel. At batch 1 with bf16 x and dy
it runs in bf16: the kernel sums in fp32 and rounds the whole sum once, which is autocast's own rounding of the
weight gradient, at about half the fp32 convolution's time. Otherwise (several samples, or fp16) it runs in fp32
on their values (exact in fp32): each sample's term rounded to bf16 before the sum over the batch could be worse
than autocast's one rounding, and in fp32 the weight gradient has no half-precision rounding at all, still several
times faster than oneDNN's own (docs/mixed_precision.md). On kernels smaller than 7 x 7 oneDNN's own weight
gradient is the faster one and runs instead (`PER_SAMPLE_MIN_KERNEL`).

The input gradient is the transposed convolution of dy with W. oneDNN's bf16 kernel for it is slow on CPU where
the stride is above 1 (tens of times the forward, several times the same gradient in fp32 with its casts:
docs/mixed_precision.md), so for strided convolutions it runs as `F.conv_transpose2d` in fp32 on the half dy and W
values and is rounded once to the input's dtype: the reference's one rounding of the same sum. With stride 1
torch's kernel runs in the compute dtype.
"""
import torch
import torch.nn.functional as F

from ..dtypes import autocast_off, compute_dtype, compute_dtype_of


def depthwise_weight_grad(x, grad, kernel_size, stride=(1, 1), padding=(0, 0), dilation=(1, 1)):
    """dW (C, 1, kh, kw) of the depth-wise convolution of x (B, C, H, W) whose output gradient is grad
    (B, C, H_out, W_out): one depth-wise convolution per sample (module docstring), computed and summed over the
    batch in `dtypes.compute_dtype(x)` (fp32 for bf16 / fp16 x; bf16 for a bf16 x at batch 1, one rounding of the
    whole sum), the result in that dtype."""
    dtype = x.dtype if x.dtype == torch.bfloat16 and x.shape[0] == 1 else compute_dtype(x)
    x, grad = x.to(dtype), grad.to(dtype)
    c = x.shape[1]
    kh, kw = kernel_size
    xp = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    dw = None
    for b in range(x.shape[0]):
        term = F.conv2d(xp[b:b + 1], grad[b].unsqueeze(1), None, dilation, 0, stride, c)[0, :, :kh, :kw]
        dw = term if dw is None else dw.add_(term)
    return dw.unsqueeze(1)


#: the smallest kernel (both sides) whose weight gradient `DepthwiseConvFunction` computes per sample
PER_SAMPLE_MIN_KERNEL = 7


def depthwise_applies(conv):
    """Whether `DepthwiseConvFunction` computes the nn.Conv2d `conv`: depth-wise (groups = in = out channels), zero
    padding given as numbers, and a kernel of at least 7 x 7 (its weight gradient per sample) or a stride above 1
    (its input gradient in fp32); a 3 x 3, stride-1 depth-wise convolution keeps torch's kernels, the faster ones
    there (docs/mixed_precision.md)."""
    return (conv.groups == conv.in_channels == conv.out_channels and conv.padding_mode == 'zeros'
            and not isinstance(conv.padding, str)
            and (min(conv.kernel_size) >= PER_SAMPLE_MIN_KERNEL or max(conv.stride) > 1))


def depthwise_input_grad(grad, weight, input_hw, stride, padding, dilation):
    """dx (B, C, H, W) of the depth-wise convolution with weight (C, 1, kh, kw) of an input of size `input_hw`
    whose output gradient is grad (B, C, H_out, W_out): the transposed convolution, computed in
    `dtypes.compute_dtype(grad)` (fp32 for bf16 / fp16 grad), the result in that dtype."""
    dtype = compute_dtype(grad)
    grad, weight = grad.to(dtype), weight.to(dtype)
    extra = [n - ((m - 1) * s - 2 * p + d * (k - 1) + 1)          # rows / columns the strided output did not reach
             for n, m, s, p, d, k in zip(input_hw, grad.shape[2:], stride, padding, dilation, weight.shape[2:])]
    return F.conv_transpose2d(grad, weight, None, stride, padding, extra, weight.shape[0], dilation)


class DepthwiseConvFunction(torch.autograd.Function):
    """y = conv2d(x, weight, bias, stride, padding, dilation, groups=C) for a depth-wise weight (C, 1, kh, kw).

    Computed in the autocast dtype under autocast (x, weight and bias cast once, as autocast casts a convolution's
    arguments), else in x's dtype; the kernel is passed channels-last (as `Conv2dCL`). Backward: the input
    gradient by `depthwise_input_grad` where the stride is above 1, else by torch's convolution backward (in the
    compute dtype, as autocast's); the weight gradient by `depthwise_weight_grad` for kernels of at least
    `PER_SAMPLE_MIN_KERNEL`, else by torch's; the bias gradient summed in fp32 (fp32 parameters get fp32
    gradients, as through autocast's cast). Keeps x and the weight in the compute dtype, as autocast's
    convolution does."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation):
        dtype = compute_dtype_of(x)
        with autocast_off(x.device.type):
            xc, wc = x.to(dtype), weight.to(dtype).contiguous(memory_format=torch.channels_last)
            bc = None if bias is None else bias.to(dtype)
            y = F.conv2d(xc, wc, bc, stride, padding, dilation, weight.shape[0])
        ctx.save_for_backward(xc, wc)
        ctx.conv = (stride, padding, dilation)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, grad):
        xc, wc = ctx.saved_tensors
        stride, padding, dilation = ctx.conv
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w = ctx.needs_input_grad[:2]
        transposed = need_x and max(stride) > 1
        per_sample = need_w and min(wc.shape[2:]) >= PER_SAMPLE_MIN_KERNEL
        with autocast_off(xc.device.type):
            grad = grad.to(xc.dtype)
            dx = dw = db = None
            mask = [need_x and not transposed, need_w and not per_sample, False]
            if any(mask):        # torch's kernels where they are the faster ones, in the compute dtype
                dx, dw, _ = torch.ops.aten.convolution_backward(
                    grad, xc, wc, None, stride, padding, dilation, False, [0, 0], wc.shape[0], mask)
            if transposed:
                dx = depthwise_input_grad(grad, wc, xc.shape[2:], stride, padding, dilation)
            if per_sample:
                dw = depthwise_weight_grad(xc, grad, wc.shape[2:], stride, padding, dilation)
            dx = None if dx is None else dx.to(x_dtype)
            dw = None if dw is None else dw.to(w_dtype)
            if ctx.needs_input_grad[2]:
                db = grad.sum((0, 2, 3), dtype=compute_dtype(grad)).to(b_dtype)
        return dx, dw, db, None, None, None
