"""Training-step memory of a ResT backbone: dense attention vs EMSA in pieces of queries (ops/emsa).

    python tools/analysis/rest_attention_memory.py [--arch small] [--size 512 512] [--batch 1]
        [--max-elems dense 1048576 ...] [--threads 2]

Every setting runs in a fresh subprocess: build the backbone (train mode, drop path 0), run one forward and
backward pass on random input, and report
* peak RSS growth over the step: ru_maxrss after the step minus the RSS just before it;
* the bytes autograd keeps for backward, counted through saved-tensor hooks (each storage once,
  parameters excluded);
* the step time.
`--max-elems dense` is the dense path (`fast_train=False`, the authors' computation); a number N is the
memory policy `dict(max_elems=N)` (maps of more than 2N entries in chunks of N). Numbers are for CPU fp32.
"""
import argparse
import json
import os.path as osp
import subprocess
import sys


def child(args):
    import torch
    from mmplugin_l2 import ResT
    from mmplugin_l2.analysis.measure import PeakMemory, clock

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kw = dict(fast_train=False) if args.max_elems == 'dense' else dict(memory_policy=dict(max_elems=int(args.max_elems)))
    model = ResT(args.arch, drop_path_rate=0., **kw).train()
    x = torch.randn(args.batch, 3, *args.size)
    saved = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):  # activations only: each storage once, parameters excluded
        try:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                saved[ptr] = max(saved.get(ptr, 0), t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with PeakMemory('cpu') as mem:
        t0 = clock('cpu')
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outs = model(x)
        loss = sum(o.square().mean() for o in outs)
        saved_bytes = sum(saved.values())
        loss.backward()
        dt = clock('cpu') - t0
    growth = mem.mb * 2**20 if mem.mb is not None else float('nan')
    print(json.dumps(dict(max_elems=args.max_elems, peak_rss_growth=growth, saved_bytes=saved_bytes,
                          step_seconds=dt, loss=loss.item())))


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--arch', default='small')
    p.add_argument('--size', type=int, nargs=2, default=(512, 512), metavar=('H', 'W'))
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--max-elems', nargs='+', default=['dense', str(2 ** 20)])
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.max_elems = args.max_elems[0]
        return child(args)
    rows = []
    for ce in args.max_elems:
        cmd = [sys.executable, osp.abspath(__file__), '--child', '--arch', args.arch, '--size', *map(str, args.size),
               '--batch', str(args.batch), '--max-elems', ce, '--threads', str(args.threads)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(r.stderr)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    gib = 2 ** 30
    print(f'ResT-{args.arch}, {args.batch} x 3 x {args.size[0]} x {args.size[1]}, train step (forward + backward), '
          f'CPU fp32')
    print(f'{"max_elems":>18} {"peak RSS growth":>16} {"saved for backward":>19} {"step":>8} {"loss":>12}')
    for r in rows:
        print(f'{r["max_elems"]:>18} {r["peak_rss_growth"] / gib:>12.3f} GiB {r["saved_bytes"] / gib:>15.3f} GiB '
              f'{r["step_seconds"]:>7.2f}s {r["loss"]:>12.6f}')
    base = rows[0]
    for r in rows[1:]:
        ratio = {k: r[k] / base[k] for k in ('peak_rss_growth', 'saved_bytes', 'step_seconds')}
        print(f'{r["max_elems"]} vs {base["max_elems"]}: peak RSS growth x{ratio["peak_rss_growth"]:.3f}, '
              f'saved x{ratio["saved_bytes"]:.3f}, time x{ratio["step_seconds"]:.2f}')


if __name__ == '__main__':
    main()
