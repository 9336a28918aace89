"""ConvLayer: conv -> optional BatchNorm2d -> optional activation (the authors' `ConvLayer`).

Keys are `conv.*` and `norm.*`, the layout of the official checkpoints.
Input and output are NCHW tensors.
"""
import torch.nn as nn


class ConvLayer(nn.Module):
    """conv(k, stride, padding, groups, bias) -> BN2d (if `norm`) -> activation (if `act`).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, groups, bias: as for nn.Conv2d.
        norm (bool): append a BatchNorm2d (default eps / momentum). Default: True.
        act (type | None): activation class, e.g. nn.ReLU. Default: nn.ReLU.
    """

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1, padding=0, groups=1,
                 bias=True, norm=True, act=nn.ReLU):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                              groups=groups, bias=bias)
        self.norm = nn.BatchNorm2d(out_channels) if norm else None
        self.act = act() if act is not None else None

    def forward(self, x):
        x = self.conv(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.act is not None:
            x = self.act(x)
        return x
