"""Window attention at inference in pieces of window rows (no autograd needed, none used).

Each piece (whole window rows across the map) is normalised and zero-padded to whole windows on its
own; the windows are independent, so the values are those of the whole map. Neither the norm's output nor the
padded map is built whole.
"""
import torch
import torch.nn.functional as F

from ..split import split
from ..tokens import padding_to_multiple
from .reference import window_partition, window_reverse


def window_attention_in_pieces(x, hw_shape, window_size, attend, key_mask, piece, norm=None):
    """`attend` inside the w x w windows of norm(x), a piece of window rows at a time.

    Args:
        x (Tensor): tokens (B, H*W, C) of an (H, W) map.
        hw_shape (tuple[int, int]): (H, W).
        window_size (int): w.
        attend (callable): as in `window_attention_reference`.
        key_mask (Tensor | None): bool (B * nW, w*w) of the whole padded map, True = ignore that key.
        piece (int): elements (padded tokens x C, the batch included) per piece.
        norm (nn.Module | None): a pre-norm applied to each piece. Default: None.

    Returns:
        Tensor: (B, H*W, C).
    """
    b, n, c = x.shape
    h, w = hw_shape
    ws = window_size
    hp, wp = h + padding_to_multiple(h, ws), w + padding_to_multiple(w, ws)
    x = x.view(b, h, w, c)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    per_row = wp // ws        # windows per window row (per sample)
    for r0, r1, _, _ in split(hp, piece, unit=b * wp * c, multiple=ws):
        e1 = min(h, r1)       # the piece's real rows (r0 < h: the padding is less than a window)
        rows_in = x[:, r0:e1] if norm is None else norm(x[:, r0:e1])
        if e1 < r1 or wp > w:
            rows_in = F.pad(rows_in, (0, 0, 0, wp - w, 0, r1 - e1))
        mask = None
        if key_mask is not None:
            mask = key_mask.view(b, hp // ws, per_row, -1)[:, r0 // ws:r1 // ws].reshape(-1, ws * ws)
        y = attend(window_partition(rows_in, ws), mask)
        out[:, r0:e1] = window_reverse(y, ws, r1 - r0, wp)[:, :e1 - r0, :w]
    return out.view(b, n, c)
