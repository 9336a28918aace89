"""The MLPs as the papers write them: the oracle every implementation of `ops.mlp` is tested against (float64,
values and gradients).

    Mlp(x)     = fc2(act(fc1(x)))                                 (ViT³, L²ViT, ResT; act = GELU)
    ConvMlp(x) = fc2(act(u + DWConv3x3(u))),  u = act(fc1(x))      (H-ViT³, the authors' act twice)

fc a linear layer over the channels, DWConv3x3 depth-wise with zero padding 1 on the (H, W) map of the tokens;
dropout after each act and after fc2 (the layers' `drop`). Tokens (B, N, C) in, (B, N, C_out) out.
"""


def mlp_naive(x, fc1, fc2, act, drop, norm=None):
    """Mlp(norm(x)) (`mlp_reference`'s signature).

    Args:
        x (Tensor): tokens (B, N, C).
        fc1 (Callable): C -> rC.
        fc2 (Callable): rC -> C_out.
        act (Callable): the activation.
        drop (Callable): the dropout.
        norm (Callable | None): a pre-norm. Default: None.

    Returns:
        Tensor: (B, N, C_out).
    """
    if norm is not None:
        x = norm(x)
    return drop(fc2(drop(act(fc1(x)))))


def conv_mlp_naive(x, hw_shape, fc1, dwc, fc2, act, drop):
    """ConvMlp(x) (`conv_mlp_reference`'s signature).

    Args:
        x (Tensor): tokens (B, N, C) of an (H, W) map.
        hw_shape (tuple[int, int]): (H, W).
        fc1 (Callable): C -> rC.
        dwc (Callable): the depth-wise 3x3 conv of (B, rC, H, W) maps.
        fc2 (Callable): rC -> C_out.
        act (Callable): the activation.
        drop (Callable): the dropout.

    Returns:
        Tensor: (B, N, C_out).
    """
    u = drop(act(fc1(x)))
    conv_u = dwc(u.transpose(1, 2).unflatten(-1, hw_shape)).flatten(2).transpose(1, 2)
    return drop(fc2(act(u + conv_u)))
