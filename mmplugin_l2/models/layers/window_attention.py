"""Local window attention (W-MSA, as Swin without shift), L2ViT's "Local Window Attention" (LWA).

The token map (B, N = H*W, C) is zero-padded right/bottom to multiples of the window size w, cut into
non-overlapping w x w windows; inside each window, with q, k, v = Linear(C, 3C) of its w*w tokens,

    out = Linear_proj(merge_heads(softmax(q k^T * d^-0.5) v))

and the windows are put back and cropped to H x W: (B, N, C) in, (B, N, C) out. The maths:
`ops/window_attention/naive.py` (`window_attention_naive` window by window, `window_msa_naive` the explicit
softmax).

* No relative position bias and no shift (L2ViT's CPE replaces the bias); keys `qkv.*`, `proj.*` (the
  authors' layout).
* Padding, the authors' way (default): padded positions enter the attention as the zero vector, so their
  keys/values are the qkv bias and they take part in the softmax of border windows (like Swin's unshifted
  W-MSA). `mask_padding=True` instead masks the padded keys out (-inf before the softmax): the result then
  does not depend on how much padding a border window gets, but no longer equals the authors' numbers at
  sizes that are not multiples of w. Every window holds at least one real token (padding < w).
* The softmax attention is torch's fused `F.scaled_dot_product_attention`: the (nW, heads, w*w, w*w)
  probability matrix is never stored. It equals the explicit softmax(q k^T * scale) v to float rounding.
  Above `MAX_SDPA_BATCH_HEADS` (windows of all images) x heads, CUDA's launch limit, the windows go through
  it in consecutive slices (`ops.window_attention.sdpa_in_slices`; L2ViT-T at 2048x2048, batch 8: 43808
  windows x 3 heads in stage 1). Training on CPU in bf16 / fp16 runs the kernel in fp32 on the half q, k, v
  (`ops.window_attention.WINDOW_ATTENTION`).

The windowing is the op `ops.window_attention` (the whole map, or pieces of window rows at inference),
chosen once per forward by `ops.dispatch.choose`.
"""
import torch.nn as nn

from ..ops import choose
from ..ops.checkpoint import output_product
from ..ops.export import exporting
from ..ops.memory import DEFAULT_POLICY
from ..ops.window_attention import (WINDOW_ATTENTION, padding_key_mask, sdpa_in_slices, window_attention,
                                    window_partition, window_reverse)
from ..ops.tokens import padding_to_multiple

__all__ = ['WindowAttention', 'padding_key_mask', 'window_partition', 'window_reverse']


class WindowAttention(nn.Module):
    """Multi-head softmax attention inside non-overlapping w x w windows of a token map.

    Args:
        dim (int): channels C.
        num_heads (int): heads (head_dim d = C / heads).
        window_size (int): w. Default: 7.
        qkv_bias (bool): bias of `qkv`. Default: True.
        mask_padding (bool): mask the right/bottom padding out of the attention instead of the authors'
            zero-padding without mask. Default: False.

    forward(x, hw_shape, norm=None): x (B, H*W, C) tokens of an (H, W) map -> (B, H*W, C); with `norm`,
    attention(norm(x)).
    """

    #: pieces of padded tokens x channels (the batch included) at inference: pieces of window rows
    memory_policy = DEFAULT_POLICY
    #: the train path (`ops.window_attention.WINDOW_ATTENTION`): on CPU in bf16 / fp16 the attention kernel in
    #: fp32; False: the reference in the dtype autocast gives
    fast_train = True

    def __init__(self, dim, num_heads, window_size=7, qkv_bias=True, mask_padding=False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'WindowAttention: dim {dim} is not divisible by num_heads {num_heads}')
        self.dim = dim
        self.num_heads = num_heads
        self.window_size = window_size
        self.mask_padding = mask_padding
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def attention(self, x, key_mask=None, dtype=None):
        """MHSA over the tokens of each window: x (B', n, C) -> (B', n, C). `key_mask` (B', n) bool, True =
        ignore that key. `dtype`: the dtype of the attention kernel (`sdpa_in_slices`; None: q's)."""
        bw, n, c = x.shape
        # q, k, v as views of the qkv output: their gradients stack back into its layout in one copy
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(bw, n, 3, self.num_heads, -1).unbind(2))
        keep = None if key_mask is None else ~key_mask[:, None, None, :]   # SDPA: True = attend
        out = sdpa_in_slices(q, k, v, attn_mask=keep, scale=self.scale, dtype=dtype)
        # the branch's last product: a selective recomputation of the branch keeps the attention's output (the
        # projection's input, a view of it where the kernel's layout allows), not the projection's
        with output_product():
            return self.proj(out.transpose(1, 2).reshape(bw, n, c))

    def forward(self, x, hw_shape, norm=None):
        b, _, c = x.shape
        h, w = hw_shape
        ws = self.window_size
        hp, wp = h + padding_to_multiple(h, ws), w + padding_to_multiple(w, ws)
        key_mask = None
        if self.mask_padding and (exporting() or (hp, wp) != (h, w)):
            key_mask = padding_key_mask((h, w), (hp, wp), ws, x.device).repeat(b, 1)
        path = choose(self, x, b * hp * wp * c, WINDOW_ATTENTION)
        return window_attention(path, x, hw_shape, ws, self.attention, key_mask, norm)
