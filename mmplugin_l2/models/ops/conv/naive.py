"""Convolution chains (stems, downsamplings) and L2ViT's LCM as the papers write them: the oracle every
implementation of `ops.conv` is tested against (float64, values and gradients).

A chain is layers of conv -> BN -> act (or conv -> act -> BN) on the whole (B, C, H, W) map, with

    BN(x) = gamma (x - mu) / sqrt(sigma^2 + eps) + beta      per channel; mu, sigma^2 the running statistics,
                                                           the batch's (biased sigma^2) for a train-mode BN

(a function of the map: the running statistics are not updated here). L2ViT's LCM (Eqs. 6-7) on tokens
X (B, N, C) of an (H, W) map:

    X^ = GELU(DWConv1(Rearrange(X))),   X_LCM = Rearrange(DWConv2(BN(X^)))
"""
import torch.nn.functional as F


def conv(x, c):
    """The convolution of the module `c` (its weight, bias, stride, padding, dilation, groups) on x."""
    return F.conv2d(x, c.weight, c.bias, c.stride, c.padding, c.dilation, c.groups)


def batch_norm(x, bn):
    """BN(x) of the BatchNorm module `bn` on the map x (B, C, H, W): gamma (x - mean) / sqrt(var + eps) + beta,
    batch statistics in train mode (without affine parameters: no gamma, beta)."""
    if bn.training:
        mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    else:
        mean, var = bn.running_mean, bn.running_var
    mean, var = mean.view(1, -1, 1, 1), var.view(1, -1, 1, 1)
    if bn.weight is None:
        return (x - mean) / (var + bn.eps).sqrt()
    return bn.weight.view(1, -1, 1, 1) * (x - mean) / (var + bn.eps).sqrt() + bn.bias.view(1, -1, 1, 1)


def conv_chain_naive(layers, x, pre=None):
    """layers(pre(x)) on the whole map (`conv_chain_reference`'s signature).

    Args:
        layers (Sequence): `ConvLayer`s or `ConvBNAct`s (`conv`, `norm` a BatchNorm or None, `act` or None,
            `act_first`).
        x (Tensor): the map (B, C, H, W).
        pre (Callable | None): a per-pixel function of the map applied first. Default: None.

    Returns:
        Tensor: (B, C_out, H_out, W_out).
    """
    if pre is not None:
        x = pre(x)
    for layer in layers:
        x = conv(x, layer.conv)
        norm = (lambda t: t) if layer.norm is None else (lambda t: batch_norm(t, layer.norm))
        act = layer.act or (lambda t: t)
        x = norm(act(x)) if getattr(layer, 'act_first', False) else act(norm(x))
    return x


def lcm_naive(x, hw_shape, conv1, bn, conv2, norm=None):
    """LCM(norm(x)), Eqs. 6-7 (`LCM.forward` with the module's conv1, bn, conv2).

    Args:
        x (Tensor): tokens (B, N, C) of an (H, W) map.
        hw_shape (tuple[int, int]): (H, W).
        conv1 (nn.Conv2d): DWConv1.
        bn (nn.BatchNorm2d): BN.
        conv2 (nn.Conv2d): DWConv2.
        norm (Callable | None): a pre-norm over the channels (the block's LN). Default: None.

    Returns:
        Tensor: (B, N, C).
    """
    if norm is not None:
        x = norm(x)
    t = x.transpose(1, 2).unflatten(-1, hw_shape)
    t = conv(batch_norm(F.gelu(conv(t, conv1)), bn), conv2)
    return t.flatten(2).transpose(1, 2)
