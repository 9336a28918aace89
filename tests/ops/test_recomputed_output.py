"""`ops.checkpoint.recomputed_output`: a cheap function's output that the code after it would save for backward is
kept as its recipe and recomputed in backward, with the same values and gradients bit for bit."""
import contextlib
import weakref

import pytest
import torch
import torch.nn as nn

from conftest import saved_for_backward
from mmplugin_l2.models.layers import ResidualCPE
from mmplugin_l2.models.ops import dispatch
from mmplugin_l2.models.ops.checkpoint import checkpointed, recomputed_output

HW = (6, 7)


class Holder(nn.Module):
    """A block-like module: a residual CPE, then a LayerNorm, a recomputed region and a product that save its
    output (the LayerNorm its input, the region its input, a product with a weight a transposed view)."""

    def __init__(self, c=8, fast_train=True):
        super().__init__()
        self.fast_train = fast_train
        self.cpe = ResidualCPE(c)
        self.norm = nn.LayerNorm(c)
        self.lin = nn.Linear(c, c)
        self.w = nn.Parameter(torch.randn(c, HW[0] * HW[1]))

    def consumers(self, y):
        region = checkpointed(lambda t: self.lin(t).sin(), y)
        return self.norm(y).tanh() + region + (y.transpose(1, 2) * self.w).transpose(1, 2)

    def forward(self, x, recompute=True):
        if not recompute:
            return self.consumers(self.cpe(x, HW))
        with recomputed_output(self, self.cpe, x, HW) as y:
            return self.consumers(y)


def _forward(m, x, autocast, *args, **kwargs):
    """(output, input, tensors saved for backward) of m(input, *args, **kwargs) on a fresh leaf copy of x, its
    gradients cleared first."""
    xr = x.detach().requires_grad_()
    m.zero_grad(set_to_none=True)
    with torch.autocast('cpu', torch.bfloat16, enabled=autocast):
        y, saved = saved_for_backward(lambda: m(xr, *args, **kwargs))
    return y, xr, saved


def _results(m, y, xr, g):
    """Backward of <y, g> in y's dtype (a half y: in float32); then [y, the input's and m's parameters' gradients]."""
    yb = y.float() if y.dtype in (torch.bfloat16, torch.float16) else y
    yb.backward(g.to(yb.dtype))
    return [y, xr.grad, *(p.grad for p in m.parameters())]


@pytest.mark.parametrize('dtype,autocast', [(torch.float64, False), (torch.float32, False), (torch.float32, True)],
                         ids=['float64', 'float32', 'bf16-autocast'])
def test_output_is_not_kept_and_backward_gets_the_same_values(dtype, autocast):
    """The output is freed after the forward (only autograd could hold it), every other saved tensor still goes
    through the hooks around it, backward recomputes it where each op that saved it reads it, and outputs and
    gradients equal those of the same code keeping it, bit for bit (the recomputation runs in the forward's autocast
    state and takes the forward's paths)."""
    torch.manual_seed(0)
    m = Holder().to(dtype)
    x = torch.randn(2, HW[0] * HW[1], 8, dtype=dtype)
    g = torch.randn(2, HW[0] * HW[1], 8)
    y, xr, kept = _forward(m, x, autocast, recompute=False)
    want = _results(m, y, xr, g)
    outs = []
    m.cpe.register_forward_hook(lambda mod, args, out: outs.append(weakref.ref(out)))
    y, xr, saved = _forward(m, x, autocast)
    assert len(outs) == 1 and outs[0]() is None        # nothing holds the CPE's output after the forward
    assert len(saved) == len(kept) - 3                  # the hooks outside saw all else that is saved
    got = _results(m, y, xr, g)
    assert len(outs) == 1 + 3     # recomputed where each of its three savers reads it
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_output_is_kept_where_it_is_off():
    """Off (`fast_train=False`, inside a recomputed region, without autograd recording): the output is kept as
    autograd keeps it."""
    torch.manual_seed(0)
    x = torch.randn(2, HW[0] * HW[1], 8, requires_grad=True)
    for m, ctx in ((Holder(fast_train=False), contextlib.nullcontext()), (Holder(), dispatch.recomputed_region())):
        outs = []
        m.cpe.register_forward_hook(lambda mod, args, out: outs.append(weakref.ref(out)))
        with ctx:
            y = m(x)
        assert outs[0]() is not None
        y.sum().backward()
    m = Holder()
    with torch.no_grad(), recomputed_output(m, m.cpe, x, HW) as y:
        assert not y.requires_grad


def _lwa():
    from mmplugin_l2.models.backbones.l2vit import LWABlock
    return LWABlock(8, 2, window_size=4)


def _lga():
    from mmplugin_l2.models.backbones.l2vit import LGABlock
    return LGABlock(8, 2)


def _ttt():
    from mmplugin_l2.models.backbones.hvit3 import TTTBlock
    return TTTBlock(8, 2, fast_compile=False)


def _record_cpe_outputs(block, refs):
    """Weak references to the block's CPE outputs (x + CPE(x)) as they are made."""
    if hasattr(block, 'residual_cpe'):
        fn = block.residual_cpe

        def residual_cpe(*args):
            out = fn(*args)
            refs.append(weakref.ref(out))
            return out
        block.residual_cpe = residual_cpe
    else:
        for cpe in block.cpe:
            cpe.register_forward_hook(lambda mod, args, out: refs.append(weakref.ref(out)))


@pytest.mark.parametrize('autocast', [False, True], ids=['float64', 'bf16-autocast'])
@pytest.mark.parametrize('build', [_lwa, _lga, _ttt], ids=['LWABlock', 'LGABlock', 'TTTBlock'])
def test_blocks_keep_no_cpe_output(build, autocast, monkeypatch):
    """L2ViT's LWA (two CPEs) and LGA blocks and H-ViT3's TTT block keep none of their CPE outputs for backward
    (`recomputed_output`), with the outputs and gradients of the same block keeping them, bit for bit."""
    import mmplugin_l2.models.ops.checkpoint as ck
    torch.manual_seed(0)
    block = build().train()
    dtype = torch.float32 if autocast else torch.float64
    block.to(dtype)
    x = torch.randn(2, HW[0] * HW[1], 8, dtype=dtype)
    g = torch.randn(2, HW[0] * HW[1], 8)

    refs = []
    _record_cpe_outputs(block, refs)
    y, xr, _ = _forward(block, x, autocast, HW)
    n = len(refs)
    assert n == (len(block.cpe) if isinstance(block.cpe, nn.ModuleList) else 1) and all(r() is None for r in refs)
    got = _results(block, y, xr, g)
    monkeypatch.setattr(ck, '_top_hooks', None)        # off: the block keeps its CPE outputs
    y, xr, _ = _forward(block, x, autocast, HW)
    assert all(r() is not None for r in refs[-n:])
    for a, b in zip(got, _results(block, y, xr, g)):
        assert torch.equal(a, b)


@pytest.mark.parametrize('reentrant', [False, True])
def test_inside_torchs_checkpoint(reentrant, monkeypatch):
    """Inside torch's own checkpoint (e.g. mmengine's `activation_checkpointing`) the same gradients, and the region
    keeps only its input: off under the non-reentrant one's hooks (a recipe would keep the CPE's input alive), on
    in the reentrant one's recomputation (a graph of its own; its forward records no graph)."""
    import mmplugin_l2.models.ops.checkpoint as ck
    torch.manual_seed(0)
    m = Holder().double()
    x = torch.randn(2, HW[0] * HW[1], 8, dtype=torch.float64)
    g = torch.randn(2, HW[0] * HW[1], 8, dtype=torch.float64)
    xr = x.detach().requires_grad_()
    want = _results(m, m(xr * 2, recompute=False) / 2, xr, g)
    xr = x.detach().requires_grad_()
    m.zero_grad(set_to_none=True)
    recipes = []

    class Counted(ck._Recipe):
        __slots__ = ()

        def __init__(self, *args):
            recipes.append(args)
            super().__init__(*args)
    monkeypatch.setattr(ck, '_Recipe', Counted)
    y = torch.utils.checkpoint.checkpoint(lambda t: m(t * 2) / 2, xr, use_reentrant=reentrant)
    assert not recipes          # a region keeps only its input: no recipe holds the CPE's input, t * 2
    got = _results(m, y, xr, g)
    assert len(recipes) == (3 if reentrant else 0)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
