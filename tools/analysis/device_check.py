"""One-shot accelerator check of the backbones (tools/analysis/device_check.sh runs it, docs/device_check.md):
parity of the device in fp32 against CPU float64, fp16 / bf16 autocast finiteness and error, no host
synchronisation in forward / backward, then inference latency and training-step time / memory against the
authors' code and Swin-T. Each part's result is written as soon as it exists: device_check.json (all parts so
far) and device_check.md (one section appended per part) in --out-dir.

    python tools/analysis/device_check.py [--device cuda] [--parts env parity amp sync latency train]
        [--parity-size 512] [--amp-size 1248] [--bench 800x1344/b2 1248/b1] [--warmup 2] [--iters 5]
        [--authors-code ViTTT=PATH L2ViT=PATH ResT=PATH] [--budget 510] [--tiny] [--out-dir DIR]

Needs torch, mmengine and mmcv's Python part (mmcv-lite; no compiled ops), plus timm for the authors' files
and for Swin-T when mmdet is not installed (mmdet's Swin-T is used when it imports). Our backbones are built
directly from mmplugin_l2.models.backbones (no registry, no mmdet). The parts run in priority order, each in
its own subprocess with its share of --budget seconds as a time limit (time an earlier part left unused
carries over); a part that fails or runs out of time is reported as such and the later ones still run; a
part that would start with less than 15 s of the budget left is reported as not run.

Parts:
* env: versions, device name, TF32 defaults, which of mmdet / mmcv ops / timm were importable.
* parity: each backbone (H-ViT3-T, ViT3-T, L2ViT-T, ResT-S; random weights, eval) on the device in fp32
  against the same weights in float64 on the CPU, batch 2 at --parity-size: max |diff| / max |ref| per output
  stage, with TF32 off ('fp32') and, on CUDA, with torch's TF32 defaults ('tf32_default').
* amp: fp16 and bf16 autocast eval forward at --amp-size, batch 1: finiteness and rel. L2 error per stage
  against fp32 on the device.
* sync (CUDA only): forward + backward (train mode, the default recompute paths and with_cp=True) and
  eval forward under torch.cuda.set_sync_debug_mode('error'): any host synchronisation raises.
* latency: median no-grad forward of ours, the authors' (with --authors-code) and Swin-T per --bench entry.
* train: median training step (forward, backward of the summed output means, AdamW) and its peak memory
  (CUDA max_memory_allocated above what was allocated before; not measured on CPU) per --bench entry, our
  recompute / with_cp combinations (mmplugin_l2/analysis/train_step.py VARIANTS) beside theirs and Swin-T.
The speed parts (latency, train) run the hierarchical backbones (not ViT3-T).
"""
import argparse
import contextlib
import copy
import json
import os
import os.path as osp
import platform
import signal
import statistics
import subprocess
import sys
import time
import types

import torch
import torch.nn as nn

#: the parts in priority order (what must survive a short lease comes first)
PARTS = ['env', 'parity', 'amp', 'sync', 'latency', 'train']
#: share of --budget per part
SHARES = {'env': .05, 'parity': .15, 'amp': .1, 'sync': .1, 'latency': .25, 'train': .35}
#: a part is not started with less than this many seconds of the budget left; env (imports everything first)
#: may take up to ENV_MIN_S of it
MIN_PART_S, ENV_MIN_S = 15., 60.
#: our backbones: name -> (class name, constructor arguments)
OURS = {'hvit3_t': ('HViT3', dict(arch='tiny')), 'vit3_t': ('ViT3', dict(arch='tiny')),
        'l2vit_t': ('L2ViT', dict(arch='tiny')), 'rest_s': ('ResT', dict(arch='small'))}
#: the backbones the speed parts (latency, train) run: those with the authors' counterparts and train VARIANTS
BENCHED = ('hvit3_t', 'l2vit_t', 'rest_s')
#: parity verdict: fp32 with TF32 off against float64 (relative max error over all stages)
PARITY_TOL = 1e-4
#: narrow widths for --tiny (a CPU smoke test of the script)
TINY = {'HViT3': dict(embed_dims=[16, 32, 64, 64], depths=[1, 1, 2, 1], num_heads=[1, 1, 2, 2]),
        'L2ViT': dict(embed_dims=[16, 32, 64, 64], depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 2]),
        'ResT': dict(embed_dims=[16, 32, 48, 64], depths=[1, 1, 2, 1], num_heads=[1, 2, 3, 4]),
        'ViT3': dict(embed_dims=32, num_layers=2, num_heads=2)}
AUTHORS_TAG = '@authors'


def analysis():
    """The measuring functions this check takes from mmplugin_l2.analysis, imported in this one place."""
    from mmplugin_l2.analysis import authors
    from mmplugin_l2.analysis.models import build as build_benchmark_model
    from mmplugin_l2.analysis.precision import rel_l2, rel_max
    from mmplugin_l2.analysis.train_step import VARIANTS, train_steps
    return types.SimpleNamespace(authors=authors, build=build_benchmark_model, rel_l2=rel_l2, rel_max=rel_max,
                                 VARIANTS=VARIANTS, train_steps=train_steps)


# ---- models ------------------------------------------------------------------------------------------

def build_ours(name, tiny=False, extra=None, authors_cfg=False):
    from mmplugin_l2.models import backbones
    cls, kw = OURS[name]
    kw = dict(kw, drop_path_rate=0.)
    if tiny:
        kw['arch'] = TINY[cls]
    if authors_cfg and cls == 'ResT':
        kw['norm_in_path'] = True  # computes the authors' detectron2 ResT (mmplugin_l2/analysis/authors.py)
    kw.update(extra or {})
    return getattr(backbones, cls)(**kw)


class NCHW(nn.Module):
    """timm's feature maps (NHWC for Swin) as NCHW tuples."""

    def __init__(self, model, nhwc):
        super().__init__()
        self.model = model
        self.nhwc = nhwc

    def forward(self, x):
        out = self.model(x)
        return tuple(o.permute(0, 3, 1, 2) for o in out) if self.nhwc else tuple(out)


def build_swin(tiny=False):
    """Swin-T: mmdet's when mmdet imports, else timm's (features_only, any input size); (model, source)."""
    try:
        import mmdet  # noqa: F401
        build = analysis().build
        if tiny:
            from mmdet.registry import MODELS
            return MODELS.build(dict(type='mmdet.SwinTransformer', embed_dims=16, depths=(1, 1, 1, 1),
                                     num_heads=(1, 1, 2, 2), window_size=7)), 'mmdet'
        return build('swin_t'), 'mmdet'
    except Exception:  # no mmdet, or one without its mmcv ops
        import timm
        kw = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2)) if tiny else {}
        m = timm.create_model('swin_tiny_patch4_window7_224', pretrained=False, features_only=True,
                              img_size=(224, 224), strict_img_size=False, **kw)
        return NCHW(m, nhwc=True), f'timm {timm.__version__}'


def build_authors(name, roots):
    authors = analysis().authors
    fam = authors.AUTHORS[name][0]
    return authors.build(name, roots[fam])


def entries(args, train=False):
    """[(label, builder)] of the models to benchmark: ours (with every recompute / with_cp variant for
    training), the authors' where --authors-code names their family, Swin-T."""
    a = analysis()
    authors, VARIANTS = a.authors, a.VARIANTS
    out = []
    for n in (m for m in args.models if m in BENCHED):
        cls = OURS[n][0]
        has_theirs = n in authors.AUTHORS and authors.AUTHORS[n][0] in args.authors_code
        variants = VARIANTS[cls] if train else {'default': {}}
        for v, cfg in variants.items():
            out.append((n if v == 'default' else f'{n}[{v}]',
                        lambda n=n, cfg=cfg, t=has_theirs: build_ours(n, args.tiny, cfg, t)))
        if has_theirs:
            out.append((n + AUTHORS_TAG, lambda n=n: build_authors(n, args.authors_code)))
    if not args.no_swin:
        out.append(('swin_t', lambda: build_swin(args.tiny)[0]))
    return out


# ---- parts ---------------------------------------------------------------------------------------------

def _sync(dev):
    if dev.type == 'cuda':
        torch.cuda.synchronize()


def _images(b, size, seed=0):
    return torch.randn(b, 3, *size, generator=torch.Generator().manual_seed(seed))


#: what our backbones must not need
HEAVY = ('mmdet', 'mmseg', 'mmpretrain', 'mmcv._ext', 'mmcv.ops')


def part_env(args):
    import importlib
    for n in OURS:  # first, before anything else imports them: what building and running ours pulls in
        with torch.no_grad():
            build_ours(n, tiny=True).eval()(torch.zeros(1, 3, 64, 64))
    heavy = sorted(m for m in sys.modules if m in HEAVY or m.startswith(tuple(h + '.' for h in HEAVY)))
    cuda = args.device.startswith('cuda')
    res = dict(backbones_import=heavy, python=platform.python_version(), executable=sys.executable,
               torch=torch.__version__, device=args.device, cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None,
               device_name=torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
               tf32_matmul=torch.backends.cuda.matmul.allow_tf32, tf32_cudnn=torch.backends.cudnn.allow_tf32,
               threads=torch.get_num_threads())
    for mod in ('mmplugin_l2', 'mmengine', 'mmcv', 'timm', 'mmdet'):
        try:
            m = importlib.import_module(mod)
            res[mod] = getattr(m, '__version__', 'present')
            res[mod + '_path'] = osp.dirname(m.__file__)
        except Exception as e:  # noqa: BLE001  (any import failure means: not usable here)
            res[mod] = f'unavailable ({type(e).__name__})'
    try:
        importlib.import_module('mmcv._ext')
        res['mmcv_ops'] = True
    except Exception:  # noqa: BLE001
        res['mmcv_ops'] = False
    res['swin_source'] = build_swin(True)[1]
    return res


@contextlib.contextmanager
def _tf32(enabled):
    """TF32 for CUDA matmuls and cuDNN convolutions on (torch's default for cuDNN) or off, restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if enabled is not None:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def part_parity(args):
    rel_max = analysis().rel_max
    dev = torch.device(args.device)
    out = {}
    x = _images(2, args.parity_size)
    # fp32 proper (TF32 off); on CUDA also with torch's defaults, which let cuDNN convolutions use TF32
    modes = {'fp32': False, 'tf32_default': None} if dev.type == 'cuda' else {'fp32': False}
    for n in args.models:
        torch.manual_seed(0)
        m = build_ours(n, args.tiny).eval()
        ref_model = copy.deepcopy(m).double()
        with torch.no_grad():
            ref = ref_model(x.double())
            del ref_model
            m.to(dev)
            res = {}
            for mode, tf32 in modes.items():
                with _tf32(tf32):
                    got = m(x.to(dev))
                res[mode] = [rel_max(a.cpu(), r) for a, r in zip(got, ref)]
        out[n] = dict(res, shapes=[list(o.shape) for o in got], ok=max(res['fp32']) < PARITY_TOL)
        del m
        if dev.type == 'cuda':
            torch.cuda.empty_cache()
    return out


def part_sync(args):
    dev = torch.device(args.device)
    if dev.type != 'cuda':
        return dict(skipped='torch.cuda.set_sync_debug_mode needs CUDA (tests/test_device_check.py runs the '
                            'meta-device check on CPU)')
    out = {}
    x = _images(1, args.parity_size).to(dev)
    for n in args.models:
        for label, extra in (('train', {}), ('train+with_cp', dict(with_cp=True)), ('eval', {})):
            m = build_ours(n, args.tiny, extra).to(dev).train(label.startswith('train'))
            _sync(dev)
            torch.cuda.set_sync_debug_mode('error')
            try:
                if label == 'eval':
                    with torch.no_grad():
                        m(x)
                else:
                    sum(o.float().mean() for o in m(x)).backward()
                out[f'{n}/{label}'] = 'no host synchronisation'
            except RuntimeError as e:
                out[f'{n}/{label}'] = f'FAILED: {str(e).splitlines()[0]}'
            finally:
                torch.cuda.set_sync_debug_mode('default')
    return out


def part_amp(args):
    rel_l2 = analysis().rel_l2
    dev = torch.device(args.device)
    out = {}
    x = _images(1, args.amp_size).to(dev)
    for n in args.models:
        torch.manual_seed(0)
        m = build_ours(n, args.tiny).to(dev).eval()
        with torch.no_grad(), _tf32(False):
            ref = [o.float() for o in m(x)]
            res = {}
            for name, dt in (('fp16', torch.float16), ('bf16', torch.bfloat16)):
                if dev.type == 'cpu' and dt == torch.float16 and not args.tiny:
                    continue
                with torch.autocast(dev.type, dtype=dt):
                    got = [o.float() for o in m(x)]
                res[name] = dict(finite=all(bool(torch.isfinite(g).all()) for g in got),
                                 rel_l2=[rel_l2(g, r) for g, r in zip(got, ref)])
        out[n] = res
        del m
        if dev.type == 'cuda':
            torch.cuda.empty_cache()
    return out


def _spec(s):
    size, _, b = s.partition('/b')
    h, _, w = size.partition('x')
    return (int(h), int(w or h)), int(b or 1)


def part_latency(args):
    dev = torch.device(args.device)
    out = {}
    for spec in args.bench:
        size, b = _spec(spec)
        x = _images(b, size).to(dev)
        for label, make in entries(args):
            try:
                m = make().to(dev).eval()
                times = []
                with torch.no_grad():
                    for i in range(args.warmup + args.iters):
                        _sync(dev)
                        t = time.perf_counter()
                        m(x)
                        _sync(dev)
                        if i >= args.warmup:
                            times.append((time.perf_counter() - t) * 1e3)
                out.setdefault(spec, {})[label] = dict(median_ms=statistics.median(times), min_ms=min(times),
                                                       max_ms=max(times))
            except Exception as e:  # noqa: BLE001  (an OOM or an unsupported size: report, go on)
                out.setdefault(spec, {})[label] = dict(error=f'{type(e).__name__}: {str(e).splitlines()[0]}')
            finally:
                m = None
                if dev.type == 'cuda':
                    torch.cuda.empty_cache()
    return out


def part_train(args):
    train_steps = analysis().train_steps
    dev = torch.device(args.device)
    out = {}
    for spec in args.bench:
        size, b = _spec(spec)
        x = _images(b, size).to(dev)
        for label, make in entries(args, train=True):
            try:
                m = make().to(dev)
                # CPU: no memory figure (the peak RSS of a process that already ran other models is not
                # this model's; tools/analysis/benchmark.py measures CPU memory in fresh processes)
                steps, peak = train_steps(m, x, args.warmup, args.iters, memory=dev.type == 'cuda')
                tot = [s['total_ms'] for s in steps]
                out.setdefault(spec, {})[label] = dict(
                    step_ms=statistics.median(tot), min_ms=min(tot), max_ms=max(tot),
                    forward_ms=statistics.median(s['forward_ms'] for s in steps),
                    backward_ms=statistics.median(s['backward_ms'] for s in steps),
                    peak_mem_mb=peak)
            except Exception as e:  # noqa: BLE001
                out.setdefault(spec, {})[label] = dict(error=f'{type(e).__name__}: {str(e).splitlines()[0]}')
            finally:
                m = None
                if dev.type == 'cuda':
                    torch.cuda.empty_cache()
    return out


PART_FN = dict(env=part_env, parity=part_parity, sync=part_sync, amp=part_amp, latency=part_latency,
               train=part_train)


def _family_path(s):
    return analysis().authors.family_path(s)


# ---- driver ----------------------------------------------------------------------------------------------

def _size(s):
    h, _, w = str(s).partition('x')
    return int(h), int(w or h)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split('\n\n', 2)[2])
    p.add_argument('--device', default='cuda')
    p.add_argument('--parts', nargs='+', default=PARTS, choices=PARTS)
    p.add_argument('--models', nargs='+', default=list(OURS), choices=list(OURS))
    p.add_argument('--parity-size', type=_size, default=(512, 512))
    p.add_argument('--amp-size', type=_size, default=(1248, 1248))
    p.add_argument('--bench', nargs='+', default=['800x1344/b2', '1248/b1'], help='HxW/bBATCH entries')
    p.add_argument('--warmup', type=int, default=2)
    p.add_argument('--iters', type=int, default=5)
    p.add_argument('--authors-code', nargs='+', type=_family_path, default=[],
                   metavar='FAMILY=PATH')
    p.add_argument('--no-swin', action='store_true')
    p.add_argument('--budget', type=float, default=510., help='seconds for all parts together')
    p.add_argument('--tiny', action='store_true', help='narrow models (a smoke test of this script)')
    p.add_argument('--out-dir', default='work_dirs/device_check')
    p.add_argument('--part', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        p.error('--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); '
                'use --device cpu for a smoke test')
    for s in args.bench:
        try:
            _spec(s)
        except ValueError:
            p.error(f'--bench: expected HxW/bBATCH such as 800x1344/b2, got {s!r}')
    if args.budget <= 0:
        p.error(f'--budget: expected a positive number of seconds, got {args.budget:g}')
    args.authors_code = analysis().authors.checked_roots(args.authors_code, p.error)
    return args


class Stopped(Exception):
    """SIGTERM (the wrapper's hard time limit) arrived while a part ran."""


#: in_part: a part's subprocess is running; stopped: the message once SIGTERM arrived
_STATE = dict(in_part=False, stopped=None)


def _on_sigterm(signum, frame):
    _STATE['stopped'] = f'stopped by signal {signum} (the hard time limit of device_check.sh)'
    if _STATE['in_part']:  # leave subprocess.run, which kills the part; elsewhere the loop sees the flag
        raise Stopped(_STATE['stopped'])


def run_part(argv, part, timeout):
    """One part in a fresh subprocess with a time limit; its result dict, or {'error': ...}."""
    t = time.perf_counter()
    cmd = [sys.executable, osp.abspath(__file__), *argv, '--part', part]
    _STATE['in_part'] = True
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f'timed out after {timeout:.0f} s'), time.perf_counter() - t
    except Stopped as e:  # subprocess.run has killed the part's process
        return dict(error=str(e)), time.perf_counter() - t
    finally:
        _STATE['in_part'] = False
    if _STATE['stopped']:  # the part died of the same signal first
        return dict(error=_STATE['stopped']), time.perf_counter() - t
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith('{')]
    if r.returncode != 0 or not lines:
        err = (r.stderr.strip().splitlines() or ['no output'])[-1]
        return dict(error=err), time.perf_counter() - t
    return json.loads(lines[-1]), time.perf_counter() - t


def _fmt_list(v, fmt='.1e'):
    return ' '.join(format(x, fmt) for x in v)


def md_header(env, args):
    return '\n'.join([
        f'# Device check: {env.get("device_name", "?")} ({args["device"]})', '',
        f'Python {env.get("python")}, torch {env.get("torch")}, CUDA {env.get("cuda")}, mmengine '
        f'{env.get("mmengine")}, mmcv {env.get("mmcv")} (ops: {env.get("mmcv_ops")}), timm {env.get("timm")}, '
        f'mmdet {env.get("mmdet")}; Swin-T from {env.get("swin_source")}; TF32 defaults: matmul '
        f'{env.get("tf32_matmul")}, cuDNN {env.get("tf32_cudnn")}; our backbones import '
        f'{", ".join(env.get("backbones_import", [])) or "none"} of {", ".join(HEAVY)}. '
        f'Budget {args["budget_s"]:.0f} s.', '', ''])


def md_part(part, r, wall):
    """The Markdown section of one part's result `r`."""
    lines = [f'## {part} ({wall:.0f} s)', '']
    if 'error' in r or 'skipped' in r:
        return '\n'.join(lines + [f'{"FAILED: " + r["error"] if "error" in r else "skipped: " + r["skipped"]}',
                                  '', ''])
    if part == 'env':
        lines += ['| | |', '|---|---|'] + [f'| {k} | {v} |' for k, v in r.items()]
    elif part == 'parity':
        tf32 = any('tf32_default' in v for v in r.values())
        lines += [f'| model | within {PARITY_TOL:g} | rel. max error per stage, fp32 (TF32 off) vs fp64 CPU |'
                  + (' torch\'s TF32 defaults |' if tf32 else ''), '|---|---|---|' + ('---|' if tf32 else '')]
        lines += [f'| `{n}` | {v["ok"]} | {_fmt_list(v["fp32"])} |'
                  + (f' {_fmt_list(v["tf32_default"])} |' if tf32 else '') for n, v in r.items()]
    elif part == 'sync':
        lines += ['| model / mode | result |', '|---|---|'] + [f'| `{k}` | {v} |' for k, v in r.items()]
    elif part == 'amp':
        lines += ['| model | fp16 finite, rel. L2 per stage | bf16 finite, rel. L2 per stage |', '|---|---|---|']
        for n, v in r.items():
            cells = [f'{v[d]["finite"]}, {_fmt_list(v[d]["rel_l2"])}' if d in v else '-' for d in ('fp16', 'bf16')]
            lines.append(f'| `{n}` | {cells[0]} | {cells[1]} |')
    else:
        key = 'median_ms' if part == 'latency' else 'step_ms'
        head = 'inference ms (min–max)' if part == 'latency' else 'train step ms (min–max) | fwd / bwd ms | peak MB'
        for spec, rows in r.items():
            lines += [f'**{spec}**', '', f'| model | {head} |', '|---|' + '---|' * head.count('|') + '---|']
            for label, v in rows.items():
                if 'error' in v:
                    lines.append(f'| `{label}` | failed: {v["error"]} |')
                    continue
                cell = f'{v[key]:.1f} ({v["min_ms"]:.1f}–{v["max_ms"]:.1f})'
                if part == 'train':
                    mem = '-' if v['peak_mem_mb'] is None else f'{v["peak_mem_mb"]:.0f}'
                    cell += f' | {v["forward_ms"]:.1f} / {v["backward_ms"]:.1f} | {mem}'
                lines.append(f'| `{label}` | {cell} |')
            lines.append('')
    return '\n'.join(lines + ['', ''])


def markdown(res):
    """The whole report of a results dict (device_check.json) as Markdown."""
    text = md_header(res.get('env', {}), res['args'])
    for part, r in res['parts'].items():
        text += md_part(part, r, res['part_wall_s'][part])
    return text


def _write_json(path, res):
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(res, f, indent=2)
    os.replace(tmp, path)  # a reader (or a kill) never sees half a file


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.part:
        print(json.dumps(PART_FN[args.part](args)))
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    t0 = time.perf_counter()
    res = dict(args=dict(device=args.device, parts=args.parts, models=args.models, bench=args.bench,
                         parity_size=list(args.parity_size), amp_size=list(args.amp_size), warmup=args.warmup,
                         iters=args.iters, authors_code=args.authors_code, tiny=args.tiny, budget_s=args.budget),
               env={}, parts={}, part_wall_s={}, complete=False)
    os.makedirs(args.out_dir, exist_ok=True)
    json_path, md_path = osp.join(args.out_dir, 'device_check.json'), osp.join(args.out_dir, 'device_check.md')
    with open(md_path, 'w') as f:
        f.write(md_header({}, res['args']))
    parts = ['env'] + [p for p in PARTS if p in args.parts and p != 'env']
    planned_end = 0.
    for part in parts:
        # each part may run until its planned end (its share of --budget after the earlier parts' shares):
        # time an earlier part left unused carries over, an overrun is taken from the later parts
        planned_end += args.budget * SHARES[part] / sum(SHARES[p] for p in parts)
        left = args.budget - (time.perf_counter() - t0)
        floor = ENV_MIN_S if part == 'env' else MIN_PART_S
        timeout = min(left, max(floor, planned_end - (time.perf_counter() - t0)))
        if _STATE['stopped'] or left < MIN_PART_S:
            r, wall = dict(error='not run: ' + (_STATE['stopped'] or f'{left:.0f} s of the budget left')), 0.
        else:
            print(f'[device_check] {part} (limit {timeout:.0f} s) ...', flush=True)
            r, wall = run_part(argv, part, timeout)
        print(f'[device_check] {part}: {"FAILED " + r["error"] if "error" in r else "done"} in {wall:.0f} s',
              flush=True)
        res['parts'][part], res['part_wall_s'][part] = r, wall
        if part == 'env' and 'error' not in r:
            res['env'] = r
            with open(md_path, 'w') as f:  # the header, now with the versions
                f.write(md_header(r, res['args']))
        res['wall_s'] = time.perf_counter() - t0
        _write_json(json_path, res)
        with open(md_path, 'a') as f:
            f.write(md_part(part, r, wall))
    res['complete'] = not _STATE['stopped']
    res['wall_s'] = time.perf_counter() - t0
    _write_json(json_path, res)
    with open(md_path, 'a') as f:
        f.write(f'Total {res["wall_s"]:.0f} s{"" if res["complete"] else " (stopped)"}.\n')
    print(markdown(res))
    print(f'wrote {json_path} and {md_path}')
    return res


if __name__ == '__main__':
    main()
