"""The TTT core's compiled path (`Path` compiled: inside `with_cp` blocks under bf16 autocast on CPU): the SwiGLU heads
compiled by inductor (`ops.compiled.Compiled`), the conv head eager.

* **Halves.** With RoPE and an even head width, the qkv projection's q1 and k1 rows are taken in `rope.halves_order`
  (each head's pairs as [first members | second members]) and W1, W2's rows in the same order within a head: the
  inner models see q1 P, k1 P and P^T W for one permutation P, so z = k1 W, the inner gradient's columns (normalised
  per column, which a row permutation leaves alone) and the read-out q1 W' are those of the reference, and RoPE
  rotates halves instead of interleaved pairs (contiguous loads and stores, in forward and in backward).
  Otherwise (no RoPE, or pairs across heads) the reference's order.
* **The conv head eager**: one grouped convolution per pass (the batch folded into the groups). Compiled it would
  take the export form (nine shifted products, so that the batch stays symbolic), for which inductor generates a
  reduction over the whole map on one thread and scalar loops.
* **Static widths**: the channel sizes are static (`ops.compiled.static_sizes`), the batch and the map's sizes
  symbolic: one compile per layer width, none per image size.
"""
import functools

import torch
import torch.nn.functional as F

from ..compiled import Compiled, static_sizes
from ..rope import apply_rope_halves, halves_order, head_table, real_table
from .reference import conv_head_tokens, heads, join_heads, split_qkv, swiglu_heads, swiglu_step_readout


def swiglu_heads_halves(qkv, table, w1, w2, num_heads, scale, lr):
    """`reference.swiglu_heads` on qkv tokens whose q1 and k1 channels are in `rope.halves_order`.

    Args:
        qkv (Tensor): (B, N, 3C + 3d) tokens [q1 | k1 | v1 | q2 | k2 | v2], q1 and k1 in halves order.
        table (Tensor): RoPE's `rope.head_table` (H, N, d/2, 2).
        w1 (Tensor): SwiGLU W1 (1, H, d, d), in the reference's order (its rows are permuted here).
        w2 (Tensor): SwiGLU W2 (1, H, d, d), likewise.
        num_heads (int): SwiGLU heads H.
        scale (float): the inner loss's scale.
        lr (float): the inner learning rate.

    Returns:
        Tensor: (B, N, C), the reference's output.
    """
    d = w1.shape[-1]
    q1, k1, v1 = (heads(t, num_heads) for t in split_qkv(qkv, num_heads, d)[:3])
    q1, k1 = apply_rope_halves(q1, table), apply_rope_halves(k1, table)
    order = halves_order(d, 1).to(w1.device)
    return swiglu_step_readout(q1, k1, v1, torch.cat([w1, w2], dim=-1)[..., order, :], scale, lr)


def _widths_static(qkv, table, w1, w2, *rest):
    """The sizes a layer's width fixes static (qkv's channels, the table's heads and width, the inner weights), so
    that only the batch and the map's sizes are symbolic. The table (RoPE's real pair for the reference's order) is
    made contiguous: its view's strides would tie to the batch by duck sizing (a spurious recompile)."""
    if isinstance(table, tuple):
        table = tuple(static_sizes(t.contiguous(), [1]) for t in table)
    elif table is not None:
        static_sizes(table, [0, 2, 3])
    static_sizes(qkv, [2])
    for w in (w1, w2):
        static_sizes(w)
    return (qkv, table, w1, w2, *rest)


def _real_widths_static(qkv, rot, *rest):
    """`_widths_static` with the RoPE table as its real (cos, sin) pair (inductor has no complex kernels)."""
    return _widths_static(qkv, real_table(rot), *rest)


#: AOTAutograd's activation memory budget of the compiled core where it is not recomputed by a checkpoint (outside
#: `with_cp` blocks): it keeps about a third of what the default partition keeps and recomputes the rest inside the
#: compiled backward (docs/mixed_precision.md)
KEPT_BUDGET = 0.1
_HALVES = "the TTT core's SwiGLU heads (ops.ttt.compiled)"
_HEADS = "the TTT core's SwiGLU heads (ops.ttt.reference.swiglu_heads)"
#: `swiglu_heads_halves` compiled by inductor on first use (`ops.compiled.Compiled`), once per layer width: the
#: default partition (recomputed in backward by a checkpoint), and under `KEPT_BUDGET` (not recomputed)
compiled_swiglu_halves = Compiled(swiglu_heads_halves, _HALVES, prepare=_widths_static)
kept_swiglu_halves = Compiled(swiglu_heads_halves, _HALVES, prepare=_widths_static, memory_budget=KEPT_BUDGET)
#: `reference.swiglu_heads` compiled likewise, for heads without RoPE or with pairs across heads; the RoPE table
#: reaches it as its real (cos, sin) pair
compiled_swiglu_heads = Compiled(swiglu_heads, _HEADS, prepare=_real_widths_static)
kept_swiglu_heads = Compiled(swiglu_heads, _HEADS, prepare=_real_widths_static, memory_budget=KEPT_BUDGET)


@functools.lru_cache(maxsize=None)
def _qkv_order(c, num_heads, d):
    """The qkv projection's output rows with q1 and k1 in `rope.halves_order`: (3C + 3d,) indices."""
    order = halves_order(c, num_heads)
    return torch.cat([order, c + order, torch.arange(2 * c, 3 * c + 3 * d)])


def halves_apply(rot, d):
    """Whether the compiled path takes the halves order: RoPE's complex table, heads of width d holding whole
    pairs."""
    return torch.is_tensor(rot) and rot.is_complex() and d % 2 == 0


def _swiglu_compiled(rot, d, kept):
    """The compiled SwiGLU heads of a layer with this RoPE table and head width d: in the halves order where
    `halves_apply`, else in the reference's; the partition under `KEPT_BUDGET` with `kept`, else the default one."""
    if halves_apply(rot, d):
        return kept_swiglu_halves if kept else compiled_swiglu_halves
    return kept_swiglu_heads if kept else compiled_swiglu_heads


def kept_failed(rot, d):
    """Whether the kept partition (`KEPT_BUDGET`) of a layer with this RoPE table and head width d could not compile:
    its eager fallback would keep all that autograd through the reference keeps, so the layer takes the checkpointed
    default partition instead."""
    return _swiglu_compiled(rot, d, True).failed is not None


def compiled_qkv_tokens(x, qkv, rot, num_heads, d):
    """The qkv projection's tokens (B, N, 3C + 3d) as the compiled core takes them: q1 and k1 in `rope.halves_order`
    where `halves_apply`, else in the reference's order (the arguments of `compiled_ttt_core`; d the head width)."""
    if not halves_apply(rot, d):
        return qkv(x)
    order = _qkv_order(num_heads * d, num_heads, d).to(qkv.weight.device)
    return F.linear(x, qkv.weight[order], None if qkv.bias is None else qkv.bias[order])


def compiled_core_tokens(tokens, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, kept=False):
    """`reference.ttt_core` on the tokens of `compiled_qkv_tokens`: the SwiGLU heads compiled by inductor (in the
    halves order where `halves_apply`), the conv head eager. With `kept` the SwiGLU heads' partition under
    `KEPT_BUDGET` (for a core no checkpoint recomputes), else the default one. (B, N, C + d)."""
    d = w1.shape[-1]
    table = head_table(rot, num_heads) if halves_apply(rot, d) else rot
    y1 = _swiglu_compiled(rot, d, kept)(tokens, table, w1, w2, num_heads, scale, lr)
    return join_heads(y1, conv_head_tokens(tokens, w3, hw_shape, num_heads, scale, lr))


def compiled_ttt_core(x, qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, kept=False):
    """`reference.ttt_core(qkv(x), ...)`: the qkv projection (`compiled_qkv_tokens`), then `compiled_core_tokens`.

    Args:
        x (Tensor): tokens (B, N, C).
        qkv (nn.Linear): C -> 3C + 3d, the layer's projection.
        rot, w1, w2, w3, hw_shape, num_heads, scale, lr: as `reference.ttt_core`.
        kept (bool): the partition under `KEPT_BUDGET` (as `compiled_core_tokens`). Default: False.

    Returns:
        Tensor: (B, N, C + d), as `reference.ttt_core(qkv(x), ...)`.
    """
    tokens = compiled_qkv_tokens(x, qkv, rot, num_heads, w1.shape[-1])
    return compiled_core_tokens(tokens, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, kept)
