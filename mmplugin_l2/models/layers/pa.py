"""PA, the pixel-attention positional gate of ResT (Zhang & Yang, arXiv 2105.13677, Eq. 8).

    PA(x) = x * sigmoid(DWConv3x3(x))

The depth-wise 3x3 conv (groups = C, padding 1) has a bias. Input and output are NCHW maps (B, C, H, W) of
any size; the parameters are `pa_conv.{weight,bias}`, the authors' key names.
"""
import torch
import torch.nn as nn

from ..ops import INFERENCE, INFERENCE_ONLY, choose


class PA(nn.Module):
    """Pixel attention: x * sigmoid(DWConv3x3(x)) on NCHW maps.

    Args:
        dim (int): channels C.

    forward(x): x (B, C, H, W) -> (B, C, H, W). At inference (`ops.dispatch.choose`) the gate is computed in
    place (same values, no autograd).
    """

    def __init__(self, dim):
        super().__init__()
        self.pa_conv = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)

    def forward(self, x):
        gate = self.pa_conv(x)
        if choose(self, x, x.numel(), INFERENCE_ONLY).impl == INFERENCE:
            return gate.sigmoid_().mul_(x)
        return x * torch.sigmoid(gate)
