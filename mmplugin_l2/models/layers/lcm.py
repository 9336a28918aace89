"""LCM, L2ViT's local concentration module: the local detail that ReLU linear attention smooths away,
restored by two depth-wise convolutions on the token map.

    LCM(x) = DWConv_k(BN2d(GELU(DWConv_k(x))))        (k = 7 in L2ViT; keys `conv1`, `bn`, `conv2`)

Tokens (B, N, C) of an (H, W) map in, (B, N, C) out. No internal residual: the block adds it
(x = x + LCM(LN(x))).
"""
import torch.nn as nn

from .conv import BatchNorm2d, Conv2dCL
from .memory import inference
from .mlp import gelu
from .tokens import map_to_tokens, tokens_to_map


class LCM(nn.Module):
    """Local concentration module: DWConv(k) -> GELU -> BN2d -> DWConv(k) on the token map.

    Args:
        dim (int): channels C. kernel_size (int): Default: 7 (L2ViT; the paper's Table 6 ablates 3).
    """

    def __init__(self, dim, kernel_size=7):
        super().__init__()
        pad = kernel_size // 2
        self.conv1 = Conv2dCL(dim, dim, kernel_size, padding=pad, groups=dim)
        self.bn = BatchNorm2d(dim)
        self.conv2 = Conv2dCL(dim, dim, kernel_size, padding=pad, groups=dim)

    def forward(self, x, hw_shape):
        # channels-last on the token map throughout (Conv2dCL kernels, no NCHW copies)
        x = gelu(self.conv1(tokens_to_map(x, hw_shape)), inference(self))
        return map_to_tokens(self.conv2(self.bn(x)))
