"""Feed-forward networks of the blocks.

`ConvMlp` (H-ViT3): fc1 (C -> rC) -> GELU -> u + DWConv3x3(u) -> GELU -> fc2 (rC -> C); GELU is applied
twice, around the residual depth-wise conv, as in the authors' code. Tokens (B, N, C) in and out.
Without autograd the GELUs run in place and the residual is added into the conv output (fewer
(B, N, rC) temporaries; same values).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .conv import Conv2dCL
from .cpe import tokens_conv


class ConvMlp(nn.Module):

    def __init__(self, dim, hidden_dim, drop=0.):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.dwc = Conv2dCL(hidden_dim, hidden_dim, 3, padding=1, groups=hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x, hw_shape):
        x = self.drop(gelu(self.fc1(x)))
        x = gelu(tokens_conv(self.dwc, x, hw_shape).add_(x))   # conv(x) + x: the conv keeps no output
        return self.drop(self.fc2(x))


def gelu(x):
    """Exact GELU; in place when no gradient is being recorded (its backward would need the input)."""
    return torch.ops.aten.gelu_(x) if not torch.is_grad_enabled() else F.gelu(x)


class Mlp(nn.Module):
    """Plain transformer MLP (ViT3): fc1 (C -> rC) -> GELU -> fc2 (rC -> C). Tokens (B, N, C) in and out;
    `hw_shape` is accepted for a common signature and unused."""

    def __init__(self, dim, hidden_dim, drop=0.):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x, hw_shape=None):
        return self.drop(self.fc2(self.drop(gelu(self.fc1(x)))))
