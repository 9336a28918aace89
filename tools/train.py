"""Train a model from an mmdet, mmseg or mmpretrain config with an mmplugin_l2 backbone.

    python tools/train.py CONFIG [--work-dir DIR] [--resume [CKPT]] [--amp] [--cfg-options k=v ...]
    bash tools/dist_train.sh CONFIG NUM_PROCS [args...]        # torchrun, --launcher pytorch
"""
import argparse
import logging
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

import torch  # noqa: E402
from mmengine.config import DictAction  # noqa: E402
from mmengine.logging import print_log  # noqa: E402

import mmplugin_l2  # noqa: E402,F401  (registers the backbones and the checkpoint allow-list)
from mmplugin_l2.engine import (build_runner, check_data, check_pretrained, load_config,  # noqa: E402
                                set_local_rank, setup_cpu_distributed)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Train an mmdet / mmseg / mmpretrain model')
    p.add_argument('config', help='config file')
    p.add_argument('--work-dir', help='where logs and checkpoints go (default: work_dirs/CONFIG_NAME)')
    p.add_argument('--resume', nargs='?', const='auto', default=None,
                   help='resume from CKPT, or from the latest checkpoint of work-dir if no path')
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
    if args.resume == 'auto':
        cfg.resume, cfg.load_from = True, None
    elif args.resume is not None:
        cfg.resume, cfg.load_from = True, args.resume
    loaders = ['train_dataloader'] + (['val_dataloader'] if cfg.get('val_cfg') else [])
    try:
        check_data(cfg, loaders)
        check_pretrained(cfg)
    except FileNotFoundError as err:
        sys.exit(f'error: {err}')
    setup_cpu_distributed(cfg)
    runner = build_runner(cfg)
    runner.train()


if __name__ == '__main__':
    main()
