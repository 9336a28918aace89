"""Local window attention (W-MSA, as Swin without shift), L2ViT's "Local Window Attention" (LWA).

The token map (B, N = H*W, C) is zero-padded right/bottom to multiples of the window size w, cut into
non-overlapping w x w windows, multi-head softmax attention runs inside each window, and the windows are put
back and cropped to H x W: (B, N, C) in, (B, N, C) out.

* No relative position bias and no shift (L2ViT's CPE replaces the bias); qkv = Linear(C, 3C), output
  projection Linear(C, C) (keys `qkv.*`, `proj.*`, the authors' layout).
* Padding, the authors' way (default): padded positions enter the attention as the zero vector, so their
  keys/values are the qkv bias and they take part in the softmax of border windows (like Swin's unshifted
  W-MSA). `mask_padding=True` instead masks the padded keys out (-inf before the softmax): the result then
  does not depend on how much padding a border window gets, but no longer equals the authors' numbers at
  sizes that are not multiples of w. Every window holds at least one real token (padding < w), so no row is
  fully masked.

The attention is torch's fused `F.scaled_dot_product_attention` (flash kernel on CPU and GPU): the
(nW, heads, w*w, w*w) probability matrix is never stored, in inference or for backward. It equals the
authors' explicit softmax(q k^T * scale) v to float rounding (~1e-6 on unit-variance inputs, as close to
an fp64 reference as theirs).

Helpers: `window_partition` (B, H, W, C) -> (B * nW, w*w, C) and `window_reverse` back.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.export import exporting
from ..ops.memory import DEFAULT_POLICY


def window_partition(x, window_size):
    """(B, H, W, C) with H, W multiples of w -> (B * H/w * W/w, w*w, C), windows in row-major order."""
    b, h, w, c = x.shape
    ws = window_size
    x = x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, ws * ws, c)


def window_reverse(windows, window_size, h, w):
    """(B * H/w * W/w, w*w, C) -> (B, H, W, C); the inverse of `window_partition`."""
    ws = window_size
    c = windows.shape[-1]
    b = windows.shape[0] // ((h // ws) * (w // ws))
    x = windows.view(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, w, c)


def padding_key_mask(hw_shape, padded_shape, window_size, device):
    """Bool (nW, w*w): True where a window position lies in the right/bottom padding."""
    h, w = hw_shape
    hp, wp = padded_shape
    pad = torch.ones(1, hp, wp, 1, dtype=torch.bool, device=device)
    pad[:, :h, :w] = False
    return window_partition(pad, window_size)[..., 0]


class WindowAttention(nn.Module):
    """Multi-head softmax attention inside non-overlapping w x w windows of a token map.

    Args:
        dim (int): channels C. num_heads (int): heads (head_dim = C / heads).
        window_size (int): w. Default: 7.
        qkv_bias (bool): Default: True.
        mask_padding (bool): mask the right/bottom padding out of the attention instead of the authors'
            zero-padding without mask. Default: False.

    forward(x, hw_shape): x (B, H*W, C) tokens of an (H, W) map -> (B, H*W, C).
    """

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

    def attention(self, x, key_mask=None):
        """MHSA over the tokens of each window: x (B', n, C) -> (B', n, C). `key_mask` (B', n) bool, True =
        ignore that key."""
        bw, n, c = x.shape
        # q, k, v as views of the qkv output: their gradients stack back into its layout in one copy
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(bw, n, 3, self.num_heads, -1).unbind(2))
        keep = None if key_mask is None else ~key_mask[:, None, None, :]   # SDPA: True = attend
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.scale)
        return self.proj(out.transpose(1, 2).reshape(bw, n, c))

    #: inference on large maps in bands of window rows (the (B, rows, Wp, C) band is the piece)
    memory_policy = DEFAULT_POLICY
    #: `forward(x, hw, norm=norm)` computes attn(norm(x), hw), the norm band by band at inference
    fuses_norm = True

    def _windows_in_bands(self, x, padded_shape, key_mask, piece, norm=None):
        """Inference on the map x (B, H, W, C), a band of window rows at a time, each band normalised
        (`norm`) and zero-padded to whole windows on its own (the windows are independent, so the values
        are those of the whole map); returns (B, H, W, C). Neither the norm's output nor the padded map is
        built whole."""
        b, h, w, c = x.shape
        hp, wp = padded_shape
        ws = self.window_size
        rows = max(1, piece // (b * ws * wp * c)) * ws
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        per_row = wp // ws        # windows per window row (per sample)
        for r0 in range(0, hp, rows):
            r1 = min(hp, r0 + rows)
            e1 = min(h, r1)       # the band's real rows (r0 < h: the padding is less than a window)
            band = x[:, r0:e1] if norm is None else norm(x[:, r0:e1])
            if e1 < r1 or wp > w:
                band = F.pad(band, (0, 0, 0, wp - w, 0, r1 - e1))
            mask = None
            if key_mask is not None:
                mask = key_mask.view(b, hp // ws, per_row, -1)[:, r0 // ws:r1 // ws].reshape(-1, ws * ws)
            y = self.attention(window_partition(band, ws), mask)
            out[:, r0:e1] = window_reverse(y, ws, r1 - r0, wp)[:, :e1 - r0, :w]
        return out

    def forward(self, x, hw_shape, norm=None):
        b, n, c = x.shape
        h, w = hw_shape
        ws = self.window_size
        pad_b, pad_r = (-h) % ws, (-w) % ws
        padded = exporting() or pad_b or pad_r   # exporting: one graph for every size (zero pads are no-ops)
        hp, wp = h + pad_b, w + pad_r
        key_mask = None
        if self.mask_padding and padded:
            key_mask = padding_key_mask((h, w), (hp, wp), ws, x.device).repeat(b, 1)
        piece = self.memory_policy.pieces(self, x, b * hp * wp * c)
        if piece is not None:
            return self._windows_in_bands(x.view(b, h, w, c), (hp, wp), key_mask, piece, norm).view(b, n, c)
        if norm is not None:
            x = norm(x)
        x = x.view(b, h, w, c)
        if padded:
            x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
        x = window_reverse(self.attention(window_partition(x, ws), key_mask), ws, hp, wp)
        if padded:
            x = x[:, :h, :w, :]
        return x.reshape(b, h * w, c)
