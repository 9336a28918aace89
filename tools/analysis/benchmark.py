"""Side-by-side backbone benchmark across resolutions: inference latency (median after warm-up),
throughput, training-step peak memory, latency-vs-tokens scaling exponents; writes a JSON file and a
log-log PNG plot.

    python tools/analysis/benchmark.py [--models hvit3_t l2vit_t rest_s swin_t pvtv2_b2]
        [--sizes 224 512 800x1344 1248] [--batch 1] [--warmup 2] [--iters 5] [--device cpu|cuda]
        [--out-dir work_dirs/benchmark]

How it measures: every (model, size) measurement runs in a fresh Python subprocess, so no allocator state
or cache carries over. Latency: `--warmup` then `--iters` no-grad forwards, median wall time (CUDA:
synchronised). Memory of one training step (forward + backward of the summed outputs): on CUDA
torch.cuda.max_memory_allocated() minus the memory allocated before the step; on CPU the process's peak
resident set (getrusage ru_maxrss) minus its resident set just before the step (model and input already
built), i.e. what the step itself adds. Ratios between models in one run are what matter; absolute
numbers depend on the machine. Models: see MODELS in mmplugin_l2/analysis/benchmark.py (ours plus mmdet's
Swin-T and PVTv2-b2).
"""
import argparse
import json
import os
import os.path as osp
import platform
import subprocess
import sys

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
sys.path.insert(0, ROOT)

from mmplugin_l2.analysis import benchmark as bm  # noqa: E402


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
    p.add_argument('--worker', nargs=3, metavar=('MODEL', 'SIZE', 'MODE'), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _cuda():
    import torch
    return torch.cuda.is_available()


def run_one(args, name, size, mode):
    cmd = [sys.executable, osp.abspath(__file__), '--worker', name, f'{size[0]}x{size[1]}', mode,
           '--batch', str(args.batch), '--warmup', str(args.warmup), '--iters', str(args.iters),
           '--device', args.device]
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
                                   args.device)))
        return
    import torch
    sizes = [bm.parse_size(s) for s in args.sizes]
    modes = ['latency'] + ([] if args.no_memory else ['memory'])
    jobs = [(n, s, m) for n in args.models for s in sizes for m in modes]
    raw = []
    for i, (name, size, mode) in enumerate(jobs, 1):
        res = run_one(args, name, size, mode)
        raw.append(res)
        if 'error' in res:
            msg = f'failed: {res["error"]}'
        elif mode == 'latency':
            msg = f'{res["latency_ms"]:10.1f} ms  {res["throughput"]:8.2f} img/s'
        else:
            msg = f'{res["train_peak_mem_mb"]:10.1f} MB train-step peak'
        print(f'[{i:3d}/{len(jobs)}] {name:9s} {size[0]}x{size[1]:<5d} {mode:8s} {msg}', flush=True)

    by_model = {}
    for r in raw:
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
                   scaling_exponent=bm.scaling_exponents(lat_rows, sizes), raw=raw)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(osp.join(args.out_dir, 'benchmark.json'), 'w') as f:
        f.write(bm.dumps(summary))
    bm.plot(summary, osp.join(args.out_dir, 'benchmark.png'))

    head = f'{"model":9s} {"size":>9s} {"tokens":>7s} {"latency ms":>11s} {"img/s":>8s} {"train MB":>9s}'
    print('\n' + head)
    for name, rows in by_model.items():
        for row in rows:
            def f(v, fmt):
                return format(v, fmt) if v is not None else '-'
            print(f'{name:9s} {row["size"][0]:>4d}x{row["size"][1]:<4d} {row["tokens"]:7d} '
                  f'{f(row["latency_ms"], "11.1f")} {f(row["throughput"], "8.2f")} '
                  f'{f(row["train_peak_mem_mb"], "9.1f")}')
    print('\nscaling exponent of latency vs tokens:')
    for name, exps in summary['scaling_exponent'].items():
        print(f'  {name:9s} ' + '  '.join(f'{k}: {v:.2f}' for k, v in exps.items()))
    print(f'\nwrote {args.out_dir}/benchmark.json and benchmark.png')
    return summary


if __name__ == '__main__':
    main()
