"""The MLPs' training functions: closed-form backward with recomputation of the elementwise parts
(exact GELU only; `ops.mlp` falls back to the reference for other activations, dropout and, for the ConvMlp
functions, autocast).

* `NormMlpFunction`: fc2(GELU(fc1(LayerNorm(x)))), keeping x and the fc1 output; optionally in pieces of
  tokens. Under autocast it computes what the reference computes there: the LayerNorm in x's dtype (fp32, or
  the autocast dtype where the residual stream already is in it) with fp32 statistics, the products, the GELU
  and the output in the autocast dtype (the weights cast once); the parameter gradients are accumulated in
  fp32.
* `ConvMlpFunction`: ConvMlp's chain, keeping x (and the fc1 output with `keep_fc1`). Under autocast its backward
  runs under the forward's autocast state: every product, convolution and GELU in the dtype the reference's
  backward runs it in (the autocast dtype), the parameter gradients cast to the parameters' dtype as the
  reference's casts are.
* `ConvMlpPiecesFunction`: the same in pieces of rows with one halo row each side.
"""
import torch
import torch.nn.functional as F

from ..dtypes import autocast_as, autocast_off, autocast_on, autocast_state, compute_dtype
from ..split import split
from ..tokens import map_to_tokens, tokens_to_map
from .pieces import linear_into as _linear_into


class NormMlpFunction(torch.autograd.Function):
    """fc2(GELU(fc1(LayerNorm(x)))) on tokens x (..., C), keeping x, the LayerNorm statistics and the fc1
    output h (..., rC) for backward. Backward recomputes LN(x) and GELU(h), and writes the GELU gradient
    into the recomputed GELU buffer once fc2's weight gradient has used it.

    `piece` (None: whole) is the elements of x per piece (`ops.split`): forward and backward run piece by
    piece of tokens, so the LayerNorm output, the GELU output and the hidden gradients are piece-sized
    temporaries that stay in cache
    instead of fresh map-sized tensors (the memory policy's training pieces, `memory.MemoryPolicy`); only h,
    the output and the input gradient are whole maps. The parameter gradients are then sums of the pieces'
    (another summation order, ~1e-7 relative in float32); the output and the input gradient are per token."""

    @staticmethod
    def forward(ctx, x, ln_w, ln_b, eps, w1, b1, w2, b2, piece=None):
        dev = x.device.type
        lp = torch.get_autocast_dtype(dev) if autocast_on(dev) else None
        c = x.shape[-1]
        x2 = x.reshape(-1, c)
        m = x2.shape[0]
        pieces = [p.own for p in split(m, piece, unit=c)]
        with autocast_off(dev):
            w1c, b1c, w2c, b2c = _cast(lp, w1, b1, w2, b2)
            h, y = x2.new_empty(m, w1.shape[0], dtype=w1c.dtype), x2.new_empty(m, w2.shape[0], dtype=w2c.dtype)
            stat = compute_dtype(x2)                                    # native_layer_norm's statistics dtype
            mean, rstd = x2.new_empty(m, 1, dtype=stat), x2.new_empty(m, 1, dtype=stat)
            for r in pieces:
                xn, mean[r], rstd[r] = torch.native_layer_norm(x2[r], (c,), ln_w, ln_b, eps)
                _linear_into(h[r], _cast(lp, xn)[0], w1c, b1c)
                _linear_into(y[r], F.gelu(h[r]), w2c, b2c)
        ctx.eps, ctx.pieces, ctx.lp = eps, pieces, lp
        ctx.save_for_backward(x, mean, rstd, ln_w, ln_b, h, w1, w2, b1, b2)
        return y.view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd, ln_w, ln_b, h, w1, w2, b1, b2 = ctx.saved_tensors
        lp = ctx.lp
        c = x.shape[-1]
        with autocast_off(x.device.type):
            w1c, w2c = _cast(lp, w1, w2)
            x2, g = x.reshape(-1, c), grad.reshape(-1, grad.shape[-1]).to(h.dtype)
            need = ctx.needs_input_grad
            dx = torch.empty_like(x2) if need[0] else None
            grads = [torch.zeros_like(t) if t is not None and n else None
                     for t, n in zip((ln_w, ln_b, w1, b1, w2, b2), need[1:3] + need[4:8])]
            dln_w, dln_b, dw1, db1, dw2, db2 = grads
            for r in ctx.pieces:
                xr, gr, hr = x2[r], g[r], h[r]
                xn = _cast(lp, torch.native_layer_norm(xr, (c,), ln_w, ln_b, ctx.eps)[0])[0]
                a = F.gelu(hr)
                if dw2 is not None:
                    _addmm_(dw2, gr.t(), a)
                if db2 is not None:
                    db2.add_(gr.sum(0, dtype=db2.dtype))
                dh = torch.ops.aten.gelu_backward.grad_input(torch.mm(gr, w2c, out=a), hr, grad_input=a)  # a is free
                if dw1 is not None:
                    _addmm_(dw1, dh.t(), xn)
                if db1 is not None:
                    db1.add_(dh.sum(0, dtype=db1.dtype))
                if dx is None and dln_w is None and dln_b is None:
                    continue
                dxr, dwr, dbr = torch.ops.aten.native_layer_norm_backward(
                    (dh @ w1c).to(xr.dtype), xr, (c,), mean[r], rstd[r], ln_w, ln_b,
                    [dx is not None, dln_w is not None, dln_b is not None])
                if dx is not None:
                    dx[r] = dxr
                if dln_w is not None:
                    dln_w.add_(dwr)
                if dln_b is not None:
                    dln_b.add_(dbr)
        return (dx.view(x.shape) if dx is not None else None, dln_w, dln_b, None, dw1, db1, dw2, db2, None)


def _cast(dtype, *tensors):
    """The tensors in `dtype` (None: as they are; None entries stay None): the autocast dtype of the matrix
    products, one cast each."""
    if dtype is None:
        return tensors
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def _addmm_(out, a, b):
    """out += a @ b; the product in a and b's dtype (the autocast dtype under autocast), accumulated in out's."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out.add_(torch.mm(a, b))


class ConvMlpFunction(torch.autograd.Function):
    """ConvMlp's fc1 -> GELU -> u + DWConv3x3(u) -> GELU -> fc2 on tokens x (B, N, C) of an (H, W) map,
    keeping x (and with `keep_fc1` the fc1 output h (B, N, rC)) for backward. Backward recomputes (fc1),
    the two GELUs and the conv, but not fc2, and writes each gradient into a buffer the chain rule has
    finished with: d(GELU2 input) into the GELU2 output once fc2's weight gradient has used it, d(fc1
    output) into the conv's input gradient."""

    @staticmethod
    def forward(ctx, x, hw_shape, keep_fc1, w1, b1, wc, bc, w2, b2):
        h = F.linear(x, w1, b1)
        s = _conv_residual(F.gelu(h), hw_shape, wc, bc)
        ctx.hw_shape, ctx.autocast = hw_shape, autocast_state(x.device.type)
        ctx.save_for_backward(x, h if keep_fc1 else None, w1, b1, wc, bc, w2, b2)
        return F.linear(F.gelu(s), w2, b2)

    @staticmethod
    def backward(ctx, grad):
        with autocast_as(ctx.autocast):
            return ConvMlpFunction._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        x, h, w1, b1, wc, bc, w2, b2 = ctx.saved_tensors
        need = ctx.needs_input_grad
        if h is None:
            h = F.linear(x, w1, b1)
        u = F.gelu(h)
        s = _conv_residual(u, ctx.hw_shape, wc, bc)
        r = h.shape[-1]
        g, a = grad.reshape(-1, grad.shape[-1]), F.gelu(s).reshape(-1, r)
        dw2 = g.t() @ a if need[7] else None
        db2 = g.sum(0) if b2 is not None and need[8] else None
        ds = torch.ops.aten.gelu_backward.grad_input((g @ w2).view(s.shape), s, grad_input=a.view(s.shape))
        del s
        du, dwc, dbc = torch.ops.aten.convolution_backward(
            tokens_to_map(ds, ctx.hw_shape), tokens_to_map(u, ctx.hw_shape),
            wc.to(u.dtype, memory_format=torch.channels_last), [r] if bc is not None else None, [1, 1], [1, 1], [1, 1],
            False, [0, 0], r, [True, need[5], bc is not None and need[6]])
        du = map_to_tokens(du).add_(ds)
        dh = torch.ops.aten.gelu_backward.grad_input(du, h, grad_input=du).reshape(-1, r)
        dw1 = dh.t() @ x.reshape(-1, x.shape[-1]) if need[3] else None
        db1 = dh.sum(0) if b1 is not None and need[4] else None
        dx = (dh @ w1).view_as(x) if need[0] else None
        dwc = dwc.contiguous() if dwc is not None else None
        return dx, None, None, dw1, db1, dwc, dbc, dw2, db2


class ConvMlpPiecesFunction(torch.autograd.Function):
    """`ConvMlpFunction` with `keep_fc1`, piece by piece of map rows of about `piece` elements of x (the memory
    policy's training pieces on the policy's devices, as `ops.dispatch.choose` picks them): fc1 runs on the whole
    map (its output h is kept), everything after it per piece with one halo row above and below for the 3x3 conv, so
    GELU(h), the conv output, the second GELU and, in backward, their gradients are piece-sized temporaries in
    cache. Backward collects d(GELU1 output) over the pieces in one (B, H, W, rC) buffer (a piece's conv gradient
    reaches its halo rows), then runs fc1's backward on the whole map. Same output and input gradient as
    `ConvMlpFunction` up to rounding; the conv and fc2 parameter gradients are sums over the pieces."""

    @staticmethod
    def forward(ctx, x, hw_shape, piece, w1, b1, wc, bc, w2, b2):
        b, n, c = x.shape
        hh, ww = hw_shape
        h = F.linear(x, w1, b1)
        hm = h.view(b, hh, ww, -1)
        y = x.new_empty(b, hh, ww, w2.shape[0])
        wcl = wc.to(memory_format=torch.channels_last)
        pieces = split(hh, piece, unit=b * ww * c, halo=1)
        for r0, r1, a0, a1 in pieces:
            u = F.gelu(hm[:, a0:a1])
            y[:, r0:r1] = F.linear(F.gelu(_piece_conv_residual(u, r0 - a0, r1 - a0, wcl, bc)), w2, b2)
        ctx.hw_shape, ctx.pieces = hw_shape, pieces
        ctx.save_for_backward(x, h, w1, b1, wc, bc, w2, b2)
        return y.view(b, n, -1)

    @staticmethod
    def backward(ctx, grad):
        x, h, w1, b1, wc, bc, w2, b2 = ctx.saved_tensors
        need = ctx.needs_input_grad
        b, n, c = x.shape
        hh, ww = ctx.hw_shape
        r = h.shape[-1]
        hm, gm = h.view(b, hh, ww, r), grad.reshape(b, hh, ww, -1)
        du = h.new_zeros(b, hh, ww, r)
        dw2 = torch.zeros_like(w2) if need[7] else None
        db2 = torch.zeros_like(b2) if b2 is not None and need[8] else None
        dwc = torch.zeros_like(wc) if need[5] else None
        dbc = torch.zeros_like(bc) if bc is not None and need[6] else None
        wcl = wc.to(memory_format=torch.channels_last)
        for r0, r1, a0, a1 in ctx.pieces:
            u = F.gelu(hm[:, a0:a1])
            s = _piece_conv_residual(u, r0 - a0, r1 - a0, wcl, bc)
            a = F.gelu(s).view(-1, r)
            g = gm[:, r0:r1].reshape(-1, gm.shape[-1])
            if dw2 is not None:
                dw2.addmm_(g.t(), a)
            if db2 is not None:
                db2.add_(g.sum(0))
            ds = torch.ops.aten.gelu_backward.grad_input(torch.mm(g, w2, out=a).view(s.shape), s,
                                                         grad_input=a.view(s.shape))
            gout = u.new_zeros(u.shape)
            gout[:, r0 - a0:r1 - a0] = ds
            dub, dwb, dbb = torch.ops.aten.convolution_backward(
                gout.permute(0, 3, 1, 2), u.permute(0, 3, 1, 2), wcl, [r] if bc is not None else None,
                [1, 1], [1, 1], [1, 1], False, [0, 0], r, [True, dwc is not None, dbc is not None])
            du[:, a0:a1] += dub.permute(0, 2, 3, 1)
            du[:, r0:r1] += ds
            if dwc is not None:
                dwc.add_(dwb)
            if dbc is not None:
                dbc.add_(dbb)
        dh = torch.ops.aten.gelu_backward.grad_input(du, hm, grad_input=du).view(-1, r)
        dw1 = dh.t() @ x.reshape(-1, c) if need[3] else None
        db1 = dh.sum(0) if b1 is not None and need[4] else None
        dx = (dh @ w1).view_as(x) if need[0] else None
        return dx, None, None, dw1, db1, dwc, dbc, dw2, db2


def _piece_conv_residual(u, i0, i1, wcl, bc):
    """u + DWConv3x3(u) on the rows [i0, i1) of a piece of rows u (B, rows, W, rC) (channels-last; `wcl` the conv
    weight in channels-last format): the conv of the whole piece (its zero padding is the map's border only
    at the map's top and bottom; the piece's first and last rows are halo rows where they are not) cut to
    the rows it has both neighbours for."""
    cv = F.conv2d(u.permute(0, 3, 1, 2), wcl, bc, padding=1, groups=u.shape[-1]).permute(0, 2, 3, 1)
    return cv[:, i0:i1].add(u[:, i0:i1])


def _conv_residual(u, hw_shape, wc, bc):
    """u + DWConv3x3(u) on tokens (B, N, rC): the conv output (channels-last, its token view needs no copy)
    with u added into it."""
    c = F.conv2d(tokens_to_map(u, hw_shape), wc.to(memory_format=torch.channels_last), bc, padding=1,
                 groups=u.shape[-1])
    return map_to_tokens(c).add_(u)
