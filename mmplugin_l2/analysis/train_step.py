"""Training-step benchmark of one backbone: wall time of full training iterations (forward, backward of the
summed output means, AdamW step, zero_grad) after warm-up, split into forward / backward / optimizer, and the
step's peak memory; measured (fresh subprocess per measurement) by tools/analysis/benchmark.py (kind `train`).

Memory: on CUDA torch.cuda.max_memory_allocated() above what the model and input held before the first step;
on CPU the process's peak resident set (ru_maxrss) above its resident set before the first step. Both include
what a training step really holds: activations, gradients and AdamW's two moment buffers (`state_mb` is that
fixed part, 3 x 4 bytes per parameter in fp32).
"""
import resource
import time

import torch

from .benchmark import _rss_bytes, _sync

#: recompute / activation-checkpointing combinations measured per family (`--variants`): the key is the
#: model's name suffix in the results, the value its config overrides. `default` is the backbone's
#: defaults; H-ViT3's detection configs use `recompute+cp`.
VARIANTS = {
    'HViT3': {'default': {}, 'cp': dict(with_cp=True),
              'norecompute': dict(recompute=False), 'norecompute+cp': dict(recompute=False, with_cp=True)},
    'L2ViT': {'default': {}, 'cp': dict(with_cp=True),
              'norecompute': dict(recompute=False), 'norecompute+cp': dict(recompute=False, with_cp=True)},
    # ResT: its attention maps are chunked with recomputation in training (recompute=True, the memory policy)
    'ResT': {'default': {}, 'cp': dict(with_cp=True), 'dense': dict(recompute=False)},
}
#: names of the defaults of each family in VARIANTS (H-ViT3: recompute=True, with_cp=False, ...)
DEFAULT_MEANING = {'HViT3': 'recompute=True, with_cp=False', 'L2ViT': 'recompute=True, with_cp=False',
                   'ResT': 'recompute=True (chunked, recomputed attention), with_cp=False'}


def _loss(outputs):
    return sum(o.float().mean() for o in outputs)


def train_steps(model, x, warmup, iters, lr=1e-4, memory=True):
    """`warmup` + `iters` training iterations of `model` on `x`; returns (per-iteration dicts of
    total / forward / backward / optimizer ms for the timed ones, peak memory in MB above the memory held
    before the first iteration, None without `memory`)."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.05)
    dev = x.device
    if not memory:
        pass
    elif dev.type == 'cuda':
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
        peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    steps = []
    for i in range(warmup + iters):
        _sync(dev)
        t0 = time.perf_counter()
        loss = _loss(model(x))
        _sync(dev)
        t1 = time.perf_counter()
        loss.backward()
        _sync(dev)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(dev)
        t3 = time.perf_counter()
        if i >= warmup:
            steps.append(dict(total_ms=(t3 - t0) * 1e3, forward_ms=(t1 - t0) * 1e3, backward_ms=(t2 - t1) * 1e3,
                              optimizer_ms=(t3 - t2) * 1e3))
        del loss
    if not memory:
        peak = None
    elif dev.type == 'cuda':
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if peak_rss <= peak_before:
            raise RuntimeError('the training steps did not raise the process peak RSS; cannot measure them')
        peak = (peak_rss - base) / 2**20
    return steps, peak
