"""BatchNorm2d's accurate training pass for channels-last fp32 maps on CPU (`BatchNormCLFunction`); the layer is
`layers.conv.BatchNorm2d`, which runs it where `BATCH_NORM` (in `ops.conv`) says, through `ops.dispatch.choose`."""
import torch

from ..split import split


def _row_blocks(piece, *mats):
    """Pieces of about `piece` elements (None: whole) of rows of (M, C) matrices (`ops.split`), zipped (a
    piece is read from memory once and then worked on in cache)."""
    pieces = split(mats[0].shape[0], piece, unit=mats[0].shape[1])
    return zip(*([m[p.own] for p in pieces] for m in mats))


def _mean_var(rows, piece):
    """Column mean and biased variance of an (M, C) matrix in one pass over memory: per piece of rows its
    sum and centred sum of squares (torch's cascade sums), combined exactly (Chan et al.):
    M2 = sum_b M2_b + sum_b n_b (mean_b - mean)^2."""
    sums, m2, counts = [], None, []
    for (r,) in _row_blocks(piece, rows):
        s = r.sum(0)
        part = (r - s / r.shape[0]).square_().sum(0)
        m2 = part if m2 is None else m2.add_(part)
        sums.append(s)
        counts.append(r.shape[0])
    sums = torch.stack(sums)
    n = sums.new_tensor(counts).unsqueeze(1)
    mean = sums.sum(0) / rows.shape[0]
    m2.add_(((sums / n - mean).square_() * n).sum(0))
    return mean, m2.div_(rows.shape[0])


class BatchNormCLFunction(torch.autograd.Function):
    """Train-mode batch normalisation of a channels-last fp32 map with accurate batch statistics.

    x (B, C, H, W), channels-last in memory, is a contiguous (M = B*H*W, C) matrix of rows. The statistics are
    column sums of it, piece by piece of rows (`_mean_var`: the mean and the biased variance, each piece centred on
    its own mean; `piece` elements per piece, the memory policy's, None: whole). torch 2.14's CPU BatchNorm kernel
    accumulates channels-last maps row by row in float32 instead: its forward error grows with M (rel. 5e-6 at a
    detection-sized stage-1 map, against 7e-8 for the same map in NCHW). Through a ReLU that follows, such errors
    flip activations near zero, and they decide how far fp32 training gradients are from float64.

    forward(x, weight, bias, eps, piece=None) -> (y, mean, var): y = (x - mean) / sqrt(var + eps) * weight
    + bias like x (channels-last); mean and the biased variance (C,) for the running statistics.
    backward: dx = (dy - mean(dy) - x_hat * mean(dy * x_hat)) * weight / std, dweight = sum(dy * x_hat),
    dbias = sum(dy), with sums over M and x_hat recomputed from the saved input (as torch's kernel: input,
    mean and 1/std are what it keeps). Both passes read x (and dy) from memory as often as torch's kernel.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, piece=None):
        c = x.shape[1]
        rows = x.permute(0, 2, 3, 1).reshape(-1, c)          # a view: x is channels-last
        mean, var = _mean_var(rows, piece)
        inv_std = (var + eps).rsqrt_()
        scale = inv_std if weight is None else inv_std * weight
        shift = -mean * scale if bias is None else bias - mean * scale
        y = torch.empty_like(x, memory_format=torch.channels_last)      # not a view: ReLU may run in place
        torch.addcmul(shift, rows, scale, out=y.permute(0, 2, 3, 1).view(-1, c))
        ctx.save_for_backward(x, weight, mean, inv_std)
        ctx.affine, ctx.piece = (weight is not None, bias is not None), piece
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        x, weight, mean, inv_std = ctx.saved_tensors
        c = x.shape[1]
        rows = x.permute(0, 2, 3, 1).reshape(-1, c)
        dy = dy.contiguous(memory_format=torch.channels_last)
        grads = dy.permute(0, 2, 3, 1).reshape(-1, c)
        m = rows.shape[0]
        sum_dy, sum_dy_xc = torch.zeros_like(mean), torch.zeros_like(mean)
        for g, r in _row_blocks(ctx.piece, grads, rows):
            sum_dy.add_(g.sum(0))
            sum_dy_xc.add_((r - mean).mul_(g).sum(0))
        sum_dy_xhat = sum_dy_xc.mul_(inv_std)
        scale = inv_std if weight is None else inv_std * weight
        # dx = scale * (dy - sum_dy / m) + a * (x - mean), a = -scale * inv_std * sum_dy_xhat / m
        a = scale * inv_std * sum_dy_xhat / -m
        shift = -a * mean - scale * sum_dy / m
        dx = torch.empty_like(dy)
        for d, g, r in _row_blocks(ctx.piece, dx.permute(0, 2, 3, 1).view(-1, c), grads, rows):
            torch.addcmul(shift, r, a, out=d).addcmul_(g, scale)
        return (dx, sum_dy_xhat if ctx.affine[0] else None, sum_dy if ctx.affine[1] else None, None, None)
