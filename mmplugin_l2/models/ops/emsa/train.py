"""EMSA's train path: A @ v over pieces of queries, recomputed piece by piece in backward.

Kept for backward: q, the centred keys, v, the output (in the compute dtype: fp32 for half inputs) and one
scalar per (image, head) (the IN scale r); no map-sized tensor. Under bf16, dA = dout v^T is a bf16 product, as
the reference's; the other products of the backward sum over pieces and stay in the compute dtype. Backward of the
instance norm: dG = r (dA - A mean(dA * A)), where the whole map's mean comes without another pass,
sum(dA * A) = sum(dout * out). The deviation map G is recomputed without autograd and its own backward is in
closed form (`reference.deviation_map_backward`: dT = (dG - mean(dG (1 + G))) (1 + G), from G alone, in place),
then the head mixing's and the logits' products as autograd would take them (the logits' in q's dtype). The
single-head form's softmax map keeps autograd (one fused backward kernel).
"""
import torch

from ..dtypes import autocast_off, compute_dtype
from .pieces import emsa_in_pieces, query_pieces
from .reference import deviation_map_backward, deviation_of, head_mixing, mix_heads, softmax_map


class EMSAPiecesFunction(torch.autograd.Function):
    """A @ v of EMSA in pieces of queries, recomputed in backward.

    Inputs: q (B, h, N, d), centred keys kc and values v (B, h, N', d), contiguous; `weight` (h, h, 1, 1) of
    the head-mixing conv (its bias does not change A), or None for the single-head form; `scale`, `eps` (IN),
    `piece` (entries of the attention map per piece, `ops.split`). Output (B, h, N, d) in v's dtype.
    """

    @staticmethod
    def forward(ctx, q, kc, v, weight, scale, eps, piece):
        pieces = query_pieces(q, kc.shape[2], piece)
        # the output in the compute dtype is kept: the instance norm's backward needs sum(dout * out)
        out, r = emsa_in_pieces(q, kc, v, weight, scale, eps, pieces, dtype=compute_dtype(v))
        ctx.pieces, ctx.scale = pieces, scale
        ctx.save_for_backward(q, kc, v, weight, out, r)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, kc, v, weight, out, r = ctx.saved_tensors
        need_q, need_k, need_v, need_w = ctx.needs_input_grad[:4]
        cdt = compute_dtype(q)
        dout = dout.contiguous()
        # dA = dout v^T in bf16 where v is bf16, as the reference's autograd takes it under bf16 autocast (dout and v
        # hold bf16 values, the product is rounded once, then used in fp32): on CPU a bf16 product runs on the
        # matrix unit, several times the fp32 one's rate. fp16 keeps fp32 (its range; CPUs lack an fp16 unit).
        bf16 = v.dtype == torch.bfloat16 and cdt != v.dtype
        vc = None if bf16 else v.to(cdt)
        dq = [] if need_q else None
        dk = torch.zeros_like(kc, dtype=cdt) if need_k else None
        dv = torch.zeros_like(v, dtype=cdt) if need_v else None
        dw = torch.zeros_like(weight) if need_w else None
        if weight is not None:
            count = q.shape[2] * kc.shape[2]
            mean_daa = ((dout.to(cdt) * out).sum(dim=(2, 3)) / count)[..., None, None]
        if weight is None:
            kd = kc.detach().requires_grad_(need_k)
        else:
            w = head_mixing(weight, ctx.scale, cdt)
        with autocast_off(q.device.type):
            for p in ctx.pieces:
                do = dout[:, :, p].to(cdt)
                da = (dout[:, :, p].to(v.dtype) @ v.transpose(-2, -1)).to(cdt) if bf16 else do @ vc.transpose(-2, -1)
                if weight is None:      # the softmax map: its backward by autograd (one fused kernel)
                    with torch.enable_grad():
                        qp = q[:, :, p].detach().requires_grad_(need_q)
                        m = softmax_map(qp, kd, ctx.scale)
                    a = m.detach()
                else:                   # the deviation map G, recomputed without autograd
                    qp = q[:, :, p]
                    s = (qp @ kc.transpose(-2, -1)).to(cdt)
                    g = deviation_of(mix_heads(w, s))
                    a = g * r
                if need_v:
                    dv += a.transpose(-2, -1) @ do
                if weight is None:
                    inputs = [t for t, need in ((qp, need_q), (kd, need_k)) if need]
                    grads = list(torch.autograd.grad(m, inputs, da)) if inputs else []
                    dq_p = grads.pop(0) if need_q else None
                    dk_p = grads.pop(0) if need_k else None
                else:       # G's backward in closed form, then the head mixing's and the logits' products
                    dt = deviation_map_backward(g, (da - a * mean_daa).mul_(r))
                    if need_w:
                        dw += (dt.flatten(2) @ s.flatten(2).transpose(-2, -1)).sum(0)[..., None, None] * ctx.scale
                    ds = mix_heads(w.t(), dt).to(q.dtype) if need_q or need_k else None
                    dq_p = ds @ kc if need_q else None
                    dk_p = ds.transpose(-2, -1) @ qp if need_k else None
                if need_q:
                    dq.append(dq_p)
                if need_k:
                    dk += dk_p
        if need_q:
            dq = torch.cat(dq, dim=2)
        if need_v:
            dv = dv.to(v.dtype)
        if need_k:
            dk = dk.to(kc.dtype)
        return dq, dk, dv, dw, None, None, None
