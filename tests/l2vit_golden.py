"""Deterministic weights in the authors' L2ViT layout for the golden-output test (tests/data/
l2vit_official_tiny.pt holds the official code's outputs for these weights; /tmp scratch script, see
docs/l2vit.md). Only torch and zlib here: the scratch script imports this file next to the official code."""
import zlib

import torch

#: the narrow arch of the golden file (= conftest.TINY_L2VIT), its sizes and classes
ARCH = dict(embed_dims=[16, 32, 64, 64], depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 2])
SIZES = [(64, 64), (50, 75)]
NUM_CLASSES = 10


def weight(key, shape):
    """A reproducible tensor per key (seeded by the key's CRC32): LN / BN affine around 1 / 0, BN statistics,
    temperatures in [0.1, 1.1), qkv weights with std 0.15 (peaked attention; the
    linear attention's clamp active at some tokens only)."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))

    def rn(s):
        return torch.randn(shape, generator=g) * s

    if key.endswith('num_batches_tracked'):
        return torch.tensor(1234)
    if key.endswith('running_mean'):
        return rn(0.3)
    if key.endswith('running_var'):
        return torch.rand(shape, generator=g) * 1.5 + 0.5
    if key.endswith('temperature'):
        return torch.rand(shape, generator=g) + 0.1
    if len(shape) == 1 and key.endswith('weight'):       # LN / BN weights
        return 1 + rn(0.2)
    if len(shape) == 1 and ('norm' in key or '.bn.' in key or '.proj.1.' in key or '.proj.4.' in key):
        return rn(0.2)                                     # LN / BN biases
    if len(shape) == 1:
        return rn(0.02)                                    # conv / linear biases
    return rn(0.15 if 'qkv' in key else 0.02)


def state_dict(shapes):
    """{key: tensor} for the authors' keys and shapes `shapes` ({key: shape})."""
    return {k: weight(k, tuple(s)) for k, s in sorted(shapes.items())}


def inputs():
    g = torch.Generator().manual_seed(0)
    return {s: torch.randn(2, 3, *s, generator=g) for s in SIZES}
