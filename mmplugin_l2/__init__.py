"""mmplugin_l2: H-ViT3, L2ViT and ResT backbones for mmdet / mmseg / mmpretrain.

`custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)` registers every backbone in
MMEngine's root MODELS registry (found from mmdet, mmseg and mmpretrain scopes alike) and allow-lists
mmengine's checkpoint types for torch's safe loader; `ExactResumeHook` (hooks.py) joins mmengine's HOOKS; `config.py` makes `_base_ = 'mmplugin_l2::mmdet/...'` resolve
to the configs installed with the package (docs/get_started.md).
"""
from . import checkpoint  # noqa: F401  (registers the safe globals)
from . import config  # noqa: F401  (lets mmengine resolve `mmplugin_l2::PATH` configs)
from . import hooks  # noqa: F401  (registers ExactResumeHook in mmengine's HOOKS)
from .models import *  # noqa: F401,F403
from .version import __version__  # noqa: F401
