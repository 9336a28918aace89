"""Convolution-chain op (stems, downsamplings, LCM): `naive` (the maths: F.conv2d and the BN formula, L2ViT's
LCM as its Eqs. 6-7; the tests' oracle), `reference` (the layers on the whole map), `pieces` (inference in bands
of output rows, halo rows recomputed). `conv_chain` dispatches between the last two."""
import torch.nn as nn

from ..dispatch import INFERENCE
from .pieces import conv_chain_in_pieces
from .reference import ConvBNAct, conv_chain_reference, conv_layer

__all__ = ['ConvBNAct', 'batch_norm_updates', 'conv_chain', 'conv_chain_in_pieces', 'conv_chain_reference',
           'conv_layer']


def batch_norm_updates(layers):
    """True when a BatchNorm of the chain is in train mode (it would normalise with the batch's statistics
    and update its running ones, which pieces cannot do)."""
    for layer in layers:
        for m in (layer.norm, layer.act):
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
                return True
    return False


def conv_chain(path, layers, x, pre=None):
    """The chain `layers` (conv -> norm -> act each) on pre(x).

    Args:
        path (Path): from `ops.dispatch.choose` (piece unit: elements of the widest intermediate, the batch
            included). 'inference' with a piece runs in bands of rows unless a BatchNorm of the chain is in
            train mode (a train-mode norm inside an eval model); anything else the reference.
        layers (Sequence): `ConvLayer`s (modules with `conv`, `norm`, `act`) or `ConvBNAct`s.
        x (Tensor): the map (B, C, H, W).
        pre (Callable | None): a per-pixel function of the map applied first. Default: None.

    Returns:
        Tensor: (B, C_out, H_out, W_out).
    """
    if path.impl == INFERENCE and path.piece is not None and not batch_norm_updates(layers):
        return conv_chain_in_pieces(layers, x, path.piece, pre)
    return conv_chain_reference(layers, x, pre)
