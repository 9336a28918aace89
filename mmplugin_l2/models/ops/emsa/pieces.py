"""EMSA's A @ v over pieces of queries, without autograd: the inference path and the forward of the train
path (`train.EMSAPiecesFunction`).

The rows of G (see `reference`) are independent, so only the instance norm's scale needs all queries: one pass
accumulates sum(G^2) per (image, head) and the unscaled products G @ v, and the whole map's scale
r = (mean(G^2) + eps N'^2)^-1/2 then multiplies the output (A @ v is linear in A, r is one number per map).
With half-precision v (autocast) the products G @ v are taken in fp32, G's dtype (v cast once), and the output
is rounded to v's dtype once, after the scale: one pass in every dtype, and no half-precision rounding of the map.
The elementwise steps run in place: a piece's map stays in cache.
"""
from ..dtypes import autocast_off, compute_dtype
from ..split import split
from .reference import apply_map, deviation_map, in_scale, softmax_map, sum_sq


def query_pieces(q, n_keys, piece):
    """The pieces of EMSA's queries as slices of N: about `piece` entries of the (B, h, N, N') map each."""
    b, h, n, _ = q.shape
    return [p.own for p in split(n, piece, unit=b * h * n_keys)]


def emsa_in_pieces(q, kc, v, weight, scale, eps, pieces, dtype=None):
    """A @ v over the query `pieces`, without autograd.

    Args:
        q (Tensor): queries (B, h, N, d).
        kc (Tensor): centred keys (B, h, N', d), contiguous (a strided view would be copied in every
            piece's matmul).
        v (Tensor): values (B, h, N', d), contiguous.
        weight (Tensor | None): the head-mixing conv's weight (h, h, 1, 1); None: the single-head form.
        scale (float): the logits' scale.
        eps (float): the instance norm's eps.
        pieces (list[slice]): pieces of queries (slices of N).
        dtype (torch.dtype | None): the output's dtype. Default: None (v's).

    Returns:
        tuple[Tensor, Tensor | None]: the output (B, h, N, d) and the IN scale r (B, h, 1, 1) in the compute
        dtype (None for the single-head form).
    """
    n, n_keys = q.shape[2], kc.shape[2]
    out = v.new_empty(q.shape[:3] + v.shape[3:], dtype=dtype)
    with autocast_off(q.device.type):
        if weight is None:
            for p in pieces:
                out[:, :, p] = apply_map(softmax_map(q[:, :, p], kc, scale), v)
            return out, None
        # G @ v in the compute dtype (v cast once), so that r can scale the product afterwards
        cdt = compute_dtype(v)
        vc = v.to(cdt)
        acc = out if out.dtype == cdt else out.new_empty(out.shape, dtype=cdt)
        total = 0
        for p in pieces:
            g = deviation_map(q[:, :, p], kc, scale, weight)
            total = total + sum_sq(g)
            acc[:, :, p] = g @ vc
        r = in_scale(total, n * n_keys, n_keys, eps)
        acc.mul_(r)
        return (acc if acc is out else out.copy_(acc)), r
