"""The TTT layer's op (H-ViT3 / ViT3): `naive` (the maths: the paper's inner step by autograd; the tests' oracle),
`step` (the inner step's formulas, shared by the rest), `reference` (the inner models on whole maps, plain
autograd), `pieces` (inference in pieces of tokens, without autograd), `train` (`TTTCore`: closed-form backward,
pieces of tokens), `compiled` (`compiled_ttt_core`: the SwiGLU heads compiled by inductor, the conv head eager).
`ttt_attention` runs the one the `Path` of `ops.dispatch.choose` names; `TTT` declares what the fast paths
support."""
import torch

from ..dispatch import CHECKPOINT, COMPILED, INFERENCE, TRAIN, Fast, Supports, recomputing
from ..export import compiling
from ..checkpoint import checkpointed
from .compiled import (compiled_core_tokens, compiled_qkv_tokens, compiled_swiglu_halves, compiled_swiglu_heads,
                       compiled_ttt_core, kept_failed, kept_swiglu_halves, kept_swiglu_heads)
from .pieces import proj_input, ttt_core_pieces, ttt_inference
from .reference import (conv_head_tokens, dwconv_inner_grad, dwconv_per_sample, join_heads, normalize_inner_grad,
                        swiglu_heads, swiglu_inner_grads, tap_sums, ttt_core)
from .train import TTTCore, ttt_core_backward

__all__ = ['TTT', 'TTTCore', 'compiled_swiglu_halves', 'compiled_swiglu_heads', 'compiled_ttt_core', 'conv_head_tokens',
           'dwconv_inner_grad', 'dwconv_per_sample', 'join_heads', 'kept_swiglu_halves', 'kept_swiglu_heads',
           'normalize_inner_grad', 'proj_input', 'swiglu_heads', 'swiglu_inner_grads', 'tap_sums', 'ttt_attention',
           'ttt_core', 'ttt_core_backward', 'ttt_core_pieces', 'ttt_inference']

#: inference in pieces / in place, any dtype; the closed-form backward in fp32 / fp64 and under fp16 autocast (its
#: products in fp16, the token sums and the inner step in fp32: more accurate than the reference there); under bf16
#: autocast and with half weights the checkpoint path (`TTTCore` recomputing by autograd): in bf16 the closed form
#: measured no faster on CPU, and its pieces' bf16-rounded token sums make the weight gradients no more accurate.
#: Under bf16 autocast on CPU, the compiled path (`compiled.compiled_core_tokens`: the SwiGLU heads' forward and
#: backward fused by inductor) instead of the checkpoint: the compiled core partitioned under a memory budget (what
#: is cheap to keep kept, the rest recomputed inside its compiled backward; `compiled.KEPT_BUDGET`), or inside a
#: `with_cp` block recomputed by the block's recomputation (no checkpoint of its own); measured faster than the eager
#: paths there. Under a whole-model torch.compile in training (any device and dtype, `fast_compile` on) the compiled
#: path's form, compiled by it
TTT = Supports(inference=Fast(), train=Fast(half='autocast', compute_dtypes=(torch.float16, torch.float32,
                                                                             torch.float64)), checkpoint=True,
               compiled=Fast(half='autocast', devices=('cpu',), compute_dtypes=(torch.bfloat16,)), traced=(COMPILED,))


def ttt_attention(x, qkv, proj, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, path):
    """The TTT layer from tokens to tokens: proj(ttt_core(qkv(x))).

    Args:
        x (Tensor): tokens (B, N, C), N = H*W.
        qkv (nn.Linear): C -> 3C + 3d.
        proj (nn.Linear): C + d -> C.
        rot (Tensor | tuple | None): the RoPE table of `rope_tables` for q1 and k1, or None.
        w1 (Tensor): SwiGLU W1 (1, H, d, d).
        w2 (Tensor): SwiGLU W2 (1, H, d, d).
        w3 (Tensor): conv-head kernel (d, 1, 3, 3).
        hw_shape (tuple[int, int]): the map's (H, W).
        num_heads (int): SwiGLU heads H.
        scale (float): the inner loss's scale.
        lr (float): the inner learning rate.
        path (Path): from `ops.dispatch.choose` with `TTT` (pieces in elements of (B, tokens, C)): 'inference'
            runs `ttt_inference` (qkv and proj inside, piece by piece), 'train' `TTTCore` with the closed-form
            backward, 'checkpoint' `TTTCore` recomputing by autograd, 'compiled' the qkv tokens
            (`compiled_qkv_tokens`) and `compiled_core_tokens` on them: under its memory budget (`kept`), or inside a
            recomputed region, under a whole-model torch.compile and where the kept partition could not compile
            (`kept_failed`) under `ops.checkpoint.checkpointed` (there the region recomputes it, or the enclosing
            compile decides), else the reference.

    Returns:
        Tensor: (B, N, C).
    """
    if path.impl == INFERENCE:
        return ttt_inference(x, qkv, proj, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, path.piece)
    if path.impl == COMPILED:
        tokens = compiled_qkv_tokens(x, qkv, rot, num_heads, w1.shape[-1])
        if compiling() or recomputing() or kept_failed(rot, w1.shape[-1]):
            y = checkpointed(lambda t: compiled_core_tokens(t, rot, w1, w2, w3, hw_shape, num_heads, scale, lr),
                             tokens)
        else:
            y = compiled_core_tokens(tokens, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, kept=True)
        return proj(proj_input(y, proj))
    args = (qkv(x), rot, w1, w2, w3, hw_shape, num_heads, scale, lr)
    if path.impl in (TRAIN, CHECKPOINT):
        y = TTTCore.apply(*args, path.piece, path.impl == TRAIN)
    else:
        y = ttt_core(*args)
    return proj(proj_input(y, proj))
