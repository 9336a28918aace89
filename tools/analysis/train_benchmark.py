"""Training-step benchmark: wall time of full training iterations (forward + backward + AdamW step) of each
backbone, split into forward / backward / optimizer, with the step's peak memory and the inference latency
beside it, at detection sizes; our recompute / with_cp combinations side by side with the authors' code and
mmdet's Swin-T / PVTv2-b2, in one run. Writes train_benchmark.json and train_benchmark.md (tables).

    python tools/analysis/train_benchmark.py [--models hvit3_t l2vit_t rest_s swin_t pvtv2_b2]
        [--sizes 800x1344 1248] [--batches 1 2] [--variants default|all|NAME ...] [--warmup 1] [--iters 2]
        [--rounds 2] [--no-inference] [--device cpu|cuda] [--out-dir work_dirs/train_benchmark]
        [--authors-code ViTTT=PATH L2ViT=PATH ResT=PATH]

How it measures: every (model, variant, size, batch, mode) runs in a fresh Python subprocess. Training:
`--warmup` then `--iters` iterations of forward, backward of the sum of the output maps' means, AdamW step and
zero_grad; the median iteration time (and of its forward / backward / optimizer parts; CUDA: synchronised).
Memory: the peak above what was held before the first iteration (CPU: resident set, ru_maxrss; CUDA:
max_memory_allocated), activations plus gradients plus AdamW state. Inference: the median of `--iters` no-grad
forwards after `--warmup` (tools/analysis/benchmark.py's measurement), same batch. The whole job list runs
`--rounds` times, round-robin, so each ratio compares measurements taken minutes apart; the tables give the
median over rounds and the range (min-max). `--variants all` (or a list of names) adds, for our backbones, every recompute /
with_cp combination of VARIANTS in mmplugin_l2/analysis/train_step.py. With `--authors-code` (see
tools/analysis/benchmark.py) each of our models with a counterpart is measured as `<model>@authors` too, and
ResT of ours then runs with norm_in_path=True, the configuration that computes their function.
"""
import argparse
import json
import os
import os.path as osp
import platform
import statistics
import subprocess
import sys

from mmplugin_l2.analysis import authors
from mmplugin_l2.analysis import benchmark as bm
from mmplugin_l2.analysis import train_step as ts

DEFAULT_MODELS = ['hvit3_t', 'l2vit_t', 'rest_s', 'swin_t', 'pvtv2_b2']




def _cuda():
    import torch
    return torch.cuda.is_available()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split('\n\n', 2)[2])
    p.add_argument('--models', nargs='+', default=DEFAULT_MODELS, choices=sorted(bm.MODELS))
    p.add_argument('--sizes', nargs='+', default=['800x1344', '1248'], help='H or HxW')
    p.add_argument('--batches', nargs='+', type=int, default=[1, 2])
    p.add_argument('--variants', nargs='+', default=['default'],
                   help='our recompute / with_cp combinations to measure: all, or names of VARIANTS '
                        '(default cp norecompute norecompute+cp dense); a family without one of them skips it')
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--iters', type=int, default=2)
    p.add_argument('--rounds', type=int, default=2)
    p.add_argument('--no-inference', action='store_true', help='training steps only')
    p.add_argument('--device', default='cuda' if _cuda() else 'cpu')
    p.add_argument('--out-dir', default='work_dirs/train_benchmark')
    p.add_argument('--authors-code', nargs='+', type=authors.family_path, default=[], metavar='FAMILY=PATH')
    p.add_argument('--worker', nargs=4, metavar=('MODEL', 'SIZE', 'BATCH', 'MODE'), help=argparse.SUPPRESS)
    p.add_argument('--authors-root', help=argparse.SUPPRESS)
    p.add_argument('--cfg', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    known = {'all'} | {v for vs in ts.VARIANTS.values() for v in vs}
    if set(args.variants) - known:
        p.error(f'--variants: unknown {sorted(set(args.variants) - known)}; choose from {sorted(known)}')
    if min(args.batches) < 1 or args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        p.error('--batches and --iters must be >= 1, --warmup >= 0, --rounds >= 1')
    args.authors_code = authors.checked_roots(args.authors_code, p.error)
    return args


def family(name):
    return bm.MODELS[name]['type'].split('.')[-1] if name in bm.MODELS else None


def entries(args):
    """[(label, model name, extra config, authors' root)] in measurement order: per model, ours (every
    variant with --variants all), then the authors'."""
    out = []
    for n in args.models:
        fam = family(n)
        root = args.authors_code.get(authors.AUTHORS[n][0]) if n in authors.AUTHORS else None
        base = authors.OURS_MATCHING_CFG.get(n, {}) if root else {}
        variants = ts.VARIANTS.get(fam, {'default': {}})
        if 'all' not in args.variants:
            variants = {k: v for k, v in variants.items() if k in args.variants or k == 'default'}
        for v, cfg in variants.items():
            out.append((n if v == 'default' else f'{n}[{v}]', n, {**base, **cfg} or None, None))
        if root:
            out.append((n + bm.AUTHORS_TAG, n + bm.AUTHORS_TAG, None, root))
    return out


def jobs(args):
    """One round's job list: (label, name, cfg, root, size, batch, mode), size-major and batch-major, so
    the entries compared with each other are measured next to each other."""
    out = []
    for s in [bm.parse_size(s) for s in args.sizes]:
        for b in args.batches:
            for label, name, cfg, root in entries(args):
                out.append((label, name, cfg, root, s, b, 'train'))
                if not args.no_inference and ('[' not in label):  # inference does not depend on the variant
                    out.append((label, name, cfg, root, s, b, 'latency'))
    return out


def run_one(args, name, size, batch, mode, root=None, cfg=None):
    cmd = [sys.executable, osp.abspath(__file__), '--worker', name, f'{size[0]}x{size[1]}', str(batch), mode,
           '--warmup', str(args.warmup), '--iters', str(args.iters), '--device', args.device]
    cmd += ['--authors-root', root] if root else []
    cmd += ['--cfg', json.dumps(cfg)] if cfg else []
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith('{')]
    if r.returncode != 0 or not lines:
        err = (r.stderr.strip().splitlines() or ['no output'])[-1]
        return dict(model=name, size=list(size), batch=batch, mode=mode, error=err)
    return json.loads(lines[-1])


def _stat(values, spread=None):
    """median of the per-round medians `values`; min / max over `spread` (every timed iteration of every
    round) when given, else over `values`."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    spread = spread or values
    return dict(median=statistics.median(values), min=min(spread), max=max(spread), n=len(spread))


def summarize(raw):
    """{'HxW/bB': {label: {step_ms, forward_ms, backward_ms, optimizer_ms, train_peak_mem_mb, infer_ms: stat}}}
    with stat = {median, min, max, n}: the median over rounds of each round's median iteration; min / max /
    n over every timed iteration (step_ms, infer_ms) or over rounds (the rest)."""
    table = {}
    for r in raw:
        key = f'{r["size"][0]}x{r["size"][1]}/b{r["batch"]}'
        row = table.setdefault(key, {}).setdefault(r['label'], dict(_rounds={}, _spread={}))
        if 'error' in r:
            row.setdefault('errors', []).append(f'{r["mode"]}: {r["error"]}')
            continue
        if r['mode'] == 'train':
            row['extra_cfg'] = r.get('extra_cfg') or {}
            row['params'] = r['params']
            for k in ('step_ms', 'forward_ms', 'backward_ms', 'optimizer_ms', 'train_peak_mem_mb'):
                row['_rounds'].setdefault(k, []).append(r[k])
            row['_spread'].setdefault('step_ms', []).extend(s['total_ms'] for s in r['steps'])
        else:
            row['_rounds'].setdefault('infer_ms', []).append(r['latency_ms'])
            row['_spread'].setdefault('infer_ms', []).extend(r['times_ms'])
    for rows in table.values():
        for row in rows.values():
            spread = row.pop('_spread')
            for k, v in row.pop('_rounds').items():
                row[k] = _stat(v, spread.get(k))
    return table


def _med(row, key):
    return (row.get(key) or {}).get('median')


def vs_authors(table):
    """Per size/batch and our label with an `<model>@authors` row: train speedup (their step time / ours),
    mem_ratio (our training peak / theirs), infer speedup (their latency / ours; our default's for variants)."""
    out = {}
    for key, rows in table.items():
        for label, row in rows.items():
            if label.endswith(bm.AUTHORS_TAG):
                continue
            model = label.split('[')[0]
            theirs = rows.get(model + bm.AUTHORS_TAG)
            if theirs is None:
                continue
            ours_inf = _med(rows.get(model, {}), 'infer_ms')

            def ratio(a, b):
                return a / b if a and b else None
            out.setdefault(key, {})[label] = dict(
                train_speedup=ratio(_med(theirs, 'step_ms'), _med(row, 'step_ms')),
                mem_ratio=ratio(_med(row, 'train_peak_mem_mb'), _med(theirs, 'train_peak_mem_mb')),
                infer_speedup=ratio(_med(theirs, 'infer_ms'), ours_inf))
    return out


def best_variants(table):
    """Per size/batch and model: the label of our fastest training step, and of our smallest peak."""
    out = {}
    for key, rows in table.items():
        by_model = {}
        for label, row in rows.items():
            if not label.endswith(bm.AUTHORS_TAG) and _med(row, 'step_ms'):
                by_model.setdefault(label.split('[')[0], []).append((label, row))
        for model, cand in by_model.items():
            if len(cand) > 1:
                out.setdefault(key, {})[model] = dict(
                    fastest=min(cand, key=lambda c: _med(c[1], 'step_ms'))[0],
                    smallest_memory=min(cand, key=lambda c: _med(c[1], 'train_peak_mem_mb') or 1e30)[0])
    return out


def _fmt(stat, scale=1., digits=0):
    if not stat:
        return '-'
    m, lo, hi = stat['median'] * scale, stat['min'] * scale, stat['max'] * scale
    f = f'{{:.{digits}f}}'
    return f.format(m) if stat['n'] == 1 else f'{f.format(m)} ({f.format(lo)}–{f.format(hi)})'


def markdown(summary):
    """The tables of the run, as markdown: per size/batch, one row per entry."""
    lines = []
    cmp = summary['vs_authors']
    for key, rows in summary['table'].items():
        size, b = key.split('/')
        lines += [f'**{size.replace("x", "×")}, batch {b[1:]}** (median over {summary["rounds"]} round(s) '
                  f'of the median of {summary["iters"]} iterations after {summary["warmup"]} warm-up; (min–max) over '
                  'every timed iteration)', '',
                  '| model | train step s | forward / backward / AdamW s | train peak MB | inference s '
                  '| vs authors: train ×, memory ×, inference × |', '|---|---|---|---|---|---|']
        for label, row in rows.items():
            parts = ' / '.join(_fmt(row.get(k), 1e-3, 2) for k in ('forward_ms', 'backward_ms', 'optimizer_ms'))
            c = cmp.get(key, {}).get(label)
            vs = '-' if not c else ', '.join('-' if c[k] is None else f'{c[k]:.2f}'
                                             for k in ('train_speedup', 'mem_ratio', 'infer_speedup'))
            err = f' (failed: {"; ".join(row["errors"])})' if row.get('errors') else ''
            lines.append(f'| `{label}`{err} | {_fmt(row.get("step_ms"), 1e-3, 2)} | {parts} | '
                         f'{_fmt(row.get("train_peak_mem_mb"))} | {_fmt(row.get("infer_ms"), 1e-3, 2)} | {vs} |')
        lines.append('')
    return '\n'.join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        name, size, batch, mode = args.worker
        cfg = json.loads(args.cfg) if args.cfg else None
        if mode == 'train':
            res = ts.worker(name, bm.parse_size(size), int(batch), args.warmup, args.iters, args.device, cfg,
                            args.authors_root)
        else:
            res = bm.worker(name, bm.parse_size(size), 'latency', int(batch), args.warmup, args.iters,
                            args.device, cfg, args.authors_root)
        print(json.dumps(res))
        return
    import torch
    if any(authors.AUTHORS.get(n, ('',))[0] in args.authors_code for n in args.models):
        try:
            authors.require_timm()
        except ImportError as e:
            raise SystemExit(f'train_benchmark.py: error: {e}')
    one_round = jobs(args)
    total = len(one_round) * args.rounds
    width = max(len(j[0]) for j in one_round)
    raw = []
    for rnd in range(args.rounds):
        for label, name, cfg, root, size, batch, mode in one_round:
            res = run_one(args, name, size, batch, mode, root, cfg)
            res.update(label=label, round=rnd, size=list(size), batch=batch, mode=mode)
            raw.append(res)
            if 'error' in res:
                msg = f'failed: {res["error"]}'
            elif mode == 'train':
                msg = (f'step {res["step_ms"] / 1e3:7.2f} s (fwd {res["forward_ms"] / 1e3:.2f}, bwd '
                       f'{res["backward_ms"] / 1e3:.2f}, opt {res["optimizer_ms"] / 1e3:.2f})  '
                       f'peak {res["train_peak_mem_mb"]:7.0f} MB')
            else:
                msg = f'inference {res["latency_ms"] / 1e3:7.2f} s'
            print(f'[{len(raw):3d}/{total}] {label:{width}s} {size[0]}x{size[1]:<5d} b{batch} {mode:7s} {msg}',
                  flush=True)
    table = summarize(raw)
    summary = dict(device=args.device, machine=f'{platform.machine()}, {os.cpu_count()} CPUs'
                   + (f', {torch.cuda.get_device_name()}' if args.device.startswith('cuda') else ''),
                   torch=torch.__version__, threads=torch.get_num_threads(), warmup=args.warmup,
                   iters=args.iters, rounds=args.rounds, sizes=args.sizes, batches=args.batches,
                   variants={k: {v: c for v, c in vs.items()} for k, vs in ts.VARIANTS.items()},
                   authors_code=args.authors_code, table=table, vs_authors=vs_authors(table),
                   best_variants=best_variants(table), raw=raw)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(osp.join(args.out_dir, 'train_benchmark.json'), 'w') as f:
        json.dump(summary, f, indent=2)
    md = markdown(summary)
    with open(osp.join(args.out_dir, 'train_benchmark.md'), 'w') as f:
        f.write(md)
    print('\n' + md)
    for key, best in summary['best_variants'].items():
        for model, b in best.items():
            print(f'{key} {model}: fastest {b["fastest"]}, smallest peak {b["smallest_memory"]}')
    print(f'\nwrote {args.out_dir}/train_benchmark.json and train_benchmark.md')
    return summary


if __name__ == '__main__':
    main()
