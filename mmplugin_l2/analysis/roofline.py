"""Roofline of a backbone on this machine (tools/analysis/roofline.py): multiply-adds (the count of
flops.py / get_flops.py) against measured time, as achieved GMAC/s next to the machine's measured peak (a
large matmul on the same threads, in fp32 and in bf16: `peak_matmul`) and memory bandwidth (a large copy), for
the whole model (inference, training) and per layer (inference), in a precision of measure.PRECISIONS (a bf16
autocast model against the bf16 peak).

A *layer* is a direct child of a block (a module whose class name ends in `Block`: attention, MLP, CPE,
norms) or a module outside the blocks that holds parameters (stem, downsamplings, output norms); per layer:
multiply-adds (mmengine's FlopAnalyzer by module), wall time of its forward calls (forward hooks, one no-grad
forward after a warm-up one) and bytes touched, estimated as its inputs + outputs + parameters (so the
arithmetic intensity MAC / byte is a lower bound of what the cache sees; a layer that keeps its
intermediates in cache does better). Time outside the layers (residual adds, reshapes) is `other`.
"""
import re
import statistics

import torch
import torch.nn as nn

from .measure import PRECISIONS, clock, precision, time_calls, train_steps


def peak_matmul(n=2048, iters=5, device='cpu', prec='fp32', call_s=0.5):
    """Best of `iters` (m x m) @ (m x m) products after a warm-up in precision `prec` (measure.PRECISIONS: the
    operands in fp32, or in bf16 / fp16 for those autocasts, so no cast is timed; 'tf32' with TF32 on):
    multiply-adds per second. The size m starts at min(n, 256) and doubles while the doubled size is at most n and
    its product would take at most about `call_s` seconds (8x the last one's time, after a warm-up at each size):
    2048 on a GPU or a CPU with bf16 / fp16 units, smaller where a product runs torch's scalar fallback (bf16 / fp16
    on a CPU without them: hundreds of times slower than fp32), so that the measurement takes seconds everywhere.
    A product of `call_s` seconds runs at its peak rate already."""
    if prec not in PRECISIONS:
        raise ValueError(f'precision {prec!r}; allowed: {", ".join(PRECISIONS)}')
    dtype = PRECISIONS[prec][0] or torch.float32
    m = min(n, 256)
    with precision(prec, device):
        while True:
            a, b = (torch.randn(m, m, device=device).to(dtype) for _ in range(2))
            seconds = time_calls(lambda: a @ b, a.device, 1, 1)[0] / 1e3
            if 2 * m > n or 8 * seconds > call_s:
                break
            m *= 2
        return m ** 3 / (min(time_calls(lambda: a @ b, a.device, 0, iters)) / 1e3)


def peak_bandwidth(mbytes=256, iters=5, device='cpu'):
    """Best of `iters` copies of an fp32 tensor of `mbytes` MB into another after one warm-up: bytes read +
    written per second."""
    src = torch.randn(mbytes * 2**18, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (min(time_calls(lambda: dst.copy_(src), src.device, 1, iters)) / 1e3)


def _is_block(m):
    return type(m).__name__.endswith('Block')


def layers(model):
    """[(name, module)]: the layers of `model` (see the module docstring), disjoint."""
    out = []

    def add(name, m):  # containers that are never called themselves: their children are the layers
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            for k, c in m.named_children():
                add(f'{name}.{k}', c)
        elif not isinstance(m, (nn.Identity, nn.Dropout)):
            out.append((name, m))

    def walk(prefix, m):
        for n, c in m.named_children():
            name = prefix + n
            if _is_block(c):
                for k, g in c.named_children():
                    add(f'{name}.{k}', g)
            elif any(_is_block(d) for d in c.modules()):
                walk(name + '.', c)
            elif any(True for _ in c.parameters()):
                add(name, c)
    walk('', model)
    return out


def tensor_bytes(obj):
    """Bytes of the tensors in `obj` (a tensor, or tuples, lists and dicts of them), as they are stored."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def layer_group(name, module):
    """'stage N / ClassName' of a layer (N: the first index in its name), 'stem / ...' before any index."""
    m = re.search(r'\d+', name)
    return f'{"stage " + str(int(m.group()) + 1) if m else "-"} / {type(module).__name__}'


@torch.no_grad()
def profile_layers(model, x, prec='fp32'):
    """Per layer group: MACs, seconds, bytes, calls; plus the forward's total seconds (one forward after a
    warm-up forward, eval mode, in precision `prec` of measure.PRECISIONS: bytes are those of the tensors as
    they are, bf16 under bf16 autocast)."""
    model.eval()
    named = layers(model)
    flops, by_module = module_macs(model, x)
    stats, hooks = {}, []
    active = [0]   # timed modules running now: one called inside another (a pre-norm passed as `norm=` and
    # run inside the attention's pieces) is timed as part of the outer one, not twice
    for name, mod in named:
        g = layer_group(name, mod)
        s = stats.setdefault(g, dict(macs=0, seconds=0., bytes=0, calls=0, modules=0))
        s['macs'] += by_module.get(name, 0)
        s['modules'] += 1
        pbytes = sum(p.numel() * p.element_size() for p in mod.parameters())

        def pre(m, args, g=g):
            m._rl_nested = active[0] > 0
            active[0] += 1
            m._rl_t = clock(x.device)

        def post(m, args, out, g=g, pbytes=pbytes):
            active[0] -= 1
            st = stats[g]
            if not m._rl_nested:
                st['seconds'] += clock(x.device) - m._rl_t
            st['bytes'] += tensor_bytes(args) + tensor_bytes(out) + pbytes
            st['calls'] += 1
        hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        with precision(prec, x.device):
            model(x)  # warm-up, with hooks (the same work)
            for s in stats.values():
                s.update(seconds=0., bytes=0, calls=0)
            t = clock(x.device)
            model(x)
            total = clock(x.device) - t
    finally:
        for h in hooks:
            h.remove()
    in_layers = sum(s['seconds'] for s in stats.values())
    stats['other'] = dict(macs=flops - sum(s['macs'] for s in stats.values()), seconds=max(0., total - in_layers),
                          bytes=0, calls=0, modules=0)
    return dict(macs=flops, seconds=total, layers=stats)


def module_macs(model, x):
    """(total multiply-adds, {module name: multiply-adds, descendants included}) of one forward of `model` on `x`,
    one trace in eval mode without autograd (the paths a tracer counts); the model's mode is restored."""
    from .flops import flops_by_module

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return flops_by_module(model, (x,))
    finally:
        model.train(was_training)


def train_step_seconds(model, x, warmup=1, iters=1, prec='fp32'):
    """Median training-step time (mmplugin_l2.analysis.measure.train_steps) in precision `prec`."""
    steps, _ = train_steps(model, x, warmup, iters, memory=False, prec=prec)
    return statistics.median(s['total_ms'] for s in steps) / 1e3


def plot(summary, path):
    """Whole-backbone GMAC/s against every measured matmul peak (`peaks_gmacs`), and the layers on the roofline
    of the summary's precision (`peak_gmacs`: the peak of that precision)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    peak, bw = summary['peak_gmacs'], summary['bandwidth_gbs']
    prec = summary.get('precision', 'fp32')
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw=dict(width_ratios=[1, 1.6]))
    names = list(summary['models'])
    xs = range(len(names))
    inf = [summary['models'][n]['inference_gmacs'] for n in names]
    tr = [summary['models'][n].get('train_gmacs') or 0 for n in names]
    ax0.bar([i - .2 for i in xs], inf, .4, label='inference')
    ax0.bar([i + .2 for i in xs], tr, .4, label='training (3 x forward MACs / step)')
    for (name, value), ls in zip((summary.get('peaks_gmacs') or {prec: peak}).items(), ('--', ':', '-.', '-')):
        ax0.axhline(value, color='k', ls=ls, lw=1, label=f'{name} matmul peak {value:.0f}')
    ax0.set_xticks(list(xs), names)
    ax0.set_ylabel('GMAC/s')
    ax0.set_title('whole backbone')
    ax0.legend(fontsize=8)
    cycle = plt.rcParams['axes.prop_cycle'].by_key()['color']
    lo, hi = 0.3, 1e3
    for i, n in enumerate(names):
        labelled = False
        for g, s in summary['models'][n]['layers'].items():
            if g == 'other' or not s['seconds'] or not s['macs'] or not s['bytes']:
                continue
            ai, perf = s['macs'] / s['bytes'], s['macs'] / s['seconds'] / 1e9
            lo, hi = min(lo, ai), max(hi, ai)
            ax1.scatter(ai, perf, s=12 + 400 * s['seconds'] / summary['models'][n]['inference_s'],
                        color=cycle[i % len(cycle)], alpha=.6, label=None if labelled else n)
            labelled = True
    xx = [lo / 2, hi * 2]
    ax1.plot([lo / 2, peak / bw, hi * 2], [bw * lo / 2, peak, peak], 'k--', lw=1,
             label=f'roof: {bw:.0f} GB/s copy, {peak:.0f} GMAC/s {prec} matmul')
    ax1.set_xlim(*xx)
    ax1.set_xscale('log')
    ax1.set_yscale('log')
    ax1.set_xlabel('MAC per byte (layer inputs + outputs + weights)')
    ax1.set_ylabel('achieved GMAC/s')
    ax1.set_title(f'layers ({prec} inference; marker area ~ share of the forward time)')
    ax1.grid(True, which='both', alpha=.3)
    ax1.legend(fontsize=8)
    fig.suptitle(summary['title'], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
