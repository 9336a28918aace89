from .hvit3 import HViT3, ViT3

__all__ = ['HViT3', 'ViT3']
from .l2vit import L2ViT  # noqa: E402

__all__ += ['L2ViT']
from .rest import ResT  # noqa: E402

__all__ += ['ResT']
