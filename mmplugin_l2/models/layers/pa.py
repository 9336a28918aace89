"""PA, the pixel-attention positional gate of ResT (Zhang & Yang, arXiv 2105.13677, Eq. 8).

    PA(x) = x * sigmoid(DWConv3x3(x))

The depth-wise 3x3 conv (groups = C, padding 1) has a bias. Input and output are NCHW maps (B, C, H, W) of
any size; the parameters are `pa_conv.{weight,bias}`, the authors' key names.
"""
import torch
import torch.nn as nn

from ..ops.memory import inference


class PA(nn.Module):

    def __init__(self, dim):
        super().__init__()
        self.pa_conv = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)

    def forward(self, x):
        gate = self.pa_conv(x)
        if not inference(self):
            return x * torch.sigmoid(gate)
        return gate.sigmoid_().mul_(x)   # no autograd: in place, same values
