"""`_base_ = 'mmplugin_l2::mmdet/mask_rcnn_l2vit_t_1x.py'` in a config anywhere on disk.

mmengine resolves `PACKAGE::PATH` through the package's installed `.mim/` folder (model-index.yml, then
`.mim/configs/PATH`), but only for the packages in its table `MODULE2PACKAGE`; importing mmplugin_l2 adds
this package to that table. setup.py installs configs/ and model-index.yml under mmplugin_l2/.mim.
The table entry must exist when the config is parsed: our tools/train.py and tools/test.py import the
plugin first; a script of your own does `import mmplugin_l2` before `Config.fromfile` (docs/get_started.md).
"""
import os.path as osp

from mmengine.config import utils as _cfg_utils

PACKAGE = 'mmplugin_l2'
_cfg_utils.MODULE2PACKAGE.setdefault(PACKAGE, PACKAGE)


def mim_dir():
    """The installed `.mim` folder (configs/, tools/, model-index.yml)."""
    return osp.join(osp.dirname(osp.abspath(__file__)), '.mim')


def config_path(rel):
    """Absolute path of an installed config, e.g. `config_path('mmdet/mask_rcnn_l2vit_t_1x.py')`."""
    path = osp.join(mim_dir(), 'configs', rel)
    if not osp.isfile(path):
        raise FileNotFoundError(
            f'{rel} is not among the configs installed with mmplugin_l2 ({osp.dirname(path)}); '
            'install it with `bash tools/install.sh` (docs/get_started.md#install) if .mim is missing')
    return path
