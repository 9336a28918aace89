"""Where one training iteration of a config goes: data loading, data preprocessing, the forward of each part
of the model (backbone, neck, heads, losses), the backward split at the backbone's outputs, the optimizer
step. Runs the real mmengine Runner built from the config (its dataloader, model, optimizer wrapper).

The iteration is the one `BaseModel.train_step` runs, taken apart so each piece can be timed:
`data_preprocessor(batch, True)` -> `_run_forward(data, mode='loss')` -> `parse_losses` ->
`optim_wrapper.backward` -> `step` -> `zero_grad`. Forward times of the parts come from wrappers around the
parts' entry points (`PARTS`); what the forward spends outside them is `forward, other` (loss bookkeeping,
the detector's glue). The backward is split exactly at the backbone's outputs: the rest of the model runs on
detached copies of them, `backward, heads + neck` is the loss's backward down to those copies, and
`backward, backbone` the backward of the backbone from the gradients they received. The same gradients as
one backward pass, in two calls.
"""
from contextlib import contextmanager

import torch

from .measure import clock, stats

#: (attribute path, method) wrapped and timed per model; absent ones are skipped
PARTS = (
    ('backbone', 'forward'),
    ('neck', 'forward'),
    ('rpn_head', 'loss_and_predict'),   # mmdet two-stage: RPN forward, its loss and the proposals
    ('roi_head', 'loss'),               # mmdet two-stage: RoI sampling, bbox and mask heads with their losses
    ('bbox_head', 'loss'),              # mmdet single-stage (RetinaNet)
    ('decode_head', 'loss'),            # mmseg
    ('auxiliary_head', 'loss'),
    ('head', 'loss'),                   # mmpretrain
)


@contextmanager
def _timed_parts(model, times):
    """Wrap the entry point of each part in PARTS present in `model`; add their wall time to `times`.
    With autograd on, the backbone wrapper returns its outputs cut from the graph (`_cut`, pairs kept in
    times['_backbone_outputs']), where `iteration` splits the backward."""
    saved = []
    dev = _device(model)
    for path, method in PARTS:
        part = getattr(model, path, None)
        if part is None or not hasattr(part, method):
            continue
        fn = getattr(part, method)

        def wrapper(*args, _fn=fn, _key=f'forward, {path}', _backbone=path == 'backbone', **kwargs):
            t0 = clock(dev)
            out = _fn(*args, **kwargs)
            times[_key] = times.get(_key, 0.) + clock(dev) - t0
            if _backbone and torch.is_grad_enabled():
                out = _cut(out, times.setdefault('_backbone_outputs', []))
            return out

        setattr(part, method, wrapper)
        saved.append((part, method))
    try:
        yield
    finally:
        for part, method in saved:
            delattr(part, method)     # back to the class's method


def _device(model):
    return next(model.parameters()).device


def _cut(out, pairs):
    """The backbone's outputs as detached leaves that require grad (pairs (output, leaf) appended), same
    structure: the rest of the model's backward stops there."""
    is_seq = isinstance(out, (tuple, list))
    cut = []
    for t in (out if is_seq else [out]):
        if torch.is_tensor(t) and t.requires_grad:
            leaf = t.detach().requires_grad_()
            pairs.append((t, leaf))
            t = leaf
        cut.append(t)
    return type(out)(cut) if is_seq else cut[0]


def prepare(runner):
    """What `Runner.train()` builds before its first iteration: the train loop (and its dataloader), the
    optimizer wrapper, the initial weights. Returns (model, optim_wrapper, dataloader)."""
    loop = runner.train_loop
    runner.optim_wrapper = runner.build_optim_wrapper(runner.optim_wrapper)
    runner._init_model_weights()
    return runner.model, runner.optim_wrapper, loop.dataloader


def iteration(model, optim, batch):
    """One training iteration of `model` with the optimizer wrapper `optim` on `batch`, timed piece by
    piece: a dict of seconds."""
    times = {}
    dev = _device(model)
    t0 = clock(dev)
    with optim.optim_context(model), _timed_parts(model, times):
        data = model.data_preprocessor(batch, True)
        t1 = clock(dev)
        losses = model._run_forward(data, mode='loss')
    t2 = clock(dev)
    loss, _ = model.parse_losses(losses)
    t3 = clock(dev)
    optim.backward(loss)
    t_cut = clock(dev)
    pairs = [(t, leaf.grad) for t, leaf in times.get('_backbone_outputs', []) if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    t4 = clock(dev)
    optim.step()
    optim.zero_grad()
    t5 = clock(dev)
    out = {'data preprocessor': t1 - t0}
    parts = {k: v for k, v in times.items() if k.startswith('forward, ')}
    out.update(parts)
    out['forward, other'] = (t2 - t1) - sum(parts.values()) + (t3 - t2)
    if pairs:
        out['backward, heads + neck'] = t_cut - t3
        out['backward, backbone'] = t4 - t_cut
    else:
        out['backward'] = t4 - t3
    out['optimizer step'] = t5 - t4
    return out


def profile_iterations(model, optim, dataloader, iters, warmup=1):
    """`warmup` + `iters` iterations over `dataloader`; per piece the median and range of the timed
    iterations (seconds) and the share of the median total."""
    model.train()
    dev = _device(model)
    loader = iter(dataloader)
    rows = []
    for i in range(warmup + iters):
        t0 = clock(dev)
        try:
            batch = next(loader)
        except StopIteration:
            loader = iter(dataloader)
            batch = next(loader)
        data_s = clock(dev) - t0
        r = {'data loading': data_s, **iteration(model, optim, batch)}
        r['total'] = sum(r.values())
        if i >= warmup:
            rows.append(r)
    keys = list(rows[0])
    total = stats([r['total'] for r in rows])['median']
    out = []
    for k in keys:
        st = stats([r[k] for r in rows])
        out.append(dict(part=k, median_s=st['median'], min_s=st['min'], max_s=st['max'],
                        share=st['median'] / total if k != 'total' else 1.0))
    return out


def table(rows):
    lines = ['| part | median s | (min–max) | share of the iteration |', '|---|---|---|---|']
    for r in rows:
        lines.append(f"| {r['part']} | {r['median_s']:.3f} | ({r['min_s']:.3f}–{r['max_s']:.3f}) | "
                     f"{100 * r['share']:.0f} % |")
    return '\n'.join(lines)
