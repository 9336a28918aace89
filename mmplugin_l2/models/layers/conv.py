"""ConvLayer: conv -> optional BatchNorm2d -> optional activation (the authors' `ConvLayer`); Conv2dCL, an
nn.Conv2d that runs with a channels-last kernel; BatchNorm2d, nn.BatchNorm2d with correct CPU gradients for
every memory layout.

Keys are `conv.*` and `norm.*`, the layout of the official checkpoints.
Input and output are (B, C, H, W) tensors.
"""
import torch
import torch.nn as nn

from .export import exporting


class Conv2dCL(nn.Conv2d):
    """nn.Conv2d whose kernel is passed in channels-last memory format.

    Token maps (`tokens_to_map` of (B, N, C) tokens) are channels-last views; with a channels-last kernel
    oneDNN / cuDNN keep the whole convolution channels-last (for depth-wise 3x3 convs on such maps ~10x
    faster on CPU than the NCHW-kernel path) and the output's token view needs no copy. Same parameters
    and keys as nn.Conv2d; results equal to float rounding (the summation order of the kernel differs).
    """

    def forward(self, x):
        return self._conv_forward(x, self.weight.to(memory_format=torch.channels_last), self.bias)


def _channels_last(x):
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


class BatchNorm2d(nn.BatchNorm2d):
    """nn.BatchNorm2d whose backward receives the gradient in the memory layout of its input.

    On CPU (torch 2.14) the BatchNorm backward returns wrong input gradients, off by O(1), when the incoming
    gradient is channels-last and the input NCHW at batch 1, which happens when the output becomes tokens
    (`map_to_tokens`, a transpose) directly: L2ViT's stem (ResT's PA gate in between gives an NCHW gradient).
    Every BatchNorm here is this class, so no other path can hit it. A gradient hook on the output gives
    the backward the input's layout (one copy of the gradient, only where the layouts differ). Same
    parameters, keys, forward values and running statistics as nn.BatchNorm2d.
    """

    def forward(self, x):
        y = super().forward(x)
        if y.requires_grad and x.device.type == 'cpu' and not exporting():
            fmt = torch.channels_last if _channels_last(x) else torch.contiguous_format
            y.register_hook(lambda g: g if g.is_contiguous(memory_format=fmt) else g.contiguous(memory_format=fmt))
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
