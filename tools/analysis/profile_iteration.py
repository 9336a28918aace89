"""Where the time of one training iteration of a config goes (data, preprocessing, backbone / neck / heads
forward, backward of the heads + neck and of the backbone, optimizer step), with the real mmengine Runner:

    python tools/analysis/profile_iteration.py CONFIG [--iters 5] [--warmup 1] [--cfg-options K=V ...]
        [--out profile.json]

Prints a markdown table (median and range over the timed iterations, share of the iteration) and writes it
as JSON with --out. See mmplugin_l2/analysis/iteration.py for what each row measures.
"""
import argparse
import json
import os.path as osp
import tempfile

from mmengine.config import DictAction


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('config')
    p.add_argument('--iters', type=int, default=5)
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--cfg-options', nargs='+', action=DictAction, default=None)
    p.add_argument('--out', help='JSON file for the table')
    args = p.parse_args()
    if args.iters < 1 or args.warmup < 0:
        p.error('--iters must be >= 1 and --warmup >= 0')

    import mmplugin_l2  # noqa: F401  (registers the backbones)
    from mmplugin_l2.analysis import iteration
    from mmplugin_l2.apis.runner import build_runner, load_config

    with tempfile.TemporaryDirectory() as work_dir:
        cfg = load_config(args.config, args.cfg_options, work_dir=work_dir)
        cfg.pop('load_from', None)
        cfg.resume = False
        runner = build_runner(cfg)
        rows = iteration.profile_iterations(*iteration.prepare(runner), iters=args.iters, warmup=args.warmup)
    print(f'{osp.basename(args.config)}: {args.iters} iteration(s) after {args.warmup} warm-up')
    print(iteration.table(rows))
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(dict(config=args.config, iters=args.iters, warmup=args.warmup, rows=rows), f, indent=1)


if __name__ == '__main__':
    main()
