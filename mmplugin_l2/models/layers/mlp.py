"""Feed-forward networks of the blocks.

`ConvMlp` (H-ViT3): fc1 (C -> rC) -> GELU -> u + DWConv3x3(u) -> GELU -> fc2 (rC -> C); GELU is applied
twice, around the residual depth-wise conv, as in the authors' code. Tokens (B, N, C) in and out.
"""
import torch.nn as nn

from .cpe import tokens_conv


class ConvMlp(nn.Module):

    def __init__(self, dim, hidden_dim, drop=0.):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.dwc = nn.Conv2d(hidden_dim, hidden_dim, 3, padding=1, groups=hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x, hw_shape):
        x = self.drop(self.act(self.fc1(x)))
        x = self.act(x + tokens_conv(self.dwc, x, hw_shape))
        return self.drop(self.fc2(x))


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
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))
