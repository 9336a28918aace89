"""EMSA's attention A @ v on whole maps, plain autograd: the reference every fast path is tested against.

For q (B, h, N, d), keys k and values v (B, h, N', d), the scale d^-0.5 and (h > 1) the head-mixing 1x1 conv:

    h > 1:  A = IN(softmax(Conv1x1(q k^T * scale)))     IN: no affine, eps, over each (image, head) N x N' map
    h = 1:  A = softmax(q k^T * scale)

Conditioning. Written as above A is ill-conditioned: the softmax map P is close to uniform (1 / N' per entry),
so P - mean(P) in the instance norm cancels almost all digits (in fp32 ~1e-4 relative; under fp16 / bf16
nothing is left). The same function is computed here without that cancellation:

* softmax over N' ignores any constant per (image, head, query) added to its logits: the conv bias and
  q . mean(k) are such constants, so the logits come from centred keys k - mean(k) and without the bias,
  T = Conv1x1_nobias(q (k - mean(k))^T * scale) (`centred_keys`, `_logits`).
* every row of P sums to one, so mean(P) = 1 / N' exactly. With e = expm1(T - c) (c = 0 unless a row's
  logits reach `_EXP_LIMIT`, where the shift c keeps exp finite) and its row mean e_, the deviation from
  uniform is P - 1 / N' = (e - e_) / (N' (1 + e_)): G = (e - e_) / (1 + e_) holds it at O(|T|) scale
  (`deviation_map`), and A = G / sqrt(mean(G^2) + eps N'^2) is the instance norm of P.
* the elementwise part (expm1, means, the norm) runs in fp32 when q, k, v are fp16 / bf16; the two matmuls
  run in the input dtype. On CPU a float32 expm1 is computed in float64 chunks (`expm1`): torch's float32
  kernel there takes about 17x its exp per element, its float64 one a sixth of that, and the result is the
  correctly rounded value. Nothing depends on the autocast state, so a forward and its recomputation in
  backward see the same dtypes on every device.

The single-head form (a plain softmax) is already well-conditioned; it takes the centred keys too, and on
whole maps it is torch's fused `F.scaled_dot_product_attention` (`fused_softmax_attention`; the map is not
stored, and on CUDA one kernel computes it). In float64 both forms equal the authors' code to rounding
(tests/test_rest.py).

The helpers are shared with the fast paths. Where nothing records autograd and nothing is exported, their
elementwise steps run in place (the same values, one map-sized buffer).
"""
import torch
import torch.nn.functional as F

from ..dtypes import autocast_off, compute_dtype
from ..export import exporting

#: logits above this are shifted down per row before exp (exact: softmax is shift-invariant)
_EXP_LIMIT = 64.0


def _records(t):
    """Out-of-place ops for `t`: autograd records it, or the model is being exported."""
    return exporting() or (torch.is_grad_enabled() and t.requires_grad)


def centred_keys(k, bias=None):
    """k - mean over the keys (dim 2): the softmax is unchanged, the logits lose their common part. With
    `bias` (the head-mixing conv bias, which the softmax also ignores) the result carries a zero gradient to
    it, so that every parameter takes part in the graph (DDP without find_unused_parameters)."""
    kf = k.to(compute_dtype(k))
    kc = (kf - kf.mean(dim=2, keepdim=True)).to(k.dtype)
    if bias is not None and torch.is_grad_enabled() and bias.requires_grad:
        kc = kc + bias.sum() * 0
    return kc


def _logits(q, kc, scale, weight):
    """(q kc^T) * scale (B, h, n, N'), heads mixed by the bias-free 1x1 conv `weight` (h, h, 1, 1) when
    given, in the compute dtype."""
    s = q @ kc.transpose(-2, -1)
    cdt = compute_dtype(s)
    records = _records(s) or (weight is not None and _records(weight))
    if weight is None:
        s = s.to(cdt)
        return s * scale if records else s.mul_(scale)
    return mix_heads(head_mixing(weight, scale, cdt), s.to(cdt))


def head_mixing(weight, scale, dtype):
    """The (h, h) matrix that mixes the heads' logits: the 1x1 conv's weight (h, h, 1, 1) times the scale."""
    return weight[:, :, 0, 0].to(dtype) * scale


def mix_heads(w, s):
    """w (h, h) applied across the heads of s (B, h, n, N'): (B, h, h) @ (B, h, n * N'), the conv's sums on the
    map as it lies (no layout copy); w expanded over the batch so that the FLOP counter's matmul rule counts
    every image."""
    return torch.matmul(w.expand(s.shape[0], -1, -1), s.flatten(2)).view_as(s)


def softmax_map(q, kc, scale):
    """Single-head form: softmax((q kc^T) * scale) over the keys, (B, h, n, N') in the compute dtype."""
    s = _logits(q, kc, scale, None)
    if _records(s):
        return s.softmax(dim=-1)
    return torch.softmax(s, dim=-1, out=s)


#: elements per float64 chunk of `expm1` on CPU (1 MB, in cache)
EXPM1_CHUNK = 2 ** 17


def _expm1_through_float64(x, out=None):
    """out = expm1(x) for a float32 x on CPU (contiguous where `out` is x; `out` None: a new contiguous tensor),
    computed in float64 chunk by chunk (the result rounded once to float32: correctly rounded). torch's CPU
    kernel for float32 expm1 is slow (torch 2.14: about 17x its exp per element, as if not vectorized), its
    float64 one is not: this takes about a sixth of its time."""
    if out is None:
        x, out = x.contiguous(), torch.empty(x.shape, dtype=x.dtype)
    for xs, os in zip(x.view(-1).split(EXPM1_CHUNK), out.view(-1).split(EXPM1_CHUNK)):
        os.copy_(torch.expm1(xs.double()))
    return out


class _Expm1Float32CPU(torch.autograd.Function):
    """expm1 with torch's derivative (grad * (expm1(x) + 1), from the kept output) and the forward above."""

    @staticmethod
    def forward(ctx, x):
        y = _expm1_through_float64(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        y, = ctx.saved_tensors
        return grad * (y + 1)


def _fast_expm1(x):
    """Whether `expm1` / `expm1_` take the float64 route for x: float32 on CPU, not traced (export and
    torch.compile see torch.expm1)."""
    return x.dtype == torch.float32 and x.device.type == 'cpu' and not exporting()


def expm1(x):
    """torch.expm1(x), out of place and differentiable; float32 on CPU through float64 chunks (same values, the
    derivative as torch's)."""
    if not _fast_expm1(x):
        return torch.expm1(x)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Expm1Float32CPU.apply(x)
    return _expm1_through_float64(x)


def expm1_(x):
    """x.expm1_() (nothing records autograd); float32 on CPU through float64 chunks."""
    if _fast_expm1(x) and x.is_contiguous():
        return _expm1_through_float64(x, x)
    return x.expm1_()


def deviation_map(q, kc, scale, weight):
    """G = N' (softmax(T) - 1 / N') for the bias-free mixed logits T of q (B, h, n, d) and centred keys
    kc (B, h, N', d): (B, h, n, N') in the compute dtype, without cancellation. The rows of G sum to zero."""
    return deviation_of(_logits(q, kc, scale, weight))


def deviation_of(t):
    """G = N' (softmax(t) - 1 / N') = (e - mean(e)) / (1 + mean(e)), e = expm1(t - c) over the last dimension of
    the logits t (c: a per-row shift where a row reaches `_EXP_LIMIT`). In place on t where nothing records
    autograd."""
    c = (t.detach().amax(dim=-1, keepdim=True) - _EXP_LIMIT).clamp_min_(0)
    if _records(t):
        e = expm1(t - c)
        e_mean = e.mean(dim=-1, keepdim=True)
        return (e - e_mean) / (1 + e_mean)
    e = expm1_(t.sub_(c))
    e_mean = e.mean(dim=-1, keepdim=True)
    return e.sub_(e_mean).div_(e_mean.add_(1))


def deviation_map_backward(g, dg):
    """dT, the gradient of the mixed logits T that `deviation_map` made G (B, h, n, N') from, given dG:

        dT = (dG - mean_j(dG (1 + G))) (1 + G)

    (1 + G = N' softmax(T), so this is softmax's backward; the shift c of large rows drops out). Needs only G.
    Without autograd, in place: dg becomes dT, g becomes 1 + G."""
    a1 = g.add_(1)
    return dg.sub_((dg * a1).mean(dim=-1, keepdim=True)).mul_(a1)


def in_scale(sum_sq, count, n_keys, eps):
    """IN scale of a map from sum(G^2) over its `count` entries: (mean(G^2) + eps N'^2)^-1/2, (B, h, 1, 1)."""
    return (sum_sq / count + eps * n_keys * n_keys).rsqrt()[..., None, None]


def sum_sq(g):
    """sum(G^2) over each (image, head) map of g (B, h, n, N'): (B, h)."""
    return torch.linalg.vector_norm(g, dim=(2, 3)).square()


def apply_map(a, v, scale=None):
    """a @ v in v's dtype (a in the compute dtype), times the per-(image, head) `scale` when given. In the
    compute dtype the scale goes on the small product; otherwise on `a` first, so that the map cast to half
    precision holds the normalised O(1) values."""
    if a.dtype == v.dtype:
        out = a @ v
        return out if scale is None else out * scale.to(out.dtype)
    if scale is not None:
        a = a * scale
    return a.to(v.dtype) @ v


def fused_softmax_attention(q, kc, v):
    """Whether the single-head form softmax(q kc^T * scale) @ v runs as torch's fused
    `F.scaled_dot_product_attention` (the same function; the (B, h, N, N') map is never stored): q, kc, v of
    one dtype, and not traced by `torch.jit.trace` (the FLOPs counter's tracer counts the written-out matrix
    products, not the fused kernel; the TorchScript ONNX export keeps the written-out graph too)."""
    return q.dtype == kc.dtype == v.dtype and not torch.jit.is_tracing()


def emsa_attention_reference(q, k, v, scale, transform_conv=None, eps=1e-5, attn_drop=None):
    """A @ v on the whole (B, h, N, N') map, well-conditioned (the module docstring); the maths as written is
    `naive.emsa_attention_naive`.

    Args:
        q (Tensor): queries (B, h, N, d).
        k (Tensor): keys (B, h, N', d).
        v (Tensor): values (B, h, N', d).
        scale (float): the logits' scale.
        transform_conv (nn.Conv2d | None): the (h, h) 1x1 head-mixing conv; None: the single-head form.
        eps (float): the instance norm's eps. Default: 1e-5.
        attn_drop (nn.Module | None): dropout on A.

    Returns:
        Tensor: (B, h, N, d) in v's dtype.
    """
    with autocast_off(q.device.type):
        if transform_conv is None:
            kc = centred_keys(k)
            if attn_drop is None and fused_softmax_attention(q, kc, v):
                return F.scaled_dot_product_attention(q, kc, v, scale=scale)
            a = softmax_map(q, kc, scale)
            if attn_drop is not None:
                a = attn_drop(a)
            return apply_map(a, v)
        kc = centred_keys(k, transform_conv.bias)
        g = deviation_map(q, kc, scale, transform_conv.weight)
        r = in_scale(sum_sq(g), g.shape[2] * g.shape[3], g.shape[3], eps)
        if attn_drop is not None:
            return apply_map(attn_drop(g * r), v)
        return apply_map(g, v, r)
