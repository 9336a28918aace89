"""Train a model from an mmdet, mmseg or mmpretrain config with an mmplugin_l2 backbone.

    python tools/train.py CONFIG [--work-dir DIR] [--resume [CKPT]] [--non-strict] [--amp] [--cfg-options k=v ...]
    bash tools/dist_train.sh CONFIG NUM_PROCS [args...]        # torchrun, --launcher pytorch

`--resume` continues exactly (random states and data position, mmplugin_l2.hooks.ExactResumeHook, added
to every config); with nothing to resume it stops with an error. A checkpoint to resume or `load_from`, or
the backbone's `init_cfg=Pretrained` file, that does not fit the model stops the run, listing the keys
(`--non-strict` loads what fits). See docs/reliability.md.
"""
import argparse
import logging
import sys

import torch
from mmengine.config import DictAction
from mmengine.logging import print_log

import mmplugin_l2  # noqa: F401  (registers the backbones and the checkpoint allow-list)
from mmplugin_l2.checkpoint import CheckpointError
from mmplugin_l2.apis import (add_resume_hook, build_runner, check_checkpoint_fits, check_data,
                              check_pretrained, load_config, read_checkpoint, resolve_resume,
                              set_local_rank, setup_cpu_distributed)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Train an mmdet / mmseg / mmpretrain model')
    p.add_argument('config', help='config file')
    p.add_argument('--work-dir', help='where logs and checkpoints go (default: work_dirs/CONFIG_NAME)')
    p.add_argument('--resume', nargs='?', const='auto', default=None,
                   help='resume from CKPT, or from the latest checkpoint of work-dir if no path (an error '
                        'when there is none)')
    p.add_argument('--non-strict', action='store_true',
                   help='load a resume / load_from / init_cfg=Pretrained checkpoint whose keys or shapes do '
                        'not all fit the model (the keys that fit; the mismatch is logged)')
    p.add_argument('--amp', action='store_true', help='automatic mixed precision (AmpOptimWrapper)')
    p.add_argument('--auto-scale-lr', action='store_true', help='scale lr by the actual batch size')
    p.add_argument('--cfg-options', nargs='+', action=DictAction,
                   help='override config entries, key=value (e.g. train_cfg.max_epochs=1)')
    p.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'], default='none')
    p.add_argument('--local_rank', '--local-rank', type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    set_local_rank(args.local_rank)
    cfg = load_config(args.config, args.cfg_options, args.work_dir, args.launcher)
    if args.amp:
        if not torch.cuda.is_available():
            sys.exit('error: --amp (fp16 AmpOptimWrapper) needs a CUDA GPU; none is available')
        if cfg.optim_wrapper.get('type', 'OptimWrapper') == 'OptimWrapper':
            cfg.optim_wrapper.type = 'AmpOptimWrapper'
            cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')
    elif cfg.optim_wrapper.get('type') == 'AmpOptimWrapper' and not torch.cuda.is_available():
        # mmengine's AmpOptimWrapper asserts a GPU; the authors' AMP configs still train in fp32 on CPU
        print_log('the config trains with AmpOptimWrapper (fp16), which needs a GPU: training in fp32 '
                  'with OptimWrapper instead', logger='current', level=logging.WARNING)
        cfg.optim_wrapper.type = 'OptimWrapper'
        for key in ('loss_scale', 'dtype', 'use_fsdp'):
            cfg.optim_wrapper.pop(key, None)
    if args.auto_scale_lr:
        if 'auto_scale_lr' not in cfg:
            raise ValueError('--auto-scale-lr needs auto_scale_lr.base_batch_size in the config')
        cfg.auto_scale_lr.enable = True
    add_resume_hook(cfg)
    init = cfg.model.get('backbone', {}).get('init_cfg')
    if args.non_strict and isinstance(init, dict) and init.get('type') == 'Pretrained':
        init['strict'] = False
    loaders = ['train_dataloader'] + (['val_dataloader'] if cfg.get('val_cfg') else [])
    try:
        resolve_resume(cfg, args.resume)
        check_data(cfg, loaders)
        check_pretrained(cfg)
        local = cfg.get('load_from') and '://' not in str(cfg.load_from)
        ckpt = read_checkpoint(cfg.load_from) if local else None
    except (FileNotFoundError, CheckpointError) as err:
        sys.exit(f'error: {err}')
    setup_cpu_distributed(cfg)
    runner = build_runner(cfg)
    try:
        if ckpt is not None:
            check_checkpoint_fits(runner.model, ckpt, cfg.load_from, strict=not args.non_strict)
            del ckpt
        runner.train()
    except CheckpointError as err:  # also init_cfg=Pretrained, raised while the weights are initialised
        sys.exit(f'error: {err}')


if __name__ == '__main__':
    main()
