"""EMSA's attention op, A @ v: `naive` (the maths: Eq. 4 as written; the tests' oracle), `reference` (whole
maps, well-conditioned, plain autograd), `pieces` (inference over pieces of queries), `train`
(`EMSAPiecesFunction`: pieces of queries recomputed in backward). `emsa_attention` runs the one the `Path`
of `ops.dispatch.choose` names; `EMSA_ATTENTION` is what the fast paths support."""
from ....deprecation import renamed_attributes
from ..dispatch import INFERENCE, TRAIN, Fast, Supports
from .pieces import emsa_in_pieces, query_pieces
from .reference import centred_keys, emsa_attention_reference
from .train import EMSAPiecesFunction

__all__ = ['EMSA_ATTENTION', 'EMSAPiecesFunction', 'emsa_attention', 'emsa_attention_reference', 'emsa_in_pieces']

#: both fast paths work in pieces only (whole maps: the reference); attention dropout takes the reference
EMSA_ATTENTION = Supports(inference=Fast(pieces_only=True), train=Fast(pieces_only=True, dropout=False))


def emsa_attention(path, q, k, v, scale, transform_conv=None, eps=1e-5, attn_drop=None):
    """A @ v of EMSA for q (B, h, N, d), k, v (B, h, N', d).

    Args:
        path (Path): from `ops.dispatch.choose` with `EMSA_ATTENTION` (piece unit: entries of the attention
            map, the batch included): 'inference' runs `emsa_in_pieces`, 'train' `EMSAPiecesFunction`,
            anything else the reference.
        q (Tensor): queries (B, h, N, d).
        k (Tensor): keys (B, h, N', d).
        v (Tensor): values (B, h, N', d).
        scale (float): the logits' scale.
        transform_conv (nn.Conv2d | None): the head-mixing 1x1 conv; None: the single-head form.
        eps (float): the instance norm's eps. Default: 1e-5.
        attn_drop (nn.Module | None): dropout on A (the reference only). Default: None.

    Returns:
        Tensor: (B, h, N, d) in v's dtype.
    """
    if path.impl not in (INFERENCE, TRAIN):
        return emsa_attention_reference(q, k, v, scale, transform_conv, eps, attn_drop)
    weight = transform_conv.weight if transform_conv is not None else None
    kc = centred_keys(k, transform_conv.bias if transform_conv is not None and path.impl == TRAIN else None)
    # contiguous once here (also what the train function keeps), not copied in every piece's matmul
    kc, v = kc.contiguous(), v.contiguous()
    if path.impl == INFERENCE:
        return emsa_in_pieces(q, kc, v, weight, scale, eps, query_pieces(q, kc.shape[2], path.piece))[0]
    return EMSAPiecesFunction.apply(q, kc, v, weight, scale, eps, path.piece)


__getattr__ = renamed_attributes(__name__, globals(), {'naive_emsa_attention': 'emsa_attention_reference',
                                                       'ChunkedEMSAAttention': 'EMSAPiecesFunction'})
