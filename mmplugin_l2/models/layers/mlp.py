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

from ..ops import choose
from ..ops.dispatch import trains_fast
from ..ops.memory import DEFAULT_POLICY
from ..ops.mlp import (ConvMlpPiecesFunction, ConvMlpFunction, NormMlpFunction, conv_mlp,  # noqa: F401
                       linear_into as _linear_into, mlp, norm_mlp_train, train_applies)
from ..ops.mlp.pieces import gelu_
from .conv import Conv2dCL
from ..ops.checkpoint import recomputed_branch


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
        return mlp(choose(self, x, x.numel()), x, self.fc1, self.fc2, self.act, self.drop, norm)


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
        return conv_mlp(choose(self, x, x.numel()), x, hw_shape, self.fc1, self.dwc, self.fc2, self.act,
                        self.drop)


def norm_mlp_branch(block, norm, mlp, x, recompute_otherwise=True):
    """The pre-norm MLP branch mlp(norm(x)) of `block` (an `Mlp`, which takes `norm=`). When the block
    recomputes (`ops.dispatch.trains_fast`), an affine LayerNorm and an `Mlp` where `ops.mlp.train_applies`
    run `NormMlpFunction` (the piece from `ops.dispatch.choose` with the MLP's policy); otherwise the whole
    branch is recomputed in backward (`checkpoint.recomputed_branch`; with `recompute_otherwise=False` plain
    autograd instead)."""
    if not trains_fast(block):
        return mlp(x, norm=norm)
    if (isinstance(norm, nn.LayerNorm) and norm.elementwise_affine and isinstance(mlp, Mlp)
            and train_applies(x, mlp.act, mlp.drop)):
        path = choose(block, x, x.numel(), policy=mlp.memory_policy)
        return norm_mlp_train(x, norm, mlp.fc1, mlp.fc2, path.piece)
    return recomputed_branch(block, norm, mlp, x) if recompute_otherwise else mlp(x, norm=norm)
