"""The TTT core without autograd: the inference path (the whole layer, in pieces of tokens) and the forward
of the train path (`train.TTTCore`, in pieces of tokens; one piece for a whole map).

Same maths as `reference.ttt_core`, with kernels that have no autograd formula: the SwiGLU derivative as
one fused kernel (`aten.silu_backward`), outputs written into their channels (`out=`), q1 and k1 rotated
by RoPE straight into contiguous heads (`rope_heads`). In pieces of tokens, two passes: the inner gradient
k^T a is a sum over the pieces (values equal the whole map's up to that summation order, ~1e-7 relative in
fp32), then the updated model is applied piece by piece; the conv head runs on the whole map (d channels).
"""
import torch
import torch.nn.functional as F

from ..dtypes import autocast_on
from ..rope import rope_heads
from ..split import split
from .reference import conv_head, fast_weights, heads, swiglu_dz, swiglu_readout, token_sum_matmul
from .step import loss_factor, update


def proj_input(y, proj):
    """The TTT core's output y (B, N, C + d) as the input of the output projection `proj`: unchanged under
    autocast (which runs `proj` in its own dtype: y is already in it, or is cast once by `proj`), else in the
    weights' dtype (half weights whose core output is fp32 after RoPE)."""
    if autocast_on(y.device.type):
        return y
    return y.to(proj.weight.dtype)


def ttt_pieces(cols, n, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, pieces, conv_tokens, target, emit):
    """The TTT core without autograd over `pieces` of tokens, two passes.

    Pass 1, piece by piece: `cols(i0, i1, 'kv')`, the piece's [k1 | v1 | q2 | k2 | v2] columns
    (B, s, 2C + 3d), RoPE on k1 (straight into contiguous heads, the layout their products take), and
    k1^T [a1 | a2] of the SwiGLU inner gradient, summed over the pieces;
    the conv-head tokens [q2 | k2 | v2] (B, N, 3d) are `conv_tokens` or, when None, gathered from the pieces.
    Then the conv head (whole map, d channels). Pass 2, piece by piece: `cols(i0, i1, 'q')` (B, s, C), RoPE,
    the updated SwiGLU model and the conv-head output, written into `target(i0, i1, like)` (a (B, s, C + d)
    tensor of `like`'s dtype), then `emit(i0, i1, y)`.

    Args:
        cols (callable): (i0, i1, 'kv' | 'q') -> the piece's qkv columns.
        n (int): tokens N = H*W.
        rot (Tensor | None): RoPE table (N, C/2) or None.
        w1 (Tensor): SwiGLU W1 (1, H, d, d).
        w2 (Tensor): SwiGLU W2 (1, H, d, d).
        w3 (Tensor): conv-head kernel (d, 1, 3, 3).
        hw_shape (tuple[int, int]): (H, W).
        num_heads (int): H.
        scale (float): the inner loss's scale.
        lr (float): the inner learning rate.
        pieces (list[Piece]): the pieces of tokens (`ops.split.split`).
        conv_tokens (Tensor | None): (B, N, 3d) conv-head tokens, or None to gather them.
        target (callable): (i0, i1, like) -> the (B, s, C + d) output view of a piece.
        emit (callable): (i0, i1, y) -> None, called with each finished piece.
    """
    h, w = hw_shape
    d = w1.shape[-1]
    c = num_heads * d

    def rope_heads_of(t, i0, i1):
        return rope_heads(t, rot[i0:i1], num_heads) if rot is not None else heads(t, num_heads)

    w12 = torch.cat([w1, w2], dim=-1)
    g = None
    gather = conv_tokens is None
    for i0, i1, _, _ in pieces:
        kv = cols(i0, i1, 'kv')
        if gather:
            if conv_tokens is None:
                conv_tokens = kv.new_empty(kv.shape[0], n, 3 * d)
            conv_tokens[:, i0:i1] = kv[..., 2 * c:]
        k1, v1 = rope_heads_of(kv[..., :c], i0, i1), heads(kv[..., c:2 * c], num_heads)
        if i0 == 0:
            w12 = fast_weights(w12, k1)
        part = token_sum_matmul(k1.transpose(-2, -1), swiglu_dz(k1 @ w12, v1, fused=True))
        g = part if g is None else g.add_(part)
    w12 = update(w12, g * loss_factor(scale, n), lr, -2)

    x2 = conv_head(*conv_tokens.unflatten(1, (h, w)).split([d, d, d], dim=-1), w3, scale, lr)
    del conv_tokens

    for i0, i1, _, _ in pieces:
        z = rope_heads_of(cols(i0, i1, 'q'), i0, i1) @ w12
        y = target(i0, i1, z)
        swiglu_readout(z, out=heads(y[..., :c], num_heads))
        y[..., c:] = x2[:, i0:i1]
        emit(i0, i1, y)


def ttt_inference(x, qkv, proj, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, piece=None):
    """The whole TTT layer without autograd, tokens (B, N, C) -> (B, N, C), in pieces of `piece` / (B C)
    tokens (None: one piece), so that no (B, N, >= C) temporary is built except the output: the qkv
    columns of each pass (`ttt_pieces`: the k1 | v1 | q2 | k2 | v2 weight rows in the first, the q1 rows
    in the second; every weight row applied once) and `proj` piece by piece.

    Args:
        x (Tensor): tokens (B, N, C).
        qkv (nn.Linear): C -> 3C + 3d.
        proj (nn.Linear): C + d -> C.
        rot (Tensor | None): RoPE table (N, C/2) or None.
        w1 (Tensor): SwiGLU W1 (1, H, d, d).
        w2 (Tensor): SwiGLU W2 (1, H, d, d).
        w3 (Tensor): conv-head kernel (d, 1, 3, 3).
        hw_shape (tuple[int, int]): (H, W).
        num_heads (int): H.
        scale (float): the inner loss's scale.
        lr (float): the inner learning rate.
        piece (int | None): elements per piece (tokens x C, the batch included); None: whole map.

    Returns:
        Tensor: (B, N, C).
    """
    b, n, _ = x.shape
    c = num_heads * w1.shape[-1]
    rows = {'q': slice(None, c), 'kv': slice(c, None)}
    out = []

    def cols(i0, i1, part):
        return F.linear(x[:, i0:i1], qkv.weight[rows[part]], None if qkv.bias is None else qkv.bias[rows[part]])

    def emit(i0, i1, y):
        y = proj(proj_input(y, proj))
        if not out:
            out.append(y.new_empty(b, n, y.shape[-1]))
        out[0][:, i0:i1] = y

    ttt_pieces(cols, n, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, split(n, piece, unit=b * c), None,
               lambda i0, i1, z: z.new_empty(b, i1 - i0, c + w1.shape[-1]), emit)
    return out[0]


def ttt_core_pieces(qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr, piece=None):
    """`reference.ttt_core` without autograd in pieces of `piece` / (B C) tokens (`ttt_pieces`; None: one
    piece): the forward of `TTTCore`. qkv (B, N, 3C + 3d) -> (B, N, C + d)."""
    b, n, _ = qkv.shape
    c = num_heads * w1.shape[-1]
    out = []

    def target(i0, i1, z):
        if not out:
            out.append(z.new_empty(b, n, c + w1.shape[-1]))
        return out[0][:, i0:i1]

    ttt_pieces(lambda i0, i1, part: qkv[:, i0:i1, :c] if part == 'q' else qkv[:, i0:i1, c:], n, rot, w1, w2,
               w3, hw_shape, num_heads, scale, lr, split(n, piece, unit=b * c), qkv[..., 3 * c:], target,
               lambda *_: None)
    return out[0]
