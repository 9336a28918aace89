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
* in training, `TTTCore` (an autograd Function) keeps only the fused qkv tensor for backward instead of
  ~10 (B, N, C) temporaries per block; its backward recomputes the inner models without autograd and runs
  the chain rule through their one-step inner gradients in closed form (`ttt_core_backward`: a fixed
  sequence of matrix products and fused elementwise kernels, q and k in the contiguous head layout their
  products take without copies), not autograd through a second forward.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.model.weight_init import trunc_normal_

from ..ops.dtypes import HALF_DTYPES, autocast_off, autocast_on, autocasts_to
from ..ops.export import eager_inference, exporting
from ..ops.memory import DEFAULT_POLICY, inference, recomputes
from .rope import apply_rope, rope_heads, rope_heads_backward
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
    g = tap_sums(k, v)
    if exporting():   # traced sizes stay in the graph (no Python float of H*W)
        return normalize_inner_grad((g * -scale / (h * w)).reshape(-1, 1, 3, 3), (-2, -1))
    g = (g * (-scale / float(h * w))).reshape(b * c, 1, 3, 3)
    return normalize_inner_grad(g, (-2, -1))


def tap_sums(k, v):
    """sum_yx k(y + dy - 1, x + dx - 1) v(y, x) per sample and channel for the nine taps (dy, dx) of a 3x3
    kernel (k zero-padded by one): the gradient of sum(conv(k, w) * v) w.r.t. a depth-wise kernel w.
    k, v: (B, H, W, d) channels-last maps. Returns (B, d, 9), fp32 for fp16 / bf16 maps."""
    h, w = k.shape[1:3]
    kp = F.pad(k, (0, 0, 1, 1, 1, 1))
    acc = torch.float32 if k.dtype in HALF_DTYPES else None  # fp16 range: sums over H*W
    if exporting():   # traced sizes stay in the graph (no slice ends from H, W)
        return torch.stack([(kp[:, _tap(dy), _tap(dx)] * v).sum(dim=(1, 2), dtype=acc)
                            for dy in range(3) for dx in range(3)], dim=-1)
    return torch.stack([(kp[:, dy:dy + h, dx:dx + w] * v).sum(dim=(1, 2), dtype=acc)
                        for dy in range(3) for dx in range(3)], dim=-1)


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
    q1, k1, v1 = _qkv_heads(q1, k1, v1, rot, num_heads, fused)
    w12 = _fast_weights(torch.cat([w1, w2], dim=-1), k1)
    w12 = w12 - (lr * _swiglu_grad_pair(k1, v1, w12, scale, fused)).to(w12.dtype)
    z = q1 @ w12
    if exporting():   # reshape, not unflatten: see `_heads`
        x2 = _conv_head(*(t.reshape(b, h, w, d) for t in (q2, k2, v2)), w3, scale, lr)
    else:
        x2 = _conv_head(*(t.unflatten(1, (h, w)) for t in (q2, k2, v2)), w3, scale, lr)
    if not fused:
        return torch.cat([_swiglu_readout(z).transpose(1, 2).reshape(b, n, c), x2.to(z.dtype)], dim=-1)
    y = z.new_empty(b, n, c + d)       # no autograd: both outputs written into their channels
    _swiglu_readout(z, out=_heads(y[..., :c], num_heads))
    y[..., c:] = x2
    return y


def _qkv_heads(q1, k1, v1, rot, num_heads, fused):
    """(B, N, C) q1, k1 (RoPE when `rot` is given) and v1 -> (B, H, N, d) heads; `fused` (no autograd)
    writes q1 and k1 contiguous, the layout their matrix products take without copying them first."""
    if fused and rot is not None:
        return rope_heads(q1, rot, num_heads), rope_heads(k1, rot, num_heads), _heads(v1, num_heads)
    if rot is not None:
        q1, k1 = apply_rope(q1, rot), apply_rope(k1, rot)
    return tuple(_heads(t, num_heads) for t in (q1, k1, v1))


def _ttt_chunks(cols, n, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, step, conv_tokens, target, emit):
    """The fused TTT forward (no autograd) over chunks of `step` tokens, two passes.

    Pass 1, chunk by chunk: `cols(i0, i1, 'kv')`, the chunk's [k1 | v1 | q2 | k2 | v2] columns (B, s, 2C + 3d),
    RoPE on k1, and k1^T [a1 | a2] of the SwiGLU inner gradient, summed over the chunks; the conv-head
    tokens [q2 | k2 | v2] (B, N, 3d) are `conv_tokens` or, when None, gathered from the chunks. Then the
    conv head (whole map, d channels). Pass 2, chunk by chunk: `cols(i0, i1, 'q')` (B, s, C), RoPE, the
    updated SwiGLU model and the conv-head output, written into `target(i0, i1, like)` (a (B, s, C + d)
    tensor of `like`'s dtype), then `emit(i0, i1, y)`. The values equal `ttt_core` up to the summation
    order of k^T a over the chunks (~1e-7 relative)."""
    h, w = hw_shape
    d = w1.shape[-1]
    c = num_heads * d

    def rope(t, i):
        return apply_rope(t, rot[i:i + step]) if rot is not None else t

    w12 = torch.cat([w1, w2], dim=-1)
    g = None
    gather = conv_tokens is None
    for i in range(0, n, step):
        kv = cols(i, min(n, i + step), 'kv')
        if gather:
            if conv_tokens is None:
                conv_tokens = kv.new_empty(kv.shape[0], n, 3 * d)
            conv_tokens[:, i:i + step] = kv[..., 2 * c:]
        k1, v1 = _heads(rope(kv[..., :c], i), num_heads), _heads(kv[..., c:2 * c], num_heads)
        if i == 0:
            w12 = _fast_weights(w12, k1)
        part = token_sum_matmul(k1.transpose(-2, -1), _swiglu_dz(k1 @ w12, v1, fused=True))
        g = part if g is None else g.add_(part)
    w12 = w12 - (lr * _normalized_swiglu_grad(g, n, scale)).to(w12.dtype)

    x2 = _conv_head(*conv_tokens.unflatten(1, (h, w)).split([d, d, d], dim=-1), w3, scale, lr)
    del conv_tokens

    for i in range(0, n, step):
        i1 = min(n, i + step)
        z = _heads(rope(cols(i, i1, 'q'), i), num_heads) @ w12
        y = target(i, i1, z)
        _swiglu_readout(z, out=_heads(y[..., :c], num_heads))
        y[..., c:] = x2[:, i:i1]
        emit(i, i1, y)


def ttt_inference(x, qkv, proj, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, piece=None):
    """The whole TTT layer without autograd, tokens (B, N, C) -> (B, N, C), in chunks of `piece` / (B C)
    tokens (None: one chunk), so that no (B, N, >= C) temporary is built except the output: the qkv
    columns of each pass (`_ttt_chunks`: the k1 | v1 | q2 | k2 | v2 weight rows in the first, the q1 rows
    in the second; every weight row applied once, as in `ttt_core`) and `proj` chunk by chunk."""
    b, n, _ = x.shape
    c = num_heads * w1.shape[-1]
    step = n if piece is None else max(1, piece // (b * c))
    rows = {'q': slice(None, c), 'kv': slice(c, None)}
    out = []

    def cols(i0, i1, part):
        return F.linear(x[:, i0:i1], qkv.weight[rows[part]], None if qkv.bias is None else qkv.bias[rows[part]])

    def emit(i0, i1, y):
        y = proj(y.to(proj.weight.dtype))
        if not out:
            out.append(y.new_empty(b, n, y.shape[-1]))
        out[0][:, i0:i1] = y

    _ttt_chunks(cols, n, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, step, None,
                lambda i0, i1, z: z.new_empty(b, i1 - i0, c + w1.shape[-1]), emit)
    return out[0]


def ttt_core_chunks(qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, piece):
    """`ttt_core` with fused kernels (no autograd) in chunks of `piece` / (B C) tokens (`_ttt_chunks`): the
    forward of `TTTCore` in the memory policy's training pieces. qkv (B, N, 3C + 3d) -> (B, N, C + d)."""
    b, n, _ = qkv.shape
    c = num_heads * w1.shape[-1]
    out = []

    def target(i0, i1, z):
        if not out:
            out.append(z.new_empty(b, n, c + w1.shape[-1]))
        return out[0][:, i0:i1]

    _ttt_chunks(lambda i0, i1, part: qkv[:, i0:i1, :c] if part == 'q' else qkv[:, i0:i1, c:], n, rot, w1, w2,
                w3, hw_shape, num_heads, scale, lr, max(1, piece // (b * c)), qkv[..., 3 * c:], target,
                lambda *_: None)
    return out[0]


def _normalize_backward(gs, dgn, dim):
    """dL/dgs of gn = gs / (||gs|| + 1) (norm over `dim`) from dgn = dL/dgn:
    (dgn - gs <dgn, gs> / (||gs|| (||gs|| + 1))) / (||gs|| + 1), the projection term dropped where
    ||gs|| = 0 (gs is zero there; autograd's norm subgradient is zero too)."""
    nrm = gs.norm(dim=dim, keepdim=True)
    den = nrm + 1.0
    dot = (dgn * gs).sum(dim=dim, keepdim=True)
    return (dgn - gs * (dot / (nrm.clamp_min(torch.finfo(gs.dtype).tiny) * den))) / den


def token_blocks(n, rows):
    """[(start, end)] of consecutive blocks of `rows` tokens (None: one block) covering n tokens."""
    rows = n if rows is None else max(1, rows)
    return [(i, min(n, i + rows)) for i in range(0, n, rows)]


def _swiglu_terms(k, v, w12):
    """The inner-gradient terms of the SwiGLU model on keys k and values v (..., N, d), W = [W1 | W2]:
    z1 (of z = k W), SiLU(z2), sigma(z2), 1 - sigma(z2), SiLU'(z2), t = z1 SiLU'(z2), and
    a = [v SiLU(z2) | v t] (..., N, 2d), whose k^T a is the unnormalised inner gradient."""
    d = v.shape[-1]
    z = k @ w12
    z1, z2 = z.split(d, dim=-1)
    s2 = torch.sigmoid(z2)
    silu2 = z2 * s2
    om = 1.0 - s2
    dsilu2 = torch.addcmul(s2, silu2, om)                 # SiLU' = s + SiLU (1 - s)
    t = z1 * dsilu2
    a = torch.empty_like(z)
    torch.mul(v, silu2, out=a[..., :d])
    torch.mul(v, t, out=a[..., d:])
    return z1, z2, silu2, s2, om, dsilu2, t, a


def _swiglu_core_backward(dy, q, k, v, w12, scale, lr, dq_out, dk_out, dv_out, blocks):
    """Closed-form backward of the SwiGLU inner model: y = (q W'1) * SiLU(q W'2) with
    W' = W - lr * normalise(-(scale/N) k^T [v SiLU(z2) | v z1 SiLU'(z2)]), z = k W, W = [W1 | W2].

    Three passes over the token blocks `blocks` (`token_blocks`): the inner gradient k^T a (a sum over
    tokens); the readout's gradient, giving dq and dW' (a sum); the chain rule through the inner gradient,
    giving dk, dv and the rest of dW. Every token-sized temporary is a block's (the memory policy's
    training pieces keep them out of fresh pages); with more than one block the inner-gradient terms are
    recomputed in the third pass instead of kept.

    Args:
        dy(i0, i1), q(i0, i1), k(i0, i1), v(i0, i1): (B, H, i1 - i0, d) blocks of the gradient of y, of
            q and k (after RoPE) and of v. w12: (1 or B, H, d, 2d).
        dq_out(i0, i1, g), dk_out(i0, i1, g): write the gradient g of a block of q / k.
        dv_out(i0, i1): the (B, H, i1 - i0, d) view the gradient of that block of v is written into.
    Returns:
        dW (B, H, d, 2d), to be summed over a broadcast batch.
    SiLU''(x) = s (1 - s) (2 + x - 2 SiLU(x)), s = sigma(x)."""
    n = blocks[-1][1]
    d = w12.shape[-1] // 2
    cst = -scale / float(n)
    gs = kept = None
    for i0, i1 in blocks:
        kb, vb = k(i0, i1), v(i0, i1)
        terms = _swiglu_terms(kb, vb, w12)
        part = kb.transpose(-2, -1) @ terms[-1]
        gs = part if gs is None else gs.add_(part)
        if len(blocks) == 1:     # whole maps: keep the terms for the third pass instead of recomputing
            kept = kb, vb, terms
        del terms
    gs.mul_(cst)
    w12n = w12 - lr * normalize_inner_grad(gs, -2)

    dwn = None
    for i0, i1 in blocks:
        qb, dyb = q(i0, i1), dy(i0, i1)
        big_z = qb @ w12n                                 # readout with the updated weights
        dz_out = torch.empty_like(big_z)
        zz1, zz2 = big_z.split(d, dim=-1)
        torch.mul(dyb, F.silu(zz2), out=dz_out[..., :d])
        torch.ops.aten.silu_backward.grad_input(dyb * zz1, zz2, grad_input=dz_out[..., d:])
        dq_out(i0, i1, dz_out @ w12n.transpose(-2, -1))
        part = qb.transpose(-2, -1) @ dz_out
        dwn = part if dwn is None else dwn.add_(part)
    dgs = _normalize_backward(gs, dwn * -lr, -2) * cst    # dL/d(k^T a)

    for i0, i1 in blocks:
        kb, vb, terms = kept if kept is not None else (k(i0, i1), v(i0, i1), None)
        kept = None
        z1, z2, silu2, s2, om, dsilu2, t, a = terms if terms is not None else _swiglu_terms(kb, vb, w12)
        del terms
        dk = a @ dgs.transpose(-2, -1)
        del a
        da = kb @ dgs
        da1, da2 = da.split(d, dim=-1)
        torch.mul(da1, silu2, out=dv_out(i0, i1)).addcmul_(da2, t)
        dz = torch.empty_like(da)
        torch.mul(da2, vb, out=dz[..., :d]).mul_(dsilu2)
        ddsilu2 = torch.add(z2, silu2, alpha=-2.0).add_(2.0).mul_(s2).mul_(om)
        dz2 = torch.mul(da1, dsilu2, out=dz[..., d:])
        dz2.addcmul_(da2.mul_(z1), ddsilu2).mul_(vb)
        del da, da1, da2, ddsilu2
        dk_out(i0, i1, dk.add_(dz @ w12.transpose(-2, -1)))
        dwn.add_(kb.transpose(-2, -1) @ dz)
    return dwn


def _conv_head_backward(dx2, q2, k2, v2, w3, scale, lr):
    """Closed-form backward of `_conv_head` (maps (B, H, W, d) channels-last, w3 (d, 1, 3, 3)):
    y = conv(q2, w') with w' = w3 - lr * normalise(-(scale/(H W)) tap_sums(k2, v2)) per sample.
    dq2 = conv(dy, flip(w')); dw' = tap_sums(q2, dy); through the inner gradient with dG = its
    gradient: dv2 = conv(k2, dG), dk2 = conv(v2, flip(dG)). Returns dq2, dk2, dv2 as (B, H*W, d) tokens
    and dw3 (d, 1, 3, 3)."""
    b, h, w, d = q2.shape
    cst = -scale / float(h * w)
    gs = tap_sums(k2, v2) * cst                                       # (B, d, 9)
    w3n = w3.reshape(1, d, 9) - lr * normalize_inner_grad(gs, -1)
    dwn = tap_sums(q2, dx2)
    dg = _normalize_backward(gs, dwn * -lr, -1) * cst
    kernels = (t.reshape(b * d, 1, 3, 3) for t in (w3n.flip(-1), dg, dg.flip(-1)))   # flip(-1) of 9 taps =
    dq2, dv2, dk2 = (dwconv_per_sample(x, k) for x, k in zip((dx2, k2, v2), kernels))  # both axes flipped
    return dq2, dk2, dv2, dwn.sum(0).view_as(w3)


def ttt_core_backward(grad_out, qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, piece=None):
    """Gradients of `ttt_core` w.r.t. qkv, w1, w2, w3 in closed form (fp32 / fp64, no autocast):
    the inner models are recomputed without autograd and the chain rule runs through their one-step
    inner gradients explicitly (`_swiglu_core_backward`, `_conv_head_backward`, RoPE transposed by its
    conjugate rotation). grad_out: (B, N, C + d). `piece` (None: whole maps): elements (tokens x C, the
    batch included) of the token blocks the SwiGLU part runs in; the values are the same up to the
    summation order of the sums over tokens. Returns dqkv (B, N, 3C + 3d) and dw1, dw2, dw3."""
    b, n, _ = qkv.shape
    h, w = hw_shape
    d = w1.shape[-1]
    c = num_heads * d
    q1, k1, v1, q2, k2, v2 = qkv.split([c, c, c, d, d, d], dim=-1)
    w12 = torch.cat([w1, w2], dim=-1)
    dqkv = qkv.new_empty(qkv.shape)
    dq1, dk1, dv1 = (dqkv[..., i * c:(i + 1) * c] for i in range(3))

    def rotated(t):
        if rot is None:
            return lambda i0, i1: _heads(t[:, i0:i1], num_heads)
        return lambda i0, i1: rope_heads(t[:, i0:i1], rot[i0:i1], num_heads)

    def rotate_back(out):
        def write(i0, i1, g):
            if rot is not None:
                rope_heads_backward(g, rot[i0:i1], out[:, i0:i1])
            else:
                _heads(out[:, i0:i1], num_heads).copy_(g)
        return write

    blocks = token_blocks(n, None if piece is None else piece // (b * c))
    dw12 = _swiglu_core_backward(
        lambda i0, i1: _heads(grad_out[:, i0:i1, :c], num_heads), rotated(q1), rotated(k1),
        lambda i0, i1: _heads(v1[:, i0:i1], num_heads), w12, scale, lr, rotate_back(dq1), rotate_back(dk1),
        lambda i0, i1: _heads(dv1[:, i0:i1], num_heads), blocks)
    dw12 = dw12.sum_to_size(w12.shape)
    maps = (t.unflatten(1, (h, w)) for t in (grad_out[..., c:], q2, k2, v2))
    *dconv, dw3 = _conv_head_backward(*maps, w3, scale, lr)
    for i, g in enumerate(dconv):
        dqkv[..., 3 * c + i * d:3 * c + (i + 1) * d] = g
    return dqkv, *dw12.split(d, dim=-1), dw3


class TTTCore(torch.autograd.Function):
    """`ttt_core` that saves only its inputs and recomputes the inner models in backward: in closed form
    (`ttt_core_backward`) for fp32 / fp64 without autocast, otherwise by autograd through a second
    `ttt_core` under the forward's autocast state. With `piece` (the memory policy's training pieces)
    the forward (`ttt_core_chunks`) and the closed-form backward run in token chunks of `piece` elements."""

    @staticmethod
    def forward(ctx, qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, piece=None):
        dev = qkv.device.type
        on = autocast_on(dev)
        ctx.autocast = (dev, on, torch.get_autocast_dtype(dev) if on else None)
        ctx.args = (hw_shape, num_heads, scale, lr)
        ctx.piece = piece
        ctx.rot = rot
        ctx.save_for_backward(qkv, w1, w2, w3)
        if piece is not None:
            return ttt_core_chunks(qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, piece)
        return ttt_core(qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, fused=True)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        needs = [ctx.needs_input_grad[i] for i in (0, 2, 3, 4)]
        dev, enabled, dtype = ctx.autocast
        if not enabled and saved[0].dtype in (torch.float32, torch.float64) and \
                all(t.dtype == saved[0].dtype for t in saved[1:]):
            g = ttt_core_backward(grad_out, *saved[:1], ctx.rot, *saved[1:], *ctx.args, ctx.piece)
            g = [t if r else None for t, r in zip(g, needs)]
            return g[0], None, g[1], g[2], g[3], None, None, None, None, None
        inputs = [t.detach().requires_grad_(r) for t, r in zip(saved, needs)]
        amp = torch.autocast(dev, enabled=True, dtype=dtype) if enabled else autocast_off(dev)
        with torch.enable_grad(), amp:
            out = ttt_core(inputs[0], ctx.rot, *inputs[1:], *ctx.args)
        wrt = [t for t, r in zip(inputs, needs) if r]
        grads = iter(torch.autograd.grad(out, wrt, grad_out)) if wrt else iter(())
        g = [next(grads) if r else None for r in needs]
        return g[0], None, g[1], g[2], g[3], None, None, None, None, None


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
            # the backward's SwiGLU part in token blocks: the memory policy's training pieces
            y = TTTCore.apply(*args, self.memory_policy.train_cache_pieces(x, x.shape[0] * x.shape[1] * self.dim))
        else:
            y = ttt_core(*args)
        return self.proj(y.to(self.proj.weight.dtype))

    def extra_repr(self):
        return f'dim={self.dim}, num_heads={self.num_heads}, scale={self.scale:.4g}'
