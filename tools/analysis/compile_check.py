"""torch.compile check: compile each backbone (default mode, `dynamic=True`), compare with eager and time both.

    python tools/analysis/compile_check.py [--models hvit3_t l2vit_t rest_s vit3_t ...] [--sizes 224x224 200x296]
        [--tiny] [--repeat 3] [--threads N]

    python tools/analysis/compile_check.py --train [--precision bf16] [--batch 1] [--with-cp] [--fast-train off]
        [--iters 3] --models hvit3_t --sizes 800x1344

For every model and size: the first compiled call (compile time; later sizes reuse the graph when the dynamic
shapes hold), the max relative difference of the compiled outputs to eager PyTorch, and the steady-state latency
of both (median of --repeat calls, after one warm-up) and their ratio. While compiling, the layers take their
export-mode paths (mmplugin_l2/models/ops/export.py): the compiled graph is the whole-map formulation, eager
runs the inference fast paths; the two are the same function. `--tiny`: narrow widths (seconds instead of
minutes). Exits 1 if a relative difference exceeds --bound (default 1e-5). A check, not a default.

`--train`: training steps as mmengine's `compile=True` runs them (the forward and backward compiled; AdamW eager):
the first compiled step (the compile), then the steady-state step of the compiled model and of the eager one (median
of --iters steps after two warm-up steps each, `measure.train_steps`, in --precision), their ratio, and the peak
memory of each one's timed steps above what it held after its warm-up (`steady_memory`; on CPU the resident set:
run it under `MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`, the benchmark's `live` allocator, for the live
tensors' peak; its times are then not a benchmark). While
compiling, each op traces the fast training paths it declares traceable (`Supports.traced`); `--fast-train off`
builds the model with `fast_train=False`, so that every op traces its reference (the comparison for what the traced
paths add). `--backend` picks the torch.compile backend (default inductor; `aot_eager` traces without generating
code).
"""
import argparse
import statistics
import sys

import torch

from mmplugin_l2.analysis.measure import PRECISIONS, clock, train_steps, time_calls
from mmplugin_l2.analysis.precision import rel_max

TINY = {
    'HViT3': dict(embed_dims=[16, 32, 64, 64], depths=[1, 1, 2, 1], num_heads=[1, 1, 2, 2]),
    'ViT3': dict(embed_dims=32, num_layers=2, num_heads=2),
    'L2ViT': dict(embed_dims=[16, 32, 64, 64], depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 2]),
    'ResT': dict(embed_dims=[16, 32, 48, 64], depths=[1, 1, 2, 1], num_heads=[1, 2, 3, 4]),
}
FAMILIES = {'hvit3': 'HViT3', 'vit3': 'ViT3', 'l2vit': 'L2ViT', 'rest': 'ResT'}
ARCHS = {'t': 'tiny', 's': 'small', 'b': 'base', 'l': 'large', 'lite': 'lite'}


def build(name, tiny=False, **kw):
    """A backbone by name `<family>_<arch>` (hvit3_t, vit3_s, l2vit_b, rest_lite, ...), or its narrow
    version with `tiny`, in eval mode with randomised weights (norms and biases too)."""
    import mmplugin_l2
    from mmplugin_l2.analysis import authors
    family, _, arch = name.partition('_')
    if family not in FAMILIES or arch not in ARCHS:
        raise SystemExit(f'error: unknown model {name!r}: use <{"|".join(FAMILIES)}>_<{"|".join(ARCHS)}>')
    cls = getattr(mmplugin_l2, FAMILIES[family])
    torch.manual_seed(0)
    model = cls(arch=TINY[cls.__name__] if tiny else ARCHS[arch], drop_path_rate=0., **kw)
    return authors.randomize_(model, seed=1).eval()


def _outputs(y):
    return [y] if torch.is_tensor(y) else list(y)


def _time(fn, x, repeat):
    """Median seconds of `repeat` calls after one warm-up (mmplugin_l2.analysis.measure)."""
    return statistics.median(time_calls(lambda: fn(x), x.device, 1, repeat)) / 1e3


def check(model, sizes, repeat=3, timing=True):
    """[dict(size, first_call_s, rel_diff, eager_s, compiled_s)] for `torch.compile(model, dynamic=True)`."""
    compiled = torch.compile(model, dynamic=True)
    rows = []
    with torch.no_grad():
        for size in sizes:
            x = torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(size[0] * 7919 + size[1]))
            ref = _outputs(model(x))
            t = clock(x.device)
            got = _outputs(compiled(x))
            first = clock(x.device) - t
            if len(got) != len(ref) or any(g.shape != r.shape for g, r in zip(got, ref)):
                raise SystemExit(f'error: compiled outputs {[tuple(g.shape) for g in got]} != eager '
                                 f'{[tuple(r.shape) for r in ref]} at {size}')
            rel = max(rel_max(g, r) for g, r in zip(got, ref))
            row = dict(size=tuple(size), first_call_s=first, rel_diff=rel)
            if timing:
                row.update(eager_s=_time(model, x, repeat), compiled_s=_time(compiled, x, repeat))
            rows.append(row)
    return rows


def check_train(model, size, batch=1, prec='fp32', iters=3, backend='inductor'):
    """dict(size, first_step_s, compiled_ms, eager_ms, compiled_mb, eager_mb) for training steps of
    `torch.compile(model, dynamic=True, backend=backend)` and of `model` (see the module docstring); the eager
    steps run first, on a copy of the weights."""
    import copy
    eager = copy.deepcopy(model)
    x = torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(size[0] * 7919 + size[1]))
    eager_steps, eager_mb = train_steps(eager, x, 2, iters, prec=prec, steady_memory=True)
    del eager
    compiled = torch.compile(model, dynamic=True, backend=backend)
    t = clock(x.device)
    train_steps(compiled, x, 0, 1, memory=False, prec=prec)
    first = clock(x.device) - t
    steps, compiled_mb = train_steps(compiled, x, 2, iters, prec=prec, steady_memory=True)
    return dict(size=tuple(size), first_step_s=first,
                compiled_ms=statistics.median(s['total_ms'] for s in steps),
                eager_ms=statistics.median(s['total_ms'] for s in eager_steps), compiled_mb=compiled_mb,
                eager_mb=eager_mb)


def train_main(args):
    """`--train`: one row per model and size (the first size only: one compiled graph serves the others)."""
    print(f'torch {torch.__version__}, {torch.get_num_threads()} threads, training steps, {args.precision}, batch '
          f'{args.batch}, torch.compile(dynamic=True, backend={args.backend!r}), with_cp={args.with_cp}, '
          f'fast_train={args.fast_train == "on"}, {"tiny widths" if args.tiny else "real widths"}')
    for name in args.models:
        model = build(name, args.tiny, with_cp=args.with_cp, fast_train=args.fast_train == 'on')
        r = check_train(model, args.sizes[0], args.batch, args.precision, args.iters, args.backend)
        print(f'{name:10s} {r["size"][0]}x{r["size"][1]}: first compiled step {r["first_step_s"]:.1f} s, compiled '
              f'{r["compiled_ms"]:.0f} ms, eager {r["eager_ms"]:.0f} ms '
              f'(compiled x{r["eager_ms"] / r["compiled_ms"]:.2f}); '
              f'peak of the timed steps: compiled {_mb(r["compiled_mb"])}, eager {_mb(r["eager_mb"])}', flush=True)


def _mb(mb):
    return 'not measurable' if mb is None else f'{mb:.0f} MB'


def parse_size(text):
    try:
        h, w = (int(v) for v in text.lower().split('x'))
    except ValueError:
        raise argparse.ArgumentTypeError(f'size {text!r} is not HxW') from None
    return h, w


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--models', nargs='+', default=['hvit3_t', 'vit3_t', 'l2vit_t', 'rest_s'])
    p.add_argument('--sizes', nargs=2, type=parse_size, default=[(224, 224), (200, 296)], metavar='HxW')
    p.add_argument('--tiny', action='store_true', help='narrow widths')
    p.add_argument('--repeat', type=int, default=3)
    p.add_argument('--threads', type=int, default=None)
    p.add_argument('--bound', type=float, default=1e-5)
    p.add_argument('--train', action='store_true', help='time training steps, compiled and eager')
    p.add_argument('--precision', default='fp32', choices=sorted(PRECISIONS), help='--train: the precision')
    p.add_argument('--batch', type=int, default=1, help='--train: the batch')
    p.add_argument('--iters', type=int, default=3, help='--train: timed steps after two warm-up steps')
    p.add_argument('--with-cp', action='store_true', help='--train: build the models with with_cp=True')
    p.add_argument('--fast-train', choices=('on', 'off'), default='on',
                   help='--train: off builds the models with fast_train=False (the reference traced)')
    p.add_argument('--backend', default='inductor', help='--train: the torch.compile backend')
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.train:
        return train_main(args)
    worst = 0.
    print(f'torch {torch.__version__}, {torch.get_num_threads()} threads, torch.compile(dynamic=True), '
          f'{"tiny widths" if args.tiny else "real widths"}')
    for name in args.models:
        rows = check(build(name, args.tiny), args.sizes, args.repeat)
        for r in rows:
            worst = max(worst, r['rel_diff'])
            print(f'{name:10s} {r["size"][0]}x{r["size"][1]}: first compiled call {r["first_call_s"]:.1f} s, '
                  f'max rel diff {r["rel_diff"]:.1e}, eager {r["eager_s"] * 1e3:.1f} ms, compiled '
                  f'{r["compiled_s"] * 1e3:.1f} ms (x{r["eager_s"] / r["compiled_s"]:.2f})', flush=True)
    print(f'worst relative difference {worst:.1e} ({"OK" if worst <= args.bound else "FAILED"}, bound {args.bound:g})')
    if worst > args.bound:
        sys.exit(1)


if __name__ == '__main__':
    main()
