"""The MLPs' reference: plain autograd on whole maps, the activation a parameter.

    Mlp(x)    = drop(fc2(drop(act(fc1(norm(x))))))              (norm optional)
    ConvMlp(x) = drop(fc2(act(u + DWConv3x3(u)))),  u = drop(act(fc1(x)))

Tokens (B, N, C) in, (B, N, C_out) out; ConvMlp's tokens form an (H, W) map.
"""
from ..tokens import tokens_conv
from .naive import mlp_naive


#: the plain MLP has nothing to stabilise or to export differently: its reference is the naive form
mlp_reference = mlp_naive


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
