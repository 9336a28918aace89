"""Numerical accuracy of a backbone off the fp32 path: float64 reference error, batch independence,
fp16 / bf16 autocast, half-precision weights and training gradients under autocast
(tools/analysis/precision.py).

Every figure is relative and per output stage:
* `rel_max(a, ref)` = max |a - ref| / max |ref| (fp32 against float64, batch of two against one at a time);
* `rel_l2(a, ref)` = ||a - ref||_2 / ||ref||_2 (low precision against fp32, as AMP users compare);
  non-finite outputs are reported as inf.
"""
import copy

import torch

from .measure import gradients, precision

#: check name -> what it compares
CHECKS = {
    'fp64': 'fp32 outputs vs the same model in float64 (rel. max abs)',
    'batch': 'a batch of two vs the two images one at a time, fp32 (rel. max abs)',
    'bf16': 'bf16 autocast vs fp32 (rel. L2)',
    'fp16': 'fp16 autocast vs fp32 (rel. L2)',
    'half': 'model.half() vs fp32 (rel. L2)',
    'bfloat16': 'model.bfloat16() vs fp32 (rel. L2)',
    'grad_bf16': 'one training step under bf16 autocast: parameter gradients vs fp32 (rel. L2, all params)',
    'grad_fp16': 'one training step under fp16 autocast: parameter gradients vs fp32 (rel. L2, all params)',
    'grad_fp64': 'one training step in fp32: parameter gradients vs the same model in float64 (rel. L2, all params)',
}
_LOW = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'half': torch.float16, 'bfloat16': torch.bfloat16}
#: autocast dtype -> precision name of mmplugin_l2.analysis.measure
_PREC = {torch.bfloat16: 'bf16', torch.float16: 'fp16'}


def rel_max(a, ref):
    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all():
        return float('inf')
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def rel_l2(a, ref):
    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all():
        return float('inf')
    return (torch.linalg.vector_norm(a - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300)).item()


@torch.no_grad()
def _forward(model, x):
    return [o.float() if o.dtype != torch.float64 else o for o in model(x)]


def fp64_error(model, x):
    ref = _forward(copy.deepcopy(model).double(), x.double())
    return [rel_max(a, r) for a, r in zip(_forward(model, x), ref)]


def batch_error(model, x):
    """x holds two or more images: the batch against each image alone."""
    full = _forward(model, x)
    single = [_forward(model, x[i:i + 1]) for i in range(x.shape[0])]
    return [rel_max(f, torch.cat([s[j] for s in single])) for j, f in enumerate(full)]


def autocast_error(model, x, dtype, ref=None):
    ref = ref if ref is not None else _forward(model, x)
    with precision(_PREC[dtype], x.device):
        out = _forward(model, x)
    return [rel_l2(a, r) for a, r in zip(out, ref)]


def cast_error(model, x, dtype, ref=None):
    ref = ref if ref is not None else _forward(model, x)
    low = copy.deepcopy(model).to(dtype)
    return [rel_l2(a, r) for a, r in zip(_forward(low, x.to(dtype)), ref)]


def grad_error(model, x, dtype):
    """rel. L2 of the flattened gradient of all parameters after one train-mode step on
    sum_i mean(out_i^2) under `dtype` autocast, against fp32; for dtype float64: fp32 against the same
    model in float64 (the training path's conditioning; custom backward functions included). inf if any
    gradient is not finite."""
    model = copy.deepcopy(model)
    if dtype == torch.float64:
        ref = gradients(copy.deepcopy(model).double(), x.double())[1]
        low = gradients(model, x)[1]
    else:
        ref = gradients(model, x)[1]
        low = gradients(model, x, _PREC[dtype])[1]
    return [grads_error(low, ref)['rel_l2']]


def grads_error(grads, ref, floor=1e-3):
    """How far the parameter gradients `grads` are from `ref` ({name: tensor} each, same names): `rel_l2` of
    all of them flattened together; per parameter max |g - ref| / max(max |ref|, floor * the largest |ref| of
    all parameters), its largest (`max_rel_max`) and that parameter's name (`worst`). The floor keeps
    gradients that are zero in exact arithmetic (a bias before a normalisation) from dividing rounding by
    rounding."""
    if set(ref) != set(grads):
        raise RuntimeError(f'gradients of {sorted(set(ref) ^ set(grads))} exist only in one precision')
    a = torch.cat([grads[n].flatten() for n in ref]).double()
    r = torch.cat([ref[n].flatten() for n in ref]).double()
    if not torch.isfinite(a).all():
        return dict(rel_l2=float('inf'), max_rel_max=float('inf'), worst=None)
    top = r.abs().max().item() if r.numel() else 0.
    per = {n: ((grads[n].double() - ref[n].double()).abs().max().item()
               / max(ref[n].abs().max().item(), floor * top, 1e-300)) if ref[n].numel() else 0. for n in ref}
    worst = max(per, key=per.get) if per else None
    return dict(rel_l2=rel_l2(a, r), max_rel_max=per[worst] if per else 0., worst=worst)


def run_checks(model, x, checks):
    """{check: [per-stage figure]} for an eval-mode `model` (fp32) and a batch `x` (fp32, B >= 2 for
    'batch'; the other checks use its first image)."""
    model.eval()
    one = x[:1]
    res, ref = {}, None
    for c in checks:
        if c not in CHECKS:
            raise KeyError(f'unknown check {c!r}; choose from {sorted(CHECKS)}')
        if c == 'fp64':
            res[c] = fp64_error(model, one)
        elif c == 'batch':
            if x.shape[0] < 2:
                raise ValueError('the batch check needs a batch of at least two images')
            res[c] = batch_error(model, x[:2])
        elif c == 'grad_fp64':
            # two images: torch's CPU BatchNorm backward is wrong at batch 1 for some layouts (see
            # `layers.conv.BatchNorm2d`), which the authors' models hit
            res[c] = grad_error(model, x[:2], torch.float64)
        elif c.startswith('grad_'):
            res[c] = grad_error(model, one, _LOW[c[5:]])
        else:
            ref = ref if ref is not None else _forward(model, one)
            fn = autocast_error if c in ('bf16', 'fp16') else cast_error
            res[c] = fn(model, one, _LOW[c], ref)
    return res
