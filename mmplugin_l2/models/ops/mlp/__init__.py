"""The MLP ops: `naive` (the maths, the tests' oracle), `reference` (plain autograd, the activation a
parameter), `pieces` (inference, exact GELU in place, in pieces of tokens / rows), `train` (closed-form backward
functions, exact GELU). `mlp` and `conv_mlp` dispatch between the last three from the `Path` of
`ops.dispatch.choose`; `norm_mlp_train` is the pre-norm MLP branch's training function.

A setting a fast path does not support falls back to the reference: an activation other than exact GELU
(every path), dropout in training and half precision / autocast (the train functions). Under the train
path the reference is then recomputed in backward (activation checkpointing, RNG state preserved).
"""
import torch
import torch.nn as nn

from ..dispatch import INFERENCE, TRAIN
from ..dtypes import autocast_on
from .pieces import conv_mlp_inference, gelu_, linear_into, mlp_inference
from .reference import conv_mlp_reference, mlp_reference
from .train import ConvMlpPiecesFunction, ConvMlpFunction, NormMlpFunction

__all__ = ['ConvMlpPiecesFunction', 'ConvMlpFunction', 'NormMlpFunction', 'conv_mlp', 'conv_mlp_inference',
           'conv_mlp_reference', 'exact_gelu', 'gelu_', 'linear_into', 'mlp', 'mlp_inference', 'mlp_reference',
           'norm_mlp_train', 'train_applies']


def exact_gelu(act):
    """Whether `act` is the exact GELU (nn.GELU, approximate='none'), the one activation of the fast paths."""
    return type(act) is nn.GELU and act.approximate == 'none'


def train_applies(x, act, drop):
    """Whether the closed-form training functions may run: exact GELU, no active dropout (its masks need
    checkpointing's RNG replay), fp32 / fp64 tokens outside autocast."""
    return (exact_gelu(act) and not (drop.p > 0 and drop.training) and x.dtype in (torch.float32, torch.float64)
            and not autocast_on(x.device.type))


def _checkpointed(fn, *args):
    from ..checkpoint import checkpointed
    return checkpointed(fn, *args)


def mlp(path, x, fc1, fc2, act, drop, norm=None):
    """The transformer MLP fc2(act(fc1(norm(x)))) (dropout after act and fc2).

    Args:
        path (Path): from `ops.dispatch.choose` (piece unit: elements of x). 'inference' runs
            `mlp_inference` (exact GELU only), 'train' the reference recomputed in backward when x needs a
            gradient, anything else the reference.
        x (Tensor): tokens (..., C).
        fc1 (nn.Linear): C -> rC.
        fc2 (nn.Linear): rC -> C_out.
        act (nn.Module): the activation.
        drop (nn.Module): the dropout.
        norm (nn.Module | None): a pre-norm applied to x first. Default: None.

    Returns:
        Tensor: (..., C_out).
    """
    if path.impl == INFERENCE and exact_gelu(act):
        return mlp_inference(x, fc1, fc2, path.piece, norm)
    if path.impl == TRAIN and x.requires_grad:
        x = x if norm is None else norm(x)
        return _checkpointed(lambda t: mlp_reference(t, fc1, fc2, act, drop), x)
    return mlp_reference(x, fc1, fc2, act, drop, norm)


def conv_mlp(path, x, hw_shape, fc1, dwc, fc2, act, drop, keep_fc1=True):
    """ConvMlp: fc2(act(u + dwc(u))), u = act(fc1(x)) (dropout after the first act and fc2).

    Args:
        path (Path): from `ops.dispatch.choose` (piece unit: elements of x). 'inference' runs
            `conv_mlp_inference` (exact GELU); 'train' (x needing a gradient) `ConvMlpPiecesFunction` with a
            piece and `keep_fc1`, else `ConvMlpFunction` (where `train_applies`), else the reference
            recomputed in backward; anything else the reference.
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
    if path.impl == INFERENCE and exact_gelu(act):
        return conv_mlp_inference(x, hw_shape, fc1, dwc, fc2, path.piece)
    if path.impl == TRAIN and x.requires_grad:
        if train_applies(x, act, drop):
            params = (fc1.weight, fc1.bias, dwc.weight, dwc.bias, fc2.weight, fc2.bias)
            if path.piece is not None and keep_fc1:
                rows = max(1, path.piece // (x.shape[0] * hw_shape[1] * x.shape[-1]))
                return ConvMlpPiecesFunction.apply(x, tuple(hw_shape), rows, *params)
            return ConvMlpFunction.apply(x, tuple(hw_shape), keep_fc1, *params)
        return _checkpointed(lambda t: conv_mlp_reference(t, hw_shape, fc1, dwc, fc2, act, drop), x)
    return conv_mlp_reference(x, hw_shape, fc1, dwc, fc2, act, drop)


def norm_mlp_train(x, norm, fc1, fc2, piece=None):
    """The pre-norm MLP branch fc2(GELU(fc1(norm(x)))) as `NormMlpFunction` (the caller checks
    `train_applies` and that `norm` is an affine LayerNorm), in pieces of about `piece` elements of x.

    Args:
        x (Tensor): tokens (..., C).
        norm (nn.LayerNorm): the pre-norm (affine).
        fc1 (nn.Linear): C -> rC.
        fc2 (nn.Linear): rC -> C_out.
        piece (int | None): elements of x per piece. Default: None.

    Returns:
        Tensor: (..., C_out).
    """
    rows = None if piece is None else piece // x.shape[-1]
    return NormMlpFunction.apply(x, norm.weight, norm.bias, norm.eps, fc1.weight, fc1.bias, fc2.weight,
                                 fc2.bias, rows)
