"""Feed-forward networks of the blocks.

`ConvMlp` (H-ViT3): fc1 (C -> rC) -> GELU -> u + DWConv3x3(u) -> GELU -> fc2 (rC -> C); GELU is applied
twice, around the residual depth-wise conv, as in the authors' code. Tokens (B, N, C) in and out.
At inference (`memory.inference`) the GELUs run in place and the residual is added into the conv output
(fewer (B, N, rC) temporaries; same values); large maps run in pieces (`memory.MemoryPolicy`).

`recompute=True` (both MLPs): in a training step only the MLP input is kept for backward and the hidden
(B, N, rC) activations are recomputed there (activation checkpointing of the MLP alone, RNG state
preserved for dropout): ~4 (Mlp) / ~16 (ConvMlp) fewer C-wide tensors per token and block, for one more
fc1 (+ conv) in backward. Same values and gradients.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .conv import Conv2dCL
from .memory import DEFAULT_POLICY, inference
from .recompute import recomputed
from .tokens import add_residual, tokens_conv


class ConvMlp(nn.Module):

    def __init__(self, dim, hidden_dim, drop=0., recompute=False):
        super().__init__()
        self.recompute = recompute
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.dwc = Conv2dCL(hidden_dim, hidden_dim, 3, padding=1, groups=hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x, hw_shape):
        return recomputed(self, self._forward, x, hw_shape)

    #: inference on large maps in bands of rows (the (B, rows * W, C) input tokens are the piece)
    memory_policy = DEFAULT_POLICY

    def _forward(self, x, hw_shape):
        piece = self.memory_policy.pieces(self, x, x.numel())
        if piece is not None:
            return self._forward_bands(x, hw_shape, piece)
        inplace = inference(self)
        x = self.drop(gelu(self.fc1(x), inplace))
        x = gelu(add_residual(tokens_conv(self.dwc, x, hw_shape), x), inplace)
        return self.drop(self.fc2(x))

    def _forward_bands(self, x, hw_shape, piece):
        """Inference on large maps, band of rows by band of rows, so that the (B, band, rC) hidden
        activations stay in cache: fc1 and GELU also run on one halo row above and below each band (the
        3x3 conv's neighbours), the conv output of the halo rows is dropped. Same values as the whole map."""
        b, n, c = x.shape
        h, w = hw_shape
        rows = max(1, piece // (b * w * c))
        xm = x.view(b, h, w, c)
        out = x.new_empty(b, h, w, self.fc2.out_features)
        for r0 in range(0, h, rows):
            r1 = min(h, r0 + rows)
            a0, a1 = max(0, r0 - 1), min(h, r1 + 1)
            u = gelu(self.fc1(xm[:, a0:a1].reshape(b, (a1 - a0) * w, c)), True)
            y = tokens_conv(self.dwc, u, (a1 - a0, w)).add_(u)
            y = y.view(b, a1 - a0, w, -1)[:, r0 - a0:r1 - a0]
            out[:, r0:r1] = self.fc2(gelu(y.reshape(b, (r1 - r0) * w, -1), True)).view(b, r1 - r0, w, -1)
        return out.view(b, n, -1)


def gelu(x, inplace=False):
    """Exact GELU; in place with `inplace` (inference only: its backward would need the input)."""
    return torch.ops.aten.gelu_(x) if inplace else F.gelu(x)


class Mlp(nn.Module):
    """Plain transformer MLP (ViT3, L2ViT, ResT): fc1 (C -> rC) -> GELU -> fc2 (rC -> C). Tokens (B, N, C)
    in and out; `hw_shape` is accepted for a common signature and unused."""

    def __init__(self, dim, hidden_dim, drop=0., recompute=False):
        super().__init__()
        self.recompute = recompute
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    #: inference on large maps in token chunks (the (B, chunk, C) input tokens are the piece)
    memory_policy = DEFAULT_POLICY

    def forward(self, x, hw_shape=None):
        return recomputed(self, self._forward, x)

    def _forward(self, x):
        b, n, c = x.shape
        piece = self.memory_policy.pieces(self, x, x.numel())
        if piece is None:
            return self.drop(self.fc2(self.drop(gelu(self.fc1(x), inference(self)))))
        # Inference on large maps: the (B, chunk, rC) hidden activation stays in cache instead of a
        # (B, N, rC) temporary (80-120 MB in stage 1 at 800 x 1344). Rows are independent, so the
        # values are the same.
        step = max(1, piece // (b * c))
        out = x.new_empty(x.shape[:-1] + (self.fc2.out_features,))
        for i in range(0, n, step):
            out[:, i:i + step] = self.fc2(gelu(self.fc1(x[:, i:i + step]), True))
        return out
