"""EMSA's attention op, A @ v: `naive` (the maths: Eq. 4 as written; the tests' oracle), `reference` (whole
maps, plain autograd), `pieces` (inference over pieces of queries), `train` (pieces of queries recomputed in
backward). `emsa_attention` dispatches between them."""
import torch

from ..dispatch import Path
from .pieces import emsa_in_pieces, query_pieces
from .reference import centred_keys, naive_emsa_attention
from .train import ChunkedEMSAAttention

__all__ = ['ChunkedEMSAAttention', 'emsa_attention', 'emsa_in_pieces', 'naive_emsa_attention']


def emsa_attention(q, k, v, scale, transform_conv=None, eps=1e-5, piece=None):
    """A @ v of EMSA for q (B, h, N, d), k, v (B, h, N', d).

    Args:
        q (Tensor): queries (B, h, N, d).
        k (Tensor): keys (B, h, N', d).
        v (Tensor): values (B, h, N', d).
        scale (float): the logits' scale.
        transform_conv (nn.Conv2d | None): the head-mixing 1x1 conv; None: the single-head form.
        eps (float): the instance norm's eps. Default: 1e-5.
        piece (Path | int | None): the `Path` from `ops.dispatch.choose`, or map entries per piece of
            queries. None (or a path without a piece): the reference on the whole map. With a piece: the
            train function `ChunkedEMSAAttention` while autograd records, else the inference pieces.

    Returns:
        Tensor: (B, h, N, d) in v's dtype.
    """
    if isinstance(piece, Path):
        piece = piece.piece
    if piece is None:
        return naive_emsa_attention(q, k, v, scale, transform_conv, eps)
    b, h, n, _ = q.shape
    rows = max(1, piece // (b * h * k.shape[2]))
    weight = transform_conv.weight if transform_conv is not None else None
    records = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, weight) if t is not None)
    kc = centred_keys(k, transform_conv.bias if transform_conv is not None and records else None)
    # contiguous once here (also what the train function keeps), not copied in every piece's matmul
    kc, v = kc.contiguous(), v.contiguous()
    if not records:
        return emsa_in_pieces(q, kc, v, weight, scale, eps, query_pieces(n, rows))[0]
    return ChunkedEMSAAttention.apply(q, kc, v, weight, scale, eps, rows)
