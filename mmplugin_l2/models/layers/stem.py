"""Convolutional stems and the convolutional downsampling ("PatchMerging") of hierarchical backbones.

All modules here take and return NCHW tensors.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .bands import ConvBNAct, can_run_in_bands, conv_chain_in_bands
from .conv import ConvLayer
from .export import exporting


def _conv_chain(layers, x, budget, whole=None):
    """The conv layers `layers` (ConvLayer / ConvBNAct) on x; at inference when the input's pixels times
    the last layer's channels exceed 4x `budget`, band by band of rows (`conv_chain_in_bands`, same
    values, no map-sized intermediates); otherwise `whole` (default: `layers`, a Sequential) on the whole
    map."""
    if can_run_in_bands(layers) and x[:, :1].numel() * layers[-1].conv.out_channels > 4 * budget:
        return conv_chain_in_bands(layers, x, budget)
    return (layers if whole is None else whole)(x)


def pad_to_multiple(x, multiple):
    """Zero-pad an NCHW tensor on the right/bottom so that H and W are multiples of `multiple`."""
    h, w = x.shape[-2:]
    pad_h, pad_w = (-h) % multiple, (-w) % multiple
    if exporting() or pad_h or pad_w:  # exporting: one graph for every size, a zero pad is a no-op
        x = F.pad(x, (0, pad_w, 0, pad_h))
    return x


class ConvStem(nn.Module):
    """Five-conv stem of H-ViT3 (stride 4): (B, in_ch, H, W) -> (B, C, ceil(H/4), ceil(W/4)).

    3x3 s2 (in -> C/2) -> 3x3 (C/2) -> 3x3 (C/2) -> 3x3 s2 (C/2 -> 4C) -> 1x1 (4C -> C, no activation);
    every conv is bias-free and followed by BatchNorm2d, ReLU after all but the last. The input is first
    zero-padded right/bottom to a multiple of 4, as the authors' dense-prediction code does. Everything
    runs channels-last (the NCHW stem grows faster than linearly with the image on CPU: 13x the time for 6x
    the pixels from 512^2 to 1248^2, 8.5x channels-last); rounding differs from theirs at the 1e-7 level.
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

    #: at inference on large images the stem runs in bands of rows holding about this many elements
    band_elems = 2 ** 20

    def forward(self, x):
        return _conv_chain(self.conv, pad_to_multiple(x, 4).contiguous(memory_format=torch.channels_last),
                           self.band_elems)


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
            nn.BatchNorm2d(embed_dim // 2),
            nn.ReLU(inplace=True),
            nn.Conv2d(embed_dim // 2, embed_dim, 3, stride=2, padding=1),
            nn.BatchNorm2d(embed_dim),
        )

    #: at inference on large images the stem runs in bands of rows holding about this many elements
    band_elems = 2 ** 20

    def forward(self, x):
        p = self.proj
        return _conv_chain([ConvBNAct(p[0], p[1], p[2]), ConvBNAct(p[3], p[4])], pad_to_multiple(x, 4),
                           self.band_elems, whole=p)


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
        if exporting() or h % 2 or w % 2:
            x = F.pad(x.permute(0, 2, 3, 1), (0, 0, 0, w % 2, 0, h % 2)).permute(0, 3, 1, 2)
        return _conv_chain(self.conv, x, self.band_elems)

    #: at inference on large maps the downsampling runs in bands of rows holding about this many elements
    band_elems = 2 ** 20
