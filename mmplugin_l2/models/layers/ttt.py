"""Test-time-training (TTT) attention of ViT3 / H-ViT3 (Han et al., arXiv 2512.01643).

The keys and values of one image are a tiny training set: an inner model is trained on them with one
full-batch gradient step (inner loss L = -(scale / N) sum(f(k) * v), learning rate `lr`), and the updated
inner model is applied to the queries. Two inner models run side by side:

* simplified SwiGLU, f(x) = (x W1) * SiLU(x W2), one per head (H heads of width d);
* a depth-wise 3x3 conv over one extra "conv head" of width d.

Both gradients are normalised as g / (||g|| + 1). The maths: `ops/ttt/naive.py` (`ttt_core_naive`: the inner
step by autograd, as the paper writes it). Its implementations live in `ops.ttt` (`reference.ttt_core`: whole
maps, export-friendly; `pieces`: inference in pieces of tokens; `train.TTTCore`: closed-form
backward); this module owns the parameters and picks the implementation once per forward (`ops.dispatch`).
"""
import torch
import torch.nn as nn
from mmengine.model.weight_init import trunc_normal_

from ..ops.dispatch import choose, fast_compile_switch
from ..ops.memory import DEFAULT_POLICY
from ..ops.ttt import (TTT, TTTCore, dwconv_inner_grad, dwconv_per_sample, normalize_inner_grad,
                       swiglu_inner_grads, tap_sums, ttt_attention, ttt_core)
from ..ops.tokens import check_token_count

__all__ = ['TTTAttention', 'TTTCore', 'dwconv_inner_grad', 'dwconv_per_sample', 'normalize_inner_grad',
           'swiglu_inner_grads', 'tap_sums', 'ttt_core']


class TTTAttention(nn.Module):
    """TTT layer: tokens x (B, N, C) on an (H, W) map -> (B, N, C).

    [q1 | k1 | v1 | q2 | k2 | v2] = qkv(x), widths C, C, C, d, d, d; q1, k1 optionally rotated by 2-D RoPE
    over the full width C before the head split. Per head, W' = [W1 | W2] - lr * normalise(dL/dW) on
    (k1, v1), y1 = (q1 W1') * SiLU(q1 W2'); per sample, w' = w3 - lr * normalise(dL/dw3) on (k2, v2),
    y2 = dwconv3x3(q2, w'). Output proj([y1 | y2]).

    Args:
        dim (int): C.
        num_heads (int): H SwiGLU heads, d = C / H.
        qkv_bias (bool): bias of qkv. Default: True.
        scale (float): inner-loss scale, 1/3 for both inner models. (The authors' detection/segmentation
            code uses 1/sqrt(32) for the SwiGLU model on the first call of each module only; that
            defect is not reproduced.) Default: 1/3.
        lr (float): inner learning rate. Default: 1.0.
        fast_train (bool): in training, keep only the qkv tokens for backward and recompute the inner
            models there (`TTTCore`); same gradients, far less memory. Default: True.
        fast_compile (bool | Sequence[str]): in training, run the SwiGLU inner models compiled by inductor where
            `ops.ttt.TTT` declares it (`ops.ttt.compiled_core_tokens`, recomputed in backward: keeping the qkv
            tokens as `fast_train`'s checkpoint does, or inside a `with_cp` block by its recomputation; the first
            step compiles); a list of device types (e.g. ['cpu', 'cuda']) runs it on those instead of the declared
            ones (CPU). Default: True.
    """

    #: pieces of tokens; the unit is elements of the (B, tokens, C) input
    memory_policy = DEFAULT_POLICY

    def __init__(self, dim, num_heads, qkv_bias=True, scale=1 / 3, lr=1.0, fast_train=True, fast_compile=True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'dim {dim} is not divisible by num_heads {num_heads}')
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = d = dim // num_heads
        self.scale = scale
        self.lr = lr
        self.fast_train = fast_train
        self.fast_compile = fast_compile_switch(fast_compile, type(self).__name__)
        self.qkv = nn.Linear(dim, dim * 3 + d * 3, bias=qkv_bias)
        self.w1 = nn.Parameter(torch.zeros(1, num_heads, d, d))
        self.w2 = nn.Parameter(torch.zeros(1, num_heads, d, d))
        self.w3 = nn.Parameter(torch.zeros(d, 1, 3, 3))
        for w in (self.w1, self.w2, self.w3):
            trunc_normal_(w, std=.02)
        self.proj = nn.Linear(dim + d, dim)

    def forward(self, x, hw_shape, rope=None):
        """x: (B, N, C); hw_shape: (H, W); rope: None or the table of `rope_tables` (N, C/2)."""
        check_token_count(x.shape[1], hw_shape)
        path = choose(self, x, x.shape[0] * x.shape[1] * self.dim, TTT)
        return ttt_attention(x, self.qkv, self.proj, rope, self.w1, self.w2, self.w3, tuple(hw_shape),
                             self.num_heads, self.scale, self.lr, path)

    def extra_repr(self):
        return f'dim={self.dim}, num_heads={self.num_heads}, scale={self.scale:.4g}'
