"""LCM, L2ViT's local concentration module: the local detail that ReLU linear attention smooths away,
restored by two depth-wise convolutions on the token map.

    LCM(x) = DWConv_k(BN2d(GELU(DWConv_k(x))))        (k = 7 in L2ViT; keys `conv1`, `bn`, `conv2`)

Tokens (B, N, C) of an (H, W) map in, (B, N, C) out. No internal residual: the block adds it
(x = x + LCM(LN(x))). At inference on large maps the chain, the pre-norm included, runs in bands of rows
(`bands.conv_chain_in_bands`, halo rows recomputed; same values) as the memory policy says: neither the
LayerNorm output nor the three intermediate maps are built whole.
"""
import torch.nn as nn

from .bands import ConvBNAct, conv_chain_in_bands, norm_map_rows
from .conv import BatchNorm2d, Conv2dCL
from ..ops.memory import DEFAULT_POLICY, inference
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

    #: inference on large maps in bands of rows (the piece: rows x width x channels of the map)
    memory_policy = DEFAULT_POLICY
    #: `forward(x, hw, norm=norm)` computes LCM(norm(x), hw), the norm band by band at inference
    fuses_norm = True

    def _gelu_bn(self, x):
        return self.bn(gelu(x, True))

    def forward(self, x, hw_shape, norm=None):
        piece = self.memory_policy.pieces(self, x, x.numel())
        if piece is not None and not self.bn.training:      # bands only with the running statistics
            layers = (ConvBNAct(self.conv1, None, self._gelu_bn), ConvBNAct(self.conv2))
            pre = None if norm is None else (lambda t: norm_map_rows(norm, t))
            return map_to_tokens(conv_chain_in_bands(layers, tokens_to_map(x, hw_shape), piece, pre))
        if norm is not None:
            x = norm(x)
        # channels-last on the token map throughout (Conv2dCL kernels, no NCHW copies)
        x = gelu(self.conv1(tokens_to_map(x, hw_shape)), inference(self))
        return map_to_tokens(self.conv2(self.bn(x)))
