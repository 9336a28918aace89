"""The TTT layer's maths as ViT³ writes it (H-ViT³ / ViT³): the oracle every implementation of `ops.ttt` is
tested against (float64, values and gradients).

The fused tokens qkv (B, N, 3C + 3d) = [Q1 | K1 | V1 | Q2 | K2 | V2] of an (H, W) map, N = H W, C = h d. The
keys and values are a training set: each inner model F_W takes one full-batch gradient step on them and the
updated model reads the queries:

    L(W) = -(s / N) sum_i F_W(K_i) . V_i                 dot-product inner loss, s = `scale`
    W* = W - eta g / (||g|| + 1),  g = dL/dW               eta = `lr`; ||.|| per column of W, per 3x3 kernel
    O = F_W*(Q)

* F1, one per head: F_W(x) = (x W1) * SiLU(x W2), W1, W2 (d, d); Q1, K1 rotated by RoPE when `rot` is given;
* F2, one extra head of width d: F_W(x) = DWConv3x3(x; W3), zero padding 1.

Every sample trains its own copy of W. g comes from autograd with create_graph (the authors' way), so the
outer gradient flows through the inner step. Output [O1 (C) | O2 (d)], (B, N, C + d).
"""
import torch
import torch.nn.functional as F

from ..rope import apply_rope


def swiglu(x, w1, w2):
    """F1: (x W1) * SiLU(x W2)."""
    return (x @ w1) * F.silu(x @ w2)


def dwconv3x3(x, w):
    """F2: depth-wise 3x3 conv, zero padding 1, a kernel per sample: x (B, d, H, W), w (B, d, 1, 3, 3)."""
    b, d, h, wd = x.shape
    out = F.conv2d(x.reshape(1, b * d, h, wd), w.reshape(b * d, 1, 3, 3), padding=1, groups=b * d)
    return out.reshape(b, d, h, wd)


def dot_loss(pred, v, scale, n):
    """The inner loss -(s / N) sum F_W(K) . V over n = N tokens (and over samples and heads: each W sees
    only its own terms)."""
    return -(scale / n) * (pred * v).sum()


def normalise(g, dims):
    """The authors' gradient "clip": g / (||g|| + 1), the norm over `dims`."""
    return g / (g.norm(dim=dims, keepdim=True) + 1)


def per_sample(w, b):
    """W repeated for b samples, as a tensor autograd differentiates to (W + 0 with a zero leaf: also when
    W itself needs no gradient)."""
    zero = torch.zeros(b, *w.shape, dtype=w.dtype, device=w.device, requires_grad=True)
    return w + zero


def inner_step(loss, weights, lr, dims):
    """W* = W - lr normalise(g) for each W of `weights`, g = dL/dW."""
    grads = torch.autograd.grad(loss, weights, create_graph=True)
    return [w - lr * normalise(g, dims) for w, g in zip(weights, grads)]


def ttt_core_naive(qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr):
    """Both inner models, from the fused qkv tokens to the output projection's input (`ttt_core`'s signature).

    Args:
        qkv (Tensor): (B, N, 3C + 3d) tokens [Q1 | K1 | V1 | Q2 | K2 | V2], N = H*W.
        rot (Tensor | None): the RoPE table of `rope_tables` (N, C/2) for Q1 and K1, or None.
        w1 (Tensor): W1 (1, h, d, d).
        w2 (Tensor): W2 (1, h, d, d).
        w3 (Tensor): W3, the conv head's kernel (d, 1, 3, 3).
        hw_shape (tuple[int, int]): (H, W).
        num_heads (int): h.
        scale (float): s.
        lr (float): eta.

    Returns:
        Tensor: (B, N, C + d).
    """
    b, n, _ = qkv.shape
    d = w1.shape[-1]
    q1, k1, v1, q2, k2, v2 = qkv.split([num_heads * d] * 3 + [d] * 3, dim=-1)
    if rot is not None:
        q1, k1 = apply_rope(q1, rot), apply_rope(k1, rot)
    q1, k1, v1 = (t.unflatten(-1, (num_heads, d)).transpose(1, 2) for t in (q1, k1, v1))    # (B, h, N, d)
    q2, k2, v2 = (t.transpose(1, 2).unflatten(-1, hw_shape) for t in (q2, k2, v2))          # (B, d, H, W)
    with torch.enable_grad():
        W1, W2, W3 = per_sample(w1[0], b), per_sample(w2[0], b), per_sample(w3, b)
        W1, W2 = inner_step(dot_loss(swiglu(k1, W1, W2), v1, scale, n), (W1, W2), lr, dims=-2)
        (W3,) = inner_step(dot_loss(dwconv3x3(k2, W3), v2, scale, n), (W3,), lr, dims=(-2, -1))
    o1 = swiglu(q1, W1, W2).transpose(1, 2).flatten(2)
    o2 = dwconv3x3(q2, W3).flatten(2).transpose(1, 2)
    return torch.cat([o1, o2], dim=-1)
