"""LCM, L2ViT's local concentration module: the local detail that ReLU linear attention smooths away,
restored by two depth-wise convolutions on the token map.

    LCM(x) = DWConv_k(BN2d(GELU(DWConv_k(x))))        (k = 7 in L2ViT; keys `conv1`, `bn`, `conv2`)

Tokens (B, N, C) of an (H, W) map in, (B, N, C) out. The maths: `ops/conv/naive.py` (`lcm_naive`, the paper's
Eqs. 6-7). No internal residual: the block adds it
(x = x + LCM(LN(x))). The chain is the op `ops.conv.conv_chain`: at inference on large maps, the pre-norm
included, in pieces of rows (halo rows recomputed; same values) as `ops.dispatch.choose` says: neither the
LayerNorm output nor the three intermediate maps are built whole.
"""
import torch.nn as nn

from functools import partial

from .conv import BatchNorm2d, Conv2dCL
from ..ops import INFERENCE, choose
from ..ops.conv import CONV_CHAIN, ConvBNAct, conv_chain
from ..ops.memory import DEFAULT_POLICY
from .mlp import gelu
from ..ops.tokens import map_to_tokens, tokens_to_map


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

    #: inference on large maps in pieces of rows (the piece: rows x width x channels of the map)
    memory_policy = DEFAULT_POLICY

    def forward(self, x, hw_shape, norm=None):
        """x (B, N, C) tokens of an (H, W) map -> (B, N, C); with `norm`, LCM(norm(x))."""
        path = choose(self, x, x.numel(), CONV_CHAIN, modules=(self.bn,))
        # channels-last on the token map throughout (Conv2dCL kernels, no NCHW copies)
        act = partial(gelu, inplace=path.impl == INFERENCE)
        layers = (ConvBNAct(self.conv1, self.bn, act, act_first=True), ConvBNAct(self.conv2))
        pre = None
        if norm is not None and path.impl == INFERENCE and path.piece is not None:
            pre = partial(_norm_map, norm)      # piece by piece of rows, inside the op
        elif norm is not None:
            x = norm(x)                         # on the tokens (B, N, C), as the block would
        return map_to_tokens(conv_chain(path, layers, tokens_to_map(x, hw_shape), pre))


def _norm_map(norm, x):
    """A norm over the channels of a map (B, C, H, W) (channels-last in, channels-last out)."""
    return norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
