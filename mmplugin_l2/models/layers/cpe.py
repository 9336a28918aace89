"""CPE, conditional positional encoding: a depth-wise 3x3 convolution over the token map.

`CPE` is an `nn.Conv2d` (a channels-last `Conv2dCL`; keys `weight`, `bias`) so the authors' checkpoints load
unchanged; `forward` takes tokens (B, N, C) with their map size (H, W) and returns the conv output as tokens
(B, N, C); the caller adds the residual (H-ViT3: x = x + cpe(x, hw)). `ResidualCPE` is L2ViT's form,
x + CPE(x), with the conv under the key `proj`.
"""
import torch.nn as nn

from .conv import Conv2dCL
from ..ops.tokens import add_residual, tokens_conv


class CPE(Conv2dCL):

    def __init__(self, dim, kernel_size=3):
        super().__init__(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim)

    def forward(self, x, hw_shape):
        return tokens_conv(super().forward, x, hw_shape)


class ResidualCPE(nn.Module):
    """x + CPE(x) on tokens (B, N, C) of an (H, W) map (the authors' L2ViT `CPE`, conv under key `proj`).

    The conv runs channels-last on the token map (no NCHW copy; float rounding differs from the authors'
    NCHW conv at the 1e-7 level) and the residual is added into its output."""

    def __init__(self, dim):
        super().__init__()
        self.proj = CPE(dim, 3)

    def forward(self, x, hw_shape):
        return add_residual(self.proj(x, hw_shape), x)
