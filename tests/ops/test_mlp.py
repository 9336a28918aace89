"""`ops.mlp`: the MLPs' inference in pieces and their training functions (closed-form backward) against the
reference (plain autograd, the activation a parameter), the dispatch of the `Mlp` / `ConvMlp` layers and of
the pre-norm MLP branch, autocast, and the fallback to the reference for settings the fast paths lack."""
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import TINY_L2VIT, TINY_REST, TINY_VIT3, nbytes, saved_for_backward
from mmplugin_l2 import L2ViT, ResT, ViT3
from mmplugin_l2.models.layers import ConvMlp, Mlp
from mmplugin_l2.models.layers.mlp import norm_mlp_branch
from mmplugin_l2.models.ops.memory import set_memory_policy
from mmplugin_l2.models.ops import TRAIN, Path
from mmplugin_l2.models.ops.mlp import (ConvMlpPiecesFunction, ConvMlpFunction, NormMlpFunction, conv_mlp,
                                        conv_mlp_inference, conv_mlp_reference, mlp_inference, mlp_reference)
from mmplugin_l2.models.ops.mlp.naive import conv_mlp_naive, mlp_naive
from ops.harness import (RecordOps, assert_autocast_no_worse, assert_matches_naive, cast_inputs, half_values,
                         record_calls)

C, R = 5, 11      # odd widths: channels and hidden channels


def _random_(module, std=0.4):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, std)
    return module.double()


def _params(c=C, r=R):
    g = torch.Generator().manual_seed(0)
    shapes = [(r, c), (r,), (r, 1, 3, 3), (r,), (c, r), (c,)]
    return [(torch.randn(s, generator=g, dtype=torch.float64) * 0.5).requires_grad_() for s in shapes]


def _conv_mlp(impl, act=F.gelu):
    """`impl` (the reference or the naive form) as a function of the tokens, the map size and the parameters."""
    def run(x, hw, w1, b1, wc, bc, w2, b2):
        return impl(x, hw, lambda t: F.linear(t, w1, b1), lambda m: F.conv2d(m, wc, bc, padding=1, groups=wc.shape[0]),
                    lambda t: F.linear(t, w2, b2), act, nn.Identity())
    return run


def _mlp(impl, act=F.gelu):
    """`impl` (the reference or the naive form) as a function of the tokens and the parameters (pre-norm
    LayerNorm with lw, lb when given)."""
    def run(x, w1, b1, w2, b2, lw=None, lb=None):
        norm = None if lw is None else (lambda t: F.layer_norm(t, t.shape[-1:], lw, lb, 1e-5))
        return impl(x, lambda t: F.linear(t, w1, b1), lambda t: F.linear(t, w2, b2), act, nn.Identity(), norm)
    return run


def _x(hw, b=2, c=C):
    return (torch.randn(b, hw[0] * hw[1], c, dtype=torch.float64) * 2).requires_grad_()


# ------------------------------------------------------------------ the references
@pytest.mark.parametrize('act', [F.gelu, torch.tanh])
def test_references_match_naive(act):
    """`mlp_reference` (with a pre-norm) and `conv_mlp_reference` (an odd map) = the naive forms: values and
    gradients of the tokens and every parameter."""
    w1, b1, _, _, w2, b2 = _params()
    lw, lb = (torch.randn(C, dtype=torch.float64).requires_grad_() for _ in range(2))
    assert_matches_naive(_mlp(mlp_reference, act), _mlp(mlp_naive, act), [_x((31, 1)), w1, b1, w2, b2, lw, lb])
    hw = (5, 7)
    assert_matches_naive(lambda x, *p: _conv_mlp(conv_mlp_reference, act)(x, hw, *p),
                         lambda x, *p: _conv_mlp(conv_mlp_naive, act)(x, hw, *p), [_x(hw)] + _params())


# ------------------------------------------------------------------ inference in pieces
@pytest.mark.parametrize('piece', [None, 3 * C, 7 * C, 10 ** 6])
@pytest.mark.parametrize('with_norm', [False, True])
def test_mlp_inference_matches_naive(piece, with_norm):
    """Pieces of 3 and 7 tokens of 2 x 31 (a partial last piece), one piece, whole map; the pre-norm in the
    pieces."""
    mlp = _random_(Mlp(C, R))
    norm = _random_(nn.LayerNorm(C)) if with_norm else None
    x = torch.randn(2, 31, C, dtype=torch.float64)
    with torch.no_grad():
        fast = mlp_inference(x, mlp.fc1, mlp.fc2, piece, norm)
        ref = mlp_naive(x, mlp.fc1, mlp.fc2, F.gelu, nn.Identity(), norm)
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize('hw', [(13, 7), (5, 9), (2, 3)])
@pytest.mark.parametrize('rows', [1, 2, 4, None])
def test_conv_mlp_inference_matches_naive(hw, rows):
    """Pieces of 1, 2 and 4 rows with a halo row each side (map edges, a partial last piece), whole map."""
    m = _random_(ConvMlp(C, R))
    x = torch.randn(2, hw[0] * hw[1], C, dtype=torch.float64)
    piece = None if rows is None else rows * 2 * hw[1] * C
    with torch.no_grad():
        fast = conv_mlp_inference(x, hw, m.fc1, m.dwc, m.fc2, piece)
        ref = conv_mlp_naive(x, hw, m.fc1, m.dwc, m.fc2, F.gelu, nn.Identity())
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------------ training functions
@pytest.mark.parametrize('keep_fc1', [True, False])
@pytest.mark.parametrize('hw', [(6, 5), (3, 7)])
def test_conv_mlp_function_matches_naive(keep_fc1, hw):
    assert_matches_naive(lambda x, *p: ConvMlpFunction.apply(x, hw, keep_fc1, *p),
                         lambda x, *p: _conv_mlp(conv_mlp_naive)(x, hw, *p), [_x(hw)] + _params())


@pytest.mark.parametrize('hw,rows', [((6, 5), 1), ((7, 9), 2), ((7, 9), 4), ((2, 3), 1), ((5, 3), 7)])
def test_conv_mlp_pieces_function_matches_naive(hw, rows):
    """Pieces of rows with their halo rows, a partial last piece, one piece for the whole map."""
    assert_matches_naive(lambda x, *p: ConvMlpPiecesFunction.apply(x, hw, rows, *p),
                         lambda x, *p: _conv_mlp(conv_mlp_naive)(x, hw, *p), [_x(hw)] + _params())


@pytest.mark.parametrize('keep_fc1', [True, False])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_conv_mlp_function_under_autocast_no_worse_than_the_reference(dtype, keep_fc1):
    """Under autocast `ConvMlpFunction` (on whole maps, as `CONV_MLP` declares) is as accurate as the reference is
    there (its backward under the forward's autocast state: products, convolutions and GELUs in the autocast
    dtype): output and every gradient against the naive form in float64; the output in the autocast dtype, the
    gradients in the inputs' dtypes."""
    hw, c, r = (9, 7), 16, 40
    g = torch.Generator().manual_seed(2)
    shapes = [(r, c), (r,), (r, 1, 3, 3), (r,), (c, r), (c,)]
    ps = [(torch.randn(s, generator=g, dtype=torch.float64) * .3).requires_grad_() for s in shapes]
    x = (torch.randn(2, hw[0] * hw[1], c, generator=g, dtype=torch.float64) * 2).requires_grad_()
    fast = lambda x, *p: ConvMlpFunction.apply(x, hw, keep_fc1, *p)  # noqa: E731
    e_fast, _ = assert_autocast_no_worse(fast, lambda x, *p: _conv_mlp(conv_mlp_reference)(x, hw, *p),
                                         lambda x, *p: _conv_mlp(conv_mlp_naive)(x, hw, *p), [x] + ps, dtype,
                                         norm='l2')
    assert max(e_fast) < (5e-2 if dtype == torch.bfloat16 else 1e-2)
    x32, ps32 = x.detach().float().requires_grad_(), [p.detach().float().requires_grad_() for p in ps]
    with torch.autocast('cpu', dtype=dtype):
        y = ConvMlpFunction.apply(x32, hw, keep_fc1, *ps32)
    grads = torch.autograd.grad(y.float().sum(), [x32] + ps32)
    assert y.dtype == dtype and all(t.dtype == torch.float32 for t in grads)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_conv_mlp_layer_under_autocast_outside_recomputed_blocks_only(dtype):
    """Under autocast a training ConvMlp runs `ConvMlpFunction` on the whole map (pieces given by the policy are
    fp32's), keeping its input and the fc1 output (in the autocast dtype); inside a recomputed region (a `with_cp`
    block) the reference, whose saved tensors the region keeps only while its backward runs; in fp32 there, its
    train function in pieces as before."""
    from mmplugin_l2.models.ops.dispatch import recomputed_region
    m = ConvMlp(C, R, fast_train=True).train()
    set_memory_policy(m, dict(max_elems=2 * C))
    hw = (7, 9)
    x = torch.randn(2, 63, C, requires_grad=True)
    got = []
    for region, amp in ((contextlib.nullcontext, True), (recomputed_region, True), (recomputed_region, False)):
        with region(), torch.autocast('cpu', dtype=dtype, enabled=amp):
            y, saved = saved_for_backward(lambda: m(x, hw))
        got.append(_grad_fn(y))
        if region is contextlib.nullcontext:
            kept = nbytes(saved) - nbytes(list(m.parameters()))
            assert kept == x.numel() * 4 + 2 * 63 * R * dtype.itemsize, kept
    assert got == ['ConvMlpFunctionBackward', 'ViewBackward0', 'ConvMlpPiecesFunctionBackward'], got


@pytest.mark.parametrize('rows', [None, 7, 1, 61])
def test_norm_mlp_function_matches_naive(rows):
    """LayerNorm -> fc1 -> GELU -> fc2 whole and in pieces of `rows` tokens of 2 x 31 (a partial last one)."""
    w1, b1, _, _, w2, b2 = _params()
    lw, lb = (torch.randn(C, dtype=torch.float64).requires_grad_() for _ in range(2))
    assert_matches_naive(lambda x, w1, b1, w2, b2, lw, lb: NormMlpFunction.apply(x, lw, lb, 1e-5, w1, b1, w2, b2, rows),
                         _mlp(mlp_naive), [_x((31, 1)), w1, b1, w2, b2, lw, lb], atol=1e-11)


@pytest.mark.parametrize('half_x', [False, True], ids=['fp32_x', 'half_x'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_norm_mlp_function_under_autocast_no_worse_than_the_reference(dtype, half_x):
    """Under autocast `NormMlpFunction` (on whole maps, as `NORM_MLP` declares) is as accurate as the reference is
    there (LayerNorm statistics in fp32, products in the autocast dtype): output and every gradient against the
    naive form in float64. `half_x`: the tokens arrive in the autocast dtype (the residual stream after a conv
    stem under autocast; values of that dtype, cast in the graph). In the L2 norm: fc1's bias gradient sums the
    hidden gradient in another order than the reference, and its largest error moves by ±30 % with the seed, both
    ways."""
    c, r = 16, 40
    g = torch.Generator().manual_seed(1)
    ps = [(torch.randn(s, generator=g, dtype=torch.float64) * k).requires_grad_()
          for s, k in (((r, c), .3), ((r,), .1), ((c, r), .2), ((c,), .1), ((c,), 1.), ((c,), .1))]
    x = (torch.randn(2, 97, c, generator=g, dtype=torch.float64) * 2).requires_grad_()
    fast = lambda x, w1, b1, w2, b2, lw, lb: NormMlpFunction.apply(x, lw, lb, 1e-5, w1, b1, w2, b2)  # noqa: E731
    ref = _mlp(mlp_reference)
    if half_x:
        x, fast, ref = half_values(x, dtype), cast_inputs(fast, dtype), cast_inputs(ref, dtype)
    e_fast, _ = assert_autocast_no_worse(fast, ref, _mlp(mlp_naive), [x] + ps, dtype, norm='l2')
    assert max(e_fast) < (5e-2 if dtype == torch.bfloat16 else 1e-2)


# ------------------------------------------------------------------ the layers' dispatch
def _grad_fn(y):
    return type(y.grad_fn).__name__


def _layer(cls, fast_train=True, max_elems=2 * 7 * C, devices=('cpu',), **kw):
    m = _random_(cls(C, R, fast_train=fast_train, **kw))
    set_memory_policy(m, dict(max_elems=max_elems, devices=devices))
    return m


@pytest.mark.parametrize('cls', [Mlp, ConvMlp])
def test_layer_inference_in_pieces_equals_naive(cls):
    m = _layer(cls).eval()
    hw = (7, 9)
    x = torch.randn(2, 63, C, dtype=torch.float64)
    with torch.no_grad():
        fast = m(x, hw)
    ref = m(x.clone().requires_grad_(), hw)          # eval with grad (Grad-CAM): the reference
    torch.testing.assert_close(fast, ref.detach(), rtol=1e-12, atol=1e-13)
    if cls is Mlp:
        naive = lambda t: mlp_naive(t, m.fc1, m.fc2, F.gelu, nn.Identity())   # noqa: E731
    else:
        naive = lambda t: conv_mlp_naive(t, hw, m.fc1, m.dwc, m.fc2, F.gelu, nn.Identity())  # noqa: E731
    assert_matches_naive(lambda t: m(t, hw), naive, [x.requires_grad_()])


def test_conv_mlp_layer_takes_the_train_functions():
    """With `fast_train` in a training step: pieces of rows on the policy's devices, whole maps elsewhere
    (devices=('cuda',) on a CPU tensor), plain autograd without `fast_train`; same values and gradients."""
    hw = (7, 9)
    x = _x(hw)
    names = {}
    for key, kw in {'pieces': {}, 'whole': dict(devices=('cuda',)), 'plain': dict(fast_train=False)}.items():
        m = _layer(ConvMlp, **kw).train()
        y = m(x, hw)
        names[key] = _grad_fn(y)
        assert_matches_naive(lambda t: m(t, hw), lambda t: _conv_mlp(conv_mlp_naive)(t, hw, *m.parameters()), [x])
    assert names == {'pieces': 'ConvMlpPiecesFunctionBackward', 'whole': 'ConvMlpFunctionBackward',
                     'plain': 'ViewBackward0'}, names


@pytest.mark.parametrize('keep_fc1', [True, False])
def test_conv_mlp_function_keeps_input_and_fc1_output(keep_fc1):
    """The op's train path on the whole map keeps x and, with `keep_fc1` (the layer always keeps it), the fc1
    output."""
    m = _layer(ConvMlp, max_elems=None).train()
    x = _x((6, 5))
    y, saved = saved_for_backward(lambda: conv_mlp(Path(TRAIN), x, (6, 5), m.fc1, m.dwc, m.fc2, m.act, m.drop,
                                                   keep_fc1))
    assert _grad_fn(y) == 'ConvMlpFunctionBackward'
    assert nbytes(saved) - nbytes(list(m.parameters())) == 8 * 2 * 30 * (C + R * keep_fc1)


@pytest.mark.parametrize('cls', [Mlp, ConvMlp])
def test_recompute_with_dropout_same_gradients_less_saved(cls):
    """Dropout in training: the reference recomputed in backward (RNG replayed: the same masks), not a
    train function; same gradients as plain autograd; only the input kept."""
    grads, saved = {}, {}
    for fast_train in (False, True):
        torch.manual_seed(0)
        m = cls(8, 32, drop=0.1, fast_train=fast_train).double().train()
        x = torch.randn(2, 6 * 5, 8, dtype=torch.float64, requires_grad=True)
        torch.manual_seed(1)
        y, saved[fast_train] = saved_for_backward(lambda: m(x, (6, 5)))
        saved[fast_train] = nbytes(saved[fast_train])
        assert 'Function' not in _grad_fn(y)
        (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y).sin()).sum().backward()
        grads[fast_train] = [x.grad] + [p.grad for p in m.parameters()]
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert saved[True] <= 2 * 30 * 8 * 8 + 64
    assert saved[True] * 4 < saved[False]


@pytest.mark.parametrize('cls', [Mlp, ConvMlp])
def test_train_mode_under_no_grad_keeps_dropout(cls):
    m = _layer(cls, drop=0.5, max_elems=1).train()
    x = torch.randn(2, 63, C, dtype=torch.float64)
    torch.manual_seed(3)
    with torch.no_grad():
        a = m(x, (7, 9))
    torch.manual_seed(3)
    b = m(x.clone().requires_grad_(), (7, 9))
    torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    with torch.no_grad():
        assert not torch.allclose(a, m.eval()(x, (7, 9)))


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_norm_mlp_branch_under_autocast_takes_the_train_function_on_whole_maps(dtype):
    """Under autocast a block's MLP branch runs `NormMlpFunction` (not the checkpointed reference) on fp32 tokens, on
    the whole map even where the memory policy gives pieces outside autocast; its output is in the autocast dtype,
    its parameter gradients in fp32."""
    from mmplugin_l2.models.backbones.l2vit import LGABlock
    blk = LGABlock(8, 2).train()
    set_memory_policy(blk, dict(max_elems=4 * 8))
    x = torch.randn(2, 40, 8, requires_grad=True)
    pieces = []
    orig = NormMlpFunction.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NormMlpFunction, 'apply', lambda *a: pieces.append(a[-1]) or orig(*a))
        norm_mlp_branch(blk, blk.norm2, blk.mlp, x)
        with torch.autocast('cpu', dtype=dtype):
            y = norm_mlp_branch(blk, blk.norm2, blk.mlp, x)
    assert pieces == [4 * 8, None], pieces
    assert y.dtype == dtype and _grad_fn(y) == 'NormMlpFunctionBackward'
    y.float().sum().backward()
    assert blk.mlp.fc1.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_norm_mlp_branch_on_half_tokens(dtype):
    """On half tokens under autocast (L2ViT's and ResT's residual streams after their conv stems) the branch of a
    block that checkpoints it (L2ViT) and of one that does not (ResT) runs `NormMlpFunction` on the whole map (keeping
    x and the fc1 output); inside a recomputed region (a `with_cp` block) the first runs the reference, the second
    the function still. All give the reference's output under the same autocast; the parameter gradients are fp32,
    the input's in the tokens' dtype. Half weights without autocast take the reference."""
    from mmplugin_l2.models.backbones.l2vit import LGABlock
    from mmplugin_l2.models.backbones.rest import ResTBlock
    from mmplugin_l2.models.layers import mlp as mlp_layer
    from mmplugin_l2.models.ops.dispatch import recomputed_region
    for blk, checkpoint, region, ran in ((LGABlock(8, 2), True, contextlib.nullcontext, ['norm_mlp_train']),
                                         (LGABlock(8, 2), True, recomputed_region, []),
                                         (ResTBlock(8, 2, 1), False, contextlib.nullcontext, ['norm_mlp_train']),
                                         (ResTBlock(8, 2, 1), False, recomputed_region, ['norm_mlp_train'])):
        blk = _random_(blk).float().train()
        set_memory_policy(blk, dict(max_elems=4 * 8))
        x = torch.randn(2, 40, 8).to(dtype).requires_grad_()
        with pytest.MonkeyPatch.context() as mp, torch.autocast('cpu', dtype=dtype), region():
            calls = record_calls(mp, mlp_layer, recomputed_branch='recomputed_branch', norm_mlp_train='norm_mlp_train')
            y = norm_mlp_branch(blk, blk.norm2, blk.mlp, x, checkpoint=checkpoint)
            ref = blk.mlp(x.detach(), norm=blk.norm2)
        assert calls.names == ran, (type(blk).__name__, region.__name__, calls.names)
        assert y.dtype == dtype
        tol = 4 * torch.finfo(dtype).eps * ref.abs().max().item()
        torch.testing.assert_close(y.float(), ref.float(), rtol=0, atol=tol)
        y.float().sum().backward()
        assert blk.mlp.fc1.weight.grad.dtype == torch.float32 and x.grad.dtype == dtype
    half = ResTBlock(8, 2, 1).to(dtype).train()                     # half weights, no autocast: the reference
    with pytest.MonkeyPatch.context() as mp:
        calls = record_calls(mp, mlp_layer, recomputed_branch='recomputed_branch', norm_mlp_train='norm_mlp_train')
        norm_mlp_branch(half, half.norm2, half.mlp, torch.randn(2, 40, 8, dtype=dtype, requires_grad=True), False)
    assert calls.names == []


def test_norm_mlp_branch_dispatch():
    """A recomputing block's branch: `NormMlpFunction` (values and gradients of the reference); pieces on
    the policy's devices only (whole maps with devices=('cuda',) give the same result)."""
    from mmplugin_l2.models.backbones.l2vit import LGABlock
    blk = _random_(LGABlock(8, 2)).train()
    x = torch.randn(2, 40, 8, dtype=torch.float64, requires_grad=True)
    for devices in (('cpu',), ('cuda',)):
        set_memory_policy(blk, dict(max_elems=4 * 8, devices=devices))
        assert _grad_fn(norm_mlp_branch(blk, blk.norm2, blk.mlp, x)) == 'NormMlpFunctionBackward'
        assert_matches_naive(lambda t: norm_mlp_branch(blk, blk.norm2, blk.mlp, t),
                             lambda t: mlp_naive(t, blk.mlp.fc1, blk.mlp.fc2, F.gelu, nn.Identity(), blk.norm2), [x],
                             atol=1e-11)


# ------------------------------------------------------------------ settings the fast paths lack
def _gelu_layer_like(m):
    g = type(m)(C, R).double()
    g.load_state_dict(m.state_dict())
    return g


@pytest.mark.parametrize('cls', [Mlp, ConvMlp])
@pytest.mark.parametrize('mode', ['inference', 'train'])
def test_other_activation_takes_the_reference(cls, mode):
    """act_cfg ReLU / tanh-GELU: every path gives the reference's values with that activation (never the
    exact GELU's), the same keys as the GELU layer."""
    hw = (7, 9)
    for act_cfg, act in ((dict(type='ReLU'), F.relu), (dict(type='GELU', approximate='tanh'),
                                                       lambda t: F.gelu(t, approximate='tanh'))):
        m = _layer(cls, act_cfg=act_cfg, max_elems=2 * C)
        x = torch.randn(2, 63, C, dtype=torch.float64)
        assert list(m.state_dict()) == list(_gelu_layer_like(m).state_dict())
        if cls is Mlp:
            ref = mlp_naive(x, m.fc1, m.fc2, act, nn.Identity())
        else:
            ref = conv_mlp_naive(x, hw, m.fc1, m.dwc, m.fc2, act, nn.Identity())
        if mode == 'inference':
            with torch.no_grad():
                y, gelu_y = m.eval()(x, hw), _gelu_layer_like(m).eval()(x, hw)
        else:
            xg = x.clone().requires_grad_()
            y, gelu_y = m.train()(xg, hw), _gelu_layer_like(m).train()(xg, hw)
            assert 'Function' not in _grad_fn(y)
        torch.testing.assert_close(y.detach(), ref.detach(), rtol=1e-12, atol=1e-13)
        assert (y - gelu_y).abs().max() > 1e-7        # tanh-GELU is within ~1e-4 of GELU


def test_norm_mlp_branch_other_activation_takes_the_reference():
    from mmplugin_l2.models.backbones.l2vit import LGABlock
    blk = _random_(LGABlock(8, 2)).train()
    blk.mlp.act = nn.ReLU()
    x = torch.randn(2, 40, 8, dtype=torch.float64, requires_grad=True)
    y = norm_mlp_branch(blk, blk.norm2, blk.mlp, x)
    assert 'NormMlp' not in _grad_fn(y)
    torch.testing.assert_close(y, mlp_naive(x, blk.mlp.fc1, blk.mlp.fc2, F.relu, nn.Identity(), blk.norm2), rtol=1e-12,
                               atol=1e-13)


# ------------------------------------------------------------------ autocast on CPU
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('cls', [Mlp, ConvMlp])
@pytest.mark.parametrize('train', [False, True])
def test_layers_under_autocast(dtype, cls, train):
    """fp32 layers under CPU autocast, pieces forced (tiny max_elems): no dtype error, the dtype autocast
    gives, the float32 reference's values to half precision; training with `fast_train` runs Mlp's (recomputed)
    reference and ConvMlp's train function on the whole map, and their gradients are close too."""
    torch.manual_seed(0)
    m = cls(C, R, fast_train=True).float()
    set_memory_policy(m, dict(max_elems=2 * C))
    m.train(train)
    hw = (7, 9)
    x = torch.randn(2, 63, C, requires_grad=train)
    ref = m(x, hw) if train else m.eval()(x.detach(), hw)
    with torch.autocast('cpu', dtype=dtype), torch.set_grad_enabled(train):
        y = m(x, hw)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, rtol=0.05, atol=0.05)
    if train:
        assert _grad_fn(y) == ('ConvMlpFunctionBackward' if cls is ConvMlp else 'ViewBackward0'), _grad_fn(y)
        g_fast = torch.autograd.grad(y.float().sum(), [x] + list(m.parameters()))
        g_ref = torch.autograd.grad(ref.sum(), [x] + list(m.parameters()))
        for a, b in zip(g_fast, g_ref):
            torch.testing.assert_close(a, b, rtol=0.05, atol=0.1)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('name', ['vit3', 'l2vit', 'rest'])
def test_backbones_under_autocast_in_pieces(dtype, name):
    """Whole backbones (stems, LCM, MLPs) in eval mode under CPU autocast with every piece path forced
    (max_elems 2**8 at 64 x 64, 2**14 at 224 x 224 crashed the Mlp's pieces before): close to fp32 whole maps."""
    torch.manual_seed(0)
    m = {'vit3': lambda: ViT3(arch=TINY_VIT3, patch_size=8),
         'l2vit': lambda: L2ViT(arch=TINY_L2VIT, drop_path_rate=0.),
         'rest': lambda: ResT(arch=TINY_REST, drop_path_rate=0.)}[name]().eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        set_memory_policy(m, None)
        ref = m(x)
        set_memory_policy(m, dict(max_elems=2 ** 8))
        with torch.autocast('cpu', dtype=dtype):
            out = m(x)
    for a, b in zip(out, ref):
        assert torch.isfinite(a).all()
        assert (a.float() - b).abs().max() <= 0.1 * b.abs().max() + 0.05


# ------------------------------------------------------------------ memory of the training pieces
def _new_tensors(numels):
    """A `RecordOps` callback appending to `numels` the element count of every tensor an op returns in new memory
    (not a view of or a write into one of its arguments)."""
    def record(func, args, kwargs, out):
        given = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                 if torch.is_tensor(t)}
        numels.extend(t.numel() for t in torch.utils._pytree.tree_leaves(out)
                      if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in given)
    return record


def test_norm_mlp_branch_pieces_keep_hidden_tensors_piece_sized():
    """In a training step on a device of the policy the branch runs in pieces of `max_elems`: the fc1 output
    is the only hidden-width (N, rC) tensor of its forward and backward; on other device types (none
    listed) the same gradients from whole maps."""
    from mmplugin_l2.models.backbones.l2vit import LGABlock
    n, c = 2 * 40, 8
    grads = {}
    for devices in (('cpu',), ()):
        torch.manual_seed(0)
        blk = _random_(LGABlock(c, 2), std=0.3).train()
        set_memory_policy(blk, dict(max_elems=4 * c, devices=devices))     # pieces of 4 tokens
        x = torch.randn(2, 40, c, dtype=torch.float64, requires_grad=True)
        numels = []
        with RecordOps(_new_tensors(numels)):
            y = norm_mlp_branch(blk, blk.norm2, blk.mlp, x)
            grads[devices] = torch.autograd.grad(y, [x] + list(blk.mlp.parameters()), torch.ones_like(y))
        hidden = sum(k >= n * 4 * c for k in numels)
        assert hidden == (1 if devices else 3), numels    # whole maps: + the GELU output twice
    for a, b in zip(*grads.values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
