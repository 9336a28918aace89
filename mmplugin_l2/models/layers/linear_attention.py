"""L2ViT's linear attention (LGA, "Linear Global Attention"). Its Local Concentration Module is in `lcm.py`.

Per head h, with q, k, v (N, d) from one Linear(C, 3C) of the tokens (B, N, C):

    Q = ReLU(q), K = ReLU(k)                                   (kernel feature map; V stays raw)
    out_i = Q_i (K^T V) t_h / max(Q_i . sum_j K_j, 100)

then the heads merged and projected, Linear(C, C): (B, N, C) in, (B, N, C) out. The maths:
`ops/linear_attention/naive.py` (`linear_attention_naive`: the N x N attention matrix written out).

* t_h is the learnable per-head multiplier `temperature` (heads, 1, 1), initialised to d^-0.5; it scales
  K^T V only, not the denominator (the paper's "s" is its reciprocal).
* The denominator is clamped from below at 100, per head and query, with no eps and no upper bound (the
  authors' `torch.clamp(q @ k.sum, 1e2)`); the clamp is active in practice on small late-stage maps.
* K^T V and the denominator are sums over all N tokens; under fp16 autocast they overflow at detection sizes,
  so that part runs in float32 with autocast off (`fp32_reduce=True`, the default; a no-op in fp32). The
  authors train in fp32 only and have no such guard.

The op is `ops.linear_attention` (reference, closed-form training backward, inference in pieces of tokens),
chosen once per forward by `ops.dispatch.choose`.
"""
import torch
import torch.nn as nn

from ..ops import choose
from ..ops.linear_attention import (LINEAR_ATTENTION, LINEAR_ATTENTION_HALF_SUMS, LinearAttentionCore,  # noqa: F401
                                    linear_attention)
from ..ops.memory import DEFAULT_POLICY


class LinearAttention(nn.Module):
    """ReLU linear attention with a per-head learnable multiplier on K^T V and a clamped denominator.

    Args:
        dim (int): channels C.
        num_heads (int): heads (head_dim d = C / heads).
        qkv_bias (bool): bias of `qkv`. Default: True (what L2ViT's LGA block passes).
        clamp_min (float): lower bound of the denominator. Default: 100 (the authors' 1e2).
        fp32_reduce (bool): compute K^T V, the denominator and the division in float32 with autocast off.
            Default: True.

    forward(x, norm=None): x (B, N, C) -> (B, N, C); with `norm`, attention(norm(x)).
    """

    #: pieces of tokens x channels (the batch included) at inference
    memory_policy = DEFAULT_POLICY
    #: the fast training path: the closed-form backward `LinearAttentionCore` (keeps only Q, K, v; nothing is
    #: recomputed); False: plain autograd
    fast_train = True

    def __init__(self, dim, num_heads, qkv_bias=True, clamp_min=100., fp32_reduce=True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'LinearAttention: dim {dim} is not divisible by num_heads {num_heads}')
        self.num_heads = num_heads
        self.clamp_min = clamp_min
        self.fp32_reduce = fp32_reduce
        self.temperature = nn.Parameter(torch.full((num_heads, 1, 1), (dim // num_heads) ** -0.5))
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, norm=None):
        path = choose(self, x, x.numel(), LINEAR_ATTENTION if self.fp32_reduce else LINEAR_ATTENTION_HALF_SUMS)
        return linear_attention(path, x, self.qkv, self.proj, self.temperature, self.num_heads, self.clamp_min,
                                self.fp32_reduce, norm)
