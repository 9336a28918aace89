"""L2ViT's linear attention (LGA). Its Local Concentration Module (LCM) is in `lcm.py`.

`LinearAttention` (the "Linear Global Attention" of L2ViT), per head h with q, k, v of shape (N, d):

    Q = ReLU(q), K = ReLU(k)                                   (kernel feature map; V stays raw)
    out_i = Q_i (K^T V) t_h / max(Q_i . sum_j K_j, 100)

* t_h is the learnable per-head multiplier `temperature` (heads, 1, 1), initialised to d^-0.5; it scales
  K^T V only, not the denominator (the paper's "s" is its reciprocal).
* The denominator is clamped from below at 100 (`clamp_min`), per head and per query token, with no eps and
  no upper bound: exactly the authors' `torch.clamp(q @ k.sum, 1e2)`. The clamp is active in practice (on
  small late-stage maps most denominators are below 100).
* K^T V and the denominator are sums over all N tokens. Under fp16 autocast they overflow at detection sizes
  (N ~ 10^5 at 1248 x 1248), so that part (from q, k, v to the normalised output) runs in float32 with
  autocast off (`fp32_reduce=True`, the default; a no-op in fp32). The authors train in fp32 only and have
  no such guard.
* Training (autograd recording) runs the same forward as one autograd function with the gradient in closed
  form (`LinearAttentionCore`): four (N, d) x (d, d) products and three elementwise passes instead of
  autograd's graph of relu / clamp / division backward nodes. Same values; gradients equal autograd's to
  float rounding (float64 gradcheck in the tests).
Tokens (B, N, C) in, (B, N, C) out; qkv = Linear(C, 3C) (bias in L2ViT), proj = Linear(C, C). q, k and v are
views of the qkv output (its backward stacks their gradients into the qkv layout in one copy); in training
`LinearAttentionCore` writes Q, K and v once in the contiguous head layout.
"""
import contextlib

import torch
import torch.nn as nn

from ..ops.dtypes import autocast_off as _autocast_off
from ..ops.export import exporting
from ..ops.memory import DEFAULT_POLICY

threshold_backward = torch.ops.aten.threshold_backward


class LinearAttentionCore(torch.autograd.Function):
    """The linear attention from q, k, v (B, heads, N, d) and the temperature t (heads, 1, 1) to the output
    (B, heads, N, d), with its gradient in closed form. With Q = ReLU(q), K = ReLU(k), s = K^T 1,
    KV = K^T v, r = Q s, den = max(r, clamp_min), out = Q (KV t) / den, and G the output's gradient:

        Gn = G / den,   dQ = Gn (KV t)^T + g s^T  with  g = -[r >= clamp_min] (Q . Gn (KV t)^T) / den,
        dKV = t Q^T Gn,  dt = sum(KV * Q^T Gn),  dK = v dKV^T + 1 (Q^T g)^T,  dv = K dKV,
        dq = dQ [q > 0],  dk = dK [k > 0]

    (the clamp passes the gradient where r >= clamp_min, as torch.clamp). Kept for backward: Q, K and v in
    the contiguous (B, heads, N, d) layout (as much as the qkv output, which is then freed), KV and r (d x d
    and N x 1). Every batched product then reads its operands in place."""

    @staticmethod
    def forward(ctx, q, k, v, temperature, clamp_min):
        # Q, K and v in the contiguous head layout, written once: q, k, v are strided views of the qkv output,
        # and torch.matmul would copy each strided operand before every batched product (ten map-sized copies
        # per layer in forward + backward). The qkv output itself is then not kept.
        qr = torch.clamp_min(q, 0, out=q.new_empty(q.shape))
        kr = torch.clamp_min(k, 0, out=k.new_empty(k.shape))
        v = v.contiguous()
        r = qr @ kr.sum(dim=-2).unsqueeze(-1)
        kv = kr.transpose(-2, -1) @ v
        out = (qr @ (kv * temperature)).div_(torch.clamp(r, min=clamp_min))
        ctx.clamp_min = clamp_min
        ctx.save_for_backward(qr, kr, v, temperature, kv, r)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, t, kv, r = ctx.saved_tensors           # q, k: Q, K (after the ReLU), contiguous like v
        with _autocast_off(grad.device.type):
            kvt = kv * t
            den = torch.clamp(r, min=ctx.clamp_min)
            gn = torch.div(grad, den, out=q.new_empty(q.shape))
            dq = gn @ kvt.transpose(-2, -1)
            g = (q * dq).sum(-1, keepdim=True).div_(den).neg_().masked_fill_(r < ctx.clamp_min, 0)
            dq.addcmul_(g, k.sum(dim=-2, keepdim=True))
            dkvt = q.transpose(-2, -1) @ gn
            dt = None
            if ctx.needs_input_grad[3]:
                dt = (dkvt * kv).sum(dim=(-2, -1), keepdim=True).sum_to_size(t.shape)
            dkv = dkvt * t
            dk = (v @ dkv.transpose(-2, -1)).add_((q.transpose(-2, -1) @ g).transpose(-2, -1))
            dv = k @ dkv
        # ReLU's backward (q, k are its outputs: the gradient passes where they are > 0)
        return threshold_backward(dq, q, 0), threshold_backward(dk, k, 0), dv, dt, None


class LinearAttention(nn.Module):
    """ReLU linear attention with a per-head learnable multiplier on K^T V and a clamped denominator.

    Args:
        dim (int): channels C. num_heads (int): heads (head_dim d = C / heads).
        qkv_bias (bool): Default: True (what L2ViT's LGA block passes).
        clamp_min (float): lower bound of the denominator. Default: 100 (the authors' 1e2).
        fp32_reduce (bool): compute K^T V, the denominator and the division in float32 with autocast off.
            Default: True.
    """

    def __init__(self, dim, num_heads, qkv_bias=True, clamp_min=100., fp32_reduce=True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'LinearAttention: dim {dim} is not divisible by num_heads {num_heads}')
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.clamp_min = clamp_min
        self.fp32_reduce = fp32_reduce
        self.temperature = nn.Parameter(torch.full((num_heads, 1, 1), head_dim ** -0.5))
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def linear_attention(self, q, k, v):
        """q, k, v (B, heads, N, d), before the feature map -> (B, heads, N, d). The authors' order:
        denominator Q (sum_j K_j); K^T V times the temperature; Q times that; divided. While autograd
        records, `LinearAttentionCore` (the same forward, a closed-form backward)."""
        if torch.is_grad_enabled() and not exporting():
            return LinearAttentionCore.apply(q, k, v, self.temperature, self.clamp_min)
        q, k = q.relu(), k.relu()
        denom = torch.clamp(q @ k.transpose(-2, -1).sum(dim=-1, keepdim=True), min=self.clamp_min)
        kv = (k.transpose(-2, -1) @ v) * self.temperature
        return (q @ kv) / denom

    #: inference on large maps in token chunks (the (B, chunk, C) tokens are the piece)
    memory_policy = DEFAULT_POLICY
    #: `forward(x, norm=norm)` computes attn(norm(x)), the norm chunk by chunk at inference
    fuses_norm = True

    def forward(self, x, norm=None):
        b, n, c = x.shape
        piece = self.memory_policy.pieces(self, x, b * n * c)
        if piece is not None:
            return self._forward_chunks(x, piece, norm)
        if norm is not None:
            x = norm(x)
        qkv = self.qkv(x)
        q, k, v = (t.transpose(1, 2) for t in qkv.view(b, n, 3, self.num_heads, c // self.num_heads).unbind(2))
        if self.fp32_reduce and qkv.dtype != torch.float64:
            with _autocast_off(x.device.type):
                out = self.linear_attention(q.float(), k.float(), v.float()).to(qkv.dtype)
        else:
            out = self.linear_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))

    def _forward_chunks(self, x, piece, norm=None):
        """Inference in token chunks, two passes. First pass, per chunk: `norm` (the pre-norm), the qkv
        product, sum_j K_j and K^T V accumulated per head, and Q = ReLU(q) written into the output buffer
        (the chunk's own rows). Second pass, per chunk: the normalised output from Q, then proj, written
        over the chunk's Q. The per-head products read strided head slices of the chunk in place (no head
        copies); only the output is map-sized. Same values as `forward` up to the summation order of the
        two sums (~1e-7 relative)."""
        b, n, c = x.shape
        nh, d = self.num_heads, c // self.num_heads
        step = max(1, piece // (b * c))
        fp32 = self.fp32_reduce and x.dtype != torch.float64
        heads = [slice(h * d, (h + 1) * d) for h in range(nh)]
        reduce_ctx = _autocast_off(x.device.type) if fp32 else contextlib.nullcontext()
        ksum, kv, out = [None] * nh, [None] * nh, None
        for i in range(0, n, step):
            t = self.qkv(x[:, i:i + step] if norm is None else norm(x[:, i:i + step]))
            if out is None:
                out = t.new_empty(b, n, c)
            torch.clamp_min(t[..., :c], 0, out=out[:, i:i + step])         # Q of this chunk
            k, v = t[..., c:2 * c].relu_(), t[..., 2 * c:]
            with reduce_ctx:
                if fp32:
                    k, v = k.float(), v.float()
                for h, sl in enumerate(heads):
                    ks, kh, vh = k[..., sl].sum(dim=1), k[..., sl].transpose(1, 2), v[..., sl]
                    if kv[h] is None:
                        ksum[h], kv[h] = ks, torch.bmm(kh, vh)
                    else:
                        ksum[h].add_(ks)
                        kv[h].baddbmm_(kh, vh)
        kvt = [kv[h] * self.temperature[h] for h in range(nh)]
        ksum = [s.unsqueeze(-1) for s in ksum]
        y = None
        for i in range(0, n, step):
            q = out[:, i:i + step]
            with reduce_ctx:
                if fp32:
                    q = q.float()
                if y is None or y.shape[1] != q.shape[1]:
                    y = q.new_empty(q.shape)
                for h, sl in enumerate(heads):
                    denom = torch.bmm(q[..., sl], ksum[h]).clamp_min_(self.clamp_min)
                    torch.div(torch.bmm(q[..., sl], kvt[h]), denom, out=y[..., sl])
            out[:, i:i + step] = self.proj(y.to(out.dtype))
        return out
