"""ConvLayer: conv -> optional BatchNorm2d -> optional activation (the authors' `ConvLayer`); Conv2dCL, an
nn.Conv2d that runs with a channels-last kernel; BatchNorm2d, nn.BatchNorm2d with correct and accurate CPU
training passes for every memory layout.

Keys are `conv.*` and `norm.*`, the layout of the official checkpoints.
Input and output are (B, C, H, W) tensors.
"""
import torch
import torch.nn as nn

from ..ops.export import exporting


class Conv2dCL(nn.Conv2d):
    """nn.Conv2d whose kernel is passed in channels-last memory format.

    Token maps (`tokens_to_map` of (B, N, C) tokens) are channels-last views; with a channels-last kernel
    oneDNN / cuDNN keep the whole convolution channels-last (for depth-wise 3x3 convs on such maps much
    faster on CPU than the NCHW-kernel path) and the output's token view needs no copy. Same parameters
    and keys as nn.Conv2d; results equal to float rounding (the summation order of the kernel differs).
    """

    #: read by the ops that run this conv's kernel themselves (`ops.conv.pieces`)
    kernel_channels_last = True

    def forward(self, x):
        return self._conv_forward(x, self.weight.to(memory_format=torch.channels_last), self.bias)


def _channels_last(x):
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def _row_blocks(*mats):
    """Blocks of ~1M elements of rows of (M, C) matrices, zipped (a block is read from memory once and then
    worked on in cache)."""
    rows = max(1, (1 << 20) // mats[0].shape[1])
    return zip(*(m.split(rows) for m in mats))


def _mean_var(rows):
    """Column mean and biased variance of an (M, C) matrix in one pass over memory: per block of rows its
    sum and centred sum of squares (torch's cascade sums), combined exactly (Chan et al.):
    M2 = sum_b M2_b + sum_b n_b (mean_b - mean)^2."""
    sums, m2, counts = [], None, []
    for (r,) in _row_blocks(rows):
        s = r.sum(0)
        part = (r - s / r.shape[0]).square_().sum(0)
        m2 = part if m2 is None else m2.add_(part)
        sums.append(s)
        counts.append(r.shape[0])
    sums = torch.stack(sums)
    n = sums.new_tensor(counts).unsqueeze(1)
    mean = sums.sum(0) / rows.shape[0]
    m2.add_(((sums / n - mean).square_() * n).sum(0))
    return mean, m2.div_(rows.shape[0])


class BatchNormCLFunction(torch.autograd.Function):
    """Train-mode batch normalisation of a channels-last fp32 map with accurate batch statistics.

    x (B, C, H, W), channels-last in memory, is a contiguous (M = B*H*W, C) matrix of rows. The statistics
    are column sums of it, block by block of rows (`_mean_var`: the mean and the biased variance, each
    block centred on its own mean). torch 2.14's CPU BatchNorm kernel accumulates channels-last maps row by
    row in float32 instead: its forward error grows with M (rel. 5e-6 at a detection-sized stage-1 map,
    against 7e-8 for the same map in NCHW). Through a ReLU that follows, such errors flip activations near
    zero, and they decide how far fp32 training gradients are from float64.

    forward(x, weight, bias, eps) -> (y, mean, var): y = (x - mean) / sqrt(var + eps) * weight + bias like
    x (channels-last); mean and the biased variance (C,) for the running statistics.
    backward: dx = (dy - mean(dy) - x_hat * mean(dy * x_hat)) * weight / std, dweight = sum(dy * x_hat),
    dbias = sum(dy), with sums over M and x_hat recomputed from the saved input (as torch's kernel: input,
    mean and 1/std are what it keeps). Both passes read x (and dy) from memory as often as torch's kernel.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        c = x.shape[1]
        rows = x.permute(0, 2, 3, 1).reshape(-1, c)          # a view: x is channels-last
        mean, var = _mean_var(rows)
        inv_std = (var + eps).rsqrt_()
        scale = inv_std if weight is None else inv_std * weight
        shift = -mean * scale if bias is None else bias - mean * scale
        y = torch.empty_like(x, memory_format=torch.channels_last)      # not a view: ReLU may run in place
        torch.addcmul(shift, rows, scale, out=y.permute(0, 2, 3, 1).view(-1, c))
        ctx.save_for_backward(x, weight, mean, inv_std)
        ctx.affine = weight is not None, bias is not None
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        x, weight, mean, inv_std = ctx.saved_tensors
        c = x.shape[1]
        rows = x.permute(0, 2, 3, 1).reshape(-1, c)
        dy = dy.contiguous(memory_format=torch.channels_last)
        grads = dy.permute(0, 2, 3, 1).reshape(-1, c)
        m = rows.shape[0]
        sum_dy, sum_dy_xc = torch.zeros_like(mean), torch.zeros_like(mean)
        for g, r in _row_blocks(grads, rows):
            sum_dy.add_(g.sum(0))
            sum_dy_xc.add_((r - mean).mul_(g).sum(0))
        sum_dy_xhat = sum_dy_xc.mul_(inv_std)
        scale = inv_std if weight is None else inv_std * weight
        # dx = scale * (dy - sum_dy / m) + a * (x - mean), a = -scale * inv_std * sum_dy_xhat / m
        a = scale * inv_std * sum_dy_xhat / -m
        shift = -a * mean - scale * sum_dy / m
        dx = torch.empty_like(dy)
        for d, g, r in _row_blocks(dx.permute(0, 2, 3, 1).view(-1, c), grads, rows):
            torch.addcmul(shift, r, a, out=d).addcmul_(g, scale)
        return (dx, sum_dy_xhat if ctx.affine[0] else None, sum_dy if ctx.affine[1] else None, None)


class BatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d with correct and accurate CPU training passes in every memory layout.

    * **Channels-last fp32 maps in train mode on CPU** (the token maps of stems, downsamplings and L2ViT's
      LCM) run `BatchNormCLFunction`: batch statistics by compensated column sums instead of torch's
      row-by-row float32 accumulation, whose error grows with the map (`BatchNormCLFunction`).
    * **Otherwise** torch's kernel runs, with one repair: on CPU (torch 2.14) its backward returns wrong
      input gradients, off by O(1), when the incoming gradient is channels-last and the input NCHW at batch
      1, which happens when the output becomes tokens (`map_to_tokens`, a transpose) directly. A gradient
      hook on the output gives the backward the input's layout (one copy of the gradient, only where the
      layouts differ).

    Every BatchNorm here is this class. Same parameters, keys, running statistics and (to float rounding)
    forward values as nn.BatchNorm2d; eval mode and exports are torch's kernel unchanged.
    """

    def forward(self, x):
        if (self.training and x.device.type == 'cpu' and x.dtype == torch.float32 and _channels_last(x)
                and (self.weight is None or self.weight.dtype == torch.float32) and not exporting()):
            return self._accurate_train_forward(x)
        y = super().forward(x)
        if y.requires_grad and x.device.type == 'cpu' and not exporting():
            fmt = torch.channels_last if _channels_last(x) else torch.contiguous_format
            y.register_hook(lambda g: g if g.is_contiguous(memory_format=fmt) else g.contiguous(memory_format=fmt))
        return y

    def _accurate_train_forward(self, x):
        self._check_input_dim(x)
        if x.shape[0] * x.shape[2] * x.shape[3] < 2:
            # torch's own message for one value per channel
            return super().forward(x)
        y, mean, var = BatchNormCLFunction.apply(x, self.weight, self.bias, self.eps)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum)
                m = x.numel() // x.shape[1]
                self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                self.running_var.mul_(1 - factor).add_(var, alpha=factor * m / (m - 1))
        return y


class ConvLayer(nn.Module):
    """conv(k, stride, padding, groups, bias) -> BN2d (if `norm`) -> activation (if `act`).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, groups, bias: as for nn.Conv2d.
        norm (bool): append a BatchNorm2d (default eps / momentum). Default: True.
        act (type | None): activation class taking `inplace`, e.g. nn.ReLU (run in place: neither the
            conv nor the BN keeps its output for backward). Default: nn.ReLU.
        channels_last (bool): run the conv as `Conv2dCL` (faster on token maps; rounding differs from an
            NCHW conv at the 1e-7 level). Default: True.
    """

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, padding=0, groups=1,
                 bias=True, norm=True, act=nn.ReLU, channels_last=True):
        super().__init__()
        conv = Conv2dCL if channels_last else nn.Conv2d
        self.conv = conv(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                              groups=groups, bias=bias)
        self.norm = BatchNorm2d(out_channels) if norm else None
        self.act = act(inplace=True) if act is not None else None

    def forward(self, x):
        x = self.conv(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.act is not None:
            x = self.act(x)
        return x
