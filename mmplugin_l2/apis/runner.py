"""Config loading and runner set-up shared by tools/train.py and tools/test.py: one entry point for mmdet,
mmseg and mmpretrain configs.

The framework is read from the config's `default_scope` ('mmdet', 'mmseg' or 'mmpretrain'); everything
else is the libraries' own Runner, datasets, evaluators and visualisation hooks.
"""
import os
import os.path as osp

from mmengine.config import Config

SCOPES = ('mmdet', 'mmseg', 'mmpretrain')


def load_config(path, cfg_options=None, work_dir=None, launcher='none'):
    if not osp.isfile(path):
        raise FileNotFoundError(f'config file not found: {path}')
    cfg = Config.fromfile(path)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    scope = cfg.get('default_scope')
    if scope not in SCOPES:
        raise ValueError(f'{path}: default_scope is {scope!r}; tools/train.py and tools/test.py handle '
                         f'configs of {SCOPES} (inherit their bases, e.g. _base_ = "mmdet::...")')
    cfg.launcher = launcher
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get('work_dir') is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(path))[0])
    return cfg


def enable_visualization(cfg, show_dir):
    """Draw every test image with its predictions into `show_dir`, the same rule for the three libraries
    (relative: under ``<work_dir>/<timestamp>/``, absolute: as is; see `show_dir.py` and docs/tools.md).

    Args:
        cfg (Config): the run's config; its ``default_hooks.visualization`` is set up in place.
        show_dir (str): the `--show-dir` value.
    """
    from .show_dir import cls_hook, seg_hook
    hooks = cfg.default_hooks
    if 'visualization' not in hooks:
        raise ValueError('--show-dir needs a visualization hook in default_hooks')
    vis = hooks.visualization
    keep = {k: vis[k] for k in ('backend_args', 'wait_time') if k in vis}
    if cfg.default_scope == 'mmdet':
        vis.draw = True
        vis.test_out_dir = show_dir
    elif cfg.default_scope == 'mmseg':
        hooks.visualization = dict(type=seg_hook(), draw=True, interval=1, out_dir=show_dir, **keep)
    else:
        hooks.visualization = dict(type=cls_hook(), enable=True, interval=1, out_dir=show_dir, **keep)


def _sync_bn_to_bn(node):
    if isinstance(node, dict):
        if node.get('type') == 'SyncBN':
            node['type'] = 'BN'
        for v in node.values():
            _sync_bn_to_bn(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _sync_bn_to_bn(v)


def setup_cpu_distributed(cfg):
    """Make a `--launcher pytorch` run work without GPUs: gloo process group, DDP without device ids,
    BN instead of SyncBN (which needs GPU tensors). mmengine assumes CUDA for the pytorch launcher."""
    import torch
    import torch.distributed as dist
    if cfg.launcher == 'none' or torch.cuda.is_available():
        return
    cfg.setdefault('env_cfg', {}).setdefault('dist_cfg', {})['backend'] = 'gloo'
    if not dist.is_initialized():
        dist.init_process_group(backend='gloo')
    if cfg.get('model_wrapper_cfg') is None:
        cfg.model_wrapper_cfg = dict(
            type='MMDistributedDataParallel', device_ids=None, broadcast_buffers=False,
            find_unused_parameters=cfg.get('find_unused_parameters', False))
    _sync_bn_to_bn(cfg.model)


def build_runner(cfg):
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner
    if 'runner_type' in cfg:
        return RUNNERS.build(cfg)
    return Runner.from_cfg(cfg)


def format_metrics(metrics):
    """One line per metric, e.g. `coco/bbox_mAP: 0.1234`."""
    def fmt(v):
        try:
            return f'{float(v):.4f}'
        except (TypeError, ValueError):
            return str(v)
    return '\n'.join(f'  {k}: {fmt(v)}' for k, v in metrics.items())


def set_local_rank(local_rank):
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(local_rank)




def to_json(v):
    """Metrics come as python, numpy or torch numbers (or strings, e.g. COCO's copypaste lines)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)
