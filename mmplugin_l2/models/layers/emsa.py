"""EMSA, ResT's efficient multi-head self-attention (Zhang & Yang, arXiv 2105.13677, Eq. 4 and the code).

For tokens x (B, N, C) of an (H, W) map, h heads of d = C / h channels, spatial reduction s:

    q    = Linear_q(x)                                 -> (B, h, N, d)
    x'   = LN(DWConv(x as a map))                      -> (B, N', C)  k = s + 1, stride s, padding s // 2
                                                          (`sr`, `sr_norm`), N' = ceil(H / s) * ceil(W / s);
                                                          with s = 1: x' = x, there is no `sr` / `sr_norm`
    k, v = Linear_kv(x')                               -> (B, h, N', d) each; output rows [0:C] are K and
                                                          [C:2C] are V, heads contiguous within each
    S    = (q @ k^T) * d^-0.5                          -> (B, h, N, N')
    h > 1:  A = IN(softmax(Conv1x1(S)))                   the 1x1 conv (`transform_conv`, with bias) mixes the
                                                          heads before the softmax over N'; the instance
                                                          norm (no affine, eps 1e-5) normalises each (image,
                                                          head) N x N' map over all of its entries, so the
                                                          rows of A no longer sum to one
    h = 1:  A = softmax(S)                                no conv and no IN, as the authors' code
    out  = Linear_proj(merge_heads(A @ v))             -> (B, N, C)

Conditioning. Written as above, A is ill-conditioned: the softmax map P is close to uniform (1 / N' per
entry), so P - mean(P) in the instance norm cancels almost all digits. In fp32 the authors' stage 2-4
outputs differ from float64 by ~1e-4 relative, a batch of two differs from one image at a time, and under
fp16 / bf16 autocast nothing of the result is left. We compute the same function in a form without that
cancellation (`deviation_map`):

* softmax over N' is invariant to any constant per (image, head, query) added to its logits. The conv bias
  is such a constant, and so is q . mean_m(k_m) (through the conv, a sum of such terms), so the logits are
  formed from centred keys k_m - mean(k) and without the bias: T = Conv1x1_nobias(q (k - k_mean)^T * scale).
  T has (exactly, up to rounding) zero mean over the keys, and no large common part cancels in q . k.
* every row of P sums to one, so mean(P) = 1 / N' exactly. With e = expm1(T - c) (c = 0 unless a row's
  logits reach 64, where c keeps exp finite) and its row mean e_, the deviation from uniform is
  P - 1 / N' = (e - e_) / (N' (1 + e_)): G = (e - e_) / (1 + e_) holds it at O(|T|) scale, computed without
  cancellation, and A = G / sqrt(mean(G^2) + eps N'^2) is the instance norm of P.
* the elementwise part (expm1, means, the norm) runs in fp32 when q, k, v are fp16 / bf16 (autocast or half
  weights); the two matmuls run in the input dtype. Nothing here depends on the autocast state, so the
  forward and the recomputation in backward see the same dtypes on every device.
The single-head form (no conv, no IN) is a plain softmax, already well-conditioned; it also takes the
centred keys. In float64 both forms equal the authors' code to rounding (tests/test_rest.py).

Memory. The attention map has B * h * N * N' entries. For an 800 x 1344 image, stage 1 has
67,200 x 1,050 = 70.6 M entries per image and block. Autograd keeps several such maps per block. Once a map
has more than twice the memory policy's `max_elems` entries in a training step (`recompute=True`, train mode,
autograd recording; `memory.MemoryPolicy.train_pieces`), `emsa_attention` switches to
`ChunkedEMSAAttention`. That path runs over blocks of queries and keeps only q, k, v, the output and one
scalar per (image, head), and the backward pass recomputes the maps block by block. The rows of G are
independent, so only the IN scale needs all queries:
* Forward (`blocked_emsa_attention`): one pass accumulates sum(G^2) for each (image, head) and the unscaled
  products G @ v; the full-map scale r = (mean(G^2) + eps N'^2)^-1/2 then multiplies the output (A @ v is
  linear in A and r is one number per map).
* Backward: dG = r (dA - A mean(dA * A)), and the full-map mean comes without another pass:
  sum(dA * A) = sum(dout * out).
Both paths compute the same function and differ only by float rounding (see tests/test_rest.py).
Inference (eval mode, no autograd, on the policy's devices; `memory.MemoryPolicy.pieces`) runs
`blocked_emsa_attention` over the same blocks, its elementwise steps in place: a block's map stays in cache
instead of going through memory once per elementwise step. In half precision the forward takes two passes
(the map is scaled before its cast to the half dtype). Without pieces (e.g. on CUDA by default) inference
takes the dense path, also in place.
"""
import torch
import torch.nn as nn

from ..ops.dtypes import autocast_off, compute_dtype
from ..ops.export import exporting
from ..ops.memory import DEFAULT_POLICY, recomputes
from .tokens import map_to_tokens, tokens_to_map

#: logits above this are shifted down per row before exp (exact: softmax is shift-invariant)
_EXP_LIMIT = 64.0


def _records(t):
    """Out-of-place ops for `t`: autograd records it, or the model is being exported (no in-place tricks in a
    traced graph)."""
    return exporting() or (torch.is_grad_enabled() and t.requires_grad)


def centred_keys(k, bias=None):
    """k - mean over the keys (dim 2): softmax(q k^T) is unchanged, the logits lose their common part.
    With `bias` (the head-mixing conv bias, which the softmax also ignores) the result carries a zero
    gradient to it, so that every parameter takes part in the graph (DDP without find_unused_parameters)."""
    kf = k.to(compute_dtype(k))
    kc = (kf - kf.mean(dim=2, keepdim=True)).to(k.dtype)
    if bias is not None and torch.is_grad_enabled() and bias.requires_grad:
        kc = kc + bias.sum() * 0
    return kc


def _logits(q, kc, scale, weight):
    """(q kc^T) * scale, heads mixed by the bias-free 1x1 conv `weight` (h, h, 1, 1) when given, in the
    compute dtype. Without autograd the scaling and the cast happen in place where they can."""
    s = q @ kc.transpose(-2, -1)
    cdt = compute_dtype(s)
    records = _records(s) or (weight is not None and _records(weight))
    if weight is None:
        s = s.to(cdt)
        return s * scale if records else s.mul_(scale)
    w = weight[:, :, 0, 0].to(cdt) * scale
    # (B, h, h) @ (B, h, n * N'): the sums of the 1x1 conv, on the map's memory as it lies (no layout copy;
    # w expanded over the batch so that the FLOP counter's matmul rule counts every image)
    s = s.to(cdt)
    return torch.matmul(w.expand(s.shape[0], -1, -1), s.flatten(2)).view_as(s)


def softmax_map(q, kc, scale):
    """Single-head form: softmax((q kc^T) * scale) over the keys, in the compute dtype."""
    s = _logits(q, kc, scale, None)
    if _records(s):
        return s.softmax(dim=-1)
    return torch.softmax(s, dim=-1, out=s)


def deviation_map(q, kc, scale, weight):
    """G = N' (softmax(T) - 1 / N') for the bias-free mixed logits T of q (B, h, n, d) and centred keys
    kc (B, h, N', d), in the compute dtype: (B, h, n, N'), computed without cancellation (module
    docstring). The rows of G sum to zero."""
    t = _logits(q, kc, scale, weight)
    c = (t.detach().amax(dim=-1, keepdim=True) - _EXP_LIMIT).clamp_min_(0)
    if _records(t):
        e = torch.expm1(t - c)
        e_mean = e.mean(dim=-1, keepdim=True)
        return (e - e_mean) / (1 + e_mean)
    e = t.sub_(c).expm1_()
    e_mean = e.mean(dim=-1, keepdim=True)
    return e.sub_(e_mean).div_(e_mean.add_(1))


def _in_scale(sum_sq, count, n_keys, eps):
    """IN scale of a map from sum(G^2) over its `count` entries: (mean(G^2) + eps N'^2)^-1/2, (B, h, 1, 1)."""
    return (sum_sq / count + eps * n_keys * n_keys).rsqrt()[..., None, None]


def _sum_sq(g):
    return torch.linalg.vector_norm(g, dim=(2, 3)).square()


def _apply(a, v, scale=None):
    """a @ v in v's dtype (a in the compute dtype), times the per-(image, head) `scale` when given. In the
    compute dtype the scale goes on the small product; otherwise on `a` first, so that the map cast to
    half precision holds the normalised O(1) values."""
    if a.dtype == v.dtype:
        out = a @ v
        return out if scale is None else out * scale.to(out.dtype)
    if scale is not None:
        a = a * scale
    return a.to(v.dtype) @ v


def naive_emsa_attention(q, k, v, scale, transform_conv=None, eps=1e-5, attn_drop=None):
    """The dense path: the whole (B, h, N, N') map at once. Without autograd its elementwise steps run in
    place (the map is 280 MB in stage 1 at 800 x 1344)."""
    with autocast_off(q.device.type):
        if transform_conv is None:
            a = softmax_map(q, centred_keys(k), scale)
            if attn_drop is not None:
                a = attn_drop(a)
            return _apply(a, v)
        kc = centred_keys(k, transform_conv.bias)
        g = deviation_map(q, kc, scale, transform_conv.weight)
        r = _in_scale(_sum_sq(g), g.shape[2] * g.shape[3], g.shape[3], eps)
        if attn_drop is not None:
            return _apply(attn_drop(g * r), v)
        return _apply(g, v, r)


def _blocks(n, rows):
    return [slice(i, min(i + rows, n)) for i in range(0, n, rows)]


def blocked_emsa_attention(q, kc, v, weight, scale, eps, blocks):
    """A @ v over the query `blocks` (slices of N), without autograd: the forward of `ChunkedEMSAAttention`
    and the inference pieces. q (B, h, N, d), centred keys kc and v (B, h, N', d), `weight` (h, h, 1, 1) of
    the head-mixing conv or None (single head); kc and v contiguous (`emsa_attention` makes them so: a strided
    view would be copied in every block's matmul). Returns the output (B, h, N, d) in v's dtype and the IN
    scale r (B, h, 1, 1) in the compute dtype (None for a single head).

    One pass when the map's compute dtype is v's (fp32 / fp64): r is applied to the output at the end. In
    half precision a first pass accumulates sum(G^2), a second applies r to each block before its cast."""
    n, n_keys = q.shape[2], kc.shape[2]
    out = v.new_empty(q.shape[:3] + v.shape[3:])
    with autocast_off(q.device.type):
        if weight is None:
            for b in blocks:
                out[:, :, b] = _apply(softmax_map(q[:, :, b], kc, scale), v)
            return out, None
        one_pass = compute_dtype(v) == v.dtype
        sum_sq = 0
        for b in blocks:
            g = deviation_map(q[:, :, b], kc, scale, weight)
            sum_sq = sum_sq + _sum_sq(g)
            if one_pass:
                out[:, :, b] = g @ v
        r = _in_scale(sum_sq, n * n_keys, n_keys, eps)
        if one_pass:
            return out.mul_(r.to(out.dtype)), r
        for b in blocks:
            out[:, :, b] = _apply(deviation_map(q[:, :, b], kc, scale, weight), v, r)
    return out, r


class ChunkedEMSAAttention(torch.autograd.Function):
    """A @ v of EMSA, computed over blocks of `rows` queries and recomputed in backward.

    Inputs: q (B, h, N, d), centred keys kc and values v (B, h, N', d); `weight` (h, h, 1, 1) of the
    head-mixing conv (its bias does not change A), or None for the single-head form (softmax only);
    `scale`, `eps` (IN), `rows`. Output (B, h, N, d) in v's dtype.
    """

    @staticmethod
    def forward(ctx, q, kc, v, weight, scale, eps, rows):
        blocks = _blocks(q.shape[2], rows)
        out, r = blocked_emsa_attention(q, kc, v, weight, scale, eps, blocks)
        ctx.blocks, ctx.scale = blocks, scale
        ctx.save_for_backward(q, kc, v, weight, out, r)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kc, v, weight, out, r = ctx.saved_tensors
        need_q, need_k, need_v, need_w = ctx.needs_input_grad[:4]
        cdt = compute_dtype(q)
        dout = dout.contiguous()
        vc = v.to(cdt)
        dq = [] if need_q else None
        dk = torch.zeros_like(kc, dtype=cdt) if need_k else None
        dv = torch.zeros_like(v, dtype=cdt) if need_v else None
        dw = torch.zeros_like(weight) if need_w else None
        if weight is not None:
            # IN backward: dG = r (dA - A mean(dA * A)), with sum(dA * A) = sum(dout * out)
            count = q.shape[2] * kc.shape[2]
            mean_daa = ((dout.to(cdt) * out.to(cdt)).sum(dim=(2, 3)) / count)[..., None, None]
        kd = kc.detach().requires_grad_(need_k)
        wd = weight.detach().requires_grad_(need_w) if weight is not None else None
        with autocast_off(q.device.type):
            for b in ctx.blocks:
                with torch.enable_grad():
                    qb = q[:, :, b].detach().requires_grad_(need_q)
                    p = softmax_map(qb, kd, ctx.scale) if weight is None else deviation_map(qb, kd, ctx.scale, wd)
                do = dout[:, :, b].to(cdt)
                da = do @ vc.transpose(-2, -1)
                if weight is None:
                    a, dp = p.detach(), da
                else:
                    a = p.detach() * r
                    dp = r * (da - a * mean_daa)
                if need_v:
                    dv += a.transpose(-2, -1) @ do
                inputs = [t for t, need in ((qb, need_q), (kd, need_k), (wd, need_w)) if need]
                if inputs:
                    grads = list(torch.autograd.grad(p, inputs, dp))
                    if need_q:
                        dq.append(grads.pop(0))
                    if need_k:
                        dk += grads.pop(0)
                    if need_w:
                        dw += grads.pop(0)
        if need_q:
            dq = torch.cat(dq, dim=2)
        if need_v:
            dv = dv.to(v.dtype)
        if need_k:
            dk = dk.to(kc.dtype)
        return dq, dk, dv, dw, None, None, None


def emsa_attention(q, k, v, scale, transform_conv=None, eps=1e-5, piece=None):
    """A @ v for q (B, h, N, d), k, v (B, h, N', d).

    With `piece` (entries of the map per block of queries): `ChunkedEMSAAttention` while autograd records,
    else `blocked_emsa_attention` (one pass over the blocks, nothing kept). Without `piece` it is the dense
    path."""
    b, h, n, _ = q.shape
    n_keys = k.shape[2]
    if piece is None:
        return naive_emsa_attention(q, k, v, scale, transform_conv, eps)
    rows = max(1, piece // (b * h * n_keys))
    weight = transform_conv.weight if transform_conv is not None else None
    records = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, weight) if t is not None)
    kc = centred_keys(k, transform_conv.bias if transform_conv is not None and records else None)
    # contiguous once here (also what the training function keeps), not copied in every block's matmul
    kc, v = kc.contiguous(), v.contiguous()
    if not records:
        return blocked_emsa_attention(q, kc, v, weight, scale, eps, _blocks(n, rows))[0]
    return ChunkedEMSAAttention.apply(q, kc, v, weight, scale, eps, rows)


class EMSA(nn.Module):
    """Efficient multi-head self-attention on tokens (B, N, C) of an (H, W) map; see the module docstring.

    Args:
        dim (int): channels C. num_heads (int): h. sr_ratio (int): spatial reduction s of K and V.
        qkv_bias (bool): biases of `q` and `kv` (the ResT factories set True). Default: False.
        qk_scale (float | None): default d^-0.5.
        attn_drop (float): dropout on the attention map (0 in ResT; > 0 forces the dense path in training).
        proj_drop (float): dropout after `proj`.
        apply_transform (bool): the head-mixing conv + IN when num_heads > 1. Default: True.
        recompute (bool): in training, large maps go through `ChunkedEMSAAttention` (blocks of queries,
            recomputed in backward; sizes from the memory policy). False: always dense. Default: True.
    """

    #: the block size of `ChunkedEMSAAttention` in training
    memory_policy = DEFAULT_POLICY

    def __init__(self, dim, num_heads, sr_ratio=1, qkv_bias=False, qk_scale=None, attn_drop=0., proj_drop=0.,
                 apply_transform=True, recompute=True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'EMSA: dim {dim} is not divisible by num_heads {num_heads}')
        self.num_heads = num_heads
        self.scale = qk_scale or (dim // num_heads) ** -0.5
        self.sr_ratio = sr_ratio
        self.recompute = recompute
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio + 1, stride=sr_ratio, padding=sr_ratio // 2,
                                groups=dim)
            self.sr_norm = nn.LayerNorm(dim)
        self.apply_transform = apply_transform and num_heads > 1
        if self.apply_transform:
            self.transform_conv = nn.Conv2d(num_heads, num_heads, kernel_size=1)
            self.transform_norm = nn.InstanceNorm2d(num_heads)  # no parameters, no running statistics

    def forward(self, x, hw_shape):
        b, n, c = x.shape
        h = self.num_heads
        q = self.q(x).reshape(b, n, h, c // h).permute(0, 2, 1, 3)
        if self.sr_ratio > 1:
            x = self.sr_norm(map_to_tokens(self.sr(tokens_to_map(x, hw_shape))))
        k, v = self.kv(x).reshape(b, -1, 2, h, c // h).permute(2, 0, 3, 1, 4)
        conv = self.transform_conv if self.apply_transform else None
        eps = self.transform_norm.eps if self.apply_transform else 1e-5
        if self.attn_drop.p > 0 and self.training:  # a random mask cannot be recomputed: dense path
            out = naive_emsa_attention(q, k, v, self.scale, conv, eps, self.attn_drop)
        else:
            n_map = b * h * n * k.shape[2]
            if recomputes(self):
                piece = self.memory_policy.train_pieces(n_map)
            else:
                piece = self.memory_policy.pieces(self, x, n_map)
            out = emsa_attention(q, k, v, self.scale, conv, eps, piece)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, c)))
