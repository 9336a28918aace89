"""Generic shape helpers: tokens (B, N, C) <-> maps (B, C, H, W), and padding a map to a multiple."""
import torch
import torch.nn.functional as F

from .export import exporting


def check_token_count(n, hw_shape):
    """Raise ValueError unless n tokens form an (H, W) map."""
    h, w = hw_shape
    if n != h * w:
        raise ValueError(f'{n} tokens do not form a {h}x{w} map')


def tokens_to_map(x, hw_shape):
    """(B, N, C) tokens -> (B, C, H, W) map (a channels-last view of the tokens when they are contiguous;
    under torch.compile a copy, see `compiled_map`).

    The view is made by splitting N and permuting, so that its batch stride is H*W*C even at batch 1. CPU
    convolutions choose their memory layout from all four strides: a channels-last map whose size-1 batch
    dimension carries another stride (as `x.transpose(1, 2).reshape(...)` leaves it) runs depth-wise
    convolutions in the NCHW layout, several times slower forward and backward, and returns NCHW maps."""
    b, n, c = x.shape
    check_token_count(n, hw_shape)
    return compiled_map(x.reshape(b, *hw_shape, c).permute(0, 3, 1, 2))


def compiled_map(x):
    """x (B, C, H, W) unchanged, except under torch.compile: there a contiguous copy when x is a view of another
    layout. Inductor (torch 2.14) keeps the strides of a view that autograd saves for backward (a conv's input)
    by sorting them with plain sympy comparisons, which fail for sizes made symbolic by `dynamic=True`
    ("cannot determine truth value of Relational: 16*s0*s1 < 16", docs/deployment.md); a copy is no view."""
    if torch.compiler.is_compiling() and not x.is_contiguous():
        return x.contiguous()
    return x


def channels_last(x):
    """Whether the map x (B, C, H, W) lies channels-last in memory (and not also contiguous NCHW, as a map
    with one channel or one pixel does)."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def map_to_tokens(x):
    """(B, C, H, W) map -> (B, H*W, C) tokens."""
    return x.flatten(2).transpose(1, 2)


def tokens_conv(fn, x, hw_shape):
    """Apply an NCHW function `fn` to tokens (B, N, C) and return tokens."""
    return map_to_tokens(fn(tokens_to_map(x, hw_shape)))


def padding_to_multiple(n, multiple):
    """How much n (an int or a traced size) must grow to become a multiple of `multiple`: (-n) mod multiple,
    written with floor division only. A Python `%` on a traced size becomes sympy's `PythonMod`, which
    torch.compile's inductor (torch 2.14) cannot evaluate when the size later reaches a float, e.g. the
    n / (n - 1) of a training BatchNorm's running variance (`TensorReferenceAnalysis` has no `python_mod`,
    docs/deployment.md); floor division it can."""
    return (n + multiple - 1) // multiple * multiple - n


def pad_to_multiple(x, multiple):
    """Zero-pad an NCHW tensor on the right/bottom so that H and W are multiples of `multiple`."""
    h, w = x.shape[-2:]
    pad_h, pad_w = padding_to_multiple(h, multiple), padding_to_multiple(w, multiple)
    if exporting() or pad_h or pad_w:  # exporting: one graph for every size, a zero pad is a no-op
        x = F.pad(x, (0, pad_w, 0, pad_h))
    return x


def add_residual(y, x):
    """y + x for a branch output y that nothing keeps for backward (a conv, linear or DropPath output).

    Without autograd the sum goes into y (no new map-sized tensor). With autograd recording it is out of
    place: y is often a view (a Linear's 3-D output, a conv output seen as tokens), and an in-place add on
    a view makes autograd rebuild the whole base tensor in backward (CopySlices / AsStrided, a zero-filled
    map and a copy per add), which cost more than the fresh tensor."""
    if torch.is_grad_enabled() and (y.requires_grad or x.requires_grad):
        return y + x
    return y.add_(x)
