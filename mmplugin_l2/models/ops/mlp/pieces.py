"""The MLPs at inference (no autograd): exact GELU in place, the residual added into the conv output, and
large maps in pieces (a piece of tokens for `Mlp`, a piece of rows with one halo row each side for
`ConvMlp`), so that the hidden (piece, rC) activations stay in cache. Same values as the whole map: the
tokens (and, with the halo rows, the rows) are independent.

Under autocast the products run as autocast runs them (weights cast to the activations' dtype) and the
output has the dtype the whole-map reference gives.
"""
import torch

from ..split import split
from ..tokens import add_residual, tokens_conv


def gelu_(x):
    """Exact GELU in place (inference only: its backward would need the input)."""
    return torch.ops.aten.gelu_(x)


def linear_into(out, x, w, b):
    """out = x @ w^T + b for 2-D x, written into `out` (a contiguous row slice of a larger tensor). Weights
    of another dtype than x (fp32 weights under autocast) are cast to x's dtype first, as autocast does."""
    if w.dtype != x.dtype:
        w, b = w.to(x.dtype), None if b is None else b.to(x.dtype)
    if b is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(b, x, w.t(), out=out)


def mlp_inference(x, fc1, fc2, piece=None, norm=None):
    """fc2(GELU(fc1(norm(x)))) without autograd, in pieces of about `piece` elements of x (None: whole).

    Args:
        x (Tensor): tokens (..., C).
        fc1 (nn.Linear): C -> rC.
        fc2 (nn.Linear): rC -> C_out.
        piece (int | None): elements of x per piece (a piece of tokens). Default: None.
        norm (nn.Module | None): a pre-norm, applied piece by piece. Default: None.

    Returns:
        Tensor: (..., C_out).
    """
    if piece is None:
        x = x if norm is None else norm(x)
        return fc2(gelu_(fc1(x)))
    c = x.shape[-1]
    x2 = x.reshape(-1, c)
    out2 = None
    for p in split(x2.shape[0], piece, unit=c):
        t = x2[p.own] if norm is None else norm(x2[p.own])
        u = gelu_(fc1(t))
        if out2 is None:
            out2 = u.new_empty(x2.shape[0], fc2.out_features)
        linear_into(out2[p.own], u, fc2.weight, fc2.bias)
    return out2.view(x.shape[:-1] + (fc2.out_features,))


def conv_mlp_inference(x, hw_shape, fc1, dwc, fc2, piece=None):
    """ConvMlp's fc2(GELU(u + dwc(u))), u = GELU(fc1(x)), without autograd, in pieces of rows of about
    `piece` elements of x (None: whole): fc1 and GELU also run on one halo row above and below each piece
    (the 3x3 conv's neighbours), the conv output of the halo rows is dropped.

    Args:
        x (Tensor): tokens (B, N, C) of an (H, W) map.
        hw_shape (tuple[int]): (H, W).
        fc1 (nn.Linear): C -> rC.
        dwc (nn.Conv2d): depth-wise 3x3, padding 1.
        fc2 (nn.Linear): rC -> C_out.
        piece (int | None): elements of x per piece. Default: None.

    Returns:
        Tensor: (B, N, C_out).
    """
    if piece is None:
        u = gelu_(fc1(x))
        return fc2(gelu_(add_residual(tokens_conv(dwc, u, hw_shape), u)))
    b, n, c = x.shape
    h, w = hw_shape
    xm = x.view(b, h, w, c)
    out = None
    for r0, r1, a0, a1 in split(h, piece, unit=b * w * c, halo=1):
        u = gelu_(fc1(xm[:, a0:a1].reshape(b, (a1 - a0) * w, c)))
        y = tokens_conv(dwc, u, (a1 - a0, w)).add_(u)
        y = y.view(b, a1 - a0, w, -1)[:, r0 - a0:r1 - a0]
        y = fc2(gelu_(y.reshape(b, (r1 - r0) * w, -1))).view(b, r1 - r0, w, -1)
        if out is None:
            out = y.new_empty(b, h, w, fc2.out_features)
        out[:, r0:r1] = y
    return out.view(b, n, -1)
