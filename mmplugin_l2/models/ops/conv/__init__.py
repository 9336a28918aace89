"""Convolution-chain op (stems, downsamplings, LCM): `naive` (the maths: F.conv2d and the BN formula, L2ViT's
LCM as its Eqs. 6-7; the tests' oracle), `reference` (the layers on the whole map), `pieces` (inference in pieces
of output rows, halo rows recomputed). `conv_chain` runs the one the `Path` of `ops.dispatch.choose` names;
`CONV_CHAIN` is what the pieces support. `batch_norm` holds BatchNorm2d's accurate CPU training pass
(`BatchNormCLFunction`), `BATCH_NORM` what it supports; `depthwise` a depth-wise convolution's training pass
with a large kernel's weight gradient as a convolution per sample and a strided convolution's input gradient in
fp32 (`DepthwiseConvFunction`; `depthwise_applies`: the convs it computes), `DEPTHWISE_CONV` where it runs."""
import torch

from ..dispatch import INFERENCE, TRAIN, Fast, Supports
from .batch_norm import BatchNormCLFunction
from .depthwise import DepthwiseConvFunction, depthwise_applies, depthwise_input_grad, depthwise_weight_grad
from .pieces import conv_chain_in_pieces
from .reference import ConvBNAct, conv_chain_reference, conv_layer

__all__ = ['BATCH_NORM', 'BatchNormCLFunction', 'CONV_CHAIN', 'ConvBNAct', 'DEPTHWISE_CONV', 'DepthwiseConvFunction',
           'chain_modules', 'conv_chain', 'conv_chain_in_pieces', 'conv_chain_reference', 'conv_layer',
           'depthwise_applies', 'depthwise_input_grad', 'depthwise_weight_grad']


#: inference in pieces of rows, not while a BatchNorm of the chain is in train mode (a train-mode norm inside an
#: eval model normalises with the batch's statistics and updates its running ones, which pieces cannot do)
CONV_CHAIN = Supports(inference=Fast(train_norm=False), train=None)
#: the accurate training pass: fp32 channels-last maps on CPU (elsewhere torch's kernel); not traced by a whole-model
#: torch.compile, which generates BatchNorm's code itself
BATCH_NORM = Supports(inference=None, train=Fast(devices=('cpu',), dtypes=(torch.float32,), channels_last=True))
#: the depth-wise training pass: computing in bf16 on CPU, where oneDNN's own depth-wise weight gradient of a large
#: kernel is slower than the per-sample convolution, and its bf16 input gradient of a strided one slower than fp32's
#: (docs/mixed_precision.md); traced by a whole-model torch.compile too (the kernels it picks are aten's there as well)
DEPTHWISE_CONV = Supports(inference=None, train=Fast(devices=('cpu',), compute_dtypes=(torch.bfloat16,)),
                          traced=(TRAIN,))


def chain_modules(layers):
    """The norms and activations of the chain `layers`, for `choose(..., modules=)`."""
    return tuple(m for layer in layers for m in (layer.norm, layer.act) if m is not None)


def conv_chain(path, layers, x, pre=None):
    """The chain `layers` (conv -> norm -> act each) on pre(x).

    Args:
        path (Path): from `ops.dispatch.choose` with `CONV_CHAIN` and `chain_modules(layers)` (piece unit:
            elements of the widest intermediate, the batch included). 'inference' with a piece runs in pieces
            of rows; anything else the reference.
        layers (Sequence): `ConvLayer`s (modules with `conv`, `norm`, `act`) or `ConvBNAct`s.
        x (Tensor): the map (B, C, H, W).
        pre (Callable | None): a per-pixel function of the map applied first. Default: None.

    Returns:
        Tensor: (B, C_out, H_out, W_out).
    """
    if path.impl == INFERENCE and path.piece is not None:
        return conv_chain_in_pieces(layers, x, path.piece, pre)
    return conv_chain_reference(layers, x, pre)
