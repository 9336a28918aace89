"""The benchmark behind tools/analysis/benchmark.py: measurements (one per fresh subprocess), the schedule
(models alternating within a round), the batch search, the results file, and what `render` makes of it
(tables with medians and min-max ranges, ratios, the crossover resolution, the plot).

A measurement (`measure`) is one dict, a *sample*: model, kind, size, batch, round and what was measured.
Kinds:
* `infer`: `warmup` + `iters` no-grad forwards; latency_ms (median of the timed ones), times_ms, throughput
  (images/s), peak_mem_mb of the forwards.
* `train`: `warmup` + `iters` training iterations (forward, backward of the summed output means, AdamW step;
  mmplugin_l2/analysis/measure.py `train_steps`); step_ms (median), forward/backward/optimizer ms, peak_mem_mb.
  For a whole detector (`models.DETECTORS`, e.g. `mask_rcnn_hvit3_t`) one iteration is its config's model on a
  preprocessed batch of random images, boxes and masks: forward with its losses, backward of their sum, AdamW
  step (data loading excluded; mmcv's RoIAlign and NMS in fp32 under autocast, `models.mmcv_ops_in_fp32`).
* `maxbatch`: the largest inference batch whose peak memory fits `budget_mb` (`largest_batch`, every probe in
  its own process), then an `infer` measurement at that batch; batch is the batch found.
Timing and peak memory are mmplugin_l2/analysis/measure.py's: CUDA torch.cuda.max_memory_allocated() above
what the model and input held before; CPU the fresh process's peak resident set above its resident set before
the first iteration. A sample's `precision` (absent: fp32 with TF32 off; 'tf32', 'bf16' or 'fp16' autocast) is
measure.py's, and so is its `allocator` (absent: glibc's default; `caching`, `live`, `jemalloc`, `tcmalloc`: the
environment its fresh process ran in, measure.ALLOCATORS); samples of different precisions or allocators are never
pooled: `summarize` keys them apart and `render` makes one set of tables (ratios and crossover included) per
precision and allocator.
"""
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

from .measure import (ALLOCATORS, PRECISIONS, allocator_env, cpu_isa, emit, failure_line, half_units, measure_infer,
                      run_fresh, train_steps)
from .models import (AUTHORS_TAG, DETECTORS, MODELS, build, build_detector, check_name,  # noqa: F401 (the tools')
                     is_detector, is_ours, label, mmcv_ops_in_fp32)

FORMAT = 'mmplugin_l2-benchmark/1'
KINDS = ('infer', 'train', 'maxbatch')
#: suites: models, sizes, batches, kinds
SUITES = {
    'headline': dict(models=['vit3_t', 'deit_t', 'deit_t_plain'], sizes=['224', '512', '1248', '2048'],
                     batches=[1], kinds=['infer', 'train']),
    'detection': dict(models=['hvit3_t', 'l2vit_t', 'rest_s', 'swin_t'], sizes=['800x1344', '1248'],
                      batches=[1, 2], kinds=['infer', 'train']),
    'all': dict(models=['hvit3_t', 'vit3_t', 'l2vit_t', 'rest_s', 'swin_t', 'swin_s', 'pvtv2_b2', 'deit_t',
                        'deit_t_plain', 'deit_s', 'vit_b'], sizes=['224', '512', '800x1344', '1248', '2048'],
                batches=[1], kinds=['infer', 'train', 'maxbatch']),
}
#: (ours, theirs) pairs of the ratio tables and the plot
PAIRS = [('vit3_t', 'deit_t'), ('vit3_t', 'deit_t_plain'), ('hvit3_t', 'swin_t'), ('l2vit_t', 'swin_t'),
         ('rest_s', 'swin_t'), ('vit3_t', 'deit_t_timm'), ('hvit3_t', 'swin_t_timm'), ('l2vit_t', 'swin_t_timm'),
         ('rest_s', 'swin_t_timm')] + [(m, m + AUTHORS_TAG) for m in ('hvit3_t', 'l2vit_t', 'rest_s')] + [
    ('hvit3_t_cp', 'swin_t'), ('hvit3_t_cp', 'hvit3_t_cp@authors'), ('hvit3_t', 'hvit3_t_cp@authors'),
    ('hvit3_t_cp_compiled', 'hvit3_t_cp'),
    ('mask_rcnn_hvit3_t', 'mask_rcnn_hvit3_t@authors'), ('mask_rcnn_hvit3_t', 'mask_rcnn_swin_t')]
BEGIN, END = '<!-- generated:begin -->', '<!-- generated:end -->'
#: how the tables head each precision (measure.PRECISIONS)
PRECISION_TITLES = {'fp32': 'fp32', 'tf32': 'TF32', 'bf16': 'bf16 autocast', 'fp16': 'fp16 autocast'}


def parse_size(s):
    """'224' -> (224, 224), '800x1344' -> (800, 1344); ValueError (one line) otherwise."""
    h, _, w = str(s).partition('x')
    try:
        size = int(h), int(w or h)
    except ValueError:
        raise ValueError(f'size {s!r} is not H or HxW (positive integers)') from None
    if min(size) < 1:
        raise ValueError(f'size {s!r} is not H or HxW (positive integers)')
    return size


def size_arg(s):
    """argparse type of a size: `parse_size`, its error as argparse's."""
    import argparse
    try:
        return parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def option_arg(text):
    """argparse type of `--cfg-options`: KEY=VALUE -> (KEY, value), the value a Python literal (True, None,
    1048576, (1, 2)) or else a string."""
    import argparse
    import ast
    key, sep, value = text.partition('=')
    if not sep or not key:
        raise argparse.ArgumentTypeError(f'expected KEY=VALUE, got {text!r}')
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def nested(options):
    """{'a.b': v} -> {'a': {'b': v}}: dotted keys of `--cfg-options` as nested arguments."""
    out = {}
    for key, value in options.items():
        *parents, last = key.split('.')
        node = out
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = value
    return out


def size_key(size):
    return f'{size[0]}x{size[1]}'


def tokens(size, stride=16):
    """Tokens of an H x W image at `stride` (16: a patch-16 ViT, 4: the first stage of the pyramids)."""
    return math.ceil(size[0] / stride) * math.ceil(size[1] / stride)


def sample_precision(s):
    """A sample's (or spec's) precision: its `precision`, 'fp32' when it has none."""
    return s.get('precision') or 'fp32'


def sample_allocator(s):
    """A sample's (or spec's) allocator: its `allocator`, 'glibc' when it has none."""
    return s.get('allocator') or 'glibc'


def variant_fields(spec):
    """The fields that say a spec's (or sample's) precision and allocator where they are not the defaults
    (fp32, glibc): what a spec of `schedule` and every sample made from it carry."""
    out = {}
    if sample_precision(spec) != 'fp32':
        out['precision'] = spec['precision']
    if sample_allocator(spec) != 'glibc':
        out['allocator'] = spec['allocator']
    return out


def runs_under(name, env=None):
    """Whether this process (or one with the environment `env`) runs under the allocator `name`
    (measure.ALLOCATORS): its environment has what measure.allocator_env sets."""
    env = os.environ if env is None else env
    want = ALLOCATORS[name]
    if isinstance(want, tuple):
        return any(lib in env.get('LD_PRELOAD', '') for lib in want)
    return all(env.get(k) == v for k, v in want.items()) and (
        name != 'glibc' or not any(k.startswith('MALLOC_') for k in env))


def running_allocator(env=None):
    """The first allocator of measure.ALLOCATORS this process (or `env`) runs under ('glibc': none of glibc's
    tunables set), or 'other' (tunables or a preload that none of them sets)."""
    return next((name for name in ALLOCATORS if runs_under(name, env)), 'other')


def check_allocator(name, env=None):
    """Raise RuntimeError unless this process runs under the allocator `name` (`runs_under`), so that a sample
    never records an allocator it did not run under."""
    if not runs_under(name, env):
        raise RuntimeError(f'this process does not run under the allocator {name!r} (its environment lacks what '
                           f'measure.allocator_env sets): measure it through run_subprocess')


def measure(spec):
    """One measurement in this process (mmplugin_l2/analysis/measure.py); a JSON-able sample.

    Args:
        spec (dict): model (str), kind ('infer' | 'train'), size ([H, W]), batch (int), warmup (int),
            iters (int), device (str), authors_roots ({family: path}, optional), round (int, optional),
            precision ('fp32' (TF32 off, the default) | 'tf32' | 'bf16', optional; recorded when not fp32),
            allocator (measure.ALLOCATORS, optional: the one this process was started under, checked; recorded
            when not glibc),
            tiny (bool, optional: narrow widths, a smoke test; a detector's neck and heads
            too, `models.narrow_detector`), cfg (dict, optional: overrides of our
            backbone's arguments (`models.is_ours`; the other models, the authors' included, are built as they
            are), recorded in the samples of the models it applied to).
    """
    if spec['device'] == 'cpu':
        check_allocator(sample_allocator(spec))
    torch.manual_seed(0)
    dev = torch.device(spec['device'])
    size, batch, prec = tuple(spec['size']), spec['batch'], spec.get('precision', 'fp32')
    detector = is_detector(spec['model'])
    cfg = spec.get('cfg') if is_ours(spec['model']) else None
    if detector:
        if spec['kind'] != 'train':
            raise ValueError(f'{spec["model"]} is a whole detector: only its training iteration is measured '
                             f'(kind train), not {spec["kind"]!r}')
        model, x = build_detector(spec['model'], size, batch, spec.get('authors_roots'), dev, cfg,
                                  tiny=spec.get('tiny', False))
    else:
        model = build(spec['model'], cfg, size=size, authors_roots=spec.get('authors_roots'),
                      tiny=spec.get('tiny', False)).to(dev)
        x = torch.randn(batch, 3, *size, device=dev)
    s = dict(model=spec['model'], kind=spec['kind'], size=list(size), batch=batch, round=spec.get('round', 0),
             params=sum(p.numel() for p in model.parameters()), **variant_fields(spec))
    if cfg:
        s['cfg'] = cfg
    if spec['kind'] == 'infer':
        med, times, mem = measure_infer(model, x, spec['warmup'], spec['iters'], prec)
        s.update(latency_ms=med, times_ms=times, throughput=batch / med * 1e3, peak_mem_mb=mem)
    elif spec['kind'] == 'train':
        with mmcv_ops_in_fp32() if detector else contextlib.nullcontext():
            steps, mem = train_steps(model, x, spec['warmup'], spec['iters'], prec=prec, device=dev)
        s.update({k: statistics.median(st[k] for st in steps) for k in steps[0]})
        s.update(step_ms=s.pop('total_ms'), steps=steps, peak_mem_mb=mem)
    else:
        raise ValueError(f'kind {spec["kind"]!r} is not measured in one process; allowed: infer, train')
    return s


#: the folder this package is imported from (a checkout, or site-packages): the measuring processes import it from
#: there, and `environment` records its commit
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_subprocess(spec, timeout=None, python=sys.executable):
    """`measure(spec)` in a fresh Python process, under the spec's allocator (measure.allocator_env); the sample,
    or the spec's fields with `error` (one line: an exception, a kill by the OS, a timeout). The process imports
    this very package (`PACKAGE_ROOT` first on its path, the working folder not on it: `python -P`), so the code
    measured is the code whose commit the run records, wherever the tool is started from."""
    base = {k: spec[k] for k in ('model', 'kind', 'size', 'batch')}
    base.update(round=spec.get('round', 0), **variant_fields(spec))
    try:
        env = allocator_env(sample_allocator(spec))
    except ValueError as e:
        return dict(base, error=str(e))
    env['PYTHONPATH'] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get('PYTHONPATH')) if p)
    samples, failure = run_fresh(['-P', '-m', 'mmplugin_l2.analysis.benchmark', json.dumps(spec)], timeout, python,
                                 env)
    if samples:
        return samples[-1]
    return dict(base, error=failure_line(failure or 'no sample printed'))


def largest_batch(peak_mb, budget_mb, max_batch=1024):
    """The largest batch b <= max_batch whose peak_mb(b) <= budget_mb: doubling from 1 until a batch does not
    fit, then bisection between the last that fits and the first that does not (peak memory grows with the
    batch). `peak_mb(b)` returns MB, or None when the batch could not run (out of memory).

    Returns:
        tuple: (batch or 0 if not even 1 fits, {batch: peak MB or None} of every probe).
    """
    probes = {}

    def fits(b):
        probes[b] = peak_mb(b)
        return probes[b] is not None and probes[b] <= budget_mb
    if not fits(1):
        return 0, probes
    lo, hi = 1, None
    while hi is None:
        b = min(lo * 2, max_batch)
        if b == lo:
            return lo, probes
        if fits(b):
            lo = b
        else:
            hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def schedule(models, sizes, batches, kinds, rounds, precisions=('fp32',), allocators=('glibc',)):
    """Measurement specs in run order: per round, per (kind, size, batch, precision, allocator), every model once;
    the models' order rotates by one each round, so no model always runs first (or right after the same one). A
    spec names its precision when it is not 'fp32' (measure.PRECISIONS) and its allocator when it is not 'glibc'
    (measure.ALLOCATORS)."""
    out = []
    for r in range(rounds):
        order = models[r % len(models):] + models[:r % len(models)]
        for kind in kinds:
            for size in sizes:
                for batch in ([1] if kind == 'maxbatch' else batches):
                    for prec in precisions:
                        for alloc in allocators:
                            extra = variant_fields(dict(precision=prec, allocator=alloc))
                            out += [dict(model=m, kind=kind, size=list(size), batch=batch, round=r, **extra)
                                    for m in order]
    return out


def package_commit(root=None):
    """The short commit of the checkout the package is imported from (`PACKAGE_ROOT`), with '+uncommitted' when
    its tracked files differ from it (the code measured is then not that commit's); None outside a checkout."""
    def git(*args):
        return subprocess.run(['git', *args], cwd=root or PACKAGE_ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        commit = git('rev-parse', '--short', 'HEAD')
        return (commit + ('+uncommitted' if git('status', '--porcelain', '--untracked-files=no') else '')) or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device):
    """Machine, versions and commit of a run."""
    import platform
    env = dict(python=platform.python_version(), torch=torch.__version__, machine=platform.machine(),
               cpus=os.cpu_count(), threads=torch.get_num_threads(), device=device,
               date=time.strftime('%Y-%m-%d', time.gmtime()))
    try:
        with open('/proc/cpuinfo') as f:
            env['cpu'] = next((ln.split(':', 1)[1].strip() for ln in f if ln.startswith('model name')), None)
    except OSError:
        env['cpu'] = None
    env['cpu_isa'] = cpu_isa()
    env['cpu_half_units'] = [p for p in ('bf16', 'fp16') if half_units(p, 'cpu')]
    if device.startswith('cuda'):
        env['gpu'] = torch.cuda.get_device_name(torch.device(device))
    env['commit'] = package_commit()
    for mod in ('mmdet', 'mmpretrain', 'mmengine'):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    return env


def run(specs, common, out_path, results=None, timeout=None, log=print, runner=run_subprocess):
    """Run every spec (fields of `common` added) through `runner`, appending each sample to `results` and
    writing `out_path` after each, so a run stopped early keeps what it measured. `maxbatch` specs run the
    batch search (`common['budget_mb']`) and then an inference measurement at the batch found."""
    results = results if results is not None else dict(format=FORMAT, samples=[])
    for i, spec in enumerate(specs):
        spec = dict(common, **spec)
        if spec['kind'] == 'maxbatch':
            def peak(b, spec=spec):
                s = runner(dict(spec, kind='infer', batch=b, warmup=0, iters=1), timeout=timeout)
                if 'error' in s:
                    return None
                # None on CPU: the forwards stayed below the fresh process's earlier peak (imports), so small
                return s['peak_mem_mb'] if s.get('peak_mem_mb') is not None else 0.
            b, probes = largest_batch(peak, spec['budget_mb'], spec.get('max_batch', 1024))
            if b:
                s = runner(dict(spec, kind='infer', batch=b), timeout=timeout)
                s['kind'] = 'maxbatch'
            else:
                s = dict({k: spec[k] for k in ('model', 'kind', 'size', 'round')}, batch=0,
                         error=f'batch 1 does not fit {spec["budget_mb"]} MB', **variant_fields(spec))
            s.update(budget_mb=spec['budget_mb'], probes={str(k): v for k, v in probes.items()})
        else:
            s = runner(spec, timeout=timeout)
        results['samples'].append(s)
        with open(out_path, 'w') as f:
            json.dump(results, f, indent=1)
        log(f'[{i + 1:3d}/{len(specs)}] ' + describe(s))
    return results


def merge(parts):
    """One results dict from several runs' (`parts`, in order): every sample, each tagged with its run's index
    (`run`), and the runs' env and config under `runs`; a smoke run anywhere makes the whole a smoke run. `render`
    pools samples of one model, kind, size, batch and precision across runs as rounds."""
    out = dict(format=FORMAT, smoke=any(p.get('smoke') for p in parts), runs=[], samples=[])
    notes = [p['note'] for p in parts if p.get('note')]
    if notes:
        out['note'] = ' '.join(dict.fromkeys(notes))
    for i, p in enumerate(parts):
        if p.get('format') != FORMAT:
            raise ValueError(f'run {i} is not a results file of this tool (format {p.get("format")!r})')
        for j, r in enumerate(p.get('runs') or [dict(env=p.get('env', {}), config=p.get('config', {}))]):
            out['runs'].append(r)
            k = len(out['runs']) - 1
            out['samples'] += [dict(s, run=k) for s in p['samples'] if s.get('run', 0) == j]
    return out


def describe(s):
    head = (f'{s["model"]:14s} {s["kind"]:8s} {size_key(s["size"]):>9s} b{s["batch"]:<3d} '
            f'{sample_precision(s):4s} r{s["round"]}') + (f' {s["allocator"]}' if 'allocator' in s else '')
    if 'error' in s:
        return f'{head} ERROR {s["error"]}'
    t = s.get('latency_ms') if s['kind'] != 'train' else s.get('step_ms')
    mem = s.get('peak_mem_mb')
    return f'{head} {t:10.1f} ms  peak ' + ('-' if mem is None else f'{mem:.0f} MB')


# ---- what render makes of the samples ------------------------------------------------------------------------

def stat(values):
    """(median, min, max) of the values, None without any."""
    values = [v for v in values if v is not None]
    return (statistics.median(values), min(values), max(values)) if values else None


def summarize(samples):
    """{(model, kind, size_key, batch, precision, allocator): {metric: (median, min, max) over rounds, 'errors':
    [...]}} with the metrics latency_ms, throughput, step_ms, peak_mem_mb (and batch of `maxbatch`); batch 0 for
    `maxbatch`, precision 'fp32' and allocator 'glibc' for a sample without one (`sample_precision`,
    `sample_allocator`)."""
    groups = {}
    for s in samples:
        groups.setdefault((s['model'], s['kind'], size_key(s['size']), s['batch'] if s['kind'] != 'maxbatch'
                           else 0, sample_precision(s), sample_allocator(s)), []).append(s)
    out = {}
    for key, ss in groups.items():
        ok = [s for s in ss if 'error' not in s]
        row = {m: stat([s.get(m) for s in ok]) for m in ('latency_ms', 'throughput', 'step_ms', 'peak_mem_mb',
                                                         'batch')}
        row['errors'] = sorted({s['error'] for s in ss if 'error' in s})
        row['rounds'] = len(ok)
        out[key] = row
    return out


def ratio(ours, theirs, higher_is_better=False):
    """Ratio of two (median, min, max) stats with its range from the extremes: theirs / ours (a speed-up, for
    times) or ours / theirs (`higher_is_better=False` ... for memory use `memory_ratio`)."""
    if ours is None or theirs is None:
        return None
    return theirs[0] / ours[0], theirs[1] / ours[2], theirs[2] / ours[1]


def memory_ratio(ours, theirs):
    """ours / theirs of two (median, min, max) memory stats, with its range; None where theirs has a zero peak (a
    tiny model's resident-set growth can be none: no ratio)."""
    if ours is None or theirs is None or not all(theirs):
        return None
    return ours[0] / theirs[0], ours[1] / theirs[2], ours[2] / theirs[1]


def crossover(points):
    """The resolution where a speed-up crosses 1: `points` is [(tokens, speed-up)] in any order; between the
    last pair of consecutive points going from < 1 to >= 1, log(speed-up) is interpolated linearly in
    log(tokens). Returns the tokens there (float), the first point's tokens if it is already >= 1 everywhere,
    None if it never gets there."""
    pts = sorted(points)
    if not pts:
        return None
    if all(r >= 1 for _, r in pts):
        return float(pts[0][0])
    if pts[-1][1] < 1:
        return None
    i = max(j for j in range(len(pts) - 1) if pts[j][1] < 1 <= pts[j + 1][1])
    (t0, r0), (t1, r1) = pts[i], pts[i + 1]
    f = -math.log(r0) / (math.log(r1) - math.log(r0)) if r1 != r0 else 0.
    return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))


def _fmt(st, digits=0, unit=''):
    if st is None:
        return '–'
    f = f'{{:.{digits}f}}'
    med, lo, hi = (f.format(v) for v in st)
    return f'{med}{unit} ({lo}–{hi})' if lo != hi else f'{med}{unit}'


def _fmt_ratio(r):
    return '–' if r is None else f'{r[0]:.2f}× ({r[1]:.2f}–{r[2]:.2f})'


def _cell(row, metric, digits=0):
    if row is None:
        return '–'
    if row[metric] is None and row['errors']:
        return 'failed: ' + '; '.join(row['errors'])[:80].replace('|', '/')
    return _fmt(row[metric], digits)


def _sizes(samples):
    return sorted({tuple(s['size']) for s in samples}, key=lambda s: (s[0] * s[1], s))


def precisions_of(samples):
    """The precisions of `samples` (`sample_precision`), in measure.PRECISIONS' order (fp32 first)."""
    found = {sample_precision(s) for s in samples}
    return [p for p in PRECISIONS if p in found] + sorted(found - set(PRECISIONS))


def variants_of(samples):
    """The (precision, allocator) pairs of `samples`: precisions as `precisions_of`, allocators in
    measure.ALLOCATORS' order (glibc first) within each."""
    found = {(sample_precision(s), sample_allocator(s)) for s in samples}
    order = list(ALLOCATORS)
    return [(p, a) for p in precisions_of(samples) for a in order + sorted({a for _, a in found} - set(order))
            if (p, a) in found]


def variant_title(prec, alloc):
    """'bf16 autocast', 'bf16 autocast, caching allocator', ...: how the tables head a (precision, allocator)."""
    return PRECISION_TITLES.get(prec, prec) + ('' if alloc == 'glibc' else f', {alloc} allocator')


def render(results):
    """The generated section of docs/benchmark.md (markdown, deterministic in `results`): the runs, then the
    tables; samples of one precision and allocator only (fp32 and glibc in every results file written before
    precisions existed) give one set of tables under `### Inference`, `### Training step`, ... (a precision or
    allocator other than fp32 / glibc named in a line above them); several give one set per (precision,
    allocator), each under its `### <precision>[, <allocator> allocator]` heading (`variant_title`) with `####`
    sub-headings."""
    samples = results['samples']
    lines = []
    if results.get('smoke'):
        lines += ['> **Smoke run, not a benchmark**: ' + results.get('note', 'tiny settings; figures mean nothing.'),
                  '']
    runs = results.get('runs') or [dict(env=results.get('env', {}), config=results.get('config', {}))]
    for i, run_ in enumerate(runs):
        env, cfg = run_.get('env', {}), run_.get('config', {})
        dev = env.get('gpu') or env.get('cpu') or env.get('machine')
        if not env.get('gpu') and env.get('cpu_isa'):
            units = env.get('cpu_half_units')
            dev += f', {env["cpu_isa"]}' + ('' if units is None else
                                             f', half-precision units: {", ".join(units) or "none"}')
        lines += [f'Run{f" {i + 1}" if len(runs) > 1 else ""}: {env.get("date")}, commit `{env.get("commit")}`, '
                  f'{env.get("device")} ({dev}, torch threads: {env.get("threads")}), torch {env.get("torch")}, '
                  f'mmdet {env.get("mmdet")}, mmpretrain {env.get("mmpretrain")}; {cfg.get("rounds")} rounds, warm-up '
                  f'{cfg.get("warmup")}, timed iterations per measurement: {cfg.get("iters")}'
                  + (f'; `{cfg["command"]}`' if cfg.get('command') else '') + '.', '']
    lines += ['Cells: median over rounds (min–max).', '']
    models = list(dict.fromkeys(s['model'] for s in samples))
    variants = variants_of(samples)
    if variants == [('fp32', 'glibc')] or not variants:
        lines += _render_tables(samples, models, '###')
    elif len(variants) == 1:
        prec, alloc = variants[0]
        lines += [f'Precision of every sample: {PRECISION_TITLES.get(prec, prec)}'
                  + ('' if alloc == 'glibc' else f'; allocator: {alloc}') + '.', '']
        lines += _render_tables(samples, models, '###')
    else:
        for prec, alloc in variants:
            lines += [f'### {variant_title(prec, alloc)}', '']
            lines += _render_tables([s for s in samples if (sample_precision(s), sample_allocator(s))
                                     == (prec, alloc)], models, '####')
    return '\n'.join(lines).rstrip() + '\n'


def _render_tables(samples, models, head):
    """The tables of `samples` (all of one precision): inference, training step, memory, ratios and crossover of
    the PAIRS measured among them; `models` the order of the rows, `head` the markdown heading of each part."""
    summ = {k[:4]: v for k, v in summarize(samples).items()}   # one precision and allocator
    sizes = _sizes(samples)
    present = {s['model'] for s in samples}
    lines = []

    def table(title, kind, metric, digits, batches=None):
        keys = [k for k in summ if k[1] == kind]
        bs = sorted({k[3] for k in keys}) if batches is None else batches
        if not keys:
            return []
        out = [f'**{title}**', '', '| model | batch | ' + ' | '.join(f'{h}×{w}' for h, w in sizes) + ' |',
               '|---|---|' + '---|' * len(sizes)]
        for m in models:
            for b in bs:
                cells = [_cell(summ.get((m, kind, size_key(sz), b)), metric, digits) for sz in sizes]
                if any(c != '–' for c in cells):
                    out.append(f'| {label(m)} | {b if kind != "maxbatch" else "largest"} | ' + ' | '.join(cells)
                               + ' |')
        return out + ['']

    lines += [f'{head} Inference', '']
    lines += table('Latency (ms, no grad)', 'infer', 'latency_ms', 0)
    lines += table('Throughput (images/s)', 'infer', 'throughput', 2)
    budget = next((s.get('budget_mb') for s in samples if s['kind'] == 'maxbatch'), None)
    lines += table(f'Throughput at the largest batch within {budget} MB (images/s)', 'maxbatch', 'throughput', 2,
                   [0])
    lines += [f'{head} Training step', '']
    lines += table('Step time (ms: forward, backward, AdamW step)', 'train', 'step_ms', 0)
    lines += [f'{head} Memory', '']
    lines += table('Training-step peak (MB above the model and input)', 'train', 'peak_mem_mb', 0)
    lines += table('Inference peak (MB)', 'infer', 'peak_mem_mb', 0)
    lines += table(f'Largest inference batch within {budget} MB', 'maxbatch', 'batch', 0, [0])
    # ratios
    pairs = [(a, b) for a, b in PAIRS if a in present and b in present]
    if pairs:
        lines += [f'{head} Scaling', '',
                  '**Ratios** (speed: their time / ours; memory: ours / theirs; range from the extremes)', '',
                  '| ours vs theirs | batch | size | inference speed | training speed | training memory |',
                  '|---|---|---|---|---|---|']
        for a, b in pairs:
            for bt in sorted({k[3] for k in summ if k[0] == a and k[1] in ('infer', 'train')}):
                for sz in sizes:
                    g = lambda m, k, met: (summ.get((m, k, size_key(sz), bt)) or {}).get(met)  # noqa: E731
                    r = [ratio(g(a, 'infer', 'latency_ms'), g(b, 'infer', 'latency_ms')),
                         ratio(g(a, 'train', 'step_ms'), g(b, 'train', 'step_ms')),
                         memory_ratio(g(a, 'train', 'peak_mem_mb'), g(b, 'train', 'peak_mem_mb'))]
                    if any(r):
                        lines.append(f'| {label(a)} vs {label(b)} | {bt} | {sz[0]}×{sz[1]} | '
                                     + ' | '.join(_fmt_ratio(x) for x in r) + ' |')
        lines += ['']
        lines += ['**Crossover** (where ours overtakes theirs, batch 1)', '',
                  '| ours vs theirs | inference | training step |', '|---|---|---|']
        for a, b in pairs:
            cells = []
            for kind, met in (('infer', 'latency_ms'), ('train', 'step_ms')):
                pts = []
                for sz in sizes:
                    ra = ratio((summ.get((a, kind, size_key(sz), 1)) or {}).get(met),
                               (summ.get((b, kind, size_key(sz), 1)) or {}).get(met))
                    if ra:
                        pts.append((sz[0] * sz[1], ra[0]))
                c = crossover(pts) if len(pts) >= 2 else None
                cells.append('–' if len(pts) < 2 else 'not within the sizes measured' if c is None
                             else f'≈ {math.sqrt(c):.0f}² pixels' + (' (at the smallest size already)'
                                                                     if c == min(p[0] for p in pts) else ''))
            lines.append(f'| {label(a)} vs {label(b)} | ' + ' | '.join(cells) + ' |')
        lines += ['']
    return lines


def replace_section(doc, section):
    """`doc` with the text between the BEGIN and END markers replaced by `section`; ValueError if the markers
    are missing."""
    if BEGIN not in doc or END not in doc or doc.index(BEGIN) > doc.index(END):
        raise ValueError(f'the page has no {BEGIN} ... {END} section to replace')
    head, rest = doc.split(BEGIN, 1)
    return head + BEGIN + '\n' + section + END + rest.split(END, 1)[1]


def plot_precision(results):
    """The precision the plot shows: fp32 where the results have fp32 samples, else their first precision."""
    precs = precisions_of(results['samples'])
    return 'fp32' if 'fp32' in precs or not precs else precs[0]


def plot_title(results):
    """The plot's title: device and torch of the run (of a merged file's first run), and the precision when it is
    not fp32."""
    env = results.get('env') or (results.get('runs') or [{}])[0].get('env', {})
    prec = plot_precision(results)
    return (('SMOKE RUN (meaningless figures) - ' if results.get('smoke') else '')
            + f'{env.get("device")} ({env.get("cpu") or env.get("gpu")}) - batch 1 - torch {env.get("torch")}'
            + ('' if prec == 'fp32' else f' - {PRECISION_TITLES.get(prec, prec)}'))


def plot(results, path):
    """Speed and training memory vs resolution of the PAIRS' models (batch 1, the samples of `plot_precision`):
    log-log, one line per model."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    prec = plot_precision(results)
    summ = {k[:4]: v for k, v in summarize(results['samples']).items() if k[4:] == (prec, 'glibc')}
    models = [m for m in dict.fromkeys(x for p in PAIRS[:3] for x in p)
              if any(k[0] == m for k in summ)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for m in models:
        for ax, (kind, met) in zip(axes, (('infer', 'latency_ms'), ('train', 'step_ms'), ('train', 'peak_mem_mb'))):
            pts = sorted((k[2], v[met]) for k, v in summ.items() if k[0] == m and k[1] == kind and k[3] == 1
                         and v[met])
            pts = sorted((parse_size(sk)[0] * parse_size(sk)[1], st) for sk, st in pts)
            if pts:
                x = [math.sqrt(p[0]) for p in pts]
                ax.errorbar(x, [p[1][0] for p in pts], yerr=[[p[1][0] - p[1][1] for p in pts],
                                                              [p[1][2] - p[1][0] for p in pts]],
                            marker='o', capsize=3, label=label(m), linestyle='--' if m in ('deit_t', 'deit_t_plain',
                                                                                            'swin_t') else '-')
    for ax, title in zip(axes, ('inference latency (ms)', 'training step (ms)', 'training-step peak memory (MB)')):
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel('resolution (sqrt of H x W, pixels)')
        ax.set_title(title)
        ax.grid(True, which='both', alpha=.3)
        ax.legend(fontsize=7)
    fig.suptitle(plot_title(results), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={'Software': None})
    plt.close(fig)


if __name__ == '__main__':   # one measurement, in the fresh process run_subprocess starts
    emit(measure(json.loads(sys.argv[1])))
