"""CPE, conditional positional encoding: a depth-wise 3x3 convolution over the token map.

It is an `nn.Conv2d` (a channels-last `Conv2dCL`; keys `weight`, `bias`) so the authors' checkpoints load unchanged; `forward` takes
tokens (B, N, C) with their map size (H, W) and returns the conv output as tokens (B, N, C). The caller adds
the residual (x = x + cpe(x, hw)).
"""
from .conv import Conv2dCL


class CPE(Conv2dCL):

    def __init__(self, dim, kernel_size=3):
        super().__init__(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim)

    def forward(self, x, hw_shape):
        return tokens_conv(super().forward, x, hw_shape)


def tokens_to_map(x, hw_shape):
    """(B, N, C) tokens -> (B, C, H, W) map."""
    b, n, c = x.shape
    check_token_count(n, hw_shape)
    return x.transpose(1, 2).reshape(b, c, *hw_shape)


def check_token_count(n, hw_shape):
    """Raise ValueError unless n tokens form an (H, W) map."""
    h, w = hw_shape
    if n != h * w:
        raise ValueError(f'{n} tokens do not form a {h}x{w} map')


def map_to_tokens(x):
    """(B, C, H, W) map -> (B, H*W, C) tokens."""
    return x.flatten(2).transpose(1, 2)


def tokens_conv(fn, x, hw_shape):
    """Apply an NCHW function `fn` to tokens (B, N, C) and return tokens."""
    return map_to_tokens(fn(tokens_to_map(x, hw_shape)))
