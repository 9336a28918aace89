"""L2ViT's linear attention op: `naive` (the maths, the attention matrix written out; the tests' oracle),
`reference` (whole maps, plain autograd, the authors' order), `train` (`LinearAttentionCore`, closed-form
backward), `pieces` (inference in pieces of tokens). `linear_attention` runs the one the `Path` of
`ops.dispatch.choose` names; `LINEAR_ATTENTION` (and `LINEAR_ATTENTION_HALF_SUMS` for a layer without
`fp32_reduce`) is what the fast paths support."""
import torch

from ..dispatch import INFERENCE, TRAIN, Fast, Supports
from .pieces import linear_attention_in_pieces
from .reference import fp32_reduce_context, linear_attention_reference
from .train import LinearAttentionCore

__all__ = ['LINEAR_ATTENTION', 'LINEAR_ATTENTION_HALF_SUMS', 'LinearAttentionCore', 'linear_attention',
           'linear_attention_in_pieces', 'linear_attention_reference']


#: inference works in pieces only (whole maps: the reference); the train function takes any dtype
LINEAR_ATTENTION = Supports(inference=Fast(pieces_only=True), train=Fast(), traced=(TRAIN,))
#: without `fp32_reduce` the train function would get q, k, v and the temperature in autocast's mixed dtypes
LINEAR_ATTENTION_HALF_SUMS = Supports(inference=Fast(pieces_only=True), train=Fast(autocast=False), traced=(TRAIN,))


def linear_attention(path, x, qkv, proj, temperature, num_heads, clamp_min=100., fp32_reduce=True, norm=None):
    """The linear attention layer's output proj(attention(q, k, v)) with q, k, v from qkv(norm(x)).

    Args:
        path (Path): from `ops.dispatch.choose` with `LINEAR_ATTENTION` (piece unit: elements of x):
            'inference' runs in pieces of tokens, 'train' takes `LinearAttentionCore`, anything else the
            reference.
        x (Tensor): tokens (B, N, C).
        qkv (nn.Module): Linear(C, 3C).
        proj (nn.Module): Linear(C, C).
        temperature (Tensor): the per-head multiplier of K^T V, (heads, 1, 1).
        num_heads (int): heads.
        clamp_min (float): lower bound of the denominator. Default: 100.
        fp32_reduce (bool): from q, k, v to the normalised output in float32 with autocast off (the sums
            over the tokens overflow fp16 at detection sizes); a no-op in float64. Default: True.
        norm (nn.Module | None): a pre-norm applied to x first. Default: None.

    Returns:
        Tensor: (B, N, C).
    """
    if path.impl == INFERENCE:
        return linear_attention_in_pieces(x, qkv, proj, temperature, num_heads, clamp_min, fp32_reduce,
                                          path.piece, norm)
    if norm is not None:
        x = norm(x)
    b, n, c = x.shape
    t = qkv(x)
    # views of the qkv output: their gradients stack back into its layout in one copy
    q, k, v = (u.transpose(1, 2) for u in t.view(b, n, 3, num_heads, c // num_heads).unbind(2))
    fp32, reduce_ctx = fp32_reduce_context(t, fp32_reduce)
    with reduce_ctx:
        if path.impl == TRAIN:      # with fp32: computes in fp32 from half q, k, v and keeps them half
            out = LinearAttentionCore.apply(q, k, v, temperature, clamp_min, torch.float32 if fp32 else None)
        elif fp32:
            out = linear_attention_reference(q.float(), k.float(), v.float(), temperature, clamp_min)
        else:
            out = linear_attention_reference(q, k, v, temperature, clamp_min)
    return proj(out.to(t.dtype).transpose(1, 2).reshape(b, n, c))
