"""Where one backbone's step goes per op, in one precision: time in forward and backward, the implementation
ops.dispatch.choose picked (reference / inference / train / checkpoint, and the piece), and the dtypes the
matrix products, convolutions and attention kernels actually ran in. Prints a markdown table.

    python tools/analysis/profile_ops.py [--model hvit3_t] [--size 800x1344] [--batch 1]
        [--precision fp32|tf32|bf16|fp16] [--kind train|infer] [--by group|module] [--warmup 1]
        [--device cpu|cuda] [--tiny] [--bounds] [--allocator glibc|caching|live|jemalloc|tcmalloc]
        [--cfg-options KEY=VALUE ...] [--authors-code FAMILY=PATH ...] [--out profile.json]

`train`: one training step (forward under the precision's autocast, backward of the summed output means; no
optimizer step), `infer`: one no-grad forward in eval mode; each after --warmup plain steps and one timed plain
step (the head line's figures). Rows: one per op (the innermost module that called choose, else a layer of the
roofline's, else `other`), per stage and class (`--by group`) or per module (`--by module`), by time. What each
column counts: mmplugin_l2/analysis/opprofile.py. --bounds adds each op's least bytes (what its forward and
backward must read and write at least), its bound (those bytes at this machine's copy bandwidth, or its
multiply-adds at the matmul peak, whichever is longer) and the measured time over the bound. A training profile
says per op how much it keeps for backward (`kept MB`: the tensors autograd saves in the forward, each storage
once). `--model <ours>@authors --authors-code FAMILY=PATH` profiles the authors' implementation from their checkout
(its rows are its layers; no `choose` there). --allocator runs
the profile in a fresh process under that allocator (benchmark.py's: `caching` keeps freed memory as a GPU's
caching allocator does, so large outputs do not page-fault); without it, in this process, under the allocator it
was started with (the head line and the JSON say which). Whole-model step times across models: benchmark.py.
"""
import argparse
import json
import subprocess
import sys

import torch

from mmplugin_l2.analysis import authors, opprofile
from mmplugin_l2.analysis.benchmark import (nested, option_arg, running_allocator, runs_under, size_arg,
                                             variant_title)
from mmplugin_l2.analysis.measure import ALLOCATORS, PRECISIONS, allocator_env
from mmplugin_l2.analysis.models import MODELS, authors_base, build, checked_names, is_detector


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog='profile_ops.py', description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split('\n\n', 2)[2])
    p.add_argument('--model', default='hvit3_t', metavar='MODEL',
                   help=f'one of {", ".join(MODELS)}, or <ours>@authors with --authors-code (default hvit3_t)')
    p.add_argument('--size', type=size_arg, default=(800, 1344), help='H or HxW (default 800x1344)')
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--precision', choices=list(PRECISIONS), default='fp32',
                   help='fp32 (TF32 off), tf32, bf16 / fp16 (autocast)')
    p.add_argument('--kind', choices=opprofile.KINDS, default='train')
    p.add_argument('--by', choices=('group', 'module'), default='group')
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--device', default='cpu')
    p.add_argument('--tiny', action='store_true', help='narrow widths (a smoke test)')
    p.add_argument('--bounds', action='store_true',
                   help='per op, the least bytes it must move and its bound on this machine (copy bandwidth, '
                        'matmul peak), and the measured time over it')
    p.add_argument('--cfg-options', nargs='+', type=option_arg, default=[], metavar='KEY=VALUE',
                   help='overrides of our backbones\' arguments, dotted keys nest (e.g. fast_train=False)')
    p.add_argument('--allocator', choices=list(ALLOCATORS),
                   help='profile in a fresh process under this allocator (default: this process, as started)')
    p.add_argument('--authors-code', nargs='+', type=authors.family_path, default=[], metavar='FAMILY=PATH',
                   help='the authors\' checkout of a family, for MODEL@authors')
    p.add_argument('--out', help='JSON file of the profile')
    args = p.parse_args(argv)
    args.authors_roots = checked_names([args.model], args.authors_code, p.error)
    if args.tiny and authors_base(args.model) is not None:
        p.error(f'--tiny: the authors\' code has no narrow widths ({args.model}); profile it at full width')
    if is_detector(args.model):
        p.error(f'--model {args.model}: a whole detector; profile_ops.py profiles backbones '
                f'(tools/analysis/profile_iteration.py splits a detector\'s iteration)')
    if args.batch < 1 or args.warmup < 0:
        p.error('--batch must be >= 1 and --warmup >= 0')
    if args.device != 'cpu' and not args.device.startswith('cuda'):
        p.error(f'--device {args.device!r}: allowed cpu, cuda, cuda:N')
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.allocator is not None and not runs_under(args.allocator):
        try:
            env = allocator_env(args.allocator)
        except ValueError as e:  # a preloaded allocator that is not installed
            sys.exit(f'profile_ops.py: {e}')
        argv = sys.argv[1:] if argv is None else list(argv)
        code = subprocess.run([sys.executable, __file__, *argv], env=env).returncode
        if code:
            sys.exit(code)
        if args.out:
            with open(args.out) as f:
                return json.load(f)
        return None
    alloc = args.allocator or running_allocator()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    try:
        model = build(args.model, nested(dict(args.cfg_options)) or None, size=args.size,
                      authors_roots=args.authors_roots, tiny=args.tiny).to(dev)
    except ValueError as e:  # a size the authors' code does not take
        sys.exit(f'profile_ops.py: {e}')
    x = torch.randn(args.batch, 3, *args.size, device=dev)
    res = opprofile.profile_ops(model, x, args.kind, args.precision, args.warmup, args.by, bounds=args.bounds)
    res.update(model=args.model, size=list(args.size), batch=args.batch, device=args.device,
               threads=torch.get_num_threads(), tiny=args.tiny, torch=torch.__version__, allocator=alloc)
    print(f'{args.model}{" (tiny)" if args.tiny else ""} {args.size[0]}x{args.size[1]}, batch {args.batch}, '
          f'{args.kind}, {variant_title(args.precision, alloc)}, {args.device} ({torch.get_num_threads()} threads), '
          f'torch {torch.__version__}')
    print()
    print(opprofile.table(res), end='')
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(res, f, indent=1)
        print(f'\nwrote {args.out}')
    return res


if __name__ == '__main__':
    main()
