"""Effective receptive fields of backbones side by side: heat maps (PNG) and the share of gradient mass
within radii (JSON), averaged over images.

    python tools/analysis/erf.py CONFIG [CONFIG ...] --images DIR [--checkpoint CKPT|none ...]
        [--names NAME ...] [--num-images 8] [--size 1024] [--stage 3] [--radii 16 32 64 ...] [--out DIR]

CONFIG: configs of our backbones or of any other mmdet / mmseg / mmpretrain backbone, e.g.
mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py or mmdet::pvt/retinanet_pvtv2-b2_fpn_1x_coco.py; only
`model.backbone` is built. --checkpoint: one per config, `none` for random weights (the default; seeded).
--stage: the backbone output index (out_indices is set to it; 3 = stage 4 of the pyramid backbones). The
ERF is |d (sum_c relu(y[c, h/2, w/2])) / d image| summed over colour channels (mmplugin_l2/analysis/erf.py).
"""
import argparse
import json
import os
import os.path as osp
import time

from mmplugin_l2.analysis import erf
from mmplugin_l2.analysis.inputs import build_backbone, list_images, load_config, load_image, norm_stats

DEFAULT_RADII = (8, 16, 32, 64, 128, 256, 512)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('configs', nargs='+')
    p.add_argument('--images', required=True, help='folder of images (searched recursively)')
    p.add_argument('--checkpoint', nargs='+', default=None, help='one per config; "none": random weights')
    p.add_argument('--names', nargs='+', default=None, help='labels (default: config file names)')
    p.add_argument('--num-images', type=int, default=8)
    p.add_argument('--size', nargs='+', type=int, default=[1024], metavar='H [W]')
    p.add_argument('--stage', type=int, default=3, help='output index (default 3: stage 4)')
    p.add_argument('--radii', nargs='+', type=int, default=None, help='pixels (default: 8 ... size / 2)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--device', default='cpu')
    p.add_argument('--out', default='work_dirs/erf')
    args = p.parse_args(argv)

    import torch
    n = len(args.configs)
    ckpts = args.checkpoint or ['none'] * n
    names = args.names or [osp.splitext(osp.basename(c))[0] for c in args.configs]
    if len(ckpts) != n or len(names) != n:
        p.error(f'{n} configs need {n} --checkpoint / --names values, got {len(ckpts)} / {len(names)}')
    size = (args.size * 2)[:2] if len(args.size) == 1 else args.size[:2]
    radii = args.radii or [r for r in DEFAULT_RADII if r <= max(size) // 2]
    images = list_images(args.images, args.num_images)
    os.makedirs(args.out, exist_ok=True)
    results, step, total = [], 0, n * len(images)
    for config, ckpt, name in zip(args.configs, ckpts, names):
        torch.manual_seed(args.seed)
        cfg = load_config(config, {'model.backbone.out_indices': (args.stage,)})
        model = build_backbone(cfg, None if ckpt == 'none' else ckpt, device=args.device)
        mean, std, to_rgb = norm_stats(cfg)
        t0 = time.time()

        def inputs():
            for path in images:
                yield load_image(path, size, mean, std, to_rgb)[0].to(args.device)

        def progress(k, m, name=name):
            nonlocal step
            step += 1
            print(f'[{step:3d}/{total}] {name}: image {k}/{m} ({time.time() - t0:.1f} s)', flush=True)
        g, hw = erf.average_erf(model, inputs(), 0, progress)
        centre = erf.centre_pixel(size, hw)
        mass = erf.mass_within(g, centre, radii)
        results.append(dict(name=name, config=config, checkpoint=ckpt, erf=g, map_hw=list(hw),
                            centre_pixel=list(centre), mass=mass))
        print(f'{name}: stage map {hw[0]}x{hw[1]}, gradient mass within r px: '
              + ', '.join(f'{r}: {v:.3f}' for r, v in mass.items()), flush=True)
    png = erf.draw_erfs(results, osp.join(args.out, 'erf.png'),
                        title=f'ERF of output {args.stage} centre, {size[0]}x{size[1]}, {len(images)} images')
    with open(osp.join(args.out, 'erf.json'), 'w') as f:
        json.dump(dict(size=list(size), stage=args.stage, images=images, radii=radii,
                       results=[{k: v for k, v in r.items() if k != 'erf'} for r in results]), f, indent=1)
    print(f'wrote {png} and {osp.join(args.out, "erf.json")}')
    return results


if __name__ == '__main__':
    main()
