"""Test-time-training (TTT) attention of ViT3 / H-ViT3.

The keys and values of one image are a tiny training set: an inner model is trained on them with one
full-batch gradient step (inner loss: negative dot product, learning rate 1), and the updated inner model
is applied to the queries. Two inner models run side by side:

* simplified SwiGLU, f(x) = (x W1) * SiLU(x W2), one per head (H heads of width d, fast weights
  (B, H, d, d));
* a depth-wise 3x3 conv over one extra "conv head" of width d (fast weights (B*d, 1, 3, 3)).

Both gradients are computed in closed form (no autograd inside forward, so the outer gradient flows
through them as ordinary ops) and normalised as g / (||g|| + 1). Cost is linear in the token count N.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model.weight_init import trunc_normal_

from .rope import apply_rope


def normalize_inner_grad(g, dim):
    """The authors' gradient "clip": g / (||g||_2 over `dim` + 1)."""
    return g / (g.norm(dim=dim, keepdim=True) + 1.0)


def swiglu_inner_grads(k, v, w1, w2, scale):
    """Closed-form gradients of L = -(scale/N) * sum(f(k) * v) with f(k) = (k W1) * SiLU(k W2).

    Args:
        k, v: (B, H, N, d) keys and values. w1, w2: (1 or B, H, d, d).
    Returns:
        (g1, g2): (B, H, d, d) normalised gradients w.r.t. W1 and W2.
    """
    z1 = k @ w1
    z2 = k @ w2
    sig = torch.sigmoid(z2)
    e = -v / float(v.shape[2]) * scale                  # dL/df
    kt = k.transpose(-2, -1)
    g1 = kt @ (e * (z2 * sig))                           # df/dz1 = SiLU(z2)
    g2 = kt @ (e * z1 * (sig * (1.0 + z2 * (1.0 - sig))))  # SiLU'(z2) = s (1 + z2 (1 - s))
    return normalize_inner_grad(g1, -2), normalize_inner_grad(g2, -2)


def dwconv_inner_grad(k, v, scale):
    """Closed-form gradient of L = -(scale/(H W)) * sum_c sum_yx (w_c * k_c)(y, x) v_c(y, x) w.r.t. the
    depth-wise 3x3 kernel w (zero padding 1, cross-correlation as F.conv2d).

    Args:
        k, v: (B, d, H, W). Returns: (B*d, 1, 3, 3) normalised gradient (per sample and channel).
    """
    b, c, h, w = k.shape
    e = -v / float(h * w) * scale
    kp = F.pad(k, (1, 1, 1, 1))
    g = torch.stack([(kp[:, :, dy:dy + h, dx:dx + w] * e).sum(dim=(-2, -1))
                     for dy in range(3) for dx in range(3)], dim=-1)
    g = g.reshape(b * c, 1, 3, 3)
    return normalize_inner_grad(g, (-2, -1))


class TTTAttention(nn.Module):
    """TTT layer: tokens (B, N, C) on an (H, W) map -> (B, N, C).

    qkv: Linear(C -> 3C + 3d) split as [q1 C | k1 C | v1 C | q2 d | k2 d | v2 d]; q1/k1 optionally get
    2-D RoPE over the full width C before the head split; proj: Linear(C + d -> C).

    Args:
        dim (int): C. num_heads (int): H SwiGLU heads, d = C / H.
        qkv_bias (bool): bias of qkv. Default: True.
        scale (float): inner-loss scale, 1/3 for both inner models. (The authors' detection/segmentation
            code uses 1/sqrt(32) for the SwiGLU model on the first call of each module only; that
            defect is not reproduced.)
        lr (float): inner learning rate. Default: 1.0.
    """

    def __init__(self, dim, num_heads, qkv_bias=True, scale=1 / 3, lr=1.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'dim {dim} is not divisible by num_heads {num_heads}')
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = d = dim // num_heads
        self.scale = scale
        self.lr = lr
        self.qkv = nn.Linear(dim, dim * 3 + d * 3, bias=qkv_bias)
        self.w1 = nn.Parameter(torch.zeros(1, num_heads, d, d))
        self.w2 = nn.Parameter(torch.zeros(1, num_heads, d, d))
        self.w3 = nn.Parameter(torch.zeros(d, 1, 3, 3))
        for w in (self.w1, self.w2, self.w3):
            trunc_normal_(w, std=.02)
        self.proj = nn.Linear(dim + d, dim)

    def forward(self, x, hw_shape, rope=None):
        """x: (B, N, C); hw_shape: (H, W); rope: None or the (cos, sin) tables of `rope_tables`."""
        b, n, c = x.shape
        h, w = hw_shape
        nh, d = self.num_heads, self.head_dim
        q1, k1, v1, q2, k2, v2 = self.qkv(x).split([c, c, c, d, d, d], dim=-1)
        if rope is not None:
            q1, k1 = apply_rope(q1, *rope), apply_rope(k1, *rope)

        def heads(t):
            return t.reshape(b, n, nh, d).transpose(1, 2)

        def spatial(t):
            return t.transpose(1, 2).reshape(b, d, h, w)

        q1, k1, v1 = heads(q1), heads(k1), heads(v1)
        g1, g2 = swiglu_inner_grads(k1, v1, self.w1, self.w2, self.scale)
        w1, w2 = self.w1 - self.lr * g1, self.w2 - self.lr * g2
        x1 = (q1 @ w1) * F.silu(q1 @ w2)
        x1 = x1.transpose(1, 2).reshape(b, n, c)

        q2, k2, v2 = spatial(q2), spatial(k2), spatial(v2)
        w3 = self.w3.repeat(b, 1, 1, 1) - self.lr * dwconv_inner_grad(k2, v2, self.scale)
        x2 = F.conv2d(q2.reshape(1, b * d, h, w), w3, padding=1, groups=b * d)
        x2 = x2.reshape(b, d, n).transpose(1, 2)
        return self.proj(torch.cat([x1, x2.to(x1.dtype)], dim=-1))

    def extra_repr(self):
        return f'dim={self.dim}, num_heads={self.num_heads}, scale={self.scale:.4g}'
