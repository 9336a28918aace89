"""L2ViT's linear attention op: `naive` (the maths, the attention matrix written out; the tests' oracle),
`reference` (whole maps, plain autograd, the authors' order), `train` (`LinearAttentionCore`, closed-form
backward), `pieces` (inference in pieces of tokens). `linear_attention` dispatches between the last three."""
from ..dispatch import INFERENCE, TRAIN
from ..dtypes import autocast_on
from .pieces import linear_attention_in_pieces
from .reference import fp32_reduce_context, linear_attention_reference
from .train import LinearAttentionCore

__all__ = ['LinearAttentionCore', 'linear_attention', 'linear_attention_in_pieces', 'linear_attention_reference']


def linear_attention(path, x, qkv, proj, temperature, num_heads, clamp_min=100., fp32_reduce=True, norm=None):
    """The linear attention layer's output proj(attention(q, k, v)) with q, k, v from qkv(norm(x)).

    Args:
        path (Path): from `ops.dispatch.choose`: 'inference' with a piece runs in pieces of tokens, 'train'
            takes `LinearAttentionCore` (the reference under autocast without `fp32_reduce`), anything else
            the reference.
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
    if path.impl == INFERENCE and path.piece is not None:
        return linear_attention_in_pieces(x, qkv, proj, temperature, num_heads, clamp_min, fp32_reduce,
                                          path.piece, norm)
    if norm is not None:
        x = norm(x)
    b, n, c = x.shape
    t = qkv(x)
    # views of the qkv output: their gradients stack back into its layout in one copy
    q, k, v = (u.transpose(1, 2) for u in t.view(b, n, 3, num_heads, c // num_heads).unbind(2))
    fp32, reduce_ctx = fp32_reduce_context(t, fp32_reduce)
    # the train function takes q, k, v and the temperature in one dtype: not under autocast without fp32_reduce
    train = path.impl == TRAIN and (fp32 or not autocast_on(t.device.type))
    attend = LinearAttentionCore.apply if train else linear_attention_reference
    with reduce_ctx:
        if fp32:
            out = attend(q.float(), k.float(), v.float(), temperature, clamp_min).to(t.dtype)
        else:
            out = attend(q, k, v, temperature, clamp_min)
    return proj(out.transpose(1, 2).reshape(b, n, c))
