"""Attention maps of one query position, drawn on the image: a grid PNG (and a JSON summary) per image.

    python tools/analysis/vis_attention.py CONFIG [CHECKPOINT] --image IMG [IMG ...] --layer NAME [NAME ...]
        --query Y X --out DIR [--size H [W]] [--max-heads 8] [--cfg-options k=v ...]
    python tools/analysis/vis_attention.py CONFIG --list-layers

CONFIG: any mmdet / mmseg / mmpretrain config with one of our backbones; CHECKPOINT: a tools/train.py
checkpoint or an authors' release file (omitted: random weights). --layer: attention modules or their
blocks (e.g. stages.2.1 for L2ViT's LGA block, layers.2.blocks.0 for ResT / H-ViT3); --query: pixel (y, x)
of the resized input. Maps (docs/visualization.md; definitions in mmplugin_l2/analysis/vis.py): L2ViT LWA
window softmax, LGA linear attention before and after LCM, ResT EMSA after head mixing and instance norm,
H-ViT3 / ViT3 TTT sensitivity |d out / d(k, v)|. Rows: one per map; columns: input, mean over heads, heads.
"""
import argparse
import json
import os
import os.path as osp
import time

from mmengine.config import DictAction

from mmplugin_l2.analysis import vis
from mmplugin_l2.analysis.inputs import build_backbone, load_config, load_image, norm_stats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('config')
    p.add_argument('checkpoint', nargs='?', help='weights (default: random, seed --seed)')
    p.add_argument('--image', nargs='+', help='image files')
    p.add_argument('--layer', nargs='+', help='attention layers or blocks (--list-layers shows them)')
    p.add_argument('--query', nargs=2, type=int, metavar=('Y', 'X'), help='query pixel of the resized input')
    p.add_argument('--size', nargs='+', type=int, default=[224], metavar='H [W]', help='input size (default 224)')
    p.add_argument('--out', default='work_dirs/vis_attention', help='output folder')
    p.add_argument('--max-heads', type=int, default=8)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--list-layers', action='store_true', help='print the attention layers and exit')
    p.add_argument('--cfg-options', nargs='+', action=DictAction, default={})
    args = p.parse_args(argv)

    import torch
    torch.manual_seed(args.seed)
    cfg = load_config(args.config, args.cfg_options)
    backbone = build_backbone(cfg, args.checkpoint)
    if args.list_layers:
        for name, m in vis.attention_layers(backbone).items():
            print(f'{name:32s} {vis.ATTENTION_KINDS[type(m).__name__]}')
        return None
    for opt in ('image', 'layer', 'query'):
        if getattr(args, opt) is None:
            p.error(f'--{opt} is required (unless --list-layers)')
    for name in args.layer:   # bad names fail before any image is read
        vis.resolve_layer(backbone, name)
    size = (args.size * 2)[:2] if len(args.size) == 1 else args.size[:2]
    mean, std, to_rgb = norm_stats(cfg)
    os.makedirs(args.out, exist_ok=True)
    weights = args.checkpoint or f'random weights (seed {args.seed})'
    written = []
    for k, path in enumerate(args.image):
        t0 = time.time()
        x, img = load_image(path, size, mean, std, to_rgb)
        y, xq = args.query
        vis.pixel_to_token((y, xq), size, (1, 1))   # range check of the pixel

        def query_fn(name, hw):
            return vis.pixel_to_token((y, xq), size, hw)[:2]
        results = vis.layer_maps(backbone, x, args.layer, query_fn)
        stem = osp.splitext(osp.basename(path))[0]
        png = osp.join(args.out, f'{stem}_attention.png')
        vis.draw_grid(img, results, png, (y, xq), args.max_heads,
                      title=f'{osp.basename(args.config)} | {weights} | query pixel ({y}, {xq})')
        summary = []
        for r in results:
            check = max(float((r['out'][key] - r['ref'][key]).abs().max()) for key in r['out'])
            summary.append(dict(layer=r['layer'], kind=r['kind'], map_hw=list(r['hw']), query_token=list(r['query']),
                                maps={t: list(m.shape) for t, m, _ in r['panels']},
                                recompute_max_abs_err=check,
                                **({'padding_mass': r['padding_mass'].tolist()} if 'padding_mass' in r else {})))
        with open(osp.join(args.out, f'{stem}_attention.json'), 'w') as f:
            json.dump(dict(config=args.config, weights=weights, image=path, size=list(size), query_pixel=[y, xq],
                           layers=summary), f, indent=1)
        written.append(png)
        print(f'[{k + 1:3d}/{len(args.image)}] {path} -> {png} ({time.time() - t0:.1f} s; '
              + ', '.join(f'{s["layer"]} token {tuple(s["query_token"])}' for s in summary) + ')', flush=True)
    return written


if __name__ == '__main__':
    main()
