"""The benchmark: every backbone the project knows (ours, the authors' code, mmpretrain's DeiT / ViT, mmdet's
Swin / PVTv2), inference latency and throughput, the largest batch within a memory budget, training-step time
and peak memory, across resolutions, on CPU or CUDA; one results file, from which docs/benchmark.md's tables
and plot are generated.

    python tools/analysis/benchmark.py run [--suite headline|detection|all] [--models ...] [--sizes 224 800x1344 ...]
        [--batches 1 2] [--kinds infer train maxbatch] [--precision fp32 tf32 bf16 fp16] [--rounds 3]
        [--allocator glibc caching live jemalloc tcmalloc] [--warmup 2] [--iters 3] [--budget-mb 8000]
        [--device cpu|cuda] [--authors-code FAMILY=PATH ...]
        [--timeout S] [--smoke] --out results.json
    python tools/analysis/benchmark.py merge a.json b.json ... --out results.json
    python tools/analysis/benchmark.py render results.json [--doc docs/benchmark.md] [--plot docs/benchmark.png]
    python tools/analysis/benchmark.py models

`run`: every measurement in a fresh Python process; per round every model once per (kind, size, batch,
precision), the models' order rotating between rounds; the results file (machine, versions, commit, every sample)
is rewritten after each measurement. A suite sets models, sizes, batches and kinds; the other flags override them.
`--precision` (default fp32: TF32 off): one or more of fp32, tf32 (TF32 on), bf16, fp16 (autocast to that dtype
around the forward, as AMP training does; no loss scaling); a sample records its precision when not fp32.
`--warmup` (default 2) untimed steps come first: a fresh process's first steps page-fault its heap in.
`--allocator` (default glibc): the CPU allocator each fresh process runs under (caching: glibc keeping freed
memory, as a GPU's caching allocator does; live: glibc returning freed tensors at once, so the peak counts live
tensors as CUDA's max_memory_allocated does; jemalloc / tcmalloc preloaded when installed); a sample records it
when not glibc, and each allocator is tabled apart. A
failed measurement (an exception, out of memory, --timeout) is kept as a sample with its one-line error.
`maxbatch`: batches 1, 2, 4, ... until the inference peak memory exceeds --budget-mb, then bisection; each
probe a fresh process; then the throughput at the batch found. `<model>@authors` (e.g. hvit3_t@authors) is the
authors' implementation from their checkout, `--authors-code ViTTT=PATH L2ViT=PATH ResT=PATH` (timm needed).
`merge`: one results file from several runs (e.g. a headline and a detection run; samples of the same model,
kind, size, batch and precision from different runs are pooled as rounds, so merge runs of one machine and code
only). `render`: the tables (median over rounds, min-max) and ratios between the docs' model pairs, the crossover
resolution, written between the generated markers of --doc; one set of tables per precision (headed 'fp32',
'bf16 autocast', ...) when the results hold several, samples of different precisions never pooled; the plot
(fp32 samples; a file without any: its first precision) to --plot.
"""
import argparse
import json
import os
import os.path as osp
import sys

from mmplugin_l2.analysis import authors
from mmplugin_l2.analysis import benchmark as bm
from mmplugin_l2.analysis.measure import ALLOCATORS, PRECISIONS, WARMUP, allocator_env, half_units_warning
from mmplugin_l2.analysis.models import MODELS, checked_names, label

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))



def parse_args(argv=None):
    p = argparse.ArgumentParser(prog='benchmark.py', description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split('\n\n', 2)[2])
    sub = p.add_subparsers(dest='command', required=True)
    r = sub.add_parser('run', help='measure and write a results file')
    r.add_argument('--suite', choices=sorted(bm.SUITES), default='headline')
    r.add_argument('--models', nargs='+', help='MODELS names or <ours>@authors (default: the suite\'s)')
    r.add_argument('--sizes', nargs='+', type=bm.size_arg, help='H or HxW (default: the suite\'s)')
    r.add_argument('--batches', nargs='+', type=int)
    r.add_argument('--kinds', nargs='+', choices=bm.KINDS)
    r.add_argument('--precision', nargs='+', choices=list(PRECISIONS), default=['fp32'],
                   help='fp32 (TF32 off), tf32 (TF32 on), bf16 / fp16 (autocast); several: each measured, '
                        'tabled apart (default: fp32)')
    r.add_argument('--rounds', type=int, default=3)
    r.add_argument('--allocator', nargs='+', choices=list(ALLOCATORS), default=['glibc'],
                   help='the CPU allocator of each measurement\'s process: glibc (its default), caching (glibc '
                        'keeping freed memory, as a GPU\'s caching allocator), live (the peak follows the live '
                        'tensors; times not a benchmark), jemalloc / tcmalloc (preloaded); several: each '
                        'measured, tabled apart (default: glibc)')
    r.add_argument('--warmup', type=int, default=WARMUP,
                   help=f'untimed steps first (default {WARMUP}: the steady state)')
    r.add_argument('--iters', type=int, default=3)
    r.add_argument('--budget-mb', type=float, default=8000., help='memory budget of maxbatch (MB)')
    r.add_argument('--max-batch', type=int, default=256)
    r.add_argument('--device', default='cpu')
    r.add_argument('--authors-code', nargs='+', type=authors.family_path, default=[], metavar='FAMILY=PATH')
    r.add_argument('--timeout', type=float, default=None, help='seconds per measurement (default: none)')
    r.add_argument('--cfg-options', nargs='+', type=bm.option_arg, default=[], metavar='KEY=VALUE',
                   help='overrides of our backbones\' arguments (ours only: the other models and the authors\' '
                        'are built as they are), dotted keys nest (e.g. fast_train=False '
                        'memory_policy.max_elems=1048576); the samples of our models record them')
    r.add_argument('--smoke', action='store_true', help='label the results a smoke run (not a benchmark)')
    r.add_argument('--out', required=True, help='results JSON')
    d = sub.add_parser('render', help='write docs tables and plot from a results file')
    d.add_argument('results')
    d.add_argument('--doc', default=osp.join(ROOT, 'docs', 'benchmark.md'))
    d.add_argument('--plot', default=osp.join(ROOT, 'docs', 'benchmark.png'))
    d.add_argument('--check', action='store_true', help='exit 1 if --doc differs from what render writes')
    g = sub.add_parser('merge', help='one results file from several')
    g.add_argument('results', nargs='+')
    g.add_argument('--out', required=True)
    sub.add_parser('models', help='list the model table')
    args = p.parse_args(argv)
    if args.command == 'run':
        for k, v in bm.SUITES[args.suite].items():
            if getattr(args, k) is None:
                setattr(args, k, [bm.parse_size(s) for s in v] if k == 'sizes' else list(v))
        args.precision = list(dict.fromkeys(args.precision))
        args.allocator = list(dict.fromkeys(args.allocator))
        for a in args.allocator:
            try:
                allocator_env(a)
            except ValueError as e:
                p.error(str(e))
        if min(args.rounds, args.iters, *args.batches) < 1 or args.warmup < 0:
            p.error('--rounds, --iters and --batches must be >= 1, --warmup >= 0')
        if args.device != 'cpu' and not args.device.startswith('cuda'):
            p.error(f'--device {args.device!r}: allowed cpu, cuda, cuda:N')
        args.authors_roots = checked_names(args.models, args.authors_code, p.error)
        out_dir = osp.dirname(osp.abspath(args.out))
        if not osp.isdir(out_dir):
            os.makedirs(out_dir)
    elif args.command in ('render', 'merge'):
        for f in [args.results] if args.command == 'render' else args.results:
            if not osp.isfile(f):
                p.error(f'results file {f} not found')
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.command == 'models':
        for name, cfg in MODELS.items():
            print(f'{name:14s} {label(name):52s} {cfg["type"]}')
        for name, (fam, _) in authors.AUTHORS.items():
            print(f'{name + bm.AUTHORS_TAG:14s} {label(name + bm.AUTHORS_TAG):52s} needs --authors-code {fam}=PATH')
        return 0
    if args.command == 'merge':
        parts = []
        for path in args.results:
            with open(path) as f:
                parts.append(json.load(f))
        try:
            merged = bm.merge(parts)
        except ValueError as e:
            raise SystemExit(f'benchmark.py: error: {e}') from None
        with open(args.out, 'w') as f:
            json.dump(merged, f, indent=1)
        print(f'wrote {args.out} ({len(merged["samples"])} samples from {len(merged["runs"])} runs)')
        return 0
    if args.command == 'render':
        with open(args.results) as f:
            results = json.load(f)
        if results.get('format') != bm.FORMAT:
            raise SystemExit(f'benchmark.py: error: {args.results} is not a results file of this tool '
                             f'(format {results.get("format")!r}, expected {bm.FORMAT!r})')
        with open(args.doc) as f:
            doc = f.read()
        try:
            new = bm.replace_section(doc, bm.render(results))
        except ValueError as e:
            raise SystemExit(f'benchmark.py: error: {args.doc}: {e}') from None
        if args.check:
            if new != doc:
                print(f'{args.doc} differs from render of {args.results}')
                return 1
            print(f'{args.doc} is up to date with {args.results}')
            return 0
        with open(args.doc, 'w') as f:
            f.write(new)
        bm.plot(results, args.plot)
        print(f'wrote the tables of {args.doc} and {args.plot}')
        return 0
    specs = bm.schedule(args.models, args.sizes, args.batches, args.kinds, args.rounds, args.precision,
                        args.allocator)
    common = dict(warmup=args.warmup, iters=args.iters, device=args.device, budget_mb=args.budget_mb,
                  max_batch=args.max_batch, authors_roots=args.authors_roots)
    if args.cfg_options:
        common['cfg'] = bm.nested(dict(args.cfg_options))
    config = dict(suite=args.suite, models=args.models, sizes=[list(s) for s in args.sizes], batches=args.batches,
                  kinds=args.kinds, precisions=args.precision, allocators=args.allocator, rounds=args.rounds,
                  warmup=args.warmup,
                  iters=args.iters, cfg=common.get('cfg'),
                  budget_mb=args.budget_mb, command=' '.join(['python', 'tools/analysis/benchmark.py']
                                                              + sys.argv[1:] if argv is None else argv))
    results = dict(format=bm.FORMAT, smoke=args.smoke, env=bm.environment(args.device), config=config, samples=[])
    if args.smoke:
        results['note'] = ('tiny sizes and one round, run only to show the format; replace with a real run '
                           '(see "How to run").')
    print(f'{len(specs)} measurements -> {args.out}', flush=True)
    for message in filter(None, (half_units_warning(prec, args.device) for prec in args.precision)):
        print(f'warning: {message}', flush=True)
    bm.run(specs, common, args.out, results, timeout=args.timeout, log=lambda s: print(s, flush=True))
    failed = [s for s in results['samples'] if 'error' in s]
    print(f'wrote {args.out} ({len(results["samples"])} samples, {len(failed)} failed)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
