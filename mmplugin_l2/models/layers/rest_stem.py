"""The ResT stem: three 3x3 convolutions (strides 2, 1, 2) and a PA gate, (B, in, H, W) -> (B, C, H', W') with
H' = ceil(H / 4), W' = ceil(W / 4) (each stride-2 conv with padding 1 gives ceil(size / 2)).

    conv3x3 s2 (in -> C/2, no bias) + BN + ReLU      `conv1` (a ConvLayer: conv1.conv, conv1.norm)
    conv3x3 s1 (C/2 -> C/2, no bias) + BN + ReLU     `conv2`
    conv3x3 s2 (C/2 -> C, no bias)                   `conv3`: no BN and no ReLU after it, as the authors
    PA(C)                                            `pos`

The authors' keys `stem.conv{1,2}.weight`, `stem.norm{1,2}.*` become `conv{1,2}.conv.weight`,
`conv{1,2}.norm.*` here (see `ResT.convert_state_dict`); `conv3.weight` and `pos.pa_conv.*` are unchanged.
"""
import torch.nn as nn

from .conv import ConvLayer
from .pa import PA


class ResTStem(nn.Module):

    def __init__(self, in_channels, embed_dim):
        super().__init__()
        hidden = embed_dim // 2
        self.conv1 = ConvLayer(in_channels, hidden, 3, stride=2, padding=1, bias=False, channels_last=False)
        self.conv2 = ConvLayer(hidden, hidden, 3, stride=1, padding=1, bias=False, channels_last=False)
        self.conv3 = nn.Conv2d(hidden, embed_dim, 3, stride=2, padding=1, bias=False)
        self.pos = PA(embed_dim)

    def forward(self, x):
        return self.pos(self.conv3(self.conv2(self.conv1(x))))
