"""Window attention op (attention inside non-overlapping windows): `naive` (the maths: window by window, the
explicit softmax; the tests' oracle), `reference` (whole map, padding and mask),
`pieces` (inference in pieces of window rows). `window_attention` runs the one the `Path` of
`ops.dispatch.choose` names; `WINDOW_ATTENTION` is what the pieces and the train path support."""
from functools import partial

import torch

from ..dispatch import INFERENCE, TRAIN, Fast, Supports
from ..dtypes import compute_dtype
from .pieces import window_attention_in_pieces
from .reference import (MAX_SDPA_BATCH_HEADS, padding_key_mask, sdpa_batch_slices, sdpa_in_slices,
                        window_attention_reference, window_partition, window_reverse)

__all__ = ['MAX_SDPA_BATCH_HEADS', 'WINDOW_ATTENTION', 'padding_key_mask', 'sdpa_batch_slices', 'sdpa_in_slices',
           'window_attention', 'window_attention_in_pieces', 'window_attention_reference', 'window_partition',
           'window_reverse']


#: inference in pieces of window rows (whole maps: the reference); training on CPU where the layer computes in bf16
#: or fp16: the reference with the attention kernel in fp32 on the half q, k, v (torch's half-precision
#: `scaled_dot_product_attention` backward on CPU is slower than its fp32 one, and rounds more; docs/mixed_precision.md)
WINDOW_ATTENTION = Supports(inference=Fast(pieces_only=True),
                            train=Fast(devices=('cpu',), compute_dtypes=(torch.bfloat16, torch.float16),
                                       half_pieces=False), traced=(TRAIN,))


def window_attention(path, x, hw_shape, window_size, attend, key_mask=None, norm=None):
    """`attend` inside the w x w windows of norm(x).

    Args:
        path (Path): from `ops.dispatch.choose` with `WINDOW_ATTENTION`: 'inference' runs in pieces of window
            rows, 'train' the reference with `attend(..., dtype=compute_dtype(x))` (float32 for half or float32
            tokens, autocast or not), anything else the reference on the whole map.
        x (Tensor): tokens (B, H*W, C) of an (H, W) map.
        hw_shape (tuple[int, int]): (H, W).
        window_size (int): w.
        attend (callable): (B', w*w, C) tokens of B' windows and a key mask (B', w*w) or None -> (B', w*w, C);
            for the 'train' path it also takes `dtype=`, the dtype of its attention kernel.
        key_mask (Tensor | None): bool (B * nW, w*w) of the padded map, True = ignore that key. Default: None.
        norm (nn.Module | None): a pre-norm applied to x first. Default: None.

    Returns:
        Tensor: (B, H*W, C).
    """
    if path.impl == INFERENCE:
        return window_attention_in_pieces(x, hw_shape, window_size, attend, key_mask, path.piece, norm)
    if path.impl == TRAIN:
        attend = partial(attend, dtype=compute_dtype(x))    # fp32 for half tokens, and for fp32 ones under autocast
    if norm is not None:
        x = norm(x)
    return window_attention_reference(x, hw_shape, window_size, attend, key_mask)
