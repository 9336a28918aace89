"""Reference of the convolution-chain op: the layers one after the other on the whole map, plain autograd.

A layer is a `ConvLayer` (an nn.Module with `conv`, `norm`, `act`; called as a module) or a `ConvBNAct`
triple of existing modules / functions.
"""
from typing import Callable, NamedTuple, Optional

import torch.nn as nn


class ConvBNAct(NamedTuple):
    """A conv -> norm -> act triple of existing modules (no parameters of its own); with `act_first`,
    conv -> act -> norm.

    Args:
        conv (nn.Conv2d): the convolution.
        norm (nn.Module | None): a per-channel norm (e.g. BatchNorm2d). Default: None.
        act (Callable | None): a per-element activation. Default: None.
        act_first (bool): the activation before the norm. Default: False.
    """
    conv: nn.Conv2d
    norm: Optional[nn.Module] = None
    act: Optional[Callable] = None
    act_first: bool = False


def norm_act(layer, x):
    """The norm and the activation of `layer` (a `ConvLayer` or `ConvBNAct`) on its conv output x, in the
    layer's order (`act_first`)."""
    steps = (layer.act, layer.norm) if getattr(layer, 'act_first', False) else (layer.norm, layer.act)
    for f in steps:
        if f is not None:
            x = f(x)
    return x


def conv_layer(layer, x):
    """One layer of a chain on the map x (B, C, H, W): its conv, then norm and act in the layer's order."""
    if isinstance(layer, nn.Module):
        return layer(x)
    return norm_act(layer, layer.conv(x))


def conv_chain_reference(layers, x, pre=None):
    """layers(pre(x)) on the whole map.

    Args:
        layers (Sequence): `ConvLayer`s or `ConvBNAct`s.
        x (Tensor): the map (B, C, H, W).
        pre (Callable | None): a per-pixel function of the map applied first. Default: None.

    Returns:
        Tensor: (B, C_out, H_out, W_out).
    """
    if pre is not None:
        x = pre(x)
    for layer in layers:
        x = conv_layer(layer, x)
    return x
