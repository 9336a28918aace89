"""Inference of a chain of `ConvLayer`s band by band of output rows.

A stem or a convolutional downsampling on a large image builds several map-sized intermediates (at
1248 x 1248 the H-ViT3 stem makes five full-resolution maps). Without autograd nothing needs them
at once: `conv_chain_in_bands` computes the final output a band of rows at a time. For each band the
rows every layer needs (its receptive field, the halo) are worked out backwards from the band; each
layer then convolves exactly those rows, with zero rows added only where its input really ends (the
vertical zero padding of that layer), so the result is the same as the whole-map chain. The band
intermediates are a few MB and stay in cache.

A layer is anything with `conv` (an nn.Conv2d), `norm` and `act` (modules or None), e.g. a `ConvLayer`
or a `ConvBNAct` view of plain Sequential entries. Input and output are (B, C, H, W) tensors; channels-last
input gives channels-last output and bands, NCHW gives NCHW.
"""
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .conv import Conv2dCL


class ConvBNAct(NamedTuple):
    """A conv -> norm -> activation triple of existing modules (no parameters of its own)."""
    conv: nn.Conv2d
    norm: Optional[nn.Module] = None
    act: Optional[nn.Module] = None


def _channels_last(x):
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def _geometry(conv):
    return conv.kernel_size[0], conv.stride[0], conv.padding[0]


def can_run_in_bands(layers):
    """True when no BatchNorm of the chain would update its statistics (the caller checks the mode)."""
    return all(layer.norm is None or not layer.norm.training for layer in layers)


def _layer_rows(layer, x, top, bottom):
    """One ConvLayer on a band of input rows, `top` / `bottom` zero rows added first (channels-last pad)."""
    conv = layer.conv
    if (top or bottom) and _channels_last(x):
        x = F.pad(x.permute(0, 2, 3, 1), (0, 0, 0, 0, top, bottom)).permute(0, 3, 1, 2)
    elif top or bottom:
        x = F.pad(x, (0, 0, top, bottom))
    weight = conv.weight.to(memory_format=torch.channels_last) if isinstance(conv, Conv2dCL) else conv.weight
    x = F.conv2d(x, weight, conv.bias, conv.stride, (0, conv.padding[1]), conv.dilation, conv.groups)
    if layer.norm is not None:
        x = layer.norm(x)
    if layer.act is not None:
        x = layer.act(x)
    return x


def norm_map_rows(norm, x):
    """A LayerNorm over the channels of a map (B, C, H, W) (channels-last in, channels-last out)."""
    return norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def conv_chain_in_bands(layers, x, budget=2 ** 20, pre=None):
    """`layers` (a sequence of ConvLayer) applied to x (B, C, H, W), band by band of output rows.

    Each band holds about `budget` elements of the widest intermediate. `pre` (optional) is a function of
    the pixels one by one (e.g. a LayerNorm over the channels, `norm_map_rows`) applied to each band of
    input rows before the first layer, so that the chain computes layers(pre(x)) without pre(x) as a whole
    map. Same values as running the layers on the whole map (for a BatchNorm in eval mode)."""
    layers = list(layers)
    heights, widths = [x.shape[-2]], [x.shape[-1]]
    for layer in layers:
        k, s, p = _geometry(layer.conv)
        heights.append((heights[-1] + 2 * p - k) // s + 1)
        kw, sw, pw = layer.conv.kernel_size[1], layer.conv.stride[1], layer.conv.padding[1]
        widths.append((widths[-1] + 2 * pw - kw) // sw + 1)
    # elements of each layer's output per output row of the chain
    per_row, rows = 0, 1
    for i in range(len(layers) - 1, -1, -1):
        per_row = max(per_row, rows * widths[i + 1] * layers[i].conv.out_channels)
        rows *= layers[i].conv.stride[0]
    band = max(1, budget // (per_row * x.shape[0]))
    out = None
    for o0 in range(0, heights[-1], band):
        o1 = min(heights[-1], o0 + band)
        plan = []          # per layer, from the last: (first input row, end input row, top, bottom)
        r0, r1 = o0, o1
        for i in range(len(layers) - 1, -1, -1):
            k, s, p = _geometry(layers[i].conv)
            a0, a1 = r0 * s - p, (r1 - 1) * s - p + k
            plan.append((max(a0, 0), min(a1, heights[i]), max(-a0, 0), max(a1 - heights[i], 0)))
            r0, r1 = plan[-1][:2]
        plan.reverse()
        t = x[:, :, plan[0][0]:plan[0][1]]
        if pre is not None:
            t = pre(t)
        for layer, (_, _, top, bottom) in zip(layers, plan):
            t = _layer_rows(layer, t, top, bottom)
        if out is None:
            out = torch.empty(t.shape[:2] + (heights[-1], widths[-1]), dtype=t.dtype, device=t.device,
                              memory_format=torch.channels_last if _channels_last(t) else torch.contiguous_format)
        out[:, :, o0:o1] = t
    return out
