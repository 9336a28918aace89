"""Window attention (W-MSA without shift, L2ViT's LWA) as a reader writes it: the oracle every implementation
of `ops.window_attention` is tested against (float64, values and gradients).

The (H, W) token map is zero-padded right/bottom to multiples of the window size w and cut into w x w
windows; inside each window, per head, with q, k, v = Linear_qkv(x) of its w*w tokens,

    out = Linear_proj(merge_heads(Softmax(q k^T * scale) v))       (padded keys at -inf with a key mask)

and the windows are put back side by side and cropped to H x W.
"""
import torch
import torch.nn.functional as F


def window_msa_naive(layer, x, key_mask=None):
    """Multi-head softmax attention over the tokens of each window (`WindowAttention.attention`; with the
    layer bound, an `attend` of the op).

    Args:
        layer (WindowAttention): its `qkv` Linear(C, 3C), `proj` Linear(C, C), `num_heads` and `scale`.
        x (Tensor): (B', n, C) tokens of B' windows.
        key_mask (Tensor | None): bool (B', n), True = ignore that key. Default: None.

    Returns:
        Tensor: (B', n, C).
    """
    b, n, c = x.shape
    q, k, v = layer.qkv(x).view(b, n, 3, layer.num_heads, -1).permute(2, 0, 3, 1, 4)
    s = q @ k.transpose(-2, -1) * layer.scale
    if key_mask is not None:
        s = s.masked_fill(key_mask[:, None, None, :], float('-inf'))
    return layer.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


def window_attention_naive(x, hw_shape, window_size, attend, key_mask=None):
    """`attend` on every w x w window of the zero-padded map, one window at a time
    (`window_attention_reference`'s signature).

    Args:
        x (Tensor): tokens (B, H*W, C) of an (H, W) map.
        hw_shape (tuple[int, int]): (H, W).
        window_size (int): w.
        attend (callable): (B, w*w, C) tokens of a window and its key mask (B, w*w) or None -> (B, w*w, C).
        key_mask (Tensor | None): bool (B * nW, w*w), windows in row-major order, True = ignore that key.

    Returns:
        Tensor: (B, H*W, C).
    """
    b, _, c = x.shape
    h, w = hw_shape
    ws = window_size
    rows, cols = -(-h // ws), -(-w // ws)
    xp = F.pad(x.view(b, h, w, c), (0, 0, 0, cols * ws - w, 0, rows * ws - h))
    masks = None if key_mask is None else key_mask.view(b, rows, cols, ws * ws)
    out = []
    for i in range(rows):
        row = []
        for j in range(cols):
            t = xp[:, i * ws:(i + 1) * ws, j * ws:(j + 1) * ws].reshape(b, ws * ws, c)
            row.append(attend(t, None if masks is None else masks[:, i, j]).view(b, ws, ws, c))
        out.append(torch.cat(row, dim=2))
    return torch.cat(out, dim=1)[:, :h, :w].reshape(b, h * w, c)
