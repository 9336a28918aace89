"""Accuracy of the backbones off the fp32 path: fp32 vs float64, batch independence, fp16 / bf16 autocast,
half-precision weights, gradients under autocast (see mmplugin_l2/analysis/precision.py for the figures).

    python tools/analysis/precision.py [--models hvit3_t vit3_t l2vit_t rest_s] [--sizes 224 800x1344]
        [--checks fp64 batch bf16 fp16 half bfloat16 grad_bf16 grad_fp16 grad_fp64] [--device cpu|cuda]
        [--authors-code ResT=PATH ...] [--same-weights] [--out results.json]

Random weights (seeded; norms, biases and BatchNorm statistics randomised too, as in the benchmark's
parity check), eval mode, batch 2 (only the batch check uses the second image). With --authors-code the
fp64, batch, autocast and grad_fp64 checks also run on the authors' implementation of each model, for comparison (and
ours is built in the configuration that computes their function, e.g. ResT with norm_in_path=True).
"""
import argparse
import json
import math

import torch

from mmplugin_l2.analysis import authors as authors_mod
from mmplugin_l2.analysis.benchmark import parse_size
from mmplugin_l2.analysis.models import MODELS, build
from mmplugin_l2.analysis.precision import CHECKS, run_checks

#: the checks also run on the authors' models (their code under autocast, as AMP users would run it)
AUTHORS_CHECKS = ('fp64', 'batch', 'bf16', 'fp16', 'grad_fp64')
EXTRA = {'vit3_t': dict(type='ViT3', arch='tiny', drop_path_rate=0.)}


def build_model(name, extra_cfg=None):
    if name in EXTRA:
        MODELS.setdefault(name, EXTRA[name])
    return authors_mod.randomize_(build(name, extra_cfg), seed=1)


def fmt(v):
    return 'inf' if not math.isfinite(v) else f'{v:.1e}'


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--models', nargs='+', default=['hvit3_t', 'vit3_t', 'l2vit_t', 'rest_s'])
    p.add_argument('--sizes', nargs='+', default=['224', '800x1344'])
    p.add_argument('--checks', nargs='+', default=list(CHECKS), choices=list(CHECKS))
    p.add_argument('--device', default='cpu')
    p.add_argument('--authors-code', nargs='+', default=[], metavar='FAMILY=PATH')
    p.add_argument('--same-weights', action='store_true',
                   help="with --authors-code: ours gets the authors' random weights (their state_dict through our "
                        "convert_state_dict), so both compute one function; otherwise each is randomised on its own")
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--out', help='write the results to this JSON file')
    args = p.parse_args(argv)
    roots = dict(a.split('=', 1) for a in args.authors_code)
    results = []
    for size_s in args.sizes:
        size = parse_size(size_s)
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(args.seed)).to(args.device)
        for name in args.models:
            family = authors_mod.AUTHORS.get(name, (None,))[0]
            # beside the authors' model, ours in the configuration that computes their function
            extra = authors_mod.OURS_MATCHING_CFG.get(name) if family in roots else None
            entries = [(name, lambda: build_model(name, extra), args.checks)]
            if family in roots:
                def theirs(name=name, family=family):
                    torch.manual_seed(args.seed)
                    return authors_mod.randomize_(authors_mod.build(name, roots[family]), seed=1)
                if args.same_weights:
                    def theirs(name=name, family=family, plain=theirs):
                        m = plain()
                        with torch.no_grad():   # ViTTT's inner-loss scale differs on a module's first call
                            m.eval()(x[:1])
                        return m

                    def ours(name=name, extra=extra, state=theirs().model.state_dict()):
                        m = build_model(name, extra)
                        m.load_state_dict(m.convert_state_dict(state), strict=True)
                        return m
                    entries[0] = (name, ours, args.checks)
                entries.append((name + '@authors', theirs, [c for c in args.checks if c in AUTHORS_CHECKS]))
            for label, make, checks in entries:
                torch.manual_seed(args.seed)
                model = make().to(args.device)
                res = run_checks(model, x, checks)
                results.append(dict(model=label, size=size_s, checks=res))
                for c, v in res.items():
                    print(f'{label:16s} {size_s:>9s} {c:10s} ' + ' / '.join(fmt(e) for e in v), flush=True)
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(dict(device=args.device, torch=torch.__version__, results=results), f, indent=1)
    return results


if __name__ == '__main__':
    main()
