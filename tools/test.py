"""Evaluate a checkpoint on an mmdet, mmseg or mmpretrain config: prints COCO AP (bbox, segm), mIoU or
top-1, whichever the config's evaluator computes.

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--show-dir DIR] [--non-strict] [--cfg-options k=v ...]
    bash tools/dist_test.sh CONFIG CHECKPOINT NUM_PROCS [args...]

A checkpoint that cannot be read, or whose keys / shapes do not fit the config's model, stops with an
error listing them (`--non-strict` evaluates anyway). See docs/reliability.md.
"""
import argparse
import json
import os.path as osp
import sys

from mmengine.config import DictAction

import mmplugin_l2  # noqa: F401
from mmplugin_l2.checkpoint import CheckpointError
from mmplugin_l2.apis import (DatasetNotFoundError, build_runner, check_checkpoint_fits,
                              check_data, enable_visualization, format_metrics, load_config,
                              read_checkpoint, set_local_rank, setup_cpu_distributed, to_json)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Test (and evaluate) an mmdet / mmseg / mmpretrain model')
    p.add_argument('config', help='config file')
    p.add_argument('checkpoint', help='checkpoint file written by tools/train.py')
    p.add_argument('--work-dir', help='where the metrics log goes')
    p.add_argument('--show-dir', help='draw every test image with its predictions into this folder; '
                   'a relative one is <work_dir>/<timestamp>/DIR, an absolute one is used as is')
    p.add_argument('--out', help='also write the metrics to this JSON file')
    p.add_argument('--non-strict', action='store_true',
                   help='evaluate a checkpoint whose keys or shapes do not all fit the model (the keys '
                        'that fit are loaded, the others keep their initialisation; the mismatch is logged)')
    p.add_argument('--cfg-options', nargs='+', action=DictAction,
                   help='override config entries, key=value')
    p.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'], default='none')
    p.add_argument('--local_rank', '--local-rank', type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    set_local_rank(args.local_rank)
    if not osp.exists(args.checkpoint):
        sys.exit(f'error: checkpoint file not found: {args.checkpoint}')
    cfg = load_config(args.config, args.cfg_options, args.work_dir, args.launcher)
    cfg.load_from = args.checkpoint
    # the backbone weights come from the checkpoint; do not require the ImageNet file as well
    if cfg.model.get('backbone', {}).get('init_cfg') is not None:
        cfg.model.backbone.init_cfg = None
    if args.show_dir:
        enable_visualization(cfg, args.show_dir)
    try:
        check_data(cfg, ['test_dataloader'])
        ckpt = read_checkpoint(args.checkpoint)
    except (DatasetNotFoundError, CheckpointError) as err:
        sys.exit(f'error: {err}')
    setup_cpu_distributed(cfg)
    runner = build_runner(cfg)
    try:
        check_checkpoint_fits(runner.model, ckpt, args.checkpoint, strict=not args.non_strict)
    except CheckpointError as err:
        sys.exit(f'error: {err}')
    del ckpt
    metrics = runner.test()
    from mmengine.dist import is_main_process
    if is_main_process():
        print(f'\nResults of {osp.basename(args.config)} with {args.checkpoint}:')
        print(format_metrics(metrics), flush=True)
        if args.out:
            with open(args.out, 'w') as f:
                json.dump({k: to_json(v) for k, v in metrics.items()}, f, indent=2)
    return metrics


if __name__ == '__main__':
    main()
