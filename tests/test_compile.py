"""`torch.compile` in training, as mmengine's `compile=True` runs it (`torch.compile(model.train_step, ...)`: the
backbone's forward runs inside the compiled function, its parts compiled frame by frame between the graph
breaks): a tiny backbone of each family, compiled once with `dynamic=True`, trains one step (forward, backward of
the summed output means), and its parameter gradients are as close to float64 as eager fp32's are.

Inductor's code generation is what costs most (minutes per backbone on a 2-core CPU with a cold cache), so it runs
for one case: H-ViT3 without `with_cp`, the backbone on which the inductor-only failures with symbolic sizes showed
(the strides of a saved conv input, `ops.tokens.compiled_map`; a `%` on a traced size,
`ops.tokens.padding_to_multiple`; both shared by every family). H-ViT3, L2ViT, ResT and ViT3 with `with_cp=True`
(the H-ViT3 detection configs set it; L2ViT's LCM BatchNorms run inside the checkpointed blocks: running statistics
updated once) run dynamo and AOT autograd with `backend='aot_eager'`: the same traced forward and backward graphs
with symbolic sizes, run by eager kernels.
`MMPLUGIN_L2_COMPILE_MATRIX=1` runs every family both ways with inductor (8 compiles).

The compiled step traces the fast training paths (`Supports.traced`, `ops.dispatch.choose`), not the reference: its
graphs hold the train paths' autograd functions and the recomputed (checkpointed) regions of the compiled and
checkpoint paths, and the gradients above are theirs.
"""
import collections
import copy
import os

import pytest
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from conftest import TINY_HVIT3, TINY_L2VIT, TINY_REST, TINY_VIT3
from mmplugin_l2.models.backbones import HViT3, L2ViT, ResT, ViT3


def _stages(arch, depths):
    """The first len(depths) stages of a tiny per-stage arch, with these depths."""
    return {k: (depths if k == 'depths' else v[:len(depths)]) for k, v in arch.items()}


#: the tiny archs, as few blocks as cover every kind: H-ViT3 and L2ViT with two stages, the second without blocks (a
#: stage boundary, a downsampling and the second stage's sizes derived from the first's are what the compiler sees
#: across stages; the blocks of a second stage run the first's code again), L2ViT's first stage with an LWA and an LGA
#: block; ResT with all four stages (its last has no key / value reduction), the third without blocks; ViT3 with one
#: layer: the time goes into tracing and code generation, which grow with the blocks
BUILDERS = {
    'hvit3': lambda **kw: HViT3(arch=_stages(TINY_HVIT3, [1, 0]), out_indices=(0, 1), drop_path_rate=0., **kw),
    'vit3': lambda **kw: ViT3(arch=dict(TINY_VIT3, num_layers=1), out_indices=(0,), **kw),
    'l2vit': lambda **kw: L2ViT(arch=_stages(TINY_L2VIT, [2, 0]), out_indices=(0, 1), drop_path_rate=0., **kw),
    'rest': lambda **kw: ResT(arch=dict(TINY_REST, depths=[1, 1, 0, 1]), drop_path_rate=0., **kw),
}
#: (family, with_cp, backend), the longest first (each case is its own unit of work under pytest-xdist: conftest.py)
DEFAULT_CASES = [('hvit3', False, 'inductor'), ('hvit3', True, 'aot_eager'), ('l2vit', True, 'aot_eager'),
                 ('rest', True, 'aot_eager'), ('vit3', True, 'aot_eager')]
CASES = ([(f, cp, 'inductor') for f in BUILDERS for cp in (False, True)] if os.environ.get('MMPLUGIN_L2_COMPILE_MATRIX')
         else DEFAULT_CASES)


#: per family, the higher-order ops of the fast paths that a compiled training step must trace, each at least once
#: per module of these classes: the train paths' autograd functions (H-ViT3's ConvMlp function in fp32, L2ViT's linear
#: attention and pre-norm MLP branches, ResT's pre-norm MLP branches) and the recomputed regions (TTT's compiled
#: path: the qkv tokens kept and the core recomputed; ViT3's MLP checkpoint); `with_cp` adds one region per block
TRACED = {
    'hvit3': dict(autograd_function_apply=('ConvMlp',), tag_activation_checkpoint=('TTTAttention',)),
    'vit3': dict(tag_activation_checkpoint=('TTTAttention', 'Mlp')),
    'l2vit': dict(autograd_function_apply=('LinearAttention', 'Mlp')),
    'rest': dict(autograd_function_apply=('Mlp',)),
}
BLOCKS = ('TTTBlock', 'LWABlock', 'LGABlock', 'ResTBlock')


def _counting(backend, counts):
    """A torch.compile backend: `backend` (a registered name), counting into `counts` the call targets of every
    graph it gets, their nested graphs (checkpointed regions, autograd functions' bodies) included."""
    from torch._dynamo.backends.registry import lookup_backend
    run = lookup_backend(backend)

    def count(gm, example_inputs):
        for sub in gm.modules():
            if isinstance(sub, torch.fx.GraphModule):
                counts.update(str(getattr(n.target, '__name__', n.target)) for n in sub.graph.nodes
                              if n.op == 'call_function')
        return run(gm, example_inputs)
    return count


def _step(model, x, run=None):
    """One training step's forward and backward of `run` (default: `model`; e.g. its compiled form):
    {name in `model`: gradient} of sum(output means)."""
    model.zero_grad(set_to_none=True)
    sum(o.mean() for o in (model if run is None else run)(x)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _bn_statistics(model):
    """{name: (running_mean, running_var, num_batches_tracked)} of the train-mode BatchNorms."""
    return {n: (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
            for n, m in model.named_modules() if isinstance(m, _BatchNorm) and m.track_running_stats}


def _relative_error(grads, ref):
    """||g - g64|| / ||g64|| over all parameters together."""
    num = sum((grads[n].double() - g).square().sum() for n, g in ref.items())
    den = sum(g.square().sum() for g in ref.values())
    return (num / den).sqrt().item()


@pytest.fixture(scope='module', params=CASES,
                ids=[f'{f}-{"cp" if cp else "nocp"}-{backend}' for f, cp, backend in CASES])
def compiled_step(request):
    """Eager fp32, eager float64 and compiled (the case's backend, dynamic=True) runs of one training step of the
    same weights: their gradients and BatchNorm statistics."""
    family, with_cp, backend = request.param
    torch.manual_seed(0)
    eager = BUILDERS[family](with_cp=with_cp).train()
    x = torch.randn(2, 3, 64, 64)
    bn_before = _bn_statistics(eager)
    compiled = copy.deepcopy(eager)
    double = copy.deepcopy(eager).double()
    plain = copy.deepcopy(eager)          # no checkpointing: BN statistics updated exactly once
    plain.with_cp = False
    torch._dynamo.reset()
    counts = collections.Counter()
    run = torch.compile(compiled, dynamic=True, backend=_counting(backend, counts))
    # sizes symbolic, float attributes (norm eps, BatchNorm momentum) constants, as automatic dynamic shapes (the
    # default) compile a model whose input size changes; dynamic=True alone makes them symbolic floats too, which
    # the compiler cannot keep and re-traces every frame once to specialise
    with torch._dynamo.config.patch(specialize_float=True):
        grads = dict(compiled=_step(compiled, x, run))
    grads.update(eager=_step(eager, x), double=_step(double, x.double()))
    _step(plain, x)
    stats = dict(before=bn_before, eager=_bn_statistics(eager), compiled=_bn_statistics(compiled),
                 plain=_bn_statistics(plain))
    modules = collections.Counter(type(m).__name__ for m in eager.modules())
    return family, with_cp, grads, stats, counts, modules


def test_compiled_gradients_as_close_to_float64_as_eager(compiled_step):
    """Every parameter gets a gradient; over all parameters the compiled step's error against float64 is at most
    5x eager fp32's (or 1e-6 relative, a few fp32 roundings: inductor fuses and reorders fp32 sums), and so is
    each parameter's, up to 1e-4 of its largest gradient plus 1e-6 of the model's (parameters whose float64
    gradient is zero, e.g. biases before a norm, keep only fp32 rounding)."""
    family, _, grads, _, _, _ = compiled_step
    assert grads['compiled'].keys() == grads['double'].keys() == grads['eager'].keys()
    err_compiled = _relative_error(grads['compiled'], grads['double'])
    err_eager = _relative_error(grads['eager'], grads['double'])
    print(f'{family}: gradient error vs float64, compiled {err_compiled:.2e}, eager fp32 {err_eager:.2e}')
    assert err_compiled <= max(5 * err_eager, 1e-6), (family, err_compiled, err_eager)
    top = max(g.abs().max().item() for g in grads['double'].values())
    for n, g in grads['double'].items():
        eager = (grads['eager'][n].double() - g).abs().max().item()
        compiled = (grads['compiled'][n].double() - g).abs().max().item()
        assert compiled <= 5 * eager + 1e-4 * g.abs().max().item() + 1e-6 * top, (family, n, compiled, eager)


def test_batchnorm_statistics_updated_once(compiled_step):
    """With or without checkpointing, eager or compiled: each train-mode BatchNorm counted the batch once
    (num_batches_tracked 1) and its running statistics equal those of the plain eager step."""
    family, with_cp, _, stats, _, _ = compiled_step
    assert bool(stats['before']) == (family != 'vit3'), (family, list(stats['before']))  # ViT3 has no BatchNorm
    for run in ('eager', 'compiled'):
        for n, (mean, var, tracked) in stats[run].items():
            p_mean, p_var, p_tracked = stats['plain'][n]
            assert tracked.item() == 1 == p_tracked.item(), (family, run, n)
            torch.testing.assert_close(mean, p_mean, rtol=1e-4, atol=1e-6, msg=lambda m: f'{run} {n}: {m}')
            torch.testing.assert_close(var, p_var, rtol=1e-4, atol=1e-6, msg=lambda m: f'{run} {n}: {m}')


def test_compiled_step_traces_the_fast_paths(compiled_step):
    """The compiled graphs hold each fast path's autograd function or recomputed region at least once per module
    that takes it (`TRACED`; `with_cp` adds a region per block). Taking the reference under compile (as before
    `Supports.traced`) leaves no autograd function and only `with_cp`'s regions, and fails this."""
    family, with_cp, _, _, counts, modules = compiled_step
    for hop, classes in TRACED[family].items():
        least = sum(modules[c] for c in classes)
        if hop == 'tag_activation_checkpoint' and with_cp:
            least += sum(modules[c] for c in BLOCKS)
        assert counts[hop] >= least > 0, (family, hop, counts[hop], least, dict(counts))
