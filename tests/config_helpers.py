"""What the config tests share: cached config loading and the framework registries of a config."""
import copy
import functools
import importlib
import os.path as osp

# `mmdet::`-style bases make mmengine parse every metafile of the package for each base it resolves
# (about a second each); memoise that YAML parsing so the configs load in seconds. Read-only use.
import mmengine.config.utils as _cfg_utils
from mmengine.config import Config
from mmengine.registry import init_default_scope

if not isinstance(_cfg_utils.load, functools._lru_cache_wrapper):
    _cfg_utils.load = functools.lru_cache(maxsize=None)(_cfg_utils.load)

CFG_ROOT = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'configs')


@functools.lru_cache(maxsize=None)
def _load(rel):
    return Config.fromfile(osp.join(CFG_ROOT, rel))


def load(rel, cfg_options=None):
    """A private copy of configs/`rel`, with `cfg_options` merged in."""
    cfg = copy.deepcopy(_load(rel))
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return cfg


def registries(cfg):
    """MODELS and TRANSFORMS of the config's library, with its default scope set."""
    scope = cfg.default_scope
    if scope not in ('mmdet', 'mmseg', 'mmpretrain'):
        raise AssertionError(f'unexpected default_scope {scope!r}')
    init_default_scope(scope)
    reg = importlib.import_module(f'{scope}.registry')
    return reg.MODELS, reg.TRANSFORMS
