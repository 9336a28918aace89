"""Stems and downsamplings of the three families, in one place: what turns an image into the first token
map, and a stage's map into the next one's. Every module takes and returns NCHW tensors unless its docstring
says tokens.

* H-ViT3: `ConvStem` (five convs, stride 4) and `ConvDownsample` (inverted bottleneck, stride 2).
* L2ViT: `ConvStem2L` (two convs, stride 4) inside `L2ViTStem` (+ LayerNorm, to tokens) and
  `L2ViTDownsample` (LayerNorm, 2x2 stride-2 conv; tokens in and out).
* ResT: `ResTStem` (three convs, stride 4, PA) and `ResTPatchEmbed` (3x3 stride-2 conv, BN, PA).

The H-ViT3 and L2ViT convolution chains are the op `ops.conv.conv_chain` (the maths: `ops/conv/naive.py`,
`conv_chain_naive`: F.conv2d and the BN formula): at inference on large images in
pieces of rows (same values), as `ops.dispatch.choose` and the memory policy say (the piece: rows of the
chain's widest intermediate).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .conv import BatchNorm2d, ConvLayer
from ..ops import choose
from ..ops.conv import CONV_CHAIN, ConvBNAct, chain_modules, conv_chain
from ..ops.export import exporting
from ..ops.memory import DEFAULT_POLICY
from .pa import PA
from ..ops.tokens import compiled_map, map_to_tokens, pad_to_multiple, padding_to_multiple, tokens_to_map


def _conv_chain(module, layers, x):
    """The conv layers `layers` (ConvLayer / ConvBNAct) of `module` on the map x (B, C, H, W), the path
    chosen for (input pixels x the last layer's channels) elements."""
    path = choose(module, x, x[:, :1].numel() * layers[-1].conv.out_channels, CONV_CHAIN,
                  modules=chain_modules(layers))
    return conv_chain(path, layers, x)


# ---- H-ViT3 -------------------------------------------------------------------------------------
class ConvStem(nn.Module):
    """Five-conv stem of H-ViT3 (stride 4): (B, in_ch, H, W) -> (B, C, ceil(H/4), ceil(W/4)).

    3x3 s2 (in -> C/2) -> 3x3 (C/2) -> 3x3 (C/2) -> 3x3 s2 (C/2 -> 4C) -> 1x1 (4C -> C, no activation);
    every conv is bias-free and followed by BatchNorm2d, ReLU after all but the last. The input is first
    zero-padded right/bottom to a multiple of 4, as the authors' dense-prediction code does. Everything
    runs channels-last (on CPU the NCHW stem's time grows faster than linearly with the image;
    docs/benchmark.md); rounding differs from theirs at the 1e-7 level.
    """

    def __init__(self, in_channels, embed_dim):
        super().__init__()
        half = embed_dim // 2
        self.conv = nn.Sequential(
            ConvLayer(in_channels, half, 3, stride=2, padding=1, bias=False),
            ConvLayer(half, half, 3, stride=1, padding=1, bias=False),
            ConvLayer(half, half, 3, stride=1, padding=1, bias=False),
            ConvLayer(half, embed_dim * 4, 3, stride=2, padding=1, bias=False),
            ConvLayer(embed_dim * 4, embed_dim, 1, bias=False, act=None),
        )

    memory_policy = DEFAULT_POLICY

    def forward(self, x):
        return _conv_chain(self, self.conv, pad_to_multiple(x, 4).contiguous(memory_format=torch.channels_last))


class ConvDownsample(nn.Module):
    """Inverted-bottleneck stride-2 downsampling ("PatchMerging" in H-ViT3):
    (B, C_in, H, W) -> (B, C_out, ceil(H/2), ceil(W/2)).

    1x1 (C_in -> r*C_out) + ReLU -> depth-wise 3x3 s2 + ReLU -> 1x1 (r*C_out -> C_out) + BN2d; all convs
    have a bias. An odd H or W is zero-padded by one row/column at the bottom/right *before* the first
    1x1 conv, as the authors do (the pad then becomes ReLU(bias), not zero). The pad is done in
    (B, H, W, C) order, like theirs, so the padded map is channels-last in memory: the conv kernels, and
    therefore the rounding, then match the authors' code exactly (an NCHW pad gives ~1e-7 differences
    that grow to ~1e-5 over the deep stage 3).
    """

    def __init__(self, in_channels, out_channels, ratio=4.0):
        super().__init__()
        hidden = int(out_channels * ratio)
        self.conv = nn.Sequential(
            ConvLayer(in_channels, hidden, 1, norm=False),
            ConvLayer(hidden, hidden, 3, stride=2, padding=1, groups=hidden, norm=False),
            ConvLayer(hidden, out_channels, 1, act=None),
        )

    def forward(self, x):
        h, w = x.shape[-2:]
        pad_h, pad_w = padding_to_multiple(h, 2), padding_to_multiple(w, 2)
        if exporting() or pad_h or pad_w:
            x = compiled_map(F.pad(x.permute(0, 2, 3, 1), (0, 0, 0, pad_w, 0, pad_h)).permute(0, 3, 1, 2))
        return _conv_chain(self, self.conv, x)

    memory_policy = DEFAULT_POLICY


# ---- L2ViT --------------------------------------------------------------------------------------
class ConvStem2L(nn.Module):
    """Two-conv stem of L2ViT (the authors' `ConvStem`, type '2L'), stride 4:
    (B, in_ch, H, W) -> (B, C, ceil(H/4), ceil(W/4)).

    3x3 s2 p1 (in -> C/2, bias) -> BN2d -> ReLU -> 3x3 s2 p1 (C/2 -> C, bias) -> BN2d, no activation at the
    end (the paper's table lists only the two convs). The input is first zero-padded right/bottom to a
    multiple of 4, as the authors do. Keys `proj.{0,1,3,4}.*`, their nn.Sequential.
    """

    def __init__(self, in_channels, embed_dim):
        super().__init__()
        self.proj = nn.Sequential(
            nn.Conv2d(in_channels, embed_dim // 2, 3, stride=2, padding=1),
            BatchNorm2d(embed_dim // 2),
            nn.ReLU(inplace=True),
            nn.Conv2d(embed_dim // 2, embed_dim, 3, stride=2, padding=1),
            BatchNorm2d(embed_dim),
        )

    memory_policy = DEFAULT_POLICY

    def forward(self, x):
        p = self.proj
        return _conv_chain(self, [ConvBNAct(p[0], p[1], p[2]), ConvBNAct(p[3], p[4])], pad_to_multiple(x, 4))


class L2ViTStem(nn.Module):
    """Image (B, 3, H, W) -> tokens (B, N, C) after ConvStem2L and a LayerNorm, with their (H/4, W/4)."""

    def __init__(self, in_channels, embed_dim):
        super().__init__()
        self.proj = ConvStem2L(in_channels, embed_dim)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x):
        x = self.proj(x)
        hw = tuple(x.shape[-2:])
        return self.norm(map_to_tokens(x)), hw


class L2ViTDownsample(nn.Module):
    """Tokens (B, H*W, C_in) -> LayerNorm -> map, odd sides zero-padded by one -> Conv2x2 s2 ->
    tokens (B, ceil(H/2)*ceil(W/2), C_out) with their map size. No norm after the conv."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.norm = nn.LayerNorm(in_channels)
        self.proj = nn.Conv2d(in_channels, out_channels, 2, stride=2)

    def forward(self, x, hw_shape):
        # NCHW like the authors. Channels-last on the token map would save two copies of the map (a few % of a
        # training step) but doubles the float32 error against float64 in stages 2-4 (7.7e-7 against 4.2e-7 at
        # 224^2, tools/analysis/precision.py --checks fp64), beyond the authors' own
        x = pad_to_multiple(tokens_to_map(self.norm(x), hw_shape).contiguous(), 2)
        x = self.proj(x)
        return map_to_tokens(x), tuple(x.shape[-2:])


# ---- ResT ---------------------------------------------------------------------------------------
class ResTStem(nn.Module):
    """The ResT stem: three 3x3 convolutions (strides 2, 1, 2) and a PA gate, (B, in, H, W) -> (B, C, H', W') with
    H' = ceil(H / 4), W' = ceil(W / 4) (each stride-2 conv with padding 1 gives ceil(size / 2)).
    
        conv3x3 s2 (in -> C/2, no bias) + BN + ReLU      `conv1` (a ConvLayer: conv1.conv, conv1.norm)
        conv3x3 s1 (C/2 -> C/2, no bias) + BN + ReLU     `conv2`
        conv3x3 s2 (C/2 -> C, no bias)                   `conv3`: no BN and no ReLU after it, as the authors
        PA(C)                                            `pos`
    
    The authors' keys `stem.conv{1,2}.weight`, `stem.norm{1,2}.*` become `conv{1,2}.conv.weight`,
    `conv{1,2}.norm.*` here (see `ResT.convert_state_dict`); `conv3.weight` and `pos.pa_conv.*` are unchanged.
    """

    def __init__(self, in_channels, embed_dim):
        super().__init__()
        hidden = embed_dim // 2
        self.conv1 = ConvLayer(in_channels, hidden, 3, stride=2, padding=1, bias=False, channels_last=False)
        self.conv2 = ConvLayer(hidden, hidden, 3, stride=1, padding=1, bias=False, channels_last=False)
        self.conv3 = nn.Conv2d(hidden, embed_dim, 3, stride=2, padding=1, bias=False)
        self.pos = PA(embed_dim)

    def forward(self, x):
        return self.pos(self.conv3(self.conv2(self.conv1(x))))


class ResTPatchEmbed(ConvLayer):
    """The ResT patch embedding that opens stages 2-4: conv3x3 stride 2 padding 1 (with bias) -> BatchNorm2d -> PA.
    
    (B, C_in, H, W) -> (B, C_out, ceil(H / 2), ceil(W / 2)). Keys `conv.*`, `norm.*`, `pos.pa_conv.*` are the
    authors' `patch_embed_{2,3,4}.*` keys.
    
    The caller must take the next stage's (H, W) from the output's shape. The authors' code uses
    (floor(H / 2), floor(W / 2)) instead. That is the same for even sizes, but for odd ones it breaks the
    stage's reshapes: their model only runs when H and W mod 32 are in {0, 29, 30, 31}.
    """

    def __init__(self, in_channels, out_channels):
        super().__init__(in_channels, out_channels, kernel_size=3, stride=2, padding=1, bias=True, norm=True,
                         act=None)
        self.pos = PA(out_channels)

    def forward(self, x):
        return self.pos(super().forward(x))
