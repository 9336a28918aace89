"""Roofline of the backbones on this machine: multiply-adds (as tools/analysis/get_flops.py counts them),
latency and achieved GMAC/s against the measured matmul peaks (fp32 and bf16) and copy bandwidth, inference and
training, whole model and per layer, in fp32 or under autocast. Writes roofline.json and roofline.png.

    python tools/analysis/roofline.py [--models hvit3_t l2vit_t rest_s] [--size 800x1344] [--batch 1]
        [--train] [--precision fp32|tf32|bf16|fp16] [--device cpu|cuda] [--tiny]
        [--out-dir work_dirs/roofline]

Peaks: the best of 5 2048 x 2048 matmuls on the same threads (n^3 multiply-adds), fp32 and bf16 (operands in
bf16), and the one of --precision if it is another (tf32: fp32 with TF32 on; fp16); bandwidth: the best of 5
copies of 256 MB (bytes read + written). --precision (default fp32) runs the models in that precision
(mmplugin_l2/analysis/measure.py: bf16 / fp16 autocast) and compares them against that precision's peak ('of
peak'). Inference: one no-grad forward after a warm-up, timed per layer with forward hooks
(mmplugin_l2/analysis/roofline.py says what a layer is). Training: GMAC/s counted as 3 x the forward's
multiply-adds (forward + two backward products) per training step, the step time measured here (`--train`: one
step after one warm-up, AdamW); recomputation adds work that this figure does not count. --tiny: narrow widths
(a smoke test). Side-by-side step times across models and sizes: tools/analysis/benchmark.py.
"""
import argparse
import json
import os
import os.path as osp
import platform

import torch

from mmplugin_l2.analysis import roofline as rl
from mmplugin_l2.analysis.benchmark import PRECISION_TITLES, parse_size
from mmplugin_l2.analysis.measure import PRECISIONS, cpu_isa
from mmplugin_l2.analysis.models import MODELS, build


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split('\n\n', 2)[2])
    p.add_argument('--models', nargs='+', default=['hvit3_t', 'l2vit_t', 'rest_s'], choices=sorted(MODELS))
    p.add_argument('--size', default='800x1344')
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--train', action='store_true', help='measure a training step per model')
    p.add_argument('--precision', choices=list(PRECISIONS), default='fp32',
                   help='run the models in fp32, tf32 or bf16 / fp16 autocast, against that matmul peak')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--tiny', action='store_true', help='narrow widths (a smoke test of the tool)')
    p.add_argument('--out-dir', default='work_dirs/roofline')
    args = p.parse_args(argv)
    size, dev, prec = parse_size(args.size), torch.device(args.device), args.precision
    peaks = {q: rl.peak_matmul(device=dev, prec=q) / 1e9 for q in dict.fromkeys(('fp32', 'bf16', prec))}
    bw, isa = rl.peak_bandwidth(device=dev), cpu_isa(dev)
    print('peak matmul ' + ', '.join(f'{q} {v:.1f} GMAC/s' for q, v in peaks.items())
          + f', copy bandwidth {bw / 1e9:.1f} GB/s ({torch.get_num_threads()} threads'
          + (f', {isa}' if isa else '') + f'); models in {prec}, '
          f'\'of peak\' against the {prec} peak', flush=True)
    summary = dict(device=args.device, machine=f'{platform.machine()}, {os.cpu_count()} CPUs', torch=torch.__version__,
                   threads=torch.get_num_threads(), cpu_isa=isa,
                   size=list(size), batch=args.batch, precision=prec,
                   peak_gmacs=peaks[prec], peaks_gmacs=peaks, bandwidth_gbs=bw / 1e9, models={})
    for name in args.models:
        torch.manual_seed(0)
        model = build(name, tiny=args.tiny).to(dev)
        x = torch.randn(args.batch, 3, *size, device=dev)
        prof = rl.profile_layers(model, x, prec)
        step = rl.train_step_seconds(model, x, prec=prec) if args.train else None
        res = dict(macs=prof['macs'], inference_s=prof['seconds'],
                   inference_gmacs=prof['macs'] / prof['seconds'] / 1e9, train_step_s=step,
                   train_gmacs=3 * prof['macs'] / step / 1e9 if step else None, layers={})
        for grp, s in sorted(prof['layers'].items(), key=lambda kv: -kv[1]['seconds']):
            res['layers'][grp] = dict(s, gmacs=s['macs'] / s['seconds'] / 1e9 if s['seconds'] else None,
                                      share=s['seconds'] / prof['seconds'],
                                      mac_per_byte=s['macs'] / s['bytes'] if s['bytes'] else None)
        summary['models'][name] = res
        print(f'{name}: {prof["macs"] / 1e9:.1f} GMAC, inference {prof["seconds"]:.2f} s = '
              f'{res["inference_gmacs"]:.1f} GMAC/s ({res["inference_gmacs"] / summary["peak_gmacs"]:.0%} of peak)'
              + (f', training {step:.1f} s/step = {res["train_gmacs"]:.1f} GMAC/s '
                 f'({res["train_gmacs"] / summary["peak_gmacs"]:.0%} of peak)' if step else ''), flush=True)
        print(f'  {"layer group":34s} {"share":>6s} {"GMAC":>7s} {"GMAC/s":>7s} {"of peak":>7s} {"MAC/B":>6s}')
        for grp, s in list(res['layers'].items())[:12]:
            gm = '-' if s['gmacs'] is None else f'{s["gmacs"]:7.1f}'
            mb = '-' if s['mac_per_byte'] is None else f'{s["mac_per_byte"]:6.1f}'
            of = '-' if s['gmacs'] is None else f'{s["gmacs"] / summary["peak_gmacs"]:7.0%}'
            print(f'  {grp:34s} {s["share"]:6.0%} {s["macs"] / 1e9:7.2f} {gm:>7s} {of:>7s} {mb:>6s}')
        del model
    summary['title'] = (f'{summary["machine"]}, {summary["threads"]} threads, torch {summary["torch"]}: '
                        f'{size[0]}x{size[1]}, batch {args.batch}, {PRECISION_TITLES[prec]}'
                        + (', tiny widths' if args.tiny else ''))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(osp.join(args.out_dir, 'roofline.json'), 'w') as f:
        json.dump(summary, f, indent=2)
    rl.plot(summary, osp.join(args.out_dir, 'roofline.png'))
    print(f'wrote {args.out_dir}/roofline.json and roofline.png')
    return summary


if __name__ == '__main__':
    main()
