"""The MLPs' reference: plain autograd on whole maps, the activation a parameter.

    Mlp(x)    = drop(fc2(drop(act(fc1(norm(x))))))              (norm optional)
    ConvMlp(x) = drop(fc2(act(u + DWConv3x3(u)))),  u = drop(act(fc1(x)))

Tokens (B, N, C) in, (B, N, C_out) out; ConvMlp's tokens form an (H, W) map.
"""
from ...layers.tokens import tokens_conv


def mlp_reference(x, fc1, fc2, act, drop, norm=None):
    """fc2(act(fc1(norm(x)))) with dropout after the activation and after fc2.

    Args:
        x (Tensor): tokens (B, N, C).
        fc1 (nn.Linear): C -> rC.
        fc2 (nn.Linear): rC -> C_out.
        act (nn.Module): the activation.
        drop (nn.Module): the dropout.
        norm (nn.Module | None): a pre-norm applied to x first. Default: None.

    Returns:
        Tensor: (B, N, C_out).
    """
    if norm is not None:
        x = norm(x)
    return drop(fc2(drop(act(fc1(x)))))


def conv_mlp_reference(x, hw_shape, fc1, dwc, fc2, act, drop):
    """fc2(act(u + dwc(u))) with u = drop(act(fc1(x))), dropout after fc2.

    Args:
        x (Tensor): tokens (B, N, C) of an (H, W) map.
        hw_shape (tuple[int]): (H, W).
        fc1 (nn.Linear): C -> rC.
        dwc (nn.Conv2d): the depth-wise 3x3 convolution (rC channels, padding 1).
        fc2 (nn.Linear): rC -> C_out.
        act (nn.Module): the activation (applied twice).
        drop (nn.Module): the dropout.

    Returns:
        Tensor: (B, N, C_out).
    """
    u = drop(act(fc1(x)))
    return drop(fc2(act(tokens_conv(dwc, u, hw_shape) + u)))
