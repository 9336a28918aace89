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

Memory. The attention map has B * h * N * N' entries. For an 800 x 1344 image, stage 1 has
67,200 x 1,050 = 70.6 M entries per image and block. Autograd keeps one such map per stage-1 block. In
stages 2-4 it keeps three per block: the conv input, the softmax output and the IN output. Once a map has
more than `chunk_elems` entries in a step that records autograd, `emsa_attention` switches to
`ChunkedEMSAAttention`. That path runs over blocks of queries and keeps only q, k, v, the output and two
scalars per (image, head). The backward pass recomputes the maps block by block. IN needs statistics over
all queries, so it is done exactly:
* Forward: a first pass accumulates the sum of P and of P^2 for each (image, head). A second pass
  recomputes each block and normalises it with those full-map statistics.
* Backward: the IN gradient needs two more full-map sums. They come without another pass:
  sum(dA) = sum_n dout_n . sum_m v_m and sum(dA * A) = sum(dout * out).
Both paths compute the same function and differ only by float rounding (see tests/test_rest.py). Inference
(no autograd) always takes the dense path, which is bit-identical to the authors' code: nothing is kept there,
and the transient maps of one block are small next to a training step's saved tensors.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .cpe import map_to_tokens, tokens_to_map

#: default size limit of an attention map held at once: 2**22 entries = 16 MiB in fp32
DEFAULT_CHUNK_ELEMS = 2 ** 22


def attention_probs(q, k, scale, weight=None, bias=None):
    """softmax(Conv1x1((q @ k^T) * scale)) over the keys; without `weight`, plain softmax. The 1x1 conv
    over the heads is written as an einsum: the same sums, more than 10x faster than a 2-8 channel conv2d
    on CPU (the dense path keeps the conv, for bit-identical results)."""
    s = (q @ k.transpose(-2, -1)) * scale
    if weight is not None:
        s = torch.einsum('gh,bhnm->bgnm', weight[:, :, 0, 0], s) + bias[:, None, None]
    return s.softmax(dim=-1)


def _softmax(x):
    """Softmax over the last dim; written into `x` when no autograd records (same kernel, same values)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return x.softmax(dim=-1)
    return torch.softmax(x, dim=-1, out=x)


def head_mix(attn, conv):
    """The 1x1 head-mixing conv on (B, h, N, N') maps, without autograd: out_o = b_o + sum_i w_oi a_i as
    h x h fused multiply-adds over whole maps. Summed in the order oneDNN's 1x1 conv uses (bias first, then
    the inputs in order), so the values are the conv's bit for bit (checked against the authors' code), but
    4-8x faster on CPU, where oneDNN handles 2-8 channel maps poorly (2 s of a 7 s ResT-S forward)."""
    h = attn.shape[1]
    w = conv.weight[:, :, 0, 0].tolist()
    out = torch.empty_like(attn)
    for o, b in enumerate(conv.bias.tolist()):
        acc = out[:, o].fill_(b)
        for i in range(h):
            acc.add_(attn[:, i], alpha=w[o][i])
    return out


def _instance_norm(x, eps):
    """F.instance_norm (no affine, no running stats) over each (image, head) map; without autograd written
    into `x` by the same batch-norm kernel (same values, one map-sized allocation less)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return F.instance_norm(x, eps=eps)
    b, h = x.shape[:2]
    flat = x.view(1, b * h, *x.shape[2:])
    stats = x.new_empty(b * h), x.new_empty(b * h)
    torch.ops.aten.native_batch_norm.out(flat, None, None, None, None, True, 0.1, eps,
                                         out=flat, save_mean=stats[0], save_invstd=stats[1])
    return x


def naive_emsa_attention(q, k, v, scale, transform_conv=None, eps=1e-5, attn_drop=None):
    """The dense path: the whole (B, h, N, N') map at once, the authors' sequence of operations. The
    scaling (and without autograd, the softmax and the instance norm) run in place, and without autograd
    the head mixing is `head_mix`: bit-identical values, fewer map-sized allocations (the map is 280 MB in
    stage 1 at 800 x 1344)."""
    attn = (q @ k.transpose(-2, -1)).mul_(scale)   # bmm keeps no output for backward
    if transform_conv is not None:
        records = torch.is_grad_enabled() and (attn.requires_grad or transform_conv.weight.requires_grad)
        attn = _softmax(transform_conv(attn) if records else head_mix(attn, transform_conv))
        if attn.shape[-2] * attn.shape[-1] > 1:
            attn = _instance_norm(attn, eps)
        else:  # a 1 x 1 map (inputs of <= 32 px): torch refuses it, the normalised value is 0
            attn = attn - attn.detach()
    else:
        attn = _softmax(attn)
    if attn_drop is not None:
        attn = attn_drop(attn)
    return attn @ v


def _custom_fwd(fn):
    amp = getattr(torch.amp, 'custom_fwd', None)
    return amp(device_type='cuda')(fn) if amp is not None else fn


def _custom_bwd(fn):
    amp = getattr(torch.amp, 'custom_bwd', None)
    return amp(device_type='cuda')(fn) if amp is not None else fn


class ChunkedEMSAAttention(torch.autograd.Function):
    """A @ v of EMSA, computed over blocks of `rows` queries and recomputed in backward.

    Inputs: q (B, h, N, d), k and v (B, h, N', d); `weight` (h, h, 1, 1) and `bias` (h,) of the head-mixing
    conv, or None for the single-head form (softmax only); `scale`, `eps` (IN), `rows`. Output (B, h, N, d).
    """

    @staticmethod
    @_custom_fwd
    def forward(ctx, q, k, v, weight, bias, scale, eps, rows):
        n = q.shape[2]
        blocks = [slice(i, min(i + rows, n)) for i in range(0, n, rows)]
        mu = rstd = None
        if weight is None:
            out = torch.cat([attention_probs(q[:, :, b], k, scale) @ v for b in blocks], dim=2)
        else:
            # full-map IN statistics, accumulated around the exact mean of a row-stochastic map (1 / N')
            shift = 1.0 / k.shape[2]
            s1 = q.new_zeros(q.shape[:2], dtype=torch.float64)
            s2 = q.new_zeros(q.shape[:2], dtype=torch.float64)
            for b in blocks:
                p = attention_probs(q[:, :, b], k, scale, weight, bias) - shift
                s1 += p.sum(dim=(2, 3), dtype=torch.float64)
                s2 += p.square().sum(dim=(2, 3), dtype=torch.float64)
            count = n * k.shape[2]
            dev = s1 / count
            var = (s2 / count - dev.square()).clamp_min(0)
            mu = (dev + shift).to(q.dtype)[..., None, None]
            rstd = (var + eps).rsqrt().to(q.dtype)[..., None, None]
            out = torch.cat([((attention_probs(q[:, :, b], k, scale, weight, bias) - mu) * rstd) @ v
                             for b in blocks], dim=2)
        ctx.blocks, ctx.scale = blocks, scale
        ctx.save_for_backward(q, k, v, weight, bias, out, mu, rstd)
        return out

    @staticmethod
    @_custom_bwd
    def backward(ctx, dout):
        q, k, v, weight, bias, out, mu, rstd = ctx.saved_tensors
        need_q, need_k, need_v, need_w, need_b = ctx.needs_input_grad[:5]
        dout = dout.contiguous()
        dq = [] if need_q else None
        dk = torch.zeros_like(k) if need_k else None
        dv = torch.zeros_like(v) if need_v else None
        dw = torch.zeros_like(weight) if need_w else None
        db = torch.zeros_like(bias) if need_b else None
        if weight is not None:
            # IN backward: dP = rstd * (dA - mean(dA) - A * mean(dA * A)), means over each N x N' map
            count = q.shape[2] * k.shape[2]
            mean_da = (torch.einsum('bhnd,bhd->bh', dout, v.sum(dim=2)) / count)[..., None, None]
            mean_daa = ((dout * out).sum(dim=(2, 3)) / count)[..., None, None]
        kd = k.detach().requires_grad_(need_k)
        wd = weight.detach().requires_grad_(need_w) if weight is not None else None
        bd = bias.detach().requires_grad_(need_b) if bias is not None else None
        for b in ctx.blocks:
            with torch.enable_grad():
                qb = q[:, :, b].detach().requires_grad_(need_q)
                p = attention_probs(qb, kd, ctx.scale, wd, bd)
            do = dout[:, :, b]
            da = do @ v.transpose(-2, -1)
            if weight is None:
                a, dp = p.detach(), da
            else:
                a = (p.detach() - mu) * rstd
                dp = rstd * (da - mean_da - a * mean_daa)
            if need_v:
                dv += a.transpose(-2, -1) @ do
            inputs = [t for t, need in ((qb, need_q), (kd, need_k), (wd, need_w), (bd, need_b)) if need]
            if inputs:
                grads = list(torch.autograd.grad(p, inputs, dp))
                if need_q:
                    dq.append(grads.pop(0))
                if need_k:
                    dk += grads.pop(0)
                if need_w:
                    dw += grads.pop(0)
                if need_b:
                    db += grads.pop(0)
        if need_q:
            dq = torch.cat(dq, dim=2)
        return dq, dk, dv, dw, db, None, None, None


def emsa_attention(q, k, v, scale, transform_conv=None, eps=1e-5, chunk_elems=DEFAULT_CHUNK_ELEMS):
    """A @ v for q (B, h, N, d), k, v (B, h, N', d).

    When autograd records (a training step) and the map has more than `chunk_elems` entries, this is
    `ChunkedEMSAAttention` with blocks of at most that size. Otherwise, and always when `chunk_elems` is
    None, it is the dense path, which is bit-identical to the authors' code. Without autograd nothing is
    kept for backward, so the dense maps are only transient."""
    b, h, n, _ = q.shape
    n_keys = k.shape[2]
    records = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if chunk_elems is None or not records or b * h * n * n_keys <= chunk_elems:
        return naive_emsa_attention(q, k, v, scale, transform_conv, eps)
    rows = max(1, chunk_elems // (b * h * n_keys))
    weight = transform_conv.weight if transform_conv is not None else None
    bias = transform_conv.bias if transform_conv is not None else None
    return ChunkedEMSAAttention.apply(q, k, v, weight, bias, scale, eps, rows)


class EMSA(nn.Module):
    """Efficient multi-head self-attention on tokens (B, N, C) of an (H, W) map; see the module docstring.

    Args:
        dim (int): channels C. num_heads (int): h. sr_ratio (int): spatial reduction s of K and V.
        qkv_bias (bool): biases of `q` and `kv` (the ResT factories set True). Default: False.
        qk_scale (float | None): default d^-0.5.
        attn_drop (float): dropout on the attention map (0 in ResT; > 0 forces the dense path in training).
        proj_drop (float): dropout after `proj`.
        apply_transform (bool): the head-mixing conv + IN when num_heads > 1. Default: True.
        chunk_elems (int | None): maps with more entries go through `ChunkedEMSAAttention`; None: always
            dense. Default: 2**22.
    """

    def __init__(self, dim, num_heads, sr_ratio=1, qkv_bias=False, qk_scale=None, attn_drop=0., proj_drop=0.,
                 apply_transform=True, chunk_elems=DEFAULT_CHUNK_ELEMS):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'EMSA: dim {dim} is not divisible by num_heads {num_heads}')
        self.num_heads = num_heads
        self.scale = qk_scale or (dim // num_heads) ** -0.5
        self.sr_ratio = sr_ratio
        self.chunk_elems = chunk_elems
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
            out = emsa_attention(q, k, v, self.scale, conv, eps, self.chunk_elems)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, c)))
