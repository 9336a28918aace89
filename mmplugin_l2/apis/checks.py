"""Checks that stop a run before it starts on the wrong thing: missing data or pretrained weights, and
checkpoints whose keys or shapes do not fit the model (docs/reliability.md)."""
import logging
import os.path as osp

DATA_HELP = {
    'mmdet': 'COCO 2017 (train2017/, val2017/, annotations/instances_*.json) under data/coco/',
    'mmseg': 'ADE20K (ADEChallengeData2016/images, ADEChallengeData2016/annotations) under data/ade/',
    'mmpretrain': 'ImageNet-1k (train/, val/, meta/{train,val}.txt) under data/imagenet/',
}
# the environment variables our configs read their data roots from (configs/*/_base_/datasets/)
DATA_ENV = {'mmdet': 'MMPLUGIN_L2_COCO=/path/to/coco', 'mmseg': 'MMPLUGIN_L2_ADE=/path/to/ADEChallengeData2016',
            'mmpretrain': 'MMPLUGIN_L2_IMAGENET=/path/to/imagenet'}


class DatasetNotFoundError(FileNotFoundError):
    pass


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
                        f'{DATA_HELP[cfg.default_scope]}: download it there, or point our configs at it '
                        f'once with {DATA_ENV[cfg.default_scope]} (an environment variable), or set it '
                        f'on the command line: --cfg-options {name}.dataset.data_root=/path/to/data/\n  To try '
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
                f'or point our configs at the folder holding it once with MMPLUGIN_L2_PRETRAINED=/path/to/folder '
                f'(an environment variable), or train from scratch with --cfg-options model.backbone.init_cfg=None')


FIT_HINT = ('Is it a checkpoint of this config\'s model (same detector / segmentor / classifier, backbone '
            'type and arch, number of classes)? To load it anyway, keeping only the keys that fit, pass '
            '--non-strict.')


def read_checkpoint(path):
    """The checkpoint at `path`, or a CheckpointError / FileNotFoundError in one line (see
    mmplugin_l2.checkpoint.load_checkpoint_file)."""
    from ..checkpoint import load_checkpoint_file
    return load_checkpoint_file(path)


def unwrap_model(model):
    from mmengine.model import is_model_wrapper
    return model.module if is_model_wrapper(model) else model


def check_checkpoint_fits(model, ckpt, source, strict=True, logger='current'):
    """Compare a whole-model checkpoint with `model` (keys and shapes). Strict: raise CheckpointError
    listing the missing / unexpected / mis-shaped keys; else log them as a warning. mmengine's own
    `Runner.load_checkpoint` only warns (strict=False)."""
    from mmengine.logging import print_log

    from ..checkpoint import CheckpointError, describe_mismatch, model_state_dict, state_dict_mismatch
    model = unwrap_model(model)
    sd = model_state_dict(ckpt, source)
    mismatch = state_dict_mismatch(model, sd)
    if not any(mismatch):
        return
    if strict:
        raise CheckpointError(describe_mismatch(model, mismatch, source, FIT_HINT, limit=5))
    print_log(describe_mismatch(model, mismatch, source, '--non-strict: loading the keys that fit; the '
                                'others keep their initialisation.', limit=5),
              logger=logger, level=logging.WARNING)
