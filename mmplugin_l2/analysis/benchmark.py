"""Backbone benchmark: inference latency / throughput and training-step peak memory, one measurement per
fresh subprocess (see tools/analysis/benchmark.py); optionally against the authors' implementations
(`<name>@authors`, see authors.py)."""
import json
import math
import os
import resource
import statistics
import time

import torch

from .models import MODELS, build  # noqa: F401  (the tools and tests use them from here too)

DEFAULT_MODELS = ['hvit3_t', 'l2vit_t', 'rest_s', 'swin_t', 'pvtv2_b2']
DEFAULT_SIZES = ['224', '512', '800x1344', '1248']
#: suffix of the authors' implementation of a model (tools/analysis/benchmark.py --authors-code)
AUTHORS_TAG = '@authors'


def parse_size(s):
    h, _, w = str(s).partition('x')
    return int(h), int(w or h)


def tokens(size):
    """Stride-4 tokens of an H x W image (the first stage of every pyramid backbone here)."""
    h, w = size
    return math.ceil(h / 4) * math.ceil(w / 4)


def _rss_bytes():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def _sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()


def measure_latency(model, x, warmup, iters):
    """Median wall time of `iters` no-grad forwards after `warmup` ones, in ms."""
    model.eval()
    times = []
    with torch.no_grad():
        for i in range(warmup + iters):
            _sync(x.device)
            t = time.perf_counter()
            model(x)
            _sync(x.device)
            if i >= warmup:
                times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), times


def measure_train_memory(model, x):
    """Peak memory of one training step (forward + backward of the sum of the outputs) above what was
    held before it, in MB. CUDA: torch.cuda.max_memory_allocated. CPU: the process's peak RSS
    (getrusage ru_maxrss) minus its RSS just before the step, in a fresh process whose earlier peak
    (imports, model build) is below the step's."""
    model.train()
    if x.device.type == 'cuda':
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sum(o.float().sum() for o in model(x)).backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    base = _rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sum(o.sum() for o in model(x)).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if peak <= peak_before:
        raise RuntimeError('the training step did not raise the process peak RSS; cannot measure it')
    return (peak - base) / 2**20


def worker(name, size, mode, batch, warmup, iters, device, extra_cfg=None, authors_root=None):
    """One measurement; returns a JSON-able dict. `name` is a MODELS key, or `<key>@authors` for the
    authors' implementation from the checkout `authors_root`; mode 'parity' compares ours with it."""
    torch.manual_seed(0)
    res = dict(model=name, size=list(size), tokens=tokens(size), batch=batch, mode=mode)
    if mode == 'parity':
        from . import authors
        res.update(authors.parity(name, authors_root, size, batch=batch, device=device))
        return res
    device = torch.device(device)
    if name.endswith(AUTHORS_TAG):
        from . import authors
        base = name[:-len(AUTHORS_TAG)]
        authors.check_size(base, size)
        model = authors.build(base, authors_root).to(device)
    else:
        model = build(name, extra_cfg).to(device)
        if extra_cfg:
            res['extra_cfg'] = extra_cfg
    x = torch.randn(batch, 3, *size, device=device)
    res['params'] = sum(p.numel() for p in model.parameters())
    if mode == 'latency':
        med, times = measure_latency(model, x, warmup, iters)
        res.update(latency_ms=med, throughput=batch / med * 1e3, times_ms=times)
    else:
        res.update(train_peak_mem_mb=measure_train_memory(model, x))
    return res


def vs_authors(by_model, parity=None):
    """Per model with an `<name>@authors` entry and per size: speedup = their latency / ours, mem_ratio =
    our training-step peak memory / theirs, max_abs_diff = the parity check's (one size, see `parity`)."""
    out = {}
    for name, rows in by_model.items():
        theirs = {tuple(r['size']): r for r in by_model.get(name + AUTHORS_TAG, [])}
        if name.endswith(AUTHORS_TAG) or not theirs:
            continue
        diff = (parity or {}).get(name, {}).get('max_abs_diff')
        for row in rows:
            t = theirs.get(tuple(row['size']))
            if t is None:
                continue
            lat, mem = (row.get('latency_ms'), t.get('latency_ms')), (row.get('train_peak_mem_mb'),
                                                                       t.get('train_peak_mem_mb'))
            out.setdefault(name, {})[f'{row["size"][0]}x{row["size"][1]}'] = dict(
                speedup=lat[1] / lat[0] if all(lat) else None,
                mem_ratio=mem[0] / mem[1] if all(mem) else None, max_abs_diff=diff)
    return out


def format_vs_authors(name, size_key, r):
    """'hvit3_t vs authors at 800x1344: forward 1.31x faster, train memory 0.52x, max |diff| 3.0e-07'."""
    def f(v, fmt):
        return '-' if v is None else format(v, fmt)
    return (f'{name} vs authors at {size_key}: forward {f(r["speedup"], ".2f")}x faster, '
            f'train memory {f(r["mem_ratio"], ".2f")}x, max |diff| {f(r["max_abs_diff"], ".1e")}')


def scaling_exponents(results, sizes):
    """Per model: d log(latency) / d log(tokens) between consecutive sizes and from the first to the
    last of them."""
    out = {}
    for name in dict.fromkeys(r['model'] for r in results):
        lat = {tuple(r['size']): r.get('latency_ms') for r in results if r['model'] == name}
        exps = {}
        pairs = list(zip(sizes, sizes[1:])) + ([(sizes[0], sizes[-1])] if len(sizes) > 2 else [])
        for a, b in pairs:
            if lat.get(a) and lat.get(b):
                exps[f'{a[0]}x{a[1]}->{b[0]}x{b[1]}'] = (math.log(lat[b] / lat[a]) /
                                                          math.log(tokens(b) / tokens(a)))
        out[name] = exps
    return out


def plot(summary, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {}
    cycle = plt.rcParams['axes.prop_cycle'].by_key()['color']
    for name, rows in summary['by_model'].items():
        base = name[:-len(AUTHORS_TAG)] if name.endswith(AUTHORS_TAG) else name
        color = colors.setdefault(base, cycle[len(colors) % len(cycle)])
        style = dict(linestyle='--', marker='x') if base != name else dict(marker='o')  # authors': dashed
        rows = sorted(rows, key=lambda r: r['tokens'])
        for ax, key in zip(axes, ('latency_ms', 'train_peak_mem_mb')):
            pts = [(r['tokens'], r[key]) for r in rows if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), color=color, label=name, **style)
    for ax, title in zip(axes, ('inference latency (ms, median)', 'training-step peak memory (MB)')):
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel('tokens at stride 4')
        ax.set_title(title)
        ax.grid(True, which='both', alpha=.3)
        ax.legend(fontsize=8)
    fig.suptitle(f'{summary["device"]} - batch {summary["batch"]} - torch {summary["torch"]}', fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def dumps(obj):
    return json.dumps(obj, indent=2)
