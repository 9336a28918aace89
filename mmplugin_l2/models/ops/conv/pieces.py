"""The convolution-chain op at inference in pieces: pieces of output rows.

A stem or a convolutional downsampling on a large image builds several map-sized intermediates (the H-ViT3
stem makes five full-resolution maps). Without autograd nothing needs them at once: `conv_chain_in_pieces`
computes the final output a piece of rows at a time. For each piece the rows every layer needs (its receptive
field, the halo) are worked out backwards from the piece; each layer then convolves exactly those rows, with
zero rows added only where its input really ends (the vertical zero padding of that layer), so the result is
the same as the whole-map chain (`reference.conv_chain_reference`). The pieces' intermediates stay in cache.

Input and output are (B, C, H, W) tensors; channels-last input gives channels-last output and pieces, NCHW
gives NCHW. A BatchNorm of the chain must use its running statistics (`conv_chain` checks).
"""
import torch
import torch.nn.functional as F

from ..split import split
from ..tokens import channels_last
from .reference import norm_act


def _geometry(conv):
    return conv.kernel_size[0], conv.stride[0], conv.padding[0]


def _layer_rows(layer, x, top, bottom):
    """One layer on a piece of input rows, `top` / `bottom` zero rows added first (channels-last pad); a conv
    with `kernel_channels_last` (`layers.conv.Conv2dCL`) gets its kernel channels-last."""
    conv = layer.conv
    if (top or bottom) and channels_last(x):
        x = F.pad(x.permute(0, 2, 3, 1), (0, 0, 0, 0, top, bottom)).permute(0, 3, 1, 2)
    elif top or bottom:
        x = F.pad(x, (0, 0, top, bottom))
    weight = conv.weight
    if getattr(conv, 'kernel_channels_last', False):
        weight = weight.to(memory_format=torch.channels_last)
    x = F.conv2d(x, weight, conv.bias, conv.stride, (0, conv.padding[1]), conv.dilation, conv.groups)
    return norm_act(layer, x)


def conv_chain_in_pieces(layers, x, piece, pre=None):
    """layers(pre(x)) piece by piece of output rows; the values of `conv_chain_reference`.

    Args:
        layers (Sequence): `ConvLayer`s or `ConvBNAct`s (norms in eval mode).
        x (Tensor): the map (B, C, H, W).
        piece (int): elements of the widest intermediate per piece (the batch included); at least one row.
        pre (Callable | None): a per-pixel function of the map (e.g. a LayerNorm over the channels) applied
            to each piece of input rows before the first layer. Default: None.

    Returns:
        Tensor: (B, C_out, H_out, W_out), in x's memory format.
    """
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
    out = None
    for o0, o1, _, _ in split(heights[-1], piece, unit=per_row * x.shape[0]):
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
                              memory_format=torch.channels_last if channels_last(t) else torch.contiguous_format)
        out[:, :, o0:o1] = t
    return out
