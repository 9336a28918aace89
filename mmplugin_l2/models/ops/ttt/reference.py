"""The TTT core on whole maps, plain autograd: the reference every fast path of `ops.ttt` is tested against.

From the fused qkv tokens (B, N, 3C + 3d) = [q1 C | k1 C | v1 C | q2 d | k2 d | v2 d] of an (H, W) map, H heads
of width d (C = H d), the keys and values are a tiny training set: each inner model takes one full-batch
gradient step on them (inner loss L = -(scale / N) sum(f(k) * v), learning rate `lr`), and the updated model
is applied to the queries:

* SwiGLU, one per head: f(x) = (x W1) * SiLU(x W2), W1, W2 (1, H, d, d); q1, k1 optionally rotated by RoPE;
* a depth-wise 3x3 conv over one extra "conv head" of width d: f(x) = conv(x, w3), w3 (d, 1, 3, 3), zero
  padding 1, one updated kernel per sample.

Both inner gradients g are written in closed form (no autograd inside, so the outer gradient flows through
them as ordinary ops) and normalised as g / (||g|| + 1) (per column of W, per 3x3 kernel). The output is
[SwiGLU heads C | conv head d] (B, N, C + d). Cost is linear in N.

Precision: the sums over all N tokens (k^T a, the conv taps) run in fp32 for fp16 maps or under fp16
autocast (they exceed fp16's range at detection sizes); bf16 has fp32's range.

The helpers are shared with the fast paths (`pieces`, `train`). Export (`ops.export.exporting`): sizes stay
symbolic (no Python float of N, no grouped conv whose group count is the batch size); the per-sample
depth-wise conv and its kernel gradient are then nine shifted multiply-adds instead of one grouped conv
(`tap_sums`, `dwconv_per_sample`).
"""
import torch
import torch.nn.functional as F

from ..dtypes import HALF_DTYPES, autocast_off, autocasts_to
from ..export import exporting
from ..rope import apply_rope
from .step import loss_factor, normalise, silu_grad, update

#: the authors' gradient "clip" g / (||g|| + 1) (`step.normalise`), under its public name
normalize_inner_grad = normalise


def heads(t, num_heads):
    """(B, N, H*d) tokens -> (B, H, N, d) per-head view (reshape: traced sizes stay symbolic)."""
    return t.reshape(t.shape[0], t.shape[1], num_heads, -1).transpose(1, 2)


def token_sum_matmul(kt, a):
    """kt @ a, a sum over all N tokens (kt (..., d, N), a (..., N, 2d)). In fp16 (autocast or half
    weights) the sum can exceed fp16's range (65504) at detection sizes, so it runs in fp32 with autocast
    off; bf16 has fp32's range and stays as it is."""
    if torch.float16 not in (kt.dtype, a.dtype) and not autocasts_to(kt, torch.float16):
        return kt @ a
    with autocast_off(kt.device.type):
        return kt.float() @ a.float()


def fast_weights(w12, k):
    """[W1 | W2] in the dtype of the matmuls with k: fp32 after RoPE (which returns fp32) on half
    weights; unchanged under autocast (fp32 weights) and in fp32 / fp64."""
    return w12.to(torch.promote_types(w12.dtype, k.dtype))


def swiglu_dz(z, v, fused):
    """[dL/dz1 | dL/dz2] up to the factor -scale/N, for z = k [W1 | W2] (..., N, 2d) and values v (..., N, d).
    `fused=True` (no autograd needed) computes v * z1 * SiLU'(z2) in one kernel."""
    z1, z2 = z.split(v.shape[-1], dim=-1)   # split, not slices: its backward is one cat, no zero-filled maps
    if fused:
        a2 = torch.ops.aten.silu_backward(v * z1, z2)
    else:
        a2 = v * z1 * silu_grad(z2, torch.sigmoid(z2))
    return torch.cat([v * F.silu(z2), a2], dim=-1)


def swiglu_grad_pair(k, v, w12, scale, fused=False):
    """[g1 | g2] (B, H, d, 2d) of L = -(scale/N) sum((k W1) * SiLU(k W2) * v), w12 = [W1 | W2], unnormalised."""
    a = swiglu_dz(k @ w12, v, fused)
    return token_sum_matmul(k.transpose(-2, -1), a) * loss_factor(scale, k.shape[-2])


def swiglu_readout(z, out=None):
    """The updated SwiGLU model's output (z W1') * SiLU(z W2') from z = q [W1' | W2'] (..., 2d)."""
    z1, z2 = z.chunk(2, dim=-1)
    return torch.mul(z1, F.silu(z2), out=out)


def swiglu_inner_grads(k, v, w1, w2, scale, fused=False):
    """Closed-form gradients of L = -(scale/N) * sum(f(k) * v) with f(k) = (k W1) * SiLU(k W2).

    Args:
        k (Tensor): keys (B, H, N, d).
        v (Tensor): values (B, H, N, d).
        w1 (Tensor): W1 (1 or B, H, d, d).
        w2 (Tensor): W2 (1 or B, H, d, d).
        scale (float): the inner loss's scale.
        fused (bool): SiLU' as one kernel without an autograd formula (`aten.silu_backward`). Default: False.

    Returns:
        tuple[Tensor, Tensor]: (g1, g2), (B, H, d, d) normalised gradients w.r.t. W1 and W2 (the norm is per
        column, so the two halves are normalised together).
    """
    g = swiglu_grad_pair(k, v, torch.cat([w1, w2], dim=-1), scale, fused=fused)
    return normalise(g, -2).chunk(2, dim=-1)


def _tap(i):
    """Rows / columns i .. i + size of a map zero-padded by one on both sides, without naming the size."""
    return slice(i, i - 2 or None)


def fold_batch(x):
    """(B, H, W, d) channels-last map -> (1, B*d, H, W) in channels-last memory: the batch folded into the
    channels, so that a depth-wise conv with one kernel per sample is one grouped conv (B*d groups)."""
    b, h, w, d = x.shape
    return x.permute(1, 2, 0, 3).reshape(1, h, w, b * d).permute(0, 3, 1, 2) \
        .contiguous(memory_format=torch.channels_last)


def tap_sums(k, v):
    """sum_yx k(y + dy - 1, x + dx - 1) v(y, x) per sample and channel for the nine taps (dy, dx) of a 3x3
    kernel (k zero-padded by one): the gradient of sum(conv(k, w) * v) w.r.t. a depth-wise kernel w.

    One weight-gradient kernel of a grouped conv, the batch folded into the groups; while exporting or traced
    by `torch.jit.trace` (the FLOPs counter; its tracer cannot record that kernel), nine shifted products (a
    traced graph keeps the batch size symbolic).

    Args:
        k (Tensor): (B, H, W, d) channels-last map (strided views are fine).
        v (Tensor): (B, H, W, d) channels-last map.

    Returns:
        Tensor: (B, d, 9), taps in row-major 3x3 order; fp32 for fp16 / bf16 maps (sums over H*W).
    """
    acc = torch.float32 if k.dtype in HALF_DTYPES or v.dtype in HALF_DTYPES else None
    if exporting() or torch.jit.is_tracing():
        kp = F.pad(k, (0, 0, 1, 1, 1, 1))
        return torch.stack([(kp[:, _tap(dy), _tap(dx)] * v).sum(dim=(1, 2), dtype=acc)
                            for dy in range(3) for dx in range(3)], dim=-1)
    b, _, _, d = k.shape
    if acc is not None:
        k, v = k.to(acc), v.to(acc)
    with autocast_off(k.device.type):
        g = torch.nn.grad.conv2d_weight(fold_batch(k), (b * d, 1, 3, 3), fold_batch(v), padding=1, groups=b * d)
    return g.reshape(b, d, 9)


def dwconv_per_sample(x, weight):
    """Depth-wise 3x3 conv (zero padding 1, cross-correlation as F.conv2d) with a different kernel per sample.

    One grouped conv, the batch folded into the groups; while exporting, nine shifted multiply-adds.

    Args:
        x (Tensor): (B, H, W, d) channels-last map.
        weight (Tensor): (B*d, 1, 3, 3) kernels, sample-major.

    Returns:
        Tensor: (B, H*W, d) tokens.
    """
    b, h, w, d = x.shape
    if exporting():
        xp = F.pad(x, (0, 0, 1, 1, 1, 1))
        taps = weight.reshape(-1, d, 9).transpose(1, 2).unsqueeze(2).unsqueeze(2)     # (B, 9, 1, 1, d)
        out = None
        for t in range(9):
            term = xp[:, _tap(t // 3), _tap(t % 3)] * taps[:, t]
            out = term if out is None else out + term
        return out.flatten(1, 2)
    out = F.conv2d(fold_batch(x), weight.to(memory_format=torch.channels_last), padding=1, groups=b * d)
    return out.permute(0, 2, 3, 1).reshape(h * w, b, d).transpose(0, 1)


def conv_grad(k, v, scale):
    """Closed-form gradient of L = -(scale/(H W)) * sum_c sum_yx (w_c * k_c)(y, x) v_c(y, x) w.r.t. the
    depth-wise 3x3 kernel w (zero padding 1, cross-correlation as F.conv2d), before normalising.

    Args:
        k (Tensor): keys, (B, H, W, d) channels-last map (strided views are fine).
        v (Tensor): values, (B, H, W, d) channels-last map.
        scale (float): the inner loss's scale.

    Returns:
        Tensor: (B, d, 9) per sample and channel, taps in row-major 3x3 order; fp32 for fp16 / bf16 maps.
    """
    h, w = k.shape[1:3]
    return tap_sums(k, v) * loss_factor(scale, h * w)


def dwconv_inner_grad(k, v, scale):
    """`conv_grad` normalised per sample and channel, as a (B*d, 1, 3, 3) kernel (the arguments of
    `conv_grad`)."""
    return normalise(conv_grad(k, v, scale).reshape(-1, 1, 3, 3), (-2, -1))


def conv_head(q2, k2, v2, w3, scale, lr):
    """The depth-wise 3x3 inner model: one gradient step on (k2, v2), applied to q2.

    Args:
        q2 (Tensor): queries, (B, H, W, d) channels-last map.
        k2 (Tensor): keys, (B, H, W, d).
        v2 (Tensor): values, (B, H, W, d).
        w3 (Tensor): the initial kernel (d, 1, 3, 3).
        scale (float): the inner loss's scale.
        lr (float): the inner learning rate.

    Returns:
        Tensor: (B, H*W, d) tokens.
    """
    d = q2.shape[-1]
    w = update(w3.reshape(1, d, 9), conv_grad(k2, v2, scale), lr, -1)
    return dwconv_per_sample(q2, w.reshape(-1, 1, 3, 3))


def split_qkv(qkv, num_heads, d):
    """(B, N, 3C + 3d) -> q1, k1, v1 (B, N, C) and q2, k2, v2 (B, N, d) views."""
    c = num_heads * d
    return qkv.split([c, c, c, d, d, d], dim=-1)


def swiglu_heads(qkv, rot, w1, w2, num_heads, scale, lr, fused=False):
    """The SwiGLU inner models of `ttt_core`, one per head: a gradient step on (k1, v1), applied to q1.

    Args:
        qkv (Tensor): (B, N, 3C + 3d) tokens [q1 | k1 | v1 | q2 | k2 | v2] (the conv head's channels unused).
        rot (Tensor | tuple | None): the RoPE table of `rope_tables` (N, C/2) for q1 and k1, or None.
        w1 (Tensor): SwiGLU W1 (1, H, d, d).
        w2 (Tensor): SwiGLU W2 (1, H, d, d).
        num_heads (int): SwiGLU heads H.
        scale (float): the inner loss's scale.
        lr (float): the inner learning rate.
        fused (bool): SiLU' as one kernel without an autograd formula (nothing records autograd). Default: False.

    Returns:
        Tensor: (B, N, C).
    """
    d = w1.shape[-1]
    q1, k1, v1 = split_qkv(qkv, num_heads, d)[:3]
    if rot is not None:
        q1, k1 = apply_rope(q1, rot), apply_rope(k1, rot)
    q1, k1, v1 = (heads(t, num_heads) for t in (q1, k1, v1))
    return swiglu_step_readout(q1, k1, v1, torch.cat([w1, w2], dim=-1), scale, lr, fused)


def swiglu_step_readout(q1, k1, v1, w12, scale, lr, fused=False):
    """The SwiGLU heads' inner step on (k1, v1) and read-out of q1, from per-head (B, H, N, d) maps (q1, k1 rotated)
    and [W1 | W2] (1, H, d, 2d): tokens (B, N, H d)."""
    b, num_heads, n, d = q1.shape
    w12 = fast_weights(w12, k1)
    w12 = update(w12, swiglu_grad_pair(k1, v1, w12, scale, fused), lr, -2)
    return swiglu_readout(q1 @ w12).transpose(1, 2).reshape(b, n, num_heads * d)


def conv_head_tokens(qkv, w3, hw_shape, num_heads, scale, lr):
    """The conv-head inner model of `ttt_core` (`conv_head`) on its channels of the fused qkv tokens
    (B, N, 3C + 3d), [q2 | k2 | v2] (the last 3d): (B, N, d) tokens (the arguments of `ttt_core`)."""
    b = qkv.shape[0]
    h, w = hw_shape
    d = w3.shape[0]
    q2, k2, v2 = split_qkv(qkv, num_heads, d)[3:]
    return conv_head(*(t.reshape(b, h, w, d) for t in (q2, k2, v2)), w3, scale, lr)


def join_heads(y1, y2):
    """[SwiGLU heads | conv head] (B, N, C + d), in the SwiGLU heads' dtype."""
    return torch.cat([y1, y2.to(y1.dtype)], dim=-1)


def ttt_core(qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, fused=False):
    """Both inner models, from the fused qkv tokens to the output projection's input.

    Args:
        qkv (Tensor): (B, N, 3C + 3d) tokens [q1 | k1 | v1 | q2 | k2 | v2], N = H*W.
        rot (Tensor | tuple | None): the RoPE table of `rope_tables` (N, C/2) for q1 and k1, or None.
        w1 (Tensor): SwiGLU W1 (1, H, d, d).
        w2 (Tensor): SwiGLU W2 (1, H, d, d).
        w3 (Tensor): conv-head kernel (d, 1, 3, 3).
        hw_shape (tuple[int, int]): the map's (H, W).
        num_heads (int): SwiGLU heads H.
        scale (float): the inner loss's scale.
        lr (float): the inner learning rate.
        fused (bool): SiLU' as one kernel without an autograd formula (nothing records autograd). Default: False.

    Returns:
        Tensor: (B, N, C + d) [SwiGLU heads | conv head].
    """
    return join_heads(swiglu_heads(qkv, rot, w1, w2, num_heads, scale, lr, fused),
                      conv_head_tokens(qkv, w3, hw_shape, num_heads, scale, lr))
