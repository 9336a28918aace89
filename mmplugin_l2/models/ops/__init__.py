"""Functional ops behind the layers: per op a plain-autograd reference and its fast implementations, one
dispatch (`dispatch.choose`) between them."""
from .dispatch import INFERENCE, REFERENCE, TRAIN, Path, choose

__all__ = ['INFERENCE', 'REFERENCE', 'TRAIN', 'Path', 'choose']
