"""Parameters and FLOPs (multiply-adds, as the papers count) of an mmdet / mmseg / mmpretrain config's
model, whole and backbone alone.

    python tools/analysis/get_flops.py CONFIG [--shape H W] [--json OUT] [--cfg-options k=v ...]
    python tools/analysis/get_flops.py --update-metafile configs/l2vit/metafile.yml [--only REGEX]

--update-metafile rewrites the Parameters and FLOPs lines (whole model, default input) of every entry of a
metafile (or of those whose name matches --only) with this counter's numbers, leaving the rest of the file as is.

Default input: 800x1280 (mmdet), 512x2048 (mmseg), 224x224 (mmpretrain). Counted with mmengine's port of
fvcore's counter: convolutions, linears, matmuls, norms, upsampling; element-wise ops are not counted.
Detector FLOPs depend on the number of RPN proposals that reach the RoI heads (test_cfg).
"""
import argparse
import json
import os.path as osp
import re

from mmengine.config import DictAction

import mmplugin_l2  # noqa: F401
from mmplugin_l2.analysis.flops import model_complexity
from mmplugin_l2.apis import load_config


ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))


def set_entry_numbers(text, name, params, flops):
    """Metafile text with the `Parameters` and `FLOPs` lines of entry `name` set (FLOPs inserted after
    Parameters when absent).

    Args:
        text (str): the metafile's text.
        name (str): the entry's `Name`.
        params (int): number of parameters.
        flops (int): multiply-adds at the default input.
    """
    lines = text.split('\n')
    start = lines.index(f'- Name: {name}')
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith('- Name: ')), len(lines))
    block = [ln for ln in lines[start:end] if not ln.startswith('    FLOPs: ')]
    at = next(i for i, ln in enumerate(block) if ln.startswith('    Parameters: '))
    block[at:at + 1] = [f'    Parameters: {params}', f'    FLOPs: {flops}']
    return '\n'.join(lines[:start] + block + lines[end:])


def update_metafile(path, only=None):
    """Count every entry of a metafile (or those whose name matches the regex `only`) and write the numbers.

    Args:
        path (str): the metafile (configs/<family>/metafile.yml).
        only (str, optional): regex on the entry names; all entries if None.
    """
    import yaml
    meta = yaml.safe_load(open(path))
    for entry in meta['Models']:
        if only and not re.search(only, entry['Name']):
            continue
        res = model_complexity(load_config(osp.join(ROOT, entry['Config'])))
        text = set_entry_numbers(open(path).read(), entry['Name'], res['model']['params'], res['model']['flops'])
        with open(path, 'w') as f:   # after each entry: a long run keeps what it counted
            f.write(text)
        print(f"{entry['Name']}: params {res['model']['params']}  FLOPs {res['model']['flops']}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('config', nargs='?')
    p.add_argument('--update-metafile', metavar='METAFILE', help='rewrite the numbers of this metafile')
    p.add_argument('--only', help='with --update-metafile: only entries whose name matches this regex')
    p.add_argument('--shape', type=int, nargs=2, metavar=('H', 'W'), help='input height and width')
    p.add_argument('--in-channels', type=int, default=3)
    p.add_argument('--json', help='also write the numbers to this JSON file')
    p.add_argument('--cfg-options', nargs='+', action=DictAction)
    args = p.parse_args(argv)
    if args.update_metafile:
        return update_metafile(args.update_metafile, args.only)
    if args.config is None:
        p.error('give a CONFIG, or --update-metafile METAFILE')
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
