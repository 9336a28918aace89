"""The TTT core's train path: `TTTCore` keeps only its inputs (the qkv tokens and the initial inner weights)
for backward instead of ~10 (B, N, C) temporaries, and its backward recomputes the inner models without
autograd and runs the chain rule through their one-step inner gradients in closed form
(`ttt_core_backward`: a fixed sequence of matrix products and fused elementwise kernels, q and k in the
contiguous head layout their products take without copies), not autograd through a second forward.

With a piece size (the memory policy's, on its devices) the forward (`pieces.ttt_core_pieces`) and the
SwiGLU part of the backward run in pieces of tokens; parameter gradients are then sums over the pieces.

Under autocast the closed form runs under the forward's autocast state: its matrix products and per-sample
convolutions in the autocast dtype, as the reference's backward runs them there; the sums over all tokens
(k^T a, q^T dz', k^T dz) as the forward takes them (`reference.token_sum_matmul`: fp32 for fp16) and
accumulated in fp32, and the inner step on the (B, H, d, 2d) gradient (its normalisation and the backward
through it) in fp32. Where the closed form does not apply (`ops.ttt.TTT` declares it, `choose` decides) the
dispatch gives the checkpoint path: the same forward, and a backward by autograd through the reference under
the forward's autocast state.
"""
import torch
import torch.nn.functional as F

from ..dtypes import autocast_as, autocast_state, compute_dtype
from ..rope import rope_heads, rope_heads_backward
from ..split import split
from .pieces import ttt_core_pieces
from .reference import dwconv_per_sample, heads, split_qkv, tap_sums, token_sum_matmul, ttt_core
from .step import loss_factor, normalise_backward, update


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
    dsilu2 = torch.addcmul(s2, silu2, om)                 # step.silu_grad: s + SiLU (1 - s)
    t = z1 * dsilu2
    a = torch.empty_like(z)
    torch.mul(v, silu2, out=a[..., :d])
    torch.mul(v, t, out=a[..., d:])
    return z1, z2, silu2, s2, om, dsilu2, t, a


def _accumulate(total, part):
    """total + part over the pieces of tokens, in fp32 at least (a half part is upcast once)."""
    return part.to(compute_dtype(part)) if total is None else total.add_(part)


def _swiglu_core_backward(dy, q, k, v, w12, scale, lr, dq_out, dk_out, dv_out, pieces):
    """Closed-form backward of the SwiGLU inner model: y = (q W'1) * SiLU(q W'2) with
    W' = W - lr * normalise(-(scale/N) k^T [v SiLU(z2) | v z1 SiLU'(z2)]), z = k W, W = [W1 | W2].

    Three passes over the pieces of tokens: the inner gradient k^T a (a sum over tokens); the readout's
    gradient, giving dq and dW' (a sum); the chain rule through the inner gradient, giving dk, dv and the rest
    of dW. Every token-sized temporary is a piece's; with more than one piece the inner-gradient terms are
    recomputed in the third pass instead of kept. SiLU''(x) = s (1 - s) (2 + x - 2 SiLU(x)), s = sigma(x).

    Args:
        dy (callable): (i0, i1) -> (B, H, i1 - i0, d) piece of the gradient of y.
        q (callable): (i0, i1) -> piece of q (after RoPE), (B, H, i1 - i0, d).
        k (callable): (i0, i1) -> piece of k (after RoPE).
        v (callable): (i0, i1) -> piece of v.
        w12 (Tensor): [W1 | W2] (1 or B, H, d, 2d).
        scale (float): the inner loss's scale.
        lr (float): the inner learning rate.
        dq_out (callable): (i0, i1, g) writes the gradient g of a piece of q.
        dk_out (callable): (i0, i1, g) writes the gradient g of a piece of k.
        dv_out (callable): (i0, i1) -> the (B, H, i1 - i0, d) view the gradient of that piece of v goes into.
        pieces (list[Piece]): the pieces of tokens (`ops.split.split`).

    Returns:
        Tensor: dW (B, H, d, 2d), to be summed over a broadcast batch.
    """
    n = pieces[-1].stop
    d = w12.shape[-1] // 2
    cst = loss_factor(scale, n)
    gs = kept = None
    for i0, i1, _, _ in pieces:
        kb, vb = k(i0, i1), v(i0, i1)
        terms = _swiglu_terms(kb, vb, w12)
        gs = _accumulate(gs, token_sum_matmul(kb.transpose(-2, -1), terms[-1]))
        if len(pieces) == 1:     # whole maps: keep the terms for the third pass instead of recomputing
            kept = kb, vb, terms
        del terms
    gs.mul_(cst)
    w12n = update(w12, gs, lr, -2)

    dwn = None
    for i0, i1, _, _ in pieces:
        qb, dyb = q(i0, i1), dy(i0, i1)
        big_z = qb @ w12n                                 # readout with the updated weights
        dz_out = torch.empty_like(big_z)
        zz1, zz2 = big_z.split(d, dim=-1)
        torch.mul(dyb, F.silu(zz2), out=dz_out[..., :d])
        torch.ops.aten.silu_backward.grad_input(dyb * zz1, zz2, grad_input=dz_out[..., d:])
        dq_out(i0, i1, dz_out @ w12n.transpose(-2, -1))
        dwn = _accumulate(dwn, token_sum_matmul(qb.transpose(-2, -1), dz_out))
    dgs = normalise_backward(gs, dwn * -lr, -2) * cst     # dL/d(k^T a)

    for i0, i1, _, _ in pieces:
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
        dwn.add_(token_sum_matmul(kb.transpose(-2, -1), dz))
    return dwn


def _conv_head_backward(dx2, q2, k2, v2, w3, scale, lr):
    """Closed-form backward of `reference.conv_head` (maps (B, H, W, d) channels-last, w3 (d, 1, 3, 3)):
    y = conv(q2, w') with w' = w3 - lr * normalise(-(scale/(H W)) tap_sums(k2, v2)) per sample.
    dq2 = conv(dy, flip(w')); dw' = tap_sums(q2, dy); through the inner gradient with dG = its
    gradient: dv2 = conv(k2, dG), dk2 = conv(v2, flip(dG)). Returns dq2, dk2, dv2 as (B, H*W, d) tokens
    and dw3 (d, 1, 3, 3)."""
    b, h, w, d = q2.shape
    cst = loss_factor(scale, h * w)
    gs = tap_sums(k2, v2) * cst                                       # (B, d, 9)
    w3n = update(w3.reshape(1, d, 9), gs, lr, -1)
    dwn = tap_sums(q2, dx2)
    dg = normalise_backward(gs, dwn * -lr, -1) * cst
    kernels = (t.reshape(b * d, 1, 3, 3) for t in (w3n.flip(-1), dg, dg.flip(-1)))   # flip(-1) of 9 taps =
    dq2, dv2, dk2 = (dwconv_per_sample(x, k) for x, k in zip((dx2, k2, v2), kernels))  # both axes flipped
    return dq2, dk2, dv2, dwn.sum(0).view_as(w3)


def ttt_core_backward(grad_out, qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, piece=None):
    """Gradients of `reference.ttt_core` w.r.t. qkv, w1, w2, w3 in closed form (under autocast as the module
    docstring says):
    the inner models are recomputed without autograd and the chain rule runs through their one-step inner
    gradients explicitly (`_swiglu_core_backward`, `_conv_head_backward`, RoPE transposed by its conjugate
    rotation).

    Args:
        grad_out (Tensor): (B, N, C + d).
        qkv (Tensor): (B, N, 3C + 3d).
        rot, w1, w2, w3, hw_shape, num_heads, scale, lr: as in `reference.ttt_core`.
        piece (int | None): elements (tokens x C, the batch included) of the pieces of tokens the SwiGLU part
            runs in; None: whole maps. The values are the same up to the summation order over tokens.

    Returns:
        tuple: dqkv (B, N, 3C + 3d) and dw1, dw2, dw3.
    """
    b, n, _ = qkv.shape
    h, w = hw_shape
    d = w1.shape[-1]
    c = num_heads * d
    q1, k1, v1, q2, k2, v2 = split_qkv(qkv, num_heads, d)
    w12 = torch.cat([w1, w2], dim=-1)
    dqkv = qkv.new_empty(qkv.shape)
    dq1, dk1, dv1 = (dqkv[..., i * c:(i + 1) * c] for i in range(3))

    def rotated(t):
        if rot is None:
            return lambda i0, i1: heads(t[:, i0:i1], num_heads)
        return lambda i0, i1: rope_heads(t[:, i0:i1], rot[i0:i1], num_heads)

    def rotate_back(out):
        def write(i0, i1, g):
            if rot is not None:
                rope_heads_backward(g, rot[i0:i1], out[:, i0:i1])
            else:
                heads(out[:, i0:i1], num_heads).copy_(g)
        return write

    pieces = split(n, piece, unit=b * c)
    dw12 = _swiglu_core_backward(
        lambda i0, i1: heads(grad_out[:, i0:i1, :c], num_heads), rotated(q1), rotated(k1),
        lambda i0, i1: heads(v1[:, i0:i1], num_heads), w12, scale, lr, rotate_back(dq1), rotate_back(dk1),
        lambda i0, i1: heads(dv1[:, i0:i1], num_heads), pieces)
    dw12 = dw12.sum_to_size(w12.shape)
    maps = (t.unflatten(1, (h, w)) for t in (grad_out[..., c:], q2, k2, v2))
    *dconv, dw3 = _conv_head_backward(*maps, w3, scale, lr)
    for i, g in enumerate(dconv):
        dqkv[..., 3 * c + i * d:3 * c + (i + 1) * d] = g
    return dqkv, *dw12.split(d, dim=-1), dw3


class TTTCore(torch.autograd.Function):
    """`reference.ttt_core` that saves only its inputs and recomputes the inner models in backward, under the
    forward's autocast state: in closed form (`ttt_core_backward`, the train path) or, with `closed_form=False`
    (the checkpoint path), by autograd through the reference. The forward is
    `pieces.ttt_core_pieces`; with `piece` it and the closed-form backward run in pieces of `piece` elements.

    Inputs: those of `reference.ttt_core`, then `piece` (int | None) and `closed_form` (bool). Output
    (B, N, C + d).
    """

    @staticmethod
    def forward(ctx, qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, piece=None, closed_form=True):
        ctx.autocast = autocast_state(qkv.device.type)
        ctx.args = (hw_shape, num_heads, scale, lr)
        ctx.piece, ctx.closed_form, ctx.rot = piece, closed_form, rot
        ctx.save_for_backward(qkv, w1, w2, w3)
        return ttt_core_pieces(qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, piece)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        needs = [ctx.needs_input_grad[i] for i in (0, 2, 3, 4)]
        none = (None,) * 6
        amp = autocast_as(ctx.autocast)
        if ctx.closed_form:
            with amp:
                g = ttt_core_backward(grad_out, *saved[:1], ctx.rot, *saved[1:], *ctx.args, ctx.piece)
            g = [t.to(s.dtype) if r else None for t, s, r in zip(g, saved, needs)]
            return g[0], None, g[1], g[2], g[3], *none
        inputs = [t.detach().requires_grad_(r) for t, r in zip(saved, needs)]
        with torch.enable_grad(), amp:
            out = ttt_core(inputs[0], ctx.rot, *inputs[1:], *ctx.args)
        wrt = [t for t, r in zip(inputs, needs) if r]
        grads = iter(torch.autograd.grad(out, wrt, grad_out)) if wrt else iter(())
        g = [next(grads) if r else None for r in needs]
        return g[0], None, g[1], g[2], g[3], *none
