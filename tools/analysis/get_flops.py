"""Parameters and FLOPs (multiply-adds, as the papers count) of an mmdet / mmseg / mmpretrain config's
model, whole and backbone alone.

    python tools/analysis/get_flops.py CONFIG [--shape H W] [--json OUT] [--cfg-options k=v ...]

Default input: 800x1280 (mmdet), 512x2048 (mmseg), 224x224 (mmpretrain). Counted with mmengine's port of
fvcore's counter: convolutions, linears, matmuls, norms, upsampling; element-wise ops are not counted.
Detector FLOPs depend on the number of RPN proposals that reach the RoI heads (test_cfg).
"""
import argparse
import json
import os.path as osp

from mmengine.config import DictAction

import mmplugin_l2  # noqa: F401
from mmplugin_l2.analysis.flops import model_complexity
from mmplugin_l2.apis import load_config


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('config')
    p.add_argument('--shape', type=int, nargs=2, metavar=('H', 'W'), help='input height and width')
    p.add_argument('--in-channels', type=int, default=3)
    p.add_argument('--json', help='also write the numbers to this JSON file')
    p.add_argument('--cfg-options', nargs='+', action=DictAction)
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.cfg_options)
    res = model_complexity(cfg, args.shape, args.in_channels)
    h, w = res['shape']
    print(f'{osp.basename(args.config)}  input {args.in_channels}x{h}x{w}')
    for part in ('model', 'backbone'):
        if part in res:
            print(f'  {part:9s} params {res[part]["params"] / 1e6:9.3f} M   '
                  f'FLOPs {res[part]["flops"] / 1e9:10.3f} G   ({res[part]["flops"]:,} multiply-adds)')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == '__main__':
    main()
