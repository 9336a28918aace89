"""What tools/train.py and tools/test.py share: one entry point for mmdet, mmseg and mmpretrain configs.

The framework is read from the config's `default_scope` ('mmdet', 'mmseg' or 'mmpretrain'); everything
else is the libraries' own Runner, datasets, evaluators and visualisation hooks.
"""
import os
import os.path as osp

from mmengine.config import Config

SCOPES = ('mmdet', 'mmseg', 'mmpretrain')

DATA_HELP = {
    'mmdet': 'COCO 2017 (train2017/, val2017/, annotations/instances_*.json) under data/coco/',
    'mmseg': 'ADE20K (ADEChallengeData2016/images, ADEChallengeData2016/annotations) under data/ade/',
    'mmpretrain': 'ImageNet-1k (train/, val/, meta/{train,val}.txt) under data/imagenet/',
}


class DatasetNotFoundError(FileNotFoundError):
    pass


class NothingToResumeError(FileNotFoundError):
    pass


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


def _datasets(ds):
    """Leaf dataset configs under wrappers (RepeatDataset, ClassBalancedDataset, ConcatDataset)."""
    if ds is None:
        return []
    if 'datasets' in ds:
        return [leaf for d in ds['datasets'] for leaf in _datasets(d)]
    if 'dataset' in ds:
        return _datasets(ds['dataset'])
    return [ds]


def dataset_paths(ds):
    """The files and folders a dataset config will read."""
    root = ds.get('data_root') or ''
    paths = []
    if root:
        paths.append(root)
    if ds.get('ann_file'):
        paths.append(osp.join(root, ds['ann_file']))
    prefix = ds.get('data_prefix')
    if isinstance(prefix, dict):
        paths += [osp.join(root, p) for p in prefix.values() if isinstance(p, str) and p]
    elif isinstance(prefix, str) and prefix:
        paths.append(osp.join(root, prefix))
    if ds.get('split') and root and not ds.get('ann_file'):
        paths.append(osp.join(root, ds['split']))
    return paths


def check_data(cfg, loaders):
    """Raise DatasetNotFoundError naming the first missing path, what it should hold and how to run
    the demo instead."""
    for name in loaders:
        loader = cfg.get(name)
        if not loader:
            continue
        for ds in _datasets(loader.get('dataset')):
            for p in dataset_paths(ds):
                if not osp.exists(p):
                    raise DatasetNotFoundError(
                        f'dataset path not found: {p!r} (needed by {name}, dataset '
                        f'{ds.get("type")}).\n  This config expects '
                        f'{DATA_HELP[cfg.default_scope]}: download it there or point the config at '
                        f'it, e.g. --cfg-options {name}.dataset.data_root=/path/to/data/\n  To try '
                        f'the model without the real data, generate the demo data and run the demo: '
                        f'python tools/make_demo_data.py && bash tools/demo.sh  (docs/get_started.md, "Demo")')


def check_pretrained(cfg):
    """Raise FileNotFoundError when the backbone's `init_cfg` names a checkpoint file that is missing."""
    init = cfg.model.get('backbone', {}).get('init_cfg')
    if isinstance(init, dict) and init.get('type') == 'Pretrained':
        path = init.get('checkpoint', '')
        if '://' not in path and not osp.isfile(path):
            raise FileNotFoundError(
                f'pretrained backbone weights not found: {path!r} (model.backbone.init_cfg).\n  Put the '
                f'authors\' ImageNet checkpoint there (tools/convert_checkpoint.py converts it; docs/get_started.md), '
                f'or train from scratch with --cfg-options model.backbone.init_cfg=None')


def enable_visualization(cfg, show_dir):
    """Draw test predictions into `show_dir` with the framework's own visualisation hook."""
    hooks = cfg.default_hooks
    if 'visualization' not in hooks:
        raise ValueError('--show-dir needs a visualization hook in default_hooks')
    vis = hooks.visualization
    if cfg.default_scope == 'mmdet':
        vis.draw = True
        vis.test_out_dir = show_dir
    elif cfg.default_scope == 'mmseg':
        vis.draw = True
        cfg.visualizer.save_dir = show_dir
    else:
        vis.enable = True
        vis.out_dir = show_dir


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


# ---- checkpoints --------------------------------------------------------------------------------
FIT_HINT = ('Is it a checkpoint of this config\'s model (same detector / segmentor / classifier, backbone '
            'type and arch, number of classes)? To load it anyway, keeping only the keys that fit, pass '
            '--non-strict.')


def read_checkpoint(path):
    """The checkpoint at `path`, or a CheckpointError / FileNotFoundError in one line (see
    mmplugin_l2.checkpoint.load_checkpoint_file)."""
    from .checkpoint import load_checkpoint_file
    return load_checkpoint_file(path)


def unwrap_model(model):
    from mmengine.model import is_model_wrapper
    return model.module if is_model_wrapper(model) else model


def check_checkpoint_fits(model, ckpt, source, strict=True, logger='current'):
    """Compare a whole-model checkpoint with `model` (keys and shapes). Strict: raise CheckpointError
    listing the missing / unexpected / mis-shaped keys; else log them as a warning. mmengine's own
    `Runner.load_checkpoint` only warns (strict=False)."""
    from mmengine.logging import print_log

    from .checkpoint import CheckpointError, describe_mismatch, model_state_dict, state_dict_mismatch
    model = unwrap_model(model)
    sd = model_state_dict(ckpt, source)
    mismatch = state_dict_mismatch(model, sd)
    if not any(mismatch):
        return
    if strict:
        raise CheckpointError(describe_mismatch(model, mismatch, source, FIT_HINT, limit=5))
    import logging
    print_log(describe_mismatch(model, mismatch, source, '--non-strict: loading the keys that fit; the '
                                'others keep their initialisation.', limit=5),
              logger=logger, level=logging.WARNING)


def resolve_resume(cfg, resume):
    """`--resume` (auto: the latest checkpoint of work_dir, as named by its `last_checkpoint` file) or
    `--resume PATH` -> the checkpoint path; set cfg.resume / cfg.load_from. Nothing to resume is an
    error (NothingToResumeError), not a silent run from scratch."""
    if resume is None:
        return None
    if resume == 'auto':
        from mmengine.runner import find_latest_checkpoint
        path = find_latest_checkpoint(cfg.work_dir) if osp.isdir(cfg.work_dir) else None
        if path is None:
            raise NothingToResumeError(
                f'--resume: nothing to resume in work dir {cfg.work_dir!r} (no last_checkpoint file there; '
                f'it is written with each checkpoint). Start without --resume to train from scratch, pass '
                f'the checkpoint as --resume PATH, or point --work-dir at the interrupted run.')
    else:
        path = resume
        if not osp.exists(path):
            raise NothingToResumeError(f'--resume: checkpoint file not found: {path!r}')
    cfg.resume, cfg.load_from = True, path
    return path


RESUME_HOOK = 'ExactResumeHook'


def add_resume_hook(cfg):
    """Add ExactResumeHook (mmplugin_l2/hooks.py) to `custom_hooks` unless the config lists it; a config
    opts out with `exact_resume = False`."""
    if cfg.get('exact_resume', True) is False:
        return
    hooks = list(cfg.get('custom_hooks') or [])
    if not any(h.get('type') in (RESUME_HOOK, f'mmplugin_l2.{RESUME_HOOK}') for h in hooks):
        hooks.append(dict(type=RESUME_HOOK))
    cfg.custom_hooks = hooks
