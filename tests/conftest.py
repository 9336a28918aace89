import os
import os.path as osp
import sys

import pytest
import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import mmplugin_l2  # noqa: E402,F401

#: cores per process: 2 in one process; under pytest-xdist the cores shared out among the workers
WORKERS = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
torch.set_num_threads(2 if WORKERS == 1 else max(1, (os.cpu_count() or 1) // WORKERS))


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pytest.ini): one worker per core, at most 4 (the real-size tests need a few GB each)."""
    return max(1, min(os.cpu_count() or 1, 4))


#: files whose module-scoped fixture is parametrised by a case that takes minutes: each case is its own unit of work
SPLIT_BY_CASE = ('tests/test_compile.py',)
#: units of work handed out first (longest first, so that no worker is left with a long one at the end), in this
#: order; the rest follow in xdist's order
FIRST = ('tests/test_compile.py', 'tests/test_tools.py', 'tests/test_device_check.py', 'tests/test_packaging.py',
         'tests/test_configs.py', 'tests/test_analysis.py')


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (pytest.ini) with two changes: the cases of SPLIT_BY_CASE files are separate units (they
    run on different workers at once), and the FIRST units are handed out first."""
    if config.getoption('dist') != 'loadfile':
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):

        def _split_scope(self, nodeid):
            path = nodeid.split('::', 1)[0]
            if path in SPLIT_BY_CASE and nodeid.endswith(']'):
                return path + nodeid[nodeid.index('['):]
            return path

        def _assign_work_unit(self, node):
            rank = [next((i for i, f in enumerate(FIRST) if s.startswith(f)), len(FIRST)) for s in self.workqueue]
            scope = list(self.workqueue)[rank.index(min(rank))]
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


#: a narrow H-ViT3 for tests where the architecture, not the width, is the point
TINY_HVIT3 = dict(embed_dims=[16, 32, 64, 64], depths=[1, 1, 2, 1], num_heads=[1, 1, 2, 2])
#: a narrow ViT3: two layers
TINY_VIT3 = dict(embed_dims=32, num_layers=2, num_heads=2)
#: a narrow L2ViT: every stage has an LWA and an LGA block
TINY_L2VIT = dict(embed_dims=[16, 32, 64, 64], depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 2])
#: a narrow ResT: one head in stage 1 (no head-mixing conv / IN), several heads later, sr 8/4/2/1
TINY_REST = dict(embed_dims=[16, 32, 48, 64], depths=[1, 1, 2, 1], num_heads=[1, 2, 3, 4])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def analysis_tool(name):
    """tools/analysis/<name>.py as a module: its functions (argument checks, main) run in this process, without an
    interpreter start."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f'_{name}_cli', osp.join(ROOT, 'tools', 'analysis', f'{name}.py'))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def saved_for_backward(fn):
    """Run fn() and return (its output, the list of tensors autograd saved for backward meanwhile)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def assert_pyramid_shapes(outs, size, dims, batch=2):
    """Four finite maps (B, C_i, ceil(H / 2^(i+2)), ceil(W / 2^(i+2))), the stride-4..32 pyramid."""
    import math
    assert len(outs) == len(dims)
    for i, (o, c) in enumerate(zip(outs, dims)):
        s = 2 ** (i + 2)
        assert o.shape == (batch, c, math.ceil(size[0] / s), math.ceil(size[1] / s)), (i, o.shape)
        assert torch.isfinite(o).all()


def assert_same_grads(a, b):
    """Models a and b (same parameters) hold the same parameter gradients, None where the other's is None."""
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


def assert_with_cp_recomputes_chains(build, kept, dropped, x=None):
    """`with_cp=True` also recomputes the convolution chains between the blocks (stem, downsamplings): of the
    maps of shapes `kept` (which a plain training forward keeps for backward) and `dropped` none is kept outside
    recomputed regions (inside them torch.utils.checkpoint keeps nothing); gradients, running statistics and
    every buffer equal those of the plain step, and each train-mode BatchNorm counted the batch once."""
    torch.manual_seed(0)
    plain, cp = build().train(), build(with_cp=True).train()
    cp.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 64, 64) if x is None else x
    (out_plain, saved_plain), (out_cp, saved_cp) = (saved_for_backward(lambda: m(x)) for m in (plain, cp))
    shapes_plain, shapes_cp = {tuple(t.shape) for t in saved_plain}, {tuple(t.shape) for t in saved_cp}
    assert all(tuple(s) in shapes_plain for s in kept), (kept, shapes_plain)
    assert not any(tuple(s) in shapes_cp for s in list(kept) + list(dropped)), shapes_cp
    sum(o.square().sum() for o in out_plain).backward()
    sum(o.square().sum() for o in out_cp).backward()
    assert_same_grads(plain, cp)
    for (n, t), u in zip(plain.state_dict().items(), cp.state_dict().values()):
        torch.testing.assert_close(t, u, rtol=0, atol=1e-7, msg=n)
    bns = [m for m in cp.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and all(m.num_batches_tracked.item() == (1 if m.training else 0) for m in bns)


def assert_with_cp_matches(build, x=None):
    """`with_cp=True` gives the same outputs and parameter gradients as without, in train mode."""
    torch.manual_seed(0)
    a, b = build(), build(with_cp=True)
    b.load_state_dict(a.state_dict())
    a.train(), b.train()
    x = torch.randn(2, 3, 64, 64) if x is None else x
    oa, ob = a(x), b(x)
    for u, v in zip(oa, ob):
        torch.testing.assert_close(u, v, rtol=0, atol=1e-6)
    sum(o.square().sum() for o in oa).backward()
    sum(o.square().sum() for o in ob).backward()
    assert_same_grads(a, b)
