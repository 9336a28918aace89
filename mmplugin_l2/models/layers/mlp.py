"""Feed-forward networks of the blocks.

    Mlp(x)     = fc2(act(fc1(x)))                                (ViT3, L2ViT, ResT)
    ConvMlp(x) = fc2(act(u + DWConv3x3(u))),  u = act(fc1(x))    (H-ViT3; act twice, as the authors)

with act the exact GELU by default (`act_cfg`). Tokens (B, N, C) in and out. The maths: `ops/mlp/naive.py`
(`mlp_naive`, `conv_mlp_naive`). The op is `ops.mlp`
(reference, inference in pieces, closed-form training functions), chosen once per forward by
`ops.dispatch.choose`; `fast_train=True` takes the training functions (or the reference recomputed in
backward where they do not apply).

`norm_mlp_branch` is the pre-norm MLP branch mlp(norm(x)) of L2ViT's and ResT's blocks; when the block
recomputes it runs `NormMlpFunction` (keeps the branch input and the fc1 output, recomputes LayerNorm and
GELU in backward).
"""
import torch.nn as nn
from mmcv.cnn import build_activation_layer

from ..ops import CHECKPOINT, TRAIN, choose
from ..ops.checkpoint import recomputed_branch
from ..ops.memory import DEFAULT_POLICY
from ..ops.mlp import (CONV_MLP, MLP, NORM_MLP, NORM_MLP_UNCHECKPOINTED, ConvMlpPiecesFunction,  # noqa: F401
                       ConvMlpFunction, NormMlpFunction, conv_mlp, mlp, norm_mlp_train)
from ..ops.mlp.pieces import gelu_
from .conv import Conv2dCL


def gelu(x, inplace=False):
    """Exact GELU; in place with `inplace` (inference only)."""
    return gelu_(x) if inplace else nn.functional.gelu(x)


class Mlp(nn.Module):
    """fc1 (C -> rC) -> act -> fc2 (rC -> C), dropout after act and fc2.

    Args:
        dim (int): channels C.
        hidden_dim (int): hidden channels rC.
        drop (float): dropout. Default: 0.
        fast_train (bool): in training, recompute the hidden activations in backward. Default: False.
        act_cfg (dict): the activation (OpenMMLab config). Default: dict(type='GELU').

    forward(x, hw_shape=None, norm=None): x (B, N, C) -> (B, N, C); `hw_shape` is unused (a common
    signature); with `norm`, mlp(norm(x)), the norm piece by piece at inference.
    """

    #: pieces of tokens x channels (the batch included) at inference
    memory_policy = DEFAULT_POLICY

    def __init__(self, dim, hidden_dim, drop=0., fast_train=False, act_cfg=dict(type='GELU')):
        super().__init__()
        self.fast_train = fast_train
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = build_activation_layer(act_cfg)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x, hw_shape=None, norm=None):
        path = choose(self, x, x.numel(), MLP, modules=(self.drop,), acts=(self.act,))
        return mlp(path, x, self.fc1, self.fc2, self.act, self.drop, norm)


class ConvMlp(nn.Module):
    """fc1 (C -> rC) -> act -> u + DWConv3x3(u) -> act -> fc2 (rC -> C), dropout after the first act and fc2.

    Args:
        dim (int): channels C.
        hidden_dim (int): hidden channels rC.
        drop (float): dropout. Default: 0.
        fast_train (bool): in training, keep the input and the fc1 output and recompute the rest in
            backward (`ConvMlpFunction`, in pieces of rows on the policy's devices). Default: False.
        act_cfg (dict): the activation (OpenMMLab config). Default: dict(type='GELU').

    forward(x, hw_shape): x (B, N, C) of an (H, W) map -> (B, N, C).
    """

    #: pieces of rows x width x channels (the batch included) at inference and in training
    memory_policy = DEFAULT_POLICY

    def __init__(self, dim, hidden_dim, drop=0., fast_train=False, act_cfg=dict(type='GELU')):
        super().__init__()
        self.fast_train = fast_train
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = build_activation_layer(act_cfg)
        self.dwc = Conv2dCL(hidden_dim, hidden_dim, 3, padding=1, groups=hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x, hw_shape):
        path = choose(self, x, x.numel(), CONV_MLP, modules=(self.drop,), acts=(self.act,))
        return conv_mlp(path, x, hw_shape, self.fc1, self.dwc, self.fc2, self.act, self.drop)


def norm_mlp_branch(block, norm, mlp, x, checkpoint=True):
    """The pre-norm MLP branch mlp(norm(x)) of `block` (an `Mlp`, which takes `norm=`), its path chosen with
    `block`'s mode and `fast_train` and the MLP's memory policy: `NormMlpFunction` where `ops.mlp.NORM_MLP`
    applies (an affine LayerNorm and an `Mlp`), else the whole branch recomputed in backward
    (`checkpoint.recomputed_branch`); with `checkpoint=False` (`ops.mlp.NORM_MLP_UNCHECKPOINTED`) the function
    also on half tokens and plain autograd where it does not apply; else `mlp(x, norm=norm)` (its own path)."""
    fused = isinstance(norm, nn.LayerNorm) and norm.elementwise_affine and isinstance(mlp, Mlp)
    supports = NORM_MLP if checkpoint else NORM_MLP_UNCHECKPOINTED
    supports = supports if fused else supports._replace(train=None)
    path = choose(block, x, x.numel(), supports, modules=(mlp.drop,), acts=(mlp.act,), policy=mlp.memory_policy)
    if path.impl == TRAIN:
        return norm_mlp_train(x, norm, mlp.fc1, mlp.fc2, path.piece)
    if path.impl == CHECKPOINT:
        return recomputed_branch(block, norm, mlp, x)
    return mlp(x, norm=norm)
