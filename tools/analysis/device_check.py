"""One-shot accelerator check of the backbones (tools/analysis/device_check.sh runs it; docs/device_check.md):
preflight, eval parity and training gradients on the device against CPU float64, the AMP training step, host
synchronisation, then speed and peak memory against the authors' code, DeiT-T and Swin-T. Every model of every
part runs in its own process under a time limit, and the results are rewritten after each: device_check.json,
device_check.md, speed_<precision>.json (the benchmark's results format) and errors/*.txt (the whole text of
every failure) in --out-dir.

    python tools/analysis/device_check.py [--device cuda] [--parts preflight parity amp sync speed]
        [--models hvit3_t vit3_t l2vit_t rest_s] [--parity-size 224x320] [--amp-size 512]
        [--headline 1248/b1 2048/b1] [--detection 800x1344/b2] [--precisions fp32 tf32 bf16]
        [--compiled auto|on|off] [--warmup 2] [--iters 5] [--authors-code ViTTT=PATH L2ViT=PATH ResT=PATH]
        [--budget 510] [--preflight-s 30] [--tiny] [--out-dir DIR]

Needs torch and timm; mmengine and mmcv's Python part (mmcv-lite) to import our backbones; mmdet / mmpretrain
are used for Swin-T / DeiT-T when they import, else timm's (the report names the source). Measuring code:
mmplugin_l2/analysis/measure.py (timer, sync, peak memory, precision, training step, fresh processes), the
model table mmplugin_l2/analysis/models.py, the speed samples mmplugin_l2/analysis/benchmark.py `measure`.

Parts, in priority order (share of what preflight leaves of --budget; time a part leaves unused carries over):
* preflight (--preflight-s): versions, device, which of mmdet / mmpretrain / mmcv ops / timm import; one
  tiny forward of each backbone, Swin-T and DeiT-T on the device, each failure's traceback saved.
* parity (32 %): each of --models with random weights, biases and norm parameters included
  (`authors.randomize_`), batch 2 at --parity-size: the eval outputs on the device in fp32 (TF32 off; on CUDA
  also TF32 on) against float64 on the CPU (rel. max error per stage), and the training gradients of all
  parameters (loss: sum of the output maps' mean squares) with the fast training path on (fast_train=True)
  and off (fast_train=False) against float64 on the CPU without it: rel. max error per parameter, its largest
  and where, rel. L2 of all gradients.
* amp (15 %): one training step at --amp-size, batch 2, under bf16 autocast and fp16 autocast with a
  torch.amp.GradScaler: loss and gradients finite, gradient error against the fp32 step (same weights and
  input), parameters finite after the optimizer step. With --compiled (the default on CUDA) also H-ViT3-T with_cp
  with the compiled TTT path on its declared devices and on every device (`COMPILED`), here and in speed; without
  it (the default on the CPU) H-ViT3-T and ViT3-T are built with fast_compile=False everywhere (`TTT_MODELS`): a CPU
  rehearsal runs what a GPU runs.
* sync (8 %, CUDA only): forward + backward (train, with and without with_cp) and eval forward under
  torch.cuda.set_sync_debug_mode('error').
* speed (45 %): inference and training step (median, min-max, peak memory) per --precisions: ViT3-T against
  DeiT-T per --headline entry; H-ViT3-T, L2ViT-T, ResT-S against Swin-T (and the authors' code when
  --authors-code names it) per --detection entry.
"""
import argparse
import copy
import json
import os
import os.path as osp
import platform
import signal
import sys
import time
import traceback

import torch

from mmplugin_l2.analysis import authors as authors_mod
from mmplugin_l2.analysis import benchmark as bm
from mmplugin_l2.analysis.measure import PRECISIONS, emit, failure_line, gradients, precision, run_fresh, sync
from mmplugin_l2.analysis.models import AUTHORS_TAG, build, label
from mmplugin_l2.analysis.precision import grads_error, rel_max

PARTS = ['preflight', 'parity', 'amp', 'sync', 'speed']
#: share of the budget that preflight leaves, per part
SHARES = {'parity': .32, 'amp': .15, 'sync': .08, 'speed': .45}
#: a model is not started with less than this many seconds of the budget left
MIN_JOB_S = 10.
OURS = ['hvit3_t', 'vit3_t', 'l2vit_t', 'rest_s']
#: the pyramids of the detection speed entries (ViT3-T is the headline's)
PYRAMIDS = ['hvit3_t', 'l2vit_t', 'rest_s']
#: the compiled TTT path (H-ViT3's `fast_compile`, measured on CPU only): H-ViT3-T as the detection configs build it
#: (`with_cp`: the compiled path on the devices it is declared for, the CPU) and with the compiled path on every
#: device; in the amp and speed parts when --compiled is on (the default on CUDA; on the CPU both are the same)
COMPILED = ['hvit3_t_cp', 'hvit3_t_cp_compiled']
#: our models with TTT layers (`fast_compile`): with --compiled off they are built with fast_compile=False, so that a
#: CPU rehearsal runs what a GPU runs (where the compiled path is not declared) instead of compiling it
TTT_MODELS = ('hvit3_t', 'vit3_t')
#: the fast training path on and off
PATHS = {'fast': dict(fast_train=True), 'plain': dict(fast_train=False)}
#: verdicts, fp32 (TF32 off) against float64: outputs within PARITY_TOL (rel. max over stages); gradients (largest
#: per-parameter error, `precision.grads_error`) within GRAD_FACTOR times the CPU's own fp32 error (the model's
#: conditioning at that size: a conv before a train-mode BatchNorm loses digits to cancellation) or GRAD_TOL
PARITY_TOL, GRAD_FACTOR, GRAD_TOL = 1e-4, 10., 1e-3
#: what our backbones must not need
HEAVY = ('mmdet', 'mmseg', 'mmpretrain', 'mmcv._ext', 'mmcv.ops')
AMP = ('bf16', 'fp16')


# ---- what each process runs: one part for one model ------------------------------------------------------

def images(batch, size, seed=0):
    """Seeded random images (batch, 3, H, W) on the CPU."""
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(seed))


def _planted(name):
    raise RuntimeError(f'planted fault in {name} (--plant-fault)')


def build_model(args, name, **cfg):
    """Our backbone (or Swin-T / DeiT-T) `name` with random weights, biases and norm parameters included."""
    if name == args.plant_fault:
        _planted(name)
    torch.manual_seed(0)
    return authors_mod.randomize_(build(name, {**uncompiled(args, name), **cfg}, tiny=args.tiny), seed=1)


def uncompiled(args, name):
    """The overrides that keep model `name` off the compiled TTT path without --compiled (`TTT_MODELS`)."""
    return dict(fast_compile=False) if name in TTT_MODELS and not args.compiled else {}


def _failure(e):
    return dict(error=f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}',
                traceback=traceback.format_exc())


def _usable(name, args, dev):
    """`name` builds and runs one no-grad forward of a 64x64 image on the device: True, or its failure."""
    try:
        with torch.no_grad():
            model = build_model(args, name).to(dev)
            model.eval()  # mmdet's backbones' train() returns None: no chaining
            model(images(1, (64, 64)).to(dev))
        return True
    except Exception as e:  # noqa: BLE001  (any failure is the finding)
        return _failure(e)


def child_preflight(args, _):
    """Versions and device, what our backbones import, one forward per backbone and of Swin-T / DeiT-T."""
    import importlib
    dev = torch.device(args.device)
    for n in OURS:  # first: what building and running ours imports; each result printed as it comes
        emit(dict(forward={n: _usable(n, args, dev)}))
    heavy = sorted(m for m in sys.modules if m in HEAVY or m.startswith(tuple(h + '.' for h in HEAVY)))
    env = dict(backbones_import=heavy, python=platform.python_version(), executable=sys.executable,
               torch=torch.__version__, device=args.device, cuda=torch.version.cuda,
               cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None,
               device_name=torch.cuda.get_device_name(dev) if dev.type == 'cuda'
               else platform.processor() or platform.machine(),
               tf32_matmul=torch.backends.cuda.matmul.allow_tf32, tf32_cudnn=torch.backends.cudnn.allow_tf32,
               threads=torch.get_num_threads())
    for mod in ('mmplugin_l2', 'mmengine', 'mmcv', 'timm', 'mmdet', 'mmpretrain'):
        try:
            m = importlib.import_module(mod)
            env[mod], env[mod + '_path'] = getattr(m, '__version__', 'present'), osp.dirname(m.__file__)
        except Exception as e:  # noqa: BLE001  (any import failure means: not usable here)
            env[mod] = f'unavailable ({type(e).__name__})'
    try:
        importlib.import_module('mmcv._ext')
        env['mmcv_ops'] = True
    except Exception:  # noqa: BLE001
        env['mmcv_ops'] = False
    emit(dict(env=env))
    # Swin-T and DeiT-T: mmdet's / mmpretrain's where they run, else timm's
    for ref, (lib, fallback) in dict(swin_t=('mmdet', 'swin_t_timm'), deit_t=('mmpretrain', 'deit_t_timm')).items():
        got = _usable(ref, args, dev) if not str(env[lib]).startswith('unavailable') else f'not tried: {lib} {env[lib]}'
        emit(dict(forward={ref: got}))
        if got is not True:
            emit(dict(forward={fallback: _usable(fallback, args, dev)}))
    emit(dict(bench_env=bm.environment(args.device)))


def child_parity(args, name):
    """Eval outputs and training gradients (both paths) on the device against float64 on the CPU."""
    dev = torch.device(args.device)
    plain = build_model(args, name, **PATHS['plain'])
    x = images(2, args.parity_size)
    ref = copy.deepcopy(plain).double()
    with torch.no_grad():
        ref.eval()
        ref_out = ref(x.double())
        model = copy.deepcopy(plain).to(dev)
        model.eval()
        row = {}
        for prec in ('fp32', 'tf32') if dev.type == 'cuda' else ('fp32',):
            with precision(prec, dev):
                out = model(x.to(dev))
            row[prec] = [rel_max(a.cpu(), r) for a, r in zip(out, ref_out)]
        row['ok'] = max(row['fp32']) < PARITY_TOL
        emit(dict(eval=row, shapes=[list(o.shape) for o in out]))
    del model
    state = copy.deepcopy(plain.state_dict())
    ref_loss, ref_grads = gradients(ref, x.double())
    # the model's own fp32 conditioning at this size: the CPU's fp32 gradients (plain path) against float64
    base = grads_error(gradients(plain, x)[1], ref_grads)
    emit(dict(grad_cpu_fp32=base))
    for path, cfg in PATHS.items():
        model = build_model(args, name, **cfg)
        model.load_state_dict(state)
        model.to(dev)
        loss, grads = gradients(model, x.to(dev))
        err = grads_error({k: v.cpu() for k, v in grads.items()}, ref_grads)
        err.update(loss=abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                   ok=err['max_rel_max'] <= max(GRAD_FACTOR * base['max_rel_max'], GRAD_TOL))
        emit({f'grad_{path}': err})
        del model
        _free(dev)


def _amp_step(model, x, prec, ref_grads, tries=16):
    """One training step of `model` in `prec`: finiteness and gradient error against `ref_grads`. fp16 runs
    with a GradScaler (its defaults, as mmengine's AmpOptimWrapper): a step whose scaled gradients overflow is
    skipped and the scale halved, as in training, up to `tries` times; `skipped_steps` counts them."""
    dev = x.device
    scaler = torch.amp.GradScaler(dev.type) if prec == 'fp16' else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    res = {}
    for i in range(tries if scaler else 1):
        loss, grads = gradients(model, x, prec, scaler)
        res = dict(loss_finite=bool(torch.isfinite(loss)),
                   grads_finite=all(bool(torch.isfinite(g).all()) for g in grads.values()))
        if scaler is None:
            opt.step()
            break
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        res.update(scale=scale, skipped_steps=i + (not res['grads_finite']))
        if res['grads_finite']:
            break
    if res['grads_finite']:
        res.update(grads_error({k: v.cpu() for k, v in grads.items()}, ref_grads))
    res['params_finite'] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return res


def child_amp(args, name):
    """bf16 and fp16 (grad-scaled) training steps against the fp32 step of the same weights and input."""
    dev = torch.device(args.device)
    model = build_model(args, name).to(dev)
    x = images(2, args.amp_size).to(dev)
    _, ref = gradients(model, x, 'fp32')
    ref = {k: v.cpu() for k, v in ref.items()}
    for prec in AMP:
        try:
            emit({prec: _amp_step(copy.deepcopy(model), x, prec, ref)})
        except Exception as e:  # noqa: BLE001  (e.g. an autocast dtype this device lacks: report, go on)
            emit({prec: _failure(e)})
        _free(dev)


def child_sync(args, name):
    """Train (with and without with_cp) and eval passes under torch.cuda.set_sync_debug_mode('error')."""
    dev = torch.device(args.device)
    x = images(1, args.parity_size).to(dev)
    for mode, cfg in (('train', {}), ('train+with_cp', dict(with_cp=True)), ('eval', {})):
        model = build_model(args, name, **cfg).to(dev)
        model.train(mode != 'eval')
        sync(dev)
        torch.cuda.set_sync_debug_mode('error')
        try:
            if mode == 'eval':
                with torch.no_grad():
                    model(x)
            else:
                sum(o.float().mean() for o in model(x)).backward()
            emit({mode: 'no host synchronisation'})
        except RuntimeError as e:
            emit({mode: _failure(e)})
        finally:
            torch.cuda.set_sync_debug_mode('default')


def child_speed(args, job):
    """The benchmark's infer and train samples of one 'model HxW/bB' job in every --precisions."""
    name, spec = job.split(' ')
    if name.partition(AUTHORS_TAG)[0] == args.plant_fault:
        _planted(name)
    size, batch = parse_spec(spec)
    dev = torch.device(args.device)
    for prec in args.precisions:
        for kind in ('infer', 'train'):
            s = dict(model=name, kind=kind, size=list(size), batch=batch, round=0, precision=prec)
            try:
                s = bm.measure(dict(s, warmup=args.warmup, iters=args.iters, device=args.device,
                                    tiny=args.tiny and not name.endswith(AUTHORS_TAG),
                                    authors_roots=args.authors_code, cfg=uncompiled(args, name) or None))
                s['precision'] = prec
            except Exception as e:  # noqa: BLE001  (an OOM or an unsupported size: report, go on)
                s.update(_failure(e))
            emit(s)
            _free(dev)


def _free(dev):
    """Hand cached CUDA blocks back between models, so the next one's peak memory starts clean."""
    if dev.type == 'cuda':
        torch.cuda.empty_cache()


CHILDREN = dict(preflight=child_preflight, parity=child_parity, amp=child_amp, sync=child_sync,
                speed=child_speed)


# ---- the driver: jobs, time limits, results ------------------------------------------------------------

def compiled_models(args):
    """The models of the compiled TTT path's check (`COMPILED`) where --compiled is on and H-ViT3 is checked."""
    return list(COMPILED) if args.compiled and 'hvit3_t' in args.models else []


def speed_jobs(args, forward):
    """The speed part's jobs 'model HxW/bB': ViT3-T and DeiT-T per --headline entry, the pyramids (and the
    compiled TTT path's models), their authors' code and Swin-T per --detection entry (Swin-T / DeiT-T from the
    source preflight found)."""
    deit = 'deit_t' if forward.get('deit_t') is True else 'deit_t_timm'
    swin = 'swin_t' if forward.get('swin_t') is True else 'swin_t_timm'
    jobs = [f'{m} {s}' for s in args.headline for m in ('vit3_t', deit) if 'vit3_t' in args.models]
    pyramids = [m for m in PYRAMIDS if m in args.models] + compiled_models(args)
    for s in args.detection if pyramids else []:
        for m in pyramids:
            jobs.append(f'{m} {s}')
            if m in authors_mod.AUTHORS and authors_mod.AUTHORS[m][0] in args.authors_code:
                jobs.append(f'{m}{AUTHORS_TAG} {s}')
        jobs.append(f'{swin} {s}')
    return jobs


def part_jobs(part, args, forward):
    """What a part runs one process for: its models (speed: 'model HxW/bB' jobs)."""
    if part == 'preflight':
        return ['all']
    if part == 'speed':
        return speed_jobs(args, forward)
    if part == 'amp':
        return list(args.models) + compiled_models(args)
    return list(args.models)


class Stopped(Exception):
    """SIGTERM (the wrapper's hard time limit) arrived while a model ran."""


#: in_job: a model's process is running; stopped: the message once SIGTERM arrived
_STATE = dict(in_job=False, stopped=None)


def _on_sigterm(signum, frame):
    _STATE['stopped'] = f'stopped by signal {signum} (the hard time limit of device_check.sh)'
    if _STATE['in_job']:  # leave subprocess.run, which kills the model's process; elsewhere the loop sees it
        raise Stopped(_STATE['stopped'])


def run_job(argv, part, job, timeout):
    """One part for one model in a fresh process: (what it printed, the failure text or None)."""
    _STATE['in_job'] = True
    try:
        return run_fresh([osp.abspath(__file__), *argv, '--child', part, job], timeout)
    except Stopped as e:
        return [], str(e) + '\n'
    finally:
        _STATE['in_job'] = False


def save_error(out_dir, part, job, text):
    """Write the whole failure `text` to errors/<part>__<job>.txt under `out_dir`; its path there."""
    rel = osp.join('errors', f'{part}__{job.replace(" ", "__").replace("/", "_")}.txt')
    os.makedirs(osp.join(out_dir, 'errors'), exist_ok=True)
    with open(osp.join(out_dir, rel), 'w') as f:
        f.write(text)
    return rel


def job_row(part, job, printed, failure, out_dir):
    """The results row of one model: what its process printed (merged; the speed part's samples listed),
    every traceback moved to a file under out_dir/errors, and the process's failure if it failed."""
    row = dict(samples=[]) if part == 'speed' else {}
    for i, r in enumerate(printed):
        for key, v in ([('sample', r)] if part == 'speed' else r.items()):
            if isinstance(v, dict) and 'traceback' in v:
                v['error_file'] = save_error(out_dir, part, f'{job} {key} {i}', v.pop('traceback'))
            if part == 'speed':
                row['samples'].append(v)
            elif key == 'forward':  # preflight: one backbone at a time
                for n, f in v.items():
                    if isinstance(f, dict) and 'traceback' in f:
                        f['error_file'] = save_error(out_dir, part, n, f.pop('traceback'))
                row.setdefault(key, {}).update(v)
            else:
                row[key] = v
    if failure is not None:
        row.update(error=failure_line(failure), error_file=save_error(out_dir, part, job, failure))
    return row


def parse_spec(s):
    """'800x1344/b2' -> ((800, 1344), 2); ValueError otherwise."""
    size, _, b = s.partition('/b')
    size, batch = bm.parse_size(size), int(b or 1)
    if batch < 1:
        raise ValueError(f'batch {batch} < 1')
    return size, batch


def _size(s):
    try:
        return bm.parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _spec(s):
    try:
        parse_spec(s)
        return s
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected HxW/bBATCH such as 800x1344/b2, got {s!r}') from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split('\n\n', 2)[2])
    p.add_argument('--device', default='cuda', help='cuda, cuda:N or cpu (a rehearsal)')
    p.add_argument('--parts', nargs='+', default=PARTS, choices=PARTS)
    p.add_argument('--models', nargs='+', default=OURS, choices=OURS,
                   help='ours to check (speed: with their references, DeiT-T for vit3_t, Swin-T for the others)')
    p.add_argument('--parity-size', type=_size, default=(224, 320), help='H or HxW (parity, sync)')
    p.add_argument('--amp-size', type=_size, default=(512, 512), help='H or HxW')
    p.add_argument('--headline', nargs='*', type=_spec, default=['1248/b1', '2048/b1'],
                   help='HxW/bBATCH of ViT3-T against DeiT-T')
    p.add_argument('--detection', nargs='*', type=_spec, default=['800x1344/b2'],
                   help='HxW/bBATCH of the pyramids against Swin-T')
    p.add_argument('--precisions', nargs='+', default=['fp32', 'tf32', 'bf16'], choices=list(PRECISIONS))
    p.add_argument('--compiled', choices=['auto', 'on', 'off'], default='auto',
                   help='the compiled TTT path (H-ViT3-T with_cp, compiled on its declared devices and on every '
                        'device) in the amp and speed parts; off: H-ViT3-T and ViT3-T built with fast_compile=False '
                        '(on a CPU as on a GPU, where the path is not declared); auto: on CUDA only')
    p.add_argument('--warmup', type=int, default=2)
    p.add_argument('--iters', type=int, default=5)
    p.add_argument('--authors-code', nargs='+', type=authors_mod.family_path, default=[], metavar='FAMILY=PATH')
    p.add_argument('--budget', type=float, default=510., help='seconds for all parts together')
    p.add_argument('--preflight-s', type=float, default=30., help='time limit of preflight (seconds)')
    p.add_argument('--tiny', action='store_true', help='narrow models (a rehearsal of this script)')
    p.add_argument('--out-dir', default='work_dirs/device_check')
    p.add_argument('--plant-fault', choices=OURS + ['swin_t_timm', 'deit_t_timm'], help=argparse.SUPPRESS)
    p.add_argument('--plant-hang', metavar='PART:JOB', help=argparse.SUPPRESS)
    p.add_argument('--child', nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device != 'cpu' and not args.device.startswith('cuda'):
        p.error(f'--device {args.device!r}: allowed cuda, cuda:N, cpu')
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        p.error('--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); '
                'use --device cpu for a rehearsal')
    if args.budget <= 0 or args.preflight_s <= 0:
        p.error(f'--budget and --preflight-s: expected positive seconds, got {args.budget:g}, {args.preflight_s:g}')
    if args.iters < 1 or args.warmup < 0:
        p.error(f'--iters must be >= 1 and --warmup >= 0, got {args.iters}, {args.warmup}')
    args.authors_code = authors_mod.checked_roots(args.authors_code, p.error)
    args.compiled = args.compiled == 'on' or (args.compiled == 'auto' and args.device.startswith('cuda'))
    return args


def _write(path, text):
    with open(path + '.tmp', 'w') as f:
        f.write(text)
    os.replace(path + '.tmp', path)  # a reader (or a kill) never sees half a file


def speed_results(res):
    """{precision: results in the benchmark's format} of the speed part's samples so far."""
    rows = res['parts'].get('speed', {}).get('rows', {})
    out = {}
    for prec in res['args']['precisions']:
        samples = [dict(s) for r in rows.values() for s in r.get('samples', []) if s.get('precision') == prec]
        out[prec] = dict(format=bm.FORMAT, smoke=res['args']['tiny'], env=res.get('bench_env', {}),
                         config=dict(rounds=1, warmup=res['args']['warmup'], iters=res['args']['iters'],
                                     precision=prec, command='tools/analysis/device_check.sh'),
                         samples=samples)
        if res['args']['tiny']:
            out[prec]['note'] = 'device_check.py --tiny: narrow widths, a rehearsal; figures mean nothing.'
    return out


def write_results(res, out_dir, t0):
    """device_check.json, device_check.md and speed_<precision>.json, each rewritten whole."""
    res['wall_s'] = time.perf_counter() - t0
    _write(osp.join(out_dir, 'device_check.json'), json.dumps(res, indent=1))
    _write(osp.join(out_dir, 'device_check.md'), markdown(res))
    if 'speed' in res['parts']:
        for prec, r in speed_results(res).items():
            _write(osp.join(out_dir, f'speed_{prec}.json'), json.dumps(r, indent=1))


def job_limit(left, part_left, jobs_left):
    """Seconds one model may run: up to twice its even share of what its part has left, at least MIN_JOB_S, at
    most what the budget has left."""
    return min(left, max(MIN_JOB_S, min(part_left, 2 * part_left / jobs_left)))


def run_part(part, jobs, res, args, argv, t0):
    """Run the part's jobs one process each until res['parts'][part]['planned_end_s'], each row written as it
    comes; after SIGTERM, or with less than MIN_JOB_S of the budget left, the rest are recorded as not run."""
    entry = res['parts'][part]
    for i, job in enumerate(jobs):
        now = time.perf_counter() - t0
        left = args.budget - now
        if _STATE['stopped'] or left < MIN_JOB_S:
            entry['rows'][job] = dict(error='not run: ' + (_STATE['stopped'] or f'{left:.0f} s of the budget left'))
            continue
        limit = job_limit(left, entry['planned_end_s'] - now, len(jobs) - i)
        print(f'[device_check] {part} {job} (limit {limit:.0f} s) ...', flush=True)
        tj = time.perf_counter()
        printed, failure = run_job(argv, part, job, limit)
        row = entry['rows'][job] = job_row(part, job, printed, failure, args.out_dir)
        row['wall_s'] = time.perf_counter() - tj
        if part == 'preflight':
            res['env'], res['bench_env'] = row.get('env', {}), row.get('bench_env', {})
        print(f'[device_check] {part} {job}: {"FAILED " + row["error"] if "error" in row else "done"} in '
              f'{row["wall_s"]:.0f} s', flush=True)
        write_results(res, args.out_dir, t0)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        if args.plant_hang == ':'.join(args.child):
            time.sleep(3600)
        return CHILDREN[args.child[0]](args, args.child[1])
    signal.signal(signal.SIGTERM, _on_sigterm)
    os.makedirs(args.out_dir, exist_ok=True)
    res = dict(args=dict(device=args.device, parts=args.parts, models=args.models, headline=args.headline,
                         detection=args.detection, precisions=args.precisions,
                         parity_size=list(args.parity_size), amp_size=list(args.amp_size), warmup=args.warmup,
                         iters=args.iters, authors_code=args.authors_code, tiny=args.tiny, budget_s=args.budget,
                         compiled=args.compiled),
               env={}, parts={}, complete=False)
    t0 = time.perf_counter()
    parts = ['preflight'] + [p for p in PARTS if p in args.parts and p != 'preflight']
    rest = max(0., args.budget - args.preflight_s)
    planned_end = min(args.preflight_s, args.budget)
    for part in parts:
        # each part may run until its planned end (its share after the earlier parts' shares): time an earlier
        # part left unused carries over, an overrun is taken from the later parts
        if part != 'preflight':
            planned_end += rest * SHARES[part] / sum(SHARES[p] for p in parts[1:])
        entry = res['parts'][part] = dict(rows={}, planned_end_s=planned_end)
        t_part = time.perf_counter()
        forward = res['parts']['preflight']['rows'].get('all', {}).get('forward', {})
        if part == 'sync' and not args.device.startswith('cuda'):
            entry['skipped'] = ('torch.cuda.set_sync_debug_mode needs CUDA (tests/test_device_check.py runs the '
                                'meta-device check on CPU)')
        else:
            run_part(part, part_jobs(part, args, forward), res, args, argv, t0)
        entry['wall_s'] = time.perf_counter() - t_part
        write_results(res, args.out_dir, t0)
    res['complete'] = not _STATE['stopped']
    write_results(res, args.out_dir, t0)
    print(markdown(res))
    print(f'wrote {args.out_dir}/device_check.json, device_check.md, speed_*.json')
    return res


# ---- the report ---------------------------------------------------------------------------------------------

def _fmt_list(v, fmt='.1e'):
    return ' '.join(format(x, fmt) for x in v)


def _failed(v):
    link = f' ([full text]({v["error_file"]}))' if v.get('error_file') else ''
    return f'failed: {str(v["error"]).replace("|", "/")}{link}'


def md_header(res):
    env, a = res.get('env', {}), res['args']
    return [f'# Device check: {env.get("device_name", "?")} ({a["device"]})', '',
            f'Python {env.get("python")}, torch {env.get("torch")}, CUDA {env.get("cuda")}, cuDNN {env.get("cudnn")}, '
            f'mmengine {env.get("mmengine")}, mmcv {env.get("mmcv")} (ops: {env.get("mmcv_ops")}), timm '
            f'{env.get("timm")}, mmdet {env.get("mmdet")}, mmpretrain {env.get("mmpretrain")}; TF32 defaults: '
            f'matmul {env.get("tf32_matmul")}, cuDNN {env.get("tf32_cudnn")}; our backbones import '
            f'{", ".join(env.get("backbones_import", [])) or "none"} of {", ".join(HEAVY)}. Budget '
            f'{a["budget_s"]:.0f} s' + (', --tiny (narrow widths: a rehearsal)' if a['tiny'] else '') + '.', '']


def md_preflight(rows):
    r = rows.get('all', {})
    lines = ['| backbone | one tiny forward |', '|---|---|']
    for n, v in r.get('forward', {}).items():
        lines.append(f'| {label(n)} | {"ok" if v is True else _failed(v) if isinstance(v, dict) else v} |')
    return lines


def md_parity(rows):
    lines = [f'| model | eval: rel. max error per stage, fp32 vs fp64 (within {PARITY_TOL:g}) | TF32 on | '
             'grads, CPU fp32 (the model\'s conditioning): max rel. max error (param), rel. L2 | '
             + ' | '.join(f'grads, {p} path (fast_train={c["fast_train"]}): max rel. max error (param), '
                          f'rel. L2, loss (within {GRAD_FACTOR:g}x CPU fp32 or {GRAD_TOL:g})'
                          for p, c in PATHS.items()) + ' |', '|---|---|---|---|---|---|']
    for n, v in rows.items():
        cells = []
        e = v.get('eval')
        cells += [f'{_fmt_list(e["fp32"])} ({e["ok"]})', _fmt_list(e['tf32']) if 'tf32' in e else '–'] if e \
            else ['–', '–']
        g = v.get('grad_cpu_fp32')
        cells.append(f'{g["max_rel_max"]:.1e} (`{g["worst"]}`), {g["rel_l2"]:.1e}' if g else '–')
        for p in PATHS:
            g = v.get(f'grad_{p}')
            cells.append(f'{g["max_rel_max"]:.1e} (`{g["worst"]}`), {g["rel_l2"]:.1e}, {g["loss"]:.1e} '
                         f'({g["ok"]})' if g else '–')
        if 'error' in v:  # in the first cell the failure left empty
            i = cells.index('–') if '–' in cells else len(cells) - 1
            cells[i] = _failed(v) if cells[i] == '–' else f'{cells[i]}; {_failed(v)}'
        lines.append(f'| {n} | ' + ' | '.join(cells) + ' |')
    return lines


def md_amp(rows):
    lines = ['| model | ' + ' | '.join(f'{p}: loss / grads / params after the step finite, grad rel. L2 and max '
                                       f'rel. max (param) vs fp32' for p in AMP) + ' |', '|---|---|---|']
    for n, v in rows.items():
        cells = []
        for p in AMP:
            a = v.get(p)
            if a is None:
                cells.append(_failed(v) if 'error' in v else '–')
            elif 'error' in a:
                cells.append(_failed(a))
            else:
                cell = f'{a["loss_finite"]} / {a["grads_finite"]} / {a["params_finite"]}'
                if 'rel_l2' in a:
                    cell += f', {a["rel_l2"]:.1e}, {a["max_rel_max"]:.1e} (`{a["worst"]}`)'
                if 'scale' in a:
                    cell += f'; loss scale {a["scale"]:g} after {a["skipped_steps"]} skipped steps'

                cells.append(cell)
        lines.append(f'| {n} | ' + ' | '.join(cells) + ' |')
    return lines


def md_sync(rows):
    modes = ('train', 'train+with_cp', 'eval')
    lines = ['| model | ' + ' | '.join(modes) + ' |', '|---|---|---|---|']
    for n, v in rows.items():
        cells = [(_failed(v[m]) if isinstance(v.get(m), dict) else v.get(m)) or (_failed(v) if 'error' in v else '–')
                 for m in modes]
        lines.append(f'| {n} | ' + ' | '.join(cells) + ' |')
    return lines


def md_speed(res):
    lines = []
    failed = {j: r for j, r in res['parts']['speed']['rows'].items() if 'error' in r}
    failed.update({f'{j} {s["precision"]} {s["kind"]}': s for j, r in res['parts']['speed']['rows'].items()
                   for s in r.get('samples', []) if 'error' in s})
    names = {'fp32': 'fp32 (TF32 off)', 'tf32': 'TF32 on', 'bf16': 'bf16 autocast', 'fp16': 'fp16 autocast'}
    for prec, r in speed_results(res).items():
        lines += [f'### Speed: {names[prec]} (`speed_{prec}.json`)', '']
        lines += (bm.render(r).replace('### ', '#### ').splitlines() if r['samples'] else ['no samples', ''])
    if failed:
        lines += ['Failed:', ''] + [f'* {j}: {_failed(v)}' for j, v in failed.items()]
    return lines


MD_ROWS = dict(preflight=md_preflight, parity=md_parity, amp=md_amp, sync=md_sync)


def markdown(res):
    """The whole report of a results dict (device_check.json) as Markdown."""
    lines = md_header(res)
    for part, entry in res['parts'].items():
        head = f'## {part} ({entry.get("wall_s", 0):.0f} s)'
        lines += [head, '']
        if 'skipped' in entry:
            lines += [f'skipped: {entry["skipped"]}', '']
            continue
        lines += md_speed(res) if part == 'speed' else MD_ROWS[part](entry['rows'])
        if part == 'preflight' and 'error' in entry['rows'].get('all', {}):
            lines += ['', _failed(entry['rows']['all'])]
        lines += ['']
    lines.append(f'Total {res.get("wall_s", 0):.0f} s' + ('' if res['complete'] else ' (not complete)') + '.')
    return '\n'.join(lines) + '\n'


if __name__ == '__main__':
    main()
