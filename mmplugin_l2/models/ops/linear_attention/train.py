"""L2ViT's linear attention, train path: the reference's forward as one autograd function with its gradient
in closed form."""
import torch

from ..dtypes import autocast_off

threshold_backward = torch.ops.aten.threshold_backward


class LinearAttentionCore(torch.autograd.Function):
    """The linear attention from q, k, v (B, heads, N, d) and the temperature t (heads, 1, 1) to the output
    (B, heads, N, d), with its gradient in closed form. With Q = ReLU(q), K = ReLU(k), s = K^T 1,
    KV = K^T v, r = Q s, den = max(r, clamp_min), out = Q (KV t) / den, and G the output's gradient:

        Gn = G / den,   dQ = Gn (KV t)^T + g s^T  with  g = -[r >= clamp_min] (Q . Gn (KV t)^T) / den,
        dKV = t Q^T Gn,  dt = sum(KV * Q^T Gn),  dK = v dKV^T + 1 (Q^T g)^T,  dv = K dKV,
        dq = dQ [q > 0],  dk = dK [k > 0]

    (the clamp passes the gradient where r >= clamp_min, as torch.clamp). Kept for backward: Q, K and v in
    the contiguous (B, heads, N, d) layout, KV and r (d x d and N x 1). Every batched product then reads its
    operands in place.

    `dtype` (None: the inputs') is the dtype everything is computed in, the output's and the gradients' before
    they are cast to the inputs' dtype: half q, k, v with `dtype=torch.float32` (the layer's `fp32_reduce`
    under autocast) compute as q.float(), k.float(), v.float() would, to the bit, and keep Q, K, v for
    backward in their half dtype (cast again there, exactly), half the bytes of fp32 copies."""

    @staticmethod
    def forward(ctx, q, k, v, temperature, clamp_min, dtype=None):
        # Q, K and v in the contiguous head layout, written once: q, k, v are strided views of the qkv output,
        # and torch.matmul would copy each strided operand before every batched product. The qkv output
        # itself is then not kept. The ReLU commutes with the cast to `dtype`: Q, K are kept in the inputs' dtype.
        qr = torch.clamp_min(q, 0, out=q.new_empty(q.shape))
        kr = torch.clamp_min(k, 0, out=k.new_empty(k.shape))
        v = v.contiguous()
        ctx.clamp_min, ctx.dtype = clamp_min, dtype or q.dtype
        kept = qr, kr, v
        qr, kr, v = (u.to(ctx.dtype) for u in kept)
        r = qr @ kr.sum(dim=-2).unsqueeze(-1)
        kv = kr.transpose(-2, -1) @ v
        out = (qr @ (kv * temperature)).div_(torch.clamp(r, min=clamp_min))
        ctx.save_for_backward(*kept, temperature, kv, r)
        return out

    @staticmethod
    def backward(ctx, grad):
        *kept, t, kv, r = ctx.saved_tensors
        q, k, v = (u.to(ctx.dtype) for u in kept)      # q, k: Q, K (after the ReLU), contiguous like v
        with autocast_off(grad.device.type):
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
        dq, dk = threshold_backward(dq, q, 0), threshold_backward(dk, k, 0)
        in_dtype = kept[0].dtype
        return dq.to(in_dtype), dk.to(in_dtype), dv.to(in_dtype), dt, None, None
