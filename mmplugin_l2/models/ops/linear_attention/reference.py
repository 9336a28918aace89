"""L2ViT's linear attention on whole maps, plain autograd, the authors' order of operations: the reference
every fast path is tested against.

Per head, with q, k, v (N, d), Q = ReLU(q), K = ReLU(k), the per-head multiplier t and the clamp c:

    out_i = Q_i (K^T V) t / max(Q_i . sum_j K_j, c)

computed as the authors do: the denominator Q (sum_j K_j), K^T V times t, Q times that, divided.
"""
import contextlib

import torch

from ..dtypes import autocast_off


def fp32_reduce_context(x, fp32_reduce):
    """Whether the sums over the tokens run in float32 for `x`, and the context they run in (autocast off
    on x's device when they do; a no-op in float64)."""
    fp32 = fp32_reduce and x.dtype != torch.float64
    return fp32, (autocast_off(x.device.type) if fp32 else contextlib.nullcontext())


def linear_attention_reference(q, k, v, temperature, clamp_min=100.):
    """The linear attention from q, k, v before the feature map.

    Args:
        q (Tensor): queries (B, heads, N, d).
        k (Tensor): keys (B, heads, N, d).
        v (Tensor): values (B, heads, N, d).
        temperature (Tensor): the per-head multiplier t of K^T V, (heads, 1, 1).
        clamp_min (float): lower bound c of the denominator. Default: 100.

    Returns:
        Tensor: (B, heads, N, d).
    """
    q, k = q.relu(), k.relu()
    denom = torch.clamp(q @ k.transpose(-2, -1).sum(dim=-1, keepdim=True), min=clamp_min)
    kv = (k.transpose(-2, -1) @ v) * temperature
    return (q @ kv) / denom
