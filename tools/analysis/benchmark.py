"""Side-by-side backbone benchmark across resolutions: inference latency (median after warm-up),
throughput, training-step peak memory, latency-vs-tokens scaling exponents; writes a JSON file and a
log-log PNG plot.

    python tools/analysis/benchmark.py [--models hvit3_t l2vit_t rest_s swin_t pvtv2_b2]
        [--sizes 224 512 800x1344 1248] [--batch 1] [--warmup 2] [--iters 5] [--device cpu|cuda]
        [--out-dir work_dirs/benchmark] [--authors-code ViTTT=PATH L2ViT=PATH ResT=PATH]

How it measures: every (model, size) measurement runs in a fresh Python subprocess, so no allocator state
or cache carries over. Latency: `--warmup` then `--iters` no-grad forwards, median wall time (CUDA:
synchronised). Memory of one training step (forward + backward of the summed outputs): on CUDA
torch.cuda.max_memory_allocated() minus the memory allocated before the step; on CPU the process's peak
resident set (getrusage ru_maxrss) minus its resident set just before the step (model and input already
built), i.e. what the step itself adds. Ratios between models in one run are what matter; absolute
numbers depend on the machine. Models: see MODELS in mmplugin_l2/analysis/benchmark.py (ours plus mmdet's
Swin-T and PVTv2-b2).

Against the authors' code: `--authors-code FAMILY=PATH ...` names the root of a clone of their repository
per family, ViTTT (github.com/Liyining-ai/ViTTT: H-ViT3), L2ViT (github.com/ChuanyangZheng/L2ViT) and ResT
(github.com/wofmanaf/ResT); timm must be installed (`pip install timm`). Their dense-prediction backbone file
is imported from the checkout (mmplugin_l2/analysis/authors.py; nothing is copied) and each of --models
with a counterpart there (hvit3_*, l2vit_*, rest_*) is also measured as `<model>@authors` by the same
protocol. Once per model, at the smallest size, a parity check loads their randomly initialised weights
(norms and BatchNorm statistics randomised too) into ours and reports max |ours - theirs| per stage (eval
mode, batch 2, their model called once first). Our models are measured in the configuration that
reproduces the authors' outputs: ResT with norm_in_path=True (their detectron2 backbone's output norms of
stages 1-3 feed the next stage; same cost as the default side branch); the others as in MODELS. The
authors' ResT needs H, W mod 32 in {0, 29, 30, 31}. Printed and in the JSON (`vs_authors`, `parity`):
speedup = their latency / ours, mem_ratio = our training-step peak / theirs. Their lines are dashed in
the plot.
"""
import argparse
import json
import os
import os.path as osp
import platform
import subprocess
import sys


from mmplugin_l2.analysis import authors
from mmplugin_l2.analysis import benchmark as bm




def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split('\n\n', 2)[2])
    p.add_argument('--models', nargs='+', default=bm.DEFAULT_MODELS, choices=sorted(bm.MODELS))
    p.add_argument('--sizes', nargs='+', default=bm.DEFAULT_SIZES, help='H or HxW')
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--warmup', type=int, default=2)
    p.add_argument('--iters', type=int, default=5)
    p.add_argument('--device', default='cuda' if _cuda() else 'cpu')
    p.add_argument('--no-memory', action='store_true', help='skip the training-step memory measurements')
    p.add_argument('--out-dir', default='work_dirs/benchmark')
    p.add_argument('--authors-code', nargs='+', type=authors.family_path, default=[], metavar='FAMILY=PATH',
                   help='also measure the authors\' implementations from these checkouts, FAMILY one of '
                        f'{", ".join(authors.FAMILIES)} (see below)')
    p.add_argument('--worker', nargs=3, metavar=('MODEL', 'SIZE', 'MODE'), help=argparse.SUPPRESS)
    p.add_argument('--authors-root', help=argparse.SUPPRESS)
    p.add_argument('--cfg', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.authors_code = authors.checked_roots(args.authors_code, p.error)
    return args


def compared_models(models, authors_code):
    """{model: checkout root} for the models of `models` whose authors' family has a checkout."""
    return {n: authors_code[authors.AUTHORS[n][0]] for n in models
            if n in authors.AUTHORS and authors.AUTHORS[n][0] in authors_code}


def _cuda():
    import torch
    return torch.cuda.is_available()


def run_one(args, name, size, mode, root=None, cfg=None):
    cmd = [sys.executable, osp.abspath(__file__), '--worker', name, f'{size[0]}x{size[1]}', mode,
           '--batch', str(2 if mode == 'parity' else args.batch), '--warmup', str(args.warmup),
           '--iters', str(args.iters), '--device', args.device]
    cmd += ['--authors-root', root] if root else []
    cmd += ['--cfg', json.dumps(cfg)] if cfg else []
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith('{')]
    if r.returncode != 0 or not lines:
        err = (r.stderr.strip().splitlines() or ['no output'])[-1]
        return dict(model=name, size=list(size), tokens=bm.tokens(size), mode=mode, error=err)
    return json.loads(lines[-1])


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        name, size, mode = args.worker
        print(json.dumps(bm.worker(name, bm.parse_size(size), mode, args.batch, args.warmup, args.iters,
                                   args.device, json.loads(args.cfg) if args.cfg else None,
                                   args.authors_root)))
        return
    import torch
    sizes = [bm.parse_size(s) for s in args.sizes]
    modes = ['latency'] + ([] if args.no_memory else ['memory'])
    compared = compared_models(args.models, args.authors_code)
    if args.authors_code and not compared:
        print(f'note: none of --models {" ".join(args.models)} has a counterpart in the authors\' code given '
              f'({", ".join(args.authors_code)}); known: {", ".join(sorted(authors.AUTHORS))}')
    if compared:
        try:
            authors.require_timm()
        except ImportError as e:
            raise SystemExit(f'benchmark.py: error: {e}')
    ours_cfg = {n: authors.OURS_MATCHING_CFG[n] for n in compared if n in authors.OURS_MATCHING_CFG}
    smallest = min(sizes, key=bm.tokens)
    jobs = []  # (name, size, mode, authors' root, extra config of ours)
    for n in args.models:
        root = compared.get(n)
        if root:
            jobs.append((n, smallest, 'parity', root, None))
    # size-major, ours next to the authors' and the other models: a ratio compares measurements taken
    # minutes apart, not half an hour apart (shared machines drift)
    for s in sizes:
        for m in modes:
            for n in args.models:
                jobs.append((n, s, m, None, ours_cfg.get(n)))
                if compared.get(n):
                    jobs.append((n + bm.AUTHORS_TAG, s, m, compared[n], None))
    width = max([9] + [len(j[0]) for j in jobs])
    raw, parity = [], {}
    for i, (name, size, mode, root, cfg) in enumerate(jobs, 1):
        res = run_one(args, name, size, mode, root, cfg)
        raw.append(res)
        if 'error' in res:
            msg = f'failed: {res["error"]}'
        elif mode == 'latency':
            msg = f'{res["latency_ms"]:10.1f} ms  {res["throughput"]:8.2f} img/s'
        elif mode == 'parity':
            msg = f'max |ours - authors| {res["max_abs_diff"]:.1e} over {len(res["stages"])} stages'
        else:
            msg = f'{res["train_peak_mem_mb"]:10.1f} MB train-step peak'
        if mode == 'parity':
            parity[name] = res
        print(f'[{i:3d}/{len(jobs)}] {name:{width}s} {size[0]}x{size[1]:<5d} {mode:8s} {msg}', flush=True)

    by_model = {}
    for r in raw:
        if r['mode'] == 'parity':
            continue
        row = next((x for x in by_model.setdefault(r['model'], []) if x['size'] == r['size']), None)
        if row is None:
            row = dict(size=r['size'], tokens=r['tokens'], latency_ms=None, throughput=None,
                       train_peak_mem_mb=None, params=r.get('params'))
            by_model[r['model']].append(row)
        for key in ('latency_ms', 'throughput', 'train_peak_mem_mb', 'params'):
            if r.get(key) is not None:
                row[key] = r[key]
        if 'error' in r:
            row.setdefault('errors', {})[r['mode']] = r['error']
    lat_rows = [dict(model=m, size=row['size'], latency_ms=row['latency_ms'])
                for m, rows in by_model.items() for row in rows]
    summary = dict(device=args.device, machine=f'{platform.machine()}, {os.cpu_count()} CPUs'
                   + (f', {torch.cuda.get_device_name()}' if args.device.startswith('cuda') else ''),
                   torch=torch.__version__, batch=args.batch, warmup=args.warmup, iters=args.iters,
                   sizes=[list(s) for s in sizes], by_model=by_model,
                   scaling_exponent=bm.scaling_exponents(lat_rows, sizes), authors_code=args.authors_code,
                   ours_cfg=ours_cfg, parity=parity, vs_authors=bm.vs_authors(by_model, parity), raw=raw)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(osp.join(args.out_dir, 'benchmark.json'), 'w') as f:
        f.write(bm.dumps(summary))
    bm.plot(summary, osp.join(args.out_dir, 'benchmark.png'))

    head = f'{"model":{width}s} {"size":>9s} {"tokens":>7s} {"latency ms":>11s} {"img/s":>8s} {"train MB":>9s}'
    print('\n' + head)
    for name, rows in by_model.items():
        for row in rows:
            def f(v, fmt):
                return format(v, fmt) if v is not None else '-'.rjust(int(fmt.split('.')[0]))
            print(f'{name:{width}s} {row["size"][0]:>4d}x{row["size"][1]:<4d} {row["tokens"]:7d} '
                  f'{f(row["latency_ms"], "11.1f")} {f(row["throughput"], "8.2f")} '
                  f'{f(row["train_peak_mem_mb"], "9.1f")}')
    for name, cfg in ours_cfg.items():
        print(f'({name} measured with {json.dumps(cfg)}, the configuration that reproduces the authors\' outputs)')
    print('\nscaling exponent of latency vs tokens:')
    for name, exps in summary['scaling_exponent'].items():
        print(f'  {name:{width}s} ' + ('  '.join(f'{k}: {v:.2f}' for k, v in exps.items()) or '-'))
    if compared:
        print('\nvs the authors\' code (forward: their latency / ours; train memory: our peak / theirs):')
        for name in compared:
            r = parity.get(name, {})
            if 'error' in r:
                print(f'  {name} parity failed: {r["error"]}')
            elif r:
                print(f'  {name} parity at {r["size"][0]}x{r["size"][1]} (batch {r["batch"]}, eval, random weights'
                      f'{", ours with " + json.dumps(r["ours_cfg"]) if r["ours_cfg"] else ""}): max |ours - authors| '
                      f'per stage ' + ' '.join(f'{st["max_abs_diff"]:.1e}' for st in r['stages']))
            for key, v in summary['vs_authors'].get(name, {}).items():
                print('  ' + bm.format_vs_authors(name, key, v))
    print(f'\nwrote {args.out_dir}/benchmark.json and benchmark.png')
    return summary


if __name__ == '__main__':
    main()
