"""Attention maps of one query token, recomputed in float64 from an attention layer's own weights and its
input (captured with a forward pre-hook on a normal forward); docs/visualization.md shows them.

Every map is an array (heads, h, w) over the layer's key grid, for the query token t = (ty, tx) of the
layer's (H, W) token map (row-major index i = ty * W + tx); "mean" in the figures is the mean over heads.

* `lwa` (L2ViT LWA, `WindowAttention`): p_h(j) = softmax_j(q_i . k_j * scale) over the w x w window that holds
  t (no position bias in L2ViT; padded positions take part as the authors do, their share is `padding_mass`,
  or are masked with `mask_padding`), zero outside the window. Key grid = the (H, W) map. Rows sum to 1.
* `lga` (L2ViT LGA, `LinearAttention`, before LCM): the implicit row of ReLU linear attention,
  a_h(j) = t_h relu(q_i) . relu(k_j) / max(relu(q_i) . sum_m relu(k_m), clamp) (t_h the learned temperature,
  clamp = 100), so that out_i = proj(concat_h sum_j a_h(j) v_j) exactly. Non-negative; sums to <= t_h.
* `lga_lcm` (after LCM): the same row carried through the block's LCM branch, u = x' + LCM(LN3(x')) with
  x' = x + proj(A V), linearised at the actual input and with the attention weights A held fixed:
  r_h(j) = <du_i/dv^h_j, W^h>_F / ||W^h||_F^2 = sum_p c_h(i, p) a_h(p, j), c_h(i, p) = [i = p] +
  tr(W^hT M_ip W^h) / ||W^h||_F^2, where W^h are the columns of `proj` that read head h and M_ip = du_i/dx'_p
  - [i = p] I is the LCM branch's Jacobian (non-zero within its receptive field around t). Without the LCM
  term r_h = a_h: the difference is what LCM adds (L2ViT's Figure 2).
* `emsa` (ResT `EMSA`): the row i of A = IN(softmax(Conv1x1(q k^T * scale))) per head (rows can be
  negative and do not sum to 1; IN normalises each head's whole N x N' map), or softmax(q k^T * scale) in
  single-head stages. Key grid = the reduced (ceil(H/s), ceil(W/s)) map of K / V.
* `ttt` (H-ViT3 / ViT3 `TTTAttention`): the layer has no attention matrix; its equivalent is the
  sensitivity of the query's output to each token's key and value, R_h(j) = || d o^h_i / d(k^h_j, v^h_j) ||_F,
  o^h_i the readout of head h's updated inner SwiGLU model at q_i (d values), and one more "head" for the
  depth-wise 3x3 conv inner model (o^c_i, keys / values k2, v2). The inner gradient step sums over all
  tokens, so every token has an influence; RoPE rotations do not change the norms.

Each function also returns the layer's output at the query recomputed from the same numbers (`out`), which
the tests compare with the module's own forward output.
"""
import copy
import math

import torch
import torch.nn.functional as F

from .inputs import fix_batchnorm_grad_layout

#: attention module class name -> map kind
ATTENTION_KINDS = {'WindowAttention': 'lwa', 'LinearAttention': 'lga', 'EMSA': 'emsa', 'TTTAttention': 'ttt'}


# ---- locating layers ------------------------------------------------------------------------------
def attention_layers(backbone):
    """{module name: module} of the attention layers of a backbone, found by class name."""
    return {n: m for n, m in backbone.named_modules() if type(m).__name__ in ATTENTION_KINDS}


def resolve_layer(backbone, name):
    """The attention module called `name`, or the one inside the block called `name`. Raises KeyError
    listing the valid names."""
    layers = attention_layers(backbone)
    if name in layers:
        return name, layers[name]
    inside = [n for n in layers if n.startswith(name + '.')] if name else []
    if len(inside) == 1:
        return inside[0], layers[inside[0]]
    valid = ', '.join(layers) or '(none: this backbone has no attention layer of ' + \
        '/'.join(ATTENTION_KINDS) + ')'
    raise KeyError(f'unknown layer {name!r} for {type(backbone).__name__}; valid layers (or their blocks): {valid}')


def _parent(backbone, name):
    mods = dict(backbone.named_modules())
    return mods[name.rsplit('.', 1)[0]] if '.' in name else backbone


def _lcm_of(block):
    """(norm, lcm) of an L2ViT LGA block: the LCM child (by class name) and the LayerNorm feeding it."""
    lcm = next((m for m in block.children() if type(m).__name__ == 'LCM'), None)
    norm = getattr(block, 'norm3', None)
    if lcm is None or norm is None:
        return None, None
    return norm, lcm


def capture(backbone, names, x):
    """Run backbone(x) without gradients and return {name: dict(args=..., kwargs=..., out=...)} for the
    named modules (their forward inputs and output). A module called with its pre-norm (`norm=`, which it
    applies itself, piece by piece at inference) is recorded with the normalised input, as if called on norm(x)."""
    mods = dict(backbone.named_modules())
    seen, handles = {}, []
    for n in names:
        def pre(m, args, kwargs, n=n):
            if kwargs.get('norm') is not None:
                args = (kwargs['norm'](args[0]),) + tuple(args[1:])
                kwargs = {k: v for k, v in kwargs.items() if k != 'norm'}
            seen.setdefault(n, {})['args'] = args
            seen[n]['kwargs'] = kwargs

        def post(m, args, kwargs, out, n=n):
            # a copy: the blocks add their residual into the branch output in place
            seen[n]['out'] = out.clone() if torch.is_tensor(out) else out
        handles.append(mods[n].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mods[n].register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            backbone(x)
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in seen]
    if missing:
        raise RuntimeError(f'the forward did not run {missing}')
    return seen


def _f64(module):
    """A float64 eval copy without parameter gradients, its BatchNorm backward fixed
    (`fix_batchnorm_grad_layout`)."""
    m = copy.deepcopy(module).double().eval().requires_grad_(False)
    fix_batchnorm_grad_layout(m)
    return m


def check_query(query, hw, layer=''):
    ty, tx = (int(v) for v in query)
    h, w = hw
    if not (0 <= ty < h and 0 <= tx < w):
        raise ValueError(f'query token ({ty}, {tx}) is outside the {h}x{w} token map of layer {layer!r}: '
                         f'allowed y in [0, {h - 1}], x in [0, {w - 1}]')
    return ty, tx


def _heads(t, nh):
    """(N, nh * d) -> (nh, N, d)."""
    return t.view(t.shape[0], nh, -1).transpose(0, 1)


# ---- L2ViT ----------------------------------------------------------------------------------------
def lwa_map(attn, x, hw, query):
    """LWA softmax row (see the module docstring). x: the layer's input (1, H*W, C). Returns dict(map
    (heads, H, W), padding_mass (heads,), out (C,))."""
    m = _f64(attn)
    x = x.detach().double()
    h, w = hw
    ty, tx = check_query(query, hw)
    ws, nh, c = m.window_size, m.num_heads, x.shape[-1]
    grid = F.pad(x[0].view(h, w, c), (0, 0, 0, (-w) % ws, 0, (-h) % ws))
    y0, x0 = ty // ws * ws, tx // ws * ws
    win = grid[y0:y0 + ws, x0:x0 + ws].reshape(ws * ws, c)
    q, k, v = (_heads(t, nh) for t in m.qkv(win).chunk(3, dim=-1))
    qi = (ty - y0) * ws + (tx - x0)
    logits = (q[:, qi][:, None] @ k.transpose(-2, -1))[:, 0] * m.scale          # (nh, ws*ws)
    rr, cc = torch.meshgrid(torch.arange(ws) + y0, torch.arange(ws) + x0, indexing='ij')
    valid = ((rr < h) & (cc < w)).reshape(-1)
    if m.mask_padding:
        logits = logits.masked_fill(~valid, float('-inf'))
    p = logits.softmax(dim=-1)
    out = m.proj((p[:, :, None] * v).sum(1).reshape(c))
    full = x.new_zeros(nh, grid.shape[0], grid.shape[1])
    full[:, y0:y0 + ws, x0:x0 + ws] = p.view(nh, ws, ws)
    return dict(map=full[:, :h, :w], padding_mass=p[:, ~valid].sum(-1), out=out)


def _lga_rows(m, x, rows):
    """Implicit rows a_h(i, .) of a float64 LinearAttention `m` for token indices `rows`: (nh, len, N),
    and the values (nh, N, d)."""
    nh = m.num_heads
    q, k, v = (_heads(t, nh) for t in m.qkv(x[0]).chunk(3, dim=-1))
    qr, kr = q[:, rows].relu(), k.relu()
    denom = torch.clamp(qr @ kr.sum(dim=1)[:, :, None], min=m.clamp_min)      # (nh, len, 1)
    return (qr @ kr.transpose(-2, -1)) * m.temperature / denom, v


def lga_map(attn, x, hw, query):
    """ReLU linear attention row before LCM. Returns dict(map (heads, H, W), out (C,))."""
    m = _f64(attn)
    ty, tx = check_query(query, hw)
    i = ty * hw[1] + tx
    a, v = _lga_rows(m, x.detach().double(), [i])
    out = m.proj(torch.einsum('hn,hnd->hd', a[:, 0], v).reshape(-1))
    return dict(map=a[:, 0].view(-1, *hw), out=out)


def lga_lcm_map(attn, norm, lcm, x, x_mid, hw, query, generic=False):
    """The LGA row after the LCM branch (module docstring). x: the attention input (1, N, C); x_mid: the
    block state x' feeding `norm` -> `lcm` (1, N, C). Returns dict(map (heads, H, W), before (heads, H, W),
    out (C,) = u_i = x'_i + LCM(LN3(x'))_i)."""
    m, norm, lcm = _f64(attn), _f64(norm), _f64(lcm)
    h, w = hw
    ty, tx = check_query(query, hw)
    r = sum(conv.kernel_size[0] // 2 for conv in (lcm.conv1, lcm.conv2))   # LCM receptive radius
    y0, y1, x0, x1 = max(0, ty - r), min(h, ty + r + 1), max(0, tx - r), min(w, tx + r + 1)
    rows = [yy * w + xx for yy in range(y0, y1) for xx in range(x0, x1)]
    a, _ = _lga_rows(m, x.detach().double(), rows)                             # (nh, P, N)
    c = x_mid.shape[-1]
    xm = x_mid.detach().double()[0].view(h, w, c)[y0:y1, x0:x1].reshape(-1, c)
    # the crop holds the whole receptive field of the query's LCM output; at the map border the crop border
    # is the map border, so the convolutions' zero padding is the model's
    crop_hw, iq = (y1 - y0, x1 - x0), (ty - y0) * (x1 - x0) + (tx - x0)
    wp = m.proj.weight                                                         # (C, C): y = W o + b
    t = _lcm_traces(norm, lcm, xm, crop_hw, iq, wp, generic)                   # (C, P): w_k^T M_ip w_k
    with torch.no_grad():
        u_i = xm[iq] + lcm(norm(xm)[None], crop_hw)[0, iq]
    nh = m.num_heads
    d = c // nh
    coef = t.view(nh, d, -1).sum(1) / wp.view(c, nh, d).square().sum(dim=(0, 2))[:, None]
    coef[:, iq] += 1
    after = torch.einsum('hp,hpn->hn', coef, a)
    return dict(map=after.view(nh, h, w), before=a[:, rows.index(ty * w + tx)].view(nh, h, w), out=u_i)


def _depthwise_lcm(norm, lcm):
    convs = [m for m in lcm.children() if isinstance(m, torch.nn.Conv2d)]
    return (isinstance(norm, torch.nn.LayerNorm) and len(convs) == 2
            and all(cv.groups == cv.in_channels == cv.out_channels for cv in convs)
            and all(isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d)) for m in lcm.children()))


def _lcm_traces(norm, lcm, xm, crop_hw, iq, wp, generic=False):
    """t[k, p] = w_k^T M_ip w_k, M_ip = d LCM(LN(x'))_i / d x'_p on the crop xm (P, C), w_k = proj column k.

    LCM is channel-wise (depth-wise convs, GELU, BN), so d LCM_i / d s_p = diag(D_p) with D from one
    backward pass, and the LayerNorm's Jacobian is diag(gamma / sigma) (I - 1 1^T / C - xh xh^T / C):
    closed form. `generic=True` (or another LCM) takes one vector-Jacobian product per column instead."""
    c = xm.shape[-1]
    with torch.enable_grad():
        if generic or not _depthwise_lcm(norm, lcm):
            xg = xm.detach().requires_grad_()
            g = lcm(norm(xg)[None], crop_hw)[0, iq]
            return torch.stack([torch.autograd.grad(g @ wk, xg, retain_graph=True)[0] @ wk for wk in wp.T])
        s = norm(xm).detach().requires_grad_()
        (dg,) = torch.autograd.grad(lcm(s[None], crop_hw)[0, iq].sum(), s)       # (P, C): D_p
    sig = torch.sqrt(xm.var(dim=-1, unbiased=False, keepdim=True) + norm.eps)
    xh = (xm - xm.mean(dim=-1, keepdim=True)) / sig
    a = dg * norm.weight / sig
    t = a @ wp.square() - (a @ wp) * wp.sum(0) / c - ((a * xh) @ wp) * (xh @ wp) / c
    return t.T


# ---- ResT -----------------------------------------------------------------------------------------
def emsa_map(attn, x, hw, query, chunk_elems=2 ** 22):
    """EMSA's attention row after head mixing and instance norm. Returns dict(map (heads, h', w') over the
    reduced key grid, reduction (s), out (C,))."""
    m = _f64(attn)
    x = x.detach().double()
    h, w = hw
    ty, tx = check_query(query, hw)
    n, c = x.shape[1], x.shape[2]
    nh = m.num_heads
    q = _heads(m.q(x[0]), nh)
    if m.sr_ratio > 1:
        red = m.sr(x[0].T.reshape(1, c, h, w))
        hr, wr = red.shape[-2:]
        xr = m.sr_norm(red.flatten(2)[0].T)
    else:
        (hr, wr), xr = hw, x[0]
    k, v = (_heads(t, nh) for t in m.kv(xr).chunk(2, dim=-1))
    nk = k.shape[1]

    def probs(sl):
        s = (q[:, sl] @ k.transpose(-2, -1)) * m.scale
        if m.apply_transform:
            conv = m.transform_conv
            s = torch.einsum('gh,hnm->gnm', conv.weight[:, :, 0, 0], s) + conv.bias[:, None, None]
        return s.softmax(dim=-1)

    i = ty * w + tx
    row = probs(slice(i, i + 1))[:, 0]
    if m.apply_transform:
        # IN over each head's whole N x N' map; its mean is exactly 1/N' (every row sums to one), so the
        # variance is accumulated from P - 1/N' without cancellation
        step = max(1, chunk_elems // (nh * nk))
        ssq = sum(((probs(slice(s, s + step)) - 1 / nk) ** 2).sum(dim=(1, 2)) for s in range(0, n, step))
        row = (row - 1 / nk) / torch.sqrt(ssq / (n * nk) + m.transform_norm.eps)[:, None]
    out = m.proj(torch.einsum('hm,hmd->hd', row, v).reshape(-1))
    return dict(map=row.view(nh, hr, wr), reduction=m.sr_ratio, out=out)


# ---- H-ViT3 / ViT3 --------------------------------------------------------------------------------
def ttt_map(attn, x, hw, query, rope=None):
    """Sensitivity of the TTT output at the query to every token's key and value (module docstring).
    Returns dict(map (heads + 1, H, W): the SwiGLU heads, then the conv head; out (C,))."""
    from mmplugin_l2.models.layers import apply_rope, dwconv_inner_grad, swiglu_inner_grads
    m = _f64(attn)
    x = x.detach().double()
    h, w = hw
    ty, tx = check_query(query, hw)
    n, i = h * w, ty * w + tx
    c, nh, d = m.dim, m.num_heads, m.head_dim
    q1, k1, v1, q2, k2, v2 = m.qkv(x[0]).split([c, c, c, d, d, d], dim=-1)
    if rope is not None:
        q1, k1 = (apply_rope(t[None], rope)[0] for t in (q1, k1))
    k1, v1, k2, v2 = (t.detach().requires_grad_() for t in (k1, v1, k2, v2))
    with torch.enable_grad():
        g1, g2 = swiglu_inner_grads(_heads(k1, nh)[None], _heads(v1, nh)[None], m.w1, m.w2, m.scale)
        qi = _heads(q1[i:i + 1], nh)[None]                                       # (1, nh, 1, d)
        o1 = (qi @ (m.w1 - m.lr * g1)) * F.silu(qi @ (m.w2 - m.lr * g2))
        w3 = m.w3 - m.lr * dwconv_inner_grad(k2.view(1, h, w, d), v2.view(1, h, w, d), m.scale)
        patch = F.pad(q2.detach().T.reshape(d, h, w), (1, 1, 1, 1))[:, ty:ty + 3, tx:tx + 3]
        o2 = (w3[:, 0] * patch).sum(dim=(1, 2))
        o1 = o1.reshape(nh, d)
        # head h's output depends on head h's keys / values only (and the conv head's on k2, v2): one
        # backward pass per output channel a serves every head at once
        rel = x.new_zeros(nh + 1, n)
        for a in range(d):
            gk, gv, gk2, gv2 = torch.autograd.grad(o1[:, a].sum() + o2[a], (k1, v1, k2, v2), retain_graph=True)
            rel[:nh] += (gk.square() + gv.square()).view(n, nh, d).sum(-1).T
            rel[nh] += gk2.square().sum(-1) + gv2.square().sum(-1)
        o = torch.cat([o1.reshape(-1), o2]).detach()
    return dict(map=rel.sqrt().view(nh + 1, h, w), out=m.proj(o))


# ---- all together ---------------------------------------------------------------------------------
def layer_maps(backbone, x, layers, query_fn):
    """Maps of the named attention layers for one input.

    Args:
        x: (1, 3, H, W) input. layers: names (see `resolve_layer`).
        query_fn: callable (layer name, token map (h, w)) -> query token (ty, tx) of that layer.
    Returns: list of dict(layer, kind, hw, query, panels=[(title, map (heads, h', w'), signed)], out=dict of
    the recomputed outputs at the query, ref=dict of the module's own).
    """
    resolved = [resolve_layer(backbone, n) for n in layers]
    hooks = []
    for name, mod in resolved:
        hooks += [name] + ([name.rsplit('.', 1)[0]] if '.' in name else [])
        if type(mod).__name__ == 'LinearAttention':
            norm, lcm = _lcm_of(_parent(backbone, name))
            if lcm is not None:
                names = {id(mm): nn_ for nn_, mm in backbone.named_modules()}
                hooks += [names[id(norm)], names[id(lcm)]]
    seen = capture(backbone, list(dict.fromkeys(hooks)), x)
    names = {id(mm): nn_ for nn_, mm in backbone.named_modules()}
    results = []
    for name, mod in resolved:
        kind = ATTENTION_KINDS[type(mod).__name__]
        args, kwargs = seen[name]['args'], seen[name]['kwargs']
        xin = args[0]
        hw = tuple(args[1] if len(args) > 1 else kwargs.get('hw_shape', ()))
        if not hw and '.' in name:   # LinearAttention takes no map size: the block's
            pargs = seen[name.rsplit('.', 1)[0]]['args']
            hw = tuple(pargs[1]) if len(pargs) > 1 and len(pargs[1]) == 2 else ()
        if len(hw) != 2 or hw[0] * hw[1] != xin.shape[1]:
            raise ValueError(f'{name}: cannot tell the token map size of its input {tuple(xin.shape)}')
        query = check_query(query_fn(name, hw), hw, name)
        ref = seen[name]['out'][0, query[0] * hw[1] + query[1]].double()
        res = dict(layer=name, kind=kind, hw=hw, query=query)
        if kind == 'lwa':
            r = lwa_map(mod, xin, hw, query)
            res.update(panels=[('LWA softmax', r['map'], False)], out=dict(attn=r['out']), ref=dict(attn=ref),
                       padding_mass=r['padding_mass'])
        elif kind == 'lga':
            r = lga_map(mod, xin, hw, query)
            res.update(panels=[('LGA linear (before LCM)', r['map'], False)], out=dict(attn=r['out']),
                       ref=dict(attn=ref))
            norm, lcm = _lcm_of(_parent(backbone, name))
            if lcm is not None:
                nn_, ln_ = names[id(norm)], names[id(lcm)]
                x_mid = seen[nn_]['args'][0]
                r2 = lga_lcm_map(mod, norm, lcm, xin, x_mid, hw, query)
                i = query[0] * hw[1] + query[1]
                res['panels'].append(('LGA linear + LCM', r2['map'], True))   # signed: can be negative
                res['out']['lcm'] = r2['out']
                res['ref']['lcm'] = (x_mid[0, i] + seen[ln_]['out'][0, i]).double()
        elif kind == 'emsa':
            r = emsa_map(mod, xin, hw, query)
            res.update(panels=[('EMSA (mix + IN)' if mod.apply_transform else 'EMSA softmax', r['map'],
                                mod.apply_transform)], out=dict(attn=r['out']), ref=dict(attn=ref),
                       reduction=r['reduction'])
        else:
            rope = args[2] if len(args) > 2 else kwargs.get('rope')
            r = ttt_map(mod, xin, hw, query, rope)
            res.update(panels=[('TTT |d out / d(k, v)|', r['map'], False)], out=dict(attn=r['out']),
                       ref=dict(attn=ref))
        results.append(res)
    return results


def pixel_to_token(yx, image_hw, map_hw):
    """Pixel (y, x) of the network input -> token of a (h, w) map: the stride is the power of two nearest
    to H / h (the backbones pad the input right / bottom, so the map covers ceil(H / stride) tokens)."""
    (y, x), (hh, ww) = yx, image_hw
    if not (0 <= y < hh and 0 <= x < ww):
        raise ValueError(f'query pixel ({y}, {x}) is outside the {hh}x{ww} input: allowed y in [0, {hh - 1}], '
                         f'x in [0, {ww - 1}]')
    s = 2 ** round(math.log2(hh / map_hw[0]))
    return min(y // s, map_hw[0] - 1), min(x // s, map_hw[1] - 1), s


# ---- drawing --------------------------------------------------------------------------------------
def draw_grid(img, results, out_path, query_px, max_heads=8, title=None):
    """One PNG: a row per map (a layer, two for LGA with LCM): the input with the query, the mean over
    heads, then each head (up to `max_heads`), each map stretched over the image area its keys cover."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    rows = [(res, p) for res in results for p in res['panels']]
    ncols = 2 + min(max_heads, max(p[1].shape[0] for _, p in rows))
    fig, axes = plt.subplots(len(rows), ncols, figsize=(2.2 * ncols, 2.3 * len(rows)), squeeze=False)
    hh, ww = img.shape[:2]
    for r, (res, (name, amap, signed)) in enumerate(rows):
        amap = amap.detach().cpu().double().numpy()
        gh, gw = amap.shape[1:]
        # each key cell spans stride x stride pixels (EMSA: the reduced grid, stride * s)
        sy = 2 ** round(math.log2(hh / res['hw'][0])) * res['hw'][0] / gh
        sx = 2 ** round(math.log2(ww / res['hw'][1])) * res['hw'][1] / gw
        extent = (-0.5, gw * sx - 0.5, gh * sy - 0.5, -0.5)
        panels = [('input', None), ('mean over heads', amap.mean(0))] + \
            [(f'head {k}' if not (res['kind'] == 'ttt' and k == amap.shape[0] - 1) else 'conv head', amap[k])
             for k in range(min(max_heads, amap.shape[0]))]
        for c in range(ncols):
            ax = axes[r, c]
            ax.axis('off')
            if c >= len(panels):
                continue
            label, m = panels[c]
            ax.imshow(img, extent=(-0.5, ww - 0.5, hh - 0.5, -0.5))
            if m is not None:
                if signed and m.min() < 0:
                    lim = max(abs(m).max(), 1e-30)
                    ax.imshow(m, cmap='RdBu_r', vmin=-lim, vmax=lim, alpha=0.65, extent=extent,
                              interpolation='nearest')
                else:
                    ax.imshow(m, cmap='jet', vmin=m.min(), vmax=max(m.max(), m.min() + 1e-30), alpha=0.55,
                              extent=extent, interpolation='nearest')
            ax.set_xlim(-0.5, ww - 0.5)
            ax.set_ylim(hh - 0.5, -0.5)
            ax.plot([query_px[1]], [query_px[0]], marker='x', color='white', markersize=7, mew=2)
            ax.set_title(f'{res["layer"]}\n{name}' if c == 0 else label, fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return out_path
