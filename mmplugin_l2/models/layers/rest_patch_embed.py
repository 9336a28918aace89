"""The ResT patch embedding that opens stages 2-4: conv3x3 stride 2 padding 1 (with bias) -> BatchNorm2d -> PA.

(B, C_in, H, W) -> (B, C_out, ceil(H / 2), ceil(W / 2)). Keys `conv.*`, `norm.*`, `pos.pa_conv.*` are the
authors' `patch_embed_{2,3,4}.*` keys.

The caller must take the next stage's (H, W) from the output's shape. The authors' code uses
(floor(H / 2), floor(W / 2)) instead. That is the same for even sizes, but for odd ones it breaks the
stage's reshapes: their model only runs when H and W mod 32 are in {0, 29, 30, 31}.
"""
from .conv import ConvLayer
from .pa import PA


class ResTPatchEmbed(ConvLayer):

    def __init__(self, in_channels, out_channels):
        super().__init__(in_channels, out_channels, kernel_size=3, stride=2, padding=1, bias=True, norm=True,
                         act=None)
        self.pos = PA(out_channels)

    def forward(self, x):
        return self.pos(super().forward(x))
