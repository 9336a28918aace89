"""ConvLayer: conv -> optional BatchNorm2d -> optional activation (the authors' `ConvLayer`); Conv2dCL, an
nn.Conv2d that runs with a channels-last kernel; BatchNorm2d, nn.BatchNorm2d with correct and accurate CPU
training passes for every memory layout.

Keys are `conv.*` and `norm.*`, the layout of the official checkpoints.
Input and output are (B, C, H, W) tensors.
"""
import torch
import torch.nn as nn

from ..ops import TRAIN, choose
from ..ops.conv import BatchNormCLFunction  # noqa: F401 (re-exported)
from ..ops.conv import BATCH_NORM, DEPTHWISE_CONV, DepthwiseConvFunction, depthwise_applies
from ..ops.export import exporting
from ..ops.memory import DEFAULT_POLICY
from ..ops.tokens import channels_last


class Conv2dCL(nn.Conv2d):
    """nn.Conv2d whose kernel is passed in channels-last memory format.

    Token maps (`tokens_to_map` of (B, N, C) tokens) are channels-last views; with a channels-last kernel
    oneDNN / cuDNN keep the whole convolution channels-last (for depth-wise 3x3 convs on such maps much
    faster on CPU than the NCHW-kernel path) and the output's token view needs no copy. Same parameters
    and keys as nn.Conv2d; results equal to float rounding (the summation order of the kernel differs).
    """

    #: read by the ops that run this conv's kernel themselves (`ops.conv.pieces`)
    kernel_channels_last = True
    #: a large depth-wise conv (`ops.conv.depthwise_applies`) trains with `DepthwiseConvFunction` where
    #: `ops.conv.DEPTHWISE_CONV` says (bf16 on CPU)
    fast_train = True

    def forward(self, x):
        if depthwise_applies(self) and choose(self, x, x.numel(), DEPTHWISE_CONV).impl == TRAIN:
            return DepthwiseConvFunction.apply(x, self.weight, self.bias, self.stride, self.padding, self.dilation)
        return self._conv_forward(x, self.weight.to(memory_format=torch.channels_last), self.bias)


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

    #: the accurate training pass is this layer's fast training path (`ops.conv.BATCH_NORM`)
    fast_train = True
    #: pieces of rows of the (B*H*W, C) map for the accurate pass's sums
    memory_policy = DEFAULT_POLICY

    def forward(self, x):
        path = choose(self, x, x.numel(), BATCH_NORM)
        if path.impl == TRAIN:
            return self._accurate_train_forward(x, path.piece)
        y = super().forward(x)
        if y.requires_grad and x.device.type == 'cpu' and not exporting():
            fmt = torch.channels_last if channels_last(x) else torch.contiguous_format
            y.register_hook(lambda g: g if g.is_contiguous(memory_format=fmt) else g.contiguous(memory_format=fmt))
        return y

    def _accurate_train_forward(self, x, piece):
        self._check_input_dim(x)
        if x.shape[0] * x.shape[2] * x.shape[3] < 2:
            # torch's own message for one value per channel
            return super().forward(x)
        y, mean, var = BatchNormCLFunction.apply(x, self.weight, self.bias, self.eps, piece)
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
