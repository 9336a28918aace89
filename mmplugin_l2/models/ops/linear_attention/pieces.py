"""L2ViT's linear attention layer at inference in pieces of tokens (no autograd).

Two passes. First, per piece of tokens: the pre-norm, the qkv product, sum_j K_j and K^T V accumulated per
head, and Q = ReLU(q) written into the output buffer (the piece's own rows). Second, per piece: the
normalised output from Q, then the output projection, written over the piece's Q. The per-head products read
strided head slices of the piece in place (no head copies); only the output is map-sized. Same values as the
whole map up to the summation order of the two sums over tokens.
"""
import torch

from ..split import split
from .reference import fp32_reduce_context


def linear_attention_in_pieces(x, qkv, proj, temperature, num_heads, clamp_min, fp32_reduce, piece, norm=None):
    """The layer's output proj(attention(qkv(norm(x)))) for tokens x, in pieces of tokens.

    Args:
        x (Tensor): tokens (B, N, C).
        qkv (nn.Module): Linear(C, 3C).
        proj (nn.Module): Linear(C, C).
        temperature (Tensor): (heads, 1, 1).
        num_heads (int): heads.
        clamp_min (float): lower bound of the denominator.
        fp32_reduce (bool): the sums over the tokens and the division in float32, autocast off.
        piece (int): elements (tokens x C, the batch included) per piece.
        norm (nn.Module | None): the pre-norm applied to each piece.

    Returns:
        Tensor: (B, N, C).
    """
    b, n, c = x.shape
    d = c // num_heads
    pieces = [p.own for p in split(n, piece, unit=b * c)]
    fp32, reduce_ctx = fp32_reduce_context(x, fp32_reduce)
    heads = [slice(h * d, (h + 1) * d) for h in range(num_heads)]
    ksum, kv, out = [None] * num_heads, [None] * num_heads, None
    for p in pieces:
        t = qkv(x[:, p] if norm is None else norm(x[:, p]))
        if out is None:
            out = t.new_empty(b, n, c)
        torch.clamp_min(t[..., :c], 0, out=out[:, p])                  # Q of this piece
        k, v = t[..., c:2 * c].relu_(), t[..., 2 * c:]
        with reduce_ctx:
            if fp32:
                k, v = k.float(), v.float()
            for h, sl in enumerate(heads):
                ks, kh, vh = k[..., sl].sum(dim=1), k[..., sl].transpose(1, 2), v[..., sl]
                if kv[h] is None:
                    ksum[h], kv[h] = ks, torch.bmm(kh, vh)
                else:
                    ksum[h].add_(ks)
                    kv[h].baddbmm_(kh, vh)
    kvt = [kv[h] * temperature[h] for h in range(num_heads)]
    ksum = [s.unsqueeze(-1) for s in ksum]
    y = None
    for p in pieces:
        q = out[:, p]
        with reduce_ctx:
            if fp32:
                q = q.float()
            if y is None or y.shape[1] != q.shape[1]:
                y = q.new_empty(q.shape)
            for h, sl in enumerate(heads):
                denom = torch.bmm(q[..., sl], ksum[h]).clamp_min_(clamp_min)
                torch.div(torch.bmm(q[..., sl], kvt[h]), denom, out=y[..., sl])
        out[:, p] = proj(y.to(out.dtype))
    return out
