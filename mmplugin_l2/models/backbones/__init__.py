from .hvit3 import HViT3, ViT3

__all__ = ['HViT3', 'ViT3']
