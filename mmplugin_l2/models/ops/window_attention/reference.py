"""Attention inside non-overlapping w x w windows of a token map, on the whole map: the reference.

The map is zero-padded right/bottom to multiples of w, cut into windows, `attend` runs on the tokens of each
window, and the windows are put back and cropped. With a key mask the padded positions are masked out of the
attention (every window holds at least one real token: the padding is less than a window).
"""
import torch
import torch.nn.functional as F

from ..dtypes import autocast_off
from ..split import piece_length, split
from ..tokens import padding_to_multiple
from ..export import compiling, exporting

#: most (window, head) pairs one `F.scaled_dot_product_attention` call takes: CUDA's limit on gridDim.y and
#: gridDim.z (65535 blocks); the flash and memory-efficient SDPA kernels launch the batch (here the windows of
#: all images) or batch x heads on one of those axes, and fail to launch above it
MAX_SDPA_BATCH_HEADS = 65535


def sdpa_batch_slices(batch, heads):
    """Consecutive slices of a batch of `batch` windows, each of at most MAX_SDPA_BATCH_HEADS // heads windows
    (one slice when the whole batch fits; while exporting one graph for every size, always one)."""
    if exporting() and not compiling():
        return [slice(None)]
    if batch <= piece_length(MAX_SDPA_BATCH_HEADS, unit=heads):
        return [slice(None)]
    return [p.own for p in split(batch, MAX_SDPA_BATCH_HEADS, unit=heads)]


def sdpa_in_slices(q, k, v, attn_mask=None, scale=None, dtype=None):
    """F.scaled_dot_product_attention(q, k, v, attn_mask, scale=scale) for q, k, v (B', heads, n, d), in
    consecutive slices of the batch (`sdpa_batch_slices`) when one call would exceed CUDA's launch limits.

    Args:
        q (Tensor): queries (B', heads, n, d).
        k (Tensor): keys (B', heads, n, d).
        v (Tensor): values (B', heads, n, d).
        attn_mask (Tensor | None): bool (B', 1, 1, n) or (B', 1, n, n), True = attend. Default: None.
        scale (float | None): the logits' scale. Default: None (d^-0.5).
        dtype (torch.dtype | None): the dtype the kernel computes in, autocast off: q, k, v cast to it and the
            output cast back to q's dtype, rounded once (None: q's dtype, as autocast gives it). Default: None.

    Returns:
        Tensor: (B', heads, n, d); the slices' outputs concatenated, the same values as one call.
    """
    if dtype is not None and dtype != q.dtype:
        with autocast_off(q.device.type):
            out = sdpa_in_slices(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask, scale)
        return out.to(q.dtype)
    slices = sdpa_batch_slices(q.shape[0], q.shape[1])
    if len(slices) == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return torch.cat([F.scaled_dot_product_attention(q[s], k[s], v[s], scale=scale,
                                                     attn_mask=None if attn_mask is None else attn_mask[s])
                      for s in slices])


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


def window_attention_reference(x, hw_shape, window_size, attend, key_mask=None):
    """`attend` inside the w x w windows of the whole map.

    Args:
        x (Tensor): tokens (B, H*W, C) of an (H, W) map.
        hw_shape (tuple[int, int]): (H, W).
        window_size (int): w.
        attend (callable): (B', w*w, C) tokens of B' windows and a key mask (B', w*w) or None -> (B', w*w, C).
        key_mask (Tensor | None): bool (B * nW, w*w), True = a padded key to ignore. Default: None.

    Returns:
        Tensor: (B, H*W, C).
    """
    b, n, c = x.shape
    h, w = hw_shape
    ws = window_size
    pad_b, pad_r = padding_to_multiple(h, ws), padding_to_multiple(w, ws)
    padded = exporting() or pad_b or pad_r   # exporting: one graph for every size (zero pads are no-ops)
    hp, wp = h + pad_b, w + pad_r
    x = x.view(b, h, w, c)
    if padded:
        x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
    x = window_reverse(attend(window_partition(x, ws), key_mask), ws, hp, wp)
    if padded:
        x = x[:, :h, :w, :]
    return x.reshape(b, h * w, c)
