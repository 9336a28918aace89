"""Every inference-only path (pieces of the memory policy, in-place kernels, the fused TTT pass) computes the
function that the path autograd runs computes, module by module and for whole backbones in eval mode, in
the regime where the path's feature is active; plus the memory policy's rule itself.

`paths(m, args, max_elems)` runs `m` twice in eval mode: under no_grad with a small policy (the inference
path, pieces forced, partial last pieces) and with autograd recording (the differentiable whole-map path).
Float64, so that a wrong constant or sign cannot hide in rounding.
"""
import contextlib

import pytest
import torch
import torch.nn as nn

from conftest import TINY_HVIT3, TINY_L2VIT, TINY_REST, TINY_VIT3
from mmplugin_l2 import HViT3, L2ViT, ResT, ViT3
from mmplugin_l2.models.layers import (CPE, LCM, PA, Conv2dCL, ConvDownsample, ConvStem, ConvStem2L,
                                      L2ViTStem, MemoryPolicy, Mlp, ResTPatchEmbed, ResTStem, set_memory_policy)
from mmplugin_l2.models.ops import INFERENCE, INFERENCE_ONLY, TRAIN, Path, choose, dispatch
from mmplugin_l2.models.ops.conv.naive import batch_norm as batch_norm_naive
from mmplugin_l2.models.ops.tokens import channels_last, map_to_tokens, tokens_to_map


class RecordingPolicy(MemoryPolicy):
    """A MemoryPolicy whose `used` records whether `ops.dispatch.choose` gave pieces for it
    (`_recording_choose`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.used = set()


@contextlib.contextmanager
def _recording_choose(policy):
    """Record the pieces that `ops.dispatch.choose` gives for `policy` (every layer's one dispatch)."""
    saved = dispatch._policy_piece

    def recording(p, x, whole_elems):
        piece = saved(p, x, whole_elems)
        if piece is not None and p is policy:
            policy.used.add('choose')
        return piece
    dispatch._policy_piece = recording
    try:
        yield
    finally:
        dispatch._policy_piece = saved


def _random_(module, std=0.3):
    """Random parameters (all of them, biases too) and BatchNorm statistics that are not the identity."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, std)
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2)
    return module.double()


def paths(m, args, max_elems, expect_pieces=True):
    """(inference-path output, autograd-path output) of `m(*args)`, both in eval mode."""
    policy = RecordingPolicy(max_elems)
    set_memory_policy(m, policy)
    m.eval()
    with torch.no_grad(), _recording_choose(policy):
        fast = m(*[a.clone() if torch.is_tensor(a) else a for a in args])
    leaf = [a.clone().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    ref = m(*leaf)
    outs = ref if isinstance(ref, (tuple, list)) else [ref]
    assert all(o.requires_grad for o in outs)    # the differentiable path really ran
    if expect_pieces:
        assert policy.used, 'the inference path took no pieces'
    detach = [o.detach() for o in outs]
    return (fast, detach) if isinstance(ref, (tuple, list)) else (fast, detach[0])


def close(a, b, tol=1e-10):
    for u, v in zip(a, b) if isinstance(a, (tuple, list)) else [(a, b)]:
        assert u.shape == v.shape
        torch.testing.assert_close(u, v, rtol=0, atol=tol * max(1., v.abs().max().item()))


# ---- module by module ----------------------------------------------------------------------------
@pytest.mark.parametrize('hw', [(13, 7), (40, 3), (5, 50), (2, 9)])
@pytest.mark.parametrize('rows', [1, 4])
def test_lcm_row_bands(hw, rows):
    """LCM (7x7 depth-wise conv, GELU, BN, 7x7 depth-wise conv) in bands of 1 and 4 output rows: halo rows of
    both convolutions recomputed, zero rows only at the map's own top / bottom (maps shorter than the halo
    too), a partial last band, BN with non-trivial statistics."""
    m = _random_(LCM(8))
    x = torch.randn(2, hw[0] * hw[1], 8, dtype=torch.float64)
    close(*paths(m, (x, hw), max_elems=2 * rows * hw[1] * 8, expect_pieces=hw[0] > 2 * rows))


@pytest.mark.parametrize('cls,args,shape', [
    (ConvStem, (3, 16), (1, 3, 64, 48)), (ConvStem, (3, 16), (2, 3, 37, 29)), (ConvStem, (3, 16), (1, 3, 5, 9)),
    (ConvDownsample, (16, 32), (1, 16, 20, 30)), (ConvDownsample, (16, 32), (2, 16, 21, 17)),
    (ConvDownsample, (16, 32), (1, 16, 1, 3)), (ConvStem2L, (3, 16), (1, 3, 64, 48)),
    (ConvStem2L, (3, 16), (2, 3, 37, 29))])
@pytest.mark.parametrize('max_elems', [1, 700, 5000])
def test_conv_chains_in_row_bands(cls, args, shape, max_elems):
    """Stems and downsampling, band by band of output rows (halo rows recomputed, zero rows only at the
    image's own top/bottom, odd sizes, batch 2, bands of one row), BN with non-trivial statistics."""
    m = _random_(cls(*args))
    x = torch.randn(shape, dtype=torch.float64)
    whole = x[:, :1].numel() * args[1]          # input pixels x the chain's output channels
    close(*paths(m, (x,), max_elems, expect_pieces=whole > 2 * max_elems))


def test_conv_chains_use_pieces_only_when_safe():
    """No pieces while a BatchNorm of the chain is in train mode (inside an eval model: it normalises with the
    batch's statistics), nor in train mode under no_grad; pieces once every norm is in eval mode."""
    stem, x = ConvStem(3, 16), torch.randn(2, 3, 32, 32)
    policy = RecordingPolicy(1)
    set_memory_policy(stem, policy)
    with torch.no_grad(), _recording_choose(policy):
        stem.train()(x)
        stem.eval().conv[1].norm.train()
        stem(x)
    assert not policy.used
    with torch.no_grad(), _recording_choose(policy):
        stem.eval()(x)
    assert policy.used


class _PreNorm(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.norm, self.module = nn.LayerNorm(32), module

    def forward(self, x, *args):
        return self.module(x, *args, norm=self.norm)


@pytest.mark.parametrize('module,hw', [(Mlp(32, 64), ()), (LCM(32), ((20, 33),))])
def test_pre_norm_in_the_pieces(module, hw):
    """`module(x, norm=norm)`: at inference the LayerNorm runs piece by piece inside the module (Mlp chunks,
    LCM row bands before the halo's zero rows) = module(norm(x)). The attention ops: tests/ops."""
    m = _random_(_PreNorm(module))
    n = hw[0][0] * hw[0][1] if hw else 45
    x = torch.randn(2, n, 32, dtype=torch.float64)
    close(*paths(m, (x, *hw), max_elems=1))


@pytest.mark.parametrize('cls,args,shape', [(PA, (8,), (2, 8, 7, 9)), (ResTStem, (3, 16), (2, 3, 29, 31)),
                                            (ResTPatchEmbed, (8, 16), (2, 8, 9, 7))])
def test_pa_in_place_gate(cls, args, shape):
    """PA's inference gate (sigmoid in place, times x) = x * sigmoid(DWConv(x)) under autograd."""
    m = _random_(cls(*args), std=0.5)
    x = torch.randn(shape, dtype=torch.float64)
    close(*paths(m, (x,), 10 ** 9, expect_pieces=False))


def test_lcm_and_cpe_in_place():
    m = _random_(LCM(16))
    x = torch.randn(2, 9 * 11, 16, dtype=torch.float64)
    close(*paths(m, (x, (9, 11)), 10 ** 9, expect_pieces=False))
    c = _random_(CPE(16))
    close(*paths(c, (x, (9, 11)), 10 ** 9, expect_pieces=False))


# ---- whole backbones in eval mode --------------------------------------------------------------
BACKBONES = {
    'hvit3': lambda: HViT3(arch=TINY_HVIT3, drop_path_rate=0.),
    'vit3': lambda: ViT3(arch=TINY_VIT3, patch_size=8),
    'l2vit': lambda: L2ViT(arch=TINY_L2VIT, drop_path_rate=0.),
    'l2vit_masked': lambda: L2ViT(arch=TINY_L2VIT, drop_path_rate=0., mask_window_padding=True),
    'rest': lambda: ResT(arch=TINY_REST, drop_path_rate=0.),
}


@pytest.mark.parametrize('name', sorted(BACKBONES))
def test_backbone_inference_path_equals_autograd_path(name):
    """The whole backbone in eval mode at an odd size, every piece path forced (max_elems 61), = the same
    backbone with autograd recording (whole maps, out-of-place)."""
    torch.manual_seed(0)
    m = _random_(BACKBONES[name](), std=0.1)
    x = torch.randn(2, 3, 75, 69, dtype=torch.float64)
    fast, ref = paths(m, (x,), max_elems=61, expect_pieces=name != 'vit3')
    close(fast, ref, tol=1e-9)


# ---- the policy's rule -------------------------------------------------------------------------
def test_policy_rule_and_errors():
    m = nn.Linear(1, 1).eval()
    m.memory_policy = MemoryPolicy(10)
    x = torch.zeros(1)
    with torch.no_grad():
        assert choose(m, x, 20) == Path(INFERENCE) and choose(m, x, 21) == Path(INFERENCE, 10)
        assert choose(m, x, 21, policy=MemoryPolicy(10, devices=())) == Path(INFERENCE)   # not this device
        assert choose(m, x, 10 ** 12, policy=MemoryPolicy(None)) == Path(INFERENCE)
        assert choose(m.train(), x, 21) == Path.reference()
    assert choose(m.eval(), x, 21) == Path.reference()                          # autograd records
    m.train().fast_train = True
    assert choose(m, x, 20) == Path(TRAIN) and choose(m, x, 21) == Path(TRAIN, 10)
    assert choose(m, x, 21, policy=MemoryPolicy(10, devices=())) == Path(TRAIN)
    assert choose(m, x, 21, INFERENCE_ONLY) == Path.reference()                  # the op has no train path
    assert MemoryPolicy.build(None).max_elems is None
    with pytest.raises(ValueError, match='max_elems must be a positive int'):
        MemoryPolicy(0)
    with pytest.raises(ValueError, match='unknown keys'):
        MemoryPolicy.build(dict(max_elem=5))
    with pytest.raises(TypeError, match='memory_policy must be a dict'):
        MemoryPolicy.build(5)


@pytest.mark.parametrize('cfg', [dict(type='HViT3', arch=TINY_HVIT3), dict(type='L2ViT', arch=TINY_L2VIT),
                                 dict(type='ResT', arch=TINY_REST)])
def test_one_policy_for_every_layer_from_a_config(cfg):
    """`memory_policy` from a config reaches every large-map layer; None turns pieces off everywhere."""
    from mmengine.registry import MODELS
    for value, expect in ((dict(max_elems=123, devices=('cpu', 'cuda')), 123), (None, None)):
        m = MODELS.build(dict(cfg, memory_policy=value))
        layers = [mod for mod in m.modules() if hasattr(mod, 'memory_policy') and mod is not m]
        assert len(layers) >= 5
        assert all(mod.memory_policy is m.memory_policy for mod in layers)
        assert m.memory_policy.max_elems == expect
    assert MODELS.build(cfg).memory_policy.max_elems == 2 ** 20


# ---- the channels-last conv ----------------------------------------------------------------------
@pytest.mark.parametrize('groups,k,stride', [(16, 3, 1), (16, 7, 1), (1, 3, 2), (1, 1, 1)])
def test_conv2d_channels_last_equals_conv2d(groups, k, stride):
    torch.manual_seed(0)
    ref = nn.Conv2d(16, 16, k, stride=stride, padding=k // 2, groups=groups)
    cl = Conv2dCL(16, 16, k, stride=stride, padding=k // 2, groups=groups)
    cl.load_state_dict(ref.state_dict())
    assert list(cl.state_dict()) == ['weight', 'bias']
    tokens = torch.randn(2, 9 * 11, 16, requires_grad=True)
    x = tokens.transpose(1, 2).reshape(2, 16, 9, 11)      # the channels-last view our layers pass
    a, b = cl(x), ref(x.contiguous())
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert a.is_contiguous(memory_format=torch.channels_last)
    a.sum().backward()
    assert cl.weight.grad.shape == cl.weight.shape


@pytest.mark.parametrize('batch', [1, 2])
@pytest.mark.parametrize('k', [3, 7])
@pytest.mark.parametrize('autocast', [False, True])
def test_token_maps_keep_depthwise_convs_channels_last(batch, k, autocast):
    """tokens_to_map's view has the batch stride of a channels-last tensor at batch 1 too: torch's CPU
    convolutions read all four strides, and a size-1 batch dimension with another stride sent depth-wise
    convolutions to the NCHW kernels (several times slower) and NCHW outputs, forward and backward."""
    torch.manual_seed(0)
    h, w, c = 9, 11, 16
    tokens = nn.Linear(c, c)(torch.randn(batch, h * w, c))       # as a layer's output reaches a conv
    x = tokens_to_map(tokens, (h, w))
    assert x.stride() == (h * w * c, 1, w * c, c)
    conv = Conv2dCL(c, c, k, padding=k // 2, groups=c)
    with torch.autocast('cpu', torch.bfloat16, enabled=autocast):
        y = conv(x)
    assert channels_last(y)
    grads = []
    x.register_hook(grads.append)
    map_to_tokens(y).float().pow(2).sum().backward()
    assert channels_last(grads[0])


# ---- BatchNorm gradients in every memory layout -------------------------------------------------------
def _functional_bn_reference(module):
    """A float64 copy of `module` whose BatchNorms are the naive formula (`ops/conv/naive.py`: batch statistics
    in train mode), so that autograd's gradient does not go through the CPU BatchNorm kernel."""
    import copy

    class PlainBN(nn.Module):
        def __init__(self, bn):
            super().__init__()
            self.bn = bn

        def forward(self, x):
            return batch_norm_naive(x, self.bn)

    ref = copy.deepcopy(module).double()

    def swap(parent):
        for name, child in parent.named_children():
            if isinstance(child, nn.BatchNorm2d):
                setattr(parent, name, PlainBN(child))
            else:
                swap(child)
    swap(ref)
    return ref


@pytest.mark.parametrize('train', [True, False])
@pytest.mark.parametrize('cls,args,shape,tokens', [
    (L2ViTStem, (3, 16), (3, 37, 29), True), (ResTPatchEmbed, (8, 16), (8, 9, 7), False),
    (ResTStem, (3, 16), (3, 29, 31), False), (ConvStem, (3, 16), (3, 37, 29), False)])
@pytest.mark.parametrize('batch', [1, 2])
def test_batchnorm_gradients_when_the_output_becomes_tokens(cls, args, shape, tokens, train, batch):
    """Input and parameter gradients of modules whose BatchNorm output is turned into tokens (a transpose,
    so a channels-last gradient can arrive at an NCHW BatchNorm) = a float64 reference with elementary-op BN.
    torch's CPU BatchNorm backward is wrong by O(1) for that layout mix at batch 1; our BatchNorm2d fixes it."""
    m = _random_(cls(*args), std=0.3).float().train(train)
    ref = _functional_bn_reference(m).train(train)
    x = torch.randn(batch, *shape)

    def run(mod, inp):
        out = mod(inp)
        t = out[0] if tokens else out.flatten(2).transpose(1, 2)   # the tokens the next stage reads
        w = torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)
        inp_grad, *pg = torch.autograd.grad((t * w).sum(), [inp] + [p for p in mod.parameters()])
        return inp_grad, pg
    gx, gp = run(m, x.clone().requires_grad_())
    rx, rp = run(ref, x.double().requires_grad_())
    scale = rx.abs().max().item()
    torch.testing.assert_close(gx.double(), rx, rtol=0, atol=1e-4 * scale)
    for a, b in zip(gp, rp):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4 * max(1., b.abs().max().item()))


@pytest.mark.parametrize('affine,momentum', [(True, 0.1), (False, None)])
def test_batchnorm_train_pass_on_channels_last_maps_is_accurate(affine, momentum):
    """Train mode, fp32, a channels-last map (mean 5, std 3, 2 x 48 x 160 x 192): output, input and parameter
    gradients and running statistics of our BatchNorm2d against float64 elementary ops, rel. L2 < 4e-7 each.
    torch's CPU kernel accumulates such maps row by row in float32 and misses this bound by ~10x."""
    from mmplugin_l2.models.layers import conv as conv_mod
    torch.manual_seed(0)
    shape = (2, 48, 160, 192)
    x = (torch.randn(*shape, dtype=torch.float64) * 3 + 5).contiguous(memory_format=torch.channels_last)
    dy = torch.randn(*shape, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    bn = conv_mod.BatchNorm2d(48, affine=affine, momentum=momentum)
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_()
    ref = _functional_bn_reference(nn.Sequential(bn))[0].train()
    bn.train()
    for _ in range(2):              # two updates of the running statistics (momentum None: their cumulative mean)
        xx = x.float().requires_grad_()
        y = bn(xx)
        assert type(y.grad_fn).__name__ == 'BatchNormCLFunctionBackward'
        y.backward(dy.float())
        rx = x.clone().requires_grad_()
        r = ref(rx)
        r.backward(dy)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    var = x.var(dim=(0, 2, 3), unbiased=True)
    mean = x.mean(dim=(0, 2, 3))
    keep = 0.9 if momentum else 0.5
    checks = {'out': rel(y.detach(), r.detach()), 'dx': rel(xx.grad, rx.grad),
              'running_mean': rel(bn.running_mean, (1 - keep ** 2) * mean if momentum else mean),
              'running_var': rel(bn.running_var, keep ** 2 + (1 - keep ** 2) * var if momentum else var)}
    if affine:
        checks.update(dweight=rel(bn.weight.grad, ref.bn.weight.grad), dbias=rel(bn.bias.grad, ref.bn.bias.grad))
    assert int(bn.num_batches_tracked) == 2
    assert y.is_contiguous(memory_format=torch.channels_last) and xx.grad.is_contiguous(memory_format=torch.channels_last)
    assert max(checks.values()) < 4e-7, checks


def test_batchnorm_channels_last_function_gradcheck():
    """`BatchNormCLFunction`'s closed-form backward against finite differences (float64, a channels-last map
    of B*H*W = 2*3*5 rows and 4 channels; weight and bias too)."""
    from mmplugin_l2.models.ops.conv import BatchNormCLFunction
    torch.manual_seed(0)
    x = torch.randn(2, 4, 3, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.rand(4, dtype=torch.float64).add_(0.5).requires_grad_()
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: BatchNormCLFunction.apply(*a, 1e-5)[0], (x, w, b))


# ---- training graphs ---------------------------------------------------------------------------
def _graph_nodes(outputs):
    """Names of every autograd node reachable from `outputs`."""
    seen, names, todo = set(), set(), [o.grad_fn for o in outputs]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize('name', sorted(BACKBONES))
@pytest.mark.parametrize('fast_train', [True, False])
def test_training_graph_has_no_in_place_writes_into_views(name, fast_train):
    """A training step's graph has no CopySlices / AsStrided node: residuals are added out of place while
    autograd records (`tokens.add_residual`). An in-place add on a view (a Linear's 3-D output, a conv output
    seen as tokens) makes backward rebuild the base tensor, a zero-filled map and a copy per add."""
    torch.manual_seed(0)
    m = BACKBONES[name]()
    for mod in m.modules():
        if hasattr(mod, 'fast_train'):
            mod.fast_train = fast_train
    m.train()
    outs = m(torch.randn(2, 3, 64, 72))
    nodes = _graph_nodes(outs)
    assert {'CopySlices', 'AsStridedBackward0'}.isdisjoint(nodes), nodes
