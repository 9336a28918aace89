"""Test-time-training (TTT) attention of ViT3 / H-ViT3.

The keys and values of one image are a tiny training set: an inner model is trained on them with one
full-batch gradient step (inner loss: negative dot product, learning rate 1), and the updated inner model
is applied to the queries. Two inner models run side by side:

* simplified SwiGLU, f(x) = (x W1) * SiLU(x W2), one per head (H heads of width d, fast weights
  (B, H, d, d));
* a depth-wise 3x3 conv over one extra "conv head" of width d (fast weights (B*d, 1, 3, 3)).

Both gradients are computed in closed form (no autograd inside forward, so the outer gradient flows
through them as ordinary ops) and normalised as g / (||g|| + 1). Cost is linear in the token count N.

Speed and memory (same maths as the authors' code, outputs equal to rounding):
* W1 and W2 are applied as one (d, 2d) matrix, and both inner gradients come from one k^T [a1 | a2]
  product; without autograd the SwiGLU derivative is one fused kernel (`aten.silu_backward`);
* the conv head works on channels-last (B, H, W, d) maps: its gradient is 9 shifted dot products over
  contiguous rows, its per-sample depth-wise conv runs with a channels-last kernel;
* in training, `TTTCore` (an autograd Function) keeps only the fused qkv tensor for backward and
  recomputes the inner-model intermediates there, instead of storing ~10 (B, N, C) temporaries per block.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model.weight_init import trunc_normal_

from .dtypes import HALF_DTYPES, autocast_off, autocast_on, autocasts_to
from .export import eager_inference, exporting
from .memory import DEFAULT_POLICY, inference, recomputes
from .rope import apply_rope
from .tokens import check_token_count


def normalize_inner_grad(g, dim):
    """The authors' gradient "clip": g / (||g||_2 over `dim` + 1)."""
    return g / (g.norm(dim=dim, keepdim=True) + 1.0)


def _swiglu_dz(z, v, fused):
    """[dL/dz1 | dL/dz2] up to the factor -scale/N, for z = k [W1 | W2] (..., 2d) and values v (..., d).
    `fused=True` (no autograd needed) computes v * z1 * SiLU'(z2) in one kernel."""
    z1, z2 = z.split(v.shape[-1], dim=-1)   # split, not slices: its backward is one cat, no zero-filled maps
    if fused:
        a2 = torch.ops.aten.silu_backward(v * z1, z2)
    else:
        sig = torch.sigmoid(z2)
        a2 = v * z1 * (sig * (1.0 + z2 * (1.0 - sig)))   # SiLU'(z2) = s (1 + z2 (1 - s))
    return torch.cat([v * F.silu(z2), a2], dim=-1)


def _normalized_swiglu_grad(kta, n, scale):
    """k^T [a1 | a2] summed over n tokens -> normalised [g1 | g2]; the norm over dim -2 is per column, so
    both halves are normalised in one go."""
    if exporting():   # n may be a traced size: divide by it in the graph instead of baking 1/n in
        return normalize_inner_grad(kta * -scale / n, -2)
    return normalize_inner_grad(kta * (-scale / float(n)), -2)


def _swiglu_grad_pair(k, v, w12, scale, fused):
    """Normalised [g1 | g2] (B, H, d, 2d) of L = -(scale/N) sum((k W1) * SiLU(k W2) * v), w12 = [W1 | W2]."""
    a = _swiglu_dz(k @ w12, v, fused)
    return _normalized_swiglu_grad(token_sum_matmul(k.transpose(-2, -1), a), k.shape[-2], scale)


def token_sum_matmul(kt, a):
    """kt @ a, a sum over all N tokens (kt (..., d, N), a (..., N, 2d)). In fp16 (autocast or half
    weights) the sum can exceed fp16's range (65504) at detection sizes, so it runs in fp32 with autocast
    off; bf16 has fp32's range and stays as it is."""
    if torch.float16 not in (kt.dtype, a.dtype) and not autocasts_to(kt, torch.float16):
        return kt @ a
    with autocast_off(kt.device.type):
        return kt.float() @ a.float()


def _fast_weights(w12, k):
    """[W1 | W2] in the dtype of the matmuls with k: fp32 after RoPE (which returns fp32) on half
    weights; unchanged under autocast (fp32 weights) and in fp32 / fp64."""
    return w12.to(torch.promote_types(w12.dtype, k.dtype))


def _heads(t, num_heads):
    """(B, N, H*d) tokens -> (B, H, N, d) per-head view."""
    if exporting():   # the ONNX tracer bakes the sizes of an `unflatten` output in; reshape keeps them symbolic
        return t.reshape(t.shape[0], t.shape[1], num_heads, -1).transpose(1, 2)
    return t.unflatten(-1, (num_heads, -1)).transpose(1, 2)


def _swiglu_readout(z, out=None):
    """The updated SwiGLU model's output (z W1') * SiLU(z W2') from z = q [W1' | W2'] (..., 2d)."""
    z1, z2 = z.chunk(2, dim=-1)
    return torch.mul(z1, F.silu(z2), out=out)


def _conv_head(q2, k2, v2, w3, scale, lr):
    """The depth-wise 3x3 inner model: one gradient step on (k2, v2), applied to q2; maps (B, H, W, d)
    channels-last -> tokens (B, H*W, d)."""
    if exporting():   # no loop over the batch: one graph for every batch size
        d = q2.shape[-1]
        w3 = w3.reshape(1, d, 9) - lr * dwconv_inner_grad(k2, v2, scale).to(w3.dtype).reshape(-1, d, 9)
        return _dwconv_taps(q2, w3)
    w3 = w3.repeat(q2.shape[0], 1, 1, 1) - lr * dwconv_inner_grad(k2, v2, scale).to(w3.dtype)
    return dwconv_per_sample(q2, w3)


def swiglu_inner_grads(k, v, w1, w2, scale):
    """Closed-form gradients of L = -(scale/N) * sum(f(k) * v) with f(k) = (k W1) * SiLU(k W2).

    Args:
        k, v: (B, H, N, d) keys and values. w1, w2: (1 or B, H, d, d).
    Returns:
        (g1, g2): (B, H, d, d) normalised gradients w.r.t. W1 and W2.
    """
    g = _swiglu_grad_pair(k, v, torch.cat([w1, w2], dim=-1), scale, fused=eager_inference())  # no autograd
    return g.chunk(2, dim=-1)


def dwconv_inner_grad(k, v, scale):
    """Closed-form gradient of L = -(scale/(H W)) * sum_c sum_yx (w_c * k_c)(y, x) v_c(y, x) w.r.t. the
    depth-wise 3x3 kernel w (zero padding 1, cross-correlation as F.conv2d).

    Args:
        k, v: (B, H, W, d) channels-last maps (strided views are fine).
    Returns:
        (B*d, 1, 3, 3) normalised gradient (per sample and channel); fp32 for fp16 / bf16 maps.
    """
    b, h, w, c = k.shape
    kp = F.pad(k, (0, 0, 1, 1, 1, 1))
    acc = torch.float32 if k.dtype in HALF_DTYPES else None  # fp16 range: sums over H*W
    if exporting():   # traced sizes stay in the graph (no Python float of H*W, no slice ends from H, W)
        g = torch.stack([(kp[:, _tap(dy), _tap(dx)] * v).sum(dim=(1, 2), dtype=acc)
                         for dy in range(3) for dx in range(3)], dim=-1)
        return normalize_inner_grad((g * -scale / (h * w)).reshape(-1, 1, 3, 3), (-2, -1))
    g = torch.stack([(kp[:, dy:dy + h, dx:dx + w] * v).sum(dim=(1, 2), dtype=acc)
                     for dy in range(3) for dx in range(3)], dim=-1)
    g = (g * (-scale / float(h * w))).reshape(b * c, 1, 3, 3)
    return normalize_inner_grad(g, (-2, -1))


def _tap(i):
    """Rows / columns i .. i + size of a map zero-padded by one on both sides, without naming the size."""
    return slice(i, i - 2 or None)


def _dwconv_taps(x, weight):
    """`dwconv_per_sample` as nine shifted multiply-adds (export mode: no loop over the batch, whose size
    a tracer would bake in). x: (B, H, W, d) channels-last map; weight: (B, d, 9), taps in row-major
    3x3 order. Returns (B, H*W, d) tokens."""
    xp = F.pad(x, (0, 0, 1, 1, 1, 1))
    taps = weight.transpose(1, 2).unsqueeze(2).unsqueeze(2)       # (B, 9, 1, 1, d)
    out = None
    for t in range(9):
        term = xp[:, _tap(t // 3), _tap(t % 3)] * taps[:, t]
        out = term if out is None else out + term
    return out.flatten(1, 2)


def dwconv_per_sample(x, weight):
    """Depth-wise 3x3 conv (padding 1) with a different kernel per sample.

    Args:
        x: (B, H, W, d) channels-last map. weight: (B*d, 1, 3, 3).
    Returns:
        (B, H*W, d) tokens.
    """
    b, h, w, d = x.shape
    x = x.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    weight = weight.to(memory_format=torch.channels_last)
    outs = [F.conv2d(x[i:i + 1], weight[i * d:(i + 1) * d], padding=1, groups=d) for i in range(b)]
    out = outs[0] if b == 1 else torch.cat(outs)
    return out.permute(0, 2, 3, 1).reshape(b, h * w, d)


def ttt_core(qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, fused=False):
    """Both inner models from the fused qkv tokens (B, N, 3C + 3d) to the proj input (B, N, C + d).

    `rot` is the complex RoPE table (N, C/2) or None. `fused=True` takes kernels that have no autograd
    formula (inference, or the forward of `TTTCore`)."""
    b, n, _ = qkv.shape
    h, w = hw_shape
    d = w1.shape[-1]
    c = num_heads * d
    q1, k1, v1, q2, k2, v2 = qkv.split([c, c, c, d, d, d], dim=-1)
    if rot is not None:
        q1, k1 = apply_rope(q1, rot), apply_rope(k1, rot)

    q1, k1, v1 = (_heads(t, num_heads) for t in (q1, k1, v1))
    w12 = _fast_weights(torch.cat([w1, w2], dim=-1), k1)
    w12 = w12 - (lr * _swiglu_grad_pair(k1, v1, w12, scale, fused)).to(w12.dtype)
    x1 = _swiglu_readout(q1 @ w12).transpose(1, 2).reshape(b, n, c)
    if exporting():   # reshape, not unflatten: see `_heads`
        x2 = _conv_head(*(t.reshape(b, h, w, d) for t in (q2, k2, v2)), w3, scale, lr)
    else:
        x2 = _conv_head(*(t.unflatten(1, (h, w)) for t in (q2, k2, v2)), w3, scale, lr)
    return torch.cat([x1, x2.to(x1.dtype)], dim=-1)


def ttt_inference(x, qkv, proj, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, piece=None):
    """The whole TTT layer without autograd, tokens (B, N, C) -> (B, N, C), in chunks of `piece` / (B C)
    tokens (None: one chunk), so that no (B, N, >= C) temporary is built except the output.

    Pass 1, chunk by chunk: the k1 | v1 | q2 | k2 | v2 columns of `qkv` (one contiguous block of its
    weight rows), RoPE on k1, and k1^T [a1 | a2] of the SwiGLU inner gradient, summed over the chunks;
    the three d-wide conv-head maps are kept. Then the conv head (whole map, d channels). Pass 2, chunk by
    chunk: the q1 columns, RoPE, the updated SwiGLU model, the conv-head output and `proj`. Every linear
    weight row is applied once, as in `ttt_core`; the values equal it up to the summation order of
    k^T a over the chunks (~1e-7 relative)."""
    b, n, _ = x.shape
    h, w = hw_shape
    d = w1.shape[-1]
    c = num_heads * d
    step = n if piece is None else max(1, piece // (b * c))
    wq, wrest = qkv.weight[:c], qkv.weight[c:]
    bq, brest = (None, None) if qkv.bias is None else (qkv.bias[:c], qkv.bias[c:])

    def rope(t, i):
        return apply_rope(t, rot[i:i + step]) if rot is not None else t

    w12 = torch.cat([w1, w2], dim=-1)
    conv_head = None
    g = None
    for i in range(0, n, step):
        kv = F.linear(x[:, i:i + step], wrest, brest)
        if conv_head is None:
            conv_head = kv.new_empty(b, n, 3 * d)
        conv_head[:, i:i + step] = kv[..., 2 * c:]
        k1, v1 = _heads(rope(kv[..., :c], i), num_heads), _heads(kv[..., c:2 * c], num_heads)
        if i == 0:
            w12 = _fast_weights(w12, k1)
        part = token_sum_matmul(k1.transpose(-2, -1), _swiglu_dz(k1 @ w12, v1, fused=True))
        g = part if g is None else g.add_(part)
    w12 = w12 - (lr * _normalized_swiglu_grad(g, n, scale)).to(w12.dtype)

    x2 = _conv_head(*conv_head.unflatten(1, (h, w)).split([d, d, d], dim=-1), w3, scale, lr)
    del conv_head

    out = None
    for i in range(0, n, step):
        z = _heads(rope(F.linear(x[:, i:i + step], wq, bq), i), num_heads) @ w12
        y = z.new_empty(b, z.shape[2], c + d)
        _swiglu_readout(z, out=_heads(y[..., :c], num_heads))
        y[..., c:] = x2[:, i:i + step]
        y = proj(y.to(proj.weight.dtype))
        if out is None:
            out = y.new_empty(b, n, y.shape[-1])
        out[:, i:i + step] = y
    return out


class TTTCore(torch.autograd.Function):
    """`ttt_core` that saves only its inputs and recomputes the inner models in backward."""

    @staticmethod
    def forward(ctx, qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr):
        dev = qkv.device.type
        on = autocast_on(dev)
        ctx.autocast = (dev, on, torch.get_autocast_dtype(dev) if on else None)
        ctx.args = (hw_shape, num_heads, scale, lr)
        ctx.rot = rot
        ctx.save_for_backward(qkv, w1, w2, w3)
        return ttt_core(qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, fused=True)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        needs = [ctx.needs_input_grad[i] for i in (0, 2, 3, 4)]
        inputs = [t.detach().requires_grad_(r) for t, r in zip(saved, needs)]
        dev, enabled, dtype = ctx.autocast
        amp = torch.autocast(dev, enabled=True, dtype=dtype) if enabled else autocast_off(dev)
        with torch.enable_grad(), amp:
            out = ttt_core(inputs[0], ctx.rot, *inputs[1:], *ctx.args)
        wrt = [t for t, r in zip(inputs, needs) if r]
        grads = iter(torch.autograd.grad(out, wrt, grad_out)) if wrt else iter(())
        g = [next(grads) if r else None for r in needs]
        return g[0], None, g[1], g[2], g[3], None, None, None, None


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
        recompute (bool): in training, keep only the qkv tokens for backward and recompute the inner
            models there (`TTTCore`); same gradients, far less memory. Default: True.
    """

    def __init__(self, dim, num_heads, qkv_bias=True, scale=1 / 3, lr=1.0, recompute=True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'dim {dim} is not divisible by num_heads {num_heads}')
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = d = dim // num_heads
        self.scale = scale
        self.lr = lr
        self.recompute = recompute
        self.qkv = nn.Linear(dim, dim * 3 + d * 3, bias=qkv_bias)
        self.w1 = nn.Parameter(torch.zeros(1, num_heads, d, d))
        self.w2 = nn.Parameter(torch.zeros(1, num_heads, d, d))
        self.w3 = nn.Parameter(torch.zeros(d, 1, 3, 3))
        for w in (self.w1, self.w2, self.w3):
            trunc_normal_(w, std=.02)
        self.proj = nn.Linear(dim + d, dim)

    #: inference in token chunks (the (B, chunk, C) tokens are the piece)
    memory_policy = DEFAULT_POLICY

    def forward(self, x, hw_shape, rope=None):
        """x: (B, N, C); hw_shape: (H, W); rope: None or the complex table of `rope_tables`."""
        check_token_count(x.shape[1], hw_shape)
        if inference(self):
            piece = self.memory_policy.pieces(self, x, x.shape[0] * x.shape[1] * self.dim)
            return ttt_inference(x, self.qkv, self.proj, rope, self.w1, self.w2, self.w3, tuple(hw_shape),
                                 self.num_heads, self.scale, self.lr, piece)
        qkv = self.qkv(x)
        args = (qkv, rope, self.w1, self.w2, self.w3, tuple(hw_shape), self.num_heads, self.scale, self.lr)
        if recomputes(self):
            y = TTTCore.apply(*args)
        else:
            y = ttt_core(*args)
        return self.proj(y.to(self.proj.weight.dtype))

    def extra_repr(self):
        return f'dim={self.dim}, num_heads={self.num_heads}, scale={self.scale:.4g}'
