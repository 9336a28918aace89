"""Functional ops behind the layers: per op a plain-autograd reference and its fast implementations, one
dispatch (`dispatch.choose`) between them."""
from .dispatch import CHECKPOINT, COMPILED, INFERENCE, INFERENCE_ONLY, REFERENCE, TRAIN, Fast, Path, Supports, choose

__all__ = ['CHECKPOINT', 'COMPILED', 'INFERENCE', 'INFERENCE_ONLY', 'REFERENCE', 'TRAIN', 'Fast', 'Path', 'Supports',
           'choose']
