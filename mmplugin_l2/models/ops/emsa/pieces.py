"""EMSA's A @ v over pieces of queries, without autograd: the inference path and the forward of the train
path (`train.EMSAPiecesFunction`).

The rows of G (see `reference`) are independent, so only the instance norm's scale needs all queries: one pass
accumulates sum(G^2) per (image, head) and the unscaled products G @ v, and the whole map's scale
r = (mean(G^2) + eps N'^2)^-1/2 then multiplies the output (A @ v is linear in A, r is one number per map).
In half precision a first pass accumulates sum(G^2) and a second applies r to each piece before its cast.
The elementwise steps run in place: a piece's map stays in cache.
"""
from ..dtypes import autocast_off, compute_dtype
from ..split import split
from .reference import apply_map, deviation_map, in_scale, softmax_map, sum_sq


def query_pieces(q, n_keys, piece):
    """The pieces of EMSA's queries as slices of N: about `piece` entries of the (B, h, N, N') map each."""
    b, h, n, _ = q.shape
    return [p.own for p in split(n, piece, unit=b * h * n_keys)]


def emsa_in_pieces(q, kc, v, weight, scale, eps, pieces):
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

    Returns:
        tuple[Tensor, Tensor | None]: the output (B, h, N, d) in v's dtype and the IN scale r (B, h, 1, 1) in
        the compute dtype (None for the single-head form).
    """
    n, n_keys = q.shape[2], kc.shape[2]
    out = v.new_empty(q.shape[:3] + v.shape[3:])
    with autocast_off(q.device.type):
        if weight is None:
            for p in pieces:
                out[:, :, p] = apply_map(softmax_map(q[:, :, p], kc, scale), v)
            return out, None
        one_pass = compute_dtype(v) == v.dtype
        total = 0
        for p in pieces:
            g = deviation_map(q[:, :, p], kc, scale, weight)
            total = total + sum_sq(g)
            if one_pass:
                out[:, :, p] = g @ v
        r = in_scale(total, n * n_keys, n_keys, eps)
        if one_pass:
            return out.mul_(r.to(out.dtype)), r
        for p in pieces:
            out[:, :, p] = apply_map(deviation_map(q[:, :, p], kc, scale, weight), v, r)
    return out, r
