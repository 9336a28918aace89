"""The MLP ops: `naive` (the maths, the tests' oracle), `reference` (plain autograd, the activation a
parameter), `pieces` (inference, exact GELU in place, in pieces of tokens / rows), `train` (closed-form backward
functions, exact GELU). `mlp` and `conv_mlp` run the implementation the `Path` of `ops.dispatch.choose` names;
`MLP`, `CONV_MLP`, `NORM_MLP` and `NORM_MLP_UNCHECKPOINTED` declare what their fast paths support;
`norm_mlp_train` is the pre-norm MLP branch's training function.

Every fast path needs the exact GELU; the train functions also no active dropout (its masks need checkpointing's
RNG replay). Under autocast the train functions compute what the reference computes there, on whole maps
(`NormMlpFunction`: LayerNorm statistics in fp32, products in the half dtype; `ConvMlpFunction`: everything in the
autocast dtype, outside recomputed blocks only). Outside that, training checkpoints the reference (recomputed in
backward, RNG state preserved).
"""
import torch.nn as nn

from ..checkpoint import checkpointed
from ..dispatch import CHECKPOINT, INFERENCE, TRAIN, Fast, Supports
from .pieces import conv_mlp_inference, gelu_, linear_into, mlp_inference
from .reference import conv_mlp_reference, mlp_reference
from .train import ConvMlpPiecesFunction, ConvMlpFunction, NormMlpFunction

__all__ = ['CONV_MLP', 'ConvMlpPiecesFunction', 'ConvMlpFunction', 'MLP', 'NORM_MLP', 'NORM_MLP_UNCHECKPOINTED',
           'NormMlpFunction', 'conv_mlp',
           'conv_mlp_inference', 'conv_mlp_reference', 'exact_gelu', 'gelu_', 'linear_into', 'mlp', 'mlp_inference',
           'mlp_reference', 'norm_mlp_train']


def exact_gelu(act):
    """Whether `act` is the exact GELU (nn.GELU, approximate='none'), the one activation of the fast paths."""
    return type(act) is nn.GELU and act.approximate == 'none'


#: what the ConvMlp closed-form training functions take (every MLP's train function and checkpoint is also traced by a
#: whole-model torch.compile, `Supports.traced`)
_TRAIN_FUNCTION = Fast(half=False, autocast=False, dropout=False, act=exact_gelu, input_grad=True)
#: Mlp: inference in pieces / in place; training checkpoints the reference
MLP = Supports(inference=Fast(act=exact_gelu), train=None, checkpoint=True, traced=(CHECKPOINT,))
#: ConvMlp: inference in pieces / in place; training `ConvMlpFunction` / `ConvMlpPiecesFunction` in fp32 / fp64, and
#: `ConvMlpFunction` under autocast (whole maps: a piece's parameter-gradient partials would be rounded to the half
#: dtype one by one; keeping the fc1 output, which measured faster than recomputing the branch, within Swin-T's
#: training memory, docs/mixed_precision.md) except inside recomputed blocks (the reference there); else checkpointed
CONV_MLP = Supports(inference=Fast(act=exact_gelu),
                    train=_TRAIN_FUNCTION._replace(half='autocast', autocast=True, half_pieces=False,
                                                   half_recomputed=False),
                    checkpoint=True, traced=(TRAIN, CHECKPOINT))
#: a recomputing block's pre-norm MLP branch (affine LayerNorm, `Mlp`; L2ViT): training `NormMlpFunction`, under
#: autocast on whole maps (its pieces' weight gradients would be sums of products rounded to the half dtype), also on
#: half tokens (the residual stream after a conv stem under autocast; keeping the fc1 output, which measured faster
#: than recomputing the branch, within Swin-T's training memory, docs/mixed_precision.md), except inside recomputed
#: blocks (the reference there); else checkpointed
NORM_MLP = Supports(inference=None, train=_TRAIN_FUNCTION._replace(input_grad=False, autocast=True, half='autocast',
                                                                   half_pieces=False, half_recomputed=False),
                    checkpoint=True, traced=(TRAIN, CHECKPOINT))
#: the branch of a block that does not recompute (ResT): `NormMlpFunction` (it keeps x and the fc1 output where the
#: reference keeps the LayerNorm output, the fc1 output and its GELU), else the reference
NORM_MLP_UNCHECKPOINTED = Supports(inference=None, train=NORM_MLP.train._replace(half_recomputed=True),
                                   checkpoint=False, traced=(TRAIN,))


def mlp(path, x, fc1, fc2, act, drop, norm=None):
    """The transformer MLP fc2(act(fc1(norm(x)))) (dropout after act and fc2).

    Args:
        path (Path): from `ops.dispatch.choose` with `MLP` (piece unit: elements of x). 'inference' runs
            `mlp_inference`, 'checkpoint' the reference recomputed in backward, anything else the reference.
        x (Tensor): tokens (..., C).
        fc1 (nn.Linear): C -> rC.
        fc2 (nn.Linear): rC -> C_out.
        act (nn.Module): the activation.
        drop (nn.Module): the dropout.
        norm (nn.Module | None): a pre-norm applied to x first. Default: None.

    Returns:
        Tensor: (..., C_out).
    """
    if path.impl == INFERENCE:
        return mlp_inference(x, fc1, fc2, path.piece, norm)
    if path.impl == CHECKPOINT:
        x = x if norm is None else norm(x)
        return checkpointed(lambda t: mlp_reference(t, fc1, fc2, act, drop), x)
    return mlp_reference(x, fc1, fc2, act, drop, norm)


def conv_mlp(path, x, hw_shape, fc1, dwc, fc2, act, drop, keep_fc1=True):
    """ConvMlp: fc2(act(u + dwc(u))), u = act(fc1(x)) (dropout after the first act and fc2).

    Args:
        path (Path): from `ops.dispatch.choose` with `CONV_MLP` (piece unit: elements of x). 'inference' runs
            `conv_mlp_inference`; 'train' `ConvMlpPiecesFunction` with a piece and `keep_fc1`, else
            `ConvMlpFunction`; 'checkpoint' the reference recomputed in backward; anything else the reference.
        x (Tensor): tokens (B, N, C) of an (H, W) map.
        hw_shape (tuple[int]): (H, W).
        fc1 (nn.Linear): C -> rC.
        dwc (nn.Conv2d): depth-wise 3x3, padding 1.
        fc2 (nn.Linear): rC -> C_out.
        act (nn.Module): the activation.
        drop (nn.Module): the dropout.
        keep_fc1 (bool): the train functions keep the fc1 output for backward (no fc1 there). Default: True.

    Returns:
        Tensor: (B, N, C_out).
    """
    if path.impl == INFERENCE:
        return conv_mlp_inference(x, hw_shape, fc1, dwc, fc2, path.piece)
    if path.impl == TRAIN:
        params = (fc1.weight, fc1.bias, dwc.weight, dwc.bias, fc2.weight, fc2.bias)
        if path.piece is not None and keep_fc1:
            return ConvMlpPiecesFunction.apply(x, tuple(hw_shape), path.piece, *params)
        return ConvMlpFunction.apply(x, tuple(hw_shape), keep_fc1, *params)
    if path.impl == CHECKPOINT:
        return checkpointed(lambda t: conv_mlp_reference(t, hw_shape, fc1, dwc, fc2, act, drop), x)
    return conv_mlp_reference(x, hw_shape, fc1, dwc, fc2, act, drop)


def norm_mlp_train(x, norm, fc1, fc2, piece=None):
    """The pre-norm MLP branch fc2(GELU(fc1(norm(x)))) as `NormMlpFunction` (the path `NORM_MLP` declares: an
    affine LayerNorm `norm`), in pieces of about `piece` elements of x.

    Args:
        x (Tensor): tokens (..., C).
        norm (nn.LayerNorm): the pre-norm (affine).
        fc1 (nn.Linear): C -> rC.
        fc2 (nn.Linear): rC -> C_out.
        piece (int | None): elements of x per piece. Default: None.

    Returns:
        Tensor: (..., C_out).
    """
    return NormMlpFunction.apply(x, norm.weight, norm.bias, norm.eps, fc1.weight, fc1.bias, fc2.weight,
                                 fc2.bias, piece)
